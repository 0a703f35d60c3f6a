"""Replay benchmarks on the dev traces: `pytest bench/ --benchmark-only`.

Each benchmark times one full replay of a trace by a method (batch 1 and 32); `extra_info` holds the
acceptance figures (accept_len, drafted_per_step, accept_rate), the speedup under each built-in profile,
the method's own proposer latency per token and the replay speed. Skips cleanly without `../shared/traces`
or without a method's package.
"""
from __future__ import annotations

import pytest

from ngramspec.methods import make_method
from ngramspec.profiles import BUILTIN_PROFILES, get_profile
from ngramspec.simulate import replay, summarize
from ngramspec.traces import dev_trace_paths, load_trace

TRACES = {p.name.split(".")[0]: p for p in dev_trace_paths()}
BENCH_TRACE = "mtbench_vicuna7b"  # the smallest multi-request trace: fast enough to run every method
METHODS = ["none", "prompt-lookup:k=8", "oracle:k=8", "ngramspec-chain:k=8", "ngramspec-tree:k=8",
           "sglang-ngram:d=9", "sglang-ngram", "arctic-suffix:k=8", "arctic-suffix:k=8,tree=1"]

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
@pytest.mark.parametrize("spec", METHODS)
def test_replay(benchmark, trace, baselines, spec, batch):
    _method_or_skip(spec)
    run = benchmark.pedantic(lambda: replay(trace, make_method(spec), batch), rounds=1, iterations=1)
    rows = {p: summarize(run, get_profile(p), baselines[batch]) for p in BUILTIN_PROFILES}
    first = rows[BUILTIN_PROFILES[0]]
    benchmark.extra_info.update({
        "trace": trace.name, "method": spec, "batch": batch, "tokens": run.tokens,
        "accept_len": first["accept_len"], "drafted_per_step": first["drafted_per_step"],
        "accept_rate": first["accept_rate"], "proposer_us_per_token": first["proposer_us_per_token"],
        "replay_tokens_per_s": run.tokens / run.replay_s,
        **{f"speedup_{p}": rows[p]["speedup"] for p in BUILTIN_PROFILES},
    })
    assert run.tokens == trace.output_tokens
