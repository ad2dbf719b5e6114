"""How volumes become samples, values and training items: the volume arguments of the data modules, checked.

``data.sample`` turns each volume (a NIfTI file, a DICOM series folder, an enhanced multi-frame file) into samples:

* ``slice``: every 2-D slice along k (the slice normal of a DICOM series, the third axis of a NIfTI file), shown
  as DICOM shows it (rows along j, columns along i);
* ``slab``: 2.5-D, the ``2r + 1`` slices around each slice as channels (``r = data.slab_radius``; at the ends the
  end slice repeats), for any 2-D family (the first convolution takes ``2r + 1`` channels, adapted from pretrained
  weights as for grayscale);
* ``volume``: the whole volume, resampled to ``data.spacing`` and cropped / padded to ``data.volume_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLE_MODES = ("image", "slice", "slab", "volume")
INTENSITIES = ("window", "percentile", "zscore")
SLICE_LABELS = ("volume", "mask")


@dataclass(frozen=True)
class VolumeOptions:
    """The volume arguments of a data module (``data.sample``, ``data.slab_radius``, ... of
    :class:`~vitlab.data.image_data.ImageData`, same names and defaults but ``sample``), checked together, once:
    each value, and which of them combine. A bad value or combination is a one-line ``ValueError`` naming the config
    key, e.g. ``data.volume_flip flips whole volumes: set data.sample to volume``.

    ``sample: image`` (2-D image files) takes none of them: every other field keeps its default. The data module
    builds this object from its flat arguments (configs keep writing ``data.patch_size``, not a nested section);
    :meth:`input_channels` checks ``data.in_chans`` against the samples' channels.

    Args:
        sample: ``image``, ``slice``, ``slab`` or ``volume`` (see the module docstring).
        slab_radius: Slices each side of the centre in a slab.
        slice_labels: ``volume`` (a slice has its volume's label) or ``mask`` (absent / present in its label map).
        intensity: ``window``, ``percentile`` or ``zscore`` (see :func:`~vitlab.data.readers.window.intensities`).
        min_mask_voxels: Voxels of the label map a slice needs to be ``present``.
        volumes_in_memory: Prepared volumes each loader process keeps at once (slices and slabs), and the block of
            volumes the training order visits together (:class:`~vitlab.data.sampling.EpochSampler`).
        spacing: Voxel size in mm along i, j, k every whole volume is resampled to; None keeps each volume's own.
        volume_size: Voxels along i, j, k of a whole volume after crop / pad; None (with ``patch_size``) keeps each
            volume's resampled size.
        patch_size: Voxels along i, j, k of the random training patches of whole volumes; None: whole volumes.
        patch_foreground: Probability that a patch is centred on a foreground voxel.
        volume_flip: Random flips of training volumes along i, j, k.
        volume_intensity: Random intensity scale / shift of training volumes (:func:`intensity_jitter`; kept here
            with its defaults filled in).
    """

    sample: str = "slice"
    slab_radius: int = 1
    slice_labels: str = "volume"
    intensity: str = "window"
    min_mask_voxels: int = 1
    volumes_in_memory: int = 4
    spacing: tuple[float, float, float] | None = None
    volume_size: tuple[int, int, int] | None = None
    patch_size: tuple[int, int, int] | None = None
    patch_foreground: float = 0.5
    volume_flip: bool = False
    volume_intensity: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.sample not in SAMPLE_MODES:
            raise ValueError(f"data.sample must be one of {list(SAMPLE_MODES)}, got {self.sample!r}")
        if self.sample == "image":
            self._check_images()
        else:
            self._check_volumes()
        if self.volume_flip and self.sample != "volume":
            raise ValueError("data.volume_flip flips whole volumes: set data.sample to volume")
        if self.volume_intensity is not None and self.sample != "volume":
            raise ValueError("data.volume_intensity jitters whole volumes: set data.sample to volume")
        self._set(volume_intensity=intensity_jitter(self.volume_intensity), volume_flip=bool(self.volume_flip),
                  spacing=_numbers(self.spacing, float), volume_size=_numbers(self.volume_size, int),
                  patch_size=_numbers(self.patch_size, int))

    def _set(self, **values) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)  # (frozen: the checked values, in one form)

    def _check_images(self) -> None:
        if (self.slice_labels != "volume" or self.intensity != "window" or self.spacing is not None
                or self.volume_size is not None or self.patch_size is not None):
            raise ValueError("data.slice_labels / data.intensity / data.spacing / data.volume_size / data.patch_size apply to volumes: "
                             "set data.sample to slice, slab or volume")

    def _check_volumes(self) -> None:
        if isinstance(self.slab_radius, bool) or not isinstance(self.slab_radius, int) or self.slab_radius < 0:
            raise ValueError(f"data.slab_radius must be an int >= 0 (slices each side of the centre), got {self.slab_radius!r}")
        if self.slice_labels not in SLICE_LABELS:
            raise ValueError(f"data.slice_labels must be one of {list(SLICE_LABELS)}, got {self.slice_labels!r}")
        if isinstance(self.min_mask_voxels, bool) or not isinstance(self.min_mask_voxels, int) or self.min_mask_voxels < 1:
            raise ValueError(f"data.min_mask_voxels must be an int >= 1, got {self.min_mask_voxels!r}")
        if self.intensity not in INTENSITIES:
            raise ValueError(f"data.intensity must be one of {list(INTENSITIES)}, got {self.intensity!r}")
        capacity = self.volumes_in_memory
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"data.volumes_in_memory must be an int >= 1, got {capacity!r}")
        size, patch = self.volume_size, self.patch_size
        if self.sample == "volume" and not (size and len(size) == 3 and all(int(n) > 0 for n in size)) \
                and not (size is None and patch is not None):
            raise ValueError(f"data.sample volume needs data.volume_size: 3 positive voxel counts (i, j, k) (or null with "
                             f"data.patch_size), got {size!r}")
        self._check_patches()
        if self.spacing is not None and not (len(self.spacing) == 3 and all(float(s) > 0 for s in self.spacing)):
            raise ValueError(f"data.spacing must be 3 positive numbers (mm along i, j, k) or null, got {self.spacing!r}")

    def _check_patches(self) -> None:
        patch, size, foreground = self.patch_size, self.volume_size, self.patch_foreground
        if patch is None:
            return
        if self.sample != "volume":
            raise ValueError(f"data.patch_size applies to data.sample volume (random 3-D training patches), not {self.sample!r}")
        if not (isinstance(patch, (list, tuple)) and len(patch) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in patch)):
            raise ValueError(f"data.patch_size must be 3 positive voxel counts (i, j, k), got {patch!r}")
        if size is not None and any(p > v for p, v in zip(patch, size)):
            raise ValueError(f"data.patch_size {list(patch)} is larger than data.volume_size {list(size)} along some axis; "
                             "a patch lies inside the volume (or set volume_size null to keep each volume's own size)")
        if isinstance(foreground, bool) or not isinstance(foreground, (int, float)) or not 0 <= foreground <= 1:
            raise ValueError(f"data.patch_foreground must be a probability in [0, 1], got {foreground!r}")

    @property
    def channels(self) -> int:
        """Channels of a sample: ``2 * slab_radius + 1`` for slabs, else 1 (a 2-D image's own count is ``in_chans``)."""
        return 2 * self.slab_radius + 1 if self.sample == "slab" else 1

    def input_channels(self, in_chans: int) -> int:
        """The model's input channels for ``data.in_chans``: as given for 2-D images (1 or 3), else the samples'
        (``in_chans`` must be 1, its default, or that count)."""
        if self.sample == "image":
            if in_chans not in (1, 3):
                raise ValueError(f"in_chans must be 1 (grayscale) or 3 (colour), got {in_chans}")
            return in_chans
        if in_chans not in (1, self.channels):
            raise ValueError(f"data.in_chans {in_chans} does not match data.sample {self.sample!r} (slab_radius {self.slab_radius}): "
                             f"its samples have {self.channels} channel(s); leave in_chans at 1")
        return self.channels

    @property
    def own_size(self) -> bool:
        """Whole volumes that keep each their resampled size (``volume_size`` null): validation and test take one
        volume per batch (sliding-window inference)."""
        return self.sample == "volume" and self.volume_size is None


def _numbers(values, kind) -> tuple | None:
    return None if values is None else tuple(kind(v) for v in values)


INTENSITY_JITTER_KEYS = ("scale", "scale_prob", "shift", "shift_prob")


def intensity_jitter(value: dict[str, float] | None) -> dict[str, float] | None:
    """``data.volume_intensity`` checked: None, or a mapping of ``scale`` / ``shift`` (>= 0, default 0) and
    ``scale_prob`` / ``shift_prob`` (in [0, 1], default 1); one line naming the key otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - set(INTENSITY_JITTER_KEYS):
        unknown = sorted(set(value) - set(INTENSITY_JITTER_KEYS)) if isinstance(value, dict) else value
        raise ValueError(f"data.volume_intensity takes {', '.join(INTENSITY_JITTER_KEYS)} (e.g. {{scale: 0.1, "
                         f"scale_prob: 0.1, shift: 0.1, shift_prob: 0.5}}), got {unknown!r}")
    out = {"scale": 0.0, "scale_prob": 1.0, "shift": 0.0, "shift_prob": 1.0}
    for key, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0 or (key.endswith("_prob") and number > 1):
            valid = "in [0, 1]" if key.endswith("_prob") else ">= 0"
            raise ValueError(f"data.volume_intensity.{key} must be a number {valid}, got {number!r}")
        out[key] = float(number)
    return out
