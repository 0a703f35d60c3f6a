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

**c(B, n) (cost)**. Learned from the step durations the server (or simulator) reports: an exponential moving
average per (batch size, width); an unmeasured batch size borrows the nearest measured one of the same width.
Unmeasured widths are interpolated between measured widths, extrapolated along the measured slope, or (with one
measured width) taken from a prior's shape (a calibration file, or a conservative default) scaled by what was
measured; and a few are tried, in a small bounded share of
steps, so a wrong prior is corrected. The controller is never told the true profile.

**Determinism and tensor parallelism**. Decisions depend only on tokens (drafts, committed tokens), on the
durations passed to ``observe_step`` and on the queue length passed to ``plan``. Tokens and the scheduler's
queue are identical on every rank; durations are not, so a TP server must measure them on rank 0 and broadcast
them (the SGLang plugin does), or feed every rank the same value. Given the same inputs the controller takes
the same decisions.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np
from numba import njit

from ngramspec.cache import DraftBatch

DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)

# calibration table axes
_MBINS = np.array([2, 4, 8], np.int64)  # match length: 1 | 2-3 | 4-7 | 8+
_QBINS = np.array([0.1, 0.25, 0.5, 0.75, 0.999], np.float64)  # raw conditional
_DBINS = np.array([2, 4, 8], np.int64)  # depth: 1 | 2-3 | 4-7 | 8+
_KBINS = np.array([2, 3, 5], np.int64)  # drafted siblings (itself included): 1 | 2 | 3-4 | 5+
_RBINS = 6  # request's recent success: unknown | 5 quantized levels
_SHAPE = (2, 4, 6, 4, 4, _RBINS)  # source, match, conditional, depth, siblings, request
_MID_PER_SOURCE = 4 * 6 * 4 * 4  # (match, conditional, depth, siblings) cells of one source
_TOP_PER_SOURCE = 6 * 4 * 4  # (conditional, depth, siblings) cells of one source


def default_prior(batch: int, width: int) -> float:
    """Conservative relative cost when nothing is known: a verify of n tokens costs 2 + 0.25 (n - 1) decodes.
    (The seed PCIe deployment measured 2.25 at n = 2; a single H200 1.3: erring high only delays drafting.)"""
    return 1.0 if width <= 1 else 2.0 + 0.25 * (width - 1)


def prior_from_calibration(path: str, column: str = "graph_ms") -> Callable[[int, int], float]:
    """c(B, n) from a calibration JSON (rows of B, k, kind, eager_ms, graph_ms), interpolated over B and n."""
    from ngramspec.profiles import TableProfile

    return TableProfile.from_json(path, column).cost_ms


def batch_bucket(batch: int) -> int:
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()


class CostModel:
    """Online c(B, n). A measured (B, n) is its EWMA. An unmeasured batch size borrows the nearest measured batch
    size of the same width, rescaled by the prior's shape; an unmeasured width is the prior times the ratio
    measured / prior learned in its batch bucket (or anywhere, or 1 before any measurement)."""

    def __init__(self, prior: Callable[[int, int], float] = default_prior, alpha: float = 0.2):
        self.prior = prior
        self.alpha = alpha
        self.ewma: dict[tuple[int, int], float] = {}
        self.batches_of_width: dict[int, set] = {}
        self.ratio: dict[int, float] = {}  # per bucket: measured / prior (EWMA)
        self.global_ratio: float | None = None

    def observe(self, batch: int, width: int, ms: float) -> None:
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"step duration must be a positive finite number of ms, got {ms!r}")
        key = (int(batch), int(width))
        old = self.ewma.get(key)
        self.ewma[key] = ms if old is None else old + self.alpha * (ms - old)
        self.batches_of_width.setdefault(key[1], set()).add(key[0])
        r = ms / self.prior(batch, width)
        b = batch_bucket(batch)
        self.ratio[b] = r if b not in self.ratio else self.ratio[b] + self.alpha * (r - self.ratio[b])
        g = self.global_ratio
        self.global_ratio = r if g is None else g + self.alpha * (r - g)

    def measured(self, batch: int, width: int) -> bool:
        """Whether this width was measured at a batch size within a factor of two of ``batch``."""
        return any(batch <= 2 * b and b <= 2 * batch for b in self.batches_of_width.get(width, ()))

    def estimate(self, batch: int, width: int) -> float:
        key = (int(batch), int(width))
        if key in self.ewma:
            return self.ewma[key]
        near = self.batches_of_width.get(key[1])
        if near:
            b = min(near, key=lambda x: (abs(math.log(x / key[0])), x))
            return self.ewma[(b, key[1])] * self.prior(batch, width) / self.prior(b, width)
        if width > 1:  # between two measured verify widths: interpolate their ratios to the prior
            ws = sorted(w for w in self.batches_of_width if w > 1)
            lo = [w for w in ws if w < width]
            hi = [w for w in ws if w > width]
            if lo and hi:
                r_lo = self.estimate(batch, lo[-1]) / self.prior(batch, lo[-1])
                r_hi = self.estimate(batch, hi[0]) / self.prior(batch, hi[0])
                t = (width - lo[-1]) / (hi[0] - lo[-1])
                return self.prior(batch, width) * ((1 - t) * r_lo + t * r_hi)
            side = lo[-2:] if lo else hi[:2]
            if len(side) == 2:  # outside the measured range: extend the measured slope (never downhill)
                (w0, w1) = side
                c0, c1 = self.estimate(batch, w0), self.estimate(batch, w1)
                slope = max(0.0, (c1 - c0) / (w1 - w0))
                anchor, c_anchor = (w1, c1) if lo else (w0, c0)
                return max(1e-9, c_anchor + slope * (width - anchor))
            if side:
                w = side[0]
                return self.prior(batch, width) * self.estimate(batch, w) / self.prior(batch, w)
        scale = self.ratio.get(batch_bucket(batch), self.global_ratio if self.global_ratio is not None else 1.0)
        return self.prior(batch, width) * scale


@njit(cache=True)
def _node_cells(parents, probs, sources, offsets, mlens, rbins, mb, qb, db, kb):
    """Calibration cell (flat index into the fine table) of every node of a flat DraftBatch."""
    n = parents.shape[0]
    cells = np.empty(n, np.int64)
    depth = np.empty(n, np.int64)
    siblings = np.zeros(n + 1, np.int64)  # children per parent (index p + 1; 0: the root)
    for i in range(offsets.shape[0] - 1):
        a = offsets[i]
        m = np.searchsorted(mb, mlens[i], side="right")
        for j in range(a, offsets[i + 1] + 1):
            siblings[j - a] = 0
        for j in range(a, offsets[i + 1]):
            siblings[parents[j] + 1] += 1
        for j in range(a, offsets[i + 1]):
            p = parents[j]
            if p < 0:
                q = probs[j]
                depth[j] = 1
            else:
                q = probs[j] / max(probs[a + p], 1e-12)
                depth[j] = depth[a + p] + 1
            qi = np.searchsorted(qb, q, side="right")
            di = np.searchsorted(db, depth[j], side="right")
            ki = np.searchsorted(kb, siblings[p + 1], side="right")
            cells[j] = ((((sources[j] * 4 + m) * 6 + qi) * 4 + di) * 4 + ki) * _RBINS + rbins[i]
    return cells


@njit(cache=True)
def _mid(cell):
    """(source, match, conditional, depth, siblings) cell of a fine cell."""
    return cell // _RBINS


@njit(cache=True)
def _top(cell):
    """(source, conditional, depth, siblings) cell of a fine cell."""
    mid = cell // _RBINS
    return (mid // _MID_PER_SOURCE) * _TOP_PER_SOURCE + mid % _TOP_PER_SOURCE


@njit(cache=True)
def _expected_tokens(parents, offsets, cells, succ, trials, mid_succ, mid_trials, top_succ, top_trials,
                     prior_mean, strength, widths):
    """Calibrated P(accepted) per node and, per request and width, the expected accepted nodes (no bonus).

    A node's conditional acceptance is its fine cell's Beta mean, shrunk towards its ``_mid`` cell, shrunk
    towards its ``_top`` cell, shrunk towards the fixed prior; P is the product along the path."""
    n = parents.shape[0]
    P = np.empty(n, np.float64)
    B = offsets.shape[0] - 1
    G = np.zeros((B, widths.shape[0]))
    for i in range(B):
        a = offsets[i]
        for j in range(a, offsets[i + 1]):
            c = cells[j]
            t = _top(c)
            mc = _mid(c)
            top = (top_succ[t] + strength * prior_mean[t]) / (top_trials[t] + strength)
            mid = (mid_succ[mc] + strength * top) / (mid_trials[mc] + strength)
            cond = (succ[c] + strength * mid) / (trials[c] + strength)
            p = parents[j]
            P[j] = cond if p < 0 else cond * P[a + p]
            k = j - a + 1  # this node is the request's k-th: every width w with w - 1 >= k holds it
            for w in range(widths.shape[0]):
                if widths[w] - 1 >= k:
                    G[i, w] += P[j]
    return P, G


@njit(cache=True)
def _record(tried, hits, succ, trials, mid_succ, mid_trials, top_succ, top_trials):
    for i in range(tried.shape[0]):
        c = tried[i]
        mc = _mid(c)
        t = _top(c)
        trials[c] += 1.0
        mid_trials[mc] += 1.0
        top_trials[t] += 1.0
        if hits[i]:
            succ[c] += 1.0
            mid_succ[mc] += 1.0
            top_succ[t] += 1.0


@dataclass
class _Pending:
    """A proposed draft being decided, one depth per committed token: at each depth the children of the node
    accepted so far are tried, and the one matching the committed token (if any) is accepted."""

    tokens: list
    parents: list
    cells: np.ndarray
    cur: int = -1  # deepest accepted node (-1: the root)


@dataclass
class _Request:
    success: float | None = None  # EWMA of this request's per-node conditional success
    pending: list = field(default_factory=list)  # every proposed draft not yet decided (oldest first)


@dataclass(frozen=True)
class Plan:
    width: int  # batch verify width incl. the root (1 = plain decode)
    lengths: np.ndarray  # draft nodes kept per request (prefix lengths)
    expected: float  # expected tokens this step (bonus included)
    cost: float  # estimated step cost (ms, or relative units before any measurement)
    reason: str  # "best", "explore" or "no-draft"


class AdaptiveController:
    """Chooses the batch verify width and each request's draft prefix. See the module docstring.

    Knobs: ``widths`` (the verify widths a server holds CUDA graphs for), ``prior`` (c(B, n) before any
    measurement: a callable or a calibration file path), ``explore_min`` + ``explore_frac`` x steps (how many steps
    may try a width not yet measured within a factor of two of the current batch size; only one that would win at ``explore_optimism``
    times its estimated cost, the widest first; unmeasured widths between measured ones are interpolated, not explored), ``prior_strength`` (pseudo-trials behind each calibration cell's prior),
    ``prior_scale`` (per depth bin 1 | 2-3 | 4-7 | 8+: the fixed prior of a cell's conditional acceptance is this
    times the cache's raw conditional; it only matters until the (conditional, depth) cells have data),
    ``request_alpha`` (EWMA weight of a request's recent success), ``min_gain`` (a width's expected value must beat
    plain decoding's by this share per decode-step of extra cost: 0.1 asks a verify costing 2 decodes for 10%
    more, one costing 1.3 decodes for 3% more), ``trace_len`` (decisions kept for debugging).
    """

    def __init__(self, widths: Sequence[int] = DEFAULT_WIDTHS, prior=None, explore_frac: float = 0.002,
                 explore_min: int = 1, explore_optimism: float = 0.7,
                 prior_strength: float = 10.0, prior_scale: Sequence[float] = (0.2, 0.35, 0.5, 0.6),
                 request_alpha: float = 0.25, min_gain: float = 0.1,
                 trace_len: int = 1000):
        widths = sorted(set(int(w) for w in widths))
        if not widths or widths[0] < 1:
            raise ValueError(f"widths must be positive integers, got {widths}")
        if widths[0] != 1:
            widths = [1] + widths
        self.widths = widths
        self._widths = np.asarray(widths, np.int64)
        self.max_width = widths[-1]
        if isinstance(prior, str):
            prior = prior_from_calibration(prior)
        self.costs = CostModel(prior or default_prior)
        self.explore_frac = float(explore_frac)
        self.explore_min = int(explore_min)
        self.explore_optimism = float(explore_optimism)
        self.prior_strength = float(prior_strength)
        self.prior_scale = np.asarray(prior_scale, np.float64)
        if self.prior_scale.shape != (4,):
            raise ValueError("prior_scale needs one factor per depth bin (1, 2-3, 4-7, 8+)")
        self.request_alpha = float(request_alpha)
        self.min_gain = float(min_gain)
        self.succ = np.zeros(int(np.prod(_SHAPE)), np.float64)  # fine cells
        self.trials = np.zeros_like(self.succ)
        self.mid_succ = np.zeros(int(np.prod(_SHAPE[:5])), np.float64)  # (source, match, conditional, depth, siblings)
        self.mid_trials = np.zeros_like(self.mid_succ)
        self.top_succ = np.zeros(2 * _TOP_PER_SOURCE, np.float64)  # (source, conditional, depth, siblings)
        self.top_trials = np.zeros_like(self.top_succ)
        q_mid = np.array([0.05, 0.175, 0.375, 0.625, 0.875, 1.0])
        # per top cell (source, conditional, depth, siblings): prior_scale[depth] x the conditional's midpoint
        self.prior_mean = np.broadcast_to(q_mid[None, :, None, None] * self.prior_scale[None, None, :, None],
                                          (2, 6, 4, 4)).reshape(-1).copy()
        self.requests: dict[Hashable, _Request] = {}
        self.trace: deque = deque(maxlen=int(trace_len))
        self._n_steps = 0
        self._n_explored = 0
        self._step = 0

    # --------------------------------------------------------------------------------------- requests
    def start(self, rid: Hashable) -> None:
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already tracked by the controller")
        self.requests[rid] = _Request()

    def finish(self, rid: Hashable) -> None:
        if self.requests.pop(rid, None) is None:
            raise KeyError(f"unknown request id {rid!r}")

    def _rbin(self, r: _Request) -> int:
        if r.success is None:
            return 0
        return 1 + min(4, int(r.success * 5))

    # --------------------------------------------------------------------------------------- decide
    def _rbins(self, rids: Sequence[Hashable]) -> np.ndarray:
        try:
            return np.array([self._rbin(self.requests[r]) for r in rids], np.int64)
        except KeyError as e:
            raise KeyError(f"unknown request id {e.args[0]!r}: call start() first") from None

    def _tables(self):
        return self.succ, self.trials, self.mid_succ, self.mid_trials, self.top_succ, self.top_trials

    def _cells(self, rids, batch: DraftBatch) -> np.ndarray:
        return _node_cells(batch.parents, batch.probs.astype(np.float64), batch.sources.astype(np.int64),
                           batch.offsets, batch.match_lens, self._rbins(rids), _MBINS, _QBINS, _DBINS, _KBINS)

    def node_values(self, rids: Sequence[Hashable], batch: DraftBatch) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated P(accepted) of every node of the batch, and each node's calibration cell."""
        cells = self._cells(rids, batch)
        P, _ = _expected_tokens(batch.parents, batch.offsets, cells, *self._tables(), self.prior_mean,
                                self.prior_strength, self._widths)
        return P, cells

    def plan(self, rids: Sequence[Hashable], batch: DraftBatch, waiting: int | None = None) -> Plan:
        """Pick the width and per-request prefixes for this step; records the drafts for calibration.

        ``waiting``: requests queued behind this batch (the scheduler's queue length), or None if unknown.
        0 switches the objective from the batch's tokens per unit time to the requests' geometric-mean speed
        (see the module docstring)."""
        B = len(rids)
        if len(batch) != B:
            raise ValueError(f"{B} request ids but {len(batch)} drafts")
        if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, (int, np.integer))
                                    or waiting < 0):
            raise ValueError(f"waiting must be a non-negative int or None, got {waiting!r}")
        cells = self._cells(rids, batch)
        _, G = _expected_tokens(batch.parents, batch.offsets, cells, *self._tables(), self.prior_mean,
                                self.prior_strength, self._widths)
        expected = B + G.sum(axis=0)
        draining = waiting == 0 and B > 1  # nobody waiting: judge each width by its mean log rate per request
        if draining:
            log_tokens = np.log1p(G).sum(axis=0)
        lens = np.diff(batch.offsets)
        for i, rid in enumerate(rids):  # shadow-evaluate every draft, sent or not (see observe_tokens)
            if lens[i] > 0:
                a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
                self.requests[rid].pending.append(
                    _Pending(batch.tokens[a:b].tolist(), batch.parents[a:b].tolist(), cells[a:b].copy()))
        any_draft = bool(batch.offsets[-1] > 0)
        values = []
        for wi, (w, tokens) in enumerate(zip(self.widths, expected.tolist())):
            if w > 1 and not any_draft:
                break
            cost = self.costs.estimate(B, w)
            if draining:  # geometric mean of the requests' rates, as a batch rate
                values.append((B * math.exp(log_tokens[wi] / B) / cost, w, tokens, cost))
            else:
                values.append((tokens / cost, w, tokens, cost))
        # a wider verify risks more time on a wrong estimate: its value must beat plain decoding by a margin
        # proportional to its extra cost (min_gain per decode-step of extra time)
        plain = values[0][3]
        best = max(values, key=lambda v: (v[0] / (1.0 + self.min_gain * max(0.0, v[3] / plain - 1.0)), -v[1]))
        reason = "best" if best[1] > 1 else ("no-draft" if not any_draft else "best")
        self._n_steps += 1
        if any_draft and self._n_explored < self.explore_min + self.explore_frac * self._n_steps:
            # try a width not yet measured here only if it would win were it cheaper than estimated;
            # the widest first: it bounds the interpolation of every width below it
            candidates = [v for v in values
                          if not self.costs.measured(B, v[1]) and v[2] / (self.explore_optimism * v[3]) > best[0]]
            if candidates:
                best = max(candidates, key=lambda v: v[1])
                reason = "explore"
                self._n_explored += 1
        self._step += 1
        _, w, tokens, cost = best
        lengths = np.minimum(lens, w - 1)
        plan = Plan(w, lengths, tokens, cost, reason)
        self.trace.append((self._step, B, w, reason, tokens, cost, values))
        return plan

    def decisions(self) -> list[dict]:
        """The recent decisions (the last ``trace_len``), readable: why each step got its width."""
        return [{"step": st, "batch": B, "width": w, "reason": why, "expected_tokens": round(tok, 3),
                 "est_cost": round(cost, 4), "options": {v[1]: round(v[0], 4) for v in values}}
                for st, B, w, why, tok, cost, values in self.trace]

    # -------------------------------------------------------------------------------------- observe
    def observe_tokens(self, rid: Hashable, committed: Sequence[int]) -> None:
        """The tokens the model committed for ``rid`` this step (accepted draft tokens + bonus)."""
        try:
            r = self.requests[rid]
        except KeyError:
            raise KeyError(f"unknown request id {rid!r}") from None
        if not r.pending:
            return
        tried: list[int] = []
        hits: list[bool] = []
        # Every draft proposed is judged, not only those sent: one that was not sent is decided over the next
        # steps' tokens while newer drafts are proposed. Judging only a draft at a time would under-sample the
        # drafts proposed while an older one keeps being right, and so underrate a request on a good streak.
        still = []
        for p in r.pending:
            for t in committed:
                nxt = -1
                for j, (tok, par) in enumerate(zip(p.tokens, p.parents)):
                    if par == p.cur:
                        tried.append(int(p.cells[j]))
                        hit = tok == t
                        hits.append(hit)
                        if hit:
                            nxt = j
                if nxt < 0:
                    break  # decided: the accepted path ends here
                p.cur = nxt
            else:
                if any(par == p.cur for par in p.parents):
                    still.append(p)  # children of the accepted node still to be decided
        r.pending = still
        if tried:
            _record(np.array(tried, np.int64), np.array(hits, np.bool_), *self._tables())
            rate = sum(hits) / len(hits)
            r.success = rate if r.success is None else r.success + self.request_alpha * (rate - r.success)

    def observe_step(self, batch: int, width: int, duration_ms: float) -> None:
        """The measured duration of a step of ``batch`` requests verified at ``width``."""
        self.costs.observe(batch, width, duration_ms)


# ------------------------------------------------------------------------------------- simulator method
def _register() -> None:
    from ngramspec.cache import NgramCache
    from ngramspec.methods import Method, register_method

    class AdaptiveMethod(Method):
        """`ngramspec-adaptive`: NgramCache tree drafts, controller-chosen width. Sees only reported durations."""

        profile_dependent = True  # its decisions depend on the durations it observes

        def __init__(self, max_width: int = 16, prior: str = "default", tree: int = 1, depth: int = 16,
                     explore_frac: float = 0.002, widths: str | None = None):
            if widths is not None:  # e.g. widths=1-2-4-8-17
                try:
                    widths = [int(w) for w in str(widths).split("-")]
                except ValueError:
                    raise ValueError(f"widths must look like 1-2-4-8-16, got {widths!r}") from None
            else:
                widths = [w for w in DEFAULT_WIDTHS if w <= max_width]
            if prior == "default":
                prior_fn = None
            elif prior in ("seed-pcie8", "h200-llama8b") or prior.endswith(".json"):
                from ngramspec.profiles import get_profile
                prior_fn = get_profile(prior).cost_ms  # a deliberately *assumed* cost, e.g. a wrong one
            else:
                raise ValueError(f"prior must be 'default', a profile name or a .json file, got {prior!r}")
            self.ctl = AdaptiveController(widths, prior=prior_fn, explore_frac=explore_frac)
            self.cache = NgramCache(max_depth=depth)
            self.tree = bool(tree)
            self._width = 1
            self._pending_rids: list = []
            self._pending_tokens: list = []

        def warmup(self) -> None:
            from ngramspec.cache import warm_up

            warm_up()
            ctl = AdaptiveController()
            c = NgramCache(max_depth=4, max_requests=2, local_nodes=64, shared_nodes=64, shared_tokens=64)
            c.start_request(0, [1, 2, 1, 2])
            ctl.start(0)
            ctl.plan([0], c.propose([0], 2))
            ctl.observe_tokens(0, [1, 2])

        def bind_profile(self, profile) -> None:
            pass  # deliberately ignored: the controller learns costs only from observe_step

        def start(self, rid, prompt):
            self.cache.start_request(rid, prompt)
            self.ctl.start(rid)

        def _flush(self):
            if self._pending_rids:  # one batched call for the step's committed tokens
                self.cache.add_tokens_batch(self._pending_rids, self._pending_tokens)
                self._pending_rids, self._pending_tokens = [], []

        def propose(self, rids):
            self._flush()
            batch = self.cache.propose(rids, max(1, self.ctl.max_width - 1), tree=self.tree)
            plan = self.ctl.plan(rids, batch, waiting=self.waiting)
            self._width = plan.width
            out = []
            for i in range(len(rids)):
                a, k = int(batch.offsets[i]), int(plan.lengths[i])
                out.append((batch.tokens[a:a + k], batch.parents[a:a + k]))
            return out

        def verify_width(self, rids, drafts):
            return self._width

        def update(self, rid, committed, n_accepted):
            self._pending_rids.append(rid)
            self._pending_tokens.append(committed)
            self.ctl.observe_tokens(rid, committed)

        def observe_step(self, batch_size, width, duration_ms):
            self.ctl.observe_step(batch_size, width, duration_ms)

        def finish(self, rid):
            self._flush()
            self.cache.finish_request(rid, share=True)
            self.ctl.finish(rid)

    register_method("ngramspec-adaptive", AdaptiveMethod)


_register()
