"""The SGLang plugin's planner on copy-heavy traffic at its server defaults: with the tries' hash views sized to the
live nodes (the cache as it is) against hashing into the whole tables (as a cache did before hash views).

    .venv-sglang/bin/python -m pytest bench/test_bench_hash.py --benchmark-only -s

The planner is built as the server builds it (`resolve_config` of SGLang's defaults: a node pool of 5 million per
trie, 16-token verifies). ``batch`` requests (1, 8, 16, and 48: SGLang's cap on a speculative server's running
requests) of 300 random prompt tokens each; every step each request commits ``COMMIT`` tokens that copy its prompt
(what a copy-heavy request commits at a high accept length), ``STEPS`` steps. The figure is the median over steps
(after ``WARM`` untimed ones) and rounds of one `DraftPlanner.plan` call, µs (wall), the two variants interleaved
round by round. Both variants must plan identically (asserted).
"""
from __future__ import annotations

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

ROUNDS = int(os.environ.get("HASH_BENCH_ROUNDS", "3"))
COMMIT, STEPS, WARM, PROMPT = 10, 24, 4, 300


def _whole_tables(planner: DraftPlanner) -> DraftPlanner:
    """Make the planner's (empty) cache hash into its whole tables, as before hash views: they never grow."""
    c = planner.cache
    c._l_table, c._s_table = c._l_hash, c._s_hash
    c._own_state = c._own_state._replace(table=c._l_hash)
    c._shared_state = c._shared_state._replace(table=c._s_hash)
    return planner


def _replay(planner: DraftPlanner, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 50_000, PROMPT).tolist() for _ in range(batch)]
    outs = [[] for _ in range(batch)]
    times, plans = [], []
    for step in range(STEPS):
        views = [RequestView(i, prompts[i], outs[i]) for i in range(batch)]
        t = time.perf_counter()
        plan = planner.plan(views)
        times.append(time.perf_counter() - t)
        plans.append((plan.width, plan.tokens.tobytes()))
        for i in range(batch):
            n = len(outs[i])
            outs[i].extend(prompts[i][50 + n:50 + n + COMMIT])
    return times[WARM:], plans


@pytest.mark.parametrize("batch", (1, 8, 16, 48))
def test_planner_copy_heavy_hash_views(benchmark, batch, capsys):
    config = resolve_config(SimpleNamespace(speculative_num_draft_tokens=16))
    DraftPlanner(config).warm_up()
    times = {"hash views": [], "whole tables": []}

    def rounds():
        for r in range(ROUNDS):
            ref = None
            for name in times:  # interleaved
                planner = DraftPlanner(config)
                if name == "whole tables":
                    _whole_tables(planner)
                t, plans = _replay(planner, batch, seed=r)
                times[name].extend(t)
                assert ref is None or plans == ref, "the two variants planned differently"
                ref = plans

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    benchmark.extra_info.update({"batch": batch, "commit_tokens_per_request_step": COMMIT, "rounds": ROUNDS,
                                 **{f"{k.replace(' ', '_')}_us_per_plan": v for k, v in med.items()},
                                 "whole_over_views": med["whole tables"] / med["hash views"]})
    with capsys.disabled():
        print(f"\nplanner, batch {batch}, {COMMIT} copied tokens per request-step: µs per plan, median "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f" (whole / views {med['whole tables'] / med['hash views']:.2f})")
