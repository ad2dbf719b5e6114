"""vitlab.runtime: threads and loader workers from the config and the cores (never the load), recorded in the
run's config.yaml; the same seed gives the same numbers on a busy machine and with any number of workers."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from vitlab.runtime import Runtime, frozen_heap

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "cores, gpu, threads, workers",
    [(1, False, 1, 0), (2, False, 2, 0), (4, False, 2, 2), (16, False, 14, 2), (2, True, 1, 1), (16, True, 12, 4)],
)
def test_auto_is_decided_by_the_cores_and_the_accelerator(cores, gpu, threads, workers, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    resolved = Runtime().resolved(gpu, cores=cores)
    assert (resolved.threads, resolved.workers, resolved.figures) == (threads, workers, "auto")


def test_numbers_given_are_kept_and_omp_num_threads_is_the_auto_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert Runtime(threads=3, workers=5, figures="off").resolved(False, cores=2) == Runtime(3, 5, "off")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert Runtime().resolved(False, cores=8).threads == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"threads": 0}, "runtime.threads must be 'auto' or an int >= 1, got 0"),
    ({"workers": -1}, "runtime.workers must be 'auto' or an int >= 0, got -1"),
    ({"workers": "many"}, "runtime.workers must be 'auto' or an int >= 0, got 'many'"),
    ({"figures": "background"}, "runtime.figures must be one of auto, inline, off, got 'background'"),
])
def test_bad_values_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as error:
        Runtime(**kwargs)
    assert str(error.value) == message


def test_apply_sets_torch_threads():
    """(OpenCV's one thread is the data loaders': tests/data/test_transforms.py.)"""
    before = torch.get_num_threads()
    try:
        Runtime(threads=1).apply()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_entry_points_bound_openmp_spinning_and_importing_vitlab_does_not():
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, vitlab, vitlab.data; a = os.environ.get('GOMP_SPINCOUNT'); import vitlab.cli; print(a, os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.split() == ["None", "10000"]


@pytest.mark.parametrize("env, expected", [({}, "10000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, None), ({"GOMP_SPINCOUNT": "500"}, "500")])
def test_prepare_process_keeps_a_policy_the_user_set(env, expected, monkeypatch):
    from vitlab.runtime import prepare_process

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    prepare_process()
    assert os.environ.get("GOMP_SPINCOUNT") == expected


_FAULTS = """
import resource, sys
from vitlab.runtime import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "kept" else "system")
import torch
for step in range(24):
    if step == 16:  # glibc's heap has grown to hold the freed blocks: count the last 8 allocations' faults
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 << 18)  # 64 MB, freed at once: a step's attention tensor
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensor_memory_is_reused_instead_of_faulted_in_again():
    """Page faults of allocating and freeing a 64 MB tensor: glibc's default maps and unmaps it each time (the
    kernel faults its 16384 pages in again); with :func:`keep_freed_memory` the heap keeps them for the next."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "VITLAB_MALLOC"))}
    faults = {}
    for mode in ("kept", "system"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env={**clean, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
        assert out[0] == ("True" if mode == "kept" else "system")
        faults[mode] = int(out[1])
    assert faults["kept"] * 8 < faults["system"], faults


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"VITLAB_MALLOC": "system"}])
def test_keep_freed_memory_leaves_glibc_as_the_user_set_it(env, monkeypatch):
    from vitlab.runtime import keep_freed_memory

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert keep_freed_memory() is False


def test_frozen_heap_freezes_survivors_for_the_fit_only():
    gc.unfreeze()
    with frozen_heap():
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0


def _fit_outputs(args: list[str]):
    """The last Q/K/V snapshot and every scalar of a fit: what must not change."""
    from tests.training.test_classification import events
    from vitlab.qkv.state import load_snapshot
    from vitlab.cli import fit

    threads = torch.get_num_threads()
    try:
        cli = fit(args)
    finally:
        torch.set_num_threads(threads)
    run = Path(cli.trainer.log_dir)
    snapshot, _ = load_snapshot(sorted((run / "qkv").glob("epoch_*.safetensors"))[-1])
    acc = events(run)
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return run, snapshot, scalars


@pytest.mark.slow
def test_same_seed_same_numbers_beside_a_busy_process_with_any_workers_and_from_the_saved_config(tiny_dataset, tmp_path, capfd):
    """Two fits with the same config and seed, one while another process keeps a core busy, give bit-identical
    snapshots and metrics; so do 0 and 2 loader workers (same threads); the run's config.yaml holds the resolved
    runtime, and passing it back repeats the run bit for bit."""
    from tests.training.test_classification import tiny_args

    base = ["--runtime.threads", "2", "--trainer.max_epochs", "2"]
    quiet_run, quiet, quiet_scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "quiet", extra=base))
    saved = yaml.safe_load((quiet_run / "config.yaml").read_text())
    assert saved["runtime"] == {"threads": 2, "workers": 0, "figures": "auto"}
    assert "vitlab: runtime: 2 torch thread(s), 0 loader worker(s)" in capfd.readouterr().err

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _, busy, busy_scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "busy", extra=base))
    finally:
        spinner.kill()
    assert "other processes" not in capfd.readouterr().err
    assert quiet.keys() == busy.keys() and all(torch.equal(quiet[k], busy[k]) for k in quiet)

    def values(scalars):  # (wall times and the learning rate's step aside, every logged number)
        return {tag: points for tag, points in scalars.items()}

    assert values(busy_scalars) == values(quiet_scalars)

    _, workers, worker_scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "workers", extra=[*base, "--runtime.workers", "2"]))
    assert all(torch.equal(quiet[k], workers[k]) for k in quiet) and values(worker_scalars) == values(quiet_scalars)

    again_dir = tmp_path / "again"
    config = quiet_run / "config.yaml"
    again = yaml.safe_load(config.read_text())
    again["trainer"]["logger"]["init_args"]["save_dir"] = str(again_dir)
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(again))
    _, repeated, repeated_scalars = _fit_outputs(["--config", str(tmp_path / "again.yaml")])
    assert all(torch.equal(quiet[k], repeated[k]) for k in quiet) and values(repeated_scalars) == values(quiet_scalars)


def test_an_old_config_with_data_num_workers_is_told_where_it_moved(tmp_path, capsys):
    from vitlab.cli import train_main

    config = tmp_path / "old.yaml"
    config.write_text("data:\n  num_workers: 2\n")
    with pytest.raises(SystemExit):
        train_main(["--config", str(config)])
    assert f"vitlab: error: {config}: data.num_workers moved to runtime.workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--data.num_workers", "2"])
    assert "--data.num_workers: moved to --runtime.workers" in capsys.readouterr().err
