"""The Q/K/V callbacks under a 2-process CPU DDP fit (gloo) equal a single-process fit from the same weights; and
``train.py`` under DDP as a multi-GPU run launches it (each rank a process running the script) ends on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.runs import DDP_SPAWN, QKV_CALLBACKS, TINY_SWIN, events, train_py
from vitlab.qkv.state import load_snapshot
from vitlab.cli import fit


def run(manifest: Path, save_dir: Path, devices: int, batch_size: int) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "max_epochs": 2,
            "accelerator": "cpu",
            "devices": devices,
            "strategy": DDP_SPAWN if devices > 1 else "auto",
            "limit_train_batches": 1,  # one step per epoch over the whole train split: order cannot matter
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger", "init_args": {"save_dir": str(save_dir), "name": "ddp", "default_hp_metric": False}},
            "callbacks": [
                {"class_path": "vitlab.callbacks.QKVSnapshot"},
                {"class_path": "vitlab.callbacks.QKVDrift"},
                {"class_path": "vitlab.callbacks.QKSpectra"},
            ],
        },
        "model": {**TINY_SWIN, "lr": 1e-2, "warmup_epochs": 0.0},
        # 8 patients x 4 slices, half of the patients in validation: 16 training images = one global batch
        "runtime": {"workers": 0}, "data": {"root": str(manifest), "image_size": 32, "batch_size": batch_size, "augment": "none", "val_fraction": 0.5},
    }
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    fit(["--config", str(path)])
    return save_dir / "ddp" / "version_0"


@pytest.mark.slow
def test_ddp_two_processes_match_single_process(tiny_dataset, tmp_path):
    single = run(tiny_dataset, tmp_path / "single", devices=1, batch_size=16)
    ddp = run(tiny_dataset, tmp_path / "ddp", devices=2, batch_size=8)

    # rank 0 alone wrote: one run folder, one event file, each snapshot once
    assert [p.name for p in (tmp_path / "ddp" / "ddp").iterdir()] == ["version_0"]
    assert len(list(ddp.glob("events.out.tfevents.*"))) == 1
    names = sorted(p.name for p in (ddp / "qkv").iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in (single / "qkv").iterdir() if not p.name.startswith("."))
    assert "epoch_002.safetensors" in names
    assert [n for n in names if n.endswith(".csv")] == ["drift_epoch_001.csv", "drift_epoch_002.csv", "spectra_epoch_000.csv", "spectra_epoch_001.csv", "spectra_epoch_002.csv"]

    # same weights after training (gradient all-reduce vs one big batch: float rounding only)
    a, _ = load_snapshot(single / "qkv" / "epoch_002.safetensors")
    b, _ = load_snapshot(ddp / "qkv" / "epoch_002.safetensors")
    ref, _ = load_snapshot(single / "qkv" / "epoch_000.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert not torch.equal(a["stage0.block0.q.weight"], ref["stage0.block0.q.weight"])

    # and the same drift / spectra metrics in TensorBoard
    ea, eb = events(single), events(ddp)
    for kind in ("scalars", "histograms", "images", "tensors"):
        assert sorted(eb.Tags()[kind]) == sorted(ea.Tags()[kind]), kind
        for tag in eb.Tags()[kind]:  # two processes write what one does: rank 0 writes, the others only join collectives
            steps = [e.step for e in getattr(eb, kind.capitalize())(tag)]
            assert steps == [e.step for e in getattr(ea, kind.capitalize())(tag)], (tag, steps)
            # one point per step; the one exception: the fit-start spectra (step 0) meet epoch 1's, which in these
            # one-batch epochs is written at the epoch's last step, 0 (the single process alike)
            repeated = sorted({s for s in steps if steps.count(s) > 1})
            assert tag == "epoch" or not repeated or (tag.startswith("spectra") and repeated == [0]), (tag, steps)
    assert "hp/best_val_acc" in eb.Tags()["scalars"]
    # the checkpoint holds both ranks' random streams (gathered: every rank's state_dict joins the collective)
    streams = torch.load(ddp / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]["RuntimeCallback"]["rng"]
    assert len(streams) == 2 and all(s["torch"].dtype == torch.uint8 for s in streams)
    tags = [t for t in ea.Tags()["scalars"] if t.startswith(("drift/", "drift_global/", "spectra/"))]
    assert len(tags) > 50 and set(tags) <= set(eb.Tags()["scalars"])
    for tag in tags:
        va, vb = [e.value for e in ea.Scalars(tag)], [e.value for e in eb.Scalars(tag)]
        assert [e.step for e in ea.Scalars(tag)] == [e.step for e in eb.Scalars(tag)], tag
        assert va == pytest.approx(vb, rel=1e-3, abs=1e-6), tag


@pytest.mark.slow
def test_train_py_under_ddp_with_a_process_per_rank_finishes_on_every_rank(tiny_dataset, tmp_path):
    # Lightning's default DDP launch (``strategy: ddp``, as on several GPUs): train.py runs again once per rank. Only
    # rank 0 prints the closing report, so it must not call a collective (``trainer.log_dir`` broadcasts): rank 0
    # used to wait there for ranks that had already left, and died of the closed connection (or hung, with NCCL).
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 1, "accelerator": "cpu", "devices": 2, "strategy": "ddp", "limit_train_batches": 1,
                    "num_sanity_val_steps": 0, "enable_progress_bar": False, "enable_model_summary": False,
                    "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(tmp_path), "name": "ddp", "default_hp_metric": False}},
                    "callbacks": QKV_CALLBACKS},
        "model": {**TINY_SWIN, "lr": 1e-2, "warmup_epochs": 0.0},
        "runtime": {"workers": 0, "threads": 1},
        "data": {"root": str(tiny_dataset), "image_size": 32, "batch_size": 8, "augment": "none", "val_fraction": 0.5},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = train_py("--config", str(path))  # (rc 0, the closing report printed once)
    run = tmp_path / "ddp" / "version_0"
    assert f"run folder   : {run}" in done.stdout
    assert [p.name for p in (tmp_path / "ddp").iterdir()] == ["version_0"]
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "qkv" / "epoch_001.safetensors").is_file()
