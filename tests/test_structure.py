"""The package's layering: the core never imports the simulator."""
from __future__ import annotations

import subprocess
import sys

import pytest

CORE = ["ngramspec", "ngramspec.cache", "ngramspec.controller", "ngramspec.layout"]


@pytest.mark.parametrize("module", CORE)
def test_core_modules_do_not_import_the_simulator(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m == 'ngramspec.sim' or m.startswith('ngramspec.sim.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"{module} imports {out.strip()}"


def test_adaptive_method_is_registered_from_the_methods_package():
    from ngramspec.sim.methods import METHODS, available_methods

    assert "ngramspec-adaptive" in available_methods()
    assert METHODS["ngramspec-adaptive"].__module__ == "ngramspec.sim.methods.adaptive"
