"""probe.py's command line on the tiny weights of ``tests/probes/conftest.py``, and what it reads and writes."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import torch

from vitlab import models
from vitlab.models.testing import TINY_MODELS
from vitlab.probes.loading import LoadedModel
from vitlab.probes.streams import load_images


def model_args(family: str, weights: dict[str, Path], prefix: str = "") -> list[str]:
    """``--model NAME --model-kwargs JSON --weights FILE`` of a tiny family (``prefix``: e.g. ``second-``)."""
    name, kwargs = TINY_MODELS[family]
    return [f"--{prefix}model", name, f"--{prefix}model-kwargs", json.dumps(kwargs), f"--{prefix}weights", str(weights[family])]


def load(family: str, weights: dict[str, Path]) -> torch.nn.Module:
    """The model the probe builds from :func:`model_args`, in eval mode."""
    name, kwargs = TINY_MODELS[family]
    return models.build_model(name, 2, weights=str(weights[family]), **kwargs).eval()


def probe_images(model: torch.nn.Module, folder: Path):
    """The images the probe sees with --images FOLDER (same files, order and normalisation)."""
    args = argparse.Namespace(images=[str(folder)], num_images=None, split="val", seed=0)
    return load_images(args, LoadedModel(model, "m", "test"), 10_000)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as handle:
        return list(csv.DictReader(handle))
