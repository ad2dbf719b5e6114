"""Probes on 3-D checkpoints: the volume stream (volumes read as training reads them, voxel size in mm), checkpoints
of MONAI segmenters probed whole, and the one-line refusal of the 2-D-only probes."""

from __future__ import annotations

import argparse

import nibabel as nib
import numpy as np
import pytest
import torch

from tests.helpers.volumes import SPACING, make_volume_run
from vitlab.probes import main
from vitlab.probes.loading import LoadedModel, load_model
from vitlab.probes.streams import image_stream, load_images

pytestmark = pytest.mark.usefixtures("one_thread")


def namespace(**kwargs):
    base = dict(checkpoint=None, config=None, model=None, images=None, num_images=None, split="val", spacing=None, seed=0)
    return argparse.Namespace(**{**base, **kwargs})


@pytest.mark.parametrize("family", ["swin_unetr", pytest.param("unetr", marks=pytest.mark.slow), "vit3d"])
def test_volume_stream_gives_the_training_volumes_of_a_run(tmp_path, family):
    run = make_volume_run(tmp_path, family)
    args = namespace(checkpoint=run.checkpoint, num_images=2)
    loaded = load_model(args)
    assert loaded.task == ("classification" if family == "vit3d" else "segmentation")
    for key, value in run.model.state_dict().items():  # the checkpoint's weights, in a model of the same shape
        torch.testing.assert_close(loaded.model.state_dict()[key], value, rtol=0, atol=0)
    stream = image_stream(args, loaded, 4, volumes=True)
    batch = load_images(args, loaded, 4, volumes=True)
    assert stream.volumetric and stream.spacing == tuple(SPACING) and batch.spacing == tuple(SPACING)
    assert batch.inputs.shape == (2, 1, *run.size) and torch.equal(batch.inputs, batch.pixels)  # no mean / std: as in training
    assert torch.equal(torch.cat(list(stream.batches(1))), batch.inputs)
    # the very tensors training gives the model: the run's data module, validation split, same volumes
    dm = loaded.data.build(num_workers=0)
    by_key = {s.key: i for i, s in enumerate(dm.samples("val"))}
    dataset = dm.dataset("val")
    for name, volume in zip(batch.names, batch.inputs):
        torch.testing.assert_close(volume, dataset[by_key[name]][0], rtol=0, atol=0)
    assert tuple(loaded.model(batch.inputs).shape[:2]) == (2, 2)  # voxel logits (2 classes) or class logits


def test_volume_stream_from_files_and_one_voxel_size(tmp_path):
    run = make_volume_run(tmp_path, "vit3d")
    files = sorted(p for p in run.volumes.glob("P*.nii.gz") if "_mask" not in p.name)
    loaded = LoadedModel(run.model, run.name, "test")  # no config: the files' own voxel size, the default window
    # a folder: every volume under it (label maps left out), each at its own voxel size, cropped / padded to the input
    own = load_images(namespace(images=[str(run.volumes)], num_images=3), loaded, 10, volumes=True)
    assert own.spacing == pytest.approx((0.7, 0.7, 2.5)) and own.names == [str(f.resolve()) for f in files[:3]] and own.labels is None
    resampled = load_images(namespace(images=[str(f) for f in files[:2]], spacing=SPACING), loaded, 10, volumes=True)
    assert resampled.spacing == tuple(SPACING) and resampled.inputs.shape == (2, 1, *run.size)
    # a volume at another voxel size, not resampled: refused in one line naming both
    odd = nib.load(files[0])
    nib.save(nib.Nifti1Image(np.asarray(odd.dataobj), np.diag([0.9, 0.9, 3.0, 1.0])), tmp_path / "odd.nii.gz")
    stream = image_stream(namespace(images=[str(files[0]), str(tmp_path / "odd.nii.gz")]), loaded, 10, volumes=True)
    stream.read(0)
    with pytest.raises(ValueError, match=r"odd.nii.gz: voxel size 0.9 x 0.9 x 3 mm differs from 0.7 x 0.7 x 2.5 mm of .*P0000.nii.gz; .*pass --spacing"):
        stream.read(1)
    with pytest.raises(ValueError, match=r"--images .*mask.txt is not a volume"):
        (tmp_path / "mask.txt").write_text("x")
        image_stream(namespace(images=[str(tmp_path / "mask.txt")]), loaded, 10, volumes=True)


def test_2d_only_probes_refuse_a_3d_checkpoint_in_one_line(tmp_path):
    run = make_volume_run(tmp_path, "vit3d")
    for sub in ("invert", "visualize", "filters"):
        with pytest.raises(ValueError, match=r"a 3-D model .*the probes that do: drift") as err:
            main([sub, "--checkpoint", str(run.checkpoint), "--out", str(tmp_path / sub)])
        assert "\n" not in str(err.value)
