"""Host time of the SGLang scheduler's phases, for diagnosis (off unless NGRAMSPEC_SCHED_PROFILE=FILE is set).

Wraps the scheduler loop's phases with AROUND hooks (inclusive host seconds and calls per phase) and measures
the decode step period (host time between consecutive decode ``run_batch`` starts, under 1 s). It works for every
algorithm, plain decoding included (the plugin loads in every SGLang process), so the same phases can be compared
between plain decoding, NGRAM and NGRAM_ADAPTIVE in one run. TP rank 0's scheduler process rewrites FILE four
times a second while decode steps run, with running sums (readers difference two snapshots).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from functools import partial
from typing import Callable

_PHASES = {
    "ingest_requests": "sglang.srt.managers.scheduler.Scheduler.ingest_requests",
    "get_next_batch_to_run": "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
    "update_running_batch": "sglang.srt.managers.scheduler.Scheduler.update_running_batch",
    "prepare_for_decode": "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
    "run_batch": "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "worker_forward": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "war_barrier": "sglang.srt.managers.scheduler.Scheduler._apply_war_barrier",
    "batch_copy": "sglang.srt.managers.schedule_batch.ScheduleBatch.copy",
    "process_batch_result": "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
    "process_result_decode": ("sglang.srt.managers.scheduler_components.batch_result_processor."
                              "SchedulerBatchResultProcessor.process_batch_result_decode"),
    "launch_sample": "sglang.srt.managers.scheduler.Scheduler.launch_batch_sample_if_needed",
}


def write_json(path: str, obj) -> None:
    """``obj`` to ``path`` whole: written to a file of this thread's own beside it, then renamed over ``path``, so a
    reader, or another thread dumping the same file at once (the periodic dump and a final one), never leaves or
    sees a half-written file."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def dump_periodically(count: Callable[[], int], dump: Callable[[], None], name: str, period_s: float = 0.25) -> None:
    """A daemon thread that calls ``dump()`` every ``period_s`` seconds while ``count()`` changes (diagnostic
    files rewritten while steps run; a dict changed under the dump, or a write error, retries at the next tick; any
    other error is logged once and retried too: the thread outlives it)."""

    def loop():
        seen, logged = -1, False
        while True:
            time.sleep(period_s)
            n = count()
            if n != seen:
                try:
                    dump()
                    seen = n
                except (RuntimeError, OSError):
                    pass
                except Exception:
                    if not logged:
                        logging.getLogger(__name__).exception("NGRAM_ADAPTIVE: %s: a diagnostic dump failed", name)
                        logged = True

    threading.Thread(target=loop, name=name, daemon=True).start()


class _Sums:
    def __init__(self, path: str):
        self.path = path
        self.rows: dict[str, list] = {}
        self.decode_steps = 0
        self.decode_period_s = 0.0
        self.decode_periods = 0
        self._last_decode = None
        self._rank0 = None
        # NGRAMSPEC_SCHED_CPROFILE=FILE: cProfile of decode run_batch calls (steps FROM..FROM+N), dumped to FILE
        self._cprof_path = os.environ.get("NGRAMSPEC_SCHED_CPROFILE")
        self._cprof = None
        if self._cprof_path:
            import cProfile
            self._cprof = cProfile.Profile()
            self._cprof_from = int(os.environ.get("NGRAMSPEC_SCHED_CPROFILE_FROM", "300"))
            self._cprof_steps = int(os.environ.get("NGRAMSPEC_SCHED_CPROFILE_STEPS", "1000"))

    def around(self, name, original, *args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            row = self.rows.setdefault(name, [0, 0.0])
            row[0] += 1
            row[1] += time.perf_counter() - t

    def run_batch(self, original, scheduler, batch, *args, **kwargs):
        t = time.perf_counter()
        if self._cprof is not None and batch is not None and batch.forward_mode.is_decode() and (
                self._cprof_from <= self.decode_steps < self._cprof_from + self._cprof_steps):
            self._cprof.enable()
            try:
                return self._run_batch(t, original, scheduler, batch, *args, **kwargs)
            finally:
                self._cprof.disable()
                if self.decode_steps == self._cprof_from + self._cprof_steps:
                    self._cprof.dump_stats(self._cprof_path)
        return self._run_batch(t, original, scheduler, batch, *args, **kwargs)

    def _run_batch(self, t, original, scheduler, batch, *args, **kwargs):
        if batch is not None and batch.forward_mode.is_decode():
            if self._last_decode is not None and t - self._last_decode < 1.0:
                self.decode_period_s += t - self._last_decode
                self.decode_periods += 1
            self._last_decode = t
            self.decode_steps += 1
            if self._rank0 is None:
                self._rank0 = getattr(scheduler, "tp_rank", 0) == 0
                if self._rank0:
                    dump_periodically(lambda: self.decode_steps, self.dump, "ngramspec-sched-profile")
        else:
            self._last_decode = None
        return self.around("run_batch", original, scheduler, batch, *args, **kwargs)

    def dump(self) -> None:
        out = {"decode_steps": self.decode_steps, "decode_periods": self.decode_periods,
               "decode_period_s": self.decode_period_s,
               "phases": {k: {"calls": r[0], "seconds": r[1]} for k, r in self.rows.items()}}
        write_json(self.path, out)


def register_profile_hooks() -> bool:
    """Install the phase timers if NGRAMSPEC_SCHED_PROFILE is set; True if installed."""
    path = os.environ.get("NGRAMSPEC_SCHED_PROFILE")
    if not path:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    sums = _Sums(path)
    for name, target in _PHASES.items():
        hook = sums.run_batch if name == "run_batch" else partial(sums.around, name)
        HookRegistry.register(target, hook, HookType.AROUND)
    return True
