"""Our replay of each anchor reproduces `shared/ANCHORS.md` on the small agent trace.

The figures are read from ANCHORS.md itself; each anchor needs its real package (sglang 0.5.23,
arctic-inference 0.3.0), else it is skipped, as is everything when the shared data is absent.
"""
from __future__ import annotations

import importlib.util
import re

import pytest

from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import data_dir, load_trace

TRACE = "agent_swe_gpt4_dev"

LABELS = [  # ANCHORS.md method label -> (our method spec, package it needs)
    (r"SGLang NgramCorpus (BFS|PROB), D=(\d+)", lambda m: f"sglang-ngram:d={m[2]},match={m[1]}", "sglang"),
    (r"Arctic suffix, (path|tree), k=(\d+)", lambda m: f"arctic-suffix:k={m[2]},tree={int(m[1] == 'tree')}",
     "arctic_inference"),
    (r"prompt lookup \(vLLM rule, n (\d+)-(\d+)\), k=(\d+)", lambda m: f"prompt-lookup:k={m[3]},min={m[1]},max={m[2]}",
     None),
    (r"perfect drafter, k=(\d+)", lambda m: f"oracle:k={m[1]}", None),
]


def anchor_spec(label: str):
    for pattern, spec, package in LABELS:
        match = re.match(pattern, label)
        if match:
            return spec(match), package
    raise ValueError(f"no method for anchor label {label!r}")


def anchor_rows(trace: str) -> list[dict]:
    """The ANCHORS.md table rows of `trace`."""
    root = data_dir()
    path = root / "ANCHORS.md" if root else None
    if path is None or not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] == trace:
            rows.append({"label": cells[1], "steps": int(cells[2]), "accept_len": float(cells[3]),
                         "drafted_per_step": float(cells[4]), "mean_width": float(cells[5]),
                         "speedup": float(cells[6])})
    return rows


ROWS = anchor_rows(TRACE)


@pytest.mark.skipif(not ROWS, reason="shared/ANCHORS.md or the dev traces are absent")
@pytest.mark.parametrize("anchor", ROWS, ids=[r["label"] for r in ROWS])
def test_anchor_is_reproduced(anchor):
    spec, package = anchor_spec(anchor["label"])
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    trace = load_trace(data_dir() / "traces" / f"{TRACE}.jsonl.gz")
    run = replay(trace, make_method(spec))
    baseline = replay(trace, make_method("none"))
    row = summarize(run, get_profile("seed-pcie8"), baseline)
    assert row["steps"] == anchor["steps"]
    assert round(row["accept_len"], 3) == anchor["accept_len"]
    assert round(row["drafted_per_step"], 2) == anchor["drafted_per_step"]
    assert round(row["mean_width"], 2) == anchor["mean_width"]
    assert round(row["speedup"], 3) == anchor["speedup"]
