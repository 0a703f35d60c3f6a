"""The controller as it was in pure Python (per-request objects, one Python loop per pending draft): the
reference the numba controller must reproduce decision for decision (tests/test_controller.py). Test-only."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np
from numba import njit

from ngramspec.cache import DraftBatch
from ngramspec.controller import batch_bucket, default_prior, prior_from_calibration  # noqa: F401

DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)

# calibration table axes
_MBINS = np.array([2, 4, 8], np.int64)  # match length: 1 | 2-3 | 4-7 | 8+
_QBINS = np.array([0.1, 0.25, 0.5, 0.75, 0.999], np.float64)  # raw conditional
_DBINS = np.array([2, 4, 8], np.int64)  # depth: 1 | 2-3 | 4-7 | 8+
_KBINS = np.array([2, 3, 5], np.int64)  # drafted siblings (itself included): 1 | 2 | 3-4 | 5+
_RBINS = 6  # request's recent success: unknown | 5 quantized levels
_N_SOURCES = 3  # own history, shared cache, token recycling
_SHAPE = (_N_SOURCES, 4, 6, 4, 4, _RBINS)  # source, match, conditional, depth, siblings, request
_MID_PER_SOURCE = 4 * 6 * 4 * 4  # (match, conditional, depth, siblings) cells of one source
_TOP_PER_SOURCE = 6 * 4 * 4  # (conditional, depth, siblings) cells of one source











class ReferenceCostModel:
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
            # outside the measured range: extend the measured slope (never downhill); below a pair whose wider
            # width came out cheaper the slope is noise, and the nearest width scales the prior's shape (below)
            if len(side) == 2 and (lo or self.estimate(batch, side[1]) >= self.estimate(batch, side[0])):
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


class ReferenceController:
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
                 trace_len: int = 1000, costs=None, drain: str = "gmean"):
        self.drain = drain
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
        self.costs = costs if costs is not None else ReferenceCostModel(prior or default_prior)
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
        self.top_succ = np.zeros(_N_SOURCES * _TOP_PER_SOURCE, np.float64)  # (source, conditional, depth, siblings)
        self.top_trials = np.zeros_like(self.top_succ)
        q_mid = np.array([0.05, 0.175, 0.375, 0.625, 0.875, 1.0])
        # per top cell (source, conditional, depth, siblings): prior_scale[depth] x the conditional's midpoint
        self.prior_mean = np.broadcast_to(q_mid[None, :, None, None] * self.prior_scale[None, None, :, None],
                                          (_N_SOURCES, 6, 4, 4)).reshape(-1).copy()
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
            if draining and self.drain == "hmean":  # the harmonic mean of the requests' rates, as a batch rate
                values.append((B * (B / float((1.0 / (1.0 + G[:, wi])).sum())) / cost, w, tokens, cost))
            elif draining and self.drain == "min":  # the slowest request's rate, as a batch rate
                values.append((B * (1.0 + float(G[:, wi].min())) / cost, w, tokens, cost))
            elif draining:  # geometric mean of the requests' rates, as a batch rate
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


