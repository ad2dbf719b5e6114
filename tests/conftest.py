"""Shared test setup: offline hub, a private cache folder, small thread counts, tiny generated data."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VITLAB_CACHE", tempfile.mkdtemp(prefix="vitlab-test-cache-"))
os.environ.setdefault("PYTHONHASHSEED", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny tensors: a second thread only adds OpenMP barriers (fits set their own threads)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: threads only add contention on a shared machine (use with ``usefixtures``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A tiny embedded-style DICOM lesion dataset (manifest path): 8 patients x 4 slices, 32 px."""
    from vitlab.data.synthetic import generate

    return generate(tmp_path_factory.mktemp("tiny-data"), seed=0, patients=8, slices=4, size=32)
