"""The base every vitlab task shares: the backbone and optimiser arguments, interventions on the backbone, AdamW
groups, warm-up + cosine, best metrics.

A task module sets ``self.model`` (a classifier, or a detector / segmenter whose backbone
:mod:`vitlab.models` finds); the Q/K/V callbacks and probes only talk to ``module.model``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytorch_lightning as pl
import torch
from torch.nn.utils.weight_norm import WeightNorm

from vitlab import models
from vitlab.run_record import RECORD_KEY, DataRecord, ModelCall, RunRecord
from vitlab.training.arguments import BackboneArgs, OptimizerArgs
from vitlab.training.batch_log import BatchLog


class TaskModule(pl.LightningModule):
    """Shared plumbing of the task modules.

    A task declares only its own arguments and passes the rest on with ``**kwargs`` (jsonargparse follows them
    here, so ``model.lr``, ``model.weights`` ... stay flat config keys with these docs in ``--help``). This
    ``__init__`` checks them once (:class:`~vitlab.training.arguments.OptimizerArgs`), keeps them as
    ``self.backbone_args`` / ``self.optimizer_args`` and saves every task argument, the subclass's included, as
    flat hyperparameters. The task then builds ``self.model`` with :meth:`build_network` from
    ``self.backbone_args`` and calls :meth:`_intervene`. Every checkpoint records what built the run
    (:meth:`run_record`, read back by :func:`vitlab.runs.open_run`).

    Args:
        model_name: timm or torchvision model name (prefix ``timm:`` / ``torchvision:`` to disambiguate).
        in_chans: Input channels (linked from the data module by the CLI).
        pretrained: Load the library's pretrained weights (needs network or a warm cache).
        weights: Local weights file (state_dict, safetensors or vitlab checkpoint); head and first conv
            are adapted when class count / channels differ; a detector / segmenter loads its backbone from it.
        model_kwargs: Extra backbone constructor arguments (e.g. ``drop_path_rate``, tiny ``embed_dim``).
        ablate: Encoder ablation applied after the weights are loaded, e.g.
            ``{"remove": ["residual"], "blocks": [0, 1]}`` (see :func:`vitlab.models.ablate`).
        freeze: Backbone parts to freeze, e.g. ``["patch_embed"]`` (see :func:`vitlab.models.freeze`).
        lr: Peak learning rate.
        weight_decay: AdamW weight decay for the decayed group.
        layer_decay: Layer-wise LR decay factor in (0, 1] (e.g. 0.75); ``None`` disables it. Parts outside the
            backbone's blocks (heads, pyramid, decoder) train with the last layer's LR.
        warmup_epochs: Linear warm-up length in epochs (fractions allowed).
        min_lr_ratio: Final LR of the cosine schedule as a fraction of ``lr``.
        compile: Train through ``torch.compile`` (``true``, or a dict of its arguments such as ``{mode:
            max-autotune}``): the network's forward is compiled in place (:func:`vitlab.models.compile_in_place`)
            when the fit sets up, so its parameters, checkpoint keys, the Q/K/V callbacks and the probes see the
            uncompiled module. Where a split ends with a smaller batch, the batch dimension is compiled symbolic
            from the start (unless ``dynamic`` is given), so that batch is not compiled again. The first steps are
            slow (compilation); later ones faster on a GPU.
    """

    def __init__(
        self,
        model_name: str = "swin_tiny_patch4_window7_224",
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
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        self.compile_options = compile_options(compile)
        self.optimizer_args = OptimizerArgs(lr, weight_decay, layer_decay, warmup_epochs, min_lr_ratio)
        self.backbone_args = BackboneArgs(model_name, in_chans, pretrained, weights, dict(model_kwargs or {}), ablate,
                                          freeze)
        self.save_hyperparameters(logger=False)  # (Lightning collects the subclass's arguments from its frame too)
        self.best_val: dict[str, float] = {}

    task: str  # each task's name, as ``task:`` of a config and in the run record

    def build_network(self, builder: str, **arguments: Any) -> torch.nn.Module:
        """``vitlab.models.<builder>(**arguments)`` (``build_model``, ``build_detector``, ``build_segmenter``), the call
        kept for the run record: a run reopens its network from what built it, not from its state-dict keys."""
        self.network_call = ModelCall(builder, arguments)
        return self.network_call.build()

    def log_batch(self, name: str, value: torch.Tensor, *, batch_size: int, **options: Any) -> None:
        """``self.log(name, value, batch_size=batch_size, **options)`` for a value logged at every batch (a step's
        loss): the same values and logs at a fraction of Lightning's host cost (:mod:`vitlab.training.batch_log`)."""
        log = self.__dict__.get("_batch_log")
        if log is None:
            log = self._batch_log = BatchLog()
        log(self, name, value, batch_size=batch_size, **options)

    def run_record(self, datamodule: Any = None) -> dict[str, Any]:
        """What built this run, in plain types (:class:`vitlab.run_record.RunRecord`): the task, the network's call, the
        ablation, the class names and ``datamodule``'s class and arguments (default: the trainer's data module)."""
        if datamodule is None and self._trainer is not None:
            datamodule = getattr(self._trainer, "datamodule", None)
        call = getattr(self, "network_call", None)
        if call is None:
            raise RuntimeError(f"{type(self).__name__} built its network without build_network: its run record has no network call")
        names = getattr(self, "class_names", None) or self.hparams.get("class_names")
        return RunRecord(self.task, call, self.backbone_args.ablate, None if names is None else list(names),
                         None if datamodule is None else DataRecord.of(datamodule)).as_dict()

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

    def _intervene(self) -> None:
        """Encoder ablation and freezing of backbone parts (``model.ablate`` / ``model.freeze``, after the weights
        are loaded)."""
        self._report_weights()
        backbone = self.backbone_args
        if backbone.ablate:
            models.ablate(self.model, **backbone.ablate)
        if backbone.freeze:
            models.freeze(self.model, backbone.freeze)

    def configure_model(self) -> None:
        """``model.compile``: compile the network's forward in place, once, as the fit sets up (after a spawned
        process receives the module: a compiled forward does not pickle).

        Under Lightning's ``ModelParallelStrategy`` (its device mesh set), the network's parameters are first sharded
        over the data-parallel ranks with FSDP2 (:func:`vitlab.models.shard`: a group per transformer block)."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None:
            self._shard(mesh)
        if self.compile_options is not None and not models.is_compiled(self.model):
            # a symbolic batch size from the start where a split ends with a smaller batch (one compilation, not two)
            data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
            varying = getattr(data, "batch_sizes_vary", None)
            symbolic = bool(varying(self._trainer.world_size)) if callable(varying) else False
            models.compile_in_place(self.model, symbolic_batch=symbolic, **self.compile_options)
            if self._trainer is None or self._trainer.is_global_zero:
                print(models.compile_notice(self.compile_options), file=sys.stderr)

    shardable = True  # whether :meth:`configure_model` may shard ``self.model`` under ModelParallelStrategy

    def _shard(self, mesh: Any) -> None:
        """FSDP2 over the mesh's data-parallel dimension; one line for what vitlab does not do (tensor parallelism,
        a task that does not shard, a checkpoint in pieces: runs are reopened from one file)."""
        names = tuple(mesh.mesh_dim_names or ())
        tensor_parallel = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
        strategy = getattr(self._trainer, "strategy", None)
        name = type(strategy).__name__ if strategy is not None else "ModelParallelStrategy"
        if tensor_parallel != 1:
            raise ValueError(f"{name}: vitlab shards the network over data-parallel ranks only (FSDP2), got "
                             f"tensor_parallel_size {tensor_parallel}: set trainer.strategy.init_args.tensor_parallel_size: 1 "
                             "and data_parallel_size to the number of devices")
        if not self.shardable:
            raise ValueError(f"{name}: the {self.task} task does not shard its network; use strategy ddp")
        if getattr(strategy, "_save_distributed_checkpoint", False):  # (Lightning keeps the setting private)
            raise ValueError(f"{name}: vitlab reopens a run from one checkpoint file: set "
                             "trainer.strategy.init_args.save_distributed_checkpoint: false")
        models.shard(self.model, mesh["data_parallel"] if "data_parallel" in names else mesh)

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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[RECORD_KEY] = self.run_record()  # what built the run (vitlab.runs reopens it from this)
        checkpoint["best_val"] = dict(self.best_val)  # a resumed run's hparams table is the uninterrupted run's

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.best_val = {str(k): float(v) for k, v in (checkpoint.get("best_val") or {}).items()}

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

        # the step a run resumed from the last checkpoint starts at: its TensorBoard writer drops what a run killed after
        # that checkpoint logged there, so a resumed run that has nothing left to train logs this once again, not twice
        step = logging_step(self.trainer)
        for logger in self.loggers:
            logger.log_hyperparams(dict(self.hparams), metrics=metrics, step=step)

    def optimizer_groups(self) -> list[dict]:
        """AdamW groups of ``self.model`` (:func:`vitlab.models.parameter_groups`: no weight decay on norms, biases,
        position tables; ``lr_scale`` from ``layer_decay``). A task with trainable modules outside ``self.model``
        (DINO's projection head) appends its groups here."""
        opt = self.optimizer_args
        return models.parameter_groups(self.model, weight_decay=opt.weight_decay, layer_decay=opt.layer_decay)

    def configure_optimizers(self):
        opt = self.optimizer_args
        groups = [group for group in self.optimizer_groups() if group["params"]]
        for group in groups:
            group["lr"] = opt.lr * group.pop("lr_scale", 1.0)
        params = [p for group in groups for p in group["params"]]
        # on a GPU, AdamW's fused kernels: one launch per group instead of a dozen per parameter tensor (the per-group
        # learning rates of layer decay are kept); on the CPU the default, so CPU runs keep their numbers
        fused = {"fused": True} if params and all(p.is_cuda for p in params) else {}
        optimizer = torch.optim.AdamW(groups, lr=opt.lr, **fused)
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        steps_per_epoch = max(total_steps // max(self.trainer.max_epochs or 1, 1), 1)
        warmup_steps = min(int(round(opt.warmup_epochs * steps_per_epoch)), total_steps - 1)
        schedule = warmup_cosine(warmup_steps, total_steps, opt.min_lr_ratio)
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


COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def compile_options(value: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """``model.compile`` as ``torch.compile`` keyword arguments (None: not compiled); one line for a bad value."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict) and set(value) <= set(COMPILE_KEYS):
        return dict(value)
    raise ValueError(f"model.compile must be true, false or a dict of torch.compile arguments ({', '.join(COMPILE_KEYS)}), "
                     f"got {value!r}")
