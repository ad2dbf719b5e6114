"""Building timm / torchvision vision transformers (and MONAI's 3-D ones) by name, with offline-safe
pretrained weights."""

from __future__ import annotations

import contextlib
import difflib
import os
import socket
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Union
from urllib.parse import urlparse

from torch import nn

from vitlab.models.adapter import unwrap_model
from vitlab.models.conv_guard import guard_conv3d
from vitlab.models.errors import PretrainedWeightsUnavailable, UnsupportedModelError
from vitlab.models.registry import get_adapter, supported_families
from vitlab.models.weights import _maker_hint, load_weights

__all__ = [
    "ChannelRepeatConv2d",
    "TORCHVISION_MODELS",
    "build_model",
    "normalization",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TIMM_PREFIXES = ("vit_", "deit_", "deit3_", "swin_", "mixer_", "swinv2_", "eva", "beit")
_PROBE_TIMEOUT_S = 3.0

# torchvision architectures: constructor arguments of the named builders (torchvision 0.29)
TORCHVISION_MODELS: dict[str, dict[str, Any]] = {
    "vit_b_16": dict(patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072),
    "vit_b_32": dict(patch_size=32, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072),
    "vit_l_16": dict(patch_size=16, num_layers=24, num_heads=16, hidden_dim=1024, mlp_dim=4096),
    "vit_l_32": dict(patch_size=32, num_layers=24, num_heads=16, hidden_dim=1024, mlp_dim=4096),
    "vit_h_14": dict(patch_size=14, num_layers=32, num_heads=16, hidden_dim=1280, mlp_dim=5120),
    "swin_t": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                   window_size=[7, 7], stochastic_depth_prob=0.2),
    "swin_s": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24],
                   window_size=[7, 7], stochastic_depth_prob=0.3),
    "swin_b": dict(patch_size=[4, 4], embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32],
                   window_size=[7, 7], stochastic_depth_prob=0.5),
    # Swin V2: SwinTransformerBlockV2 + PatchMergingV2 (added by _build_torchvision for names swin_v2_*)
    "swin_v2_t": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                      window_size=[8, 8], stochastic_depth_prob=0.2),
    "swin_v2_s": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24],
                      window_size=[8, 8], stochastic_depth_prob=0.3),
    "swin_v2_b": dict(patch_size=[4, 4], embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32],
                      window_size=[8, 8], stochastic_depth_prob=0.5),
}
_LIBRARY_PREFIXES = {"timm": "timm", "torchvision": "torchvision", "tv": "torchvision", "hf": "hf", "vit3d": "vit3d",
                     "monai": "monai"}
VIT3D_PREFIXES = ("vit_", "deit_", "deit3_")  # timm VisionTransformer names a 3-D ViT can be built from


class ChannelRepeatConv2d(nn.Conv2d):
    """A 3-channel patch convolution that accepts grayscale images by repeating the channel.

    Equivalent to a 1-channel convolution with the RGB filters summed, while the parameters keep the
    library's shape, so plain torchvision weight files load unchanged.
    """

    in_chans = 1

    def forward(self, x):  # (B, 1, H, W) -> (B, D, H/P, W/P)
        if x.shape[1] == 1:
            x = x.expand(-1, self.in_channels, -1, -1)
        return super().forward(x)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "ChannelRepeatConv2d":
        wrapped = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                      padding=conv.padding, bias=conv.bias is not None)
        wrapped.load_state_dict(conv.state_dict())
        return wrapped


def _resolve_name(name: str) -> tuple[str, str]:
    """``[library:]architecture`` -> (library, architecture)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    library, sep, arch = name.strip().partition(":")
    if sep:
        if library not in _LIBRARY_PREFIXES:
            raise ValueError(f"unknown library prefix '{library}:' in model name {name!r}: use one of "
                             f"{[prefix + ':' for prefix in _LIBRARY_PREFIXES]}")
        return _LIBRARY_PREFIXES[library], arch
    return ("torchvision" if library in TORCHVISION_MODELS else "timm"), library


def _unknown_model(name: str, candidates: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, candidates, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ValueError(f"unknown model {name!r}{hint}: use a timm name ({', '.join(p + '*' for p in TIMM_PREFIXES)}) "
                      f"or a torchvision name ({', '.join(TORCHVISION_MODELS)}), optionally prefixed "
                      f"'timm:' or 'torchvision:'")


def _network_reachable(host: str, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host:443`` opens within ``timeout_s`` (DNS included)."""
    outcome: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout_s).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(outcome and outcome[0])


def _offline(host: str) -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE", "") or os.environ.get("VITLAB_OFFLINE", "")
    return flag.strip().lower() in {"1", "true", "yes", "on"} or not _network_reachable(host)


@contextlib.contextmanager
def _hub_offline(enabled: bool) -> Iterator[None]:
    """Put huggingface_hub in offline mode (cache only, no retries) for the duration."""
    if not enabled:
        yield
        return
    from huggingface_hub import constants

    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous


def _unavailable(name: str, reason: str) -> PretrainedWeightsUnavailable:
    err = PretrainedWeightsUnavailable(
        f"pretrained weights for {name!r} are not available ({reason}): set `model.weights: /path/to/file` "
        f"(a timm/torchvision state_dict, .safetensors file or vitlab checkpoint) or train from scratch "
        f"with `model.pretrained: false`")
    err.reason = reason  # the probe CLI words its own advice (--weights FILE)
    return err


def _download_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, RuntimeError, ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import HfHubHTTPError

        errors.append(HfHubHTTPError)
    with contextlib.suppress(ImportError):
        import httpx

        errors.append(httpx.HTTPError)
    return tuple(errors)


def _create_timm(arch: str, pretrained: bool, build: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    """``timm.create_model``; ``overrides`` replace architecture arguments that the named entry point
    fixes itself (e.g. ``patch_size`` of ``mixer_s16_224``), so tests can build tiny variants."""
    import sys

    import timm
    from timm.models import model_entrypoint

    if not overrides:
        return timm.create_model(arch, pretrained=pretrained, **build)
    module = sys.modules[model_entrypoint(arch).__module__]
    library_builder = module.build_model_with_cfg

    def overriding_builder(model_cls, variant, pretrained, **kwargs):
        return library_builder(model_cls, variant, pretrained, **{**kwargs, **overrides})

    module.build_model_with_cfg = overriding_builder
    try:
        return timm.create_model(arch, pretrained=pretrained, **build)
    finally:
        module.build_model_with_cfg = library_builder


def _build_timm(name: str, arch: str, num_classes: int, in_chans: int, pretrained: bool,
                kwargs: dict[str, Any]) -> nn.Module:
    import timm

    if not arch.startswith(TIMM_PREFIXES):
        raise UnsupportedModelError(f"model {name!r} is not a supported family: vitlab supports "
                                    + "; ".join(supported_families()))
    if not timm.is_model(arch):
        raise _unknown_model(arch, timm.list_models([p + "*" for p in TIMM_PREFIXES]) + list(TORCHVISION_MODELS))
    build = dict(num_classes=num_classes, in_chans=in_chans, **kwargs)
    try:
        with _hub_offline(pretrained and _offline("huggingface.co")):
            try:
                return _create_timm(arch, pretrained, build, {})
            except TypeError as error:
                if "multiple values for keyword argument" not in str(error):
                    raise
                return _create_timm(arch, pretrained, dict(num_classes=num_classes, in_chans=in_chans), kwargs)
    except TypeError as error:
        raise ValueError(f"bad keyword argument for timm model {arch!r}: {error}") from error
    except _download_errors() as error:
        if not pretrained:
            raise
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}"
        raise _unavailable(name, reason) from error


def _build_vit3d(name: str, arch: str, num_classes: int, in_chans: int, pretrained: bool,
                 kwargs: dict[str, Any]) -> nn.Module:
    """A timm ViT over volumes (:mod:`vitlab.models.vit3d`): ``img_size=(D, H, W)`` and ``patch_size=(pd, p,
    p)`` go to its Conv3d patch embedding, every other keyword to timm as for the 2-D model. ``pretrained``
    loads timm's 2-D weights of ``arch`` into a 2-D twin (the same keywords, the in-plane sizes: timm
    resamples them as for any 2-D model) and inflates them."""
    from vitlab.models.vit3d import PatchEmbed3d, in_plane_sizes

    if not arch.startswith(VIT3D_PREFIXES):
        raise UnsupportedModelError(f"model {name!r}: vit3d: builds timm VisionTransformer names "
                                    f"({', '.join(p + '*' for p in VIT3D_PREFIXES)}), got {arch!r}")
    if "img_size" not in kwargs or "patch_size" not in kwargs:
        raise ValueError(f"model {name!r} needs img_size=(D, H, W) and patch_size=(pd, p, p) (or ints for cubes)")
    if "embed_layer" in kwargs or kwargs.get("dynamic_img_size"):
        raise ValueError(f"model {name!r} sets its own embed_layer and takes fixed-size volumes (no "
                         f"embed_layer / dynamic_img_size)")
    volume, patch = kwargs.pop("img_size"), kwargs.pop("patch_size")
    embed_layer = PatchEmbed3d.sized(volume, patch)
    twin = None
    if pretrained:  # first: fails fast offline
        twin = _build_timm(name, arch, num_classes, in_chans, True, {**kwargs, **in_plane_sizes(volume, patch)})
    model = _build_timm(name, arch, num_classes, in_chans, False, {**kwargs, "embed_layer": embed_layer})
    if twin is not None:
        load_weights(model, twin.state_dict())  # the 3-D adapter inflates the 2-D weights
    return model


def _build_torchvision(name: str, arch: str, num_classes: int, in_chans: int,
                       kwargs: dict[str, Any]) -> nn.Module:
    from torchvision.models import SwinTransformer, VisionTransformer

    if arch not in TORCHVISION_MODELS:
        raise _unknown_model(arch, list(TORCHVISION_MODELS))
    if in_chans not in (1, 3):
        raise ValueError(f"torchvision model {arch!r} takes in_chans 1 or 3, got {in_chans}")
    config = dict(TORCHVISION_MODELS[arch])
    image_size = kwargs.pop("image_size", kwargs.pop("img_size", 224))
    config.update(kwargs)
    try:
        if arch.startswith("vit"):
            model = VisionTransformer(image_size=image_size, num_classes=num_classes, **config)
            conv_path = "conv_proj"
        else:
            for key in ("patch_size", "window_size"):
                if isinstance(config[key], int):
                    config[key] = [config[key], config[key]]
            if arch.startswith("swin_v2_"):
                from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2

                config.update(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2)
            model = SwinTransformer(num_classes=num_classes, **config)
            model.image_size = image_size  # the configured input size (torchvision Swin accepts any)
            conv_path = "features.0.0"
    except TypeError as error:
        raise ValueError(f"bad keyword argument for torchvision model {arch!r}: {error}") from error
    if in_chans == 1:
        parent_path, _, child = conv_path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, ChannelRepeatConv2d.from_conv(getattr(parent, child)))
    return model


def _torchvision_pretrained_file(name: str, arch: str) -> str:
    """Path of torchvision's default weights for ``arch`` in the torch hub cache (downloaded if online)."""
    import torch
    from torchvision.models import get_model_weights

    url = get_model_weights(arch).DEFAULT.url
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    if cached.is_file():
        return str(cached)
    if _offline(urlparse(url).hostname or "download.pytorch.org"):
        raise _unavailable(name, f"offline and {cached} is not cached")
    try:
        torch.hub.download_url_to_file(url, str(cached), progress=False)
    except _download_errors() as error:
        raise _unavailable(name, f"{type(error).__name__}: {error}") from error
    return str(cached)


def build_model(name: str, num_classes: int, in_chans: int = 3, pretrained: bool = False,
                weights: Optional[Union[str, Path]] = None, **kwargs: Any) -> nn.Module:
    """Builds a supported vision transformer from timm or torchvision.

    Args:
        name: A timm name (``vit_*``, ``deit_*``, ``swin_*``, ``mixer_*``) or a torchvision name
            (``vit_b_16`` ... ``vit_h_14``, ``swin_t/s/b``, ``swin_v2_t/s/b``); ``timm:`` / ``torchvision:`` / ``tv:``
            prefixes choose the library explicitly. ``hf:<model type | folder | hub id>`` builds a Hugging
            Face ``transformers`` ViT / DINOv2 / Swin (optional extra, see :mod:`vitlab.models.hf_build`).
            ``vit3d:<timm ViT name>`` builds that ViT over volumes (B, C, D, H, W) with a Conv3d patch
            embedding (:mod:`vitlab.models.vit3d`; needs ``img_size=(D, H, W)`` and ``patch_size=(pd, p, p)``).
            ``monai:swin_unetr`` / ``monai:unetr`` build MONAI's 3-D SwinUNETR / UNETR with
            ``in_channels=in_chans, out_channels=num_classes`` (see :mod:`vitlab.models.monai_build`).
        num_classes: Classifier outputs.
        in_chans: Image channels (1 for grayscale). torchvision models repeat a grayscale channel.
        pretrained: Load the library's ImageNet weights (fails fast offline unless cached); for ``vit3d:``
            timm's 2-D weights of the named ViT, inflated; always fails for ``monai:`` (no downloadable weights).
        weights: A local weights file (state dict, ``.safetensors`` or vitlab Lightning checkpoint);
            takes precedence over ``pretrained``. Head and first conv are adapted as needed. For ``hf:``
            models also a ``save_pretrained`` folder. A ``vit3d:`` model inflates a 2-D ViT's file and
            loads a 3-D one as it is.
        **kwargs: Passed to the constructor (e.g. ``img_size=32, embed_dim=32, depth=2`` for timm;
            ``image_size, patch_size, num_layers, hidden_dim ...`` for torchvision; MONAI's constructor
            arguments for ``monai:``, plus ``img_size`` (the volume size) for ``monai:swin_unetr``).

    Returns:
        The model, in training mode. Its 3-D convolutions compute in float32 where oneDNN's bf16 weight gradient
        on the CPU is wrong (:mod:`vitlab.models.conv_guard`).

    Raises:
        ValueError: unknown name or bad argument. UnsupportedModelError: another model family.
        PretrainedWeightsUnavailable: ``pretrained=True`` without network or cache.
        FileNotFoundError / WeightsMismatchError: bad ``weights`` file.
    """
    library, arch = _resolve_name(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if isinstance(in_chans, bool) or not isinstance(in_chans, int) or in_chans < 1:
        raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
    if weights is not None:
        weights = Path(weights).expanduser()
        if not weights.is_file() and not (library == "hf" and weights.is_dir()):
            raise FileNotFoundError(f"weights file not found: {weights} (model.weights must be an existing file, "
                                    f"or a save_pretrained folder for hf: models){_maker_hint(weights)}")
        pretrained = False
    if library == "hf":  # optional extra: transformers is imported only here
        from vitlab.models.hf_build import build_hf

        folder = weights if weights is not None and weights.is_dir() else None
        model = build_hf(name, arch, num_classes, in_chans, pretrained, folder, dict(kwargs))
        weights = None if folder is not None else weights
    elif library == "monai":  # MONAI is imported only there
        from vitlab.models.monai_build import build_monai

        model = build_monai(name, arch, num_classes, in_chans, pretrained, dict(kwargs))
    elif library == "timm":
        model = _build_timm(name, arch, num_classes, in_chans, pretrained, dict(kwargs))
    elif library == "vit3d":
        model = _build_vit3d(name, arch, num_classes, in_chans, pretrained, dict(kwargs))
    else:
        source = _torchvision_pretrained_file(name, arch) if pretrained else None
        model = _build_torchvision(name, arch, num_classes, in_chans, dict(kwargs))
        weights = weights or source
    try:
        get_adapter(model)
    except UnsupportedModelError as error:  # e.g. hybrid CNN-ViTs, other block types
        raise UnsupportedModelError(f"model {name!r} has a block or patch-embedding layout vitlab does not "
                                    f"know; {error}") from None
    if weights is not None:
        load_weights(model, weights)
    guard_conv3d(model)  # (3-D convolutions whose bf16 weight gradient oneDNN gets wrong on the CPU: in float32)
    return model


def normalization(model: nn.Module) -> tuple[list[float], list[float]]:
    """Input mean/std the model expects, one value per input channel.

    timm models use their pretrained config (ImageNet or 0.5/0.5); torchvision uses ImageNet. For
    ``in_chans=1`` the RGB statistics are averaged; other channel counts repeat the average.

    Returns:
        (mean, std) lists of length ``in_chans``.
    """
    model = unwrap_model(model)
    in_chans = get_adapter(model).in_chans(model)
    config = getattr(model, "pretrained_cfg", None) or {}
    mean = [float(value) for value in config.get("mean", IMAGENET_MEAN)]
    std = [float(value) for value in config.get("std", IMAGENET_STD)]
    if len(mean) == in_chans:
        return mean, std
    return [sum(mean) / len(mean)] * in_chans, [sum(std) / len(std)] * in_chans
