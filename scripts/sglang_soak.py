#!/usr/bin/env python3
"""Load, aborts, mixed requests and bad requests through SGLang's HTTP server, with NGRAM_ADAPTIVE or a control.

One GPU call (H200, SGLang 0.5.23 kit copied to .gpukit and carried, SmolLM2-135M-Instruct float16 at $MODEL_DIR;
both soaks and scripts/sglang_sampling_check.py side by side on one GPU, ~8 minutes; the KV pools are capped,
--max-total-tokens, so that servers starting at the same time do not starve each other: SGLang sizes a pool from the
free memory it measures around loading the weights. A 10-minute soak does not fit a 10-minute call with its
start-ups, restart and checks; --minutes 4 does):
    source .gpukit/device/env.sh && W=/tmp/harness && mkdir -p $W && S=scripts/sglang_soak.py && \
    { timeout -k 15 540 python3 $S --model $MODEL_DIR --algorithm NGRAM_ADAPTIVE --minutes 4 --port 30100 \
        --max-total-tokens 400000 --out $W/soak_adaptive > $W/soak_adaptive.txt 2>&1 & \
      timeout -k 15 540 python3 $S --model $MODEL_DIR --algorithm plain --minutes 4 --port 30200 \
        --max-total-tokens 400000 --out $W/soak_plain > $W/soak_plain.txt 2>&1 & \
      timeout -k 15 500 python3 scripts/sglang_sampling_check.py --model $MODEL_DIR --out $W/sampling.json \
        --max-total-tokens 400000 --budget 480 --logs $W/sampling_logs > $W/sampling.txt 2>&1 ; wait ; } ; \
    python3 $S --compare $W/soak_adaptive/soak.json $W/soak_plain/soak.json > $W/compare.txt 2>&1 ; \
    cp $W/sampling.json $OUT/ ; cp $W/soak_adaptive/soak.json $OUT/soak_adaptive.json ; \
    cp $W/soak_plain/soak.json $OUT/soak_plain.json ; cat $W/*.txt > $OUT/console.txt ; \
    tar -czf $OUT/logs.tar.gz -C $W --exclude='*.json' --exclude='*.jsonl' --exclude='*.npz' . ; \
    tail -n 30 $W/sampling.txt $W/soak_adaptive.txt $W/soak_plain.txt $W/compare.txt
(5 files come back under $OUT: sampling.json, soak_adaptive.json, soak_plain.json, console.txt, logs.tar.gz.)

What one run does (wall time under --minutes + 3; every HTTP call has a timeout; the server is killed at exit):
1. `python -m sglang.launch_server` on 127.0.0.1 (--enable-metrics, triton attention, pytorch sampling; for
   NGRAM_ADAPTIVE a --speculative-adaptive-config with a `state_file` in --out), waits for /health, reads the idle
   metrics, sends the greedy probe set (fixed prompts, one at a time) and keeps the outputs.
2. --minutes of load: `python -m sglang.bench_serving --backend sglang --dataset-name random` (a ShareGPT-format
   file written to --out, so no download; prompt and output lengths drawn from 16..2048 tokens; ignore_eos): each
   server instance's part of the load (before and after the restart) steps its request rate 2, 4, 8, 16, 32 req/s
   over its first half and holds 32 req/s over its second half (`--hold`; a segment still running 15 s after its
   share is cut: its requests are disconnected); alongside, --clients threads send the request mix of `RequestMix`
   (streamed requests of which a share disconnect mid-stream, `/abort_request` on in-flight rids, `return_logprob`,
   `json_schema`, `regex`, stop strings, `n` > 1, frequency/presence/repetition penalties, plain greedy requests;
   copy-heavy prompts, so drafting requests share batches with them), and a disconnecting client keeps mid-stream
   disconnects above 10% of all streamed requests (bench_serving's included); `/flush_cache` every minute (refused
   with 400 while requests run: recorded); at half time the server is killed and started again with the same
   arguments (NGRAM_ADAPTIVE: the same `state_file`, a warm start; plain: the same restart). Every 5 s: the RSS of
   the server's processes (/proc: the main process, `sglang::scheduler*`, `sglang::detokenizer`) and /metrics.
3. After the load: bench_serving and the clients stop, the server drains; then the checks below, a `/flush_cache`,
   the probe set again (after the load, and after the flush), then the bad requests, each followed by /health
   (a server that went down is started again, if time allows, and the case recorded).

Checks (`evaluate`; `--compare A B` puts a run beside its control and adds: no kind of request fails in A that
never fails in B, and every bad request is answered in A as in B, or with a 400 where B's server went down):
- server_up: the server never exited except for the planned restart, and answers /health at the end.
- no_failures: no client request failed (HTTP status other than expected, connection error outside the restart,
  broken body, a constraint not kept: invalid JSON for json_schema, no regex match, a stop string in the output,
  not n choices, logprobs not one per output token), no /abort_request or /flush_cache call failed, no error in a
  bench_serving segment that completed. Timeouts and cut segments are reported beside.
- disconnect_share >= 0.10 of streamed requests (bench_serving's counted as streamed), aborts sent > 0.
- idle_after_drain: sglang:num_running_reqs and sglang:num_queue_reqs 0, sglang:kv_used_tokens back to its value
  when the same server instance was idle after start-up (the KV pool holds nothing but the radix cache), and the
  server logs no "memory leak detected" / "double free" / "use-after-free" (SGLang checks the KV pool and the
  request table, req_to_token_pool, whenever it is idle).
- rss_flat: the scheduler's RSS, a line fitted over the second half of each server instance's load window (those
  with at least 6 samples: the peak rate held, after the ramp brought every batch size), grows less than
  --rss-slope-limit MB/min. The same fit per kind of page (anonymous,
  file, shared: /proc's smaps_rollup) is reported beside it, for plain decoding too: CUDA's pinned host memory,
  which torch caches and never returns, is shared memory.
- flush_keeps_memory: after the drain, --flush-cycles times the probes and then /flush_cache, the scheduler's RSS
  read after each flush: it grows by at most FLUSH_GROWTH_MB from the first such flush to the last (a flush that
  kept the old n-gram cache alive would add the cache's whole size, hundreds of MB at the default capacity, each
  time).
- probes_identical: the greedy probe outputs after the load (and after the restart, and after the flush) equal
  the first ones, or part from them only at near-ties: the top-2 logprob margin at the first differing position,
  measured, at most --tie-margin (default 0.05; float16 sums in other batch shapes flip such tokens in plain
  decoding too). Every difference is reported with its position and margin; `identical` says whether there was none.
- ngramspec_gauges_moving (NGRAM_ADAPTIVE only): every `ngramspec:` gauge in /metrics took at least 2 values.
- bad_requests: each answered (status and body recorded) and the server up after each.

    python scripts/sglang_soak.py --model MODEL_DIR --algorithm NGRAM_ADAPTIVE|plain|NGRAM --out DIR
        [--minutes 10] [--port 30000] [--clients 8] [--mem-fraction 0.5] [--max-running-requests 48]
    python scripts/sglang_soak.py --compare DIR_A/soak.json DIR_B/soak.json
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import http.client
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

HOST = "127.0.0.1"
RATES = (2, 4, 8, 16, 32)
HOLD = 0.5  # share of each server instance's load spent at the peak rate after its ramp (`schedule`)
IDLE_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:kv_used_tokens",
               "sglang:kv_available_tokens", "sglang:kv_evictable_tokens")
TRACKED = IDLE_GAUGES + ("sglang:spec_accept_length", "sglang:gen_throughput", "sglang:num_requests_total",
                         "sglang:num_aborted_requests_total", "sglang:http_requests_active")
NGRAMSPEC_GAUGES = ("ngramspec:verify_width", "ngramspec:drafted_tokens", "ngramspec:predicted_accept_length",
                    "ngramspec:realized_accept_length")
LEAK_PATTERNS = ("memory leak detected", "double free", "use-after-free")
FLUSH_GROWTH_MB = 100.0  # flush_keeps_memory: the scheduler's RSS from the first flush cycle to the last
LENGTHS_DIFFER = "host lengths differ from the device's"  # NGRAMSPEC_CHECK_LENS=1 in the server's environment
LOG_PATTERNS = LEAK_PATTERNS + ("Traceback (most recent call last)", "NGRAM_ADAPTIVE: controller state loaded",
                                "NGRAM_ADAPTIVE: no controller state", "ignoring the controller state file",
                                LENGTHS_DIFFER)
EXPECTED_OUTCOMES = ("ok", "disconnected", "aborted", "restart")

_CODE = [
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.total > 100\nORDER BY orders.total DESC;\n",
]
_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog did not move. The fox jumped again, higher this time, "
    "and landed softly in the tall grass on the other side of the fence.",
    "Our store opens at 9 am on weekdays and 10 am on weekends. Returns are accepted within 30 days with a "
    "receipt. Gift cards cannot be exchanged for cash.",
]
COPY_PROMPTS = ([f"Repeat this code exactly:\n\n{c}\nRepeated:\n" for c in _CODE]
                + [f"Repeat the following text word for word:\n\n{t}\n\nRepeated: " for t in _TEXT])
PROBES = [COPY_PROMPTS[0], COPY_PROMPTS[3], "Write a short poem about the sea at night.\n",
          "Explain why the sky is blue to a ten-year-old.\n"]
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                           "age": {"type": "integer"}},
                          "required": ["name", "age"], "additionalProperties": False})
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)"


# ------------------------------------------------------------------------------------------- pure helpers

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict:
    """Prometheus text exposition -> {sample name: [(labels dict, value), ...]} (comments skipped)."""
    out = defaultdict(list)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(3) or "")}
        out[m.group(1)].append((labels, value))
    return dict(out)


def metric(parsed: dict, name: str, **labels) -> float | None:
    """Sum of a sample's values over the label sets matching `labels` (None if absent)."""
    rows = [v for lab, v in parsed.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    return sum(rows) if rows else None


def tracked_values(parsed: dict) -> dict:
    """The gauges a soak records: TRACKED and every `ngramspec:` sample."""
    out = {name: metric(parsed, name) for name in TRACKED}
    out.update({name: metric(parsed, name) for name in parsed if name.startswith("ngramspec:")})
    return {k: v for k, v in out.items() if v is not None}


def responses_by_status(parsed: dict) -> dict:
    """sglang:http_responses_total as {"endpoint status": count}."""
    out = Counter()
    for lab, v in parsed.get("sglang:http_responses_total", []):
        out[f"{lab.get('endpoint', '?')} {lab.get('status_code', '?')}"] += v
    return dict(out)


def schedule(load_s: float, rates=RATES, restart_at: float | None = 0.5, hold: float = HOLD) -> list[dict]:
    """Load segments, times in seconds from the start of the load. Each server instance's part of the load (the
    whole load, or the parts before and after the restart at restart_at * load_s) ramps through ``rates`` in equal
    steps over its first (1 - hold) share, then holds the last rate for the rest (segment flagged "hold"): the
    RSS check fits each instance's second half, so with hold 0.5 it sees the peak load sustained, every batch size
    it brings already met in the ramp, and growth there is not the warm-up of new batch shapes."""
    bounds = [0.0, load_s] if restart_at is None else [0.0, restart_at * load_s, load_s]
    segs = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if i:
            segs.append({"kind": "restart", "start": a, "end": a})
        ramp_end = a + (1.0 - hold) * (b - a)
        step = (ramp_end - a) / len(rates)
        segs += [{"kind": "bench", "rate": r, "start": a + j * step, "end": a + (j + 1) * step}
                 for j, r in enumerate(rates)]
        if hold > 0:
            segs.append({"kind": "bench", "rate": rates[-1], "start": ramp_end, "end": b, "hold": True})
    return [x for x in segs if x["kind"] == "restart" or x["end"] > x["start"]]


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute (None below 3 points or no time spread)."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def second_half(points: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The points of the window's second half."""
    mid = start + (end - start) / 2
    return [(t, y) for t, y in points if mid <= t <= end]


class RequestMix:
    """The soak clients' requests, drawn from a seeded RNG: a kind by WEIGHTS, a copy-heavy prompt, bounded lengths.
    `next()` returns {"kind", "body" (the /generate JSON), "stream", "disconnect_after" (chunks, or None),
    "abort_after" (seconds, or None), "check" (what the answer must satisfy)}."""

    WEIGHTS = {"stream": 0.30, "abort": 0.10, "logprob": 0.10, "json_schema": 0.09, "regex": 0.08, "stop": 0.08,
               "n": 0.08, "penalties": 0.09, "greedy": 0.08}
    DISCONNECT = 0.35  # share of the mix's streamed requests that disconnect mid-stream
    MAX_NEW = 256

    def __init__(self, seed: int = 0, prefix: str = "soak", kinds=None):
        """``kinds``: send only these kinds (their relative weights kept); None: all of WEIGHTS."""
        kinds = list(self.WEIGHTS) if kinds is None else list(kinds)
        if not kinds or not set(kinds) <= set(self.WEIGHTS):
            raise ValueError(f"request kinds must be some of {sorted(self.WEIGHTS)}, got {kinds!r}")
        self.weights = {k: w for k, w in self.WEIGHTS.items() if k in kinds}
        self.rng = random.Random(seed)
        self.count = 0
        self.prefix = prefix
        self._lock = threading.Lock()

    def next(self) -> dict:
        with self._lock:
            self.count += 1
            rng, i = self.rng, self.count
            kind = rng.choices(list(self.weights), weights=list(self.weights.values()))[0]
            prompt = rng.choice(COPY_PROMPTS)
            max_new = rng.randint(16, self.MAX_NEW)
            sp = {"max_new_tokens": max_new, "temperature": 0.0}
            body = {"text": prompt, "sampling_params": sp}
            spec = {"kind": kind, "body": body, "stream": False, "disconnect_after": None, "abort_after": None,
                    "check": None}
            if kind == "stream":
                spec["stream"] = True
                sp["temperature"] = rng.choice([0.0, 0.7])
                if rng.random() < self.DISCONNECT:
                    spec["disconnect_after"] = rng.randint(1, 8)
            elif kind == "abort":
                body["rid"] = f"{self.prefix}-{i}"
                sp["max_new_tokens"] = self.MAX_NEW
                spec["stream"] = rng.random() < 0.5
                spec["abort_after"] = round(rng.uniform(0.05, 1.5), 3)
            elif kind == "logprob":
                body.update(return_logprob=True, top_logprobs_num=3,
                            logprob_start_len=0 if rng.random() < 0.3 else -1)
                spec["check"] = "logprobs"
            elif kind == "json_schema":
                body["text"] = "Give a JSON object with a person's name and age.\n"
                sp.update(json_schema=JSON_SCHEMA, max_new_tokens=128, temperature=rng.choice([0.0, 0.7]))
                spec["check"] = "json"
            elif kind == "regex":
                body["text"] = "Do you like fruit? Answer with yes or no, a number and a fruit.\n"
                sp.update(regex=REGEX, max_new_tokens=32)
                spec["check"] = "regex"
            elif kind == "stop":
                sp["stop"] = rng.choice([["\n\n"], ["."], ["return", ";"]])
                spec["check"] = "stop"
            elif kind == "n":
                sp.update(n=rng.choice([2, 3]), temperature=0.8)
                spec["check"] = "n"
            elif kind == "penalties":
                sp.update(frequency_penalty=round(rng.uniform(0.1, 1.0), 2),
                          presence_penalty=round(rng.uniform(0.1, 1.0), 2),
                          repetition_penalty=round(rng.uniform(1.05, 1.3), 2),
                          temperature=rng.choice([0.0, 0.7]))
            return spec


def check_answer(spec: dict, answer) -> str | None:
    """What is wrong with a completed answer to `spec` (None: nothing). Constraints are judged only where the
    request stopped by itself (a length stop may cut a JSON object)."""
    check = spec.get("check")
    n = spec["body"]["sampling_params"].get("n", 1)
    if check == "n":
        return None if isinstance(answer, list) and len(answer) == n else "n: not n choices"
    if not isinstance(answer, dict) or "text" not in answer:
        return "bad_body"
    meta = answer.get("meta_info") or {}
    finish = (meta.get("finish_reason") or {}).get("type")
    text = answer["text"]
    if check == "logprobs":
        lp = meta.get("output_token_logprobs")
        if lp is None or len(lp) != meta.get("completion_tokens"):
            return "logprobs: not one per output token"
    elif check == "json" and finish == "stop":
        try:
            obj = json.loads(text)
        except ValueError:
            return "json_schema: output is not JSON"
        if not isinstance(obj, dict) or set(obj) != {"name", "age"} or not isinstance(obj["age"], int):
            return "json_schema: output does not match the schema"
    elif check == "regex" and finish == "stop" and not re.fullmatch(REGEX, text):
        return "regex: output does not match"
    elif check == "stop" and finish == "stop":
        if any(s in text for s in spec["body"]["sampling_params"]["stop"]):
            return "stop: a stop string in the output"
    return None


def outcome_of(spec: dict, status: int | None, answer, error: str | None) -> str:
    """An outcome label: ok / disconnected / aborted, or the kind of failure."""
    if error:
        return error
    if status != 200:
        if spec.get("abort_after") is not None and status is not None and 400 <= status < 500:
            return "aborted"
        return f"http_{status}"
    if answer is None:
        return "empty_answer"
    if isinstance(answer, dict) and "error" in answer and "text" not in answer:
        return "aborted" if spec.get("abort_after") is not None else "error_in_body"
    finish = (answer.get("meta_info") or {}).get("finish_reason") if isinstance(answer, dict) else None
    if spec.get("abort_after") is not None and isinstance(finish, dict) and finish.get("type") == "abort":
        return "aborted"
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return "unexpected_abort"
    problem = check_answer(spec, answer)
    return "constraint" if problem else "ok"


def classify_exception(e: BaseException) -> str:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(e, (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead, OSError)):
        return "connection"
    if isinstance(e, ValueError):
        return "bad_body"
    return f"exception_{type(e).__name__}"


def synthetic_sharegpt(n: int, seed: int = 0) -> list[dict]:
    """n two-turn conversations in ShareGPT's format (bench_serving's random dataset takes its prompt tokens from
    the first turn, repeated or cut to the drawn length): code and text to copy, edit or continue."""
    rng = random.Random(seed)
    words = ("alpha beta gamma delta river stone cloud paper window orange silver garden rocket candle "
             "market bridge winter summer lantern harbor").split()
    asks = ("Repeat this exactly:", "Add comments to this, keeping all of it:", "Continue this:",
            "Fix any mistakes and output the full text:", "Translate the comments of this to French:")
    out = []
    for i in range(n):
        body = rng.choice(_CODE + _TEXT)
        tail = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        out.append({"id": f"soak-{i}", "conversations": [
            {"from": "human", "value": f"{rng.choice(asks)}\n\n{body}\n{tail} {i}"},
            {"from": "gpt", "value": body}]})
    return out


def token_pattern(n: int, vocab: int = 49152, period: int = 61) -> list[int]:
    """n in-vocabulary token ids (ordinary ones, well above the special tokens) that repeat with `period`
    (copy-heavy: n-gram drafts find the continuation)."""
    base, span = min(1000, vocab // 4), min(500, vocab // 4)
    block = [base + (k * 37) % span for k in range(period)]
    return block * (n // period) + block[: n % period]


def bad_request_cases(context_len: int, vocab: int) -> list[tuple[str, dict]]:
    """(name, /generate body) per bad or edge-case request, the ones that may take a server down last."""
    def ids(input_ids: list[int], max_new: int, **sp) -> dict:
        return {"input_ids": input_ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, **sp}}

    def text(prompt: str, max_new: int, **kw) -> dict:
        return {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new}, **kw}

    return [
        ("max_new_tokens_0", text(COPY_PROMPTS[0], 0)),
        ("max_new_tokens_1", text(COPY_PROMPTS[0], 1)),
        ("max_new_tokens_1_stream", text(COPY_PROMPTS[1], 1, stream=True)),
        ("empty_text", text("", 8)),
        ("empty_input_ids", ids([], 8)),
        ("context_limit", ids(token_pattern(context_len - 1, vocab), 1)),
        # drafts of a copy-heavy prompt run up to the last position the context holds
        ("context_limit_drafting", ids(token_pattern(context_len - 33, vocab), 32, ignore_eos=True)),
        ("context_over", ids(token_pattern(context_len, vocab), 1)),
        ("oov_vocab_size", ids(token_pattern(16, vocab) + [vocab], 8)),
        ("oov_large", ids([vocab + 1000] + token_pattern(15, vocab), 8)),
        ("negative_id", ids([-1] + token_pattern(15, vocab), 8)),
    ]


def model_limits(model: str) -> tuple[int, int]:
    """(context length, vocabulary size) from the model folder's config.json (SmolLM2's if unreadable)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return int(cfg.get("max_position_embeddings") or 8192), int(cfg.get("vocab_size") or 49152)
    except (OSError, ValueError, TypeError):
        return 8192, 49152


def find_key(obj, key: str):
    """The first value under `key` anywhere in a JSON value (None if absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            r = find_key(v, key)
            if r is not None:
                return r
    return None


def first_difference(a: list, b: list) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------- processes and RSS (/proc)


def _children() -> dict[int, list[int]]:
    kids = defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        kids[int(fields[1])].append(int(name))
    return kids


def process_tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def process_role(pid: int, root: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "sglang::scheduler" in cmd:
        return "scheduler"
    if "sglang::detokenizer" in cmd:
        return "detokenizer"
    return "server" if pid == root else "other"


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] != "Z"


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


SMAPS_KINDS = (("anon", "Anonymous"), ("file", "Pss_File"), ("shmem", "Pss_Shmem"))
PINNED_GAUGES = (("pinned", "ngramspec:pinned_host_mb"), ("pinned_in_use", "ngramspec:pinned_host_active_mb"))


def rss_kinds(pid: int) -> dict[str, float] | None:
    """A process's resident memory by kind in MB (/proc/PID/smaps_rollup): anonymous pages (the heap: Python,
    malloc, numpy), file pages, shared memory (where the CUDA driver's pinned host memory appears)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {k: v for k, _, v in (line.partition(":") for line in f) if v.strip().endswith("kB")}
        return {key: round(int(fields[name].split()[0]) / 1024, 1) for key, name in SMAPS_KINDS if name in fields}
    except (OSError, ValueError, IndexError):
        return None


def scheduler_kinds(root: int) -> dict[str, float]:
    """`rss_kinds` summed over the server's scheduler processes (one per TP rank)."""
    out = Counter()
    for pid in process_tree(root):
        if process_role(pid, root) == "scheduler":
            out.update(rss_kinds(pid) or {})
    return {k: round(v, 1) for k, v in out.items()}


def rss_by_role(root: int) -> dict[str, float]:
    """RSS in MB of each role in the server's process tree (summed over the processes of a role)."""
    out = Counter()
    for pid in process_tree(root):
        mb = rss_mb(pid)
        if mb is not None:
            out[process_role(pid, root)] += mb
    return {k: round(v, 1) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------- HTTP client


def http_call(port: int, method: str, path: str, body=None, timeout: float = 30.0) -> tuple[int, str]:
    """One HTTP request to 127.0.0.1:port; (status, body text). Raises on connection errors and timeouts."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def generate(port: int, body: dict, timeout: float) -> tuple[int, object]:
    status, text = http_call(port, "POST", "/generate", body, timeout)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def stream_generate(port: int, body: dict, timeout: float, disconnect_after: int | None = None,
                    total_timeout: float = 300.0, give_up_after: float | None = None) -> tuple[int, object, int, str]:
    """A streamed /generate: (status, last chunk or error body, chunks read, how it ended: "done" ([DONE] came),
    "disconnected" (by us), "eof" (the server closed the stream early), "error" (an error object in the stream, or
    an HTTP error status)). The client goes away mid-stream (closes the connection) after `disconnect_after` chunks
    or `give_up_after` seconds, whichever comes first (a request still queued gets no chunk: it is dropped while
    waiting)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.time()
    sock = None

    def hang_up() -> None:
        with contextlib.suppress(OSError, AttributeError):
            sock.shutdown(socket.SHUT_RDWR)

    try:
        conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
        sock = conn.sock  # kept: http.client drops conn.sock when the response closes the connection
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                return resp.status, json.loads(text), 0, "error"
            return resp.status, text, 0, "error"
        last, chunks = None, 0
        while True:
            spent = time.time() - t0
            if spent >= total_timeout:
                raise socket.timeout("stream took longer than its total timeout")
            limit = min(timeout, total_timeout - spent)
            if give_up_after is not None:
                if spent >= give_up_after:
                    hang_up()
                    return 200, last, chunks, "disconnected"
                limit = min(limit, give_up_after - spent)
            with contextlib.suppress(OSError, AttributeError):
                sock.settimeout(max(0.05, limit))
            try:
                line = resp.readline()
            except socket.timeout:
                if give_up_after is not None and time.time() - t0 >= give_up_after - 0.05:
                    hang_up()
                    return 200, last, chunks, "disconnected"
                raise
            if not line:
                return 200, last, chunks, "eof"
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return 200, last, chunks, "done"
            chunks += 1
            last = json.loads(payload)
            if isinstance(last, dict) and "error" in last:
                return 200, last, chunks, "error"
            if disconnect_after is not None and chunks >= disconnect_after:
                hang_up()
                return 200, last, chunks, "disconnected"
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------------ server


def bench_serving_env(out: str) -> dict:
    """The environment for `python -m sglang.bench_serving`. SGLang 0.5.23's client imports Hugging Face `datasets`
    when it starts (its MMMU loader), even to read a local file; where `datasets` is not installed (the GPU kit), a
    package in `out` stands in for it, whose `load_dataset` raises if anything calls it."""
    import importlib.util

    env = dict(os.environ)
    if importlib.util.find_spec("datasets") is None:
        shim = os.path.join(os.path.abspath(out), "no_datasets")
        os.makedirs(os.path.join(shim, "datasets"), exist_ok=True)
        with open(os.path.join(shim, "datasets", "__init__.py"), "w") as f:
            f.write("def load_dataset(*args, **kwargs):\n"
                    "    raise ImportError('Hugging Face datasets is not installed (a stand-in for its import)')\n")
        env["PYTHONPATH"] = shim + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def port_answers(port: int) -> bool:
    """Whether something already accepts connections on 127.0.0.1:port (a server left running)."""
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1.0):
        return True
    return False


class Server:
    """One `sglang.launch_server` (or a stand-in command), in its own process group, log to a file."""

    def __init__(self, cmd: list[str], port: int, out: str, mem_trace: bool = False):
        self.cmd, self.port, self.out, self.mem_trace = cmd, port, out, mem_trace
        self.proc: subprocess.Popen | None = None
        self.instance = -1
        self.log_path = ""
        self._log = None

    def start(self) -> None:
        self.instance += 1
        self.log_path = os.path.join(self.out, f"server_{self.instance}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ)
        if self.mem_trace:  # NGRAM_ADAPTIVE's scheduler writes where its memory grows (diagnostics.MemTrace)
            env["NGRAMSPEC_MEM_TRACE"] = self.mem_trace_path(self.instance)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)

    def mem_trace_path(self, instance: int) -> str:
        return os.path.join(self.out, f"mem_trace_{instance}.json")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 10.0) -> bool:
        try:
            return http_call(self.port, "GET", "/health", timeout=timeout)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def wait_ready(self, timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            if not self.alive():
                return False
            if self.healthy(timeout=5.0):
                return True
            time.sleep(1.0)
        return False

    def stop(self, hard: bool = False, grace: float = 10.0, gone_wait: float = 30.0) -> None:
        """SIGTERM to the server's process group (SGLang then waits for running requests) and SIGKILL after
        `grace` s, or SIGKILL at once (`hard`, as a crash); returns once every process of the tree is gone (at most
        `gone_wait` s), so that a new server finds the GPU memory free."""
        if self.proc is None:
            return
        pids = process_tree(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None and not hard:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # children left behind by the main process
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        end = time.time() + gone_wait
        while time.time() < end and any(_running(pid) for pid in pids):
            time.sleep(0.2)
        if self._log:
            self._log.close()
            self._log = None


def scan_log(path: str) -> dict:
    counts = Counter()
    try:
        with open(path, errors="replace") as f:
            for line in f:
                for pat in LOG_PATTERNS:
                    if pat in line:
                        counts[pat] += 1
    except OSError:
        pass
    return dict(counts)


# ------------------------------------------------------------------------------------------------------- soak


class Soak:
    def __init__(self, a):
        self.a = a
        self.t0 = time.time()
        self.load_s = a.minutes * 60.0
        self.hard_end = self.t0 + self.load_s + 160.0  # every phase after the load is budgeted from this
        os.makedirs(a.out, exist_ok=True)
        self.lock = threading.Lock()
        self.gate = threading.Event()  # set while the server takes requests
        self.stop_clients = threading.Event()
        self.stop_sampler = threading.Event()
        self.records: list[dict] = []
        self.calls: list[dict] = []  # /abort_request and /flush_cache
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.restart_windows: list[list[float]] = []
        self.instances: list[dict] = []
        self.benches: list[dict] = []
        self.bench_procs: list[tuple[subprocess.Popen, dict]] = []
        self.planned_stop = False
        self.mix = RequestMix(seed=a.seed, prefix=f"soak{os.getpid()}",
                              kinds=a.kinds.split(",") if a.kinds else None)
        self.disconnect_rate = 0.0  # extra disconnecting streams per second (a share of bench_serving's rate)
        self.streams = Counter()  # ours: sent, disconnected
        self.context_len, self.vocab = model_limits(a.model)
        self.server = Server(self.server_cmd(), a.port, a.out, mem_trace=a.mem_trace)
        self.result: dict = {"args": {k: v for k, v in vars(a).items()}, "algorithm": a.algorithm}

    def now(self) -> float:
        return round(time.time() - self.t0, 2)

    def left(self) -> float:
        return self.hard_end - time.time()

    def load_end(self, load_start: float) -> float:
        """When the load stops: --minutes after the server's start-up, or earlier, so that the drain, the checks and
        the bad requests fit before the hard end (with --load-from-ready the hard end moves instead)."""
        if self.a.load_from_ready:
            self.hard_end = max(self.hard_end, load_start + self.load_s + 110.0)
        return min(load_start + self.load_s, self.hard_end - 110.0)

    def budget(self, cap: float, reserve: float) -> float:
        """A timeout of at most `cap` s that leaves `reserve` s before the hard end (at least 1 s)."""
        return max(1.0, min(cap, self.left() - reserve))

    def event(self, what: str, **kw) -> None:
        with self.lock:
            self.events.append({"t": self.now(), "what": what, **kw})
        print(f"[{self.now():7.1f}s] {what} {json.dumps(kw) if kw else ''}", flush=True)

    # ---- commands
    def server_cmd(self) -> list[str]:
        a = self.a
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--host", HOST,
               "--port", str(a.port), "--dtype", a.dtype, "--enable-metrics", "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--max-running-requests", str(a.max_running_requests),
               "--random-seed", "0", "--log-level", "info", "--disable-prefill-cuda-graph"]
        if a.mem_fraction is not None:
            cmd += ["--mem-fraction-static", str(a.mem_fraction)]
        if a.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(a.max_total_tokens)]
        if a.algorithm == "NGRAM_ADAPTIVE":
            cfg = {**json.loads(a.adaptive_config),
                   "state_file": os.path.join(os.path.abspath(a.out), "controller_state.npz"),
                   "state_save_minutes": max(0.25, min(1.0, a.minutes / 8))}
            path = os.path.join(os.path.abspath(a.out), "adaptive_config.json")
            with open(path, "w") as f:
                json.dump(cfg, f)
            cmd += ["--speculative-algorithm", "NGRAM_ADAPTIVE", "--speculative-adaptive-config", path]
        elif a.algorithm == "NGRAM":
            cmd += ["--speculative-algorithm", "NGRAM"]
        if a.server_cmd:  # a stand-in server (tests)
            return [x.format(port=a.port, out=a.out) for x in json.loads(a.server_cmd)]
        return cmd + shlex.split(a.server_args)

    def bench_cmd(self, rate: float, num: int, out_file: str, seed: int) -> list[str]:
        a = self.a
        if a.bench_cmd:
            return [x.format(port=a.port, rate=rate, num_prompts=num, output_file=out_file, seed=seed)
                    for x in json.loads(a.bench_cmd)]
        return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", HOST,
                "--port", str(a.port), "--model", a.model, "--tokenizer", a.model, "--dataset-name", "random",
                "--dataset-path", self.dataset_path, "--random-input-len", "2048", "--random-output-len", "2048",
                "--random-range-ratio", str(16 / 2048), "--request-rate", str(rate), "--num-prompts", str(num),
                "--max-concurrency", str(a.bench_max_concurrency), "--seed", str(seed), "--output-file", out_file,
                "--output-details", "--disable-tqdm", "--warmup-requests", "1", "--ready-check-timeout-sec", "30"]

    # ---- server lifecycle
    def launch(self, why: str, probe_key: str | None = None) -> bool:
        """Start the server and wait for /health; read its idle gauges (and, with probe_key, send the probe set)
        before the clients may send again."""
        t = time.time()
        self.server.start()
        ready = self.server.wait_ready(max(10.0, min(self.a.startup_timeout, self.left() - 30)))
        inst = {"instance": self.server.instance, "why": why, "pid": self.server.proc.pid,
                "started": round(t - self.t0, 2), "ready_at": self.now(), "startup_s": round(time.time() - t, 1),
                "ready": ready,
                "log": os.path.basename(self.server.log_path)}
        self.instances.append(inst)
        self.event("server started" if ready else "server did not start", **inst)
        if ready:
            inst["idle_baseline"] = self.idle_metrics(wait=min(10.0, max(1.0, self.left() - 60)))
            if probe_key:
                self.result[probe_key] = self.probe()
            self.gate.set()
        return ready

    def restart(self, why: str, probe_key: str | None = None) -> bool:
        self.gate.clear()
        t_kill = time.time()
        state = os.path.join(self.a.out, "controller_state.npz")
        if os.path.exists(state):
            self.event("state file before restart", bytes=os.path.getsize(state),
                       age_s=round(time.time() - os.path.getmtime(state), 1))
        elif self.a.algorithm == "NGRAM_ADAPTIVE":
            self.event("no state file before restart")
        self.planned_stop = True
        self.server.stop(hard=self.a.restart_signal == "kill")
        self.planned_stop = False
        ok = self.launch(why, probe_key)
        with self.lock:
            self.restart_windows.append([t_kill, time.time()])
        return ok

    def metrics(self, timeout: float = 5.0) -> dict | None:
        try:
            status, text = http_call(self.a.port, "GET", "/metrics", timeout=timeout)
        except (OSError, http.client.HTTPException):
            return None
        return parse_metrics(text) if status == 200 else None

    def idle_values(self) -> dict:
        parsed = self.metrics()
        if not parsed:
            return {}
        vals = {k: metric(parsed, k) for k in IDLE_GAUGES}
        vals["generate_requests_active"] = metric(parsed, "sglang:http_requests_active", endpoint="/generate")
        return vals

    def idle_metrics(self, wait: float, used_max: float | None = None) -> dict:
        """The idle gauges once no request runs, waits or has its /generate call open (and, given `used_max`, the KV
        pool holds at most that many tokens outside the radix cache), polled for up to `wait` s: SGLang republishes
        its gauges when it falls idle and every 30 s."""
        t0 = time.time()
        while True:
            vals = self.idle_values()
            idle = bool(vals) and not vals.get("sglang:num_running_reqs") and not vals.get("sglang:num_queue_reqs")
            # and no /generate call still open (a cut client's connection closes a moment after its request ends)
            idle = idle and not vals.get("generate_requests_active")
            if idle and used_max is not None:
                idle = (vals.get("sglang:kv_used_tokens") or 0) <= used_max
            if idle or time.time() - t0 >= wait:
                break
            time.sleep(1.0)
        return {**vals, "waited_s": round(time.time() - t0, 1)}

    # ---- probes
    def probe(self) -> list:
        """The greedy probe outputs (token ids), one request at a time; after a request that got no answer the
        rest are skipped (a sick server must not eat the time left)."""
        outs = []
        for prompt in PROBES:
            if outs and outs[-1] in ("timeout", "connection", "skipped"):
                outs.append("skipped")
                continue
            try:
                status, ans = generate(self.a.port, {"text": prompt, "sampling_params": {
                    "temperature": 0.0, "max_new_tokens": self.a.probe_tokens}}, timeout=self.budget(30, 40))
                if status == 200 and isinstance(ans, dict):
                    outs.append(ans.get("output_ids") or ans.get("text"))
                else:
                    outs.append(f"http_{status}")
            except (OSError, http.client.HTTPException, ValueError) as e:
                outs.append(classify_exception(e))
        return outs

    def probe_margin(self, prompt: str, position: int) -> float | None:
        """Top-2 logprob margin at an output position (from a fresh greedy request with top logprobs)."""
        try:
            status, ans = generate(self.a.port, {"text": prompt, "return_logprob": True, "top_logprobs_num": 2,
                                                 "sampling_params": {"temperature": 0.0,
                                                                     "max_new_tokens": self.a.probe_tokens}},
                                   timeout=self.budget(30, 40))
            top = ans["meta_info"]["output_top_logprobs"][position]
            return round(float(top[0][0]) - float(top[1][0]), 5)
        except (OSError, http.client.HTTPException, KeyError, IndexError, TypeError, ValueError):
            return None

    # ---- clients
    def record(self, row: dict) -> None:
        with self.lock:
            self.records.append(row)

    def in_restart(self, t0: float, t1: float) -> bool:
        with self.lock:
            windows = [list(w) for w in self.restart_windows]
        if not self.gate.is_set():
            windows.append([t0, t1])
        return any(t0 <= w1 and t1 >= w0 - 1.0 for w0, w1 in windows)

    def run_spec(self, spec: dict) -> dict:
        a, t0 = self.a, time.time()
        body, status, answer, error, chunks, ended = spec["body"], None, None, None, 0, None
        timer = None
        if spec.get("abort_after") is not None:
            timer = threading.Timer(spec["abort_after"], self.abort, args=(body["rid"],))
            timer.daemon = True
            timer.start()
        try:
            if spec["stream"]:
                status, answer, chunks, ended = stream_generate(
                    a.port, body, timeout=a.request_timeout, disconnect_after=spec.get("disconnect_after"),
                    total_timeout=a.request_timeout, give_up_after=spec.get("give_up_after"))
            else:
                status, answer = generate(a.port, body, timeout=a.request_timeout)
        except (OSError, http.client.HTTPException, ValueError) as e:
            error = classify_exception(e)
        finally:
            if timer:
                timer.cancel()
        t1 = time.time()
        disconnected = ended == "disconnected"
        if disconnected:
            outcome = "disconnected"
        elif ended == "eof" and not error:
            outcome = "truncated_stream"
        else:
            outcome = outcome_of(spec, status, answer, error)
        if outcome == "constraint":
            detail = check_answer(spec, answer)
        elif outcome not in EXPECTED_OUTCOMES:
            detail = (json.dumps(answer) if not isinstance(answer, str) else answer)[:300] if answer else error
        else:
            detail = None
        if outcome not in EXPECTED_OUTCOMES and outcome != "timeout" and self.in_restart(t0, t1):
            outcome = "restart"
        if spec["stream"]:
            with self.lock:
                self.streams["sent"] += 1
                self.streams["disconnected"] += disconnected
        return {"kind": spec["kind"], "t0": round(t0 - self.t0, 2), "t1": round(t1 - self.t0, 2),
                "instance": self.server.instance, "status": status, "outcome": outcome, "chunks": chunks,
                "detail": detail}

    def abort(self, rid: str) -> None:
        t0 = time.time()
        try:
            status, _ = http_call(self.a.port, "POST", "/abort_request", {"rid": rid}, timeout=10)
            err = None
        except (OSError, http.client.HTTPException) as e:
            status, err = None, classify_exception(e)
        row = {"call": "abort", "t": round(t0 - self.t0, 2), "status": status, "error": err,
               "restart": err is not None and self.in_restart(t0, time.time())}  # in_restart takes the lock
        with self.lock:
            self.calls.append(row)

    def client_loop(self, end: float) -> None:
        while not self.stop_clients.is_set() and time.time() < end:
            if not self.gate.wait(timeout=0.5):
                continue
            self.record(self.guarded(self.mix.next()))
            self.stop_clients.wait(random.uniform(0.0, 0.2))

    def guarded(self, spec: dict) -> dict:
        """run_spec, an error of the harness itself recorded as one (a client thread must not die)."""
        try:
            return self.run_spec(spec)
        except Exception as e:  # noqa: BLE001 - recorded, and counted as a failure
            return {"kind": spec["kind"], "t0": self.now(), "t1": self.now(), "instance": self.server.instance,
                    "status": None, "outcome": f"harness_{type(e).__name__}", "chunks": 0, "detail": repr(e)[:300]}

    def disconnector_loop(self, end: float) -> None:
        """Streams that go away after a few chunks or a few seconds (queued or not), at `disconnect_rate` per second
        (at most 256 at once)."""
        sem = threading.Semaphore(256)
        rng = random.Random(self.a.seed + 1)
        while not self.stop_clients.is_set() and time.time() < end:
            rate = self.disconnect_rate
            if rate <= 0 or not self.gate.is_set():
                self.stop_clients.wait(0.2)
                continue
            self.stop_clients.wait(rng.expovariate(rate))
            if not sem.acquire(timeout=1.0):
                continue
            spec = {"kind": "disconnect", "body": {"text": rng.choice(COPY_PROMPTS), "sampling_params": {
                "temperature": 0.0, "max_new_tokens": 256}}, "stream": True,
                    "disconnect_after": rng.randint(1, 12), "give_up_after": round(rng.uniform(1.0, 20.0), 2),
                    "abort_after": None, "check": None}

            def go(spec=spec):
                try:
                    self.record(self.guarded(spec))
                finally:
                    sem.release()
            threading.Thread(target=go, daemon=True).start()

    def flusher_loop(self, end: float) -> None:
        while not self.stop_clients.wait(self.a.flush_every) and time.time() < end:
            if not self.gate.is_set():
                continue
            t0 = time.time()
            try:
                status, body = http_call(self.a.port, "POST", "/flush_cache", timeout=30)
                err = None
            except (OSError, http.client.HTTPException) as e:
                status, body, err = None, "", classify_exception(e)
            row = {"call": "flush", "t": round(t0 - self.t0, 2), "status": status, "error": err, "body": body[:120],
                   "restart": err is not None and self.in_restart(t0, time.time())}  # in_restart takes the lock
            with self.lock:
                self.calls.append(row)

    def sampler_loop(self, end: float) -> None:
        while not self.stop_sampler.is_set() and time.time() < end:
            t = self.now()
            proc = self.server.proc
            if proc is not None and proc.poll() is not None and not self.planned_stop and self.gate.is_set():
                self.event("server exited unexpectedly", instance=self.server.instance, rc=proc.returncode)
                self.gate.clear()
            row = {"t": t, "instance": self.server.instance}
            try:
                if proc is not None and proc.poll() is None:
                    row["rss"] = rss_by_role(proc.pid)
                    row["scheduler_kinds"] = scheduler_kinds(proc.pid)
                parsed = self.metrics() if self.gate.is_set() else None
                if parsed:
                    row["m"] = tracked_values(parsed)
                    row["responses"] = responses_by_status(parsed)
            except Exception as e:  # noqa: BLE001 - a sample lost, the sampler goes on
                row["error"] = repr(e)[:200]
            with self.lock:
                self.samples.append(row)
            self.stop_sampler.wait(max(0.0, self.a.sample_every - (self.now() - t)))

    # ---- bench_serving
    def start_bench(self, seg: dict, idx: int, seg_end_abs: float) -> None:
        dur = seg_end_abs - time.time()
        num = max(1, int(round(seg["rate"] * max(1.0, dur - self.a.bench_startup))))
        out_file = os.path.join(self.a.out, f"bench_{idx}_{seg['rate']}rps.jsonl")
        info = {"segment": idx, "rate": seg["rate"], "num_prompts": num, "started": self.now(),
                "deadline": round(seg_end_abs - self.t0 + self.a.segment_grace, 2), "output_file": out_file,
                "instance": self.server.instance}
        log = open(os.path.join(self.a.out, f"bench_{idx}.log"), "w")
        proc = subprocess.Popen(self.bench_cmd(seg["rate"], num, out_file, self.a.seed + idx), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=bench_serving_env(self.a.out))
        info["log"] = log
        self.bench_procs.append((proc, info))
        self.disconnect_rate = self.a.disconnect_share * seg["rate"]
        self.event("bench segment", **{k: v for k, v in info.items() if k != "log"})

    def reap_benches(self, cut_all: bool = False) -> None:
        keep = []
        for proc, info in self.bench_procs:
            rc = proc.poll()
            if rc is None and (cut_all or self.now() > info["deadline"]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
                info["cut"] = True
                rc = proc.returncode
            if rc is None:
                keep.append((proc, info))
                continue
            info["log"].close()
            info.update(rc=rc, ended=self.now(), **bench_result(info["output_file"]))
            info["log"] = os.path.basename(info["output_file"]).replace(".jsonl", ".log")
            self.benches.append(info)
        self.bench_procs = keep

    # ---- bad requests
    def bad_requests(self) -> list[dict]:
        ctx = self.context_len
        info = None
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            info = json.loads(http_call(self.a.port, "GET", "/server_info", timeout=10)[1])
        for key in ("context_length", "context_len"):
            v = find_key(info, key) if info else None
            if isinstance(v, int) and v > 0:
                ctx = v
                break
        rows = []
        for name, body in bad_request_cases(ctx, self.vocab):
            if self.left() < 20:
                rows.append({"case": name, "skipped": "out of time"})
                continue
            if not self.server.alive() and not (self.left() > 90 and self.restart(f"after bad request {name}")):
                rows.append({"case": name, "skipped": "server down"})
                continue
            t0, limit = time.time(), self.budget(60, 15)
            try:
                if body.get("stream"):
                    status, ans, _, _ = stream_generate(self.a.port, body, timeout=limit, total_timeout=limit)
                else:
                    status, ans = generate(self.a.port, body, timeout=limit)
                err = None
            except (OSError, http.client.HTTPException, ValueError) as e:
                status, ans, err = None, None, classify_exception(e)
            text = ans if isinstance(ans, str) else json.dumps(ans)
            up = self.server.alive() and self.server.healthy(timeout=self.budget(20, 10))
            row = {"case": name, "status": status, "error": err, "seconds": round(time.time() - t0, 2),
                   "answer": (text or "")[:400], "server_up_after": up, "context_len": ctx, "vocab": self.vocab}
            if isinstance(ans, dict):
                row["output_ids"] = ans.get("output_ids")
                row["finish_reason"] = (ans.get("meta_info") or {}).get("finish_reason")
            rows.append(row)
            self.event("bad request", **{k: row[k] for k in ("case", "status", "error", "server_up_after")})
            if not up:
                self.server.stop()
        return rows

    def segments(self, load_s: float) -> list[dict]:
        return schedule(load_s, restart_at=None if self.a.no_restart else 0.5, hold=self.a.hold)

    # ---- the run
    def run(self) -> dict:
        a = self.a
        self.dataset_path = os.path.join(a.out, "sharegpt_synthetic.json")
        with open(self.dataset_path, "w") as f:
            # prompts enough for the largest segment (bench_serving draws each request's prompt from this file)
            most = max(g["rate"] * (g["end"] - g["start"]) for g in self.segments(self.load_s) if g["kind"] == "bench")
            json.dump(synthetic_sharegpt(max(64, int(most) + 16), a.seed), f)
        res = self.result
        try:
            if port_answers(a.port):
                res["fatal"] = f"something already answers on port {a.port} (a server left running?)"
                return res
            if not self.launch("start", probe_key="probe_before"):
                res["fatal"] = "the server did not start"
                return res
            load_start = time.time()
            load_end = self.load_end(load_start)
            res["load_window"] = [round(load_start - self.t0, 2), round(load_end - self.t0, 2)]
            threads = [threading.Thread(target=self.client_loop, args=(load_end,), daemon=True)
                       for _ in range(a.clients)]
            threads += [threading.Thread(target=f, args=(load_end,), daemon=True)
                        for f in (self.disconnector_loop, self.flusher_loop)]
            sampler = threading.Thread(target=self.sampler_loop, args=(self.hard_end - 20.0,), daemon=True)
            sampler.start()
            for t in threads:
                t.start()
            segs = self.segments(load_end - load_start)
            res["load_segments"] = [{**g, "start": round(g["start"] + load_start - self.t0, 2),
                                     "end": round(g["end"] + load_start - self.t0, 2)} for g in segs]
            for idx, seg in enumerate(segs):
                start_abs, end_abs = load_start + seg["start"], load_start + seg["end"]
                while time.time() < start_abs:
                    self.reap_benches()
                    time.sleep(min(0.5, max(0.0, start_abs - time.time())))
                if seg["kind"] == "restart":
                    self.reap_benches(cut_all=True)
                    self.restart("half-time restart", probe_key="probe_after_restart")
                    continue
                if not self.server.alive() and not self.restart("server down during the load"):
                    break
                if end_abs - time.time() > 1.0:
                    self.start_bench(seg, idx, end_abs)
            while time.time() < load_end:
                self.reap_benches()
                time.sleep(0.5)
            self.disconnect_rate = 0.0
            self.stop_clients.set()
            self.event("load over; draining")
            grace_end = time.time() + min(a.segment_grace, max(0.0, self.left() - 100))
            while self.bench_procs and time.time() < grace_end:
                self.reap_benches()
                time.sleep(0.5)
            self.reap_benches(cut_all=True)
            join_end = time.time() + max(0.0, min(a.request_timeout, self.left() - 90))
            for t in threads:
                t.join(timeout=max(0.0, join_end - time.time()))
            res["unfinished_client_threads"] = sum(t.is_alive() for t in threads)
            res["server_alive_after_load"] = self.server.alive()
            res["drain_instance"] = self.server.instance
            res["drain"] = self.idle_metrics(wait=max(1.0, min(60.0, self.left() - 75)))
            base = next((i.get("idle_baseline") or {} for i in self.instances
                         if i["instance"] == self.server.instance), {})
            res["idle_after_drain"] = self.idle_metrics(wait=max(1.0, min(a.idle_wait, self.left() - 60)),
                                                        used_max=base.get("sglang:kv_used_tokens") or 0)
            res["probe_after"] = self.probe()
            status, body = self.flush_idle(reserve=40)
            res["flush_after_drain"] = {"status": status, "body": body[:200]}
            res["idle_after_flush"] = self.idle_metrics(wait=2.0)
            res["probe_after_flush"] = self.probe()
            res["probe_margins"] = self.margins(res)
            res["flush_cycles"] = self.flush_cycles(self.a.flush_cycles)
            res["bad_requests"] = self.bad_requests()
            res["server_up_at_end"] = self.server.alive() and self.server.healthy(timeout=self.budget(15, 5))
        finally:
            self.stop_clients.set()
            self.stop_sampler.set()
            self.reap_benches(cut_all=True)
            self.planned_stop = True
            self.server.stop(grace=min(10.0, max(1.0, self.left() - 10)), gone_wait=max(5.0, min(30.0, self.left())))
            self.finish()
        return res

    def flush_idle(self, reserve: float) -> tuple:
        """/flush_cache on the drained server: (HTTP status, body), or (None, what went wrong)."""
        try:
            return http_call(self.a.port, "POST", "/flush_cache?timeout=10", timeout=self.budget(20, reserve))
        except (OSError, http.client.HTTPException) as e:
            return None, classify_exception(e)

    def flush_cycles(self, n: int) -> list:
        """``n`` times: the probes (something for the caches to hold), /flush_cache, then the scheduler's RSS. Stops
        early where too little time is left for the bad requests after it, or the server is down."""
        rows = []
        for _ in range(n):
            if self.left() < 80 or not self.server.alive():
                break
            self.probe()
            status, body = self.flush_idle(reserve=70)
            proc = self.server.proc
            rss = rss_by_role(proc.pid).get("scheduler") if proc is not None and proc.poll() is None else None
            rows.append({"t": self.now(), "status": status, "error": None if status else body,
                         "scheduler_rss_mb": rss})
        return rows

    def margins(self, res: dict) -> list:
        out = []
        for label in ("probe_after_restart", "probe_after", "probe_after_flush"):
            for i, (x, y) in enumerate(zip(res.get("probe_before", []), res.get(label, []))):
                if isinstance(x, list) and isinstance(y, list) and x != y and self.left() > 60:
                    at = first_difference(x, y)
                    out.append({"probe": i, "after": label, "position": at,
                                "top2_margin": self.probe_margin(PROBES[i], at)})
        return out

    def finish(self) -> None:
        res = self.result
        with self.lock:
            res.update(records=list(self.records), calls=list(self.calls), samples=list(self.samples),
                       events=list(self.events), restart_windows=[[round(t - self.t0, 2) for t in w]
                                                                  for w in self.restart_windows],
                       instances=list(self.instances), benches=list(self.benches), streams=dict(self.streams))
        res["logs"] = {inst["log"]: scan_log(os.path.join(self.a.out, inst["log"])) for inst in self.instances}
        if self.a.mem_trace:
            res["mem_trace"] = {}
            for inst in self.instances:
                path = self.server.mem_trace_path(inst["instance"])
                try:
                    with open(path) as f:
                        res["mem_trace"][str(inst["instance"])] = json.load(f)
                except (OSError, ValueError):
                    pass
        res["wall_s"] = self.now()
        res["checks"] = evaluate(res, self.a.rss_slope_limit, self.a.tie_margin)
        with open(os.path.join(self.a.out, "soak.json"), "w") as f:
            json.dump(res, f)


def bench_result(path: str) -> dict:
    """bench_serving's JSONL line: completed, failed (non-empty errors), duration, throughput, accept length."""
    try:
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return {"completed": None}
    if not lines:
        return {"completed": None}
    r = lines[-1]
    errors = [e for e in r.get("errors", []) if e]
    return {"completed": r.get("completed"), "failed": len(errors),
            "errors": sorted(Counter(e.strip().splitlines()[-1][:160] for e in errors).items())[:10],
            "duration": r.get("duration"), "output_throughput": r.get("output_throughput"),
            "accept_length": r.get("accept_length"), "mean_e2e_latency_ms": r.get("mean_e2e_latency_ms")}


# -------------------------------------------------------------------------------------------------- the checks


def failures_by_kind(res: dict) -> dict:
    """{outcome: {request kind: count}} for every outcome that is neither expected nor a timeout."""
    out = defaultdict(Counter)
    for r in res.get("records", []):
        if r["outcome"] not in EXPECTED_OUTCOMES and r["outcome"] != "timeout":
            out[r["outcome"]][r["kind"]] += 1
    for c in res.get("calls", []):
        bad = c["error"] is not None and not c["restart"]
        if c["call"] == "flush":
            bad |= c["status"] is not None and c["status"] not in (200, 400)
        elif c["status"] is not None:
            bad |= c["status"] != 200
        if bad:
            out[f"{c['call']}_call"][str(c["status"] if c["status"] is not None else c["error"])] += 1
    for b in res.get("benches", []):
        if b.get("failed"):
            out["bench_serving"][f"rate {b['rate']}"] += b["failed"]
    return {k: dict(v) for k, v in out.items()}


def rss_windows(res: dict) -> list[dict]:
    """Per server instance: the scheduler RSS slope over the second half of its part of the load window, from the
    time it was ready to the time the next instance was started (its own stop: a restart stops it first)."""
    load = res.get("load_window")
    if not load:
        return []
    ready = {i["instance"]: i.get("ready_at", i["started"] + i["startup_s"]) for i in res.get("instances", [])}
    started = [i["started"] for i in res.get("instances", [])]
    out = []
    for inst in sorted({s["instance"] for s in res.get("samples", []) if "rss" in s}):
        pts = [(s["t"], s["rss"].get("scheduler")) for s in res["samples"]
               if s["instance"] == inst and s.get("rss", {}).get("scheduler") is not None]
        if not pts:
            continue
        w0 = max(load[0], ready.get(inst, load[0]))
        w1 = min([load[1]] + [t for t in started if t > w0])
        half = second_half(pts, w0, w1)
        slope = slope_per_min(half)
        by_kind = {}  # the same fit for each kind of page, and for NGRAM_ADAPTIVE's gauges of torch's pinned memory
        series = [(key, "scheduler_kinds", key) for key, _ in SMAPS_KINDS]
        series += [(key, "m", gauge) for key, gauge in PINNED_GAUGES]
        for key, field, name in series:
            kind_pts = [(s["t"], s[field][name]) for s in res["samples"]
                        if s["instance"] == inst and name in (s.get(field) or {})]
            kind_slope = slope_per_min(second_half(kind_pts, w0, w1))
            if kind_slope is not None:
                by_kind[key] = round(kind_slope, 3)
        out.append({"instance": inst, "window": [round(w0, 1), round(w1, 1)], "points": len(half),
                    "slope_mb_per_min": None if slope is None else round(slope, 3),
                    "rss_mb_first": half[0][1] if half else None, "rss_mb_last": half[-1][1] if half else None,
                    "slope_by_kind": by_kind})
    return out


def evaluate(res: dict, rss_limit: float = 10.0, tie_margin: float = 0.05) -> dict:
    """The run's checks: {name: {"ok": True/False/None (not applicable), ...}}."""
    checks = {}
    unexpected = [e for e in res.get("events", []) if e["what"] in ("server exited unexpectedly",
                                                                     "server did not start")]
    unexpected += [{"what": f"server started again: {i['why']}"} for i in res.get("instances", [])
                   if i.get("why") not in (None, "start", "half-time restart")]
    checks["server_up"] = {"ok": not unexpected and bool(res.get("server_up_at_end")), "events": unexpected}
    differ = sum(counts.get(LENGTHS_DIFFER, 0) for counts in res.get("logs", {}).values())
    if differ or os.environ.get("NGRAMSPEC_CHECK_LENS", "") not in ("", "0"):
        checks["lengths_agree"] = {"ok": not differ, "batches_differing": differ}
    window, minutes = res.get("load_window"), (res.get("args") or {}).get("minutes")
    if window and minutes:  # a slow server start eats the load window (it ends at minutes + 50 s from the start)
        ran = window[1] - window[0]
        checks["load_ran"] = {"ok": ran >= 0.5 * 60 * minutes, "seconds": round(ran, 1), "asked": 60 * minutes}
    fails = failures_by_kind(res)
    outcomes = Counter(r["outcome"] for r in res.get("records", []))
    checks["no_failures"] = {"ok": not fails, "failures": fails, "outcomes": dict(outcomes),
                             "timeouts": outcomes.get("timeout", 0),
                             "bench_cut": sum(bool(b.get("cut")) for b in res.get("benches", []))}
    bench_streams = sum(b["num_prompts"] for b in res.get("benches", []))
    ours = res.get("streams", {})
    share = ours.get("disconnected", 0) / max(1, ours.get("sent", 0) + bench_streams)
    aborts = sum(1 for c in res.get("calls", []) if c["call"] == "abort")
    checks["disconnect_share"] = {"ok": share >= 0.10, "share": round(share, 4),
                                  "disconnected": ours.get("disconnected", 0),
                                  "streamed": ours.get("sent", 0) + bench_streams}
    checks["aborts_sent"] = {"ok": aborts > 0, "aborts": aborts,
                             "aborted_requests": outcomes.get("aborted", 0)}
    flushes = Counter(str(c["status"]) for c in res.get("calls", []) if c["call"] == "flush")
    checks["flush_under_load"] = {"ok": bool(flushes), "statuses": dict(flushes),
                                  "after_drain": (res.get("flush_after_drain") or {}).get("status")}
    idle = res.get("idle_after_drain") or {}
    insts = {i["instance"]: i for i in res.get("instances", [])}
    base = (insts.get(res.get("drain_instance"), {}).get("idle_baseline")) or {}
    leaks = {log: {p: n for p, n in c.items() if p in LEAK_PATTERNS} for log, c in res.get("logs", {}).items()}
    leaks = {k: v for k, v in leaks.items() if v}
    used, used0 = idle.get("sglang:kv_used_tokens"), base.get("sglang:kv_used_tokens")
    checks["idle_after_drain"] = {
        "ok": bool(idle) and idle.get("sglang:num_running_reqs") == 0 and idle.get("sglang:num_queue_reqs") == 0
        and used is not None and used <= (used0 or 0) and not idle.get("generate_requests_active") and not leaks,
        "after": idle, "baseline": base, "leak_lines": leaks}
    wins = rss_windows(res)
    slopes = [w["slope_mb_per_min"] for w in wins if w["slope_mb_per_min"] is not None and w["points"] >= 6]
    checks["rss_flat"] = {"ok": (max(slopes) <= rss_limit) if slopes else None, "limit_mb_per_min": rss_limit,
                          "windows": wins}
    if res.get("flush_cycles") is not None:
        done = [c for c in res["flush_cycles"] if c.get("status") == 200 and c.get("scheduler_rss_mb") is not None]
        grew = done[-1]["scheduler_rss_mb"] - done[0]["scheduler_rss_mb"] if len(done) >= 2 else None
        checks["flush_keeps_memory"] = {"ok": None if grew is None else grew <= FLUSH_GROWTH_MB,
                                        "grew_mb": None if grew is None else round(grew, 1),
                                        "limit_mb": FLUSH_GROWTH_MB, "cycles": res["flush_cycles"]}
    before = res.get("probe_before")
    probes = {}
    for label in ("probe_after_restart", "probe_after", "probe_after_flush"):
        if res.get(label) is not None:
            probes[label] = [first_difference(x, y) if isinstance(x, list) and isinstance(y, list) else "error"
                             for x, y in zip(before or [], res[label])]
    # a difference passes only at a measured near-tie: the top-2 log-probability margin at its first differing
    # position at most tie_margin (batch-dependent float16 sums flip such a token in plain decoding too)
    margins = {(m.get("after"), m.get("probe")): m.get("top2_margin") for m in res.get("probe_margins", [])}
    diffs = [(label, i, d) for label, ds in probes.items() for i, d in enumerate(ds) if d is not None]
    near_ties = [{"after": label, "probe": i, "position": d, "top2_margin": margins.get((label, i))}
                 for label, i, d in diffs if d != "error" and isinstance(margins.get((label, i)), (int, float))
                 and margins[(label, i)] <= tie_margin]
    answered = bool(before) and "probe_after" in probes
    checks["probes_identical"] = {"ok": answered and len(near_ties) == len(diffs), "identical": answered and not diffs,
                                  "near_ties": near_ties, "tie_margin": tie_margin, "first_differences": probes,
                                  "margins": res.get("probe_margins", [])}
    gauges = defaultdict(set)
    for s in res.get("samples", []):
        for k, v in (s.get("m") or {}).items():
            if k.startswith("ngramspec:"):
                gauges[k].add(round(v, 4))
    if res.get("algorithm") == "NGRAM_ADAPTIVE":
        checks["ngramspec_gauges_moving"] = {
            "ok": all(len(gauges.get(g, ())) >= 2 for g in NGRAMSPEC_GAUGES),
            "distinct_values": {g: len(gauges.get(g, ())) for g in NGRAMSPEC_GAUGES}}
        logs = res.get("logs", {})
        restarted = [i for i in res.get("instances", []) if i.get("why") == "half-time restart"]
        existed = any(e["what"] == "state file before restart" for e in res.get("events", []))
        loaded = {k: v.get("NGRAM_ADAPTIVE: controller state loaded", 0) for k, v in logs.items()}
        checks["warm_start"] = {"ok": (existed and all(loaded.get(i["log"], 0) > 0 for i in restarted))
                                if restarted else None, "state_file_before_restart": existed,
                                "state_loaded_lines": loaded}
    bad = res.get("bad_requests", [])
    checks["bad_requests"] = {"ok": bool(bad) and all(r.get("server_up_after") for r in bad if "skipped" not in r)
                              and not any("skipped" in r for r in bad),
                              "answers": {r["case"]: r.get("skipped") or r.get("status") or r.get("error")
                                          for r in bad}}
    return checks


def mem_trace_lines(traces: dict, top: int = 3) -> list[str]:
    """Per server instance with a memory trace: RSS and traced Python heap from its first snapshot to its last, and
    the sites that grew most."""
    lines = []
    for inst, trace in sorted(traces.items()):
        snaps = trace.get("snapshots") or []
        if not snaps:
            continue
        a, b = snaps[0], snaps[-1]
        lines.append(f"memory trace, instance {inst}: {len(snaps)} snapshots over {b['t_s'] - a['t_s']:.0f} s, RSS "
                     f"{a['rss_mb']} -> {b['rss_mb']} MB, traced Python heap {a['traced_mb']} -> {b['traced_mb']} MB")
        na, nb = a.get("native") or {}, b.get("native") or {}
        if na and nb:
            lines.append("  of it: " + ", ".join(f"{k} {na[k]} -> {nb[k]}" for k in na if k in nb))
        lines += [f"  grew {g['mb']:+.2f} MB ({g['count']:+d} blocks) at {g['site']}" for g in b.get("grew", [])[:top]]
    return lines


def print_table(res: dict) -> bool:
    checks = res["checks"]
    print(f"\nsoak {res.get('algorithm')}: {res.get('wall_s')} s, load window {res.get('load_window')}, "
          f"{len(res.get('records', []))} client requests, {len(res.get('benches', []))} bench_serving segments")
    for name, c in checks.items():
        ok = {True: "ok", False: "FAIL", None: "-"}[c["ok"]]
        rest = {k: v for k, v in c.items() if k not in ("ok", "windows", "answers", "events", "cycles")}
        print(f"  {name:24s} {ok:5s} {json.dumps(rest)[:300]}")
    for w in checks.get("rss_flat", {}).get("windows", []):
        kinds = ", ".join(f"{k} {v}" for k, v in (w.get("slope_by_kind") or {}).items())
        print(f"  scheduler RSS, instance {w['instance']}: {w['rss_mb_first']} -> {w['rss_mb_last']} MB, "
              f"{w['slope_mb_per_min']} MB/min over {w['points']} samples" + (f" (of it: {kinds})" if kinds else ""))
    cycles = checks.get("flush_keeps_memory", {}).get("cycles")
    if cycles:
        print("  flush cycles (status, scheduler RSS MB): "
              + ", ".join(f"{c['status']} {c['scheduler_rss_mb']}" for c in cycles))
    for log, counts in res.get("logs", {}).items():
        print(f"  {log}: {json.dumps(counts) if counts else 'none of ' + json.dumps(LOG_PATTERNS)}")
    for line in mem_trace_lines(res.get("mem_trace") or {}):
        print("  " + line)
    for b in res.get("benches", []):
        print(f"  bench {b['rate']:>3} req/s: {b['num_prompts']} prompts, completed {b.get('completed')}, "
              f"failed {b.get('failed')}, cut {bool(b.get('cut'))}, accept length {b.get('accept_length')}")
    for r in res.get("bad_requests", []):
        print(f"  bad request {r['case']:24s} status {r.get('status')} error {r.get('error')} "
              f"up after {r.get('server_up_after')} {r.get('skipped', '')} {(r.get('answer') or '')[:100]!r}")
    return all(c["ok"] is not False for c in checks.values())


def compare(path_a: str, path_b: str) -> int:
    """A run beside its control: checks side by side; a failure kind in A that B never shows; bad requests answered
    differently (status, or output ids where both answered)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sglang_engine_bench import load_json  # reads .json and .json.gz (results kept in docs/sglang/)

    ra, rb = load_json(path_a), load_json(path_b)
    for res, path in ((ra, path_a), (rb, path_b)):  # judged by the checks of this version
        args = res.get("args") or {}
        checks = evaluate(res, args.get("rss_slope_limit", 10.0), args.get("tie_margin", 0.05))
        changed = [k for k in checks if res["checks"].get(k, {}).get("ok") != checks[k]["ok"]]
        if changed:
            print(f"{path}: re-evaluated, verdicts changed since the run: {', '.join(changed)}")
        res["checks"] = {**res["checks"], **checks}
    print(f"{'check':26s} {ra.get('algorithm')!s:>16s} {rb.get('algorithm')!s:>16s}")
    word = {True: "ok", False: "FAIL", None: "-"}
    for name in dict.fromkeys(list(ra["checks"]) + list(rb["checks"])):
        print(f"{name:26s} {word[ra['checks'].get(name, {}).get('ok')]:>16s} "
              f"{word[rb['checks'].get(name, {}).get('ok')]:>16s}")
    fa, fb = failures_by_kind(ra), failures_by_kind(rb)
    only_a = {k: v for k, v in fa.items() if k not in fb}
    print(f"failures {ra.get('algorithm')}: {json.dumps(fa)}\nfailures {rb.get('algorithm')}: {json.dumps(fb)}")
    ta = ra["checks"]["no_failures"]["timeouts"]
    tb = rb["checks"]["no_failures"]["timeouts"]
    print(f"timeouts: {ta} vs {tb}")
    bb = {r["case"]: r for r in rb.get("bad_requests", [])}
    differ = []
    for r in ra.get("bad_requests", []):
        o = bb.get(r["case"])
        if o is None or "skipped" in r or "skipped" in o:
            continue
        same_status = (r.get("status"), r.get("error")) == (o.get("status"), o.get("error"))
        same_out = r.get("output_ids") == o.get("output_ids")
        # a 400 where the control's server went down (NGRAM_ADAPTIVE's request guard) is an improvement
        better = r.get("status") == 400 and r.get("server_up_after") and not o.get("server_up_after")
        print(f"bad request {r['case']:24s} {r.get('status') or r.get('error')!s:>8} vs "
              f"{o.get('status') or o.get('error')!s:>8}  outputs equal: {same_out}"
              f"{'  (refused where the control went down)' if better else ''}")
        if not same_status and not better:
            differ.append(r["case"])
    ok = not only_a and not differ
    print(f"\nfailure kinds only in {ra.get('algorithm')}: {only_a or 'none'}; bad requests answered differently: "
          f"{differ or 'none'} -> {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", nargs=2, metavar=("A_SOAK_JSON", "CONTROL_SOAK_JSON"))
    p.add_argument("--model", help="model folder (Hugging Face layout)")
    p.add_argument("--algorithm", default="NGRAM_ADAPTIVE", choices=["plain", "NGRAM_ADAPTIVE", "NGRAM"])
    p.add_argument("--minutes", type=float, default=10.0,
                   help="minutes of load (the run takes under minutes + 3; with --load-from-ready, its start-up + "
                        "minutes + 2)")
    p.add_argument("--mem-trace", action="store_true",
                   help="NGRAM_ADAPTIVE's scheduler records where its Python memory grows (NGRAMSPEC_MEM_TRACE, a "
                        "snapshot every 30 s into --out/mem_trace_N.json, summed up in soak.json): for diagnosis, "
                        "it slows the scheduler's Python allocations")
    p.add_argument("--load-from-ready", action="store_true",
                   help="--minutes of load counted from the server's first start-up, not from this run's start (a "
                        "slow start-up, e.g. beside other servers, then lengthens the run instead of the load)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--out", help="folder for soak.json, the server logs and bench_serving's files")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--mem-fraction", type=float, help="--mem-fraction-static of the server (default: SGLang's)")
    p.add_argument("--max-total-tokens", type=int,
                   help="--max-total-tokens: a KV pool of at most this many tokens. Servers that share a GPU and "
                        "start at the same time need it: SGLang sizes the pool from the free memory measured before "
                        "and after loading the weights, which another process starting meanwhile changes (with a "
                        "cap, the pool is the cap as long as the others leave room for it)")
    p.add_argument("--max-running-requests", type=int, default=48,
                   help="the server's --max-running-requests, the same for every algorithm (NGRAM_ADAPTIVE's and "
                        "NGRAM's default is 48)")
    p.add_argument("--server-args", default="", help="extra launch_server arguments (one string)")
    p.add_argument("--adaptive-config", default="{}",
                   help="NGRAM_ADAPTIVE settings (a JSON object) beside the soak's own state_file, e.g. "
                        "'{\"plain_forwards_max_batch\": 48}'")
    p.add_argument("--clients", type=int, default=8, help="client threads sending the request mix")
    p.add_argument("--kinds", help="comma-separated: the clients send only these kinds of request (default: all; "
                   f"{','.join(RequestMix.WEIGHTS)}), e.g. to find which kind a failure needs")
    p.add_argument("--disconnect-share", type=float, default=0.15,
                   help="extra mid-stream disconnects per second, as a share of bench_serving's request rate")
    p.add_argument("--bench-max-concurrency", type=int, default=256, help="bench_serving's --max-concurrency")
    p.add_argument("--bench-startup", type=float, default=10.0,
                   help="seconds bench_serving takes to start (its prompts are planned for the rest of a segment)")
    p.add_argument("--segment-grace", type=float, default=15.0,
                   help="seconds a bench_serving segment may run past its share of the time before it is cut")
    p.add_argument("--flush-every", type=float, default=60.0)
    p.add_argument("--flush-cycles", type=int, default=4, help="after the drain: probes then /flush_cache, this many "
                   "times, the scheduler's RSS after each (flush_keeps_memory)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS and /metrics samples")
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds per client request")
    p.add_argument("--idle-wait", type=float, default=40.0, help="seconds to wait for the idle gauges after drain")
    p.add_argument("--probe-tokens", type=int, default=64)
    p.add_argument("--rss-slope-limit", type=float, default=10.0, help="MB per minute")
    p.add_argument("--tie-margin", type=float, default=0.05,
                   help="a greedy probe that differs after the load passes only if the top-2 log-probability margin "
                        "at its first differing position is at most this (a near-tie)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--no-restart", action="store_true", help="no restart at half time")
    p.add_argument("--hold", type=float, default=HOLD,
                   help="share of each server instance's load held at the peak rate after its ramp (0: ramp only)")
    p.add_argument("--restart-signal", default="kill", choices=["kill", "term"],
                   help="the half-time restart: SIGKILL (as a crash; the state file is the last periodic write) or "
                        "SIGTERM (SGLang's graceful exit, SIGKILL after 10 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-cmd", help=argparse.SUPPRESS)  # tests: JSON list, {port} {out} filled in
    p.add_argument("--bench-cmd", help=argparse.SUPPRESS)  # tests: JSON list, {port} {rate} {num_prompts} ...
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.compare:
        try:
            return compare(*a.compare)
        except (OSError, ValueError, KeyError) as e:
            print(f"--compare {' '.join(a.compare)}: not two soak.json files ({e!r})", file=sys.stderr)
            return 2
    if not a.out or not (a.model or a.server_cmd):
        p.error("--model and --out are needed (or --compare A B)")
    if a.minutes <= 0:
        p.error("--minutes must be > 0")
    if not 0.0 <= a.hold < 1.0:
        p.error("--hold must be in [0, 1): the share of each instance's load held at the peak rate")
    a.model = a.model or ""
    if a.algorithm == "NGRAM":
        # where flashinfer is missing (the GPU kit), SGLang's NGRAM stops at its first sampled request; the control
        # samples through ngramspec's fallback then, as NGRAM_ADAPTIVE does (a no-op where flashinfer is installed)
        os.environ.setdefault("NGRAMSPEC_SAMPLING_FALLBACK", "1")
    soak = Soak(a)
    atexit.register(soak.server.stop)

    def on_term(signum, frame):
        raise SystemExit(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    res = soak.run()
    if "fatal" in res:
        print(f"FATAL: {res['fatal']} (log: {soak.server.log_path})")
        return 1
    ok = print_table(res)
    print(f"\n{'all checks passed' if ok else 'CHECKS FAILED'}; details in {os.path.join(a.out, 'soak.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
