"""Volumes: one 3-D array with the geometry that places each voxel in the patient, from NIfTI or DICOM.

Geometry contract (nibabel's): ``volume.array[i, j, k]`` is the voxel whose centre lies at
``volume.affine @ [i, j, k, 1]`` in RAS+ millimetres, where (x, y, z)_RAS = (-x, -y, z)_LPS and LPS is DICOM's
patient coordinate system (ImagePositionPatient's). ``spacing`` is the column norms of ``affine[:3, :3]``. The
geometry travels with the array, as in nibabel and MONAI's MetaTensor, so that resampling and masks never guess.

:func:`read_volume` reads a NIfTI file, a folder holding a DICOM series or one enhanced multi-frame DICOM file
(the DICOM part lives in :mod:`vitlab.data.readers.dicom_series`, NIfTI in :mod:`vitlab.data.readers.nifti`), and refuses in one line what would give a wrong
geometry or wrong values. It only reads: nothing in the user's folders is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vitlab.data.readers.dicom_series import read_multiframe, read_series_folder
from vitlab.data.readers.errors import VOLUME_SOURCES, ImageNotFoundError, ImageReadError, VolumeError
from vitlab.data.readers.image import image_kind
from vitlab.data.readers.nifti import NIFTI_SUFFIXES, is_nifti, read_nifti

__all__ = ["LPS_TO_RAS", "NIFTI_SUFFIXES", "Volume", "VolumeError", "read_volume", "reorient"]

LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])  # (4, 4): DICOM's patient space -> nibabel's world space (an involution)


@dataclass(frozen=True, eq=False)  # (no field-wise ==: arrays do not compare to one bool)
class Volume:
    """A 3-D image and where its voxels lie.

    Args:
        array: (I, J, K) float32 values after the modality LUT (Hounsfield units for CT; no window).
        affine: (4, 4) float64 voxel index -> RAS+ mm (see the module docstring).
        patient_id: PatientID of a DICOM volume (None for NIfTI or when the file has none).
        series_uid: SeriesInstanceUID of a DICOM volume.
        modality: Modality of a DICOM volume ("CT", "MR", ...).
        source: The file or folder it was read from.

    ``spacing`` (mm per step along i, j, k) is computed from ``affine``.
    """

    array: np.ndarray = field(repr=False)
    affine: np.ndarray
    patient_id: str | None = None
    series_uid: str | None = None
    modality: str | None = None
    source: Path | None = None
    spacing: tuple[float, float, float] = field(init=False)

    def __post_init__(self) -> None:
        if self.array.ndim != 3 or self.affine.shape != (4, 4):
            raise ValueError(f"Volume needs a 3-D array and a 4x4 affine, got {self.array.shape} and {self.affine.shape}")
        object.__setattr__(self, "spacing", tuple(float(n) for n in np.linalg.norm(self.affine[:3, :3], axis=0)))

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.array.shape


def read_volume(
    path: str | os.PathLike, *, series_uid: str | None = None, orientation: str | None = None
) -> Volume:
    """Read a volume: a NIfTI file, a folder holding a DICOM series, or an enhanced multi-frame DICOM file.

    NIfTI (``.nii``, ``.nii.gz``): nibabel's array (scl_slope / scl_inter applied) and affine (sform, else
    qform, else pixdim). DICOM: slices of the series (``series_uid`` chooses one when the folder holds several)
    ordered by position along the slice normal, i along columns, j along rows, k along the normal; values
    through the modality LUT; the affine converted from LPS to RAS+.

    Args:
        path: The file or folder.
        series_uid: SeriesInstanceUID to read from a folder holding several series.
        orientation: None keeps the stored axes; a 3-letter axis code (``"RAS"``, ``"LPS"``, ...) reorients the
            array to the closest such axes by flips and transposes and updates the affine (``"RAS"`` is nibabel's
            ``as_closest_canonical``). The geometry contract holds either way.

    Returns:
        The :class:`Volume`.

    Raises:
        ValueError: Invalid options.
        ImageNotFoundError: ``path`` does not exist.
        VolumeError: The file or folder cannot be read as one volume (one line: what, where, what is valid).
    """
    _check_orientation(orientation)
    if series_uid is not None and not isinstance(series_uid, str):
        raise ValueError(f"series_uid must be a SeriesInstanceUID string, got {series_uid!r}")
    try:
        return _read(Path(path), series_uid, orientation)
    except (VolumeError, ImageNotFoundError):
        raise
    except ImageReadError as exc:  # a file-level refusal of the DICOM / NIfTI readers underneath: same line
        raise VolumeError(str(exc)) from None


def _read(source: Path, series_uid: str | None, orientation: str | None) -> Volume:
    if source.is_dir():
        dicom = read_series_folder(source, series_uid)
    elif not source.exists():
        raise ImageNotFoundError(f"{source}: not found; {VOLUME_SOURCES}")
    elif series_uid is not None:
        raise ValueError(f"series_uid= chooses a series in a DICOM folder; {source} is a file")
    elif is_nifti(source):
        array, affine = read_nifti(source)
        return _finish(Volume(array, affine, source=source), orientation)
    elif image_kind(source) == "dicom":
        dicom = read_multiframe(source)
    else:
        suffix = repr(source.suffix) if source.suffix else "none"
        raise VolumeError(f"{source}: not a volume file (suffix {suffix}, not DICOM); {VOLUME_SOURCES}")
    volume = Volume(dicom.array, LPS_TO_RAS @ dicom.affine_lps, dicom.patient_id, dicom.series_uid, dicom.modality,
                    source)  # fmt: skip
    return _finish(volume, orientation)


def _check_orientation(orientation: str | None) -> None:
    if orientation is None:
        return
    letters = set(orientation.upper()) if isinstance(orientation, str) else set()
    pairs = ({"L", "R"}, {"A", "P"}, {"S", "I"})
    if len(orientation if isinstance(orientation, str) else "") != 3 or not all(len(letters & p) == 1 for p in pairs):
        raise ValueError(
            f"orientation must be None or a 3-letter axis code naming each of L/R, A/P, S/I once (e.g. 'RAS', 'LPS'), "
            f"got {orientation!r}"
        )


def _finish(volume: Volume, orientation: str | None) -> Volume:
    """Check the affine, then reorient when asked."""
    where, affine = volume.source, volume.affine
    if not np.isfinite(affine).all():
        raise VolumeError(f"{where}: the voxel-to-world affine has non-finite entries; {_affine_hint(where)}")
    singular = np.linalg.svd(affine[:3, :3], compute_uv=False)  # (3,) descending
    if not singular[-1] > 1e-6 * singular[0]:
        raise VolumeError(
            f"{where}: singular voxel-to-world affine (spacing {', '.join(f'{s:.4g}' for s in volume.spacing)} mm, "
            f"singular values {', '.join(f'{s:.3g}' for s in singular)}): its voxel axes must span 3-D space; "
            f"{_affine_hint(where)}"
        )
    if orientation is None:
        return volume
    array, affine = reorient(volume.array, affine, orientation.upper())
    return Volume(array, affine, volume.patient_id, volume.series_uid, volume.modality, volume.source)


def _affine_hint(where: Path | None) -> str:
    if where is not None and is_nifti(where):
        return "check the header's sform, qform and pixdim"
    return "check ImageOrientationPatient, PixelSpacing and the slice positions"


def reorient(array: np.ndarray, affine: np.ndarray, orientation: str = "RAS") -> tuple[np.ndarray, np.ndarray]:
    """Flip and transpose ``array`` to the axes closest to ``orientation`` and update ``affine`` to match.

    Exact (no resampling): nibabel's ``io_orientation`` picks, for each voxel axis, the world axis it is closest
    to; for ``"RAS"`` this is ``nibabel.as_closest_canonical``. Returns the inputs when nothing changes, else a
    Fortran-ordered copy of the array.
    """
    from nibabel import orientations

    transform = orientations.ornt_transform(orientations.io_orientation(affine), orientations.axcodes2ornt(orientation))
    if np.array_equal(transform, [[0, 1], [1, 1], [2, 1]]):
        return array, affine
    moved = np.asfortranarray(orientations.apply_orientation(array, transform))
    return moved, affine @ orientations.inv_ornt_aff(transform, array.shape)
