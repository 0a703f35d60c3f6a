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

**Host cost**. All per-step work runs in numba kernels over flat arrays: the calibration cells, the shadow
evaluation of every pending draft (kept per request in preallocated pools grown on demand), the cost model and
the width choice. ``plan`` is one kernel call for the batch and ``observe_batch`` one for the whole batch's
committed tokens; ``step`` does a server's whole step (commit tokens to cache and controller, propose, plan)
in four kernel calls. ``warm_up()`` compiles them all.

**Determinism and tensor parallelism**. Decisions depend only on tokens (drafts, committed tokens), on the
durations passed to ``observe_step`` and on the queue length passed to ``plan``. Tokens and the scheduler's
queue are identical on every rank; durations are not, so a TP server must measure them on rank 0 and broadcast
them (the SGLang plugin does), or feed every rank the same value. Given the same inputs the controller takes
the same decisions.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Hashable, Sequence

import numpy as np
from numba import njit

from ngramspec.cache import MAX_TOKEN, DraftBatch, as_tokens

DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_WIDTH = 4097  # a width holds the root and at most the cache's MAX_BUDGET draft nodes

# calibration table axes
_MBINS = np.array([2, 4, 8], np.int64)  # match length: 1 | 2-3 | 4-7 | 8+
_QBINS = np.array([0.1, 0.25, 0.5, 0.75, 0.999], np.float64)  # raw conditional
_DBINS = np.array([2, 4, 8], np.int64)  # depth: 1 | 2-3 | 4-7 | 8+
_KBINS = np.array([2, 3, 5], np.int64)  # drafted siblings (itself included): 1 | 2 | 3-4 | 5+
_RBINS = 6  # request's recent success: unknown | 5 quantized levels
_SHAPE = (2, 4, 6, 4, 4, _RBINS)  # source, match, conditional, depth, siblings, request
_MID_PER_SOURCE = 4 * 6 * 4 * 4  # (match, conditional, depth, siblings) cells of one source
_TOP_PER_SOURCE = 6 * 4 * 4  # (conditional, depth, siblings) cells of one source
_REASONS = ("best", "no-draft", "explore", "re-measure")
REMEASURE_RATIO = 1.5  # a stale width is re-measured only if its estimate is this far above what the others imply


def default_prior(batch: int, width: int) -> float:
    """Conservative relative cost when nothing is known: a verify of n tokens costs 2 + 0.25 (n - 1) decodes.
    (The seed PCIe deployment measured 2.25 at n = 2; a single H200 1.3: erring high only delays drafting.)"""
    return 1.0 if width <= 1 else 2.0 + 0.25 * (width - 1)


def prior_from_calibration(path: str, column: str = "graph_ms") -> Callable[[int, int], float]:
    """c(B, n) from a calibration JSON (rows of B, k, kind, eager_ms, graph_ms), interpolated over B and n."""
    from ngramspec.sim.profiles import TableProfile

    return TableProfile.from_json(path, column).cost_ms


def batch_bucket(batch: int) -> int:
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()


_INT_TYPES = frozenset((int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# ---------------------------------------------------------------------------------------------- cost model
@njit(cache=True)
def _bucket_id(b):
    """Index of ``batch_bucket(b)``: 1-4 as themselves, then one per power of two."""
    if b <= 4:
        return b
    k = 0
    x = b - 1
    while x > 0:
        x >>= 1
        k += 1
    return k + 2


@njit(cache=True)
def _cost_observe(B, wi, ms, ewma, last, blist, nblist, ratio, has_ratio, gstate, prior, alpha, clip, clock,
                  stale_after):
    """One measured step. Updates are clipped to [old / clip, old * clip] (clip <= 0: not clipped); a key not
    measured for ``stale_after`` steps (<= 0: never stale) restarts from the new sample."""
    old = ewma[B, wi]
    if np.isnan(old):
        ewma[B, wi] = ms
        k = nblist[wi]
        blist[wi, k] = B
        nblist[wi] = k + 1
    elif stale_after > 0 and clock - last[B, wi] > stale_after:
        ewma[B, wi] = ms
    else:
        x = ms
        if clip > 0:
            x = min(max(x, old / clip), old * clip)
        ewma[B, wi] = old + alpha * (x - old)
    last[B, wi] = clock
    r = ms / prior[B, wi]
    bi = _bucket_id(B)
    if not has_ratio[bi]:
        ratio[bi] = r
        has_ratio[bi] = True
    else:
        x = r
        if clip > 0:
            x = min(max(x, ratio[bi] / clip), ratio[bi] * clip)
        ratio[bi] = ratio[bi] + alpha * (x - ratio[bi])
    if gstate[1] == 0.0:
        gstate[0] = r
        gstate[1] = 1.0
    else:
        x = r
        if clip > 0:
            x = min(max(x, gstate[0] / clip), gstate[0] * clip)
        gstate[0] = gstate[0] + alpha * (x - gstate[0])


@njit(cache=True)
def _cost_row(B, ewma, blist, nblist, ratio, has_ratio, gstate, prior, widths, exclude, out):
    """c(B, w) for every width into ``out``; width index ``exclude`` (-1: none) is treated as never measured."""
    W = widths.shape[0]
    nb = ewma.shape[0]
    direct = np.empty(W, np.float64)
    for wi in range(W):
        direct[wi] = np.nan
        if wi == exclude:
            continue
        if B < nb and not np.isnan(ewma[B, wi]):
            direct[wi] = ewma[B, wi]
            continue
        best_b = -1
        best_d = np.inf
        for k in range(nblist[wi]):
            b = blist[wi, k]
            d = abs(math.log(b / B))
            if d < best_d or (d == best_d and b < best_b):
                best_d = d
                best_b = b
        if best_b > 0:
            direct[wi] = ewma[best_b, wi] * prior[B, wi] / prior[best_b, wi]
    for wi in range(W):
        if not np.isnan(direct[wi]):
            out[wi] = direct[wi]
            continue
        w = widths[wi]
        if w > 1:
            lo = -1
            lo2 = -1
            hi = -1
            hi2 = -1
            for v in range(W):
                if widths[v] <= 1 or np.isnan(direct[v]):
                    continue
                if widths[v] < w:
                    lo2 = lo
                    lo = v
                elif widths[v] > w:
                    if hi < 0:
                        hi = v
                    elif hi2 < 0:
                        hi2 = v
            if lo >= 0 and hi >= 0:  # between two measured verify widths: interpolate their ratios to the prior
                r_lo = direct[lo] / prior[B, lo]
                r_hi = direct[hi] / prior[B, hi]
                t = (w - widths[lo]) / (widths[hi] - widths[lo])
                out[wi] = prior[B, wi] * ((1 - t) * r_lo + t * r_hi)
                continue
            if lo >= 0 and lo2 >= 0 or lo < 0 and hi2 >= 0:  # outside: extend the measured slope (never downhill)
                if lo >= 0:
                    w0, w1 = lo2, lo
                else:
                    w0, w1 = hi, hi2
                c0 = direct[w0]
                c1 = direct[w1]
                slope = max(0.0, (c1 - c0) / (widths[w1] - widths[w0]))
                if lo >= 0:
                    out[wi] = max(1e-9, c1 + slope * (w - widths[w1]))
                else:
                    out[wi] = max(1e-9, c0 + slope * (w - widths[w0]))
                continue
            side = lo if lo >= 0 else hi
            if side >= 0:
                out[wi] = prior[B, wi] * direct[side] / prior[B, side]
                continue
        bi = _bucket_id(B)
        if bi < has_ratio.shape[0] and has_ratio[bi]:
            scale = ratio[bi]
        elif gstate[1] != 0.0:
            scale = gstate[0]
        else:
            scale = 1.0
        out[wi] = prior[B, wi] * scale


@njit(cache=True)
def _cost_near(B, widths, last, blist, nblist, clock, stale_after, measured, stale):
    """Per width: measured at a batch size within a factor of two of B; and if so, whether all such
    measurements are older than ``stale_after`` steps."""
    for wi in range(widths.shape[0]):
        newest = -1
        found = False
        for k in range(nblist[wi]):
            b = blist[wi, k]
            if B <= 2 * b and b <= 2 * B:
                found = True
                if last[b, wi] > newest:
                    newest = last[b, wi]
        measured[wi] = found
        stale[wi] = found and stale_after > 0 and clock - newest > stale_after


class CostModel:
    """Online c(B, n) over the verify widths ``widths``. A measured (B, n) is a moving average of its samples,
    each update clipped to a factor ``clip`` of the current value (``clip=None``: plain EWMA). An unmeasured
    batch size borrows the nearest measured batch size of the same width, rescaled by the prior's shape; an
    unmeasured width is interpolated between measured widths, extended along their slope, or the prior times
    the ratio measured / prior (per batch bucket, else anywhere, else 1). A (B, n) not measured for
    ``stale_after`` samples (``None``: never) restarts from its next sample. State: flat arrays, kernels in
    numba; the prior is tabulated once per batch size."""

    def __init__(self, prior: Callable[[int, int], float] = default_prior, alpha: float = 0.2,
                 widths: Sequence[int] = DEFAULT_WIDTHS, clip: float | None = 2.0, stale_after: int | None = 500):
        self.prior = prior
        self.alpha = float(alpha)
        ws = sorted(set(int(w) for w in widths))
        if not ws or ws[0] < 1 or ws[-1] > MAX_WIDTH:
            raise ValueError(f"widths must be integers in [1, {MAX_WIDTH}], got {list(widths)!r}")
        if ws[0] != 1:
            ws = [1] + ws
        if clip is not None and not clip > 1:
            raise ValueError(f"clip must be > 1 or None, got {clip!r}")
        if stale_after is not None and (not _is_int(stale_after) or stale_after < 1):
            raise ValueError(f"stale_after must be an int >= 1 or None, got {stale_after!r}")
        self.widths = ws
        self._w = np.asarray(ws, np.int64)
        self._wi = {w: i for i, w in enumerate(ws)}
        self.clip = 0.0 if clip is None else float(clip)
        self.stale_after = 0 if stale_after is None else int(stale_after)
        self.clock = 0  # samples observed
        W = len(ws)
        self._ewma = np.full((2, W), np.nan)
        self._last = np.full((2, W), -1, np.int64)
        self._prior = np.zeros((2, W))
        self._prior_rows = 0  # rows of _prior filled (batch sizes 1 .. _prior_rows - 1)
        self._blist = np.zeros((W, 8), np.int64)
        self._nblist = np.zeros(W, np.int64)
        self._ratio = np.zeros(40)
        self._has_ratio = np.zeros(40, np.bool_)
        self._g = np.zeros(2)  # global ratio, has one
        self._version = 0  # bumped by every observe: cached rows are stale
        self._rows: dict = {}

    def _ensure(self, batch: int) -> None:
        """Grow the tables to hold batch size ``batch`` and tabulate the prior up to it."""
        if batch >= self._ewma.shape[0]:
            n = max(batch + 1, 2 * self._ewma.shape[0])
            W = len(self.widths)
            for name, fill, dt in (("_ewma", np.nan, np.float64), ("_last", -1, np.int64), ("_prior", 0.0, np.float64)):
                old = getattr(self, name)
                new = np.full((n, W), fill, dt)
                new[: old.shape[0]] = old
                setattr(self, name, new)
        if batch >= self._prior_rows:
            for b in range(max(1, self._prior_rows), batch + 1):
                row = [float(self.prior(b, w)) for w in self.widths]
                if not all(v > 0 and math.isfinite(v) for v in row):
                    raise ValueError(f"the cost prior must be positive and finite, got {row} at batch {b}")
                self._prior[b] = row
            self._prior_rows = batch + 1

    def _check(self, batch, width) -> int:
        if not _is_int(batch) or batch < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {batch!r}")
        if not _is_int(width) or int(width) not in self._wi:
            raise ValueError(f"width must be one of {self.widths}, got {width!r}")
        return self._wi[int(width)]

    def observe(self, batch: int, width: int, ms: float) -> None:
        wi = self._check(batch, width)
        if isinstance(ms, (bool, np.bool_)) or not isinstance(ms, (int, float, np.integer, np.floating)) \
                or not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"step duration must be a positive finite number of ms, got {ms!r}")
        batch = int(batch)
        self._ensure(batch)
        if self._nblist[wi] >= self._blist.shape[1] and np.isnan(self._ewma[batch, wi]):
            grown = np.zeros((self._blist.shape[0], 2 * self._blist.shape[1]), np.int64)
            grown[:, : self._blist.shape[1]] = self._blist
            self._blist = grown
        if batch_bucket(batch) > 1 << 36:
            raise ValueError(f"batch size {batch} is out of range")
        self.clock += 1
        _cost_observe(batch, wi, float(ms), self._ewma, self._last, self._blist, self._nblist, self._ratio,
                      self._has_ratio, self._g, self._prior, self.alpha, self.clip, self.clock, self.stale_after)
        self._version += 1
        self._rows.clear()

    def row(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(c(B, n), measured near B, stale near B, c(B, n) as the other widths imply it) for every width;
        cached until the next observe. Do not modify the arrays."""
        got = self._rows.get(batch)
        if got is not None:
            return got
        if batch >= self._prior_rows:
            self._ensure(batch)
        W = len(self.widths)
        costs = np.empty(W)
        _cost_row(batch, self._ewma, self._blist, self._nblist, self._ratio, self._has_ratio, self._g,
                  self._prior, self._w, -1, costs)
        measured = np.empty(W, np.bool_)
        stale = np.empty(W, np.bool_)
        _cost_near(batch, self._w, self._last, self._blist, self._nblist, self.clock, self.stale_after,
                   measured, stale)
        implied = costs.copy()
        for wi in np.flatnonzero(stale):
            tmp = np.empty(W)
            _cost_row(batch, self._ewma, self._blist, self._nblist, self._ratio, self._has_ratio, self._g,
                      self._prior, self._w, int(wi), tmp)
            implied[wi] = tmp[wi]
        got = (costs, measured, stale, implied)
        if len(self._rows) > 64:
            self._rows.clear()
        self._rows[batch] = got
        return got

    def measured(self, batch: int, width: int) -> bool:
        """Whether this width was measured at a batch size within a factor of two of ``batch``."""
        wi = self._check(batch, width)
        return bool(self.row(int(batch))[1][wi])

    def estimate(self, batch: int, width: int) -> float:
        wi = self._check(batch, width)
        return float(self.row(int(batch))[0][wi])


# ----------------------------------------------------------------------------------------- calibration
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
def _rbin(success):
    """The request's recent-success bin (success < 0: unknown)."""
    if success < 0:
        return 0
    return 1 + min(4, int(success * 5))


@njit(cache=True)
def _node_cells(parents, probs, sources, offsets, mlens, slots, success, cells):
    """Calibration cell (flat index into the fine table) of every node of a flat DraftBatch, into ``cells``."""
    n = parents.shape[0]
    depth = np.empty(n, np.int64)
    siblings = np.zeros(n + 1, np.int64)  # children per parent (index p + 1; 0: the root)
    for i in range(offsets.shape[0] - 1):
        a = offsets[i]
        m = np.searchsorted(_MBINS, mlens[i], side="right")
        rb = _rbin(success[slots[i]])
        for j in range(a, offsets[i + 1] + 1):
            siblings[j - a] = 0
        for j in range(a, offsets[i + 1]):
            siblings[parents[j] + 1] += 1
        for j in range(a, offsets[i + 1]):
            p = parents[j]
            if p < 0:
                q = np.float64(probs[j])
                depth[j] = 1
            else:
                q = np.float64(probs[j]) / max(np.float64(probs[a + p]), 1e-12)
                depth[j] = depth[a + p] + 1
            qi = np.searchsorted(_QBINS, q, side="right")
            di = np.searchsorted(_DBINS, depth[j], side="right")
            ki = np.searchsorted(_KBINS, siblings[p + 1], side="right")
            cells[j] = ((((np.int64(sources[j]) * 4 + m) * 6 + qi) * 4 + di) * 4 + ki) * _RBINS + rb


@njit(cache=True)
def _node_values(parents, offsets, cells, succ, trials, mid_succ, mid_trials, top_succ, top_trials,
                 prior_mean, strength, widths, P, G):
    """Calibrated P(accepted) per node into ``P`` and, per request and width, the expected accepted nodes (no
    bonus) into ``G``. A node's conditional acceptance is its fine cell's Beta mean, shrunk towards its ``_mid``
    cell, shrunk towards its ``_top`` cell, shrunk towards the fixed prior; P is the product along the path."""
    B = offsets.shape[0] - 1
    for i in range(B):
        for w in range(widths.shape[0]):
            G[i, w] = 0.0
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


@njit(cache=True)
def _choose(parents, probs, sources, offsets, mlens, slots, success, succ, trials, mid_succ, mid_trials,
            top_succ, top_trials, prior_mean, strength, widths, costs, measured, stale, implied, draining,
            min_gain, may_explore, may_remeasure, optimism, cells, P, G, values, expected, lengths):
    """The width choice for one step (see AdaptiveController.plan). Fills cells, values (-inf: width not
    considered), expected and lengths; returns (width index, reason index)."""
    B = offsets.shape[0] - 1
    W = widths.shape[0]
    _node_cells(parents, probs, sources, offsets, mlens, slots, success, cells)
    _node_values(parents, offsets, cells, succ, trials, mid_succ, mid_trials, top_succ, top_trials,
                 prior_mean, strength, widths, P, G)
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


@njit(cache=True)
def _pend_room(slots, offsets, nd, nn, cap_d, cap_n):
    """Room the pending pools need for the batch's drafts: (drafts, nodes) per slot, or (0, 0) if they fit."""
    need_d = 0
    need_n = 0
    for i in range(slots.shape[0]):
        L = offsets[i + 1] - offsets[i]
        if L > 0:
            s = slots[i]
            if nd[s] + 1 > cap_d:
                need_d = max(need_d, nd[s] + 1)
            if nn[s] + L > cap_n:
                need_n = max(need_n, nn[s] + L)
    return need_d, need_n


@njit(cache=True)
def _pend_add(slots, tokens, parents, offsets, cells, ptok, ppar, pcell, pstart, plen, pcur, nd, nn):
    """Queue every non-empty draft of the batch for shadow evaluation (the pools have room)."""
    for i in range(slots.shape[0]):
        a = offsets[i]
        L = offsets[i + 1] - a
        if L == 0:
            continue
        s = slots[i]
        d = nd[s]
        base = nn[s]
        pstart[s, d] = base
        plen[s, d] = L
        pcur[s, d] = -1
        for j in range(L):
            ptok[s, base + j] = tokens[a + j]
            ppar[s, base + j] = parents[a + j]
            pcell[s, base + j] = cells[a + j]
        nd[s] = d + 1
        nn[s] = base + L


@njit(cache=True)
def _observe(slots, toks, offs, ptok, ppar, pcell, pstart, plen, pcur, nd, nn, success, alpha,
             succ, trials, mid_succ, mid_trials, top_succ, top_trials):
    """Shadow-evaluate every pending draft of each request against its committed tokens ``toks[offs[k]:
    offs[k+1]]``: at each depth the children of the node accepted so far are tried, the one matching the
    committed token (if any) is accepted; a draft is decided when none matches or its accepted node has no
    children. Counts go to the calibration tables, the request's success rate moves; undecided drafts stay
    (oldest first), compacted in place."""
    for k in range(slots.shape[0]):
        s = slots[k]
        if nd[s] == 0:
            continue
        a = offs[k]
        b = offs[k + 1]
        ntried = 0
        nhit = 0
        keep = 0
        wpos = 0
        for d in range(nd[s]):
            st = pstart[s, d]
            L = plen[s, d]
            cur = pcur[s, d]
            decided = False
            for q in range(a, b):
                t = toks[q]
                nxt = -1
                for j in range(L):
                    if ppar[s, st + j] == cur:
                        c = pcell[s, st + j]
                        mc = _mid(c)
                        tc = _top(c)
                        trials[c] += 1.0
                        mid_trials[mc] += 1.0
                        top_trials[tc] += 1.0
                        ntried += 1
                        if ptok[s, st + j] == t:
                            succ[c] += 1.0
                            mid_succ[mc] += 1.0
                            top_succ[tc] += 1.0
                            nhit += 1
                            nxt = j
                if nxt < 0:
                    decided = True
                    break
                cur = nxt
            if decided:
                continue
            alive = False
            for j in range(L):
                if ppar[s, st + j] == cur:
                    alive = True
                    break
            if alive:  # children of the accepted node still to be decided
                if wpos != st:
                    for j in range(L):
                        ptok[s, wpos + j] = ptok[s, st + j]
                        ppar[s, wpos + j] = ppar[s, st + j]
                        pcell[s, wpos + j] = pcell[s, st + j]
                pstart[s, keep] = wpos
                plen[s, keep] = L
                pcur[s, keep] = cur
                keep += 1
                wpos += L
        nd[s] = keep
        nn[s] = wpos
        if ntried > 0:
            rate = nhit / ntried
            success[s] = rate if success[s] < 0 else success[s] + alpha * (rate - success[s])


@njit(cache=True)
def _step_kernel(slots, toks, offs, parents, probs, sources, tokens, offsets, mlens, success, alpha,
                 succ, trials, mid_succ, mid_trials, top_succ, top_trials, prior_mean, strength, widths, costs,
                 measured, stale, implied, draining, min_gain, may_explore, may_remeasure, optimism, cells, P, G,
                 values, expected, lengths, ptok, ppar, pcell, pstart, plen, pcur, nd, nn):
    """The controller's whole step in one call: shadow-evaluate the pending drafts against the tokens committed
    since the last step (``toks``/``offs``, one slice per request), choose the width for the new drafts, queue
    them. Returns (width index, reason index, drafts, nodes): if the pending pools lack room it changes nothing
    and returns (-1, -1, drafts, nodes) they need per request."""
    need_d, need_n = _pend_room(slots, offsets, nd, nn, pstart.shape[1], ptok.shape[1])
    if need_d > 0 or need_n > 0:
        return -1, -1, need_d, need_n
    if offs.shape[0] > 1:
        _observe(slots, toks, offs, ptok, ppar, pcell, pstart, plen, pcur, nd, nn, success, alpha,
                 succ, trials, mid_succ, mid_trials, top_succ, top_trials)
    best, reason = _choose(parents, probs, sources, offsets, mlens, slots, success, succ, trials, mid_succ,
                           mid_trials, top_succ, top_trials, prior_mean, strength, widths, costs, measured, stale,
                           implied, draining, min_gain, may_explore, may_remeasure, optimism, cells, P, G, values,
                           expected, lengths)
    _pend_add(slots, tokens, parents, offsets, cells, ptok, ppar, pcell, pstart, plen, pcur, nd, nn)
    return best, reason, 0, 0


# ------------------------------------------------------------------------------------------------ plans
@dataclass(frozen=True)
class Plan:
    width: int  # batch verify width incl. the root (1 = plain decode)
    lengths: np.ndarray  # draft nodes kept per request (prefix lengths)
    expected: float  # expected tokens this step (bonus included)
    cost: float  # estimated step cost (ms, or relative units before any measurement)
    reason: str  # "best", "explore", "re-measure" or "no-draft"


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
    docstring; None: never), ``trace_len`` (decisions kept for debugging).
    """

    def __init__(self, widths: Sequence[int] = DEFAULT_WIDTHS, prior=None, explore_frac: float = 0.002,
                 explore_min: int = 1, explore_optimism: float = 0.7,
                 prior_strength: float = 10.0, prior_scale: Sequence[float] = (0.2, 0.35, 0.5, 0.6),
                 request_alpha: float = 0.25, min_gain: float = 0.1, cost_clip: float | None = 2.0,
                 stale_after: int | None = 500, trace_len: int = 1000):
        try:
            ws = [w for w in widths]
        except TypeError:
            raise ValueError(f"widths must be a sequence of integers, got {widths!r}") from None
        if not ws or not all(_is_int(w) and 1 <= w <= MAX_WIDTH for w in ws):
            raise ValueError(f"widths must be integers in [1, {MAX_WIDTH}], got {list(ws)!r}")
        widths = sorted(set(int(w) for w in ws))
        if widths[0] != 1:
            widths = [1] + widths
        self.widths = widths
        self._widths = np.asarray(widths, np.int64)
        self.max_width = widths[-1]
        if isinstance(prior, str):
            prior = prior_from_calibration(prior)
        self.costs = CostModel(prior or default_prior, widths=widths, clip=cost_clip, stale_after=stale_after)
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
        # per-request state in slots: recent success (-1: unknown) and the pool of pending drafts
        self._slot_of: dict[Hashable, int] = {}
        self._free: list[int] = []
        S = 8
        self._success = np.full(S, -1.0)
        self._nd = np.zeros(S, np.int64)  # pending drafts per slot
        self._nn = np.zeros(S, np.int64)  # their nodes
        self._pstart = np.zeros((S, 4), np.int64)
        self._plen = np.zeros((S, 4), np.int64)
        self._pcur = np.zeros((S, 4), np.int64)
        self._ptok = np.zeros((S, 64), np.int32)
        self._ppar = np.zeros((S, 64), np.int32)
        self._pcell = np.zeros((S, 64), np.int64)
        # per-step scratch, grown on demand
        W = len(widths)
        self._cells = np.zeros(64, np.int64)
        self._P = np.zeros(64)
        self._G = np.zeros((8, W))
        self._values = np.zeros(W)
        self._expected = np.zeros(W)
        self._tok_buf = np.zeros(256, np.int32)
        self._off_buf = np.zeros(9, np.int64)
        self.trace: deque = deque(maxlen=int(trace_len))
        self._n_steps = 0
        self._n_explored = 0
        self._n_remeasured = 0
        self._step = 0

    # --------------------------------------------------------------------------------------- requests
    def start(self, rid: Hashable) -> None:
        if rid in self._slot_of:
            raise ValueError(f"request {rid!r} is already tracked by the controller")
        if self._free:
            s = self._free.pop()
        else:
            s = len(self._slot_of)
            if s >= self._success.shape[0]:
                self._grow_slots(2 * self._success.shape[0])
        self._slot_of[rid] = s
        self._success[s] = -1.0
        self._nd[s] = 0
        self._nn[s] = 0

    def finish(self, rid: Hashable) -> None:
        s = self._slot_of.pop(rid, None)
        if s is None:
            raise KeyError(f"unknown request id {rid!r}")
        self._nd[s] = 0
        self._nn[s] = 0
        self._free.append(s)

    def pending(self, rid: Hashable) -> int:
        """How many of the request's drafts are still being shadow-evaluated."""
        return int(self._nd[self._slots([rid])[0]])

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

    def _grow_slots(self, S: int) -> None:
        def grow(a, fill):
            new = np.full((S,) + a.shape[1:], fill, a.dtype)
            new[: a.shape[0]] = a
            return new

        self._success = grow(self._success, -1.0)
        self._nd, self._nn = grow(self._nd, 0), grow(self._nn, 0)
        self._pstart, self._plen, self._pcur = grow(self._pstart, 0), grow(self._plen, 0), grow(self._pcur, 0)
        self._ptok, self._ppar, self._pcell = grow(self._ptok, 0), grow(self._ppar, 0), grow(self._pcell, 0)

    def _grow_pool(self, need_d: int, need_n: int) -> None:
        def widen(a, n):
            new = np.zeros((a.shape[0], n), a.dtype)
            new[:, : a.shape[1]] = a
            return new

        if need_d:
            n = max(need_d, 2 * self._pstart.shape[1])
            self._pstart, self._plen, self._pcur = widen(self._pstart, n), widen(self._plen, n), widen(self._pcur, n)
        if need_n:
            n = max(need_n, 2 * self._ptok.shape[1])
            self._ptok, self._ppar, self._pcell = widen(self._ptok, n), widen(self._ppar, n), widen(self._pcell, n)

    # --------------------------------------------------------------------------------------- decide
    def _tables(self):
        return self.succ, self.trials, self.mid_succ, self.mid_trials, self.top_succ, self.top_trials

    def _scratch(self, B: int, n: int) -> None:
        if n > self._cells.shape[0]:
            m = max(n, 2 * self._cells.shape[0])
            self._cells, self._P = np.zeros(m, np.int64), np.zeros(m)
        if B > self._G.shape[0]:
            self._G = np.zeros((max(B, 2 * self._G.shape[0]), len(self.widths)))

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
        _node_cells(batch.parents, batch.probs, batch.sources, batch.offsets, batch.match_lens, slots,
                    self._success, cells)
        _node_values(batch.parents, batch.offsets, cells, *self._tables(), self.prior_mean, self.prior_strength,
                     self._widths, P, G)
        return P, cells

    def plan(self, rids: Sequence[Hashable], batch: DraftBatch, waiting: int | None = None) -> Plan:
        """Pick the width and per-request prefixes for this step; records the drafts for calibration.

        ``waiting``: requests queued behind this batch (the scheduler's queue length), or None if unknown.
        0 switches the objective from the batch's tokens per unit time to the requests' geometric-mean speed
        (see the module docstring). Nothing changes when it raises."""
        if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, (int, np.integer))
                                    or waiting < 0):
            raise ValueError(f"waiting must be a non-negative int or None, got {waiting!r}")
        slots = self._slots(rids)
        B = len(slots)
        self._check_batch(B, batch)
        if B == 0:  # nothing to decode: a plain step of nobody, not counted
            return Plan(1, np.zeros(0, np.int64), 0.0, 0.0, "no-draft")
        return self._plan(slots, batch, waiting)

    def _plan(self, slots: np.ndarray, batch: DraftBatch, waiting, toks=None, offs=None) -> Plan:
        """Observe ``toks``/``offs`` (tokens committed per request since the last step; None: none), then plan."""
        B = len(slots)
        offsets = batch.offsets
        n = int(offsets[B])
        if n > self._cells.shape[0] or B > self._G.shape[0]:
            self._scratch(B, n)
        costs, measured, stale, implied = self.costs.row(B)
        self._n_steps += 1
        may_explore = self._n_explored < self.explore_min + self.explore_frac * self._n_steps
        # at most one re-measurement per stale_after steps
        may_remeasure = self.stale_after is not None and self._n_remeasured * self.stale_after < self._n_steps
        lengths = np.empty(B, np.int64)
        if toks is None:
            toks, offs = _NO_TOKENS, _NO_OFFSETS
        while True:
            wi, why, need_d, need_n = _step_kernel(
                slots, toks, offs, batch.parents, batch.probs, batch.sources, batch.tokens, offsets,
                batch.match_lens, self._success, self.request_alpha, self.succ, self.trials, self.mid_succ,
                self.mid_trials, self.top_succ, self.top_trials, self.prior_mean, self.prior_strength,
                self._widths, costs, measured, stale, implied, waiting == 0 and B > 1, self.min_gain, may_explore,
                may_remeasure, self.explore_optimism, self._cells, self._P, self._G, self._values, self._expected,
                lengths,
                self._ptok, self._ppar, self._pcell, self._pstart, self._plen, self._pcur, self._nd, self._nn)
            if wi >= 0:
                break
            self._grow_pool(need_d, need_n)  # nothing changed: grow the pending pools and go again
        if why == 2:
            self._n_explored += 1
        elif why == 3:
            self._n_remeasured += 1
        self._step += 1
        w = self.widths[wi]
        tokens, cost = float(self._expected[wi]), float(costs[wi])
        self.trace.append((self._step, B, w, why, tokens, cost, self._values.copy()))
        return Plan(w, lengths, tokens, cost, _REASONS[why])

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
        _observe(slots, toks, self._off_buf[:2], self._ptok, self._ppar, self._pcell, self._pstart, self._plen,
                 self._pcur, self._nd, self._nn, self._success, self.request_alpha, *self._tables())

    def observe_batch(self, rids: Sequence[Hashable], committed: Sequence) -> None:
        """``observe_tokens`` for a whole batch (``committed[i]`` for ``rids[i]``) in one kernel call.
        Validates everything before changing anything."""
        slots = self._slots(rids)
        if len(committed) != len(slots):
            raise ValueError(f"{len(slots)} request ids but {len(committed)} token lists")
        toks, offs = self._flatten(committed, rids)
        self._observe_flat(slots, toks, offs)

    def _observe_flat(self, slots, toks, offs) -> None:
        _observe(slots, toks, offs, self._ptok, self._ppar, self._pcell, self._pstart, self._plen, self._pcur,
                 self._nd, self._nn, self._success, self.request_alpha, *self._tables())

    def _flatten(self, committed: Sequence, rids) -> tuple[np.ndarray, np.ndarray]:
        """Token lists -> validated (flat int32 tokens, int64 offsets), the offsets in a reused buffer."""
        B = len(committed)
        if B + 1 > self._off_buf.shape[0]:
            self._off_buf = np.zeros(max(B + 1, 2 * self._off_buf.shape[0]), np.int64)
        offs = self._off_buf[: B + 1]
        if all(type(t) is list for t in committed):  # the common case: lists of Python ints, checked in one pass
            flat = [x for t in committed for x in t]
            if all(type(x) in _INT_TYPES for x in flat) and (not flat or (min(flat) >= 0 and max(flat) < MAX_TOKEN)):
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
        positive finite number."""
        self.costs.observe(batch, width, duration_ms)

    # ----------------------------------------------------------------------------------- whole step
    def step(self, cache, rids: Sequence[Hashable], committed: Sequence | None = None, waiting: int | None = None,
             tree: bool = True) -> tuple[DraftBatch, Plan]:
        """A server's whole host step for the batch ``rids``: the tokens each request committed since its last
        step (``committed[i]``, possibly empty; None: none) go to ``cache`` and to the controller, then the
        cache proposes drafts of up to ``max_width - 1`` nodes and the controller plans the step. Four kernel
        calls for the whole batch. Validates everything before changing anything. Returns (drafts, plan)."""
        if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, (int, np.integer))
                                    or waiting < 0):
            raise ValueError(f"waiting must be a non-negative int or None, got {waiting!r}")
        slots = self._slots(rids)
        B = len(slots)
        cslots = np.array(cache._slots(rids), np.int64)
        toks = offs = None
        if committed is not None:
            if len(committed) != B:
                raise ValueError(f"{B} request ids but {len(committed)} token lists")
            toks, offs = self._flatten(committed, rids)
            if toks.size:
                cache._append_flat(cslots, toks, offs)
            else:
                toks = offs = None
        batch = cache._propose_slots(cslots, max(1, self.max_width - 1), bool(tree))
        if B == 0:
            return batch, Plan(1, np.zeros(0, np.int64), 0.0, 0.0, "no-draft")
        return batch, self._plan(slots, batch, waiting, toks, offs)


_NO_TOKENS = np.zeros(0, np.int32)
_NO_OFFSETS = np.zeros(1, np.int64)
