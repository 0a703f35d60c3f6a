"""The worker's controller state file (`"state_file"`): when it is loaded and written, on CPU, no sglang."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from ngramspec.controller import AdaptiveController
from ngramspec_sglang.config import AdaptiveConfig, resolve_config
from ngramspec_sglang.drafting import DraftPlanner, FixedWidthController
from ngramspec_sglang.state import StateKeeper


def config_from(tmp_path, data):
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(data))
    return resolve_config(SimpleNamespace(speculative_adaptive_config=str(path)))


def test_state_file_keys_are_read_and_validated(tmp_path):
    cfg = config_from(tmp_path, {"widths": [1, 2, 4], "state_file": "/tmp/x.npz", "state_save_minutes": 2.5})
    assert (cfg.state_file, cfg.state_save_minutes) == ("/tmp/x.npz", 2.5)
    assert config_from(tmp_path, {"widths": [1, 2]}).state_save_minutes == 10
    for bad, message in (({"state_file": 3}, "state_file"), ({"state_file": ""}, "state_file"),
                         ({"state_file": "s.npz", "state_save_minutes": 0}, "state_save_minutes"),
                         ({"state_file": "s.npz", "state_save_minutes": "5"}, "state_save_minutes"),
                         ({"state_file": "s.npz", "fixed_width": 2}, "fixed_width")):
        with pytest.raises(ValueError, match=message):
            config_from(tmp_path, {"widths": [1, 2, 4], **bad})
    assert StateKeeper.from_config(AdaptiveConfig(widths=(1, 2)), 0) is None


def trained(widths=(1, 2, 4, 8)):
    ctl = AdaptiveController(widths)
    for w, ms in ((1, 10.0), (2, 12.0), (4, 13.0), (8, 15.0)):
        if w in ctl.widths:
            ctl.observe_step(1, w, ms)
    ctl.calibration.trials[:5] = 4.0
    ctl.calibration.succ[:5] = 3.0
    return ctl


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_rank_zero_writes_every_interval_and_every_rank_loads_the_same_state(tmp_path):
    path = str(tmp_path / "state.npz")
    cfg = AdaptiveConfig(widths=(1, 2, 4, 8), state_file=path, state_save_minutes=1)
    clock = Clock()
    writer = StateKeeper(cfg.state_file, 60 * cfg.state_save_minutes, writer=True, clock=clock)
    reader = StateKeeper.from_config(cfg, 1)
    assert reader.every_s == 60 and not reader.writer
    ctl = trained()
    assert not reader.save(ctl) and not (tmp_path / "state.npz").exists()  # other ranks never write
    assert not writer.maybe_save(ctl)  # not yet
    clock.t = 59.0
    assert not writer.maybe_save(ctl)
    clock.t = 60.0
    assert writer.maybe_save(ctl) and writer.saves == 1
    clock.t = 100.0
    assert not writer.maybe_save(ctl)  # the next one 60 s after the last
    clock.t = 121.0
    assert writer.maybe_save(ctl) and writer.saves == 2
    ranks = [DraftPlanner(cfg).controller for _ in range(2)]
    for keeper, c in zip((writer, reader), ranks):
        assert keeper.load(c)
    for a, b, c in zip(ranks[0].calibration, ranks[1].calibration, ctl.calibration):
        assert np.array_equal(a, c) and np.array_equal(b, c)
    assert np.array_equal(ranks[0].costs.row(1).costs, ctl.costs.row(1).costs)
    assert np.array_equal(ranks[1].costs.row(1).costs, ctl.costs.row(1).costs)


def test_missing_or_bad_files_start_cold_and_never_raise(tmp_path, caplog):
    path = tmp_path / "state.npz"
    keeper = StateKeeper(str(path), 600, writer=True)
    ctl = AdaptiveController((1, 2, 4, 8))
    assert not keeper.load(ctl)  # missing: cold
    trained((1, 2, 4)).save_state(path)  # other widths
    assert not keeper.load(ctl)
    assert "widths" in caplog.text
    path.write_bytes(b"garbage")
    assert not keeper.load(ctl)
    assert not ctl.calibration.trials.any() and ctl.costs.clock == 0  # still cold
    assert not keeper.load(FixedWidthController(4))  # nothing to load into
    bad_dir = StateKeeper(str(tmp_path / "no" / "such" / "dir.npz"), 600, writer=True)
    assert not bad_dir.save(trained())  # logged, not raised


def test_attach_loads_now_and_saves_at_exit(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr("ngramspec_sglang.state.atexit.register", registered.append)
    path = tmp_path / "state.npz"
    trained().save_state(path)
    holder = SimpleNamespace(controller=AdaptiveController((1, 2, 4, 8)))
    StateKeeper(str(path), 600, writer=False).attach(lambda: holder.controller)
    assert holder.controller.costs.clock == 4 and registered == []
    StateKeeper(str(path), 600, writer=True).attach(lambda: holder.controller)
    holder.controller.observe_step(1, 2, 11.0)
    path.unlink()
    registered[0]()  # what the interpreter runs at exit
    again = AdaptiveController((1, 2, 4, 8))
    again.load_state(path)
    assert again.costs.clock == 5
