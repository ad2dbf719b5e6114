"""The README's examples run as written, its commands parse, it stays short, and its links resolve."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
README = REPO / "README.md"
MAX_README_LINES = 450
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
