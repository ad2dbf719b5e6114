"""A torch Dataset over :class:`~vitlab.data.layouts.Sample` lists."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import albumentations as A
import numpy as np
import torch
from torch.utils.data import Dataset

from vitlab.data.cache import ArrayCache, MemoryCache
from vitlab.data.readers.errors import ImageReadError
from vitlab.data.readers.image import ImageReader
from vitlab.data.readers.options import ReadOptions
from vitlab.data.transforms import defers_normalize, repeats_channels
from vitlab.data.layouts import UNLABELLED, Sample, SkippedFileWarning

T = TypeVar("T")

# ITU-R BT.601 luma weights, to feed colour images to a grayscale model.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def to_channels(image: np.ndarray, in_chans: int, keep_gray: bool = False) -> np.ndarray:
    """(H, W) or (H, W, 3) float32 -> (H, W, in_chans): gray is replicated (kept (H, W, 1) with ``keep_gray``: a
    transform that repeats the channels itself, :func:`vitlab.data.transforms.repeats_channels`), colour -> luma."""
    if image.ndim == 2:
        image = image[:, :, None]  # (H, W, 1)
    if image.shape[2] == in_chans or (keep_gray and image.shape[2] == 1):
        return image
    if in_chans == 3:
        return np.repeat(image, 3, axis=2)  # (H, W, 3)
    return (image @ _LUMA)[:, :, None]  # (H, W, 1)


class SkippedFiles:
    """The files a data module's datasets skipped at load time, in every process that loads them.

    A file that fails only when its pixels are decoded (or its finished tensor is not finite) is skipped by whichever
    process loads it: the training process or a loader worker. Each process warns about a file once (:meth:`add` is
    True the first time it sees it); a file of ``paths`` is also marked in memory shared with the process that made
    this record (one flag per file, shared before the workers start), so that process's :attr:`found` holds what
    every worker skipped too.

    Args:
        paths: The files that may be loaded (the data module's samples); a file outside them is known to the
            process that skipped it only.
    """

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self._paths = sorted(set(paths))
        self._index = {path: i for i, path in enumerate(self._paths)}
        self._marks = torch.zeros(len(self._paths), dtype=torch.bool)  # (N,) one flag per file
        if self._paths:
            self._marks.share_memory_()  # (before the loader workers start: they inherit the mapping)
        self._seen: set[str] = set()  # this process's

    def add(self, path: str) -> bool:
        """Record that ``path`` was skipped; True the first time in this process (warn then)."""
        index = self._index.get(path)
        if index is not None:
            self._marks[index] = True
        first = path not in self._seen
        self._seen.add(path)
        return first

    @property
    def found(self) -> set[str]:
        """Every file skipped so far, by this process or by any process that shares the record (loader workers)."""
        marked = torch.nonzero(self._marks).flatten().tolist()
        return self._seen | {self._paths[i] for i in marked}


class MedicalImageDataset(Dataset):
    """Decoded, windowed, augmented images with integer labels.

    Under ``on_bad_file="skip"`` a file that fails to decode, or whose finished tensor holds a non-finite value,
    is reported once per process (a :class:`SkippedFileWarning`, the path added to ``skipped``) and the next
    index's image is returned instead, so a bad file found only at decode time does not stop training; under
    ``"error"`` it raises a one-line :class:`ImageReadError` naming the file. No NaN or infinity reaches a batch.

    Args:
        samples: The images.
        class_names: Class order: ``label index = class_names.index(sample.label)``.
        transform: Albumentations pipeline ending in Normalize (float32 (H, W, C) in, (S, S, C) out).
        in_chans: 1 or 3 channels in the output.
        read_options: How files are decoded and windowed.
        on_bad_file: ``"skip"`` or ``"error"``.
        cache: Decoded-array cache, or None to decode every time.
        prescale_to: When an image is at least twice this size, shrink it first by the largest integer
            factor that keeps both sides >= this (an exact box filter, ~15x cheaper than a non-integer
            area resize); the transform's own resize then finishes. None disables it.
        reader: A reader whose header memory is already filled (see ``ImageReader.inspect``);
            None -> a new one with ``read_options``.
        memory: Keep items in memory (within its budget): the decoded, channel-converted and prescaled
            image before an augmenting ``transform`` (a gray image with one channel), the final tensor when
            ``deterministic``.
        deterministic: ``transform`` gives the same output for the same input (resize + normalise: the
            validation, test and probe pipelines), so whole items can be kept.
        skipped: The record of the files skipped at decode time (a data module shares one among its
            datasets to count them); None -> a new one.
        volumes: Where slices and slabs of volume samples (``sample.slice`` set) come from
            (:class:`vitlab.data.datasets.slices.VolumeStore`).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        class_names: Sequence[str],
        transform: A.Compose,
        *,
        in_chans: int = 1,
        read_options: ReadOptions | None = None,
        on_bad_file: str = "skip",
        cache: ArrayCache | None = None,
        reader: ImageReader | None = None,
        prescale_to: int | None = None,
        memory: MemoryCache | None = None,
        deterministic: bool = False,
        skipped: SkippedFiles | None = None,
        volumes=None,
    ) -> None:
        if read_options is not None and read_options.frames == "all":
            raise ValueError("frames='all' gives a volume per file; a 2-D dataset needs 'middle' or a frame index")
        self.samples = list(samples)
        self.class_index = {name: i for i, name in enumerate(class_names)}
        self.labels = [-1 if s.label == UNLABELLED else self.class_index[s.label] for s in self.samples]  # -1: unlabelled
        self.in_chans = in_chans
        self.prescale_to = prescale_to
        self.transform = transform
        self.read_options = read_options or ReadOptions()
        if reader is not None and reader.options != self.read_options:
            raise ValueError("reader.options differ from read_options")
        self.reader = reader or ImageReader(self.read_options)
        self.on_bad_file = on_bad_file
        self.cache = cache
        self.skipped = SkippedFiles() if skipped is None else skipped  # skipped at decode time
        self.memory = memory
        self.deterministic = deterministic
        self.volumes = volumes

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def transform(self) -> A.Compose:
        """The albumentations pipeline; one that repeats a gray image's channels itself is handed gray images with
        one channel (``keep_gray``: a third of the augmentation's work for a three-channel model)."""
        return self._transform

    @transform.setter
    def transform(self, transform: A.Compose) -> None:
        self._transform = transform
        # only after the prescale: it leaves every image's shorter side under twice the pipeline's size, so no crop or
        # resize of the pipeline is OpenCV's 2 x 2 block average, whose rounding depends on the number of channels
        self.keep_gray = bool(self.prescale_to) and self.in_chans > 1 and repeats_channels(transform)
        self.normalized_later = defers_normalize(transform)  # (its samples are unnormalised: a key of their own)

    @property
    def bad_paths(self) -> set[str]:
        """The files skipped at decode time so far (:attr:`SkippedFiles.found`)."""
        return self.skipped.found

    def set_random_state(self, rng: np.random.Generator, py_rng) -> None:
        """Seeds every random draw of the next item (:class:`~vitlab.data.sampling.KeyedAugmentation`): here the
        transform's; a dataset with draws of its own (volume patches) takes them from ``rng`` too."""
        self.transform.set_random_state(rng, py_rng)

    def load_array(self, index: int) -> np.ndarray:
        """Decoded, windowed float32 image in [0, 1], (H, W) or (H, W, 3), from the cache if enabled; the slice or
        slab (H, W, C) of a volume sample, from ``volumes``."""
        sample = self.samples[index]
        if sample.slice is not None:
            return self.volumes.image(sample)
        path = sample.path
        if self.cache is None:
            return self.reader(path)
        return self.cache.load(path, lambda: self.reader(path))

    def first_good(self, index: int, load: Callable[[int], T], what: str = "images") -> tuple[T, int]:
        """``load(i)`` and ``i`` for the first sample from ``index`` on (wrapping around) that loads: under
        ``on_bad_file="skip"`` a sample that fails is warned about once per process and the next one is tried,
        so a bad file found only at decode time does not stop training; under ``"error"`` it raises."""
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            try:
                return load(candidate), candidate
            except (ImageReadError, OSError) as error:
                if self.on_bad_file == "error":
                    raise
                path = str(self.samples[candidate].path)
                if self.skipped.add(path):
                    warnings.warn(f"skipping bad file: {error}", SkippedFileWarning, stacklevel=3)
        raise RuntimeError(f"none of the {len(self)} {what} could be read (see the warnings above)")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.first_good(index, self._item)[0]

    def _item(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index`` as ``(tensor (C, S, S), label)``, through the memory cache.

        Raises:
            ImageReadError: The file cannot be read, or the finished tensor is not finite.
        """
        path = self.samples[index].path
        key = (self.deterministic, self.normalized_later, self.samples[index].key)  # (one cache may serve several splits)
        kept = self.memory.get(key) if self.memory is not None else None
        if kept is not None and self.deterministic:
            tensor, label = kept
            return tensor.clone(), label  # (the caller may change it in place)
        if kept is not None:
            image = kept[0].copy()  # (a transform may change its input in place)
        else:
            image = to_channels(self.load_array(index), self.in_chans, keep_gray=True)  # (H, W, C), gray (H, W, 1)
            if self.prescale_to:
                image = integer_downscale(image, self.prescale_to, self.in_chans)
            if self.memory is not None and not self.deterministic:
                self.memory.put(key, (image.copy(), index), image.nbytes)
        image = to_channels(image, self.in_chans, self.keep_gray)  # gray repeated here unless the pipeline repeats it
        out = self.transform(image=image)["image"]  # (S, S, C) normalised (or not yet, and gray (S, S, 1): normalized_later)
        if out.ndim == 2:
            out = out[:, :, None]
        tensor = finite_tensor(path, torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)))
        if self.memory is not None and self.deterministic:
            self.memory.put(key, (tensor.clone(), self.labels[index]), tensor.numel() * tensor.element_size())
        return tensor, self.labels[index]  # (C, S, S)


def finite_tensor(path: object, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` when every value is finite, else :class:`ImageReadError` naming the file.

    The last guard before a batch: the readers return finite images in [0, 1], but a transform (a user's, or
    Normalize with a tiny std) can still make NaN or infinity, and one such value makes a whole run's loss NaN.
    """
    # a NaN or an infinity anywhere makes the sum non-finite, so a finite sum clears the tensor in one pass (about 17x
    # faster than an element-wise check on a 224 px image); a non-finite sum (or finite values whose sum overflows) is
    # checked element by element
    if bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()):
        return tensor
    bad = int((~torch.isfinite(tensor)).sum())
    raise ImageReadError(
        f"{path}: {bad} non-finite (NaN or infinite) value(s) in its {tuple(tensor.shape)} sample tensor after the "
        "transforms; an image must be finite to be batched (check the transforms and mean/std)"
    )


def integer_downscale(image: np.ndarray, target: int, like_channels: int = 1) -> np.ndarray:
    """Box-filter (H, W, C) by the largest integer factor k with min(H, W) // k >= target (k = 1: unchanged).

    Averaging k x k blocks is the exact area resize for an integer factor, so anti-aliasing is kept. A one-channel
    image is given the values its repetition to ``like_channels`` channels would get: OpenCV averages 2 x 2 blocks of
    a one-channel image with vectorised code that rounds differently (in the last bit) from its three-channel code,
    so for k = 2 a gray image kept with one channel for a three-channel model is averaged here in the three-channel
    code's order, ((a + b) + c) + d then times 0.25 in float32 (tests/data/test_transforms.py compares it with
    OpenCV's three-channel result).
    """
    import cv2

    factor = min(image.shape[0], image.shape[1]) // target
    if factor < 2:
        return image
    height, width = image.shape[0] // factor, image.shape[1] // factor
    part = image[: height * factor, : width * factor]
    if factor == 2 and like_channels > 1 and image.ndim == 3 and image.shape[2] == 1 and image.dtype == np.float32:
        out = np.add(part[0::2, 0::2], part[0::2, 1::2])  # (H / 2, W / 2, 1)
        out += part[1::2, 0::2]
        out += part[1::2, 1::2]
        out *= np.float32(0.25)
        return out
    out = cv2.resize(part, (width, height), interpolation=cv2.INTER_AREA)
    return out[:, :, None] if out.ndim == 2 else out  # (H / k, W / k, C)
