"""`scripts/sglang_engine_bench.py --repeats`: the sets at concurrency > 1 timed again, each from a flushed and
re-warmed server, on a stand-in for `sglang.Engine` (the script's flow on the CPU, before a GPU call depends on it)."""
import importlib.util
import json
import statistics
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sglang_engine_bench.py"


class FakeEngine:
    """Answers every prompt with 8 tokens in 4 verify steps; records the calls."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(("generate", len(prompts) if isinstance(prompts, list) else 1))
        one = {"text": "x", "output_ids": list(range(8)), "meta_info": {"completion_tokens": 8, "spec_verify_ct": 4}}
        return [dict(one) for _ in prompts] if isinstance(prompts, list) else one

    def flush_cache(self):
        self.calls.append(("flush", 0))

    def shutdown(self):
        self.calls.append(("shutdown", 0))


@pytest.fixture
def bench(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("sglang_engine_bench_repeats", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    engines = []

    def make(**kwargs):
        engines.append(FakeEngine(**kwargs))
        return engines[-1]

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=make))
    monkeypatch.setattr(module, "chat_prompts", lambda model, prompts, pre=0: list(prompts))
    monkeypatch.setattr(module, "prompt_ids", lambda model, sets: {k: [[1]] * len(v) for k, v in sets.items()})
    monkeypatch.setattr(module, "triton_kernels", set)
    monkeypatch.setattr(module.time, "sleep", lambda s: None)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for key in ("NGRAMSPEC_PROFILE", "NGRAMSPEC_SCHED_PROFILE"):  # run_one sets them: restored after the test
        monkeypatch.setenv(key, "")
    return module, engines


def args(repeats):
    return SimpleNamespace(model="m", dtype="float16", extra="", kernel_profile=0, sched_profile=False, tp=1,
                           concurrency=[1, 4], max_new_tokens=8, preamble_tokens=0, prompts_per_set=3, warm_prompts=2,
                           no_flush=False, retry_compiled=1, warmup=1, repeats=repeats)


def test_each_set_at_concurrency_above_one_is_timed_again_from_a_flushed_warm_server(bench):
    module, engines = bench
    out = module.run_one("plain", args(3))
    calls = engines[0].calls
    for key, run in out["runs"].items():
        if key.endswith("/c1"):
            assert "tok_s_repeats" not in run
        else:
            assert len(run["tok_s_repeats"]) == 3 and run["tok_s_repeats"][0] == run["tok_s"]
            assert run["accept_len_repeats"] == [2.0, 2.0, 2.0]
            assert run["new_triton_kernels_repeats"] == [[], [], []]
            assert run["period_ms_repeats"] == [None, None, None]  # no scheduler profile asked for
    # one flush between the levels, then two per c4 set before its repeats; each repeat re-warms (2 batches) first
    assert sum(1 for c in calls if c[0] == "flush") == 1 + 2 * 2
    flushes = [i for i, c in enumerate(calls) if c[0] == "flush"][1:]
    assert all(calls[i + 1] == ("generate", 2) and calls[i + 2] == ("generate", 2) and calls[i + 3] == ("generate", 3)
               for i in flushes)


def test_one_pass_by_default(bench):
    module, engines = bench
    out = module.run_one("plain", args(1))
    assert all("tok_s_repeats" not in run for run in out["runs"].values())
    assert sum(1 for c in engines[0].calls if c[0] == "flush") == 1


def test_the_summary_prints_each_pass_and_the_medians_ratio(bench, monkeypatch, tmp_path, capsys):
    module, engines = bench
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--model", "m", "--out", str(out), "--configs", "plain,adaptive",
                                      "--concurrency", "1", "4", "--prompts-per-set", "3", "--repeats", "2"])
    monkeypatch.setattr(module, "run_child", lambda script, name, timeout, logs: module.run_one(name, module.a_seen))
    real_parse = module.argparse.ArgumentParser.parse_args

    def parse(self, *a, **k):
        module.a_seen = real_parse(self, *a, **k)
        return module.a_seen

    monkeypatch.setattr(module.argparse.ArgumentParser, "parse_args", parse)
    assert module.main() == 0
    text = capsys.readouterr().out
    assert "repeated sets" in text
    lines = [line for line in text.splitlines() if line.startswith("adaptive") and "x plain" in line]
    res = json.loads(out.read_text())
    assert len(lines) == 2
    for line in lines:
        run = line.split()[1]
        want = (statistics.median(res["adaptive"]["runs"][run]["tok_s_repeats"])
                / statistics.median(res["plain"]["runs"][run]["tok_s_repeats"]))
        assert float(line.split()[-1]) == pytest.approx(want, abs=6e-4)


def test_a_kernel_built_during_a_repeat_pass_is_recorded_with_that_pass(bench, monkeypatch):
    module, engines = bench
    built = set()
    monkeypatch.setattr(module, "triton_kernels", lambda: set(built))
    monkeypatch.setattr(module, "triton_entry", lambda entry: str(entry))
    real_timed = module.timed_run
    timed = []

    def timed_run(*a, **k):
        timed.append(1)
        if len(timed) == 5:  # c1: copy, free; c4: copy and its two repeats -> the last repeat of copy/c4
            built.add("_fwd_kernel")
        return real_timed(*a, **k)

    monkeypatch.setattr(module, "timed_run", timed_run)
    out = module.run_one("plain", args(3))
    assert out["runs"]["copy/c4"]["new_triton_kernels_repeats"] == [[], [], ["_fwd_kernel"]]
    assert out["runs"]["free/c4"]["new_triton_kernels_repeats"] == [[], [], []]


def test_summary_prints_the_tables_of_a_saved_run_without_a_model(bench, monkeypatch, tmp_path, capsys):
    module, engines = bench
    res = {name: module.run_one(name, args(2)) for name in ("plain", "adaptive")}
    out = tmp_path / "cut.json"
    out.write_text(json.dumps(res))
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(out), "--summary"])
    assert module.main() == 0
    text = capsys.readouterr().out
    # four sets, two repeated sets, the host probe
    assert "repeated sets" in text and len([ln for ln in text.splitlines() if ln.startswith("adaptive ")]) == 7
    assert not engines[2:]  # no engine started
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(out)])
    with pytest.raises(SystemExit):
        module.main()  # without --summary a model is needed


def test_drafting_steps_compare_the_expectation_with_the_tokens_committed_on_the_same_steps(bench):
    module, _ = bench
    ctl = {"expected_tokens_per_request": 2.0,
           "sources": {"accepted_ngram_per_request": 0.5, "accepted_recycled_per_request": 0.25}}
    assert module.drafting_steps(ctl) == (2.0, 1.75)  # bonus token + accepted draft tokens of both sources
    assert module.drafting_steps({"expected_tokens_per_request": None, "sources": None}) is None  # no drafting step
    assert module.drafting_steps({"expected_tokens_per_request": 2.0, "sources": {}}) is None


def test_each_timed_set_records_a_host_probe_and_the_summary_gives_each_configs_spread(bench, monkeypatch, capsys):
    """A slow host shows as a slower probe beside the figures, so a slower run is not read as a slower version."""
    module, _ = bench
    assert module.host_probe(reps=3, n=1000) > 0.0
    readings = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0])
    monkeypatch.setattr(module, "host_probe", lambda: next(readings))
    res = {"plain": module.run_one("plain", args(2)), "adaptive": module.run_one("adaptive", args(2))}
    runs = res["plain"]["runs"]
    assert [runs[k]["host_probe_ms"] for k in ("copy/c1", "free/c1")] == [1.0, 2.0]
    assert runs["copy/c4"]["host_probe_ms_repeats"] == [3.0, 4.0] and runs["copy/c4"]["host_probe_ms"] == 3.0
    assert runs["free/c4"]["host_probe_ms_repeats"] == [5.0, 6.0]
    module.print_summary(res)
    text = capsys.readouterr().out
    assert "host probe" in text
    plain = [ln for ln in text.splitlines() if ln.startswith("plain ") and "median" in ln]
    adaptive = [ln for ln in text.splitlines() if ln.startswith("adaptive ") and "median" in ln]
    assert plain[0].split()[1:7] == ["median", "3.500", "min", "1.000", "max", "6.000"] and "(6 sets)" in plain[0]
    assert adaptive[0].split()[1:7] == ["median", "9.000", "min", "9.000", "max", "9.000"]


def test_a_config_past_its_limit_keeps_the_sets_it_finished(bench, tmp_path, monkeypatch):
    """A configuration cut by its limit (a cold machine's slow start) gives back the sets it had timed: the child
    prints its result so far after each set, and `run_child` keeps the last one, marked with the timeout."""
    module, _ = bench
    out = module.run_one("plain", args(1))  # the child prints PARTIAL after each set, the last one whole
    (tmp_path / "so_far.json").write_text(json.dumps(out))
    child = tmp_path / "child.py"
    child.write_text("import json, time\n"
                     "print('PARTIAL ' + json.dumps({'config': 'plain', 'runs': {}}), flush=True)\n"
                     f"print('PARTIAL ' + open({str(tmp_path / 'so_far.json')!r}).read(), flush=True)\n"
                     "time.sleep(60)\n")
    monkeypatch.setattr(sys, "argv", ["bench"])
    res = module.run_child(str(child), "plain", timeout=3, logs=None, grace=1)
    assert res["error"] == "timeout 3s" and res["runs"] == out["runs"] and res["wall_s"] < 30
    child.write_text("import time\ntime.sleep(60)\n")  # nothing finished: the error alone, as before
    res = module.run_child(str(child), "plain", timeout=2, logs=None, grace=1)
    assert res["error"] == "timeout 2s" and "runs" not in res


def test_run_one_prints_its_result_so_far_after_each_set(bench, capsys):
    module, _ = bench
    out = module.run_one("plain", args(1))
    partial = [json.loads(line[8:]) for line in capsys.readouterr().out.splitlines() if line.startswith("PARTIAL ")]
    assert [list(p["runs"]) for p in partial] == [["copy/c1"], ["copy/c1", "free/c1"],
                                                   ["copy/c1", "free/c1", "copy/c4"], list(out["runs"])]
    assert partial[-1]["runs"] == json.loads(json.dumps(out["runs"]))
