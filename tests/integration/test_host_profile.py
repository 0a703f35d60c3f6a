"""The opt-in profile's device clock (`ngramspec_sglang.diagnostics.HostProfile.add_device`), with fake CUDA events:
the idle gap before each decode step and its parts, read only once the device passed a step's end."""
import json

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
