"""Every configuration of the server benchmark (`scripts/sglang_engine_bench.py`) is one the plugin accepts: its
`--speculative-adaptive-config` file resolves and builds its controller (a misspelt knob fails here, on the CPU, not
minutes into a GPU call)."""
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ngramspec_sglang.config import resolve_config
from ngramspec_sglang.drafting import make_controller

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_engine_bench.py"


@pytest.fixture(scope="module")
def configs():
    spec = importlib.util.spec_from_file_location("sglang_engine_bench_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.CONFIGS


def test_every_adaptive_config_resolves_and_builds_its_controller(configs, tmp_path):
    checked = 0
    for name, cfg in configs.items():
        if cfg.get("speculative_algorithm") != "NGRAM_ADAPTIVE":
            continue
        path = None
        if "adaptive_file" in cfg:
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(cfg["adaptive_file"]))
        args = SimpleNamespace(speculative_num_draft_tokens=cfg.get("speculative_num_draft_tokens"),
                               speculative_adaptive_config=str(path) if path else None,
                               speculative_ngram_max_bfs_breadth=cfg.get("speculative_ngram_max_bfs_breadth", 10))
        config = resolve_config(args)
        make_controller(config)
        for key, value in cfg.get("adaptive_file", {}).get("controller", {}).items():
            assert config.controller[key] == value, name
        checked += 1
    assert checked >= 10


def test_a_misspelt_controller_knob_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"controller": {"min_gian": 0.3}}))
    config = resolve_config(SimpleNamespace(speculative_num_draft_tokens=None, speculative_adaptive_config=str(path),
                                            speculative_ngram_max_bfs_breadth=10))
    with pytest.raises(ValueError, match="min_gian"):
        make_controller(config)
