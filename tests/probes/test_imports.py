"""No probe subcommand imports Lightning (nor torchmetrics): each one's module, its parser, the model it loads
from a training checkpoint and the images it draws from the run's data section; and drift, claims and
attention end to end on a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitlab.probes import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
TRAINING_ONLY = {"pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics"}


def imported_after(code: str, cwd: Path) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint('MODULES=' + json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("MODULES=")][-1]
    return set(json.loads(line[len("MODULES="):]))


@pytest.fixture(scope="module")
def tiny_run(tiny_dataset, tmp_path_factory) -> Path:
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit

    cli = fit(tiny_args(tiny_dataset, tmp_path_factory.mktemp("probe-imports"), epochs=1))
    return Path(cli.trainer.log_dir)


@pytest.mark.slow
def test_no_probe_subcommand_its_model_or_its_images_import_lightning(tiny_run, tmp_path):
    """Every subcommand in one fresh interpreter, one after the other: its module, its parser, the model it loads
    from a training checkpoint and its images; the first one that brings in a training-only package is named."""
    ckpt = tiny_run / "checkpoints" / "last.ckpt"
    code = (
        "import importlib, argparse, contextlib, io, sys\n"
        "from vitlab.probes import build_parser, SUBCOMMANDS\n"
        "from vitlab.probes.loading import load_model\n"
        "from vitlab.probes.streams import image_stream\n"
        f"training_only = {sorted(TRAINING_ONLY)!r}\n"
        "def check(step):\n"
        "    found = sorted({m.split('.')[0] for m in sys.modules} & set(training_only))\n"
        "    assert not found, f'{step} imported {found}'\n"
        "for subcommand in sorted(SUBCOMMANDS):\n"
        "    importlib.import_module(SUBCOMMANDS[subcommand])\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        build_parser([subcommand, '--help']).parse_args([subcommand, '--help'])\n"
        "    check(subcommand)\n"
        f"args = argparse.Namespace(checkpoint={str(ckpt)!r}, config=None, model=None, pretrained=False, weights=None,\n"
        "                           model_kwargs=None, num_classes=None, in_chans=None, images=None, num_images=2, split='val', seed=0)\n"
        "loaded = load_model(args)\n"
        "stream = image_stream(args, loaded, 2)\n"
        "assert next(stream.batches(2)).shape[0] == 2\n"
        "check('load_model / image_stream')\n"
    )
    loaded = imported_after(code, tmp_path)
    assert not loaded & TRAINING_ONLY, sorted(loaded & TRAINING_ONLY)
    assert len(SUBCOMMANDS) >= 8


@pytest.mark.slow
def test_drift_claims_and_attention_run_without_lightning(tiny_run, tmp_path):
    ckpt = str(tiny_run / "checkpoints" / "last.ckpt")
    runs = [
        ["drift", "--reference", str(tiny_run / "qkv" / "epoch_000.safetensors"), "--finetuned", ckpt, "--out", str(tmp_path / "drift")],
        ["claims", "--run", str(tiny_run), "--out", str(tmp_path / "claims"), "--permutations", "19"],
        ["attention", "--checkpoint", ckpt, "--num-images", "2", "--out", str(tmp_path / "attention")],
    ]
    for argv in runs:
        loaded = imported_after(f"from vitlab.probe_cli import probe_main\nprobe_main({argv!r})", tmp_path)
        assert not loaded & TRAINING_ONLY, (argv[0], sorted(loaded & TRAINING_ONLY))
    assert any((tmp_path / "drift").iterdir()) and any((tmp_path / "claims").iterdir()) and any((tmp_path / "attention").iterdir())
