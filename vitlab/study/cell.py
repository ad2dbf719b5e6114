"""Run one cell of a study: a ``train.py`` run in its own process, resumed from its ``last.ckpt`` when an earlier
attempt was stopped, never while another process runs it, and marked done only when it finished.

:func:`run_cell` is what every launcher calls: a thread of ``train.py --study`` (local), or a submitit job on this
machine or on a SLURM node. It needs only the study folder and the cell's name (the arguments are in
``study.json``) and returns the cell's status.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from vitlab.study.record import DONE, FAILED, INTERRUPTED, RUNNING, StudyFolder

TRAIN_MODULE = "vitlab.study.train_cell"  # the training process's entry point: train.py's own fit
BUSY = "busy"


def cell_command(folder: StudyFolder, name: str, record: dict) -> tuple[list[str], Path | None]:
    """(the ``train.py`` arguments of this attempt, the checkpoint it resumes from or None)."""
    cell = next(c for c in record["cells"] if c["name"] == name)
    args = list(cell["args"])
    from vitlab.study.runfolder import RunFolder

    ckpt = RunFolder(folder.run_path(name)).last_checkpoint
    if ckpt is not None:
        args += ["--ckpt_path", str(ckpt)]
    return args, ckpt


def run_cell(study: str | os.PathLike, name: str, env: dict[str, str] | None = None) -> str:
    """Train cell ``name`` of the study folder ``study`` to the end; returns ``done``, ``failed``, ``interrupted``
    or ``busy`` (another process holds it). ``env``: extra environment of the training process (its GPUs / cores).

    A done cell is left as it is. A cell with a ``last.ckpt`` resumes from it (``--ckpt_path``: its TensorBoard
    keeps one point per step); a cell without one starts again from nothing, its partial ``version_0`` (no
    checkpoint to resume, so nothing of value) removed first so that the run is ``version_0`` again. The exit
    status and the CPU seconds of the training process go into the cell's state (``cells/<cell>.json``).
    """
    folder = StudyFolder(study)
    with folder.lock(name) as fd:
        if fd is None:
            return BUSY
        state = folder.state(name)
        if state.get("status") == DONE:
            return DONE
        record = folder.load()
        args, ckpt = cell_command(folder, name, record)
        attempt = int(state.get("attempts", 0)) + 1
        if ckpt is None:
            others = sorted(p.name for p in (folder.path / name).glob("*") if p.name != "version_0")
            if others:  # e.g. a repeat made from the cell's config.yaml: not the study's to remove
                folder.write_state(name, {**state, "status": FAILED, "attempts": attempt, "error": (
                    f"{folder.path / name} holds {', '.join(others)} beside the study's version_0, which has no "
                    "checkpoint to resume: move them out of the study folder to run this cell again")})
                return FAILED
            shutil.rmtree(folder.run_path(name), ignore_errors=True)
        started = time.time()
        new_state = {"status": RUNNING, "attempts": attempt, "resumed_from": str(ckpt) if ckpt else None,
                     "host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "log": str(folder.log_path(name))}
        folder.write_state(name, new_state)
        child_env = {**os.environ, **(env or {}), "VITLAB_STUDY_PARENT": str(os.getpid())}
        with open(folder.log_path(name), "a") as log:
            log.write(f"\n=== attempt {attempt} ({new_state['started']}, {new_state['host']}): python -m {TRAIN_MODULE} "
                      f"{' '.join(args)}\n")
            log.flush()
            process = subprocess.Popen([sys.executable, "-m", TRAIN_MODULE, *args], cwd=record["cwd"], env=child_env,
                                       stdout=log, stderr=subprocess.STDOUT, pass_fds=(fd,))  # the child holds the lock too
            code, cpu_s = _wait(process)
        status = DONE if code == 0 else INTERRUPTED if code in (130, -2, -9, -15) else FAILED
        folder.write_state(name, {**new_state, "status": status, "returncode": code,
                                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": round(time.time() - started, 1),
                                  "cpu_s": cpu_s, "error": None if code == 0 else _last_error(folder.log_path(name))})
        return status


def _wait(process: subprocess.Popen) -> tuple[int, float | None]:
    """(exit status, CPU seconds of the process and the children it waited for: user + system), as ``wait4`` gives
    them: the cell's own CPU time, whatever else the machine runs."""
    if not hasattr(os, "wait4"):  # not POSIX
        return process.wait(), None
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, round(usage.ru_utime + usage.ru_stime, 1)


def _last_error(log: Path) -> str:
    """The line of the cell's log that says what went wrong (vitlab's one-line errors, else the last line)."""
    text = log.read_text(errors="replace")
    text = text[text.rfind("\n=== attempt "):]  # this attempt's output
    lines = [line.rstrip() for line in text.splitlines()[2:] if line.strip()]
    errors = [line for line in lines if line.startswith("vitlab: error:") or "Error" in line.split(":", 1)[0]]
    return (errors or lines or ["(no output)"])[-1][:500]
