"""Resume after SIGKILL: a run killed at any moment, resumed from last.ckpt, leaves exactly one TensorBoard point
per step for every tag (images included) and the same tags and steps as an unkilled run; tables and snapshots
of the re-run epoch are the resumed run's; temp files of a killed write are removed. On images (a tiny Swin
classifier) and on volumes (a tiny MONAI SwinUNETR segmenting whole CT volumes, its 3-D window attention recorded)."""

from __future__ import annotations

import csv
import functools
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint

from tests.training.test_classification import events, tiny_args
from vitlab.cli import fit
from vitlab.qkv.state import load_snapshot

ROOT = Path(__file__).resolve().parents[2]
CALLBACKS = ["--trainer.callbacks+=pytorch_lightning.callbacks.LearningRateMonitor", "--trainer.callbacks.logging_interval=epoch"]


class SigkillAfterEpoch(pl.Callback):
    """SIGKILL this process in ``on_train_epoch_end`` of epoch ``epoch``: after QKVDrift / QKSpectra have logged
    and handed their figures to the figure worker (they are listed before it), before the checkpoints (Lightning
    runs them last), once the previous epoch's ``last.ckpt`` is there (written when its figures were). Nothing
    is flushed: what is not on disk is lost, as in a real kill."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            path = Path(trainer.log_dir) / "checkpoints" / "last.ckpt"
            deadline = time.monotonic() + 120
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)


class SigkillAfterCheckpoint(Checkpoint):
    """Write ``last.ckpt`` in ``on_train_epoch_end`` of epoch ``epoch`` as the run's checkpointer does (a
    monitoring callback: after the task module's epoch-end hook, before Lightning writes the epoch's ``train/*``
    metrics) and SIGKILL this process the moment the file is there."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            path = Path(trainer.log_dir) / "checkpoints" / "last.ckpt"
            trainer.save_checkpoint(path)
            deadline, seen = time.monotonic() + 120, None  # (written by a thread once the epoch's figures are on disk)
            while time.monotonic() < deadline:
                stamp = path.stat().st_mtime_ns if path.exists() else None
                if stamp != seen:
                    seen = stamp
                    if torch.load(path, weights_only=True, mmap=True)["epoch"] == self.epoch:
                        break
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)


RunArgs = Callable[..., list[str]]  # (runs folder, epochs=, extra=) -> train.py arguments of a run named "tiny"


def killed_run(run_args: RunArgs | Path, runs: Path, killer: str, epochs: int) -> Path:
    """Run ``epochs`` epochs in a subprocess that ``killer`` (a class above) SIGKILLs in epoch 1; its run folder.
    ``run_args``: the run's arguments (:data:`RunArgs`), or a manifest for :func:`tiny_args`."""
    run_args = functools.partial(tiny_args, run_args) if isinstance(run_args, Path) else run_args
    kill = [f"--trainer.callbacks+=tests.training.test_resume_kill.{killer}", "--trainer.callbacks.epoch=1"]
    args = run_args(runs, epochs=epochs, extra=CALLBACKS + kill)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    code = "import sys, torch; torch.set_num_threads(1); from vitlab.cli import fit; fit(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return runs / "tiny" / "version_0"


def all_points(run: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, wall_time)] in the order TensorBoard's EventAccumulator reads them back."""
    acc = events(run)
    readers = {"scalars": acc.Scalars, "images": acc.Images, "histograms": acc.Histograms, "tensors": acc.Tensors}
    points: dict[str, list[tuple[int, float]]] = {}
    for kind, read in readers.items():
        for tag in acc.Tags()[kind]:
            points[f"{kind}:{tag}"] = [(e.step, e.wall_time) for e in read(tag)]
    return points


def qkv_state_of(path: Path) -> dict[str, torch.Tensor]:
    return load_snapshot(path)[0]


@pytest.fixture(scope="module")
def image_run_args(tiny_dataset) -> RunArgs:
    return functools.partial(tiny_args, tiny_dataset)


@pytest.fixture(scope="module")
def volume_run_args(tmp_path_factory) -> RunArgs:
    """A tiny SwinUNETR segmenting 4 synthetic CT patients' whole volumes (2 train, 2 validation: one step per epoch)."""
    from tests.probes.volume_runs import volume_fit_args
    from vitlab.data.synthetic import generate_volumes

    manifest = generate_volumes(tmp_path_factory.mktemp("volumes"), patients=4, size=32, slices=8, seed=2, difficulty=0.0)
    return functools.partial(volume_fit_args, manifest)


def unkilled_run(run_args: RunArgs, runs: Path) -> Path:
    """The run folder of a 3-epoch run that nobody kills."""
    fit(run_args(runs, epochs=3, extra=CALLBACKS))
    return runs / "tiny" / "version_0"


@pytest.fixture(scope="module")
def unkilled(image_run_args, tmp_path_factory) -> Path:
    return unkilled_run(image_run_args, tmp_path_factory.mktemp("unkilled"))


@pytest.fixture(scope="module")
def unkilled_volumes(volume_run_args, tmp_path_factory) -> Path:
    return unkilled_run(volume_run_args, tmp_path_factory.mktemp("unkilled-volumes"))


@pytest.mark.slow
@pytest.mark.parametrize("killer,data", [("SigkillAfterEpoch", "images"), ("SigkillAfterCheckpoint", "images"),
                                         # volumes: the kill with the most pending (epoch 1's figures, the segmentation
                                         # overlay among them, and train/* metrics); both killers pass, each ~1 min
                                         ("SigkillAfterCheckpoint", "volumes")])
def test_killed_and_resumed_run_has_every_tag_and_step_of_an_unkilled_run(killer, data, request, tmp_path):
    """Killed during epoch 1's figure set (after its drift and snapshot writes; resumes from epoch 0's checkpoint)
    or right after epoch 1's checkpoint (its figures and ``train/*`` metrics were pending then): every tag has the
    unkilled run's steps, once each; the re-run epoch's snapshot and tables are the resumed run's; one Q/K/V
    snapshot per epoch (and the initial one)."""
    run_args = request.getfixturevalue("image_run_args" if data == "images" else "volume_run_args")
    unkilled = request.getfixturevalue("unkilled" if data == "images" else "unkilled_volumes")
    runs = tmp_path / "runs"
    run = killed_run(run_args, runs, killer, epochs=3)
    qkv = run / "qkv"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == (1 if killer == "SigkillAfterCheckpoint" else 0)
    assert (qkv / "drift_epoch_002.csv").is_file() and (qkv / "epoch_002.safetensors").is_file()
    killed_at = (qkv / "epoch_002.safetensors").stat().st_mtime_ns
    stale = qkv / ".epoch_003.safetensors.k3j_x9a2.tmp"  # as a kill during a snapshot write leaves it
    stale.write_bytes(b"half a snapshot")

    fit(run_args(runs, epochs=3, extra=CALLBACKS + ["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]))
    assert not (runs / "tiny" / "version_1").exists()
    points = {tag: [s for s, _ in pts] for tag, pts in all_points(run).items()}
    assert not stale.exists() and not list(run.rglob("*.tmp"))

    def key(tag: str) -> str:  # image tags carry a suffix when one tag has several images per step
        return tag.split(" ")[0]

    reference = {key(t): [s for s, _ in pts] for t, pts in all_points(unkilled).items()}
    assert sorted(map(key, points)) == sorted(reference)
    for tag, steps in points.items():
        assert steps == reference[key(tag)], tag
    assert points["scalars:data/skipped_files"] == [0]
    snapshots = sorted(p.name for p in qkv.glob("*.safetensors"))
    assert snapshots == [f"epoch_{e:03d}.safetensors" for e in range(4)] == sorted(p.name for p in (unkilled / "qkv").glob("*.safetensors"))
    if data == "volumes":  # the segmentation figure (the middle slice) and validation's Dice, once per epoch
        assert points["scalars:val/dice_lesion"] == reference["scalars:val/dice_lesion"] and len(points["scalars:val/dice_lesion"]) == 3
        assert len([s for t, steps in points.items() if key(t) == "images:val/segmentation" for s in steps]) == 3

    # the re-run epoch's snapshot and tables are rewritten: one row per (block, matrix, row), from the snapshots
    rewritten = (qkv / "epoch_002.safetensors").stat().st_mtime_ns > killed_at
    assert rewritten == (killer == "SigkillAfterEpoch")
    redo, ref = qkv_state_of(qkv / "epoch_002.safetensors"), qkv_state_of(qkv / "epoch_000.safetensors")
    rows = list(csv.DictReader(open(qkv / "drift_epoch_002.csv")))
    per_key = defaultdict(int)
    for r in rows:
        per_key[(r["block"], r["matrix"], r["row"])] += 1
    assert set(per_key.values()) == {1}
    for r in rows[:: max(len(rows) // 7, 1)]:
        name, i = f"{r['block']}.{r['matrix']}.weight", int(r["row"])
        expect = float((redo[name][i].double() - ref[name][i].double()).norm())
        assert float(r["euclidean"]) == pytest.approx(expect, rel=1e-6)
    spectra_rows = list(csv.DictReader(open(qkv / "spectra_epoch_002.csv")))
    assert len(spectra_rows) == len({(r["block"], r["head"]) for r in spectra_rows})
