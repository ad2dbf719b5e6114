"""The arguments every task shares, grouped and checked once: the backbone to build, and how to optimise it.

The task modules take them as flat keyword arguments (``model.model_name``, ``model.lr`` ... in a config or on
the command line) and pass them on with ``**kwargs`` to :class:`~vitlab.training.base.TaskModule`, which
documents them once (``--help`` reads that docstring) and gathers them into these two dataclasses. The
checks live in ``__post_init__``, so every task refuses a bad value with the same one-line message naming its
config key. Hyperparameters stay the flat arguments (plain types: checkpoints load with ``weights_only=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BackboneArgs:
    """Which backbone a task builds, from which weights, and what is done to it once they are loaded.

    The fields are :class:`~vitlab.training.base.TaskModule`'s arguments of the same names; ``model_kwargs`` is
    a dict (empty for none). Their values are checked where they are used (:func:`vitlab.models.build_model`,
    :func:`vitlab.models.ablate`, :func:`vitlab.models.freeze`), which name the bad value.
    """

    model_name: str
    in_chans: int = 1
    pretrained: bool = False
    weights: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    ablate: dict[str, Any] | None = None
    freeze: list[str] | None = None


@dataclass(frozen=True)
class OptimizerArgs:
    """AdamW over the backbone's parameter groups, with linear warm-up then cosine decay per step.

    The fields are :class:`~vitlab.training.base.TaskModule`'s arguments of the same names.

    Raises:
        ValueError: A value outside its range, naming the config key (``model.layer_decay must be in (0, 1] or
            null, got 1.5``), before any model is built.
    """

    lr: float = 1e-4
    weight_decay: float = 0.05
    layer_decay: float | None = None
    warmup_epochs: float = 1.0
    min_lr_ratio: float = 0.01

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0.0):
            raise ValueError(f"model.lr must be > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise ValueError(f"model.weight_decay must be >= 0, got {self.weight_decay}")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"model.layer_decay must be in (0, 1] or null, got {self.layer_decay}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0.0):
            raise ValueError(f"model.warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"model.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
