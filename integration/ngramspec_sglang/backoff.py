"""When the worker plans: every step while drafts pay, less often while they do not.

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
