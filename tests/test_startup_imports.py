"""probe.py start-up: `--help` and the spectra probe import no Lightning / torchmetrics (matplotlib only to draw)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAINING_ONLY = ("pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics")


def imported_after(code: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint('MODULES=' + json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("MODULES=")][-1]
    return set(json.loads(line[len("MODULES="):]))


@pytest.mark.slow
def test_probe_help_imports_no_training_stack_nor_drawing():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['probe.py', '--help']\n"
        "try:\n    runpy.run_path('probe.py', run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
    )
    loaded = imported_after(code)
    assert not loaded & {*TRAINING_ONLY, "matplotlib", "timm", "torchvision"}, sorted(loaded & {*TRAINING_ONLY, "matplotlib", "timm", "torchvision"})


@pytest.mark.slow
def test_spectra_probe_parser_and_run_import_no_lightning(tmp_path):
    from vitlab.models import build_model

    kwargs = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}
    model = build_model("vit_tiny_patch16_224", 2, in_chans=1, **kwargs)
    ckpt = tmp_path / "last.ckpt"  # what a vitlab training checkpoint holds for probes
    torch.save({"hyper_parameters": {"model_name": "vit_tiny_patch16_224", "num_classes": 2, "in_chans": 1, "model_kwargs": kwargs},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, ckpt)
    argv = ["spectra", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")]
    parsed = imported_after(f"from vitlab.probes import build_parser\nbuild_parser({argv!r}).parse_args({argv!r})")
    assert not parsed & set(TRAINING_ONLY), sorted(parsed & set(TRAINING_ONLY))
    ran = imported_after(f"from vitlab.probe_cli import probe_main\nprobe_main({argv!r})")
    assert not ran & set(TRAINING_ONLY), sorted(ran & set(TRAINING_ONLY))
    assert (tmp_path / "out" / "spectra.csv").is_file()


def test_importing_vitlabs_augmentations_asks_no_server_for_albumentations_updates():
    """albumentations checks PyPI for a newer version at import unless ``NO_ALBUMENTATIONS_UPDATE`` is set; vitlab
    sets it (keeping a value the user set), so loading data makes no network request."""
    probe = (
        "import urllib.request\n"
        "calls = []\n"
        "def refuse(self, *args, **kwargs):\n"
        "    calls.append(args)\n"
        "    raise OSError('no network in this test')\n"
        "urllib.request.OpenerDirector.open = refuse\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "import {module}\n"
        "print('REQUESTS=%d' % len(calls))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "NO_ALBUMENTATIONS_UPDATE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def requests(module: str, **extra: str) -> int:
        done = subprocess.run([sys.executable, "-c", probe.format(module=module)], cwd=ROOT, env={**env, **extra},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split("REQUESTS=")[-1])

    assert requests("vitlab.data.transforms") == 0
    import importlib.util

    if importlib.util.find_spec("albumentations.check_version") is not None:  # (releases that still check)
        assert requests("albumentations") == 1  # without vitlab it asks
        assert requests("vitlab.data.transforms", NO_ALBUMENTATIONS_UPDATE="0") == 1  # the user's choice is kept
