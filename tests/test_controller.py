"""The adaptive controller on its own, and through the simulator on hand-made traces."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramspec import NgramCache
from ngramspec.controller import AdaptiveController, CostModel, default_prior
from ngramspec.controller.calibration import TOP_SHAPE
from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import LinearProfile, get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import make_trace

SEED = get_profile("seed-pcie8")


def seed_cost(batch, width):
    return SEED.cost_ms(batch, width)


def drive(ctl, cache, rid, output, widths_log, profile=SEED):
    """Decode `output` greedily with the controller choosing widths; returns tokens per step."""
    pos = 0
    steps = 0
    while pos < len(output):
        batch = cache.propose([rid], max(1, ctl.max_width - 1), tree=True)
        plan = ctl.plan([rid], batch)
        d = batch.draft(0).prefix(int(plan.lengths[0]))
        path, cur = [], -1
        for t in output[pos:]:
            nxt = next((j for j in range(len(d)) if d.parents[j] == cur and d.tokens[j] == t), -1)
            if nxt < 0:
                break
            path.append(nxt)
            cur = nxt
        n = min(len(path) + 1, len(output) - pos)
        committed = output[pos:pos + n]
        cache.add_tokens(rid, committed)
        ctl.observe_tokens(rid, committed)
        ctl.observe_step(1, plan.width, profile.cost_ms(1, plan.width))
        widths_log.append((pos, plan.width))
        pos += n
        steps += 1
    return len(output) / steps


def test_width_rises_within_a_few_steps_of_a_copy_and_falls_after():
    rng = np.random.default_rng(0)
    passage = rng.integers(1000, 50000, 300).tolist()
    prompt = rng.integers(1000, 50000, 200).tolist() + passage + rng.integers(1000, 50000, 100).tolist()
    free1 = rng.integers(50000, 90000, 150).tolist()
    free2 = rng.integers(50000, 90000, 150).tolist()
    output = free1 + passage + free2
    cache = NgramCache(max_depth=16)
    ctl = AdaptiveController(prior=seed_cost)
    cache.start_request(0, prompt)
    ctl.start(0)
    log = []
    drive(ctl, cache, 0, output, log)
    copy_start, copy_end = len(free1), len(free1) + len(passage)
    free_steps = [w for p, w in log if p < copy_start]
    copy_steps = [w for p, w in log if copy_start <= p < copy_end]
    after = [w for p, w in log if p >= copy_end + 2]
    assert all(w == 1 for w in free_steps), "nothing to copy: never pay for a verify"
    first_wide = next(i for i, w in enumerate(copy_steps) if w > 1)
    assert first_wide <= 8, f"width rose only after {first_wide} steps of copying"
    assert np.mean([w for w in copy_steps[first_wide:]]) >= 8, "verbatim copying should earn wide drafts"
    assert len(copy_steps) < len(passage) / 3, "the copy should go several tokens per step"
    # back to plain decoding, but for the rare sparse exploration of a width not yet measured
    assert np.mean(np.array(after[3:]) == 1) >= 0.95, "after the copy ends the width falls back to 1"


def test_no_draft_means_width_one():
    cache = NgramCache()
    ctl = AdaptiveController()
    cache.start_request("a", [5, 6, 7])
    ctl.start("a")
    plan = ctl.plan(["a"], cache.propose(["a"], 15))
    assert plan.width == 1 and plan.lengths.tolist() == [0] and plan.reason == "no-draft"


def test_width_one_when_nothing_pays():
    """Drafts that always fail, expensive verify: after learning, it stops drafting for good."""
    rng = np.random.default_rng(1)
    cache = NgramCache()
    ctl = AdaptiveController(prior=seed_cost, explore_frac=0.0)
    base = rng.integers(0, 40, 4000).tolist()  # a small alphabet: matches everywhere, predictions poor
    cache.start_request(0, base[:100])
    ctl.start(0)
    log = []
    drive(ctl, cache, 0, base[100:], log)
    tail = [w for _, w in log[-500:]]
    assert np.mean(np.array(tail) == 1) > 0.95


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(st.lists(st.integers(0, 6), min_size=2, max_size=60), min_size=1, max_size=6),
       widths=st.sets(st.integers(1, 16), min_size=1, max_size=5))
def test_plans_respect_widths_and_budgets(seqs, widths):
    cache = NgramCache(max_depth=8)
    ctl = AdaptiveController(widths=sorted(widths), prior=seed_cost, explore_frac=0.5)
    rids = list(range(len(seqs)))
    for r, s in zip(rids, seqs):
        cache.start_request(r, s)
        ctl.start(r)
    for step in range(4):
        batch = cache.propose(rids, max(1, ctl.max_width - 1))
        plan = ctl.plan(rids, batch)
        assert plan.width in ctl.widths
        lens = np.diff(batch.offsets)
        assert np.all(plan.lengths <= np.minimum(lens, plan.width - 1)) and np.all(plan.lengths >= 0)
        for r in rids:
            ctl.observe_tokens(r, [step % 7])
            cache.add_tokens(r, [step % 7])
        ctl.observe_step(len(rids), plan.width, seed_cost(len(rids), plan.width))


def test_decisions_are_deterministic():
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 30, 500).tolist()
    out = rng.integers(0, 30, 300).tolist()
    logs = []
    for _ in range(2):
        cache, ctl, log = NgramCache(), AdaptiveController(prior=seed_cost), []
        cache.start_request(0, prompt)
        ctl.start(0)
        drive(ctl, cache, 0, out, log)
        logs.append((log, [t["options"] for t in ctl.decisions()]))
    assert logs[0] == logs[1]


def test_cost_model_learns_measured_widths_and_scales_the_prior():
    cm = CostModel(default_prior)
    assert cm.estimate(1, 8) == default_prior(1, 8)
    cm.observe(1, 1, 10.0)
    assert cm.estimate(1, 1) == 10.0
    assert cm.estimate(1, 8) == pytest.approx(10.0 * default_prior(1, 8))  # scaled by what was measured
    cm.observe(1, 8, 12.0)
    assert cm.estimate(1, 8) == 12.0
    with pytest.raises(ValueError):
        cm.observe(1, 2, float("nan"))
    with pytest.raises(ValueError):
        cm.observe(1, 2, -1.0)


def test_below_two_measured_widths_a_downhill_slope_falls_back_to_the_prior_shape():
    """The server's case (64-expert MoE, batch 1): plain 4.18 ms, width 12 measured once at 13.3 ms and width 16 at
    11.7. Extending the two widths' slope below them (clipped flat: never downhill) put widths 2-8 at 13.3 ms, dearer
    than width 16 and than the prior had put them before anything wide was measured, so they were never tried. A
    downhill pair says nothing about the slope: the nearest measured width scales the prior's shape, as when one
    width is measured. An uphill pair still extends its slope downward."""
    cm = CostModel(default_prior, clip=None)
    cm.observe(1, 1, 4.18)
    before = {w: cm.estimate(1, w) for w in (2, 3, 4, 6, 8)}
    cm.observe(1, 12, 13.3)
    cm.observe(1, 16, 11.7)
    for w, was in before.items():
        now = cm.estimate(1, w)
        assert now == pytest.approx(13.3 * default_prior(1, w) / default_prior(1, 12))
        assert now < min(was, 11.7), (w, now)  # cheaper than width 16 measured: worth trying
    uphill = CostModel(default_prior, clip=None)
    uphill.observe(1, 1, 4.0)
    uphill.observe(1, 12, 20.0)
    uphill.observe(1, 16, 28.0)  # 2 ms per token
    assert uphill.estimate(1, 8) == pytest.approx(12.0)
    flat = CostModel(default_prior, clip=None)
    flat.observe(1, 12, 20.0)
    flat.observe(1, 16, 20.0)
    assert flat.estimate(1, 4) == pytest.approx(20.0)  # flat measured: flat below too, as before


def test_unknown_requests_are_rejected():
    ctl = AdaptiveController()
    with pytest.raises(KeyError, match="unknown request"):
        ctl.observe_tokens("x", [1])
    with pytest.raises(KeyError, match="unknown request"):
        ctl.finish("x")
    ctl.start("x")
    with pytest.raises(ValueError):
        ctl.start("x")
    cache = NgramCache()
    cache.start_request("x", [1, 2, 1, 2])
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="waiting"):
            ctl.plan(["x"], cache.propose(["x"], 3), waiting=bad)


def _trace(records):
    return make_trace("hand", records)


@pytest.mark.parametrize("profile", ["seed-pcie8"])
def test_never_slower_on_text_that_never_repeats(profile):
    rng = np.random.default_rng(3)
    recs = [{"prompt": rng.integers(0, 90000, 50).tolist(), "output": rng.integers(0, 90000, 400).tolist()}
            for _ in range(4)]
    tr = _trace(recs)
    prof = get_profile(profile)
    base = replay(tr, make_method("none"), 1)
    ad = summarize(replay(tr, make_method("ngramspec-adaptive"), 1, prof), prof, base)
    assert ad["speedup"] >= 0.99


def test_adaptive_speeds_up_a_copy_task_like_the_best_static_choice():
    rng = np.random.default_rng(4)
    recs = []
    for _ in range(3):
        doc = rng.integers(0, 90000, 400).tolist()
        recs.append({"prompt": doc, "output": doc[:300]})
    tr = _trace(recs)
    prof = SEED
    base = replay(tr, make_method("none"), 1)
    ad = summarize(replay(tr, make_method("ngramspec-adaptive"), 1, prof), prof, base)
    static = max(summarize(replay(tr, make_method(f"ngramspec-chain:k={k}"), 1), prof, base)["speedup"]
                 for k in (2, 4, 8, 16))
    assert ad["speedup"] > 2.0
    assert ad["speedup"] >= 0.9 * static


def test_every_draft_is_judged_while_older_ones_are_pending():
    """Drafts not sent are judged against the tokens that follow, each of them: a new draft every step even
    while older ones are still undecided (judging one at a time would skip the drafts of a good streak)."""
    rng = np.random.default_rng(5)
    passage = rng.integers(100, 5000, 80).tolist()
    cache = NgramCache(max_depth=8)
    ctl = AdaptiveController(prior=lambda b, w: 1.0 if w == 1 else 100.0, explore_frac=0.0, explore_min=0)
    cache.start_request(0, passage + rng.integers(100, 5000, 20).tolist())
    ctl.start(0)
    roots_proposed = 0
    for t in passage[:60]:  # a verbatim copy, decoded one token per step (nothing is sent: verify too dear)
        batch = cache.propose([0], 15)
        plan = ctl.plan([0], batch)
        assert plan.width == 1
        roots_proposed += int(np.sum(batch.parents == -1))
        cache.add_tokens(0, [t])
        ctl.observe_tokens(0, [t])
        ctl.observe_step(1, 1, 1.0)
    depth_one = ctl.calibration.top_trials.reshape(TOP_SHAPE)[:, :, 0, :].sum()
    assert roots_proposed > 50 and depth_one == roots_proposed
    assert ctl.pending(0) > 1  # the copy keeps several drafts alive at once


def test_a_request_whose_drafts_under_deliver_stops_drafting():
    """A cache and calibration learnt on copy-heavy requests, then a request over a small vocabulary: its own
    history matches at every step and the calibration, learnt on copies, predicts its deep drafts to hold, while
    the model follows them for about one token in ten. On a verify that costs about 1.5 decodes (a 2-core CPU) the
    request's own evidence (realized against predicted accepted nodes) stops its drafting within a few steps;
    without the check it drafts all along and runs slower than plain decoding. A copy-heavy request after it keeps
    its speedup."""
    cpu = LinearProfile("cpu-like", decode_ms=62.0, verify_base_ms=77.0, verify_per_token_ms=1.0)

    def run(**kw):
        rng = np.random.default_rng(0)
        cache = NgramCache(max_depth=16)
        ctl = AdaptiveController(prior=cpu.cost_ms, **kw)

        def request(rid, prompt, output):
            cache.start_request(rid, prompt)
            ctl.start(rid)
            log = []
            drive(ctl, cache, rid, output, log, cpu)
            cache.finish_request(rid, share=True)
            ctl.finish(rid)
            speedup = len(output) * cpu.cost_ms(1, 1) / sum(cpu.cost_ms(1, w) for _, w in log)
            return speedup, sum(w > 1 for _, w in log)

        for i in range(4):  # copy-heavy requests: each output copies a long passage of its prompt
            doc = rng.integers(1000, 50000, 400).tolist()
            assert request(i, doc, doc[50:350])[0] > 2.5
        vocab = rng.integers(1000, 50000, 12)
        weak = request("weak", rng.choice(vocab, 300).tolist(), rng.choice(vocab, 200).tolist())
        doc = rng.integers(1000, 50000, 400).tolist()
        return weak, request("copy", doc, doc[50:350])

    (speedup, drafting), copy = run()
    (speedup_off, drafting_off), copy_off = run(request_prior=None)
    assert drafting_off > 40 and speedup_off < 0.96  # without the check: slower than plain decoding
    assert drafting <= 15 and speedup >= 0.975
    assert copy[0] > 2.5 and copy[0] >= 0.98 * copy_off[0]


class _QueueBlind:
    """Hides the queue length from the controller, as a server that does not report it would."""

    waiting = property(lambda self: None, lambda self, value: None)


def test_a_draining_batch_is_not_slowed_down_for_one_request():
    """Eight requests start together, nobody queues; one copies its prompt, seven write text that never
    repeats. Drafting for the copy costs the seven a wider verify every step and buys no time: the copy does
    not finish last. Told that nobody waits, the controller judges widths by the requests' geometric-mean
    speed and does not draft; blind to the queue it maximizes the batch's tokens and drafts."""
    rng = np.random.default_rng(6)
    doc = rng.integers(0, 90000, 400).tolist()
    recs = [{"prompt": doc, "output": doc[:300]}]
    recs += [{"prompt": rng.integers(0, 90000, 50).tolist(), "output": rng.integers(0, 90000, 500).tolist()}
             for _ in range(7)]
    tr = _trace(recs)
    # a verify costs 1.4-1.55 decodes, about what an H200 pays at batch 8 (no shared calibration data needed)
    prof = LinearProfile("cheap-verify", decode_ms=5.8, verify_base_ms=8.0, verify_per_token_ms=0.06)
    base = replay(tr, make_method("none"), 8)
    told = summarize(replay(tr, make_method("ngramspec-adaptive"), 8, prof), prof, base)
    blind_method = make_method("ngramspec-adaptive")
    blind_method.__class__ = type("Blind", (_QueueBlind, type(blind_method)), {})
    blind = summarize(replay(tr, blind_method, 8, prof), prof, base)
    assert told["speedup"] >= 0.99
    assert blind["mean_width"] > 1.0 and blind["speedup"] < told["speedup"]


def test_simulator_method_takes_a_width_set():
    assert make_method("ngramspec-adaptive:widths=1-2-4-17").ctl.widths == [1, 2, 4, 17]
    assert make_method("ngramspec-adaptive:widths=4-8").ctl.widths == [1, 4, 8]  # plain decoding always there
    with pytest.raises(ValueError, match="widths"):
        make_method("ngramspec-adaptive:widths=1-x")


def test_simulator_method_takes_the_step_limits():
    ctl = make_method("ngramspec-adaptive:max_tokens=768,draft_batch=48").ctl
    assert (ctl.max_step_tokens, ctl.max_draft_batch) == (768, 48)
    ctl = make_method("ngramspec-adaptive").ctl
    assert (ctl.max_step_tokens, ctl.max_draft_batch) == (None, None)


# ------------------------------------------------------------------------ the numba controller vs the reference
def _lockstep(records, batch, profile, steps, waiting_of=lambda n_left: n_left, **kw):
    """Replay ``records`` with the pure-Python reference controller and the numba one side by side (each with its
    own cache, fed the same tokens); return both decision logs."""
    import controller_reference as ref

    from ngramspec.controller import CostModel

    widths = DEFAULT_WIDTHS_
    # the reference predates the per-request check of a request's own drafts (request_prior): without it here
    new = AdaptiveController(widths, cost_clip=None, stale_after=None, request_prior=None, **kw)
    old = ref.ReferenceController(widths, costs=CostModel(default_prior, widths=widths, clip=None,
                                                         stale_after=None), **kw)
    caches = [NgramCache(max_depth=16), NgramCache(max_depth=16)]
    pos, active, upcoming, logs = {}, [], 0, ([], [])
    for _ in range(steps):
        while len(active) < batch and upcoming < len(records):
            for c, ctl in zip(caches, (old, new)):
                c.start_request(upcoming, records[upcoming]["prompt"])
                ctl.start(upcoming)
            pos[upcoming] = 0
            active.append(upcoming)
            upcoming += 1
        if not active:
            break
        waiting = waiting_of(len(records) - upcoming)
        plans = []
        for c, ctl, log in zip(caches, (old, new), logs):
            drafts = c.propose(active, 15)
            p = ctl.plan(active, drafts, waiting=waiting)
            plans.append((p, drafts))
            log.append((p.width, p.lengths.tolist(), p.expected, p.cost, p.reason))
        p, drafts = plans[0]
        for i, rid in enumerate(active):
            out = records[rid]["output"]
            d = drafts.draft(i).prefix(int(p.lengths[i]))
            cur, n = -1, 0
            for t in out[pos[rid]:]:
                nxt = next((j for j in range(len(d)) if d.parents[j] == cur and d.tokens[j] == t), -1)
                if nxt < 0:
                    break
                cur, n = nxt, n + 1
            k = min(n + 1, len(out) - pos[rid])
            committed = out[pos[rid]:pos[rid] + k]
            pos[rid] += k
            for c, ctl in zip(caches, (old, new)):
                c.add_tokens(rid, committed)
                ctl.observe_tokens(rid, committed)
        for ctl in (old, new):
            ctl.observe_step(len(active), p.width, profile.cost_ms(len(active), p.width))
        for rid in [r for r in active if pos[r] == len(records[r]["output"])]:
            active.remove(rid)
            for c, ctl in zip(caches, (old, new)):
                c.finish_request(rid)
                ctl.finish(rid)
    cal = new.calibration
    for a, b in ((old.succ, cal.succ), (old.trials, cal.trials), (old.top_trials, cal.top_trials)):
        assert np.array_equal(a, b)
    return logs


DEFAULT_WIDTHS_ = (1, 2, 3, 4, 6, 8, 12, 16)


def _synthetic_records(seed, n=12):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 400, 300).tolist() for _ in range(3)]
    recs = []
    for i in range(n):
        doc = docs[i % 3]
        a = int(rng.integers(0, 150))
        out = doc[a:a + 60] + rng.integers(0, 400, 40).tolist() + doc[a + 60:a + 120]
        recs.append({"prompt": doc[:200] + rng.integers(0, 400, 30).tolist(), "output": out})
    return recs


@pytest.mark.parametrize("batch, waiting", [(1, "queue"), (4, "queue"), (4, "unknown"), (6, "drain"),
                                            (6, "drain-min"), (6, "drain-hmean")])
def test_numba_controller_takes_the_reference_decisions(batch, waiting):
    """The numba kernels (cells, shadow evaluation, cost model, width choice) reproduce the pure-Python
    controller decision for decision, expected tokens and estimated cost bit for bit."""
    waiting_of = {"queue": lambda n: n, "unknown": lambda n: None, "drain": lambda n: 0,
                  "drain-min": lambda n: 0, "drain-hmean": lambda n: 0}[waiting]
    kw = {"drain": waiting[6:]} if waiting.startswith("drain-") else {}
    old, new = _lockstep(_synthetic_records(batch), batch, SEED, 400, waiting_of, **kw)
    assert len(old) > 100 and old == new
    assert len({w for w, *_ in old}) > 2  # the run exercised several widths


def test_numba_controller_takes_the_reference_decisions_on_a_real_trace():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mtbench_vicuna7b.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    from ngramspec.sim.traces import load_trace

    tr = load_trace(str(path)).head(24)
    recs = [{"prompt": r.prompt.tolist(), "output": r.output.tolist()} for r in tr.requests]
    for profile in ("h200-llama8b", "seed-pcie8"):
        old, new = _lockstep(recs, 8, get_profile(profile), 600)
        assert len(old) > 300 and old == new


def test_cost_model_matches_the_reference_when_unclipped():
    import controller_reference as ref

    rng = np.random.default_rng(7)
    for trial in range(20):
        a = CostModel(seed_cost, clip=None, stale_after=None)
        b = ref.ReferenceCostModel(seed_cost)
        for _ in range(int(rng.integers(0, 12))):
            B, w = int(rng.integers(1, 70)), int(rng.choice(DEFAULT_WIDTHS_))
            ms = float(rng.uniform(1, 50))
            a.observe(B, w, ms)
            b.observe(B, w, ms)
        for B in (1, 2, 3, 7, 16, 33, 64, 100):
            for w in DEFAULT_WIDTHS_:
                assert a.estimate(B, w) == b.estimate(B, w), (trial, B, w)
                assert a.measured(B, w) == b.measured(B, w)


# ---------------------------------------------------------------------------------------- bad input, robustness
def _ready(widths=(1, 2, 4, 8)):
    cache, ctl = NgramCache(max_depth=8), AdaptiveController(widths, prior=seed_cost)
    for rid in ("a", "b"):
        cache.start_request(rid, [1, 2, 3, 1, 2, 3, 1, 2])
        ctl.start(rid)
    return cache, ctl


def _state(ctl):
    c = ctl.costs
    cal, pend = ctl.calibration, ctl._pend
    return (cal.succ.copy(), cal.trials.copy(), pend.success.copy(), pend.nd.copy(), pend.nn.copy(),
            c.state.ewma.copy(), c.state.ratio.copy(), c.state.global_ratio.copy(), c.clock, ctl._n_steps,
            len(ctl.trace))


def _same(s1, s2):
    return all(np.array_equal(x, y, equal_nan=True) if isinstance(x, np.ndarray) else x == y for x, y in zip(s1, s2))


@pytest.mark.parametrize("args", [(0, 2, 5.0), (-3, 2, 5.0), (1.5, 2, 5.0), (True, 2, 5.0), (2, 0, 5.0),
                                  (2, -3, 5.0), (2, 99, 5.0), (2, 3, 5.0), (2, 2, 0.0), (2, 2, -1.0),
                                  (2, 2, float("nan")), (2, 2, float("inf")), (2, 2, "5"), (2, 2, None)])
def test_bad_step_reports_are_rejected_and_change_nothing(args):
    cache, ctl = _ready()
    ctl.observe_step(2, 2, 6.0)
    before = _state(ctl)
    with pytest.raises(ValueError):
        ctl.observe_step(*args)
    assert _same(before, _state(ctl))
    plan = ctl.plan(["a", "b"], cache.propose(["a", "b"], 7))  # the controller still works
    assert plan.width in ctl.widths and np.isfinite(plan.cost)


def test_an_empty_batch_plans_a_plain_step():
    cache, ctl = _ready()
    ctl.observe_step(2, 2, 6.0)
    before = _state(ctl)
    plan = ctl.plan([], cache.propose([], 7))
    assert plan.width == 1 and plan.lengths.shape == (0,) and plan.reason == "no-draft"
    assert _same(before, _state(ctl))


def test_a_failed_plan_changes_nothing():
    cache, ctl = _ready()
    batch = cache.propose(["a", "b"], 7)
    assert batch.offsets[-1] > 0
    before = _state(ctl)
    with pytest.raises(ValueError, match="drafts"):
        ctl.plan(["a"], batch)  # two drafts, one request id
    with pytest.raises(ValueError, match="twice"):
        ctl.plan(["a", "a"], batch)
    with pytest.raises(KeyError, match="unknown"):
        ctl.plan(["a", "zz"], batch)
    with pytest.raises(ValueError, match="waiting"):
        ctl.plan(["a", "b"], batch, waiting=-1)
    with pytest.raises(TypeError, match="DraftBatch"):
        ctl.plan(["a", "b"], [batch.draft(0), batch.draft(1)])
    assert _same(before, _state(ctl)) and ctl.pending("a") == 0


@pytest.mark.parametrize("widths", [(0, 2), (-3, 4), (1, 2.5), (1, True), (), (1, 5000)])
def test_bad_widths_are_rejected(widths):
    with pytest.raises(ValueError, match="widths"):
        AdaptiveController(widths)


@pytest.mark.parametrize("tokens", [[-1], [1.5], [1, -1], ["3"], [2**31], np.array([1.5])])
def test_bad_committed_tokens_are_rejected_and_change_nothing(tokens):
    cache, ctl = _ready()
    ctl.plan(["a", "b"], cache.propose(["a", "b"], 7))
    before = _state(ctl)
    with pytest.raises((TypeError, ValueError)):
        ctl.observe_tokens("a", tokens)
    with pytest.raises((TypeError, ValueError)):
        ctl.observe_batch(["a", "b"], [[1], tokens])
    with pytest.raises(ValueError, match="twice"):
        ctl.observe_batch(["a", "a"], [[1], [2]])
    assert _same(before, _state(ctl))


def _copy_run(steps, report, widths=(1, 2, 6), true=lambda w: {1: 10.0, 2: 12.0, 6: 15.0}[w]):
    """One request copying a periodic text (every draft right): widths chosen per step; ``report(step, width)``
    gives the duration reported for the step (the true cost unless it injects a stall)."""
    rng = np.random.default_rng(8)
    period = rng.integers(0, 5000, 50).tolist()
    text = period * (steps * 6 // 50 + 4)
    cache, ctl = NgramCache(max_depth=16), AdaptiveController(widths)
    cache.start_request(0, text[:100])
    ctl.start(0)
    pos, log, committed = 100, [], None
    for step in range(steps):
        batch, plan = ctl.step(cache, [0], None if step == 0 else [committed])
        d = batch.draft(0).prefix(int(plan.lengths[0]))
        cur, n = -1, 0
        for t in text[pos:]:
            nxt = next((j for j in range(len(d)) if d.parents[j] == cur and d.tokens[j] == t), -1)
            if nxt < 0:
                break
            cur, n = nxt, n + 1
        committed = text[pos:pos + n + 1]
        pos += n + 1
        ctl.observe_step(1, plan.width, report(step, plan.width) or true(plan.width))
        log.append(plan.width)
    return log, ctl


def test_one_stall_does_not_ban_a_width():
    """A single 1000 ms step at width 6 (true 15 ms) moves its estimate by a bounded share: width 6 stays."""
    stall = {}

    def report(step, width):
        if width == 6 and step >= 50 and not stall:
            stall["at"] = step
            return 1000.0

    log, ctl = _copy_run(120, report)
    at = stall["at"]
    assert log[at - 10:at] == [6] * 10 and log[at + 1:] == [6] * (len(log) - at - 1)
    assert ctl.costs.estimate(1, 6) < 2 * 15.0


def test_a_stall_as_the_first_sample_of_a_batch_size_is_capped():
    """A plain step at a batch size not seen before that stalls (a compile, a collection: 25x a plain step)
    starts that (B, 1) at no more than twice what its neighbours imply, not at the stall: while the controller
    then drafts at that batch size, plain decoding is not sampled there again to correct it. A first sample
    below what is implied is taken as it is (a stall never makes a step shorter), and a cost that really is
    higher is reached by the samples that follow."""
    cm = CostModel(default_prior)
    for b in (4, 8):
        for _ in range(5):
            cm.observe(b, 1, 2.0)
    implied = cm.estimate(6, 1)
    cm.observe(6, 1, 50.0)
    assert implied < cm.estimate(6, 1) <= 2 * implied + 1e-9
    unclipped = CostModel(default_prior, clip=None)
    for b in (4, 8):
        for _ in range(5):
            unclipped.observe(b, 1, 2.0)
    unclipped.observe(6, 1, 50.0)
    assert unclipped.estimate(6, 1) == 50.0  # (the cap is the clip's)
    cm.observe(12, 1, 0.5)
    assert cm.estimate(12, 1) == 0.5
    truth = 6 * cm.estimate(16, 1)
    for _ in range(30):
        cm.observe(16, 1, truth)
    assert cm.estimate(16, 1) == pytest.approx(truth, rel=0.05)
    first = CostModel(default_prior)
    first.observe(3, 4, 40.0)  # nothing measured before: the very first sample is all there is to go by
    assert first.estimate(3, 4) == 40.0
    stale = CostModel(default_prior, stale_after=5)  # a re-measurement that stalls is capped alike
    stale.observe(1, 2, 12.0)
    for _ in range(6):
        stale.observe(1, 1, 10.0)
    stale.observe(1, 2, 500.0)
    assert stale.estimate(1, 2) == 24.0
    for _ in range(6):
        stale.observe(1, 1, 10.0)
    stale.observe(1, 2, 3.0)  # a restart below the old value is taken as it is
    assert stale.estimate(1, 2) == 3.0


def test_a_width_first_measured_in_a_stall_is_re_measured():
    """Worst case: the first sample of width 6 is a 1000 ms stall. It is capped at twice what the other widths
    imply (still about 4x the true 15 ms), and a first sample at the cap is suspect: it is re-measured after a
    tenth of the stale wait (50 steps, not 500), within the bounded exploration share, and then chosen again."""
    first = {}

    def report(step, width):
        if width == 6 and not first:
            first["at"] = step
            return 1000.0

    log, ctl = _copy_run(1200, report)
    at = first["at"]
    assert first and log[at + 1: at + 45].count(6) == 0  # banned for a while...
    assert log[at + 45: at + 70].count(6) > 0  # ...re-measured soon...
    assert log[-200:] == [6] * 200  # ...and chosen for good
    assert ctl._n_explored <= ctl.explore_min + ctl.explore_frac * ctl._n_steps + 1


def test_a_stall_on_a_widths_second_sample_waits_the_whole_stale_interval():
    """Only a first sample at the cap is suspect: a stall on a later sample is clipped (`cost_clip`) and re-checked
    at the usual pace, so one more measured stall never triggers early re-measurement."""
    from ngramspec.controller.cost import CostModel, default_prior

    cm = CostModel(default_prior, widths=(1, 2, 6), clip=2.0, stale_after=500)
    for width, ms in ((1, 10.0), (1, 10.0), (2, 12.0), (6, 15.0), (6, 1000.0)):
        cm.observe(1, width, ms)
    for _ in range(100):
        cm.observe(1, 2, 12.0)
    assert not cm.row(1).stale[2]  # width 6: not stale 100 samples on
    cold = CostModel(default_prior, widths=(1, 2, 6), clip=2.0, stale_after=500)
    for width, ms in ((1, 10.0), (1, 10.0), (2, 12.0), (6, 1000.0)):
        cold.observe(1, width, ms)
    for _ in range(100):
        cold.observe(1, 2, 12.0)
    assert cold.row(1).stale[2]  # a first sample at the cap: stale after 50


def test_first_propose_and_plan_after_warm_up_is_fast():
    """warm_up() compiles (or loads) every kernel of cache and controller: in a fresh process the first
    propose + plan, the first whole step, the first step whose pending pools must grow (steps with no new
    tokens pile drafts up) and the first whose tokens need a larger hash view of the trie, take well under 50 ms
    each."""
    import os
    import subprocess
    import sys

    code = """
import time
try:  # as in a server or the engine
    import torch  # noqa: F401
except ImportError:
    pass
from ngramspec.cache import NgramCache
from ngramspec.controller import AdaptiveController
from ngramspec.warmup import warm_up
warm_up()
cache, ctl = NgramCache(), AdaptiveController()
cache.start_request(9, [1, 2])  # a step whose tokens need more than the trie's hash view holds: it grows first
ctl.start(9)
size = cache._l_table.size
t = time.perf_counter()
ctl.step(cache, [9], [list(range(size // cache.max_depth))], waiting=0)
hgrow = time.perf_counter() - t
assert cache._l_table.size > size
for rid in (0, 1, 2):
    cache.start_request(rid, list(range(40)) * 3)
    ctl.start(rid)
t0 = time.perf_counter()
batch, plan = ctl.step(cache, [0, 1], [[0, 1], [0]], waiting=0)
ctl.observe_step(2, plan.width, 12.5)
t1 = time.perf_counter()
pools = ctl._pend.tok.shape
while ctl._pend.tok.shape == pools:
    t = time.perf_counter()
    ctl.step(cache, [0, 1], None, waiting=0)
    grow = time.perf_counter() - t
t2 = time.perf_counter()
plan = ctl.plan([2], cache.propose([2], 15), waiting=3)
t3 = time.perf_counter()
print(t3 - t2, t1 - t0, grow, hgrow)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in (_ROOT,)] + [os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    first, step, grow, hgrow = map(float, out.stdout.split())
    assert first < 0.05 and step < 0.05 and grow < 0.05 and hgrow < 0.05, (first, step, grow, hgrow)


from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]


def test_simulator_charges_measured_host_time():
    """--host-cost measured: each step also costs the host time the method took; both speedups reported."""
    import gzip
    import json

    from ngramspec.sim.simulate import main

    def write_trace(path, records):
        with gzip.open(path, "wt") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")

    rng = np.random.default_rng(9)
    doc = rng.integers(0, 90000, 300).tolist()
    recs = [{"prompt": doc, "output": doc[:200]}, {"prompt": doc[:50], "output": rng.integers(0, 90000, 100).tolist()}]
    tr = _trace(recs)
    base = replay(tr, make_method("none"), 2)
    run = replay(tr, make_method("ngramspec-adaptive"), 2, SEED)
    plain = summarize(run, SEED, base)
    both = summarize(run, SEED, base, host_cost="measured")
    assert "speedup_with_host" not in plain and both["speedup_no_host"] == plain["speedup"]
    assert both["host_ms"] == pytest.approx(run.proposer_s * 1e3) and both["host_ms"] > 0
    base_ms, ms = SEED.total_ms(base.step_counts), SEED.total_ms(run.step_counts)
    assert both["speedup"] == both["speedup_with_host"] == pytest.approx(
        (base_ms + base.proposer_s * 1e3) / (ms + run.proposer_s * 1e3))
    with pytest.raises(ValueError, match="host_cost"):
        summarize(run, SEED, base, host_cost="guess")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/t.jsonl.gz"
        write_trace(path, recs)
        assert main([path, "--method", "ngramspec-adaptive", "--profile", "seed-pcie8", "--host-cost", "measured",
                     "--no-progress", "--json", f"{d}/rows.json"]) == 0
        rows = json.load(open(f"{d}/rows.json"))
        assert all(r["speedup_with_host"] < r["speedup_no_host"] for r in rows)


def test_drain_min_judges_a_draining_batch_by_its_slowest_request():
    """drain="min" drafts less than "gmean" in a draining batch (a request without a draft holds the minimum at
    plain speed), and changes nothing while requests wait."""
    recs = _synthetic_records(6)
    gmean, _ = _lockstep(recs, 6, SEED, 300, lambda n: 0)
    lo, _ = _lockstep(recs, 6, SEED, 300, lambda n: 0, drain="min")
    assert sum(w for w, *_ in lo) < sum(w for w, *_ in gmean)
    queued, _ = _lockstep(recs, 6, SEED, 300, lambda n: n + 1)
    queued_min, _ = _lockstep(recs, 6, SEED, 300, lambda n: n + 1, drain="min")
    assert queued == queued_min
    with pytest.raises(ValueError, match="drain"):
        AdaptiveController(drain="max")


def _copying_batch(ctl, B, steps, fast, rng_seed=7):
    """``B`` requests copying passages they have seen (every draft token right), verify cost flat in width (the
    widest pays most); the widths the controller chose, step by step (``fast``: through ``step``, else ``plan``)."""
    rng = np.random.default_rng(rng_seed)
    cache = NgramCache(max_depth=16)
    texts = [rng.integers(1000, 50000, 400).tolist() for _ in range(B)]
    for r in range(B):
        cache.start_request(r, texts[r] + texts[r][:5])  # the passage, then its start again: copying from there
        ctl.start(r)
    rids, pos, log, commit = list(range(B)), [5] * B, [], None
    for _ in range(steps):
        if fast:
            batch, plan = ctl.step(cache, rids, commit)
        else:
            batch = cache.propose(rids, ctl.max_width - 1)
            plan = ctl.plan(rids, batch)
        drafts = [batch.draft(i).prefix(int(plan.lengths[i])).tokens.tolist() for i in rids]
        assert all(d == texts[i][pos[i]:pos[i] + len(d)] for i, d in enumerate(drafts)), "a copy's drafts are right"
        commit = [texts[i][pos[i]:pos[i] + 1 + len(drafts[i])] for i in rids]
        for i in rids:
            pos[i] += len(commit[i])
            if not fast:
                cache.add_tokens(i, commit[i])
                ctl.observe_tokens(i, commit[i])
        ctl.observe_step(B, plan.width, 10.0)
        log.append(plan.width)
    return log


@pytest.mark.parametrize("fast", [False, True])
def test_max_step_tokens_bounds_batch_times_width(fast):
    def run(B, **kw):
        return _copying_batch(AdaptiveController(prior=lambda b, w: 10.0, **kw), B, 14, fast)

    free = run(16, explore_frac=0.5)
    assert max(free) > 8, f"without a limit the widest verify should win here, got {free}"
    capped = run(16, explore_frac=0.5, max_step_tokens=64)
    assert max(capped) <= 4 and capped.count(4) >= len(capped) // 2, capped
    one = run(1, max_step_tokens=64)
    assert max(one) == 16, f"one request may verify 16 tokens under a limit of 64, got {one}"
    # max_draft_batch: a batch above it decodes plainly, one at or below it drafts as before
    assert set(run(16, explore_frac=0.5, max_draft_batch=15)) == {1}
    assert run(16, explore_frac=0.5, max_draft_batch=16) == free


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "64"])
@pytest.mark.parametrize("name", ["max_step_tokens", "max_draft_batch"])
def test_bad_step_limits_are_rejected(bad, name):
    with pytest.raises(ValueError, match=name):
        AdaptiveController(**{name: bad})
