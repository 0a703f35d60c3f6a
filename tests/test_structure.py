"""The package's layering: the core never imports the simulator; one home per concept."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("ngramspec", "integration", "bench", "scripts")
                 for p in (ROOT / folder).rglob("*.py"))
TREE = "ngramspec/layout.py"  # tree semantics: layouts, rows, masks back to parents, greedy acceptance


def _top_level(path: Path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    yield target.id


def _defined(name_test) -> list[str]:
    return sorted(f"{p.relative_to(ROOT)}:{name}" for p in SOURCES for name in _top_level(p) if name_test(name))


def test_default_widths_are_defined_once():
    assert _defined(lambda n: n == "DEFAULT_WIDTHS") == ["ngramspec/controller/protocol.py:DEFAULT_WIDTHS"]


def test_tree_semantics_live_in_one_module():
    names = {"tree_rows", "greedy_walk", "mask_parents", "accepted_path"}
    found = _defined(lambda n: n in names or n.startswith("accept") or n.endswith("parents_of"))
    assert found and all(f.startswith(TREE + ":") for f in found), found
