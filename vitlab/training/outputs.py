"""Step outputs kept on the device until the epoch ends, so that a training step never waits for the GPU.

A torchmetrics ``update`` on a CUDA tensor synchronises with the device: the argument checks count the distinct
labels (``torch.unique``) and the confusion counts size themselves by the largest label (``bincount``). Called every
step, each update stops the host until the GPU has finished every queued kernel, so the next step's kernels are
launched late and the GPU idles. :class:`EpochOutputs` keeps each step's detached predictions and labels where they
are (no copy, no synchronisation) and hands them to the metrics in one update at the end of the epoch, or in a few
when they grow large. The metrics see the same rows in the same order, so what they compute does not change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Elements held before the outputs are handed over early (one synchronisation per this many, bounding memory).
FLUSH_ELEMENTS = 1 << 24


class EpochOutputs:
    """Per-step tensors of one stage (train / val / test), concatenated along dim 0 when the epoch ends.

    Args:
        consume: Called with the concatenated tensors (e.g. ``lambda probs, labels: metrics.update(probs, labels)``)
            when :meth:`flush` runs, and early once more than ``flush_elements`` elements are held.
        flush_elements: See ``consume``.
        concatenate: False: ``consume`` is called once per step's tensors, in order, when they are handed over (steps
            whose tensors differ in shape beyond dim 0: whole volumes of their own sizes).
    """

    def __init__(self, consume: Callable[..., None], flush_elements: int = FLUSH_ELEMENTS, concatenate: bool = True) -> None:
        self.consume = consume
        self.flush_elements = flush_elements
        self.concatenate = concatenate
        self._parts: list[tuple[torch.Tensor, ...]] = []
        self._elements = 0

    def append(self, *tensors: torch.Tensor) -> None:
        """Keep one step's tensors (detached, on their device)."""
        self._parts.append(tuple(t.detach() for t in tensors))
        self._elements += sum(t.numel() for t in tensors)
        if self._elements > self.flush_elements:
            self.flush()

    def flush(self) -> None:
        """Hand everything held to ``consume`` (nothing when empty) and forget it."""
        parts, self._parts, self._elements = self._parts, [], 0
        if parts and self.concatenate:
            self.consume(*(torch.cat(column) for column in zip(*parts)))
        elif parts:
            for part in parts:
                self.consume(*part)

    def clear(self) -> None:
        """Forget what is held without handing it over (e.g. a sanity check's outputs)."""
        self._parts, self._elements = [], 0

    def __len__(self) -> int:
        return len(self._parts)
