"""Detection and segmentation end to end through train.py's CLI; metric paths on perfect / empty predictions."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import DENSE_SWIN, dense_args, events
from vitlab.qkv.state import load_snapshot, qkv_state
from vitlab.cli import fit
from vitlab.training import DetectionModule, SegmentationModule

@pytest.mark.slow
@pytest.mark.parametrize("task,metrics", [
    ("detection", ["val/map", "val/map_50", "val/mask_map", "val/mask_map_50", "train/loss_mask"]),
    ("segmentation", ["val/dice", "val/dice_lesion", "val/iou_lesion", "val/loss"]),
])
def test_dense_fit_logs_metrics_and_drift_and_resumes(task, metrics, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    cli = fit(dense_args(task, tmp_path / "runs", epochs=1))
    run = tmp_path / "runs" / task / "version_0"
    acc = events(run)
    scalars = set(acc.Tags()["scalars"])
    for tag in [*metrics, "drift/rel_frobenius/stage0.block0.q", "spectra/positive_mass/stage1.block1"]:
        assert tag in scalars, tag
    assert all(0.0 <= e.value <= 1.0 for m in metrics if not m.endswith(("loss", "_epoch")) for e in acc.Scalars(m))
    # the validation figure, on its scalars' axis (the step of val/*), drawn as every other figure is
    figure, metric = ("val/segmentation", "val/dice") if task == "segmentation" else ("val/detection", "val/map")
    assert [e.step for e in acc.Images(figure)] == [e.step for e in acc.Scalars(metric)]
    snap, _ = load_snapshot(run / "qkv" / "epoch_001.safetensors")  # the callbacks snapshot the backbone
    live = qkv_state(cli.model.model)
    assert snap.keys() == live.keys() and all(torch.equal(snap[k], live[k]) for k in live)

    # probes given the checkpoint see the same backbone (a classifier built around it)
    import argparse

    from vitlab.probes.loading import load_model

    loaded = load_model(argparse.Namespace(checkpoint=run / "checkpoints" / "last.ckpt"))
    probed = qkv_state(loaded.model)
    assert probed.keys() == live.keys() and all(torch.equal(probed[k], live[k]) for k in live)

    fit(dense_args(task, tmp_path / "runs", epochs=2, extra=["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]))
    assert not (tmp_path / "runs" / task / "version_1").exists()
    assert (run / "qkv" / "epoch_002.safetensors").is_file()
    assert len(events(run).Scalars("drift/rel_frobenius/stage0.block0.q")) == 2


def planted_targets(size=32):
    masks = torch.zeros(2, size, size, dtype=torch.uint8)
    masks[0, 2:10, 3:12] = 1
    masks[1, 18:30, 15:29] = 1
    return {"boxes": torch.tensor([[3.0, 2, 12, 10], [15, 18, 29, 30]]), "labels": torch.tensor([1, 1]), "masks": masks}


def test_detection_metric_path_perfect_and_empty():
    module = DetectionModule(num_classes=1, image_size=32, **DENSE_SWIN)
    truth = [planted_targets(), {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                                 "masks": torch.zeros(0, 32, 32, dtype=torch.uint8)}]
    perfect = [{**t, "scores": torch.ones(len(t["labels"])), "masks": t["masks"][:, None].float()} for t in truth]
    module.update_metric(module.val_map, perfect, truth)
    values = module.summarise(module.val_map.compute(), "val")
    module.val_map.reset()
    assert values["val/map_50"] == pytest.approx(1.0) and values["val/map"] == pytest.approx(1.0)
    assert values["val/mask_map"] == pytest.approx(1.0)
    empty = [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64),
              "masks": torch.zeros(0, 1, 32, 32)} for _ in truth]
    module.update_metric(module.val_map, empty, truth)
    values = module.summarise(module.val_map.compute(), "val")
    assert values["val/map_50"] == 0.0 and values["val/mask_map"] == 0.0


def test_module_reports_the_backbone_keys_it_loaded(tmp_path, capsys):
    from vitlab import models

    classifier = models.build_model(DENSE_SWIN["model_name"], num_classes=2, in_chans=1, img_size=32, **DENSE_SWIN["model_kwargs"])
    torch.save({"state_dict": {f"model.{k}": v for k, v in classifier.state_dict().items()}}, tmp_path / "c.ckpt")
    module = SegmentationModule(num_classes=1, image_size=32, weights=str(tmp_path / "c.ckpt"), **DENSE_SWIN)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    n = len(models.backbone_state(module.model))
    assert f"{n} backbone tensors loaded" in line and "c.ckpt" in line and "head was left out" in line


def test_segmentation_metric_path_perfect_and_empty():
    module = SegmentationModule(num_classes=1, image_size=32, class_names=["lesion"], **DENSE_SWIN)
    mask = planted_targets()["masks"].amax(dim=0, keepdim=True).long()  # (1, H, W) label map
    mask = torch.cat([mask, torch.zeros_like(mask)])  # and a lesion-free image
    perfect = torch.nn.functional.one_hot(mask, 2).permute(0, 3, 1, 2).float() * 10  # (B, 2, H, W) logits
    module.update_metrics("val", perfect, mask)
    values = module.compute_metrics("val")
    assert values["val/dice_lesion"] == pytest.approx(1.0) and values["val/iou_lesion"] == pytest.approx(1.0)
    background_only = torch.tensor([10.0, -10.0])[None, :, None, None].expand(2, 2, 32, 32)
    module.update_metrics("val", background_only, mask)
    values = module.compute_metrics("val")
    assert values["val/dice_lesion"] == 0.0 and values["val/iou"] == 0.0
    loss_perfect = module._loss(perfect, mask)
    assert loss_perfect < 0.01 < module._loss(-perfect, mask)


def test_segmentation_class_weights_weight_each_pixels_cross_entropy_by_its_class():
    """The loss with ``class_weights`` = the weighted mean of per-pixel -log softmax (written out) + the soft Dice."""
    from vitlab.training.segmentation import soft_dice_loss

    torch.manual_seed(0)
    logits, mask = torch.randn(2, 3, 8, 8, 4), torch.randint(0, 3, (2, 8, 8, 4))  # 2 foreground classes, volumes
    weights = torch.rand(3) * 4 + 0.1
    module = SegmentationModule(num_classes=2, image_size=32, class_weights=weights.tolist(), dice_weight=0.7, **DENSE_SWIN)
    nll = -logits.log_softmax(dim=1).gather(1, mask[:, None])[:, 0]  # (2, 8, 8, 4)
    w = weights[mask]
    expected = (w * nll).sum() / w.sum() + 0.7 * soft_dice_loss(logits, mask)
    assert module._loss(logits, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    plain = SegmentationModule(num_classes=2, image_size=32, **DENSE_SWIN)
    assert plain._loss(logits, mask).item() == pytest.approx((nll.mean() + soft_dice_loss(logits, mask)).item(), rel=1e-5)
    for bad in ([1.0, 2.0], [1.0, 0.0, 2.0]):
        with pytest.raises(ValueError, match=r"model.class_weights must be 3 positive numbers \(background, then 2 "):
            SegmentationModule(num_classes=2, image_size=32, class_weights=bad, **DENSE_SWIN)


def test_segmentation_refuses_rows_with_boxes_but_no_mask(tmp_path):
    import pytorch_lightning as pl

    from tests.helpers.data import planted, write_manifest
    from vitlab.data import DenseDataModule

    rows = []
    for i in range(6):
        s = planted(tmp_path, f"i{i}", [(4, 6, 8)] if i % 2 else [], size=32)
        rows.append((s.path.name, "lesion" if i % 2 else "none", f"P{i}", s.mask.name if i != 3 else "",
                     "6 4 14 12 lesion" if i == 3 else ""))
    manifest = write_manifest(tmp_path / "m.csv", rows, header=("path", "label", "patient_id", "mask", "boxes"))
    dm = DenseDataModule(root=str(manifest), image_size=32, num_workers=0, batch_size=2, val_fraction=0.34)
    module = SegmentationModule(num_classes=1, image_size=32, **DENSE_SWIN)
    trainer = pl.Trainer(fast_dev_run=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"segmentation needs a label map for every image: .*i3.png has a 'boxes' "
                                         r"cell but no 'mask' \(1 such rows\)"):
        trainer.fit(module, datamodule=dm)


def test_the_detection_figure_draws_the_truth_and_the_detections_above_the_score_with_their_names():
    """Boxes where the instances are (a box's x2, y2 one past its last pixel), masks blended into the image, class
    names and scores as labels, detections under ``min_score`` left out, and the figure's batch cut to the top
    detections with their masks at 0.5, kept on the module's device."""
    import matplotlib
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    from vitlab.outputs.figures import OVERLAY_ALPHA, DetectionOverlay
    from vitlab.training.detection import FIGURE_DETECTIONS, figure_batch

    gen = torch.Generator().manual_seed(5)
    images = torch.rand(3, 1, 32, 32, generator=gen)
    truth = [planted_targets() for _ in range(3)]
    many = 30
    preds = [{"boxes": torch.tensor([[3.0, 2, 12, 10]]).repeat(many, 1), "labels": torch.ones(many, dtype=torch.int64),
              "scores": torch.linspace(0.9, 0.1, many), "masks": torch.rand(many, 1, 32, 32, generator=gen)} for _ in range(3)]
    kept_images, kept_truth, kept_pred = figure_batch(images, truth, preds, 2)
    assert torch.equal(kept_images, images[:2, 0]) and len(kept_truth) == len(kept_pred) == 2
    assert FIGURE_DETECTIONS == 20 and len(kept_pred[0]["scores"]) == 20
    assert torch.equal(kept_pred[0]["masks"], preds[0]["masks"][:20, 0] > 0.5)
    host = lambda group: {k: v.numpy() for k, v in group.items()}  # noqa: E731
    figure = DetectionOverlay(kept_images.numpy(), [host(t) for t in kept_truth], [host(p) for p in kept_pred], ["lesion"])
    fig = figure.build()
    try:
        panels = [ax for ax in fig.axes if ax.get_images()]
        assert len(panels) == 6
        shown = int((kept_pred[0]["scores"] >= 0.5).sum())
        assert shown == 15 and [ax.get_title() for ax in panels[:3]] == ["image", "ground truth\n2 instances", f"prediction (score >= 0.5)\n{shown} detections"]
        boxes = [p for p in panels[1].patches if isinstance(p, Rectangle)]
        assert [(b.get_x(), b.get_y(), b.get_width(), b.get_height()) for b in boxes] == [(2.5, 1.5, 9, 8), (14.5, 17.5, 14, 12)]
        assert [t.get_text() for t in panels[2].texts] == [f"lesion {float(s):.2f}" for s in kept_pred[0]["scores"][:shown]]
        assert [t.get_text() for t in panels[1].texts] == ["lesion", "lesion"]
        gray = (images[0, 0].double().numpy() - float(images[0, 0].min())) / (float(images[0, 0].max() - images[0, 0].min()) + 1e-8)
        colour = np.asarray(matplotlib.colormaps["tab10"](1)[:3])
        expected = np.repeat(gray[..., None], 3, axis=2)
        inside = truth[0]["masks"].sum(0).numpy() > 0
        expected[inside] = (1 - OVERLAY_ALPHA) * expected[inside] + OVERLAY_ALPHA * colour
        np.testing.assert_allclose(panels[1].get_images()[0].get_array(), expected, atol=1e-6)
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["1 lesion"]
    finally:
        plt.close(fig)
    low = {"boxes": np.zeros((2, 4)), "labels": np.array([1, 1]), "scores": np.array([0.31, 0.2]), "masks": np.zeros((2, 32, 32), bool)}
    fig = DetectionOverlay(kept_images.numpy()[:1], [host(kept_truth[0])], [low], ["lesion"]).build()
    try:
        panels = [ax for ax in fig.axes if ax.get_images()]
        assert panels[2].get_title().replace("\n", " ").endswith("0 detections (top score 0.31)") and not panels[2].texts
    finally:
        plt.close(fig)
