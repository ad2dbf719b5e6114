"""vitlab.data.transforms: OpenCV (albumentations' backend) on one thread in every process that loads data, set in
one place (``single_opencv_thread``): the process that makes a loader, and each loader worker as it starts. vitlab's
Normalize gives albumentations' values bit for bit, and a gray image augmented once and then repeated to three
channels gives what augmenting the repeated image gave, for every pipeline that does so."""

from __future__ import annotations

import random

import albumentations as A
import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import DenseDataModule, MedicalDataModule
from vitlab.data.datasets.images import integer_downscale
from vitlab.data.transforms import (
    AUGMENT_RECIPES,
    Normalize,
    eval_transform,
    repeats_channels,
    seed_worker,
    train_transform,
)


class _CV2Threads(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return cv2.getNumThreads()


@pytest.fixture
def opencv_threads():
    """OpenCV's thread count as it was, put back after the test."""
    before = cv2.getNumThreads()
    yield
    cv2.setNumThreads(before)


def test_loader_workers_run_opencv_on_one_thread(opencv_threads):
    cv2.setNumThreads(3)  # what a forked worker inherits
    loader = torch.utils.data.DataLoader(_CV2Threads(), batch_size=1, num_workers=1, worker_init_fn=seed_worker)
    assert [int(b) for b in loader] == [1, 1]
    control = torch.utils.data.DataLoader(_CV2Threads(), batch_size=1, num_workers=1)
    assert [int(b) for b in control] == [3, 3]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_process_making_a_loader_runs_opencv_on_one_thread(tmp_path, opencv_threads, workers):
    """The training process augments the batches itself without workers, and forks them with: one thread either way."""
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(tmp_path / label / f"{i}.png")
    dm = MedicalDataModule(root=str(tmp_path), image_size=16, batch_size=2, val_fraction=0.0, num_workers=workers)
    cv2.setNumThreads(3)
    dm.train_dataloader()
    assert cv2.getNumThreads() == 1


# ------------------------------------------------------------------------------------ Normalize, gray images repeated
def _albumentations_normalize(mean, std) -> A.Normalize:
    return A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=1.0)


@pytest.mark.parametrize("channels", [1, 3, 5])
def test_normalize_gives_albumentations_values_bit_for_bit(channels):
    rng = np.random.default_rng(channels)
    for trial in range(20):
        mean = rng.uniform(-1, 2, channels).tolist()
        std = rng.uniform(1e-4 if trial % 4 == 0 else 0.05, 3, channels).tolist()
        image = rng.uniform(-0.5, 1.5, (int(rng.integers(1, 40)), int(rng.integers(1, 40)), channels)).astype(np.float32)
        if trial % 5 == 0:  # non-finite input stays where it was
            image[0, 0, 0], image[-1, -1, -1] = np.nan, np.inf
        expected = _albumentations_normalize(mean, std)(image=image.copy())["image"]
        got = Normalize(mean, std)(image=image.copy())["image"]
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        if channels > 1:  # a gray image repeated by Normalize itself
            gray = image[:, :, :1].copy()
            expected = _albumentations_normalize(mean, std)(image=np.repeat(gray, channels, axis=2))["image"]
            np.testing.assert_array_equal(Normalize(mean, std, repeat_gray=True)(image=gray)["image"], expected)


def _gray_images(rng, size: int) -> list[np.ndarray]:
    """Gray float32 images in [0, 1] with structure for the warps to move (and flat ones), of shapes around and at
    multiples of ``size`` (the prescale's 2 x 2 block average among them)."""
    images = []
    for height, width in ((2 * size, 2 * size), (3 * size, 3 * size), (2 * size + 1, 4 * size), (size, size),
                          (size + 5, 2 * size - 3), (17, 23)):
        yy, xx = np.mgrid[0:height, 0:width]
        smooth = 0.5 + 0.4 * np.sin(xx / rng.uniform(2, 9)) * np.cos(yy / rng.uniform(2, 9))
        images.append(np.clip(smooth + rng.normal(0, 0.1, (height, width)), 0, 1).astype(np.float32))
    images += [np.zeros((30, 30), np.float32), np.full((30, 30), 0.3, np.float32)]
    return images


@pytest.mark.parametrize("recipe", [*AUGMENT_RECIPES, "eval"])
def test_a_gray_image_augmented_once_then_repeated_is_the_repeated_images_augmentation(recipe):
    """Every pipeline repeats a gray image's channels itself (in Normalize after every other transform, or before the
    first that draws per channel) and gives, for every seed, what albumentations gives for the repeated image, both
    prescaled as the datasets prescale them."""
    rng = np.random.default_rng(0)
    mean, std = rng.uniform(0.3, 0.6, 3).tolist(), rng.uniform(0.2, 0.3, 3).tolist()
    for size in (32, 48):
        steps = (lambda: [A.Resize(size, size, area_for_downscale="image")]) if recipe == "eval" else (
            lambda: AUGMENT_RECIPES[recipe](size))
        pipeline = eval_transform(size, mean, std) if recipe == "eval" else train_transform(size, mean, std, augment=recipe)
        reference = A.Compose([*steps(), _albumentations_normalize(mean, std)], seed=0)
        assert repeats_channels(pipeline)
        if recipe == "strong":  # its GaussNoise draws a noise field per channel: repeated just before it
            names = [type(t).__name__ for t in pipeline.transforms]
            assert names.index("RepeatChannels") + 1 == names.index("GaussNoise") and not pipeline.transforms[-1].repeat_gray
        for seed, image in enumerate(_gray_images(rng, size) * 6):
            repeated = integer_downscale(np.repeat(image[:, :, None], 3, axis=2), size)
            given = integer_downscale(image[:, :, None], size, 3) if repeats_channels(pipeline) else repeated
            results = []
            for transform, start in ((pipeline, given), (reference, repeated)):
                transform.set_random_state(np.random.default_rng(seed), random.Random(seed))
                results.append(transform(image=start.copy())["image"])
            assert results[0].shape == (size, size, 3)
            np.testing.assert_array_equal(results[0], results[1], err_msg=f"{recipe}, seed {seed}, {image.shape}, OpenCV "
                                          f"{cv2.__version__} (constraints.txt pins the version these paths agree on)")


def test_the_pipelines_survive_albumentations_serialisation():
    rng = np.random.default_rng(1)
    image = rng.random((40, 40, 1), dtype=np.float32)
    for pipeline in (train_transform(32, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3), augment="strong", seed=3),
                     eval_transform(32, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))):
        again = A.from_dict(A.to_dict(pipeline))
        assert [type(t) for t in again.transforms] == [type(t) for t in pipeline.transforms] and repeats_channels(again)
        outputs = []
        for transform in (pipeline, again):
            transform.set_random_state(np.random.default_rng(5), random.Random(5))
            outputs.append(transform(image=image.copy())["image"])
        np.testing.assert_array_equal(*outputs)


def _reference_transform(recipe: str | None, size: int, mean, std) -> A.Compose:
    steps = [A.Resize(size, size, area_for_downscale="image")] if recipe is None else AUGMENT_RECIPES[recipe](size)
    return A.Compose([*steps, _albumentations_normalize(mean, std)], seed=0)


@pytest.mark.parametrize("kind,recipe", [("classification", "default"), ("classification", "strong"),
                                         ("segmentation", "default")])
def test_datasets_hand_gray_images_with_one_channel_and_make_the_same_samples(tmp_path, tiny_dataset, kind, recipe):
    """A three-channel model's samples of gray images: the datasets give the pipeline the one-channel image (kept so
    in the memory cache too) and make, for every seed, the samples of the gray image repeated first and normalised by
    albumentations."""
    size = 16 if kind == "classification" else 24  # either way the prescale halves the images (32 and 48 px)
    if kind == "classification":
        dm = MedicalDataModule(root=str(tiny_dataset), image_size=size, in_chans=3, augment=recipe, val_fraction=0.25,
                               num_workers=0)
    else:
        from tests.helpers.data import planted, write_manifest

        rows = []
        for i in range(8):
            sample = planted(tmp_path, f"i{i}", [(4 + i, 6, 8), (28, 20 + i, 10)] if i % 2 else [(30, 4, 6)])
            rows.append((sample.path.name, "lesion" if i % 2 else "none", f"P{i // 2}", sample.mask.name))
        manifest = write_manifest(tmp_path / "m.csv", rows)
        dm = DenseDataModule(root=str(manifest), image_size=size, in_chans=3, augment="default", val_fraction=0.25,
                             num_workers=0)
    dm.setup("fit")
    for split, augmented in (("train", True), ("val", False)):
        dataset = dm.dataset(split, augmented=augmented)
        assert dataset.keep_gray
        new = [_sample(dataset, i, seed) for seed in range(3) for i in range(len(dataset))]
        if kind == "classification" and augmented:  # the images kept before augmentation have one channel
            kept = [v[0] for v in dataset.memory._items.values() if isinstance(v[0], np.ndarray)]
            assert kept and all(image.shape[2] == 1 for image in kept), [image.shape for image in kept]
        # the earlier path: the image repeated as it is decoded (prescaled and augmented with three channels),
        # albumentations' Normalize
        dataset.transform = _reference_transform(recipe if augmented else None, size, dm.mean, dm.std)
        dataset.memory = None  # (validation keeps finished samples)
        if kind == "classification":
            decode = dataset.load_array
            dataset.load_array = lambda index: np.repeat(np.atleast_3d(decode(index)), 3, axis=2)
        assert not dataset.keep_gray
        old = [_sample(dataset, i, seed) for seed in range(3) for i in range(len(dataset))]
        for (a_image, a_target), (b_image, b_target) in zip(new, old, strict=True):
            assert a_image.shape == (3, size, size) and torch.equal(a_image, b_image)
            if isinstance(a_target, dict):
                assert a_target.keys() == b_target.keys()
                assert all(torch.equal(a_target[k], b_target[k]) for k in a_target)
            else:
                assert a_target == b_target


def _sample(dataset, index: int, seed: int):
    dataset.set_random_state(np.random.default_rng(seed), random.Random(seed))
    return dataset[index]


def test_a_dataset_without_the_prescale_repeats_gray_images_itself(tiny_dataset):
    """Without the prescale an image of twice the output size reaches the pipeline's resize, whose 2 x 2 block average
    rounds one channel otherwise than three: such a dataset repeats a gray image before the pipeline, as before."""
    from vitlab.data.datasets.images import MedicalImageDataset

    dm = MedicalDataModule(root=str(tiny_dataset), image_size=16, in_chans=3, val_fraction=0.25, num_workers=0)
    dm.setup("fit")
    samples = dm.samples("val")
    for prescale, kept_gray in ((16, True), (None, False)):
        dataset = MedicalImageDataset(samples, dm.class_names, eval_transform(16, dm.mean, dm.std), in_chans=3,
                                      prescale_to=prescale)
        assert dataset.keep_gray is kept_gray
        reference = MedicalImageDataset(samples, dm.class_names, _reference_transform(None, 16, dm.mean, dm.std),
                                        in_chans=3, prescale_to=prescale)
        for i in range(len(samples)):  # 32 px images: without the prescale the resize halves them
            assert torch.equal(dataset[i][0], reference[i][0])
