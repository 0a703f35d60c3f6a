"""Diagnostics of `NgramAdaptiveWorker`, all off by default: `HostProfile` (NGRAMSPEC_PROFILE=FILE, host
seconds per decode step by phase), `DraftLog` (NGRAMSPEC_DRAFT_LOG=PREFIX, a CRC32 per step of what each TP
rank verified), `MemTrace` (NGRAMSPEC_MEM_TRACE=FILE, where the scheduler's memory grows) and `stacks_on_sigusr1`
(NGRAMSPEC_STACKS_ON_SIGUSR1=1: every thread's stack on SIGUSR1)."""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import time
import tracemalloc
import zlib
from collections import deque

import numpy as np

from .sched_profile import dump_periodically, write_json

logger = logging.getLogger(__name__)


def stacks_on_sigusr1() -> bool:
    """With NGRAMSPEC_STACKS_ON_SIGUSR1=1, SIGUSR1 makes this process print every thread's Python stack to stderr
    and run on (`faulthandler`): where a scheduler that stopped answering waits. Returns whether it registered."""
    if os.environ.get("NGRAMSPEC_STACKS_ON_SIGUSR1") != "1" or not hasattr(signal, "SIGUSR1"):
        return False
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return True


class HostProfile:
    """Host seconds per decode step by phase (NGRAMSPEC_PROFILE=FILE): waiting for the previous step's tokens,
    drafting and width choice, then launching the forward (mask, indices, model, sampling), per kind of step
    (plain without waiting, plain after waiting, verify), with the controller's reasons, expected tokens, measured
    step durations and cost estimates. Rank 0 rewrites FILE with the running sums four times a second while steps
    run (readers difference two snapshots); for diagnosis, off by default."""

    def __init__(self, path: str):
        self.path = path
        self.steps = 0
        self.rows: dict[str, list[float]] = {}
        self.reasons: dict[str, int] = {}  # why each planned step got its width
        self.expected = [0, 0.0, 0.0]  # planned requests, expected committed tokens (all, drafting steps only)
        self.durations: dict[str, list[float]] = {}  # "width/batch" -> [samples, seconds, min, max]
        self.controller = None
        self.batches: set = set()
        self.forwards_summary = None  # () -> the "auto" plain-forwards choice per batch size, or None
        self.preplan_summary = None  # () -> `preplan` "auto"'s measured medians and decision, or None
        # verifies prepared before the wait (`preplan`): "used" (at the plan's own width), "fitted" (the plan laid out
        # at the prepared width), "dropped" (the plan ran otherwise), "unavailable" (nothing could be prepared)
        self.preplan: dict[str, int] = {}
        # the device's clock per step (CUDA events, `device_marks`): "width/batch" -> [steps, idle before the step,
        # its work before the forward call, the forward call, after it; steps whose idle gap was measured]
        self.device: dict[str, list] = {}
        self._device_module = None
        self._pending: deque = deque()
        self._prev_end = None  # the end mark of the last decode step (None after a prefill)
        # draft tokens sent and accepted by source since start: intervals already closed (`fold`) plus the open one
        self.source_totals: dict[str, int] = {}
        self.live_stats = None  # () -> the planner's open interval (`IntervalStats`), or None
        dump_periodically(lambda: self.steps, self.dump, "ngramspec-profile")

    @classmethod
    def from_env(cls, rank: int):
        path = os.environ.get("NGRAMSPEC_PROFILE")
        return cls(path) if path and rank == 0 else None

    def device_marks(self, device_module) -> None:
        """Also time each decode step on the device's clock (``device_module``: e.g. ``torch.cuda``): four CUDA
        events per step (`mark`), read without blocking once the device passed them."""
        self._device_module = device_module

    def mark(self):
        """A CUDA event recorded on the current stream now, or None when the device's clock is not timed."""
        if self._device_module is None:
            return None
        event = self._device_module.Event(enable_timing=True)
        event.record()
        return event

    def interrupt(self) -> None:
        """A prefill runs next: the gap before the next decode step is not a decode step's idle time."""
        self._prev_end = None

    def add_device(self, width: int, batch_size: int, marks: tuple) -> None:
        """One decode step's marks: (launch start, before the forward call, after it, step end). The device idles
        from the previous step's end to this step's launch start while the host prepares this step (waits for
        tokens, plans): the host's part of the critical path; the rest is the device's own work and whatever host
        launch gaps lie inside it."""
        if self._device_module is None or any(m is None for m in marks):
            return
        self._pending.append((f"{width}/{batch_size}", marks, self._prev_end))
        self._prev_end = marks[3]
        while self._pending and self._pending[0][1][3].query():
            key, (start, fwd0, fwd1, end), prev = self._pending.popleft()
            row = self.device.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0, 0])
            row[0] += 1
            row[2] += start.elapsed_time(fwd0) / 1e3
            row[3] += fwd0.elapsed_time(fwd1) / 1e3
            row[4] += fwd1.elapsed_time(end) / 1e3
            if prev is not None:
                row[1] += prev.elapsed_time(start) / 1e3
                row[5] += 1

    def fold(self, stats) -> None:
        """Add an interval's counts (`IntervalStats`) before the planner starts a new one or is replaced."""
        for key, value in stats.by_source().items():
            self.source_totals[key] = self.source_totals.get(key, 0) + value

    def sources(self) -> dict[str, int]:
        """Draft tokens sent and accepted, by source, since start (closed intervals and the open one)."""
        live = self.live_stats() if self.live_stats is not None else None
        out = dict(self.source_totals)
        for key, value in (live.by_source() if live is not None else {}).items():
            out[key] = out.get(key, 0) + value
        return out

    def count_preplan(self, outcome: str) -> None:
        self.preplan[outcome] = self.preplan.get(outcome, 0) + 1

    def add_duration(self, width: int, batch_size: int, seconds: float) -> None:
        row = self.durations.setdefault(f"{width}/{batch_size}", [0, 0.0, float("inf"), 0.0])
        row[0] += 1
        row[1] += seconds
        row[2] = min(row[2], seconds)
        row[3] = max(row[3], seconds)

    def add(self, width: int, batch_size: int, lagging: bool, wait_s: float, plan_s: float, launch_s: float,
            forward_s: float, graph: bool, plan=None, controller=None, forwards: int = 1, parts=None,
            verify_parts=None) -> None:
        """One step; ``parts``: seconds of plan_s spent in (prefetch, the request views: waiting for the previous
        step's tokens when the step needs them, the first planner call, preparing the verify before the wait:
        `preplan`); ``verify_parts``: of a verify's launch_s,
        the seconds before its forward call (mask, indices, cache locations), in its sampling and after it
        (accepted tokens, KV moves, the result)."""
        key = ("plain-overlapped" if lagging else "plain") if width == 1 else "verify"
        if plan is not None:
            self.reasons[plan.reason] = self.reasons.get(plan.reason, 0) + 1
            self.expected[0] += batch_size
            self.expected[1] += float(plan.expected_tokens)
            if width > 1:
                self.expected[2] += float(plan.expected_tokens)
            self.controller = controller
            self.batches.add(batch_size)
        row = self.rows.setdefault(key, [0, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        if parts is not None:
            row[9] += parts[0]
            row[10] += parts[1]
            row[11] += parts[2]
            if len(parts) > 3:
                row[15] += parts[3]
        if verify_parts is not None:
            row[12] += verify_parts[0]
            row[13] += verify_parts[1]
            row[14] += verify_parts[2]
        row[6] += forward_s
        row[7] += bool(graph)
        row[8] += forwards
        row[0] += 1
        row[1] += batch_size
        row[2] += wait_s
        row[3] += plan_s
        row[4] += launch_s
        row[5] += width
        self.steps += 1

    def dump(self) -> None:
        out = {k: {"steps": r[0], "requests": r[1], "width": r[5], "wait_s": r[2], "plan_s": r[3], "launch_s": r[4],
                   "forward_s": r[6], "graph_steps": r[7], "forwards": r[8], "prefetch_s": r[9], "views_s": r[10],
                   "planner_s": r[11], "verify_prepare_s": r[12], "verify_sample_s": r[13], "verify_after_s": r[14],
                   "preplan_s": r[15]}
               for k, r in self.rows.items()}
        costs = {}
        estimates = getattr(getattr(self.controller, "costs", None), "row", None)
        if estimates is not None:
            widths = self.controller.costs.widths
            seen = sorted(self.batches)
            for b in seen if len(seen) <= 8 else seen[:4] + seen[-4:]:  # the smallest and the largest batches
                row = estimates(b)
                costs[str(b)] = {str(w): [round(float(c), 4), bool(m)] for w, c, m in zip(widths, row[0], row[1])}
        out["_diag"] = {"reasons": self.reasons, "planned_requests": self.expected[0],
                        "expected_tokens": self.expected[1], "expected_tokens_drafting": self.expected[2],
                        "durations": self.durations, "cost_estimates_ms": costs,
                        "plain_forwards": self.forwards_summary() if self.forwards_summary is not None else None,
                        "preplan": self.preplan, "sources": self.sources(),
                        "preplan_rule": self.preplan_summary() if self.preplan_summary is not None else None,
                        # running sums in seconds (readers difference two snapshots)
                        "device": {k: {"steps": r[0], "idle_before_s": r[1], "idle_measured": r[5], "prepare_s": r[2],
                                       "forward_s": r[3], "after_s": r[4]} for k, r in self.device.items()}}
        write_json(self.path, out)


class DraftLog:
    """One line per decode step: width and a CRC32 of the verified tokens and tree mask
    (NGRAMSPEC_DRAFT_LOG=PREFIX writes PREFIX.rank<N> on every TP rank; identical files show the ranks drafted
    identical trees). For checks, off by default."""

    def __init__(self, path: str):
        self.file = open(path, "w", buffering=1)

    @classmethod
    def from_env(cls, rank: int):
        prefix = os.environ.get("NGRAMSPEC_DRAFT_LOG")
        return cls(f"{prefix}.rank{rank}") if prefix else None

    def write(self, plan) -> None:
        tokens = np.ascontiguousarray(plan.tokens, dtype=np.int64)
        mask = np.ascontiguousarray(plan.mask, dtype=np.bool_)
        crc = zlib.crc32(mask.tobytes(), zlib.crc32(tokens.tobytes()))
        self.file.write(f"{plan.width} {tokens.shape[0]} {crc:08x}\n")


class MemTrace:
    """Where the scheduler's memory grows (NGRAMSPEC_MEM_TRACE=FILE, rank 0; for diagnosis, off by default).

    `tracemalloc` records the Python allocations from the worker's start on (`frames` deep); the first snapshot is
    taken at the first decode step after ``warm_s`` seconds, then every ``every_s`` seconds
    (NGRAMSPEC_MEM_TRACE_SECONDS, default 30) a decode step takes another and rewrites FILE (JSON): per snapshot the
    time, the process's RSS and the traced Python heap, and the allocation sites that grew most since the first
    snapshot (file:line, MB, count).
    RSS growing while the traced heap stays flat points below Python (torch, numba, CUDA's host allocations); each
    snapshot also splits the RSS (`native_memory`: anonymous, file-backed and shared pages, malloc's heap in use and
    free, torch's pinned host memory) to say which. The trace keeps only the first snapshot's per-site totals, not
    the snapshot, and records one frame per allocation (the allocating line): its own memory (``tracing_mb``) stays
    that of the live allocations. A snapshot stalls the step that takes it (longer the more is traced), and tracing
    slows Python allocations: not for timed runs. A snapshot that fails turns the trace off (logged); the server
    runs on."""

    def __init__(self, path: str, every_s: float = 30.0, warm_s: float = 30.0, frames: int = 1, top: int = 25,
                 clock=time.monotonic):
        self.path, self.every_s, self.warm_s, self.top = path, float(every_s), float(warm_s), int(top)
        self._clock = clock
        self._t0 = clock()
        self._next = self._t0 + self.warm_s
        self._first = None
        self.rows: list[dict] = []
        self.failed: str | None = None
        if not tracemalloc.is_tracing():
            tracemalloc.start(int(frames))

    @classmethod
    def from_env(cls, rank: int):
        path = os.environ.get("NGRAMSPEC_MEM_TRACE")
        if not path or rank != 0:
            return None
        return cls(path, every_s=float(os.environ.get("NGRAMSPEC_MEM_TRACE_SECONDS", "30")))

    def tick(self) -> None:
        """Call once per decode step: a snapshot when one is due."""
        now = self._clock()
        if self.failed or now < self._next:
            return
        self._next = now + self.every_s
        try:
            self._snapshot(now)
        except Exception as e:  # a diagnostic never takes the server down
            self.failed = repr(e)
            logger.warning("NGRAMSPEC_MEM_TRACE: a snapshot failed (%s); off", self.failed)

    def _snapshot(self, now: float) -> None:
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        sites = {(st.traceback[0].filename, st.traceback[0].lineno): (st.size, st.count)
                 for st in snap.statistics("lineno")}
        del snap  # the per-site totals are all that is kept
        row = {"t_s": round(now - self._t0, 1), "rss_mb": round(rss_mb(), 1),
               "traced_mb": round(sum(size for size, _ in sites.values()) / 2**20, 2),
               "tracing_mb": round(tracemalloc.get_tracemalloc_memory() / 2**20, 2),  # the trace's own share
               "native": native_memory()}
        if self._first is None:
            self._first = sites
            row["grew"] = []
        else:
            first = self._first
            diffs = [(size - first.get(k, (0, 0))[0], count - first.get(k, (0, 0))[1], k)
                     for k, (size, count) in sites.items()]
            grew = sorted((d for d in diffs if d[0] > 0), key=lambda d: -d[0])[:self.top]
            row["grew"] = [{"site": f"{f}:{line}", "mb": round(size / 2**20, 3), "count": count}
                           for size, count, (f, line) in grew]
        self.rows.append(row)
        write_json(self.path, {"every_s": self.every_s, "snapshots": self.rows})


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc >= 2.33)."""
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def native_memory() -> dict:
    """Where this process's memory lies, in MB (a key is missing where its source is): resident pages by kind
    (/proc/self/smaps_rollup: ``anon``, ``file``, ``shmem``), glibc malloc's heap (``malloc_used``: in use, ``mmap``
    of it in blocks of their own; ``malloc_free``: held but free, fragmentation) and torch's cached pinned host
    memory (``pinned``: the blocks torch holds, in use or cached for reuse, which it does not give back;
    ``pinned_active``: those in use; ``pinned_blocks``: how many blocks; where torch keeps the counts). Pinned memory
    is resident as shared memory."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = {k: v for k, _, v in (line.partition(":") for line in f) if v.strip().endswith("kB")}
        for key, name in (("anon", "Anonymous"), ("file", "Pss_File"), ("shmem", "Pss_Shmem")):
            if name in fields:
                out[key] = round(int(fields[name].split()[0]) / 1024, 1)
    except (OSError, ValueError):
        pass
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
        out.update(malloc_used=round((m.uordblks + m.hblkhd) / 2**20, 1), mmap=round(m.hblkhd / 2**20, 1),
                   malloc_free=round(m.fordblks / 2**20, 1))
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        pass
    try:
        torch = sys.modules.get("torch")  # only where the process has it already
        stats = torch.cuda.memory.host_memory_stats() if torch is not None and torch.cuda.is_initialized() else {}
        for key, name in (("pinned", "allocated_bytes.current"), ("pinned_active", "active_bytes.current")):
            if name in stats:
                out[key] = round(stats[name] / 2**20, 1)
        if "allocations.current" in stats:  # how many blocks: a few large copies or many small ones
            out["pinned_blocks"] = int(stats["allocations.current"])
    except Exception:  # a torch without these counts
        pass
    return out


def rss_mb() -> float:
    """This process's resident set size in MB (NaN where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")
