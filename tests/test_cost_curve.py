"""scripts/cost_curve.py: the step cost by width from a bench result, NGRAM's fixed widths included at batch 1."""
from __future__ import annotations

import pytest
from script_module import load_script
from test_server_replay import cost, synthetic_bench


@pytest.fixture(scope="module")
def cc():
    return load_script("cost_curve")


def test_widths_from_a_config_and_from_ngram_periods(cc):
    bench = synthetic_bench()
    for key, run in bench["ngram"]["runs"].items():  # NGRAM verifies 12 tokens every step
        run["scheduler"] = {"decode_steps": 20, "period_ms": 30.0 if key.endswith("/c1") else 99.0}
    bench["adaptive_sweep"]["runs"]["free/c16"]["profile"]["controller"]["durations"]["1/16"] = {
        "n": 7, "mean_ms": cost(16, 1)}  # plain decoding's step at batch 16: the sweep's width-1 steps there
    rows = cc.table(bench, bench, [1, 16], config="adaptive_sweep")
    at1 = {r["width"]: r for r in rows if r["batch"] == 1}
    assert at1[1]["ms"] == pytest.approx(cost(1, 1))
    assert at1[4]["ms"] == pytest.approx(cost(1, 4)) and at1[4]["source"] == "adaptive_sweep"
    # width 12 at batch 1: the sweep's 20 samples merged with NGRAM's 40 c1 steps (its c16 periods not used)
    assert at1[12]["ms"] == pytest.approx((20 * cost(1, 12) + 40 * 30.0) / 60)
    assert "ngram c1 scheduler period" in at1[12]["source"] and at1[12]["samples"] == 60
    assert at1[12]["x_decode"] == pytest.approx(at1[12]["ms"] / cost(1, 1))
    at16 = {r["width"]: r for r in rows if r["batch"] == 16}
    assert at16[1]["ms"] == pytest.approx(cost(16, 1))
    assert at16[12]["ms"] == pytest.approx(cost(16, 12))
    # another config's durations, and widths with too few samples left out
    only = cc.table(bench, bench, [1], config="adaptive", min_samples=6)
    assert [r["width"] for r in only] == [1, 12] and only[1]["source"] == "ngram c1 scheduler period"
    with pytest.raises(SystemExit):
        cc.table(bench, bench, [1], config="nope")
