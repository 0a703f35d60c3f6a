"""The opt-in profile's device clock (`ngramspec_sglang.diagnostics.HostProfile.add_device`), with fake CUDA events:
the idle gap before each decode step and its parts, read only once the device passed a step's end."""
import json
import sys
from pathlib import Path

from ngramspec_sglang.diagnostics import HostProfile


class FakeDevice:
    """`Event()` objects carry the device time they stand for; `now` is how far the device has got."""

    def __init__(self):
        self.now = 0.0
        self.at = 0.0  # the device time the next recorded event stands for
        outer = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = outer.at

            def query(self):
                return self.t <= outer.now

            def elapsed_time(self, other):  # milliseconds, as torch's
                return 1e3 * (other.t - self.t)

        self.Event = Event


def step(prof, dev, start, prepare, forward, after, width=4, batch=1):
    dev.at = start
    m0 = prof.mark()
    dev.at += prepare
    f0 = prof.mark()
    dev.at += forward
    f1 = prof.mark()
    dev.at += after
    prof.add_device(width, batch, (m0, f0, f1, prof.mark()))


def test_idle_gap_and_parts_per_width(tmp_path):
    dev = FakeDevice()
    prof = HostProfile(str(tmp_path / "p.json"))
    prof.device_marks(dev)
    step(prof, dev, 0.000, 0.001, 0.005, 0.001)           # ends at 7 ms: the first step, no gap measured
    step(prof, dev, 0.010, 0.001, 0.005, 0.001)           # 3 ms idle before it
    step(prof, dev, 0.017, 0.0, 0.004, 0.0, width=1)      # launched behind the previous step: no idle gap
    assert prof.device == {}                              # nothing passed yet: nothing read, nothing waited for
    dev.now = 5.0
    step(prof, dev, 1.000, 0.002, 0.006, 0.001)           # a long host pause before it (983 ms idle)
    row = prof.device["4/1"]
    assert row[0] == 3 and row[5] == 2
    assert abs(row[1] - (0.003 + 0.979)) < 1e-9           # idle: 10 - 7 ms, then 1000 - 21 ms
    assert abs(row[2] - 0.004) < 1e-9 and abs(row[3] - 0.016) < 1e-9 and abs(row[4] - 0.003) < 1e-9
    assert prof.device["1/1"][:2] == [1, 0.0]
    prof.interrupt()                                      # a prefill: the next gap is not a decode step's
    step(prof, dev, 2.0, 0.0, 0.005, 0.0, width=8)
    assert prof.device["8/1"][5] == 0 and prof.device["8/1"][1] == 0.0
    prof.dump()
    dumped = json.load(open(tmp_path / "p.json"))["_diag"]["device"]
    assert dumped["4/1"]["steps"] == 3 and dumped["4/1"]["idle_measured"] == 2


def test_off_without_a_device():
    prof = HostProfile("/nonexistent/p.json")
    assert prof.mark() is None
    prof.add_device(4, 1, (None, None, None, None))
    assert prof.device == {}


def test_draft_tokens_by_source_survive_interval_resets_and_reach_the_bench(tmp_path):
    """The profile's running totals by source: closed intervals folded in, the open one added on top; the engine
    bench turns two snapshots into tokens per request-step by source."""
    from ngramspec_sglang.drafting import IntervalStats

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        from sglang_engine_bench import diag_delta
    finally:
        sys.path.pop(0)
    prof = HostProfile(str(tmp_path / "p.json"))
    live = IntervalStats(verified_requests=4, drafted_tokens=20, drafted_recycled=6, observed_requests=4,
                         realized_accepted=9, accepted_recycled=2)
    prof.live_stats = lambda: live
    prof.dump()
    before = json.load(open(tmp_path / "p.json"))
    prof.fold(live)  # the decode log closed the interval ...
    live = IntervalStats(verified_requests=2, drafted_tokens=10, observed_requests=2, realized_accepted=5)
    assert prof.sources() == {"drafted_ngram": 14 + 10, "drafted_recycled": 6, "accepted_ngram": 7 + 5,
                              "accepted_recycled": 2, "verified_requests": 6, "observed_requests": 6}
    prof.dump()
    after = json.load(open(tmp_path / "p.json"))
    assert diag_delta(before, after)["sources"] == {
        "drafted_ngram_per_request": 5.0, "drafted_recycled_per_request": 0.0,
        "accepted_ngram_per_request": 2.5, "accepted_recycled_per_request": 0.0}


def test_sigusr1_prints_every_threads_stack_and_the_process_runs_on(tmp_path):
    """NGRAMSPEC_STACKS_ON_SIGUSR1=1 (the engine bench sets it): a scheduler that stops answering shows where it
    waits; without the variable SIGUSR1 keeps its default (the process ends)."""
    import os
    import subprocess
    import sys

    code = ("import os, signal, sys\n"
            "from ngramspec_sglang.diagnostics import stacks_on_sigusr1\n"
            "print(stacks_on_sigusr1(), flush=True)\n"
            "def marker_frame():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "marker_frame()\n"
            "print('ran on', flush=True)\n")
    for value, registered in (("1", True), (None, False)):
        env = {k: v for k, v in os.environ.items() if k != "NGRAMSPEC_STACKS_ON_SIGUSR1"}
        if value:
            env["NGRAMSPEC_STACKS_ON_SIGUSR1"] = value
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert proc.stdout.startswith(str(registered))
        if registered:
            assert "ran on" in proc.stdout and "marker_frame" in proc.stderr and proc.returncode == 0
        else:
            assert "ran on" not in proc.stdout and proc.returncode != 0


def test_the_memory_trace_names_the_site_that_grew(tmp_path):
    """NGRAMSPEC_MEM_TRACE: a first snapshot once warm, then one per interval, each with the process's RSS, the
    traced heap and the sites that grew since the first; a list kept growing in this test is named."""
    import tracemalloc

    from ngramspec_sglang.diagnostics import MemTrace

    now = [0.0]
    path = tmp_path / "mem.json"
    was_tracing = tracemalloc.is_tracing()
    trace = MemTrace(str(path), every_s=10.0, warm_s=5.0, clock=lambda: now[0])
    kept = []
    try:
        trace.tick()
        assert not path.exists()  # not warm yet
        now[0] = 5.0
        trace.tick()
        for _ in range(3):
            now[0] += 10.0
            kept.extend(bytearray(4096) for _ in range(256))  # 1 MB more per interval, from this line
            trace.tick()
            trace.tick()  # within the interval: nothing
    finally:
        if not was_tracing:
            tracemalloc.stop()
    out = json.loads(path.read_text())
    snaps = out["snapshots"]
    assert out["every_s"] == 10.0 and [s["t_s"] for s in snaps] == [5.0, 15.0, 25.0, 35.0]
    assert snaps[0]["grew"] == [] and all(s["rss_mb"] > 0 for s in snaps)
    # where the RSS lies: on Linux at least the anonymous pages and malloc's heap, which holds the list grown here
    assert all(s["native"]["anon"] > 0 and s["native"]["malloc_used"] > 0 for s in snaps)
    assert snaps[-1]["native"]["malloc_used"] - snaps[0]["native"]["malloc_used"] > 2.5
    assert snaps[-1]["traced_mb"] - snaps[0]["traced_mb"] > 2.5
    top = snaps[-1]["grew"][0]
    assert "test_host_profile.py:" in top["site"] and top["mb"] > 2.5 and top["count"] > 0


def test_native_memory_reads_torchs_pinned_counts(monkeypatch):
    """torch's pinned host memory (no GPU here: a stand-in for torch with its counters' names): blocks held, in use
    and their number; a torch that has not started CUDA is not asked."""
    import sys
    from types import SimpleNamespace

    from ngramspec_sglang.diagnostics import native_memory

    stats = {"allocated_bytes.current": 64 * 2**20, "active_bytes.current": 2**20, "allocations.current": 5}
    started = [True]
    fake = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: started[0],
                                                memory=SimpleNamespace(host_memory_stats=lambda: stats)))
    monkeypatch.setitem(sys.modules, "torch", fake)
    out = native_memory()
    assert (out["pinned"], out["pinned_active"], out["pinned_blocks"]) == (64.0, 1.0, 5)
    started[0] = False
    assert not {"pinned", "pinned_active", "pinned_blocks"} & set(native_memory())


def test_the_memory_trace_is_off_unless_asked(monkeypatch):
    from ngramspec_sglang.diagnostics import MemTrace

    monkeypatch.delenv("NGRAMSPEC_MEM_TRACE", raising=False)
    assert MemTrace.from_env(0) is None
    monkeypatch.setenv("NGRAMSPEC_MEM_TRACE", "/nonexistent/m.json")
    assert MemTrace.from_env(1) is None  # rank 0 only


def test_a_failing_memory_snapshot_turns_the_trace_off_and_raises_nothing(tmp_path, monkeypatch):
    import tracemalloc

    from ngramspec_sglang import diagnostics

    now = [0.0]
    was_tracing = tracemalloc.is_tracing()
    trace = diagnostics.MemTrace(str(tmp_path / "m.json"), every_s=1.0, warm_s=0.0, clock=lambda: now[0])
    try:
        def broken():
            raise MemoryError("no room for a snapshot")

        monkeypatch.setattr(diagnostics.tracemalloc, "take_snapshot", broken)
        trace.tick()
        assert trace.failed and "MemoryError" in trace.failed
        now[0] = 5.0
        trace.tick()  # off: not tried again
        assert not (tmp_path / "m.json").exists()
    finally:
        if not was_tracing:
            tracemalloc.stop()


def test_the_dump_thread_outlives_a_failing_dump(caplog):
    """A dump that raises something unexpected is logged once; the thread dumps on at the next ticks."""
    import threading

    from ngramspec_sglang.sched_profile import dump_periodically

    calls, steps, done = [], [0], threading.Event()

    def dump():
        calls.append(steps[0])
        if len(calls) <= 2:
            raise AttributeError("a view read a planner being replaced")
        if len(calls) >= 4:
            done.set()

    def count():
        steps[0] += 1  # every tick sees new steps
        return steps[0]

    with caplog.at_level("ERROR"):
        dump_periodically(count, dump, "test-dump", period_s=0.01)
        assert done.wait(10)
    failures = [r for r in caplog.records if "a diagnostic dump failed" in r.getMessage()]
    assert len(failures) == 1 and "test-dump" in failures[0].getMessage()
