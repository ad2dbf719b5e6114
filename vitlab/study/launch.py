"""Where a study's cells run: here, one after another or several at once (one per GPU, or a share of the cores
each), through submitit's local executor, or as one SLURM job array through submitit.

Every launcher ends up in :func:`vitlab.study.cell.run_cell` for each cell, which skips a finished cell, resumes
an interrupted one and refuses one that another process runs.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from vitlab.study.cell import BUSY, run_cell
from vitlab.study.grid import StudyOptions
from vitlab.study.record import DONE, INTERRUPTED, QUEUED, StudyFolder

SLURM_ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED", "REQUEUE_HOLD")
Report = Callable[[str, str], None]  # (cell, status) as each cell ends


def slots(parallel: int | str, on_gpu: bool, gpus: int, cores: Sequence[int], gpus_per_run: int = 1) -> list[dict[str, str]]:
    """The environment of each run that may go at once (one dict per slot).

    On GPUs: ``gpus // gpus_per_run`` slots by default, each with its own ``CUDA_VISIBLE_DEVICES``. On the CPU: one
    slot with nothing changed (a run takes every core, as ``train.py`` alone does), or ``parallel`` slots sharing
    out ``cores`` (``VITLAB_STUDY_CPUS``: the run's affinity, so ``runtime.threads: auto`` resolves to its share;
    ``OMP_NUM_THREADS`` where affinity cannot be set).
    """
    if on_gpu and gpus > 0:
        per = max(1, gpus_per_run)
        count = max(1, gpus // per) if parallel == "auto" else int(parallel)
        return [{"CUDA_VISIBLE_DEVICES": ",".join(str((i * per + g) % gpus) for g in range(per))} for i in range(count)]
    count = 1 if parallel == "auto" else int(parallel)
    if count == 1:
        return [{}]
    cores = list(cores)
    shares = [cores[i::count] or [cores[i % len(cores)]] for i in range(count)]
    return [{"VITLAB_STUDY_CPUS": ",".join(map(str, sorted(share))), "OMP_NUM_THREADS": str(len(share))} for share in shares]


def run_local(folder: StudyFolder, names: list[str], env_slots: list[dict[str, str]], report: Report) -> dict[str, str]:
    """Run ``names`` here, at most one per slot at a time; Ctrl-C stops starting new ones (the running ones stop
    too: they get the same signal) and raises KeyboardInterrupt once they have."""
    free: queue.Queue[dict[str, str]] = queue.Queue()
    for env in env_slots:
        free.put(env)
    stop = threading.Event()
    results: dict[str, str] = {}

    def one(name: str) -> str:
        if stop.is_set():
            return INTERRUPTED
        env = free.get()
        try:
            return INTERRUPTED if stop.is_set() else run_cell(folder.path, name, env)
        finally:
            free.put(env)

    with ThreadPoolExecutor(max_workers=len(env_slots)) as pool:
        futures = {pool.submit(one, name): name for name in names}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in finished:
                    results[futures[future]] = future.result()
                    report(futures[future], results[futures[future]])
        except KeyboardInterrupt:
            stop.set()
            for future in pending:
                future.cancel()
            wait(pending)
            raise
    return results


def _executor(folder: StudyFolder, options: StudyOptions, cluster: str, count: int, on_gpu: bool):
    import submitit

    executor = submitit.AutoExecutor(folder=str(folder.path / "submitit"), cluster=cluster)
    params: dict[str, Any] = {"timeout_min": options.time, "name": f"vitlab-{folder.path.name}",
                              "gpus_per_node": options.gpus_per_run if (on_gpu or cluster == "slurm") else 0}
    if cluster == "slurm":
        params.update(slurm_partition=options.partition, slurm_account=options.account, cpus_per_task=options.cpus_per_run,
                      mem_gb=options.mem_gb, slurm_setup=list(options.setup),
                      slurm_array_parallelism=count if options.parallel == "auto" else int(options.parallel))
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def run_submitit_local(folder: StudyFolder, names: list[str], options: StudyOptions, on_gpu: bool, report: Report) -> dict[str, str]:
    """Run ``names`` as jobs of submitit's local executor (each job a ``run_cell``), ``parallel`` (default 1) at a time."""
    executor = _executor(folder, options, "local", len(names), on_gpu)
    limit = 1 if options.parallel == "auto" else int(options.parallel)
    todo, running, results = list(names), {}, {}
    try:
        while todo or running:
            while todo and len(running) < limit:
                name = todo.pop(0)
                running[name] = executor.submit(run_cell, str(folder.path), name)
            time.sleep(0.2)
            for name, job in list(running.items()):
                if job.done():
                    del running[name]
                    try:
                        results[name] = job.result()
                    except Exception as err:  # noqa: BLE001 - the job's own failure (its traceback is in its log)
                        print(f"vitlab: study: cell {name}: submitit job failed: {str(err).strip().splitlines()[-1]}", file=sys.stderr)
                        results[name] = folder.status(name)
                    report(name, results[name])
    except KeyboardInterrupt:
        for job in running.values():
            job.cancel(check=False)
        raise
    return results


def submit_slurm(folder: StudyFolder, record: dict[str, Any], names: list[str], options: StudyOptions, report: Report) -> dict[str, str]:
    """Submit the cells that are neither done nor queued / running under an earlier job as one SLURM job array and
    return at once (the jobs' ids go into ``study.json``; rerun the command to see them and resubmit what stopped)."""
    import submitit

    jobs: dict[str, str] = record.setdefault("jobs", {})
    earlier = {name: submitit.SlurmJob(folder=str(folder.path / "submitit"), job_id=jobs[name]) for name in names if name in jobs}
    if earlier:
        submitit.SlurmJob.watcher.update()  # one sacct call for them all
    results, submit = {}, []
    for name in names:
        job_id = jobs.get(name)
        state = submitit.SlurmJob.watcher.get_state(job_id, mode="cache") if name in earlier else None
        if state in SLURM_ACTIVE:
            results[name] = QUEUED
            report(name, f"{QUEUED} (SLURM job {job_id}: {state})")
        else:
            submit.append(name)
    if submit:
        executor = _executor(folder, options, "slurm", len(submit), True)
        submitted = executor.map_array(run_cell, [str(folder.path)] * len(submit), submit)
        for name, job in zip(submit, submitted):
            jobs[name] = job.job_id
            results[name] = QUEUED
            report(name, f"{QUEUED} (SLURM job {job.job_id})")
        folder.save(record)
    return results


__all__ = ["slots", "run_local", "run_submitit_local", "submit_slurm", "BUSY", "DONE"]
