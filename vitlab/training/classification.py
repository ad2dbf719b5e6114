"""LightningModule for fine-tuning a Vision Transformer classifier on medical images."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
)

from vitlab.training.base import TaskModule, warmup_cosine
from vitlab.training.outputs import EpochOutputs

__all__ = ["ClassificationModule", "warmup_cosine"]


class ClassificationModule(TaskModule):
    """Fine-tunes a timm / torchvision ViT, Swin or Mixer as an image classifier.

    The model is built through :func:`vitlab.models.build_model`, so any analysis (Q/K/V views, attention
    recording, ablations) works on ``module.model``. Optimiser: AdamW over
    :func:`vitlab.models.parameter_groups` (no weight decay on norms, biases, position embeddings and
    relative-position tables; optional layer-wise LR decay), linear warm-up then cosine decay per step.

    Args:
        num_classes: Number of classes (linked from the data module by the CLI).
        label_smoothing: Cross-entropy label smoothing.
        class_names: Class names for the confusion matrix (linked from the data module).
        class_weights: Cross-entropy weight per class in the training loss (e.g. ``[1, 5]`` when the second class is
            five times rarer, as lesion slices are among a volume's slices); None: equal weights. Validation and test
            losses stay unweighted.
        **kwargs: The backbone and optimiser arguments of :class:`~vitlab.training.base.TaskModule`
            (``model_name``, ``weights``, ``lr``, ``layer_decay`` ...).
    """

    task = "classification"

    def __init__(
        self,
        num_classes: int = 2,
        label_smoothing: float = 0.0,
        class_names: list[str] | None = None,
        class_weights: list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_classes < 2:
            hint = " (data.labels false gives unlabelled images: they pretrain with task: dino)" if num_classes == 0 else ""
            raise ValueError(f"model.num_classes must be >= 2, got {num_classes}{hint}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"model.label_smoothing must be in [0, 1), got {label_smoothing}")
        if class_weights is not None and (len(class_weights) != num_classes or not all(w > 0 for w in class_weights)):
            raise ValueError(f"model.class_weights must give {num_classes} positive numbers (one per class), got {class_weights}")
        self.register_buffer("class_weights", None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32),
                             persistent=False)
        backbone = self.backbone_args
        self.model = self.build_network("build_model", name=backbone.model_name, num_classes=num_classes,
                                        in_chans=backbone.in_chans, pretrained=backbone.pretrained,
                                        weights=backbone.weights, **backbone.model_kwargs)
        self._intervene()
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        metrics = MetricCollection(
            {
                "acc": MulticlassAccuracy(num_classes, average="micro"),
                "balanced_acc": MulticlassAccuracy(num_classes, average="macro"),
                "f1_macro": MulticlassF1Score(num_classes, average="macro"),
                "auroc": MulticlassAUROC(num_classes),
            }
        )
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        self.val_confusion = MulticlassConfusionMatrix(num_classes)
        # each step's probabilities and labels stay on the device; the metrics get them once per epoch
        self.outputs = {stage: EpochOutputs(getattr(self, f"_update_{stage}")) for stage in ("train", "val", "test")}

    def _update_train(self, probs: torch.Tensor, labels: torch.Tensor) -> None:
        self.train_metrics.update(probs, labels)

    def _update_val(self, probs: torch.Tensor, labels: torch.Tensor) -> None:
        self.val_metrics.update(probs, labels)
        self.val_confusion.update(probs, labels)

    def _update_test(self, probs: torch.Tensor, labels: torch.Tensor) -> None:
        self.test_metrics.update(probs, labels)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, K)
        return self.model(images)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        """Loss of one batch; its probabilities and labels are kept on the device for the epoch's metrics (no
        host-device synchronisation here: see :mod:`vitlab.training.outputs`)."""
        images, labels = batch  # (B, C, H, W), (B,)
        logits = self(images)  # (B, K)
        train = stage == "train"
        loss = F.cross_entropy(logits, labels, weight=self.class_weights if train else None,
                               label_smoothing=self.hparams.label_smoothing if train else 0.0)
        self.outputs[stage].append(logits.detach().float().softmax(dim=-1), labels)  # (B, K), (B,)
        on_step = stage == "train"
        # (not prog_bar: Lightning reads such values off the device after every batch; vitlab.callbacks.LogStepProgressBar
        # shows the loss at the logging steps)
        self.log_batch(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, batch_size=len(labels), sync_dist=not on_step)
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def on_train_epoch_end(self) -> None:
        self.outputs["train"].flush()
        self.log_dict(self.train_metrics.compute(), sync_dist=True)
        self.train_metrics.reset()

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self.outputs["val"].flush()
        values = self.val_metrics.compute()
        self.log_dict(values, prog_bar=False, sync_dist=True)
        self.val_metrics.reset()
        self._confusion = self.val_confusion.compute().cpu().numpy()  # (K, K) rows = true class
        self.val_confusion.reset()
        if self.trainer.sanity_checking:
            return
        self._track_best(values)

    def validation_figures(self) -> dict[str, Any]:
        if getattr(self, "_confusion", None) is None:
            return {}
        from vitlab.outputs.figures import confusion_matrix

        return {"val/confusion_matrix": confusion_matrix(self._confusion, self.class_names)}

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.outputs["test"].flush()
        self.log_dict(self.test_metrics.compute(), sync_dist=True)
        self.test_metrics.reset()
