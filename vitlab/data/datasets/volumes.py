"""Whole volumes as training items (``data.sample: volume``): resampled, cropped / padded, windowed, and for
training randomly patched, flipped and intensity-jittered, every draw keyed by (seed, epoch, index)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vitlab.data.datasets.images import MedicalImageDataset, SkippedFiles, finite_tensor
from vitlab.data.layouts import Sample
from vitlab.data.masks import read_label_map, within_classes
from vitlab.data.readers.options import ReadOptions
from vitlab.data.readers.volume import Volume, read_volume
from vitlab.data.readers.window import intensities
from vitlab.data.resample import crop_at, crop_or_pad, resample
from vitlab.data.volume_options import VolumeOptions, intensity_jitter


class KeyedVolumeTransform:
    """The transform of a :class:`VolumeDataset`, drawn from the generator
    :class:`~vitlab.data.sampling.KeyedAugmentation` sets for each sample (unseeded outside it: a fresh draw):

    - ``flip``: which of the axes i, j, k an item is flipped along (each with probability 0.5);
    - ``intensity`` (:func:`intensity_jitter`): with probability ``scale_prob`` the intensities are multiplied by
      ``1 + u``, u uniform in [-scale, scale] (MONAI's ``RandScaleIntensity``), and with probability ``shift_prob``
      ``v`` uniform in [-shift, shift] is added (``RandShiftIntensity``), on the windowed values.

    Every item draws the same count of numbers whatever comes out (3 for the flips, 4 for the intensities)."""

    def __init__(self, flip: bool, intensity: dict[str, float] | None = None) -> None:
        self.flip, self.intensity = flip, intensity_jitter(intensity)
        self._rng: np.random.Generator | None = None

    def set_random_state(self, rng: np.random.Generator, py_random=None) -> None:  # as albumentations' Compose
        self._rng = rng

    def draw(self) -> tuple[list[int], float, float]:
        """(axes to flip, factor, offset): values become ``values * factor + offset``."""
        rng = self._rng if self._rng is not None else np.random.default_rng()
        axes = [axis for axis, draw in enumerate(rng.random(3)) if draw < 0.5] if self.flip else []
        factor, offset = 1.0, 0.0
        if self.intensity is not None:
            scaled, u, shifted, v = rng.random(4)
            jitter = self.intensity
            if scaled < jitter["scale_prob"]:
                factor = 1.0 + (2.0 * u - 1.0) * jitter["scale"]
            if shifted < jitter["shift_prob"]:
                offset = (2.0 * v - 1.0) * jitter["shift"]
        return axes, factor, offset


class VolumeDataset(MedicalImageDataset):
    """Whole volumes (``data.sample: volume``): each resampled to ``options.spacing`` mm (trilinear,
    :func:`resample`), cropped / padded about its centre to ``options.volume_size`` voxels, values through
    :func:`intensities`; items are ``(tensor (1, I, J, K), label)`` in the volume's array axes (MONAI's
    channel-first layout). Bad volumes are skipped as images are (:meth:`first_good`). ``volume_size`` None keeps
    each volume's resampled size (batches of one, or patches). The augmentations (``augmented``: training) are
    ``options.volume_flip`` and ``options.volume_intensity`` (``transform`` is a :class:`KeyedVolumeTransform`),
    seeded per sample
    with the patch draw by :class:`~vitlab.data.sampling.KeyedAugmentation` from (seed, epoch, index) in the
    training loader, so neither depends on the loader workers.

    With ``num_mask_classes`` (segmentation) items are ``(tensor, {"mask": (I, J, K) int64})``: the label map
    resampled with nearest neighbours onto the same grid and padded with background.

    With ``options.patch_size`` (training) each item is a random patch of that many voxels of the volume (padded first
    where smaller), as MONAI's ``RandCropByPosNegLabeld`` draws them: with probability ``options.patch_foreground`` the
    patch is centred on a random foreground voxel of the label map (when it has one), else placed uniformly
    (shifted inside the volume). The draws come from the generator :meth:`set_random_state` gives, which
    :class:`~vitlab.data.sampling.KeyedAugmentation` seeds with (seed, epoch, index): whatever the loader
    workers, one patch per sample and epoch.

    Args:
        samples: One per volume (``slice`` None).
        class_names: Class order.
        options: The volume options: ``spacing``, ``volume_size``, ``intensity``, and for training ``patch_size``,
            ``patch_foreground``, ``volume_flip`` and ``volume_intensity``.
        read_options: The window.
        augmented: Training items: random patches (with ``options.patch_size``), flips and intensity jitter as the
            options say; else the whole (cropped / padded) volume as it is.
        on_bad_file: ``"skip"`` or ``"error"``.
        skipped: The record of the volumes skipped at load time (:class:`~vitlab.data.datasets.images.SkippedFiles`).
        num_mask_classes: Foreground classes of the label maps (segmentation); None: items carry the volume's label.
    """

    def __init__(self, samples: Sequence[Sample], class_names: Sequence[str], options: VolumeOptions,
                 read_options: ReadOptions, *, augmented: bool = False, on_bad_file: str = "skip",
                 skipped: SkippedFiles | None = None, num_mask_classes: int | None = None) -> None:
        transform = KeyedVolumeTransform(augmented and options.volume_flip, options.volume_intensity if augmented else None)
        super().__init__(samples, class_names, transform, read_options=read_options, on_bad_file=on_bad_file, skipped=skipped)
        self.options, self.spacing, self.size = options, options.spacing, options.volume_size
        self.num_mask_classes = num_mask_classes
        self.patch_size = options.patch_size if augmented else None
        self.patch_foreground = float(options.patch_foreground)
        self.rng = np.random.default_rng(0)  # reseeded per item by KeyedAugmentation
        self.last_spacing: tuple[float, ...] | None = None

    def set_random_state(self, rng: np.random.Generator, py_rng) -> None:
        super().set_random_state(rng, py_rng)
        self.rng = rng

    def draw_patch(self, volume, mask):
        """A random ``patch_size`` block of ``volume`` (padded with its lowest value where smaller) and the same
        block of ``mask`` (None without one), drawn from ``self.rng`` (see the class docstring)."""
        patch = np.asarray(self.patch_size)
        if np.any(patch > np.asarray(volume.shape)):
            grown = tuple(int(n) for n in np.maximum(patch, volume.shape))
            volume = crop_or_pad(volume, grown, fill=float(volume.array.min()))
            mask = None if mask is None else crop_or_pad(mask, grown, fill=0.0)
        high = np.asarray(volume.shape) - patch  # origins 0..high along each axis
        centred = self.rng.random() < self.patch_foreground  # drawn for every patch: the stream does not depend on the mask
        pick = self.rng.random()
        origin = np.array([self.rng.integers(0, h + 1) for h in high])
        if mask is not None and centred:
            foreground = np.flatnonzero(mask.array > 0.5)
            if foreground.size:
                centre = np.array(np.unravel_index(foreground[min(int(pick * foreground.size), foreground.size - 1)], mask.shape))
                origin = np.clip(centre - patch // 2, 0, high)
        return crop_at(volume, origin, patch), None if mask is None else crop_at(mask, origin, patch)

    def load_volume(self, index: int):
        """The resampled, cropped / padded :class:`~vitlab.data.readers.volume.Volume` of sample ``index`` (values: HU) and
        its label map on the same grid (None without ``num_mask_classes``)."""
        sample = self.samples[index]
        volume = read_volume(sample.path, series_uid=sample.series_uid)
        mask = None
        if self.num_mask_classes is not None:
            mask = Volume(read_label_map(sample, volume.shape, volume.affine).astype(np.float32), volume.affine)
        if self.spacing is not None:
            volume = resample(volume, self.spacing, mode="linear")
            mask = None if mask is None else resample(mask, self.spacing, mode="nearest", fill=0.0)
        self.last_spacing = volume.spacing  # voxel size in mm of the volume loaded last (crop / pad keep it)
        fill = float(volume.array.min())  # outside the field of view: the volume's lowest value (air in CT)
        if self.size is not None:
            volume, mask = crop_or_pad(volume, self.size, fill=fill), None if mask is None else crop_or_pad(mask, self.size, fill=0.0)
        return volume, mask

    def _item(self, index: int):
        volume, mask = self.load_volume(index)
        values = intensities(volume.array, self.read_options.explicit_window, self.options.intensity)  # (I, J, K), of the whole volume
        if self.patch_size is not None:
            patch, mask = self.draw_patch(Volume(values, volume.affine), mask)
            values = patch.array
        axes, factor, offset = self.transform.draw()  # drawn before the checks: one draw per item, whatever its outcome
        tensor = finite_tensor(self.samples[index].path, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))[None])
        if factor != 1.0 or offset != 0.0:
            tensor = tensor * factor + offset
        if axes:
            tensor = tensor.flip([a + 1 for a in axes])
        if mask is None:
            return tensor, self.labels[index]  # (1, I, J, K)
        labels = within_classes(self.samples[index], np.rint(mask.array).astype(np.int64), self.num_mask_classes)  # (I, J, K)
        labels = torch.from_numpy(labels)
        return tensor, {"mask": labels.flip(axes) if axes else labels}
