"""Building blocks of the synthetic phantoms (2-D slices and 3-D volumes): correlated noise, soft shapes, DICOM data sets."""

from __future__ import annotations

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian

LABELS = ("lesion", "no_lesion")  # the label of a slice (2-D) or a patient (volumes)
INTERCEPT_HU = -1024.0  # RescaleIntercept of the synthetic CT: stored int16 = HU + 1024


def smooth_field(rng: np.random.Generator, shape: tuple[int, ...], sigma_px: float) -> np.ndarray:
    """Gaussian-filtered white noise (periodic, via FFT), scaled to unit std, float32."""
    noise = rng.standard_normal(shape)
    freqs = np.meshgrid(*[np.fft.fftfreq(n) for n in shape[:-1]], np.fft.rfftfreq(shape[-1]), indexing="ij")
    gain = np.exp(-2.0 * (np.pi * sigma_px) ** 2 * sum(f**2 for f in freqs))
    field = np.fft.irfftn(np.fft.rfftn(noise) * gain, s=shape, axes=tuple(range(len(shape))))
    return (field / (field.std() + 1e-12)).astype(np.float32)


def soft(inside_distance: np.ndarray, edge: float) -> np.ndarray:
    """Soft indicator: 1 inside, 0 outside, logistic edge of width ``edge`` (the distance's unit: px or mm)."""
    return 1.0 / (1.0 + np.exp(-np.clip(inside_distance / edge, -30, 30)))


def dicom_dataset(sop_class_uid: str, sop_instance_uid: str) -> Dataset:
    """A new DICOM data set with its file meta (Explicit VR Little Endian) and SOP class / instance UIDs."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = sop_class_uid, sop_instance_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = sop_class_uid, sop_instance_uid
    return ds
