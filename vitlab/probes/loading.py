"""The model a probe reads: a run (--checkpoint / --config, opened by :mod:`vitlab.runs`) or a library model
(--model NAME [--pretrained | --weights FILE]), as a :class:`LoadedModel`."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitlab import models, runs
from vitlab.run_record import DataRecord

@dataclass
class LoadedModel:
    """A model ready for probing plus where it came from."""

    model: nn.Module
    name: str
    source: str
    build: dict[str, Any] = field(default_factory=dict)  # build_model arguments (to make a fresh copy)
    data: DataRecord | None = None  # the run's data module (its class and arguments), when known
    class_names: list[str] | None = None  # names of the head's outputs, when the checkpoint knows them
    run: str | None = None  # "<name>-<version>" when the checkpoint lives in a run folder (names the output folder)
    task: str = "classification"  # "detection" / "segmentation" / "dino": a backbone in a classifier with a fresh head,
    # or (a 3-D segmenter such as monai:swin_unetr) the whole network, whose outputs are voxel logits, not classes
    hparams: dict[str, Any] = field(default_factory=dict)  # the training checkpoint's hyperparameters (e.g. sliding_window)

    @property
    def head_trained(self) -> bool:
        """False for a detection / segmentation / DINO checkpoint: the classifier head around its backbone is untrained."""
        return self.task == "classification"

    def untrained_head(self, what: str) -> str:
        """One line saying why ``what`` (a use of the classifier head's outputs) is not done for this model."""
        return (f"{what}: {self.source} is a {self.task} checkpoint; its backbone is probed inside a classifier whose "
                "head is freshly initialised (untrained), so its class outputs mean nothing")

    def fresh(self, seed: int = 0) -> nn.Module:
        """An untrained model of the same architecture (for transplant / untrained baselines)."""
        torch.manual_seed(seed)
        args = {k: v for k, v in self.build.items() if k not in ("weights", "pretrained")}
        return models.build_model(**args).eval()


def load_model(args: argparse.Namespace, prefix: str = "", device: str = "cpu") -> LoadedModel:
    """The model named by --checkpoint / --config (a run: :func:`vitlab.runs.open_run`) or --model (a library
    model), with the given option prefix; --config also gives the data of a --model."""
    get = lambda key: getattr(args, f"{prefix}{key}".replace("-", "_"), None)  # noqa: E731
    checkpoint, config, name = get("checkpoint"), get("config"), get("model")
    flag = f"--{prefix}"
    if sum(x is not None for x in (checkpoint, name)) > 1:
        raise ValueError(f"give one of {flag}checkpoint or {flag}model, not both")
    if name is None and (checkpoint is not None or config is not None):
        with _named(flag, checkpoint, config):
            run = runs.open_run(checkpoint=checkpoint, config=config)
        return opened_model(run, device)
    if name is None:
        raise ValueError(f"no model given: use {flag}checkpoint PATH.ckpt, {flag}config RUN/config.yaml or {flag}model NAME [{flag}pretrained | {flag}weights FILE]")
    kwargs = json.loads(get("model_kwargs")) if get("model_kwargs") else {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{flag}model-kwargs must be a JSON object, got {get('model_kwargs')!r}")
    build = dict(name=name, num_classes=get("num_classes") or (1000 if get("pretrained") else 2), in_chans=get("in_chans") or 3,
                 pretrained=bool(get("pretrained")), weights=str(get("weights")) if get("weights") else None, **kwargs)
    try:
        model = models.build_model(**build)
    except models.PretrainedWeightsUnavailable as err:
        reason = getattr(err, "reason", None) or str(err)
        raise models.PretrainedWeightsUnavailable(
            f"{flag}pretrained: weights for {name!r} are not available ({reason}); pass {flag}weights FILE "
            f"(a timm/torchvision state_dict, .safetensors file or vitlab checkpoint) instead, or drop {flag}pretrained "
            "to probe an untrained model") from None
    data = None
    if config is not None:
        with _named(flag, None, config):
            data = runs.config_data(runs.read_config(config), str(config))
    source = str(get("weights") or ("pretrained" if get("pretrained") else "untrained"))
    return LoadedModel(model.to(device).eval(), name, source, build, data)


def opened_model(run: runs.Run, device: str = "cpu") -> LoadedModel:
    """An opened run's network for probing, with what the probes need to know of the run."""
    build, _ = run.record.model.network()
    trained = run.state is not None
    source = str(run.checkpoint) if trained else f"{run.config_file} (untrained: no checkpoints/last.ckpt beside it)"
    names = run.record.class_names if run.task == "classification" else None  # a dense / DINO model's classes are not the head's
    return LoadedModel(run.model(device), str(build["name"]), source, build, run.record.data, names,
                       run.label if trained else None, run.task, dict(run.hparams))


@contextlib.contextmanager
def _named(flag: str, checkpoint: Any, config: Any) -> Iterator[None]:
    """A run's one-line error (it names the file) with the option that gave the file, and for a checkpoint that is
    plain weights, how to probe it."""
    try:
        yield
    except (FileNotFoundError, ValueError) as err:
        option = f"{flag}config" if config is not None and str(err).startswith(str(config)) else f"{flag}checkpoint"
        hint = f"; use {flag}model NAME {flag}weights {checkpoint}" if "not a vitlab training checkpoint" in str(err) else ""
        raise type(err)(f"{option} {err}{hint}") from None
