"""vitlab.callbacks.runtime: ``data/skipped_files``, logged by the run-time callback (the data knows no trainer): the
files left out at set-up at step 0, once per run (not again when a killed run resumes), and again at the end of a
training epoch in which files failing only when loaded raised the count. Read back from the event files."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from pydicom.data import get_testdata_file
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vitlab.callbacks import RuntimeCallback
from vitlab.data import MedicalDataModule, SkippedFileWarning


def data_with_bad_files(root: Path) -> tuple[MedicalDataModule, list[str]]:
    """PNG class folders with one truncated DICOM (refused at set-up) and two PNGs whose pixels are cut (their
    headers read: they fail only when loaded); the data module and the cut files."""
    rng = np.random.default_rng(1)
    for label in ("benign", "malignant"):
        (root / label).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(root / label / f"{i}.png")
    shutil.copy(get_testdata_file("MR_truncated.dcm", download=False), root / "benign" / "broken.dcm")
    cut = [root / "benign" / "1.png", root / "malignant" / "2.png"]
    for path in cut:
        path.write_bytes(path.read_bytes()[:60])
    dm = MedicalDataModule(root=str(root), image_size=16, batch_size=4, augment="none", val_fraction=0.0)
    with pytest.warns(SkippedFileWarning, match="broken.dcm"):
        dm.setup("fit")
    return dm, [str(p) for p in cut]


def trainer_of(dm, logger: TensorBoardLogger, step: int = 0) -> SimpleNamespace:
    """What the callback reads of a trainer: the data module, the loggers and the step (batches that stepped)."""
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step))
    return SimpleNamespace(datamodule=dm, loggers=[logger], logger=logger, is_global_zero=True, fit_loop=loop)


def points(logger: TensorBoardLogger) -> list[tuple[int, float]]:
    logger.save()
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    return [(e.step, e.value) for e in acc.Scalars("data/skipped_files")] if "data/skipped_files" in tags else []


def test_skipped_files_at_step_0_then_when_loads_raise_the_count(tmp_path):
    dm, cut = data_with_bad_files(tmp_path / "data")
    logger = TensorBoardLogger(tmp_path / "runs", name="run")
    callback = RuntimeCallback(figures="off")
    callback.setup(trainer_of(dm, logger), None, "fit")
    assert points(logger) == [(0, 1.0)]  # the truncated DICOM

    callback.on_train_epoch_end(trainer_of(dm, logger, step=3), None)  # nothing loaded yet: nothing new
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedFileWarning)
        list(dm.train_dataloader())
    callback.on_train_epoch_end(trainer_of(dm, logger, step=6), None)  # the two cut files: at the epoch's step
    list(dm.train_dataloader())
    callback.on_train_epoch_end(trainer_of(dm, logger, step=9), None)  # the same files again: no new point
    assert points(logger) == [(0, 1.0), (5, 3.0)] and dm.bad_paths == set(cut)


def test_a_resumed_run_keeps_its_first_starts_point(tmp_path):
    dm, _ = data_with_bad_files(tmp_path / "data")
    logger = TensorBoardLogger(tmp_path / "runs", name="run", purge_step=12)  # as train.py reopens a resumed run's
    callback = RuntimeCallback(figures="off")
    callback.setup(trainer_of(dm, logger, step=12), None, "fit")
    callback.on_train_epoch_end(trainer_of(dm, logger, step=15), None)
    assert points(logger) == []


def test_data_without_a_count_logs_nothing(tmp_path):
    logger = TensorBoardLogger(tmp_path / "runs", name="run")
    callback = RuntimeCallback(figures="off")
    callback.setup(trainer_of(None, logger), None, "fit")
    callback.on_train_epoch_end(trainer_of(None, logger, step=4), None)
    assert points(logger) == []
