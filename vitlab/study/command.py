"""``train.py --config CONFIG --study KEY=V1,V2 ...``: check the grid, record it, run what is not done yet.

Every grid value is checked by ``train.py``'s own parser before anything runs: each value is parsed as a
``train.py`` command line would be (``fit(... --print_config)``), so a key the parser does not know, or a value
its type refuses, gets the parser's own one-line error, prefixed with the grid item.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from vitlab.study.cell import BUSY
from vitlab.study.grid import ABLATE, SEED, Axis, StudyCommand, default_name, make_cells, parse_command
from vitlab.study.record import DONE, FAILED, StudyFolder


class StudyError(RuntimeError):
    """A study that ran but left cells failed (one line: which, and where their logs are)."""


class _Checker:
    """Parses ``train.py`` command lines with ``fit``'s parser, without building anything (``--print_config``)."""

    def __init__(self, fit: Callable[[list[str]], Any]) -> None:
        self.fit = fit

    def config(self, args: list[str], item: str | None = None) -> dict[str, Any]:
        """The parsed config of ``args`` as a dict; a ValueError with the parser's one line (prefixed by ``item``)."""
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.fit([*args, "--print_config"])
        except SystemExit as exit_:
            if exit_.code in (0, None):
                return yaml.safe_load(out.getvalue()) or {}
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            message = next((line for line in lines if line.startswith("vitlab: error:")), lines[-1] if lines else f"exit {exit_.code}")
        except (ValueError, FileNotFoundError) as error:
            message = str(error)
        else:
            return yaml.safe_load(out.getvalue()) or {}
        message = message.removeprefix("vitlab: error:").strip()
        raise ValueError(f"{item}: {message}" if item else message)


def _logger_dirs(base: dict[str, Any]) -> tuple[str, str]:
    """(save_dir, name) of the base config's TensorBoard logger; refused without one."""
    logger = (base.get("trainer") or {}).get("logger")
    if not isinstance(logger, dict) or not str(logger.get("class_path", "")).endswith("TensorBoardLogger"):
        raise ValueError(f"--study: each cell is a run folder of a TensorBoardLogger; trainer.logger is {logger!r} "
                         "(set it to pytorch_lightning.loggers.TensorBoardLogger)")
    init = logger.get("init_args") or {}
    return str(init.get("save_dir") or "runs"), str(init.get("name") or "vitlab")


def baseline_variant(axes: list[Axis]) -> str:
    """The variant paired differences are taken against: ``ablate=none`` when listed, else each axis's first value."""
    parts = [f"{a.key}={'none' if a.key == ABLATE and 'none' in a.values else a.values[0]}" for a in axes if a.key != SEED]
    return ", ".join(parts) or "-"


def plan_study(command: StudyCommand, fit: Callable[[list[str]], Any]) -> tuple[StudyFolder, dict[str, Any]]:
    """The study folder and the record of ``command``'s grid, every value checked by ``train.py``'s parser."""
    if any(a == "--ckpt_path" or a.startswith("--ckpt_path=") for a in command.run_args):
        raise ValueError("--study: no --ckpt_path (rerun the same study command: it resumes each unfinished cell from its last.ckpt)")
    checker = _Checker(fit)
    base = checker.config(command.run_args)
    save_dir, run_name = _logger_dirs(base)
    for axis in command.axes:
        for value in axis.values:
            checker.config(command.run_args + axis.overrides(value, base), f"--study {axis.key}={value}")
    folder = StudyFolder(Path(save_dir) / (command.options.name or default_name(run_name, command.axes)))
    cells = []
    for cell in make_cells(command.axes, base):
        logger = [f"--trainer.logger.init_args.save_dir={folder.path}", f"--trainer.logger.init_args.name={cell.name}",
                  "--trainer.logger.init_args.version=null", "--trainer.enable_progress_bar=false"]  # output: a log file
        cells.append({"name": cell.name, "values": cell.values, "seed": cell.seed, "variant": cell.variant,
                      "run": f"{cell.name}/version_0", "args": [*command.run_args, *cell.overrides, *logger]})
    plan = {"name": folder.path.name, "cwd": os.getcwd(), "base_args": command.run_args, "base_config": base,
            "grid": [{"key": a.key, "values": list(a.values), **({"sets": list(a.sets)} if a.sets else {})} for a in command.axes],
            "baseline": baseline_variant(command.axes), "cells": cells, "options": dataclasses.asdict(command.options)}
    return folder, plan


def _machine(base: dict[str, Any]) -> tuple[bool, int, list[int]]:
    """(trains on GPUs, visible GPUs, usable cores) for the base config on this machine."""
    import torch

    accelerator = str((base.get("trainer") or {}).get("accelerator") or "auto").lower()
    gpus = torch.cuda.device_count() if accelerator != "cpu" else 0
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    return gpus > 0, gpus, cores


def run_study(argv: list[str], fit: Callable[[list[str]], Any]) -> dict[str, Any]:
    """``train.py ... --study ...``: plan and check the grid, then run every cell not done yet; returns the record.

    ``fit`` is :func:`vitlab.cli.fit` (given, not imported, so that this package does not import the CLI).
    """
    command = parse_command(argv)
    folder, plan = plan_study(command, fit)
    options = command.options
    if command.print_config:  # the plan, checked: nothing runs, nothing is written
        view = {"study": str(folder.path), "launcher": options.launcher, "parallel": options.parallel,
                "grid": {axis["key"]: axis["values"] for axis in plan["grid"]}, "baseline": plan["baseline"],
                "cells": [{"name": c["name"], "command": "python train.py " + shlex.join(c["args"])} for c in plan["cells"]]}
        print(yaml.safe_dump(view, sort_keys=False, width=1000), end="")
        sys.exit(0)
    record = folder.open(plan)
    names = [c["name"] for c in record["cells"]]
    todo = [n for n in names if folder.status(n) != DONE]
    print(f"vitlab: study {folder.path}: {len(names)} cells ({len(names) - len(todo)} done), launcher {options.launcher}",
          file=sys.stderr)
    done_count = [len(names) - len(todo)]

    def report(name: str, status: str) -> None:
        state = folder.state(name)
        done_count[0] += status == DONE
        extra = f" in {state['wall_s']:.0f} s" if status == DONE and state.get("wall_s") is not None else ""
        if state.get("resumed_from") and status == DONE:
            extra += " (resumed from its last.ckpt)"
        if status == FAILED:
            extra = f": {state.get('error')} (log: {folder.log_path(name)})"
        if status == BUSY:
            extra = ": another process is running it"
        print(f"vitlab: study: [{done_count[0]}/{len(names)}] {name}: {status}{extra}", file=sys.stderr)
        record["status"] = {n: folder.status(n) for n in names}
        folder.save(record)

    from vitlab.study import launch

    on_gpu, gpus, cores = _machine(record["base_config"])
    started = time.time()
    try:
        if options.launcher == "local":
            launch.run_local(folder, todo, launch.slots(options.parallel, on_gpu, gpus, cores, options.gpus_per_run), report)
        elif options.launcher == "submitit_local":
            launch.run_submitit_local(folder, todo, options, on_gpu, report)
        else:
            launch.submit_slurm(folder, record, todo, options, report)
    except KeyboardInterrupt:
        print(f"\nvitlab: study interrupted; rerun the same command to resume it ({folder.path})", file=sys.stderr)
        sys.exit(130)
    record["status"] = {n: folder.status(n) for n in names}
    record["wall_s"] = round(time.time() - started, 1)
    folder.save(record)
    unfinished = [n for n in names if record["status"][n] != DONE]
    if options.launcher == "slurm":
        print(f"vitlab: study: submitted; rerun this command to see the cells' progress and resubmit any that stopped "
              f"(job logs: {folder.path / 'submitit'})", file=sys.stderr)
    elif unfinished:
        elsewhere = sum(folder.busy(n) for n in unfinished)
        raise StudyError(f"study {folder.path}: {len(unfinished)} of {len(names)} cells did not finish here "
                         f"({', '.join(unfinished[:3])}{', ...' if len(unfinished) > 3 else ''}; {elsewhere} of them running in "
                         f"another process; logs: {folder.path / 'cells'}); rerun the same command to retry them")
    else:
        print(f"\nvitlab: study finished: {len(names)} runs in {folder.path} ({record['wall_s']:.0f} s)\n"
              f"  claims over the seeds : python probe.py claims --study {folder.path}\n"
              f"  view it with          : tensorboard --logdir {folder.path} --host 127.0.0.1")
    return record
