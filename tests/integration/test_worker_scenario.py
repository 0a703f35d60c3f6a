"""NgramAdaptiveWorker's own decode-step code on CPU around a scripted model (`worker_scenario.py`, in a subprocess:
it stubs a CUDA-only package to import the worker). Lossless whatever the path, and the verify prepared before the
wait (`preplan`) reads the drafts, positions and mask written after it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_server]  # the worker imports sglang's server modules
SCENARIO = Path(__file__).with_name("worker_scenario.py")
CONFIGS = {
    "defaults": {"widths": [1, 2, 4, 8, 16]},
    "preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
    "preplan_chain": {"widths": [1, 2, 4, 8, 16], "preplan": True, "tree": False},
    "fixed16": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16},
    "fixed16_preplan": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True},
}


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, str(SCENARIO), json.dumps(list(CONFIGS.values()))], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(CONFIGS, json.loads(proc.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_output_equals_the_models_greedy_tokens(results, name):
    r = results[name]
    assert r["outputs_equal_truth"] and not r["preplan_failed"]
    assert r["verifies"] > 0  # copy-heavy requests: the worker drafted


@pytest.mark.parametrize("name", ["preplan", "preplan_chain", "fixed16_preplan"])
def test_prepared_verifies_run_and_read_what_was_written_after_the_wait(results, name):
    r = results[name]
    used = r["preplan"].get("used", 0) + r["preplan"].get("fitted", 0)
    assert used > 0 and r["prepared_verifies"] == used
    assert r["loads"] == used + r["preplan"].get("dropped", 0)  # every prepared batch was loaded once
    assert len(r["mask_checks"]) == used and all(r["mask_checks"])


def test_at_a_fixed_width_every_verify_is_prepared(results):
    r, off = results["fixed16_preplan"], results["fixed16"]
    assert r["prepared_verifies"] == r["verifies"] == off["verifies"]
    assert off["prepared_verifies"] == 0 and off["loads"] == 0
