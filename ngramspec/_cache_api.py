"""The internal API between the cache (`ngramspec.cache`) and the controllers (`ngramspec.controller`).

What the two share below the cache's public names; a controller takes nothing else from the cache's modules
(``cache``, ``_draft``, ``_shared``, ``_trie``) but their public API (``tests/test_structure.py`` checks it):

- calling a kernel: `Direct` (through the compiled entry point of its first call's argument types), `fixed` and
  `fix` (the one array type such a call takes), the dtypes `I32` and `I64`;
- the draft kernels a controller's step kernel runs on the cache's state: `append_own`, `propose_own`,
  `propose_batch`, and `S_EPOCH` (the index of the shared cache's epoch in its ring, which a proposal takes);
- an `NgramCache`'s state and helpers a controller's step reads or calls (attributes, not module names):
  ``_own_state``, ``_shared_state``, ``_hists``, ``_ring``, ``_out``, ``_slot_of``, ``_slots_gen``, and
  ``_slots``, ``_append``, ``_propose_slots``, ``_propose_buffers``, ``_uniform_budgets``, ``_batch_view``.
"""
from __future__ import annotations

import weakref

import numpy as np

from ngramspec._draft import append_own, propose_batch, propose_own
from ngramspec._shared import S_EPOCH

__all__ = ["I32", "I64", "Direct", "S_EPOCH", "append_own", "fix", "fixed", "propose_batch", "propose_own"]

I32, I64 = np.dtype(np.int32), np.dtype(np.int64)


def fixed(a, dtype: np.dtype) -> bool:
    """Whether ``a`` has the one numba type the `Direct` kernels take for an array argument: a 1-D,
    C-contiguous, aligned, writeable base ndarray of the native ``dtype``."""
    return type(a) is np.ndarray and a.dtype is dtype and a.ndim == 1 and a.flags.carray


def fix(a, dtype: np.dtype) -> np.ndarray:
    """``a`` itself when it is `fixed`, else a `fixed` copy."""
    return a if fixed(a, dtype) else np.array(a, dtype=dtype, order="C").reshape(-1)


class Direct:
    """A jitted kernel called through the compiled entry point of the argument types of its first call.

    numba's dispatcher works out every argument's type on every call to pick the compiled version: about 0.05 µs
    per array, 0.5 µs for the typed List of histories and 1-2 µs per named tuple of state arrays, 1-4 µs per call
    of the append and propose kernels. Calling the entry point skips that, and is only correct while every
    argument keeps its numba type: one `Direct` per cache and kernel, called with the cache's own state (arrays,
    their `OwnState` / `SharedState` bundles and the typed List, all fixed at construction), Python ints and bools
    of fixed meaning, and arrays that went through `fix`. The first call goes through the dispatcher (compiling
    or loading the kernel) and then puts the entry point in its place, ``owner.<attr>``, so that later calls go
    to it without even this object's frame; should numba's internals not offer it, the dispatcher goes there.
    It holds its owner weakly: an owner whose kernel was never called is freed when its last reference goes, without
    waiting for the cyclic garbage collector (a server's old cache after a flush: hundreds of MB)."""

    __slots__ = ("owner", "attr", "kernel")

    def __init__(self, owner, attr: str, kernel):
        self.owner, self.attr, self.kernel = weakref.ref(owner), attr, kernel

    def __call__(self, *args):
        out = self.kernel(*args)
        try:
            from numba.core.typing.typeof import Purpose, typeof

            sig = tuple(typeof(a, Purpose.argument) for a in args)
            entry = self.kernel.overloads[sig].entry_point
        except Exception:  # numba internals changed: keep the dispatcher
            entry = self.kernel
        owner = self.owner()
        if owner is not None:
            setattr(owner, self.attr, entry)
        return out
