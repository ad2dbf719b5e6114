"""Reading weight files and loading them into a model with head and input-channel adaptation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
from torch import Tensor, nn

from vitlab.models.adapter import unwrap_model
from vitlab.models.errors import WeightsMismatchError
from vitlab.models.registry import get_adapter

__all__ = ["LoadReport", "load_weights", "read_state_dict"]

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")
_CONTAINER_KEYS = ("state_dict", "model", "module", "model_state_dict")
_WRAPPER_PREFIXES = ("model.", "module.", "_orig_mod.", "backbone.body.")  # last: a detector's / segmenter's backbone
_SHOWN_KEYS = 3


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` did.

    Attributes:
        source: The file (or ``"<state_dict>"``).
        loaded_keys: State-dict keys copied into the model.
        head_reset: True when the file's classifier did not fit and the model keeps its fresh head.
        input_conv_adapted: True when the first convolution was converted to the model's in_chans.
    """

    source: str
    loaded_keys: tuple[str, ...]
    head_reset: bool
    input_conv_adapted: bool


def read_state_dict(path: Union[str, Path]) -> dict[str, Tensor]:
    """Reads a state dict from a ``.pth/.pt/.bin/.ckpt`` (torch, ``weights_only``) or ``.safetensors`` file.

    Lightning checkpoints and other containers (``{"state_dict": ...}``, ``{"model": ...}``) are
    unwrapped; wrapper prefixes are handled by :func:`load_weights`.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file cannot be read as weights.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path} (model.weights must point to an existing "
                                f"{'/'.join(WEIGHT_SUFFIXES)} file){_maker_hint(path)}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            content = load_file(str(path), device="cpu")
        else:
            content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any reader failure becomes one message naming the file
        raise ValueError(f"cannot read weights file {path}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from error
    return _unwrap_container(content, str(path))


def _maker_hint(path: Path) -> str:
    """For ``runs/<name>/<version>/checkpoints/x.ckpt`` with a ``configs/<name>.yaml`` here: the command that makes it."""
    parts = path.parts
    if len(parts) >= 4 and parts[-2] == "checkpoints":
        config = Path("configs") / f"{parts[-4]}.yaml"
        if config.is_file():
            return f"; make it first with: python train.py --config {config}"
    return ""


def _unwrap_container(content, source: str) -> dict[str, Tensor]:
    """Descends into checkpoint containers until a flat name -> tensor mapping is found."""
    for _ in range(3):
        if not isinstance(content, Mapping):
            break
        if content and all(isinstance(value, Tensor) for value in content.values()):
            return dict(content)
        inner = next((content[key] for key in _CONTAINER_KEYS if isinstance(content.get(key), Mapping)), None)
        if inner is None:
            break
        content = inner
    raise ValueError(f"{source} holds no state_dict (expected a name -> tensor mapping, possibly under "
                     f"one of {list(_CONTAINER_KEYS)})")


def _strip_wrapper_prefix(state_dict: dict[str, Tensor], model_keys: set[str]) -> dict[str, Tensor]:
    """Keeps the ``model.``-prefixed entries of a LightningModule (or DDP/compile) state dict, unprefixed."""
    for prefix in _WRAPPER_PREFIXES:
        if any(key.startswith(prefix) for key in model_keys):
            continue
        prefixed = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
        if prefixed:
            state_dict = prefixed
    return state_dict


def _describe(keys: list[str], state: Mapping[str, Tensor]) -> str:
    shown = ", ".join(f"{key} {tuple(state[key].shape)}" for key in keys[:_SHOWN_KEYS])
    return shown + (f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else "")


def load_weights(model: nn.Module, weights: Union[str, Path, Mapping[str, Tensor]]) -> LoadReport:
    """Loads a timm/torchvision state dict, a safetensors file or a vitlab Lightning checkpoint.

    The classifier head is kept freshly initialised when its shape differs (other class count); the
    first convolution is converted to the model's ``in_chans`` as timm does (sum over RGB for 1).

    Args:
        model: A model of a supported family (see :func:`vitlab.models.build_model`).
        weights: Path to a weights file, or a state dict.

    Returns:
        A :class:`LoadReport`.

    Raises:
        WeightsMismatchError: the file belongs to another architecture; the message names the first
            missing / unexpected / mismatched keys with their shapes.
    """
    from timm.models import adapt_input_conv

    model = unwrap_model(model)
    adapter = get_adapter(model)
    source = "<state_dict>" if isinstance(weights, Mapping) else str(weights)
    state = _unwrap_container(weights, source) if isinstance(weights, Mapping) else read_state_dict(weights)
    target = model.state_dict()
    state = unfiltered = _strip_wrapper_prefix(state, set(target))
    try:  # the family's own conversion (timm's checkpoint filters; 2-D -> 3-D ViT inflation)
        state = dict(adapter.filter_state_dict(dict(state), model))
    except WeightsMismatchError as error:
        raise WeightsMismatchError(f"{source}: {error}") from None

    conv_key = adapter.input_conv + ".weight"  # after the filter: Hugging Face adapters set it there
    raw_conv, file_conv, model_conv = unfiltered.get(conv_key), state.get(conv_key), target.get(conv_key)
    # the filter may have converted the channels already (3-D ViT inflation does)
    conv_adapted = (raw_conv is not None and model_conv is not None and file_conv is not None
                    and raw_conv.shape[1] != file_conv.shape[1] == model_conv.shape[1])
    if (file_conv is not None and model_conv is not None and file_conv.ndim == 4
            and file_conv.shape[1] != model_conv.shape[1] and file_conv.shape[2:] == model_conv.shape[2:]):
        state[conv_key] = adapt_input_conv(model_conv.shape[1], file_conv, base_chans=file_conv.shape[1])
        conv_adapted = True

    head_prefixes = tuple(adapter.parts(model).get("head", []))
    head_keys = [key for key in state if key.startswith(head_prefixes)] if head_prefixes else []
    head_reset = any(key not in target or state[key].shape != target[key].shape for key in head_keys)
    if head_reset:
        for key in head_keys:
            del state[key]

    unexpected = [key for key in state if key not in target]
    mismatched = [key for key in state if key in target and state[key].shape != target[key].shape]
    missing = [key for key in target if key not in state
               and not (head_prefixes and key.startswith(head_prefixes) and (head_reset or not head_keys))]
    if unexpected or mismatched or missing:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {_describe(missing, target)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected: {_describe(unexpected, state)}")
        if mismatched:
            shown = ", ".join(f"{key} file {tuple(state[key].shape)} vs model {tuple(target[key].shape)}"
                              for key in mismatched[:_SHOWN_KEYS])
            problems.append(f"{len(mismatched)} shape mismatches: {shown}")
        raise WeightsMismatchError(f"{source} does not fit this {adapter.description} architecture: "
                                   + "; ".join(problems))
    model.load_state_dict(state, strict=False)
    return LoadReport(source=source, loaded_keys=tuple(state), head_reset=head_reset,
                      input_conv_adapted=conv_adapted)
