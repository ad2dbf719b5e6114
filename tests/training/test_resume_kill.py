"""Resume after SIGKILL: a run killed at any moment, resumed from last.ckpt, leaves exactly one TensorBoard point
per step for every tag (images included) and the same tags and steps as an unkilled run; tables and snapshots
of the re-run epoch are the resumed run's; temp files of a killed write are removed."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint

from tests.training.test_classification import events, tiny_args
from vitlab.cli import fit
from vitlab.qkv.state import load_snapshot, qkv_state

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


def killed_run(tiny_dataset: Path, runs: Path, killer: str, epochs: int) -> Path:
    """Run ``epochs`` epochs in a subprocess that ``killer`` (a class above) SIGKILLs; its run folder."""
    kill = [f"--trainer.callbacks+=tests.training.test_resume_kill.{killer}", "--trainer.callbacks.epoch=1"]
    args = tiny_args(tiny_dataset, runs, epochs=epochs, extra=CALLBACKS + kill)
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


@pytest.mark.slow
def test_sigkill_after_drift_write_then_resume_has_one_point_per_step(tiny_dataset, tmp_path):
    runs = tmp_path / "runs"
    callbacks = CALLBACKS
    run = killed_run(tiny_dataset, runs, "SigkillAfterEpoch", epochs=2)
    qkv = run / "qkv"
    # the killed run got as far as the drift of its second epoch, and no further checkpoint
    killed = all_points(run)
    assert (qkv / "drift_epoch_002.csv").is_file() and (qkv / "epoch_002.safetensors").is_file()
    steps_per_epoch = killed["scalars:val/acc"][0][0] + 1
    # (epoch 1's points were still in the writer's buffer: only what a checkpoint covers must be on disk)
    assert [s for s, _ in killed["scalars:drift_global/cosine_distance/q"]][:1] == [steps_per_epoch - 1]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == 0 and ckpt["global_step"] == steps_per_epoch
    stale = qkv_state_of(qkv / "epoch_002.safetensors")

    resume = ["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]
    cli = fit(tiny_args(tiny_dataset, runs, epochs=2, extra=callbacks + resume))
    assert not (runs / "tiny" / "version_1").exists()
    epochs = cli.trainer.current_epoch
    assert epochs == 2 and cli.trainer.global_step == 2 * steps_per_epoch

    points = all_points(run)
    for tag, pts in points.items():
        steps = [s for s, _ in pts]
        if tag == "scalars:epoch":  # Lightning writes `epoch` with every log call (step, val and epoch end)
            assert steps == sorted(steps), (tag, steps)
            continue
        assert steps == sorted(set(steps)), (tag, steps)  # one point per step, in step order: no zig-zag
    # nothing was lost either: every epoch's outputs at the step of its val/* metrics
    epoch_ends = [k * steps_per_epoch - 1 for k in range(1, epochs + 1)]
    for tag in ["scalars:val/acc", "scalars:train/acc", "scalars:drift_global/cosine_distance/q",
                "scalars:drift/rel_frobenius/stage0.block0.k", "histograms:drift_rows/euclidean/v",
                "scalars:drift_global/frobenius_change/rel_pos_table"]:
        assert [s for s, _ in points[tag]] == epoch_ends, tag
    assert [s for s, _ in points["scalars:spectra/positive_mass/stage1.block1"]] == [0, *epoch_ends]
    assert [s for s, _ in points["scalars:train/loss_step"]] == list(range(epochs * steps_per_epoch))
    assert [s for s, _ in points["scalars:lr-AdamW/decay"]] == [k * steps_per_epoch for k in range(epochs)]
    images = {tag.split(":", 1)[1].split(" ")[0]: [s for s, _ in pts] for tag, pts in points.items() if tag.startswith("images:")}
    for tag in ["val/confusion_matrix", "drift_map/cosine_distance", "drift_local/stage1.block0"]:
        assert images[tag] == epoch_ends, tag
    assert images["spectra_figure/stage0"] == [0, *epoch_ends]
    # the re-run epoch's points are the resumed run's, not the killed run's
    killed_time = max(t for s, t in killed["scalars:drift_global/cosine_distance/q"])
    assert points["scalars:drift_global/cosine_distance/q"][1][1] > killed_time

    # snapshot and tables of the re-run epoch are the resumed run's: rewritten, one row per (block, matrix, row)
    redo = qkv_state_of(qkv / "epoch_002.safetensors")
    live = qkv_state(cli.model.model)
    assert redo.keys() == live.keys() and all(torch.equal(redo[k], v) for k, v in live.items())
    # precondition of the check above: the re-run (fresh loader generator) trained on another order than the killed run
    assert not all(torch.equal(stale[k], v) for k, v in live.items()), "re-run identical to the killed run: snapshot rewrite untested"
    ref = qkv_state_of(qkv / "epoch_000.safetensors")
    rows = list(csv.DictReader(open(qkv / "drift_epoch_002.csv")))
    per_key = defaultdict(int)
    for r in rows:
        per_key[(r["block"], r["matrix"], r["row"])] += 1
    assert set(per_key.values()) == {1}
    for r in rows[:: max(len(rows) // 7, 1)]:
        key, i = f"{r['block']}.{r['matrix']}.weight", int(r["row"])
        expect = float((redo[key][i].double() - ref[key][i].double()).norm())
        assert float(r["euclidean"]) == pytest.approx(expect, rel=1e-6)
    spectra_rows = list(csv.DictReader(open(qkv / "spectra_epoch_002.csv")))
    assert len(spectra_rows) == len({(r["block"], r["head"]) for r in spectra_rows})


def qkv_state_of(path: Path) -> dict[str, torch.Tensor]:
    return load_snapshot(path)[0]


@pytest.fixture(scope="module")
def unkilled_points(tiny_dataset, tmp_path_factory) -> dict[str, list[int]]:
    """tag -> steps of a 3-epoch run that nobody kills."""
    runs = tmp_path_factory.mktemp("unkilled")
    fit(tiny_args(tiny_dataset, runs, epochs=3, extra=CALLBACKS))
    return {tag: [s for s, _ in pts] for tag, pts in all_points(runs / "tiny" / "version_0").items()}


@pytest.mark.slow
@pytest.mark.parametrize("killer", ["SigkillAfterEpoch", "SigkillAfterCheckpoint"])
def test_killed_and_resumed_run_has_every_tag_and_step_of_an_unkilled_run(killer, tiny_dataset, unkilled_points, tmp_path):
    """Killed during epoch 1's figure set (resumes from epoch 0's checkpoint) or right after epoch 1's checkpoint
    (its figures and ``train/*`` metrics were pending then): every tag has the unkilled run's steps, once each."""
    runs = tmp_path / "runs"
    run = killed_run(tiny_dataset, runs, killer, epochs=3)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == (1 if killer == "SigkillAfterCheckpoint" else 0)
    stale = run / "qkv" / ".epoch_003.safetensors.k3j_x9a2.tmp"  # as a kill during a snapshot write leaves it
    stale.write_bytes(b"half a snapshot")

    fit(tiny_args(tiny_dataset, runs, epochs=3, extra=CALLBACKS + ["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]))
    points = {tag: [s for s, _ in pts] for tag, pts in all_points(run).items()}
    assert not stale.exists() and not list(run.rglob("*.tmp"))

    def key(tag: str) -> str:  # image tags carry a suffix when one tag has several images per step
        return tag.split(" ")[0]

    assert sorted(map(key, points)) == sorted(map(key, unkilled_points))
    unkilled = {key(t): s for t, s in unkilled_points.items()}
    for tag, steps in points.items():
        assert steps == unkilled[key(tag)], tag
    assert points["scalars:data/skipped_files"] == [0]
