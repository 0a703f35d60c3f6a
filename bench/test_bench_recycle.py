"""Host time of the SGLang plugin's planner with token recycling on (`recycle`) against off, at its server defaults.

    .venv-sglang/bin/python -m pytest bench/test_bench_recycle.py --benchmark-only -s

The planner is built as the server builds it (`resolve_config` of SGLang's defaults: 16-token verifies), for
SmolLM2's vocabulary (49,152 tokens). ``batch`` requests (1 and 16) of 300 random prompt tokens; steps alternate
between committing ``COPY`` tokens that copy the prompt and ``FREE`` fresh tokens (the n-gram cache matches on
the first, recycling drafts on the second). With recycling on, every step also hands the table the top-8 of four
scored rows per request (what a verify of the draft nodes gives back). The figures are medians over ``STEPS``
steps (after ``WARM`` untimed ones) and rounds of one `DraftPlanner.plan` call and one `recycle_update`, µs
(wall), the two variants interleaved round by round.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from ngramspec_sglang.config import resolve_config  # noqa: E402
from ngramspec_sglang.drafting import DraftPlanner, RequestView  # noqa: E402

ROUNDS = int(os.environ.get("RECYCLE_BENCH_ROUNDS", "3"))
VOCAB, COPY, FREE, STEPS, WARM, PROMPT = 49_152, 6, 3, 40, 5, 300


def _replay(planner: DraftPlanner, batch: int, seed: int, recycle: bool):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 40_000, PROMPT).tolist() for _ in range(batch)]
    outs = [[] for _ in range(batch)]
    plan_s, update_s = [], []
    for step in range(STEPS):
        views = [RequestView(i, prompts[i], outs[i]) for i in range(batch)]
        t = time.perf_counter()
        planner.plan(views)
        plan_s.append(time.perf_counter() - t)
        for i in range(batch):
            n = len(outs[i])
            outs[i].extend(prompts[i][50 + n:50 + n + COPY] if step % 2 else
                           rng.integers(40_000, VOCAB, FREE).tolist())
        if recycle:
            tokens = np.array([o[-1] for o in outs] * 4, np.int64)
            topk = rng.integers(0, VOCAB, (len(tokens), 8))
            t = time.perf_counter()
            planner.recycle_update(tokens, topk)
            update_s.append(time.perf_counter() - t)
    return plan_s[WARM:], update_s[WARM:]


@pytest.mark.parametrize("batch", (1, 16))
def test_planner_host_time_with_recycling(benchmark, batch, capsys):
    base = resolve_config(SimpleNamespace(speculative_num_draft_tokens=16))
    configs = {"n-gram only": base, "recycle": dataclasses.replace(base, recycle=True)}
    for config in configs.values():
        DraftPlanner(config, vocab_size=VOCAB).warm_up()
    plans = {name: [] for name in configs}
    updates = []

    def rounds():
        for r in range(ROUNDS):
            for name, config in configs.items():  # interleaved
                p, u = _replay(DraftPlanner(config, vocab_size=VOCAB), batch, r, name == "recycle")
                plans[name].extend(p)
                updates.extend(u)

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {name: 1e6 * statistics.median(t) for name, t in plans.items()}
    upd = 1e6 * statistics.median(updates)
    benchmark.extra_info.update({"batch": batch, "rounds": ROUNDS, "ngram_only_us_per_plan": med["n-gram only"],
                                 "recycle_us_per_plan": med["recycle"], "recycle_update_us": upd,
                                 "recycle_over_ngram": med["recycle"] / med["n-gram only"]})
    with capsys.disabled():
        print(f"\nplanner, batch {batch}: µs per plan, median: n-gram only {med['n-gram only']:.1f}, recycle "
              f"{med['recycle']:.1f} ({med['recycle'] / med['n-gram only']:.2f}x), table update {upd:.1f}")
