"""The probes' shared set-ups: randomised tiny weights per family, a folder of tiny DICOMs, the figures a probe logs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vitlab.models.testing import tiny_model


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """Randomised tiny weights per family (default init would make attention uniform and MI trivial)."""
    folder = tmp_path_factory.mktemp("tiny-weights")
    paths = {}
    for family in ("timm-vit", "timm-swin", "timm-mixer", "torchvision-vit"):
        paths[family] = folder / f"{family}.pt"
        torch.save(tiny_model(family, num_classes=2, seed=1).state_dict(), paths[family])
    return paths


@pytest.fixture(scope="module")
def image_dir(tiny_dataset) -> Path:
    """The tiny DICOM dataset's folder (what ``--images FOLDER`` reads)."""
    return Path(tiny_dataset).parent


@pytest.fixture
def figures(monkeypatch):
    """Every figure the probes hand to TensorBoard's ``add_figure``, by tag (a tag's last), kept open to be read."""
    from torch.utils.tensorboard import SummaryWriter

    import matplotlib.pyplot as plt

    seen, kept = {}, []
    original = SummaryWriter.add_figure

    def capture(self, tag, figure, *args, **kwargs):
        seen[tag] = figure
        kept.append(figure)
        kwargs["close"] = False
        return original(self, tag, figure, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_figure", capture)
    yield seen
    for figure in kept:  # closed as add_figure would have (pyplot's figures stay open otherwise)
        plt.close(figure)
