"""Batches normalised where they arrive (beside a GPU, by the data module's hook after the transfer) hold the values
the loaders' own Normalize gives, bit for bit, for every recipe, one or three channels, classification and dense
batches; a gray image for a model of three channels travels with one channel."""

from __future__ import annotations

import zlib

import albumentations as A
import numpy as np
import pytest
import torch

from vitlab.data import DenseDataModule, MedicalDataModule
from vitlab.data.transforms import (Normalize, deferred_normalize, defers_normalize, eval_transform, normalize_images,
                                    train_transform)


def _batches(dm, split: str, epoch: int = 0) -> list:
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    if split == "train":
        loader.sampler.set_epoch(epoch)
    return list(loader)


def _stats(rng: np.random.Generator, channels: int) -> tuple[list[float], list[float]]:
    """Random per-channel means and stds (not ImageNet's: every channel its own)."""
    return rng.uniform(0.2, 0.7, channels).tolist(), rng.uniform(0.1, 0.4, channels).tolist()


@pytest.mark.parametrize("augment", ["none", "light", "default", "strong"])
@pytest.mark.parametrize("in_chans", [1, 3])
def test_classification_batches_normalised_on_the_device_equal_the_loaders(tiny_dataset, augment, in_chans):
    rng = np.random.default_rng(zlib.crc32(f"{augment}-{in_chans}".encode()))  # (random, the same every run)
    mean, std = _stats(rng, in_chans)
    kwargs = dict(root=str(tiny_dataset), image_size=32, batch_size=5, num_workers=0, augment=augment, val_fraction=0.25,
                  in_chans=in_chans, mean=mean, std=std, seed=int(rng.integers(1000)))
    here, there = MedicalDataModule(**kwargs), MedicalDataModule(**kwargs)
    there.normalize_on_device = True
    for split in ("train", "val"):
        for epoch in (0, 1):
            expected, raw = _batches(here, split, epoch), _batches(there, split, epoch)
            assert len(expected) == len(raw) > 0
            for (x, y), batch in zip(expected, raw):
                # the gray slices travel with one channel unless a transform draws per channel before Normalize
                travels = 3 if in_chans == 3 and augment == "strong" and split == "train" else 1
                assert batch[0].shape[1] == travels and batch[0].min() >= 0 and batch[0].max() <= 1
                images, labels = there.on_after_batch_transfer(batch, 0)
                assert images.shape == x.shape and torch.equal(images, x) and torch.equal(labels, y)
    assert here.on_after_batch_transfer(expected[0], 0) is expected[0]  # normalised by the loaders: left as it is


@pytest.mark.parametrize("in_chans", [1, 3])
def test_dense_batches_normalised_on_the_device_equal_the_loaders(in_chans):
    rng = np.random.default_rng(in_chans)
    mean, std = _stats(rng, in_chans)
    kwargs = dict(root=None, embedded_kwargs={"patients": 4, "slices": 2, "size": 32, "difficulty": 0.0}, image_size=32,
                  batch_size=3, augment="default", val_fraction=0.34, in_chans=in_chans, mean=mean, std=std)
    here, there = DenseDataModule(**kwargs), DenseDataModule(**kwargs)
    there.normalize_on_device = True
    for split in ("train", "val"):
        for (x, targets), batch in zip(_batches(here, split), _batches(there, split), strict=True):
            assert batch[0].shape[1] == 1
            images, moved = there.on_after_batch_transfer(batch, 0)
            assert torch.equal(images, x)
            assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(targets, moved))


def test_a_colour_image_is_normalised_per_channel_as_on_the_host():
    """An RGB image (no repetition) through the default recipe: the same values, channel by channel."""
    rng = np.random.default_rng(7)
    mean, std = _stats(rng, 3)
    pipeline = train_transform(24, mean, std, augment="default", seed=3)
    deferred, mean_np, denominator = deferred_normalize(pipeline)
    image = rng.random((40, 36, 3), dtype=np.float32)
    pipeline.set_random_seed(11)
    deferred.set_random_seed(11)
    expected = torch.from_numpy(pipeline(image=image)["image"].transpose(2, 0, 1).copy())[None]
    raw = torch.from_numpy(deferred(image=image)["image"].transpose(2, 0, 1).copy())[None]
    out = normalize_images(raw, torch.from_numpy(mean_np), torch.from_numpy(denominator))
    assert torch.equal(out, expected)


def test_deferred_normalize_copies_the_pipeline_and_leaves_others_alone():
    pipeline = eval_transform(16, [0.5, 0.4, 0.3], [0.2, 0.25, 0.3])
    deferred, mean, denominator = deferred_normalize(pipeline)
    assert defers_normalize(deferred) and not defers_normalize(pipeline)  # the original is unchanged
    assert mean.dtype == denominator.dtype == np.float32 and np.array_equal(denominator, np.reciprocal(np.float32([0.2, 0.25, 0.3])))
    assert deferred_normalize(deferred) is None  # (already deferred)
    assert deferred_normalize(A.Compose([A.HorizontalFlip(p=0.5)])) is None  # no vitlab Normalize last
    assert deferred_normalize(A.Compose([Normalize([0.5], [0.2], p=0.5)])) is None  # not every image normalised
    gray = np.random.default_rng(0).random((16, 16, 1), dtype=np.float32)
    assert np.array_equal(deferred(image=gray)["image"], gray)  # handed on as it is: one channel, float32


def test_normalize_images_rejects_a_batch_it_cannot_normalise():
    mean, denominator = torch.zeros(3), torch.ones(3)
    for bad in (torch.zeros(2, 2, 4, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, 4, dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"normalize_images: need float32 images \(B, 1 or 3, H, W\), got"):
            normalize_images(bad, mean, denominator)


def test_a_validation_tensor_kept_in_memory_is_kept_apart_from_the_normalised_one(tiny_dataset):
    """One memory cache, the finished validation tensors of both kinds: each dataset gets its own back."""
    dm = MedicalDataModule(root=str(tiny_dataset), image_size=32, batch_size=4, augment="none", val_fraction=0.25, in_chans=3)
    normalised = dm.dataset("val")
    raw = dm.dataset("val")
    raw.transform = deferred_normalize(raw.transform)[0]
    for _ in range(2):  # the second pass from the memory cache
        assert normalised[0][0].shape[0] == 3 and raw[0][0].shape[0] == 1
        assert raw[0][0].min() >= 0 and normalised[0][0].min() < 0


@pytest.mark.parametrize("mean, std, message", [
    ([0.5], [0.0], r"std must be positive and at least 1e-37 \(its float32 reciprocal finite\), got \[0.0\]"),
    ([0.5], [-0.2], r"std must be positive and at least 1e-37 \(its float32 reciprocal finite\), got \[-0.2\]"),
    ([0.5], [1e-45], r"std must be positive and at least 1e-37 \(its float32 reciprocal finite\), got \[1e-45\]"),
    ([float("nan")], [0.2], r"mean must be finite, got \[nan\]"),
])
def test_means_and_stds_that_cannot_normalise_are_refused_in_one_line(tiny_dataset, mean, std, message):
    """Normalising on the device checks no sample after it: a std whose reciprocal overflows is refused up front."""
    with pytest.raises(ValueError, match=message):
        MedicalDataModule(root=str(tiny_dataset), image_size=32, mean=mean, std=std)


def test_loaders_made_to_normalise_their_own_batches_are_not_normalised_again(tiny_dataset):
    """A data module used on the GPU and then, in the same process, on the CPU (its flag set back): the later loaders'
    batches come normalised, and the hook leaves them as they are."""
    dm = MedicalDataModule(root=str(tiny_dataset), image_size=32, batch_size=4, augment="none", val_fraction=0.25, in_chans=3)
    dm.normalize_on_device = True
    raw = next(iter(dm.val_dataloader()))
    normalised = dm.on_after_batch_transfer(raw, 0)
    dm.normalize_on_device = False
    batch = next(iter(dm.val_dataloader()))
    assert dm.on_after_batch_transfer(batch, 0) is batch and torch.equal(batch[0], normalised[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_normalised_on_cuda_equal_the_loaders(tiny_dataset):
    """On the GPU itself (Lightning's hook after the transfer): the values the loaders compute on the host."""
    kwargs = dict(root=str(tiny_dataset), image_size=32, batch_size=5, augment="default", val_fraction=0.25, in_chans=3)
    here, there = MedicalDataModule(**kwargs), MedicalDataModule(**kwargs)
    there.normalize_on_device = True
    for (x, y), (raw, labels) in zip(_batches(here, "train"), _batches(there, "train"), strict=True):
        images, _ = there.on_after_batch_transfer([raw.cuda(), labels.cuda()], 0)
        assert images.is_cuda and torch.equal(images.cpu(), x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_label_maps_sent_as_bytes_are_the_label_maps_again():
    """Beside a GPU the workers send a dense batch's label maps as uint8 (``narrow_label_maps``); after the transfer
    Lightning's hook widens them on the GPU: the int64 label maps a loader without workers gives."""
    kwargs = dict(root=None, embedded_kwargs={"patients": 4, "slices": 2, "size": 32, "difficulty": 0.0}, image_size=32,
                  batch_size=3, augment="default", val_fraction=0.34)
    here, there = DenseDataModule(**kwargs, num_workers=0), DenseDataModule(**kwargs, num_workers=1)
    there.narrow_label_maps = True
    for (x, targets), (raw, sent) in zip(_batches(here, "train"), _batches(there, "train"), strict=True):
        assert all(t["mask"].dtype == torch.uint8 for t in sent)
        moved = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in t.items()} for t in sent]
        images, widened = there.on_after_batch_transfer((raw.cuda(), moved), 0)
        assert torch.equal(images.cpu(), x)
        for a, b in zip(targets, widened, strict=True):
            assert b["mask"].is_cuda and b["mask"].dtype == torch.int64 and torch.equal(b["mask"].cpu(), a["mask"])
