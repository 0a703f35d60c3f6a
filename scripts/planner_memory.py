#!/usr/bin/env python3
"""Does the SGLang plugin's host state grow with the requests served? Its DraftPlanner (cache, controller) at the
server's default capacity serves batches of up to 16 requests (uuid request ids, prompts of 16..2,048 tokens as in
scripts/sglang_soak.py's load, outputs copying their prompts in part, greedy verification against them), each request
released when done; the process's RSS and Python heap every 250 requests. CPU only, no sglang server:
    .venv-sglang/bin/python scripts/planner_memory.py 4000
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


def main(total: int) -> None:
    rng = np.random.default_rng(0)
    planner = DraftPlanner(AdaptiveConfig(widths=(1, 2, 3, 4, 6, 8, 12, 16)))  # the server's default capacity
    running = [new_request(rng) for _ in range(BATCH)]
    done, base, t0 = 0, None, time.time()
    tracemalloc.start()
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
        if done // 250 != before // 250:
            gc.collect()
            heap = tracemalloc.get_traced_memory()[0] / 2**20
            if base is None:
                base = (rss_mb(), heap)
            print(f"{done:6d} requests {time.time() - t0:6.1f} s  RSS {rss_mb():8.1f} MB ({rss_mb() - base[0]:+6.1f})"
                  f"  Python heap {heap:6.2f} MB ({heap - base[1]:+5.2f})  tracked {len(planner.tracked_requests)}",
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
