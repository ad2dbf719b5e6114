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


def _session(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``benchmarks/gpu_session.sh`` as a lent GPU machine runs it, its temp files under ``tmp_path``."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), str(out)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    return done, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the scripts would measure")
def test_without_a_gpu_the_session_script_keeps_each_benchmarks_line(tmp_path):
    done, out = _session(tmp_path, GPU_SESSION_LADDER="1")
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("bench_gpu.txt", "ladder.txt"):
        text = (out / name).read_text()
        assert "no CUDA GPU" in text and "exit status 0" in text, text
    tests = (out / "cudatests.txt").read_text()  # (the CUDA-only tests, skipped here)
    assert "skipped" in tests and "failed" not in tests and "CUDA tests exit status 0" in tests, tests
    assert all(path.is_file() for path in out.iterdir())


def test_bench_gpu_smoke_runs_both_tasks_and_a_variant(tmp_path):
    """Through the session script a lent GPU machine runs: data made on the machine, the bare loops, vitlab's fits in
    new processes (the default one profiled), the fit fed from memory, the report and its JSON; what comes back is a
    few files (the data and runs stay in the temp folder)."""
    done, out = _session(tmp_path, GPU_SESSION_SMOKE="1", GPU_SESSION_LADDER="0", GPU_SESSION_TESTS="0",
                         BENCH_GPU_ARGS="--task vit swinunetr --variants memdata --epochs 2")
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert sorted(path.name for path in out.iterdir()) == ["bench_gpu.json", "bench_gpu.txt", "results.tar.gz"]
    report = (out / "bench_gpu.txt").read_text()
    assert "bench_gpu.py exit status 0" in report
    results = json.loads((out / "bench_gpu.json").read_text())
    for run in ("vit/default", "vit/memdata", "swinunetr/default"):
        figures = results[run]
        assert figures["train_ips"] > 0 and figures["epoch_ips"] > 0 and figures["step_ms"] > 0, run
    for task in ("vit", "swinunetr"):
        assert results[f"{task}/bare"]["train_ips"] > 0
    # SwinUNETR's bare loop also as a plain MONAI loop, its masks made at every forward, and the ratio to it
    assert results["swinunetr/bare"]["monai_masks_train_ips"] > 0 and "the bare loop with MONAI's own masks" in report
    # the default ViT run's 5 profiled steps and the profiler's own time are left out of its epoch's figures
    assert results["vit/default"]["profiled_s"] > 0 and results["vit/memdata"]["profiled_s"] == 0
    # the smoke runs put the Q/K/V work and the checkpoints on their threads, as beside a GPU: both are timed there,
    # and the Q/K/V work is reported against the epoch
    for run in ("vit/default", "swinunetr/default"):
        assert results[run]["background_writes"] > 0 and results[run]["qkv_jobs"] > 0, run
        assert results[run]["qkv_done_after_s"] > 0, run
    assert "vit Q/K/V work of an epoch: done" in report
    # every epoch's own figures, and the fit's end (the background work drained, once a fit) apart from the last epoch
    for run in ("vit/default", "swinunetr/default"):
        epochs, end = results[run]["per_epoch"], results[run]["fit_end_s"]
        assert len(epochs) == 2 and all(e["epoch_s"] >= e["train_s"] > 0 for e in epochs) and end > 0, run
    assert "fit end" in report
    # the loader's waits in validation apart from the training steps', and the first epoch's seconds (compilation)
    for run in ("vit/default", "swinunetr/default"):
        figures = results[run]
        assert all(e["val_fetch_s"] >= 0 and e["fetch_s"] > 0 for e in figures["per_epoch"]), run
        assert figures["first_epoch_s"] > 0 and figures["first_epoch_s"] == pytest.approx(figures["per_epoch"][0]["epoch_s"], abs=1e-3), run
        # (Lightning's sanity check before the first epoch, where model.compile compiles validation's graph; none for the
        # SwinUNETR recipe, which validates every tenth epoch)
        assert (figures["sanity_s"] > 0) == (run == "vit/default"), run
    assert results["vit/default"]["val_fetch_s"] > 0 and "waiting for batches" in report and "first epoch" in report
    # the paired probe: bare steps between the default ViT run's steps (its first epoch here: the last is profiled), in
    # the fit's process, each synchronised; their steps and time left out of that epoch's figures; none in the variant
    paired = results["vit/default"]["paired"]
    assert paired["pairs"] >= 1 and paired["epoch"] == 1, paired
    assert all(paired[key] > 0 for key in ("vitlab_ms", "vitlab_host_ms", "bare_ms", "bare_host_ms", "bare_alone_ms")), paired
    assert paired["vitlab_host_ms"] <= paired["vitlab_ms"] and paired["bare_host_ms"] <= paired["bare_ms"], paired
    first = results["vit/default"]["per_epoch"][0]
    assert first["paired_left_out_s"] > 0 and results["vit/default"]["per_epoch"][1]["paired_left_out_s"] == 0
    assert results["vit/memdata"]["paired"] is None and "vit: paired in the fit's process, epoch 1" in report
    import shutil

    if shutil.which("py-spy"):  # (a tool of the GPU session's wheels, not a dependency): the default runs sampled
        assert "vit: py-spy" in report and "swinunetr: py-spy" in report
    import tarfile

    with tarfile.open(out / "results.tar.gz") as archive:
        names = archive.getnames()
        assert "gpu/bench_gpu.json" in names and "gpu/profile_vit.txt" in names, names
        profile = archive.extractfile("gpu/profile_vit.txt").read().decode()
    assert profile.startswith("torch.profiler over 5 training steps")
    assert "vit whole epoch:" in report and "x bare" in report


def test_the_py_spy_summary_counts_the_training_threads_samples_and_the_locks_other_holders():
    """``bench_gpu.py``'s reading of py-spy's raw samples (``record --threads --format raw``; the process header may
    span lines, as a ``python -c`` command does): shares of the window of the training thread on a CPU and holding
    the interpreter's lock, the lock's other holders by thread name, the training thread's innermost frames."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    head = 'process 7:"python -c \nimport x\n";'
    active = "\n".join([
        head + "thread (7): MainThread;<module> (<string>:1);step (train.py:10) 150",
        head + "thread (7): MainThread;<module> (<string>:1);fetch (data.py:3) 50",
        head + "thread (9): vitlab-qkv;run (qkv.py:5) 120",
        head + "thread (11): pin_memory;loop (pin.py:2) 40",
    ])
    gil = "\n".join([
        head + "thread (7): MainThread;<module> (<string>:1);step (train.py:10) 100",
        head + "thread (9): vitlab-qkv;run (qkv.py:5) 200",
        head + "thread (11): pin_memory;loop (pin.py:2) 20",
    ])
    spy = bench.py_spy_summary(active, gil, tid=7, seconds=2, rate=200)
    window = 400
    assert spy["active_samples"] == 360 and spy["gil_samples"] == 320
    assert spy["training_on_cpu"] == pytest.approx(200 / window) and spy["training_holds_lock"] == pytest.approx(100 / window)
    assert spy["lock_held_by_others"] == pytest.approx({"vitlab-qkv": 200 / window, "pin_memory": 20 / window})
    assert list(spy["lock_held_by_others"]) == ["vitlab-qkv", "pin_memory"]  # (the largest first)
    assert spy["training_top_on_cpu"] == pytest.approx({"step (train.py:10)": 150 / window, "fetch (data.py:3)": 50 / window})
    line = bench.py_spy_line("vit", spy)
    assert "holding the interpreter's lock 25%" in line and "vitlab-qkv 50%" in line
    assert "py-spy, 2 s of the first epoch" in line
    assert "no samples" in bench.py_spy_line("vit", bench.py_spy_summary("", "", tid=7, seconds=2, rate=200))


def test_the_paired_probe_says_whether_the_fits_step_or_its_process_is_slow():
    """The paired probe's reading: vitlab's step against a bare step run beside it in the fit's process, and that bare
    step against the bare loop's in a process of its own (the medians of the pairs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.paired_summary([]) is None and bench.paired_line("vit", {"paired": None}) == ""
    pairs = [{"epoch": 2, "vitlab_s": v, "vitlab_host_s": v * 0.9, "bare_s": b, "bare_host_s": b * 0.3}
             for v, b in ((0.042, 0.029), (0.040, 0.028), (0.090, 0.030))]
    summary = bench.paired_summary(pairs)
    assert summary["pairs"] == 3 and summary["epoch"] == 3
    assert summary["vitlab_ms"] == pytest.approx(42.0) and summary["bare_ms"] == pytest.approx(29.0)  # (medians)
    assert summary["vitlab_host_ms"] == pytest.approx(37.8) and summary["bare_host_ms"] == pytest.approx(8.7)

    def line(vitlab_ms, bare_ms, alone_ms):
        return bench.paired_line("vit", {"paired": {**summary, "vitlab_ms": vitlab_ms, "bare_ms": bare_ms,
                                                    "bare_alone_ms": alone_ms}})
    own, around = "the fit's own step costs more", "the fit's process slows a bare step too"
    assert own in line(42.0, 29.0, 28.5) and around not in line(42.0, 29.0, 28.5) and "= 1.45x" in line(42.0, 29.0, 28.5)
    assert around in line(42.0, 40.0, 28.5) and own not in line(42.0, 40.0, 28.5)
    assert around in line(60.0, 40.0, 28.5) and own in line(60.0, 40.0, 28.5)  # (both)
    assert "neither" in line(29.5, 29.0, 28.5)
    assert "epoch 3, 3 pair(s)" in line(42.0, 29.0, 28.5)


def test_bench_gpu_names_the_graphs_a_compiled_run_compiled_and_why_it_compiled_again():
    """A compiled run's line says how many graphs dynamo compiled and the guards that failed before each compilation
    of a function already compiled: what tells, on the GPU, whether a mode compiled once."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()  # (what other tests in this process compiled: reset() keeps the counters)
    guard_failures.clear()
    assert bench.compile_stats() is None and bench.compile_line(None) == ""

    def double_sine(x):
        return x.sin() * 2

    compiled = torch.compile(double_sine, backend="aot_eager", dynamic=False)
    x = torch.randn(3, generator=torch.Generator().manual_seed(0))
    compiled(x)
    compiled(x)  # (the same graph serves)
    with torch.no_grad():
        compiled(x)  # the grad mode changed: compiled again
    compiled(torch.randn(5))  # another size, every shape specialised: again
    stats = bench.compile_stats()
    assert stats["graphs"] == 3
    assert all(reason.startswith("double_sine (test_benchmarks.py:") for reason in stats["recompiled"])
    assert any("grad_mode" in reason for reason in stats["recompiled"])
    assert any("size" in reason or "shape" in reason for reason in stats["recompiled"]), stats
    assert stats["cudagraph_skips"] == 0  # (no CUDA graphs asked for)
    line = bench.compile_line(stats)
    assert line.startswith("; compiled 3 graph(s), 3 guard failure(s)") and "grad_mode" in line
    assert "run without CUDA graphs" in bench.compile_line({**stats, "cudagraph_skips": 2})
    torch._dynamo.reset()
