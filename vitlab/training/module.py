"""LightningModule for fine-tuning a Vision Transformer classifier on medical images."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
)

from vitlab import models
from vitlab.tblog import confusion_matrix_figure, figures_due, logging_step, tensorboard_writer


class ClassificationModule(pl.LightningModule):
    """Fine-tunes a timm / torchvision ViT, Swin or Mixer as an image classifier.

    The model is built through :func:`vitlab.models.build_model`, so any analysis (Q/K/V views, attention
    recording, ablations) works on ``module.model``. Optimiser: AdamW over
    :func:`vitlab.models.parameter_groups` (no weight decay on norms, biases, position embeddings and
    relative-position tables; optional layer-wise LR decay), linear warm-up then cosine decay per step.

    Args:
        model_name: timm or torchvision model name (prefix ``timm:`` / ``torchvision:`` to disambiguate).
        num_classes: Number of classes (linked from the data module by the CLI).
        in_chans: Input channels (linked from the data module by the CLI).
        pretrained: Load the library's pretrained weights (needs network or a warm cache).
        weights: Local weights file (state_dict, safetensors or vitlab checkpoint); head and first conv
            are adapted when class count / channels differ.
        model_kwargs: Extra constructor arguments (e.g. ``drop_path_rate``, tiny ``embed_dim``).
        ablate: Encoder ablation applied after the weights are loaded, e.g.
            ``{"remove": ["residual"], "blocks": [0, 1]}`` (see :func:`vitlab.models.ablate`).
        freeze: Parts to freeze, e.g. ``["patch_embed"]`` (see :func:`vitlab.models.freeze`).
        lr: Peak learning rate.
        weight_decay: AdamW weight decay for the decayed group.
        layer_decay: Layer-wise LR decay factor (e.g. 0.75); ``None`` disables it.
        warmup_epochs: Linear warm-up length in epochs (fractions allowed).
        min_lr_ratio: Final LR of the cosine schedule as a fraction of ``lr``.
        label_smoothing: Cross-entropy label smoothing.
        class_names: Class names for the confusion matrix (linked from the data module).
    """

    def __init__(
        self,
        model_name: str = "swin_tiny_patch4_window7_224",
        num_classes: int = 2,
        in_chans: int = 1,
        pretrained: bool = False,
        weights: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        ablate: dict[str, Any] | None = None,
        freeze: list[str] | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.05,
        layer_decay: float | None = None,
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.01,
        label_smoothing: float = 0.0,
        class_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"model.num_classes must be >= 2, got {num_classes}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"model.label_smoothing must be in [0, 1), got {label_smoothing}")
        if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"model.layer_decay must be in (0, 1] or null, got {layer_decay}")
        self.save_hyperparameters(logger=False)
        self.model = models.build_model(
            model_name,
            num_classes=num_classes,
            in_chans=in_chans,
            pretrained=pretrained,
            weights=weights,
            **(model_kwargs or {}),
        )
        if ablate:
            models.ablate(self.model, **ablate)
        if freeze:
            models.freeze(self.model, freeze)
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
        self.best_val: dict[str, float] = {}

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, K)
        return self.model(images)

    def _step(
        self, batch: tuple[torch.Tensor, torch.Tensor], metrics: MetricCollection, stage: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = batch  # (B, C, H, W), (B,)
        logits = self(images)  # (B, K)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing if stage == "train" else 0.0)
        probs = logits.detach().float().softmax(dim=-1)
        metrics.update(probs, labels)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, batch_size=len(labels), sync_dist=not on_step)
        return loss, probs, labels

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._step(batch, self.train_metrics, "train")
        return loss

    def on_train_epoch_end(self) -> None:
        self.log_dict(self.train_metrics.compute(), sync_dist=True)
        self.train_metrics.reset()

    def validation_step(self, batch, batch_idx: int) -> None:
        _, probs, labels = self._step(batch, self.val_metrics, "val")
        self.val_confusion.update(probs, labels)

    def on_validation_epoch_end(self) -> None:
        values = self.val_metrics.compute()
        self.log_dict(values, prog_bar=False, sync_dist=True)
        self.val_metrics.reset()
        confusion = self.val_confusion.compute().cpu()  # (K, K) rows = true class
        self.val_confusion.reset()
        if self.trainer.sanity_checking:
            return
        for key, value in values.items():
            name = key.split("/", 1)[1]
            value = float(value)
            best = self.best_val.get(name)
            self.best_val[name] = value if best is None else max(best, value)
        if self.trainer.is_global_zero and figures_due(self.trainer, self.current_epoch + 1):
            writer = tensorboard_writer(self.trainer)
            if writer is not None:
                writer.add_figure("val/confusion_matrix", confusion_matrix_figure(confusion, self.class_names), logging_step(self.trainer))  # val/*'s step

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, self.test_metrics, "test")

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute(), sync_dist=True)
        self.test_metrics.reset()

    def on_fit_end(self) -> None:
        """Log hyperparameters together with the best validation metrics (no placeholder ``hp_metric``)."""
        if not self.best_val:
            return
        metrics = {f"hp/best_val_{k}": v for k, v in self.best_val.items()}
        step = max(logging_step(self.trainer) - 1, 0)  # the last epoch's step: a resumed run adds a point, not a duplicate
        for logger in self.loggers:
            logger.log_hyperparams(dict(self.hparams), metrics=metrics, step=step)

    def configure_optimizers(self):
        groups = models.parameter_groups(self.model, weight_decay=self.hparams.weight_decay, layer_decay=self.hparams.layer_decay)
        for group in groups:
            group["lr"] = self.hparams.lr * group.pop("lr_scale", 1.0)
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        steps_per_epoch = max(total_steps // max(self.trainer.max_epochs or 1, 1), 1)
        warmup_steps = min(int(round(self.hparams.warmup_epochs * steps_per_epoch)), total_steps - 1)
        schedule = warmup_cosine(warmup_steps, total_steps, self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier: linear warm-up from ~0 to 1 over ``warmup_steps``, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
