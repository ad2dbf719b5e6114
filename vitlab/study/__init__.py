"""Studies: a grid of ordinary ``train.py`` runs over seeds and variants, run as one command.

``python train.py --config configs/quickstart.yaml --study seeds=0,1,2 ablate=none,attention`` (or a study file,
``--study configs/study_ablation.yaml``) makes one run folder per cell under ``<save_dir>/<study name>/``,
records the grid and each cell's status in ``study.json``, and runs the cells here (one at a time, one per GPU,
or ``--study.parallel N``), through submitit's local executor, or as a SLURM job array. Rerunning the command
skips finished cells and resumes the others from their ``last.ckpt``. ``python probe.py claims --study FOLDER``
then gives each claim over the seeds with its interval (:mod:`vitlab.analysis.studies`).

Modules: :mod:`~vitlab.study.grid` (the command line and the cells), :mod:`~vitlab.study.command` (checking,
recording, launching), :mod:`~vitlab.study.record` (the study folder), :mod:`~vitlab.study.launch` (where cells
run), :mod:`~vitlab.study.cell` (one cell), :mod:`~vitlab.study.train_cell` (its training process),
:mod:`~vitlab.study.runfolder` (reading a run folder).
"""

from __future__ import annotations

from typing import Any, Callable

from vitlab.study.grid import requested

__all__ = ["requested", "run_study"]


def run_study(argv: list[str], fit: Callable[[list[str]], Any]) -> dict[str, Any]:
    """Run the study ``argv`` asks for (see :func:`vitlab.study.command.run_study`)."""
    from vitlab.study.command import run_study as run

    return run(argv, fit)
