"""Files -> arrays -> batches, in four layers a newcomer can read in order:

- :mod:`vitlab.data.readers`: one module per file format (PNG / JPEG / TIFF, DICOM, DICOM series and
  multi-frame, NIfTI) -> arrays in [0, 1] or volumes with their geometry;
- :mod:`vitlab.data.synthetic`: the generated CT data (2-D slices, 3-D volumes) the quickstarts train on;
- where the files are and which split each belongs to (:mod:`~vitlab.data.layouts`,
  :mod:`~vitlab.data.volume_layouts`), label maps and boxes (:mod:`~vitlab.data.masks`, :mod:`~vitlab.data.boxes`),
  and :mod:`vitlab.data.datasets`: samples -> tensors (images, images with dense targets, slices / slabs and
  whole volumes of volumes);
- the data modules: :class:`ImageData` / :class:`DenseImageData` (files -> splits -> loaders, no Lightning, as
  probes use them) and their LightningDataModules :class:`MedicalDataModule` / :class:`DenseDataModule`
  (``train.py``), with their volume options (:mod:`~vitlab.data.volume_options`), training order
  (:mod:`~vitlab.data.sampling`), augmentations (:mod:`~vitlab.data.transforms`) and caches (:mod:`~vitlab.data.cache`).

``docs/data.md`` maps every module to what it holds.
"""

from vitlab.data.cache import ArrayCache, cache_root
from vitlab.data.datasets.images import MedicalImageDataset
from vitlab.data.layouts import Sample, SkippedFileWarning
from vitlab.data.readers.dicom import modality_values
from vitlab.data.readers.errors import ImageNotFoundError, ImageReadError, VolumeError
from vitlab.data.readers.image import ImageReader, read_image
from vitlab.data.readers.options import ReadOptions
from vitlab.data.readers.window import WINDOW_PRESETS, window_values

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


_LAZY = {"embedded_dataset": "synthetic", "generate": "synthetic", "generate_volumes": "synthetic",
         "ImageData": "image_data", "DenseImageData": "dense_data", "MedicalDataModule": "datamodule",
         "DenseDataModule": "datamodule", "read_volume": "readers.volume", "Volume": "readers.volume"}


def __getattr__(name: str):
    """Load on first use: the data modules (Lightning, which probes do not import), the volume readers
    (nibabel) and the synthetic data generators."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"vitlab.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vitlab.data' has no attribute {name!r}")
