"""The base every vitlab task shares: interventions on the backbone, AdamW groups, warm-up + cosine, best metrics.

A task module sets ``self.model`` (a classifier, or a detector / segmenter whose backbone
:mod:`vitlab.models` finds); the Q/K/V callbacks and probes only talk to ``module.model``.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch.nn.utils.weight_norm import WeightNorm

from vitlab import models


class TaskModule(pl.LightningModule):
    """Shared plumbing. Subclasses call ``save_hyperparameters`` (with ``lr``, ``weight_decay``,
    ``layer_decay``, ``warmup_epochs``, ``min_lr_ratio``), build ``self.model``, then :meth:`_intervene`."""

    def __init__(self) -> None:
        super().__init__()
        self.best_val: dict[str, float] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn``) and deep-copyable at any time: a ``torch.nn.utils.weight_norm`` layer (lightly's
        DINO head) keeps its weight as a non-leaf tensor that pickle refuses; it is recomputed from ``weight_g`` /
        ``weight_v`` before every forward, so the stored copy is detached."""
        for module in self.modules():
            for hook in module._forward_pre_hooks.values():
                if isinstance(hook, WeightNorm):
                    weight = getattr(module, hook.name)
                    if isinstance(weight, torch.Tensor) and not weight.is_leaf:
                        setattr(module, hook.name, weight.detach())
        return super().__getstate__()

    def _report_weights(self) -> None:
        """One line saying which backbone tensors a ``weights:`` file gave a detector / segmenter."""
        report = getattr(getattr(self.model, "backbone", None), "weights_report", None)
        if report is not None:
            keys = report.loaded_keys
            print(f"vitlab: {report.source}: {len(keys)} backbone tensors loaded ({keys[0]} ... {keys[-1]})"
                  + ("; its classifier head was left out" if report.head_reset else ""))

    def _intervene(self, ablate: dict[str, Any] | None, freeze: list[str] | None) -> None:
        """Encoder ablation and freezing of backbone parts (after the weights are loaded)."""
        self._report_weights()
        if ablate:
            models.ablate(self.model, **ablate)
        if freeze:
            models.freeze(self.model, freeze)

    def _track_best(self, values: dict[str, Any]) -> None:
        """Remember the best (max) value of each ``stage/name`` metric for the hparams table."""
        if self.trainer.sanity_checking:
            return
        for key, value in values.items():
            name = key.split("/", 1)[-1]
            value = float(value)
            if math.isnan(value):
                continue
            best = self.best_val.get(name)
            self.best_val[name] = value if best is None else max(best, value)

    def validation_figures(self) -> dict[str, Any]:
        """Figures of the last validation (tag -> :mod:`vitlab.outputs.figures` object), drawn by the run's
        :class:`vitlab.callbacks.RuntimeCallback` when figures are due; none by default."""
        return {}

    def on_fit_end(self) -> None:
        """Log hyperparameters together with the best validation metrics (no placeholder ``hp_metric``)."""
        if not self.best_val:
            return
        metrics = {f"hp/best_val_{k}": v for k, v in self.best_val.items()}
        from vitlab.outputs.tensorboard import logging_step

        step = max(logging_step(self.trainer) - 1, 0)  # the last epoch's step: a resumed run adds a point, not a duplicate
        for logger in self.loggers:
            logger.log_hyperparams(dict(self.hparams), metrics=metrics, step=step)

    def optimizer_groups(self) -> list[dict]:
        """AdamW groups of ``self.model`` (:func:`vitlab.models.parameter_groups`: no weight decay on norms, biases,
        position tables; ``lr_scale`` from ``layer_decay``). A task with trainable modules outside ``self.model``
        (DINO's projection head) appends its groups here."""
        hp = self.hparams
        return models.parameter_groups(self.model, weight_decay=hp.weight_decay, layer_decay=hp.get("layer_decay"))

    def configure_optimizers(self):
        hp = self.hparams
        groups = [group for group in self.optimizer_groups() if group["params"]]
        for group in groups:
            group["lr"] = hp.lr * group.pop("lr_scale", 1.0)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr)
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        steps_per_epoch = max(total_steps // max(self.trainer.max_epochs or 1, 1), 1)
        warmup_steps = min(int(round(hp.warmup_epochs * steps_per_epoch)), total_steps - 1)
        schedule = warmup_cosine(warmup_steps, total_steps, hp.min_lr_ratio)
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
