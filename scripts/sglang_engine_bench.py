#!/usr/bin/env python3
"""Plain decoding vs SGLang's NGRAM vs NGRAM_ADAPTIVE in a real SGLang engine, side by side, in one run. Needs a GPU.

Each configuration runs in its own child process (`sglang.Engine`, offline; clean GPU memory, a crash stays
contained), on the same greedy prompts, at each concurrency level (1: one request at a time; N: all prompts
submitted at once, at most N running). Reported per configuration, prompt set and concurrency: output tokens per
second (wall clock over the whole set), SGLang's accept length (completion tokens / forward steps), and for
NGRAM_ADAPTIVE the mean verify width and host milliseconds per step (from the plugin's NGRAMSPEC_PROFILE
counters). Greedy outputs are compared token by token with plain decoding's; a difference is reported with the
first position where it differs.

    python scripts/sglang_engine_bench.py --model MODEL_DIR --out results.json \
        [--configs plain,ngram,adaptive,adaptive_w1] [--concurrency 1 16] [--max-new-tokens 256] \
        [--dtype float32] [--tp 1] [--extra '{"attention_backend": "triton"}'] [--warmup 1]

Before any timed set, each prompt of two other sets (WARM_PROMPTS, free text, and WARM_COPY, copy-heavy) is
generated once, one at a time, untimed; at concurrency > 1 each timed set is also preceded by --warmup untimed
passes of both sets at that concurrency: a run of a second or two otherwise pays the first-time (JIT) costs of its
new prefill, batch and verify shapes inside its figure (copy-heavy traffic is what makes a drafting configuration
verify wide at that batch size). Every configuration gets the same warm-up. The concurrency levels time the same
prompts, so before each level after the first the server's caches are flushed (`Engine.flush_cache`: the radix
cache, SGLang's n-gram corpus, NGRAM_ADAPTIVE's cache; its controller keeps what it learned); without it an n-gram
cache would hold the earlier level's outputs of the very prompts it times (`--no-flush` keeps them, as runs before
this option did).
Kernels that Triton still compiles during a timed set are listed per set (``new_triton_kernels``: new entries in
TRITON_CACHE_DIR, default ~/.triton/cache); such a set is timed again once from a flushed and re-warmed server
(``--retry-compiled``), since a build of a few seconds dwarfs a set of a few seconds. `--repeats N` times each set at
concurrency > 1 N times, each from a flushed and re-warmed server (``tok_s_repeats``), for the spread of sets that
last about a second.

Prompts: two built-in sets, chat-formatted with the model's template: `copy` (code edits, reformatting,
repetition: output copies much of the prompt) and `free` (open questions and creative writing).
"""
from __future__ import annotations

import argparse
import faulthandler
import functools
import gzip
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CODE = [
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def is_empty(self):\n        return not self.items\n",
    "function fetchUser(id) {\n  return fetch('/api/users/' + id)\n    .then(res => res.json())\n"
    "    .then(data => {\n      console.log(data.name);\n      return data;\n    });\n}\n",
    "SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.total > 100\nORDER BY orders.total DESC;\n",
]
TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog did not move. The fox jumped again, higher this time, "
    "and landed softly in the tall grass on the other side of the fence.",
    "Our store opens at 9 am on weekdays and 10 am on weekends. Returns are accepted within 30 days with a "
    "receipt. Gift cards cannot be exchanged for cash.",
    "Alice met Bob at the station at noon. They took the train to the coast, walked along the beach, "
    "and had dinner at a small restaurant near the harbour before returning home.",
    "name: build\non: [push]\njobs:\n  test:\n    runs-on: ubuntu-latest\n    steps:\n"
    "      - uses: actions/checkout@v4\n      - run: pip install -e .\n      - run: pytest -q\n",
]
COPY_PROMPTS = (
    [f"Rewrite this code with a docstring and comments, keeping all the code:\n\n{c}" for c in CODE]
    + [f"Repeat this code exactly, then explain it in one sentence:\n\n{c}" for c in CODE]
    + [f"Repeat the following text word for word:\n\n{t}" for t in TEXT]
    + [f"Correct any mistakes and output the full corrected text:\n\n{t}" for t in TEXT]
)
FREE_PROMPTS = [
    "Write a short poem about the sea at night.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What are the main causes of inflation?",
    "Describe a day in the life of a lighthouse keeper.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between weather and climate?",
    "Suggest a healthy breakfast and explain why it is healthy.",
    "How do airplanes stay in the air?",
    "Write a letter to a friend you have not seen in years.",
    "What should I consider when buying a used car?",
    "Explain photosynthesis in simple terms.",
    "Invent a new board game and describe its rules.",
    "Why do cats purr?",
    "Write a product description for a reusable water bottle.",
    "What are some good habits for better sleep?",
]
WARM_PROMPTS = [  # untimed warm-up traffic: neither set's prompts (the n-gram caches would learn their outputs)
    "Describe the water cycle in a few sentences.",
    "List five fruits and the colour of each.",
    "Summarise the plot of a detective story you make up.",
    "Translate 'good morning, how are you?' into French and Spanish, then explain the grammar.",
    "Write a haiku about autumn leaves.",
    "What is a prime number? Give examples.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "Explain how a bicycle gear system works.",
    "Give a recipe for a simple tomato soup.",
    "What are the planets of the solar system, in order?",
    "Write a limerick about a forgetful wizard.",
    "Compare trains and buses for a daily commute.",
    "Repeat this list exactly: apples, pears, plums, cherries, grapes, melons.",
    "How does a refrigerator keep food cold?",
    "Write a short motivational message for a student before an exam.",
    "Explain what a database index is and when to use one.",
]
WARM_CODE = [  # copy-heavy warm-up traffic (none of the timed prompts): drafting configurations reach wide verifies
    "def area(w, h):\n    if w < 0 or h < 0:\n        raise ValueError('negative size')\n    return w * h\n",
    "for (let i = 0; i < rows.length; i++) {\n  if (rows[i].done) {\n    count += 1;\n  }\n}\n",
    "The meeting is moved to Thursday at 3 pm in room 204. Please bring the quarterly figures and the draft "
    "budget, and send your slides to Maria by Wednesday evening.",
    "UPDATE accounts\nSET balance = balance - 50\nWHERE id = 7 AND balance >= 50;\n",
]
WARM_COPY = ([f"Repeat this exactly, then explain it in one sentence:\n\n{c}" for c in WARM_CODE]
             + [f"Rewrite this with comments, keeping all of it:\n\n{c}" for c in WARM_CODE])
COMMON = dict(attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.5,
              log_level="warning", random_seed=0, disable_prefill_cuda_graph=True)
CONFIGS = {
    "plain": {},
    "ngram": dict(speculative_algorithm="NGRAM"),  # SGLang's own n-gram speculation at its defaults (12-token trees)
    "ngram8": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8),  # 8-token trees
    "adaptive": dict(speculative_algorithm="NGRAM_ADAPTIVE"),
    # fixed width 1 drafts nothing: multi-step plain decoding alone (plain_forwards at every batch size)
    "adaptive_w1": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"fixed_width": 1, "plain_forwards": 4,
                                                                                "plain_forwards_max_batch": 48}),
    # the step cost by width: every width in turn, one step each (the profile's durations per width and batch)
    "adaptive_sweep": dict(speculative_algorithm="NGRAM_ADAPTIVE",
                           adaptive_file={"width_cycle": [2, 3, 4, 6, 8, 12, 16]}),
    # multi-step plain decoding always on at batch size 1 (the default before "auto")
    "adaptive_pf4": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"plain_forwards": 4}),
    "adaptive_pf": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"prefetch": True}),
    "adaptive_cw": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"charge_waits_to_drafts": True}),
    # the wait after a draft counted as plain decoding's cost (the default before charge_waits_to_drafts was)
    "adaptive_nocw": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"charge_waits_to_drafts": False}),
    "adaptive_chain": dict(speculative_algorithm="NGRAM_ADAPTIVE", speculative_ngram_max_bfs_breadth=1),
    # plain_forwards "auto" (measured per batch-size bucket) up to batch 48 (the default), or at batch size 1 only
    "adaptive_mb48": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"plain_forwards_max_batch": 48}),
    "adaptive_mb1": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"plain_forwards_max_batch": 1}),
    # one decode forward per scheduler step where nothing is drafted (the default runs up to 4 where it pays)
    "adaptive_pf1": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"plain_forwards": 1}),
    "adaptive_w1_pf1": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"fixed_width": 1,
                                                                                    "plain_forwards": 1}),
    # a wider margin a draft must beat plain decoding by, per decode-step of extra cost (the controller's min_gain,
    # default 0.1): where a verify costs 2-3x a plain step and drafts accept little (free text at batch 8-16)
    "adaptive_mg03": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"controller": {"min_gain": 0.3}}),
    "adaptive_mg05": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"controller": {"min_gain": 0.5}}),
    # the objective when nobody waits behind the batch (the controller's drain, default gmean: the requests'
    # geometric-mean speed): their harmonic-mean speed, or the slowest request's (a closed batch ends with its last)
    "adaptive_dhm": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"controller": {"drain": "hmean"}}),
    "adaptive_dmin": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"controller": {"drain": "min"}}),
    # a step that waits for the previous step's tokens prepares its verify (batch, metadata, graph inputs) first
    # (the default "auto" does so where it costs at most a quarter of a plain step; adaptive_nopp builds the whole
    # verify after the wait)
    "adaptive_pp": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"preplan": True}),
    "adaptive_nopp": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"preplan": False}),
    "adaptive_pp_pf1": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"preplan": True,
                                                                                    "plain_forwards": 1}),
    # planning while plans draft nothing: skip steps after idle plans always (the default before "auto", which
    # skips only where a plan costs more than 5% of a plain step), or never
    "adaptive_bo": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"plan_backoff": True}),
    "adaptive_nobo": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"plan_backoff": False}),
    # token recycling as a third draft source (the verifier's own top-k after every scored position)
    "adaptive_rc": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"recycle": True}),
    "adaptive_rc_pp": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"recycle": True, "preplan": True}),
    # recycling where the n-gram match is shorter than 3 tokens (at the default 1, any one-token match keeps the
    # n-gram draft and recycling rarely drafts), no widening
    "adaptive_rc3": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"recycle": True, "recycle_min_match": 3,
                                                                                 "recycle_widen": False}),
    # token recycling at the paper's tree shape: up to 64 nodes (branching 4-2-2-1-1-1) where the n-gram match is
    # shorter than 3 tokens, widths up to 64; and its control, the n-gram drafts alone at widths up to 64
    "adaptive_rc64": dict(speculative_algorithm="NGRAM_ADAPTIVE", speculative_num_draft_tokens=64,
                          adaptive_file={"recycle": True, "recycle_min_match": 3,
                                         "recycle_branching": [4, 2, 2, 1, 1, 1]}),
    "adaptive_ng64": dict(speculative_algorithm="NGRAM_ADAPTIVE", speculative_num_draft_tokens=64),
    # every step verifies 16 tokens, so every step waits for the one before: the drafting step's period with and
    # without the verify prepared before the wait (the profile's durations at width 16)
    "adaptive_f16": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"fixed_width": 16}),
    "adaptive_f16_pp": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"fixed_width": 16,
                                                                                    "preplan": True}),
    # up to 1 or 3 steps in a row after a drafting step draft on the device (prompt lookup), without waiting
    "adaptive_dd1": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"device_drafts": 1}),
    "adaptive_dd3": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"device_drafts": 3}),
    "adaptive_f16_dd3": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"fixed_width": 16,
                                                                                     "device_drafts": 3}),
    # a verify's attention split over the prefix (as a decode step's) instead of SGLang's prefill kernel
    "adaptive_skv": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"split_kv_verify": True}),
    "adaptive_f16_skv": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"fixed_width": 16,
                                                                                     "split_kv_verify": True}),
    # the same with one program per KV head for its GQA group of query heads (the default)
    "adaptive_skvg": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"split_kv_verify": "grouped"}),
    # SGLang's own verify attention (its prefill kernel), the previous default
    "adaptive_noskv": dict(speculative_algorithm="NGRAM_ADAPTIVE", adaptive_file={"split_kv_verify": False}),
    # the width sweep (adaptive_sweep) through the grouped kernel: each width's verify cost with it
    "sweep_skvg": dict(speculative_algorithm="NGRAM_ADAPTIVE",
                       adaptive_file={"width_cycle": [2, 3, 4, 6, 8, 12, 16], "split_kv_verify": "grouped"}),
}


PREAMBLE_FILES = ("ngramspec/cache.py", "ngramspec/_trie.py", "ngramspec/_draft.py", "ngramspec/layout.py")


def preamble_text(tok, n_tokens: int) -> str:
    """A long shared context of about ``n_tokens`` tokens, as an agent's system prompt carries one: this repository's
    own source files, repeated as needed, cut at ``n_tokens`` tokens (deterministic for a given tokenizer)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = []
    for rel in PREAMBLE_FILES:
        path = os.path.join(root, rel)
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"# file: {rel}\n{f.read()}")
    body = "\n\n".join(parts) or "def f(x):\n    return x\n"
    head = "You are a coding assistant. The repository's files follow; answer the user's request.\n\n"
    ids = tok(head + body)["input_ids"]
    while len(ids) < n_tokens:
        body = body + "\n\n" + body
        ids = tok(head + body)["input_ids"]
    return tok.decode(ids[:n_tokens], skip_special_tokens=True)


@functools.lru_cache(maxsize=2)
def tokenizer(model: str):
    """The model's tokenizer, loaded once per process (a configuration's run needs it six times)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def chat_prompts(model: str, prompts: list[str], preamble_tokens: int = 0) -> list[str]:
    """The prompts in the model's chat template; with ``preamble_tokens``, each behind the same long system prompt
    (`preamble_text`): every step then attends over thousands of tokens, as in agents' requests."""
    tok = tokenizer(model)
    system = preamble_text(tok, preamble_tokens) if preamble_tokens > 0 else None
    if not getattr(tok, "chat_template", None):
        return [f"{system}\n\n{p}" if system else p for p in prompts]
    lead = [{"role": "system", "content": system}] if system else []
    return [tok.apply_chat_template(lead + [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts]


def prompt_ids(model: str, sets: dict) -> dict:
    """Each set's prompts as the token ids the server sees (for a replay in the simulator)."""
    tok = tokenizer(model)
    return {name: [tok(p)["input_ids"] for p in prompts] for name, prompts in sets.items()}


def profile_snapshot(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def profile_delta(before: dict, after: dict) -> dict | None:
    """Per step: mean verify width, waiting / planning / launch host ms, over all kinds of step."""
    tot = {k: 0.0 for k in ("steps", "requests", "width", "wait_s", "plan_s", "launch_s", "forward_s", "graph_steps",
                            "forwards", "prefetch_s", "views_s", "planner_s", "verify_prepare_s", "verify_sample_s",
                            "verify_after_s", "preplan_s")}
    kinds, by_kind = {}, {}
    for kind, row in after.items():
        if kind.startswith("_"):
            continue
        old = before.get(kind, {})
        d = {k: row.get(k, 0) - old.get(k, 0) for k in tot}
        kinds[kind] = int(d["steps"])
        if d["steps"]:  # host ms per step of this kind: planning (of it: prefetch, the request views with any wait
            # for the previous step's tokens, the first planner call), launch (forward call included), the forward call
            by_kind[kind] = {"plan_ms": round(1e3 * d["plan_s"] / d["steps"], 3),
                             "prefetch_ms": round(1e3 * d["prefetch_s"] / d["steps"], 3),
                             "preplan_ms": round(1e3 * d["preplan_s"] / d["steps"], 3),
                             "views_ms": round(1e3 * d["views_s"] / d["steps"], 3),
                             "planner_ms": round(1e3 * d["planner_s"] / d["steps"], 3),
                             "launch_ms": round(1e3 * d["launch_s"] / d["steps"], 3),
                             "forward_call_ms": round(1e3 * d["forward_s"] / d["steps"], 3),
                             # of launch_ms on verify steps: before the forward call, sampling, after sampling
                             **({f"{p}_ms": round(1e3 * d[f"{p}_s"] / d["steps"], 3)
                                 for p in ("verify_prepare", "verify_sample", "verify_after")} if kind == "verify"
                                else {}),
                             "forwards_per_step": round(d["forwards"] / d["steps"], 3)}
        for k in tot:
            tot[k] += d[k]
    n = tot["steps"]
    if not n:
        return None
    return {"steps": int(n), "mean_width": tot["width"] / n, "mean_batch": tot["requests"] / n,
            "host_ms_per_step": 1e3 * (tot["plan_s"] + tot["launch_s"]) / n,
            "wait_ms_per_step": 1e3 * tot["wait_s"] / n,
            "plan_ms_per_step": 1e3 * tot["plan_s"] / n, "forward_call_ms_per_step": 1e3 * tot["forward_s"] / n,
            "graph_share": tot["graph_steps"] / n, "forwards_per_step": tot["forwards"] / n, "steps_by_kind": kinds,
            "host_ms_by_kind": by_kind, "controller": diag_delta(before, after)}


def diag_delta(before: dict, after: dict) -> dict:
    """The controller's side of the run: reasons, expected tokens per planned request, mean measured step ms per
    width/batch, and its cost estimates at the end."""
    a, b = after.get("_diag", {}), before.get("_diag", {})
    if not a:
        return {}
    reasons = {k: v - b.get("reasons", {}).get(k, 0) for k, v in a.get("reasons", {}).items()}
    planned = a.get("planned_requests", 0) - b.get("planned_requests", 0)
    durations = {}
    for key, row in a.get("durations", {}).items():
        old = b.get("durations", {}).get(key, [0, 0.0, 0, 0])
        n = row[0] - old[0]
        if n > 0:
            durations[key] = {"n": n, "mean_ms": round(1e3 * (row[1] - old[1]) / n, 3),
                              "min_ms": round(1e3 * row[2], 3), "max_ms": round(1e3 * row[3], 3)}
    device = {}  # the device's clock per step (CUDA events): ms per step of each part, by width/batch
    for key, row in a.get("device", {}).items():
        old = b.get("device", {}).get(key, {})
        d = {k: row.get(k, 0) - old.get(k, 0) for k in row}
        if d["steps"] > 0:
            device[key] = {"steps": d["steps"],
                           "idle_before_ms": round(1e3 * d["idle_before_s"] / d["idle_measured"], 3)
                           if d["idle_measured"] else None,
                           **{f"{p}_ms": round(1e3 * d[f"{p}_s"] / d["steps"], 3)
                              for p in ("prepare", "forward", "after")}}
    sources = None  # draft tokens sent and accepted per verified / observed request-step, by source
    if "sources" in a:
        d = {k: v - b.get("sources", {}).get(k, 0) for k, v in a["sources"].items()}
        n, m = d.get("verified_requests", 0), d.get("observed_requests", 0)
        sources = {f"{k}_per_request": round(d[k] / (n if k.startswith("drafted") else m), 4)
                   for k in ("drafted_ngram", "drafted_recycled", "accepted_ngram", "accepted_recycled")
                   if (n if k.startswith("drafted") else m)}
    return {"reasons": {k: v for k, v in reasons.items() if v},
            "device_ms": device, "sources": sources,
            "expected_tokens_per_request": (a.get("expected_tokens", 0) - b.get("expected_tokens", 0)) / planned
            if planned else None,
            "durations": durations, "cost_estimates_ms": a.get("cost_estimates_ms", {}),
            "plain_forwards": a.get("plain_forwards"), "preplan_rule": a.get("preplan_rule")}


def sched_delta(before: dict, after: dict) -> dict | None:
    """Scheduler phases (NGRAMSPEC_SCHED_PROFILE): host ms per decode step of each phase, and the step period."""
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    periods = after.get("decode_periods", 0) - before.get("decode_periods", 0)
    if steps <= 0:
        return None
    out = {"decode_steps": steps,
           "period_ms": round(1e3 * (after["decode_period_s"] - before.get("decode_period_s", 0.0)) / periods, 4)
           if periods else None}
    for name, row in after.get("phases", {}).items():
        old = before.get("phases", {}).get(name, {"calls": 0, "seconds": 0.0})
        out[name + "_ms"] = round(1e3 * (row["seconds"] - old["seconds"]) / steps, 4)
    return out


def run_one(name: str, a) -> dict:
    import sglang

    cfg = dict(CONFIGS[name])
    adaptive_file = cfg.pop("adaptive_file", None)
    if adaptive_file is not None:
        path = os.path.join(tempfile.mkdtemp(), f"{name}.json")
        with open(path, "w") as f:
            json.dump(adaptive_file, f)
        cfg["speculative_adaptive_config"] = path
    extra = json.loads(a.extra) if a.extra else {}
    prof = os.path.join(tempfile.mkdtemp(), "profile.json")
    os.environ["NGRAMSPEC_PROFILE"] = prof
    sched = os.path.join(tempfile.mkdtemp(), "sched.json")
    kprof = None
    if a.kernel_profile and cfg.get("speculative_algorithm") == "NGRAM_ADAPTIVE":  # the plugin's worker writes it
        kprof = os.path.join(tempfile.mkdtemp(), "kernels.json")
        os.environ["NGRAMSPEC_KERNEL_PROFILE"] = kprof
        os.environ["NGRAMSPEC_KERNEL_PROFILE_STEPS"] = str(a.kernel_profile)
    if a.sched_profile:
        os.environ["NGRAMSPEC_SCHED_PROFILE"] = sched
        if os.environ.get("CPROF_DIR"):
            os.environ["NGRAMSPEC_SCHED_CPROFILE"] = os.path.join(os.environ["CPROF_DIR"], f"{name}.pstats")
    t0 = time.time()
    engine = sglang.Engine(model_path=a.model, dtype=a.dtype, tp_size=a.tp, max_running_requests=max(a.concurrency),
                           **{**COMMON, **extra, **cfg})
    startup = time.time() - t0
    print(f"[bench] {name}: engine started in {startup:.1f} s", file=sys.stderr, flush=True)  # in a timeout's tail
    sampling = {"temperature": 0, "max_new_tokens": a.max_new_tokens}
    pre = a.preamble_tokens
    sets = {"copy": chat_prompts(a.model, COPY_PROMPTS, pre)[: a.prompts_per_set],
            "free": chat_prompts(a.model, FREE_PROMPTS, pre)[: a.prompts_per_set]}
    warm = chat_prompts(a.model, WARM_PROMPTS, pre)[: min(a.prompts_per_set, a.warm_prompts)]
    warm_copy = chat_prompts(a.model, WARM_COPY, pre)[: min(a.prompts_per_set, a.warm_prompts)]
    out = {"config": name, "startup_s": round(startup, 1), "runs": {}, "preamble_tokens": pre,
           "prompt_ids": prompt_ids(a.model, sets),
           "warm_prompt_ids": prompt_ids(a.model, {"free": warm, "copy": warm_copy})}

    def warm_batches():
        for _ in range(a.warmup):
            engine.generate(warm, sampling)
            engine.generate(warm_copy, sampling)

    try:
        for prompt in warm + warm_copy:  # untimed, one at a time: prefill and verify shapes meet first-time costs
            engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64})
        for i, conc in enumerate(a.concurrency):
            if i and not a.no_flush:  # the n-gram caches forget the earlier level's outputs of the same prompts
                out.setdefault("flushed_before", []).append(conc)
                engine.flush_cache()
            for set_name, prompts in sets.items():
                for attempt in range(1 + a.retry_compiled):
                    if attempt:  # the first try paid kernel builds: time it again from a flushed, re-warmed server
                        engine.flush_cache()
                        if conc == 1:
                            for prompt in warm + warm_copy:
                                engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64})
                    if conc > 1:  # untimed, other prompts: batch shapes meet first-time costs here, not in the figure
                        warm_batches()
                    kernels = triton_kernels()
                    run = timed_run(engine, prompts, sampling, conc, prof, sched)
                    run["new_triton_kernels"] = [triton_entry(entry) for entry in sorted(triton_kernels() - kernels)]
                    previous = out["runs"].get(f"{set_name}/c{conc}") if attempt else None
                    if previous is not None:
                        run["compiled_first_try"] = {k: previous[k] for k in ("tok_s", "seconds", "new_triton_kernels")}
                    if kprof is not None:  # after the timed set: the profiler's host time stays out of it
                        run["kernel_profile"] = kernel_window(engine, kprof, warm_copy if set_name == "copy" else warm,
                                                              sampling, conc)
                    out["runs"][f"{set_name}/c{conc}"] = run
                    if not run["new_triton_kernels"]:
                        break
                run = out["runs"][f"{set_name}/c{conc}"]
                if conc > 1 and a.repeats > 1:  # short sets: again from a flushed, re-warmed server, for the spread
                    passes = [run]
                    for _ in range(a.repeats - 1):
                        engine.flush_cache()
                        warm_batches()
                        kernels = triton_kernels()
                        passes.append(timed_run(engine, prompts, sampling, conc, prof, sched))
                        passes[-1]["new_triton_kernels"] = [triton_entry(e) for e in sorted(triton_kernels() - kernels)]
                    # per pass: an outlier says whether a kernel build or longer steps (the period) made it slow
                    run["tok_s_repeats"] = [r["tok_s"] for r in passes]
                    run["accept_len_repeats"] = [r["accept_len"] for r in passes]
                    run["period_ms_repeats"] = [(r["scheduler"] or {}).get("period_ms") for r in passes]
                    run["host_probe_ms_repeats"] = [r["host_probe_ms"] for r in passes]
                    run["new_triton_kernels_repeats"] = [r["new_triton_kernels"] for r in passes]
                # what run_child keeps if the configuration runs past its limit
                print("PARTIAL " + json.dumps(out), flush=True)
    finally:
        engine.shutdown()
    return out


def kernel_window(engine, path: str, prompts: list, sampling: dict, conc: int, wait_s: float = 20.0) -> dict:
    """GPU time by kernel over the first decode steps of an untimed pass (warm-up prompts of the set's kind, at its
    concurrency), from the worker's NGRAMSPEC_KERNEL_PROFILE window (NGRAM_ADAPTIVE configurations only). The pass
    adds its outputs to the n-gram caches: take speed figures from a run without it."""
    if os.path.exists(path):
        os.remove(path)
    open(path + ".start", "w").close()
    # one request at a time at c1, as the set; at c>1 the set's batch, again while the window is open (the pass's
    # prompts were warm-up prompts, so the cache knows their outputs and drafts them whole: few steps per pass)
    batches = [[prompt] for prompt in prompts[:4]] if conc == 1 else [prompts[:conc]] * 4
    for batch in batches:
        engine.generate(batch if conc > 1 else batch[0], sampling)
        if os.path.exists(path):
            break
    t = time.time()
    while not os.path.exists(path) and time.time() - t < wait_s:
        time.sleep(0.1)
    if not os.path.exists(path):
        if os.path.exists(path + ".start"):
            os.remove(path + ".start")
        return {"error": "no window written (not an NGRAM_ADAPTIVE server, or fewer decode steps than the window)"}
    with open(path) as f:
        return json.load(f)


def triton_kernels() -> set:
    """The kernels in Triton's on-disk cache (compiled by this or an earlier process), one entry per specialization."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    entries = set()  # (hash folder, kernel name): one per compiled specialization
    for folder, _, files in os.walk(root):
        entries.update((os.path.basename(folder), f[:-5]) for f in files
                       if f.endswith(".json") and not f.startswith("__grp__"))
    return entries


def triton_entry(entry: tuple) -> str:
    """A kernel of `triton_kernels` as its name and the specialisation Triton recorded for it (constants, and the
    arguments it specialised on, e.g. pointer alignment), as far as its metadata says."""
    folder, name = entry
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        with open(os.path.join(root, folder, name + ".json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return name
    keys = ("constants", "attrs", "signature", "specialization")
    return f"{name} " + json.dumps({k: meta[k] for k in keys if k in meta}, default=str)[:400]


def host_probe(reps: int = 5, n: int = 20000) -> float:
    """Milliseconds of a fixed pure-Python workload (median of ``reps``), run while the server is idle. The
    scheduler's work is Python too: a host that runs this slower (another CPU, cores shared with other jobs) runs
    the scheduler slower, which the GPU figures alone would not tell apart from a slower version."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        d: dict = {}
        for i in range(n):
            d[i & 1023] = d.get(i & 1023, 0) + i
        times.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(times), 3)


def timed_run(engine, prompts, sampling, conc, prof, sched) -> dict:
    probe = host_probe()
    before, sched_before = profile_snapshot(prof), profile_snapshot(sched)
    t = time.perf_counter()
    if conc == 1:
        res = [engine.generate(p, sampling) for p in prompts]
    else:
        res = engine.generate(prompts, sampling)
    secs = time.perf_counter() - t
    time.sleep(0.6)  # the profiles are rewritten four times a second
    prof_d = profile_delta(before, profile_snapshot(prof))
    sched_d = sched_delta(sched_before, profile_snapshot(sched))
    tokens = sum(r["meta_info"]["completion_tokens"] for r in res)
    steps = [r["meta_info"].get("spec_verify_ct") or 0 for r in res]
    return {"seconds": round(secs, 3), "tokens": tokens, "tok_s": round(tokens / secs, 1), "host_probe_ms": probe,
            "accept_len": round(tokens / sum(steps), 3) if sum(steps) else None,
            "profile": prof_d, "scheduler": sched_d,
            "output_ids": [r.get("output_ids") for r in res], "texts": [r["text"] for r in res]}


def first_difference(a, b) -> int | None:
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_child(script: str, name: str, timeout: float, logs: str | None, grace: float = 5.0) -> dict:
    """Run ``script --one NAME`` (this process's arguments passed on) in a child process (its own process group,
    with the engine's processes) and return the JSON it prints after ``RESULT ``, or an error with the tail of its
    stderr; ``wall_s`` added. Its stderr goes to LOGS/NAME.log when ``logs`` is given. At the timeout the group gets
    SIGUSR1 first: the processes that registered it (the child; with NGRAMSPEC_STACKS_ON_SIGUSR1, which this sets,
    NGRAM_ADAPTIVE's scheduler) print every thread's stack to stderr, so a hang shows where; then it is killed, and
    the sets it finished (its last ``PARTIAL `` line) come back with the error."""
    cmd = [sys.executable, os.path.abspath(script), "--one", name] + sys.argv[1:]
    env = dict(os.environ, NGRAMSPEC_STACKS_ON_SIGUSR1="1")
    t = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc.pid, signal.SIGUSR1)  # the stacks first
        try:
            out, err = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            out = err = None
        _signal_group(proc.pid, signal.SIGKILL)  # then the whole group, the engine's processes too
        if out is None:
            out, err = proc.communicate()
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"{name}.log"), "w") as f:
            f.write(err[-400_000:])
    if timed_out:
        # the sets it finished (the child prints its result so far after each set), marked with the error
        partial = [ln for ln in (out or "").splitlines() if ln.startswith("PARTIAL ")]
        res = json.loads(partial[-1][8:]) if partial else {"config": name}
        res.update(error=f"timeout {int(timeout)}s", stderr_tail=err[-6000:])
    else:
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(line[-1][7:]) if line else {"config": name, "error": f"rc={proc.returncode}",
                                                      "stderr_tail": err[-6000:]}
    res["wall_s"] = round(time.time() - t, 1)
    return res


def load_json(path: str):
    """A result file of this script, gzipped (``.gz``, as kept in docs/sglang/) or not."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def drafting_steps(ctl: dict) -> tuple[float, float] | None:
    """Tokens per request and drafting step (bonus included): the controller's expectation and what was committed.
    The set's accept length counts every decode step, the plain ones too, so it is not the controller's yardstick."""
    src = ctl.get("sources") or {}
    expected = ctl.get("expected_tokens_per_request")
    if expected is None or "accepted_ngram_per_request" not in src:
        return None
    return expected, 1.0 + src["accepted_ngram_per_request"] + src.get("accepted_recycled_per_request", 0.0)


def print_summary(results: dict) -> None:
    """The tables of a run from its results (also of a run cut short: `--summary OUT.json`)."""
    base = results.get("plain", {}).get("runs", {})
    print(f"\n{'config':14s} {'run':9s} {'tok/s':>8s} {'x plain':>8s} {'accept':>7s} {'width':>6s} "
          f"{'host ms':>8s} {'wait ms':>8s} {'fwd/step':>8s} {'identical':>10s}")
    for name, res in results.items():
        for run, r in res.get("runs", {}).items():
            ref = base.get(run)
            ratio = r["tok_s"] / ref["tok_s"] if ref else float("nan")
            same, diffs = "-", []
            if ref and name != "plain":
                key = "output_ids" if r["output_ids"][0] is not None else "texts"
                diffs = [(i, first_difference(x, y)) for i, (x, y) in enumerate(zip(ref[key], r[key]))]
                diffs = [(i, d) for i, d in diffs if d is not None]
                same = f"{len(r[key]) - len(diffs)}/{len(r[key])}"
                r["differs_at"] = diffs
            pr = r.get("profile") or {}
            print(f"{name:14s} {run:9s} {r['tok_s']:8.1f} {ratio:8.3f} {r['accept_len'] or 1.0:7.2f} "
                  f"{pr.get('mean_width', float('nan')):6.2f} {pr.get('host_ms_per_step', float('nan')):8.3f} "
                  f"{pr.get('wait_ms_per_step', float('nan')):8.3f} {pr.get('forwards_per_step', float('nan')):8.2f} "
                  f"{same:>10s}"
                  + (f"  first differences (prompt, token): {diffs[:4]}" if diffs else ""))
    phases = ["period_ms", "run_batch_ms", "worker_forward_ms", "get_next_batch_to_run_ms", "prepare_for_decode_ms",
              "process_batch_result_ms", "process_result_decode_ms", "batch_copy_ms", "launch_sample_ms",
              "ingest_requests_ms"]
    if any((r.get("scheduler") for res in results.values() for r in res.get("runs", {}).values())):
        print("\nscheduler host ms per decode step (period: between decode launches; phases inclusive)")
        print(f"{'config':14s} {'run':9s} " + " ".join(f"{p[:-3][:12]:>12s}" for p in phases))
        for name, res in results.items():
            for run, r in res.get("runs", {}).items():
                sc = r.get("scheduler") or {}
                print(f"{name:14s} {run:9s} " + " ".join(
                    f"{sc[p]:12.4f}" if sc.get(p) is not None else f"{'-':>12s}" for p in phases))
    if any(r.get("tok_s_repeats") for res in results.values() for r in res.get("runs", {}).values()):
        print("\nrepeated sets: tok/s of each pass (x plain: medians' ratio)")
        for name, res in results.items():
            for run, r in res.get("runs", {}).items():
                reps = r.get("tok_s_repeats")
                ref = (base.get(run) or {}).get("tok_s_repeats")
                if reps:
                    ratio = statistics.median(reps) / statistics.median(ref) if ref else float("nan")
                    periods = " ".join("-" if p is None else f"{p:.2f}" for p in r.get("period_ms_repeats") or [])
                    built = [k for ks in r.get("new_triton_kernels_repeats") or [] for k in ks]
                    print(f"{name:14s} {run:9s} {' '.join(f'{x:8.1f}' for x in reps)}  x plain {ratio:6.3f}"
                          + (f"  period ms {periods}" if periods.strip("- ") else "")
                          + (f"  Triton built: {built}" if built else ""))
    probes = {name: [p for r in res.get("runs", {}).values()
                     for p in (r.get("host_probe_ms_repeats") or [r.get("host_probe_ms")]) if p is not None]
              for name, res in results.items()}
    if any(probes.values()):
        print("\nhost probe: ms of a fixed Python workload before each timed set (median of 5; a slower host reads "
              "higher)")
        for name, ps in probes.items():
            if ps:
                print(f"{name:14s} median {statistics.median(ps):7.3f}  min {min(ps):7.3f}  max {max(ps):7.3f}  "
                      f"({len(ps)} sets)")
    for name, res in results.items():
        for run, r in res.get("runs", {}).items():
            kinds = (r.get("profile") or {}).get("host_ms_by_kind")
            if kinds:
                print(f"host ms per step by kind {name} {run}: {json.dumps(kinds)}")
    for name, res in results.items():
        for run, r in res.get("runs", {}).items():
            if r.get("new_triton_kernels"):
                print(f"Triton compiled during the timed set {name} {run}: {r['new_triton_kernels']}")
    if any(r.get("kernel_profile") for res in results.values() for r in res.get("runs", {}).values()):
        print("\nGPU ms per decode step by kernel category (an untimed pass after each set; widths: steps per width)")
        for name, res in results.items():
            for run, r in res.get("runs", {}).items():
                k = r.get("kernel_profile") or {}
                if "gpu_ms_per_step" in k:
                    cats = " ".join(f"{c} {v:.3f}" for c, v in k["by_category_ms_per_step"].items())
                    print(f"{name:14s} {run:9s} total {k['gpu_ms_per_step']:.3f}  widths {k['widths']} "
                          f"forwards {k['forwards']} prefills {k['prefills_in_window']}  {cats}")
                elif k:
                    print(f"{name:14s} {run:9s} {k.get('error')}")
    rows = [(name, run, drafting_steps(ctl)) for name, res in results.items() for run, r in res.get("runs", {}).items()
            if (ctl := (r.get("profile") or {}).get("controller"))]
    if any(row[2] for row in rows):
        print("\ndrafting steps: tokens per request and step (bonus included), the controller's expectation against "
              "what was committed")
        for name, run, pair in rows:
            if pair:
                print(f"{name:14s} {run:9s} expected {pair[0]:6.3f}  committed {pair[1]:6.3f}  "
                      f"ratio {pair[1] / pair[0]:6.3f}")
    for name, res in results.items():
        for run, r in res.get("runs", {}).items():
            ctl = (r.get("profile") or {}).get("controller")
            if ctl:
                print(f"controller {name} {run}: {json.dumps(ctl)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (required unless --summary)")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts-per-set", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--configs", default="plain,ngram,adaptive,adaptive_w1")
    p.add_argument("--extra", default="", help="JSON object of extra sglang.Engine arguments for every config")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--logs", help="folder for each configuration's server log (stderr)")
    p.add_argument("--retry-compiled", type=int, default=1,
                   help="times a set is timed again (from a flushed, re-warmed server) when Triton compiled kernels "
                        "during it: a build takes seconds, a set lasts a few (default 1; the first try is kept as "
                        "compiled_first_try)")
    p.add_argument("--no-flush", action="store_true",
                   help="keep the caches between concurrency levels (by default each level after the first starts "
                        "from a flushed server: its prompts are the same, and an n-gram cache would hold their "
                        "outputs from the earlier level)")
    p.add_argument("--warm-prompts", type=int, default=16,
                   help="prompts of each warm-up set generated once, one at a time, before timing (default 16)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes of the warm-up prompts before each timed set at concurrency > 1")
    p.add_argument("--sched-profile", action="store_true",
                   help="time the scheduler's phases per decode step (NGRAMSPEC_SCHED_PROFILE), every config")
    p.add_argument("--preamble-tokens", type=int, default=0,
                   help="put every prompt (timed and warm-up) behind the same long system prompt of this many tokens "
                        "(this repository's source), so each step attends over a long context, as in agents' "
                        "requests (e.g. 4000; the radix cache holds it after the warm-up)")
    p.add_argument("--repeats", type=int, default=1,
                   help="time each set at concurrency > 1 this many times, each from a flushed, re-warmed server "
                        "(those sets last about a second); tok_s stays the first pass's, tok_s_repeats has all")
    p.add_argument("--kernel-profile", type=int, metavar="STEPS", default=0,
                   help="after each timed set, split STEPS decode steps of an untimed pass by GPU kernel "
                        "(NGRAMSPEC_KERNEL_PROFILE; NGRAM_ADAPTIVE configurations; e.g. 32)")
    p.add_argument("--summary", action="store_true",
                   help="print the tables of an earlier run's --out file (one cut short too) and exit")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.summary:
        print_summary(load_json(a.out))
        return 0
    if a.one:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_child's timeout: where it hangs
        print("RESULT " + json.dumps(run_one(a.one, a)), flush=True)
        return 0
    if not a.model:
        p.error("--model is required")
    results = {}
    for name in a.configs.split(","):
        results[name] = res = run_child(__file__, name, a.timeout, a.logs)
        if "error" in res:
            print(f"{name}: {res['error']}\n{res.get('stderr_tail', '')}", flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f)
    print_summary(results)
    with open(a.out, "w") as f:
        json.dump(results, f)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
