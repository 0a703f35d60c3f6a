"""Make `ngramspec_sglang` importable from a plain checkout (it ships from integration/ when installed), and skip
tests marked `sglang_server` where sglang's server modules cannot import for want of a GPU-only package that the
cpu flavour of the test environment leaves out (scripts/setup_env.sh). Any other import failure is not skipped."""
import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("ngramspec_sglang") is None:
    sys.path.insert(0, str(ROOT / "integration"))


def left_out_in_cpu_flavour() -> set:
    """Top-level modules of the packages scripts/sglang_cpu_requirements.py leaves out (its GPU_ONLY)."""
    spec = importlib.util.spec_from_file_location("sglang_cpu_requirements",
                                                  ROOT / "scripts" / "sglang_cpu_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.GPU_ONLY.values())


@functools.cache
def missing_gpu_only_module() -> str | None:
    """The left-out module that stops `import sglang.srt.configs` here, or None when it imports (or fails otherwise)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    proc = subprocess.run([sys.executable, "-c", "import sglang.srt.configs"], capture_output=True, text=True)
    found = re.search(r"No module named '([\w.]+)'", proc.stderr) if proc.returncode else None
    if found and found.group(1).split(".")[0] in left_out_in_cpu_flavour():
        return found.group(1)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("sglang_server") and (module := missing_gpu_only_module()):
            item.add_marker(pytest.mark.skip(
                reason=f"sglang's server modules import {module}, left out of this cpu-flavour environment "
                       "(no CPU build of it for the CPU torch here; scripts/setup_env.sh)"))
