"""Replay engine, profiles, traces and CLI on hand-made traces with known answers."""
from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest

from ngramspec.layout import accepted_length
from ngramspec.sim import simulate
from ngramspec.sim.methods import EMPTY_DRAFT, Method, chain, make_method
from ngramspec.sim.profiles import SEED_PCIE8, LinearProfile, TableProfile, get_profile
from ngramspec.sim.simulate import replay, run_all, summarize
from ngramspec.sim.traces import data_dir, load_trace, make_trace

A = list(range(100, 120))  # 20 distinct tokens


def copy_trace():
    """Prompt holds A, a separator, then A's first 3 tokens; the output copies the rest of A."""
    return make_trace("copy", [{"prompt": A + [7] + A[:3], "output": A[3:]}])


def no_repeat_trace(requests=3):
    """Every token distinct across the whole trace: nothing can be predicted from history."""
    rng = np.random.default_rng(0)
    tokens = rng.permutation(10_000)
    records, at = [], 0
    for n in range(requests):
        records.append({"prompt": tokens[at: at + 30].tolist(), "output": tokens[at + 30: at + 60 + n].tolist()})
        at += 60 + n
    return make_trace("norepeat", records)


def repetitive_trace(requests=6, seed=1):
    """Outputs built from a few shared phrases, so n-gram methods get real hits and misses."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 50, size=rng.integers(3, 12)).tolist() for _ in range(8)]
    records = []
    for _ in range(requests):
        prompt = sum((phrases[i] for i in rng.integers(0, 8, size=4)), [])
        output = sum((phrases[i] + [int(rng.integers(50, 60))] for i in rng.integers(0, 8, size=10)), [])
        records.append({"prompt": prompt, "output": output})
    return make_trace("repetitive", records)


# --- verification ------------------------------------------------------------------------------------------

def test_accepted_length_chain_takes_longest_matching_prefix():
    output = np.array([5, 6, 7, 8], dtype=np.int32)
    tokens, parents = chain([6, 7, 9])
    assert accepted_length(tokens, parents, output, 1) == 2
    assert accepted_length(tokens, parents, output, 0) == 0


def test_accepted_length_tree_takes_its_second_branch():
    output = np.array([1, 2, 3, 4], dtype=np.int32)
    tokens = np.array([9, 1, 8, 2, 3], dtype=np.int32)  # branch 1: 9-8; branch 2: 1-2-3
    parents = np.array([-1, -1, 0, 1, 3], dtype=np.int32)
    assert accepted_length(tokens, parents, output, 0) == 3


def test_accepted_length_stops_at_end_of_output():
    output = np.array([1, 2], dtype=np.int32)
    tokens, parents = chain([2, 3])
    assert accepted_length(tokens, parents, output, 1) == 1  # the truth from pos 1 is [2]; 3 lies beyond


def random_tree(rng, n, vocab):
    parents = np.array([rng.integers(-1, j) for j in range(n)], dtype=np.int32)
    return rng.integers(0, vocab, size=n).astype(np.int32), parents


def test_accepted_length_agrees_with_layout_accepted_path():
    layout = pytest.importorskip("ngramspec.layout")
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens, parents = random_tree(rng, int(rng.integers(1, 12)), 3)  # small vocab: duplicate siblings too
        output = rng.integers(0, 3, size=int(rng.integers(1, 10))).astype(np.int32)
        pos = int(rng.integers(0, len(output)))
        assert accepted_length(tokens, parents, output, pos) == len(layout.accepted_path(tokens, parents,
                                                                                          output[pos:]))


def test_accepted_length_rejects_bad_parents():
    output = np.array([1, 2], dtype=np.int32)
    with pytest.raises(ValueError):
        accepted_length(np.array([1, 2], np.int32), np.array([1, -1], np.int32), output, 0)


# --- replay semantics --------------------------------------------------------------------------------------

def test_copy_task_prompt_lookup_copies_in_two_steps():
    trace = copy_trace()
    run = replay(trace, make_method("prompt-lookup:k=8"))
    # step 1: A[0:3] matched in the prompt, 8 drafted + bonus = 9; step 2: the last 8 tokens, all accepted
    assert (run.steps, run.tokens, run.drafted, run.accepted) == (2, 17, 16, 16)


def test_copy_task_oracle_is_ceiling_of_output_over_k_plus_one():
    trace = copy_trace()
    for k in (1, 3, 8, 16):
        run = replay(trace, make_method(f"oracle:k={k}"))
        assert run.steps == math.ceil(17 / (k + 1))
        assert run.accepted == run.drafted == 17 - run.steps


def test_no_repeat_task_never_accepts():
    trace = no_repeat_trace()
    for spec in ("prompt-lookup:k=8", "none"):
        run = replay(trace, make_method(spec))
        assert run.steps == run.tokens == trace.output_tokens
        assert run.accepted == 0


class ScriptedTree(Method):
    """Always proposes two branches under the root: [wrong, wrong-child] and the true next two tokens."""

    needs_future = True

    def __init__(self):
        self.future, self.pos, self.seen = {}, {}, []

    def see_future(self, rid, output):
        self.future[rid], self.pos[rid] = output, 0

    def propose(self, rids):
        drafts = []
        for rid in rids:
            out, p = self.future[rid], self.pos[rid]
            if len(out) - p < 3:
                drafts.append(EMPTY_DRAFT)
                continue
            wrong = int(out[p]) + 1
            drafts.append((np.array([wrong, wrong, out[p], out[p + 1]], np.int32),
                           np.array([-1, 0, -1, 2], np.int32)))
        return drafts

    def update(self, rid, committed, n_accepted):
        self.seen.append((rid, n_accepted, committed.tolist()))
        self.pos[rid] += len(committed)


def test_replay_tree_accepts_second_branch_and_bonus():
    trace = make_trace("t", [{"prompt": [1], "output": [10, 20, 30, 40, 50, 60, 70]}])
    method = ScriptedTree()
    method.name = "scripted"
    run = replay(trace, method)
    # steps: accept 2 + bonus (3 tokens), again 3 tokens, then 1 token left: plain decode
    assert [s[1] for s in method.seen] == [2, 2, 0]
    assert [s[2] for s in method.seen] == [[10, 20, 30], [40, 50, 60], [70]]
    assert run.steps == 3 and run.step_counts == {(1, 5): 2, (1, 1): 1}


def test_none_is_one_token_per_step_and_speedup_one():
    trace = repetitive_trace()
    for batch in (1, 4):
        rows = run_all_trace(trace, ["none"], batch)
        for row in rows:
            assert row["accept_len"] == 1.0 and row["speedup"] == 1.0 and row["drafted_per_step"] == 0


def run_all_trace(trace, specs, batch, profiles=(SEED_PCIE8,)):
    base = replay(trace, make_method("none"), batch)
    rows = []
    for spec in specs:
        method = make_method(spec)
        for profile in profiles:
            run = replay(trace, make_method(spec), batch, profile) if method.profile_dependent \
                else replay(trace, method, batch)
            rows.append(summarize(run, profile, base))
    return rows


def test_batch_interleaving_follows_file_order():
    trace = make_trace("b", [{"prompt": [1], "output": [2] * 5}, {"prompt": [1], "output": [3] * 2},
                             {"prompt": [1], "output": [4] * 3}])
    run = replay(trace, make_method("none"), batch=2)
    # r0 and r1 start; r1 ends after 2 steps, r2 joins and runs 3 steps alongside r0's last 3
    assert run.step_counts == {(2, 1): 5}
    assert run.steps == run.tokens == 10
    run = replay(trace, make_method("none"), batch=8)
    assert run.step_counts == {(3, 1): 2, (2, 1): 1, (1, 1): 2}


class Spy(Method):
    """Checks that a method only ever sees committed tokens, in order."""

    def __init__(self, trace):
        self.trace = trace
        self.history = {}

    def start(self, rid, prompt):
        assert rid not in self.history
        self.history[rid] = []

    def propose(self, rids):
        return [EMPTY_DRAFT for _ in rids]

    def update(self, rid, committed, n_accepted):
        self.history[rid].extend(committed.tolist())
        assert self.history[rid] == self.trace.requests[rid].output[: len(self.history[rid])].tolist()

    def finish(self, rid):
        assert self.history[rid] == self.trace.requests[rid].output.tolist()


def test_methods_see_only_committed_tokens():
    trace = repetitive_trace()
    spy = Spy(trace)
    spy.name = "spy"
    replay(trace, spy, batch=3)
    assert set(spy.history) == set(range(len(trace.requests)))


def test_oracle_never_beaten_in_tokens_per_step():
    trace = repetitive_trace(requests=8, seed=3)
    specs = ["prompt-lookup:k=8", "ngramspec-chain:k=8", "ngramspec-tree:k=8", "oracle-ctl:k=8"]
    for batch in (1, 4):
        oracle = replay(trace, make_method("oracle:k=8"), batch)
        for spec in specs:
            try:
                method = make_method(spec)
            except ImportError:
                continue
            run = replay(trace, method, batch, SEED_PCIE8)
            assert run.tokens / run.steps <= oracle.tokens / oracle.steps, spec


def test_replay_is_deterministic():
    trace = repetitive_trace()
    timing = ("proposer_s", "replay_s")
    for spec in ("prompt-lookup:k=4", "oracle:k=8", "ngramspec-tree:k=8"):
        try:
            runs = [replay(trace, make_method(spec), 2) for _ in range(2)]
        except ImportError:
            continue
        a, b = ({k: v for k, v in vars(r).items() if k not in timing} for r in runs)
        assert a == b


def test_profile_dependent_method_is_replayed_per_profile():
    trace = repetitive_trace()
    rows = run_all_trace(trace, ["oracle-ctl:k=8"], 1, profiles=(SEED_PCIE8, LinearProfile("flat", 1, 1, 0)))
    seed_row, flat_row = rows
    # when verify costs no more than decode, the oracle controller never has a reason to hold back
    assert flat_row["accept_len"] >= seed_row["accept_len"]
    assert flat_row["speedup"] >= 1.0 and seed_row["speedup"] >= 1.0


def test_replay_rejects_width_smaller_than_draft():
    class Narrow(ScriptedTree):
        def verify_width(self, rids, drafts):
            return 2

    method = Narrow()
    method.name = "narrow"
    with pytest.raises(ValueError, match="verify width"):
        replay(make_trace("t", [{"prompt": [1], "output": [1, 2, 3, 4]}]), method)


# --- profiles ----------------------------------------------------------------------------------------------

def test_seed_profile_follows_its_formula():
    assert SEED_PCIE8.cost_ms(1, 1) == 12.2
    assert SEED_PCIE8.cost_ms(32, 9) == pytest.approx(22.5 + 2.5 * 9)
    with pytest.raises(ValueError):
        SEED_PCIE8.cost_ms(1, 0)


def test_table_profile_hits_grid_and_interpolates():
    profile = TableProfile("t", [1, 8], [1, 2, 4], [[5, 7, 9], [6, 10, 14]])
    assert profile.cost_ms(8, 2) == 10
    assert profile.cost_ms(1, 3) == pytest.approx(8)
    assert profile.cost_ms(4, 1) == pytest.approx(5 + 3 / 7)
    assert profile.cost_ms(1, 6) == pytest.approx(11)  # linear past the last width
    with pytest.raises(ValueError):
        TableProfile("bad", [1], [2, 3], [[1, 2]])


def test_json_profile_roundtrip_and_errors(tmp_path):
    rows = [{"B": b, "k": k, "kind": "chain", "graph_ms": b + k, "eager_ms": 2 * (b + k)}
            for b in (1, 4) for k in (1, 2, 8)]
    rows.append({"B": 1, "k": 2, "kind": "tree", "graph_ms": 999.0, "eager_ms": 999.0})
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"rows": rows}))
    assert get_profile(str(path)).cost_ms(4, 2) == 6
    assert get_profile(f"{path}:eager_ms").cost_ms(1, 2) == 6
    path.write_text(json.dumps({"rows": rows[:-2]}))
    with pytest.raises(ValueError, match="incomplete"):
        get_profile(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError):
        get_profile(str(path))
    with pytest.raises(ValueError):
        get_profile("no-such-profile")


def calibration_path():
    root = data_dir()
    path = root / "calibration" / "h200_llama8b_sdpa.json" if root else None
    return path if path and path.is_file() else None


@pytest.mark.skipif(calibration_path() is None, reason="shared calibration data absent")
def test_h200_profile_reads_graph_chain_rows():
    """The packaged h200-llama8b profile is the project's calibration file, chain rows, CUDA-graph column."""
    data = json.loads(calibration_path().read_text())
    profile = get_profile("h200-llama8b")
    for row in data["rows"]:
        if row["kind"] == "chain":
            assert profile.cost_ms(row["B"], row["k"]) == pytest.approx(row["graph_ms"])


# --- traces and CLI ----------------------------------------------------------------------------------------

def write_trace(path, records):
    with gzip.open(path, "wt") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


def test_trace_validation(tmp_path):
    for bad in ([{"prompt": [1]}], [{"prompt": [], "output": [1]}], [{"prompt": [1], "output": [-1]}],
                [{"prompt": [1], "output": ["a"]}], []):
        with pytest.raises(ValueError):
            make_trace("bad", bad)
    path = tmp_path / "x.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("{broken\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_trace(path)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl.gz")


def test_method_specs_are_validated():
    with pytest.raises(ValueError, match="unknown method"):
        make_method("nope")
    with pytest.raises(ValueError, match="parameters"):
        make_method("prompt-lookup:q=1")
    with pytest.raises(ValueError):
        make_method("prompt-lookup:k=0")
    with pytest.raises(ValueError):
        make_method("prompt-lookup:k")
    assert make_method("prompt-lookup:k=3,min=1,max=2").name == "prompt-lookup:k=3,min=1,max=2"


def test_cli_writes_json_table_and_plot(tmp_path, capsys):
    path = tmp_path / "copy.jsonl.gz"
    write_trace(path, [{"prompt": A + [7] + A[:3], "output": A[3:]}, {"prompt": [1, 2], "output": [3, 4, 5]}])
    out_json, out_png = tmp_path / "new" / "r.json", tmp_path / "new" / "r.png"
    assert simulate.main([str(path), "--method", "none", "--method", "prompt-lookup:k=8", "--profile",
                          "seed-pcie8", "--batch", "1", "--batch", "2", "--json", str(out_json), "--plot",
                          str(out_png), "--no-progress"]) == 0
    rows = json.loads(out_json.read_text())
    assert len(rows) == 4 and out_png.stat().st_size > 0
    fields = {"trace", "method", "profile", "batch", "requests", "tokens", "steps", "accept_len",
              "drafted_per_step", "accept_rate", "speedup", "proposer_us_per_token"}
    assert fields <= set(rows[0])
    assert "prompt-lookup:k=8" in capsys.readouterr().out
    assert simulate.main([str(path), "--method", "nope", "--profile", "seed-pcie8", "--no-progress"]) == 2


def test_run_all_with_two_jobs_matches_serial(tmp_path):
    path = tmp_path / "rep.jsonl.gz"
    trace = repetitive_trace()
    write_trace(path, [{"prompt": r.prompt.tolist(), "output": r.output.tolist()} for r in trace.requests])
    args = ([str(path)], ["prompt-lookup:k=8", "oracle:k=4"], ["seed-pcie8"], [1, 3])
    serial = run_all(*args, jobs=1, progress=False)
    parallel = run_all(*args, jobs=2, progress=False)
    strip = ("proposer_us_per_token", "replay_s")
    assert [{k: v for k, v in r.items() if k not in strip} for r in serial] == \
           [{k: v for k, v in r.items() if k not in strip} for r in parallel]
