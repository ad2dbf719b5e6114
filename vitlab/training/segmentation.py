"""LightningModule for semantic segmentation: a timm ViT / Swin encoder with a light FPN decoder."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassJaccardIndex
from torchmetrics.segmentation import DiceScore

from vitlab.training.base import TaskModule
from vitlab.training.outputs import EpochOutputs


def soft_dice_loss(logits: torch.Tensor, target: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    """1 - mean over foreground classes of the batch soft Dice; logits (B, K+1, *S), target (B, *S) int, for images
    (S = H, W) and volumes (S = I, J, K): MONAI's ``DiceLoss(include_background=False, to_onehot_y=True,
    softmax=True, batch=True, smooth_nr=eps, smooth_dr=eps)``."""
    probs = logits.float().softmax(dim=1)[:, 1:]  # (B, K, *S)
    onehot = F.one_hot(target, logits.shape[1]).movedim(-1, 1)[:, 1:].float()  # (B, K, *S)
    dims = (0, *range(2, logits.ndim))
    inter = (probs * onehot).sum(dim=dims)
    total = probs.sum(dim=dims) + onehot.sum(dim=dims)
    return 1.0 - ((2 * inter + eps) / (total + eps)).mean()


class SegmentationModule(TaskModule):
    """Fine-tunes a segmenter (see :func:`vitlab.models.build_segmenter`) with cross-entropy + soft Dice, on images
    or on whole volumes (``data.sample: volume`` with a 3-D model such as ``monai:swin_unetr``; validation and test
    then run MONAI's ``sliding_window_inference`` over each volume when ``sliding_window`` is set, and the figure
    shows the middle slice).

    Batches are ``(images, targets)`` from :class:`vitlab.data.DenseDataModule` (``target["mask"]`` is the
    label map). Validation logs ``val/loss``, ``val/dice`` and ``val/iou`` (mean over foreground classes)
    and ``val/dice_<class>`` / ``val/iou_<class>`` (torchmetrics ``DiceScore`` and ``MulticlassJaccardIndex``,
    pooled over the split's pixels), and a figure ``val/segmentation`` (image | ground truth | prediction)
    of the first validation images every epoch.

    Args:
        num_classes: Foreground classes (linked from ``data.num_mask_classes``).
        image_size: Input side (linked from the data).
        decoder_channels: Width of the pyramid and the fusion head.
        dice_weight: Weight of the soft Dice loss added to cross-entropy.
        class_weights: Weight of each class in the cross-entropy term, background first (K + 1 numbers; the ``weight``
            of MONAI's ``DiceCELoss`` / torch's ``cross_entropy``: a weighted mean over pixels); None: all 1. A
            foreground weight above 1 moves the decision towards small, rare structures the unweighted mean would
            leave to the background.
        grid_images: Images in the validation figure (0 disables it).
        class_names: Foreground class names (linked from ``data.mask_classes``).
        sliding_window: Window (voxels along i, j, k) of MONAI's ``sliding_window_inference`` for validation and test
            on volumes; None: one forward pass over the whole input.
        sliding_overlap: Overlap of neighbouring windows (fraction of the window).
        **kwargs: The backbone and optimiser arguments of :class:`~vitlab.training.base.TaskModule`, as for
            :class:`~vitlab.training.DetectionModule`.
    """

    task = "segmentation"

    def __init__(
        self,
        num_classes: int = 1,
        image_size: int = 224,
        decoder_channels: int = 64,
        dice_weight: float = 1.0,
        class_weights: list[float] | None = None,
        grid_images: int = 4,
        class_names: list[str] | None = None,
        sliding_window: list[int] | None = None,
        sliding_overlap: float = 0.25,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sliding_window is not None and not (len(sliding_window) == 3 and all(int(n) > 0 for n in sliding_window)):
            raise ValueError(f"model.sliding_window must be 3 positive voxel counts (i, j, k) or null, got {sliding_window!r}")
        if not 0.0 <= sliding_overlap < 1.0:
            raise ValueError(f"model.sliding_overlap must be in [0, 1), got {sliding_overlap}")
        if class_weights is not None and (len(class_weights) != num_classes + 1 or min(class_weights) <= 0):
            raise ValueError(f"model.class_weights must be {num_classes + 1} positive numbers (background, then "
                             f"{num_classes} foreground class(es)), got {class_weights!r}")
        if num_classes < 1:
            raise ValueError(f"model.num_classes must be >= 1 (foreground classes), got {num_classes}")
        backbone = self.backbone_args
        self.model = self.build_network("build_segmenter", name=backbone.model_name, num_classes=num_classes,
                                        in_chans=backbone.in_chans, image_size=image_size,
                                        pretrained=backbone.pretrained, weights=backbone.weights,
                                        decoder_channels=decoder_channels, model_kwargs=backbone.model_kwargs)
        self._intervene()
        # on the module's device with it (not rebuilt from the list each step: a host-to-device copy waits for the GPU)
        self.register_buffer("loss_weights", None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32),
                             persistent=False)
        self.class_names = list(class_names) if class_names else [str(i + 1) for i in range(num_classes)]
        k = num_classes + 1
        for stage in ("val", "test"):
            setattr(self, f"{stage}_dice", DiceScore(k, include_background=False, average="none",
                                                     aggregation_level="global", input_format="index"))
            setattr(self, f"{stage}_iou", MulticlassJaccardIndex(k, average="none"))
        # each step's prediction and label map stay on the device until the epoch's metrics are computed (the metrics'
        # updates wait for the GPU: see vitlab.training.outputs); volumes of their own sizes are handed over one by one
        self.outputs = {stage: EpochOutputs(functools.partial(self._update_now, stage), concatenate=False)
                        for stage in ("val", "test")}
        self._grid: tuple | None = None
        self._grid_view = ""  # what the figure's rows show, for its title

    def setup(self, stage: str) -> None:
        """A manifest row with ``boxes`` but no ``mask`` has no label map to learn: one line, before any step."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None or not hasattr(datamodule, "samples"):
            return
        boxed = [s for split in ("train", "val", "test") for s in datamodule.samples(split) if s.mask is None]
        if boxed:
            raise ValueError(f"segmentation needs a label map for every image: {boxed[0].path} has a 'boxes' cell but no "
                             f"'mask' ({len(boxed)} such rows); add the masks, or train these boxes with task: detection")

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, C, *S) -> (B, K+1, *S)
        return self.model(images)

    def predict_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (B, K+1, *S) for evaluation: MONAI's sliding-window inference over a volume when
        ``sliding_window`` is set, else one forward pass."""
        from vitlab.models.inference import segment_logits

        return segment_logits(self.model, images, self.hparams.sliding_window, self.hparams.sliding_overlap)

    def _loss(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), mask, weight=self.loss_weights) + self.hparams.dice_weight * soft_dice_loss(logits, mask)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        mask = torch.stack([t["mask"] for t in targets])  # (B, H, W)
        loss = self._loss(self(images), mask)
        self.log_batch("train/loss", loss, on_step=True, on_epoch=True, batch_size=len(images))
        return loss

    def update_metrics(self, stage: str, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed one batch's argmax prediction to the stage's Dice / IoU (kept on the device and handed to the metrics
        when :meth:`compute_metrics` runs, or earlier once they grow large: no wait for the GPU in the step)."""
        self.outputs[stage].append(logits.argmax(dim=1), mask)  # (B, *S), (B, *S)

    def _update_now(self, stage: str, pred: torch.Tensor, mask: torch.Tensor) -> None:
        getattr(self, f"{stage}_dice").update(pred, mask)
        getattr(self, f"{stage}_iou").update(pred, mask)

    def compute_metrics(self, stage: str) -> dict[str, float]:
        """``stage/dice``, ``stage/iou`` and per-class values; resets the metrics."""
        self.outputs[stage].flush()
        dice = getattr(self, f"{stage}_dice").compute().reshape(-1)  # (K,) foreground
        iou = getattr(self, f"{stage}_iou").compute().reshape(-1)[1:]  # (K,) without background
        getattr(self, f"{stage}_dice").reset()
        getattr(self, f"{stage}_iou").reset()
        values = {f"{stage}/dice": float(dice.mean()), f"{stage}/iou": float(iou.mean())}
        for name, d, j in zip(self.class_names, dice, iou):
            values[f"{stage}/dice_{name}"], values[f"{stage}/iou_{name}"] = float(d), float(j)
        return values

    def validation_step(self, batch, batch_idx: int) -> None:
        images, targets = batch
        mask = torch.stack([t["mask"] for t in targets])
        logits = self.predict_logits(images)
        self.log_batch("val/loss", self._loss(logits, mask), on_epoch=True, batch_size=len(images))
        self.update_metrics("val", logits, mask)
        if batch_idx == 0 and self.hparams.grid_images:
            n = self.hparams.grid_images
            grid = (images[:n].detach(), mask[:n], logits[:n].argmax(dim=1))
            self._grid_view = ""
            if images.ndim == 5:  # volumes (B, C, I, J, K): the middle slice along k, shown as DICOM shows it (rows along j)
                k = images.shape[-1] // 2
                grid = tuple(t[..., k].transpose(-1, -2) for t in grid)
                self._grid_view = f"each volume's middle slice along k (k = {k} of 0-{images.shape[-1] - 1}; rows along j)"
            # copies kept on the device until the figures are drawn (a copy to the host here would wait for the GPU)
            self._grid = tuple(t.clone() for t in grid)

    def on_validation_epoch_end(self) -> None:
        values = self.compute_metrics("val")
        self.log_dict(values)
        if self.trainer.sanity_checking:
            return
        self._track_best(values)

    def validation_figures(self) -> dict[str, Any]:
        if self._grid is None:
            return {}
        from vitlab.outputs.figures import SegmentationOverlay

        images, truth, pred = (t.cpu() for t in self._grid)
        return {"val/segmentation": SegmentationOverlay(images[:, 0].float().numpy(), truth.numpy(), pred.numpy(), list(self.class_names),
                                                        self._grid_view)}

    def test_step(self, batch, batch_idx: int) -> None:
        images, targets = batch
        self.update_metrics("test", self.predict_logits(images), torch.stack([t["mask"] for t in targets]))

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.compute_metrics("test"))
