"""`AdaptiveController.step` (one fused kernel call for commit + propose + plan) against the same step done verb
by verb (`add_tokens_batch`, `observe_batch`, `propose`, `plan`) and against its own fully validated path (other
containers than lists): the same drafts, plans and decision trace; bad input rejected with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from ngramspec import NgramCache
from ngramspec.controller import AdaptiveController
from ngramspec.controller.step import _host_step
from ngramspec.sim.profiles import get_profile

PROFILE = get_profile("seed-pcie8")


def _records(seed, n):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 300, 250).tolist() for _ in range(3)]
    recs = []
    for i in range(n):
        doc = docs[i % 3]
        a = int(rng.integers(0, 100))
        out = doc[a:a + 50] + rng.integers(0, 300, 30).tolist() + doc[a + 50:a + 110]
        recs.append((doc[:180] + rng.integers(0, 300, 20).tolist(), out))
    return recs


def _verbwise(ctl, cache, rids, committed, waiting):
    """What ``step`` does, one public verb at a time."""
    if committed is not None and any(len(t) for t in committed):
        cache.add_tokens_batch(rids, committed)
        ctl.observe_batch(rids, committed)
    batch = cache.propose(rids, ctl.max_width - 1)
    return batch, ctl.plan(rids, batch, waiting=waiting)


def _replay(mode, batch, steps=160, waiting_of=lambda n: n, trace_len=1000, commit_kind="array", prefetch=False):
    """Replay synthetic requests with one way of stepping; the log of (drafts, plan) per step and the
    controller."""
    recs = _records(batch, 3 * batch + 2)
    cache, ctl = NgramCache(max_depth=16), AdaptiveController(trace_len=trace_len)
    pos, active, upcoming, committed, log = {}, [], 0, {}, []
    for step in range(steps):
        while len(active) < batch and upcoming < len(recs):
            cache.start_request(upcoming, recs[upcoming][0])
            ctl.start(upcoming)
            pos[upcoming] = 0
            active.append(upcoming)
            upcoming += 1
        if not active:
            break
        waiting = waiting_of(len(recs) - upcoming)
        commits = [committed.pop(r, []) for r in active]
        if commit_kind == "array":
            commits = [np.asarray(c, np.int32) for c in commits]
        if step % 7 == 3:
            commits = None  # a step that reports nothing new (its tokens come with the next one)
            for r in active:
                committed[r] = []
        if mode == "step":
            b, p = ctl.step(cache, list(active), commits, waiting=waiting)
        elif mode == "checked":  # tuples: the fully validated path
            b, p = ctl.step(cache, tuple(active), None if commits is None else tuple(commits), waiting=waiting)
        else:
            b, p = _verbwise(ctl, cache, list(active), commits, waiting)
        log.append((p.width, p.lengths.tolist(), p.expected, p.cost, p.reason, b.tokens.tolist(),
                    b.parents.tolist(), b.offsets.tolist(), b.match_lens.tolist()))
        for i, rid in enumerate(list(active)):
            out = recs[rid][1]
            a, k = int(b.offsets[i]), int(p.lengths[i])
            toks, pars = b.tokens[a:a + k].tolist(), b.parents[a:a + k].tolist()
            cur, n = -1, 0
            for t in out[pos[rid]:]:
                nxt = next((j for j in range(k) if pars[j] == cur and toks[j] == t), -1)
                if nxt < 0:
                    break
                cur, n = nxt, n + 1
            n = min(n + 1, len(out) - pos[rid])
            committed[rid] = committed.get(rid, []) + out[pos[rid]:pos[rid] + n]
            pos[rid] += n
        ctl.observe_step(len(active), p.width, PROFILE.cost_ms(len(active), p.width))
        for rid in [r for r in active if pos[r] == len(recs[r][1])]:
            active.remove(rid)
            committed.pop(rid, None)
            cache.finish_request(rid)
            ctl.finish(rid)
        if prefetch and active:  # as the engine does while the device runs the forward
            ctl.prefetch(cache, list(active))
    return log, ctl


@pytest.mark.parametrize("batch, waiting, kind", [(1, "queue", "array"), (1, "queue", "list"),
                                                  (4, "unknown", "array"), (4, "drain", "list")])
def test_step_takes_the_decisions_of_the_verbs_one_by_one(batch, waiting, kind):
    waiting_of = {"queue": lambda n: n, "unknown": lambda n: None, "drain": lambda n: 0}[waiting]
    runs = {mode: _replay(mode, batch, waiting_of=waiting_of, commit_kind=kind)
            for mode in ("step", "checked", "verbs")}
    (log, ctl), others = runs["step"], [runs["checked"], runs["verbs"]]
    assert len(log) > 100 and len({e[0] for e in log}) > 1  # drafts were sent
    for other_log, other_ctl in others:
        assert log == other_log
        assert ctl.decisions() == other_ctl.decisions()
        assert np.array_equal(ctl.calibration.trials, other_ctl.calibration.trials)
        # the step durations reach the cost model inside `step`'s kernel call, through `plan` after a flush:
        # the same cost state, sample clock and counters either way
        mine, theirs = ctl.state_dict(), other_ctl.state_dict()
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert np.array_equal(mine[key], theirs[key], equal_nan=mine[key].dtype.kind == "f"), key
    assert ctl._n_steps == len(log) and ctl.costs.clock == len(log)


def test_the_decision_trace_keeps_the_last_trace_len_steps_in_order():
    log, full = _replay("step", 2, steps=60)
    _, short = _replay("step", 2, steps=60, trace_len=7)
    _, none = _replay("step", 2, steps=60, trace_len=0)
    assert len(full.decisions()) == len(log)
    assert short.decisions() == full.decisions()[-7:]
    assert [d["step"] for d in short.decisions()] == list(range(len(log) - 6, len(log) + 1))
    assert none.decisions() == [] and none.trace == []
    assert len(full.trace) == len(log) and full.trace[-1][0] == len(log)


def _ready():
    cache, ctl = NgramCache(max_depth=8), AdaptiveController((1, 2, 4, 8))
    for rid in ("a", "b"):
        cache.start_request(rid, [1, 2, 3, 1, 2, 3, 1, 2])
        ctl.start(rid)
    ctl.step(cache, ["a", "b"], None)
    return cache, ctl


def _state(cache, ctl):
    return (cache.history("a").tolist(), cache.history("b").tolist(), ctl.calibration.trials.copy(),
            ctl._pend.nd.copy(), ctl._pend.nn.copy(), ctl._n_steps, ctl._step, len(ctl.trace))


def _same(s1, s2):
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(s1, s2))


@pytest.mark.parametrize("rids, committed, error, match", [
    (["a"], [np.array([3, -1], np.int32)], ValueError, "request 'a'.*out of range"),
    (["a", "b"], [np.array([3], np.int32), np.array([-2], np.int32)], ValueError, "request 'b'.*out of range"),
    (["a"], [[3, -1]], ValueError, "out of range"),
    (["a", "b"], [np.array([3], np.int32), np.array([True])], TypeError, "request 'b'.*integer"),
    (["a", "b"], [np.array([3], np.int32), np.array([[3]], np.int32)], ValueError, "one-dimensional"),
    (["a", "b"], [np.array([[3]], np.int32), np.array([[3]], np.int32)], ValueError, "one-dimensional"),
    (["a", "b"], [np.array([3], np.int32), np.int32(3)], TypeError, "request 'b'"),
    (["a", "b"], [np.array([3], np.int32), [2**31]], ValueError, "out of range"),
    (["a"], [np.array([2**31], np.int64)], ValueError, "out of range"),
    (["a"], [[1.5]], TypeError, "integer"),
    (["a", "b"], [[1]], ValueError, "token lists"),
    (["a", "a"], [[1], [2]], ValueError, "twice"),
    (["a", "zz"], [[1], [2]], KeyError, "unknown"),
    ([["a"]], [[1]], TypeError, "hashable"),
])
def test_bad_step_input_is_rejected_and_changes_nothing(rids, committed, error, match):
    cache, ctl = _ready()
    before = _state(cache, ctl)
    with pytest.raises(error, match=match):
        ctl.step(cache, rids, committed)
    assert _same(before, _state(cache, ctl))


def test_a_request_the_cache_does_not_know_is_rejected_and_changes_nothing():
    cache, ctl = _ready()
    ctl.start("c")  # known to the controller only
    before = _state(cache, ctl)
    with pytest.raises(KeyError, match="'c'"):
        ctl.step(cache, ["a", "c"], [[1], [2]])
    with pytest.raises(KeyError, match="'c'"):
        ctl.step(cache, ["c"], [np.array([2], np.int32)])
    with pytest.raises(ValueError, match="waiting"):
        ctl.step(cache, ["a"], [[1]], waiting=-1)
    assert _same(before, _state(cache, ctl))


def test_step_grows_histories_and_pending_pools_as_the_verbs_do():
    """Long commits (histories grow inside the step) and many steps whose drafts stay pending (the pools grow):
    the same drafts and plans as verb by verb."""
    rng = np.random.default_rng(3)
    period = rng.integers(0, 1000, 40).tolist()
    logs = []
    for mode in ("step", "verbs"):
        cache, ctl = NgramCache(max_depth=16), AdaptiveController()
        for rid in (0, 1):
            cache.start_request(rid, period * 2)
            ctl.start(rid)
        log = []
        for step in range(120):
            if step % 40 == 39:  # a long commit: more than the history has room for
                commits = [np.array(period * 8, np.int32), period * 9]
            else:
                commits = None  # nothing committed: every draft stays pending
            if mode == "step":
                b, p = ctl.step(cache, [0, 1], commits, waiting=1)
            else:
                b, p = _verbwise(ctl, cache, [0, 1], commits, 1)
            ctl.observe_step(2, p.width, PROFILE.cost_ms(2, p.width))
            log.append((p.width, p.lengths.tolist(), p.expected, p.reason, b.tokens.tolist(), b.offsets.tolist()))
        logs.append((log, ctl.decisions(), cache.history(0).tolist(), ctl._pend.start.shape[1]))
    assert logs[0] == logs[1]
    assert logs[0][3] > 4  # the pending pools grew (from 4 drafts per request)


def test_a_negative_trace_len_is_rejected():
    with pytest.raises(ValueError, match="trace_len"):
        AdaptiveController(trace_len=-1)


def test_step_follows_every_replaced_part_of_its_state():
    """The fused step reads the cache's and the controller's arrays through one bundle; it must follow every
    replacement of a part: another cache, pending slots grown (more requests than the pool has rows), cost tables
    grown (larger batches), a learned state loaded mid-run. Same drafts and plans as verb by verb."""
    _, donor = _replay("step", 4)
    state = donor.state_dict()
    rng = np.random.default_rng(5)
    period = rng.integers(0, 500, 30).tolist()
    logs = []
    for mode in ("step", "verbs"):
        caches, ctl = (NgramCache(max_depth=16), NgramCache(max_depth=16)), AdaptiveController()
        for rid in range(24):
            caches[rid % 2].start_request(rid, period * 2 + [rid])
            ctl.start(rid)
        log = []
        for step in range(60):
            c = step % 2
            rids = [r for r in range(24) if r % 2 == c][: 2 + step // 6]
            commits = [period[(step + r) % 28:(step + r) % 28 + 2] for r in rids]
            if step == 30:
                ctl.load_state_dict(state)
            if mode == "step":
                b, p = ctl.step(caches[c], rids, commits, waiting=1)
            else:
                b, p = _verbwise(ctl, caches[c], rids, commits, 1)
            ctl.observe_step(len(rids), p.width, PROFILE.cost_ms(len(rids), p.width))
            log.append((p.width, p.lengths.tolist(), p.expected, p.reason, b.tokens.tolist(), b.offsets.tolist()))
        logs.append((log, ctl.decisions()))
    assert logs[0] == logs[1]
    assert len({e[0] for e in logs[0][0]}) > 1


def test_step_follows_batches_larger_than_any_before():
    """The step's bundle holds the cache's output buffers, the budgets and the scratch with room for the largest
    batch so far; a larger batch (here past every initial size: 64 and the buffers' 1,024 nodes) must grow them
    first, and smaller batches after it must still read only their own rows. Same drafts and plans as verb by
    verb."""
    rng = np.random.default_rng(11)
    period = rng.integers(0, 500, 30).tolist()
    sizes = [1, 3, 70, 2, 100, 1, 65, 4]
    logs = []
    for mode in ("step", "verbs"):
        cache, ctl = NgramCache(max_depth=16), AdaptiveController()
        for rid in range(100):
            cache.start_request(rid, period * 3 + [rid])
            ctl.start(rid)
        log = []
        for step in range(48):
            rids = list(range(sizes[step % len(sizes)]))
            commits = [period[(step + r) % 28:(step + r) % 28 + 1] for r in rids]
            if mode == "step":
                b, p = ctl.step(cache, rids, commits, waiting=1)
            else:
                b, p = _verbwise(ctl, cache, rids, commits, 1)
            ctl.observe_step(len(rids), p.width, PROFILE.cost_ms(len(rids), p.width))
            log.append((p.width, p.lengths.tolist(), p.expected, p.reason, b.tokens.tolist(), b.offsets.tolist()))
        logs.append((log, ctl.decisions()))
    assert logs[0] == logs[1]
    assert max(len(e[4]) for e in logs[0][0]) > 1024  # a proposal larger than the initial buffers


def _small_run(requests, seed, at_step, change):
    """``requests`` requests stepped 40 times over a repeating text; ``change(ctl)`` before step ``at_step``.
    Returns (the log of plans and drafts, the controller)."""
    period = np.random.default_rng(seed).integers(0, 500, 30).tolist()
    cache, ctl = NgramCache(max_depth=16), AdaptiveController()
    rids = list(range(requests))
    for rid in rids:
        cache.start_request(rid, period * 2 + [rid])
        ctl.start(rid)
    log = []
    for step in range(40):
        if step == at_step:
            change(ctl)
        commits = [period[(step + r) % 28:(step + r) % 28 + 2] for r in rids]
        b, p = ctl.step(cache, rids, commits, waiting=1)
        ctl.observe_step(requests, p.width, PROFILE.cost_ms(requests, p.width))
        log.append((p.width, p.lengths.tolist(), p.expected, p.reason, b.tokens.tolist()))
    return (log, ctl.decisions()), ctl


def test_a_loaded_state_of_another_memory_layout_takes_the_same_decisions():
    """A state whose arrays come in Fortran order (e.g. written by other tools): loaded, it must not change what
    the step's compiled entry point reads (it takes C-ordered arrays)."""
    _, donor = _replay("step", 4)
    state = donor.state_dict()
    fortran = {k: np.asfortranarray(v) if isinstance(v, np.ndarray) and v.ndim == 2 else v for k, v in state.items()}
    assert any(v.ndim == 2 and not v.flags.c_contiguous for v in fortran.values())
    runs = [_small_run(4, 9, 5, lambda ctl, data=data: ctl.load_state_dict(data))[0] for data in (state, fortran)]
    assert runs[0] == runs[1]


def _fortran_scratch(ctl):
    ctl._sc = type(ctl._sc)(*(np.asfortranarray(a) for a in ctl._sc))


def test_state_arrays_of_another_layout_go_through_the_dispatcher():
    """The step calls the compiled entry point of the state types of its first call; state arrays of another
    numba type (here: the per-step scratch in Fortran order) must go through numba's dispatcher instead, which
    compiles for them, with the same decisions."""
    plain, plain_ctl = _small_run(3, 11, 3, lambda ctl: None)
    fortran, fortran_ctl = _small_run(3, 11, 3, _fortran_scratch)
    assert plain_ctl._host_direct is not _host_step and fortran_ctl._host_direct is _host_step
    assert plain == fortran


def test_a_switch_cost_makes_drafting_dearer_for_that_step_only():
    """``switch_cost`` (ms) is added to every width > 1 of one step: large enough, the step decodes plainly; the
    next step without it drafts as before. A bad value is rejected and changes nothing."""
    period = list(range(100, 140))
    plans = {}
    for switch in (0.0, 1e6):
        cache, ctl = NgramCache(max_depth=16), AdaptiveController()
        cache.start_request(0, period * 4)
        ctl.start(0)
        for _ in range(30):  # learn that drafting pays here
            b, p = ctl.step(cache, [0], None, waiting=0)
            ctl.observe_step(1, p.width, PROFILE.cost_ms(1, p.width))
            cache.add_tokens(0, period[:1])
            ctl.observe_tokens(0, period[:1])
            period = period[1:] + period[:1]
        _, during = ctl.step(cache, [0], None, waiting=0, switch_cost=switch)
        _, after = ctl.step(cache, [0], None, waiting=0)
        plans[switch] = during.width, after.width
        for bad in (-1.0, float("nan"), float("inf"), "1", True):
            before = ctl.decisions()
            with pytest.raises(ValueError, match="switch_cost"):
                ctl.step(cache, [0], None, waiting=0, switch_cost=bad)
            with pytest.raises(ValueError, match="switch_cost"):
                ctl.plan([0], cache.propose([0], 15), waiting=0, switch_cost=bad)
            assert ctl.decisions() == before
    assert plans[0.0][0] > 1 and plans[1e6][0] == 1 and plans[1e6][1] > 1


def test_a_step_duration_is_in_the_cost_model_as_soon_as_it_is_read():
    """`observe_step` keeps a duration for the next step's kernel call; whoever reads `costs` first sees it."""
    cache, ctl = _ready()
    direct = AdaptiveController((1, 2, 4, 8)).costs
    direct._ensure(2)
    for width, ms in ((1, 3.0), (4, 9.0), (1, 5.0)):
        ctl.observe_step(2, width, ms)
        direct.observe(2, width, ms)
        assert ctl.costs.clock == direct.clock
        assert ctl.costs.estimate(2, 4) == direct.estimate(2, 4)
    ctl.observe_step(2, 8, 20.0)  # kept, then taken by the step's kernel call
    b, p = ctl.step(cache, ["a", "b"], [[3], [3]])
    direct.observe(2, 8, 20.0)
    assert ctl.costs.clock == direct.clock
    for mine, theirs in zip(ctl.costs.state, direct.state):
        assert np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f")
    before = ctl.costs.clock
    for bad in ((0, 1, 1.0), (2, 3, 1.0), (2, 1, float("nan")), (2, 1, -1.0), (2, 1, "1")):
        with pytest.raises(ValueError):
            ctl.observe_step(*bad)
    assert ctl.costs.clock == before


@pytest.mark.parametrize("batch", [1, 3])
def test_prefetch_changes_no_decision(batch):
    """`prefetch` between steps (the engine calls it while the device works) leaves every draft, plan, count and
    cost the same."""
    log, ctl = _replay("step", batch)
    log_p, ctl_p = _replay("step", batch, prefetch=True)
    assert log == log_p and len({e[0] for e in log}) > 1
    assert ctl.decisions() == ctl_p.decisions()
    mine, theirs = ctl.state_dict(), ctl_p.state_dict()
    for key in mine:
        assert np.array_equal(mine[key], theirs[key], equal_nan=mine[key].dtype.kind == "f"), key
    assert np.array_equal(ctl._pend.nd, ctl_p._pend.nd) and np.array_equal(ctl._pend.tok, ctl_p._pend.tok)


def test_prefetch_ignores_what_it_cannot_warm():
    cache, ctl = _ready()
    before = _state(cache, ctl)
    for rids in (["a", "x"], ("a", "b"), [], ["a", "a"], "ab", None):
        ctl.prefetch(cache, rids)
    ctl.prefetch(cache, ["a", "b"])
    assert _same(_state(cache, ctl), before)


def test_a_batchs_slots_are_reused_only_while_its_requests_keep_them():
    """`step` keeps the slots of the last batch's ids: reused while neither the controller nor the cache started or
    finished a request, whatever list object holds the ids (one changed in place included). Requests that finish
    and start again under the same ids get new slots in both; drafts and plans equal a run that never reuses."""
    def run(reuse):
        rng = np.random.default_rng(5)
        docs = [rng.integers(0, 40, 120).tolist() for _ in range(3)]
        cache, ctl = NgramCache(max_depth=8), AdaptiveController()
        ids = ["a", "b", "c"]
        for i, r in enumerate(ids):
            cache.start_request(r, docs[i][:60])
            ctl.start(r)
        pos = {r: 60 for r in ids}
        log = []
        for step in range(60):
            if step % 9 == 4:  # one request ends and another starts under the same id, in other slots
                r = ids[step % 3]
                cache.finish_request(r)
                ctl.finish(r)
                cache.start_request("other", docs[0][:20])  # takes the freed slots
                ctl.start("other")
                d = int(rng.integers(0, 3))
                cache.start_request(r, docs[d][:30])
                ctl.start(r)
                cache.finish_request("other")
                ctl.finish("other")
                pos[r] = 30
            if step % 11 == 6:  # the same list object, changed in place
                ids[0], ids[2] = ids[2], ids[0]
            if not reuse:
                ctl._batch_slots = None
            commits = [np.asarray(docs[j % 3][pos[r]:pos[r] + 1 + step % 2], np.int32) for j, r in enumerate(ids)]
            for j, r in enumerate(ids):
                pos[r] += len(commits[j])
            b, p = ctl.step(cache, ids, commits)
            ctl.observe_step(len(ids), p.width, PROFILE.cost_ms(len(ids), p.width))
            log.append((p.width, p.lengths.tolist(), b.tokens.tolist(), b.offsets.tolist(), b.match_lens.tolist()))
        return log, ctl

    reused, ctl = run(True)
    fresh, _ = run(False)
    assert reused == fresh
    assert ctl._batch_slots is not None and ctl._batch_slots[3] == ["c", "b", "a"]
    assert any(len(t) for _, _, t, _, _ in reused)  # drafts were made: the comparison covers slots in use
