#!/usr/bin/env python3
"""Plain decoding, SGLang's NGRAM and NGRAM_ADAPTIVE through SGLang's HTTP server, measured by SGLang's own client.

For each configuration: `python -m sglang.launch_server` on 127.0.0.1, then `python -m sglang.bench_serving
--backend sglang` over the same prompts at each request rate (default: inf, then 8 req/s), then the server is
stopped. The prompts are a ShareGPT-format file written to --out (no download): half copy-heavy (code and text to
repeat, comment or fix) and half free text (questions, stories), from the server benchmark's prompt sets
(`sglang_engine_bench.py`), numbered so that no two are equal, with the model's chat template; up to
--max-new-tokens each, stopping at EOS (`--disable-ignore-eos`: what a user's request does). Reported per
configuration and rate: output tokens/s, TTFT and inter-token latency (bench_serving's ITL: the gap between two
streamed chunks; a chunk of several tokens is one gap) median and p99, TPOT median, accept length, and each
against plain decoding of the same run.

One GPU call (H200, the SGLang 0.5.23 kit copied to .gpukit and carried, SmolLM2-135M-Instruct float16 at
$MODEL_DIR; three servers one after another, about 6 minutes):
    source .gpukit/device/env.sh && python3 scripts/sglang_http_bench.py --model $MODEL_DIR --out /tmp/http \
        && cp /tmp/http/http_bench.json $OUT/
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
from sglang_engine_bench import COPY_PROMPTS, FREE_PROMPTS  # noqa: E402
from sglang_soak import HOST, Server  # noqa: E402

CONFIGS = {
    "plain": [],
    "ngram": ["--speculative-algorithm", "NGRAM"],
    "adaptive": ["--speculative-algorithm", "NGRAM_ADAPTIVE"],
}
METRICS = ("completed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
           "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_e2e_latency_ms", "accept_length")


def sharegpt_prompts(n: int) -> list[dict]:
    """n conversations in ShareGPT's format, copy-heavy and free text alternating, each numbered (no two equal)."""
    out = []
    for i in range(n):
        pool = COPY_PROMPTS if i % 2 == 0 else FREE_PROMPTS
        text = pool[(i // 2) % len(pool)]
        kind = "copy" if i % 2 == 0 else "free"
        out.append({"id": f"{kind}-{i}", "conversations": [
            {"from": "human", "value": f"(request {i})\n{text}"},
            {"from": "gpt", "value": "ok"}]})  # bench_serving reads the output length from --sharegpt-output-len
    return out


def server_cmd(a, config: str) -> list[str]:
    if a.server_cmd:  # a stand-in server (tests)
        return [x.format(port=a.port, config=config) for x in json.loads(a.server_cmd)]
    return ([sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--host", HOST,
             "--port", str(a.port), "--dtype", a.dtype, "--attention-backend", "triton",
             "--sampling-backend", "pytorch", "--random-seed", "0", "--log-level", "warning"]
            + CONFIGS[config] + shlex.split(a.server_args))


def bench_cmd(a, rate: str, out_file: str, dataset: str) -> list[str]:
    if a.bench_cmd:
        return [x.format(port=a.port, rate=rate, num_prompts=a.num_prompts, output_file=out_file)
                for x in json.loads(a.bench_cmd)]
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", HOST,
            "--port", str(a.port), "--model", a.model, "--tokenizer", a.model, "--dataset-name", "sharegpt",
            "--dataset-path", dataset, "--sharegpt-output-len", str(a.max_new_tokens), "--apply-chat-template",
            "--disable-ignore-eos", "--num-prompts", str(a.num_prompts), "--request-rate", rate,
            "--seed", "0", "--output-file", out_file, "--disable-tqdm", "--warmup-requests", str(a.warmup),
            "--ready-check-timeout-sec", "30"]


def read_result(path: str) -> dict:
    """The metrics of bench_serving's last JSONL line (None for each one it lacks); {} if there is none."""
    try:
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return {}
    if not lines:
        return {}
    return {k: lines[-1].get(k) for k in METRICS}


def run_config(a, config: str, dataset: str) -> dict:
    import subprocess

    out = os.path.join(a.out, config)
    os.makedirs(out, exist_ok=True)
    server = Server(server_cmd(a, config), a.port, out)
    t = time.time()
    server.start()
    res: dict = {"rates": {}}
    try:
        if not server.wait_ready(a.startup_timeout):
            res["error"] = "the server did not start (see its log)"
            return res
        res["startup_s"] = round(time.time() - t, 1)
        for rate in a.rates.split(","):
            out_file = os.path.join(out, f"rate_{rate}.jsonl")
            with open(os.path.join(out, f"bench_{rate}.log"), "w") as log:
                proc = subprocess.run(bench_cmd(a, rate, out_file, dataset), stdout=log, stderr=subprocess.STDOUT,
                                      timeout=a.bench_timeout, check=False)
            r = read_result(out_file)
            if proc.returncode != 0 or not r:
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
    p.add_argument("--server-args", default="", help="more launch_server arguments, for every config")
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
    dataset = os.path.join(os.path.abspath(a.out), "prompts_sharegpt.json")
    with open(dataset, "w") as f:
        json.dump(sharegpt_prompts(a.num_prompts), f)
    results = {}
    path = os.path.join(a.out, "http_bench.json")
    for config in configs:
        results[config] = run_config(a, config, dataset)
        with open(path, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
        print(f"{config}: {json.dumps(results[config])[:300]}", flush=True)
    print(table(results))
    ok = all("error" not in r and all("error" not in x for x in r["rates"].values()) for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
