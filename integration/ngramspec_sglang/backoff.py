"""When the worker plans (every step while drafts pay, less often while they do not), and how many decode
forwards a step that drafts nothing runs.

Planning (syncing the cache with the committed tokens, proposing drafts, weighing widths) costs host time on every
decode step, and on a small model whose decode step is itself mostly host time that shows. After ``n`` plans in a
row that drafted nothing, the next ``min(n, max_skipped)`` steps run plain without planning; the first plan that
drafts resets the count. The cache loses nothing (the next plan feeds it every token committed meanwhile); a copy
that starts is noticed at most ``max_skipped`` steps late. Decisions depend on plan widths only, which are identical
on every TP rank, so all ranks skip the same steps.
"""
from __future__ import annotations


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

    def planned(self, width: int) -> None:
        """A plan chose ``width`` for this step."""
        self.idle_plans = 0 if width > 1 else self.idle_plans + 1
        self.to_skip = min(self.idle_plans, self.max_skipped)

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
