"""Helpers of ``train.py``'s command line: shipped configs by name, typo suggestions, clean saved configs.

Kept apart from :mod:`vitlab.cli` so the CLI class itself stays small; nothing here imports Lightning at
module level (``probe.py`` uses the output helpers and must start fast).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import shutil
import sys
import warnings
from functools import cache
from pathlib import Path
from typing import Any


def _shipped_folder() -> Path:
    """The shipped configs: the ``configs`` folder inside an installed package (the wheel maps the repository's
    top-level ``configs/`` there, see setup.py), else the top-level ``configs/`` of the source checkout vitlab runs
    from (an editable install or ``PYTHONPATH``). One source either way: the repository's ``configs/``."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


PACKAGE_CONFIGS = _shipped_folder()
_ALWAYS_KNOWN = {"config", "print_config", "help", "c", "h"}
MOVED = {"data.num_workers": "runtime.workers"}  # keys of older configs -> where they live now


# ---------------------------------------------------------------------------------------------- shipped configs


def config_dirs() -> list[Path]:
    """Where ``--config NAME`` is looked up: ``./configs`` then the shipped configs (deduplicated)."""
    dirs: list[Path] = []
    for folder in (Path("configs"), PACKAGE_CONFIGS):
        if folder.is_dir() and all(folder.resolve() != d.resolve() for d in dirs):
            dirs.append(folder)
    return dirs


def shipped_configs() -> list[str]:
    """Names of the shipped configs (``quickstart``, ``medical_swin``, ...)."""
    return sorted({p.stem for d in config_dirs() for p in d.glob("*.yaml")})


def configs_help() -> str:
    """The ``--help`` paragraph naming the shipped configs (``--config NAME`` finds them from any folder)."""
    names = sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))
    return (f"Shipped configs, run from any folder with --config NAME: {', '.join(names) or 'none found'}. "
            "A configs/NAME.yaml in the current folder comes first. Your own file: --config path/to/file.yaml; "
            "a run's config.yaml repeats that run.")


def program_name(script: str) -> str:
    """How the user started the command: the installed console script (``vitlab-train``, ``vitlab-probe``) by its
    name, anything else (``python probe.py``, a test runner, ``python -m``) as the repository's ``script``."""
    name = Path(sys.argv[0]).name.removesuffix(".exe")
    return name if name.startswith("vitlab-") else script


def find_config(value: str) -> str:
    """A ``--config`` value as a path: an existing file as is, else ``configs/<value>[.yaml]``; else a one-line error."""
    if Path(value).expanduser().is_file() or value.lstrip().startswith("{"):
        return value
    name = Path(value).name
    for folder in config_dirs():
        for candidate in (folder / name, folder / f"{name}.yaml"):
            if candidate.is_file():
                return str(candidate)
    raise FileNotFoundError(
        f"--config {value}: no such file, and no shipped config of that name; shipped configs "
        f"({', '.join(str(d) for d in config_dirs()) or 'configs/'}): {', '.join(shipped_configs())}")


def refuse_moved_keys(args: list[str] | dict[str, Any]) -> None:
    """One line for a key of an older config that moved (:data:`MOVED`), in a config dict, a flag or a ``--config`` file."""
    import yaml

    sources: list[tuple[str, Any]] = []
    if isinstance(args, dict):
        sources.append(("the config", args))
    else:
        for i, token in enumerate(args):
            name = token.split("=", 1)[0]
            value = token.split("=", 1)[1] if "=" in token else (args[i + 1] if i + 1 < len(args) else None)
            if name in ("--config", "-c") and value and Path(value).is_file():
                with contextlib.suppress(yaml.YAMLError):
                    sources.append((value, yaml.safe_load(Path(value).read_text())))
            elif name.startswith("--") and name[2:] in MOVED:
                raise ValueError(f"{name}: moved to --{MOVED[name[2:]]}")
    for where, cfg in sources:
        for old, new in MOVED.items():
            node = cfg
            for part in old.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                raise ValueError(f"{where}: {old} moved to {new} (e.g. runtime: {{{new.split('.', 1)[1]}: {node}}})")


def resolve_config_args(args: list[str]) -> list[str]:
    """``--config medical_swin`` / ``-c medical_swin.yaml`` / ``--config=x`` -> paths of the shipped configs."""
    out = list(args)
    for i, token in enumerate(out):
        if token in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = find_config(out[i + 1])
        elif token.startswith("--config="):
            out[i] = "--config=" + find_config(token.split("=", 1)[1])
    return out


# ---------------------------------------------------------------------------------------------- typos


def __getattr__(name: str):
    if name == "VitlabArgumentParser":  # pickling (ddp_spawn) finds the class by this module-level name
        return parser_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def parser_class() -> type:
    """LightningArgumentParser whose errors start with the line that matters.

    An unknown key (on the command line or in a ``--config`` file) gives one line with the closest valid key
    (``--data.batchsize`` -> did you mean ``--data.batch_size``?), every unknown key of a file at once, and no
    usage screen; other errors print jsonargparse's message and a pointer to ``--help``.
    """
    from pytorch_lightning.cli import LightningArgumentParser

    class VitlabArgumentParser(LightningArgumentParser):
        _argv: list[str] | None = None

        def parse_args(self, args=None, *rest, **kwargs):  # records argv for error()
            self._argv = list(sys.argv[1:] if args is None else args)
            return super().parse_args(args, *rest, **kwargs)

        def error(self, message: str, ex: Exception | None = None):
            if not self.exit_on_error or self._argv is None or os.environ.get("JSONARGPARSE_DEBUG"):
                return super().error(message, ex)
            problems = unknown_keys(self, self._argv)
            prog = self.prog.replace(" [options]", "")
            prog = f"python {prog}" if prog.endswith(".py") else prog  # train.py, or the console script vitlab-train
            if problems:
                print(f"vitlab: error: unknown option(s): {'; '.join(problems)}", file=sys.stderr)
            else:
                print(f"vitlab: error: {short_error(message)}", file=sys.stderr)
            print(f"  ({prog} --help lists every option)", file=sys.stderr)
            sys.exit(2)

    VitlabArgumentParser.__qualname__ = "VitlabArgumentParser"
    return VitlabArgumentParser


def short_error(message: str) -> str:
    """jsonargparse's nested type error as one line: ``data.embedded_kwargs.patients: Expected a <class 'int'>. Got value: x``."""
    import re

    keys: list[str] = []
    for line in message.splitlines():
        found = re.search(r'Parser key "([^"]+)":', line)
        if found:
            keys.append(found.group(1))
        elif keys and "Expected a" in line and "NoneType" not in line:
            return f"{'.'.join(keys)}: {line.strip()}"
    return message


def _dests(parser) -> set[str]:
    """Every valid dotted key: the parser's options plus the fields of dataclass-typed options."""
    import dataclasses
    import typing

    dests = set(_ALWAYS_KNOWN)
    for action in parser._actions:
        dest = getattr(action, "dest", None)
        if not isinstance(dest, str) or dest.endswith(".help"):
            continue
        dests.add(dest)
        hint = getattr(action, "_typehint", None)
        for candidate in (hint, *typing.get_args(hint)):
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                dests |= {f"{dest}.{f.name}" for f in dataclasses.fields(candidate)}
    return dests


def _status(key: str, dests: set[str]) -> str:
    """'known' (a leaf or a free-form value below one), 'group' (has known keys below it) or 'unknown'."""
    if key in dests and not any(d.startswith(key + ".") for d in dests):
        return "known"
    if any(d.startswith(key + ".") for d in dests):
        return "group"
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):  # below a leaf (subclass / dict / init_args): that value's business
        prefix = ".".join(parts[:n])
        if prefix in dests and not any(d.startswith(prefix + ".") and d != prefix for d in dests):
            return "known"
    return "unknown"


def _suggest(key: str, dests: set[str], dash: str) -> str:
    if key in MOVED:
        return f"{dash}{key} (moved to {dash}{MOVED[key]})"
    match = difflib.get_close_matches(key, sorted(dests - _ALWAYS_KNOWN), n=1, cutoff=0.6)
    return f"{dash}{key} (did you mean {dash}{match[0]}?)" if match else f"{dash}{key}"


def unknown_keys(parser, argv: list[str]) -> list[str]:
    """Every unknown key in ``argv`` and in the YAML files it passes with ``--config``, each with a suggestion."""
    import yaml

    dests = _dests(parser)
    problems: list[str] = []
    for i, token in enumerate(argv):
        value = argv[i + 1] if token in ("--config", "-c") and i + 1 < len(argv) else None
        value = token.split("=", 1)[1] if token.startswith("--config=") else value
        if value is not None:
            path = Path(value)
            if not path.is_file():
                continue
            try:
                cfg = yaml.safe_load(path.read_text())
            except yaml.YAMLError:
                continue
            found = _walk(cfg, "", dests) if isinstance(cfg, dict) else []
            if found:
                problems.append(f"in {path}: " + ", ".join(_suggest(k, dests, "") for k in found))
        elif token.startswith("--") and len(token) > 2:
            key = token[2:].split("=", 1)[0].rstrip("+")
            if _status(key, dests) == "unknown":
                problems.append(_suggest(key, dests, "--"))
    return problems


def _walk(cfg: dict, prefix: str, dests: set[str]) -> list[str]:
    found: list[str] = []
    for name, value in cfg.items():
        key = f"{prefix}{name}"
        status = _status(key, dests)
        if status == "unknown":
            found.append(key)
        elif status == "group" and isinstance(value, dict) and "class_path" not in value:
            found += _walk(value, key + ".", dests)
    return found


# ---------------------------------------------------------------------------------------------- runs


def clean_recipe(config) -> Any:
    """A copy of the parsed config that repeats the run: no ``ckpt_path`` (taken before resume pins the logger)."""
    recipe = config.clone()
    if "ckpt_path" in recipe:
        recipe.ckpt_path = None
    return recipe


def save_recipe(trainer, recipe) -> None:
    """Make the trainer's SaveConfigCallback write ``recipe`` as the run's ``config.yaml``."""
    from pytorch_lightning.cli import SaveConfigCallback

    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback):
            callback.config = recipe


def resume_save_dir(ckpt: Path, version_dir: Path) -> str:
    """The logger ``save_dir`` for a resumed run, spelt as the run spelt it (so ModelCheckpoint sees the same dirpath).

    Lightning restores a checkpointer's best score only when its ``dirpath`` string equals the stored one; a relative
    first run resumed with an absolute path would lose it and write a second ``best-*.ckpt``.
    """
    import torch

    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True).get("callbacks") or {}
    except Exception:  # noqa: BLE001 - unreadable here means Lightning reports it in a moment
        state = {}
    target = (version_dir / "checkpoints").resolve()
    for value in state.values():
        dirpath = value.get("dirpath") if isinstance(value, dict) else None
        if isinstance(dirpath, str) and Path(dirpath).resolve() == target:
            return os.path.dirname(os.path.dirname(os.path.dirname(os.path.normpath(dirpath)))) or "."
    return str(version_dir.parent.parent)


def remove_stub_run(log_dir: Path | None, existed: bool, global_step: int) -> None:
    """Remove a run folder created by a run that failed before training a step and has no checkpoints."""
    if log_dir is None or existed or global_step > 0 or not log_dir.is_dir() or (log_dir / "checkpoints").exists():
        return
    shutil.rmtree(log_dir, ignore_errors=True)


def without_validation(trainer, datamodule) -> list[str]:
    """When the data has no validation split (unlabelled images for DINO, or ``val_fraction: 0``): turn the
    validation loop off (``limit_val_batches = 0``, no empty-loader warnings) and remove the checkpointers that
    monitor a ``val/`` metric, since nothing would ever be scored (``last.ckpt`` is still written every epoch).
    Returns the monitors removed; rank 0 says so in one line."""
    samples = getattr(datamodule, "samples", None)
    if samples is None or samples("val"):
        return []
    trainer.limit_val_batches = 0
    dropped = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb.monitor, str) and cb.monitor.startswith("val/")]
    if not dropped:
        return []
    trainer.callbacks = [cb for cb in trainer.callbacks if all(cb is not d for d in dropped)]
    monitors = [cb.monitor for cb in dropped]
    why = "unlabelled images (data.labels false)" if not getattr(datamodule, "has_labels", True) else "an empty validation split"
    if trainer.is_global_zero:
        print(f"vitlab: no best checkpoint by {', '.join(monitors)}: the data has {why}; last.ckpt is written every epoch",
              file=sys.stderr)
    return monitors


# ---------------------------------------------------------------------------------------------- output


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.getMessage())


def quiet_output(one_line_warnings: bool = False) -> None:
    """Silence Lightning's litlogger advertisement; optionally print warnings as one line without the echoed source."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTip) for f in logger.filters):
            logger.addFilter(_DropTip())
    if one_line_warnings:
        warnings.formatwarning = format_warning


def format_warning(message, category, filename, lineno, line=None) -> str:
    """``vitlab: warning: ...`` for vitlab's own warnings, ``file:line: Category: ...`` for others; no source line."""
    module_file = str(filename)
    if f"{os.sep}vitlab{os.sep}" in module_file:
        return f"vitlab: warning: {message}\n"
    return f"{filename}:{lineno}: {category.__name__}: {message}\n"
