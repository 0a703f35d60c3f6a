"""The package's layering: the core never imports the simulator; one home per concept."""
from __future__ import annotations

import ast
import subprocess
import sys
import types
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


# ------------------------------------------------------------------------------------------- import graph
PACKAGES = {"ngramspec": ROOT / "ngramspec", "ngramspec_sglang": ROOT / "integration" / "ngramspec_sglang"}


def _modules() -> dict[str, Path]:
    out = {}
    for base in PACKAGES.values():
        for p in base.rglob("*.py"):
            parts = list(p.relative_to(base.parent).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str]]:
    """(imported module, imported name or "") of every import statement of ``module``, those inside functions
    (lazy imports) included; ``from package import submodule`` counts as an import of the submodule."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            out += [(f"{target}.{a.name}", "") if f"{target}.{a.name}" in MODULES else (target, a.name)
                    for a in node.names]
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_every_module_and_finds_a_circle():
    assert {"ngramspec.cache", "ngramspec.controller.adaptive", "ngramspec_sglang.algorithm",
            "ngramspec_sglang.worker"} <= set(MODULES)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "ngramspec_sglang.worker" in _graph()["ngramspec_sglang.algorithm"]  # a lazy import counts


def test_no_import_circles():
    """No module imports, even lazily inside a function, one that imports it back (directly or through others):
    a lower layer does not know a higher one. (The cache once warmed up the controller; the SGLang algorithm and
    its worker once imported each other.)"""
    assert _cycles(_graph()) == []


def _reaches(module: str) -> set[str]:
    graph, seen, todo = _graph(), set(), [module]
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


@pytest.mark.parametrize("lower, higher", [
    ("ngramspec.cache", "ngramspec.controller"),  # the cache's warm-up is its own; `ngramspec.warmup` warms all
    ("ngramspec.cache", "ngramspec.warmup"),
    ("ngramspec._cache_api", "ngramspec.cache"),
    ("ngramspec.layout", "ngramspec.cache"),
    ("ngramspec.controller", "ngramspec.warmup"),
    ("ngramspec_sglang.worker", "ngramspec_sglang.algorithm"),  # `host_seq_lens` carries the worker's answer
    ("ngramspec_sglang.host_seq_lens", "ngramspec_sglang.worker"),
    ("ngramspec_sglang.worker_startup", "ngramspec_sglang.worker"),  # the worker's phases do not know its class
    ("ngramspec_sglang.worker_forward", "ngramspec_sglang.worker"),
    ("ngramspec_sglang.diagnostics", "ngramspec_sglang.worker"),
])
def test_lower_layers_do_not_know_higher_ones(lower, higher):
    """Statically (lazy imports included) and at run time: ``lower`` does not import ``higher``."""
    reached = {m for m in _reaches(lower) if m == higher or m.startswith(higher + ".")}
    assert not reached, f"{lower} imports {sorted(reached)}"
    if lower.startswith("ngramspec.") and higher not in _reaches("ngramspec"):  # (`import ngramspec` loads those)
        code = f"import sys, {lower}; print(sorted(m for m in sys.modules if m.startswith({higher + '.'!r})" \
               f" or m == {higher!r}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "[]", f"importing {lower} loads {out.strip()}"


CACHE_SIDE = ("ngramspec.cache", "ngramspec._cache_api", "ngramspec._draft", "ngramspec._shared", "ngramspec._trie")


def test_the_controller_touches_the_cache_only_through_named_apis():
    """The controllers take from the cache's modules only public names of ``ngramspec.cache`` and of
    ``ngramspec._cache_api`` (the internal API the cache and the controllers share), nothing from ``_draft``,
    ``_shared`` or ``_trie`` directly and no private (``_``) name."""
    bad = [f"{m}: {t}.{name or '*'}" for m in MODULES if m.startswith("ngramspec.controller")
           for t, name in _imports(m) if t in CACHE_SIDE
           and (t not in ("ngramspec.cache", "ngramspec._cache_api") or not name or name.startswith("_"))]
    assert bad == []


def test_the_internal_api_names_what_it_holds():
    from ngramspec import _cache_api

    public = {name for name, v in vars(_cache_api).items() if not name.startswith("_") and name != "annotations"
              and not isinstance(v, types.ModuleType)}
    assert sorted(_cache_api.__all__) == sorted(public)
