"""A study's command line: the grid (``--study seeds=0,1,2 ablate=none,attention`` or a study file), the study
options (``--study.parallel 2``) and the ordinary ``train.py`` arguments; and the cells the grid makes.

Nothing here runs or checks a config: :mod:`vitlab.study.command` checks every grid value with ``train.py``'s
own parser. Lightning-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SEED, ABLATE = "seed", "ablate"
ALIASES = {"seeds": SEED, "seed": SEED, "ablate": ABLATE}  # grid keys that are no config key
# model.ablate's component names for every family (vitlab.models.ablation_components; a test keeps them equal)
ABLATE_COMPONENTS = ("residual", "residual_attention", "residual_mlp", "residual_token_mixing", "layernorm", "norm1",
                     "norm2", "attention", "token_mixing", "mlp")
LAUNCHERS = ("local", "submitit_local", "slurm")
STUDY_FILE_KEYS = ("grid", "name", "seed_keys", "launcher", "parallel", "gpus_per_run", "cpus_per_run", "mem_gb",
                   "partition", "account", "time", "setup")
SEED_KEYS = ["seed_everything", "data.seed"]  # what a seed sets by default: a run's whole randomness
RESERVED = ("trainer.logger", "ckpt_path", "config")  # set by the study for each cell, never a grid key


@dataclass
class StudyOptions:
    """Where and how a study's cells run (``--study.<name>`` or a study file's keys).

    Args:
        name: The study folder ``<trainer.logger save_dir>/<name>``; default ``<logger name>-<grid keys>``.
        seed_keys: The config keys a seed sets: ``seed_everything`` (initialisation, dropout) and ``data.seed``
            (the patient split, the order and the augmentations; left out where the data has no such key).
            ``[seed_everything]`` keeps one split for every seed.
        launcher: ``local`` (subprocesses of this command), ``submitit_local`` (submitit's local executor: the
            cluster path on this machine) or ``slurm`` (one SLURM job array through submitit).
        parallel: Cells at once. ``auto``: one per GPU (``gpus_per_run`` each) when the config trains on GPUs,
            else one (a run already takes every core); N > 1 on a CPU gives each run its share of the cores.
            SLURM: the array's parallelism (``auto``: no limit).
        gpus_per_run: GPUs each cell gets (local GPU slots, SLURM ``--gpus-per-node``).
        cpus_per_run: SLURM ``--cpus-per-task`` (None: the cluster's default).
        mem_gb: SLURM ``--mem`` in GB (None: the cluster's default).
        partition: SLURM ``--partition``.
        account: SLURM ``--account``.
        time: SLURM time limit of each cell, minutes (also submitit_local's timeout).
        setup: Shell lines a SLURM job runs first (``module load cuda``, ``source venv/bin/activate``).
    """

    name: str | None = None
    seed_keys: list[str] = field(default_factory=lambda: list(SEED_KEYS))
    launcher: str = "local"
    parallel: int | str = "auto"
    gpus_per_run: int = 1
    cpus_per_run: int | None = None
    mem_gb: float | None = None
    partition: str | None = None
    account: str | None = None
    time: int = 60
    setup: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        def count(key: str, value: Any, minimum: int, none_ok: bool = False) -> None:
            if value is None and none_ok:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--study.{key} must be an integer >= {minimum}{' or null' if none_ok else ''}, got {value!r}")

        if self.launcher not in LAUNCHERS:
            raise ValueError(f"--study.launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.parallel != "auto":
            count("parallel", self.parallel, 1)
        count("gpus_per_run", self.gpus_per_run, 0)
        count("cpus_per_run", self.cpus_per_run, 1, none_ok=True)
        count("time", self.time, 1)
        if self.mem_gb is not None and (isinstance(self.mem_gb, bool) or not isinstance(self.mem_gb, (int, float)) or self.mem_gb <= 0):
            raise ValueError(f"--study.mem_gb must be a number > 0 or null, got {self.mem_gb!r}")
        for key in ("name", "partition", "account"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"--study.{key} must be a non-empty string or null, got {value!r}")
        if self.name is not None and (Path(self.name).name != self.name or self.name in (".", "..")):
            raise ValueError(f"--study.name {self.name!r} must be a folder name, not a path (the folder goes under trainer.logger's save_dir)")
        if not isinstance(self.setup, list) or not all(isinstance(s, str) for s in self.setup):
            raise ValueError(f"--study.setup must be a list of shell lines, got {self.setup!r}")
        if not isinstance(self.seed_keys, list) or not self.seed_keys or not all(isinstance(s, str) and s for s in self.seed_keys):
            raise ValueError(f"--study.seed_keys must be a non-empty list of config keys, got {self.seed_keys!r}")


@dataclass(frozen=True)
class Axis:
    """One grid key and its values, as typed (strings a ``train.py`` command line takes)."""

    key: str
    values: tuple[str, ...]
    sets: tuple[str, ...] = ()  # the seed axis: the config keys a seed sets

    @property
    def short(self) -> str:
        """The key as it appears in cell names: ``seed``, ``ablate``, ``lr`` for ``model.lr``."""
        return self.key.rsplit(".", 1)[-1]

    def overrides(self, value: str, base: dict[str, Any]) -> list[str]:
        """The ``train.py`` arguments that set this axis to ``value`` on the parsed base config ``base``."""
        if self.key == SEED:
            data = base.get("data") if isinstance(base.get("data"), dict) else {}
            return [f"--{key}={value}" for key in self.sets if key != "data.seed" or "seed" in data]
        if self.key == ABLATE:
            if value == "none":
                return ["--model.ablate=null"]
            blocks = ((base.get("model") or {}).get("ablate") or {}).get("blocks")
            spec = {"remove": value.split("+"), "blocks": blocks}
            return [f"--model.ablate={yaml.safe_dump(spec, default_flow_style=True).strip()}"]
        return [f"--{self.key}={value}"]


@dataclass(frozen=True)
class Cell:
    """One run of the grid: its name (its folder), the value of each axis and the arguments that set them."""

    name: str
    values: dict[str, str]
    overrides: tuple[str, ...]

    @property
    def seed(self) -> str | None:
        return self.values.get(SEED)

    @property
    def variant(self) -> str:
        """The values of every axis but the seed: ``ablate=attention`` (``-`` for a grid of seeds only)."""
        return ", ".join(f"{k}={v}" for k, v in self.values.items() if k != SEED) or "-"


@dataclass
class StudyCommand:
    """A ``train.py --study ...`` command split into its parts."""

    run_args: list[str]
    axes: list[Axis]
    options: StudyOptions
    print_config: bool = False


def requested(argv: list[str]) -> bool:
    """Whether a ``train.py`` command line asks for a study (``--study`` or any ``--study.<option>``)."""
    return any(t == "--study" or t.startswith(("--study=", "--study.")) for t in argv)


def split_values(text: str) -> list[str]:
    """``0,1,2`` -> ``["0", "1", "2"]``; commas inside brackets or braces stay (``[2,2],[4,4]``)."""
    out, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{("
        depth -= char in "]})"
        if char == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += char
    out.append(current.strip())
    return [v for v in out if v != ""]


def as_arg(value: Any) -> str:
    """A YAML value as a command-line value (``0.001``, ``null``, ``[2, 2]``)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def parse_command(argv: list[str]) -> StudyCommand:
    """Split ``argv`` into the train arguments, the grid (``KEY=V1,V2`` items and a study file) and the options."""
    from vitlab.cli_support import find_config

    run_args: list[str] = []
    items: list[str] = []
    option_args: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--study" or token.startswith("--study="):
            if token.startswith("--study="):
                items.append(token[len("--study="):])
            i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                items.append(argv[i])
                i += 1
            continue
        if token.startswith("--study."):
            key, sep, value = token[len("--study."):].partition("=")
            if not sep:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ValueError(f"--study.{key}: give a value (e.g. --study.{key}=VALUE)")
                value = argv[i + 1]
                i += 1
            option_args[key] = value
            i += 1
            continue
        run_args.append(token)
        i += 1
    print_config = "--print_config" in run_args or any(a.startswith("--print_config=") for a in run_args)
    run_args = [a for a in run_args if a != "--print_config" and not a.startswith("--print_config=")]

    grid: dict[str, list[str]] = {}
    file_options: dict[str, Any] = {}
    for item in items:
        if "=" in item:
            key, _sep, text = item.partition("=")
            if not key:
                raise ValueError(f"--study {item}: a grid item is KEY=V1,V2,... (e.g. seeds=0,1,2)")
            grid[key] = split_values(text)
            if not grid[key]:
                raise ValueError(f"--study {item}: no values for {key} (give e.g. {key}=V1,V2)")
        else:
            try:
                path = Path(find_config(item))
            except FileNotFoundError:
                raise FileNotFoundError(f"--study {item}: no such study file (a study file, e.g. configs/study_ablation.yaml, "
                                        "or grid items KEY=V1,V2,... such as seeds=0,1,2)") from None
            file_grid, file_options = _read_study_file(path)
            grid = {**file_grid, **{k: v for k, v in grid.items()}}
    if not grid:
        raise ValueError("--study: give the grid, e.g. --study seeds=0,1,2 ablate=none,attention, or a study file "
                         "(--study configs/study_ablation.yaml)")
    fields = {f.name for f in dataclasses.fields(StudyOptions)}
    options = dict(file_options)
    for key, text in option_args.items():
        if key not in fields:
            raise ValueError(f"--study.{key}: unknown study option{_did_you_mean(key, fields)}; options: {', '.join(sorted(fields))}")
        options[key] = text if key in ("name", "partition", "account") else yaml.safe_load(text)
    if isinstance(options.get("setup"), str):
        options["setup"] = [options["setup"]]
    if isinstance(options.get("seed_keys"), str):
        options["seed_keys"] = [options["seed_keys"]]
    study_options = StudyOptions(**options)
    return StudyCommand(run_args, _axes(grid, study_options.seed_keys), study_options, print_config)


def _read_study_file(path: Path) -> tuple[dict[str, list[str]], dict[str, Any]]:
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"--study {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(content, dict) or not isinstance(content.get("grid"), dict):
        raise ValueError(f"--study {path}: a study file is a mapping with a grid: section (e.g. grid: {{seeds: [0, 1, 2]}})")
    unknown = [k for k in content if k not in STUDY_FILE_KEYS]
    if unknown:
        raise ValueError(f"--study {path}: unknown key {unknown[0]}{_did_you_mean(unknown[0], STUDY_FILE_KEYS)}; "
                         f"keys: {', '.join(STUDY_FILE_KEYS)}")
    grid = {}
    for key, values in content["grid"].items():
        values = values if isinstance(values, list) else [values]
        grid[str(key)] = [as_arg(v) for v in values]
        if not grid[str(key)]:
            raise ValueError(f"--study {path}: grid.{key} is an empty list (give its values, e.g. [0, 1, 2])")
    options = {k: v for k, v in content.items() if k != "grid"}
    if "name" in options and options["name"] is not None:
        options["name"] = str(options["name"])
    return grid, options


def _did_you_mean(key: str, known) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _axes(grid: dict[str, list[str]], seed_keys: list[str]) -> list[Axis]:
    """Axes in the grid's order with the seeds last; aliases resolved; reserved and repeated keys refused."""
    axes: list[Axis] = []
    for key, values in grid.items():
        name = ALIASES.get(key, key)
        if key in seed_keys:
            raise ValueError(f"--study {key}=...: a seed sets {key} (--study.seed_keys: {', '.join(seed_keys)}); give "
                             "seeds=... instead")
        if any(key == r or key.startswith(r + ".") for r in RESERVED):
            raise ValueError(f"--study {key}=...: the study sets {key} for each cell itself (each cell is its own run folder); "
                             "not a grid key")
        if any(a.key == name for a in axes):
            raise ValueError(f"--study: {key} given twice (as {name})")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"--study {key}=...: {repeated[0]} is listed twice")
        if name == SEED:
            bad = [v for v in values if not re.fullmatch(r"[+-]?\d+", v)]
            if bad:
                raise ValueError(f"--study {key}={','.join(values)}: {bad[0]!r} is not an integer seed")
        if name == ABLATE:
            for value in values:
                parts = value.split("+")
                bad = [p for p in parts if p not in ABLATE_COMPONENTS and not (p == "none" and len(parts) == 1)]
                if bad:
                    raise ValueError(f"--study ablate={value}: unknown component {bad[0]!r}; valid: none, "
                                     f"{', '.join(ABLATE_COMPONENTS)} (join several with +, e.g. attention+mlp)")
        axes.append(Axis(name, tuple(values), tuple(seed_keys) if name == SEED else ()))
    return sorted(axes, key=lambda a: a.key == SEED)  # stable: the seeds last


def make_cells(axes: list[Axis], base: dict[str, Any]) -> list[Cell]:
    """Every combination of the axes' values, the seeds varying slowest (a study stopped early has whole seeds:
    every variant of its first seeds, so its paired comparisons can already be read)."""
    order = sorted(range(len(axes)), key=lambda i: axes[i].key != SEED)  # seeds first in the loop: slowest
    names = _short_names(axes)
    cells = []
    for combo in itertools.product(*(axes[i].values for i in order)):
        chosen = dict(zip((axes[i].key for i in order), combo))
        values = {a.key: chosen[a.key] for a in axes}  # display order: variants, then the seed
        name = "_".join(f"{names[a.key]}-{_safe(values[a.key])}" for a in axes)
        overrides = tuple(arg for a in axes for arg in a.overrides(values[a.key], base))
        cells.append(Cell(name, values, overrides))
    seen: dict[str, Cell] = {}
    for cell in cells:
        if cell.name in seen:
            raise ValueError(f"--study: cells {seen[cell.name].values} and {cell.values} would share the folder {cell.name} "
                             "(values that differ only in characters other than letters, digits, '.', '+' and '-')")
        seen[cell.name] = cell
    return cells


def _short_names(axes: list[Axis]) -> dict[str, str]:
    shorts = [a.short for a in axes]
    return {a.key: (a.short if shorts.count(a.short) == 1 else a.key) for a in axes}


def _safe(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", value).strip("_") or "_"


def default_name(logger_name: str, axes: list[Axis]) -> str:
    """``quickstart-ablate-seed``: the run name and the grid's keys."""
    return "-".join([_safe(logger_name), *(_safe(a.short) for a in axes)])
