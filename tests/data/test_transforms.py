"""vitlab.data.transforms: OpenCV (albumentations' backend) on one thread in every process that loads data, set in
one place (``single_opencv_thread``): the process that makes a loader, and each loader worker as it starts."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import MedicalDataModule
from vitlab.data.transforms import seed_worker


class _CV2Threads(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return cv2.getNumThreads()


@pytest.fixture
def opencv_threads():
    """OpenCV's thread count as it was, put back after the test."""
    before = cv2.getNumThreads()
    yield
    cv2.setNumThreads(before)


def test_loader_workers_run_opencv_on_one_thread(opencv_threads):
    cv2.setNumThreads(3)  # what a forked worker inherits
    loader = torch.utils.data.DataLoader(_CV2Threads(), batch_size=1, num_workers=1, worker_init_fn=seed_worker)
    assert [int(b) for b in loader] == [1, 1]
    control = torch.utils.data.DataLoader(_CV2Threads(), batch_size=1, num_workers=1)
    assert [int(b) for b in control] == [3, 3]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_process_making_a_loader_runs_opencv_on_one_thread(tmp_path, opencv_threads, workers):
    """The training process augments the batches itself without workers, and forks them with: one thread either way."""
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(tmp_path / label / f"{i}.png")
    dm = MedicalDataModule(root=str(tmp_path), image_size=16, batch_size=2, val_fraction=0.0, num_workers=workers)
    cv2.setNumThreads(3)
    dm.train_dataloader()
    assert cv2.getNumThreads() == 1
