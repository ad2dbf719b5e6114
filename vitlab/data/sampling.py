"""Training order and augmentations as a function of (seed, epoch, sample index), whatever the loader workers.

A ``DataLoader`` hands each sample to whichever worker is free, and albumentations draws from the generator
of the process it runs in: with per-worker generators the augmentation a sample gets depends on the number of
workers and on timing. Here the sampler yields ``(index, epoch)`` and :class:`KeyedAugmentation` seeds the
transform from ``(seed, epoch, index)`` before each sample, so 0, 1 or 8 workers give the same batches, and a
run resumed at epoch k shuffles and augments epoch k as an uninterrupted run does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


def mixed_seed(*keys: int) -> int:
    """A 32-bit seed from non-negative integer keys, e.g. (seed, epoch, index) for one sample's augmentation in
    one epoch (NumPy's ``SeedSequence`` mixes them: nearby keys give unrelated seeds)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


class EpochSampler(Sampler):
    """Yields ``(index, epoch)`` for every sample of an epoch: shuffled by a generator seeded with (seed, epoch).

    The epoch is the one :meth:`set_epoch` gave last: Lightning calls it at the start of every training epoch (as it
    does for torch's ``DistributedSampler``, through its distributed wrapper too), so a run resumed at epoch k loads
    epoch k as the uninterrupted run did. A loader iterated without it (outside a trainer) counts its own epochs
    0, 1, 2, ...

    Args:
        size: Number of samples.
        seed: The data seed.
        shuffle: A new order each epoch; else 0..size-1.
        groups: With ``block``: the group (volume) of each sample. The groups are shuffled and visited ``block`` at
            a time, the samples of a block shuffled together, so a loader process that keeps ``block`` groups in
            memory reads each group once per epoch (slices and slabs of volumes, see :mod:`vitlab.data.datasets.slices`).
        block: Groups per block (0: no blocks, one shuffle over all samples).
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True, groups: Sequence[object] | None = None,
                 block: int = 0) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch: int | None = None  # (set_epoch's)
        self._iterations = 0
        self.members: list[list[int]] | None = None
        if groups is not None and block:
            if len(groups) != size:
                raise ValueError(f"groups has {len(groups)} entries for {size} samples")
            first: dict[object, list[int]] = {}
            for index, group in enumerate(groups):
                first.setdefault(group, []).append(index)
            self.members, self.block = list(first.values()), block

    def __len__(self) -> int:
        return self.size

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iterations load (Lightning's hook, called before every training epoch)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch if self.epoch is not None else self._iterations
        self._iterations += 1
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, epoch))
        if self.shuffle and self.members is not None:
            groups = [self.members[g] for g in torch.randperm(len(self.members), generator=generator).tolist()]
            order = []
            for start in range(0, len(groups), self.block):
                block = [index for group in groups[start : start + self.block] for index in group]
                order += [block[i] for i in torch.randperm(len(block), generator=generator).tolist()]
        elif self.shuffle:
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = range(self.size)
        return iter([(index, epoch) for index in order])


class KeyedAugmentation(Dataset):
    """``dataset[index]`` with ``dataset.transform`` (an albumentations ``Compose``) and any draws of the dataset's own
    (``dataset.set_random_state``, e.g. volume patches) from one generator seeded with (seed, epoch, index).

    One generator shared by every transform of the pipeline (``Compose.set_random_state``), not
    ``Compose.set_random_seed``: that gives each transform its own generator with the same seed, so transforms
    with the same probability fire together (a horizontal flip always with a vertical one); it also builds two
    generators per transform and sample.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        index, epoch = item
        seed = mixed_seed(self.seed, epoch, index)
        rng, py_rng = np.random.default_rng(seed), random.Random(seed)
        if hasattr(self.dataset, "set_random_state"):
            self.dataset.set_random_state(rng, py_rng)
        else:
            self.dataset.transform.set_random_state(rng, py_rng)
        return self.dataset[index]
