"""Files -> arrays -> batches: images (DICOM, PNG, ...) and volumes (NIfTI, DICOM series), layouts, splits,
synthetic data, DataModules."""

from vitlab.data.cache import ArrayCache, cache_root
from vitlab.data.dataset import MedicalImageDataset
from vitlab.data.io import (
    WINDOW_PRESETS,
    ImageNotFoundError,
    ImageReader,
    ImageReadError,
    ReadOptions,
    modality_values,
    read_image,
    window_values,
)
from vitlab.data.layouts import Sample, SkippedFileWarning
from vitlab.data.read_options import VolumeError

__all__ = [
    "WINDOW_PRESETS",
    "ArrayCache",
    "ImageNotFoundError",
    "ImageReadError",
    "ImageReader",
    "DenseDataModule",
    "DenseImageData",
    "ImageData",
    "MedicalDataModule",
    "MedicalImageDataset",
    "ReadOptions",
    "Sample",
    "SkippedFileWarning",
    "Volume",
    "VolumeError",
    "cache_root",
    "embedded_dataset",
    "generate",
    "generate_volumes",
    "modality_values",
    "read_image",
    "read_volume",
    "window_values",
]


_LAZY = {"embedded_dataset": "synthetic", "generate": "synthetic", "ImageData": "image_data", "MedicalDataModule": "datamodule",
         "DenseImageData": "dense_data", "DenseDataModule": "datamodule", "read_volume": "volume", "Volume": "volume",
         "generate_volumes": "synthetic_volumes"}


def __getattr__(name: str):
    """Load on first use: the data modules (Lightning, which probes do not import), the volume readers
    and ``embedded_dataset`` / ``generate`` / ``generate_volumes`` (importing them eagerly would make
    ``python -m vitlab.data.synthetic`` load that module twice)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"vitlab.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vitlab.data' has no attribute {name!r}")
