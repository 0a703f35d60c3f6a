#!/usr/bin/env python3
"""Does the SGLang plugin's host state grow with the requests served? Its DraftPlanner (cache, controller) at the
server's default capacity serves batches of up to 16 requests (uuid request ids, prompts of 16..2,048 tokens as in
scripts/sglang_soak.py's load, outputs copying their prompts in part, greedy verification against them), each request
released when done; the process's RSS and Python heap every 250 requests. CPU only, no sglang server:
    .venv-sglang/bin/python scripts/planner_memory.py 4000
With --flushes N: N times, 40 requests served and then the planner replaced, as SGLang's /flush_cache does in the
server, with Python's cyclic collector off (a server may not run it for a long time): RSS after each flush, which
grows by a whole cache per flush where the old one is only freed by that collector.
    .venv-sglang/bin/python scripts/planner_memory.py --flushes 4
"""
import gc
import sys
import time
import tracemalloc
import uuid

import numpy as np

from ngramspec.layout import accepted_path, mask_parents
from ngramspec_sglang.config import AdaptiveConfig
from ngramspec_sglang.diagnostics import rss_mb
from ngramspec_sglang.drafting import DraftPlanner, RequestView

VOCAB = 49152  # SmolLM2's
BATCH = 16


def new_request(rng) -> dict:
    prompt = rng.integers(0, VOCAB, int(rng.integers(16, 2048))).tolist()
    out, n = [], int(rng.integers(16, 400))
    while len(out) < n:
        if rng.random() < 0.5:
            s = int(rng.integers(0, len(prompt)))
            out += prompt[s:s + int(rng.integers(5, 40))]
        else:
            out += rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
    return {"rid": uuid.uuid4().hex, "prompt": prompt, "truth": out[:n], "output": []}


def committed_count(plan, i: int, upcoming: list) -> int:
    """Tokens a greedy verify commits for request ``i``: the accepted draft nodes (chain or tree) plus one."""
    k = int(plan.drafted[i]) if plan.width > 1 else 0
    if k == 0:
        return 1
    parents = mask_parents(plan.mask[i, :k + 1, :k + 1])[1:] - 1  # draft-relative, -1: the root
    return 1 + len(accepted_path(plan.tokens[i, 1:1 + k], parents, upcoming))


CONFIG = AdaptiveConfig(widths=(1, 2, 3, 4, 6, 8, 12, 16))  # the server's default capacity


def serve(planner, rng, total: int, report=None) -> None:
    """Batches of up to BATCH requests until ``total`` have finished, each released when done (the rest at the end);
    ``report(before, done)`` after each release."""
    running = [new_request(rng) for _ in range(BATCH)]
    done = 0
    while done < total:
        plan = planner.plan([RequestView(r["rid"], r["prompt"], r["output"]) for r in running])
        for i, r in enumerate(running):
            upcoming = r["truth"][len(r["output"]):]
            r["output"] = r["output"] + upcoming[:committed_count(plan, i, upcoming)]
        planner.record_duration(plan.width, len(running), 0.006 * (1 + 0.05 * plan.width))
        finished = [r for r in running if len(r["output"]) >= len(r["truth"])]
        if not finished:
            continue
        planner.release([r["rid"] for r in finished])
        before, done = done, done + len(finished)
        running = [r for r in running if len(r["output"]) < len(r["truth"])]
        running += [new_request(rng) for _ in finished]
        if report is not None:
            report(before, done)
    planner.release([r["rid"] for r in running])


def flushes(n: int) -> None:
    rng = np.random.default_rng(0)
    gc.disable()
    planner = DraftPlanner(CONFIG)
    print(f"start: RSS {rss_mb():8.1f} MB", flush=True)
    for k in range(1, n + 1):
        serve(planner, rng, 40)
        planner = None  # as the worker does: the old planner goes before the new one is built
        planner = DraftPlanner(CONFIG)
        print(f"flush {k}: RSS {rss_mb():8.1f} MB", flush=True)


def main(total: int) -> None:
    rng = np.random.default_rng(0)
    planner = DraftPlanner(CONFIG)
    base, t0 = None, time.time()
    tracemalloc.start()

    def report(before: int, done: int) -> None:
        nonlocal base
        if done // 250 != before // 250:
            gc.collect()
            heap = tracemalloc.get_traced_memory()[0] / 2**20
            if base is None:
                base = (rss_mb(), heap)
            print(f"{done:6d} requests {time.time() - t0:6.1f} s  RSS {rss_mb():8.1f} MB ({rss_mb() - base[0]:+6.1f})"
                  f"  Python heap {heap:6.2f} MB ({heap - base[1]:+5.2f})  tracked {len(planner.tracked_requests)}",
                  flush=True)

    serve(planner, rng, total, report)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--flushes":
        flushes(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
