#!/usr/bin/env python3
"""Plain decoding, SGLang's NGRAM and NGRAM_ADAPTIVE through SGLang's HTTP server, measured by SGLang's own client.

For each configuration: `python -m sglang.launch_server` on 127.0.0.1, then `python -m sglang.bench_serving
--backend sglang` at each request rate (default: inf, then 8 req/s), then the server is stopped. The prompts are
ShareGPT-format files written to --out (no download), one per rate, so that no rate meets a prompt (or its output)
that an earlier rate put into the server's caches: half copy-heavy (a function of this checkout's own source to
comment, annotate, rename or repeat), half free text (a poem, story, facts or explanation on one of 40 topics), no
two equal, with the model's chat template; up to --max-new-tokens each, stopping at EOS (`--disable-ignore-eos`:
what a user's request does). Every server gets the engine bench's settings (`COMMON`: memory fraction 0.5, no
prefill CUDA graphs, Triton attention, PyTorch sampling), then --server-args. `adaptive_mr256` is NGRAM_ADAPTIVE
with every batch drafting under plain decoding's running-request cap, `adaptive_mr256_tb` the same with no verify
above 768 tokens (the controller's `max_step_tokens`), `adaptive_cap48` every batch drafting under SGLang's cap for
speculative servers (48; the default before `draft_max_batch`), `adaptive_dmb48` the default spelled out. Reported
per configuration and rate: output tokens/s, TTFT and inter-token latency (bench_serving's ITL: the gap between two
streamed chunks; a chunk of several tokens is one gap) median and p99, TPOT median, accept length, and each against
plain decoding of the same run; and per rate, from the profiles (NGRAMSPEC_SCHED_PROFILE, NGRAMSPEC_PROFILE, set for
every server): SGLang's decode step period and for NGRAM_ADAPTIVE its mean batch, verify width, host time, measured
step costs and cost estimates.

One GPU call (H100/H200, the SGLang 0.5.23 kit copied to .gpukit and carried, a float16 model at $MODEL_DIR, e.g.
the 8B-cost padded SmolLM2; per configuration about 80 s of start-up and 30-60 s of load):
    source .gpukit/device/env.sh && python3 scripts/sglang_http_bench.py --model $MODEL_DIR --out /tmp/http \
        && cp /tmp/http/http_bench.json $OUT/
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import signal
import sys
import time

import numpy as np

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
import sglang_engine_bench as engine_bench  # noqa: E402
from sglang_engine_bench import COMMON, COPY_PROMPTS, FREE_PROMPTS  # noqa: E402
from sglang_soak import HOST, Server, bench_serving_env, port_answers  # noqa: E402

ROOT = os.path.dirname(SCRIPTS)
CONFIGS = {
    "plain": [],
    "ngram": ["--speculative-algorithm", "NGRAM"],
    # the defaults: drafting only in batches of up to 48 requests, under plain decoding's running-request cap
    "adaptive": ["--speculative-algorithm", "NGRAM_ADAPTIVE"],
    "adaptive_dmb48": ["--speculative-algorithm", "NGRAM_ADAPTIVE", {"draft_max_batch": 48}],
    # every batch may draft; SGLang's cap for speculative servers, 48 running requests (NGRAM's too)
    "adaptive_cap48": ["--speculative-algorithm", "NGRAM_ADAPTIVE", {"draft_max_batch": None}],
    # every batch may draft, under plain decoding's cap on an 80-141 GB GPU (256, its largest decode CUDA graph)
    "adaptive_mr256": ["--speculative-algorithm", "NGRAM_ADAPTIVE", "--max-running-requests", "256",
                       {"draft_max_batch": None}],
    # the same, no verify above 768 tokens (batch x width: what the 48-request cap allowed at width 16), so at large
    # batches it verifies narrow or not at all whatever its cost estimates say (a dict: the adaptive config file)
    "adaptive_mr256_tb": ["--speculative-algorithm", "NGRAM_ADAPTIVE", "--max-running-requests", "256",
                          {"draft_max_batch": None, "controller": {"max_step_tokens": 768}}],
}


def config_cli(a, config: str) -> list[str]:
    """A configuration's launch_server flags; its dict, if any, written to --out as the
    `--speculative-adaptive-config` file."""
    out = []
    for item in CONFIGS[config]:
        if isinstance(item, dict):
            path = os.path.join(a.out, config, "adaptive_config.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(item, f)
            out += ["--speculative-adaptive-config", path]
        else:
            out.append(item)
    return out


def common_cli() -> list[str]:
    """The engine bench's settings for every configuration (`COMMON`: Triton attention, PyTorch sampling, memory
    fraction 0.5, no prefill CUDA graphs, seed, log level) as launch_server flags."""
    out = []
    for key, value in COMMON.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


COPY_ASKS = ("Rewrite this code with a docstring and comments, keeping all the code:",
             "Add type hints to this function and give back the whole function:",
             "Give this code descriptive variable names; return all of it:",
             "Repeat this code exactly, then say in one sentence what it does:")
TOPICS = ("the sea at night", "a lighthouse keeper", "volcanoes", "the history of bread", "honeybees",
          "black holes", "the printing press", "city gardens", "glaciers", "chess openings", "the Silk Road",
          "jazz", "tides", "coral reefs", "the first railways", "owls", "desert plants", "the Moon landing",
          "paper making", "thunderstorms", "ancient Rome's roads", "octopuses", "solar panels", "mountain goats",
          "the invention of the clock", "rainforests", "the Northern Lights", "sourdough", "whales' songs",
          "the compass", "bicycles", "earthquakes", "tea", "migratory birds", "the telescope", "caves",
          "the human heart", "windmills", "snowflakes", "the Olympic Games")
FREE_ASKS = ("Write a short poem about {}.", "Explain {} to a ten-year-old.", "Give me three facts about {}.",
             "Write a short story about {}.", "What should a visitor know about {}?")
METRICS = ("completed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
           "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_e2e_latency_ms", "accept_length")


def code_snippets() -> list[str]:
    """Functions of 6-30 lines from this checkout's own source (`ngramspec/`, in path and line order), then the
    server benchmark's code prompts: code no other prompt contains."""
    found = []
    for base, _, files in sorted(os.walk(os.path.join(ROOT, "ngramspec"))):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(base, name)) as f:
                src = f.read()
            lines = src.splitlines()
            spans = sorted((node.lineno, node.end_lineno) for node in ast.walk(ast.parse(src))
                           if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno + 1 <= 30)
            found += ["\n".join(lines[start - 1:end]) for start, end in spans]
    return list(dict.fromkeys(found + [p.split(":\n\n", 1)[-1] for p in COPY_PROMPTS]))


def sharegpt_prompts(n: int, offset: int = 0) -> list[dict]:
    """n conversations in ShareGPT's format, copy-heavy and free text alternating: prompts offset..offset+n-1 of
    one fixed sequence in which no code and no free-text question comes twice, so a run at a second request rate
    (offset n) meets none of the first's prompts or outputs in the server's caches."""
    codes = code_snippets()
    frees = [ask.format(topic) for ask in FREE_ASKS for topic in TOPICS] + list(FREE_PROMPTS)
    out = []
    for i in range(offset, offset + n):
        k = i // 2
        if i % 2 == 0:
            text = f"{COPY_ASKS[k % len(COPY_ASKS)]}\n\n{codes[k % len(codes)]}"
        else:
            text = frees[k % len(frees)]
        out.append({"id": f"{'copy' if i % 2 == 0 else 'free'}-{i}", "conversations": [
            {"from": "human", "value": text},
            {"from": "gpt", "value": "ok"}]})  # bench_serving reads the output length from --sharegpt-output-len
    return out


def server_cmd(a, config: str) -> list[str]:
    if a.server_cmd:  # a stand-in server (tests)
        return [x.format(port=a.port, config=config) for x in json.loads(a.server_cmd)]
    return ([sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--host", HOST,
             "--port", str(a.port), "--dtype", a.dtype] + common_cli() + config_cli(a, config)
            + shlex.split(a.server_args))


def bench_cmd(a, rate: str, out_file: str, dataset: str) -> list[str]:
    if a.bench_cmd:
        return [x.format(port=a.port, rate=rate, num_prompts=a.num_prompts, output_file=out_file)
                for x in json.loads(a.bench_cmd)]
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", HOST,
            "--port", str(a.port), "--model", a.model, "--tokenizer", a.model, "--dataset-name", "sharegpt",
            "--dataset-path", dataset, "--sharegpt-output-len", str(a.max_new_tokens), "--apply-chat-template",
            "--disable-ignore-eos", "--num-prompts", str(a.num_prompts), "--request-rate", rate,
            "--seed", "0", "--output-file", out_file, "--disable-tqdm", "--warmup-requests", str(a.warmup),
            "--ready-check-timeout-sec", "30", "--output-details"]


def read_result(path: str) -> dict:
    """The metrics of bench_serving's last JSONL line (None for each one it lacks); {} if there is none."""
    try:
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return {}
    if not lines:
        return {}
    r = {k: lines[-1].get(k) for k in METRICS}
    if isinstance(lines[-1].get("itls"), list) and isinstance(lines[-1].get("ttfts"), list):
        r["itl_timeline"] = itl_timeline(lines[-1]["ttfts"], lines[-1]["itls"])
    return r


def itl_timeline(ttfts: list, itls: list, parts: int = 10, top: int = 20) -> dict:
    """Where the gaps between streamed chunks fall, from bench_serving's per-request details (seconds): each gap's
    time is its chunk's arrival since the request was sent (TTFT plus the gaps before it; at rate inf every request
    is sent at once, so this is the time since the burst began). ``parts``: the span cut into that many equal
    slices, each with its count of gaps and their median, p99 and largest (ms); ``top``: the largest gaps, each with
    its time (s), its request, the chunk's place in that request and the request's number of chunks."""
    gaps = []  # (arrival s, gap ms, request, chunk index, chunks in the request)
    for req, (ttft, itl) in enumerate(zip(ttfts, itls)):
        if not isinstance(ttft, (int, float)) or not isinstance(itl, list):
            continue
        t = float(ttft)
        for j, g in enumerate(itl):
            t += float(g)
            gaps.append((t, float(g) * 1000.0, req, j + 1, len(itl) + 1))
    if not gaps:
        return {}
    end = max(x[0] for x in gaps) or 1.0
    slices = []
    for k in range(parts):
        lo, hi = end * k / parts, end * (k + 1) / parts
        ms = sorted(x[1] for x in gaps if lo <= x[0] < hi or (k == parts - 1 and x[0] == hi))
        slices.append({"from_s": round(lo, 3), "to_s": round(hi, 3), "gaps": len(ms),
                       "p50_ms": round(float(np.percentile(ms, 50)), 2) if ms else None,
                       "p99_ms": round(float(np.percentile(ms, 99)), 2) if ms else None,
                       "max_ms": round(ms[-1], 2) if ms else None})
    largest = sorted(gaps, key=lambda x: -x[1])[:top]
    return {"span_s": round(end, 3), "slices": slices,
            "largest": [{"at_s": round(t, 3), "gap_ms": round(g, 2), "request": r, "chunk": j, "chunks": n}
                        for t, g, r, j, n in largest]}


def run_config(a, config: str, datasets: dict) -> dict:
    import subprocess

    out = os.path.join(a.out, config)
    os.makedirs(out, exist_ok=True)
    server = Server(server_cmd(a, config), a.port, out)
    res: dict = {"rates": {}}
    if port_answers(a.port):
        res["error"] = f"something already answers on port {a.port} (a server left running?)"
        return res
    # the plugin's profiles (read at each rate's start and end): NGRAM_ADAPTIVE's host time, widths, batch sizes,
    # step costs and cost estimates; SGLang's scheduler phases and decode step period, for every configuration
    prof, sched = (os.path.join(os.path.abspath(out), name) for name in ("profile.json", "sched_profile.json"))
    os.environ["NGRAMSPEC_PROFILE"], os.environ["NGRAMSPEC_SCHED_PROFILE"] = prof, sched
    t = time.time()
    server.start()
    try:
        if not server.wait_ready(a.startup_timeout):
            res["error"] = "the server did not start (see its log)"
            return res
        res["startup_s"] = round(time.time() - t, 1)
        for rate in a.rates.split(","):
            out_file = os.path.join(out, f"rate_{rate}.jsonl")
            before = engine_bench.profile_snapshot(prof), engine_bench.profile_snapshot(sched)
            with open(os.path.join(out, f"bench_{rate}.log"), "w") as log:
                proc = subprocess.run(bench_cmd(a, rate, out_file, datasets[rate]), stdout=log,
                                      stderr=subprocess.STDOUT, timeout=a.bench_timeout, check=False,
                                      env=bench_serving_env(a.out))
            r = read_result(out_file)
            time.sleep(0.6)  # the profiles are rewritten four times a second
            r["profile"] = engine_bench.profile_delta(before[0], engine_bench.profile_snapshot(prof))
            r["scheduler"] = engine_bench.sched_delta(before[1], engine_bench.profile_snapshot(sched))
            if proc.returncode != 0 or r.get("completed") is None:
                r["error"] = f"bench_serving exited with {proc.returncode} (see bench_{rate}.log)"
            res["rates"][rate] = r
            if not server.alive():
                res["error"] = "the server went down (see its log)"
                break
    except subprocess.TimeoutExpired:
        res["error"] = f"bench_serving ran past {a.bench_timeout} s"
    finally:
        server.stop()
    return res


def ratio(x, y):
    return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def table(results: dict) -> str:
    def f(x, fmt="8.1f"):
        return format(x, fmt) if isinstance(x, (int, float)) else f"{'-':>{fmt.split('.')[0]}}"

    base = results.get("plain", {}).get("rates", {})
    lines = [f"{'config':9s} {'rate':>5s} {'done':>5s} {'tok/s':>8s} {'x plain':>7s} {'TTFT p50':>8s} "
             f"{'TTFT p99':>8s} {'ITL p50':>8s} {'ITL p99':>8s} {'x plain':>7s} {'TPOT p50':>8s} {'accept':>6s}"]
    for config, res in results.items():
        if "error" in res and not res.get("rates"):
            lines.append(f"{config:9s} error: {res['error']}")
        for rate, r in res.get("rates", {}).items():
            b = base.get(rate, {})
            tok_ratio = ratio(r.get("output_throughput"), b.get("output_throughput"))
            itl_ratio = ratio(r.get("p99_itl_ms"), b.get("p99_itl_ms"))
            lines.append(f"{config:9s} {rate:>5s} {f(r.get('completed'), '5.0f')} {f(r.get('output_throughput'))} "
                         f"{f(tok_ratio, '7.3f')} {f(r.get('median_ttft_ms'))} {f(r.get('p99_ttft_ms'))} "
                         f"{f(r.get('median_itl_ms'), '8.2f')} {f(r.get('p99_itl_ms'), '8.2f')} {f(itl_ratio, '7.3f')} "
                         f"{f(r.get('median_tpot_ms'), '8.2f')} {f(r.get('accept_length'), '6.2f')}"
                         + (f"  {r['error']}" if r.get("error") else ""))
        if res.get("error") and res.get("rates"):
            lines.append(f"{config:9s} error: {res['error']}")
    return "\n".join(lines)


def profile_lines(results: dict) -> str:
    """Per configuration and rate, from the profiles: SGLang's decode step period and host ms per step, and for
    NGRAM_ADAPTIVE its mean batch, mean verify width and host ms per step."""
    lines = []
    for config, res in results.items():
        for rate, r in res.get("rates", {}).items():
            sc, pr = r.get("scheduler") or {}, r.get("profile") or {}
            parts = [f"decode steps {sc['decode_steps']}, period {sc.get('period_ms')} ms"] if sc else []
            if pr:
                parts.append(f"mean batch {pr['mean_batch']:.1f}, mean width {pr['mean_width']:.2f}, "
                             f"plugin host {pr['host_ms_per_step']:.2f} ms/step")
            if parts:
                lines.append(f"{config:9s} {rate:>5s} " + "; ".join(parts))
    return "\n".join(lines)


def timeline_lines(results: dict) -> str:
    """Per configuration and rate: the gaps between streamed chunks, p99 (ms) in each tenth of the span since the
    requests were sent, and the three largest with their time (s)."""
    lines = []
    for config, res in results.items():
        for rate, r in res.get("rates", {}).items():
            tl = r.get("itl_timeline") or {}
            if tl.get("slices"):
                p99 = " ".join("-" if x["p99_ms"] is None else f"{x['p99_ms']:.0f}" for x in tl["slices"])
                big = ", ".join(f"{x['gap_ms']:.0f} ms at {x['at_s']:.2f} s" for x in tl["largest"][:3])
                lines.append(f"{config:9s} {rate:>5s} ITL p99 by tenth of {tl['span_s']:.1f} s: {p99}; largest {big}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder (also bench_serving's tokenizer)")
    p.add_argument("--out", required=True, help="folder for http_bench.json, the prompts, logs and raw results")
    p.add_argument("--configs", default="plain,ngram,adaptive", help=f"comma-separated, in order, of {list(CONFIGS)}")
    p.add_argument("--rates", default="inf,8", help="request rates (req/s, comma-separated; inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=4, help="bench_serving's --warmup-requests before each rate")
    p.add_argument("--port", type=int, default=30300)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--server-args", default="", help="more launch_server arguments, for every config (after the "
                   "engine bench's settings, which a repeated flag overrides)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=600.0, help="seconds one bench_serving run may take")
    p.add_argument("--server-cmd", help=argparse.SUPPRESS)  # tests: a stand-in server, JSON list ({port}, {config})
    p.add_argument("--bench-cmd", help=argparse.SUPPRESS)  # tests: a stand-in client, JSON list
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    configs = a.configs.split(",")
    for name in configs:
        if name not in CONFIGS:
            p.error(f"--configs: unknown config {name!r}; known: {sorted(CONFIGS)}")
    for rate in a.rates.split(","):
        if rate != "inf":
            try:
                if float(rate) <= 0:
                    raise ValueError
            except ValueError:
                p.error(f"--rates: {rate!r} is not a positive number or inf")
    if a.num_prompts < 2:
        p.error("--num-prompts must be >= 2")
    os.makedirs(a.out, exist_ok=True)
    datasets = {}  # each rate its own prompts: a server meets no prompt twice
    for i, rate in enumerate(a.rates.split(",")):
        datasets[rate] = os.path.join(os.path.abspath(a.out), f"prompts_sharegpt_{rate}.json")
        with open(datasets[rate], "w") as f:
            json.dump(sharegpt_prompts(a.num_prompts, offset=i * a.num_prompts), f)

    def on_term(signum, frame):  # `timeout` and the like: leave through the finally that stops the server
        raise SystemExit(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    results = {}
    path = os.path.join(a.out, "http_bench.json")
    for config in configs:
        results[config] = run_config(a, config, datasets)
        with open(path, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
        print(f"{config}: {json.dumps(results[config])[:300]}", flush=True)
    print(table(results))
    print(profile_lines(results))
    print(timeline_lines(results))
    ok = all("error" not in r and all("error" not in x for x in r["rates"].values()) for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
