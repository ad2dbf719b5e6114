"""Shared test setup: offline hub, a private cache folder (shared by the run's worker processes: its entries are
written atomically), small thread counts, the number of worker processes, tiny generated data."""

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


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (setup.cfg's addopts): a worker process per core this process may use, at most 4 (each holds
    torch, Lightning and timm, and the fits in it take every core for their threads); none on one core.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets it, as in pytest-xdist."""
    from vitlab.runtime import available_cores

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = available_cores()
    return min(cores, 4) if cores > 1 else 0


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
