"""The plugin's step cost measure (`ngramspec_sglang.timing.StepTimer`), with fake device marks: no GPU needed."""
import json
from itertools import accumulate
from types import SimpleNamespace

import pytest

from ngramspec_sglang.config import AdaptiveConfig, resolve_config
from ngramspec_sglang.timing import StepTimer


class FakeDevice:
    """Marks are (time the device reaches them); `now` is how far the device has got."""

    def __init__(self):
        self.now = 0.0
        self.queue_end = 0.0  # when the work launched so far ends

    def launch(self, at: float, work: float) -> float:
        """The host launches `work` seconds of work at host time `at`; returns when the device finishes it."""
        self.queue_end = max(self.queue_end, at) + work
        return self.queue_end


def make(records, drop_first=False):
    dev = FakeDevice()
    pending = []

    def mark():
        pending.append(dev.queue_end)
        return dev.queue_end

    timer = StepTimer(lambda w, b, s: records.append((w, b, round(s, 6))), mark, lambda m: m <= dev.now,
                      lambda a, b: b - a, drop_first_of_each_shape=drop_first)
    return dev, timer


def test_a_step_costs_its_execution_plus_the_idle_gap_before_it():
    records = []
    dev, timer = make(records)
    # plain steps launched while the device is busy: each costs its execution (1.0)
    for i in range(3):
        dev.launch(at=0.1 * i, work=1.0)
        timer.step_launched(1, 4)
    # a drafting step: the host waits for the device (t = 3.0), plans 0.5 s, then launches 1.2 s of work
    dev.now = 3.0
    timer.harvest()
    dev.launch(at=3.5, work=1.2)
    timer.step_launched(8, 4)
    dev.now = 10.0
    timer.harvest()
    # the first step has no predecessor; the verify pays its 0.5 s host gap
    assert records == [(1, 4, 1.0), (1, 4, 1.0), (8, 4, 1.7)]
    assert timer.recorded == 3


def test_harvest_never_waits_and_a_prefill_breaks_the_chain():
    records = []
    dev, timer = make(records)
    dev.launch(at=0.0, work=1.0)
    timer.step_launched(1, 2)
    dev.launch(at=0.0, work=1.0)
    timer.step_launched(2, 2)
    assert records == []  # the device has not reached either mark: nothing recorded, nothing blocked
    timer.interrupt()  # a prefill runs here
    dev.launch(at=0.0, work=5.0)  # (the prefill's work, unmarked)
    dev.launch(at=0.0, work=1.0)
    timer.step_launched(1, 3)
    dev.launch(at=0.0, work=1.0)
    timer.step_launched(1, 3)
    dev.now = 100.0
    timer.harvest()
    # step 2 follows step 1; the step after the prefill is dropped; the last one follows a decode step
    assert records == [(2, 2, 1.0), (1, 3, 1.0)]


@pytest.mark.parametrize("period", [0.0, 50.0])
def test_implausible_periods_are_dropped_not_recorded(period):
    records = []
    marks = iter([0.0, period])
    timer = StepTimer(lambda *r: records.append(r), lambda: next(marks), lambda m: True, lambda a, b: b - a,
                      max_period_s=10.0, drop_first_of_each_shape=False)
    timer.step_launched(1, 1)
    timer.step_launched(1, 1)
    assert records == [] and timer.dropped == 1


def test_host_clock_timer_records_launch_to_launch_periods():
    records = []
    timer = StepTimer.for_device(lambda *r: records.append(r))
    timer.step_launched(1, 1)
    timer.step_launched(2, 1)  # the first period of width 2 at batch 1: dropped
    timer.step_launched(2, 1)
    assert len(records) == 1 and records[0][:2] == (2, 1) and records[0][2] > 0


def test_the_first_period_of_each_shape_is_dropped():
    """Seen on the H200 (Llama-8B shape): the first width-16 verify took 316 ms, the next 11 ms. Recorded, the
    first set the estimate of every width but 1 near 300-400 ms and the controller never drafted again."""
    records = []
    dev, timer = make(records, drop_first=True)
    for width, work in [(1, 0.005), (1, 0.005), (16, 0.316), (16, 0.011), (1, 0.005), (16, 0.011), (8, 0.2),
                        (8, 0.009)]:
        dev.launch(at=0.0, work=work)
        timer.step_launched(width, 4)
    dev.now = 100.0
    timer.harvest()
    # the very first step has no predecessor; then the first period of each (width, batch) goes
    assert records == [(16, 4, 0.011), (1, 4, 0.005), (16, 4, 0.011), (8, 4, 0.009)]
    assert timer.dropped == 3 and timer.recorded == 4


def test_waits_after_drafting_steps_go_to_record_wait_when_given():
    """Plain steps after plain steps take 2 (overlapped); a drafting step 3.5; a plain step right after a drafting
    step waits for its tokens and takes 5. With ``record_wait`` those 5s go there, not to width 1."""
    steps = [(1, 2.0), (1, 2.0), (8, 3.5), (1, 5.0), (1, 2.0), (8, 3.5), (16, 3.6), (1, 5.0), (1, 2.0)]
    out = {}
    for split in (False, True):
        records, waits, clock = [], [], iter([0.0, *accumulate(p for _, p in steps)])
        timer = StepTimer(lambda w, b, s: records.append((w, b, round(s, 6))), lambda: next(clock), lambda m: True,
                          lambda a, b: b - a, drop_first_of_each_shape=False,
                          record_wait=(lambda b, s: waits.append((b, round(s, 6)))) if split else None)
        timer.step_launched(1, 4)  # the step before the first period
        for width, _ in steps:
            timer.step_launched(width, 4)
        out[split] = records, waits
    assert out[False] == ([(w, 4, p) for w, p in steps], [])
    assert out[True] == ([(1, 4, 2.0), (1, 4, 2.0), (8, 4, 3.5), (1, 4, 2.0), (8, 4, 3.5), (16, 4, 3.6),
                          (1, 4, 2.0)], [(4, 5.0), (4, 5.0)])


def test_a_step_of_several_forwards_records_what_one_forward_cost():
    """A plain step of 4 forwards back to back took 4.4 (4 x 1.0 of forwards, 0.4 of scheduler work paid once):
    one forward then costs 1.1, and that is the width-1 cost the controller weighs drafting against."""
    records = []
    dev, timer = make(records, drop_first=True)
    for forwards, work in [(1, 1.4), (4, 4.4), (4, 4.4), (1, 1.4), (4, 4.4)]:
        dev.launch(at=0.0, work=work)
        timer.step_launched(1, 2, forwards)
    dev.now = 100.0
    timer.harvest()
    # the first step of each (width, batch, forwards) is dropped, as a new shape's
    assert records == [(1, 2, 1.1), (1, 2, 1.1)]
    assert timer.dropped == 2


def test_the_server_knob_is_read_and_validated(tmp_path):
    def config_from(data):
        path = tmp_path / "adaptive.json"
        path.write_text(json.dumps({"widths": [1, 2], **data}))
        return resolve_config(SimpleNamespace(speculative_adaptive_config=str(path)))

    assert config_from({}).charge_waits_to_drafts is True  # waits after a draft are charged to drafting
    assert config_from({"charge_waits_to_drafts": False}).charge_waits_to_drafts is False
    with pytest.raises(ValueError, match="charge_waits_to_drafts"):
        config_from({"charge_waits_to_drafts": "yes"})
    assert config_from({}).prefetch is False and config_from({"prefetch": True}).prefetch is True
    with pytest.raises(ValueError, match="prefetch"):
        config_from({"prefetch": 1})
    assert config_from({}).preplan == "auto" and config_from({"preplan": False}).preplan is False
    with pytest.raises(ValueError, match="preplan"):
        config_from({"preplan": "on"})


def test_the_plain_forwards_knob_is_read_and_validated(tmp_path):
    def config_from(data):
        path = tmp_path / "adaptive.json"
        path.write_text(json.dumps({"widths": [1, 2, 8], **data}))
        return resolve_config(SimpleNamespace(speculative_adaptive_config=str(path)))

    assert config_from({}).plain_forwards == 4 and config_from({}).plain_forwards_auto  # "auto": up to 4
    assert config_from({"plain_forwards": "auto"}).plain_forwards_auto
    assert not config_from({"plain_forwards": 4}).plain_forwards_auto  # an int: always that many
    assert config_from({}).plain_forwards_max_batch == 48
    assert config_from({"plain_forwards_max_batch": 16}).plain_forwards_max_batch == 16
    for bad in (0, 1.5, None, "2"):
        with pytest.raises(ValueError, match="plain_forwards_max_batch"):
            config_from({"plain_forwards_max_batch": bad})
    assert config_from({"plain_forwards": 1}).plain_forwards == 1
    assert config_from({"plain_forwards": 8}).plain_forwards == 8
    assert config_from({"widths": [1, 2]}).plain_forwards == 2  # the default, at most the largest width
    for bad in (0, 9, 2.0, True, "4"):  # the KV reserved per request per step holds the largest width
        with pytest.raises(ValueError, match="plain_forwards"):
            config_from({"plain_forwards": bad})


def test_plain_steps_after_plain_steps_reach_record_plain_with_their_forwards():
    plain, records = [], []
    clock = iter(float(t) for t in range(100))
    timer = StepTimer(lambda *r: records.append(r), lambda: next(clock), lambda m: True, lambda a, b: b - a,
                      drop_first_of_each_shape=False, record_wait=lambda *r: None,
                      record_plain=lambda *r: plain.append(r))
    for width, forwards in [(1, 1), (1, 4), (1, 4), (8, 1), (1, 1), (1, 1)]:
        timer.step_launched(width, 1, forwards)
    # periods: 1 time unit each; the first step has no period, the plain step after the verify is a wait
    assert plain == [(1, 4, 0.25), (1, 4, 0.25), (1, 1, 1.0)]
    assert (8, 1, 1.0) in records


def test_a_plain_step_that_waited_for_the_previous_tokens_is_no_sample_of_plain_forwards():
    """A plan that wanted to draft waited for the exact tokens and then drafted nothing: the step's period holds
    that wait. It is still the controller's cost sample, but not a sample of one forward against a chunk."""
    plain, records = [], []
    clock = iter([0.0, 1.0, 3.5, 4.5, 5.5])
    timer = StepTimer(lambda *r: records.append(r), lambda: next(clock), lambda m: True, lambda a, b: b - a,
                      drop_first_of_each_shape=False, record_wait=lambda *r: None,
                      record_plain=lambda *r: plain.append(r))
    timer.step_launched(1, 2)
    timer.step_launched(1, 2)  # period 1.0
    timer.step_launched(1, 2, waited=True)  # period 2.5: the wait included
    timer.step_launched(1, 2, 4, waited=True)  # a chunk after a wait: no sample either
    timer.step_launched(1, 2)
    assert plain == [(2, 1, 1.0), (2, 1, 1.0)]
    assert records == [(1, 2, 1.0), (1, 2, 2.5), (1, 2, 0.25), (1, 2, 1.0)]


def test_planner_shares_plain_samples_and_the_auto_choice_is_the_same_on_every_rank(tmp_path):
    from ngramspec_sglang.drafting import DraftPlanner, RequestView, WidthCycleController

    def config(**kw):
        return AdaptiveConfig(widths=(1, 2, 4), max_depth=8, capacity=1 << 16, tp_sync_interval=1, **kw)

    shared = []
    rank0 = DraftPlanner(config(), broadcast=lambda obj: shared.append(list(obj)) or obj)
    rank1 = DraftPlanner(config(), is_timing_rank=False, broadcast=lambda obj: shared[-1])
    assert rank0.forwards is not None and rank0.forwards_limit(1) == 4 and rank0.forwards_limit(2) == 4
    assert rank0.forwards_limit(49) == 1  # above plain_forwards_max_batch
    views = [RequestView("r", [1, 2, 3], [])]
    for step in range(12):  # chunks cost 3 ms a forward, single forwards 2 ms
        f = rank0.forwards_limit(1)
        assert rank1.forwards_limit(1) == f
        rank0.plain_stepped(1, f)
        rank1.plain_stepped(1, f)
        rank0.record_plain(1, f, (3.0 if f > 1 else 2.0) / 1e3)
        rank1.record_plain(1, f, 99.0)  # not the timing rank: never used
        views = [RequestView("r", [1, 2, 3], list(range(step + 1)))]
        rank0.plan(views)
        rank1.plan(views)
    assert rank0.forwards.summary() == rank1.forwards.summary()
    assert rank0.forwards_limit(1) == rank1.forwards_limit(1) == 1
    fixed = DraftPlanner(config(plain_forwards=2))
    assert fixed.forwards is None and fixed.forwards_limit(1) == fixed.forwards_limit(48) == 2
    assert fixed.forwards_limit(49) == 1
    # the width sweep: widths in turn, drafts cut to fit
    sweep = DraftPlanner(config(width_cycle=(2, 4, 1)))
    assert isinstance(sweep.controller, WidthCycleController)
    text = [7, 8, 9] * 6
    widths = [sweep.plan([RequestView("s", text, text[: k])]).width for k in range(1, 7)]
    assert widths == [2, 4, 1, 2, 4, 1]
    for bad in ({"width_cycle": []}, {"width_cycle": [3]}, {"width_cycle": [2], "fixed_width": 2}):
        with pytest.raises(ValueError, match="width_cycle"):
            config(**{k: tuple(v) if isinstance(v, list) else v for k, v in bad.items()})
