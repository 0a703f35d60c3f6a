"""Host-side drafting for the SGLang worker: cache bookkeeping, width choice, verify layout.

No sglang or torch import: the worker hands in plain request views and gets back numpy arrays, so
everything here runs (and is tested) on CPU. One `DraftPlanner` per scheduler process (= per TP rank).

Tensor-parallel determinism: every rank sees the same batches and the same committed tokens, so the
cache proposes the same drafts and realized acceptance is the same. The only rank-local input is the
measured verify duration; those samples are collected on TP rank 0 only and handed to the controller
on every rank at the same step (every `tp_sync_interval` verify steps) through `broadcast`, which the
worker binds to SGLang's TP CPU-group `broadcast_object`. Decisions therefore depend on tokens,
acceptance and rank 0's timings only, and are identical on all ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

import numpy as np

from ngramspec.cache import Draft, NgramCache

from .config import AdaptiveConfig


@dataclass
class RequestView:
    """What the planner needs of one request in a decode batch (no copies: slices are taken lazily).

    `pending` are tokens already committed but not yet in `output` (SGLang's overlap relay: the
    previous step's accepted tokens); `prompt` is only read when the request is new.
    """

    rid: Hashable
    prompt: Sequence[int]
    output: Sequence[int]
    pending: Sequence[int] = ()

    @property
    def committed_len(self) -> int:
        return len(self.prompt) + len(self.output) + len(self.pending)

    def tail(self, start: int) -> list[int]:
        """Committed tokens from absolute position `start` on."""
        p, o = len(self.prompt), len(self.output)
        if start >= p + o:
            return list(self.pending[start - p - o:])
        if start >= p:
            return list(self.output[start - p:]) + list(self.pending)
        return list(self.prompt[start:]) + list(self.output) + list(self.pending)

    def last_token(self) -> int:
        if self.pending:
            return int(self.pending[-1])
        if self.output:
            return int(self.output[-1])
        return int(self.prompt[-1])


@dataclass(frozen=True)
class DurationSample:
    """One verify step as measured on TP rank 0."""

    width: int
    batch_size: int
    seconds: float


class WidthController(Protocol):
    """The controller hook: pick a batch width and per-request draft lengths, learn from outcomes."""

    def choose(self, drafts: Sequence[Draft]) -> tuple[int, np.ndarray]: ...

    def observe(self, drafted: np.ndarray, accepted: np.ndarray, durations: Sequence[DurationSample]) -> None: ...


class FixedWidthController:
    """Verify every step at one width; each request sends as many draft nodes as fit (width - 1)."""

    def __init__(self, width: int):
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an int >= 1, got {width!r}")
        self.width = width

    def choose(self, drafts: Sequence[Draft]) -> tuple[int, np.ndarray]:
        lengths = np.array([min(len(d), self.width - 1) for d in drafts], dtype=np.int64)
        return self.width, lengths

    def observe(self, drafted, accepted, durations) -> None:
        return None


def make_controller(config: AdaptiveConfig) -> WidthController:
    """The adaptive controller of `ngramspec.controller`, or a fixed width when configured / not available.

    Hook for issue 4: until `ngramspec.controller` exposes `make_sglang_controller(widths, **options)`
    returning a `WidthController`, NGRAM_ADAPTIVE runs at the largest width (NGRAM-like behaviour).
    """
    if config.fixed_width is not None:
        return FixedWidthController(config.fixed_width)
    try:
        from ngramspec.controller import make_sglang_controller  # type: ignore[attr-defined]
    except ImportError:
        return FixedWidthController(config.max_width)
    return make_sglang_controller(config.widths, **dict(config.controller))


@dataclass
class StepPlan:
    """One verify step: width, per-request draft lengths and SGLang-layout arrays `[B, width]`."""

    width: int
    drafted: np.ndarray  # int64 [B]: real draft nodes per request (the rest of the row is padding)
    predicted: np.ndarray  # float64 [B]: expected accepted draft tokens (sum of node probabilities)
    tokens: np.ndarray
    mask: np.ndarray
    depths: np.ndarray
    retrieve_index: np.ndarray
    retrieve_next_token: np.ndarray
    retrieve_next_sibling: np.ndarray


@dataclass
class IntervalStats:
    """Counters since the last SGLang decode log line (read by hooks and metrics)."""

    verify_steps: int = 0
    verified_requests: int = 0
    width_tokens: int = 0  # sum over requests of the verify width
    drafted_tokens: int = 0
    predicted_accepted: float = 0.0
    observed_requests: int = 0
    realized_accepted: int = 0
    predicted_for_observed: float = 0.0

    def record_step(self, plan: StepPlan) -> None:
        self.verify_steps += 1
        self.verified_requests += int(plan.drafted.size)
        self.width_tokens += plan.width * int(plan.drafted.size)
        self.drafted_tokens += int(plan.drafted.sum())
        self.predicted_accepted += float(plan.predicted.sum())

    def record_outcome(self, predicted: np.ndarray, accepted: np.ndarray) -> None:
        self.observed_requests += int(accepted.size)
        self.realized_accepted += int(accepted.sum())
        self.predicted_for_observed += float(predicted.sum())

    def mean_width(self) -> float:
        """1 + drafted tokens per verified request: SGLang's accept rate is exact under this width."""
        return 1.0 + self.drafted_tokens / max(1, self.verified_requests)

    def summary(self) -> dict[str, float]:
        n = max(1, self.verified_requests)
        m = max(1, self.observed_requests)
        return {
            "mean_verify_width": self.width_tokens / n,
            "drafted_tokens_per_request": self.drafted_tokens / n,
            "predicted_accept_length": 1.0 + self.predicted_for_observed / m,
            "realized_accept_length": 1.0 + self.realized_accepted / m,
        }

    def reset(self) -> None:
        for name, value in IntervalStats().__dict__.items():
            setattr(self, name, value)


def _identity_broadcast(obj):
    return obj


class DraftPlanner:
    """Keeps the cache in step with committed tokens and turns drafts into verify plans."""

    def __init__(
        self,
        config: AdaptiveConfig,
        cache: NgramCache | None = None,
        controller: WidthController | None = None,
        *,
        is_timing_rank: bool = True,
        broadcast: Callable[[Any], Any] = _identity_broadcast,
        max_requests: int = 1024,
        layout: Callable | None = None,
    ):
        self.config = config
        self.cache = cache if cache is not None else NgramCache(max_depth=config.max_depth, max_requests=max_requests)
        self.controller = controller if controller is not None else make_controller(config)
        self.is_timing_rank = is_timing_rank
        self.broadcast = broadcast
        if layout is None:
            from ngramspec.layout import tree_layout as layout
        self.layout = layout
        self.stats = IntervalStats()
        self._fed: dict[Hashable, int] = {}  # committed tokens the cache has seen, per request
        # per request in the last plan: (committed length at planning, drafted, predicted)
        self._last: dict[Hashable, tuple[int, int, float]] = {}
        self._local_durations: list[DurationSample] = []
        self._steps = 0

    # ----------------------------------------------------------------------------------- per step
    def plan(self, views: Sequence[RequestView]) -> StepPlan:
        """Sync the cache with `views`, learn from the previous step, choose width and drafts."""
        if not views:
            raise ValueError("plan() needs at least one request")
        drafted_prev, accepted_prev, predicted_prev = self._sync(views)
        durations: list[DurationSample] = []
        if self._steps % self.config.tp_sync_interval == 0:
            durations = list(self.broadcast(self._local_durations if self.is_timing_rank else None) or [])
            self._local_durations = []
        if drafted_prev.size or durations:
            self.stats.record_outcome(predicted_prev, accepted_prev)
            self.controller.observe(drafted_prev, accepted_prev, durations)
        self._steps += 1

        rids = [v.rid for v in views]
        budget = max(1, self.config.max_width - 1)
        batch = self.cache.propose(rids, budget, tree=self.config.tree)
        drafts = [batch.draft(i) for i in range(len(rids))]
        width, lengths = self.controller.choose(drafts)
        plan = self._build(views, drafts, width, lengths)
        for v, k, p in zip(views, plan.drafted, plan.predicted):
            self._last[v.rid] = (v.committed_len, int(k), float(p))
        self.stats.record_step(plan)
        return plan

    def record_duration(self, width: int, batch_size: int, seconds: float) -> None:
        """A measured verify step (only kept on the timing rank; shared at the next sync step)."""
        if self.is_timing_rank:
            self._local_durations.append(DurationSample(int(width), int(batch_size), float(seconds)))

    def release(self, rids: Sequence[Hashable]) -> None:
        """Requests that left the decode batch: their output joins the shared cache."""
        for rid in rids:
            if rid in self._fed:
                del self._fed[rid]
                self._last.pop(rid, None)
                self.cache.finish_request(rid, share=True)

    @property
    def tracked_requests(self) -> set:
        return set(self._fed)

    # ------------------------------------------------------------------------------------- inner
    def _sync(self, views: Sequence[RequestView]):
        """Feed new committed tokens; return (drafted, accepted, predicted) of the previous plan."""
        new_rids, new_tokens = [], []
        drafted, accepted, predicted = [], [], []
        for v in views:
            total = v.committed_len
            fed = self._fed.get(v.rid)
            if fed is None:
                if total == 0:
                    raise ValueError(f"request {v.rid!r} has no tokens")
                prompt = list(v.prompt) if len(v.prompt) else v.tail(0)[:1]
                self.cache.start_request(v.rid, prompt)
                fed = len(prompt)
                self._fed[v.rid] = fed
            if total > fed:
                new_rids.append(v.rid)
                new_tokens.append(v.tail(fed))
                self._fed[v.rid] = total
            last = self._last.pop(v.rid, None)
            if last is not None and total > last[0]:
                planned_len, k, p = last
                drafted.append(k)
                accepted.append(min(k, total - planned_len - 1))
                predicted.append(p)
        if new_rids:
            self.cache.add_tokens_batch(new_rids, new_tokens)
        return (np.asarray(drafted, dtype=np.int64), np.asarray(accepted, dtype=np.int64),
                np.asarray(predicted, dtype=np.float64))

    def _build(self, views, drafts, width, lengths) -> StepPlan:
        if width not in self.config.widths:
            raise ValueError(f"controller chose width {width}, not one of {self.config.widths}")
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.shape != (len(drafts),):
            raise ValueError(f"controller returned {lengths.shape} draft lengths for {len(drafts)} requests")
        sizes = np.array([len(d) for d in drafts], dtype=np.int64)
        if (lengths < 0).any() or (lengths > width - 1).any() or (lengths > sizes).any():
            raise ValueError(f"draft lengths {lengths.tolist()} do not fit width {width} / drafts {sizes.tolist()}")
        kept = [d.prefix(int(k)) for d, k in zip(drafts, lengths)]
        roots = np.array([v.last_token() for v in views], dtype=np.int64)
        lay = self.layout(kept, roots, width)
        predicted = np.array([float(d.probs.sum()) for d in kept], dtype=np.float64)
        return StepPlan(width, lengths, predicted, lay.tokens, lay.mask, lay.depths, lay.retrieve_index,
                        lay.retrieve_next_token, lay.retrieve_next_sibling)
