"""Tiny 3-D runs for the probe and run tests, without training: synthetic CT volumes, and for each 3-D family a run folder
``runs/<family>/version_0/`` holding ``config.yaml`` (the task, model and data sections) and ``checkpoints/last.ckpt``
(the Lightning layout vitlab writes: ``hyper_parameters`` + ``state_dict`` with the ``model.`` prefix) of a model with
every parameter randomised; both with the run record of :mod:`vitlab.runs`, or (``recorded=False``) without it, as
checkpoints were written before runs recorded themselves.

Use: ``run = make_volume_run(tmp_path, "swin_unetr")`` -> :class:`VolumeRun` with ``checkpoint``, ``config``,
``volumes`` (the NIfTI folder) and ``model`` (the same model, in eval mode, as the checkpoint holds it).
Trained runs: ``fit(volume_fit_args(manifest, runs, epochs))`` (:func:`volume_fit_args`, a tiny SwinUNETR fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from tests.helpers.runs import tiny_args
from vitlab import models
from vitlab.data.synthetic import generate_volumes
from vitlab.models.testing import randomize_parameters
from vitlab.run_record import RECORD_KEY, DataRecord, ModelCall, RunRecord

VOLUME = [32, 32, 16]  # voxels along i, j, k of the model input
SPACING = [1.4, 1.4, 2.5]  # mm: the synthetic 0.7 x 0.7 x 2.5 mm volumes, resampled

# family -> (model name, model kwargs, task); UNETR: 12 blocks, 16^3 patches (fixed by MONAI): a 4 x 4 x 2 token grid
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "swin_unetr": ("monai:swin_unetr", dict(img_size=[32, 32, 32], feature_size=12, depths=[2, 2, 2, 2], num_heads=[2, 2, 4, 4],
                                            window_size=[4, 4, 4], norm_name="batch"), "segmentation"),
    "unetr": ("monai:unetr", dict(img_size=[64, 64, 32], feature_size=8, hidden_size=32, mlp_dim=64, num_heads=2,
                                  norm_name="batch"), "segmentation"),
    "vit3d": ("vit3d:vit_tiny_patch16_224", dict(img_size=VOLUME, patch_size=[8, 8, 4], embed_dim=32, depth=2, num_heads=2),
              "classification"),
}


@dataclass
class VolumeRun:
    checkpoint: Path
    config: Path
    volumes: Path  # folder of NIfTI volumes (with *_mask.nii.gz label maps beside them)
    model: nn.Module
    name: str
    size: list[int]


def volume_data(root: Path, patients: int = 6) -> Path:
    """The synthetic volumes' manifest (NIfTI, with lesion label maps), 32 x 32 x 8 voxels of 0.7 x 0.7 x 2.5 mm."""
    folder = root / "volumes"
    if not folder.is_dir():
        generate_volumes(folder, patients=patients, size=32, slices=8, seed=3, difficulty=0.0)
    return folder / "manifest.csv"


def make_volume_run(root: Path, family: str, seed: int = 0, patients: int = 6, recorded: bool = True) -> VolumeRun:
    """A run folder under ``root`` for one of :data:`FAMILIES` (see the module docstring)."""
    name, kwargs, task = FAMILIES[family]
    manifest = volume_data(root, patients)
    size = list(kwargs["img_size"]) if family != "swin_unetr" else [32, 32, 32]
    classes = 2  # segmentation: background + lesion; classification: lesion / no_lesion
    torch.manual_seed(seed)
    model = models.build_model(name, classes, in_chans=1, **kwargs)
    randomize_parameters(model, seed=seed)
    model.eval()
    version = root / "runs" / family / "version_0"
    (version / "checkpoints").mkdir(parents=True, exist_ok=True)
    data = dict(root=str(manifest), sample="volume", spacing=SPACING, volume_size=size, window="soft_tissue", val_fraction=0.5)
    config = dict(task=task, model=dict(model_name=name, model_kwargs=kwargs), data=data)
    hp = dict(model_name=name, model_kwargs=kwargs, in_chans=1, ablate=None, class_names=["lesion"] if task == "segmentation" else ["lesion", "no_lesion"],
              num_classes=1 if task == "segmentation" else 2)
    call = ModelCall("build_model", dict(name=name, num_classes=classes, in_chans=1, pretrained=False, weights=None, **kwargs))
    if task == "segmentation":
        data["mask_classes"] = ["lesion"]
        hp.update(sliding_window=size, image_size=224)
        call = ModelCall("build_segmenter", dict(name=name, num_classes=1, in_chans=1, image_size=224, pretrained=False,
                                                 weights=None, decoder_channels=64, model_kwargs=kwargs))
    record = RunRecord(task, call, None, hp["class_names"], DataRecord("DenseImageData" if task == "segmentation" else "ImageData", data))
    extra = {RECORD_KEY: record.as_dict()} if recorded else {}
    (version / "config.yaml").write_text(yaml.safe_dump({**config, **extra}))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    checkpoint = version / "checkpoints" / "last.ckpt"
    torch.save({"hyper_parameters": hp, "state_dict": state, **extra}, checkpoint)
    return VolumeRun(checkpoint, version / "config.yaml", manifest.parent / "nifti", model, name, size)


SWIN_UNETR = "{img_size: 32, feature_size: 12, depths: [2, 2, 2, 2], num_heads: [2, 2, 4, 4], window_size: 4, norm_name: batch}"


def volume_fit_args(manifest: Path, runs: Path, epochs: int, extra: list[str] | None = None) -> list[str]:
    """A tiny SwinUNETR lesion segmentation of whole volumes (32^3 voxels of 1.4 x 1.4 x 2.5 mm), Q/K/V callbacks on."""
    return tiny_args(manifest, runs, epochs=epochs, extra=[
        "--task", "segmentation", "--model.model_name", "monai:swin_unetr", "--model.model_kwargs", SWIN_UNETR,
        "--model.sliding_window", "[32, 32, 32]", "--data.sample", "volume", "--data.spacing", "[1.4, 1.4, 2.5]",
        "--data.volume_size", "[32, 32, 32]", "--data.mask_classes", "[lesion]", "--data.window", "soft_tissue",
        "--data.augment", "none", "--data.val_fraction", "0.5", "--data.batch_size", "2", *(extra or [])])
