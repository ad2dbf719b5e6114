"""A study folder: what it records and how each cell's state is kept.

``<study>/study.json`` records the grid, the base config (the ``train.py`` config every cell starts from, as the
parser read it), each cell's arguments and run folder, and their status. A folder made from another grid or
another base config is refused. Each cell's own state is ``<study>/cells/<cell>.json`` (written only by the
process that runs the cell) beside its log ``<cell>.log`` and its lock ``<cell>.lock``, held for as long as a
process trains the cell: a second command (or a SLURM job submitted twice) finds it held and leaves the cell
alone, so no run is trained twice. The runs are ``<study>/<cell>/version_0``, ordinary run folders.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vitlab.outputs.files import write_json

FORMAT = 1
DONE, FAILED, INTERRUPTED, RUNNING, PENDING, QUEUED = "done", "failed", "interrupted", "running", "pending", "queued"


def _first_difference(a: Any, b: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first dotted key where two nested dicts differ, with both values (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            found = _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if a == b else (prefix.rstrip("."), a, b)


def grid_text(grid: list[dict[str, Any]]) -> str:
    return " ".join(f"{axis['key']}={','.join(axis['values'])}" + (f" [sets {', '.join(axis['sets'])}]" if axis.get("sets") else "")
                    for axis in grid)


class StudyFolder:
    """The study folder ``path`` and its record (``study.json``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.record_path = self.path / "study.json"

    def exists(self) -> bool:
        return self.record_path.is_file()

    def load(self) -> dict[str, Any]:
        if not self.exists():
            raise FileNotFoundError(f"{self.path}: no study here (no study.json; a study folder is made by "
                                    "train.py --config CONFIG --study KEY=V1,V2 ...)")
        return json.loads(self.record_path.read_text())

    def save(self, record: dict[str, Any]) -> None:
        record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(self.record_path, record)

    def open(self, plan: dict[str, Any]) -> dict[str, Any]:
        """The record for ``plan`` (grid, base config, cells): new, or the folder's own when it holds the same grid
        and base config (cell arguments and options refreshed); another grid or base config is refused."""
        if self.exists():
            old = self.load()
            if old.get("grid") != plan["grid"]:
                raise ValueError(f"{self.path} holds a study of another grid (there: {grid_text(old.get('grid', []))}; this command: "
                                 f"{grid_text(plan['grid'])}): rerun that grid, or give the new one its own --study.name")
            diff = _first_difference(old.get("base_config"), plan["base_config"])
            if diff:
                key, was, now = diff
                raise ValueError(f"{self.path} holds a study of another config ({key}: {was!r} there, {now!r} in this command): "
                                 "rerun it with its own config, or give this one its own --study.name")
            record = {**old, **{k: v for k, v in plan.items() if k not in ("created",)}}
        else:
            record = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **plan, "jobs": {}}
        (self.path / "cells").mkdir(parents=True, exist_ok=True)
        self.save(record)
        return record

    # ------------------------------------------------------------------------------------------------ cells

    def run_path(self, name: str) -> Path:
        return self.path / name / "version_0"

    def state_path(self, name: str) -> Path:
        return self.path / "cells" / f"{name}.json"

    def log_path(self, name: str) -> Path:
        return self.path / "cells" / f"{name}.log"

    def state(self, name: str) -> dict[str, Any]:
        path = self.state_path(name)
        return json.loads(path.read_text()) if path.is_file() else {"status": PENDING}

    def write_state(self, name: str, state: dict[str, Any]) -> None:
        write_json(self.state_path(name), state)

    def status(self, name: str) -> str:
        """``done`` / ``failed`` / ``interrupted`` / ``running`` (a process holds the cell) / ``pending``."""
        status = self.state(name).get("status", PENDING)
        if status == RUNNING and not self.busy(name):
            return INTERRUPTED  # its process ended without saying how (killed)
        return status

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[int | None]:
        """Hold the cell's lock (an exclusive ``flock``): yields its file descriptor, or None when another process holds
        it. A child given the descriptor (``pass_fds``) keeps the lock held until it ends too."""
        path = self.path / "cells" / f"{name}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            yield fd
        finally:
            os.close(fd)

    def busy(self, name: str) -> bool:
        """Whether a process holds the cell's lock now."""
        with self.lock(name) as fd:
            return fd is None
