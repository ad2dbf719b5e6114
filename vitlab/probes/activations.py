"""What the activation probes (mi, stats, attention, features) share: batched recording and block options.

Not a subcommand: the recording loop (capture, optionally attention, one batch at a time with a progress
bar, so memory holds one batch of sub-layer outputs and the caller keeps only what it reduces them to),
the ``--blocks`` / ``--batch-size`` options and the one-line errors for models without attention.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from vitlab import models
from vitlab.models import AttentionRecord, BlockView, Capture
from vitlab.probes.common import progress

SITE_ALIASES = {"token_mixing": "attn"}  # MLP-Mixer's name for the token-mixing branch
SITE_CHOICES = (*models.CAPTURE_SITES, *SITE_ALIASES)


def canonical_sites(names: Iterable[str]) -> list[str]:
    """Capture-site names with aliases resolved and duplicates dropped (``token_mixing`` -> ``attn``)."""
    return list(dict.fromkeys(SITE_ALIASES.get(name, name) for name in names))


def add_recording_arguments(parser: argparse.ArgumentParser, batch_size: int = 32) -> argparse._ArgumentGroup:
    """``--blocks`` and ``--batch-size`` in a "recording" group (returned for subcommand-specific options)."""
    group = parser.add_argument_group("recording")
    group.add_argument("--blocks", nargs="+", default=None, metavar="BLOCK", help="blocks to probe: global indices or names such as stage2.block5 (default: all)")
    group.add_argument("--batch-size", type=int, default=batch_size, help=f"images per forward pass (default {batch_size})")
    return group


def selected_blocks(model: nn.Module, refs: list[str] | None) -> list[BlockView]:
    """The blocks named by ``--blocks`` (all when None); a bad reference raises one line listing the valid ones."""
    try:
        return models.select_blocks(model, refs)
    except ValueError as err:
        raise ValueError(f"--blocks: {err}") from None


def require_attention(model: nn.Module, subcommand: str) -> None:
    """One clear line when the model has no attention (MLP-Mixer): name the families that have it."""
    if not all(view.has_attention for view in models.blocks(model)):
        families = ", ".join(f for f in models.supported_families() if "mixer" not in f)
        raise ValueError(
            f"probe.py {subcommand}: {models.family_name(model)} has no attention (token mixing is an MLP); "
            f"use a model of the families {families}, or probe.py mi/stats/features (site token_mixing)"
        )


@dataclass
class Recorded:
    """One batch of recordings: sub-layer outputs and, when asked for, attention probabilities."""

    start: int  # index of the batch's first image
    capture: Capture
    attention: AttentionRecord | None


def record_batches(
    model: nn.Module,
    inputs: torch.Tensor | Iterable[torch.Tensor],
    sites: Iterable[str],
    blocks: list[BlockView],
    batch_size: int,
    device: torch.device,
    desc: str,
    dtype: torch.dtype | None = None,
    attention: bool = False,
    channels: dict[tuple[str, str], torch.Tensor] | None = None,
    total: int | None = None,
    autocast: torch.dtype | None = None,
) -> Iterator[Recorded]:
    """Run the model over ``inputs`` a batch at a time and yield what was recorded for each batch.

    Args:
        model: The model (eval mode, on ``device``).
        inputs: (N, C, H, W) normalised images (CPU), or an iterable of such batches (streamed: e.g.
            :meth:`vitlab.probes.streams.ImageStream.batches`, so that the N images are never all in memory).
        sites: :data:`vitlab.models.CAPTURE_SITES` names to capture.
        blocks: The blocks to record.
        batch_size: Images per forward pass (a tensor ``inputs`` is cut into such batches).
        device: Where the model runs.
        desc: Progress-bar label.
        dtype: Storage dtype of the captured outputs (e.g. ``torch.float16``); None keeps the model's.
        attention: Also record post-softmax attention (models with attention only).
        channels: ``{(block, site): channel ids}`` to keep of those outputs (see :func:`vitlab.models.capture`).
        total: Number of images of streamed ``inputs`` (for the progress bar).
        autocast: Run the forward under ``torch.autocast`` in this dtype (e.g. ``torch.bfloat16``: matrix
            products in bf16 with fp32 accumulation, normalisations and the residual stream in fp32); None: as is.

    Yields:
        :class:`Recorded` per batch; captured tensors are on the CPU.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    names = [view.name for view in blocks]
    if isinstance(inputs, torch.Tensor):
        total = inputs.shape[0]
        batches: Iterable[torch.Tensor] = (inputs[start : start + batch_size] for start in range(0, total, batch_size))
    else:
        batches = inputs
    start = 0
    for batch in progress(batches, desc, total=-(-total // batch_size) if total else None):
        x = batch.to(device)  # (b, C, H, W)
        with ExitStack() as stack, torch.no_grad():
            if autocast is not None:
                stack.enter_context(torch.autocast(torch.device(device).type, dtype=autocast))
            rec = stack.enter_context(models.record_attention(model, names, to_cpu=True)) if attention else None
            cap = stack.enter_context(models.capture(model, list(sites), names, to_cpu=True, dtype=dtype, channels=channels))
            model(x)
        yield Recorded(start, cap, rec)
        start += x.shape[0]


def block_label(view: BlockView) -> str:
    """``stage0.block3 (#3)``: the name plus the global index, for figure titles."""
    return f"{view.name} (#{view.global_index})"
