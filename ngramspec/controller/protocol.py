"""What every controller is: the protocol, the plan it returns, the verify widths, the input validators, and the
two static controllers (a fixed verify width; a fixed draft budget).

A controller chooses, each step, one verify width for the batch (incl. the root; 1 = plain decode) and how many
nodes of each request's best-first draft to send. The caller drives it per request (``start``/``finish``), per
step (``plan`` with the cache's ``DraftBatch``, then the measured ``observe_step``) and per committed token
(``observe_tokens``). ``AdaptiveController`` (``ngramspec.controller.adaptive``) is the adaptive one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_WIDTH = 4097  # a width holds the root and at most the cache's MAX_BUDGET draft nodes


@dataclass(frozen=True)
class Plan:
    width: int  # batch verify width incl. the root (1 = plain decode)
    lengths: np.ndarray  # draft nodes kept per request (prefix lengths)
    expected: float  # expected tokens this step (bonus included)
    cost: float  # estimated step cost (ms, or relative units before any measurement)
    reason: str  # "best", "explore", "re-measure", "no-draft" or "fixed"


def _new_plan(width: int, lengths: np.ndarray, expected: float, cost: float, reason: str) -> Plan:
    """``Plan(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (most of its cost on the
    per-step path); the result is an ordinary, equal Plan."""
    p = object.__new__(Plan)
    p.__dict__.update(width=width, lengths=lengths, expected=expected, cost=cost, reason=reason)
    return p


@runtime_checkable
class Controller(Protocol):
    """The controller protocol. ``max_width``: the widest verify it may choose, so drafts need at most
    ``max_width - 1`` nodes."""

    max_width: int

    def start(self, rid: Hashable) -> None: ...

    def finish(self, rid: Hashable) -> None: ...

    def plan(self, rids: Sequence[Hashable], batch, waiting: int | None = None) -> Plan:
        """Width and per-request prefix lengths for the ``DraftBatch`` ``batch`` of ``rids``; ``waiting``: the
        requests queued behind the batch (None: unknown)."""

    def observe_tokens(self, rid: Hashable, committed: Sequence[int]) -> None:
        """The tokens the model committed for ``rid`` this step (accepted draft tokens + bonus)."""

    def observe_step(self, batch: int, width: int, duration_ms: float) -> None:
        """The measured duration of a step of ``batch`` requests verified at ``width``."""


# ------------------------------------------------------------------------------------------ validators
_INT_TYPES = frozenset((int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))


def is_int(v) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_widths(widths) -> list[int]:
    """Verify widths -> sorted, unique, with the plain decode width 1; ValueError unless integers in
    [1, MAX_WIDTH]."""
    try:
        ws = [w for w in widths]
    except TypeError:
        raise ValueError(f"widths must be a sequence of integers, got {widths!r}") from None
    if not ws or not all(is_int(w) and 1 <= w <= MAX_WIDTH for w in ws):
        raise ValueError(f"widths must be integers in [1, {MAX_WIDTH}], got {list(ws)!r}")
    ws = sorted(set(int(w) for w in ws))
    return ws if ws[0] == 1 else [1] + ws


def check_waiting(waiting) -> None:
    """``waiting`` (the scheduler's queue length) is a non-negative int or None."""
    if waiting is not None and (not is_int(waiting) or waiting < 0):
        raise ValueError(f"waiting must be a non-negative int or None, got {waiting!r}")


def check_positive(value, what: str) -> int:
    """An int >= 1, else ValueError naming ``what``."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------------- static controllers
class FixedWidthController:
    """Verify every step at one width; each request sends as many draft nodes as fit (``width - 1``)."""

    def __init__(self, width: int):
        self.width = check_positive(width, "width")
        self.max_width = self.width

    def start(self, rid) -> None:
        pass

    def finish(self, rid) -> None:
        pass

    def plan(self, rids, batch, waiting=None) -> Plan:
        lengths = np.minimum(np.diff(batch.offsets), self.width - 1)
        return Plan(self.width, lengths, float(len(rids)), 1.0, "fixed")

    def observe_tokens(self, rid, committed) -> None:
        pass

    def observe_step(self, batch: int, width: int, duration_ms: float) -> None:
        pass


class FixedBudgetController(FixedWidthController):
    """Send up to ``k`` draft nodes per request and verify all of them: the width is 1 + the longest draft sent
    in the batch."""

    def __init__(self, k: int):
        super().__init__(check_positive(k, "k") + 1)
        self.k = self.width - 1

    def plan(self, rids, batch, waiting=None) -> Plan:
        lengths = np.minimum(np.diff(batch.offsets), self.k)
        return Plan(1 + int(lengths.max(initial=0)), lengths, float(len(rids)), 1.0, "fixed")
