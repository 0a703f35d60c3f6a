"""The adaptive controller: each step, draft only what pays.

Each step it picks one verify width ``n`` for the batch (``n == 1``: plain decode, nothing drafted) and gives
every request the first ``min(n - 1, len)`` nodes of its best-first draft. With requests queued behind the
batch (or when the server does not say), it maximizes expected goodput, the batch's tokens per unit time

    sum_i (1 + sum_{j < n-1} P_ij)  /  c(B, n)

When nobody waits (``plan(..., waiting=0)``: the batch drains, or a server at low load), it maximizes the
requests' geometric-mean speed instead, B * (prod_i (1 + sum_j P_ij))^(1/B) / c(B, n): a verify is paid by
every request in the batch, so one request's long draft must not slow the others down (in a finite replay the
last, longest requests set the makespan; in a server each request's latency counts). Either way a width must
beat plain decoding by ``min_gain`` per decode-step of extra time it costs (c(B, n) / c(B, 1) - 1): a wider
verify risks more time on a wrong estimate.

**P (acceptance)**. The cache gives each node a path probability from counts; the controller turns each node's
conditional (its probability over its parent's) into a calibrated conditional acceptance, learned online from
Beta counts at three levels: fine cells (source, match length, raw conditional, depth, drafted siblings, the
request's recent success rate) shrink towards (source, match length, raw conditional, depth, siblings), which
shrink towards (source, raw conditional, depth, siblings), which shrink towards a fixed pessimistic prior
(``prior_scale`` x the raw conditional); ``prior_strength`` pseudo-trials at each level. P is the product of the
calibrated conditionals along the path. Every proposed draft is *shadow-evaluated* against the tokens the
model then really commits, whether or not it was sent, and every one of them, not only one at a time (a draft
not sent is decided over the next steps while newer drafts arrive; judging one at a time would under-sample
the drafts proposed during a good streak): a request that stopped drafting keeps producing evidence at no
cost, so it recovers after a dry spell without paid probes, and a request that starts copying earns long
drafts within a few steps.

**c(B, n) (cost)**. Learned from the step durations the server (or simulator) reports: a moving average per
(batch size, width) whose updates are clipped to a factor ``clip`` of the current estimate (a GC pause or a
one-off stall moves it by a bounded share, not by 60x); an unmeasured batch size borrows the nearest measured
one of the same width. Unmeasured widths are interpolated between measured widths, extrapolated along the
measured slope, or (with one measured width) taken from a prior's shape (a calibration file, or a conservative
default) scaled by what was measured; and a few are tried, in a small bounded share of steps, so a wrong prior
is corrected. A width whose measurement near this batch size is older than ``stale_after`` reported steps, is
more than 1.5x what the other widths imply for it, and would win at that, is re-measured (at most once per
``stale_after`` steps; its stale average is then replaced, not clipped): a width once measured during a stall
is not banned for good. The controller is never told the true profile.

**Host cost**. All per-step work runs in numba kernels over flat arrays, passed as bundles (named tuples of
arrays: ``calibration.Calibration``, ``calibration.Pending``, ``cost.CostState``, ``cost.CostRow``, ``Scratch``,
``Trace``): the calibration cells, the shadow evaluation of every pending draft (kept per request in preallocated
pools grown on demand), the cost model, the width choice and the decision trace (a preallocated ring, read only by
``decisions()``). ``plan`` is one kernel call for the batch and ``observe_batch`` one for the whole batch's
committed tokens; ``step`` does a server's whole step (commit tokens to cache and controller, propose, plan) in one
kernel call, through its compiled entry point, after a check of the common input (a list of known request ids;
lists of Python ints, or int32 arrays whose ids the cache's append kernel checks) that falls back to full
validation for anything else. ``ngramspec.cache.warm_up()`` compiles them all.

**Determinism and tensor parallelism**. Decisions depend only on tokens (drafts, committed tokens), on the
durations passed to ``observe_step`` and on the queue length passed to ``plan``. Tokens and the scheduler's
queue are identical on every rank; durations are not, so a TP server must measure them on rank 0 and broadcast
them (the SGLang plugin does), or feed every rank the same value. Given the same inputs the controller takes
the same decisions.
"""
from __future__ import annotations

import math
import os
from itertools import accumulate
from typing import Hashable, NamedTuple, Sequence

import numpy as np
from numba import njit, types
from numba.core.typing.typeof import Purpose, typeof
from numba.experimental import structref

from ngramspec import _shared
from ngramspec._draft import append_own, propose_batch, propose_own
from ngramspec._nrt import NO_REFCOUNT as _NO_REFCOUNT
from ngramspec._nrt import NO_REFCOUNT_LIST as _NO_REFCOUNT_LIST
from ngramspec._nrt import field
from ngramspec.cache import _I32, MAX_TOKEN, DraftBatch, _Direct, as_tokens
from ngramspec.controller.calibration import (
    Calibration,
    Pending,
    _node_cells,
    _node_values,
    _shadow_evaluate,
    node_cells,
    node_values,
    pend_add,
    pend_room,
    shadow_evaluate,
)
from ngramspec.controller.cost import (
    CostModel,
    CostRow,
    _cost_observe,
    _cost_row_all,
    default_prior,
    prior_from_calibration,
)
from ngramspec.controller.protocol import _INT_TYPES, DEFAULT_WIDTHS, Plan, _new_plan, check_waiting, check_widths

_REASONS = ("best", "no-draft", "explore", "re-measure")
REMEASURE_RATIO = 1.5  # a stale width is re-measured only if its estimate is this far above what the others imply
C_STEPS, C_EXPLORED, C_REMEASURED, C_TRACED, C_STEP = range(5)  # the controller's counters, by index


class Scratch(NamedTuple):
    """Per-step scratch of the width choice, grown on demand."""

    cells: np.ndarray  # [nodes] int64: each draft node's calibration cell
    P: np.ndarray  # [nodes] float64: each node's calibrated P(accepted)
    G: np.ndarray  # [requests, widths] float64: expected accepted nodes per request and width
    values: np.ndarray  # [widths] float64: each width's value (-inf: not considered)
    expected: np.ndarray  # [widths] float64: expected tokens of the step at each width
    depth: np.ndarray  # [nodes] int64: `node_cells`' scratch (each node's depth)
    kids: np.ndarray  # [nodes + 1] int64: `node_cells`' scratch (children per parent)
    cols: np.ndarray  # [6] int64: the logistic correction's scratch


@njit(cache=True)
def _choose(parents, probs, sources, offsets, mlens, slots, success, run, cal, prior_mean, strength, widths, row,
            draining, min_gain, may_explore, may_remeasure, optimism, sc, lengths):
    """The width choice for one step (see AdaptiveController.plan). Fills the scratch ``sc`` (cells, P, G,
    values: -inf for a width not considered, expected) and lengths; returns (width index, reason index)."""
    B = offsets.shape[0] - 1
    W = widths.shape[0]
    costs, measured, stale, implied = row
    cells, G, values, expected = sc.cells, sc.G, sc.values, sc.expected
    _node_cells(parents, probs, sources, offsets, mlens, slots, success, cells, run, sc.depth, sc.kids)
    _node_values(parents, offsets, cells, cal, prior_mean, strength, widths, sc.P, G, sc.cols)
    for w in range(W):
        acc = 0.0
        for i in range(B):
            acc += G[i, w]
        expected[w] = B + acc
    any_draft = offsets[B] > 0
    best = -1
    best_score = -np.inf
    plain = costs[0]
    for w in range(W):
        values[w] = -np.inf
        if widths[w] > 1 and not any_draft:
            continue
        if draining:  # geometric mean of the requests' rates, as a batch rate
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
            if not measured[w] and expected[w] / (optimism * costs[w]) > values[best]:
                pick = w
        if pick >= 0:
            best = pick
            reason = 2
    if any_draft and may_remeasure and reason != 2:
        # re-measure a width whose measurement is stale and far above what the other widths imply for it, if it
        # would win at that (one stall must not ban a width for good)
        pick = -1
        for w in range(W):
            if stale[w] and w != best and costs[w] > REMEASURE_RATIO * implied[w] \
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
    _cost_row_all(cstate, B, widths, clock, stale_after, row.costs, row.measured, row.stale, row.implied, tmp)
    if switch > 0.0:
        for w in range(widths.shape[0]):
            if widths[w] > 1:
                row.costs[w] += switch
    if offs.shape[0] > 1:
        _shadow_evaluate(slots, toks, offs, pend, alpha, cal, prior_mean, strength, sc.cols)
    best, reason = _choose(parents, probs, sources, offsets, mlens, slots, pend.success, pend.run, cal, prior_mean,
                           strength, widths, row, draining, min_gain, may_explore, may_remeasure, optimism, sc, lengths)
    if queue:
        pend_add(slots, tokens, parents, offsets, sc.cells, pend)
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
    bud, epoch = bud[:B], ring[_S_EPOCH]
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


def _counter(i: int, doc: str) -> property:
    """A Python int view of counter ``i`` of `AdaptiveController._ctr`."""
    def get(self) -> int:
        return int(self._ctr[i])

    def put(self, value: int) -> None:
        self._ctr[i] = value

    return property(get, put, doc=doc)


class AdaptiveController:
    """Chooses the batch verify width and each request's draft prefix. See the module docstring.

    Knobs: ``widths`` (the verify widths a server holds CUDA graphs for), ``prior`` (c(B, n) before any
    measurement: a callable or a calibration file path), ``explore_min`` + ``explore_frac`` x steps (how many
    steps may try a width not yet measured within a factor of two of the current batch size; only one that
    would win at ``explore_optimism`` times its estimated cost, the widest first;
    unmeasured widths between measured ones are interpolated, not explored), ``prior_strength`` (pseudo-trials
    behind each calibration cell's prior), ``prior_scale`` (per depth bin 1 | 2-3 | 4-7 | 8+: the fixed prior of
    a cell's conditional acceptance is this times the cache's raw conditional; it only matters until the
    (conditional, depth) cells have data), ``request_alpha`` (EWMA weight of a request's recent success),
    ``min_gain`` (a width's expected value must beat plain decoding's by this share per decode-step of extra
    cost: 0.1 asks a verify costing 2 decodes for 10% more, one costing 1.3 decodes for 3% more),
    ``cost_clip`` (a step duration moves its average by at most this factor; None: unclipped),
    ``stale_after`` (reported steps after which a width's measurement may be re-checked, see the module
    docstring; None: never), ``trace_len`` (decisions kept for debugging), ``predictor`` ("beta": the Beta cells
    alone; "logistic": their estimate corrected online by a logistic model over the request's copy run and
    success, see ``calibration``).
    """

    _n_steps = _counter(C_STEPS, "steps decided")
    _n_explored = _counter(C_EXPLORED, "steps that explored an unmeasured width")
    _n_remeasured = _counter(C_REMEASURED, "steps that re-measured a stale width")
    _n_traced = _counter(C_TRACED, "decisions written to the trace ring")
    _step = _counter(C_STEP, "the step number of the last decision")

    def __init__(self, widths: Sequence[int] = DEFAULT_WIDTHS, prior=None, explore_frac: float = 0.002,
                 explore_min: int = 1, explore_optimism: float = 0.7,
                 prior_strength: float = 10.0, prior_scale: Sequence[float] = (0.2, 0.35, 0.5, 0.6),
                 request_alpha: float = 0.25, min_gain: float = 0.1, cost_clip: float | None = 2.0,
                 stale_after: int | None = 500, trace_len: int = 1000, predictor: str = "beta"):
        if predictor not in ("beta", "logistic"):
            raise ValueError(f"predictor must be 'beta' or 'logistic', got {predictor!r}")
        self.predictor = predictor
        widths = check_widths(widths)
        self.widths = widths
        self._widths = np.asarray(widths, np.int64)
        self.max_width = widths[-1]
        if isinstance(prior, str):
            prior = prior_from_calibration(prior)
        self._costs = CostModel(prior or default_prior, widths=widths, clip=cost_clip, stale_after=stale_after)
        self._obs = None  # a step duration not yet given to the cost model: (batch, width, width index, ms)
        self.stale_after = stale_after
        self.explore_frac = float(explore_frac)
        self.explore_min = int(explore_min)
        self.explore_optimism = float(explore_optimism)
        self.prior_strength = float(prior_strength)
        self.prior_scale = np.asarray(prior_scale, np.float64)
        if self.prior_scale.shape != (4,):
            raise ValueError("prior_scale needs one factor per depth bin (1, 2-3, 4-7, 8+)")
        self.request_alpha = float(request_alpha)
        self.min_gain = float(min_gain)
        # the acceptance counts (public: inspect, copy, load) and the logistic correction's weights if any
        self.calibration = Calibration.empty(logistic=predictor == "logistic")
        q_mid = np.array([0.05, 0.175, 0.375, 0.625, 0.875, 1.0])
        # per top cell (source, conditional, depth, siblings): prior_scale[depth] x the conditional's midpoint
        self.prior_mean = np.broadcast_to(q_mid[None, :, None, None] * self.prior_scale[None, None, :, None],
                                          (2, 6, 4, 4)).reshape(-1).copy()
        # per-request state in slots: recent success (-1: unknown) and the pool of pending drafts
        self._slot_of: dict[Hashable, int] = {}
        self._slots_gen = 0  # counts changes of _slot_of
        # the last batch's slots (`_fast_slots`): (cache, both generations, a copy of its ids, the two arrays)
        self._batch_slots: tuple | None = None
        self._free: list[int] = []
        self._pend = Pending.empty()
        # per-step scratch, grown on demand
        W = len(widths)
        self._sc = Scratch(np.zeros(64, np.int64), np.zeros(64), np.zeros((8, W)), np.zeros(W), np.zeros(W),
                           np.zeros(64, np.int64), np.zeros(65, np.int64), np.zeros(6, np.int64))
        # `step` calls its kernels through their compiled entry points (see ngramspec.cache._Direct): every
        # argument there has one fixed numba type (the cache's state and output buffers, this controller's own
        # arrays, token and slot arrays of one dtype and layout)
        self._host_direct = _Direct(self, "_host_direct", _host_step)
        self._st = None  # the StepState of the last step and the parts it was built from
        self._st_parts = ()
        self._st_cap = 0  # the largest batch it has room for
        self._st_kind = None  # its numba type, which the compiled entry point of `_host_direct` takes
        self._step_direct = _Direct(self, "_step_direct", _step_kernel)
        self._off_buf = np.zeros(9, np.int64)
        self._one_off = np.zeros(2, np.int64)  # reused arguments of single-request steps
        self._one_slot = np.zeros(1, np.int64)
        self._one_cslot = np.zeros(1, np.int64)
        # the cost row of the step's batch size, computed inside the step kernel
        self._row = CostRow(np.zeros(W), np.zeros(W, np.bool_), np.zeros(W, np.bool_), np.zeros(W))
        self._row_tmp = np.zeros(2 * W)  # `_cost_row_all`'s scratch
        # the decision trace: a ring the step kernel writes, read by `decisions()`
        self._trace_len = int(trace_len)
        if self._trace_len < 0:
            raise ValueError(f"trace_len must be >= 0, got {trace_len!r}")
        N = max(1, self._trace_len)
        self._trace = Trace(np.zeros((N, 4), np.int64), np.zeros((N, 2)), np.zeros((N, W)))
        # the counters (decided steps, explored, re-measured, traced, step number), an array the step kernel updates
        self._ctr = np.zeros(5, np.int64)
        self._budget = max(1, self.max_width - 1)

    # --------------------------------------------------------------------------------------- requests
    def start(self, rid: Hashable) -> None:
        if rid in self._slot_of:
            raise ValueError(f"request {rid!r} is already tracked by the controller")
        if self._free:
            s = self._free.pop()
        else:
            s = len(self._slot_of)
            if s >= self._pend.success.shape[0]:
                self._pend = self._pend.grow_slots(2 * self._pend.success.shape[0])
        self._slot_of[rid] = s
        self._slots_gen += 1
        pend = self._pend
        pend.success[s] = -1.0
        pend.run[s] = 0
        pend.nd[s] = 0
        pend.nn[s] = 0

    def finish(self, rid: Hashable) -> None:
        s = self._slot_of.pop(rid, None)
        if s is None:
            raise KeyError(f"unknown request id {rid!r}")
        self._slots_gen += 1
        self._pend.nd[s] = 0
        self._pend.nn[s] = 0
        self._free.append(s)

    def pending(self, rid: Hashable) -> int:
        """How many of the request's drafts are still being shadow-evaluated."""
        return int(self._pend.nd[self._slots([rid])[0]])

    @property
    def active_requests(self) -> int:
        return len(self._slot_of)

    def _slots(self, rids: Sequence[Hashable]) -> np.ndarray:
        try:
            slots = np.fromiter((self._slot_of[r] for r in rids), np.int64, len(rids))
        except KeyError as e:
            raise KeyError(f"unknown request id {e.args[0]!r}: call start() first") from None
        except TypeError as e:
            raise TypeError(f"request ids must be hashable: {e}") from None
        if len(slots) > 1 and len(set(slots.tolist())) != len(slots):
            raise ValueError("a request id appears twice in one batch")
        return slots

    # --------------------------------------------------------------------------------------- decide
    def _scratch(self, B: int, n: int) -> None:
        sc = self._sc
        if n > sc.cells.shape[0]:
            m = max(n, 2 * sc.cells.shape[0])
            sc = sc._replace(cells=np.zeros(m, np.int64), P=np.zeros(m), depth=np.zeros(m, np.int64),
                             kids=np.zeros(m + 1, np.int64))
        if B > sc.G.shape[0]:
            sc = sc._replace(G=np.zeros((max(B, 2 * sc.G.shape[0]), len(self.widths))))
        self._sc = sc

    @staticmethod
    def _check_batch(B: int, batch: DraftBatch) -> None:
        if not isinstance(batch, DraftBatch):
            raise TypeError(f"batch must be a DraftBatch (from NgramCache.propose), got {type(batch).__name__}")
        if len(batch) != B:
            raise ValueError(f"{B} request ids but {len(batch)} drafts")

    def node_values(self, rids: Sequence[Hashable], batch: DraftBatch) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated P(accepted) of every node of the batch, and each node's calibration cell."""
        slots = self._slots(rids)
        self._check_batch(len(slots), batch)
        n = batch.parents.shape[0]
        cells, P, G = np.zeros(n, np.int64), np.zeros(n), np.zeros((len(slots), len(self.widths)))
        node_cells(batch.parents, batch.probs, batch.sources, batch.offsets, batch.match_lens, slots,
                   self._pend.success, cells, self._pend.run)
        node_values(batch.parents, batch.offsets, cells, self.calibration, self.prior_mean, self.prior_strength,
                    self._widths, P, G)
        return P, cells

    def plan(self, rids: Sequence[Hashable], batch: DraftBatch, waiting: int | None = None,
             switch_cost: float = 0.0) -> Plan:
        """Pick the width and per-request prefixes for this step; records the drafts for calibration.

        ``waiting``: requests queued behind this batch (the scheduler's queue length), or None if unknown.
        0 switches the objective from the batch's tokens per unit time to the requests' geometric-mean speed
        (see the module docstring). ``switch_cost``: ms added to the cost of every width > 1 for this step only,
        what drafting now costs beyond its own step (a server that must wait after a drafting step before the
        next plain one passes that wait while the last step was plain). Nothing changes when it raises."""
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
        wi, why, expected, cost = self._ctl_step(_step_kernel, slots, batch, toks, offs, waiting == 0 and B > 1,
                                                 may_explore, may_remeasure, lengths, switch)
        return self._decided(wi, why, lengths, expected, cost)

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

    # -------------------------------------------------------------------------------------- observe
    def observe_tokens(self, rid: Hashable, committed: Sequence[int]) -> None:
        """The tokens the model committed for ``rid`` this step (accepted draft tokens + bonus)."""
        slots = self._slots([rid])
        toks = as_tokens(committed, "committed tokens")
        self._off_buf[1] = toks.size
        shadow_evaluate(slots, toks, self._off_buf[:2], self._pend, self.request_alpha, self.calibration,
                        self.prior_mean, self.prior_strength)

    def observe_batch(self, rids: Sequence[Hashable], committed: Sequence) -> None:
        """``observe_tokens`` for a whole batch (``committed[i]`` for ``rids[i]``) in one kernel call.
        Validates everything before changing anything."""
        slots = self._slots(rids)
        if len(committed) != len(slots):
            raise ValueError(f"{len(slots)} request ids but {len(committed)} token lists")
        toks, offs = self._flatten(committed, rids)
        self._observe_flat(slots, toks, offs)

    def _observe_flat(self, slots, toks, offs) -> None:
        shadow_evaluate(slots, toks, offs, self._pend, self.request_alpha, self.calibration, self.prior_mean,
                        self.prior_strength)

    def _flatten(self, committed: Sequence, rids, negatives_ok: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Token lists -> validated (flat int32 tokens, int64 offsets), the offsets in a reused buffer.
        ``negatives_ok``: int32 arrays are not checked for negative ids (the cache's append kernel checks them)."""
        B = len(committed)
        if B + 1 > self._off_buf.shape[0]:
            self._off_buf = np.zeros(max(B + 1, 2 * self._off_buf.shape[0]), np.int64)
        offs = self._off_buf[: B + 1]
        if negatives_ok and B and type(committed[0]) is np.ndarray:
            try:  # int32 arrays (e.g. slices of a trace): only their shapes are checked
                if all([t.dtype is _I32 for t in committed]):
                    flat = np.concatenate(committed)  # (raises for 0-d or mixed 1-d and n-d arrays)
                    if type(flat) is np.ndarray and flat.ndim == 1:
                        offs[1:] = list(accumulate(map(len, committed)))
                        return flat, offs
            except (AttributeError, TypeError, ValueError):
                pass  # not arrays: checked below
        if all(type(t) is list for t in committed):  # the common case: lists of Python ints, checked in one pass
            flat = [x for t in committed for x in t]
            if set(map(type, flat)) <= _INT_TYPES and (not flat or (min(flat) >= 0 and max(flat) < MAX_TOKEN)):
                offs[1:] = list(accumulate([len(t) for t in committed]))
                return np.array(flat, np.int32), offs
        elif B and all(type(t) is np.ndarray and t.ndim == 1 and t.dtype.kind in "iu" for t in committed):
            flat = np.concatenate(committed)  # integer arrays (e.g. slices of a trace): checked in one pass
            if not flat.size or (int(flat.min()) >= 0 and int(flat.max()) < MAX_TOKEN):
                offs[1:] = list(accumulate([t.size for t in committed]))
                return flat.astype(np.int32, copy=False), offs
        arrays = [as_tokens(t, f"committed tokens of request {rid!r}") for rid, t in zip(rids, committed)]
        offs[1:] = list(accumulate([a.size for a in arrays]))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return flat, offs

    def observe_step(self, batch: int, width: int, duration_ms: float) -> None:
        """The measured duration of a step of ``batch`` requests verified at ``width`` (one of ``widths``).
        ValueError, and nothing changes, for a batch size < 1, an unknown width or a duration that is not a
        positive finite number. (The cost model takes it at the next ``step``, inside its kernel call, or
        when anything reads ``costs`` first: the same state either way.)"""
        costs = self._costs
        if self._obs is None and type(batch) is int and type(duration_ms) is float and 0 < batch < costs._prior_rows \
                and 0.0 < duration_ms < math.inf:  # the common case, checked in one line: kept for the next step
            wi = costs._wi.get(width) if type(width) is int else None
            if wi is not None and costs.state.nblist[wi] < costs.state.blist.shape[1]:
                self._obs = (batch, width, wi, duration_ms)
                return
        if self._obs is not None:
            self._flush_obs()
        costs.observe(batch, width, duration_ms)

    def _flush_obs(self) -> None:
        """Give the cost model the step duration `observe_step` kept."""
        batch, width, _, ms = self._obs
        self._obs = None
        self._costs.observe(batch, width, ms)

    @property
    def costs(self) -> CostModel:
        """The cost model c(B, n), up to date with every reported step duration."""
        if self._obs is not None:
            self._flush_obs()
        return self._costs

    # ----------------------------------------------------------------------------------- whole step
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
            if k is not None and k[0] is cache and k[1] == self._slots_gen and k[2] == cache._slots_gen \
                    and k[3] == rids:
                return k[4]
            B = len(rids)
            if len(set(rids)) != B:
                return None
            pair = (np.fromiter(map(so.__getitem__, rids), np.int64, B),
                    np.fromiter(map(cso.__getitem__, rids), np.int64, B))
            self._batch_slots = (cache, self._slots_gen, cache._slots_gen, list(rids), pair)
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
            if B == 1 and type(t) is np.ndarray and t.dtype is _I32 and t.ndim == 1 and t.flags.carray:
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
                self.prior_strength, costs.stale_after, waiting == 0 and B > 1, self.min_gain, self.explore_optimism,
                lengths, switch, self.explore_min, self.explore_frac, clock, obs_batch, obs_wi, obs_ms, costs.alpha,
                costs.clip, dry)
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
                                                     waiting == 0 and B > 1, may_explore, may_remeasure, lengths,
                                                     switch)
            return batch, self._decided(wi, why, lengths, expected, cost)
        return batch, _new_plan(self.widths[wi], lengths, expected, cost, _REASONS[why])

    # ----------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, np.ndarray]:
        """What the controller learned, as named arrays (copies): the acceptance counts (``calibration``), the
        cost model's estimates and ratios, and the step counters behind the exploration budget. Not the
        per-request state (recent success, pending drafts): a restarted server starts with no requests."""
        out = {"format": np.array(STATE_FORMAT), "version": np.array([STATE_VERSION], np.int64),
               "widths": np.asarray(self.widths, np.int64),
               "counters": np.array([self._n_steps, self._n_explored, self._n_remeasured, self._step], np.int64)}
        out.update({f"cal_{name}": np.array(a, copy=True) for name, a in zip(Calibration._fields, self.calibration)})
        out.update(self.costs.state_dict())
        return out

    def load_state_dict(self, data) -> None:
        """Start from a learned state (``state_dict``, e.g. of a previous run): replaces the acceptance counts,
        the cost model's state and the counters; requests in flight keep their own state. ValueError, and
        nothing changes, for another format or version, other widths, other table shapes or a different cost
        prior."""
        try:
            fmt = str(np.asarray(data["format"]))
            version = int(np.asarray(data["version"]).reshape(-1)[0])
            widths = tuple(int(w) for w in np.asarray(data["widths"]).reshape(-1))
            counters = np.asarray(data["counters"], np.int64).reshape(-1)
            cal = Calibration(*(np.asarray(data[f"cal_{name}"]) if name in _COUNTS or f"cal_{name}" in data
                                else np.zeros(0) for name in Calibration._fields))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"not a controller state: {e}") from None
        if fmt != STATE_FORMAT:
            raise ValueError(f"not a controller state (format {fmt!r}, expected {STATE_FORMAT!r})")
        if version != STATE_VERSION:
            raise ValueError(f"controller state version {version} is not supported (this version reads "
                             f"{STATE_VERSION})")
        if widths != tuple(self.widths):
            raise ValueError(f"controller state was learned with widths {list(widths)}, this controller has "
                             f"{list(self.widths)}")
        if counters.shape != (4,) or counters.min() < 0:
            raise ValueError(f"controller state: bad counters {counters.tolist()}")
        for name, mine, theirs in zip(Calibration._fields, self.calibration, cal):
            if name not in _COUNTS:  # the logistic correction: taken only if this controller has one of that shape
                if theirs.shape == mine.shape and not np.all(np.isfinite(theirs)):
                    raise ValueError(f"controller state: non-finite {name}")
                continue
            if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                raise ValueError(f"controller state: calibration {name} has shape {theirs.shape} {theirs.dtype}, "
                                 f"expected {mine.shape} {mine.dtype} (saved by another version?)")
            if not np.all(np.isfinite(theirs)) or theirs.min() < 0:
                raise ValueError(f"controller state: calibration {name} holds negative or non-finite counts")
        if np.any(cal.succ > cal.trials) or np.any(cal.mid_succ > cal.mid_trials) or \
                np.any(cal.top_succ > cal.top_trials):
            raise ValueError("controller state: more successes than trials in the calibration")
        self.costs.load_state_dict(data)  # validates everything first: raises before anything changes
        self.calibration.load(cal)
        self._n_steps, self._n_explored, self._n_remeasured, self._step = (int(c) for c in counters)

    def save_state(self, path) -> None:
        """Write ``state_dict`` to ``path`` (a small compressed .npz file, tens of kB), atomically: a reader never sees
        a half-written file."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, **self.state_dict())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load_state(self, path) -> None:
        """``load_state_dict`` from a file written by ``save_state``. FileNotFoundError for a missing file,
        ValueError for an unreadable or mismatched one; nothing changes on failure."""
        path = os.fspath(path)
        data = read_state_file(path)
        try:
            self.load_state_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _check_switch(switch_cost) -> float:
    """``switch_cost`` as a float: ValueError unless a finite number >= 0."""
    if isinstance(switch_cost, bool) or type(switch_cost) not in _INT_TYPES and not isinstance(
            switch_cost, (float, np.floating)) or not (0.0 <= switch_cost < math.inf):
        raise ValueError(f"switch_cost must be a finite number of ms >= 0, got {switch_cost!r}")
    return float(switch_cost)


def read_state_file(path) -> dict[str, np.ndarray]:
    """The arrays of a state file (``AdaptiveController.save_state``), unchecked. FileNotFoundError for a
    missing file, ValueError for one that is not a readable .npz."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"controller state file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # a truncated or foreign file: zipfile, pickle or format errors
        raise ValueError(f"{path}: not a readable controller state file ({type(e).__name__}: {e})") from None


_COUNTS = Calibration._fields[:6]  # the Beta counts: every state has them
STATE_FORMAT = "ngramspec-controller-state"
STATE_VERSION = 1
_NO_TOKENS = np.zeros(0, np.int32)
_S_EPOCH = _shared.S_EPOCH
_NO_OFFSETS = np.zeros(1, np.int64)
