"""Every checkpoint-taking ``probe.py`` subcommand on a detection checkpoint: it probes the detector's backbone.

The probes see the backbone inside a classifier with a fresh head; what depends on that head (ablate's accuracy,
visualize's class logits, transplanting the head) is refused or skipped with one line, never reported.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest

from tests.helpers.runs import DENSE_SWIN, dense_args
from vitlab.probe_cli import probe_main
from vitlab.probes import main as probe
from vitlab.probes.loading import load_model
from vitlab.run_record import DataRecord

@pytest.fixture(scope="module")
def detection_run(tmp_path_factory) -> Path:
    """A 1-epoch tiny Swin Mask R-CNN fit (32 px, Q/K/V callbacks on): its run folder."""
    from vitlab.cli import fit

    root = tmp_path_factory.mktemp("dense-probes")
    fit(dense_args("detection", root / "runs", epochs=1))
    return root / "runs" / "detection" / "version_0"


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def run_probe(run: Path, out: Path, subcommand: str, *extra: str) -> Path:
    probe([subcommand, "--checkpoint", str(run / "checkpoints" / "last.ckpt"), *extra, "--out", str(out)])
    return out


@pytest.mark.slow
def test_drift_of_a_detection_checkpoint_equals_the_training_callback(detection_run, tmp_path):
    out = tmp_path / "drift"
    probe(["drift", "--finetuned", str(detection_run / "checkpoints" / "last.ckpt"), "--out", str(out)])
    probed, logged = rows(out / "drift.csv"), rows(detection_run / "qkv" / "drift_epoch_001.csv")
    assert len(probed) == len(logged) > 0
    for mine, theirs in zip(probed, logged):
        assert (mine["block"], mine["matrix"], mine["row"]) == (theirs["block"], theirs["matrix"], theirs["row"])
        assert float(mine["cosine_distance"]) == pytest.approx(float(theirs["cosine_distance"]), rel=1e-4, abs=1e-7)
    assert max(float(r["euclidean"]) for r in probed) > 0  # training moved the backbone's Q/K/V


@pytest.mark.slow
def test_spectra_of_a_detection_checkpoint_equal_the_training_callback(detection_run, tmp_path):
    out = run_probe(detection_run, tmp_path / "spectra", "spectra")
    probed, logged = rows(out / "spectra.csv"), rows(detection_run / "qkv" / "spectra_epoch_001.csv")
    assert [(r["block"], r["head"]) for r in probed] == [(r["block"], r["head"]) for r in logged]
    assert {r["block"] for r in probed} == {"stage0.block0", "stage0.block1", "stage1.block0", "stage1.block1"}
    for mine, theirs in zip(probed, logged):
        assert float(mine["positive_mass"]) == pytest.approx(float(theirs["positive_mass"]), abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("subcommand,extra,outputs", [
    ("attention", ["--num-images", "2"], ["attention_angle.csv", "attention_mass.csv"]),
    ("mi", ["--num-images", "8", "--split", "train"], ["mi.csv"]),
    ("stats", ["--num-images", "4"], ["stats.csv"]),
    ("features", ["--num-images", "8"], ["features.csv"]),
    ("invert", ["--num-images", "1", "--steps", "3", "--layers", "embed,0"], ["summary.csv", "inversion.json"]),
    ("filters", [], ["filters.json", "pca.csv"]),
])
def test_image_probes_run_on_a_detection_checkpoint(detection_run, tmp_path, subcommand, extra, outputs):
    out = run_probe(detection_run, tmp_path / subcommand, subcommand, *extra)
    for name in outputs:
        assert (out / name).is_file(), name
        assert not name.endswith(".csv") or rows(out / name), f"{name} is empty"
    assert any(p.name.startswith("events.out.tfevents") for p in out.iterdir())
    if subcommand in ("stats", "attention"):  # one row group per backbone block
        table = rows(out / outputs[-1])
        assert {"stage0.block0", "stage1.block1"} <= {r.get("layer") or r.get("block") for r in table}


@pytest.mark.slow
def test_ablate_skips_the_untrained_heads_accuracy(detection_run, tmp_path, capsys):
    out = run_probe(detection_run, tmp_path / "ablate", "ablate", "--ablate", "attention", "--num-images", "1",
                    "--steps", "3", "--layers", "0", "--accuracy-images", "4")
    printed = capsys.readouterr().out
    assert "accuracy skipped" in printed and "detection checkpoint" in printed and "untrained" in printed
    assert not (out / "accuracy.csv").exists()
    assert {r["variant"] for r in rows(out / "summary.csv")} == {"intact", "no attention"}


@pytest.mark.slow
def test_visualize_skips_or_refuses_class_logits_of_a_dense_checkpoint(detection_run, tmp_path, capsys):
    out = run_probe(detection_run, tmp_path / "visualize", "visualize", "--steps", "3", "--neurons", "stage1.block0:0-1")
    assert "class visualisation skipped" in capsys.readouterr().out
    assert [r["kind"] for r in rows(out / "visualize.csv")] == ["neuron", "neuron"]  # no class rows
    with pytest.raises(SystemExit) as exit_info:  # classes asked for explicitly: a one-line refusal
        probe_main(["visualize", "--checkpoint", str(detection_run / "checkpoints" / "last.ckpt"), "--classes", "0",
                    "--steps", "3", "--out", str(tmp_path / "refused")])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1
    assert "--classes 0" in error and "detection checkpoint" in error and "untrained" in error


@pytest.mark.slow
def test_transplant_refuses_the_untrained_head(detection_run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe_main(["transplant", "--checkpoint", str(detection_run / "checkpoints" / "last.ckpt"), "--parts", "head",
                    "--steps", "3", "--num-images", "1", "--out", str(tmp_path / "transplant")])
    assert "--parts head" in capsys.readouterr().err


@pytest.mark.slow
def test_loaded_dense_checkpoint_knows_its_task(detection_run):
    loaded = load_model(argparse.Namespace(checkpoint=detection_run / "checkpoints" / "last.ckpt"))
    assert loaded.task == "detection" and not loaded.head_trained and loaded.class_names is None


def test_probe_images_of_a_coco_detection_run_are_the_jsons_images(tmp_path, monkeypatch):
    """A detection run trained on a COCO JSON: the probes draw its images, not the embedded set's."""
    import json

    from tests.helpers.data import planted
    from vitlab import models
    from vitlab.probes.loading import LoadedModel
    from vitlab.probes.streams import image_stream

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    images, annotations = [], []
    for i in range(6):
        planted(tmp_path, f"c{i}", [(4 * i, 6, 8)] if i % 2 else [])
        images.append({"id": i, "file_name": f"c{i}.png", "height": 48, "width": 48})
        if i % 2:
            annotations.append({"id": i, "image_id": i, "category_id": 1, "iscrowd": 0, "bbox": [6, 4 * i, 8, 8],
                                "segmentation": [[6, 4 * i, 14, 4 * i, 14, 4 * i + 8, 6, 4 * i + 8]]})
    coco = tmp_path / "instances.json"
    coco.write_text(json.dumps({"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "tumour"}]}))
    model = models.build_model(DENSE_SWIN["model_name"], num_classes=1, in_chans=1, img_size=32, **DENSE_SWIN["model_kwargs"])
    loaded = LoadedModel(model.eval(), "swin", "test", task="detection",
                         data=DataRecord("DenseImageData", {"coco_json": str(coco), "val_fraction": 0.34, "image_size": 32}))
    args = argparse.Namespace(images=None, num_images=None, split="train", seed=0)
    stream = image_stream(args, loaded, default_count=10)
    names = sorted(stream.read(i)[2] for i in range(stream.count))
    assert 0 < len(names) < 6 and all(Path(n).parent == tmp_path and Path(n).name.startswith("c") for n in names)
    pixels, _, _ = stream.read(0)
    assert pixels.shape == (1, 32, 32) and 0 <= float(pixels.min()) and float(pixels.max()) <= 1
