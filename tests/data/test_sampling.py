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
