"""Replay benchmarks on the dev traces: `pytest bench/ --benchmark-only`.

Each benchmark times full replays of a trace by a method (batch 1 and 32), `ROUNDS` rounds (default 3,
`NGRAMSPEC_BENCH_ROUNDS` to change), each on a fresh method. `extra_info` holds the acceptance figures
(accept_len, drafted_per_step, accept_rate), the speedup under each built-in profile, the method's own proposer
latency per token and the replay speed; the terminal summary prints accept length and speedup per method.
Methods whose drafts depend on the cost profile (`ngramspec-adaptive`, `oracle-ctl`) are replayed, and
benchmarked, once per profile. Skips cleanly without the dev traces (`$NGRAMSPEC_DATA/traces`, set by
bench/conftest.py) or without a method's package.
"""
from __future__ import annotations

import os

import pytest

from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import BUILTIN_PROFILES, get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import dev_trace_paths, load_trace

TRACES = {p.name.split(".")[0]: p for p in dev_trace_paths()}
BENCH_TRACE = "mtbench_vicuna7b"  # the smallest multi-request trace: fast enough to run every method
ROUNDS = int(os.environ.get("NGRAMSPEC_BENCH_ROUNDS", "3"))
METHODS = ["none", "prompt-lookup:k=8", "oracle:k=8", "ngramspec-chain:k=8", "ngramspec-tree:k=8",
           "sglang-ngram:d=9", "sglang-ngram", "arctic-suffix:k=8", "arctic-suffix:k=8,tree=1"]
PER_PROFILE = ["ngramspec-adaptive", "oracle-ctl:k=15"]  # replayed under each profile
CASES = [(spec, None) for spec in METHODS] + [(spec, p) for spec in PER_PROFILE for p in BUILTIN_PROFILES]

pytestmark = pytest.mark.skipif(BENCH_TRACE not in TRACES, reason="shared dev traces are absent")


def _method_or_skip(spec):
    try:
        return make_method(spec)
    except ImportError as exc:
        pytest.skip(str(exc).splitlines()[0])


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACES[BENCH_TRACE])


@pytest.fixture(scope="module")
def baselines(trace):
    return {batch: replay(trace, make_method("none"), batch) for batch in (1, 32)}


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("spec,profile", CASES, ids=[s if p is None else f"{s}@{p}" for s, p in CASES])
def test_replay(benchmark, sim_rows, trace, baselines, spec, profile, batch):
    _method_or_skip(spec)
    bound = get_profile(profile) if profile else None
    runs = []

    def one_replay():
        runs.append(replay(trace, make_method(spec), batch, bound))

    benchmark.pedantic(one_replay, rounds=ROUNDS, iterations=1)
    run = runs[-1]
    profiles = [profile] if profile else list(BUILTIN_PROFILES)
    rows = {p: summarize(run, get_profile(p), baselines[batch]) for p in profiles}
    first = rows[profiles[0]]
    info = {
        "trace": trace.name, "method": spec if profile is None else f"{spec} @{profile}", "batch": batch,
        "tokens": run.tokens, "rounds": ROUNDS,
        "accept_len": first["accept_len"], "drafted_per_step": first["drafted_per_step"],
        "accept_rate": first["accept_rate"], "proposer_us_per_token": first["proposer_us_per_token"],
        "replay_tokens_per_s": run.tokens / run.replay_s,
        **{f"speedup_{p}": rows[p]["speedup"] for p in profiles},
    }
    benchmark.extra_info.update(info)
    sim_rows.append(info)
    assert run.tokens == trace.output_tokens
    # every round replays the same trace deterministically: the same accepted tokens each time
    assert len({(r.steps, r.accepted) for r in runs}) == 1
