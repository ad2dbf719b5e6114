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
    """How volumes become samples and values (``data.sample``, ``data.slab_radius``, ...; see :class:`ImageData`)."""

    sample: str = "slice"
    slab_radius: int = 1
    slice_labels: str = "volume"
    intensity: str = "window"
    min_mask_voxels: int = 1

    def __post_init__(self) -> None:
        if self.sample not in SAMPLE_MODES[1:]:
            raise ValueError(f"data.sample must be one of {list(SAMPLE_MODES)}, got {self.sample!r}")
        if isinstance(self.slab_radius, bool) or not isinstance(self.slab_radius, int) or self.slab_radius < 0:
            raise ValueError(f"data.slab_radius must be an int >= 0 (slices each side of the centre), got {self.slab_radius!r}")
        if self.slice_labels not in SLICE_LABELS:
            raise ValueError(f"data.slice_labels must be one of {list(SLICE_LABELS)}, got {self.slice_labels!r}")
        if isinstance(self.min_mask_voxels, bool) or not isinstance(self.min_mask_voxels, int) or self.min_mask_voxels < 1:
            raise ValueError(f"data.min_mask_voxels must be an int >= 1, got {self.min_mask_voxels!r}")
        if self.intensity not in INTENSITIES:
            raise ValueError(f"data.intensity must be one of {list(INTENSITIES)}, got {self.intensity!r}")

    @property
    def channels(self) -> int:
        return 2 * self.slab_radius + 1 if self.sample == "slab" else 1


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
