"""The SGLang worker's host-side logic (cache bookkeeping, width choice, TP determinism) on CPU, no sglang."""
import json

import numpy as np
import pytest

from ngramspec.cache import NgramCache
from ngramspec.controller import AdaptiveController, Plan
from ngramspec.layout import layout_flat
from ngramspec_sglang.config import AdaptiveConfig, resolve_config, widths_up_to
from ngramspec_sglang.drafting import (
    DraftPlanner,
    FixedWidthController,
    RequestView,
    make_controller,
)


class RecordingController:
    """Chooses scripted widths (same interface as AdaptiveController) and records what it is told."""

    def __init__(self, widths_to_choose):
        self.widths = list(widths_to_choose)
        self.tokens, self.steps, self.started, self.finished, self.waiting = [], [], [], [], []

    def start(self, rid):
        self.started.append(rid)

    def finish(self, rid):
        self.finished.append(rid)

    def plan(self, rids, batch, waiting=None):
        self.waiting.append(waiting)
        width = self.widths.pop(0)
        return Plan(width, np.minimum(np.diff(batch.offsets), width - 1), float(len(rids)), 1.0, "scripted")

    def observe_tokens(self, rid, committed):
        self.tokens.append((rid, list(committed)))

    def observe_step(self, batch, width, duration_ms):
        self.steps.append((batch, width, duration_ms))


def planner(widths=(1, 2, 4, 8), controller=None, **kw):
    return DraftPlanner(AdaptiveConfig(widths=widths, max_depth=8, capacity=1 << 16), controller=controller, **kw)


def test_cache_sees_each_committed_token_once_with_and_without_relay():
    p = planner(controller=FixedWidthController(8))
    prompt = [5, 6, 7, 8]
    p.plan([RequestView("r", prompt, [])])
    # overlap mode: the last step's tokens arrive first as `pending`, then show up in `output`
    p.plan([RequestView("r", prompt, [], pending=[9, 10])])
    p.plan([RequestView("r", prompt, [9, 10], pending=[11])])
    p.plan([RequestView("r", prompt, [9, 10, 11, 12], pending=[])])
    assert p.cache.history("r").tolist() == [5, 6, 7, 8, 9, 10, 11, 12]


def test_realized_acceptance_is_committed_growth_minus_bonus():
    ctrl = RecordingController([8, 8, 8])
    p = planner(controller=ctrl)
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    first = p.plan([RequestView("a", seq, []), RequestView("b", [9, 8, 7], [])])
    assert first.drafted.tolist()[0] == 7  # the repeated pattern fills the chain
    p.plan([RequestView("a", seq, [4, 1, 2]), RequestView("b", [9, 8, 7], [6])])
    assert ctrl.started == ["a", "b"]
    assert ctrl.tokens == [("a", [4, 1, 2]), ("b", [6])]  # the controller sees exactly the committed tokens
    assert p.stats.realized_accepted == 2 and p.stats.observed_requests == 2
    p.release(["a"])
    assert ctrl.finished == ["a"]


def test_width_one_is_a_root_only_step():
    p = planner(controller=RecordingController([1]))
    plan = p.plan([RequestView("a", [1, 2, 1, 2, 1], []), RequestView("b", [3, 4], [5])])
    assert plan.width == 1
    assert plan.tokens.tolist() == [[1], [5]]
    assert plan.mask.tolist() == [[[True]], [[True]]]
    assert plan.drafted.tolist() == [0, 0]
    # the same arrays the layout kernel makes for width 1, whatever the batch size; shared ones are read-only
    p = planner(controller=FixedWidthController(1))
    for views in ([RequestView("c", [7, 8], [])], [RequestView(k, [3, k], [4]) for k in range(5)]):
        plan = p.plan(views)
        lay = layout_flat(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(len(views) + 1, np.int64),
                          np.zeros(len(views), np.int64), np.array([v.last_token() for v in views]), 1)
        for name in ("tokens", "mask", "depths", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
            np.testing.assert_array_equal(getattr(plan, name), getattr(lay, name))
            assert getattr(plan, name).dtype == getattr(lay, name).dtype, name
        for shared in (plan.depths, plan.mask):
            with pytest.raises(ValueError):
                shared[0, 0] = 1


def test_layout_rows_hold_root_then_prefix_of_the_draft():
    p = planner(controller=FixedWidthController(4))
    plan = p.plan([RequestView("a", [1, 2, 3, 1, 2, 3, 1, 2], [])])
    assert plan.tokens.shape == (1, 4) and plan.mask.shape == (1, 4, 4)
    assert plan.tokens[0, 0] == 2  # the root is the last committed token
    assert plan.tokens[0, 1:].tolist() == [3, 1, 2]
    assert plan.depths[0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("width, lengths, message", [
    (5, None, "not one of"),
    (4, [4], "do not fit"),
    (4, [1, 1], "draft lengths for 1 requests"),
])
def test_bad_controller_answers_raise(width, lengths, message):
    class Bad(RecordingController):
        def plan(self, rids, batch, waiting=None):
            return Plan(width, np.array(lengths if lengths is not None else [0] * len(rids)), 1.0, 1.0, "bad")

    p = planner(controller=Bad([]))
    with pytest.raises(ValueError, match=message):
        p.plan([RequestView("a", [1, 2, 1, 2], [])])


def run_ranks(timings_of_rank, share_rank0, steps=60):
    """Planners with the real AdaptiveController, fed identical tokens and rank-local step timings."""
    mailbox = {}
    cfg = AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, tp_sync_interval=2, capacity=1 << 16)

    def broadcast(rank):
        def fn(obj):
            if rank == 0:
                mailbox["v"] = obj
                return obj
            return mailbox["v"] if share_rank0 else obj
        return fn

    ranks = [DraftPlanner(cfg, is_timing_rank=True, broadcast=broadcast(r)) for r in range(len(timings_of_rank))]
    text = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    outs = {"x": [], "y": []}
    plans = [[] for _ in ranks]
    for step in range(steps):
        for r, p in enumerate(ranks):  # rank 0 first in each step, as the collective orders it
            plan = p.plan([RequestView("x", text, outs["x"]), RequestView("y", [7, 7, 7, 8], outs["y"])])
            plans[r].append(plan)
            p.record_duration(plan.width, 2, timings_of_rank[r](plan.width))
        outs["x"].append(text[len(outs["x"]) % len(text)])
        outs["y"].append(step % 5)
    return plans


def test_tensor_parallel_ranks_make_identical_decisions():
    """Rank-local timings disagree; only rank 0's reach the controllers, so every decision agrees."""
    def steep(w):  # rank 0: wide verifies are expensive
        return 0.01 * w * w

    def flat(w):  # rank 1: its own clock says width is free
        return 0.01

    shared = run_ranks([steep, flat], share_rank0=True)
    for a, b in zip(*shared):
        assert a.width == b.width and a.reason == b.reason
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.mask, b.mask)
        np.testing.assert_array_equal(a.drafted, b.drafted)
    # control: had rank 1 used its own timings, decisions would have diverged
    local = run_ranks([steep, flat], share_rank0=False)
    assert any(a.width != b.width for a, b in zip(*local))


def test_released_output_is_drafted_for_a_new_request():
    p = planner(controller=FixedWidthController(8))
    p.plan([RequestView("old", [100, 101], [7, 8, 9, 10, 11, 12])])
    p.release(["old"])
    assert "old" not in p.tracked_requests and "old" not in p.cache
    plan = p.plan([RequestView("new", [50, 7, 8, 9], [])])
    assert plan.tokens[0, 1:4].tolist() == [10, 11, 12]


def test_interval_stats_mean_width_makes_sglang_rate_exact():
    p = planner(controller=RecordingController([8, 4]))
    stats = p.stats
    p.plan([RequestView("a", [1, 2, 1, 2, 1, 2], []), RequestView("b", [3], [])])
    p.plan([RequestView("a", [1, 2, 1, 2, 1, 2], [1]), RequestView("b", [3], [4])])
    # SGLang: accept_rate = correct / (forward_ct * (num_draft_tokens - 1)); forward_ct counts requests
    assert stats.verified_requests == 4 and stats.drafted_tokens > 0
    assert stats.verified_requests * (stats.mean_width() - 1) == pytest.approx(stats.drafted_tokens)
    summary = stats.summary()
    assert summary["mean_verify_width"] == pytest.approx((8 * 2 + 4 * 2) / 4)
    stats.reset()
    assert stats.verified_requests == 0 and stats.mean_width() == 1.0


def test_default_controller_is_the_adaptive_one_and_bad_options_raise():
    assert isinstance(make_controller(AdaptiveConfig(widths=(1, 4))), AdaptiveController)
    assert isinstance(make_controller(AdaptiveConfig(widths=(1, 4), fixed_width=4)), FixedWidthController)
    with pytest.raises(ValueError, match="controller"):
        make_controller(AdaptiveConfig(widths=(1, 4), controller={"no_such_knob": 1}))
    assert AdaptiveConfig(widths=(4, 8)).widths == (1, 4, 8)  # plain decode always available


def test_views_reject_empty_requests_and_batches():
    p = planner()
    with pytest.raises(ValueError):
        p.plan([])
    with pytest.raises(ValueError, match="no tokens"):
        p.plan([RequestView("e", [], [])])


def test_widths_up_to_and_resolve_config(tmp_path):
    assert widths_up_to(16) == (1, 2, 3, 4, 6, 8, 12, 16)
    assert widths_up_to(10) == (1, 2, 3, 4, 6, 8, 10)
    with pytest.raises(ValueError):
        widths_up_to(0)

    class Args:
        speculative_num_draft_tokens = None
        speculative_adaptive_config = None
        speculative_ngram_max_bfs_breadth = 1
        speculative_ngram_max_trie_depth = 12

    cfg = resolve_config(Args())
    assert cfg.max_width == 16 and cfg.tree is False and cfg.max_depth == 12
    assert cfg.cache_sizes() == {"local_nodes": 5_000_000, "shared_nodes": 5_000_000, "shared_tokens": 2_500_000}
    Args.speculative_ngram_capacity = 100
    with pytest.raises(ValueError, match="capacity"):
        resolve_config(Args())
    Args.speculative_ngram_capacity = 1 << 16
    assert resolve_config(Args()).cache_sizes()["local_nodes"] == 1 << 15

    path = tmp_path / "ngram.json"
    path.write_text(json.dumps({"widths": [1, 4, 8], "fixed_width": 4, "controller": {"alpha": 0.1}}))
    Args.speculative_adaptive_config = str(path)
    cfg = resolve_config(Args())
    assert cfg.widths == (1, 4, 8) and cfg.fixed_width == 4 and cfg.controller == {"alpha": 0.1}

    path.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}}))
    with pytest.raises(ValueError, match="EAGLE"):
        resolve_config(Args())
    path.write_text(json.dumps({"widths": [1, 4], "fixed_width": 3}))
    with pytest.raises(ValueError, match="fixed_width"):
        resolve_config(Args())
    Args.speculative_adaptive_config = str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no such file"):
        resolve_config(Args())


def test_planner_uses_the_cache_it_is_given():
    cache = NgramCache(max_depth=4, max_requests=4)
    p = DraftPlanner(AdaptiveConfig(widths=(1, 4), max_depth=4), cache=cache, controller=FixedWidthController(4))
    p.plan([RequestView("a", [1, 2, 1, 2], [])])
    assert "a" in cache


def test_requests_the_cache_has_no_room_for_are_served_without_drafts():
    cache = NgramCache(max_depth=4, max_requests=2, local_nodes=64)
    ctrl = RecordingController([4, 4, 4])
    p = DraftPlanner(AdaptiveConfig(widths=(1, 4), max_depth=4), cache=cache, controller=ctrl)
    views = [RequestView(r, [1, 2, 1, 2, 1], []) for r in ("a", "b", "c")]
    plan = p.plan(views)  # "c" does not fit (max_requests=2): no exception, no draft for it
    assert plan.drafted.tolist()[2] == 0 and plan.drafted.tolist()[0] > 0
    assert plan.tokens[2].tolist() == [1, 0, 0, 0]  # root, then padding
    assert "c" not in cache and ctrl.started == ["a", "b", "c"]
    p.plan([RequestView(r, [1, 2, 1, 2, 1], [2]) for r in ("a", "b", "c")])
    p.release(["a", "c"])
    assert ctrl.finished == ["a", "c"]
    plan = p.plan([RequestView("d", [3, 4, 3, 4, 3], [])])  # room again
    assert "d" in cache and plan.drafted.tolist() == [3]


def test_the_queue_length_reaches_the_controller():
    ctrl = RecordingController([1, 1])
    p = planner(controller=ctrl)
    p.plan([RequestView("r", [1, 2, 3], [])], waiting=5)
    p.plan([RequestView("r", [1, 2, 3], [4])])
    assert ctrl.waiting == [5, None]


@pytest.mark.parametrize("args", [(3, 2, 0.01), (0, 2, 0.01), (True, 2, 0.01), (2, 0, 0.01), (2, -1, 0.01),
                                  (2, 2, 0.0), (2, 2, -0.01), (2, 2, float("nan")), (2, 2, float("inf")),
                                  (2, 2, "0.01"), (2, 2.5, 0.01)])
def test_bad_durations_are_rejected(args):
    p = planner()
    p.plan([RequestView("a", [1, 2, 1, 2], [])])
    with pytest.raises(ValueError):
        p.record_duration(*args)
    assert p._local_durations == []
    p.record_duration(2, 1, 0.01)
    assert len(p._local_durations) == 1


def _drive(p, steps=40):
    text = [3, 1, 4, 1, 5, 9, 2, 6] * 4
    outs = {"x": [], "y": []}
    plans = []
    for step in range(steps):
        views = [RequestView("x", text, outs["x"]), RequestView("y", [7, 7, 7, 8], outs["y"])]
        plan = p.plan(views, waiting=step % 3)
        plans.append((plan.width, plan.drafted.tolist(), plan.tokens.tolist(), plan.mask.tolist(), plan.reason))
        p.record_duration(plan.width, 2, 0.01 + 0.001 * plan.width)
        outs["x"].append(text[len(outs["x"]) % len(text)])
        outs["y"].append(step % 5)
        if step == 25:
            p.release(["y"])
            outs["y"] = []
    return plans


def test_prefetch_before_every_plan_changes_no_plan():
    """`DraftPlanner.prefetch` (what the worker runs while it waits for the previous step's tokens) before every
    plan, with the batch's ids (known, new, released): the same plans, cache and controller state as without."""
    class Prefetching(DraftPlanner):
        def plan(self, views, waiting=None, after_draft=False):
            self.prefetch([v.rid for v in views])
            return super().plan(views, waiting, after_draft)

    plain, pre = planner(), Prefetching(AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, capacity=1 << 16))
    assert _drive(pre) == _drive(plain)
    assert pre.cache.stats() == plain.cache.stats()
    a, b = pre.controller.state_dict(), plain.controller.state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f") for k in a)


def test_prefetch_runs_the_controllers_dry_step_only_for_tracked_batches():
    calls = []

    class Spy(AdaptiveController):
        def prefetch(self, cache, rids):
            calls.append(list(rids))
            super().prefetch(cache, rids)

    p = DraftPlanner(AdaptiveConfig(widths=(1, 2, 4), max_depth=8, capacity=1 << 16), controller=Spy((1, 2, 4)))
    p.prefetch(("a",))  # Spy is not exactly AdaptiveController: the generic path has no dry step
    assert calls == []
    q = planner()
    q.plan([RequestView("a", [1, 2, 3, 1, 2, 3], [])])
    seen = []
    q.controller.prefetch = lambda cache, rids: seen.append(list(rids))
    q.prefetch(("a",))
    q._untracked.add("b")
    q.prefetch(("a", "b"))  # a request served without drafts: nothing to warm
    assert seen == [["a"]]


def test_fast_path_plans_like_the_per_request_calls():
    """The planner's one-call step (AdaptiveController.step + the layout kernel) plans exactly as the generic
    path (observe_tokens per request, propose, plan, layout of each draft)."""
    class Generic(AdaptiveController):  # not exactly AdaptiveController: the planner takes the generic path
        pass

    def layout(drafts, roots, width):
        from ngramspec.layout import tree_layout
        return tree_layout(drafts, roots, width)

    fast = _drive(planner())
    slow = _drive(planner(controller=Generic((1, 2, 4, 8)), layout=layout))
    assert fast == slow and {w for w, *_ in fast} != {1}


def test_warm_up_leaves_the_planner_as_it_was():
    p = planner()
    p.plan([RequestView("a", [1, 2, 3, 1, 2, 3], [])])
    p.record_duration(2, 1, 0.01)
    before = (p.tracked_requests, p.cache.stats(), p.controller.calibration.trials.copy(), p.controller.costs.clock,
              p.stats.summary(), p._steps, list(p._local_durations), dict(p._fed))
    p.warm_up()
    after = (p.tracked_requests, p.cache.stats(), p.controller.calibration.trials.copy(), p.controller.costs.clock,
             p.stats.summary(), p._steps, list(p._local_durations), dict(p._fed))
    assert before[0] == after[0] and before[1] == after[1] and np.array_equal(before[2], after[2])
    assert before[3:] == after[3:]
    assert p.plan([RequestView("a", [1, 2, 3, 1, 2, 3], [1])]).width in (1, 2, 4, 8)


def test_first_plan_after_warm_up_is_fast():
    """In a fresh process, after DraftPlanner.warm_up() the first plan (new requests: cache, controller and
    layout kernels all used) takes well under 50 ms."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = """
import time
from ngramspec_sglang.config import AdaptiveConfig
from ngramspec_sglang.drafting import DraftPlanner, RequestView
p = DraftPlanner(AdaptiveConfig(widths=(1, 2, 4, 8, 16), max_depth=16))
p.warm_up()
t0 = time.perf_counter()
p.plan([RequestView("a", [1, 2, 3] * 20, [1]), RequestView("b", [5, 6, 7] * 9, [])], waiting=0)
t1 = time.perf_counter()
p.record_duration(2, 2, 0.01)
p.plan([RequestView("a", [1, 2, 3] * 20, [1, 2]), RequestView("b", [5, 6, 7] * 9, [5])], waiting=1)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "integration"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    first, second = map(float, out.stdout.split())
    assert first < 0.05 and second < 0.05, (first, second)


def test_the_plugin_uses_the_cores_fixed_width_controller():
    """One fixed-width controller: the plugin's fixed_width knob builds the core's class."""
    from ngramspec.controller import FixedWidthController as CoreFixedWidth

    assert FixedWidthController is CoreFixedWidth
    ctl = make_controller(AdaptiveConfig(widths=(1, 4), fixed_width=4))
    assert type(ctl) is CoreFixedWidth and ctl.width == 4


def tp_planners(cfg, n=2):
    """``n`` planners as on ``n`` TP ranks: rank 0 times steps and its broadcast reaches every rank (each rank's
    planner calls it in turn within a step, rank 0 first)."""
    mailbox = {}

    def broadcast(rank):
        def fn(obj):
            if rank == 0:
                mailbox["v"] = obj
            return mailbox["v"]
        return fn

    return [DraftPlanner(cfg, is_timing_rank=r == 0, broadcast=broadcast(r)) for r in range(n)]


def test_tensor_parallel_ranks_charge_the_same_waits():
    """Waits after drafting steps (`record_wait`) are shared like durations: ranks whose own clocks disagree
    still charge the same switch cost and make identical decisions; bad waits are rejected like durations."""
    ranks = tp_planners(AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, tp_sync_interval=2, capacity=1 << 16,
                                       charge_waits_to_drafts=True))
    waits = [0.05, 0.001]  # rank 0 sees long waits after drafting steps, rank 1 none
    text = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    outs = {"x": [], "y": []}
    plans = [[] for _ in ranks]
    last = [1, 1]
    for step in range(80):
        for r, p in enumerate(ranks):
            plan = p.plan([RequestView("x", text, outs["x"]), RequestView("y", [7, 7, 7, 8], outs["y"])],
                          after_draft=last[r] > 1)
            plans[r].append((plan.width, plan.drafted.tolist(), plan.tokens.tolist()))
            if plan.width == 1 and last[r] > 1:
                p.record_wait(2, 0.01 + waits[r])
            else:
                p.record_duration(plan.width, 2, 0.01 + 0.004 * plan.width)
            last[r] = plan.width
        outs["x"].append(text[len(outs["x"]) % len(text)] if step % 20 < 10 else 100 + step)  # copies, then not
        outs["y"].append(step % 5)
    assert plans[0] == plans[1]
    assert ranks[0]._wait_any is not None and ranks[0]._wait_any == ranks[1]._wait_any
    for bad in ((0, 0.01), (2, 0.0), (2, float("nan")), (True, 0.01)):
        n = len(ranks[0]._local_durations)
        with pytest.raises(ValueError):
            ranks[0].record_wait(*bad)
        assert len(ranks[0]._local_durations) == n


def test_fits_prepared_is_within_a_factor_two_and_both_drafting():
    from ngramspec_sglang.drafting import fits_prepared

    assert fits_prepared(8, 8) and fits_prepared(8, 4) and fits_prepared(8, 16) and fits_prepared(2, 4)
    assert not fits_prepared(8, 2) and not fits_prepared(2, 8) and not fits_prepared(16, 4)
    assert not fits_prepared(1, 2) and not fits_prepared(2, 1) and not fits_prepared(1, 1)


def _fit_pair(width, fit_width, widths=(1, 2, 4, 8, 16), max_step_tokens=None):
    """The same two steps planned twice (two requests), the second once as chosen and once fitted to
    ``fit_width``."""
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3] * 3
    plans = []
    for fit in (None, fit_width):
        ctl = RecordingController([width, width])
        if max_step_tokens is not None:
            ctl.max_step_tokens = max_step_tokens
        p = planner(widths=widths, controller=ctl)
        p.plan([RequestView("r", text, []), RequestView("s", text[:20], [])])
        plans.append((p, p.plan([RequestView("r", text, [3, 1]), RequestView("s", text[:20], [])],
                                fit_width=fit)))
    return plans


@pytest.mark.parametrize("width, fit_width", [(8, 4), (8, 16), (4, 8), (16, 8)])
def test_a_plan_fitted_to_a_prepared_width_keeps_its_best_drafts(width, fit_width):
    """A verify prepared at another width before the wait takes the plan (`fit_width`): laid out at the prepared
    width, drafts beyond it cut (their best-ranked prefix kept), shorter ones padded; what the planner remembers
    drafting (for the acceptance it learns next step) is what was laid out."""
    (p0, own), (p1, fitted) = _fit_pair(width, fit_width)
    assert own.width == width and not p0.fitted
    assert fitted.width == fit_width and p1.fitted
    assert own.drafted.max() > 0
    assert fitted.drafted.tolist() == np.minimum(own.drafted, fit_width - 1).tolist()
    for i, k in enumerate(fitted.drafted.tolist()):
        # the root and the kept drafts: the same tokens in the same places
        assert fitted.tokens[i, : k + 1].tolist() == own.tokens[i, : k + 1].tolist()
        assert fitted.mask[i, : k + 1, : k + 1].tolist() == own.mask[i, : k + 1, : k + 1].tolist()
    assert [p1._last[r][1] for r in ("r", "s")] == fitted.drafted.tolist()


@pytest.mark.parametrize("width, fit_width", [(8, 2), (2, 8), (1, 4)])
def test_a_plan_far_from_the_prepared_width_keeps_its_own(width, fit_width):
    (_, own), (p1, plan) = _fit_pair(width, fit_width)
    assert plan.width == width and not p1.fitted
    assert plan.tokens.tolist() == own.tokens.tolist() and plan.drafted.tolist() == own.drafted.tolist()


def test_a_prepared_width_above_the_controllers_token_limit_is_not_taken():
    """A controller with ``max_step_tokens`` never verifies more tokens than that: a verify prepared wider than the
    limit allows for the batch is not fitted to (two requests at width 16 are 32 tokens)."""
    (_, own), (p1, plan) = _fit_pair(8, 16, max_step_tokens=16)
    assert plan.width == 8 and not p1.fitted and plan.tokens.tolist() == own.tokens.tolist()
    (_, own), (p1, plan) = _fit_pair(8, 16, max_step_tokens=32)
    assert plan.width == 16 and p1.fitted


def test_recycling_drafts_where_the_ngram_cache_has_nothing():
    """With `recycle`, the planner keeps a token-recycling table (`recycle_update`: a step's scored rows) and a
    request the n-gram cache cannot draft for gets the table's tree, which the controller plans over (here a fixed
    width: all of it; the adaptive controller takes the same merged batch)."""
    cfg = AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, capacity=1 << 16, recycle=True, recycle_topk=2,
                         recycle_branching=(2, 1))
    with pytest.raises(ValueError, match="vocabulary"):
        DraftPlanner(cfg)
    for controller in (FixedWidthController(8), None):
        p = DraftPlanner(cfg, controller=controller, vocab_size=64)
        p.warm_up()  # the server's worker does this first: its scratch planner needs the vocabulary size too
        p.recycle_update(np.array([9, 20, 21]), np.array([[20, 21], [30, 31], [40, 41]]))
        plan = p.plan([RequestView("r", [1, 2, 3, 9], [])])  # 9 is new to the cache: no n-gram draft
        assert p.recycled_requests == 1 and p.cache.propose(["r"], 7).offsets[-1] == 0
        if controller is not None:
            assert plan.width == 8 and int(plan.drafted[0]) == 4
            assert plan.tokens[0, :5].tolist() == [9, 20, 21, 30, 40]  # the root, its two candidates, theirs
    untouched = DraftPlanner(AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, capacity=1 << 16))
    assert untouched.recycle_table is None
    untouched.recycle_update(np.array([9]), np.array([[20, 21]]))  # no table: nothing to update
    for bad in ({"recycle": 1}, {"recycle_topk": 0}, {"recycle_branching": []}, {"recycle_branching": "4-1"},
                {"recycle_min_match": 0}, {"recycle_widen": "yes"}):
        with pytest.raises(ValueError, match="recycle"):
            AdaptiveConfig(widths=(1, 2), **bad)


@pytest.mark.parametrize("s_tokens, recycled_accepted", [([13, 15, 1], 2), ([14, 2], 1), ([2], 0)])
def test_the_stats_say_which_source_drafted_the_accepted_tokens(s_tokens, recycled_accepted):
    """With `recycle`, the interval stats split drafted and accepted draft tokens by source (the gauges'
    `*_by_source`): "r" drafts from the n-gram cache and accepts 2 of its nodes, "s" from recycling's tree
    13 -> 15, 14, whose accepted path is read from the tokens it committed (the last one is the bonus token)."""
    cfg = AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, capacity=1 << 16, recycle=True, recycle_topk=2,
                         recycle_branching=(2, 1))
    p = DraftPlanner(cfg, controller=FixedWidthController(8), vocab_size=64)
    p.recycle_update(np.array([12, 13]), np.array([[13, 14], [15, 16]]))
    plan = p.plan([RequestView("r", [3, 9, 4, 3], []), RequestView("s", [11, 12], [])])
    assert plan.tokens[0, 1:3].tolist() == [9, 4] and plan.tokens[1, :4].tolist() == [12, 13, 14, 15]
    assert plan.drafted.tolist() == [7, 3] and p.stats.drafted_recycled == 3
    p.plan([RequestView("r", [3, 9, 4, 3], [9, 4, 5]), RequestView("s", [11, 12], s_tokens)])
    st, summary = p.stats, p.stats.summary()
    assert (st.realized_accepted, st.accepted_recycled) == (2 + recycled_accepted, recycled_accepted)
    assert summary["accepted_recycled_per_request"] == recycled_accepted / 2
    assert summary["accepted_ngram_per_request"] == 1.0
    assert summary["drafted_recycled_per_request"] + summary["drafted_ngram_per_request"] == \
        summary["drafted_tokens_per_request"]
    p.release(["r", "s"])
    assert not p._sent
    plain = DraftPlanner(AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, capacity=1 << 16),
                         controller=FixedWidthController(8))
    plain.plan([RequestView("r", [3, 9, 4, 3], [])])
    plain.plan([RequestView("r", [3, 9, 4, 3], [9, 4, 5])])
    assert (plain.stats.realized_accepted, plain.stats.accepted_recycled, plain.stats.drafted_recycled) == (2, 0, 0)


def test_plans_are_cheap_only_when_both_costs_are_measured_and_the_same_on_every_rank():
    """`plans_are_cheap` (the worker plans every step where it holds) compares rank 0's plan time, shared, with the
    measured plain step: False until both are measured, then by the share; a rank whose own plans are slow agrees."""
    ranks = tp_planners(AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, tp_sync_interval=1, capacity=1 << 16))
    views = [RequestView("x", [3, 1, 4, 1, 5], [])]
    for p in ranks:
        p.plan(views)
    assert not any(p.plans_are_cheap(1, 0.05) for p in ranks)  # nothing measured
    for r, p in enumerate(ranks):
        p.record_plan(0.0002 if r == 0 else 0.01)  # rank 1's own clock says slow: ignored, rank 0's is shared
        p.plan(views)
    assert not any(p.plans_are_cheap(1, 0.05) for p in ranks)  # the plain step is not measured yet
    for _ in range(3):
        for p in ranks:
            p.record_duration(1, 1, 0.006)
            p.plan(views)
    assert all(p.plans_are_cheap(1, 0.05) for p in ranks)  # 0.2 ms against 5% of 6 ms
    assert not any(p.plans_are_cheap(1, 0.02) for p in ranks)
    for _ in range(60):  # plans slow down to 1 ms: the average follows
        for p in ranks:
            p.record_plan(0.001)
            p.plan(views)
    assert not any(p.plans_are_cheap(1, 0.05) for p in ranks)
    assert ranks[0]._plan_ms == ranks[1]._plan_ms


def test_preplan_pays_where_the_wait_outlasts_it_and_the_same_on_every_rank():
    """`preplan_pays` ("auto" `preplan`): True until rank 0's waits and preparations are both measured (so that they
    are), then whether the waits' median outlasts the preparations' by the slack; medians, so a first slow
    preparation does not decide; ranks agree whatever their own clocks say."""
    ranks = tp_planners(AdaptiveConfig(widths=(1, 2, 4, 8), max_depth=8, tp_sync_interval=1, capacity=1 << 16))
    views = [RequestView("x", [3, 1, 4, 1, 5], [])]
    for p in ranks:
        p.plan(views)
    assert all(p.preplan_pays(0.2) for p in ranks)  # nothing measured: prepare, and so measure
    for r, p in enumerate(ranks):  # a small model: a preparation of 0.9 ms covers the whole wait and more
        p.record_preplan(0.00095, 0.02 if r == 0 else 0.0001)  # a first slow one; rank 1's own clock ignored
        p.plan(views)
    for _ in range(4):
        for r, p in enumerate(ranks):
            p.record_preplan(0.00095, 0.0009 if r == 0 else 0.0001)
            p.plan(views)
    assert not any(p.preplan_pays(0.2) for p in ranks)
    for _ in range(10):  # off: the waits without a preparation stay short
        for p in ranks:
            p.record_preplan(0.0001, None)
            p.plan(views)
    assert not any(p.preplan_pays(0.2) for p in ranks)
    for _ in range(12):  # the GPU step grows (a larger batch): the waits outlast a preparation again
        for p in ranks:
            p.record_preplan(0.004, None)
            p.plan(views)
    assert all(p.preplan_pays(0.2) for p in ranks)
    for _ in range(15):  # on, a large model: 0.9 ms of preparation, then 3 ms more of waiting
        for p in ranks:
            p.record_preplan(0.0039, 0.0009)
            p.plan(views)
    assert all(p.preplan_pays(0.2) for p in ranks) and not any(p.preplan_pays(3.5) for p in ranks)
    assert list(ranks[0]._preplan_waits) == list(ranks[1]._preplan_waits)
    assert ranks[1].preplan_summary(0.2) == {"wait_ms": 3.9, "preparation_ms": 0.9, "pays": True}
