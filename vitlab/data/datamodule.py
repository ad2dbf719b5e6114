"""The LightningDataModules ``train.py`` builds: :class:`ImageData` / :class:`DenseImageData` with Lightning's
hooks, their arguments saved as the data module's hyperparameters (the arguments and their docs are those of
the data classes: jsonargparse follows ``**kwargs`` to them)."""

from __future__ import annotations

import pytorch_lightning as pl

from vitlab.data.dense_data import DenseImageData
from vitlab.data.datasets.targets import widen_label_maps
from vitlab.data.image_data import ImageData


class _AfterTransfer:
    """Lightning's hook after a batch reaches its device: images that the loaders left unnormalised
    (:attr:`ImageData.normalize_on_device`) are normalised there, and label maps that travelled narrow (a loader
    worker's :class:`~vitlab.data.datasets.targets.PackedTargets`) are widened back to int64."""

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        batch = self.normalize_batch(batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], list):
            batch = type(batch)([batch[0], widen_label_maps(batch[1])])
        return batch


class MedicalDataModule(_AfterTransfer, ImageData, pl.LightningDataModule):
    """:class:`~vitlab.data.image_data.ImageData` as a LightningDataModule (classification, DINO)."""

    def __init__(self, *args, **kwargs) -> None:
        pl.LightningDataModule.__init__(self)
        super().__init__(*args, **kwargs)
        self.save_hyperparameters(self.arguments)


class DenseDataModule(_AfterTransfer, DenseImageData, pl.LightningDataModule):
    """:class:`~vitlab.data.dense_data.DenseImageData` as a LightningDataModule (detection, segmentation)."""

    def __init__(self, *args, **kwargs) -> None:
        pl.LightningDataModule.__init__(self)
        super().__init__(*args, **kwargs)
        self.save_hyperparameters(self.arguments)
