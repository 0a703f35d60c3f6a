"""Drafting on the device (`device_drafts`) in a replay of the SGLang worker's step protocol, one request at a time.

    .venv-sglang/bin/python -m pytest bench/test_bench_device_drafts.py --benchmark-only -s

The protocol of `tests/integration/test_worker_protocol.py` (plan on the tokens the host has; wait for the exact
ones only around drafting steps) through the real `DraftPlanner` and controller, greedy verification against each
trace's recorded output. With ``device_drafts`` N, up to N steps in a row right after a drafting step draft on the
device instead: a chain from prompt lookup over the request's own tokens (`lookup_reference`, the host twin of the
device kernel) at the last drafting width, then one step plans on the host again.

What it measures is acceptance: tokens per drafting step, host-planned and device-drafted apart, on real traces.
The speed column applies an assumed clock, not a measured one (an 8B model's step on one H200, from the
production-cost measurements: plain decode 4.6 ms; a drafting step that waits for the previous step's tokens on
the host 7.5 ms + 0.03 ms per verified token; one that does not wait, the target of removing the wait, 1.1x a
decode step + 0.03 ms per token). The server's figure comes from a GPU run, not from this.
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from ngramspec.layout import accepted_path  # noqa: E402
from ngramspec_sglang.config import AdaptiveConfig  # noqa: E402
from ngramspec_sglang.device_drafts import lookup_reference  # noqa: E402
from ngramspec_sglang.drafting import DraftPlanner, RequestView  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACES = ("agent_swe_gpt4_dev", "chat_gpt4", "reasoning_o3mini")
REQUESTS = 60
PLAIN_MS = 4.6


def host_ms(width: int) -> float:
    return 7.5 + 0.03 * width


def device_ms(width: int) -> float:
    return 1.1 * PLAIN_MS + 0.03 * width


def parents(mask, k: int) -> list[int]:
    out = []
    for i in range(1, k + 1):
        anc = [j for j in range(1, i) if mask[i, j]]
        out.append(anc[-1] - 1 if anc else -1)
    return out


def serve(requests, device_drafts: int) -> dict:
    planner = DraftPlanner(AdaptiveConfig(widths=(1, 2, 3, 4, 6, 8, 12, 16), capacity=1 << 22))
    c = dict(time_ms=0.0, tokens=0, steps=0, host_steps=0, host_tokens=0, device_steps=0, device_tokens=0,
             plain_steps=0)
    drafted_last, last_width, streak = False, None, 0
    for rid, (prompt, truth) in enumerate(requests):
        output, pending = [], []
        while len(output) + len(pending) < len(truth):
            if drafted_last and streak < device_drafts and last_width:
                committed = prompt + output + pending
                drafts, _ = lookup_reference(committed, last_width - 1)
                upcoming = truth[len(output) + len(pending):]
                n = 1
                while n - 1 < len(drafts) and n - 1 < len(upcoming) and drafts[n - 1] == upcoming[n - 1]:
                    n += 1
                planner.forget_outcomes([rid])
                output = output + list(pending)
                pending = truth[len(output):len(output) + n]
                ms = device_ms(last_width)
                c["device_steps"] += 1
                c["device_tokens"] += len(pending)
                planner.record_duration(last_width, 1, ms / 1000.0)
                streak += 1
            else:
                streak = 0
                behind = not drafted_last
                plan = planner.plan([RequestView(rid, prompt, output, () if behind else pending)])
                if behind and plan.width > 1:
                    plan = planner.plan([RequestView(rid, prompt, output, pending)])
                output = output + list(pending)
                if plan.width > 1:
                    k = int(plan.drafted[0])
                    n = 1 + len(accepted_path(plan.tokens[0, 1:1 + k], parents(plan.mask[0], k),
                                              truth[len(output):]))
                    ms = host_ms(plan.width)
                    last_width = plan.width
                    c["host_steps"] += 1
                    c["host_tokens"] += min(n, len(truth) - len(output))
                else:
                    n, ms = 1, PLAIN_MS
                    c["plain_steps"] += 1
                pending = truth[len(output):len(output) + n]
                planner.record_duration(plan.width, 1, ms / 1000.0)
                drafted_last = plan.width > 1
            c["time_ms"] += ms
            c["tokens"] += len(pending)
            c["steps"] += 1  # (a device step drafted: `drafted_last` stays true)
        planner.release([rid])
    return {"speed_vs_plain": round(c["tokens"] / c["time_ms"] * PLAIN_MS, 3),
            "tokens_per_host_drafting_step": round(c["host_tokens"] / max(1, c["host_steps"]), 3),
            "tokens_per_device_step": round(c["device_tokens"] / max(1, c["device_steps"]), 3),
            "device_step_share": round(c["device_steps"] / c["steps"], 3),
            "drafting_step_share": round((c["host_steps"] + c["device_steps"]) / c["steps"], 3),
            "steps": c["steps"]}


@pytest.mark.parametrize("trace", TRACES)
def test_device_drafts_in_the_worker_protocol(benchmark, trace):
    path = SHARED / f"{trace}.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    with gzip.open(path, "rt") as f:
        requests = [(r["prompt"], r["output"]) for _, r in zip(range(REQUESTS), map(json.loads, f))]
    results = {}

    def run():
        for n in (0, 1, 3):
            results[f"device_drafts_{n}"] = serve(requests, n)
    benchmark.pedantic(run, rounds=1, iterations=1)
    print(f"\n{trace} ({len(requests)} requests, assumed 8B-H200 clock)")
    for name, r in results.items():
        print(f"  {name}: {r}")
        for key, value in r.items():
            benchmark.extra_info[f"{name}_{key}"] = value
    for r in results.values():  # a replay of every token of every request, whatever the option
        assert r["steps"] > 0
