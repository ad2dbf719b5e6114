"""vitlab.data.image_data: the data module's record of its arguments (``arguments``, the LightningDataModule's
hparams) is complete, in the form the class takes, and rebuilds the same data module: samples, splits, classes,
channels and volume options. Runs reopen their data from it."""

from __future__ import annotations

import inspect
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from vitlab.data import DenseDataModule, MedicalDataModule
from vitlab.data.dense_data import DenseImageData
from vitlab.data.image_data import ImageData

AFFINE = np.diag([0.8, 0.8, 2.5, 1.0])


def volumes(root: Path, patients: int = 6) -> Path:
    """Class folders of random NIfTI volumes (16 x 16 x 6) with a lesion's label map each in the parallel masks/ tree."""
    rng = np.random.default_rng(3)
    for p in range(patients):
        label = ("a", "b")[p % 2]
        mask = np.zeros((16, 16, 6), np.uint8)
        mask[4:9, 5:8, p % 3 : p % 3 + 2] = 1  # a lesion through two slices
        for folder, array in ((root / label, rng.uniform(-100, 900, (16, 16, 6))), (root / "masks" / label, mask)):
            folder.mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(np.asarray(array, np.float32), AFFINE), folder / f"P{p}.nii.gz")
    return root


def manifest(root: Path) -> Path:
    """The volumes of :func:`volumes` in a manifest with a ``mask`` column (``slice_labels: mask`` reads masks from one)."""
    volumes(root)
    rows = ["path,mask,patient_id"] + [f"{p.relative_to(root)},{Path('masks', p.relative_to(root))},{p.stem}"
                                       for p in sorted(root.glob("[ab]/*.nii.gz"))]
    (root / "manifest.csv").write_text("\n".join(rows) + "\n")
    return root / "manifest.csv"


def parameters(cls: type) -> set[str]:
    """The arguments a data module class takes (jsonargparse follows DenseImageData's ``**kwargs`` to ImageData)."""
    names = {n for n, p in inspect.signature(cls).parameters.items() if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    return names | (parameters(ImageData) if cls is DenseImageData else set())


def same_data(a: ImageData, b: ImageData) -> None:
    assert type(a) is type(b) and a.arguments == b.arguments
    assert (a.class_names, a.in_chans, a.volume_options, a.read_options) == (b.class_names, b.in_chans, b.volume_options, b.read_options)
    for split in ("train", "val", "test"):
        assert a.samples(split) == b.samples(split)


CASES = {
    "images": lambda tmp, tiny: (ImageData, dict(root=str(tiny), image_size=32, in_chans=3, test_fraction=0.25, seed=4,
                                                window="soft_tissue", classes=["no_lesion", "lesion"], augment="strong")),
    "slabs by mask": lambda tmp, tiny: (ImageData, dict(root=str(manifest(tmp)), image_size=16, sample="slab", slab_radius=2,
                                                        slice_labels="mask", intensity="zscore", volumes_in_memory=2)),
    "volume patches": lambda tmp, tiny: (DenseImageData, dict(root=str(volumes(tmp)), sample="volume", spacing=[1.6, 1.6, 2.5],
                                                              volume_size=None, patch_size=[4, 4, 2], patch_foreground=0.25,
                                                              volume_flip=True, volume_intensity={"shift": 0.1},
                                                              mask_classes=["lesion"], val_fraction=0.34)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_record_is_every_argument_and_rebuilds_the_same_data(case, tmp_path, tiny_dataset):
    cls, kwargs = CASES[case](tmp_path, tiny_dataset)
    data = cls(**kwargs)
    assert set(data.arguments) == parameters(cls) - {"train_transforms"}  # (a Compose object is no hyperparameter)
    assert {k: data.arguments[k] for k in kwargs} == kwargs  # as given, not as resolved
    same_data(data, cls(**data.arguments))


def test_a_lightning_data_module_saves_the_record_as_its_hyperparameters(tiny_dataset, tmp_path):
    image = MedicalDataModule(root=str(tiny_dataset), image_size=32)
    dense = DenseDataModule(root=str(volumes(tmp_path)), sample="volume", volume_size=[8, 8, 4], mask_classes=["lesion"])
    for data in (image, dense):
        assert dict(data.hparams) == data.arguments
        same_data(data, type(data)(**dict(data.hparams)))
