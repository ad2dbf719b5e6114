"""Files -> arrays -> batches: DICOM/PNG reading, layouts, splits, synthetic data, DataModule."""

from vitlab.data.cache import ArrayCache, cache_root
from vitlab.data.datamodule import MedicalDataModule
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
from vitlab.data.synthetic import embedded_dataset, generate

__all__ = [
    "WINDOW_PRESETS",
    "ArrayCache",
    "ImageNotFoundError",
    "ImageReadError",
    "ImageReader",
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
