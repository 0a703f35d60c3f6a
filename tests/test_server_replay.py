"""scripts/server_replay.py on a small synthetic sglang_engine_bench.py result: the fitted profile, the replay."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from script_module import load_script

from ngramspec.sim.profiles import get_profile

RUNS = ("copy/c1", "free/c1", "copy/c16", "free/c16")
WIDTHS = (2, 3, 4, 6, 8, 12, 16)


@pytest.fixture(scope="module")
def sr():
    return load_script("server_replay")


def cost(batch: int, width: int) -> float:
    """Made-up step time: decode 5 ms + 0.05 ms per request, a verify 1 ms + 0.3 ms per token more."""
    ms = 5.0 + 0.05 * batch
    return ms if width == 1 else ms + 1.0 + 0.3 * width * (1 + batch / 16)


def synthetic_bench(n_prompts: int = 4, out_len: int = 48, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompts, outputs = {}, {}
    for set_name in ("copy", "free"):
        ps, os_ = [], []
        for i in range(n_prompts):
            phrase = rng.integers(100, 5000, size=12).tolist()
            prompt = [1, 2] + phrase * 3  # repetitive prompt
            if set_name == "copy":  # the output repeats the prompt's phrase
                out = (phrase * 8)[: out_len - i]
            else:  # free text: fresh tokens, a little repetition
                out = (rng.integers(100, 5000, size=out_len // 2).tolist() * 2)[: out_len - i]
            ps.append(prompt)
            os_.append(out)
        prompts[set_name], outputs[set_name] = ps, os_

    def run(key, tok_s, accept=None, durations=None, mean_width=None, period=None):
        set_name, conc = key.split("/")
        toks = sum(len(o) for o in outputs[set_name])
        profile = None
        if durations is not None:
            profile = {"mean_width": mean_width, "mean_batch": None,
                       "controller": {"durations": durations}}
        return {"tok_s": tok_s, "tokens": toks, "seconds": round(toks / tok_s, 3), "accept_len": accept,
                "output_ids": outputs[set_name], "profile": profile,
                "scheduler": {"decode_steps": toks, "period_ms": period} if period else None}

    def result(name, runs):
        return {"config": name, "runs": runs, "prompt_ids": prompts,
                "warm_prompt_ids": {"free": [[1, 2, 3]], "copy": [[1, 2, 4]]}}

    plain = {k: run(k, 190.0 if k.endswith("c1") else 700.0, period=cost(1 if k.endswith("c1") else 16, 1))
             for k in RUNS}
    plain["copy/c16"]["scheduler"]["period_ms"] = cost(3, 1)  # the c16 run's mean batch (4 prompts)
    plain["free/c16"]["scheduler"]["period_ms"] = cost(3, 1)

    def durations(batches):
        return {f"{w}/{b}": {"n": 10, "mean_ms": cost(b, w), "min_ms": 0, "max_ms": 0}
                for w in WIDTHS for b in batches}

    sweep = {k: run(k, 100.0, 2.0, durations([1] if k.endswith("c1") else [4, 16]), 6.0) for k in RUNS}
    speedups = {"copy/c1": 2.1, "free/c1": 1.2, "copy/c16": 1.6, "free/c16": 1.05}  # made up
    adaptive = {k: run(k, speedups[k] * plain[k]["tok_s"], 3.0,
                       {"1/1": {"n": 5, "mean_ms": 5.0, "min_ms": 0, "max_ms": 0}}, 3.0) for k in RUNS}
    return {"plain": result("plain", plain), "adaptive": result("adaptive", adaptive),
            "ngram": result("ngram", {k: run(k, 0.9 * speedups[k] * plain[k]["tok_s"], 2.5) for k in RUNS}),
            "adaptive_sweep": result("adaptive_sweep", sweep)}


def write_bench(tmp_path: Path) -> tuple[Path, Path]:
    bench = synthetic_bench()
    sweep = {"adaptive_sweep": bench.pop("adaptive_sweep")}
    main, second = tmp_path / "bench.json", tmp_path / "sweep.json"
    main.write_text(json.dumps(bench))
    second.write_text(json.dumps(sweep))
    return main, second


def test_fitted_profile_loads_and_keeps_the_measured_costs(sr, tmp_path):
    main, second = write_bench(tmp_path)
    bench = sr.load_bench([str(main), str(second)])
    data, notes = sr.fit_profile(bench)
    out = tmp_path / "fit.json"
    out.write_text(json.dumps(data))
    profile = get_profile(str(out))  # the loader behind `--profile FILE.json`
    assert profile.cost_ms(1, 1) == pytest.approx(cost(1, 1), abs=1e-3)  # plain c1 scheduler period
    assert profile.cost_ms(1, 4) == pytest.approx(cost(1, 4), abs=1e-3)  # the sweep at batch 1
    assert profile.cost_ms(16, 8) == pytest.approx(cost(16, 8), abs=1e-3)  # the sweep at batch 16
    # plain c16's period sits at the run's mean batch (from its outputs: 4 prompts of 45-48 tokens -> B=4)
    rows = {(r["B"], r["k"]): r for r in data["rows"]}
    assert rows[(4, 1)]["graph_ms"] == pytest.approx(cost(3, 1), abs=1e-3)
    assert "filled" not in rows[(4, 1)]
    assert "filled" in rows[(16, 1)]  # no plain run at batch 16: copied from the nearest measured batch
    assert {r["k"] for r in data["rows"]} == {1, *WIDTHS}
    assert data["description"] and data["source"]
    assert any("filled" in n for n in notes)


def test_fixed_width_configs_measure_their_width_at_batch_1(sr, tmp_path):
    """SGLang's NGRAM verifies 12 tokens every step: its c1 scheduler periods are measured cells at (1, 12), merged
    with the sweep's by sample count; its c16 periods (batch unknown) and --no-fixed-width leave the profile alone."""
    main, second = write_bench(tmp_path)
    bench = sr.load_bench([str(main), str(second)])
    before = {(r["B"], r["k"]): r for r in sr.fit_profile(bench)[0]["rows"]}
    ngram = bench["ngram"]["runs"]
    for key in RUNS:
        ngram[key]["scheduler"] = {"decode_steps": 30, "period_ms": 40.0}
    sweep_n = sum(10 for k in RUNS if k.endswith("c1"))  # the sweep's (1, 12) samples
    rows = {(r["B"], r["k"]): r for r in sr.fit_profile(bench)[0]["rows"]}
    expect = (sweep_n * cost(1, 12) + 2 * 30 * 40.0) / (sweep_n + 60)
    assert rows[(1, 12)]["graph_ms"] == pytest.approx(expect, abs=1e-3)
    assert "ngram copy/c1 scheduler.period_ms" in rows[(1, 12)]["source"]
    assert rows[(16, 12)]["graph_ms"] == before[(16, 12)]["graph_ms"]  # c16 periods not used
    assert rows[(1, 8)]["graph_ms"] == before[(1, 8)]["graph_ms"]  # no ngram8 config in this bench
    off = {(r["B"], r["k"]): r for r in sr.fit_profile(bench, fixed_width={})[0]["rows"]}
    assert off[(1, 12)]["graph_ms"] == before[(1, 12)]["graph_ms"]


def test_replay_rows(sr, tmp_path):
    main, second = write_bench(tmp_path)
    bench = sr.load_bench([str(main), str(second)])
    data, _ = sr.fit_profile(bench)
    rows, checks, skipped = sr.replay_runs(bench, sr.profile_from_data(data), {"adaptive": "ngramspec-adaptive"})
    assert [r["run"] for r in rows] == list(RUNS)
    assert [r["batch"] for r in rows] == [1, 1, 16, 16]
    for r in rows:
        assert math.isfinite(r["predicted_speedup"]) and r["predicted_speedup"] > 0
        assert r["measured_speedup"] == pytest.approx(bench["adaptive"]["runs"][r["run"]]["tok_s"]
                                                      / bench["plain"]["runs"][r["run"]]["tok_s"])
        assert r["ratio"] == pytest.approx(r["predicted_speedup"] / r["measured_speedup"])
    copy = {r["run"]: r for r in rows}
    assert copy["copy/c1"]["predicted_accept_len"] > 1.5  # the copy set repeats its prompt's phrase
    assert [c["run"] for c in checks] == list(RUNS) and not skipped
    cold, _, _ = sr.replay_runs(bench, sr.profile_from_data(data), {"adaptive": "ngramspec-adaptive"}, carry=False)
    # the c16 runs regenerate the c1 prompts: with the state carried over the cache already holds their outputs
    assert copy["copy/c16"]["predicted_accept_len"] > cold[2]["predicted_accept_len"]
    assert not cold[0]["carried_state"] and copy["copy/c1"]["carried_state"]


def test_time_outside_decode_steps_comes_from_the_servers_profile(sr, tmp_path):
    """Plain decoding's wall clock less its decode steps x their mean period is the time outside decode steps
    (prefill, the host between requests); `+outside` adds it to both sides of every replayed speedup. Without a
    scheduler profile the replay's own residual stands in."""
    main, second = write_bench(tmp_path)
    bench = sr.load_bench([str(main), str(second)])
    run = bench["plain"]["runs"]["copy/c1"]
    run["seconds"] = run["scheduler"]["decode_steps"] * run["scheduler"]["period_ms"] / 1e3 + 0.5
    bench["plain"]["runs"]["free/c1"]["scheduler"] = None
    data, _ = sr.fit_profile(bench)
    rows, checks, _ = sr.replay_runs(bench, sr.profile_from_data(data), {"adaptive": "ngramspec-adaptive"})
    check = {c["run"]: c for c in checks}
    assert check["copy/c1"]["plain_outside_s"] == pytest.approx(0.5, abs=1e-6)
    free = check["free/c1"]
    assert free["plain_outside_s"] == pytest.approx(free["plain_measured_s"] - free["plain_predicted_s"])
    row = next(r for r in rows if r["run"] == "copy/c1")
    pred_plain, pred_method = check["copy/c1"]["plain_predicted_s"], row["predicted_s"]
    assert row["predicted_speedup_with_outside"] == pytest.approx((pred_plain + 0.5) / (pred_method + 0.5))
    assert 1.0 < row["predicted_speedup_with_outside"] < row["predicted_speedup"]  # time both sides share


def test_main(sr, tmp_path, capsys):
    main, second = write_bench(tmp_path)
    fit, rows_json = tmp_path / "fit.json", tmp_path / "rows.json"
    assert sr.main([str(main), str(second), "--fit-profile", str(fit), "--json", str(rows_json)]) == 0
    text = capsys.readouterr().out
    assert "copy/c16" in text and "pred/meas" in text
    out = json.loads(rows_json.read_text())
    runs = {(r["config"], r["run"]) for r in out["rows"]}
    assert {("adaptive", k) for k in RUNS} <= runs
    assert get_profile(str(fit)).cost_ms(16, 16) == pytest.approx(cost(16, 16), abs=1e-3)
    try:  # SGLang's NGRAM needs the real sglang package: a row per run, or a line saying why it was skipped
        import sglang  # noqa: F401
        assert {("ngram", k) for k in RUNS} <= runs
    except ImportError:
        assert [s["config"] for s in out["skipped"]] == ["ngram"]
        assert "skipped ngram" in text


def test_errors(sr, tmp_path):
    main, _ = write_bench(tmp_path)  # no sweep config in it
    assert sr.main([str(main)]) == 2


def test_an_unmeasured_width_grows_with_the_batch_as_a_measured_one(sr, tmp_path):
    """A width measured only at batch 1 is filled at batch 16 from a width measured there, scaled by the two widths'
    ratio at batch 1 (not copied from batch 1, which would make it as cheap at batch 16 as at batch 1)."""
    bench = synthetic_bench()
    sweep = bench["adaptive_sweep"]
    for key, run in sweep["runs"].items():  # width 12 only at batch 1; width 16 at batches 1 and 16
        durations = run["profile"]["controller"]["durations"]
        for wb in list(durations):
            w, b = map(int, wb.split("/"))
            if w not in (12, 16) or (w == 12 and b != 1):
                del durations[wb]
    data, notes = sr.fit_profile(bench)
    rows = {(r["B"], r["k"]): r for r in data["rows"]}
    assert "filled" not in rows[(16, 16)] and "filled" in rows[(16, 12)]
    expected = cost(16, 16) * cost(1, 12) / cost(1, 16)
    assert rows[(16, 12)]["graph_ms"] == pytest.approx(expected, rel=1e-3)
    assert rows[(16, 12)]["graph_ms"] > 1.4 * rows[(1, 12)]["graph_ms"]  # the copy would be 1.0x
    assert "ratio" in rows[(16, 12)]["filled"]
    assert "filled" in rows[(16, 1)] and "ratio" not in rows[(16, 1)]["filled"]  # width 1: along the batch axis


def test_an_unmeasured_width_lies_between_the_widths_measured_at_its_batch(sr):
    """Batch 1 measured widths 1, 8, 12 and 16 (16 a little below 12: noise), batch 4 widths 6, 8 and 12: width 6 at
    batch 1 is interpolated between widths 1 and 8 there (a ratio from batch 4, where width 6 is relatively dear,
    would put it above width 8); width 16 at batch 4, scaled from width 12 by their ratio at batch 1, would cost less
    than width 12 there, and is held at width 12's cost."""
    bench = synthetic_bench()
    measured = {(1, 8): 10.0, (1, 12): 11.0, (1, 16): 10.5, (4, 6): 12.0, (4, 8): 12.5, (4, 12): 13.0}
    for run in bench["adaptive_sweep"]["runs"].values():
        durations = run["profile"]["controller"]["durations"]
        durations.clear()
        durations.update({f"{w}/{b}": {"n": 10, "mean_ms": ms, "min_ms": 0, "max_ms": 0}
                          for (b, w), ms in measured.items()})
    data, _ = sr.fit_profile(bench)
    rows = {(r["B"], r["k"]): r for r in data["rows"]}
    w1 = rows[(1, 1)]["graph_ms"]
    assert rows[(1, 6)]["graph_ms"] == pytest.approx(w1 + (10.0 - w1) * 5 / 7, rel=1e-3)
    assert "linear between widths 1 and 8" in rows[(1, 6)]["filled"]
    assert rows[(4, 16)]["graph_ms"] == 13.0 and "bounded" in rows[(4, 16)]["filled"]  # the ratio: 12.4
    costs = [rows[(4, w)]["graph_ms"] for w in sorted(w for b, w in rows if b == 4)]
    assert costs == sorted(costs)  # never cheaper for a wider verify at one batch


def test_a_flush_empties_the_caches_and_keeps_what_the_controller_learned(sr):
    """At a cache flush the plugin builds a new planner (empty n-gram caches) whose controller starts from the old
    one's learned state; the replay does the same where the server flushed before a concurrency level."""
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay
    from ngramspec.sim.traces import make_trace

    phrase = list(range(100, 112))
    trace = make_trace("t", [{"prompt": [1, 2] + phrase * 3, "output": phrase * 6} for _ in range(3)])
    method = make_method("ngramspec-adaptive")
    replay(trace, method, 1, get_profile("h200-llama8b"))
    learned = method.ctl.state_dict()
    assert method.cache.count(phrase[:4], source="shared") > 0  # the finished outputs are in the shared cache
    after = sr.after_flush(method, "ngramspec-adaptive")
    assert after is not method and after.cache.count(phrase[:4], source="shared") == 0
    kept, cold = after.ctl.state_dict(), make_method("ngramspec-adaptive").ctl.state_dict()

    def same(a, b):
        return np.array_equal(a, b, equal_nan=a.dtype.kind == "f")

    assert kept.keys() == learned.keys()
    assert all(same(kept[k], learned[k]) for k in learned)
    assert not all(same(cold[k], learned[k]) for k in learned)  # it learned something: the check has teeth
    # a method without a controller (SGLang's NGRAM, prompt lookup) just starts again
    assert sr.after_flush(make_method("prompt-lookup"), "prompt-lookup").name == "prompt-lookup"
