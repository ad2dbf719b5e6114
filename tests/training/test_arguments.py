"""The backbone / optimiser arguments the four tasks share: declared and checked once on the base, still flat keys."""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("lightly")

from tests.helpers.runs import DENSE_SWIN  # noqa: E402
from vitlab.cli import TASKS, fit  # noqa: E402
from vitlab.training import TaskModule  # noqa: E402
from vitlab.training.arguments import OptimizerArgs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {"classification": "quickstart", "detection": "quickstart_detection",
           "segmentation": "quickstart_segmentation", "dino": "dino_pretrain"}
SHARED = list(inspect.signature(TaskModule.__init__).parameters)[1:]  # model_name ... min_lr_ratio
# what the CLI links from the data into each task
LINKED = {"classification": {"num_classes": 2, "class_names": ["a", "b"]}, "dino": {"num_classes": 2, "class_names": ["a", "b"]},
          "detection": {"num_classes": 1, "class_names": ["lesion"], "image_size": 32},
          "segmentation": {"num_classes": 1, "class_names": ["lesion"], "image_size": 32}}


def module_class(task: str) -> type:
    return TASKS[task][0]


def small(task: str, **overrides) -> TaskModule:
    """A task module over a tiny Swin with the data links filled in."""
    backbone = dict(DENSE_SWIN, model_kwargs=dict(DENSE_SWIN["model_kwargs"], img_size=32))
    return module_class(task)(**backbone, in_chans=1, **LINKED[task], **overrides)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize(("key", "value", "message"), [
    ("layer_decay", 1.5, "model.layer_decay must be in (0, 1] or null, got 1.5"),
    ("layer_decay", 0.0, "model.layer_decay must be in (0, 1] or null, got 0.0"),
    ("lr", 0.0, "model.lr must be > 0, got 0.0"),
    ("weight_decay", -0.1, "model.weight_decay must be >= 0, got -0.1"),
    ("warmup_epochs", -1.0, "model.warmup_epochs must be >= 0, got -1.0"),
    ("min_lr_ratio", 1.5, "model.min_lr_ratio must be in [0, 1], got 1.5"),
])
def test_every_task_refuses_a_bad_optimiser_value_with_one_message(task, key, value, message, monkeypatch):
    from vitlab import models

    def never(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    for builder in ("build_model", "build_detector", "build_segmenter"):
        monkeypatch.setattr(models, builder, never)
    with pytest.raises(ValueError) as info:
        module_class(task)(**{key: value})
    assert str(info.value) == message


def test_optimizer_args_accept_the_edges():
    OptimizerArgs(lr=1e-6, weight_decay=0.0, layer_decay=1.0, warmup_epochs=0.0, min_lr_ratio=0.0)
    OptimizerArgs(layer_decay=None, min_lr_ratio=1.0)
    with pytest.raises(ValueError, match="model.lr must be > 0, got nan"):
        OptimizerArgs(lr=float("nan"))


@pytest.mark.parametrize("task", list(TASKS))
def test_hparams_stay_flat_plain_and_loadable_with_weights_only(task, tmp_path):
    module = small(task, lr=3e-4, layer_decay=0.75, freeze=["patch_embed"], warmup_epochs=0.5)
    own = [p for p in inspect.signature(module_class(task).__init__).parameters if p not in ("self", "kwargs")]
    assert set(module.hparams) == set(SHARED) | set(own)
    assert module.hparams.lr == module.optimizer_args.lr == 3e-4
    assert module.hparams.layer_decay == module.optimizer_args.layer_decay == 0.75
    assert module.hparams.freeze == module.backbone_args.freeze == ["patch_embed"]
    assert module.hparams.model_name == module.backbone_args.model_name == DENSE_SWIN["model_name"]
    torch.save({"hyper_parameters": dict(module.hparams)}, tmp_path / "hp.ckpt")
    loaded = torch.load(tmp_path / "hp.ckpt", weights_only=True)["hyper_parameters"]
    assert loaded == dict(module.hparams)
    patch_embed = next(m for name, m in module.model.named_modules() if name.endswith("patch_embed"))
    assert not any(p.requires_grad for p in patch_embed.parameters())  # model.freeze reached the backbone


@pytest.mark.parametrize("task", list(TASKS))
def test_flat_keys_parse_print_and_show_their_docs_for_every_task(task, capsys):
    flags = ["--model.model_name", "vit_tiny_patch16_224", "--model.weights", "/some/weights.safetensors",
             "--model.pretrained", "false", "--model.model_kwargs", "{depth: 2}", "--model.lr", "3e-4",
             "--model.weight_decay", "0.01", "--model.layer_decay", "0.75", "--model.warmup_epochs", "0.5",
             "--model.min_lr_ratio", "0.1", "--model.ablate", "{remove: [residual], blocks: [0]}",
             "--model.freeze", "[patch_embed]"]
    with pytest.raises(SystemExit) as exc:
        fit(["--config", f"configs/{CONFIGS[task]}.yaml", *flags, "--print_config"])
    assert exc.value.code == 0
    model = yaml.safe_load(io.StringIO(capsys.readouterr().out))["model"]
    assert model["model_name"] == "vit_tiny_patch16_224" and model["weights"] == "/some/weights.safetensors"
    assert model["pretrained"] is False and model["model_kwargs"] == {"depth": 2}
    assert (model["lr"], model["weight_decay"], model["layer_decay"]) == (3e-4, 0.01, 0.75)
    assert (model["warmup_epochs"], model["min_lr_ratio"]) == (0.5, 0.1)
    assert model["ablate"] == {"remove": ["residual"], "blocks": [0]} and model["freeze"] == ["patch_embed"]
    assert not {"backbone_args", "optimizer_args", "kwargs"} & set(model)
    with pytest.raises(SystemExit):
        fit(["--config", f"configs/{CONFIGS[task]}.yaml", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for doc in ("Peak learning rate", "Layer-wise LR decay factor", "Local weights file", "Backbone parts to freeze"):
        assert doc in help_text, (task, doc)
    shipped = [p.stem for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")]
    assert shipped and all(f" {name}" in help_text for name in shipped), help_text[-800:]  # (the epilog)
