"""A study cell's training process: ``python -m vitlab.study.train_cell <train.py arguments>``.

``train.py``'s own fit, plus what a process run for a study needs: it ends with the process that started it
(Linux: ``PR_SET_PDEATHSIG``; a killed study leaves no run training on its own), it runs on the cores it was
given (``VITLAB_STUDY_CPUS``, set before torch is imported, so ``runtime.threads: auto`` resolves to them), and
its exit status tells finished (0) from interrupted (130) and failed (1, or 2 for a one-line user error).
"""

from __future__ import annotations

import os
import signal
import sys


def _end_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.environ.get("VITLAB_STUDY_PARENT")
    if parent and os.getppid() != int(parent):  # the parent ended before the line above
        os._exit(130)


def _restrict_cores() -> None:
    cores = os.environ.get("VITLAB_STUDY_CPUS")
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


def main(args: list[str] | None = None) -> None:
    _end_with_parent()
    _restrict_cores()
    from vitlab.cli import _exit_with_message, fit

    try:
        cli = fit(list(sys.argv[1:] if args is None else args))
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        _exit_with_message(err)
        return
    if cli.trainer.interrupted:
        print("vitlab: the run was interrupted; rerunning the study resumes it", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
