"""vitlab.runs: a run folder, its config or a checkpoint opened into the network, the task and the data.

Every task (classification, detection, segmentation, DINO; 2-D and 3-D) writes its run record through the task
module itself; opening the run must give back the trained weights (randomised, so equality means something), the
ablation, the task and the data module the run had. The record is checked against the truth: the call it holds
rebuilds the task's network, which loads the checkpoint's state strictly. Older checkpoints and configs hold no
record (a checkpoint as the task module writes it, the record stripped): the fallback must open the same network
from the same weights, with the same data.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.volumes import FAMILIES, SPACING, VOLUME, volume_data
from vitlab import models
from vitlab.models.testing import randomize_parameters
from vitlab.run_record import RECORD_KEY, DataRecord, ModelCall, RunRecord, checkpoint_task, fallback_record, plain
from vitlab.runs import newest_checkpoint, open_run, recorded_task, run_folder, run_label

pytestmark = pytest.mark.usefixtures("one_thread")

SWIN = {"model_name": "swin_tiny_patch4_window7_224",
        "model_kwargs": {"patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2], "window_size": 4}}
VIT = {"model_name": "vit_tiny_patch16_224", "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}}
LINKED = ("num_classes", "in_chans", "class_names", "image_size")  # linked from the data: absent from a saved config


def task_module(case: str):
    """(the task module of a case, its task name); parameters randomised."""
    from vitlab.training import ClassificationModule, DetectionModule, DINOModule, SegmentationModule

    if case == "classification":  # with an ablation: the opened network must have it too
        module = ClassificationModule(num_classes=2, class_names=["lesion", "no_lesion"], model_name=SWIN["model_name"],
                                      model_kwargs={**SWIN["model_kwargs"], "img_size": 32}, ablate={"remove": ["attention"], "blocks": [1]})
    elif case in ("detection", "segmentation"):
        module = (DetectionModule if case == "detection" else SegmentationModule)(num_classes=1, image_size=32, class_names=["lesion"], **SWIN)
    elif case == "dino":
        module = DINOModule(num_classes=2, class_names=["lesion", "no_lesion"], out_dim=64, hidden_dim=32, bottleneck_dim=16, local_crops=2,
                            local_size=16, **VIT)
    elif case == "segmentation-3d":
        name, kwargs, _ = FAMILIES["swin_unetr"]
        module = SegmentationModule(num_classes=1, class_names=["lesion"], model_name=name, model_kwargs=kwargs, sliding_window=[32, 32, 32])
    else:
        name, kwargs, _ = FAMILIES["vit3d"]
        module = ClassificationModule(num_classes=2, class_names=["lesion", "no_lesion"], model_name=name, model_kwargs=kwargs,
                                      ablate={"remove": ["mlp"]})
    randomize_parameters(module, seed=7)
    return module.eval(), case.removesuffix("-3d")


def data_module(case: str, tiny_dataset: Path, volumes: Path):
    from vitlab.data.dense_data import DenseImageData
    from vitlab.data.image_data import ImageData

    if case in ("detection", "segmentation"):
        return DenseImageData(root=str(tiny_dataset), image_size=32, batch_size=4, val_fraction=0.25)
    if case.endswith("-3d"):
        kind = DenseImageData if case.startswith("segmentation") else ImageData
        size = [32, 32, 32] if case.startswith("segmentation") else VOLUME
        extra = {"mask_classes": ["lesion"]} if kind is DenseImageData else {}
        return kind(root=str(volumes), sample="volume", spacing=SPACING, volume_size=size, window="soft_tissue", val_fraction=0.5, **extra)
    return ImageData(root=str(tiny_dataset), image_size=32, batch_size=4, val_fraction=0.25)


def write_run(root: Path, case: str, module, task: str, dm, recorded: bool = True) -> Path:
    """``runs/<case>/version_0`` as train.py writes it: config.yaml and checkpoints/last.ckpt (the task module's
    hyperparameters and state; the run record unless ``recorded`` is False, as before runs recorded themselves)."""
    folder = root / "runs" / case / "version_0"
    (folder / "checkpoints").mkdir(parents=True)
    record = {RECORD_KEY: module.run_record(dm)} if recorded else {}
    hp = dict(module.hparams)
    config = {"task": task, "model": {k: v for k, v in hp.items() if k not in LINKED},
              "data": {k: v for k, v in dm.arguments.items() if k != "num_workers"}, **record}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"hyper_parameters": hp, "state_dict": module.state_dict(), **record}, folder / "checkpoints" / "last.ckpt")
    return folder


def assert_trained_weights(network: torch.nn.Module, module) -> None:
    """Every tensor of ``network`` is the module's (its network's, or a detector's / segmenter's backbone's) but a
    fresh classifier head (a dense task's, DINO's dropped one)."""
    state = module.state_dict()
    head = models.part_prefixes(network, "head") or ()
    matched = 0
    for key, value in network.state_dict().items():
        source = state.get(f"model.{key}", state.get(f"model.backbone.body.{key}"))
        if source is None:
            assert head and key.startswith(head), key
            continue
        assert torch.equal(value, source), key
        matched += 1
    assert matched > 0.9 * len(network.state_dict())


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    return volume_data(tmp_path_factory.mktemp("run-volumes"))


CASES = ["classification", "detection", "segmentation", "dino", "segmentation-3d", "classification-3d"]


@pytest.mark.parametrize("case", CASES)
def test_a_run_opens_as_recorded_and_an_older_one_as_the_same_run(case, tiny_dataset, volumes, tmp_path):
    module, task = task_module(case)
    dm = data_module(case, tiny_dataset, volumes)
    folder = write_run(tmp_path / "new", case, module, task, dm)
    run = open_run(folder)
    assert run.recorded and run.task == task and run.label == f"{case}-version_0"
    assert run.checkpoint == folder / "checkpoints" / "last.ckpt" and run.hparams["model_name"] == module.hparams.model_name
    assert run.record.data == DataRecord.of(dm) and run.record.ablate == module.hparams.ablate
    assert [s.key for s in run.data().samples("val")] == [s.key for s in dm.samples("val")]  # the same data module
    network = run.model()
    assert_trained_weights(network, module)
    call, whole = run.record.model.network()
    if whole:  # the task's own network, with the run's ablation: the same outputs
        size = models.input_size(network)
        x = torch.rand(1, *size)
        with torch.no_grad():
            expected = module.model(x) if task != "dino" else None
            assert expected is None or torch.equal(network(x), expected)
    # the record is what built the network: its call rebuilds it, and the checkpoint's state loads strictly
    built = run.record.model.build()
    if task == "dino":
        models.drop_classifier(built)
    built.load_state_dict({k[len("model."):]: v for k, v in module.state_dict().items() if k.startswith("model.")}, strict=True)

    # the same run written before runs recorded themselves: the fallback opens the same network with the same weights
    old = open_run(write_run(tmp_path / "old", case, module, task, dm, recorded=False))
    assert not old.recorded and old.task == ("classification" if task == "dino" else task)  # (an older DINO reads as a classifier)
    assert old.record.model.network() == (call, whole) and old.record.class_names == run.record.class_names
    state = module.state_dict()  # (a fresh head is drawn anew)
    trained = {k: v for k, v in network.state_dict().items() if f"model.{k}" in state or f"model.backbone.body.{k}" in state}
    reopened = old.model().state_dict()
    assert all(torch.equal(reopened[k], v) for k, v in trained.items())
    assert old.record.data.kind == run.record.data.kind
    assert old.record.data.arguments == {k: v for k, v in dm.arguments.items() if k in old.record.data.arguments}

    # a config alone (no checkpoint beside it): an untrained network of the same call, recorded or inferred from the data
    for opened in (folder, tmp_path / "old" / "runs" / case / "version_0"):
        (opened / "checkpoints" / "last.ckpt").unlink()
        alone = open_run(opened / "config.yaml")
        assert alone.state is None and alone.checkpoint is None and alone.record.model.network() == (call, whole)
        assert alone.record.data.kind == run.record.data.kind


def test_probes_open_runs_through_the_record(tiny_dataset, volumes, tmp_path):
    """The probes' view: a dense or DINO run's classifier head is untrained, so its classes are not the head's."""
    import argparse

    from vitlab.probes.loading import load_model

    for case, head_trained in (("classification", True), ("dino", False)):
        module, task = task_module(case)
        folder = write_run(tmp_path, case, module, task, data_module(case, tiny_dataset, volumes))
        loaded = load_model(argparse.Namespace(checkpoint=folder / "checkpoints" / "last.ckpt", config=None, model=None))
        assert loaded.task == task and loaded.head_trained is head_trained and loaded.run == f"{case}-version_0"
        assert loaded.class_names == (["lesion", "no_lesion"] if head_trained else None)
        assert loaded.data == DataRecord.of(data_module(case, tiny_dataset, volumes))
        fresh = loaded.fresh(seed=1)
        assert fresh.state_dict().keys() == loaded.model.state_dict().keys()


def test_the_config_given_with_a_checkpoint_gives_the_data(tiny_dataset, volumes, tmp_path):
    module, task = task_module("classification")
    folder = write_run(tmp_path, "classification", module, task, data_module("classification", tiny_dataset, volumes))
    other = yaml.safe_load((folder / "config.yaml").read_text())
    other[RECORD_KEY]["data"]["arguments"]["val_fraction"] = 0.5
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    run = open_run(checkpoint=folder / "checkpoints" / "last.ckpt", config=tmp_path / "other.yaml")
    assert run.record.data.arguments["val_fraction"] == 0.5 and run.record.model == open_run(folder).record.model


def test_checkpoint_task_from_the_state_dict():
    from vitlab.models.dense import BACKBONE_PREFIX
    from vitlab.training import DetectionModule, SegmentationModule

    assert BACKBONE_PREFIX == "backbone.body."  # spelled out in checkpoint_task (no torchvision detection import)
    classifier = models.build_model(SWIN["model_name"], num_classes=2, in_chans=1, img_size=32, **SWIN["model_kwargs"])
    prefixed = lambda module: {f"model.{k}": v for k, v in module.state_dict().items()}  # noqa: E731
    assert checkpoint_task(prefixed(classifier)) == "classification"
    assert checkpoint_task(DetectionModule(num_classes=1, image_size=32, **SWIN).state_dict()) == "detection"
    assert checkpoint_task(SegmentationModule(num_classes=1, image_size=32, **SWIN).state_dict()) == "segmentation"
    assert checkpoint_task({"model.head.weight": torch.zeros(2, 2)}) == "classification"
    # a MONAI segmenter's keys are a classifier's: its sliding_window hyperparameter says it segments
    hp = {"model_name": "monai:unetr", "num_classes": 1, "sliding_window": None, "model_kwargs": {}}
    assert fallback_record(hp, {"model.vit.norm.weight": None}, None).task == "segmentation"


def test_every_task_module_names_its_task_as_the_cli_does():
    from vitlab.cli import TASKS

    assert all(module.task == task for task, (module, _, _) in TASKS.items())


def test_records_hold_plain_types_and_bad_records_are_one_line(tmp_path):
    import numpy as np

    assert plain({"a": [1, (2.0, None)], "b": Path("x")}, "r") == {"a": [1, (2.0, None)], "b": "x"}
    with pytest.raises(TypeError, match=r"r\.a\[1\]: int64 is not a plain type"):
        plain({"a": [1, np.int64(2)]}, "r")
    good = RunRecord("classification", ModelCall("build_model", {"name": "vit_tiny_patch16_224", "num_classes": 2}), None, ["a", "b"],
                     DataRecord("ImageData", {"root": "x"}))
    assert RunRecord.from_dict(good.as_dict(), "f") == good
    for change, message in (({"version": 2}, "newer vitlab"), ({"task": "depth"}, "task 'depth' is not one of"),
                            ({"model": {"builder": "build_unet", "arguments": {}}}, "model builder 'build_unet'"),
                            ({"data": {"class": "MyData"}}, "data class 'MyData'"), ({"model": None}, "unreadable run record")):
        with pytest.raises(ValueError, match=message) as err:
            RunRecord.from_dict({**good.as_dict(), **change}, "f.ckpt")
        assert str(err.value).startswith("f.ckpt: unreadable run record") and "\n" not in str(err.value)


def test_files_that_are_not_runs_are_refused_in_one_line(tmp_path):
    import argparse

    from vitlab.probes.loading import load_model

    with pytest.raises(FileNotFoundError, match="nope.ckpt: no such file"):
        open_run(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        open_run(tmp_path)
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.ckpt: not a readable torch checkpoint"):
        open_run(tmp_path / "junk.ckpt")
    torch.save({"weight": torch.zeros(2)}, tmp_path / "weights.pt")
    with pytest.raises(ValueError, match=r"--checkpoint .*weights.pt: not a vitlab training checkpoint .*use --model NAME --weights"):
        load_model(argparse.Namespace(checkpoint=tmp_path / "weights.pt", config=None, model=None))
    (tmp_path / "x.yaml").write_text("data: {}\n")
    with pytest.raises(ValueError, match="x.yaml: not a vitlab training config"):
        open_run(tmp_path / "x.yaml")
    assert recorded_task(tmp_path / "junk.ckpt") is None and recorded_task(tmp_path / "weights.pt") is None


def test_run_folders_labels_and_the_newest_checkpoint(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no trained run in runs/"):
        newest_checkpoint()
    for version, mtime in (("version_0", 2_000_000), ("version_1", 1_000_000)):
        folder = tmp_path / "runs" / "tiny" / version
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"")
        os.utime(folder / "checkpoints" / "last.ckpt", (mtime, mtime))
    assert newest_checkpoint() == Path("runs/tiny/version_0/checkpoints/last.ckpt")
    folder = run_folder("runs/tiny/version_0/checkpoints/last.ckpt")
    assert folder == tmp_path / "runs" / "tiny" / "version_0" and run_folder(tmp_path / "last.ckpt") is None
    assert run_label(folder) is None  # no config.yaml: not a run train.py wrote
    (folder / "config.yaml").write_text("model: {}\n")
    assert run_label(folder) == "tiny-version_0"


def test_a_run_folder_gives_its_snapshots_and_scalars(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    module, task = task_module("classification")
    folder = tmp_path / "runs" / "tiny" / "version_0"
    (folder / "qkv").mkdir(parents=True)
    for epoch in (2, 0, 1):
        (folder / "qkv" / f"epoch_{epoch:03d}.safetensors").write_bytes(b"")
    values = torch.rand(3).tolist()
    with SummaryWriter(str(folder)) as writer:
        for step, value in enumerate(values):
            writer.add_scalar("val/balanced_acc", value, step)
    record = RunRecord(task, module.network_call)
    (folder / "config.yaml").write_text(yaml.safe_dump({"task": task, "model": {"model_name": "x"}, RECORD_KEY: record.as_dict()}))
    run = open_run(folder)
    assert [p.name for p in run.snapshots()] == ["epoch_000.safetensors", "epoch_001.safetensors", "epoch_002.safetensors"]
    read = run.scalars("val/balanced_acc")
    assert [s for s, _ in read] == [0, 1, 2] and all(math.isclose(a, b, rel_tol=1e-6) for (_, a), b in zip(read, values))
    assert run.scalars("val/never") == []


def test_data_modules_are_recorded_as_their_lightning_free_class(tiny_dataset):
    from vitlab.data import DenseDataModule, MedicalDataModule

    dm = MedicalDataModule(root=str(tiny_dataset), image_size=32, num_workers=0)
    record = DataRecord.of(dm)
    assert record.kind == "ImageData" and record.arguments == dm.arguments and not record.dense
    assert DataRecord.of(DenseDataModule(root=str(tiny_dataset), image_size=32, num_workers=0)).kind == "DenseImageData"
    rebuilt = record.build()
    assert type(rebuilt).__name__ == "ImageData" and rebuilt.arguments == dm.arguments
    with pytest.raises(TypeError, match="not a vitlab data module"):
        DataRecord.of(object())


def tiny_fit_args(manifest: Path, save_dir: Path, *extra: str) -> list[str]:
    cfg = {"seed_everything": 0,
           "trainer": {"max_epochs": 1, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False,
                       "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                                  "init_args": {"save_dir": str(save_dir), "name": "tiny", "default_hp_metric": False}}},
           "model": {**SWIN, "model_kwargs": {**SWIN["model_kwargs"], "img_size": 32}, "ablate": {"remove": ["mlp"], "blocks": [0]}},
           "runtime": {"workers": 0}, "data": {"root": str(manifest), "image_size": 32, "batch_size": 8, "val_fraction": 0.25}}
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return ["--config", str(save_dir / "cfg.yaml"), *extra]


@pytest.mark.slow
def test_a_trained_run_records_itself_and_reopens_without_its_record(tiny_dataset, tmp_path):
    """train.py's checkpoints and config.yaml hold the same record; config.yaml still repeats the run; resuming another
    task's checkpoint is one line; the run as main wrote it (no record) gives the probes the same images and outputs."""
    import argparse
    import shutil

    from vitlab.cli import fit
    from vitlab.probes.loading import load_model
    from vitlab.probes.streams import load_images

    cli = fit(tiny_fit_args(tiny_dataset, tmp_path / "runs"))
    folder = tmp_path / "runs" / "tiny" / "version_0"
    checkpoint = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    record = checkpoint[RECORD_KEY]
    assert record == yaml.safe_load((folder / "config.yaml").read_text())[RECORD_KEY]
    assert record["data"] == {"class": "ImageData", "arguments": checkpoint["datamodule_hyper_parameters"]}
    assert record["ablate"] == {"remove": ["mlp"], "blocks": [0]} and recorded_task(folder / "checkpoints" / "last.ckpt") == "classification"
    built = RunRecord.from_dict(record, "last.ckpt").model.build()
    assert built.state_dict().keys() == cli.model.model.state_dict().keys()

    again = fit(["--config", str(folder / "config.yaml"), "--trainer.logger.init_args.save_dir", str(tmp_path / "again")])
    assert again.model.run_record(again.datamodule) == record  # the saved config builds the same run
    other = dict(checkpoint, **{RECORD_KEY: {**record, "task": "dino"}})
    torch.save(other, tmp_path / "dino.ckpt")
    with pytest.raises(ValueError, match=r"dino.ckpt: a dino checkpoint; this config trains classification \(resume it with task: dino\)"):
        fit(tiny_fit_args(tiny_dataset, tmp_path / "resume", "--ckpt_path", str(tmp_path / "dino.ckpt")))

    old = tmp_path / "old" / "tiny" / "version_0"  # the same run as written before runs recorded themselves
    shutil.copytree(folder, old)
    torch.save({k: v for k, v in checkpoint.items() if k != RECORD_KEY}, old / "checkpoints" / "last.ckpt")
    config = yaml.safe_load((old / "config.yaml").read_text())
    (old / "config.yaml").write_text(yaml.safe_dump({k: v for k, v in config.items() if k != RECORD_KEY}))
    batches = []
    for run in (folder, old):
        args = argparse.Namespace(checkpoint=run / "checkpoints" / "last.ckpt", config=None, model=None, images=None, num_images=4,
                                  split="val", seed=0)
        loaded = load_model(args)
        batch = load_images(args, loaded, 4)
        with torch.no_grad():
            batches.append((batch.names, batch.inputs, loaded.model(batch.inputs), loaded.class_names))
    (names, inputs, logits, classes), (old_names, old_inputs, old_logits, old_classes) = batches
    assert names == old_names and torch.equal(inputs, old_inputs) and torch.equal(logits, old_logits) and classes == old_classes
    with torch.no_grad():  # the trained, ablated network itself
        assert torch.equal(logits, cli.model.model.eval()(inputs))
