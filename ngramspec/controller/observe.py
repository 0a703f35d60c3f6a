"""The adaptive controller's first phase, **observe**: what it learns from, reported after each step.

- the tokens the model committed for each request: every pending draft is shadow-evaluated against them (sent or
  not), which updates the acceptance calibration and the request's recent success (``calibration``'s kernels);
- the measured duration of a step of ``batch`` requests at ``width``: a sample for the cost model (``cost``),
  kept until the next step's kernel call takes it.

`Observing` is the controller's Python side of both (inside ``step`` the same kernels run in its one call).
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Hashable, Sequence

import numpy as np

from ngramspec._cache_api import I32
from ngramspec.cache import MAX_TOKEN, as_tokens
from ngramspec.controller.calibration import shadow_evaluate
from ngramspec.controller.cost import CostModel
from ngramspec.controller.protocol import _INT_TYPES


class Observing:
    """`AdaptiveController`'s observe phase: committed tokens into the calibration (``calibration``, the pending
    drafts ``_pend``), step durations into the cost model (``_costs``, through ``_obs``)."""

    def observe_tokens(self, rid: Hashable, committed: Sequence[int]) -> None:
        """The tokens the model committed for ``rid`` this step (accepted draft tokens + bonus)."""
        slots = self._slots([rid])
        toks = as_tokens(committed, "committed tokens")
        self._off_buf[1] = toks.size
        shadow_evaluate(slots, toks, self._off_buf[:2], self._pend, self.request_alpha, self.calibration,
                        self.prior_mean, self.prior_strength)

    def observe_batch(self, rids: Sequence[Hashable], committed: Sequence) -> None:
        """``observe_tokens`` for a whole batch (``committed[i]`` for ``rids[i]``) in one kernel call.
        Validates everything before changing anything."""
        slots = self._slots(rids)
        if len(committed) != len(slots):
            raise ValueError(f"{len(slots)} request ids but {len(committed)} token lists")
        toks, offs = self._flatten(committed, rids)
        self._observe_flat(slots, toks, offs)

    def _observe_flat(self, slots, toks, offs) -> None:
        shadow_evaluate(slots, toks, offs, self._pend, self.request_alpha, self.calibration, self.prior_mean,
                        self.prior_strength)

    def _flatten(self, committed: Sequence, rids, negatives_ok: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Token lists -> validated (flat int32 tokens, int64 offsets), the offsets in a reused buffer.
        ``negatives_ok``: int32 arrays are not checked for negative ids (the cache's append kernel checks them)."""
        B = len(committed)
        if B + 1 > self._off_buf.shape[0]:
            self._off_buf = np.zeros(max(B + 1, 2 * self._off_buf.shape[0]), np.int64)
        offs = self._off_buf[: B + 1]
        if negatives_ok and B and type(committed[0]) is np.ndarray:
            try:  # int32 arrays (e.g. slices of a trace): only their shapes are checked
                if all([t.dtype is I32 for t in committed]):
                    flat = np.concatenate(committed)  # (raises for 0-d or mixed 1-d and n-d arrays)
                    if type(flat) is np.ndarray and flat.ndim == 1:
                        offs[1:] = list(accumulate(map(len, committed)))
                        return flat, offs
            except (AttributeError, TypeError, ValueError):
                pass  # not arrays: checked below
        if all(type(t) is list for t in committed):  # the common case: lists of Python ints, checked in one pass
            flat = [x for t in committed for x in t]
            if set(map(type, flat)) <= _INT_TYPES and (not flat or (min(flat) >= 0 and max(flat) < MAX_TOKEN)):
                offs[1:] = list(accumulate([len(t) for t in committed]))
                return np.array(flat, np.int32), offs
        elif B and all(type(t) is np.ndarray and t.ndim == 1 and t.dtype.kind in "iu" for t in committed):
            flat = np.concatenate(committed)  # integer arrays (e.g. slices of a trace): checked in one pass
            if not flat.size or (int(flat.min()) >= 0 and int(flat.max()) < MAX_TOKEN):
                offs[1:] = list(accumulate([t.size for t in committed]))
                return flat.astype(np.int32, copy=False), offs
        arrays = [as_tokens(t, f"committed tokens of request {rid!r}") for rid, t in zip(rids, committed)]
        offs[1:] = list(accumulate([a.size for a in arrays]))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return flat, offs

    def observe_step(self, batch: int, width: int, duration_ms: float) -> None:
        """The measured duration of a step of ``batch`` requests verified at ``width`` (one of ``widths``).
        ValueError, and nothing changes, for a batch size < 1, an unknown width or a duration that is not a
        positive finite number. (The cost model takes it at the next ``step``, inside its kernel call, or
        when anything reads ``costs`` first: the same state either way.)"""
        costs = self._costs
        if self._obs is None and type(batch) is int and type(duration_ms) is float and 0 < batch < costs._prior_rows \
                and 0.0 < duration_ms < math.inf:  # the common case, checked in one line: kept for the next step
            wi = costs._wi.get(width) if type(width) is int else None
            if wi is not None and costs.state.nblist[wi] < costs.state.blist.shape[1]:
                self._obs = (batch, width, wi, duration_ms)
                return
        if self._obs is not None:
            self._flush_obs()
        costs.observe(batch, width, duration_ms)

    def _flush_obs(self) -> None:
        """Give the cost model the step duration `observe_step` kept."""
        batch, width, _, ms = self._obs
        self._obs = None
        self._costs.observe(batch, width, ms)

    @property
    def costs(self) -> CostModel:
        """The cost model c(B, n), up to date with every reported step duration."""
        if self._obs is not None:
            self._flush_obs()
        return self._costs
