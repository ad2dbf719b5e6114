"""Segmentation on whole volumes: the loss against MONAI's, label maps on the resampled grid, sliding-window
validation against a direct forward, and a tiny SwinUNETR fit read back from the event files."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from vitlab.data.dense_data import DenseImageData
from vitlab.training.segmentation import soft_dice_loss


@pytest.mark.parametrize("shape", [(3, 3, 8, 9), (2, 3, 6, 5, 4)], ids=["image", "volume"])
def test_soft_dice_is_monais_batch_dice_loss(shape):
    from monai.losses import DiceLoss

    torch.manual_seed(0)
    logits = torch.randn(shape)
    target = torch.randint(0, shape[1], (shape[0], *shape[2:]))
    monai = DiceLoss(include_background=False, to_onehot_y=True, softmax=True, batch=True, smooth_nr=1.0, smooth_dr=1.0)
    torch.testing.assert_close(soft_dice_loss(logits, target), monai(logits, target[:, None]))


def test_volume_label_maps_follow_their_volumes_onto_the_resampled_grid(tmp_path):
    rng = np.random.default_rng(0)
    affine = np.diag([0.7, 0.7, 2.5, 1.0])
    rows = ["path,mask,label"]
    for p in range(4):
        array = rng.uniform(0, 1000, (20, 18, 6)).astype(np.float32)
        mask = np.zeros((20, 18, 6), np.uint8)
        mask[5:11, 4:9, 2:4] = 1
        nib.save(nib.Nifti1Image(array, affine), tmp_path / f"v{p}.nii.gz")
        nib.save(nib.Nifti1Image(mask, affine), tmp_path / f"m{p}.nii.gz")
        rows.append(f"v{p}.nii.gz,m{p}.nii.gz,{'ab'[p % 2]}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    native = DenseImageData(str(tmp_path / "manifest.csv"), sample="volume", volume_size=[20, 18, 6], val_fraction=0.5)
    image, target = native.dataset("train")[0]
    assert image.shape == (1, 20, 18, 6) and target["mask"].dtype == torch.int64
    assert int(target["mask"].sum()) == 6 * 5 * 2 and target["mask"][5:11, 4:9, 2:4].all()
    coarse = DenseImageData(str(tmp_path / "manifest.csv"), sample="volume", spacing=[1.4, 1.4, 2.5], volume_size=[16, 16, 8],
                            val_fraction=0.5)
    image, target = coarse.dataset("train")[0]
    assert image.shape == (1, 16, 16, 8) and set(target["mask"].unique().tolist()) == {0, 1}
    # the lesion's centre in mm stays where it was: (7.5, 6, 2.5) voxels at 0.7 / 0.7 / 2.5 mm
    centre_mm = np.argwhere(target["mask"].numpy()).mean(axis=0)  # on the 16 x 16 x 8 grid, padded about the centre
    offset = (np.array([16, 16, 8]) - np.array([10, 9, 6])) // 2  # old grid (20, 18, 6) at 1.4 mm -> 10 x 9 x 6 voxels
    np.testing.assert_allclose((centre_mm - offset) * [1.4, 1.4, 2.5], [7.5 * 0.7, 6 * 0.7, 2.5 * 2.5], atol=0.75)


def tiny_swin_unetr():
    from vitlab import models

    return models.build_model("monai:swin_unetr", 2, in_chans=1, img_size=32, feature_size=12, depths=(2, 2, 2, 2),
                              num_heads=(2, 2, 4, 4), window_size=4, norm_name="batch").eval()


def test_sliding_window_validation_equals_a_direct_forward_when_the_volume_fits_one_window():
    from vitlab.models.testing import randomize_parameters
    from vitlab.training.segmentation import SegmentationModule

    module = SegmentationModule(num_classes=1, model_name="monai:swin_unetr", sliding_window=[32, 32, 32],
                                model_kwargs=dict(img_size=32, feature_size=12, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4),
                                                  window_size=4, norm_name="batch")).eval()
    randomize_parameters(module.model, seed=0)
    volume = torch.randn(2, 1, 32, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(module.predict_logits(volume), module(volume), atol=1e-5, rtol=1e-5)
        bigger = torch.randn(1, 1, 64, 32, 32)  # two windows along i: the same as MONAI's own loop
        from monai.inferers import sliding_window_inference

        from vitlab.models.inference import gaussian_weights

        gaussian_weights.cache_clear()
        for shape in ((1, 1, 64, 32, 32), (1, 1, 70, 40, 20)):  # two windows along i; overlapping ones and a padded side
            bigger = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
            expected = sliding_window_inference(bigger, (32, 32, 32), 4, module.model, overlap=0.25, mode="gaussian")
            assert torch.equal(module.predict_logits(bigger), expected)  # MONAI's own loop and weights, bit for bit
        # the blending weights were made once, not at every call (making them reads the device)
        assert gaussian_weights.cache_info().misses == 1 and gaussian_weights.cache_info().hits == 1


def test_validation_metrics_kept_on_the_device_equal_the_metrics_fed_batch_by_batch():
    """Predictions and label maps held until the epoch's metrics are computed (volumes of their own sizes, handed over
    one by one, and held ones handed over early once they grow large) give the metrics per-batch updates give."""
    from torchmetrics.classification import MulticlassJaccardIndex
    from torchmetrics.segmentation import DiceScore

    from vitlab.training.segmentation import SegmentationModule

    module = SegmentationModule(num_classes=2, model_name="monai:swin_unetr",
                                model_kwargs=dict(img_size=32, feature_size=12, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                                  window_size=4, norm_name="batch"))
    dice = DiceScore(3, include_background=False, average="none", aggregation_level="global", input_format="index")
    iou = MulticlassJaccardIndex(3, average="none")
    generator = torch.Generator().manual_seed(3)
    module.outputs["val"].flush_elements = 3000  # (the second and third batches overflow it: what is held goes early)
    for shape in ((1, 12, 10, 8), (2, 9, 9, 9), (1, 16, 12, 10), (1, 5, 7, 6)):
        logits, mask = torch.randn(shape[0], 3, *shape[1:], generator=generator), torch.randint(0, 3, shape, generator=generator)
        module.update_metrics("val", logits, mask)
        dice.update(logits.argmax(dim=1), mask)
        iou.update(logits.argmax(dim=1), mask)
    assert len(module.outputs["val"]) == 1  # the last volume still held
    values = module.compute_metrics("val")
    expected_dice, expected_iou = dice.compute(), iou.compute()[1:]
    assert values["val/dice"] == float(expected_dice.mean()) and values["val/iou"] == float(expected_iou.mean())
    for index, name in enumerate(module.class_names):
        assert values[f"val/dice_{name}"] == float(expected_dice[index]) and values[f"val/iou_{name}"] == float(expected_iou[index])
    assert len(module.outputs["val"]) == 0  # all handed over


@pytest.mark.slow
@pytest.mark.parametrize("patches", [False, True], ids=["whole", "patches"])
def test_tiny_swin_unetr_segments_whole_volumes_with_the_qkv_callbacks(tmp_path, patches):
    from tests.helpers.runs import events, tiny_args
    from vitlab.cli import fit
    from vitlab.data.synthetic import generate_volumes

    manifest = generate_volumes(tmp_path / "v", patients=4, size=32, slices=8, seed=2, difficulty=0.0)
    kwargs = "{img_size: 32, feature_size: 12, depths: [2, 2, 2, 2], num_heads: [2, 2, 4, 4], window_size: 4, norm_name: batch}"
    extra = ["--task", "segmentation", "--model.model_name", "monai:swin_unetr", "--model.model_kwargs", kwargs,
             "--model.sliding_window", "[32, 32, 32]", "--data.sample", "volume", "--data.spacing", "[1.4, 1.4, 2.5]",
             "--data.volume_size", "[32, 32, 32]", "--data.mask_classes", "[lesion]", "--data.window", "soft_tissue",
             "--data.augment", "none", "--data.val_fraction", "0.5", "--data.batch_size", "2"]
    if patches:  # training on random 32^3 patches of each volume at its own resampled size; validation on whole volumes
        extra += ["--data.volume_size", "null", "--data.patch_size", "[32, 32, 32]", "--data.patch_foreground", "0.5"]
    cli = fit(tiny_args(manifest, tmp_path / "runs", epochs=1, extra=extra))
    run = tmp_path / "runs" / "tiny" / "version_0"
    acc = events(run)
    tags = set(acc.Tags()["scalars"])
    assert {"val/dice_lesion", "val/iou_lesion", "drift/rel_frobenius/stage0.block0.q", "spectra/positive_mass/stage3.block1"} <= tags
    assert "val/segmentation" in acc.Tags()["images"] and (run / "qkv" / "epoch_001.safetensors").is_file()
    assert cli.model.model.__class__.__name__ == "SwinUNETR"
    if patches:
        assert [batch[0].shape for batch in cli.datamodule.val_dataloader()] == [(1, 1, 16, 16, 8)] * 2  # 32 x 32 x 8 at 1.4 mm
        assert next(iter(cli.datamodule.train_dataloader()))[0].shape == (2, 1, 32, 32, 32)
