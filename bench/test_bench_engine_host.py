"""Host time of the real-model engine's decode loop per step, with the model taken out.

    .venv/bin/python -m pytest bench/test_bench_engine_host.py --benchmark-only -s

`SpecDecoder.generate` runs its whole loop (drafts and plan, verify layout, greedy walk, bookkeeping, step
records) against a stand-in verifier that returns the recorded greedy output of an MT-bench trace (Vicuna-7B,
greedy), so every step costs only what the engine's host side costs: on a GPU that time adds to each step,
plain decoding's included. The adaptive policy is told modelled step durations (`STEP_MS`, close to SmolLM2's
steps on an H200 with CUDA graphs), not the host-only times it would measure here, so it drafts as it would on the
GPU. One request at a time, the first 40 requests with at least 32 output tokens, outputs cut to 256 tokens; every
policy in the same process, interleaved, 3 rounds; the figure is the median step, and for the steps that drafted
nothing (width 1) the median of the policy's part (its drafts and plan). Skips without ../shared/traces.

``ENGINE_BENCH_COLD=1``: each verify first writes 8 MB of other data (as the work around a device's forward evicts
the host's caches), then runs what the decoder does while the device works (`AdaptiveController.prefetch`); the
policies are then plain, adaptive and adaptive without that prefetch (``adaptive:prefetch=0``).
"""
from __future__ import annotations

import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ngramspec import NgramCache
from ngramspec.sim.traces import dev_trace_paths, load_trace
from ngramspec.warmup import warm_up

torch = pytest.importorskip("torch")
from ngramspec.engine.decode import SpecDecoder  # noqa: E402
from ngramspec.engine.policy import make_policy  # noqa: E402

TRACES = {p.name.split(".")[0]: p for p in dev_trace_paths()}
TRACE, REQUESTS, CAP, ROUNDS = "mtbench_vicuna7b", 40, 256, 3
COLD = os.environ.get("ENGINE_BENCH_COLD", "0") == "1"
POLICIES = ("plain", "adaptive", "adaptive:prefetch=0") if COLD else ("plain", "tree:k=8", "adaptive")
_EVICT = np.zeros(1 << 20) if COLD else None

pytestmark = pytest.mark.skipif(TRACE not in TRACES, reason=f"trace {TRACE} (../shared/traces) is absent")


class _NoModel:
    """What `SpecDecoder` needs of a `KVModel`, with no model behind it."""

    def __init__(self, max_len: int):
        self.batch, self.max_len = 1, max_len
        self.shape = SimpleNamespace(vocab=1 << 20)
        self.device = torch.device("cpu")

    def move(self, *args) -> None:
        pass


class _RecordedGreedy(SpecDecoder):
    """Predicts, after each row of a verify block, the recorded token at that row's depth."""

    def __init__(self, sequence: np.ndarray):
        super().__init__(_NoModel(len(sequence) + 20))
        self.sequence = sequence

    def _prefill(self, row, tokens) -> None:
        pass

    def _verify(self, tok, depth, anc, length, L) -> np.ndarray:
        if COLD:
            np.add(_EVICT, 1.0, out=_EVICT)
            if self._while_forward is not None:
                fn, *args = self._while_forward
                fn(*args)
        s = self.sequence
        return s[np.minimum(length[:, None] + depth + 1, len(s) - 1)]


def STEP_MS(width: int) -> float:
    """A modelled step duration at ``width`` (ms)."""
    return 4.3 + 0.08 * (width - 1) + (0.5 if width > 1 else 0.0)


def _run(spec: str, requests) -> tuple[list[float], int, list[float]]:
    policy = make_policy(spec)
    if hasattr(policy, "costs"):  # the adaptive policy learns from the modelled durations
        policy.observe_step = lambda batch, width, ms, observe=policy.observe_step: observe(batch, width,
                                                                                            STEP_MS(width))
    cache = NgramCache() if policy else None
    step_us, tokens, plan_us = [], 0, []
    for k, (prompt, output) in enumerate(requests):
        dec = _RecordedGreedy(np.array(prompt + output, np.int64))
        res = dec.generate([prompt], len(output), policy=policy, cache=cache, rids=[k] if policy else None)
        assert res.outputs[0] == output, f"{spec}: request {k} does not reproduce the recorded greedy output"
        step_us += [r.seconds * 1e6 for r in res.records]
        plan_us += [r.plan_seconds * 1e6 for r in res.records if r.width == 1]
        tokens += len(output)
    return step_us, tokens, plan_us


def test_engine_host_time_per_step(benchmark, capsys):
    warm_up()
    trace = load_trace(TRACES[TRACE])
    requests = [(list(map(int, r.prompt)), list(map(int, r.output[:CAP]))) for r in trace.requests
                if len(r.output) >= 32][:REQUESTS]
    _run("adaptive", requests[:2])
    results = {spec: [] for spec in POLICIES}

    def rounds():
        for _ in range(ROUNDS):
            for spec in POLICIES:
                t = time.perf_counter()
                steps, tokens, plans = _run(spec, requests)
                results[spec].append((statistics.median(steps), (time.perf_counter() - t) * 1e6 / tokens,
                                      tokens / len(steps), statistics.median(plans) if plans else 0.0))

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {spec: [statistics.median(x[i] for x in rs) for i in range(4)] for spec, rs in results.items()}
    benchmark.extra_info["cold"] = COLD
    for spec, (step, per_token, accept, plan) in med.items():
        key = spec.replace(":", "_").replace("=", "")
        benchmark.extra_info[f"{key}_us_per_step"] = step
        benchmark.extra_info[f"{key}_us_per_token"] = per_token
        benchmark.extra_info[f"{key}_tokens_per_step"] = accept
        benchmark.extra_info[f"{key}_width1_policy_us"] = plan
    with capsys.disabled():
        print(f"\n{TRACE}, {len(requests)} requests, one at a time: engine host time{' (cold caches)' if COLD else ''}"
              f", median of {ROUNDS} rounds")
        print("| policy | us per step (median) | us per generated token (whole loop) | tokens per step "
              "| width-1 steps: policy us (median) |")
        print("|---|---:|---:|---:|---:|")
        for spec, (step, per_token, accept, plan) in med.items():
            print(f"| {spec} | {step:.1f} | {per_token:.1f} | {accept:.2f} | {plan:.1f} |")
