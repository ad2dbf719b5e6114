"""The run record: what built a run, in plain types (the ``"vitlab"`` entry of its checkpoints and the ``vitlab`` key
of its ``config.yaml``), and for runs written before runs recorded themselves, the record inferred as the probes
always did (:func:`fallback_record`: the one place that still guesses). :mod:`vitlab.runs` opens runs with it;
docs/runs.md describes both."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from vitlab import models
from vitlab.models.networks import BUILDERS, backbone_call

RECORD_KEY = "vitlab"  # the record's key in a checkpoint and in config.yaml
RECORD_VERSION = 1
TASKS = ("classification", "detection", "segmentation", "dino")
DENSE_TASKS = ("detection", "segmentation")
DATA_CLASSES = {"ImageData": "vitlab.data.image_data", "DenseImageData": "vitlab.data.dense_data"}  # name -> module


@dataclass(frozen=True)
class ModelCall:
    """``vitlab.models.<builder>(**arguments)``: how a task built its network.

    ``builder`` is ``build_model`` (a classifier; DINO's backbone, whose classifier it then drops),
    ``build_detector`` or ``build_segmenter``; ``arguments`` are what it took, ``pretrained`` and ``weights``
    included (:meth:`network` leaves them out: a checkpoint holds every weight).
    """

    builder: str
    arguments: dict[str, Any]

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS:
            raise ValueError(f"model builder {self.builder!r} is not one of {', '.join(BUILDERS)}")

    def build(self) -> nn.Module:
        """The task's network as the call builds it (its library weights or ``weights`` file included)."""
        return getattr(models, self.builder)(**self.arguments)

    def network(self) -> tuple[dict[str, Any], bool]:
        """The :func:`~vitlab.models.build_model` arguments of the network the analyses read (the classifier itself,
        a detector's / segmenter's backbone in a classifier, a MONAI segmenter whole: see
        :func:`vitlab.models.networks.backbone_call`), without ``pretrained`` / ``weights``, and whether that network
        is the whole task network."""
        call, whole = backbone_call(self.builder, self.arguments)
        return {k: v for k, v in call.items() if k not in ("pretrained", "weights")}, whole


@dataclass(frozen=True)
class DataRecord:
    """A data module as plain types: its Lightning-free class (``ImageData`` / ``DenseImageData``; a
    ``MedicalDataModule`` is recorded as the ``ImageData`` it extends) and the arguments that rebuild it."""

    kind: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in DATA_CLASSES:
            raise ValueError(f"data class {self.kind!r} is not one of {', '.join(DATA_CLASSES)}")

    @classmethod
    def of(cls, datamodule: Any) -> DataRecord:
        """The record of a vitlab data module (its ``arguments``: every argument as given)."""
        for klass in type(datamodule).__mro__:
            if DATA_CLASSES.get(klass.__name__) == klass.__module__:
                return cls(klass.__name__, plain(dict(datamodule.arguments), "data"))
        raise TypeError(f"{type(datamodule).__name__} is not a vitlab data module ({', '.join(DATA_CLASSES)} or a subclass)")

    @property
    def dense(self) -> bool:
        """Images with masks / boxes (detection, segmentation)."""
        return self.kind == "DenseImageData"

    def build(self, **overrides: Any) -> Any:
        """The data module, Lightning-free: ``ImageData(**arguments, **overrides)`` (or ``DenseImageData``)."""
        klass = getattr(importlib.import_module(DATA_CLASSES[self.kind]), self.kind)
        return klass(**{**self.arguments, **overrides})


EMBEDDED = DataRecord("ImageData")  # no data recorded: the embedded synthetic set (ImageData's defaults)


@dataclass(frozen=True)
class RunRecord:
    """What built a run: the ``"vitlab"`` entry of its checkpoints and the ``vitlab`` key of its ``config.yaml``.

    Attributes:
        task: ``classification``, ``detection``, ``segmentation`` or ``dino``.
        model: The call that built the task's network.
        ablate: The encoder ablation applied after the weights (``model.ablate``), or None.
        class_names: The task's class names (a classifier's outputs; a dense task's foreground classes; DINO: the
            data's, for its k-NN).
        data: The data module, or None when the run had none.
    """

    task: str
    model: ModelCall
    ablate: dict[str, Any] | None = None
    class_names: list[str] | None = None
    data: DataRecord | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {', '.join(TASKS)}")

    def as_dict(self) -> dict[str, Any]:
        """Plain types (checkpoints load with ``weights_only=True``; ``config.yaml`` is YAML)."""
        return plain({
            "version": RECORD_VERSION, "task": self.task,
            "model": {"builder": self.model.builder, "arguments": self.model.arguments},
            "ablate": self.ablate, "class_names": self.class_names,
            "data": None if self.data is None else {"class": self.data.kind, "arguments": self.data.arguments},
        }, RECORD_KEY)

    @classmethod
    def from_dict(cls, value: Any, source: str) -> RunRecord:
        """The record :meth:`as_dict` wrote; a bad one is one line naming ``source``."""
        try:
            if not isinstance(value, Mapping):
                raise ValueError(f"a mapping, got {type(value).__name__}")
            if int(value.get("version", 0)) > RECORD_VERSION:
                raise ValueError(f"version {value['version']} was written by a newer vitlab (this one reads {RECORD_VERSION}); update vitlab")
            model, data = value["model"], value.get("data")
            return cls(str(value["task"]), ModelCall(str(model["builder"]), dict(model["arguments"])), value.get("ablate"),
                       None if value.get("class_names") is None else [str(n) for n in value["class_names"]],
                       None if data is None else DataRecord(str(data["class"]), dict(data.get("arguments") or {})))
        except (KeyError, TypeError, ValueError) as err:
            detail = f"no {err}" if isinstance(err, KeyError) else str(err)
            raise ValueError(f"{source}: unreadable run record ('{RECORD_KEY}': {detail})") from None


def plain(value: Any, where: str) -> Any:
    """``value`` in plain types (None, bool, int, float, str, lists, tuples, dicts with str keys; a path as its str),
    or a ``TypeError`` naming the key that holds anything else: a checkpoint must load with ``weights_only=True``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where}: {type(value).__name__} is not a plain type (a run record holds None, bool, int, float, str, "
                    "lists and dicts)")


# ---------------------------------------------------------------------------------------------- older runs


def fallback_record(hparams: Mapping[str, Any], state: Iterable[str] | None, data: Mapping[str, Any] | None,
                    task: str | None = None) -> RunRecord:
    """The record of a run written before runs recorded themselves, inferred as the probes always did.

    From a checkpoint (``state``: its state-dict keys): the task from the key prefixes (:func:`checkpoint_task`), and a
    "classifier" with a ``sliding_window`` hyperparameter is a MONAI segmenter (its keys have no vitlab backbone
    prefix). From a config (``state`` None): its ``task``, and the class counts and input channels of the data module
    its ``data`` section builds (what the CLI links into the model). The data: :func:`fallback_data`. An older DINO
    checkpoint reads as a classification one (its keys are a classifier's).
    """
    hp = dict(hparams)
    if "model_name" not in hp:
        raise ValueError(f"no model_name among the model hyperparameters {sorted(hp)}")
    if state is not None:
        task = checkpoint_task(state)
        if task == "classification" and "sliding_window" in hp:  # a MONAI segmenter probed whole
            task = "segmentation"
    task = task or "classification"
    record_data = fallback_data(data, task)
    classes, in_chans = hp.get("num_classes", 2), hp.get("in_chans", 1)
    image_size = hp.get("image_size", 224)
    if state is None:  # a config: the counts the CLI would link from the data
        dm = (record_data or EMBEDDED).build(num_workers=0)
        classes = dm.num_mask_classes if task in DENSE_TASKS else dm.num_classes
        in_chans, image_size = dm.in_chans, hp.get("image_size") or (data or {}).get("image_size") or 224
    name, kwargs = hp["model_name"], dict(hp.get("model_kwargs") or {})
    if task in ("classification", "dino"):
        call = ModelCall("build_model", dict(name=name, num_classes=max(int(classes), 2), in_chans=in_chans, **kwargs))
    elif task == "detection":
        call = ModelCall("build_detector", dict(name=name, num_classes=classes, in_chans=in_chans, image_size=image_size,
                                                heads=hp.get("heads", "light"), model_kwargs=kwargs, **(hp.get("head_kwargs") or {})))
    else:
        call = ModelCall("build_segmenter", dict(name=name, num_classes=classes, in_chans=in_chans, image_size=image_size,
                                                 decoder_channels=hp.get("decoder_channels", 64), model_kwargs=kwargs))
    names = hp.get("class_names")
    return RunRecord(task, call, hp.get("ablate"), list(names) if names else None, record_data)


def checkpoint_task(state: Iterable[str]) -> str:
    """``detection`` / ``segmentation`` for an older vitlab dense checkpoint's state-dict keys (its backbone sits
    under ``model.backbone.body.``; a detector has a region proposal network), else ``classification``."""
    keys = list(state)
    # vitlab.models.dense.BACKBONE_PREFIX, spelled out: importing it would load torchvision's detection (slow start-up)
    if not any(key.startswith("model.backbone.body.") for key in keys):
        return "classification"
    return "detection" if any(key.startswith("model.rpn.") for key in keys) else "segmentation"


# the data arguments the probes read from an older run's config (its data section may hold more, or other, keys)
PROBED_DATA_ARGUMENTS = ("root", "in_chans", "window", "window_center", "window_width", "window_index", "frames", "val_fraction",
                         "test_fraction", "seed", "on_bad_file", "mean", "std", "embedded_kwargs", "classes", "labels", "sample",
                         "slab_radius", "slice_labels", "intensity", "min_mask_voxels", "spacing", "volume_size")
DENSE_DATA_ARGUMENTS = ("mask_classes", "coco_json", "coco_mask_dir")


def fallback_data(data: Mapping[str, Any] | None, task: str) -> DataRecord | None:
    """The data of an older run's config section: the arguments probes read (:data:`PROBED_DATA_ARGUMENTS`), and
    for a dense task (or a COCO JSON) the dense ones in a ``DenseImageData``; None without a data section."""
    if data is None:
        return None
    dense = task in DENSE_TASKS or bool(data.get("coco_json"))
    keep = PROBED_DATA_ARGUMENTS + (DENSE_DATA_ARGUMENTS if dense else ())
    return DataRecord("DenseImageData" if dense else "ImageData", {k: v for k, v in data.items() if k in keep})
