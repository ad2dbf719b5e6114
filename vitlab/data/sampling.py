"""Training order and augmentations as a function of (seed, epoch, sample index), whatever the loader workers.

A ``DataLoader`` hands each sample to whichever worker is free, and albumentations draws from the generator
of the process it runs in: with per-worker generators the augmentation a sample gets depends on the number of
workers and on timing. Here the sampler yields ``(index, epoch)`` and :class:`KeyedAugmentation` seeds the
transform from ``(seed, epoch, index)`` before each sample, so 0, 1 or 8 workers give the same batches, and a
run resumed at epoch k shuffles and augments epoch k as an uninterrupted run does.

Because an epoch's batches are a function of its number, the next epoch's can be made before the training loop
asks for them: :class:`EpochLoader` lets its persistent workers start on epoch k + 1 as soon as epoch k's last
training batch is taken, while the training process validates, runs the epoch-end callbacks and checkpoints.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


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


class EpochLoader(DataLoader):
    """A ``DataLoader`` whose persistent workers can begin an epoch's batches before the training loop asks for them.

    With persistent workers, a ``DataLoader`` starts an epoch's batches when it is iterated, at the start of the
    epoch: the first training step of every epoch then waits for a worker to make a whole batch (on a GPU, a batch of
    64 augmented 224 px images is about 0.2 s of one worker's time, and a volume patch batch can be seconds), while
    the workers sat idle through the previous epoch's validation, epoch-end callbacks and checkpoint.
    :meth:`start_epoch` sets the epoch on the loader's samplers, as the training loop will, and restarts the
    workers on it at once (``vitlab.callbacks.RuntimeCallback`` calls it after an epoch's last training batch); the
    next iteration of the loader then hands over that running iterator instead of starting another. The batches
    are the ones the loader would have made: the order is the sampler's for that epoch and each sample's
    augmentation is keyed on (seed, epoch, index); restarting the workers draws from no random stream of the
    training process. Nothing changes without persistent workers, when a sampler's order is not a function of its
    epoch (no ``set_epoch``) or when the epoch was cut short with batches still being made: those loaders start at
    iteration, as a ``DataLoader`` does.
    """

    _ahead: int | None = None  # the epoch the workers were restarted on by start_epoch, until the next iteration

    def _samplers(self) -> list:
        """The sampler and the batch sampler's sampler (once each): the objects the training loop sets the epoch on."""
        found = {}
        for sampler in (getattr(self, "sampler", None), getattr(getattr(self, "batch_sampler", None), "sampler", None)):
            if sampler is not None:
                found[id(sampler)] = sampler
        return list(found.values())

    def start_epoch(self, epoch: int) -> bool:
        """Restart the persistent workers on ``epoch`` now; returns whether they were (see the class docstring)."""
        samplers = self._samplers()
        if (self._ahead is not None or not self.persistent_workers or self.num_workers == 0 or self._iterator is None
                or not samplers or not all(callable(getattr(s, "set_epoch", None)) for s in samplers)
                # batches still being made (an epoch cut short, ``limit_train_batches``): restarting now would wait
                # for them, which the restart at the epoch's start does not (they are made by then)
                or getattr(self._iterator, "_tasks_outstanding", 1)):
            return False
        for sampler in samplers:
            sampler.set_epoch(epoch)
        self._iterator._reset(self)  # what a persistent loader's next iteration does: the workers resume on the epoch
        self._ahead = epoch
        return True

    def __iter__(self):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._iterator is not None and all(
                getattr(s, "epoch", None) == ahead for s in self._samplers()):
            return self._iterator  # already running on this epoch
        return super().__iter__()
