"""The controller's calibration: P(a draft node is accepted), learned online from Beta counts.

Each node of a draft falls in a fine cell (source, match length, raw conditional, depth, drafted siblings, the
request's recent success); its conditional acceptance is the cell's Beta mean, shrunk towards its mid cell
(without the request's success), shrunk towards its top cell (without the match length), shrunk towards a
fixed prior. Every proposed draft waits in its request's pending pool until the committed tokens decide it
(shadow evaluation), and every decision counts.

Optional (``AdaptiveController(predictor="logistic")``): a logistic correction of that estimate, logit P =
w0 logit(Beta) + one weight per group of one-hot features (the request's copy run: committed tokens since the last
one no pending draft predicted, alone, x depth, x raw conditional and x match length; the request's recent
success, alone and x depth), learned online by AdaGrad from the same shadow-evaluated outcomes, each from the
Beta estimate before it is counted. It starts as the identity (the Beta estimate).

State: the counts (``Calibration``) and the per-request slots with their pending drafts (``Pending``), two
bundles of flat arrays that the numba kernels take whole. ``AdaptiveController.calibration`` is the public view.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

# calibration table axes
MBINS = np.array([2, 4, 8], np.int64)  # match length: 1 | 2-3 | 4-7 | 8+
QBINS = np.array([0.1, 0.25, 0.5, 0.75, 0.999], np.float64)  # raw conditional
DBINS = np.array([2, 4, 8], np.int64)  # depth: 1 | 2-3 | 4-7 | 8+
KBINS = np.array([2, 3, 5], np.int64)  # drafted siblings (itself included): 1 | 2 | 3-4 | 5+
RBINS = 6  # request's recent success: unknown | 5 quantized levels
# a draft node's source: 0 the request's own history, 1 the shared cache, 2 token recycling (`ngramspec.recycle`)
N_SOURCES = 3
SHAPE = (N_SOURCES, 4, 6, 4, 4, RBINS)  # source, match, conditional, depth, siblings, request
FINE = N_SOURCES * 4 * 6 * 4 * 4 * RBINS  # fine cells; a node's cell number is its fine cell + FINE x its run bin
RUNB = np.array([1, 4, 8, 16, 32], np.int64)  # request's copy run (tokens): 0 | 1-3 | 4-7 | 8-15 | 16-31 | 32+
# the logistic correction's one-hot columns: run, run x depth, success, success x depth, conditional x run,
# match x run; then the weight of the Beta estimate's logit
N_LOGIT = 6 + 24 + 6 + 24 + 36 + 24 + 1
LOGIT_LR = 0.1  # AdaGrad step
LOGIT_L2 = 1e-4
TOP_SHAPE = (N_SOURCES, 6, 4, 4)  # source, conditional, depth, siblings
_MID_PER_SOURCE = 4 * 6 * 4 * 4  # (match, conditional, depth, siblings) cells of one source
_TOP_PER_SOURCE = 6 * 4 * 4  # (conditional, depth, siblings) cells of one source


class Calibration(NamedTuple):
    """Acceptance counts (successes, trials) at the three levels: fine cells (``SHAPE``: source, match length,
    raw conditional, depth, drafted siblings, request's recent success), mid cells (``SHAPE[:5]``) and top cells
    (``TOP_SHAPE``: source, raw conditional, depth, siblings); flat float64 arrays, C order."""

    succ: np.ndarray
    trials: np.ndarray
    mid_succ: np.ndarray
    mid_trials: np.ndarray
    top_succ: np.ndarray
    top_trials: np.ndarray
    # the optional logistic correction (``predictor="logistic"``; empty arrays: the Beta estimate alone)
    logit_w: np.ndarray  # [N_LOGIT] weights (the last: the Beta estimate's logit)
    logit_g2: np.ndarray  # [N_LOGIT] AdaGrad sums of squared gradients

    @classmethod
    def empty(cls, logistic: bool = False) -> "Calibration":
        fine = np.zeros(int(np.prod(SHAPE)), np.float64)
        mid = np.zeros(int(np.prod(SHAPE[:5])), np.float64)
        top = np.zeros(N_SOURCES * _TOP_PER_SOURCE, np.float64)
        w, g2 = initial_logit() if logistic else (np.zeros(0), np.zeros(0))
        return cls(fine, fine.copy(), mid, mid.copy(), top, top.copy(), w, g2)

    def by_depth(self) -> tuple[np.ndarray, np.ndarray]:
        """(successes, trials) per depth bin 1 | 2-3 | 4-7 | 8+, over every other axis."""
        return (self.top_succ.reshape(TOP_SHAPE).sum(axis=(0, 1, 3)),
                self.top_trials.reshape(TOP_SHAPE).sum(axis=(0, 1, 3)))

    def load(self, other: "Calibration") -> None:
        """Overwrite these counts with ``other``'s (e.g. to start a controller warm)."""
        for name, dst, src in zip(self._fields, self, other):
            if dst.shape == src.shape:
                dst[:] = src
            elif dst.size and name in ("logit_w", "logit_g2"):  # no logistic correction there: this one restarts
                dst[:] = initial_logit()[name == "logit_g2"]


def initial_logit() -> tuple[np.ndarray, np.ndarray]:
    """The logistic correction's starting weights (the identity: the Beta estimate unchanged) and AdaGrad sums."""
    w = np.zeros(N_LOGIT)
    w[-1] = 1.0
    return w, np.full(N_LOGIT, 1e-6)


class Pending(NamedTuple):
    """Per-request state in slots (rows): the recent success rate and the pool of drafts still being
    shadow-evaluated. Draft d of slot s owns nodes ``start[s, d]:start[s, d] + length[s, d]`` of ``tok``, ``par``
    and ``cell``; ``cur[s, d]`` is its node accepted so far (-1: the root)."""

    success: np.ndarray  # [S] float64: recent success (-1: unknown)
    nd: np.ndarray  # [S] int64: pending drafts
    nn: np.ndarray  # [S] int64: their nodes
    start: np.ndarray  # [S, D] int64
    length: np.ndarray  # [S, D] int64
    cur: np.ndarray  # [S, D] int64
    tok: np.ndarray  # [S, N] int32
    par: np.ndarray  # [S, N] int32
    cell: np.ndarray  # [S, N] int64
    run: np.ndarray  # [S] int64: committed tokens since the last one no pending draft predicted (a copy's run)
    # the draft's prefix that the step's best drafting width holds (the decision's part of it) and that prefix's
    # expected accepted nodes when it was proposed (the sum of its calibrated P)
    prefix: np.ndarray  # [S, D] int64
    expect: np.ndarray  # [S, D] float64
    # the request's own evidence (`request_factor`): the expected accepted nodes of its decided drafts' prefixes
    # and the nodes they accepted there, each from the prior's pseudo-count (predicted < 0: no check for it)
    predicted: np.ndarray  # [S] float64
    realized: np.ndarray  # [S] float64

    @classmethod
    def empty(cls, slots: int = 8, drafts: int = 4, nodes: int = 64) -> "Pending":
        S = slots
        return cls(np.full(S, -1.0), np.zeros(S, np.int64), np.zeros(S, np.int64), np.zeros((S, drafts), np.int64),
                   np.zeros((S, drafts), np.int64), np.zeros((S, drafts), np.int64), np.zeros((S, nodes), np.int32),
                   np.zeros((S, nodes), np.int32), np.zeros((S, nodes), np.int64), np.zeros(S, np.int64),
                   np.zeros((S, drafts), np.int64), np.zeros((S, drafts)), np.full(S, -1.0), np.zeros(S))

    def grow_slots(self, S: int) -> "Pending":
        def grow(a, fill):
            new = np.full((S,) + a.shape[1:], fill, a.dtype)
            new[: a.shape[0]] = a
            return new

        unknown = ("success", "predicted")  # -1 in a new slot: no estimate yet; every other field starts at 0
        return Pending(*(grow(a, -1.0 if name in unknown else 0) for name, a in zip(self._fields, self)))

    def grow_pool(self, need_d: int, need_n: int) -> "Pending":
        def widen(a, n):
            new = np.zeros((a.shape[0], n), a.dtype)
            new[:, : a.shape[1]] = a
            return new

        p = self
        if need_d:
            n = max(need_d, 2 * p.start.shape[1])
            p = p._replace(start=widen(p.start, n), length=widen(p.length, n), cur=widen(p.cur, n),
                           prefix=widen(p.prefix, n), expect=widen(p.expect, n))
        if need_n:
            n = max(need_n, 2 * p.tok.shape[1])
            p = p._replace(tok=widen(p.tok, n), par=widen(p.par, n), cell=widen(p.cell, n))
        return p


@njit(cache=True)
def fine_cell(cell):
    """The fine cell (index into ``Calibration.succ``) of a node's cell number."""
    return cell % FINE


@njit(cache=True)
def mid_cell(cell):
    """(source, match, conditional, depth, siblings) cell of a node's cell number."""
    return (cell % FINE) // RBINS


@njit(cache=True)
def top_cell(cell):
    """(source, conditional, depth, siblings) cell of a node's cell number."""
    mid = (cell % FINE) // RBINS
    return (mid // _MID_PER_SOURCE) * _TOP_PER_SOURCE + mid % _TOP_PER_SOURCE


@njit(cache=True)
def logit_columns(cell, cols):
    """The logistic correction's one-hot column of each feature group, into ``cols`` (6 entries)."""
    ru = cell // FINE
    f = cell % FINE
    rb = f % RBINS
    ki = (f // RBINS) % 4
    di = (f // (RBINS * 4)) % 4
    qi = (f // (RBINS * 16)) % 6
    m = (f // (RBINS * 96)) % 4
    cols[0] = ru
    cols[1] = 6 + ru * 4 + di
    cols[2] = 30 + rb
    cols[3] = 36 + rb * 4 + di
    cols[4] = 60 + qi * 6 + ru
    cols[5] = 96 + m * 6 + ru
    return ki


@njit(cache=True)
def beta_mean(cal, c, prior_mean, strength):
    """A node's conditional acceptance from the Beta counts: its fine cell's mean, shrunk towards its mid cell,
    shrunk towards its top cell, shrunk towards the fixed prior."""
    t = top_cell(c)
    mc = mid_cell(c)
    fc = fine_cell(c)
    top = (cal.top_succ[t] + strength * prior_mean[t]) / (cal.top_trials[t] + strength)
    mid = (cal.mid_succ[mc] + strength * top) / (cal.mid_trials[mc] + strength)
    return (cal.succ[fc] + strength * mid) / (cal.trials[fc] + strength)


@njit(cache=True)
def _logit(p):
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    return math.log(p / (1.0 - p))


@njit(cache=True)
def corrected(w, c, base, cols):
    """The logistic correction of the Beta estimate ``base`` for a node of cell number ``c``."""
    logit_columns(c, cols)
    z = w[N_LOGIT - 1] * _logit(base)
    for k in range(6):
        z += w[cols[k]]
    return 1.0 / (1.0 + math.exp(-z))


@njit(cache=True)
def logit_learn(cal, c, hit, prior_mean, strength, cols):
    """One AdaGrad step of the logistic correction on a decided node (cell number ``c``), from the Beta
    estimate before this outcome is counted."""
    w, g2 = cal.logit_w, cal.logit_g2
    lb = _logit(beta_mean(cal, c, prior_mean, strength))
    logit_columns(c, cols)
    z = w[N_LOGIT - 1] * lb
    for k in range(6):
        z += w[cols[k]]
    g = 1.0 / (1.0 + math.exp(-z)) - (1.0 if hit else 0.0)
    gl = g * lb + LOGIT_L2 * (w[N_LOGIT - 1] - 1.0)
    g2[N_LOGIT - 1] += gl * gl
    w[N_LOGIT - 1] -= LOGIT_LR * gl / math.sqrt(g2[N_LOGIT - 1])
    for k in range(6):
        j = cols[k]
        gj = g + LOGIT_L2 * w[j]
        g2[j] += gj * gj
        w[j] -= LOGIT_LR * gj / math.sqrt(g2[j])


@njit(cache=True)
def _rbin(success):
    """The request's recent-success bin (success < 0: unknown)."""
    if success < 0:
        return 0
    return 1 + min(4, int(success * 5))


@njit(cache=True)
def node_cells(parents, probs, sources, offsets, mlens, slots, success, cells, run=None):
    """Cell number of every node of a flat DraftBatch, into ``cells``: its fine cell (flat index into the fine
    table) + ``FINE`` x the request's copy-run bin (``run``: per slot; None: bin 0)."""
    n = parents.shape[0]
    _node_cells(parents, probs, sources, offsets, mlens, slots, success, cells, run, np.empty(n, np.int64),
                np.empty(n + 1, np.int64))


@njit(cache=True)
def _node_cells(parents, probs, sources, offsets, mlens, slots, success, cells, run, dep, kids):
    """`node_cells` on int64 scratch ``dep`` and ``kids`` of at least n and n + 1 entries (n nodes): it allocates
    nothing (see ``choose._ctl_step``)."""
    for i in range(offsets.shape[0] - 1):
        a = offsets[i]
        m = np.searchsorted(MBINS, mlens[i], side="right")
        rb = _rbin(success[slots[i]])
        if run is not None:
            rb += FINE * np.searchsorted(RUNB, run[slots[i]], side="right")
        for j in range(a, offsets[i + 1] + 1):
            kids[j - a] = 0
        for j in range(a, offsets[i + 1]):
            kids[parents[j] + 1] += 1
        for j in range(a, offsets[i + 1]):
            p = parents[j]
            if p < 0:
                q = np.float64(probs[j])
                dep[j] = 1
            else:
                q = np.float64(probs[j]) / max(np.float64(probs[a + p]), 1e-12)
                dep[j] = dep[a + p] + 1
            qi = np.searchsorted(QBINS, q, side="right")
            di = np.searchsorted(DBINS, dep[j], side="right")
            ki = np.searchsorted(KBINS, kids[p + 1], side="right")
            cells[j] = ((((np.int64(sources[j]) * 4 + m) * 6 + qi) * 4 + di) * 4 + ki) * RBINS + rb


@njit(cache=True)
def node_values(parents, offsets, cells, cal, prior_mean, strength, widths, P, G):
    """Calibrated P(accepted) per node into ``P`` and, per request and width, the expected accepted nodes (no
    bonus) into ``G``. A node's conditional acceptance is its fine cell's Beta mean, shrunk towards its ``mid_cell``
    cell, shrunk towards its ``top_cell``, shrunk towards the fixed prior; P is the product along the path."""
    _node_values(parents, offsets, cells, cal, prior_mean, strength, widths, P, G, np.empty(6, np.int64))


@njit(cache=True)
def _node_values(parents, offsets, cells, cal, prior_mean, strength, widths, P, G, c6):
    """`node_values` on int64 scratch ``c6`` of 6 entries: it allocates nothing."""
    logistic = cal.logit_w.shape[0] > 0
    B = offsets.shape[0] - 1
    for i in range(B):
        for w in range(widths.shape[0]):
            G[i, w] = 0.0
        a = offsets[i]
        for j in range(a, offsets[i + 1]):
            c = cells[j]
            cond = beta_mean(cal, c, prior_mean, strength)
            if logistic:
                cond = corrected(cal.logit_w, c, cond, c6)
            p = parents[j]
            P[j] = cond if p < 0 else cond * P[a + p]
            k = j - a + 1  # this node is the request's k-th: every width w with w - 1 >= k holds it
            for w in range(widths.shape[0]):
                if widths[w] - 1 >= k:
                    G[i, w] += P[j]


@njit(cache=True)
def pend_room(slots, offsets, pend):
    """Room the pending pools need for the batch's drafts: (drafts, nodes) per slot, or (0, 0) if they fit."""
    nd, nn, cap_d, cap_n = pend.nd, pend.nn, pend.start.shape[1], pend.tok.shape[1]
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
def pend_add(slots, tokens, parents, offsets, cells, P, cap, pend):
    """Queue every non-empty draft of the batch for shadow evaluation (the pools have room), with its prefix of at
    most ``cap`` nodes (what the step's best drafting width holds) and that prefix's expected accepted nodes (the
    sum of its nodes' calibrated ``P``)."""
    ptok, ppar, pcell, pstart, plen, pcur, nd, nn = (pend.tok, pend.par, pend.cell, pend.start, pend.length,
                                                      pend.cur, pend.nd, pend.nn)
    pexp, ppre = pend.expect, pend.prefix
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
        e = 0.0
        for j in range(L):
            if j < cap:
                e += P[a + j]
            ptok[s, base + j] = tokens[a + j]
            ppar[s, base + j] = parents[a + j]
            pcell[s, base + j] = cells[a + j]
        pexp[s, d] = e
        ppre[s, d] = min(L, cap)
        nd[s] = d + 1
        nn[s] = base + L


@njit(cache=True)
def shadow_evaluate(slots, toks, offs, pend, alpha, cal, prior_mean=None, strength=0.0):
    """Shadow-evaluate every pending draft of each request against its committed tokens ``toks[offs[k]:
    offs[k+1]]``: at each depth the children of the node accepted so far are tried, the one matching the
    committed token (if any) is accepted; a draft is decided when none matches or its accepted node has no
    children. Counts go to the calibration tables, the request's success rate moves; undecided drafts stay
    (oldest first), compacted in place."""
    _shadow_evaluate(slots, toks, offs, pend, alpha, cal, prior_mean, strength, np.empty(6, np.int64))


@njit(cache=True)
def _shadow_evaluate(slots, toks, offs, pend, alpha, cal, prior_mean, strength, c6):
    """`shadow_evaluate` on int64 scratch ``c6`` of 6 entries: it allocates nothing."""
    ptok, ppar, pcell, pstart, plen, pcur, nd, nn = (pend.tok, pend.par, pend.cell, pend.start, pend.length,
                                                      pend.cur, pend.nd, pend.nn)
    success = pend.success
    run = pend.run
    pexp, ppre, predicted, realized = pend.expect, pend.prefix, pend.predicted, pend.realized
    succ, trials, mid_succ, mid_trials, top_succ, top_trials = cal.succ, cal.trials, cal.mid_succ, cal.mid_trials, \
        cal.top_succ, cal.top_trials
    learn = prior_mean is not None and cal.logit_w.shape[0] > 0
    for k in range(slots.shape[0]):
        s = slots[k]
        a = offs[k]
        b = offs[k + 1]
        if nd[s] == 0:
            if b > a:
                run[s] = 0  # nothing predicted these tokens
            continue
        check = predicted[s] >= 0.0  # the request's own evidence is kept
        ntried = 0
        nhit = 0
        keep = 0
        wpos = 0
        reach = 0  # committed tokens of this step that some pending draft predicted in a row
        missed = False  # whether the drafts reaching furthest stopped on a wrong token (not on their last node)
        for d in range(nd[s]):
            st = pstart[s, d]
            L = plen[s, d]
            cur = pcur[s, d]
            decided = False
            for q in range(a, b):
                t = toks[q]
                nxt = -1
                tried = False
                for j in range(L):
                    if ppar[s, st + j] == cur:
                        tried = True
                        c = pcell[s, st + j]
                        hit = ptok[s, st + j] == t
                        if learn:
                            logit_learn(cal, c, hit, prior_mean, strength, c6)
                        mc = mid_cell(c)
                        tc = top_cell(c)
                        fc = fine_cell(c)
                        trials[fc] += 1.0
                        mid_trials[mc] += 1.0
                        top_trials[tc] += 1.0
                        ntried += 1
                        if hit:
                            succ[fc] += 1.0
                            mid_succ[mc] += 1.0
                            top_succ[tc] += 1.0
                            nhit += 1
                            nxt = j
                if nxt < 0:
                    decided = True
                    if q - a > reach:
                        reach = q - a
                        missed = tried
                    elif q - a == reach and tried:
                        missed = True
                    break
                cur = nxt
            alive = False
            if not decided:
                reach = b - a
                for j in range(L):
                    if ppar[s, st + j] == cur:
                        alive = True
                        break
            if not alive:  # decided: its prefix's expected accepted nodes against those it accepted
                if check:
                    predicted[s] += pexp[s, d]
                    j = cur
                    while j >= 0:
                        if j < ppre[s, d]:
                            realized[s] += 1.0
                        j = ppar[s, st + j]
                continue
            if alive:  # children of the accepted node still to be decided
                if wpos != st:
                    for j in range(L):
                        ptok[s, wpos + j] = ptok[s, st + j]
                        ppar[s, wpos + j] = ppar[s, st + j]
                        pcell[s, wpos + j] = pcell[s, st + j]
                pstart[s, keep] = wpos
                plen[s, keep] = L
                pcur[s, keep] = cur
                pexp[s, keep] = pexp[s, d]
                ppre[s, keep] = ppre[s, d]
                keep += 1
                wpos += L
        nd[s] = keep
        nn[s] = wpos
        run[s] = 0 if missed and reach < b - a else run[s] + (b - a)
        if ntried > 0:
            rate = nhit / ntried
            success[s] = rate if success[s] < 0 else success[s] + alpha * (rate - success[s])
