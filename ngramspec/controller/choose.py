"""The adaptive controller's third phase, **choose**: the batch's verify width and each request's draft prefix.

`_choose` takes the width of the best value, the batch's expected tokens per unit time (or, when nobody waits,
its requests' geometric-mean speed), that beats plain decoding by ``min_gain`` per decode-step of extra cost; it
may instead try a width not yet measured here, or re-measure a stale one, if that would win at an optimistic
cost (see the ``adaptive`` module docstring). Each request then sends the first ``width - 1`` nodes of its draft.

`_ctl_step` is the controller's whole step in one kernel, the three phases in order: observe (the pending drafts
against the tokens committed since the last step, ``calibration``), estimate (``estimate``), choose; then it
queues the new drafts for observation and records the decision in the `Trace` ring. `Choosing` is the
controller's Python side of it (`plan`, `decisions`, `trace`).
"""
from __future__ import annotations

import math
from typing import Hashable, NamedTuple, Sequence

import numpy as np
from numba import njit

from ngramspec._nrt import NO_REFCOUNT as _NO_REFCOUNT
from ngramspec.cache import DraftBatch
from ngramspec.controller.calibration import _shadow_evaluate, pend_add, pend_room
from ngramspec.controller.estimate import _estimate, _estimate_costs
from ngramspec.controller.protocol import _INT_TYPES, Plan, _new_plan, check_waiting

_REASONS = ("best", "no-draft", "explore", "re-measure")
REMEASURE_RATIO = 1.5  # a stale width is re-measured only if its estimate is this far above what the others imply
C_STEPS, C_EXPLORED, C_REMEASURED, C_TRACED, C_STEP = range(5)  # the controller's counters, by index
_NO_TOKENS = np.zeros(0, np.int32)  # no tokens committed since the last step (with `_NO_OFFSETS`)
_NO_OFFSETS = np.zeros(1, np.int64)


@njit(cache=True)
def _choose(offsets, widths, row, draining, min_gain, may_explore, may_remeasure, optimism, sc, lengths):
    """The width choice for one step (see AdaptiveController.plan), from the estimates in the scratch ``sc`` (G,
    expected: `_estimate`) and the cost row ``row``. Fills ``sc.values`` (-inf for a width not considered) and
    lengths; returns (width index, reason index)."""
    B = offsets.shape[0] - 1
    W = widths.shape[0]
    costs, measured, stale, implied = row
    G, values, expected = sc.G, sc.values, sc.expected
    any_draft = offsets[B] > 0
    best = -1
    best_score = -np.inf
    plain = costs[0]
    limit, batch_limit = sc.limit[0], sc.limit[1]
    if batch_limit > 0 and B > batch_limit:
        any_draft = False  # a batch this large decodes plainly
    for w in range(W):
        values[w] = -np.inf
        if widths[w] > 1 and (not any_draft or (limit > 0 and widths[w] * B > limit)):
            continue
        if draining == 3:  # the harmonic mean of the requests' rates, as a batch rate (drain="hmean")
            inv = 0.0
            for i in range(B):
                inv += 1.0 / (1.0 + G[i, w])
            values[w] = B * (B / inv) / costs[w]
        elif draining == 2:  # the slowest request's rate, as a batch rate (drain="min")
            lo = np.inf
            for i in range(B):
                lo = min(lo, G[i, w])
            values[w] = B * (1.0 + lo) / costs[w]
        elif draining:  # geometric mean of the requests' rates, as a batch rate
            lt = 0.0
            for i in range(B):
                lt += math.log1p(G[i, w])
            values[w] = B * math.exp(lt / B) / costs[w]
        else:
            values[w] = expected[w] / costs[w]
        # a wider verify risks more time on a wrong estimate: its value must beat plain decoding by a margin
        # proportional to its extra cost (min_gain per decode-step of extra time)
        score = values[w] / (1.0 + min_gain * max(0.0, costs[w] / plain - 1.0))
        if score > best_score:
            best_score = score
            best = w
    reason = 0 if (widths[best] > 1 or any_draft) else 1
    if any_draft and may_explore:
        # try a width not yet measured here only if it would win were it cheaper than estimated (the widest
        # first: it bounds the interpolation of every width below it)
        pick = -1
        for w in range(W):
            if not measured[w] and values[w] > -np.inf and expected[w] / (optimism * costs[w]) > values[best]:
                pick = w
        if pick >= 0:
            best = pick
            reason = 2
    if any_draft and may_remeasure and reason != 2:
        # re-measure a width whose measurement is stale and far above what the other widths imply for it, if it
        # would win at that (one stall must not ban a width for good)
        pick = -1
        for w in range(W):
            if stale[w] and w != best and values[w] > -np.inf and costs[w] > REMEASURE_RATIO * implied[w] \
                    and expected[w] / (optimism * implied[w]) > values[best]:
                pick = w
        if pick >= 0:
            best = pick
            reason = 3
    cap = widths[best] - 1
    for i in range(B):
        n = offsets[i + 1] - offsets[i]
        lengths[i] = n if n < cap else cap
    return best, reason


class Trace(NamedTuple):
    """The recent decisions, a ring of ``trace_len`` rows written by the step kernel (``decisions()`` reads it)."""

    ints: np.ndarray  # [N, 4] int64: step, batch size, width, reason index
    floats: np.ndarray  # [N, 2] float64: expected tokens, estimated cost
    values: np.ndarray  # [N, widths] float64: each width's value (-inf: not considered)


@njit(cache=True, **_NO_REFCOUNT)
def _ctl_step(slots, toks, offs, parents, probs, sources, tokens, offsets, mlens, pend, alpha, cal, prior_mean,
              strength, widths, cstate, clock, stale_after, row, tmp, draining, min_gain, may_explore, may_remeasure,
              optimism, sc, lengths, trace, tpos, step_no, switch, queue=True):
    """The controller's whole step: shadow-evaluate the pending drafts against the tokens committed since the
    last step (``toks``/``offs``, one slice per request; ``offs`` of length 1: none), compute the cost row of
    this batch size (into ``row`` and ``tmp``, from the cost state ``cstate``), choose the width for the new
    drafts (every width > 1 costing ``switch`` more), queue them and record the decision in row ``tpos`` of
    ``trace`` (tpos < 0: not recorded; ``queue`` False: the drafts are not queued either). Returns
    (width index, reason index, drafts, nodes, expected tokens, estimated cost): if the pending pools lack room
    it changes nothing and returns (-1, -1, drafts, nodes, 0, 0) they need per request.

    Compiled without numba's reference counting (``_nrt=False``, which its callees inherit): it allocates nothing
    (scratch comes in ``sc`` and ``tmp``) and keeps no array beyond the call, and otherwise every array it reads
    out of a bundle or passes on costs an atomic increment and decrement, some 200 a step (about 40% of the
    step's time at batch 1)."""
    need_d, need_n = pend_room(slots, offsets, pend)
    if need_d > 0 or need_n > 0:
        return -1, -1, need_d, need_n, 0.0, 0.0
    B = slots.shape[0]
    _estimate_costs(cstate, B, widths, clock, stale_after, row, tmp, switch)
    if offs.shape[0] > 1:  # observe
        _shadow_evaluate(slots, toks, offs, pend, alpha, cal, prior_mean, strength, sc.cols)
    _estimate(parents, probs, sources, offsets, mlens, slots, pend.success, pend.run, pend.predicted, pend.realized,
              cal, prior_mean, strength, widths, sc)
    best, reason = _choose(offsets, widths, row, draining, min_gain, may_explore, may_remeasure, optimism, sc,
                           lengths)
    if queue:
        # each draft is judged on the prefix of the best drafting width (what a drafting step would have sent)
        wd = -1
        for w in range(widths.shape[0]):
            if widths[w] > 1 and (wd < 0 or sc.values[w] > sc.values[wd]):
                wd = w
        pend_add(slots, tokens, parents, offsets, sc.cells, sc.P, widths[wd] - 1 if wd >= 0 else 0, pend)
    if tpos >= 0:
        ti, tf, tv = trace.ints, trace.floats, trace.values
        ti[tpos, 0] = step_no
        ti[tpos, 1] = B
        ti[tpos, 2] = widths[best]
        ti[tpos, 3] = reason
        tf[tpos, 0] = sc.expected[best]
        tf[tpos, 1] = row.costs[best]
        for w in range(widths.shape[0]):
            tv[tpos, w] = sc.values[w]
    return best, reason, 0, 0, sc.expected[best], row.costs[best]


@njit(cache=True)
def _step_kernel(slots, toks, offs, parents, probs, sources, tokens, offsets, mlens, pend, alpha, cal, prior_mean,
                 strength, widths, cstate, clock, stale_after, row, tmp, draining, min_gain, may_explore,
                 may_remeasure, optimism, sc, lengths, trace, tpos, step_no, switch):
    """`_ctl_step` as a kernel of its own (``plan``, ``step``'s fallback when the pending pools had to grow)."""
    return _ctl_step(slots, toks, offs, parents, probs, sources, tokens, offsets, mlens, pend, alpha, cal,
                     prior_mean, strength, widths, cstate, clock, stale_after, row, tmp, draining, min_gain,
                     may_explore, may_remeasure, optimism, sc, lengths, trace, tpos, step_no, switch)


@njit(cache=True)
def _count_decision(ctr, why):
    """Count a decided step in the counters ``ctr`` (see `AdaptiveController._ctr`)."""
    ctr[C_STEPS] += 1
    if why == 2:
        ctr[C_EXPLORED] += 1
    elif why == 3:
        ctr[C_REMEASURED] += 1
    ctr[C_STEP] += 1
    ctr[C_TRACED] += 1


def _check_switch(switch_cost) -> float:
    """``switch_cost`` as a float: ValueError unless a finite number >= 0."""
    if isinstance(switch_cost, bool) or type(switch_cost) not in _INT_TYPES and not isinstance(
            switch_cost, (float, np.floating)) or not (0.0 <= switch_cost < math.inf):
        raise ValueError(f"switch_cost must be a finite number of ms >= 0, got {switch_cost!r}")
    return float(switch_cost)


class Choosing:
    """`AdaptiveController`'s choose phase on the Python side: `plan` (the step kernel for a batch whose drafts
    the caller proposed), the counting of decided steps and the decision trace (``_trace``, ``_trace_len``)."""

    def plan(self, rids: Sequence[Hashable], batch: DraftBatch, waiting: int | None = None,
             switch_cost: float = 0.0) -> Plan:
        """Pick the width and per-request prefixes for this step; records the drafts for calibration.

        ``waiting``: requests queued behind this batch (the scheduler's queue length), or None if unknown.
        0 switches the objective from the batch's tokens per unit time to the requests' geometric-mean speed
        (see the ``adaptive`` module docstring). ``switch_cost``: ms added to the cost of every width > 1 for this
        step only, what drafting now costs beyond its own step (a server that must wait after a drafting step
        before the next plain one passes that wait while the last step was plain). Nothing changes when it
        raises."""
        check_waiting(waiting)
        switch = _check_switch(switch_cost)
        slots = self._slots(rids)
        B = len(slots)
        self._check_batch(B, batch)
        if B == 0:  # nothing to decode: a plain step of nobody, not counted
            return _new_plan(1, np.zeros(0, np.int64), 0.0, 0.0, "no-draft")
        return self._plan(slots, batch, waiting, switch=switch)

    def _plan(self, slots: np.ndarray, batch: DraftBatch, waiting, toks=None, offs=None, switch=0.0) -> Plan:
        """Observe ``toks``/``offs`` (tokens committed per request since the last step; None: none), then plan."""
        B = len(slots)
        n = int(batch.offsets[B])
        if n > self._sc.cells.shape[0] or B > self._sc.G.shape[0]:
            self._scratch(B, n)
        if B >= self.costs._prior_rows:
            self.costs._ensure(B)
        may_explore, may_remeasure = self._may()
        lengths = np.empty(B, np.int64)
        if toks is None:
            toks, offs = _NO_TOKENS, _NO_OFFSETS
        wi, why, expected, cost = self._ctl_step(_step_kernel, slots, batch, toks, offs, self._draining(waiting, B),
                                                 may_explore, may_remeasure, lengths, switch)
        return self._decided(wi, why, lengths, expected, cost)

    def _draining(self, waiting, B: int) -> int:
        """The step kernels' objective: 0 the batch's tokens per unit time (requests queued, or unknown), else
        (nobody waits: the batch drains) 1 its requests' geometric-mean speed, 2 its slowest request's speed, 3 their
        harmonic-mean speed."""
        return self._drain if waiting == 0 and B > 1 else 0

    def _may(self) -> tuple[bool, bool]:
        """Whether this step may explore an unmeasured width, and re-measure a stale one (at most one
        re-measurement per stale_after steps)."""
        n = self._n_steps + 1
        return (self._n_explored < self.explore_min + self.explore_frac * n,
                self.stale_after is not None and self._n_remeasured * self.stale_after < n)

    def _tpos(self) -> int:
        """The trace row of the next decision (-1: none kept)."""
        return self._n_traced % self._trace_len if self._trace_len else -1

    def _ctl_step(self, kernel, slots, batch, toks, offs, draining, may_explore, may_remeasure, lengths, switch):
        """The controller's part of a step (`_ctl_step`, through ``kernel``), growing the pending pools as
        needed. Returns (width index, reason index, expected tokens, estimated cost)."""
        costs = self.costs
        while True:
            wi, why, need_d, need_n, expected, cost = kernel(
                slots, toks, offs, batch.parents, batch.probs, batch.sources, batch.tokens, batch.offsets,
                batch.match_lens, self._pend, self.request_alpha, self.calibration, self.prior_mean,
                self.prior_strength, self._widths, costs.state, costs.clock, costs.stale_after, self._row,
                self._row_tmp, draining, self.min_gain, may_explore, may_remeasure, self.explore_optimism, self._sc,
                lengths, self._trace, self._tpos(), self._step + 1, switch)
            if wi >= 0:
                return wi, why, expected, cost
            self._pend = self._pend.grow_pool(need_d, need_n)  # nothing changed: grow the pools and go again

    def _decided(self, wi: int, why: int, lengths: np.ndarray, expected: float, cost: float) -> Plan:
        """Count a step the kernel decided (and recorded); its plan."""
        self._n_steps += 1
        if why == 2:
            self._n_explored += 1
        elif why == 3:
            self._n_remeasured += 1
        self._step += 1
        self._n_traced += 1
        return _new_plan(self.widths[wi], lengths, expected, cost, _REASONS[why])

    @property
    def trace(self) -> list[tuple]:
        """The recent decisions (the last ``trace_len``, oldest first) as (step, batch, width, reason index,
        expected tokens, estimated cost, each width's value) tuples."""
        N = self._trace_len
        k = min(self._n_traced, N)
        ints, floats, values = self._trace
        out = []
        for j in range(self._n_traced - k, self._n_traced):
            i = j % N
            st, B, w, why = (int(x) for x in ints[i])
            out.append((st, B, w, why, float(floats[i, 0]), float(floats[i, 1]), values[i].copy()))
        return out

    def decisions(self) -> list[dict]:
        """The recent decisions (the last ``trace_len``), readable: why each step got its width."""
        return [{"step": st, "batch": B, "width": w, "reason": _REASONS[why], "expected_tokens": round(tok, 3),
                 "est_cost": round(cost, 4),
                 "options": {ww: round(float(v), 4) for ww, v in zip(self.widths, values) if v != -np.inf}}
                for st, B, w, why, tok, cost, values in self.trace]
