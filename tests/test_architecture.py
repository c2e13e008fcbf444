"""The package's layering: no module-level import circles, and the torch-free layers import no torch.

The import graph is read from the sources with ``ast`` (nothing is imported to build it): one node per
module of ``tvm_mamba`` plus the repository's ``schedules/`` folder as ``tvm_mamba.schedules`` (what the
``tvm_mamba/schedules`` link makes it; the walk does not follow links). An edge is an import
statement, relative imports resolved against the importing module's package; ``from pkg import name`` points
at ``pkg.name`` when that is a module, else at ``pkg``.

Imports inside functions count too. A function-level import is lazy (it runs when called, so it cannot
deadlock an import, and keeps a heavy dependency such as torch off the import path); that is why it is the
usual way to hide a circle, and a hidden circle is still two modules that cannot be understood, tested or
moved apart. Lazy imports of modules outside the package (torch, safetensors, ...) are not edges here.
Not seen: imports by computed name (``importlib.import_module(f"...{op}")``, dispatch's discovery by op).
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tvm_mamba"
# (module-name prefix, folder): the schedules folder sits beside the package, linked into it
FOLDERS = ((PACKAGE, ROOT / PACKAGE), (f"{PACKAGE}.schedules", ROOT / "schedules"))


def module_files() -> dict[str, pathlib.Path]:
    """{dotted module name: file} for every .py of the package (a package is its ``__init__.py``)."""
    out = {}
    for prefix, folder in FOLDERS:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def _imports(tree: ast.Module):
    """Every import statement of a module, at module level or inside functions."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _resolve(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (its ``module`` part, relative dots resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base if is_package else base[:-1]  # a package's __init__ resolves "." to itself
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """{module: modules of the package it imports}."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                where = _resolve(name, is_package, node)
                targets = [f"{where}.{a.name}" if f"{where}.{a.name}" in files else where for a in node.names]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of modules that
    all import each other, directly or through the others."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

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
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per component, as a path ``[a, b, ..., a]`` that follows real edges, so the message names
    the imports to cut (cutting one may leave another cycle in a larger component: its members are listed)."""
    return [_cycle_in(graph, comp) for comp in components(graph)]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_graph_sees_the_package():
    """The walk finds the modules and resolves relative imports (a broken walk would find no cycle)."""
    graph = import_graph()
    assert f"{PACKAGE}.schedules.cuda.causal_conv1d" in graph
    assert f"{PACKAGE}.runtime.key" in graph[f"{PACKAGE}.runtime.dispatch"]
    assert f"{PACKAGE}.schedules.rule" in graph[f"{PACKAGE}.runtime.dispatch"]


def test_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    found = [(_cycle_in(graph, comp), comp) for comp in components(graph)]
    assert not found, "import cycles (cut one import of each; lazy imports count):\n" + "\n".join(
        "  " + " -> ".join(cycle) + (f"   (a component of {len(comp)}: {', '.join(sorted(comp))})"
                                    if len(comp) > len(cycle) - 1 else "") for cycle, comp in found)


# The product's layers, lowest first (docs/architecture.md): a module imports its own layer or lower ones.
# compute/ holds the definitions, schedules/ lays them onto targets, runtime/ finds, builds and caches
# kernels, torch_ops/ and modules/ are what users call. tools/ (checks, roofline, tuning, AOT) and the CLI
# that dispatches to them sit beside the product: they import it, it never imports them.
LAYERS = ("compute", "schedules", "runtime", "torch_ops", "modules")
TOOLS = (f"{PACKAGE}.tools", f"{PACKAGE}.cli", f"{PACKAGE}.__main__")


def _layer(module: str):
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_downward_and_tools_stay_apart():
    graph = import_graph()
    upward = sorted((a, b) for a, deps in graph.items() for b in deps
                    if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(f"  {a} -> {b}" for a, b in upward)
    into_tools = sorted((a, b) for a, deps in graph.items() for b in deps
                        if b.startswith(TOOLS) and not a.startswith(TOOLS))
    assert not into_tools, "the product imports a tool:\n" + "\n".join(f"  {a} -> {b}" for a, b in into_tools)
    assert any(b.startswith(f"{PACKAGE}.tools") for b in graph[f"{PACKAGE}.cli"])  # the walk sees the CLI's imports


# Run in a fresh interpreter as a TVM-only host (an AOT deployment) would: ``torch`` cannot be imported.
# (tvm_ffi's own __init__ tries ``import torch`` first when it is installed, to dodge a symbol clash, so with
# torch installed every TVM user has it in sys.modules; that attempt is not ours and is allowed to fail.)
# Every module of the layer is imported; any attempt from a tvm_mamba file is reported with its line.
_NO_TORCH = """
import importlib, pkgutil, sys, traceback

attempts = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
            importer = stack[-1]  # the file whose import statement asked for torch
            if "/tvm_mamba/" in importer.filename or "/schedules/" in importer.filename:
                attempts.append(f"{importer.filename}:{importer.lineno}")
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: a TVM-only host)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
layer = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(layer.__path__, layer.__name__ + "."):
    importlib.import_module(info.name)
print(sorted(set(attempts)), "torch" in sys.modules)
"""


@pytest.mark.parametrize("layer", ["tvm_mamba.compute", "tvm_mamba.runtime", "tvm_mamba.tools.roofline"])
def test_torch_free_layers_import_no_torch(layer):
    """compute/ and runtime/ (every module) import without torch, and none of them tries to import it at
    import time (CONVENTIONS: only torch_ops/ imports torch and TVM together); the roofline tool neither
    (it runs kernels on TVM tensors through the CUDA harness)."""
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, layer], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, f"import {layer} without torch failed:\n{out.stderr[-2000:]}"
    assert out.stdout.strip().splitlines()[-1] == "[] False", f"import {layer} reached torch: {out.stdout[-500:]}"
