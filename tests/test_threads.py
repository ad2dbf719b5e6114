"""vitlab.threads and process set-up: torch threads, loader workers and OpenCV threads sized to the free cores,
OpenMP's spin policy, and start-up objects kept out of the garbage collections of a fit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import cv2
import pytest
import torch

import vitlab.threads as threads
from vitlab.cli_support import frozen_heap
from vitlab.data.transforms import seed_worker


@pytest.fixture
def fresh_sample(monkeypatch):
    monkeypatch.setattr(threads, "_BUSY", [])  # no sample reused from an earlier call
    monkeypatch.delenv("VITLAB_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before, before_cv2 = torch.get_num_threads(), cv2.getNumThreads()
    yield
    torch.set_num_threads(before)
    cv2.setNumThreads(before_cv2)


@pytest.mark.parametrize(
    "requested, cores, gpu, expected",
    [(2, 2, False, 0), (4, 1, False, 0), (2, 2, True, 1), (4, 8, False, 4), (8, 4, False, 3), (0, 8, True, 0)],
)
def test_loader_workers_within_the_cores_and_none_beside_cpu_training_on_two(requested, cores, gpu, expected):
    assert threads.loader_workers(requested, cores, gpu=gpu) == expected


def test_busy_cores_is_the_busy_share_of_this_process_cores_over_the_window(fresh_sample, monkeypatch):
    samples = iter([(1000.0, 5000.0), (1150.0, 5200.0)])  # 150 of 200 jiffies busy
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(samples))
    monkeypatch.setattr(threads, "_idle_policy_ticks", lambda: 0.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads.busy_cores(window_s=0.0) == pytest.approx(2 * 150 / 200)
    assert threads.busy_cores(window_s=0.0) == pytest.approx(1.5)  # reused within max_age_s: no new sample


def test_busy_cores_sees_a_process_spinning_on_one_of_the_cores(fresh_sample):
    cpus = sorted(os.sched_getaffinity(0))
    busy, total = threads._cpu_times(set(cpus))
    assert total > 0 and 0 <= busy <= total
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert threads._sample_busy(0.5) >= 0.5  # one busy process: about one core
    finally:
        spinner.kill()
        spinner.wait()


def test_busy_cores_leaves_out_idle_priority_processes(fresh_sample, monkeypatch):
    """An idle-priority process (vitlab's figure process warming up as a run starts) takes no core from torch:
    its CPU time is taken out of the busy share (it counted a whole core, and the quickstart trained on one thread)."""
    samples = iter([(1000.0, 5000.0), (1150.0, 5200.0)])  # 150 of 200 jiffies busy ...
    idle = iter([300.0, 400.0])  # ... 100 of them by idle-priority processes
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(samples))
    monkeypatch.setattr(threads, "_idle_policy_ticks", lambda: next(idle))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads.busy_cores(window_s=0.0) == pytest.approx(2 * (150 - 100) / 200)


def _ticks(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return float(fields[11]) + float(fields[12])  # utime + stime


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.exists("/proc/self/stat"), reason="Linux")
def test_idle_policy_ticks_count_idle_priority_processes_only():
    """Read from /proc: a SCHED_IDLE spinner's CPU time is in the sum, a normal spinner's is not."""
    idle = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"])
    normal = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 30
        while _ticks(idle.pid) < 5 or _ticks(normal.pid) < 50:  # both have run (the idle one when a core was free)
            if time.monotonic() > deadline:
                pytest.skip("the machine is too busy for an idle-priority process to run")
            time.sleep(0.1)
        before = _ticks(idle.pid)
        total = threads._idle_policy_ticks()
        after, normal_ticks = _ticks(idle.pid), _ticks(normal.pid)
        assert total >= before  # the idle spinner is counted ...
        assert total - after < normal_ticks  # ... the normal one is not (other idle processes apart)
    finally:
        for proc in (idle, normal):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("busy, expected", [(0.2, 2), (0.6, 1), (1.4, 1), (2.0, 1)])
def test_configure_threads_leaves_busy_cores_to_others_and_says_so(fresh_sample, monkeypatch, capsys, busy, expected):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    cv2.setNumThreads(4)
    assert threads.configure_threads() == expected == torch.get_num_threads()
    assert cv2.getNumThreads() == 1  # OpenCV does not compete with torch's threads
    message = capsys.readouterr().err
    if expected < 2:
        assert f"keep {busy:.1f} of this run's 2 cores busy: torch trains on 1 thread " in message
        assert "VITLAB_THREADS=N" in message
    else:
        assert message == ""


def test_configure_threads_keeps_the_users_count(fresh_sample, monkeypatch):
    monkeypatch.setenv("VITLAB_THREADS", "3")
    monkeypatch.setattr(threads, "busy_cores", lambda: pytest.fail("no sampling when the user chose"))
    assert threads.configure_threads() == 3 == torch.get_num_threads()


class _CV2Threads(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return cv2.getNumThreads()


def test_loader_workers_run_opencv_on_one_thread():
    before = cv2.getNumThreads()
    cv2.setNumThreads(3)  # what a forked worker inherits
    try:
        loader = torch.utils.data.DataLoader(_CV2Threads(), batch_size=1, num_workers=1, worker_init_fn=seed_worker)
        assert [int(b) for b in loader] == [1, 1]
        control = torch.utils.data.DataLoader(_CV2Threads(), batch_size=1, num_workers=1)
        assert [int(b) for b in control] == [3, 3]
    finally:
        cv2.setNumThreads(before)


@pytest.mark.parametrize(
    "env, expected",
    [({}, "10000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, None), ({"GOMP_SPINCOUNT": "500"}, "500")],
)
def test_importing_vitlab_bounds_openmp_spinning_unless_the_user_chose(env, expected):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, vitlab; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


def test_frozen_heap_freezes_survivors_for_the_fit_only():
    gc.unfreeze()
    with frozen_heap():
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("cores, workers, busy, expected", [(2, 1, 0.0, 1), (8, 2, 0.0, 6), (8, 2, 2.2, 4), (4, 9, 0.0, 1)])
def test_configure_threads_leaves_a_core_to_each_loader_worker(fresh_sample, monkeypatch, cores, workers, busy, expected):
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    assert threads.configure_threads(workers) == expected


def test_data_modules_report_the_worker_processes_their_loaders_run(tiny_dataset, monkeypatch):
    from vitlab.data import DenseDataModule, MedicalDataModule

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    classification = MedicalDataModule(tiny_dataset, num_workers=2, batch_size=4)
    assert classification.worker_processes == 0  # batches load in the training process
    assert classification.train_dataloader().num_workers == 0
    assert DenseDataModule(tiny_dataset, num_workers=2).worker_processes == 2  # kept as configured
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    assert classification.worker_processes == 2 == classification.train_dataloader().num_workers
