"""End to end on volumes: tiny fits on slices, slabs (classification, segmentation, detection) and unlabelled
volumes (DINO) through train.py's CLI, read back from the TensorBoard event files."""

from __future__ import annotations

import pytest

from tests.helpers.runs import DINO_TINY, TINY_SWIN, dense_args, events, tiny_args
from vitlab.cli import fit
from vitlab.data.synthetic import generate_volumes


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    """6 synthetic CT patients (3 with lesions), 32 x 32 x 6 voxels: NIfTI with label maps and DICOM series."""
    return generate_volumes(tmp_path_factory.mktemp("volumes"), patients=6, size=32, slices=6, seed=1, difficulty=0.0)


def run_tags(save_dir):
    acc = events(save_dir / "tiny" / "version_0")
    return acc, acc.Tags()["scalars"]


@pytest.mark.slow
@pytest.mark.parametrize("sample", ["slice", "slab"])
def test_classification_on_slices_and_slabs(volumes, tmp_path, sample):
    extra = ["--data.sample", sample, "--data.slab_radius", "1", "--data.slice_labels", "mask", "--data.window", "soft_tissue",
             "--data.val_fraction", "0.34", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2"]
    cli = fit(tiny_args(volumes, tmp_path, epochs=1, extra=extra))
    assert cli.datamodule.in_chans == (3 if sample == "slab" else 1) and cli.model.model.patch_embed.proj.in_channels == cli.datamodule.in_chans
    acc, tags = run_tags(tmp_path)
    assert {"train/loss_step", "val/balanced_acc", "val/auroc", "drift/rel_frobenius/stage0.block0.q"} <= set(tags)
    assert [e.step for e in acc.Scalars("data/skipped_files")] == [0] and acc.Scalars("data/skipped_files")[0].value == 0
    assert (tmp_path / "tiny" / "version_0" / "qkv" / "epoch_001.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_dense_tasks_on_slabs_of_dicom_series(volumes, tmp_path, task):
    manifest = volumes.parent / "manifest_dicom.csv"  # the series folders, the NIfTI label maps
    extra = ["--data.sample", "slab", "--data.slab_radius", "1", "--data.window", "soft_tissue",
             "--data.mask_classes", "[lesion]", "--data.val_fraction", "0.34", "--data.batch_size", "4",
             "--data.root", str(manifest), "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    cli = fit(dense_args(task, tmp_path, epochs=1, extra=extra))
    assert cli.trainer.global_step == 2 and cli.datamodule.in_chans == 3
    tags = set(events(tmp_path / task / "version_0").Tags()["scalars"])
    assert {"val/map_50", "val/mask_map_50"} <= tags if task == "detection" else {"val/dice_lesion"} <= tags


@pytest.mark.slow
def test_dino_on_unlabelled_volumes(volumes, tmp_path):

    nifti = volumes.parent / "nifti"
    args = tiny_args(volumes, tmp_path, epochs=1)
    import yaml

    cfg = yaml.safe_load(open(args[1]))
    cfg.update(task="dino", checkpoint={"monitor": "val/knn_acc"}, model={**DINO_TINY, "lr": 1e-3, "warmup_epochs": 0.5})
    cfg["data"].update(root=str(nifti), sample="slab", slab_radius=1, labels=False, augment="none")
    cfg["trainer"]["max_steps"] = 2
    open(args[1], "w").write(yaml.safe_dump(cfg))
    cli = fit(["--config", args[1]])
    assert cli.trainer.global_step == 2 and cli.datamodule.in_chans == 3
    assert len(cli.datamodule.samples("train")) == 6 * 6  # every slab of the six volumes (their label maps are not volumes)
    _, tags = run_tags(tmp_path)
    assert "dino/teacher_entropy" in tags and not any(t.startswith("val/") for t in tags)


def test_class_weights_weight_the_training_loss_only():
    import torch
    import torch.nn.functional as F

    from vitlab.training.classification import ClassificationModule

    with pytest.raises(ValueError, match="class_weights must give 2 positive"):
        ClassificationModule(num_classes=2, class_weights=[1.0], **TINY_SWIN)
    module = ClassificationModule(num_classes=2, class_weights=[1.0, 3.0], **TINY_SWIN).eval()
    module.log = lambda *a, **k: None
    torch.manual_seed(0)
    images, labels = torch.randn(6, 1, 32, 32), torch.tensor([0, 1, 1, 0, 0, 1])
    logits = module(images)
    weights = torch.tensor([1.0, 3.0])[labels]
    by_hand = (weights * F.cross_entropy(logits, labels, reduction="none")).sum() / weights.sum()
    train_loss = module._step((images, labels), "train")
    val_loss = module._step((images, labels), "val")
    torch.testing.assert_close(train_loss, by_hand)
    torch.testing.assert_close(val_loss, F.cross_entropy(logits, labels))


@pytest.mark.slow
def test_classification_of_whole_volumes_with_a_3d_vit(volumes, tmp_path, capsys):
    kwargs = '{img_size: [16, 16, 8], patch_size: [8, 8, 4], embed_dim: 16, depth: 2, num_heads: 2, global_pool: avg, class_token: false}'
    extra = ["--model.model_name", "vit3d:vit_tiny_patch16_224", "--model.model_kwargs", kwargs, "--data.sample", "volume",
             "--data.spacing", "[1.4, 1.4, 2.5]", "--data.volume_size", "[16, 16, 8]", "--data.window", "soft_tissue",
             "--data.augment", "none", "--data.val_fraction", "0.34", "--data.batch_size", "2"]
    cli = fit(tiny_args(volumes, tmp_path, epochs=1, extra=extra))
    assert cli.model.model.patch_embed.grid_size == (2, 2, 2)
    _, tags = run_tags(tmp_path)
    assert {"val/balanced_acc", "drift/rel_frobenius/stage0.block0.q"} <= set(tags)
    assert (tmp_path / "tiny" / "version_0" / "qkv" / "epoch_001.safetensors").is_file()
    # a 2-D-only probe given the 3-D checkpoint says so in one line; spectra reads it
    from vitlab.probe_cli import probe_main

    ckpt = str(tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit):
        probe_main(["invert", "--checkpoint", ckpt, "--out", str(tmp_path / "att")])
    err = capsys.readouterr().err.strip().splitlines()
    assert "a 3-D model (input (1, 16, 16, 8)" in err[-1] and "does not take 3-D checkpoints" in err[-1]
    probe_main(["spectra", "--checkpoint", ckpt, "--out", str(tmp_path / "spectra")])
    assert list((tmp_path / "spectra").glob("events.out.tfevents.*"))
