"""The adaptive controller: each step, draft only what pays.

Each step it picks one verify width ``n`` for the batch (``n == 1``: plain decode, nothing drafted) and gives
every request the first ``min(n - 1, len)`` nodes of its best-first draft, maximizing expected goodput

    sum_i (1 + sum_{j < n-1} P_ij)  /  c(B, n)

**P (acceptance)**. The cache gives each node a path probability from counts; the controller turns each node's
conditional (its probability over its parent's) into a calibrated conditional acceptance, learned online from
a table of Beta counts indexed by (source, match length, raw conditional, depth, the request's recent success
rate). Every proposed draft is *shadow-evaluated* against the tokens the model then really commits, whether or
not it was sent: a request that stopped drafting keeps producing evidence at no cost, so it recovers after a dry
spell without paid probes, and a request that starts copying earns long drafts within a few steps.

**c(B, n) (cost)**. Learned from the step durations the server (or simulator) reports, per batch-size bucket and
width (an exponential moving average). Widths not yet measured in a bucket are estimated from a prior (a
calibration file, or a conservative default shape) scaled by what was measured, and each is tried once in a
while (``explore_every`` steps) so a wrong prior is corrected. The controller is never told the true profile.

**Determinism and tensor parallelism**. Decisions depend only on tokens (drafts, committed tokens) and on the
durations passed to ``observe_step``. Tokens are identical on every rank; durations are not, so a TP server
must measure them on rank 0 and broadcast them (the SGLang plugin does), or feed every rank the same value.
Given the same inputs the controller takes the same decisions.
"""
from __future__ import annotations

import json
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
_RBINS = 6  # request's recent success: unknown | 5 quantized levels
_SHAPE = (2, 4, 6, 4, _RBINS)


def default_prior(batch: int, width: int) -> float:
    """Conservative relative cost when nothing is known: a verify of n tokens costs 2 + 0.25 (n - 1) decodes.
    (The seed PCIe deployment measured 2.25 at n = 2; a single H200 1.3: erring high only delays drafting.)"""
    return 1.0 if width <= 1 else 2.0 + 0.25 * (width - 1)


def prior_from_calibration(path: str, column: str = "graph_ms") -> Callable[[int, int], float]:
    """c(B, n) from a calibration JSON (rows of B, k, kind, eager_ms, graph_ms), interpolated over B and n."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("kind", "chain") == "chain"]
    batches = sorted({int(r["B"]) for r in rows})
    table = {b: sorted((int(r["k"]), float(r[column])) for r in rows if int(r["B"]) == b) for b in batches}

    def at_batch(b: int, n: int) -> float:
        ks, ms = zip(*table[b])
        return float(np.interp(n, ks, ms))

    def cost(batch: int, width: int) -> float:
        if batch <= batches[0]:
            return at_batch(batches[0], width)
        if batch >= batches[-1]:
            return at_batch(batches[-1], width) * batch / batches[-1] if batch > batches[-1] else at_batch(batch, width)
        hi = next(b for b in batches if b >= batch)
        lo = max(b for b in batches if b <= batch)
        if hi == lo:
            return at_batch(lo, width)
        t = (batch - lo) / (hi - lo)
        return (1 - t) * at_batch(lo, width) + t * at_batch(hi, width)

    return cost


def batch_bucket(batch: int) -> int:
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()


class CostModel:
    """Online c(B, n): measured EWMA per (bucket, width); prior x learned scale where unmeasured."""

    def __init__(self, prior: Callable[[int, int], float] = default_prior, alpha: float = 0.2):
        self.prior = prior
        self.alpha = alpha
        self.ewma: dict[tuple[int, int], float] = {}
        self.ratio: dict[int, float] = {}  # per bucket: measured / prior (EWMA)
        self.global_ratio: float | None = None

    def observe(self, batch: int, width: int, ms: float) -> None:
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"step duration must be a positive finite number of ms, got {ms!r}")
        key = (batch_bucket(batch), width)
        old = self.ewma.get(key)
        self.ewma[key] = ms if old is None else old + self.alpha * (ms - old)
        r = ms / self.prior(batch, width)
        b = key[0]
        self.ratio[b] = r if b not in self.ratio else self.ratio[b] + self.alpha * (r - self.ratio[b])
        g = self.global_ratio
        self.global_ratio = r if g is None else g + self.alpha * (r - g)

    def measured(self, batch: int, width: int) -> bool:
        return (batch_bucket(batch), width) in self.ewma

    def estimate(self, batch: int, width: int) -> float:
        key = (batch_bucket(batch), width)
        if key in self.ewma:
            return self.ewma[key]
        scale = self.ratio.get(key[0], self.global_ratio if self.global_ratio is not None else 1.0)
        return self.prior(batch, width) * scale


@njit(cache=True)
def _node_cells(parents, probs, sources, offsets, mlens, rbins, mb, qb, db):
    """Calibration cell (flat index) and conditional of every node of a flat DraftBatch."""
    n = parents.shape[0]
    cells = np.empty(n, np.int64)
    depth = np.empty(n, np.int64)
    for i in range(offsets.shape[0] - 1):
        a = offsets[i]
        m = np.searchsorted(mb, mlens[i], side="right")
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
            cells[j] = (((sources[j] * 4 + m) * 6 + qi) * 4 + di) * _RBINS + rbins[i]
    return cells


@njit(cache=True)
def _path_values(parents, offsets, cond):
    """P(node accepted) = product of calibrated conditionals along its path."""
    P = np.empty(parents.shape[0], np.float64)
    for i in range(offsets.shape[0] - 1):
        a = offsets[i]
        for j in range(a, offsets[i + 1]):
            p = parents[j]
            P[j] = cond[j] if p < 0 else cond[j] * P[a + p]
    return P


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
    pending: _Pending | None = None


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
    measurement: a callable or a calibration file path), ``explore_every`` (steps between tries of a width not yet
    measured in the current batch bucket, and only one that would pay at half its estimated cost), ``prior_strength`` (pseudo-trials behind each calibration cell's prior),
    ``prior_scale`` (per match-length bin: the prior of a cell's conditional acceptance is this times the cache's
    raw conditional; longer matches are trusted more),
    ``request_alpha`` (EWMA weight of a request's recent success), ``trace_len`` (decisions kept for debugging).
    """

    def __init__(self, widths: Sequence[int] = DEFAULT_WIDTHS, prior=None, explore_every: int = 64,
                 prior_strength: float = 2.0, prior_scale: Sequence[float] = (0.3, 0.45, 0.6, 0.75),
                 request_alpha: float = 0.25,
                 trace_len: int = 1000):
        widths = sorted(set(int(w) for w in widths))
        if not widths or widths[0] < 1:
            raise ValueError(f"widths must be positive integers, got {widths}")
        if widths[0] != 1:
            widths = [1] + widths
        self.widths = widths
        self.max_width = widths[-1]
        if isinstance(prior, str):
            prior = prior_from_calibration(prior)
        self.costs = CostModel(prior or default_prior)
        self.explore_every = int(explore_every)
        self.prior_strength = float(prior_strength)
        self.prior_scale = np.asarray(prior_scale, np.float64)
        if self.prior_scale.shape != (4,):
            raise ValueError("prior_scale needs one factor per match-length bin (1, 2-3, 4-7, 8+)")
        self.request_alpha = float(request_alpha)
        self.succ = np.zeros(int(np.prod(_SHAPE)), np.float64)
        self.trials = np.zeros_like(self.succ)
        q_mid = np.array([0.05, 0.175, 0.375, 0.625, 0.875, 1.0])
        self.prior_mean = np.broadcast_to(self.prior_scale[None, :, None, None, None] * q_mid[None, None, :, None, None],
                                          _SHAPE).reshape(-1).copy()
        self.requests: dict[Hashable, _Request] = {}
        self.trace: deque = deque(maxlen=int(trace_len))
        self._steps_since_explore: dict[int, int] = {}
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
    def node_values(self, rids: Sequence[Hashable], batch: DraftBatch) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated P(accepted) of every node of the batch, and each node's calibration cell."""
        try:
            rbins = np.array([self._rbin(self.requests[r]) for r in rids], np.int64)
        except KeyError as e:
            raise KeyError(f"unknown request id {e.args[0]!r}: call start() first") from None
        cells = _node_cells(batch.parents, batch.probs.astype(np.float64), batch.sources.astype(np.int64),
                            batch.offsets, batch.match_lens, rbins, _MBINS, _QBINS, _DBINS)
        cond = (self.succ[cells] + self.prior_strength * self.prior_mean[cells]) / (self.trials[cells] + self.prior_strength)
        return _path_values(batch.parents, batch.offsets, cond), cells

    def plan(self, rids: Sequence[Hashable], batch: DraftBatch) -> Plan:
        """Pick the width and per-request prefixes for this step; records the drafts for calibration."""
        B = len(rids)
        if len(batch) != B:
            raise ValueError(f"{B} request ids but {len(batch)} drafts")
        P, cells = self.node_values(rids, batch)
        lens = np.diff(batch.offsets)
        for i, rid in enumerate(rids):  # shadow-evaluate this draft unless one is already pending
            r = self.requests[rid]
            if r.pending is None and lens[i] > 0:
                a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
                r.pending = _Pending(batch.tokens[a:b].tolist(), batch.parents[a:b].tolist(), cells[a:b].copy())
        # prefix sums of P per request, padded to the widest width
        kmax = self.max_width - 1
        S = np.zeros((B, kmax + 1))
        for i in range(B):
            a, k = int(batch.offsets[i]), int(min(lens[i], kmax))
            S[i, 1:k + 1] = np.cumsum(P[a:a + k])
            S[i, k + 1:] = S[i, k]
        any_draft = bool(lens.any())
        values = []
        for w in self.widths:
            if w > 1 and not any_draft:
                break
            tokens = B + float(S[:, w - 1].sum())
            cost = self.costs.estimate(B, w)
            values.append((tokens / cost, w, tokens, cost))
        best = max(values, key=lambda v: (v[0], -v[1]))
        reason = "best" if best[1] > 1 else ("no-draft" if not any_draft else "best")
        bucket = batch_bucket(B)
        since = self._steps_since_explore.get(bucket, self.explore_every) + 1
        self._steps_since_explore[bucket] = since
        if any_draft and since >= self.explore_every:
            # try a width not yet measured here only if it would win were it half as costly as estimated
            unmeasured = [v for v in values
                          if not self.costs.measured(B, v[1]) and v[2] / (0.5 * v[3]) > best[0]]
            if unmeasured:
                best = unmeasured[self._step % len(unmeasured)]
                reason = "explore"
                self._steps_since_explore[bucket] = 0
        self._step += 1
        _, w, tokens, cost = best
        lengths = np.minimum(lens, w - 1)
        plan = Plan(w, lengths, tokens, cost, reason)
        self.trace.append({"step": self._step, "batch": B, "width": w, "reason": reason,
                           "expected_tokens": round(tokens, 3), "est_cost": round(cost, 4),
                           "options": {v[1]: round(v[0], 4) for v in values}})
        return plan

    # -------------------------------------------------------------------------------------- observe
    def observe_tokens(self, rid: Hashable, committed: Sequence[int]) -> None:
        """The tokens the model committed for ``rid`` this step (accepted draft tokens + bonus)."""
        try:
            r = self.requests[rid]
        except KeyError:
            raise KeyError(f"unknown request id {rid!r}") from None
        p = r.pending
        if p is None:
            return
        tried: list[int] = []
        hits: list[float] = []
        for t in committed:
            nxt = -1
            for j, (tok, par) in enumerate(zip(p.tokens, p.parents)):
                if par == p.cur:
                    tried.append(int(p.cells[j]))
                    hit = tok == t
                    hits.append(1.0 if hit else 0.0)
                    if hit:
                        nxt = j
            if nxt < 0:
                r.pending = None  # decided: the accepted path ends here
                break
            p.cur = nxt
        else:
            if not any(par == p.cur for par in p.parents):
                r.pending = None  # every node decided
        if tried:
            np.add.at(self.trials, tried, 1.0)
            np.add.at(self.succ, tried, hits)
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
                     explore_every: int = 64):
            widths = [w for w in DEFAULT_WIDTHS if w <= max_width]
            if prior == "default":
                prior_fn = None
            elif prior in ("seed-pcie8", "h200-llama8b") or prior.endswith(".json"):
                from ngramspec.profiles import get_profile
                prior_fn = get_profile(prior).cost_ms  # a deliberately *assumed* cost, e.g. a wrong one
            else:
                raise ValueError(f"prior must be 'default', a profile name or a .json file, got {prior!r}")
            self.ctl = AdaptiveController(widths, prior=prior_fn, explore_every=explore_every)
            self.cache = NgramCache(max_depth=depth)
            self.tree = bool(tree)
            self._width = 1

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

        def propose(self, rids):
            batch = self.cache.propose(rids, max(1, self.ctl.max_width - 1), tree=self.tree)
            plan = self.ctl.plan(rids, batch)
            self._width = plan.width
            out = []
            for i in range(len(rids)):
                a, k = int(batch.offsets[i]), int(plan.lengths[i])
                out.append((batch.tokens[a:a + k], batch.parents[a:a + k]))
            return out

        def verify_width(self, rids, drafts):
            return self._width

        def update(self, rid, committed, n_accepted):
            self.cache.add_tokens(rid, committed)
            self.ctl.observe_tokens(rid, committed)

        def observe_step(self, batch_size, width, duration_ms):
            self.ctl.observe_step(batch_size, width, duration_ms)

        def finish(self, rid):
            self.cache.finish_request(rid, share=True)
            self.ctl.finish(rid)

    register_method("ngramspec-adaptive", AdaptiveMethod)


_register()
