"""The static import graph of the ``vitlab`` package: no import circle inside the packages in scope.

The graph is read from the source with :mod:`ast`, so it sees every import a module can make, not only
those a test run happens to execute: ``import x`` / ``from x import y`` statements anywhere in a file (module
level, inside functions, under ``TYPE_CHECKING``), relative imports, ``from pkg import name`` resolved to the
submodule ``pkg.name`` when that is a module file, and ``importlib.import_module("literal")`` calls. The edge
from a submodule to its own parent packages (Python runs a package's ``__init__`` before its submodules) is
left out: it is not a dependency the submodule chose. An import circle is a strongly connected component of
more than one module.

Run this file as a script (``python tests/test_import_graph.py [package ...]``) to print every circle of the
whole package, or of the named packages, with the import lines that close it.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vitlab"
ACYCLIC_PACKAGES = ["vitlab.models"]  # package prefixes that must hold no import circle
WHOLE_PACKAGE_ACYCLIC = True  # no import circle anywhere in vitlab
SCOPES = [PACKAGE] if WHOLE_PACKAGE_ACYCLIC else ACYCLIC_PACKAGES


@dataclass(frozen=True)
class Edge:
    """One import of ``target`` by ``source``, written at ``path:line`` as ``statement``."""

    source: str
    target: str
    path: Path
    line: int
    statement: str

    def __str__(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}: {self.statement}  ({self.source} -> {self.target})"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file for every ``.py`` file of ``package`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> Optional[str]:
    """The module of ``modules`` that ``name`` (a module or a name inside one) lives in; None outside."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _absolute(module: str, is_package: bool, level: int, name: Optional[str]) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _import_module_literal(node: ast.Call) -> Optional[tuple[str, Optional[str]]]:
    """(name, package) of an ``importlib.import_module("literal"[, "package"])`` call, else None."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called != "import_module" or not node.args:
        return None
    literal = [arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
               for arg in [*node.args, *(kw.value for kw in node.keywords if kw.arg == "package")]]
    if literal[0] is None:
        return None
    return literal[0], literal[1] if len(literal) > 1 else None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import of a module of ``modules`` that ``path`` (the source of ``module``) makes."""
    source = path.read_text()
    lines = source.splitlines()
    is_package = path.name == "__init__.py"
    edges: dict[tuple[str, int], Edge] = {}

    def add(target: Optional[str], node: ast.AST) -> None:
        if target is None or module == target or module.startswith(target + "."):
            return  # outside the package, or the submodule's implicit edge to its parent packages
        edges.setdefault((target, node.lineno), Edge(module, target, path, node.lineno, lines[node.lineno - 1].strip()))

    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else _resolve(base, modules), node)
        elif isinstance(node, ast.Call) and (call := _import_module_literal(node)):
            name, package = call
            if name.startswith(".") and package:
                level = len(name) - len(name.lstrip("."))
                name = _absolute(package, True, level, name.lstrip(".") or None)
            add(_resolve(name, modules), node)
    return list(edges.values())


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, list[Edge]]:
    """Module -> its imports of other modules of ``package``."""
    modules = module_files(root, package)
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                target = edge.target
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.get(target, []))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def import_cycles(graph: dict[str, list[Edge]], scopes: list[str]) -> list[list[Edge]]:
    """The import circles among the modules under ``scopes`` (package prefixes; a circle that leaves them
    is not counted): for each strongly connected component of more than one module, every import inside it
    (the lines to cut it at)."""

    def in_scope(module: str) -> bool:
        return any(module == scope or module.startswith(scope + ".") for scope in scopes)

    scoped = {module: [edge for edge in edges if in_scope(edge.target)]
              for module, edges in graph.items() if in_scope(module)}
    cycles = []
    for component in strongly_connected(scoped):
        members = set(component)
        inside = [edge for module in component for edge in scoped[module] if edge.target in members]
        if len(component) > 1:
            cycles.append(inside)
    return cycles


def shortest_circle(edges: list[Edge]) -> list[Edge]:
    """One shortest circle through the first module of a component's ``edges`` (breadth-first)."""
    start = min(edge.source for edge in edges)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for edge in (e for e in edges if e.source == module):
                if edge.target == start:
                    circle = [edge]
                    while circle[0].source != start:
                        circle.insert(0, came[circle[0].source])
                    return circle
                if edge.target not in came:
                    came[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    return []


def report(cycles: list[list[Edge]]) -> str:
    """Human-readable listing of ``cycles``: members, one shortest circle, then every import inside."""
    out = []
    for number, edges in enumerate(cycles, 1):
        members = sorted({edge.source for edge in edges})
        out.append(f"circle {number}: {', '.join(members)}")
        out.append("  shortest: " + " -> ".join([e.source for e in shortest_circle(edges)] + [min(members)]))
        out.extend(f"  {edge}" for edge in sorted(edges, key=lambda e: (e.source, e.line)))
    return "\n".join(out) or "no import circle"


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Edge]]:
    return import_graph()


@pytest.mark.parametrize("scope", SCOPES)
def test_no_import_circle(graph, scope):
    cycles = import_cycles(graph, [scope])
    assert not cycles, f"import circles in {scope}:\n{report(cycles)}"


def test_family_modules_import_neither_each_other_nor_the_registry(graph):
    registry = "vitlab.models.registry"
    listed = {edge.target for edge in graph[registry]} - {"vitlab.models.adapter", "vitlab.models.errors"}
    assert {"vitlab.models.timm_families", "vitlab.models.hf_families"} <= listed, sorted(listed)
    wrong = [edge for module in sorted(listed) for edge in graph[module] if edge.target in listed | {registry}]
    assert not wrong, "family modules import only the shared bases:\n" + "\n".join(map(str, wrong))


def test_the_data_layer_imports_no_training_outputs_or_probes(graph):
    """Data knows nothing of TensorBoard, the trainer's callbacks, the tasks or the probes: they use the data."""
    above = ("vitlab.outputs", "vitlab.callbacks", "vitlab.training", "vitlab.probes", "vitlab.runtime", "vitlab.cli")
    wrong = [edge for module, edges in sorted(graph.items()) if module.startswith("vitlab.data")
             for edge in edges if edge.target.startswith(above)]
    assert not wrong, "vitlab.data imports what is built on it:\n" + "\n".join(map(str, wrong))


def test_the_graph_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import thing\n",
        "a.py": "import os\ndef f():\n    from . import b\n    from .sub import c as _c\n",
        "b.py": "import importlib\nimportlib.import_module('pkg.sub')\nimport pkg.sub.c\n",
        "sub/__init__.py": "from .. import a\nfrom ..b import name\n",
        "sub/c.py": "from pkg.sub import d\nimport importlib\nimportlib.import_module('.b', package='pkg')\n",
        "sub/d.py": "from pkg import sub\nfrom pkg.sub import *\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    found = {module: sorted({edge.target for edge in edges}) for module, edges in import_graph(tmp_path, "pkg").items()}
    assert found == {
        "pkg": ["pkg.a"],
        "pkg.a": ["pkg.b", "pkg.sub.c"],
        "pkg.b": ["pkg.sub", "pkg.sub.c"],
        "pkg.sub": ["pkg.a", "pkg.b"],
        "pkg.sub.c": ["pkg.b", "pkg.sub.d"],
        "pkg.sub.d": [],  # its parent packages only: the implicit edge is left out
    }
    cycles = import_cycles(import_graph(tmp_path, "pkg"), ["pkg"])
    assert [sorted({edge.source for edge in edges}) for edges in cycles] == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"]]
    assert import_cycles(import_graph(tmp_path, "pkg"), ["pkg.sub"]) == []  # a.b / pkg.b are out of scope


if __name__ == "__main__":
    print(report(import_cycles(import_graph(), sys.argv[1:] or [PACKAGE])))
