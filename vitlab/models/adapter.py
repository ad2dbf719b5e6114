"""The family-adapter vocabulary: the single place that says how vitlab sees a vision transformer.

An adapter describes one model family (timm ViT, timm Swin, ...) through a small, uniform vocabulary:
its blocks (with their stage/index), the sub-modules of a block (``norm1``, token mixer, ``norm2``,
``mlp``), how to run the two branches of a block, where its fused Q/K/V projection lives, how to
record attention probabilities, and which parameter-name prefixes form the embedding / head / norm.
Everything else in :mod:`vitlab.models` is written once against this vocabulary.

This module holds the base class :class:`FamilyAdapter`, the views it returns (:class:`BlockView`,
:class:`Embeddings`) and helpers the family modules share (:func:`conv_embeddings`,
:func:`window_slot_tokens`, :func:`unwrap_model`). It imports no family: the family modules
(``timm_families``, ``torchvision_families``, ...) import it, and :mod:`vitlab.models.registry` lists them
in matching order and finds the adapter of a model (see there for how to add a family).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import torch
from torch import Tensor, nn

__all__ = [
    "BlockView",
    "Embeddings",
    "FamilyAdapter",
    "conv_embeddings",
    "plain_type",
    "unwrap_model",
    "window_slot_tokens",
]


@dataclass(frozen=True, eq=False)
class BlockView:
    """One transformer block as seen by vitlab.

    Attributes:
        name: ``stage{s}.block{b}`` (ViT-like models have a single stage 0).
        stage: Stage index ``s``.
        index: Block index ``b`` inside its stage.
        global_index: Position ``g`` among all blocks (``sum(depths[:s]) + b``).
        module: The live block module.
        qualname: The block's dotted path in the model (its state_dict prefix).
        dim: Channel width C of the residual stream in this block.
        num_heads: Attention heads (None for MLP-Mixer).
        head_dim: Channels per head (None for MLP-Mixer).
        has_attention: False for MLP-Mixer blocks (token mixing is an MLP).
        window_size: Swin attention window (h, w) at the configured input size, (d, h, w) for 3-D models
            (MONAI SwinUNETR); None otherwise.
        shift_size: Swin cyclic shift (h, w) or (d, h, w), all 0 for unshifted blocks; None otherwise.
        rel_pos_table: Swin V1 / BEiT relative-position bias table ((2w-1)^2 (+3 for BEiT's class token),
            heads; (2wd-1)(2wh-1)(2ww-1) rows for 3-D windows), the live Parameter; or None (Swin V2's bias
            comes from an MLP).
        grid: Token grid (H, W) entering this block at the model's configured input size; (D, H, W) for
            3-D models, whose tokens run row-major over the three axes.
        num_prefix_tokens: Class/register tokens in front of the patch tokens (0 for Swin/Mixer).
        attention_form: ``"dot"`` (logits = q.k / sqrt(hd) + position terms) or ``"cosine"`` (Swin V2:
            logits = exp(min(s_h, log 100)) * q.k / (|q| |k|) + position bias). For cosine attention the QK
            spectra (:func:`vitlab.analysis.qk_spectra`) are those of Wq_h^T Wk_h, the bilinear form of the
            un-normalised numerator q.k: its sign structure (positive mass, symmetry score) and effective
            rank carry over to the cosine logits, its singular-value magnitudes do not (the per-pair norms
            and the logit scale s_h set those).
    """

    name: str
    stage: int
    index: int
    global_index: int
    module: nn.Module = field(repr=False)
    qualname: str
    dim: int
    num_heads: Optional[int]
    head_dim: Optional[int]
    has_attention: bool
    window_size: Optional[tuple[int, ...]]
    shift_size: Optional[tuple[int, ...]]
    rel_pos_table: Optional[nn.Parameter] = field(repr=False)
    grid: tuple[int, ...]
    num_prefix_tokens: int
    attention_form: str = "dot"


@dataclass(frozen=True, eq=False)
class Embeddings:
    """Input embedding of a model, for the patch-filter / position-embedding probes.

    Attributes:
        patch_weight: Effective patch-embedding filters (D, in_chans, P, P), (D, in_chans, Pd, P, P) for
            3-D models. A live parameter (view) except for torchvision models built with ``in_chans=1``,
            where it is the RGB filters summed, and MONAI's perceptron patch embedding, a reshaped view.
        patch_bias: Patch-embedding bias (D,) or None.
        pos_embed: Position embedding of the patch tokens only (H*W, D), or None (Swin, Mixer).
        cls_token: Class token (D,), or None.
        num_prefix_tokens: Tokens in front of the patch tokens.
        grid: Patch grid (H, W) at the configured input size; (D, H, W) for 3-D models.
        patch_size: Patch size (ph, pw) in pixels; (pd, ph, pw) voxels for 3-D models.
    """

    patch_weight: Tensor
    patch_bias: Optional[Tensor]
    pos_embed: Optional[Tensor]
    cls_token: Optional[Tensor]
    num_prefix_tokens: int
    grid: tuple[int, ...]
    patch_size: tuple[int, ...]


def _pair(value) -> tuple[int, int]:
    """Turns an int or a 2-sequence into a (h, w) tuple of ints."""
    if isinstance(value, int):
        return (value, value)
    first, second = value
    return (int(first), int(second))


class FamilyAdapter:
    """Describes one model family. Subclasses override the methods below; the rest of vitlab only
    talks to models through them.

    Class attributes:
        family: Short id, e.g. ``"timm-vit"``.
        description: Human name for error messages, e.g. ``"timm VisionTransformer (vit_*, deit_*)"``.
        mixer_name: Name of the token-mixing branch: ``"attention"`` or ``"token_mixing"`` (Mixer).
        part_names: Block-relative module names of ``norm1``, ``mixer``, ``norm2``, ``mlp``.
        input_conv: Dotted name of the first (patch-embedding) convolution.
        mlp_act_name: Name of the activation inside the block's channel MLP.
        norm_placement: ``"pre"`` (``x + f(norm(x))``, most ViTs) or ``"post"`` (res-post-norm,
            ``x + norm(f(x))``: Swin V2). Post-norm adapters' branch methods take the ``norm`` to apply.
        library, classes, examples, supports, notes: the registry row shown in the README table
            (``supports`` lists what works, ``notes`` the family's particulars and limits).
    """

    family: ClassVar[str] = ""
    description: ClassVar[str] = ""
    library: ClassVar[str] = ""
    classes: ClassVar[str] = ""
    examples: ClassVar[str] = ""
    supports: ClassVar[str] = "qkv, blocks, record_attention, capture, ablate, transplant, forward_until"
    notes: ClassVar[str] = ""
    norm_placement: ClassVar[str] = "pre"
    mixer_name: ClassVar[str] = "attention"
    part_names: ClassVar[dict[str, str]] = {}
    input_conv: ClassVar[str] = ""
    mlp_act_name: ClassVar[str] = "act"

    # ---- identification -------------------------------------------------------------------------
    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family (and uses the block layout this adapter knows)."""
        raise NotImplementedError

    # ---- anatomy ------------------------------------------------------------------------------------
    def block_views(self, model: nn.Module) -> list[BlockView]:
        """All blocks in forward order."""
        raise NotImplementedError

    def embeddings(self, model: nn.Module) -> Embeddings:
        """Patch / position / class embeddings."""
        raise NotImplementedError

    def num_prefix_tokens(self, model: nn.Module) -> int:
        """Class/register tokens in front of the patch tokens."""
        return 0

    def image_size(self, model: nn.Module) -> tuple[int, ...]:
        """Configured input size (H, W) in pixels; (D, H, W) voxels for 3-D models."""
        raise NotImplementedError

    def check_volume_size(self, model: nn.Module, size) -> tuple[int, ...]:
        """The spatial size (D, H, W) of a volume this model can take, as a tuple; 3-D families override it.

        Raises:
            ValueError: always here: the family takes 2-D images.
        """
        raise ValueError(f"{self.description} takes 2-D images (B, C, H, W), not volumes")

    def check_input(self, model: nn.Module, x: Tensor) -> None:
        """Raises a one-line ValueError for an input the model cannot take, before a forward that would fail
        deep inside the library (3-D families: a 2-D image, a volume size they cannot tile). Default: no
        check."""

    def in_chans(self, model: nn.Module) -> int:
        """Number of input image channels the model accepts."""
        conv = model.get_submodule(self.input_conv)
        return int(getattr(conv, "in_chans", conv.in_channels))

    def qkv_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        """The fused projection of a block: weight (3C', C) and bias (3C',) or None (default: ``attn.qkv``).
        Families with separate projections return the tuples (W_q, W_k, W_v) and (b_q, b_k, b_v) or None."""
        qkv = self._attention(block).qkv
        return qkv.weight, qkv.bias

    def out_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        """The attention output projection: weight (C, C') and bias or None (default: ``attn.proj``)."""
        proj = self._attention(block).proj
        return proj.weight, proj.bias

    def _attention(self, block: nn.Module) -> nn.Module:
        if self.mixer_name != "attention":
            raise ValueError(f"{self.description} has no query/key/value: token mixing is an MLP")
        return self.part(block, "mixer")

    # ---- running a block by parts (ablation, capture) ------------------------------------------------
    def part(self, block: nn.Module, part: str) -> nn.Module:
        """The block's ``norm1`` / ``mixer`` / ``norm2`` / ``mlp`` sub-module."""
        return block.get_submodule(self.part_names[part])

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        """Token-mixing branch on the normalised input, up to (excluding) the residual add. Post-norm
        adapters get the block input and a ``norm`` keyword (norm1 or the identity) to apply to the output."""
        raise NotImplementedError

    def mlp_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        """Channel-MLP branch on the normalised input, up to (excluding) the residual add (post-norm:
        on the stream, with ``norm``)."""
        raise NotImplementedError

    def block_output(self, x: Tensor):
        """What the library block returns for the output stream ``x`` (default: ``x`` itself)."""
        return x

    def runtime_grid(self, block: nn.Module, args: tuple) -> tuple[int, ...]:
        """Swin only: the token grid (H, W) of a block call from its positional ``args`` (default: the
        (B, H, W, C) input's shape; 3-D families return (D, H, W))."""
        return (int(args[0].shape[1]), int(args[0].shape[2]))

    def to_mlp_layout(self, x: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """Reshape the stream between the two branches as the library does; returns (x, undo)."""
        return x, _identity

    def main_branch_norm(self, block: nn.Module, x: Tensor) -> Tensor:
        """A norm the block applies to the stream after both residual adds (Swin V2-Cr ``norm3``; it is
        kept by every ablation, like the model's final norm). Default: none."""
        return x

    def mlp_activation(self, block: nn.Module) -> nn.Module:
        """The activation module of the block's channel MLP (its output is the MLP hidden layer)."""
        return self.part(block, "mlp").get_submodule(self.mlp_act_name)

    # ---- attention recording -------------------------------------------------------------------------
    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]) -> AbstractContextManager:
        """A context manager under which every forward of ``block`` calls ``sink`` with its post-softmax
        attention probabilities: (B, heads, N, N), or (B*nW, heads, w*w, w*w) for Swin windows."""
        raise NotImplementedError(f"{self.description} has no attention to record")

    def window_geometry(self, block: nn.Module, grid: tuple[int, ...]) -> Optional[tuple]:
        """Swin only: ((wh, ww), (sh, sw), roll_before_pad) the block uses on a runtime ``grid`` (3-tuples
        for a 3-D grid)."""
        return None

    # ---- parameters by name ------------------------------------------------------------------------
    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        """Named model parts -> parameter-name prefixes (``patch_embed``, ``pos_embed``, ``cls_token``,
        ``norm``, ``head``). Parts the family lacks are absent."""
        raise NotImplementedError

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        """Parameter-name prefixes of everything before the first block (layer 0 for layer decay)."""
        raise NotImplementedError

    def stage_entry_prefixes(self, model: nn.Module) -> dict[str, int]:
        """Prefixes of between-stage modules (Swin patch merging) -> global index of the block they feed."""
        return {}

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        """Convert a library-format state dict for this model (e.g. resample position embeddings)."""
        return state_dict


def _identity(x: Tensor) -> Tensor:
    return x


def conv_embeddings(conv: nn.Conv2d, grid: tuple[int, int], pos_embed: Optional[Tensor] = None,
                    cls_token: Optional[Tensor] = None, num_prefix_tokens: int = 0) -> Embeddings:
    """:class:`Embeddings` of a patchify convolution; a channel-repeating conv (torchvision grayscale)
    reports its RGB filters summed, the filters it effectively applies."""
    weight = conv.weight.detach()  # (D, C, P, P)
    if getattr(conv, "in_chans", conv.in_channels) == 1 and weight.shape[1] != 1:
        weight = weight.sum(dim=1, keepdim=True)  # (D, 1, P, P)
    return Embeddings(
        patch_weight=weight, patch_bias=None if conv.bias is None else conv.bias.detach(), pos_embed=pos_embed,
        cls_token=cls_token, num_prefix_tokens=num_prefix_tokens, grid=grid, patch_size=_pair(conv.kernel_size),
    )


def plain_type(module: nn.Module) -> type:
    """The module's own class, also once FSDP2's ``fully_shard`` has given it its subclass (``FSDP<Name>``, of
    ``FSDPModule`` and the class): the family checks compare exact classes, so that a subclass with another forward
    is not taken for the library's block."""
    cls = type(module)
    if not cls.__name__.startswith("FSDP"):
        return cls
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))


def unwrap_model(model: nn.Module) -> nn.Module:
    """Returns the plain network inside a ``torch.compile`` wrapper (or the model itself), and the backbone
    of a task model (detector, segmenter) that names it through a ``vitlab_backbone()`` method."""
    model = getattr(model, "_orig_mod", model)
    backbone = getattr(model, "vitlab_backbone", None)
    return unwrap_model(backbone()) if callable(backbone) else model


def window_slot_tokens(
    grid: tuple[int, ...], window: tuple[int, ...], shift: tuple[int, ...], roll_before_pad: bool
) -> Tensor:
    """Original token index of every slot of every Swin window (pad slots hold the token count).

    Works for 2-D grids (H, W) and 3-D grids (D, H, W) alike: tokens are numbered row-major over the grid,
    windows are ordered row-major over the window grid, and slots row-major inside a window (the order of
    timm, torchvision and MONAI's ``window_partition``).

    Args:
        grid: Token grid (H, W) or (D, H, W) of the block input.
        window: Window size, one number per axis.
        shift: Cyclic shift per axis; the library rolls by ``-shift`` before partitioning.
        roll_before_pad: timm rolls the unpadded grid then pads; torchvision and MONAI pad then roll.

    Returns:
        LongTensor (nW, prod(window)) in the library's window order.
    """
    axes = len(grid)
    num_tokens = math.prod(grid)
    padded_size = [-(-size // side) * side for size, side in zip(grid, window)]
    tokens = torch.arange(num_tokens).view(*grid)
    padded = torch.full(padded_size, num_tokens, dtype=torch.long)
    inside = tuple(slice(0, size) for size in grid)
    rolled = tuple(-step for step in shift)
    if roll_before_pad:
        if any(shift):
            tokens = torch.roll(tokens, shifts=rolled, dims=tuple(range(axes)))
        padded[inside] = tokens
    else:
        padded[inside] = tokens
        if any(shift):
            padded = torch.roll(padded, shifts=rolled, dims=tuple(range(axes)))
    # (n0, w0, n1, w1, ...) -> (n0, n1, ..., w0, w1, ...)
    split = [part for size, side in zip(padded_size, window) for part in (size // side, side)]
    order = list(range(0, 2 * axes, 2)) + list(range(1, 2 * axes, 2))
    windows = padded.view(*split).permute(*order)
    return windows.reshape(-1, math.prod(window))
