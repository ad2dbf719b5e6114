"""The network sharded with FSDP2 over 2 CPU processes (Lightning's ModelParallelStrategy, gloo): the Q/K/V callbacks
gather each block on every rank and write on rank 0 what a single-process fit from the same weights writes; the
checkpoint is one file that reopens as the single-process run's does; a resumed run goes on with one point per step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.runs import QKV_CALLBACKS, TINY_SWIN, events, train_py
from vitlab.cli import fit
from vitlab.qkv.state import load_snapshot

FSDP2 = {"class_path": "pytorch_lightning.strategies.ModelParallelStrategy",
         "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1, "save_distributed_checkpoint": False,
                       "timeout": "0:03:00"}}


def config(manifest: Path, save_dir: Path, devices: int, batch_size: int, epochs: int = 2) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "max_epochs": epochs, "accelerator": "cpu", "devices": devices, "strategy": FSDP2 if devices > 1 else "auto",
            "limit_train_batches": 1,  # one step per epoch over the whole train split: order cannot matter
            "num_sanity_val_steps": 0, "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(save_dir), "name": "fsdp", "default_hp_metric": False}},
            "callbacks": QKV_CALLBACKS,
        },
        "model": {**TINY_SWIN, "lr": 1e-2, "warmup_epochs": 0.0, "layer_decay": 0.75},
        # 8 patients x 4 slices, half of the patients in validation: 16 training images = one global batch
        "runtime": {"workers": 0, "threads": 1},
        "data": {"root": str(manifest), "image_size": 32, "batch_size": batch_size, "augment": "none", "val_fraction": 0.5},
    }
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / f"cfg{epochs}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_fsdp2_two_processes_match_single_process_and_resume(tiny_dataset, tmp_path):
    fit(["--config", str(config(tiny_dataset, tmp_path / "single", devices=1, batch_size=16))])
    single = tmp_path / "single" / "fsdp" / "version_0"
    train_py("--config", str(config(tiny_dataset, tmp_path / "sharded", devices=2, batch_size=8)))
    sharded = tmp_path / "sharded" / "fsdp" / "version_0"

    # rank 0 alone wrote: one run folder, one event file, the same files
    assert [p.name for p in (tmp_path / "sharded" / "fsdp").iterdir()] == ["version_0"]
    assert len(list(sharded.glob("events.out.tfevents.*"))) == 1
    names = sorted(p.name for p in (sharded / "qkv").iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in (single / "qkv").iterdir() if not p.name.startswith("."))

    # the weights gathered from the shards are the single process's: the same start, the same training
    start, meta = load_snapshot(sharded / "qkv" / "epoch_000.safetensors")
    start_single, _ = load_snapshot(single / "qkv" / "epoch_000.safetensors")
    assert list(start) == list(start_single) and all(torch.equal(start[k], start_single[k]) for k in start)
    assert meta["heads"] == {"stage0.block0": 1, "stage0.block1": 1, "stage1.block0": 2, "stage1.block1": 2}
    end, _ = load_snapshot(sharded / "qkv" / "epoch_002.safetensors")
    end_single, _ = load_snapshot(single / "qkv" / "epoch_002.safetensors")
    assert all(torch.allclose(end[k], end_single[k], atol=1e-5) for k in end)
    assert not torch.equal(end["stage0.block0.q.weight"], start["stage0.block0.q.weight"])

    # the same drift and spectra in TensorBoard, one point per step
    ea, eb = events(single), events(sharded)
    tags = [t for t in ea.Tags()["scalars"] if t.startswith(("drift/", "drift_global/", "spectra/"))]
    assert len(tags) > 30 and set(tags) <= set(eb.Tags()["scalars"])
    for tag in tags:
        assert [e.step for e in ea.Scalars(tag)] == [e.step for e in eb.Scalars(tag)], tag
        assert [e.value for e in eb.Scalars(tag)] == pytest.approx([e.value for e in ea.Scalars(tag)], rel=1e-3, abs=1e-6), tag

    # one checkpoint file with the unsharded names and the single process's values
    state = torch.load(sharded / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    state_single = torch.load(single / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert list(state) == list(state_single)
    assert all(type(v) is torch.Tensor and torch.allclose(v, state_single[k], atol=1e-5) for k, v in state.items())

    # resumed under the same strategy: the next epoch's snapshot, drift from the same reference, no repeated step
    train_py("--config", str(config(tiny_dataset, tmp_path / "sharded", devices=2, batch_size=8, epochs=3)),
             "--ckpt_path", str(sharded / "checkpoints" / "last.ckpt"))
    assert (sharded / "qkv" / "epoch_003.safetensors").is_file()
    assert [p.name for p in (tmp_path / "sharded" / "fsdp").iterdir()] == ["version_0"]
    resumed = events(sharded)
    for tag in ("drift_global/cosine_distance/q", "spectra/positive_mass/stage0.block0"):
        before, after = [e.step for e in eb.Scalars(tag)], [e.step for e in resumed.Scalars(tag)]
        assert after == before + [max(before) + 1], (tag, before, after)
    # the resumed epoch's weights, and its drift against the epoch before it and the reference: the single process's
    # resumed the same way (the strategy loads the checkpoint after on_fit_start: the callbacks start once it is loaded)
    fit(["--config", str(config(tiny_dataset, tmp_path / "single", devices=1, batch_size=16, epochs=3)),
         "--ckpt_path", str(single / "checkpoints" / "last.ckpt")])
    end, _ = load_snapshot(sharded / "qkv" / "epoch_003.safetensors")
    end_single, _ = load_snapshot(single / "qkv" / "epoch_003.safetensors")
    assert all(torch.allclose(end[k], end_single[k], atol=1e-5) for k in end)
    single_resumed = events(single)
    tags = [t for t in single_resumed.Tags()["scalars"] if t.startswith(("drift_step_global/", "drift_step_stage/", "drift_global/"))]
    assert any(t.startswith("drift_step_global/") for t in tags)
    for tag in tags:
        want, got = single_resumed.Scalars(tag)[-1], resumed.Scalars(tag)[-1]
        assert got.step == want.step == 2 and got.value == pytest.approx(want.value, rel=1e-3, abs=1e-6), tag
