"""Hugging Face ``transformers`` image models (ViT, DINOv2, DINOv2 with registers, Swin) as vitlab classifiers.

Optional: needs ``pip install -e ".[hf]"``. Only this module, :mod:`vitlab.models.hf_classifier` and
:mod:`vitlab.models.hf_families` import ``transformers``. ``build_model("hf:...")`` returns an
:class:`~vitlab.models.hf_classifier.HFClassifier`: the library's own
``*ForImageClassification`` model (its head, its weights layout) behind a ``pixels -> logits`` forward, so
the training module, the callbacks and every probe use it like a timm model.

Names: ``hf:<model type>`` (``vit``, ``dinov2``, ``dinov2_with_registers``, ``swin``) builds a random model
from the library's default config with ``**kwargs`` overriding config fields (``hidden_size=32`` ...);
``hf:<local folder>`` or ``hf:<hub id>`` takes the architecture from that ``config.json`` (and its weights
with ``pretrained=True``). ``weights`` may be a local ``save_pretrained`` folder: its weights are loaded
through ``from_pretrained`` (which converts older checkpoint layouts), then through
:func:`vitlab.models.load_weights` (fresh head for another class count, first conv summed for grayscale).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from vitlab.models.errors import PretrainedWeightsUnavailable, UnsupportedModelError
from vitlab.models.hf_classifier import HF_MODEL_TYPES, HFClassifier, require_transformers

# HF_MODEL_TYPES, HFClassifier and require_transformers live in hf_classifier; re-exported for their old path
__all__ = ["HF_MODEL_TYPES", "HFClassifier", "build_hf", "require_transformers"]

_DERIVED_FIELDS = {"out_features", "out_indices", "stage_names", "model_type", "transformers_version"}


def _image_stats(source: str) -> tuple[Optional[list], Optional[list]]:
    """``image_mean`` / ``image_std`` of a folder's (or cached hub repo's) ``preprocessor_config.json``."""
    path = Path(source).expanduser() / "preprocessor_config.json"
    if not path.is_file():
        try:
            from transformers.utils import cached_file

            found = cached_file(source, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
        except Exception:  # noqa: BLE001 - statistics are optional; defaults apply
            found = None
        if not found:
            return None, None
        path = Path(found)
    content = json.loads(path.read_text())
    return content.get("image_mean"), content.get("image_std")


def _unavailable(name: str, error: BaseException):
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return PretrainedWeightsUnavailable(
        f"Hugging Face model {name!r} is not available ({type(error).__name__}: {first}): use a local "
        f"save_pretrained folder (hf:/path/to/folder or model.weights: /path/to/folder), or a model type "
        f"({', '.join(HF_MODEL_TYPES)}) to train from scratch")


def _config(name: str, source: str, kwargs: dict[str, Any]):
    """The architecture: a model type's default config, or a folder's / hub repo's ``config.json``."""
    from transformers import AutoConfig

    if "img_size" in kwargs:
        kwargs["image_size"] = kwargs.pop("img_size")
    if source in HF_MODEL_TYPES:
        config = AutoConfig.for_model(source)
    else:
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as error:
            raise _unavailable(name, error) from error
    if config.model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(f"Hugging Face model {name!r} is a {config.model_type!r} model: vitlab "
                                    f"supports the model types {', '.join(HF_MODEL_TYPES)}")
    for key in kwargs:
        if not hasattr(config, key):
            raise ValueError(f"bad keyword argument {key!r} for Hugging Face model {name!r}: not a field of "
                             f"{type(config).__name__}")
    if not kwargs:
        return config
    # rebuild through the constructor so derived fields (e.g. DINOv2's backbone stage names) follow
    fields = {key: value for key, value in config.to_dict().items() if key not in _DERIVED_FIELDS}
    return type(config)(**{**fields, **kwargs})


def load_hf_pretrained(model: HFClassifier, source: str, name: str):
    """Loads the weights of a ``save_pretrained`` folder or hub repo into ``model`` (see module doc).

    Returns:
        The :class:`vitlab.models.LoadReport`.
    """
    from vitlab.models.weights import load_weights

    from transformers.utils import logging as hf_logging

    library_class = type(model.hf)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        loaded, info = library_class.from_pretrained(source, output_loading_info=True)
    except (OSError, ValueError) as error:
        raise _unavailable(name, error) from error
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    missing = set(info.get("missing_keys", ()))  # e.g. the head of a folder saved from a base model
    state = {f"hf.{key}": value for key, value in loaded.state_dict().items() if key not in missing}
    report = load_weights(model, state)
    return report


def build_hf(name: str, source: str, num_classes: int, in_chans: int, pretrained: bool,
             weights_folder: Optional[Path], kwargs: dict[str, Any]) -> HFClassifier:
    """Builds an :class:`HFClassifier` (see module doc); ``weights_folder`` is a ``save_pretrained`` folder.

    Raises:
        ImportError: ``transformers`` is not installed. ValueError: bad keyword argument, or
        ``pretrained`` with a bare model type. PretrainedWeightsUnavailable: hub repo not reachable/cached.
    """
    transformers = require_transformers()  # from now on the registry lists the Hugging Face families

    source = source.strip()
    if not source:
        raise ValueError(f"model name {name!r} needs a model type, folder or hub id after 'hf:'")
    if pretrained and source in HF_MODEL_TYPES and weights_folder is None:
        raise ValueError(f"{name!r} names an architecture, not weights: use hf:<save_pretrained folder or hub "
                         f"id> with pretrained, or model.weights: /path/to/folder")
    config = _config(name, source, dict(kwargs))
    config.num_labels = num_classes
    config.num_channels = in_chans
    library_class = getattr(transformers, HF_MODEL_TYPES[config.model_type][0])
    mean, std = _image_stats(str(weights_folder)) if weights_folder is not None else (None, None)
    if mean is None and source not in HF_MODEL_TYPES:
        mean, std = _image_stats(source)
    if mean is not None and len(mean) != in_chans:
        mean, std = [sum(mean) / len(mean)] * in_chans, [sum(std) / len(std)] * in_chans
    model = HFClassifier(library_class(config), mean, std)
    weight_source = str(weights_folder) if weights_folder is not None else (source if pretrained else None)
    if weight_source is not None:
        load_hf_pretrained(model, weight_source, name)
    return model
