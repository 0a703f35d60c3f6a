"""The server's whole host step in one kernel call (`AdaptiveController.step`): the committed tokens go to the
cache and to the controller, the step duration reported since the last step to the cost model, the cache
proposes, and the controller observes, estimates and chooses (``choose._ctl_step``): `_host_step`, on every
state bundle of the cache and of the controller at once through one numba StructRef (`StepState`). Also
`prefetch`, the same call as a dry run that only warms the CPU caches. `Stepping` is the controller's Python side
of it; the cache's side of the interface is ``ngramspec._cache_api``.
"""
from __future__ import annotations

import weakref
from typing import Hashable, Sequence

import numpy as np
from numba import njit, types
from numba.core.typing.typeof import Purpose, typeof
from numba.experimental import structref

from ngramspec._cache_api import I32, S_EPOCH, append_own, propose_batch, propose_own
from ngramspec._nrt import NO_REFCOUNT_LIST as _NO_REFCOUNT_LIST
from ngramspec._nrt import field
from ngramspec.cache import MAX_TOKEN, DraftBatch
from ngramspec.controller.choose import (
    _NO_OFFSETS,
    _NO_TOKENS,
    _REASONS,
    C_EXPLORED,
    C_REMEASURED,
    C_STEP,
    C_STEPS,
    C_TRACED,
    _check_switch,
    _count_decision,
    _ctl_step,
)
from ngramspec.controller.cost import _cost_observe
from ngramspec.controller.protocol import Plan, _new_plan, check_waiting


@structref.register
class _StepStateType(types.StructRef):
    """The numba type of `StepState`."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class StepState(structref.StructRefProxy):
    """Every state bundle `_host_step` reads or writes, the cache's and the controller's, as one numba StructRef:
    a call unboxes one pointer instead of some seventy arrays (about 1 us instead of 5 per step), with the cache's
    output buffers, budgets and constants. It refers to the arrays, it does not copy them;
    `AdaptiveController._step_state` builds a new one when a part is replaced (a pool or table grown, another
    cache) or a batch is larger than its buffers hold."""


_STEP_FIELDS = ("own", "hists", "shared", "pend", "cal", "prior_mean", "widths", "cstate", "row", "tmp", "sc",
                "trace", "ctr", "ring", "out", "bud", "max_depth", "use_shared", "trace_len")
structref.define_constructor(StepState, _StepStateType, _STEP_FIELDS)
structref.define_boxing(_StepStateType, StepState)


@njit(cache=True)
def _new_step_state(own, hists, shared, pend, cal, prior_mean, widths, cstate, row, tmp, sc, trace, ctr, ring, out,
                    bud, max_depth, use_shared, trace_len):
    """A `StepState` (built in compiled code: the proxy's own constructor is compiled anew in every process)."""
    return StepState(own, hists, shared, pend, cal, prior_mean, widths, cstate, row, tmp, sc, trace, ctr, ring, out,
                     bud, max_depth, use_shared, trace_len)


@njit(cache=True, **_NO_REFCOUNT_LIST)
def _host_core(cslots, toks, offs, append, st, tree, slots, alpha, strength, stale_after, draining, min_gain,
               optimism, lengths, switch, explore_min, explore_frac, clock, obs_batch, obs_wi, obs_ms, cost_alpha,
               cost_clip, dry):
    """`_host_step`, compiled without reference counting (``st``'s fields read in place by `field`)."""
    own, hists, shared, pend, cal = field(st, "own"), field(st, "hists"), field(st, "shared"), field(st, "pend"), \
        field(st, "cal")
    prior_mean, widths, cstate, row, tmp = field(st, "prior_mean"), field(st, "widths"), field(st, "cstate"), \
        field(st, "row"), field(st, "tmp")
    sc, trace, ctr, ring, out = field(st, "sc"), field(st, "trace"), field(st, "ctr"), field(st, "ring"), \
        field(st, "out")
    bud, max_depth, use_shared, trace_len = field(st, "bud"), field(st, "max_depth"), field(st, "use_shared"), \
        field(st, "trace_len")
    B = cslots.shape[0]
    o_tok, o_par, o_prob, o_src, offsets, mlens = out
    offsets = offsets[:B + 1]
    mlens = mlens[:B]
    if append and not dry:
        code = append_own(cslots, toks, offs, max_depth, own, hists)
        if code != 0:
            return code, 0, -1, -1, 0, 0, 0.0, 0.0
    if obs_batch > 0 and not dry:
        _cost_observe(cstate, obs_batch, obs_wi, obs_ms, cost_alpha, cost_clip, clock, stale_after)
    bud, epoch = bud[:B], ring[S_EPOCH]
    n = propose_own(cslots, bud, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob, o_src,
                    offsets, mlens)
    if n < 0:  # a budget exceeds the cache's scratch: its allocating path
        n = propose_batch(cslots, bud, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob,
                          o_src, offsets, mlens)
    n1 = ctr[C_STEPS] + 1
    may_explore = ctr[C_EXPLORED] < explore_min + explore_frac * n1
    may_remeasure = stale_after > 0 and ctr[C_REMEASURED] * stale_after < n1
    tpos = ctr[C_TRACED] % trace_len if trace_len > 0 and not dry else -1
    wi, why, need_d, need_n, expected, cost = _ctl_step(
        slots, toks, offs, o_par[:n], o_prob[:n], o_src[:n], o_tok[:n], offsets, mlens, pend, alpha, cal,
        prior_mean, strength, widths, cstate, clock, stale_after, row, tmp, draining, min_gain,
        may_explore, may_remeasure, optimism, sc, lengths, trace, tpos, ctr[C_STEP] + 1, switch, not dry)
    if wi >= 0 and not dry:
        _count_decision(ctr, why)
    return 0, n, wi, why, need_d, need_n, expected, cost


@njit(cache=True)
def _host_step(cslots, toks, offs, append, st, tree, slots, alpha, strength, stale_after, draining, min_gain,
               optimism, lengths, switch, explore_min, explore_frac, clock, obs_batch, obs_wi, obs_ms, cost_alpha,
               cost_clip, dry=False):
    """`AdaptiveController.step` in one call, on the state bundles of ``st`` (`StepState`): with ``append``, the
    committed tokens go to the cache (its ``append_batch``: on a negative token, a history or hash view without room it
    changes nothing and this returns its code); then a step duration reported since the last step (``obs_batch``
    > 0: batch size, width index, ms) goes to the cost model at sample ``clock``; then the cache proposes (its
    ``propose_batch`` into its output buffers, at the shared cache's epoch in ``ring``), then `_ctl_step`, which
    may explore / re-measure as the counters ``ctr`` allow, and the decision is counted there. Returns (append
    code, nodes proposed, then `_ctl_step`'s six values); a width index of -1: the pending pools lack room (the
    cache's and the cost model's parts are done, the controller's is not, nothing is counted).

    ``dry``: the same proposal and width choice on the tokens the cache already holds, with no tokens appended,
    no duration observed, no draft queued, decided or traced (``offs`` of one entry: no shadow evaluation): it
    only warms the CPU caches for a real step, with the code and data that step will use. (The proposal resets
    the cache's incremental match bounds, which only bound work: drafts never depend on them.)

    The cache's output buffers (``st.out``), budgets (``st.bud``), shared-cache ring, depth and the counters come
    from ``st`` too; their first ``B`` (``B + 1``) entries are this step's."""
    return _host_core(cslots, toks, offs, append, st, tree, slots, alpha, strength, stale_after, draining, min_gain,
                      optimism, lengths, switch, explore_min, explore_frac, clock, obs_batch, obs_wi, obs_ms,
                      cost_alpha, cost_clip, dry)


class Stepping:
    """`AdaptiveController`'s whole step: `step` and `prefetch`, through `_host_step`'s compiled entry point
    (``_host_direct``) on the `StepState` of the cache and this controller (``_st``, rebuilt when a part changed)."""

    def step(self, cache, rids: Sequence[Hashable], committed: Sequence | None = None, waiting: int | None = None,
             tree: bool = True, switch_cost: float = 0.0) -> tuple[DraftBatch, Plan]:
        """A server's whole host step for the batch ``rids``: the tokens each request committed since its last
        step (``committed[i]``, possibly empty; None: none) go to ``cache`` and to the controller, then the
        cache proposes drafts of up to ``max_width - 1`` nodes and the controller plans the step (``waiting``
        and ``switch_cost`` as in `plan`). One kernel call for the whole batch. Validates everything before
        changing anything. Returns (drafts, plan)."""
        switch = 0.0 if switch_cost == 0.0 and type(switch_cost) in (float, int) else _check_switch(switch_cost)
        if type(rids) is list and rids and (waiting is None or type(waiting) is int and waiting >= 0) and (
                committed is None or type(committed) is list and len(committed) == len(rids)):
            slots = self._fast_slots(cache, rids)
            if slots is not None:
                return self._run_step(cache, rids, slots[0], slots[1], committed, waiting, tree, switch)
        # anything else (an empty batch, other containers, bad input): validated in full, step by step
        check_waiting(waiting)
        slots = self._slots(rids)
        B = len(slots)
        cslots = np.array(cache._slots(rids), np.int64)
        if committed is not None and len(committed) != B:
            raise ValueError(f"{B} request ids but {len(committed)} token lists")
        if B == 0:
            return cache._propose_slots(cslots, max(1, self.max_width - 1), bool(tree)), \
                _new_plan(1, np.zeros(0, np.int64), 0.0, 0.0, "no-draft")
        return self._run_step(cache, rids, slots, cslots, committed, waiting, tree, switch)

    def prefetch(self, cache, rids: list) -> None:
        """Warm the CPU caches for the next ``step`` of the batch ``rids`` (a list of known request ids), e.g. while
        the device runs this step's forward: ``step``'s own code path (Python and compiled) runs the proposal and
        width choice on the tokens ``cache`` already holds, with nothing appended, observed, queued, decided or
        traced. After a device wait a step's host work otherwise finds its code and data evicted and runs several
        times slower. Changes no decision; overwrites the arrays of the last step's drafts (views of reused
        buffers that the next step overwrites anyway); does nothing for anything but a list of known, distinct
        request ids."""
        if type(rids) is list and rids:
            slots = self._fast_slots(cache, rids)
            if slots is not None:
                self._run_step(cache, rids, slots[0], slots[1], None, None, True, dry=True)

    def _step_state(self, cache, B: int) -> StepState:
        """The `StepState` of ``cache`` and this controller for a batch of ``B`` requests, rebuilt when a part was
        replaced since the last step (the pending pools, the cost tables, the scratch or a hash view grown, the
        state loaded, another cache) or is too small for ``B`` (then grown first: the cache's output buffers and
        budgets, the scratch, the cost prior's rows)."""
        st, p = self._st, self._st_parts
        if st is None or B > self._st_cap or p[0] is not cache._own_state or p[1] is not self._pend \
                or p[2] is not self._costs.state or p[3] is not self._sc or p[4] is not self.calibration \
                or p[5] is not cache._shared_state or p[6] is not cache._out:
            budget, costs = self._budget, self._costs
            cap = max(B, self._st_cap, 64)
            cache._propose_buffers(cap, budget)
            bud = cache._uniform_budgets(budget, cap)
            if cap * budget > self._sc.cells.shape[0] or cap > self._sc.G.shape[0]:
                self._scratch(cap, cap * budget)
            if B >= costs._prior_rows:
                costs._ensure(B)
            st = self._st = _new_step_state(cache._own_state, cache._hists, cache._shared_state, self._pend,
                                            self.calibration, self.prior_mean, self._widths, costs.state,
                                            self._row, self._row_tmp, self._sc, self._trace, self._ctr, cache._ring,
                                            cache._out, bud, cache.max_depth, cache.use_shared, self._trace_len)
            self._st_parts = (cache._own_state, self._pend, costs.state, self._sc, self.calibration,
                              cache._shared_state, cache._out, bud)
            self._st_cap = min(cap, costs._prior_rows - 1)
            kind = typeof(st, Purpose.argument)
            if self._st_kind is None:
                self._st_kind = kind
            elif kind != self._st_kind:  # an array of another dtype or layout: not what the entry point takes
                self._host_direct = _host_step
        return st

    def _fast_slots(self, cache, rids: list) -> tuple[np.ndarray, np.ndarray] | None:
        """The controller's and the cache's slots of ``rids`` (a non-empty list), or None when a request is
        unknown to either, an id is not hashable or appears twice (the full validation then says which)."""
        so, cso = self._slot_of, cache._slot_of
        try:
            if len(rids) == 1:
                rid = rids[0]
                slots, cslots = self._one_slot, self._one_cslot
                slots[0] = so[rid]
                cslots[0] = cso[rid]
                return slots, cslots
            k = self._batch_slots  # a decode batch mostly keeps its requests from one step to the next
            if k is not None and k[0]() is cache and k[1] == self._slots_gen and k[2] == cache._slots_gen \
                    and k[3] == rids:
                return k[4]
            B = len(rids)
            if len(set(rids)) != B:
                return None
            pair = (np.fromiter(map(so.__getitem__, rids), np.int64, B),
                    np.fromiter(map(cso.__getitem__, rids), np.int64, B))
            self._batch_slots = (weakref.ref(cache), self._slots_gen,  # weakly: a flushed cache goes at once
                                 cache._slots_gen, list(rids), pair)
            return pair
        except (KeyError, TypeError):
            return None

    def _run_step(self, cache, rids, slots: np.ndarray, cslots: np.ndarray, committed, waiting, tree,
                  switch=0.0, dry=False) -> tuple | None:
        """``step`` for validated, distinct slots (int64 arrays) of a non-empty batch and ``committed`` of the
        right length (or None). ``dry``: `prefetch` (``committed`` None; returns None)."""
        B = slots.shape[0]
        if committed is None:
            toks, offs = _NO_TOKENS, _NO_OFFSETS
        else:
            t = committed[0]
            if B == 1 and type(t) is np.ndarray and t.dtype is I32 and t.ndim == 1 and t.flags.carray:
                toks, offs = t, self._one_off  # (the append kernel checks for negative ids)
                offs[1] = t.shape[0]
            else:
                toks, offs = self._flatten(committed, rids, negatives_ok=True)
            if not toks.shape[0]:
                toks, offs = _NO_TOKENS, _NO_OFFSETS
        costs = self._costs
        obs = None if dry else self._obs
        if obs is None:
            clock, obs_batch, obs_wi, obs_ms = costs.clock, 0, 0, 0.0
        else:
            clock, (obs_batch, _, obs_wi, obs_ms) = costs.clock + 1, obs
        lengths = np.empty(B, np.int64)
        append = toks.shape[0] > 0
        while True:
            code, n, wi, why, need_d, need_n, expected, cost = self._host_direct(
                cslots, toks, offs, append, self._step_state(cache, B), bool(tree), slots, self.request_alpha,
                self.prior_strength, costs.stale_after, self._draining(waiting, B), self.min_gain,
                self.explore_optimism, lengths, switch, self.explore_min, self.explore_frac, clock, obs_batch, obs_wi,
                obs_ms, costs.alpha, costs.clip, dry)
            if code == 0:
                break
            if code < 0:  # a negative token id: nothing changed; the full validation names the request
                self._flatten(committed, rids)
                raise ValueError(f"committed tokens: token id {int(toks[-1 - code])} is out of range "
                                 f"[0, {MAX_TOKEN + 1})")
            cache._append(cslots, toks, offs)  # a history or the hash view lacks room: the cache grows it, appends
            append = False
        if dry:
            return None
        if obs is not None:  # the kernel gave the cost model the kept duration
            self._obs = None
            costs.clock = clock
            costs._rows.clear()
        batch = cache._batch_view(B, n)
        if wi < 0:  # the cache's part is done; the controller's waits for room in its pending pools
            self._pend = self._pend.grow_pool(need_d, need_n)
            may_explore, may_remeasure = self._may()
            wi, why, expected, cost = self._ctl_step(self._step_direct, slots, batch, toks, offs,
                                                     self._draining(waiting, B), may_explore, may_remeasure, lengths,
                                                     switch)
            return batch, self._decided(wi, why, lengths, expected, cost)
        return batch, _new_plan(self.widths[wi], lengths, expected, cost, _REASONS[why])
