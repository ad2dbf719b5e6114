"""The README's examples run as written, its commands parse, it stays short, and its links resolve; every file,
module and name that the docs, docstrings and comments point a reader to exists."""

from __future__ import annotations

import ast
import io
import re
import shlex
import tokenize
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
README = REPO / "README.md"
MAX_README_LINES = 520
# the files whose shown commands must run as written: the README and the notes it links to
DOC_FILES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    import importlib.util

    has_hf = importlib.util.find_spec("transformers") is not None
    namespaces = []
    for code in blocks:
        if '"hf:' in code and not has_hf:  # the optional extra's example (the dev install includes it)
            continue
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
        namespaces.append(namespace)
    inside = [ns for ns in namespaces if "dense" in ns]  # the "From Python" example, wherever it stands
    assert len(inside) == 1, "README lacks the example that records attention into `dense`"
    assert inside[0]["dense"].shape[-1] == inside[0]["dense"].shape[-2] == 256
    assert inside[0]["spec"].positive_mass.shape == (4,)


# ------------------------------------------------------------------------------------------- length, links


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move engineering notes to docs/ and link them")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # '#' comments in code blocks are no headings
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http://", "https://", "mailto:"))]


def test_readme_links_docs_and_benchmarks():
    targets = {t.split("#")[0] for t in _links(README)}
    docs = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert docs, "docs/ holds no notes"
    assert docs | {"benchmarks/README.md"} <= targets, "every docs/*.md and benchmarks/README.md is linked from the README"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    for link in _links(path):
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.is_file(), f"{path.relative_to(REPO)} links to {link}, which is not a file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{path.relative_to(REPO)} links to {link}: no such heading"


# ------------------------------------------------------------------------------------------- CI's commands


def _ci_command(label: str) -> str:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return lines[lines.index(f"# {label}:") + 1].strip()


@pytest.mark.parametrize("label", ["README install command", "README test command"])
def test_ci_runs_the_readme_commands(label):
    command = _ci_command(label)
    shown = {line.strip() for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
             for line in block.splitlines()}
    assert command in shown, f".ci/run's {label} `{command}` is not shown in the README"


# ------------------------------------------------------------------------------------------- shell commands


def _shell_commands(path: Path) -> list[list[str]]:
    """The ``python ...`` command lines of a file's bash blocks, split as the shell would (comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("python "):
                commands.append(shlex.split(line, comments=True))
    return commands


def _commands(script: str) -> list[tuple[str, list[str]]]:
    return [(f"{p.relative_to(REPO)}: {shlex.join(c)}", c[2:]) for p in DOC_FILES for c in _shell_commands(p)
            if c[1] == script]


def test_shown_commands_found():
    assert len(_commands("train.py")) >= 10 and len(_commands("probe.py")) >= 12


@pytest.mark.parametrize("where, argv", _commands("probe.py"), ids=lambda v: v if isinstance(v, str) else "")
def test_probe_commands_parse(where, argv):
    from vitlab.probes import build_parser

    argv = ["ablate", *argv] if argv and argv[0].startswith("--ablate") else argv  # as probe.py itself does
    args = build_parser(argv).parse_args(argv)
    assert args.subcommand, where


@pytest.mark.slow
@pytest.mark.parametrize("where, argv", _commands("train.py"), ids=lambda v: v if isinstance(v, str) else "")
def test_train_commands_parse(where, argv, monkeypatch, capsys):
    from vitlab.cli import fit

    monkeypatch.chdir(REPO)  # the commands are typed in the repository root
    with pytest.raises(SystemExit) as exc:
        fit([*argv, "--print_config"])
    assert exc.value.code == 0, f"{where}: {capsys.readouterr().err}"


def test_benchmark_commands_name_existing_scripts():
    scripts = [c[1] for p in DOC_FILES for c in _shell_commands(p) if c[1].startswith("benchmarks/")]
    assert scripts
    for script in scripts:
        assert (REPO / script).is_file(), script
    listed = (REPO / "benchmarks" / "README.md").read_text()
    for file in (REPO / "benchmarks").glob("*.py"):
        assert f"`{file.name}`" in listed, f"benchmarks/README.md does not list {file.name}"


# ------------------------------------------------------------------------------------------- references


# a repository path as text names it: `docs/<note>.md#<heading>`, a module or test file, a folder; text with a
# placeholder (`configs/quickstart_<task>.yaml`) or a wildcard names no one file and is left alone
PATH_REF = re.compile(r"(?<![\w./-])((?:vitlab|tests|docs|benchmarks|configs)/[\w./-]*\w(?:#[\w-]+)?)(?![\w./<{*\[-])")
MODULE_REF = re.compile(r"(?<![\w./-])(vitlab(?:\.\w+)+)")  # a module, a name in it, or a class's attribute
# what a reader of the repository cannot follow: the project's own planning documents and issue numbers
PRIVATE_REF = re.compile(r"\bSPEC\b|\b[Ss]eeds? 00[0-9]\b|\b[Ii]ssues? #?[0-9]+")
SOURCES = sorted([*REPO.glob("vitlab/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/*.py"),
                  REPO / "train.py", REPO / "probe.py"])
NOTES = [*DOC_FILES, *sorted((REPO / "configs").glob("*.yaml"))]


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a reader reads as prose: a note's lines; a module's docstrings and comments."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


@cache
def _defined(module_file: Path) -> dict[str, set[str] | None]:
    """Top-level names of a module's source (-> the names a class defines, or None: not a class). A module
    ``__getattr__`` (lazy imports) answers the names its module-level tables spell as strings (``__all__``, ...)."""
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(module_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n for item in node.body for n in _bound(item)}
        for name in _bound(node):
            names.setdefault(name, None)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        if isinstance(node, ast.If | ast.Try):  # optional imports and TYPE_CHECKING blocks
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    names.update({(a.asname or a.name).split(".")[0]: None for a in inner.names})
    if "__getattr__" in names:
        tables = [node.value for node in ast.parse(module_file.read_text(encoding="utf-8")).body
                  if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None]
        names.update({c.value: None for table in tables for c in ast.walk(table)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.isidentifier()})
    return names


def _bound(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _module_ref_problem(dotted: str) -> str | None:
    """Why a dotted module / name / class attribute names nothing in the source tree (None: it resolves), read from
    the source without importing it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:n])
        module_file = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
        if module_file.is_file():
            break
    else:
        return "no such module"
    rest = parts[n:]
    if not rest:
        return None
    names = _defined(module_file)
    if rest[0] not in names:
        if (base / f"{rest[0]}.py").is_file() or (base / rest[0] / "__init__.py").is_file():
            return None  # a submodule the package does not import (not an attribute yet, but a module)
        return f"{module_file.relative_to(REPO)} defines no {rest[0]}"
    members = names.get(rest[0])
    if len(rest) > 1 and members is not None and rest[1] not in members:
        return f"{rest[0]} in {module_file.relative_to(REPO)} has no {rest[1]}"
    return None


@cache
def _references() -> list[tuple[str, int, str]]:
    """(file, line, prose) of every note and source file (read once for the tests below)."""
    return [(str(path.relative_to(REPO)), line, text) for path in NOTES + SOURCES for line, text in _prose(path)]


def test_paths_named_in_docs_docstrings_and_comments_exist():
    missing = []
    for where, line, text in _references():
        for ref in PATH_REF.findall(text):
            target, _, anchor = ref.partition("#")
            file = REPO / target
            if not file.exists():
                missing.append(f"{where}:{line}: {ref} (no such file or folder)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                missing.append(f"{where}:{line}: {ref} (no such heading)")
    assert not missing, "\n".join(missing)


def test_modules_and_names_named_in_docs_docstrings_and_comments_exist():
    problems = []
    for where, line, text in _references():
        for ref in MODULE_REF.findall(text):
            problem = _module_ref_problem(ref)
            if problem:
                problems.append(f"{where}:{line}: {ref}: {problem}")
    assert not problems, "\n".join(problems)


def test_no_reference_a_reader_of_the_repository_cannot_follow():
    found = [f"{where}:{line}: {match.group(0)!r}" for where, line, text in _references()
             for match in PRIVATE_REF.finditer(text)]
    assert not found, "cite the paper's short name (README: the papers behind vitlab) or docs/:\n" + "\n".join(found)
