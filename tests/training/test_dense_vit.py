"""Plain-ViT detector (ViTDet simple feature pyramid) and segmenter end to end through train.py's CLI.

Fit, metrics and drift tags read back from the event files, resume from ``last.ckpt``, and probes run on the
checkpoint and see the same ViT blocks the training callbacks saw.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.runs import dense_args, events
from vitlab.qkv.state import load_snapshot, qkv_state
from vitlab.cli import fit
from vitlab.probes import main as probe

VIT = {"model_name": "vit_tiny_patch16_224",
       "model_kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}}
BLOCKS = {"stage0.block0", "stage0.block1"}  # a plain ViT is one stage


def vit_args(task: str, save_dir: Path, epochs: int, extra: list[str] | None = None) -> list[str]:
    """:func:`dense_args` with the tiny ViT as backbone (32 px images: 4 x 4 tokens of 8 px)."""
    args = dense_args(task, save_dir, epochs, extra)
    path = Path(args[1])
    cfg = yaml.safe_load(path.read_text())
    cfg["model"].update(VIT)
    path.write_text(yaml.safe_dump(cfg))
    return args


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
@pytest.mark.parametrize("task,metrics", [
    ("detection", ["val/map", "val/map_50", "val/mask_map_50", "train/loss_mask", "train/loss_objectness"]),
    ("segmentation", ["val/dice", "val/dice_lesion", "val/iou_lesion"]),
])
def test_plain_vit_dense_fit_resume_and_probe(task, metrics, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    cli = fit(vit_args(task, tmp_path / "runs", epochs=1))
    model = cli.model.model
    assert model.backbone.is_plain and type(model.backbone.fpn).__name__ == "SimpleFeaturePyramid"
    run = tmp_path / "runs" / task / "version_0"
    scalars = set(events(run).Tags()["scalars"])
    for tag in [*metrics, *(f"drift/rel_frobenius/{b}.{m}" for b in BLOCKS for m in "qkv"),
                *(f"spectra/positive_mass/{b}" for b in BLOCKS)]:
        assert tag in scalars, tag
    live = qkv_state(model)
    assert {k.rsplit(".", 2)[0] for k in live} == BLOCKS
    snap, _ = load_snapshot(run / "qkv" / "epoch_001.safetensors")
    assert snap.keys() == live.keys() and all(torch.equal(snap[k], live[k]) for k in live)

    ckpt = run / "checkpoints" / "last.ckpt"
    probe(["spectra", "--checkpoint", str(ckpt), "--out", str(tmp_path / "spectra")])
    probed, logged = rows(tmp_path / "spectra" / "spectra.csv"), rows(run / "qkv" / "spectra_epoch_001.csv")
    assert {r["block"] for r in probed} == BLOCKS and len(probed) == len(logged)
    for mine, theirs in zip(probed, logged):  # the probe's model is the trained backbone, not a fresh ViT
        assert (mine["block"], mine["head"]) == (theirs["block"], theirs["head"])
        assert float(mine["positive_mass"]) == pytest.approx(float(theirs["positive_mass"]), abs=1e-5)
    probe(["attention", "--checkpoint", str(ckpt), "--num-images", "2", "--out", str(tmp_path / "attention")])
    table = rows(tmp_path / "attention" / "attention_mass.csv")
    assert table and {r.get("layer") or r.get("block") for r in table} == BLOCKS

    fit(vit_args(task, tmp_path / "runs", epochs=2, extra=["--ckpt_path", str(ckpt)]))
    assert not (tmp_path / "runs" / task / "version_1").exists()
    snap2, _ = load_snapshot(run / "qkv" / "epoch_002.safetensors")
    assert snap2.keys() == live.keys() and any(not torch.equal(snap2[k], live[k]) for k in live)  # it trained on
    acc = events(run)
    assert len(acc.Scalars("drift/rel_frobenius/stage0.block1.v")) == 2
    assert len(acc.Scalars(metrics[1])) == 2  # validation ran again after the resume
