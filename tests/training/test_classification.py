"""End to end: train.py's CLI on a tiny Swin and tiny DICOM data; TensorBoard events read back; resume."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import TINY_SWIN, events, tiny_args
from vitlab.qkv.state import load_snapshot, qkv_state
from vitlab.cli import fit, train_main

def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_fit_writes_dashboards_snapshots_and_resumes(tiny_dataset, tmp_path, capsys):
    cli = fit(tiny_args(tiny_dataset, tmp_path / "runs", epochs=2))
    run = tmp_path / "runs" / "tiny" / "version_0"
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {tmp_path / 'runs'}" in out and str(run) in out

    # run folder layout
    assert (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    qkv_dir = run / "qkv"
    assert sorted(p.name for p in qkv_dir.glob("epoch_*.safetensors")) == ["epoch_000.safetensors", "epoch_001.safetensors", "epoch_002.safetensors"]
    assert (qkv_dir / "drift_epoch_002.csv").is_file() and (qkv_dir / "spectra_epoch_002.csv").is_file()

    # snapshot round trip is bit-exact against the trained weights, and carries its metadata
    snap, meta = load_snapshot(qkv_dir / "epoch_002.safetensors")
    live = qkv_state(cli.model.model)
    assert snap.keys() == live.keys()
    assert all(torch.equal(snap[k], live[k]) for k in live)
    assert meta["epoch"] == 2 and meta["global_step"] == cli.trainer.global_step
    assert meta["heads"] == {"stage0.block0": 1, "stage0.block1": 1, "stage1.block0": 2, "stage1.block1": 2}
    assert any(k.endswith("rel_pos_table") for k in snap)

    # the reference is the weights before the first step
    ref, meta0 = load_snapshot(qkv_dir / "epoch_000.safetensors")
    assert meta0["global_step"] == 0
    assert not torch.equal(ref["stage0.block0.q.weight"], snap["stage0.block0.q.weight"])

    acc = events(run)
    tags = acc.Tags()
    for tag in ["val/acc", "val/balanced_acc", "val/f1_macro", "val/auroc", "train/loss_step",
                "drift/cosine_distance/stage0.block0.q", "drift/rel_frobenius/stage1.block1.v",
                "drift_stage/euclidean/stage1.k", "drift_global/dot/v", "drift_step_global/mse/q",
                "drift_global/frobenius_change/rel_pos_table", "drift_global/frobenius_change/q_bias", "spectra/positive_mass/stage0.block0",
                "spectra_summed/symmetry_score/stage1.block1", "hp/best_val_acc"]:
        assert tag in tags["scalars"], tag
    for tag in ["drift_rows/cosine_distance/q", "drift_rows/dot/v"]:
        assert tag in tags["histograms"], tag
    for tag in ["drift_map/cosine_distance", "drift_local/stage1.block0", "spectra_figure/stage0", "spectra_heads/positive_mass", "val/confusion_matrix"]:
        assert any(t.startswith(tag) for t in tags["images"]), tag
    assert "custom_scalars__config__" in tags["tensors"]
    assert "hp_metric" not in tags["scalars"]
    # drift against the reference is logged once per epoch, and it is positive after training
    cos = acc.Scalars("drift/rel_frobenius/stage0.block0.q")
    assert len(cos) == 2 and all(e.value > 0 for e in cos)

    # the per-row CSV agrees with the snapshots it came from
    import csv

    rows = [r for r in csv.DictReader(open(qkv_dir / "drift_epoch_002.csv")) if r["block"] == "stage1.block0" and r["matrix"] == "k"]
    u, v = ref["stage1.block0.k.weight"].double(), snap["stage1.block0.k.weight"].double()
    for r in rows[:5]:
        i = int(r["row"])
        assert float(r["euclidean"]) == pytest.approx(float((u[i] - v[i]).norm()), rel=1e-6)

    # resume: weights_only checkpoint loading, same run folder, the sequence continues, nothing rewritten
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert any("QKVDrift" in k for k in ckpt["callbacks"])
    hashes = {p.name: sha(p) for p in qkv_dir.glob("epoch_*.safetensors")}
    fit(tiny_args(tiny_dataset, tmp_path / "runs", epochs=3, extra=["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]))
    assert not (tmp_path / "runs" / "tiny" / "version_1").exists()
    names = sorted(p.name for p in qkv_dir.glob("epoch_*.safetensors"))
    assert names == ["epoch_000.safetensors", "epoch_001.safetensors", "epoch_002.safetensors", "epoch_003.safetensors"]
    assert all(sha(qkv_dir / n) == h for n, h in hashes.items())
    acc = events(run)
    steps = [e.step for e in acc.Scalars("drift/rel_frobenius/stage0.block0.q")]
    assert len(steps) == 3 and len(set(steps)) == 3  # one per epoch, no duplicate
    for kind, read in (("scalars", acc.Scalars), ("tensors", acc.Tensors), ("images", acc.Images)):
        for tag in acc.Tags()[kind]:  # a second run in the folder adds no second point at any step
            tag_steps = [e.step for e in read(tag)]
            assert tag == "epoch" or len(tag_steps) == len(set(tag_steps)), (tag, tag_steps)
    # still measured against the original reference: the epoch-3 drift equals a recomputation from files
    ref3, _ = load_snapshot(qkv_dir / "epoch_003.safetensors")
    expect = float((ref3["stage0.block0.q.weight"].double() - ref["stage0.block0.q.weight"].double()).norm() / ref["stage0.block0.q.weight"].double().norm())
    assert acc.Scalars("drift/rel_frobenius/stage0.block0.q")[-1].value == pytest.approx(expect, rel=1e-5)


def test_bad_input_is_one_line(tiny_dataset, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train_main(tiny_args(tiny_dataset, tmp_path / "runs", extra=["--data.root", str(tmp_path / "missing")]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]
    with pytest.raises(SystemExit):
        train_main(tiny_args(tiny_dataset, tmp_path / "runs", extra=["--ckpt_path", str(tmp_path / "nope.ckpt")]))
    assert "nope.ckpt" in capsys.readouterr().err


@pytest.mark.slow
def test_test_split_is_evaluated_after_fit(tiny_dataset, tmp_path):
    cli = fit(tiny_args(tiny_dataset, tmp_path / "runs", epochs=1, extra=["--data.test_fraction", "0.25", "--data.val_fraction", "0.25"]))
    assert cli.datamodule.has_test
    acc = events(tmp_path / "runs" / "tiny" / "version_0")
    assert {"test/acc", "test/balanced_acc", "test/f1_macro", "test/auroc"} <= set(acc.Tags()["scalars"])

    # a probe given only the run's checkpoint finds the run's config.yaml and draws images from its data
    import argparse

    from vitlab.probes.loading import load_model

    loaded = load_model(argparse.Namespace(checkpoint=tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"))
    assert Path(loaded.data.arguments["root"]) == Path(tiny_dataset) and loaded.class_names == cli.datamodule.class_names


def test_optimizer_groups_layer_decay_freeze_and_schedule():
    from vitlab.training import ClassificationModule, warmup_cosine

    module = ClassificationModule(model_name=TINY_SWIN["model_name"], num_classes=3, in_chans=1, model_kwargs=TINY_SWIN["model_kwargs"],
                                  lr=1e-3, weight_decay=0.05, layer_decay=0.5, freeze=["patch_embed"])
    assert not any(p.requires_grad for n, p in module.model.named_parameters() if n.startswith("patch_embed"))

    class FakeTrainer:
        estimated_stepping_batches = 100
        max_epochs = 10

    module._trainer = FakeTrainer()  # configure_optimizers only reads these two
    config = module.configure_optimizers()
    groups = config["optimizer"].param_groups
    trainable = {id(p) for p in module.model.parameters() if p.requires_grad}
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(trainable)  # every trainable parameter exactly once, frozen ones absent
    lrs = {round(g["initial_lr"] / 1e-3, 8) for g in groups}
    assert max(lrs) == 1.0 and min(lrs) < 0.5  # the head keeps the full LR, early blocks are decayed
    no_decay = [g for g in groups if g["weight_decay"] == 0.0]
    names = {id(p): n for n, p in module.model.named_parameters()}
    skipped = [names[id(p)] for g in no_decay for p in g["params"]]
    assert any("relative_position_bias_table" in n for n in skipped)
    assert all(p.ndim <= 1 or "relative_position_bias_table" in names[id(p)] for g in no_decay for p in g["params"])
    assert all(p.ndim >= 2 for g in groups if g["weight_decay"] > 0 for p in g["params"])
    f = warmup_cosine(10, 100, 0.01)
    assert f(0) == pytest.approx(1 / 11) and f(9) == pytest.approx(10 / 11) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.01 + 0.99 * 0.5) and f(100) == pytest.approx(0.01)
