"""Slices and slabs of volumes for the 2-D datasets: a bounded store of prepared volumes per loader process.

The loaders read volumes through a :class:`VolumeStore`: each process holds at most ``volumes_in_memory``
prepared volumes (least recently used out), and the training order visits the volumes in blocks of that many
(:class:`~vitlab.data.sampling.EpochSampler`'s ``groups``), so an epoch decodes each volume once per process
whatever the number of volumes, and the memory held stays bounded.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from vitlab.data.layouts import Sample
from vitlab.data.masks import read_label_map, within_classes
from vitlab.data.readers.options import ReadOptions
from vitlab.data.readers.volume import read_volume
from vitlab.data.readers.window import intensities
from vitlab.data.volume_options import VolumeOptions


class VolumeStore:
    """Prepared volumes of this process, at most ``options.volumes_in_memory`` at a time (least recently used out).

    A prepared volume is (K, J, I) float32, C-ordered (a slab is contiguous), values through :func:`intensities`;
    its label map (K, J, I) uint8 is read on first need. ``decodes`` counts volumes read, ``most_held`` the most
    held at once. A copy sent to a loader worker starts empty.
    """

    def __init__(self, options: VolumeOptions, read_options: ReadOptions) -> None:
        self.options, self.read_options, self.capacity = options, read_options, options.volumes_in_memory
        self._held: OrderedDict = OrderedDict()
        self.decodes = self.most_held = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_held=OrderedDict(), decodes=0, most_held=0)
        return state

    def _entry(self, sample: Sample) -> dict:
        key = (str(sample.path), sample.series_uid)
        entry = self._held.get(key)
        if entry is not None:
            self._held.move_to_end(key)
            return entry
        volume = read_volume(sample.path, series_uid=sample.series_uid)
        values = intensities(volume.array, self.read_options.explicit_window, self.options.intensity)  # (I, J, K)
        entry = {"image": np.ascontiguousarray(values.transpose(2, 1, 0)), "grid": (volume.shape, volume.affine)}  # (K, J, I)
        while len(self._held) >= self.capacity:
            self._held.popitem(last=False)
        self._held[key] = entry
        self.decodes += 1
        self.most_held = max(self.most_held, len(self._held))
        return entry

    def image(self, sample: Sample) -> np.ndarray:
        """The slice (J, I, 1) or slab (J, I, 2r + 1) around ``sample.slice``; slices past an end repeat it."""
        image = self._entry(sample)["image"]
        r = self.options.slab_radius if self.options.sample == "slab" else 0
        ks = np.clip(np.arange(sample.slice - r, sample.slice + r + 1), 0, image.shape[0] - 1)
        return np.ascontiguousarray(image[ks].transpose(1, 2, 0))  # (J, I, C)

    def mask(self, sample: Sample, num_classes: int) -> np.ndarray:
        """The label map's slice (J, I) int64 at ``sample.slice``, its values checked against ``num_classes``."""
        entry = self._entry(sample)
        if "mask" not in entry:
            entry["mask"] = np.ascontiguousarray(read_label_map(sample, *entry["grid"]).transpose(2, 1, 0))
        return within_classes(sample, entry["mask"][sample.slice].astype(np.int64), num_classes)  # (J, I)
