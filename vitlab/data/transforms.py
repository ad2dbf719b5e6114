"""Albumentations pipelines for float32 images in [0, 1].

Every pipeline ends with a resize to ``image_size`` x ``image_size`` and
``Normalize(max_pixel_value=1.0)`` with one mean/std entry per channel, also after a
user-supplied ``Compose``. Albumentations' ``Compose`` keeps its own random generator: the training loader
seeds it for every sample from (seed, epoch, index) (:mod:`vitlab.data.sampling`).

A grayscale image given to a model of three input channels is the gray image repeated three times. The pipelines
repeat it themselves, after the transforms that act on each channel alike (:data:`CHANNEL_WISE`): in their
:class:`Normalize` where all do (the validation pipeline, the recipes ``none``, ``light`` and ``default``), else
just before the first that does not (``strong``'s GaussNoise, :class:`RepeatChannels`), and the datasets hand them
the one-channel image: the same output, bit for bit (tested for every recipe), for a third of the warping and
resizing.

Beside a GPU the training run's loaders leave the final :class:`Normalize` to the device (:func:`deferred_normalize`,
:func:`normalize_images`): the loader workers hand over the image before it (a gray image with one channel where the
pipeline would repeat it), a third of the bytes to collate, pin and copy to the GPU for a gray image and a model of
three channels, and the GPU computes the same float32 values.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence

import albumentations as A
import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _resize(size: int) -> A.BasicTransform:
    return A.Resize(size, size, area_for_downscale="image")


def _crop(size: int, min_scale: float) -> A.BasicTransform:
    return A.RandomResizedCrop((size, size), scale=(min_scale, 1.0), ratio=(0.85, 1.18), area_for_downscale="image")


# Built-in recipes: name -> (image_size -> transforms before Normalize).
AUGMENT_RECIPES: dict[str, Callable[[int], list[A.BasicTransform]]] = {
    "none": lambda size: [_resize(size)],
    "light": lambda size: [
        _resize(size),
        A.HorizontalFlip(p=0.5),
        A.Affine(translate_percent=(-0.04, 0.04), scale=(0.95, 1.05), rotate=(-8, 8), p=0.5),
    ],
    "default": lambda size: [
        _crop(size, 0.7),
        A.HorizontalFlip(p=0.5),
        A.Affine(rotate=(-15, 15), p=0.5),
        A.RandomBrightnessContrast(brightness_limit=0.1, contrast_limit=0.1, p=0.5),
    ],
    "strong": lambda size: [
        _crop(size, 0.5),
        A.HorizontalFlip(p=0.5),
        A.VerticalFlip(p=0.5),
        A.Affine(rotate=(-30, 30), shear=(-8, 8), scale=(0.9, 1.1), p=0.7),
        A.RandomBrightnessContrast(brightness_limit=0.2, contrast_limit=0.2, p=0.7),
        A.RandomGamma(gamma_limit=(80, 120), p=0.5),
        A.GaussianBlur(sigma_limit=(0.3, 1.2), p=0.2),
        A.GaussNoise(std_range=(0.01, 0.04), p=0.3),
        A.CoarseDropout(num_holes_range=(1, 4), hole_height_range=(0.05, 0.15), hole_width_range=(0.05, 0.15), p=0.3),
    ],
}


class Normalize(A.Normalize):
    """Albumentations' ``Normalize`` of images in [0, 1] (``max_pixel_value=1``, the standard normalisation): the same
    float32 values, bit for bit, computed one channel at a time without the two image-sized arrays of means and
    denominators albumentations fills for every image (about a third of a 224 px three-channel sample's time in a
    loader worker, profiled).

    With ``repeat_gray`` a one-channel image becomes one of ``len(mean)`` channels: each output channel is computed
    from the gray one, as Normalize computes it from a repeated image. Pipelines put it last, after transforms that
    act on each channel alike (:func:`repeats_channels`), so that a grayscale image is augmented once instead of
    once per channel.

    ``deferred``: the image is handed on as float32, unnormalised (a gray one not repeated); the batch is normalised
    later by :func:`normalize_images` (see :func:`deferred_normalize`).
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], repeat_gray: bool = False, p: float = 1.0,
                 deferred: bool = False) -> None:
        super().__init__(mean=tuple(mean), std=tuple(std), max_pixel_value=1.0, p=p)
        self.repeat_gray = repeat_gray
        self.deferred = deferred

    def apply(self, img: np.ndarray, **params) -> np.ndarray:
        if self.deferred:
            return img if img.dtype == np.float32 else img.astype(np.float32)
        channels = len(self.mean_np)
        src = img[:, :, None] if img.ndim == 2 else img
        gray_to_repeat = src.ndim == 3 and src.shape[2] == 1 and channels > 1
        if img.dtype != np.float32 or src.ndim != 3 or src.shape[2] not in (1, channels) or (
            gray_to_repeat and not self.repeat_gray
        ):
            return super().apply(img, **params)
        out = np.empty(src.shape[:2] + (channels,), dtype=np.float32)
        for c in range(channels):  # (x - mean) * (1 / std) in float32, as albumentations' two OpenCV calls do
            plane = out[:, :, c]
            np.subtract(src[:, :, c if src.shape[2] > 1 else 0], self.mean_np[c], out=plane)
            np.multiply(plane, self.denominator[c], out=plane)
        return out

    def get_transform_init_args_names(self) -> tuple[str, ...]:
        return ("mean", "std", "repeat_gray", "deferred")


class RepeatChannels(A.ImageOnlyTransform):
    """A one-channel image (H, W) or (H, W, 1) repeated to (H, W, ``channels``); any other image is unchanged.

    A pipeline puts it just before its first transform that does not act on each channel alike (``strong``'s
    GaussNoise, a noise field per channel): the transforms before it augment a gray image once. It draws no random
    number, so every later transform draws what it drew before.
    """

    def __init__(self, channels: int, p: float = 1.0) -> None:
        super().__init__(p=p)
        self.channels = channels

    def apply(self, img: np.ndarray, **params) -> np.ndarray:
        image = img[:, :, None] if img.ndim == 2 else img
        return np.repeat(image, self.channels, axis=2) if image.shape[2] == 1 < self.channels else image

    def get_transform_init_args_names(self) -> tuple[str, ...]:
        return ("channels",)


# Transforms that act on every channel of an image alike, as the built-in recipes use them: augmenting a gray image
# and then repeating it gives the repeated image's augmentation, bit for bit (tests/data/test_transforms.py checks
# every recipe). GaussNoise (a noise field per channel) is not one. Exact types: a subclass may act otherwise.
CHANNEL_WISE = (A.Resize, A.RandomResizedCrop, A.HorizontalFlip, A.VerticalFlip, A.Affine, A.RandomBrightnessContrast,
                A.RandomGamma, A.GaussianBlur, A.CoarseDropout)


def repeats_channels(transform: A.BasicTransform | A.BaseCompose) -> bool:
    """Whether ``transform`` repeats a one-channel image to its channels itself (:class:`RepeatChannels`, or
    :class:`Normalize` with ``repeat_gray``): a dataset then hands it grayscale images with one channel."""
    return any(isinstance(t, RepeatChannels) or (isinstance(t, Normalize) and t.repeat_gray) for t in _flatten(transform))


def deferred_normalize(transform: A.BaseCompose) -> tuple[A.Compose, np.ndarray, np.ndarray] | None:
    """A copy of ``transform`` whose final :class:`Normalize` hands the image on unnormalised (``deferred``), with
    the float32 means and reciprocal stds that :func:`normalize_images` then applies to the batch; None when the
    pipeline does not end with vitlab's :class:`Normalize` (it is left as it is).

    The datasets treat the copy as they treat the pipeline: a gray image stays one channel where its Normalize would
    repeat it (:func:`repeats_channels`), so a batch holds a third of the values for a model of three channels."""
    last = (getattr(transform, "transforms", None) or [None])[-1]
    if not isinstance(last, Normalize) or last.deferred or last.p != 1.0:  # (p < 1: not every image is normalised)
        return None
    copied = copy.deepcopy(transform)
    copied.transforms[-1].deferred = True
    return copied, last.mean_np.astype(np.float32), last.denominator.astype(np.float32)


def defers_normalize(transform: A.BaseCompose) -> bool:
    """Whether ``transform`` ends with a :class:`Normalize` left to :func:`normalize_images` (``deferred``)."""
    last = (getattr(transform, "transforms", None) or [None])[-1]
    return isinstance(last, Normalize) and last.deferred


def normalize_images(images: torch.Tensor, mean: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """(B, 1 or C, H, W) images left unnormalised by a :func:`deferred_normalize` pipeline -> (B, C, H, W) normalised
    where they are (the GPU included): (x - mean) * (1 / std) per channel, a one-channel batch broadcast to the C
    channels, in float32: the values :class:`Normalize` computes on the host, bit for bit (two correctly rounded
    operations per value, as its two OpenCV calls).

    Args:
        images: The batch, float32.
        mean: (C,) float32 means, on the images' device (:func:`deferred_normalize`'s, moved there once).
        denominator: (C,) float32 reciprocal stds, likewise.
    """
    channels = mean.shape[0]
    if images.ndim != 4 or images.shape[1] not in (1, channels) or images.dtype != torch.float32:
        raise ValueError(f"normalize_images: need float32 images (B, 1 or {channels}, H, W), got {images.dtype} "
                         f"{tuple(images.shape)}")
    return torch.sub(images, mean.view(1, channels, 1, 1)).mul_(denominator.view(1, channels, 1, 1))


def _finish(steps: list[A.BasicTransform], mean: Sequence[float], std: Sequence[float], user: bool) -> list:
    """``steps``, then :class:`Normalize`. A gray image's channels are repeated after the steps that act on each channel
    alike (:data:`CHANNEL_WISE`): by Normalize when they all do, else by :class:`RepeatChannels` before the first that
    does not; never in a user's Compose."""
    if user or len(mean) == 1:
        return [*steps, Normalize(mean, std)]
    first = next((i for i, step in enumerate(steps) if any(type(t) not in CHANNEL_WISE for t in _flatten(step))), None)
    if first is None:
        return [*steps, Normalize(mean, std, repeat_gray=True)]
    return [*steps[:first], RepeatChannels(len(mean)), *steps[first:], Normalize(mean, std)]


def normalization_stats(
    in_chans: int, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std: given ones (a single value is repeated), else ImageNet's.

    ImageNet statistics are averaged to one value for any ``in_chans`` but 3 (1: grayscale; 2r + 1: the slices of
    a slab, each a grayscale image).

    Raises:
        ValueError: A length that is neither 1 nor ``in_chans``, or a std that is not positive.
    """
    if isinstance(in_chans, bool) or not isinstance(in_chans, int) or in_chans < 1:
        raise ValueError(f"in_chans must be 1 (grayscale), 3 (colour) or a slab's 2r + 1, got {in_chans}")
    defaults = (IMAGENET_MEAN, IMAGENET_STD)
    stats = []
    for name, given, default in (("mean", mean, defaults[0]), ("std", std, defaults[1])):
        if given is None:
            values = tuple(default) if in_chans == 3 else (float(np.mean(default)),) * in_chans
        elif len(given) in (1, in_chans):
            values = tuple(float(v) for v in given) * (in_chans // len(given))
        else:
            raise ValueError(f"{name} has {len(given)} values; give 1 or in_chans={in_chans}")
        stats.append(values)
    if not np.isfinite(stats[0]).all():
        raise ValueError(f"mean must be finite, got {list(stats[0])}")
    if not min(stats[1]) >= 1e-37:  # (a smaller one's float32 reciprocal overflows, or nearly: every value infinite)
        raise ValueError(f"std must be positive and at least 1e-37 (its float32 reciprocal finite), got {list(stats[1])}")
    return stats[0], stats[1]


def train_transform(
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    augment: str = "default",
    user_transforms: A.Compose | None = None,
    seed: int | None = None,
) -> A.Compose:
    """Training pipeline: a built-in recipe, or ``user_transforms`` + resize; then Normalize.

    Args:
        image_size: Output side in pixels.
        mean: Per-channel mean (length = channels).
        std: Per-channel std.
        augment: One of :data:`AUGMENT_RECIPES` (ignored when ``user_transforms`` is given).
        user_transforms: A full override; must not contain its own ``Normalize``.
        seed: Seed of the Compose's generator (workers reseed it, see :func:`seed_worker`).

    Raises:
        ValueError: Unknown recipe, or a ``Normalize`` inside ``user_transforms``.
    """
    if user_transforms is not None:
        if any(isinstance(t, A.Normalize) for t in _flatten(user_transforms)):
            raise ValueError(
                "train_transforms contains Normalize; remove it: vitlab appends "
                "Normalize(max_pixel_value=1.0) with the configured mean/std"
            )
        steps = [user_transforms, _resize(image_size)]
    elif augment in AUGMENT_RECIPES:
        steps = AUGMENT_RECIPES[augment](image_size)
    else:
        raise ValueError(f"unknown augment recipe {augment!r}; valid: {', '.join(AUGMENT_RECIPES)}")
    return A.Compose(_finish(steps, mean, std, user=user_transforms is not None), seed=seed)


def eval_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> A.Compose:
    """Deterministic pipeline for validation, test and probes: resize + Normalize (a gray image's channels repeated
    by it, :class:`Normalize`)."""
    return A.Compose(_finish([_resize(image_size)], mean, std, user=False), seed=0)


def _flatten(transform: A.BasicTransform | A.BaseCompose) -> list:
    """All leaf transforms of a (nested) Compose."""
    children = getattr(transform, "transforms", None)
    if children is None:
        return [transform]
    return [leaf for child in children for leaf in _flatten(child)]


def single_opencv_thread() -> None:
    """OpenCV (albumentations' backend) on one thread in this process: vitlab's one OpenCV thread setting.

    The data loaders make it in every process that loads: the training process when it makes a loader (before its
    workers start: OpenCV's thread pool, once running, does not survive a fork, and a worker that then touched
    OpenCV waited forever) and each worker as it starts (:func:`seed_worker`; a forked worker inherits it, a spawned
    one does not). OpenCV's default, a thread per core in every process, would compete with torch's threads and the
    other workers for the cores (``docs/performance.md``)."""
    import cv2

    cv2.setNumThreads(1)


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: one OpenCV thread (:func:`single_opencv_thread`); Python's and NumPy's global
    generators seeded per worker.

    The augmentations themselves are seeded per sample (:mod:`vitlab.data.sampling`), so they do not depend on
    which worker loads a sample.
    """
    single_opencv_thread()
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
