"""Capturing sub-layer outputs as (images, tokens, channels), and truncated forwards."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Optional, Union

import torch
from torch import Tensor, nn

from vitlab.models.adapter import BlockView, unwrap_model
from vitlab.models.anatomy import BlockRef, blocks as all_blocks, select_blocks
from vitlab.models.blockpatch import patch_block, release_block
from vitlab.models.registry import get_adapter

__all__ = ["CAPTURE_SITES", "Capture", "capture", "forward_until"]

CAPTURE_SITES = {
    "qkv_input": "norm1 output: the input of Q/K/V (or of the token-mixing MLP); post-norm Swin V2: the block input",
    "attn": "attention (token-mixing) branch output before the residual add; Swin un-windowed; post-norm: after norm1",
    "mlp_input": "norm2 output: the MLP input; post-norm Swin V2: the stream entering the MLP",
    "mlp_hidden": "MLP hidden layer after the activation",
    "mlp": "MLP branch output before the residual add",
    "resid": "residual stream after the block",
}
_SITE_ALIASES = {"token_mixing": "attn"}


def _valid_sites(sites: Union[str, Iterable[str]]) -> list[str]:
    sites = [sites] if isinstance(sites, str) else list(sites)
    resolved = []
    for site in sites:
        site = _SITE_ALIASES.get(site, site)
        if site not in CAPTURE_SITES:
            raise ValueError(f"unknown capture site {site!r}: valid are {', '.join(CAPTURE_SITES)} "
                             f"(alias: token_mixing = attn)")
        if site not in resolved:
            resolved.append(site)
    if not resolved:
        raise ValueError(f"capture needs at least one site among {', '.join(CAPTURE_SITES)}")
    return resolved


def _as_tokens(tensor: Tensor) -> Tensor:
    """(B, H, W, C) -> (B, H*W, C); 3-D Swin (B, D, H, W, C) -> (B, D*H*W, C); (B, N, C) unchanged."""
    return tensor.flatten(1, tensor.ndim - 2) if tensor.ndim >= 4 else tensor


def _grid_of(tensor: Tensor, view: BlockView) -> tuple[int, ...]:
    if tensor.ndim >= 4:
        return tuple(int(size) for size in tensor.shape[1:-1])
    patches = tensor.shape[1] - view.num_prefix_tokens
    if patches == math.prod(view.grid):
        return view.grid
    side = math.isqrt(patches)
    return (side, patches // side) if side * side == patches else (1, patches)


class Capture:
    """Sub-layer outputs recorded by :func:`capture`, concatenated over forward passes.

    Attributes:
        views: The captured blocks by name.
        sites: The captured sites.
        grids: Token grid (H, W) per block name (from the runtime shapes); (D, H, W) for 3-D models.
    """

    def __init__(self, views: list[BlockView], sites: list[str], to_cpu: bool, dtype: Optional[torch.dtype],
                 channels: Optional[Mapping[tuple[str, str], Tensor]] = None):
        self.views = {view.name: view for view in views}
        self._channels = dict(channels or {})
        self.sites = sites
        self.grids: dict[str, tuple[int, int]] = {view.name: view.grid for view in views}
        self._to_cpu, self._dtype = to_cpu, dtype
        self._chunks: dict[tuple[str, str], list[Tensor]] = {}
        self._prefix_chunks: dict[tuple[str, str], list[Tensor]] = {}

    def _sink(self, view: BlockView, site: str):
        key, prefix = (view.name, site), view.num_prefix_tokens

        def store(tensor: Tensor) -> None:
            tensor = tensor.detach()
            self.grids[view.name] = _grid_of(tensor, view)
            tokens = _as_tokens(tensor)  # (B, N, C)
            if key in self._channels:  # keep only these channels (before the copy: less memory)
                tokens = tokens.index_select(-1, self._channels[key].to(tokens.device))
            tokens = tokens.to(device="cpu" if self._to_cpu else tokens.device, dtype=self._dtype or tokens.dtype)
            if prefix and tensor.ndim == 3:
                self._prefix_chunks.setdefault(key, []).append(tokens[:, :prefix])
                tokens = tokens[:, prefix:]
            self._chunks.setdefault(key, []).append(tokens)
        return store

    @staticmethod
    def _joined(chunks: dict[tuple[str, str], list[Tensor]]) -> dict[str, dict[str, Tensor]]:
        result: dict[str, dict[str, Tensor]] = {}
        for (name, site), parts in chunks.items():
            if len(parts) > 1:
                chunks[(name, site)] = parts = [torch.cat(parts, dim=0)]
            result.setdefault(name, {})[site] = parts[0]
        return result

    @property
    def outputs(self) -> dict[str, dict[str, Tensor]]:
        """``{block name: {site: (images, patch tokens, channels)}}`` (prefix tokens removed)."""
        return self._joined(self._chunks)

    @property
    def prefix(self) -> dict[str, dict[str, Tensor]]:
        """``{block name: {site: (images, prefix tokens, channels)}}`` for models with class tokens."""
        return self._joined(self._prefix_chunks)

    def __getitem__(self, key: tuple[str, str]) -> Tensor:
        """``capture[name, site]`` -> (images, tokens, channels)."""
        name, site = key
        outputs = self.outputs
        if name not in outputs or site not in outputs[name]:
            raise KeyError(f"nothing captured for block {name!r} site {site!r}; captured blocks: "
                           f"{sorted(outputs)}, sites: {self.sites}")
        return outputs[name][site]


@contextmanager
def capture(model: nn.Module, sites: Union[str, Iterable[str]],
            blocks: Optional[Union[BlockRef, Iterable[BlockRef]]] = None, to_cpu: bool = True,
            dtype: Optional[torch.dtype] = None,
            channels: Optional[Mapping[tuple[str, str], Tensor]] = None) -> Iterator[Capture]:
    """Records the named sub-layer outputs of the chosen blocks during the forwards inside the context.

    Sites (see :data:`CAPTURE_SITES`): ``qkv_input``, ``attn`` (alias ``token_mixing``; MLP-Mixer: the
    token MLP output transposed back to (B, T, C)), ``mlp_input``, ``mlp_hidden``, ``mlp``, ``resid``.
    Only the chosen sites/blocks are kept; outputs are unchanged (bit-identical) while capturing.

    Args:
        model: A supported model.
        sites: Site name(s).
        blocks: Global indices or names; None = all blocks.
        to_cpu: Move captured tensors to the CPU as they arrive.
        dtype: Store in this dtype (e.g. ``torch.float16`` to halve memory); None keeps the model's.
        channels: ``{(block name, site): channel indices}``: store only these channels of those outputs
            (the others are dropped as they arrive; probes that need a few channels stay small).

    Yields:
        A :class:`Capture` (``.outputs``, ``.prefix``, ``.grids``, ``capture[name, site]``).
    """
    model = unwrap_model(model)
    adapter = get_adapter(model)
    sites = _valid_sites(sites)
    views = select_blocks(model, blocks)
    record = Capture(views, sites, to_cpu, dtype, channels)
    with ExitStack() as stack:
        for view in views:
            block = view.module
            state = patch_block(block, adapter)
            stack.callback(release_block, block)
            for site in sites:
                if site == "mlp_hidden":
                    sink = record._sink(view, site)
                    hook = adapter.mlp_activation(block).register_forward_hook(
                        lambda module, args, output, sink=sink: sink(output))
                    stack.callback(hook.remove)
                else:
                    sink = record._sink(view, site)
                    state.taps.setdefault(site, []).append(sink)
                    stack.callback(state.taps[site].remove, sink)
        yield record


class _StopForward(Exception):
    """Carries the residual stream out of a truncated forward."""

    def __init__(self, stream: Tensor):
        super().__init__()
        self.stream = stream


def _raise_output(module: nn.Module, args: tuple, output: Tensor) -> None:
    raise _StopForward(output[0] if isinstance(output, tuple) else output)  # HF Swin: (stream, weights)


def _raise_input(module: nn.Module, args: tuple) -> None:
    raise _StopForward(args[0])


def forward_until(model: nn.Module, x: Tensor, block: Union[BlockRef, str], site: str = "resid") -> Tensor:
    """The residual stream after ``block`` (or another site of it), running only the layers up to it.

    Differentiable in ``x`` (for inversion and feature visualisation): later blocks, and with a
    ``site`` before ``resid`` the rest of ``block`` itself, never run.

    Args:
        model: A supported model.
        x: Images (B, C, H, W), or volumes (B, C, D, H, W) for 3-D models.
        block: Global index, block name, or ``"embed"`` (after patch embedding, position embedding and
            class token: the input of the first block).
        site: Where in ``block`` to stop: a :data:`CAPTURE_SITES` name (alias ``token_mixing``);
            ``resid`` (default) is the block output. Must be ``resid`` for ``"embed"``.

    Returns:
        (B, N, C) tokens, prefix tokens included (Swin's (B, H, W, C) and 3-D Swin's (B, D, H, W, C)
        flattened); for ``mlp_hidden`` C is the MLP hidden width.

    Raises:
        ValueError: an input the model cannot take (3-D models: a 2-D image, a volume size they cannot
            tile), an unknown site or block.
    """
    model = unwrap_model(model)
    site = _valid_sites(site)[0]
    get_adapter(model).check_input(model, x)
    with ExitStack() as stack:
        if block == "embed":
            if site != "resid":
                raise ValueError(f"forward_until(block='embed') has only the site 'resid', got {site!r}")
            stack.callback(all_blocks(model)[0].module.register_forward_pre_hook(_raise_input).remove)
        elif site == "resid":  # a plain hook keeps the library forward (fastest)
            stack.callback(select_blocks(model, block)[0].module.register_forward_hook(_raise_output).remove)
        else:
            module = select_blocks(model, block)[0].module
            adapter = get_adapter(model)
            if site == "mlp_hidden":
                hook = adapter.mlp_activation(module).register_forward_hook(_raise_output)
                stack.callback(hook.remove)
            else:
                taps = patch_block(module, adapter).taps.setdefault(site, [])
                stack.callback(release_block, module)
                taps.append(_raise_stream)
                stack.callback(taps.remove, _raise_stream)
        try:
            model(x)
        except _StopForward as stop:
            return _as_tokens(stop.stream)
    raise RuntimeError(f"block {block!r} (site {site!r}) never ran in the forward of {type(model).__name__}")


def _raise_stream(tensor: Tensor) -> None:
    raise _StopForward(tensor)
