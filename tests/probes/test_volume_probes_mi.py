"""probe.py mi, stats and features on 3-D checkpoints (ViT-3D, UNETR, SwinUNETR): volumes in, distances in mm.

Independent references: distances from the block's token grid, the model input and the run's voxel size
(``tests.helpers.volumes.SPACING``) by a loop over tokens; MI, kurtosis and k-NN accuracy recomputed from activations recorded
here on the volumes the run's data gives, with labels read from the data's manifest.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.volumes import SPACING, make_volume_run
from vitlab import models
from vitlab.analysis.mi import gaussian_copula_mi
from vitlab.analysis.probing import knn_probe
from vitlab.probes import main
from vitlab.probes.loading import load_model
from vitlab.probes.streams import load_images
from vitlab.probes import mi as mi_probe

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:probe.py mi. only")]
PATIENTS = 20  # val_fraction 0.5: 10 train and 10 validation volumes
BLOCKS = {"vit3d": ["0", "1"], "unetr": ["0", "11"], "swin_unetr": ["1", "4", "7"]}  # SwinUNETR: grids 16^3, 4^3, 2^3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("volume-runs")
    made: dict[str, object] = {}

    def get(family: str):
        if family not in made:
            made[family] = make_volume_run(root, family, seed=len(made) + 1, patients=PATIENTS)
        return made[family]

    return get


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def events(out: Path) -> EventAccumulator:
    acc = EventAccumulator(str(out), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    return acc


def namespace(run, split="val", num_images=None):
    return argparse.Namespace(checkpoint=run.checkpoint, config=None, model=None, images=None, num_images=num_images, split=split, spacing=None, seed=0)


def token_mm(run, grid) -> np.ndarray:
    """mm per token along i, j, k: model input voxels x voxel size / tokens."""
    return np.array(run.size, dtype=float) * np.array(SPACING) / np.array(grid)


def mm_offsets(run, grid) -> np.ndarray:
    """(T, 3) offsets in mm of every token (row-major) from the centre token, by a loop over the grid."""
    size = token_mm(run, grid)
    return np.array([[(p - g // 2) * s for p, g, s in zip(pos, grid, size)] for pos in itertools.product(*map(range, grid))])


def recorded(run, views, sites, split="val", count=10):
    """Sub-layer outputs of ``views`` over the run's volumes, recorded here in fp32 (N, T, C), with the batch."""
    loaded = load_model(namespace(run, split, count))
    batch = load_images(namespace(run, split, count), loaded, count, volumes=True)
    assert batch.spacing == tuple(SPACING)
    with torch.no_grad(), models.capture(loaded.model, sites, [v.name for v in views]) as cap:
        loaded.model(batch.inputs)
    return cap, batch


@pytest.mark.parametrize("family", ["vit3d", pytest.param("unetr", marks=pytest.mark.slow), pytest.param("swin_unetr", marks=pytest.mark.slow)])
def test_mi_on_volumes_distances_in_mm(tmp_path, runs, family, monkeypatch, capsys):
    run = runs(family)
    out = tmp_path / "mi"
    monkeypatch.setattr(mi_probe, "LARGE_TABLE_BYTES", 1000)  # the size note names the largest table
    main(["mi", "--checkpoint", str(run.checkpoint), "--out", str(out), "--num-images", "10", "--blocks", *BLOCKS[family],
          "--centre-channels", "3", "--cross-channels", "2", "--binned-channels", "2", "--binned-cross-channels", "1", "--bins", "3",
          "--ksg-pairs", "4", "--precision", "fp32", "--batch-size", "4"])
    views = {v.name: v for v in models.select_blocks(run.model, BLOCKS[family])}
    tokens = max(math.prod(v.grid) for v in views.values())
    width = min(5, min(v.dim for v in views.values() if math.prod(v.grid) == tokens))  # K + C' channels kept
    assert f"keeps 10 images x {tokens} tokens x {width} channels = " in capsys.readouterr().out
    rows, checks = read_csv(out / "mi.csv"), read_csv(out / "mi_ksg.csv")
    assert "distance_mm" in rows[0] and "distance" not in rows[0] and "distance_mm" in checks[0]
    assert {(r["layer"], r["sublayer"]) for r in rows} == {(name, site) for name in views for site in ("attn", "mlp")}
    for (layer, site), group in itertools.groupby(rows, key=lambda r: (r["layer"], r["sublayer"])):
        group = list(group)
        dist = np.sqrt((mm_offsets(run, views[layer].grid) ** 2).sum(1))  # (T,) mm from the centre token
        levels = np.unique(np.round(dist, 6))
        assert [float(r["distance_mm"]) for r in group] == pytest.approx(levels.tolist(), rel=1e-7), (layer, site)
        assert [int(r["tokens"]) for r in group] == [int((np.abs(dist - d) < 1e-5).sum()) for d in levels]
        assert all(int(r["n_images"]) == 10 for r in group) and math.isnan(float(group[0]["mi_same"]))
        # no 0/0 from constant neurons (padding); +inf is possible: tokens over the padding can rank alike over 10 volumes
        assert not any(math.isnan(float(r["mi_same"])) or float(r["mi_same"]) < -1 for r in group[1:]), (layer, site)
    # the KSG check's pairs: the centre token of the 3-D grid, the mm distance of the token, the copula MI of the pair
    cap, _ = recorded(run, list(views.values()), ["attn", "mlp"])
    for row in checks:
        grid = views[row["layer"]].grid
        t0 = int(np.ravel_multi_index([g // 2 for g in grid], grid))
        offset = mm_offsets(run, grid)[int(row["token"])]
        assert float(row["distance_mm"]) == pytest.approx(float(np.sqrt((offset**2).sum())), rel=1e-6)
        acts = cap[row["layer"], row["sublayer"]].half().float()  # the probe keeps fp16 neurons
        x, y = acts[:, t0, int(row["centre_channel"])], acts[:, int(row["token"]), int(row["channel"])]
        assert float(row["mi_copula"]) == pytest.approx(float(gaussian_copula_mi(x, y)), abs=1e-6)
    acc = events(out)
    steps = sorted(v.global_index for v in views.values())
    assert [e.step for e in acc.Scalars("mi_nearest_same/attn")] == steps
    assert {f"mi/{name}" for name in views} <= set(acc.Tags()["images"])


def test_mi_figure_axes_in_mm(tmp_path):
    """The block and depth figures of a volume say mm on the x axis and the token size in the title; images: tokens."""
    g = torch.Generator().manual_seed(4)
    grid, size = (4, 4, 2), (11.2, 11.2, 20.0)
    acts = torch.randn(30, 32, 6, generator=g)
    acts = acts + 0.8 * acts.roll(1, 1)
    args = argparse.Namespace(centre_channels=3, cross_channels=2, binned_channels=2, binned_cross_channels=1, bins=3)
    view = models.blocks(make_volume_run(tmp_path, "vit3d").model)[0]
    for token_size, unit in ((size, "mm"), (None, "tokens")):
        result = mi_probe.estimate(acts, grid, args, 0, token_size)
        figures = [mi_probe.block_figure(view, {"attn": result, "mlp": result}, 30), mi_probe.layers_figure("attn", 0, [(view.name, result)], 30)]
        for fig in figures:
            assert {ax.get_xlabel() for ax in fig.axes} == {f"distance from the centre token ({unit})"}
            line = fig.axes[0].lines[0].get_xdata()
            expected = result["copula"].distances.numpy()
            np.testing.assert_allclose(line, expected)
        if token_size:
            assert "token 11.2 x 11.2 x 20 mm" in figures[0]._suptitle.get_text() and "N = 30 volumes" in figures[0]._suptitle.get_text()
            assert expected[1] == pytest.approx(11.2)  # nearest: one token along i or j
            figures[0].savefig(tmp_path / "mi_volume.png")
        else:
            assert expected[1] == 1.0


@pytest.mark.parametrize("family", ["vit3d", pytest.param("swin_unetr", marks=pytest.mark.slow), pytest.param("unetr", marks=pytest.mark.slow)])
def test_stats_on_volumes_matches_scipy(tmp_path, runs, family):
    run = runs(family)
    out = tmp_path / "stats"
    blocks = BLOCKS[family][-2:]
    main(["stats", "--checkpoint", str(run.checkpoint), "--out", str(out), "--num-images", "10", "--blocks", *blocks,
          "--batch-size", "3", "--histogram-values", "500"])
    rows = read_csv(out / "stats.csv")
    views = models.select_blocks(run.model, blocks)
    cap, _ = recorded(run, views, ["attn", "mlp"])
    assert len(rows) == 2 * len(views)
    for row in rows:
        acts = cap[row["layer"], row["sublayer"]].double().numpy()  # (N, T, C)
        varying = acts.std(0) > 1e-9 * np.abs(acts).max()
        kurt = scipy_stats.kurtosis(acts, axis=0)[varying]
        assert int(row["neurons"]) == acts.shape[1] * acts.shape[2] and int(row["n_images"]) == 10
        assert int(row["constant_neurons"]) == int((~varying).sum())
        assert float(row["kurtosis_median"]) == pytest.approx(float(np.median(kurt)), abs=1e-4)
        assert float(row["kurtosis_max"]) == pytest.approx(float(kurt.max()), abs=1e-4)
    acc = events(out)
    assert [e.step for e in acc.Scalars("kurtosis_median/attn")] == [v.global_index for v in views]


def manifest_labels(run) -> dict[str, str]:
    with open(run.volumes.parent / "manifest.csv", newline="") as handle:
        return {str((run.volumes.parent / r["path"]).resolve()): r["label"] for r in csv.DictReader(handle)}


@pytest.mark.parametrize("family", ["vit3d", pytest.param("swin_unetr", marks=pytest.mark.slow)])
def test_features_on_volumes_labels_from_the_manifest(tmp_path, runs, family):
    """k-NN per depth on the run's labelled volumes; a segmentation checkpoint (SwinUNETR) takes the volumes' labels from
    the data's manifest like a classifier does."""
    run = runs(family)
    loaded = load_model(namespace(run))
    assert loaded.task == ("segmentation" if family == "swin_unetr" else "classification")
    out = tmp_path / "features"
    blocks = BLOCKS[family][-2:]
    main(["features", "--checkpoint", str(run.checkpoint), "--out", str(out), "--blocks", *blocks, "--knn-k", "3", "--batch-size", "4"])
    rows = read_csv(out / "features.csv")
    views = models.select_blocks(run.model, blocks)
    truth = manifest_labels(run)
    pooled, labels = {}, {}
    for split in ("train", "val"):
        cap, batch = recorded(run, views, ["resid"], split, count=PATIENTS)
        assert [batch.class_names[i] for i in batch.labels] == [truth[name] for name in batch.names]  # labels = manifest's
        labels[split] = batch.labels
        for view in views:
            cls = view.num_prefix_tokens > 0
            pooled[split, view.name] = cap.prefix[view.name]["resid"][:, 0] if cls else cap[view.name, "resid"].mean(1)
    assert set(labels["train"].tolist()) == {0, 1} and labels["train"].numel() + labels["val"].numel() == PATIENTS
    assert [r["layer"] for r in rows] == [v.name for v in views]
    for row, view in zip(rows, views):
        assert row["pool"] == ("cls" if family == "vit3d" else "mean")
        assert (int(row["n_train"]), int(row["n_eval"])) == (labels["train"].numel(), labels["val"].numel())
        knn = knn_probe(pooled["train", view.name], labels["train"], pooled["val", view.name], labels["val"], k=3)
        assert float(row["knn_accuracy"]) == pytest.approx(knn.accuracy, abs=1e-7)
    acc = events(out)
    assert [e.step for e in acc.Scalars("features/knn_accuracy/model")] == [v.global_index for v in views]


@pytest.mark.slow
def test_volume_probes_refuse_in_one_line(tmp_path, runs):
    """What cannot work says why in one line: no class token to pool (UNETR), too few volumes for MI, a Swin block by --pool cls."""
    run = runs("unetr")
    cases = [
        (["features", "--pool", "cls", "--blocks", "0"], r"--pool cls: stage0.block0 has no class token"),
        (["mi", "--num-images", "50"], r"--num-images 50: the image source has only 10 images"),
        (["mi", "--split", "test"], r"the data has no 'test' volumes"),
    ]
    for i, (argv, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message) as err:
            main([argv[0], "--checkpoint", str(run.checkpoint), "--out", str(tmp_path / str(i)), *argv[1:]])
        assert "\n" not in str(err.value)
