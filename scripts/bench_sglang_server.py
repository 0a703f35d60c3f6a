#!/usr/bin/env python3
"""Real SGLang servers, NGRAM vs NGRAM_ADAPTIVE (and plain decode), side by side. Needs a GPU.

For each algorithm this launches `python -m sglang.launch_server` with the same model and width
bound, waits for it, replays the same prompts at each concurrency level (greedy, fixed max new
tokens), and records output tokens per second (wall clock, all requests) and SGLang's own
`meta_info.spec_accept_length` (completion tokens / verify steps, bonus included). It also checks
that every algorithm produced the same text as the first one (greedy: speculation must not change
outputs; a mismatch is reported, it can come from numerics of different verify widths).

Prompts: decoded from an ngramspec trace file (cl100k token ids -> text with tiktoken), by default
`<repo>/../shared/traces/agent_swe_gpt4_dev.jsonl.gz`, or plain text lines from `--prompts FILE`.

Example (one H100/H200, from the repository root, after `pip install -e .[sglang] tiktoken`):

    python scripts/bench_sglang_server.py --model-path meta-llama/Llama-3.1-8B-Instruct \
        --trace ../shared/traces/chat_gpt4.jsonl.gz --num-prompts 64 --concurrency 1 8 32
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "agent_swe_gpt4_dev.jsonl.gz"


def load_prompts(args) -> list[str]:
    if args.prompts:
        lines = [ln.rstrip("\n") for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        if not lines:
            raise SystemExit(f"{args.prompts}: no prompts")
        return lines[: args.num_prompts]
    trace = Path(args.trace)
    if not trace.is_file():
        raise SystemExit(f"trace {trace} not found; pass --trace FILE or --prompts FILE")
    try:
        import tiktoken
    except ImportError:
        raise SystemExit("decoding a trace needs tiktoken (pip install tiktoken), or pass --prompts FILE") from None
    enc = tiktoken.get_encoding("cl100k_base")
    prompts = []
    with gzip.open(trace, "rt") as f:
        for line in f:
            rec = json.loads(line)
            prompt = rec["prompt"][-args.max_prompt_tokens:]
            prompts.append(enc.decode(prompt))
            if len(prompts) >= args.num_prompts:
                break
    return prompts


def http_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode() or "{}")


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            urllib.request.urlopen(base + "/health_generate", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(2)
    raise TimeoutError(f"server at {base} not ready after {timeout:.0f}s")


def launch(args, algorithm: str, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--port", str(args.port), "--tp-size", str(args.tp_size), "--log-level", "info",
           "--max-running-requests", str(max(args.concurrency))]
    if algorithm != "NONE":
        cmd += ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    if algorithm == "NGRAM_ADAPTIVE" and args.adaptive_config:
        cmd += ["--speculative-adaptive-config", args.adaptive_config]
    cmd += shlex.split(args.server_args)
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_level(base: str, prompts: list[str], concurrency: int, max_new_tokens: int) -> dict:
    def one(prompt: str) -> dict:
        out = http_json(base + "/generate", {
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": False},
        })
        return out

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {
        "tok_s": tokens / elapsed,
        "accept_len": (tokens / verify) if verify else float("nan"),
        "tokens": tokens,
        "seconds": elapsed,
        "texts": [o["text"] for o in outs],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--algorithms", nargs="+", default=["NONE", "NGRAM", "NGRAM_ADAPTIVE"],
                    help="NONE = plain decode; any registered --speculative-algorithm")
    ap.add_argument("--num-draft-tokens", type=int, default=16, help="--speculative-num-draft-tokens for both")
    ap.add_argument("--adaptive-config", help="--speculative-adaptive-config JSON for NGRAM_ADAPTIVE")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--prompts", help="text file, one prompt per line (instead of --trace)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--port", type=int, default=30011)
    ap.add_argument("--server-args", default="", help="extra launch_server arguments, one string")
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench_sglang_server.json")
    args = ap.parse_args(argv)

    prompts = load_prompts(args)
    base = f"http://127.0.0.1:{args.port}"
    results: dict[str, dict[int, dict]] = {}
    for algorithm in args.algorithms:
        log_path = Path(f"server_{algorithm.lower()}.log")
        proc = launch(args, algorithm, log_path)
        try:
            wait_ready(base, proc, args.startup_timeout)
            run_level(base, prompts[: min(4, len(prompts))], 1, 16)  # warm-up, not measured
            results[algorithm] = {}
            for c in args.concurrency:
                r = run_level(base, prompts, c, args.max_new_tokens)
                results[algorithm][c] = r
                print(f"{algorithm:15s} conc {c:3d}: {r['tok_s']:9.1f} tok/s  accept len {r['accept_len']:.2f}",
                      flush=True)
        except Exception as e:
            print(f"{algorithm}: failed ({e}); server log in {log_path}", flush=True)
        finally:
            stop(proc)

    first = next(iter(results), None)
    print("\nconcurrency  " + "".join(f"{a + ' tok/s':>22s}{'acc len':>9s}" for a in results))
    for c in args.concurrency:
        row = f"{c:11d}  "
        for a in results:
            r = results[a].get(c)
            row += f"{r['tok_s']:22.1f}{r['accept_len']:9.2f}" if r else f"{'-':>22s}{'-':>9s}"
        print(row)
    if first:
        for a in results:
            for c, r in results[a].items():
                ref = results[first].get(c)
                if ref and a != first:
                    same = sum(x == y for x, y in zip(ref["texts"], r["texts"]))
                    print(f"{a} conc {c}: {same}/{len(r['texts'])} outputs identical to {first}")
    summary = {a: {c: {k: v for k, v in r.items() if k != "texts"} for c, r in lv.items()} for a, lv in results.items()}
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": summary}, indent=2))
    print(f"wrote {args.out}")
    return 0 if len(results) == len(args.algorithms) else 1


if __name__ == "__main__":
    raise SystemExit(main())
