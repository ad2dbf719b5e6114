"""Tiny training runs through train.py's CLI, and their TensorBoard events read back.

:func:`tiny_args` (a tiny Swin classifier on a DICOM manifest, Q/K/V callbacks on), :func:`dense_args` (detection or
segmentation on the embedded synthetic data), :data:`DINO_TINY` (the DINO module's tiny arguments) and
:data:`DDP_SPAWN` (a 2-process CPU strategy) build runs; :func:`train_py` runs ``train.py`` in a process of its own
(as a distributed run starts); :func:`events` and :func:`all_points` read what they logged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TINY_SWIN = {
    "model_name": "swin_tiny_patch4_window7_224",
    "model_kwargs": {"img_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2], "window_size": 4, "drop_path_rate": 0.0},
}
# the dense tasks' tiny Swin (its image size comes from the data module)
DENSE_SWIN = {"model_name": "swin_tiny_patch4_window7_224",
              "model_kwargs": {"patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2], "window_size": 4}}
DINO_TINY = dict(model_name="vit_tiny_patch16_224", model_kwargs=dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, dynamic_img_size=True),
                 out_dim=64, hidden_dim=32, bottleneck_dim=16, local_crops=2, local_size=16)
# a collective that one rank never reaches fails after 3 minutes instead of hanging the suite
DDP_SPAWN = {"class_path": "pytorch_lightning.strategies.DDPStrategy", "init_args": {"start_method": "spawn", "timeout": "0:03:00"}}
QKV_CALLBACKS = [{"class_path": "vitlab.callbacks.QKVSnapshot"}, {"class_path": "vitlab.callbacks.QKVDrift"},
                 {"class_path": "vitlab.callbacks.QKSpectra"}]


def _trainer(epochs: int, save_dir: Path, name: str) -> dict:
    """A CPU trainer logging every step to TensorBoard under ``save_dir/name``, the Q/K/V callbacks on."""
    return {
        "max_epochs": epochs, "accelerator": "cpu", "devices": 1, "log_every_n_steps": 1,
        "enable_progress_bar": False, "enable_model_summary": False,
        "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": str(save_dir), "name": name, "default_hp_metric": False}},
        "callbacks": list(QKV_CALLBACKS),
    }


def _config_args(cfg: dict, path: Path, extra: list[str] | None) -> list[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path), *(extra or [])]


def tiny_args(manifest: Path, save_dir: Path, epochs: int = 2, extra: list[str] | None = None) -> list[str]:
    """train.py arguments: a tiny Swin classifier on ``manifest`` (32 px), logged to ``save_dir/tiny/version_N``."""
    cfg = {
        "seed_everything": 0,
        "trainer": _trainer(epochs, save_dir, "tiny"),
        "model": {**TINY_SWIN, "lr": 1e-3, "warmup_epochs": 0.5},
        "runtime": {"workers": 0}, "data": {"root": str(manifest), "image_size": 32, "batch_size": 8, "augment": "light", "val_fraction": 0.25},
    }
    return _config_args(cfg, save_dir / "cfg.yaml", extra)


def dense_args(task: str, save_dir: Path, epochs: int, extra: list[str] | None = None) -> list[str]:
    """train.py arguments: ``task`` (detection / segmentation) on 6 embedded synthetic patients, logged to
    ``save_dir/<task>/version_N``."""
    cfg = {
        "task": task,
        "seed_everything": 0,
        "trainer": _trainer(epochs, save_dir, task),
        "model": {**DENSE_SWIN, "lr": 2e-3, "warmup_epochs": 0.5},
        "runtime": {"workers": 0},
        "data": {"root": None, "embedded_kwargs": {"patients": 6, "slices": 2, "size": 32, "difficulty": 0.0},
                 "image_size": 32, "batch_size": 4, "augment": "light", "val_fraction": 0.34},
    }
    return _config_args(cfg, save_dir / f"{task}.yaml", extra)


REPO = Path(__file__).resolve().parents[2]


def train_py(*args: str) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` from the repository root, offline, as a multi-device run starts (Lightning runs the script
    again for every other rank); asserts that it ended well and printed the closing report once (rank 0)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("vitlab: run finished.") == 1, done.stdout
    return done


def events(run_dir: Path) -> EventAccumulator:
    """Every event of a run folder (no sampling), as TensorBoard reads it back."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def all_points(run: Path) -> dict[str, list[tuple[int, object]]]:
    """kind:tag -> [(step, value)] as TensorBoard's EventAccumulator reads them back (images: their tag and step)."""
    acc = events(run)
    points: dict[str, list[tuple[int, object]]] = {}
    for tag in acc.Tags()["scalars"]:
        points[f"scalars:{tag}"] = [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()["histograms"]:
        points[f"histograms:{tag}"] = [(e.step, e.histogram_value) for e in acc.Histograms(tag)]
    for tag in acc.Tags()["tensors"]:
        points[f"tensors:{tag}"] = [(e.step, str(e.tensor_proto).replace(str(run), "<run>")) for e in acc.Tensors(tag)]
    for tag in acc.Tags()["images"]:
        points[f"images:{tag}"] = [(e.step, None) for e in acc.Images(tag)]
    return points
