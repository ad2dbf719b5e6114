"""LightningModule for instance detection / segmentation: torchvision Mask R-CNN over a timm ViT / Swin."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics.detection import MeanAveragePrecision

from vitlab.training.base import TaskModule

# MeanAveragePrecision keys -> logged names (``val/<name>``)
_LOGGED = {"bbox_map": "map", "bbox_map_50": "map_50", "bbox_map_75": "map_75", "bbox_mar_100": "mar_100",
           "segm_map": "mask_map", "segm_map_50": "mask_map_50", "segm_map_75": "mask_map_75"}


class DetectionModule(TaskModule):
    """Fine-tunes a Mask R-CNN (boxes + instance masks) whose backbone is a timm Swin or ViT.

    Batches are ``(images (B, C, S, S), targets)`` from :class:`vitlab.data.DenseDataModule`. The training
    loss is the sum of torchvision's five losses (each logged under ``train/``); validation logs COCO
    box and mask mAP (torchmetrics ``MeanAveragePrecision``, pycocotools backend): ``val/map``,
    ``val/map_50``, ``val/map_75``, ``val/mar_100``, ``val/mask_map``, ``val/mask_map_50``, ``val/mask_map_75``.

    Args:
        num_classes: Foreground classes (linked from ``data.num_mask_classes``).
        image_size: Input side (linked from the data).
        heads: ``"light"`` (2-core CPU sizes) or ``"full"`` (torchvision's defaults).
        head_kwargs: Overrides of :data:`vitlab.models.DETECTION_HEADS` keys (``fpn_channels``, ``anchor_base`` ...).
        class_names: Foreground class names (linked from ``data.mask_classes``).
        grid_images: Images of the first validation batch in the validation figure, image | ground truth |
            prediction (0 disables it).
        **kwargs: The backbone and optimiser arguments of :class:`~vitlab.training.base.TaskModule` (a timm Swin /
            ViT ``model_name``; ``weights`` a classifier's or detector's checkpoint, whose backbone is loaded).
    """

    task = "detection"

    def __init__(
        self,
        num_classes: int = 1,
        image_size: int = 224,
        heads: str = "light",
        head_kwargs: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        grid_images: int = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_classes < 1:
            raise ValueError(f"model.num_classes must be >= 1 (foreground classes), got {num_classes}")
        backbone = self.backbone_args
        self.model = self.build_network("build_detector", name=backbone.model_name, num_classes=num_classes,
                                        in_chans=backbone.in_chans, image_size=image_size,
                                        pretrained=backbone.pretrained, weights=backbone.weights, heads=heads,
                                        model_kwargs=backbone.model_kwargs, **(head_kwargs or {}))
        self._intervene()
        self.class_names = list(class_names) if class_names else [str(i + 1) for i in range(num_classes)]
        self.val_map = MeanAveragePrecision(iou_type=("bbox", "segm"), backend="pycocotools")
        self.test_map = MeanAveragePrecision(iou_type=("bbox", "segm"), backend="pycocotools")
        self._grid: tuple | None = None  # the figure's images, targets and detections (validation's first batch)

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Detections per image: ``boxes`` (N, 4), ``labels`` (N,), ``scores`` (N,), ``masks`` (N, 1, S, S)."""
        return self.model(list(images))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        losses = self.model(list(images), targets)
        loss = sum(losses.values())
        batch_size = len(images)
        self.log_batch("train/loss", loss, on_step=True, on_epoch=True, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, on_step=False, on_epoch=True, batch_size=batch_size)
        return loss

    @staticmethod
    def update_metric(metric: MeanAveragePrecision, preds: list[dict], targets: list[dict]) -> None:
        """Feed detections and ground truth to a ``MeanAveragePrecision`` (masks binarised at 0.5)."""
        metric.update(
            [{"boxes": p["boxes"].float(), "scores": p["scores"].float(), "labels": p["labels"],
              "masks": (p["masks"][:, 0] > 0.5) if p["masks"].ndim == 4 else p["masks"].bool()} for p in preds],
            [{"boxes": t["boxes"].float(), "labels": t["labels"], "masks": t["masks"].bool()} for t in targets],
        )

    @staticmethod
    def summarise(values: dict[str, torch.Tensor], stage: str) -> dict[str, float]:
        """The logged scalars of a computed ``MeanAveragePrecision`` (-1 'no ground truth' becomes 0)."""
        return {f"{stage}/{name}": max(float(values[key]), 0.0) for key, name in _LOGGED.items() if key in values}

    def validation_step(self, batch, batch_idx: int) -> None:
        images, targets = batch
        preds = self(images)
        self.update_metric(self.val_map, preds, targets)
        if batch_idx == 0 and self.hparams.grid_images:
            self._grid = figure_batch(images, targets, preds, self.hparams.grid_images)

    def validation_figures(self) -> dict[str, Any]:
        if self._grid is None:
            return {}
        from vitlab.outputs.figures import DetectionOverlay

        images, truth, pred = self._grid
        host = lambda group: {k: v.cpu().numpy() for k, v in group.items()}  # noqa: E731
        return {"val/detection": DetectionOverlay(images.cpu().float().numpy(), [host(t) for t in truth],
                                                  [host(p) for p in pred], list(self.class_names))}

    def on_validation_epoch_end(self) -> None:
        values = self.summarise(self.val_map.compute(), "val")
        self.val_map.reset()
        self.log_dict(values)
        self._track_best(values)

    def test_step(self, batch, batch_idx: int) -> None:
        images, targets = batch
        self.update_metric(self.test_map, self(images), targets)

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.summarise(self.test_map.compute(), "test"))
        self.test_map.reset()


FIGURE_DETECTIONS = 20  # the most detections of an image kept for the figure (torchvision's come by score, highest first)


def figure_batch(images: torch.Tensor, targets: list[dict], preds: list[dict], count: int) -> tuple:
    """The first ``count`` images (first channel), their targets and their top detections (masks at 0.5), kept on
    the device until the figure is drawn (slices and comparisons only: no wait for the GPU)."""
    keep = lambda t, keys: {k: t[k].detach().clone() for k in keys if k in t}  # noqa: E731
    pred = []
    for p in preds[:count]:
        top = {k: v[:FIGURE_DETECTIONS].detach() for k, v in p.items() if k in ("boxes", "labels", "scores", "masks")}
        if "masks" in top:
            top["masks"] = (top["masks"][:, 0] > 0.5) if top["masks"].ndim == 4 else top["masks"].bool()
        pred.append({k: v.clone() for k, v in top.items()})
    truth = [keep(t, ("boxes", "labels")) | ({"masks": t["masks"].bool()} if "masks" in t else {}) for t in targets[:count]]
    return images[:count, 0].detach().clone(), truth, pred
