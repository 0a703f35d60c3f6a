"""What each decode step really costs the server, host time included.

The controller weighs a width by what a step at that width costs. A timer around the verify forward alone leaves
out what the server spends on the host between steps (drafting, layout, index preparation, the scheduler's own
work) whenever that time is not hidden behind the GPU, and n-gram drafting hides none of it: a step that drafts
must wait for the previous step's tokens, so the GPU idles while the host drafts. So a step's cost is measured as
the time between the GPU reaching the end of the previous step and reaching the end of this one: the idle gap
the host left before it, plus its own execution. A plain step launched while the GPU is still busy (nothing to
wait for) costs just its execution; a drafting step pays for its wait. Widths compare as the server sees them.

A period that spans anything other than two consecutive decode steps (a prefill in between) is dropped, and so
is the first period of each (width, batch size): the first step of a shape pays one-time costs (lazy
allocations, kernel builds, a first graph replay) that can be a hundred times a step's cost. One such sample
would set that width's estimate, and through it the estimates of the widths never measured, so high that the
controller never tries them again.
A step that runs several decode forwards back to back (a plain step of ``forwards`` forwards, see
`backoff.plain_forwards`) is recorded as what one of its forwards cost: its period divided by ``forwards``, the
scheduler's host work shared among them. Given ``record_plain``, every plain step after a plain step is also
reported there with its forwards (``record_plain(batch_size, forwards, seconds_per_forward)``), for the choice of
how many forwards plain steps run (`backoff.ForwardsChooser`), unless the step waited for the previous step's
tokens before it launched (a plan that wanted to draft, then drafted nothing on the exact tokens): that wait is
planning's, and it would make a lone forward look dearer than a chunk of them, over which it is shared.
Marks are CUDA events on the forward stream (read without blocking, once the GPU has passed them), or host
clock readings where there is no GPU.

A plain step right after a drafting step waits for that step's tokens before it can even plan, so it costs
more than a plain step after a plain one; recorded as a plain step's cost, that wait makes plain decoding look
dearer, and drafting cheaper, the more the controller drafts. Given ``record_wait``, such periods go there
instead (``record_wait(batch_size, seconds)``), for the caller to charge to starting a draft (see
`DraftPlanner.record_wait`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable


class StepTimer:
    """Turns a mark at the end of every decode step into ``record(width, batch_size, seconds)`` per step."""

    def __init__(self, record: Callable[[int, int, float], None], mark: Callable[[], Any],
                 passed: Callable[[Any], bool], seconds: Callable[[Any, Any], float], max_period_s: float = 10.0,
                 drop_first_of_each_shape: bool = True, record_wait: Callable[[int, float], None] | None = None,
                 record_plain: Callable[[int, int, float], None] | None = None):
        self._record = record
        self._record_wait = record_wait
        self._record_plain = record_plain
        self._last_width = 1  # the width of the step launched last
        self._mark = mark
        self._passed = passed
        self._seconds = seconds
        self._max_period_s = max_period_s
        self._queue: deque = deque()  # (width, batch_size, mark, follows_a_decode_step)
        self._last = None  # the newest mark the device has passed
        self._chained = False
        self._seen: set | None = set() if drop_first_of_each_shape else None  # shapes whose first period went
        self.recorded = 0
        self.dropped = 0

    @classmethod
    def for_device(cls, record, device_module=None, record_wait=None, record_plain=None) -> "StepTimer":
        """CUDA events when ``device_module`` (e.g. ``torch.cuda``) is given, else the host clock."""
        if device_module is None:
            return cls(record, time.perf_counter, lambda m: True, lambda a, b: b - a, record_wait=record_wait,
                       record_plain=record_plain)

        def mark():
            event = device_module.Event(enable_timing=True)
            event.record()
            return event

        return cls(record, mark, lambda e: e.query(), lambda a, b: a.elapsed_time(b) / 1000.0,
                   record_wait=record_wait, record_plain=record_plain)

    def step_launched(self, width: int, batch_size: int, forwards: int = 1, waited: bool = False) -> None:
        """Call after a decode step's work was launched (``forwards``: the decode forwards it ran back to back;
        ``waited``: it waited for the previous step's tokens before launching)."""
        self._queue.append((int(width), int(batch_size), self._mark(), self._chained, self._last_width > 1,
                            int(forwards), bool(waited)))
        self._chained = True
        self._last_width = int(width)
        self.harvest()

    def interrupt(self) -> None:
        """Something other than a decode step runs next (a prefill): the next period would not be a step's."""
        self._chained = False

    def harvest(self) -> None:
        """Record every step whose end the device has passed (never waits)."""
        while self._queue and self._passed(self._queue[0][2]):
            width, batch_size, mark, chained, after_draft, forwards, waited = self._queue.popleft()
            if chained and self._last is not None:
                period = self._seconds(self._last, mark)
                shape = (width, batch_size, forwards)
                if self._seen is not None and shape not in self._seen:
                    self._seen.add(shape)
                    self.dropped += 1
                elif 0.0 < period <= self._max_period_s:
                    if width == 1 and after_draft and self._record_wait is not None:
                        self._record_wait(batch_size, period)
                    else:
                        self._record(width, batch_size, period / forwards)
                        if width == 1 and not after_draft and not waited and self._record_plain is not None:
                            self._record_plain(batch_size, forwards, period / forwards)
                    self.recorded += 1
                else:
                    self.dropped += 1
            self._last = mark
