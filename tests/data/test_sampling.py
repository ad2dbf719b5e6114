"""vitlab.data.sampling: the training order's epoch comes from Lightning's own hook (``set_epoch``, called before
every training epoch, through its distributed wrapper too), or is counted by the sampler outside a trainer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning_fabric.utilities.data import _set_sampler_epoch
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from PIL import Image

from vitlab.data import MedicalDataModule
from vitlab.data.sampling import EpochSampler


def orders(sampler, times: int) -> list[list[tuple[int, int]]]:
    return [list(sampler) for _ in range(times)]


@pytest.mark.parametrize("seed", [0, 7])
def test_set_epoch_gives_the_order_an_uncounted_sampler_reaches_at_that_epoch(seed):
    groups = [g for g in range(5) for _ in range(2 + g % 3)]
    counted = orders(EpochSampler(len(groups), seed, groups=groups, block=2), 4)  # epochs 0, 1, 2, 3
    assert [{e for _, e in order} for order in counted] == [{0}, {1}, {2}, {3}]
    told = EpochSampler(len(groups), seed, groups=groups, block=2)
    for epoch in (2, 0, 3):
        told.set_epoch(epoch)
        assert orders(told, 2) == [counted[epoch]] * 2  # (the epoch holds until set again)
    assert len({tuple(i for i, _ in order) for order in counted}) == 4


def test_lightning_sets_the_epoch_of_a_data_modules_training_loader(tmp_path):
    """The hook Lightning's fit loop calls on every training loader (``_set_sampler_epoch``), on the loader as it
    is and wrapped for distributed training as Lightning wraps it: the sampler loads that epoch (pinned here, so
    that a Lightning upgrade that stops calling it fails loudly)."""
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(tmp_path / label / f"{i}.png")
    dm = MedicalDataModule(root=str(tmp_path), image_size=16, batch_size=2, augment="strong", val_fraction=0.0)
    loader = dm.train_dataloader()
    counted = [[images for images, _ in loader] for _ in range(3)]  # epochs 0, 1, 2
    _set_sampler_epoch(loader, 2)
    assert loader.sampler.epoch == 2
    assert all(torch.equal(a, b) for a, b in zip([images for images, _ in loader], counted[2], strict=True))
    wrapped = DistributedSamplerWrapper(loader.sampler, num_replicas=1, rank=0, shuffle=False)
    wrapped.set_epoch(1)
    assert loader.sampler.epoch == 1 and [e for _, e in wrapped] == [1] * 6


class _Keyed(torch.utils.data.Dataset):
    """A sample per (index, epoch), drawn from a generator keyed on both (as KeyedAugmentation seeds its
    transforms): a batch shows which epoch and which samples it came from."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, item):
        index, epoch = item
        return torch.rand(3, generator=torch.Generator().manual_seed(1000 * epoch + index)), index


def _epoch_loader(workers: int = 2, persistent: bool = True):
    from vitlab.data.sampling import EpochLoader

    return EpochLoader(_Keyed(), batch_size=4, sampler=EpochSampler(12, seed=3), num_workers=workers,
                       persistent_workers=persistent, generator=torch.Generator().manual_seed(0))


def _batches(loader):
    return [(x.clone(), i.clone()) for x, i in loader]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(i, j) for (x, i), (y, j) in zip(a, b))


def test_an_epoch_loader_started_early_hands_over_the_batches_that_epoch_would_load():
    """After epoch 0's last batch, ``start_epoch(1)`` restarts the persistent workers on epoch 1; the training
    loop's own ``set_epoch(1)`` and iteration then get that running iterator (not restarted again) and exactly the
    batches a loader never started early loads. The batches are the keyed ones: a batch of epoch 0 would differ."""
    early, plain = _epoch_loader(), _epoch_loader()
    for loader in (early, plain):
        _set_sampler_epoch(loader, 0)
        first = _batches(loader)
    assert early.start_epoch(1) is True
    running = early._iterator
    assert early.start_epoch(1) is False  # (once until it is iterated)
    resets = []
    original = type(running)._reset
    try:
        type(running)._reset = lambda self, *a, **k: resets.append(1) or original(self, *a, **k)
        for loader in (early, plain):
            _set_sampler_epoch(loader, 1)  # what Lightning's fit loop does at the epoch's start
        handed = iter(early)
        assert handed is running
        second = _batches(handed)  # (the handed-over iterator's batches, not restarted)
        assert resets == []
    finally:
        type(running)._reset = original
    expected = _batches(plain)
    assert _same(second, expected) and not _same(second, first)
    # the epoch after, not started early: an ordinary iteration
    for loader in (early, plain):
        _set_sampler_epoch(loader, 2)
    assert _same(_batches(early), _batches(plain))


def test_an_epoch_loader_started_on_another_epoch_than_the_loop_sets_loads_the_loops():
    early, plain = _epoch_loader(workers=1), _epoch_loader(workers=1)
    for loader in (early, plain):
        _batches(loader)
    assert early.start_epoch(5)
    for loader in (early, plain):
        _set_sampler_epoch(loader, 1)
    assert _same(_batches(early), _batches(plain))


@pytest.mark.parametrize("workers, persistent", [(0, False), (1, False)])
def test_an_epoch_loader_without_persistent_workers_starts_at_iteration(workers, persistent):
    loader = _epoch_loader(workers, persistent)
    _batches(loader)
    assert loader.start_epoch(1) is False


def test_an_epoch_loader_cut_short_with_batches_in_the_making_starts_at_iteration():
    """An epoch cut short (``limit_train_batches``) leaves batches in the workers: restarting them then would wait
    for those, so the loader starts at the next iteration instead."""
    loader, plain = _epoch_loader(workers=2), _epoch_loader(workers=2)
    for each in (loader, plain):
        next(iter(each))  # one batch of three; the workers have the others in hand
    assert loader.start_epoch(1) is False
    for each in (loader, plain):
        _set_sampler_epoch(each, 1)
    assert _same(_batches(loader), _batches(plain))


def test_an_epoch_loader_remade_for_distributed_training_starts_early_too():
    """Lightning remakes a training loader around its distributed sampler (same class, same arguments): the remade
    loader is an EpochLoader whose early start loads what the loop's own start of that epoch would."""
    from pytorch_lightning.utilities.data import _update_dataloader

    from vitlab.data.sampling import EpochLoader

    remade = []
    for _ in range(2):
        loader = _epoch_loader(workers=1)
        remade.append(_update_dataloader(loader, DistributedSamplerWrapper(loader.sampler, num_replicas=1, rank=0, shuffle=False)))
    early, plain = remade
    assert type(early) is EpochLoader and isinstance(early.sampler, DistributedSamplerWrapper)
    for loader in (early, plain):
        _set_sampler_epoch(loader, 0)
        _batches(loader)
    assert early.start_epoch(1) and early.sampler.epoch == 1
    running = early._iterator
    for loader in (early, plain):
        _set_sampler_epoch(loader, 1)
    handed = iter(early)
    assert handed is running
    assert _same(_batches(handed), _batches(plain))
