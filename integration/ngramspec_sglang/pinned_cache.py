"""`PinnedCacheCap`: keeps the scheduler's cache of pinned host memory under a cap (`pinned_cache_mb`).

torch keeps every pinned host block it ever allocated (sizes rounded up to a power of two) and hands it out again
for a request of the same size class; it gives none back. A verify step's host buffers scale with batch x width
(for example SGLang's grammar bitmask, one 6 KB row per verified token of the whole batch), so a server that
drafts at many widths and batch sizes collects blocks of many size classes: in a 10-minute soak the scheduler's
pinned cache grew from 14 to 174 MB, resident as shared memory, and stayed there. Plain decoding's buffers scale
with the batch alone.

Every `every` decode steps the cap reads torch's host allocator counts; where the blocks held but not in use exceed
the cap, it returns them (`torch._C._host_emptyCache`; freeing pinned memory may wait for the work queued on the
device, so a trim can cost one step's wait). Blocks in use are never touched. A cache flush returns them all.

What is in use is not read from torch's own count alone: in a GPU soak (torch 2.11) that count grew without bound
(759 MB in use against 172 MB held; torch's `free()` left it up for blocks freed without pending events, fixed upstream
in pytorch/pytorch#171662), so a cap trusting it saw nothing cached and never trimmed. The cap takes the smaller of
torch's count and what the last trim left held (a trim returns every unused block, so what stays was in use then;
before any trim, nothing is taken as in use).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

logger = logging.getLogger(__name__)
MB = 2**20


class PinnedCacheCap:
    def __init__(self, limit_mb: float, stats: Callable[[], dict], empty: Callable[[], None], every: int = 256):
        self.limit_bytes = float(limit_mb) * MB
        self.every = int(every)
        self._stats = stats
        self._empty = empty
        self._steps = 0
        self.trims = 0
        self.returned_bytes = 0
        self._kept = 0  # bytes held right after the last trim: in use then

    @classmethod
    def for_torch(cls, limit_mb: Optional[float], every: int = 256) -> Optional["PinnedCacheCap"]:
        """The cap on this process's torch, or None where there is no cap, no CUDA, or a torch without the counts."""
        if limit_mb is None:
            return None
        import torch

        empty = getattr(torch._C, "_host_emptyCache", None)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if not torch.cuda.is_available():
            return None
        if empty is None or stats is None:
            logger.info("NGRAM_ADAPTIVE: this torch (%s) cannot return cached pinned host memory: no cap",
                        torch.__version__)
            return None
        logger.info("NGRAM_ADAPTIVE: cached pinned host memory capped at %.0f MB", float(limit_mb))
        return cls(limit_mb, stats, empty, every)

    def counts(self) -> dict[str, float]:
        """The `ngramspec:pinned_host_*` gauges: MB torch holds (in use or cached), MB in use, trims so far."""
        s = self._stats()
        return {"allocated_mb": int(s.get("allocated_bytes.current", 0)) / MB,
                "active_mb": int(s.get("active_bytes.current", 0)) / MB, "trims": float(self.trims)}

    def cached_bytes(self) -> int:
        """Pinned bytes torch holds but nobody uses, at most (0 where the counts are missing): what it holds less the
        smaller of its in-use count and what the last trim left."""
        return self._unused(self._stats())

    def _unused(self, s: dict) -> int:
        in_use = min(int(s.get("active_bytes.current", 0)), self._kept)
        return max(0, int(s.get("allocated_bytes.current", 0)) - in_use)

    def step(self) -> bool:
        """Count a decode step; every `every` steps, trim if over the cap. True if it trimmed."""
        self._steps += 1
        if self._steps % self.every:
            return False
        return self.trim()

    def trim(self, force: bool = False) -> bool:
        """Return the unused blocks if they exceed the cap (any at all with `force`, e.g. at a cache flush)."""
        s = self._stats()
        cached = self._unused(s)
        if cached <= 0 or (not force and cached <= self.limit_bytes):
            return False
        held = int(s.get("allocated_bytes.current", 0))
        self._empty()
        self._kept = int(self._stats().get("allocated_bytes.current", 0))
        self.trims += 1
        self.returned_bytes += max(0, held - self._kept)
        if self.trims == 1 or self.trims % 20 == 0:
            logger.info("NGRAM_ADAPTIVE: returned cached pinned host memory to the driver (%d times, %.1f MB in all; "
                        "cap %.0f MB)", self.trims, self.returned_bytes / MB, self.limit_bytes / MB)
        return True
