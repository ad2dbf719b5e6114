"""Files -> arrays -> batches: DICOM/PNG reading, layouts, splits, synthetic data, DataModule."""

from vitlab.data.cache import ArrayCache, cache_root
from vitlab.data.datamodule import MedicalDataModule
from vitlab.data.dense_datamodule import DenseDataModule
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

__all__ = [
    "WINDOW_PRESETS",
    "ArrayCache",
    "ImageNotFoundError",
    "ImageReadError",
    "ImageReader",
    "DenseDataModule",
    "MedicalDataModule",
    "MedicalImageDataset",
    "ReadOptions",
    "Sample",
    "SkippedFileWarning",
    "cache_root",
    "embedded_dataset",
    "generate",
    "modality_values",
    "read_image",
    "window_values",
]


def __getattr__(name: str):
    """Load ``embedded_dataset`` and ``generate`` on first use.

    Importing them eagerly would make ``python -m vitlab.data.synthetic`` load that module twice.
    """
    if name in ("embedded_dataset", "generate"):
        from vitlab.data import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module 'vitlab.data' has no attribute {name!r}")
