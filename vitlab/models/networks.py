"""The calls that build a task's network, as plain data, and the :func:`build_model` network inside each.

A task builds its network with one of :data:`BUILDERS` (:func:`~vitlab.models.build_model` for a classifier or a
DINO backbone, :func:`~vitlab.models.build_detector`, :func:`~vitlab.models.build_segmenter`). Every analysis reads
a :func:`build_model` network: a classifier itself, the timm backbone of a detector or segmenter (as a classifier
with a fresh head: its state-dict keys are the backbone's, see :mod:`vitlab.models.dense`), or a MONAI segmenter
whole (it is a :func:`build_model` network with its own decoder). :func:`backbone_call` says which, from the call
alone, without building anything (no torchvision detection import: ``probe.py`` starts fast).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BUILDERS", "backbone_call", "segments_whole"]

BUILDERS = ("build_model", "build_detector", "build_segmenter")  # the vitlab.models functions a task builds with


def segments_whole(name: str) -> bool:
    """True for a ``monai:`` network (SwinUNETR, UNETR): already a segmenter with its own decoder, built by
    :func:`build_model` with ``num_classes + 1`` outputs (background first), not a backbone under vitlab's decoder."""
    return str(name).startswith("monai:")


def backbone_call(builder: str, arguments: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The :func:`build_model` arguments of the network inside the task model ``builder(**arguments)``, and whether
    that network is the whole task model.

    * ``build_model``: the model itself.
    * ``build_segmenter`` of a ``monai:`` name: the whole segmenter (``num_classes + 1`` outputs, ``model_kwargs``;
      ``image_size`` and ``decoder_channels`` are unused), as :func:`~vitlab.models.build_segmenter` builds it.
    * ``build_detector`` / ``build_segmenter`` of a timm name: its backbone as a classifier: ``img_size`` the task's
      ``image_size`` unless ``model_kwargs`` sets it, ``max(num_classes, 2)`` outputs (a fresh head: the task's
      classes are not the head's).

    ``pretrained`` and ``weights`` are passed on as given.

    Raises:
        ValueError: ``builder`` is not one of :data:`BUILDERS`, or ``arguments`` lacks ``name`` / ``num_classes``.
    """
    if builder not in BUILDERS:
        raise ValueError(f"unknown model builder {builder!r}; valid: {', '.join(BUILDERS)}")
    if builder == "build_model":
        return dict(arguments), True
    missing = [key for key in ("name", "num_classes") if key not in arguments]
    if missing:
        raise ValueError(f"{builder} arguments lack {', '.join(missing)}: got {sorted(arguments)}")
    name, classes = arguments["name"], int(arguments["num_classes"])
    common = dict(in_chans=arguments.get("in_chans", 1), pretrained=arguments.get("pretrained", False),
                  weights=arguments.get("weights"))
    kwargs = dict(arguments.get("model_kwargs") or {})
    if builder == "build_segmenter" and segments_whole(name):
        return dict(name=name, num_classes=classes + 1, **common, **kwargs), True
    return dict(name=name, num_classes=max(classes, 2), **common, **{"img_size": arguments.get("image_size", 224), **kwargs}), False
