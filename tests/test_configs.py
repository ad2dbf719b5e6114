"""Every shipped config parses; the small ones train a step; the pretrained ones fail fast offline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from vitlab.cli import fit, train_main

STUDIES = sorted((Path(__file__).parent.parent / "configs").glob("study_*.yaml"))  # grids for train.py --study
CONFIGS = sorted(set((Path(__file__).parent.parent / "configs").glob("*.yaml")) - set(STUDIES))
DENSE = [c for c in CONFIGS if c.stem in ("quickstart_detection", "quickstart_segmentation")]  # need masks
VOLUMES = [c for c in CONFIGS if c.stem in ("quickstart_slab", "quickstart_volume")]  # need volumes
SMALL = [c for c in CONFIGS if c.stem.startswith(("ablation_", "mixer", "quickstart", "dino")) and c not in DENSE + VOLUMES and c.stem != "quickstart_pretrained"]


def test_all_configs_listed():
    names = {c.stem for c in CONFIGS}
    assert {"quickstart", "medical_swin", "medical_vit", "mixer", "ablation_residual", "ablation_layernorm", "ablation_attention", "ablation_mlp",
            "quickstart_detection", "quickstart_segmentation", "medical_swin_maskrcnn", "medical_vit_maskrcnn", "quickstart_slab",
            "quickstart_volume", "medical_vit3d", "medical_swinunetr"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exc:
        fit(["--config", str(config), "--print_config"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert "model_name" in printed and "trainer" in printed


@pytest.mark.slow  # (the whole grid through the train parser)
@pytest.mark.parametrize("study", STUDIES, ids=lambda c: c.stem)
def test_study_file_plans_over_the_quickstart(study, capsys):
    with pytest.raises(SystemExit) as exc:
        fit(["--config", "quickstart", "--study", str(study), "--print_config"])
    assert exc.value.code == 0 and "cells:" in capsys.readouterr().out


@pytest.mark.parametrize("config", SMALL, ids=lambda c: c.stem)
@pytest.mark.slow
def test_small_config_trains_one_step(config, tiny_dataset, tmp_path):
    cli = fit([
        "--config", str(config),
        "--data.root", str(tiny_dataset), "--runtime.workers", "0", "--data.batch_size", "4",
        "--trainer.max_epochs", "1", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
    ])
    assert cli.trainer.global_step == 1
    ablate = cli.config.model.get("ablate")
    if ablate:
        from vitlab.models import ablation_state

        assert ablation_state(cli.model.model), "the config's ablation was not applied"


@pytest.mark.parametrize("config", VOLUMES, ids=lambda c: c.stem)
@pytest.mark.slow
def test_volume_config_trains_one_step(config, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    cli = fit([
        "--config", str(config), "--data.embedded_kwargs", '{"patients": 4, "slices": 3, "size": 64}',
        "--runtime.workers", "0", "--data.batch_size", "4", "--data.val_fraction", "0.5",
        "--trainer.max_epochs", "1", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
        *(["--trainer.precision", "bf16-mixed"] if config.stem == "quickstart_volume" else []),  # SwinUNETR under CPU autocast
    ])
    assert cli.trainer.global_step == 1 and cli.datamodule.volume_options is not None
    if config.stem == "quickstart_volume":
        assert cli.trainer.precision == "bf16-mixed" and torch.isfinite(cli.trainer.callback_metrics["train/loss_step"])


@pytest.mark.parametrize("config", DENSE, ids=lambda c: c.stem)
@pytest.mark.slow
def test_dense_config_trains_one_step(config, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    cli = fit([
        "--config", str(config), "--data.embedded_kwargs", '{"patients": 4, "slices": 2, "size": 32}',
        "--data.image_size", "32", "--runtime.workers", "0", "--data.batch_size", "2", "--data.val_fraction", "0.5",
        "--trainer.max_epochs", "1", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.precision", "bf16-mixed",  # CPU autocast here; the fp32 path runs in tests/training/test_dense.py
    ])
    assert cli.trainer.global_step == 1 and cli.model.hparams.image_size == 32


TINY_BACKBONES = {  # the full-scale dense configs' recipe (heads, optimizer groups, layer decay) on a tiny backbone
    "medical_swin_maskrcnn": ("swin_tiny_patch4_window7_224",
                              {"patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2], "window_size": 4}),
    "medical_vit_maskrcnn": ("vit_tiny_patch16_224", {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(TINY_BACKBONES))
def test_full_scale_dense_config_trains_one_step_on_a_tiny_backbone(config, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    name, kwargs = TINY_BACKBONES[config]
    cli = fit([
        "--config", str(CONFIGS[0].parent / f"{config}.yaml"), "--model.model_name", name, "--model.pretrained", "false",
        "--model.model_kwargs", json.dumps(kwargs), "--data.embedded_kwargs", '{"patients": 4, "slices": 2, "size": 32}',
        "--data.image_size", "32", "--runtime.workers", "0", "--data.batch_size", "2", "--data.val_fraction", "0.5",
        "--trainer.max_epochs", "1", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
        "--trainer.devices", "1", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ])
    assert cli.trainer.global_step == 1 and cli.model.hparams.heads == "full"
    assert cli.model.model.backbone.is_plain == config.startswith("medical_vit")
    scales = {round(g["initial_lr"] / cli.model.hparams.lr, 6) for g in cli.trainer.optimizers[0].param_groups}
    assert (len(scales) > 2) == (cli.model.hparams.layer_decay is not None)  # layer-wise decay reached the backbone


@pytest.mark.parametrize("config", ["medical_swin", "medical_vit", "medical_swin_maskrcnn", "medical_vit_maskrcnn"])
@pytest.mark.slow
def test_pretrained_offline_fails_fast_with_a_way_forward(config, tiny_dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        train_main(["--config", str(Path("configs") / f"{config}.yaml"), "--data.root", str(tiny_dataset), "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert exc.value.code == 2
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "model.weights" in err[0] and "pretrained: false" in err[0]


def test_pretrained_quickstart_without_its_pretraining_names_the_command(tiny_dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).parent.parent)  # the config's relative runs/ path and configs/ folder
    weights = Path("runs/dino_pretrain/version_0/checkpoints/last.ckpt")
    if weights.exists():
        pytest.skip("a dino_pretrain run exists in this checkout")
    with pytest.raises(SystemExit) as exc:
        train_main(["--config", "configs/quickstart_pretrained.yaml", "--data.root", str(tiny_dataset), "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python train.py --config configs/dino_pretrain.yaml" in err[0]


@pytest.mark.parametrize("config, expected", [("medical_vit3d", "pretrained: false"), ("medical_swinunetr", "model_swinvit.pt")])
@pytest.mark.slow
def test_full_scale_volume_configs_stop_offline_with_a_way_forward(config, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        train_main(["--config", str(Path("configs") / f"{config}.yaml"), "--data.embedded_kwargs", '{"patients": 4, "slices": 3, "size": 32}',
                    "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert exc.value.code == 2 and time.perf_counter() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.weights" in err[0] and expected in err[0]
