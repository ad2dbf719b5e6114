"""Resume after SIGKILL: a run killed at any moment and resumed from last.ckpt is the run that was never killed.

Bit for bit on the CPU, against an unkilled run of the same config and seed (drop path on, so the resumed run's
torch stream matters): every Q/K/V snapshot and drift / spectra table in ``qkv/`` (one lineage: the killed
run's files after its checkpoint are rewritten), every TensorBoard scalar and histogram (values and steps, one
point per step), every image tag and step (once each: the figures a checkpoint lists as not yet written are
drawn by the resumed run when the killed one had not written them), and ``last.ckpt``'s weights, optimiser and
random streams. Killed right after an epoch's snapshot, right after a checkpoint, during a checkpoint write and
at a random moment; on images (a tiny Swin classifier) and on volumes (a tiny MONAI SwinUNETR segmenting whole CT
volumes, its 3-D window attention recorded)."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import Checkpoint

from tests.helpers.runs import TINY_SWIN, all_points, tiny_args
from tests.helpers.volumes import SWIN_UNETR, volume_fit_args
from vitlab.cli import fit
from vitlab.qkv.state import load_snapshot

ROOT = Path(__file__).resolve().parents[2]
CALLBACKS = ["--trainer.callbacks+=pytorch_lightning.callbacks.LearningRateMonitor", "--trainer.callbacks.logging_interval=epoch"]
EPOCHS = 5  # figures after epochs 1, 2, 4 and 5: the kill falls in a figure epoch, epoch 3 draws none


class SigkillAfterEpoch(pl.Callback):
    """SIGKILL this process in ``on_train_epoch_end`` of epoch ``epoch``: after the epoch's snapshot, drift and
    spectra tables (their callbacks are listed before it) and figures handed to the figure worker, before its
    checkpoint (Lightning runs checkpointers last). Nothing is flushed: what is not on disk is lost, as in a real
    kill. The previous epoch's ``last.ckpt`` must be there already (a checkpoint at most one epoch behind)."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


class SigkillAfterCheckpoint(Checkpoint):
    """Write ``last.ckpt`` in ``on_train_epoch_end`` of epoch ``epoch`` as the run's checkpointer does (a
    monitoring callback: after the task module's epoch-end hook, before Lightning writes the epoch's ``train/*``
    metrics) and SIGKILL this process once it returns: figures may still be being drawn."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(Path(trainer.log_dir) / "checkpoints" / "last.ckpt")
            os.kill(os.getpid(), signal.SIGKILL)


class SigkillDuringCheckpointWrite(pl.Callback):
    """SIGKILL this process halfway through writing epoch ``epoch``'s ``last.ckpt``: the file's bytes go to a temp
    file (fsspec's transaction, Lightning's atomic save) that is renamed once complete, so the previous
    ``last.ckpt`` stays whole."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.epoch:
            return
        from fsspec.implementations.local import LocalFileOpener

        write = LocalFileOpener.write

        def half_then_kill(opener, data):
            if str(opener.path).endswith("last.ckpt"):
                write(opener, bytes(data)[: len(data) // 2])
                opener.f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return write(opener, data)

        LocalFileOpener.write = half_then_kill


RunArgs = Callable[..., list[str]]  # (runs folder, epochs=, extra=) -> train.py arguments of a run named "tiny"


def _run_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-c", "import sys; from vitlab.cli import fit; fit(sys.argv[1:])", *args], env


def killed_run(run_args: RunArgs, runs: Path, killer: str) -> Path:
    """Run :data:`EPOCHS` epochs in a subprocess that ``killer`` (a class above) SIGKILLs in epoch 1; its folder."""
    kill = [f"--trainer.callbacks+=tests.training.test_resume_kill.{killer}", "--trainer.callbacks.epoch=1"]
    command, env = _run_command(run_args(runs, epochs=EPOCHS, extra=CALLBACKS + kill))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return runs / "tiny" / "version_0"


def resume(run_args: RunArgs, runs: Path, run: Path) -> None:
    fit(run_args(runs, epochs=EPOCHS, extra=CALLBACKS + ["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]))
    assert not (runs / "tiny" / "version_1").exists()


def assert_same_run(run: Path, reference: Path) -> None:
    """``run`` (killed and resumed) equals ``reference`` (never killed), bit for bit; see the module docstring."""
    files = sorted(p.name for p in (reference / "qkv").iterdir())
    assert sorted(p.name for p in (run / "qkv").iterdir()) == files  # one lineage, no temp file left
    assert not list(run.rglob("*.tmp"))
    for name in files:
        ours, theirs = run / "qkv" / name, reference / "qkv" / name
        if name.endswith(".safetensors"):
            (a, meta_a), (b, meta_b) = load_snapshot(ours), load_snapshot(theirs)
            assert meta_a == meta_b and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert ours.read_bytes() == theirs.read_bytes(), name
    points, expected = all_points(run), all_points(reference)
    assert sorted(points) == sorted(expected)
    for tag, values in expected.items():
        assert points[tag] == values, tag
    assert points["scalars:data/skipped_files"] == [(0, 0.0)]
    ours, theirs = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=True) for r in (run, reference))
    assert ours["epoch"] == theirs["epoch"] == EPOCHS - 1 and ours["global_step"] == theirs["global_step"]
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    assert all(torch.equal(ours["state_dict"][k], theirs["state_dict"][k]) for k in theirs["state_dict"])
    for a, b in zip(ours["optimizer_states"][0]["state"].values(), theirs["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert ours["best_val"] == theirs["best_val"]  # (the hparams table's best validation metrics)
    streams = [c["callbacks"]["RuntimeCallback"]["rng"][0] for c in (ours, theirs)]
    assert torch.equal(streams[0]["torch"], streams[1]["torch"]) and streams[0]["numpy"]["pos"] == streams[1]["numpy"]["pos"]


def _with_drop_path(run_args: RunArgs, kwargs_flag: list[str]) -> RunArgs:
    def args(runs: Path, epochs: int, extra: list[str] | None = None) -> list[str]:
        return run_args(runs, epochs=epochs, extra=[*kwargs_flag, "--runtime.threads", "1", *(extra or [])])

    return args


@pytest.fixture(scope="module")
def image_run_args(tiny_dataset) -> RunArgs:
    """The tiny Swin classifier with drop path 0.1, one torch thread (as the killed subprocess runs)."""
    kwargs = json.dumps({**TINY_SWIN["model_kwargs"], "drop_path_rate": 0.1})
    return _with_drop_path(functools.partial(tiny_args, tiny_dataset), ["--model.model_kwargs", kwargs])


@pytest.fixture(scope="module")
def volume_run_args(tmp_path_factory) -> RunArgs:
    """A tiny SwinUNETR (drop path 0.1) segmenting 4 synthetic CT patients' whole volumes (2 train, 2 validation)."""
    from vitlab.data.synthetic import generate_volumes

    manifest = generate_volumes(tmp_path_factory.mktemp("volumes"), patients=4, size=32, slices=8, seed=2, difficulty=0.0)
    kwargs = json.dumps({**yaml.safe_load(SWIN_UNETR), "dropout_path_rate": 0.1})

    def args(runs: Path, epochs: int, extra: list[str] | None = None) -> list[str]:
        return volume_fit_args(manifest, runs, epochs, extra=["--model.model_kwargs", kwargs, "--runtime.threads", "1", *(extra or [])])

    return args


def unkilled_run(run_args: RunArgs, runs: Path) -> tuple[Path, float]:
    """The run folder of a run that nobody kills, and the seconds it took."""
    start = time.perf_counter()
    fit(run_args(runs, epochs=EPOCHS, extra=CALLBACKS))
    return runs / "tiny" / "version_0", time.perf_counter() - start


@pytest.fixture(scope="module")
def unkilled(image_run_args, tmp_path_factory) -> tuple[Path, float]:
    return unkilled_run(image_run_args, tmp_path_factory.mktemp("unkilled"))


@pytest.fixture(scope="module")
def unkilled_volumes(volume_run_args, tmp_path_factory) -> tuple[Path, float]:
    return unkilled_run(volume_run_args, tmp_path_factory.mktemp("unkilled-volumes"))


@pytest.mark.slow
@pytest.mark.parametrize("killer,data", [("SigkillAfterEpoch", "images"), ("SigkillAfterCheckpoint", "images"),
                                         ("SigkillDuringCheckpointWrite", "images"),
                                         # volumes: the kill with the most pending (epoch 1's figures, the segmentation
                                         # overlay among them, and train/* metrics)
                                         ("SigkillAfterCheckpoint", "volumes")])
def test_a_killed_and_resumed_run_is_the_unkilled_run(killer, data, request, tmp_path):
    """Killed in epoch 1 after its snapshot and tables (resumes from epoch 0's checkpoint: at most one epoch
    behind), right after epoch 1's checkpoint (its figures possibly not drawn yet) or halfway through writing it
    (resumes from epoch 0's, a stale snapshot temp file beside): the resumed run equals the unkilled one."""
    run_args = request.getfixturevalue("image_run_args" if data == "images" else "volume_run_args")
    unkilled, _ = request.getfixturevalue("unkilled" if data == "images" else "unkilled_volumes")
    runs = tmp_path / "runs"
    run = killed_run(run_args, runs, killer)
    qkv = run / "qkv"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == (1 if killer == "SigkillAfterCheckpoint" else 0)
    assert (qkv / "drift_epoch_002.csv").is_file() and (qkv / "epoch_002.safetensors").is_file()
    killed_at = (qkv / "epoch_002.safetensors").stat().st_mtime_ns
    (qkv / ".epoch_003.safetensors.k3j_x9a2.tmp").write_bytes(b"half a snapshot")  # as a kill during a snapshot write leaves it

    resume(run_args, runs, run)
    assert_same_run(run, unkilled)
    rewritten = (qkv / "epoch_002.safetensors").stat().st_mtime_ns > killed_at
    assert rewritten == (killer != "SigkillAfterCheckpoint")  # the re-run epoch's snapshot is the resumed run's
    if data == "volumes":  # validation's Dice every epoch, the segmentation figure (the middle slice) in figure epochs
        points = all_points(run)
        assert len(points["scalars:val/dice_lesion"]) == EPOCHS
        figure_epochs = [1, 2, 4, 5]  # (every ceil(5 / 4) = 2 epochs, the first and the last)
        assert len([s for t, steps in points.items() if t.startswith("images:val/segmentation") for s in steps]) == len(figure_epochs)


@pytest.mark.slow
def test_a_run_killed_at_a_random_moment_resumes_as_the_unkilled_run(image_run_args, unkilled, tmp_path):
    """SIGKILL at a random moment once the first checkpoint exists (the moment's seed is in the failure message),
    resume from ``last.ckpt``: ``qkv/``, the event files and ``last.ckpt`` are the unkilled run's."""
    reference, seconds = unkilled
    seed = random.randrange(2**31)
    delay = random.Random(seed).uniform(0.0, seconds)
    runs = tmp_path / "runs"
    command, env = _run_command(image_run_args(runs, epochs=EPOCHS, extra=CALLBACKS))
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = runs / "tiny" / "version_0"
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "last.ckpt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    proc.kill()
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode in (0, -signal.SIGKILL), stderr[-3000:]
    if proc.returncode:
        resume(image_run_args, runs, run)
    try:
        assert_same_run(run, reference)
    except AssertionError as error:
        raise AssertionError(f"killed {delay:.2f} s after the first checkpoint (seed {seed}): {error}") from error
