"""The GPU benchmarks run where no GPU is: they are the measure of vitlab's GPU speed, and a GPU machine is lent for
minutes at a time, so a benchmark broken by a change must fail here, not there. ``--smoke`` runs the whole script
on tiny models on the CPU (it measures nothing); without it, a machine without a GPU gets one line and exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the scripts would measure")
@pytest.mark.parametrize("script", ["bench_gpu.py", "bench_gpu_ladder.py"])
def test_without_a_gpu_the_gpu_benchmarks_say_so_in_one_line(script):
    done = _run(script, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]


def test_bench_gpu_smoke_runs_both_tasks_and_a_variant(tmp_path):
    """Data made on the machine, the bare loops, vitlab's fits in new processes (the default one profiled), the fit fed
    from memory, the report and its JSON."""
    done = _run("bench_gpu.py", "--smoke", "--task", "vit", "swinunetr", "--variants", "memdata", "--epochs", "2",
                "--out", str(tmp_path))
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    for run in ("vit/default", "vit/memdata", "swinunetr/default"):
        figures = results[run]
        assert figures["train_ips"] > 0 and figures["epoch_ips"] > 0 and figures["step_ms"] > 0, run
    for task in ("vit", "swinunetr"):
        assert results[f"{task}/bare"]["train_ips"] > 0
    # the default ViT run's 5 profiled steps and the profiler's own time are left out of its epoch's figures
    assert results["vit/default"]["profiled_s"] > 0 and results["vit/memdata"]["profiled_s"] == 0
    # the smoke runs put the Q/K/V work and the checkpoints on their threads, as beside a GPU: both are timed there,
    # and the Q/K/V work is reported against the epoch
    for run in ("vit/default", "swinunetr/default"):
        assert results[run]["background_writes"] > 0 and results[run]["qkv_jobs"] > 0, run
        assert results[run]["qkv_done_after_s"] > 0, run
    assert "vit Q/K/V work of an epoch: done" in done.stdout
    assert (tmp_path / "profile_vit.txt").read_text().startswith("torch.profiler over 5 training steps")
    assert "vit whole epoch:" in done.stdout and "x bare" in done.stdout
