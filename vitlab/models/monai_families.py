"""Adapters for MONAI's 3-D transformers: SwinUNETR (the blocks of its ``swinViT`` encoder) and ViT / UNETR
(the blocks of its ``vit``).

Each adapter takes the whole network (``SwinUNETR``, ``UNETR``) or its bare transformer (``SwinTransformer``,
``ViT``): block names, Q/K/V views, recording, capture, ablation and transplants then work on the model a
user trains, with state-dict prefixes (``swinViT.``, ``vit.``) in the block ``qualname`` and the parts. The
UNETR-style convolutional decoder is the model's ``head`` (everything outside the transformer), so
``freeze all_but_head`` freezes the encoder and an encoder-only checkpoint loads with a fresh decoder.

Tokens of a 3-D model run row-major over the (D, H, W) grid (MONAI's ``flatten(2)`` of a Conv3d output and
its ``window_partition``), so ``BlockView.grid`` and the window geometry are 3-tuples and everything written
for 2-D token grids applies per axis.

MONAI is never imported by this module: :meth:`matches` looks MONAI's classes up in ``sys.modules`` (a model
whose library was never imported cannot be a MONAI model), so looking up the adapter of a timm model costs
no MONAI import; the methods that need MONAI's window helpers take them from the module the model came from.
"""

from __future__ import annotations

import math
import operator
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitlab.models.adapter import BlockView, Embeddings, FamilyAdapter, plain_type

__all__ = ["DEFAULT_VOLUME_SIZE", "MonaiSwinUNETRAdapter", "MonaiViTAdapter"]

DEFAULT_VOLUME_SIZE = 96  # configured side of a SwinUNETR built without ``img_size`` (MONAI's usual ROI)
_SWIN = "monai.networks.nets.swin_unetr"
_VIT = "monai.networks.nets.vit"
_UNETR = "monai.networks.nets.unetr"
_SELF_ATTENTION = "monai.networks.blocks.selfattention"
_TRANSFORMER_BLOCK = "monai.networks.blocks.transformerblock"
_AXES = "DHW"


def _library(name: str):
    """The MONAI module ``name`` if it was imported, else None."""
    return sys.modules.get(name)


def _swin_library():
    import importlib

    return importlib.import_module(_SWIN)  # already imported when a model of it exists


def _ints(values) -> tuple[int, ...]:
    return tuple(int(value) for value in values)


def _size_tuple(size, axes: int, what: str) -> tuple[int, ...]:
    """An int (a cube) or ``axes`` ints -> a tuple; one-line ValueError for another number of axes."""
    if isinstance(size, bool):
        raise ValueError(f"volume size must be an int or {axes} ints, got {size!r}")
    try:
        size = (operator.index(size),) * axes  # one int (Python or NumPy): a cube
    except TypeError:
        pass
    try:
        size = _ints(size)
    except (TypeError, ValueError):
        raise ValueError(f"volume size must be an int or {axes} ints, got {size!r}") from None
    if len(size) != axes:
        shape = ", ".join(_AXES[-axes:]) if axes <= 3 else f"{axes} sides"
        raise ValueError(f"{what} takes {axes}-D inputs ({shape}); got a {len(size)}-D size {size}")
    if any(side < 1 for side in size):
        raise ValueError(f"volume size must be positive, got {size}")
    return size


def _check_input_tensor(adapter: FamilyAdapter, model: nn.Module, x: Tensor, axes: int) -> None:
    """(B, C, *spatial) with ``axes`` spatial sides the model can take, or a one-line ValueError."""
    if not isinstance(x, Tensor):
        return
    if x.ndim != axes + 2:
        shape = ", ".join(_AXES[-axes:]) if axes <= 3 else "..."
        raise ValueError(f"{adapter.description} takes (B, C, {shape}) inputs; got a {x.ndim}-D tensor of shape "
                         f"{tuple(x.shape)}" + (" (a 2-D image batch?)" if x.ndim == 4 and axes == 3 else ""))
    adapter.check_volume_size(model, tuple(x.shape[2:]))


# ------------------------------------------------------------------------------------------------ SwinUNETR


def _swin_encoder(model: nn.Module, library) -> Optional[tuple[nn.Module, str]]:
    """(the ``SwinTransformer``, its state-dict prefix) of a SwinUNETR or a bare SwinTransformer, else None."""
    if isinstance(model, library.SwinUNETR):
        return model.swinViT, "swinViT."
    if isinstance(model, library.SwinTransformer):
        return model, ""
    return None


def _swin_stages(encoder: nn.Module) -> list[nn.Module]:
    """The ``BasicLayer`` of every stage (``layers1[0]`` ... ``layers4[0]``)."""
    return [getattr(encoder, f"layers{stage + 1}")[0] for stage in range(encoder.num_layers)]


def _is_window_block(block: nn.Module, library) -> bool:
    """A windowed-attention block (MONAI 1.6 stages may hold Hyena blocks instead: no attention)."""
    return plain_type(block) is library.SwinTransformerBlock and plain_type(block.attn) is library.WindowAttention


class MonaiSwinUNETRAdapter(FamilyAdapter):
    """MONAI ``SwinUNETR`` (the blocks of its ``swinViT``) or a bare ``SwinTransformer``: stages
    ``layers1`` ... ``layers4``, each a ``BasicLayer`` of ``SwinTransformerBlock`` s with 3-D windowed attention.

    The geometry follows MONAI exactly: a block pads its (D, H, W) grid to whole windows, then rolls it by
    ``-shift`` (pad before roll); where a side is no larger than the window, MONAI's ``get_window_size`` shrinks
    the window to that side and drops the shift along it. The relative-position bias of a window of n slots is
    ``table[index[:n, :n]]``, as the module computes it (for a shrunk window these are the top-left n x n
    entries of the full window's index, MONAI's own choice). The shift mask (-100 between slots from different
    regions of the rolled grid) comes from the ``BasicLayer`` as the block's second argument.
    """

    family = "monai-swin-unetr"
    description = "MONAI SwinUNETR / SwinTransformer (3-D shifted windows)"
    library = "monai"
    classes = "SwinUNETR (its `swinViT`), SwinTransformer"
    examples = "`monai:swin_unetr`"
    notes = ("3-D windows (d, h, w) with MONAI's shift mask and window shrinking; 3-D rel-pos table in `BlockView`; "
             "grids are (D, H, W); the conv decoder is the `head`; Hyena blocks skipped; sizes: `check_volume_size`")
    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "swinViT.patch_embed.proj"
    mlp_act_name = "fn"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        library = _library(_SWIN)
        if library is None:
            return False
        found = _swin_encoder(model, library)
        if found is None:
            return False
        return any(_is_window_block(block, library) for stage in _swin_stages(found[0]) for block in stage.blocks)

    # ---- anatomy ------------------------------------------------------------------------------------
    def _encoder(self, model: nn.Module) -> tuple[nn.Module, str]:
        return _swin_encoder(model, _swin_library())

    def _axes(self, model: nn.Module) -> int:
        return len(self._encoder(model)[0].window_size)

    def image_size(self, model: nn.Module) -> tuple[int, ...]:
        configured = getattr(model, "vitlab_img_size", None)
        axes = self._axes(model)
        return _size_tuple(configured, axes, self.description) if configured is not None else (DEFAULT_VOLUME_SIZE,) * axes

    def in_chans(self, model: nn.Module) -> int:
        return int(self._encoder(model)[0].patch_embed.proj.in_channels)

    def _stage_grids(self, model: nn.Module) -> list[tuple[int, ...]]:
        """Token grid entering each stage at the configured size: the patch embedding pads to whole patches,
        each patch merging pads odd sides and halves."""
        encoder, _ = self._encoder(model)
        patch = _ints(encoder.patch_embed.patch_size)
        grid = tuple(-(-side // step) for side, step in zip(self.image_size(model), patch))
        grids = []
        for _ in range(encoder.num_layers):
            grids.append(grid)
            grid = tuple((side + 1) // 2 for side in grid)
        return grids

    def block_views(self, model: nn.Module) -> list[BlockView]:
        library = _swin_library()
        encoder, prefix = self._encoder(model)
        views: list[BlockView] = []
        for stage, (layer, grid) in enumerate(zip(_swin_stages(encoder), self._stage_grids(model))):
            for index, block in enumerate(layer.blocks):
                if not _is_window_block(block, library):
                    continue
                window, shift = self.window_geometry(block, grid)[:2]
                attn = block.attn
                views.append(BlockView(
                    name=f"stage{stage}.block{index}", stage=stage, index=index, global_index=len(views),
                    module=block, qualname=f"{prefix}layers{stage + 1}.0.blocks.{index}", dim=block.dim,
                    num_heads=attn.num_heads, head_dim=block.dim // attn.num_heads, has_attention=True,
                    window_size=window, shift_size=shift, rel_pos_table=attn.relative_position_bias_table,
                    grid=grid, num_prefix_tokens=0,
                ))
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        conv = self._encoder(model)[0].patch_embed.proj
        return Embeddings(
            patch_weight=conv.weight.detach(), patch_bias=None if conv.bias is None else conv.bias.detach(),
            pos_embed=None, cls_token=None, num_prefix_tokens=0, grid=self._stage_grids(model)[0],
            patch_size=_ints(conv.kernel_size),
        )

    def check_volume_size(self, model: nn.Module, size) -> tuple[int, ...]:
        library = _swin_library()
        size = _size_tuple(size, self._axes(model), self.description)
        if not isinstance(model, library.SwinUNETR):
            return size  # the bare encoder pads any size to whole patches and windows
        patch = model.patch_size
        patch = (patch,) * len(size) if isinstance(patch, int) else _ints(patch)
        steps = tuple(step ** 5 for step in patch)  # SwinUNETR.forward's own check: patch_size ** 5 per side
        if any(side % step for side, step in zip(size, steps)):
            down = tuple(max(step, side // step * step) for side, step in zip(size, steps))
            up = tuple(-(-side // step) * step for side, step in zip(size, steps))
            nearest = f"{down} or {up}" if down != up else f"{up}"
            raise ValueError(f"SwinUNETR cannot take a volume of size {size}: every side must be a multiple of "
                             f"{steps[0] if len(set(steps)) == 1 else steps} (patch_size ** 5); nearest valid sizes: "
                             f"{nearest}")
        instance_norm = any(isinstance(module, nn.modules.instancenorm._InstanceNorm)
                            for module in model.encoder10.modules())
        if instance_norm and all(side == step for side, step in zip(size, steps)):
            bigger = (2 * steps[0],) + size[1:]
            raise ValueError(f"SwinUNETR cannot take a volume of size {size}: it leaves one voxel at the bottleneck, "
                             f"where the decoder's instance norm fails; use a side of {2 * steps[0]} or more "
                             f"(e.g. {bigger}) or build with norm_name='batch'")
        return size

    def check_input(self, model: nn.Module, x: Tensor) -> None:
        _check_input_tensor(self, model, x, self._axes(model))

    # ---- running a block by parts ---------------------------------------------------------------------
    def mixer_branch(self, block: nn.Module, h: Tensor, mask_matrix: Optional[Tensor] = None, **kwargs) -> Tensor:
        """``SwinTransformerBlock.forward_part1`` after its ``norm1``, then the block's drop path: pad to whole
        windows, roll by -shift, window attention (with ``mask_matrix`` for shifted blocks), un-window, roll
        back, crop."""
        library = _swin_library()
        spatial, channels = _ints(h.shape[1:-1]), h.shape[-1]
        window, shift = library.get_window_size(spatial, block.window_size, block.shift_size)
        pads = [(side_w - side % side_w) % side_w for side, side_w in zip(spatial, window)]
        padding = [0, 0]
        for pad in reversed(pads):  # F.pad lists the last axis first: channels, then W, H (, D)
            padding += [0, pad]
        x = F.pad(h, padding)
        dims = [x.shape[0], *x.shape[1:-1]]
        axes = tuple(range(1, len(spatial) + 1))
        shifted = any(step > 0 for step in shift)
        if shifted:
            x = torch.roll(x, shifts=tuple(-step for step in shift), dims=axes)
        windows = block.attn(library.window_partition(x, window), mask=mask_matrix if shifted else None)
        x = library.window_reverse(windows.view(-1, *(tuple(window) + (channels,))), window, dims)
        if shifted:
            x = torch.roll(x, shifts=tuple(shift), dims=axes)
        if any(pads):
            x = x[(slice(None), *(slice(0, side) for side in spatial))].contiguous()
        return block.drop_path(x)

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path(block.mlp(h))

    def runtime_grid(self, block: nn.Module, args: tuple) -> tuple[int, ...]:
        return _ints(args[0].shape[1:-1])  # (B, D, H, W, C)

    # ---- attention recording -------------------------------------------------------------------------
    @contextmanager
    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]) -> Iterator[None]:
        # the explicit path's softmax output: (B*nW, heads, n, n), after the rel-pos bias and the shift mask
        attn = block.attn
        flash = getattr(attn, "use_flash_attention", None)  # MONAI >= 1.5 may run SDPA instead
        if flash is not None:
            attn.use_flash_attention = False
        handle = attn.softmax.register_forward_hook(lambda module, args, output: sink(output))
        try:
            yield
        finally:
            handle.remove()
            if flash is not None:
                attn.use_flash_attention = flash

    def window_geometry(self, block: nn.Module, grid: tuple[int, ...]):
        window, shift = _swin_library().get_window_size(_ints(grid), block.window_size, block.shift_size)
        return _ints(window), _ints(shift), False  # MONAI pads, then rolls

    # ---- parameters by name ------------------------------------------------------------------------
    def _head(self, model: nn.Module, prefix: str) -> list[str]:
        """Everything outside the transformer (the UNETR-style decoder and its output conv)."""
        inner = prefix.rstrip(".")
        return [f"{name}." for name, _ in model.named_children() if name != inner] if prefix else []

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        _, prefix = self._encoder(model)
        parts = {"patch_embed": [f"{prefix}patch_embed."]}
        head = self._head(model, prefix)
        if head:
            parts["head"] = head
        return parts

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return [f"{self._encoder(model)[1]}patch_embed."]

    def stage_entry_prefixes(self, model: nn.Module) -> dict[str, int]:
        library = _swin_library()
        encoder, prefix = self._encoder(model)
        stages = _swin_stages(encoder)
        counts = [sum(_is_window_block(block, library) for block in layer.blocks) for layer in stages]
        firsts = [sum(counts[:stage]) for stage in range(len(stages) + 1)]  # first attention block at or after
        entries: dict[str, int] = {}
        for stage in range(len(stages)):
            entries[f"{prefix}layers{stage + 1}c."] = firsts[stage]  # use_v2: a conv block before the stage
            entries[f"{prefix}layers{stage + 1}.0.downsample."] = firsts[stage + 1]
            if counts[stage] == 0:  # a stage without attention (Hyena) joins the next attention block
                entries[f"{prefix}layers{stage + 1}.0."] = firsts[stage]
        return entries

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        """MONAI's self-supervised Swin checkpoints hold the encoder alone, named without ``swinViT.`` (after
        the loader strips ``module.``) or with ``swin_vit.``, and their MLPs as ``mlp.fc1`` / ``mlp.fc2``
        (what ``SwinUNETR.load_from`` reads): they are renamed into this model; a full model's file passes
        unchanged."""
        _, prefix = self._encoder(model)
        state = dict(state_dict)
        planar = [key for key, value in state.items() if key.endswith("patch_embed.proj.weight") and value.ndim == 4]
        if planar and any(v.ndim == 5 for k, v in model.state_dict().items() if k.endswith("patch_embed.proj.weight")):
            from vitlab.models.errors import WeightsMismatchError

            raise WeightsMismatchError(
                f"2-D Swin weights (patch kernel {tuple(state[planar[0]].shape)} at {planar[0]}) cannot start a 3-D Swin: its "
                "windows, relative-position tables and patch kernels are 3-D and have no inflation rule; use MONAI's "
                "self-supervised swinViT weights (model_swinvit.pt), a 3-D checkpoint, or a vit3d: ViT (which inflates 2-D ViT weights)")
        if prefix and not any(key.startswith(prefix) for key in state):
            renamed = {}
            for key, value in state.items():
                if key.startswith("swin_vit."):
                    key = prefix + key[len("swin_vit."):]
                elif key.startswith(("patch_embed.", "layers1", "layers2", "layers3", "layers4")):
                    key = prefix + key
                renamed[key] = value
            state = renamed
        model_keys = set(model.state_dict())
        converted = {}
        for key, value in state.items():
            if key not in model_keys and ".mlp.fc" in key:
                candidate = key.replace(".mlp.fc1.", ".mlp.linear1.").replace(".mlp.fc2.", ".mlp.linear2.")
                key = candidate if candidate in model_keys else key
            converted[key] = value
        return converted


# ------------------------------------------------------------------------------------------------ ViT / UNETR


def _vit_backbone(model: nn.Module, vit_library) -> Optional[tuple[nn.Module, str]]:
    """(the ``ViT``, its state-dict prefix) of a UNETR or a bare ViT, else None."""
    if isinstance(model, vit_library.ViT):
        return model, ""
    unetr = _library(_UNETR)
    if unetr is not None and isinstance(model, unetr.UNETR) and isinstance(getattr(model, "vit", None), vit_library.ViT):
        return model.vit, "vit."
    return None


def _plain_block(block: nn.Module) -> bool:
    """A pre-norm ``TransformerBlock`` with a plain self-attention ``SABlock`` (no cross-attention, causal
    mask, relative-position term or missing output projection)."""
    blocks, attention = _library(_TRANSFORMER_BLOCK), _library(_SELF_ATTENTION)
    if blocks is None or attention is None or plain_type(block) is not blocks.TransformerBlock:
        return False
    attn = block.attn
    return (plain_type(attn) is attention.SABlock and not block.with_cross_attention and not attn.causal
            and attn.rel_positional_embedding is None and attn.include_fc)


class MonaiViTAdapter(FamilyAdapter):
    """MONAI ``ViT`` or ``UNETR`` (the blocks of its ``vit``): pre-norm ``TransformerBlock`` s with ``SABlock``
    self-attention over a 3-D patch grid (row-major over (D, H, W)); a class token in front with
    ``classification=True``. Q/K/V come from the combined ``qkv`` Linear (rows q | k | v, heads inside each)
    or, with ``use_combined_linear=False``, from ``to_q`` / ``to_k`` / ``to_v``.

    UNETR keeps its patch grid (``feat_size``); a bare ViT keeps only its patch count, so its grid comes from
    ``model.vitlab_img_size`` when set and is otherwise taken to be a cube (a non-cubic count becomes a
    (1, 1, N) row)."""

    family = "monai-vit"
    description = "MONAI ViT / UNETR (3-D patch grid)"
    library = "monai"
    classes = "ViT, UNETR (its `vit`)"
    examples = "`monai:unetr`"
    notes = ("grid (D, H, W); combined `qkv` or separate `to_q/to_k/to_v`; class token with `classification=True`; "
             "recording sets `save_attn`; UNETR's conv decoder is the `head`; not cross-attention, causal or rel-pos SABlocks")
    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "vit.patch_embedding.patch_embeddings"
    mlp_act_name = "fn"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        library = _library(_VIT)
        if library is None:
            return False
        found = _vit_backbone(model, library)
        return found is not None and len(found[0].blocks) > 0 and all(_plain_block(block) for block in found[0].blocks)

    # ---- anatomy ------------------------------------------------------------------------------------
    def _vit(self, model: nn.Module) -> tuple[nn.Module, str]:
        import importlib

        return _vit_backbone(model, importlib.import_module(_VIT))

    def _patch_size(self, vit: nn.Module) -> tuple[int, ...]:
        embedding = vit.patch_embedding
        if embedding.proj_type == "conv":
            return _ints(embedding.patch_embeddings.kernel_size)
        lengths = embedding.patch_embeddings[0].axes_lengths  # perceptron: Rearrange(... p1 p2 p3 ...)
        return tuple(int(lengths[f"p{axis + 1}"]) for axis in range(len(lengths)))

    def _grid(self, model: nn.Module) -> tuple[int, ...]:
        vit, prefix = self._vit(model)
        if prefix and getattr(model, "feat_size", None) is not None:  # UNETR keeps its patch grid
            return _ints(model.feat_size)
        patch = self._patch_size(vit)
        configured = getattr(model, "vitlab_img_size", None)
        if configured is not None:
            return tuple(side // step for side, step in zip(_size_tuple(configured, len(patch), self.description), patch))
        count, axes = int(vit.patch_embedding.n_patches), len(patch)
        side = round(count ** (1.0 / axes))
        for candidate in (side - 1, side, side + 1):  # a bare ViT does not keep its img_size: assume a cube
            if candidate > 0 and candidate ** axes == count:
                return (candidate,) * axes
        return (1,) * (axes - 1) + (count,)

    def num_prefix_tokens(self, model: nn.Module) -> int:
        return int(hasattr(self._vit(model)[0], "cls_token"))

    def image_size(self, model: nn.Module) -> tuple[int, ...]:
        patch = self._patch_size(self._vit(model)[0])
        return tuple(side * step for side, step in zip(self._grid(model), patch))

    def in_chans(self, model: nn.Module) -> int:
        vit = self._vit(model)[0]
        embedding = vit.patch_embedding
        if embedding.proj_type == "conv":
            return int(embedding.patch_embeddings.in_channels)
        return int(embedding.patch_embeddings[1].in_features // math.prod(self._patch_size(vit)))

    def block_views(self, model: nn.Module) -> list[BlockView]:
        vit, prefix = self._vit(model)
        grid, tokens = self._grid(model), self.num_prefix_tokens(model)
        views = []
        for index, block in enumerate(vit.blocks):
            attn = block.attn
            views.append(BlockView(
                name=f"stage0.block{index}", stage=0, index=index, global_index=index, module=block,
                qualname=f"{prefix}blocks.{index}", dim=attn.hidden_input_size, num_heads=attn.num_heads,
                head_dim=attn.dim_head, has_attention=True, window_size=None, shift_size=None,
                rel_pos_table=None, grid=grid, num_prefix_tokens=tokens,
            ))
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        vit, _ = self._vit(model)
        embedding, patch = vit.patch_embedding, self._patch_size(vit)
        if embedding.proj_type == "conv":
            weight, bias = embedding.patch_embeddings.weight, embedding.patch_embeddings.bias
        else:  # Linear over (p1 p2 p3 c) -> filters (D, C, p1, p2, p3)
            linear = embedding.patch_embeddings[1]
            weight, bias = linear.weight.view(linear.out_features, *patch, -1), linear.bias
            weight = weight.permute(0, len(patch) + 1, *range(1, len(patch) + 1))
        cls_token = vit.cls_token.detach()[0, 0] if hasattr(vit, "cls_token") else None
        return Embeddings(
            patch_weight=weight.detach(), patch_bias=None if bias is None else bias.detach(),
            pos_embed=embedding.position_embeddings.detach()[0], cls_token=cls_token,
            num_prefix_tokens=self.num_prefix_tokens(model), grid=self._grid(model), patch_size=patch,
        )

    def qkv_projection(self, block: nn.Module):
        attn = block.attn
        if attn.use_combined_linear:
            return attn.qkv.weight, attn.qkv.bias
        projections = (attn.to_q, attn.to_k, attn.to_v)
        biases = None if attn.to_q.bias is None else tuple(linear.bias for linear in projections)
        return tuple(linear.weight for linear in projections), biases

    def out_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        return block.attn.out_proj.weight, block.attn.out_proj.bias

    def check_volume_size(self, model: nn.Module, size) -> tuple[int, ...]:
        vit, prefix = self._vit(model)
        patch, grid = self._patch_size(vit), self._grid(model)
        size = _size_tuple(size, len(patch), self.description)
        fits = all(side // step == cells for side, step, cells in zip(size, patch, grid))
        if prefix or vit.patch_embedding.proj_type != "conv":
            # UNETR's decoder returns grid * patch voxels per side, and the perceptron embedding reshapes
            # whole patches: the input must be exactly grid * patch
            fits = fits and all(side % step == 0 for side, step in zip(size, patch))
        if not fits:
            raise ValueError(f"{self.description} cannot take a volume of size {size}: its position embedding "
                             f"is fixed to a {grid} patch grid of {patch} voxels; the valid size is "
                             f"{self.image_size(model)}")
        return size

    def check_input(self, model: nn.Module, x: Tensor) -> None:
        _check_input_tensor(self, model, x, len(self._patch_size(self._vit(model)[0])))

    # ---- running a block by parts ---------------------------------------------------------------------
    def mixer_branch(self, block: nn.Module, h: Tensor, context: Optional[Tensor] = None,
                     attn_mask: Optional[Tensor] = None, **kwargs) -> Tensor:
        return block.attn(h, attn_mask=attn_mask)

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.mlp(h)

    # ---- attention recording -------------------------------------------------------------------------
    @contextmanager
    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]) -> Iterator[None]:
        # SABlock keeps its post-softmax probabilities (B, heads, N, N) in ``att_mat`` when ``save_attn``
        # is set (explicit path only): set it, read them after each forward, put everything back
        attn = block.attn
        saved, flash, previous = attn.save_attn, getattr(attn, "use_flash_attention", False), attn.att_mat
        attn.save_attn, attn.use_flash_attention = True, False
        handle = attn.register_forward_hook(lambda module, args, output: sink(module.att_mat))
        try:
            yield
        finally:
            handle.remove()
            attn.save_attn, attn.use_flash_attention = saved, flash
            if not saved:
                attn.att_mat = previous

    # ---- parameters by name ------------------------------------------------------------------------
    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        vit, prefix = self._vit(model)
        parts = {"patch_embed": [f"{prefix}patch_embedding.patch_embeddings."],
                 "pos_embed": [f"{prefix}patch_embedding.position_embeddings"], "norm": [f"{prefix}norm."]}
        if hasattr(vit, "cls_token"):
            parts["cls_token"] = [f"{prefix}cls_token"]
        head = [f"{prefix}classification_head."] if hasattr(vit, "classification_head") else []
        if prefix:
            head += [f"{name}." for name, _ in model.named_children() if name != prefix.rstrip(".")]
        if head:
            parts["head"] = head
        return parts

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        prefix = self._vit(model)[1]
        return [f"{prefix}patch_embedding.", f"{prefix}cls_token"]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        """Drops the ``blocks.{i}.cross_attn.*`` entries of files from older MONAI versions, which built a
        cross-attention module in every block (what ``ViT.load_old_state_dict`` drops)."""
        model_keys = set(model.state_dict())
        return {key: value for key, value in state_dict.items()
                if key in model_keys or ".cross_attn." not in key}
