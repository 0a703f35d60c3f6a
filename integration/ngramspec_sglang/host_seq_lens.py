"""Whether the overlap relay must carry host sequence lengths: the worker says, the algorithm asks.

SGLang assumes any n-gram verify reads host sequence lengths (NGRAM sizes its full mask from them, each step) and
builds the overlap relay (`FutureMap`) to carry them. Ours takes them from the tokens it waits for anyway, so
with attention backends that do not need them the scheduler need not wait for the previous step's lengths, and
a plain decode step overlaps. The worker (`worker.py`) knows its backends; the algorithm (`algorithm.py`) builds
the relay. Both import this module, neither imports the other for it: the worker exists in the scheduler process
before SGLang builds the relay and registers its answer here.
"""
from __future__ import annotations

from typing import Callable

_backends_need_cpu_seq_lens: Callable[[], bool] | None = None


def set_cpu_seq_lens_need(need: Callable[[], bool] | None) -> None:
    """Register the callable that says whether the running attention backends read host sequence lengths
    (None: withdraw it; SGLang's own decision then stands)."""
    global _backends_need_cpu_seq_lens
    _backends_need_cpu_seq_lens = need


def cpu_seq_lens_need() -> bool | None:
    """Whether the attention backends read host sequence lengths; None when no worker has said."""
    need = _backends_need_cpu_seq_lens
    return None if need is None else bool(need())
