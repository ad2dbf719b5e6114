"""probe.py ablate on 3-D checkpoints: a 3-D segmenter's Dice of each foreground class (the training definition, on
whole volumes through the run's sliding window), a 3-D classifier's accuracy, each ablation applied to every block.

Oracles: ablating nothing is bit-identical; the Dice (and the accuracy) read back from dice.csv and the TensorBoard
event file equal an independent computation on the same volumes (training's data module for the volumes and label
maps, MONAI's ``sliding_window_inference`` and torchmetrics' ``DiceScore`` as validation configures it)."""

from __future__ import annotations

import csv
import functools
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.volumes import make_volume_run
from vitlab import models
from vitlab.analysis.probing import dice_counts, dice_from_counts
from vitlab.probes import ablate, build_parser, main
from vitlab.probes.common import ProbeContext
from vitlab.probes.loading import load_model
from vitlab.probes.streams import image_stream, load_images
from vitlab.probes.invert import Variant

pytestmark = pytest.mark.usefixtures("one_thread")


def read_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def scalars(folder) -> dict[str, float]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def training_volumes(loaded, split="val"):
    """The split's volumes and label maps as segmentation training reads them (DenseImageData, whole volumes)."""
    assert loaded.data.dense  # the run's DenseImageData
    dm = loaded.data.build(augment="none", num_workers=0)
    dataset = dm.dataset(split)
    items = [dataset[i] for i in range(len(dataset))]
    return torch.stack([x for x, _ in items]), torch.stack([t["mask"] for _, t in items]), [s.key for s in dm.samples(split)]


@torch.no_grad()
def oracle_dice(model, volumes, masks, window) -> float:
    from monai.inferers import sliding_window_inference
    from torchmetrics.segmentation import DiceScore

    metric = DiceScore(2, include_background=False, average="none", aggregation_level="global", input_format="index")
    for volume, mask in zip(volumes, masks):
        logits = sliding_window_inference(volume[None], tuple(window), sw_batch_size=4, predictor=model, overlap=0.25, mode="gaussian")
        metric.update(logits.argmax(1), mask[None])
    return float(metric.compute().reshape(-1)[0])


@pytest.mark.parametrize("family", ["swin_unetr", pytest.param("unetr", marks=pytest.mark.slow)])
def test_ablate_a_3d_segmenter_gives_the_dice_of_each_class(tmp_path, family, capsys):
    run = make_volume_run(tmp_path, family)
    out = tmp_path / "out"
    main(["ablate", "--checkpoint", str(run.checkpoint), "--ablate", "attention", "--accuracy-images", "2", "--out", str(out)])
    assert "inversion survey (2-D images) is skipped" in capsys.readouterr().out
    rows = {row["variant"]: row for row in read_rows(out / "dice.csv")}
    assert list(rows) == ["intact", "no attention"] and all(row["volumes"] == "2" for row in rows.values())
    logged = scalars(out)
    loaded = load_model(common_args(run.checkpoint))
    volumes, masks, keys = training_volumes(loaded)
    # the probe's volumes (the first 2 of the seed's draw) and their label maps are training's
    batch = load_images(common_args(run.checkpoint, "--num-images", "2"), loaded, 2, volumes=True)
    order = [keys.index(name) for name in batch.names]
    volumes, masks = volumes[order], masks[order]
    assert batch.mask_classes == ["lesion"] and torch.equal(batch.masks, masks) and torch.equal(batch.inputs, volumes)
    assert int(masks.max()) == 1  # lesions present
    for variant, names in (("intact", []), ("no attention", ["attention"])):
        with models.ablated(run.model, names):
            expected = oracle_dice(run.model, volumes, masks, run.size)
        tag = variant.replace(" ", "_")
        assert float(rows[variant]["dice_lesion"]) == pytest.approx(expected, rel=1e-6, abs=1e-9), variant
        assert logged[f"dice_lesion/{tag}"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
        assert logged[f"dice/{tag}"] == pytest.approx(expected, rel=1e-6, abs=1e-9)  # one class: the mean is its Dice


def common_args(checkpoint, *extra):
    return build_parser(["ablate"]).parse_args(["ablate", "--checkpoint", str(checkpoint), "--ablate", "mlp", *extra])


def test_ablating_nothing_is_bit_identical_on_a_3d_segmenter(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from vitlab.models.inference import segment_logits

    run = make_volume_run(tmp_path, "swin_unetr")
    args = common_args(run.checkpoint, "--accuracy-images", "2")
    loaded = load_model(args)
    volume = load_images(args, loaded, 1, volumes=True).inputs[:1]
    with torch.no_grad():
        intact = segment_logits(loaded.model, volume, run.size)
        with models.ablated(loaded.model, []):
            nothing = segment_logits(loaded.model, volume, run.size)
    assert torch.equal(intact, nothing)
    with SummaryWriter(str(tmp_path / "out")) as writer:
        ctx = ProbeContext(args, "ablate", tmp_path / "out", torch.device("cpu"), writer, loaded)
        variants = [Variant("intact", loaded.model), Variant("none", loaded.model, functools.partial(models.ablated, loaded.model, []))]
        rows = ablate.dice(ctx, variants)
        pair = ablate.dice(ctx, variants[:1], batch_size=2)  # streamed one volume at a time or two: the same pooled counts
    assert rows[0]["dice_lesion"] == rows[1]["dice_lesion"] == pair[0]["dice_lesion"] and not math.isnan(rows[0]["dice_lesion"])
    # a segmentation run's volumes come with their label maps, a run without mask_classes' do not
    stream = image_stream(args, loaded, 2, volumes=True)
    assert stream.mask_classes == ["lesion"] and next(stream.image_batches(2)).masks.shape == (2, *run.size)


def test_dice_counts_pool_voxels_over_volumes_with_nan_for_an_absent_class():
    pred = torch.tensor([[0, 1, 1, 2], [0, 0, 1, 0]])
    truth = torch.tensor([[0, 1, 0, 0], [1, 0, 1, 0]])
    scores = dice_from_counts(dice_counts(pred[:1], truth[:1], 3) + dice_counts(pred[1:], truth[1:], 3))
    assert scores[0].item() == pytest.approx(2 * 2 / (3 + 3)) and scores[1].item() == 0.0 and math.isnan(scores[2].item())


def test_ablate_a_3d_classifier_gives_the_accuracy(tmp_path):
    run = make_volume_run(tmp_path, "vit3d")
    out = tmp_path / "out"
    main(["ablate", "--checkpoint", str(run.checkpoint), "--ablate", "attention+layernorm", "--accuracy-images", "3", "--out", str(out)])
    rows = {row["variant"]: row for row in read_rows(out / "accuracy.csv")}
    assert not (out / "dice.csv").exists() and list(rows) == ["intact", "no attention+layernorm"]
    args = common_args(run.checkpoint, "--num-images", "3")
    batch = load_images(args, load_model(args), 3, volumes=True)
    logged = scalars(out)
    with torch.no_grad():
        for variant, names in (("intact", []), ("no attention+layernorm", ["attention", "layernorm"])):
            with models.ablated(run.model, names):
                expected = float((run.model(batch.inputs).argmax(1) == batch.labels).float().mean())
            assert float(rows[variant]["accuracy"]) == pytest.approx(expected) and rows[variant]["images"] == "3"
            assert logged[f"accuracy/{variant.replace(' ', '_').replace('+', '_')}"] == pytest.approx(expected)
