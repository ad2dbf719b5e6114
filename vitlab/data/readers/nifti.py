"""NIfTI-1/2 files: the (I, J, K) array (scl_slope / scl_inter applied) and nibabel's voxel -> RAS+ affine.

Read through :func:`~vitlab.data.readers.volume.read_volume`, which checks the affine and gives the
:class:`~vitlab.data.readers.volume.Volume`; here what is not one finite 3-D scalar volume is refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from vitlab.data.readers.errors import VOLUME_SOURCES, VolumeError, file_errors

NIFTI_SUFFIXES = (".nii", ".nii.gz")


def is_nifti(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a NIfTI file (by its suffix, any case)."""
    return Path(path).name.lower().endswith(NIFTI_SUFFIXES)


def read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A NIfTI-1/2 file's (I, J, K) float32 array (scaling applied) and its affine; refuses what is not one."""
    import nibabel

    with file_errors(path, "not a readable NIfTI file"):
        try:
            image = nibabel.load(path, mmap=False)
        except nibabel.filebasedimages.ImageFileError as exc:
            raise VolumeError(f"{path}: not a NIfTI file ({' '.join(str(exc).split())}); {VOLUME_SOURCES}") from None
        if not isinstance(image, (nibabel.Nifti1Image, nibabel.Nifti2Image)):
            raise VolumeError(f"{path}: a {type(image).__name__}, not a NIfTI-1/2 image; {VOLUME_SOURCES}")
        shape = image.shape
        while len(shape) > 3 and shape[-1] == 1:  # trailing unit axes (x, y, z, 1): still one volume
            shape = shape[:-1]
        if len(shape) != 3:
            many = f"holds {int(np.prod(shape[3:]))} volumes" if len(shape) > 3 else "is not a volume"
            raise VolumeError(f"{path}: {len(image.shape)}-D NIfTI of shape {image.shape} {many}; read_volume reads 3-D images")
        dtype = image.get_data_dtype()
        if dtype.fields is not None or dtype.kind == "c":
            raise VolumeError(f"{path}: NIfTI data type {dtype} (colour or complex); read_volume reads real scalar voxels")
        try:
            array = image.get_fdata(dtype=np.float32).reshape(shape, order="A")
        except (EOFError, OSError, ValueError) as exc:  # gzip / zlib / short reads
            raise VolumeError(
                f"{path}: truncated or corrupt NIfTI data ({type(exc).__name__}: {' '.join(str(exc).split())}); "
                f"the header announces shape {image.shape} of {dtype}"
            ) from None
        affine = np.array(image.affine, dtype=np.float64)
    if not np.isfinite(array).all():
        bad = ~np.isfinite(array)
        first = tuple(int(v) for v in np.argwhere(bad)[0])
        raise VolumeError(
            f"{path}: {int(bad.sum())} NaN or infinite voxels (the first at {list(first)}); a volume must be finite "
            "everywhere (check the data and scl_slope / scl_inter)"
        )
    return array, affine
