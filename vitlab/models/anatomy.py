"""Model anatomy: blocks, their Q/K/V weights and the input embedding, for every supported family."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

from torch import Tensor, nn

from vitlab.models.adapter import BlockView, Embeddings, unwrap_model
from vitlab.models.registry import get_adapter

__all__ = ["blocks", "check_volume_size", "embeddings", "family_name", "input_size", "num_blocks", "out_proj",
           "part_prefixes", "qkv", "select_blocks"]

BlockRef = Union[int, str]


def blocks(model: nn.Module) -> list[BlockView]:
    """All transformer blocks of ``model`` in forward order (see :class:`BlockView`)."""
    model = unwrap_model(model)
    return get_adapter(model).block_views(model)


def num_blocks(model: nn.Module) -> int:
    """Number of transformer blocks (all stages)."""
    return len(blocks(model))


def input_size(model: nn.Module) -> tuple[int, ...]:
    """The input (in_chans, H, W) the model is configured for (torchvision Swin: the ``image_size`` given
    to :func:`build_model`, 224 by default); (in_chans, D, H, W) for 3-D models (MONAI SwinUNETR: the
    ``img_size`` given to :func:`build_model`, 96 by default)."""
    model = unwrap_model(model)
    adapter = get_adapter(model)
    return (adapter.in_chans(model), *adapter.image_size(model))


def check_volume_size(model: nn.Module, size) -> tuple[int, ...]:
    """The volume size (D, H, W) ``model`` can take, checked before data is prepared for it.

    Args:
        model: A supported model.
        size: An int (a cube) or three ints.

    Returns:
        The size as a tuple of three ints.

    Raises:
        ValueError: one line: a 2-D model, a 2-D size, or a size the model cannot take (the message names
            the nearest valid sizes).
    """
    model = unwrap_model(model)
    return get_adapter(model).check_volume_size(model, size)


def family_name(model: nn.Module) -> str:
    """Family id: ``timm-vit``, ``timm-swin``, ``timm-mixer``, ``torchvision-vit`` or ``torchvision-swin``."""
    return get_adapter(model).family


def select_blocks(model: nn.Module, selection: Optional[Union[BlockRef, Iterable[BlockRef]]] = None
                  ) -> list[BlockView]:
    """Blocks picked by global index or name (``stage1.block0``); all blocks when ``selection`` is None.

    Raises:
        ValueError: an index out of range or an unknown name; the message lists the valid choices.
    """
    views = blocks(model)
    if selection is None:
        return views
    if isinstance(selection, (int, str)):
        selection = [selection]
    by_name = {view.name: view for view in views}
    chosen: list[BlockView] = []
    for ref in selection:
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise ValueError(f"block reference must be an int index or a block name, got {ref!r}")
        if isinstance(ref, str) and ref.lstrip("-").isdigit():
            ref = int(ref)
        if isinstance(ref, int):
            if not 0 <= ref < len(views):
                raise ValueError(f"block index {ref} out of range: this model has blocks 0-{len(views) - 1}")
            view = views[ref]
        elif ref in by_name:
            view = by_name[ref]
        else:
            raise ValueError(f"unknown block {ref!r}: valid names are {views[0].name} ... {views[-1].name} "
                             f"(or indices 0-{len(views) - 1})")
        if all(view.global_index != other.global_index for other in chosen):
            chosen.append(view)
    return sorted(chosen, key=lambda view: view.global_index)


def qkv(model: nn.Module, names: Optional[Iterable[str]] = None) -> dict[str, dict[str, Tensor]]:
    """Query/key/value weights of every block (or of the blocks ``names``), split from the fused projection.

    Q = W[0:C'], K = W[C':2C'], V = W[2C':3C'] of the fused (3C', C) weight (C' = heads * head_dim);
    biases likewise. The tensors are detached VIEWS of the live parameters: they follow training
    and cost no memory; ``.clone()`` them to keep a snapshot.

    Returns:
        ``{block name: {"q", "k", "v": (C', C), and "q_bias", "k_bias", "v_bias": (C',) when present}}``.

    Raises:
        ValueError: for MLP-Mixer, which has no query/key/value.
    """
    model = unwrap_model(model)
    adapter = get_adapter(model)
    if adapter.mixer_name != "attention":
        raise ValueError(f"{adapter.description} has no query/key/value: token mixing is an MLP")
    result: dict[str, dict[str, Tensor]] = {}
    wanted = None if names is None else set(names)
    for view in adapter.block_views(model):
        if wanted is not None and view.name not in wanted:
            continue
        weight, bias = adapter.qkv_projection(view.module)
        if isinstance(weight, tuple):  # separate projections (Hugging Face)
            entry = {key: matrix.detach() for key, matrix in zip("qkv", weight)}
            entry.update({f"{key}_bias": vector.detach() for key, vector in zip("qkv", bias or ())})
            result[view.name] = entry
            continue
        weight = weight.detach()  # (3C', C)
        width = weight.shape[0] // 3
        entry = {key: weight[i * width:(i + 1) * width] for i, key in enumerate("qkv")}
        if bias is not None:
            bias = bias.detach()  # (3C',)
            entry.update({f"{key}_bias": bias[i * width:(i + 1) * width] for i, key in enumerate("qkv")})
        result[view.name] = entry
    return result


def out_proj(model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """Attention output projection of every block as detached views: ``{name: {"weight", "bias"}}``
    (weight (C, C'); ``bias`` only when present).

    Raises:
        ValueError: for MLP-Mixer.
    """
    model = unwrap_model(model)
    adapter = get_adapter(model)
    if adapter.mixer_name != "attention":
        raise ValueError(f"{adapter.description} has no attention output projection: token mixing is an MLP")
    result = {}
    for view in adapter.block_views(model):
        weight, bias = adapter.out_projection(view.module)
        result[view.name] = {"weight": weight.detach()}
        if bias is not None:
            result[view.name]["bias"] = bias.detach()
    return result


def embeddings(model: nn.Module) -> Embeddings:
    """Patch-embedding filters, patch position embedding and class token (see :class:`Embeddings`)."""
    model = unwrap_model(model)
    return get_adapter(model).embeddings(model)


def part_prefixes(model: nn.Module, part: str) -> Optional[tuple[str, ...]]:
    """State-dict prefixes of a named model part: ``patch_embed``, ``pos_embed``, ``cls_token``, ``norm``,
    ``head`` (where the family has them) or ``embed`` (everything before the first block); None for
    any other name."""
    model = unwrap_model(model)
    adapter = get_adapter(model)
    parts = adapter.parts(model)
    if part in parts:
        return tuple(parts[part])
    if part == "embed":
        return tuple(adapter.embedding_prefixes(model))
    return None
