"""Saving and loading what the adaptive controller learned (start warm after a restart)."""
import numpy as np
import pytest

from ngramspec import NgramCache
from ngramspec.controller import AdaptiveController, default_prior
from ngramspec.sim.profiles import get_profile

SEED = get_profile("seed-pcie8")


def seed_cost(batch, width):
    return SEED.cost_ms(batch, width)


def _records(seed, n=8):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 300, 250).tolist() for _ in range(2)]
    recs = []
    for i in range(n):
        doc = docs[i % 2]
        a = int(rng.integers(0, 100))
        out = doc[a:a + 50] + rng.integers(0, 300, 30).tolist() + doc[a + 50:a + 100]
        recs.append((doc[:150] + rng.integers(0, 300, 20).tolist(), out))
    return recs


def run(ctls, records, batch=3, rid0=0):
    """Decode ``records`` with every controller of ``ctls`` in lock step (each with its own cache); returns the
    plans of each, and checks that the controllers never diverge in what they commit."""
    caches = [NgramCache(max_depth=12) for _ in ctls]
    plans = [[] for _ in ctls]
    pos, active, nxt = {}, [], 0
    while active or nxt < len(records):
        while len(active) < batch and nxt < len(records):
            rid = rid0 + nxt
            for c, ctl in zip(caches, ctls):
                c.start_request(rid, records[nxt][0])
                ctl.start(rid)
            pos[rid] = 0
            active.append(rid)
            nxt += 1
        outs = {}
        for k, (c, ctl) in enumerate(zip(caches, ctls)):
            drafts = c.propose(active, max(1, ctl.max_width - 1), tree=True)
            p = ctl.plan(active, drafts, waiting=len(records) - nxt)
            plans[k].append((p.width, p.lengths.tolist(), p.expected, p.cost, p.reason))
            for i, rid in enumerate(active):
                d = drafts.draft(i).prefix(int(p.lengths[i]))
                out = records[rid - rid0][1]
                cur, n = -1, 0
                for t in out[pos[rid]:]:
                    j = next((j for j in range(len(d)) if d.parents[j] == cur and d.tokens[j] == t), -1)
                    if j < 0:
                        break
                    cur, n = j, n + 1
                outs.setdefault(rid, []).append(out[pos[rid]:pos[rid] + min(n + 1, len(out) - pos[rid])])
        for rid in active:
            committed = outs[rid][0]
            assert all(o == committed for o in outs[rid]), "controllers diverged"
            pos[rid] += len(committed)
            for c, ctl in zip(caches, ctls):
                c.add_tokens(rid, committed)
                ctl.observe_tokens(rid, committed)
        for ctl, w in zip(ctls, [pl[-1][0] for pl in plans]):
            ctl.observe_step(len(active), w, SEED.cost_ms(len(active), w))
        for rid in [r for r in active if pos[r] == len(records[r - rid0][1])]:
            active.remove(rid)
            for c, ctl in zip(caches, ctls):
                c.finish_request(rid)
                ctl.finish(rid)
    return plans


def test_a_saved_and_loaded_controller_plans_like_the_original(tmp_path):
    old = AdaptiveController(prior=seed_cost)
    run([old], _records(0))
    path = tmp_path / "state.npz"
    old.save_state(path)
    assert path.stat().st_size < 200_000
    new = AdaptiveController(prior=seed_cost)
    new.load_state(path)
    for a, b in zip(old.calibration, new.calibration):
        assert np.array_equal(a, b)
    plans_old, plans_new = run([old, new], _records(1), batch=2, rid0=100)
    assert plans_old == plans_new
    assert len({p[0] for p in plans_old}) > 1  # the test exercises more than one width
    cold = AdaptiveController(prior=seed_cost)
    plans_cold = run([cold], _records(1), batch=2, rid0=100)[0]
    assert plans_cold != plans_old  # a cold start plans differently: the state mattered


def test_state_dict_round_trip_and_counters():
    old = AdaptiveController(prior=seed_cost)
    run([old], _records(2, n=4))
    new = AdaptiveController(prior=seed_cost)
    new.load_state_dict(old.state_dict())
    assert new.costs.clock == old.costs.clock
    assert (new._n_steps, new._n_explored) == (old._n_steps, old._n_explored)
    for B in (1, 2, 3, 5):
        assert np.array_equal(new.costs.row(B).costs, old.costs.row(B).costs)


def _snapshot(ctl):
    return [a.copy() for a in ctl.calibration] + [a.copy() for a in ctl.costs.state] + [ctl.costs.clock]


def _unchanged(ctl, snap):
    now = _snapshot(ctl)
    assert now[-1] == snap[-1]
    for a, b in zip(now[:-1], snap[:-1]):
        assert np.array_equal(a, b, equal_nan=True)


def _trained(prior=seed_cost, widths=None):
    ctl = AdaptiveController(prior=prior) if widths is None else AdaptiveController(widths, prior=prior)
    run([ctl], _records(3, n=3))
    return ctl


def test_bad_states_are_rejected_and_change_nothing(tmp_path):
    src = _trained()
    good = src.state_dict()
    target = _trained()  # trained on the same data, then altered state must not leak in
    target.observe_step(1, 1, 123.0)
    snap = _snapshot(target)

    def bad(change, match):
        data = dict(good)
        change(data)
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(data)
        _unchanged(target, snap)

    bad(lambda d: d.update(version=np.array([99])), "version 99")
    bad(lambda d: d.update(format=np.array("something else")), "not a controller state")
    bad(lambda d: d.pop("cal_succ"), "not a controller state")
    bad(lambda d: d.pop("cost_ewma"), "incomplete")
    bad(lambda d: d.update(cal_succ=d["cal_succ"][:10]), "shape")
    bad(lambda d: d.update(cal_succ=d["cal_trials"] + 1), "more successes than trials")
    bad(lambda d: d.update(cost_ratio=np.zeros(3)), "shape")
    with pytest.raises(ValueError, match="widths"):
        AdaptiveController((1, 2, 4, 8), prior=seed_cost).load_state_dict(good)
    other_prior = AdaptiveController(prior=default_prior)
    other_snap = _snapshot(other_prior)
    with pytest.raises(ValueError, match="different cost prior"):
        other_prior.load_state_dict(good)
    _unchanged(other_prior, other_snap)

    with pytest.raises(FileNotFoundError, match="not found"):
        target.load_state(tmp_path / "missing.npz")
    corrupt = tmp_path / "corrupt.npz"
    src.save_state(corrupt)
    corrupt.write_bytes(corrupt.read_bytes()[:500])
    with pytest.raises(ValueError, match="not a readable controller state"):
        target.load_state(corrupt)
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ValueError, match="not a readable controller state"):
        target.load_state(tmp_path / "text.npz")
    _unchanged(target, snap)
    target.load_state_dict(good)  # a good one still loads
    assert target.costs.clock == src.costs.clock


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path):
    ctl = _trained()
    path = tmp_path / "s.npz"
    ctl.save_state(path)
    ctl.save_state(path)  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]


def test_simulator_runs_chain_through_a_state_file(tmp_path):
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay
    from ngramspec.sim.traces import make_trace

    recs = _records(4, n=6)
    first = make_trace("first", [{"prompt": p, "output": o} for p, o in recs[:3]])
    second = make_trace("second", [{"prompt": p, "output": o} for p, o in recs[3:]])
    out = str(tmp_path / "state-{profile}.npz")
    learner = make_method(f"ngramspec-adaptive:state_out={out}")
    replay(first, learner, 1, SEED)
    saved = tmp_path / "state-seed-pcie8.npz"
    assert saved.is_file()
    warm = make_method(f"ngramspec-adaptive:state_in={out}")
    warm.bind_profile(SEED)
    assert warm.ctl.costs.clock == learner.ctl.costs.clock > 0
    for a, b in zip(warm.ctl.calibration, learner.ctl.calibration):
        assert np.array_equal(a, b)
    run = replay(second, make_method(f"ngramspec-adaptive:state_in={out}"), 1, SEED)
    assert run.tokens == sum(len(o) for _, o in recs[3:])
    with pytest.raises(FileNotFoundError):
        replay(second, make_method(f"ngramspec-adaptive:state_in={tmp_path}/nope.npz"), 1, SEED)
