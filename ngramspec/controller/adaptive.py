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
verify risks more time on a wrong estimate. With ``max_step_tokens``, a width n > 1 is considered only while
B x n is at most that many tokens: at large batch sizes a server verifies narrow or not at all, whatever its cost
estimates say (they are least sure there: an unmeasured batch size borrows a measured one's costs). With
``max_draft_batch``, a batch of more requests than that decodes plainly (a server that has verify graphs only up to
that batch size).

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
measured slope (below two measured widths whose wider one came out cheaper, from the nearest one and the prior's
shape instead: a downhill pair is noise), or (with one measured width) taken from a prior's shape (a
calibration file, or a conservative default) scaled by what was measured; and a few are tried, in a small
bounded share of steps, so a wrong prior is corrected. A width whose measurement near this batch size is older than
``stale_after`` reported steps, is more than 1.5x what the other widths imply for it, and would win at that, is
re-measured (at most once per ``stale_after`` steps; its stale average is then replaced, not clipped): a width
once measured during a stall is not banned for good. A first sample capped as a likely stall counts as stale after
a tenth of ``stale_after``. The controller is never told the true profile.

**Host cost**. All per-step work runs in numba kernels over flat arrays, passed as bundles (named tuples of
arrays: ``calibration.Calibration``, ``calibration.Pending``, ``cost.CostState``, ``cost.CostRow``,
``estimate.Scratch``, ``choose.Trace``): the calibration cells, the shadow evaluation of every pending draft (kept
per request in preallocated pools grown on demand), the cost model, the width choice and the decision trace (a
preallocated ring, read only by ``decisions()``). ``plan`` is one kernel call for the batch and ``observe_batch``
one for the whole batch's committed tokens; ``step`` does a server's whole step (commit tokens to cache and
controller, propose, plan) in one kernel call, through its compiled entry point, after a check of the common input
(a list of known request ids; lists of Python ints, or int32 arrays whose ids the cache's append kernel checks)
that falls back to full validation for anything else. ``ngramspec.warmup.warm_up()`` compiles them all.

**Where it lives**. This module holds the class, its knobs and its requests; each phase of a step has a module
of its own, which the class combines: ``observe`` (committed tokens and step durations in), ``estimate`` (what
each width is worth: calibrated acceptance, expected tokens, cost row), ``choose`` (the width, the step's
kernel that runs the three phases, ``plan``, the decision trace), ``step`` (the server's whole host step with
the cache, ``step`` and ``prefetch``) and ``persist`` (the learned state, saved and loaded). Under them:
``calibration`` (the acceptance counts and the shadow evaluation), ``cost`` (the cost model) and ``protocol``.

**Determinism and tensor parallelism**. Decisions depend only on tokens (drafts, committed tokens), on the
durations passed to ``observe_step`` and on the queue length passed to ``plan``. Tokens and the scheduler's
queue are identical on every rank; durations are not, so a TP server must measure them on rank 0 and broadcast
them (the SGLang plugin does), or feed every rank the same value. Given the same inputs the controller takes
the same decisions.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from ngramspec._cache_api import Direct
from ngramspec.controller.calibration import TOP_SHAPE, Calibration, Pending
from ngramspec.controller.choose import (
    C_EXPLORED,
    C_REMEASURED,
    C_STEP,
    C_STEPS,
    C_TRACED,
    REMEASURE_RATIO,
    Choosing,
    Trace,
    _step_kernel,
)
from ngramspec.controller.cost import CostModel, CostRow, default_prior, prior_from_calibration
from ngramspec.controller.estimate import Estimating, Scratch
from ngramspec.controller.observe import Observing
from ngramspec.controller.persist import STATE_FORMAT, STATE_VERSION, Persisting, read_state_file
from ngramspec.controller.protocol import DEFAULT_WIDTHS, check_widths
from ngramspec.controller.step import Stepping, _host_step

# (REMEASURE_RATIO, read_state_file and the state file's format: re-exported from their modules)
__all__ = ["AdaptiveController", "REMEASURE_RATIO", "STATE_FORMAT", "STATE_VERSION", "read_state_file"]


def _counter(i: int, doc: str) -> property:
    """A Python int view of counter ``i`` of `AdaptiveController._ctr`."""
    def get(self) -> int:
        return int(self._ctr[i])

    def put(self, value: int) -> None:
        self._ctr[i] = value

    return property(get, put, doc=doc)


_DRAIN = {"gmean": 1, "min": 2, "hmean": 3}  # the drain objectives, as the step kernels number them


class AdaptiveController(Observing, Estimating, Choosing, Stepping, Persisting):
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
    success, see ``calibration``), ``drain`` (the objective when nobody waits behind a batch of several requests:
    "gmean", their geometric-mean speed; "hmean", their harmonic-mean speed; "min", the slowest one's: the last
    two weigh more the requests a draft does not speed up, which hold back a closed batch that ends with its last
    request), ``request_prior`` (pseudo-nodes behind each request's own check of its drafts: the nodes its decided
    drafts accepted within the prefix of the step's best drafting width, against the calibrated expectation there;
    where even the 99% upper bound of that ratio is below 1, the request's expected nodes are scaled down by it, see
    ``estimate.request_factor``; None: no check).
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
                 stale_after: int | None = 500, trace_len: int = 1000, predictor: str = "beta",
                 drain: str = "gmean", request_prior: float | None = 4.0, max_step_tokens: int | None = None,
                 max_draft_batch: int | None = None):
        if predictor not in ("beta", "logistic"):
            raise ValueError(f"predictor must be 'beta' or 'logistic', got {predictor!r}")
        if drain not in _DRAIN:
            raise ValueError(f"drain must be one of {', '.join(_DRAIN)}, got {drain!r}")
        self.drain = drain
        self._drain = _DRAIN[drain]
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
        if request_prior is not None and not (0.0 < float(request_prior) < float("inf")):
            raise ValueError(f"request_prior must be a positive number of nodes or None, got {request_prior!r}")
        self.request_prior = None if request_prior is None else float(request_prior)
        self.min_gain = float(min_gain)
        for name, value in (("max_step_tokens", max_step_tokens), ("max_draft_batch", max_draft_batch)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        self.max_step_tokens = None if max_step_tokens is None else int(max_step_tokens)
        self.max_draft_batch = None if max_draft_batch is None else int(max_draft_batch)
        # the acceptance counts (public: inspect, copy, load) and the logistic correction's weights if any
        self.calibration = Calibration.empty(logistic=predictor == "logistic")
        q_mid = np.array([0.05, 0.175, 0.375, 0.625, 0.875, 1.0])
        # per top cell (source, conditional, depth, siblings): prior_scale[depth] x the conditional's midpoint
        self.prior_mean = np.broadcast_to(q_mid[None, :, None, None] * self.prior_scale[None, None, :, None],
                                          TOP_SHAPE).reshape(-1).copy()
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
                           np.zeros(64, np.int64), np.zeros(65, np.int64), np.zeros(6, np.int64),
                           np.array([self.max_step_tokens or 0, self.max_draft_batch or 0], np.int64))
        # `step` calls its kernels through their compiled entry points (see ngramspec._cache_api.Direct): every
        # argument there has one fixed numba type (the cache's state and output buffers, this controller's own
        # arrays, token and slot arrays of one dtype and layout)
        self._host_direct = Direct(self, "_host_direct", _host_step)
        self._st = None  # the StepState of the last step and the parts it was built from
        self._st_parts = ()
        self._st_cap = 0  # the largest batch it has room for
        self._st_kind = None  # its numba type, which the compiled entry point of `_host_direct` takes
        self._step_direct = Direct(self, "_step_direct", _step_kernel)
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
        # its own evidence starts from the prior's pseudo-count (-1: no check)
        pend.predicted[s] = -1.0 if self.request_prior is None else self.request_prior
        pend.realized[s] = 0.0 if self.request_prior is None else self.request_prior
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
