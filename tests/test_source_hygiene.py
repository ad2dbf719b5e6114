"""Source checks a merge can silently break: a class that defines a method twice keeps only the second (a merge of
two branches that each added the same hook did exactly that once, and checkpoints lost their run record)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _redefinitions(path: Path, root: Path = REPO) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        seen: dict[str, int] = {}
        for item in node.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            decorators = [ast.unparse(d) for d in item.decorator_list]
            if any(d.endswith((".setter", ".deleter", ".register")) or d in ("overload", "typing.overload") for d in decorators):
                continue  # a property's setter, a singledispatch case, an overload: the same name on purpose
            if item.name in seen:
                found.append(f"{path.relative_to(root)}:{item.lineno}: {node.name}.{item.name} again (first at line {seen[item.name]})")
            seen[item.name] = item.lineno
    return found


def _functions(path: Path) -> list[str]:
    """Module-level functions defined twice."""
    seen: dict[str, int] = {}
    found = []
    for item in ast.parse(path.read_text(), str(path)).body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.decorator_list:
            if item.name in seen:
                found.append(f"{path.relative_to(REPO)}:{item.lineno}: {item.name} again (first at line {seen[item.name]})")
            seen[item.name] = item.lineno
    return found


def test_no_class_or_module_defines_a_function_twice():
    sources = sorted([*REPO.glob("vitlab/**/*.py"), *REPO.glob("benchmarks/*.py"), REPO / "train.py", REPO / "probe.py"])
    found = [line for path in sources for line in (*_redefinitions(path), *_functions(path))]
    assert not found, "\n".join(found)


def test_the_check_finds_a_method_defined_twice(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("class A:\n    def hook(self):\n        pass\n\n    def hook(self):\n        pass\n")
    assert _redefinitions(source, tmp_path) == ["mod.py:5: A.hook again (first at line 2)"]
