"""When the worker plans (every step while drafts pay, less often while they do not), and how many decode
forwards a step that drafts nothing runs.

Planning (syncing the cache with the committed tokens, proposing drafts, weighing widths) costs host time on every
decode step, and on a small model whose decode step is itself mostly host time that shows. After ``n`` plans in a
row that drafted nothing, the next ``min(n, max_skipped)`` steps run plain without planning; the first plan that
drafts resets the count. The cache loses nothing (the next plan feeds it every token committed meanwhile); a copy
that starts is noticed at most ``max_skipped`` steps late. On a large model a plan costs a few percent of a decode
step, hidden behind the GPU, and noticing a copy late costs more than the plans saved: the worker then plans every
step (``planned(width, skip=False)``; the ``plan_backoff`` option). Decisions depend on plan widths and on timings
shared from TP rank 0, which are identical on every TP rank, so all ranks skip the same steps.
"""
from __future__ import annotations

import statistics
from collections import deque


class PlanBackoff:
    def __init__(self, max_skipped: int = 3):
        if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 0:
            raise ValueError(f"max_skipped must be an int >= 0, got {max_skipped!r}")
        self.max_skipped = max_skipped
        self.idle_plans = 0  # consecutive plans that drafted nothing
        self.to_skip = 0  # steps left to run without planning

    def skip_planning(self) -> bool:
        """Whether this step may run plain without planning (consumes one skip if so)."""
        if self.to_skip > 0:
            self.to_skip -= 1
            return True
        return False

    def planned(self, width: int, skip: bool = True) -> None:
        """A plan chose ``width`` for this step; ``skip=False``: plan the next step too, whatever the width."""
        self.idle_plans = 0 if width > 1 else self.idle_plans + 1
        self.to_skip = min(self.idle_plans, self.max_skipped) if skip else 0

    def reset(self) -> None:
        self.idle_plans = self.to_skip = 0


def plain_forwards(limit: int, batch, max_batch: int | None = None) -> int:
    """How many decode forwards a step that drafts nothing runs back to back (multi-step decoding): up to
    ``limit`` for a batch of at most ``max_batch`` requests (any size if None), 1 for a larger one, never more
    than the most tokens a request of the batch may still generate, and 1 where a forward would need host state
    the chunk does not update between its forwards: penalties or a custom logit processor that read the output so
    far, sampling masks or hidden states returned per token. Every TP rank sees the same batch, so every rank runs
    the same count. Tokens past a request's stop are dropped by SGLang, as a verify's are.
    """
    if limit <= 1 or getattr(batch, "return_hidden_states", False):
        return 1
    if max_batch is not None and len(batch.reqs) > max_batch:
        return 1
    info = getattr(batch, "sampling_info", None)
    if info is not None:
        orchestrator = getattr(info, "penalizer_orchestrator", None)
        if (orchestrator is not None and orchestrator.is_required) or getattr(info, "has_custom_logit_processor",
                                                                              False):
            return 1
        if any(getattr(info, "return_sampling_masks", None) or ()):
            return 1
    most = 1
    for req in batch.reqs:
        cap = getattr(req.sampling_params, "max_new_tokens", None)
        if cap is None:
            return limit
        most = max(most, cap - len(req.output_ids))
        if most >= limit:
            return limit
    return most


class ForwardsChooser:
    """Multi-step plain decoding only where it pays, decided from measured step periods (``plain_forwards`` "auto",
    the default).

    Several decode forwards per scheduler step share the scheduler's per-step host work; that pays where a decode
    step is mostly host time (a small model) and costs where it is not (a large model's step is the GPU streaming
    weights, and the host work of the next step already overlaps it): there a chunk of forwards runs no faster per
    token, delays the next chance to draft by up to ``limit - 1`` tokens and hands tokens to clients in groups. So
    per batch-size bucket (1, 2, 3-4, 5-8, 9-16, ...: a batch's size drifts as its requests end, and one arm per
    size would explore again at every size) it measures the period per forward of plain steps of one forward and of
    ``limit`` forwards (each after a plain step, launched without waiting for its tokens; ``samples`` of each, the
    chunked one first) and then runs chunks only while their period per forward is below ``1 - margin`` times a
    single forward's. Once a bucket has decided, the others start from its choice (the nearest decided bucket's, the
    smaller on a tie) and measure the other arm only at their first revisit, after ``first_revisit`` plain steps:
    exploring chunks costs a large model's batch a chance to draft at every step of them, and a batch draining from
    16 requests to 1 passes through five buckets; where the other bucket's choice does not hold for this one (chunks
    that pay at batch 1 need not at 16) it holds only that long. Every ``revisit`` plain steps the arm not in use
    runs ``samples`` steps again, so a change of load is followed. Each arm's estimate is the median of its last
    ``samples`` samples: a lone slow step (a stall of the host) would move a mean by more than the margin, and it
    weighs ``limit`` times more on a single forward than on a chunk, where its period is shared. Decisions depend on
    the step counts and on the samples the planner shares from TP rank 0, so every rank chooses the same.
    """

    def __init__(self, limit: int, max_batch: int, *, margin: float = 0.1, samples: int = 6, revisit: int = 512,
                 first_revisit: int = 64):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self.limit, self.max_batch = limit, max_batch
        self.margin, self.samples, self.revisit, self.first_revisit = margin, samples, revisit, first_revisit
        self._arms: dict[int, _Arm] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        """The largest batch size of ``batch_size``'s bucket: 1, 2, 4, 8, 16, ..."""
        return 1 << (batch_size - 1).bit_length()

    def _arm(self, batch_size: int) -> _Arm:
        b = self.bucket(batch_size)
        arm = self._arms.get(b)
        if arm is None:
            arm = self._arms[b] = _Arm(self.samples)
        return arm

    def observe(self, batch_size: int, forwards: int, seconds_per_forward: float) -> None:
        """A plain step after a plain step: its period divided by its forwards."""
        if batch_size > self.max_batch or self.limit <= 1:
            return
        arm = self._arm(batch_size)
        (arm.single if forwards == 1 else arm.chunk).add(seconds_per_forward)

    def _measured(self, arm: _Arm) -> bool:
        return arm.single.n >= self.samples and arm.chunk.n >= self.samples

    def _pays(self, arm: _Arm) -> bool:
        return arm.chunk.median < (1.0 - self.margin) * arm.single.median

    def _prior(self, bucket: int) -> bool | None:
        """The choice of the nearest bucket with both arms measured (the smaller on a tie), None if none is."""
        decided = [b for b, a in self._arms.items() if b != bucket and self._measured(a)]
        if not decided:
            return None
        nearest = min(decided, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self._pays(self._arms[nearest])

    def chunked(self, batch_size: int) -> bool:
        """Whether plain steps of this batch size should run ``limit`` forwards now (before revisits)."""
        b = self.bucket(batch_size)
        arm = self._arms.get(b)
        if arm is not None and self._measured(arm):
            return self._pays(arm)
        prior = self._prior(b)
        if prior is not None:
            return prior
        return arm is None or arm.chunk.n < self.samples  # nothing decided anywhere: chunks first, then singles

    def forwards_limit(self, batch_size: int) -> int:
        """The forwards a plain step of ``batch_size`` requests may run (`plain_forwards` caps it further)."""
        if batch_size > self.max_batch or self.limit <= 1:
            return 1
        arm = self._arms.get(self.bucket(batch_size))
        chunk = self.chunked(batch_size)
        if arm is not None and arm.revisit > 0:  # revisiting the other arm
            chunk = not chunk
        return self.limit if chunk else 1

    def stepped(self, batch_size: int, forwards: int) -> None:
        """A plain step of ``batch_size`` requests ran ``forwards`` forwards (counts steps toward revisits)."""
        if batch_size > self.max_batch or self.limit <= 1:
            return
        arm = self._arm(batch_size)
        if arm.revisit > 0:
            arm.revisit -= 1
            return
        # the arm in use has its samples (while a bucket explores with nothing decided, the arm in use lacks them)
        if (arm.chunk if self.chunked(batch_size) else arm.single).n >= self.samples:
            arm.steps += 1
            if arm.steps >= (self.revisit if self._measured(arm) else self.first_revisit):
                arm.steps = 0
                arm.revisit = self.samples

    def summary(self) -> dict:
        """Per bucket ("9-16"): ms per forward of single and chunked plain steps (medians of the last ``samples``),
        sample counts, the current choice."""
        return {(str(b) if b <= 2 else f"{b // 2 + 1}-{b}"): {
            "single_ms": round(1e3 * a.single.median, 4), "single_n": a.single.n,
            "chunked_ms": round(1e3 * a.chunk.median, 4), "chunked_n": a.chunk.n,
            "chunked": self.chunked(b)} for b, a in list(self._arms.items())}


class _Samples:
    """The last ``window`` samples of one arm and their median, kept current as samples arrive."""

    __slots__ = ("_ring", "n", "median")

    def __init__(self, window: int):
        self._ring: deque[float] = deque(maxlen=window)
        self.n = 0  # samples seen in all
        self.median = 0.0

    def add(self, value: float) -> None:
        self._ring.append(value)
        self.n += 1
        self.median = statistics.median(self._ring)


class _Arm:
    """One batch-size bucket: samples of single and chunked plain steps; plain steps toward the next revisit and
    steps left of the current one."""

    __slots__ = ("single", "chunk", "steps", "revisit")

    def __init__(self, window: int):
        self.single, self.chunk = _Samples(window), _Samples(window)
        self.steps = 0
        self.revisit = 0
