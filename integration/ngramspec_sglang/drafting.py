"""Host-side drafting for the SGLang worker: cache bookkeeping, width choice, verify layout.

No sglang or torch import: the worker hands in plain request views and gets back numpy arrays, so
everything here runs (and is tested) on CPU. One `DraftPlanner` per scheduler process (= per TP rank).

Tensor-parallel determinism: every rank sees the same batches and the same committed tokens, so the
cache proposes the same drafts and the controller sees the same acceptance. The only rank-local input
is the measured verify duration: samples are collected on TP rank 0 only and handed to the controller
(`observe_step`) on every rank at the same step (every `tp_sync_interval` verify steps) through
`broadcast`, which the worker binds to SGLang's TP `broadcast_object` (CPU group). Decisions therefore
depend on tokens, acceptance and rank 0's timings only, and are identical on all ranks.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np

from ngramspec.cache import DraftBatch, NgramCache
from ngramspec.controller import AdaptiveController, FixedWidthController, Plan
from ngramspec.layout import accepted_path, layout_flat
from ngramspec.recycle import RECYCLED, RecycleTable, bfs_template, order_by_value, with_recycled

from .backoff import ForwardsChooser
from .config import AdaptiveConfig

logger = logging.getLogger(__name__)


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


class DurationSample(NamedTuple):
    """One verify step as measured on TP rank 0 (``after_draft``: a plain step that waited for a drafting
    step's tokens, see `DraftPlanner.record_wait`)."""

    width: int
    batch_size: int
    seconds: float
    after_draft: bool = False


class PlainSample(NamedTuple):
    """A plain step after a plain step as measured on TP rank 0: its period per forward (`backoff.ForwardsChooser`)."""

    batch_size: int
    forwards: int
    seconds: float


class PlanSample(NamedTuple):
    """The host time of a plan on a step that had not waited for the previous step's tokens, as measured on TP
    rank 0 (`DraftPlanner.plans_are_cheap`)."""

    seconds: float


class PreplanSample(NamedTuple):
    """A step that waited for the previous step's tokens, as measured on TP rank 0 (`DraftPlanner.preplan_pays`):
    the wait as it would have been without preparing a verify first (the preparation's time plus what was left of
    the wait after it, else the wait itself), and the preparation's time (None: none prepared)."""

    wait: float
    preplan: float | None


class WidthCycleController(FixedWidthController):
    """Verify at each of ``widths`` in turn, one step each, sending the draft nodes that fit: a sweep of the step
    cost by width in a live server (``width_cycle``). Identical on every TP rank (it counts plans)."""

    def __init__(self, widths: Sequence[int]):
        self.widths = tuple(int(w) for w in widths)
        super().__init__(max(self.widths))
        self._next = 0

    def plan(self, rids, batch, waiting=None):
        self.width = self.widths[self._next % len(self.widths)]
        self._next += 1
        return super().plan(rids, batch, waiting)


def make_controller(config: AdaptiveConfig):
    """`ngramspec.controller.AdaptiveController` over the configured widths, or a fixed width
    (`ngramspec.controller.FixedWidthController`), or a width sweep (`WidthCycleController`)."""
    if config.width_cycle is not None:
        return WidthCycleController(config.width_cycle)
    if config.fixed_width is not None:
        return FixedWidthController(config.fixed_width)
    from ngramspec.controller import AdaptiveController

    options = dict(config.controller)
    if config.draft_max_batch is not None:
        options.setdefault("max_draft_batch", config.draft_max_batch)
    try:
        return AdaptiveController(config.widths, **options)
    except TypeError as e:
        raise ValueError(f"bad \"controller\" options in --speculative-adaptive-config: {e}") from None


@dataclass
class StepPlan:
    """One verify step: width, per-request draft lengths and SGLang-layout arrays `[B, width]`."""

    width: int
    drafted: np.ndarray  # int64 [B]: real draft nodes per request (the rest of the row is padding)
    expected_tokens: float  # the controller's expected committed tokens this step (bonus included)
    reason: str  # why this width ("best", "explore", "no-draft", "fixed")
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
    expected_tokens: float = 0.0  # the controller's expectation, bonus included
    observed_requests: int = 0
    realized_accepted: int = 0
    drafted_recycled: int = 0  # of drafted_tokens, those token recycling drafted (`recycle`)
    accepted_recycled: int = 0  # of realized_accepted, those token recycling drafted

    def record_step(self, plan: StepPlan, drafted: Sequence[int] | None = None) -> None:
        """Count a planned step; ``drafted``: ``plan.drafted`` as a list, when the caller has it."""
        B = int(plan.drafted.size)
        self.verify_steps += 1
        self.verified_requests += B
        self.width_tokens += plan.width * B
        self.drafted_tokens += int(plan.drafted.sum()) if drafted is None else sum(drafted)
        self.expected_tokens += float(plan.expected_tokens)

    def record_outcome(self, accepted, recycled: int = 0) -> None:
        """Draft tokens accepted per request of the last step (a sequence of ints), ``recycled`` of them drafted by
        token recycling."""
        self.observed_requests += len(accepted)
        self.realized_accepted += int(sum(accepted))
        self.accepted_recycled += recycled

    def mean_width(self) -> float:
        """1 + drafted tokens per verified request: SGLang's accept rate is exact under this width."""
        return 1.0 + self.drafted_tokens / max(1, self.verified_requests)

    def by_source(self) -> dict[str, int]:
        """Draft tokens sent and accepted by source (the n-gram cache, token recycling), and the request-steps
        they are over."""
        return {"drafted_ngram": self.drafted_tokens - self.drafted_recycled, "drafted_recycled": self.drafted_recycled,
                "accepted_ngram": self.realized_accepted - self.accepted_recycled,
                "accepted_recycled": self.accepted_recycled, "verified_requests": self.verified_requests,
                "observed_requests": self.observed_requests}

    def summary(self) -> dict[str, float]:
        n, m = max(1, self.verified_requests), max(1, self.observed_requests)
        src = self.by_source()
        return {
            "mean_verify_width": self.width_tokens / n,
            "drafted_tokens_per_request": self.drafted_tokens / n,
            "predicted_accept_length": self.expected_tokens / n,
            "realized_accept_length": 1.0 + self.realized_accepted / m,
            # by source: the n-gram cache's drafts and token recycling's, per request and step
            **{f"{k}_per_request": src[k] / (n if k.startswith("drafted") else m)
               for k in ("drafted_ngram", "drafted_recycled", "accepted_ngram", "accepted_recycled")},
        }

    def reset(self) -> None:
        for name, value in IntervalStats().__dict__.items():
            setattr(self, name, value)


from ngramspec.layout import tree_layout as _default_layout  # noqa: E402


def _identity_broadcast(obj):
    return obj


class DraftPlanner:
    """Keeps cache and controller in step with committed tokens and turns drafts into verify plans."""

    def __init__(
        self,
        config: AdaptiveConfig,
        cache: NgramCache | None = None,
        controller=None,
        *,
        is_timing_rank: bool = True,
        broadcast: Callable[[Any], Any] = _identity_broadcast,
        max_requests: int = 1024,
        layout: Callable | None = None,
        vocab_size: int | None = None,
    ):
        self.config = config
        if cache is None:
            cache = NgramCache(max_depth=config.max_depth, max_requests=max_requests, **config.cache_sizes())
        self.cache = cache
        self.controller = controller if controller is not None else make_controller(config)
        self.is_timing_rank = is_timing_rank
        self.broadcast = broadcast
        self.layout = _default_layout if layout is None else layout
        self.stats = IntervalStats()
        # token recycling (`recycle`): each token's latest top-k successors from the verifier's own scores
        self.recycle_table = None
        if config.recycle:
            if vocab_size is None:
                raise ValueError("recycle needs the model's vocabulary size")
            self.recycle_table = RecycleTable(int(vocab_size), config.recycle_topk,
                                              bfs_template(config.recycle_branching))
        self.recycled_requests = 0  # request-steps whose draft recycling made or widened
        # rid -> (tokens, parents, recycled?) of the draft sent last step, where recycling drafted part of it: which
        # source the accepted tokens came from is read from it at the next plan (metrics only)
        self._sent: dict[Hashable, tuple[list, list, list]] = {}
        self._fed: dict[Hashable, int] = {}  # committed tokens the cache has seen, per request
        self._untracked: set = set()  # requests the cache had no room for: served without drafts
        self._last: dict[Hashable, tuple[int, int]] = {}  # rid -> (committed length at planning, drafted)
        self._local_durations: list[DurationSample] = []
        self._steps = 0
        self.fitted = False  # the last plan was laid out at a prepared width (`plan`'s fit_width), not its own
        self._wait_ms: dict[int, float] = {}  # batch size -> what a plain step after a drafting step costs extra
        self._wait_any: float | None = None  # the same over every batch size
        self._plan_ms: float | None = None  # what a plan costs the host (moving average of `record_plan`'s samples)
        # `preplan` "auto": recent waits for the previous step's tokens and recent preparations (ms, rank 0's), and
        # their medians (updated as samples arrive)
        self._preplan_waits: deque = deque(maxlen=15)
        self._preplan_costs: deque = deque(maxlen=15)
        self._preplan_medians: tuple[float, float] | None = None
        self._root_layouts: dict[int, tuple] = {}  # batch size -> `_root_rows`
        self._widths = frozenset(config.widths)
        # multi-step plain decoding where measured to pay (plain_forwards "auto"), else None
        self.forwards = (ForwardsChooser(config.plain_forwards, config.plain_forwards_max_batch)
                         if config.plain_forwards_auto and config.plain_forwards > 1 else None)

    # ----------------------------------------------------------------------------------- per step
    def plan(self, views: Sequence[RequestView], waiting: int | None = None, after_draft: bool = False,
             fit_width: int | None = None) -> StepPlan:
        """Sync cache and controller with `views`, share timings, choose width and drafts. ``waiting``: the
        scheduler's queue length (identical on every TP rank), or None when unknown. ``after_draft``: the last
        decode step drafted; if not, and waits were recorded (`record_wait`), drafting now is charged the wait
        its end will cost a plain step. ``fit_width``: a verify already prepared at that width; a drafting plan
        whose width is within a factor 2 of it is laid out at that width instead (`fits_prepared`): drafts longer
        than it allows are cut, shorter ones padded as in any batch."""
        if not views:
            raise ValueError("plan() needs at least one request")
        rids, totals, committed, accepted, lasts = self._collect(views)
        self.stats.record_outcome(accepted, self._recycled_accepted(rids, committed) if self._sent else 0)
        if self._steps % self.config.tp_sync_interval == 0:
            samples = self.broadcast(self._local_durations if self.is_timing_rank else None) or []
            self._local_durations = []
            preplans = False  # `preplan` samples among them: its medians change
            for s in samples:
                if type(s) is PlainSample:
                    if self.forwards is not None:
                        self.forwards.observe(s.batch_size, s.forwards, s.seconds)
                elif type(s) is PlanSample:
                    ms = s.seconds * 1000.0
                    self._plan_ms = ms if self._plan_ms is None else self._plan_ms + 0.1 * (ms - self._plan_ms)
                elif type(s) is PreplanSample:
                    preplans = True
                    self._preplan_waits.append(s.wait * 1000.0)
                    if s.preplan is not None:
                        self._preplan_costs.append(s.preplan * 1000.0)
                elif s.after_draft:
                    self._note_wait(s.batch_size, s.seconds * 1000.0)
                else:
                    self.controller.observe_step(s.batch_size, s.width, s.seconds * 1000.0)
            if preplans and self._preplan_waits and self._preplan_costs:
                self._preplan_medians = (statistics.median(self._preplan_waits),
                                         statistics.median(self._preplan_costs))
        self._steps += 1

        ctl = self.controller
        recycling = self.recycle_table is not None
        switch = 0.0 if after_draft or self._wait_any is None else self._wait_ms.get(len(rids), self._wait_any)
        if type(ctl) is AdaptiveController and not recycling and not (
                self._untracked and any(r in self._untracked for r in rids)):
            # the fast path: commit, propose and plan for the whole batch in a few kernel calls
            batch, decision = ctl.step(self.cache, rids, committed, waiting=waiting, tree=self.config.tree,
                                       switch_cost=switch)
        else:
            new_rids = [r for r, t in zip(rids, committed) if len(t) and r not in self._untracked]
            if new_rids:
                self.cache.add_tokens_batch(new_rids, [t for r, t in zip(rids, committed)
                                                       if len(t) and r not in self._untracked])
            if type(ctl) is AdaptiveController:
                ctl.observe_batch(rids, committed)  # one kernel call for the batch
            else:
                for r, t in zip(rids, committed):
                    if len(t):
                        ctl.observe_tokens(r, t)
            batch = self._propose(rids)
            if recycling:  # recycling's drafts merged into the cache's (a third source, calibrated apart)
                batch, used = with_recycled(batch, self.recycle_table, lasts, max(1, self.config.max_width - 1),
                                            self.config.recycle_min_match, widen=self.config.recycle_widen)
                self.recycled_requests += used
                if self.config.recycle_widen and type(ctl) is AdaptiveController:
                    # the best nodes of both sources first (the merge puts recycling's after the n-gram draft)
                    batch = order_by_value(batch, ctl.node_values(rids, batch)[0])
            if recycling and type(ctl) is AdaptiveController:
                decision = ctl.plan(rids, batch, waiting=waiting, switch_cost=switch)
            else:
                decision = ctl.plan(rids, batch, waiting=waiting)
        if (self.config.draft_max_batch is not None and len(rids) > self.config.draft_max_batch
                and decision.width > 1):  # a fixed width or a sweep (the adaptive controller never drafts there)
            decision = Plan(1, np.zeros(len(rids), np.int64), float(len(rids)), float(decision.cost), "no-draft")
        width = int(decision.width)
        limit = getattr(ctl, "max_step_tokens", None)
        self.fitted = (fit_width is not None and fit_width != width and fits_prepared(width, fit_width)
                       and self.layout is _default_layout and (limit is None or fit_width * len(rids) <= limit))
        if self.fitted:
            lengths = np.minimum(np.asarray(decision.lengths, dtype=np.int64), fit_width - 1)
            plan = self._build(views, batch, decision, lasts, width=fit_width, lengths=lengths)
        else:
            plan = self._build(views, batch, decision, lasts)
        last = self._last
        drafted = plan.drafted.tolist()
        for rid, total, k in zip(rids, totals, drafted):
            last[rid] = (total, k)
        self.stats.record_step(plan, drafted)
        if recycling:
            self._note_sent(rids, batch, drafted)
        return plan

    def _note_sent(self, rids, batch: DraftBatch, drafted: list[int]) -> None:
        """Count the recycled nodes of the drafts sent (the first ``drafted[i]`` nodes of each) and keep the drafts
        that have any, for `_recycled_accepted`."""
        sent, offsets, n = self._sent, batch.offsets, 0
        is_recycled = batch.sources == RECYCLED
        if not is_recycled.any():  # the common case: nothing recycled in this batch's drafts
            if sent:
                for rid in rids:
                    sent.pop(rid, None)
            return
        for i, (rid, k) in enumerate(zip(rids, drafted)):
            a = int(offsets[i])
            recycled = is_recycled[a:a + k]
            r = int(np.count_nonzero(recycled)) if k else 0
            if r:
                n += r
                sent[rid] = (batch.tokens[a:a + k].tolist(), batch.parents[a:a + k].tolist(), recycled.tolist())
            else:
                sent.pop(rid, None)
        self.stats.drafted_recycled += n

    def _recycled_accepted(self, rids, committed) -> int:
        """Of the draft tokens accepted since the last plan, how many token recycling drafted: each kept draft's
        accepted path (`accepted_path`) over the tokens committed since (the last one is the bonus token)."""
        n, sent = 0, self._sent
        for rid, tokens in zip(rids, committed):
            entry = sent.pop(rid, None)
            if entry is not None and len(tokens) > 1:
                draft, parents, recycled = entry
                n += sum(recycled[j] for j in accepted_path(draft, parents, tokens[:-1]))
        return n

    def recycle_update(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Token recycling's table takes one step's scored rows: ``topk[i]`` the verifier's most likely tokens after
        ``tokens[i]`` (no-op without `recycle`)."""
        if self.recycle_table is not None and len(tokens):
            self.recycle_table.update(tokens, topk)

    def prefetch(self, rids: Sequence[Hashable]) -> None:
        """Warm the CPU caches for the next `plan` of the batch ``rids`` while the host would otherwise wait on
        the device: the adaptive controller's step code runs on the tokens the cache already holds, changing
        nothing (`AdaptiveController.prefetch`). Does nothing for other controllers, for requests the planner
        does not track yet, or for a batch with a request served without drafts."""
        ctl = self.controller
        if type(ctl) is AdaptiveController and not (self._untracked and any(r in self._untracked for r in rids)):
            ctl.prefetch(self.cache, list(rids))

    def record_duration(self, width: int, batch_size: int, seconds: float, *, after_draft: bool = False) -> None:
        """A measured verify step (only kept on the timing rank; shared at the next sync step). ValueError for a
        width not in the configured widths, a batch size < 1 or a duration that is not positive and finite."""
        if type(width) is int and type(batch_size) is int and type(seconds) is float and width in self._widths \
                and batch_size >= 1 and 0.0 < seconds < math.inf:  # the common case, checked in one line
            if self.is_timing_rank:
                self._local_durations.append(DurationSample(width, batch_size, seconds, after_draft))
            return
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or int(width) not in self.config.widths:
            raise ValueError(f"width must be one of {self.config.widths}, got {width!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)) \
                or not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"step duration must be a positive finite number of seconds, got {seconds!r}")
        if self.is_timing_rank:
            self._local_durations.append(DurationSample(int(width), int(batch_size), float(seconds), after_draft))

    def record_plain(self, batch_size: int, forwards: int, seconds: float) -> None:
        """A plain step after a plain step: ``seconds`` per forward of its ``forwards`` (kept on the timing rank,
        shared at the next sync step, for `forwards_limit`)."""
        if self.forwards is not None and self.is_timing_rank:
            self._local_durations.append(PlainSample(int(batch_size), int(forwards), float(seconds)))

    def record_plan(self, seconds: float) -> None:
        """The host time of a plan made before the previous step's tokens were waited for (kept on the timing rank,
        shared at the next sync step, for `plans_are_cheap`)."""
        if self.is_timing_rank:
            self._local_durations.append(PlanSample(float(seconds)))

    def record_preplan(self, wait: float, preplan: float | None) -> None:
        """A step that waited for the previous step's tokens: ``wait`` seconds as without a verify prepared first,
        ``preplan`` seconds preparing one (None: none prepared). Kept on the timing rank, shared at the next sync
        step, for `preplan_pays`."""
        if self.is_timing_rank:
            self._local_durations.append(PreplanSample(float(wait), None if preplan is None else float(preplan)))

    def preplan_pays(self, slack_ms: float) -> bool:
        """Whether preparing a verify before the wait fits in the wait: the recent waits' median exceeds the recent
        preparations' median by at least ``slack_ms`` (True until both are measured, so that they are). Where the
        GPU step is short (a small model), the preparation outlasts the wait and delays the next forward. Medians,
        so that a first slow preparation (a kernel's first load) does not decide. The same on every TP rank (rank
        0's measurements, shared)."""
        if self._preplan_medians is None:
            return True
        wait, cost = self._preplan_medians
        return wait >= cost + slack_ms

    def preplan_summary(self, slack_ms: float) -> dict | None:
        """For the profile: the medians `preplan_pays` compares (ms) and its answer; None until measured."""
        if self._preplan_medians is None:
            return None
        wait, cost = self._preplan_medians
        return {"wait_ms": round(wait, 4), "preparation_ms": round(cost, 4), "pays": self.preplan_pays(slack_ms)}

    def plans_are_cheap(self, batch_size: int, share: float) -> bool:
        """Whether a plan costs at most ``share`` of a plain step of ``batch_size`` requests, both measured (False
        until both are). Where it does, skipping plans saves little and may miss a draft that pays. The same on
        every TP rank (both measurements are rank 0's, shared)."""
        ctl = self.controller
        if self._plan_ms is None or not isinstance(ctl, AdaptiveController) or not ctl.costs.measured(batch_size, 1):
            return False
        return self._plan_ms <= share * ctl.costs.estimate(batch_size, 1)

    def forwards_limit(self, batch_size: int) -> int:
        """The decode forwards a plain step of ``batch_size`` requests may run (`backoff.plain_forwards` caps it):
        the configured number, or with "auto" what the measured periods favour."""
        if self.forwards is None:
            return self.config.plain_forwards if batch_size <= self.config.plain_forwards_max_batch else 1
        return self.forwards.forwards_limit(batch_size)

    def plain_stepped(self, batch_size: int, forwards: int) -> None:
        """A plain step ran ``forwards`` forwards (for the "auto" choice's revisits)."""
        if self.forwards is not None:
            self.forwards.stepped(batch_size, forwards)

    def record_wait(self, batch_size: int, seconds: float) -> None:
        """A plain step measured right after a drafting step (it waited for that step's tokens). Shared like the
        durations; its excess over the controller's estimate of a plain step is then charged to every step that
        starts drafting. Same checks as `record_duration`."""
        self.record_duration(1, batch_size, seconds, after_draft=True)

    def _note_wait(self, batch_size: int, ms: float) -> None:
        """Fold a shared wait sample into the per-batch-size excess (the same on every TP rank)."""
        if not isinstance(self.controller, AdaptiveController):
            return
        extra = max(0.0, ms - self.controller.costs.estimate(batch_size, 1))
        old = self._wait_ms.get(batch_size)
        self._wait_ms[batch_size] = extra if old is None else old + 0.2 * (extra - old)
        self._wait_any = extra if self._wait_any is None else self._wait_any + 0.2 * (extra - self._wait_any)

    def forget_outcomes(self, rids) -> None:
        """A step drafted elsewhere (on the device) ran after this planner's last plan for ``rids``: the next plan
        sees both steps' tokens, so it counts no accepted drafts for them (the controller's calibration is not
        affected: it matches its drafts against whatever tokens were committed)."""
        for rid in rids:
            self._last.pop(rid, None)
            self._sent.pop(rid, None)

    def release(self, rids) -> None:
        """Requests that left the decode batch: their output joins the shared cache."""
        for rid in rids:
            if rid in self._fed:
                del self._fed[rid]
                self._last.pop(rid, None)
                self._sent.pop(rid, None)
                if rid in self._untracked:
                    self._untracked.discard(rid)
                else:
                    self.cache.finish_request(rid, share=True)
                self.controller.finish(rid)

    def warm_up(self) -> None:
        """Compile every kernel the planner uses (cache, controller, layout) on throwaway objects of the same
        kinds; the planner's own cache, controller, counters and timings are untouched."""
        from ngramspec.warmup import warm_up

        warm_up()
        cache = NgramCache(max_depth=self.config.max_depth, max_requests=4, local_nodes=256, shared_nodes=256,
                           shared_tokens=256)
        scratch = DraftPlanner(self.config, cache=cache, controller=make_controller(self.config),
                               layout=self.layout,
                               vocab_size=None if self.recycle_table is None else self.recycle_table.vocab_size)
        text = [1, 2, 3, 1, 2, 3, 1, 2]
        for waiting in (None, 0, 1):
            out = text[: 2 + (waiting or 0)]
            plan = scratch.plan([RequestView("a", text, out), RequestView("b", text[:4], [])], waiting=waiting)
            scratch.record_duration(plan.width, 2, 0.01)
        scratch.release(["a", "b"])

    @property
    def tracked_requests(self) -> set:
        return set(self._fed)

    # ------------------------------------------------------------------------------------- inner
    def _collect(self, views: Sequence[RequestView]):
        """Start new requests, and per request: its id, committed length, the tokens committed since the last
        plan (to feed cache and controller) and, for requests planned last step, the draft tokens accepted
        (committed growth minus the bonus token); and each request's last committed token."""
        rids, totals, committed, accepted, lasts = [], [], [], [], []
        fed_of, last_of = self._fed, self._last
        for v in views:
            rid, prompt, output, pending = v.rid, v.prompt, v.output, v.pending
            p, o = len(prompt), len(output)
            total = p + o + len(pending)
            fed = fed_of.get(rid)
            if fed is None:
                if total == 0:
                    raise ValueError(f"request {rid!r} has no tokens")
                prompt = list(v.prompt) if len(v.prompt) else v.tail(0)[:1]
                try:
                    self.cache.start_request(rid, prompt)
                except RuntimeError as e:  # cache full: serve it undrafted rather than fail the batch
                    self._untracked.add(rid)
                    logger.warning("NGRAM_ADAPTIVE: request %r served without drafts: %s", rid, e)
                self.controller.start(rid)
                fed = len(prompt)
                fed_of[rid] = fed
            if total > fed:  # (`RequestView.tail`, inlined: the common cases first)
                if fed >= p + o:
                    committed.append(list(pending[fed - p - o:]))
                elif fed >= p and not len(pending):
                    committed.append(list(output[fed - p:]))
                else:
                    committed.append(v.tail(fed))
                fed_of[rid] = total
            else:
                committed.append(_NO_TOKENS)
            last = last_of.pop(rid, None)
            if last is not None and total > last[0]:
                accepted.append(max(0, min(last[1], total - last[0] - 1)))
            rids.append(rid)
            totals.append(total)
            lasts.append(pending[-1] if len(pending) else output[-1] if o else v.prompt[-1])
        return rids, totals, committed, accepted, lasts

    def _propose(self, rids) -> DraftBatch:
        """Drafts for the batch; requests without cache state get empty drafts."""
        budget = max(1, self.config.max_width - 1)
        tracked = [r for r in rids if r not in self._untracked]
        if len(tracked) == len(rids):
            return self.cache.propose(rids, budget, tree=self.config.tree)
        part = self.cache.propose(tracked, budget, tree=self.config.tree) if tracked else None
        sizes, match, k = np.zeros(len(rids), np.int64), np.zeros(len(rids), np.int64), 0
        for i, rid in enumerate(rids):
            if rid not in self._untracked:
                sizes[i] = part.offsets[k + 1] - part.offsets[k]
                match[i] = part.match_lens[k]
                k += 1
        offsets = np.zeros(len(rids) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        if part is None:
            empty = np.zeros(0, np.int32)
            return DraftBatch(empty, empty.copy(), np.zeros(0, np.float32), np.zeros(0, np.int8), offsets, match)
        return DraftBatch(part.tokens, part.parents, part.probs, part.sources, offsets, match)

    def _build(self, views, batch, decision, lasts, width=None, lengths=None) -> StepPlan:
        width = int(decision.width) if width is None else int(width)
        if width not in self.config.widths:
            raise ValueError(f"controller chose width {width}, not one of {self.config.widths}")
        lengths = np.asarray(decision.lengths if lengths is None else lengths, dtype=np.int64)
        if not isinstance(self.controller, AdaptiveController):  # its plans fit by construction
            if lengths.shape != (len(views),):
                raise ValueError(f"controller returned {lengths.shape} draft lengths for {len(views)} requests")
            sizes = batch.offsets[1:] - batch.offsets[:-1]
            if lengths.size and (lengths.min() < 0 or lengths.max() > width - 1 or (lengths > sizes).any()):
                raise ValueError(f"draft lengths {lengths.tolist()} do not fit width {width} / drafts "
                                 f"{sizes.tolist()}")
        roots = np.array(lasts, np.int64)
        if width == 1 and self.layout is _default_layout:  # the roots alone: the rest is the same every step
            depths, index, none, mask = self._root_rows(len(views))
            return StepPlan(1, lengths, float(decision.expected), str(decision.reason), roots.reshape(-1, 1), mask,
                            depths, index, none, none)
        if self.layout is _default_layout:
            lay = layout_flat(batch.tokens, batch.parents, batch.offsets, lengths, roots, width)
        else:
            kept = [batch.draft(i).prefix(int(k)) for i, k in enumerate(lengths)]
            lay = self.layout(kept, roots, width)
        return StepPlan(width, lengths, float(decision.expected), str(decision.reason), lay.tokens, lay.mask,
                        lay.depths, lay.retrieve_index, lay.retrieve_next_token, lay.retrieve_next_sibling)

    def _root_rows(self, B: int) -> tuple:
        """Arrays of a width-1 step's layout of ``B`` requests (depths, retrieve index, -1s for the retrieve links,
        the mask), the `layout_flat` convention, read-only and kept per batch size."""
        rows = self._root_layouts.get(B)
        if rows is None:
            rows = (np.zeros((B, 1), np.int64), np.arange(B, dtype=np.int64)[:, None], np.full((B, 1), -1, np.int64),
                    np.ones((B, 1, 1), np.bool_))
            for a in rows:
                a.flags.writeable = False
            if len(self._root_layouts) >= 256:
                self._root_layouts.clear()
            self._root_layouts[B] = rows
        return rows


def fits_prepared(width: int, prepared: int) -> bool:
    """Whether a plan that drafts at ``width`` runs at a verify width ``prepared`` before it was drafted
    (`DraftPlanner.plan`'s ``fit_width``): both draft, and neither is more than twice the other."""
    return width > 1 and prepared > 1 and prepared <= 2 * width and width <= 2 * prepared


_NO_TOKENS: list = []
