"""probe.py attention on 3-D checkpoints (SwinUNETR, UNETR, 3-D ViT): query-voxel montages, rollout, attention vs
distance in mm, checked against brute force from the recorded dense attention."""

from __future__ import annotations

import argparse
import csv
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.models import shifted_window_partners
from tests.helpers.volumes import make_volume_run
from vitlab import models
from vitlab.probes import main
from vitlab.probes.loading import load_model
from vitlab.probes.streams import load_images
from vitlab.probes.attention_volume import query_maps, query_voxel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("attention3d")  # the synthetic volumes are made once for the module


@pytest.fixture(scope="module")
def runs(root):
    """family -> run, built once (a MONAI SwinUNETR takes seconds to build)."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_volume_run(root, family, seed=3)
        return cache[family]
    return get


def volumes(run, count=2):
    args = argparse.Namespace(checkpoint=run.checkpoint, config=None, model=None, images=None, num_images=count, split="val",
                              spacing=None, seed=0)
    loaded = load_model(args)
    return load_images(args, loaded, count, volumes=True)


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def events(out):
    acc = EventAccumulator(str(next(out.glob("events.out.tfevents.*"))), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


# a few blocks keep the test fast (every block is drawn the same way): SwinUNETR 4096-token, shifted 8-window and one-window
# blocks, UNETR (12 blocks) its first and last
BLOCKS = {"swin_unetr": ["--blocks", "0", "3", "5"], "unetr": ["--blocks", "0", "11"], "vit3d": []}


@pytest.mark.parametrize("family", [pytest.param("swin_unetr", marks=pytest.mark.slow), pytest.param("unetr", marks=pytest.mark.slow), "vit3d"])
def test_attention_probe_on_volumes(root, runs, family):
    run = runs(family)
    out = root / f"out_{family}"
    main(["attention", "--checkpoint", str(run.checkpoint), "--out", str(out), "--num-images", "2", "--show", "1", *BLOCKS[family]])
    views = models.select_blocks(run.model, [int(b) for b in BLOCKS[family][1:]] or None)
    images = set(events(out).Tags()["images"])
    for view in views:
        assert any(t.startswith(f"attention_query/{view.name} volume 0 (rows: head 0") and t.endswith("columns: axial, coronal, sagittal)") for t in images), view.name
        assert f"attention_distance/{view.name} (x: query-key distance in mm; lines: heads)" in images
        assert f"attention_angle/{view.name}" in images
    assert "attention_distance/mean distance (blocks x heads, mm)" in images
    rollout = [t for t in images if t.startswith("attention_rollout/volume 0")]
    assert rollout == ["attention_rollout/volume 0 (rows: " + ("class token" if family == "vit3d" else "query token, mean over queries")
                       + "; columns: axial, coronal, sagittal)"]
    assert not any(t.startswith("attention_query/") and "volume 1" in t for t in images)  # --show 1

    # independent computation: dense attention of both volumes, distances between token centres by loops
    batch = volumes(run)
    size, spacing = run.size, batch.spacing
    with torch.no_grad(), models.record_attention(run.model, to_cpu=True) as rec:
        run.model(batch.inputs)
    means = {(r["layer"], int(r["head"])): float(r["mean_attention_distance"]) for r in read_csv(out / "attention_distance_mean.csv")}
    bins = read_csv(out / "attention_distance.csv")
    for view in views:
        grid, prefix = rec.grids[view.name], view.num_prefix_tokens
        if math.prod(grid) > 512:  # SwinUNETR's first stage (4096 tokens): the same code as the next stage, too big for loops
            continue
        dense = rec.dense(view.name)[:, :, prefix:, prefix:].double()  # (2, H, P, P)
        token_mm = [n * s / g for n, s, g in zip(size, spacing, grid)]
        cells = [(i, j, k) for i in range(grid[0]) for j in range(grid[1]) for k in range(grid[2])]
        centre = torch.tensor([[(c + 0.5) * t for c, t in zip(cell, token_mm)] for cell in cells], dtype=torch.float64)
        dist = torch.tensor([[math.dist(a, b) for b in centre.tolist()] for a in centre.tolist()], dtype=torch.float64)
        for head in range(dense.shape[1]):
            expected = float((dense[:, head] * dist).sum() / dense[:, head].sum())
            assert means[view.name, head] == pytest.approx(expected, rel=1e-5)
        pairs = torch.ones_like(dist, dtype=torch.bool)  # ViT: one group of all tokens, every pair counts
        if view.window_size is not None:  # MONAI Swin: odd blocks shift by half a window unless one window covers the grid
            window = view.window_size
            shift = [w // 2 if int(view.name[-1]) % 2 and n > w else 0 for n, w in zip(grid, window)]
            pairs = shifted_window_partners(grid, window, shift)
        rows = [r for r in bins if r["layer"] == view.name]
        assert rows
        for r in rows:
            in_bin = (dist >= float(r["bin_low"])) & (dist < float(r["bin_high"])) & pairs
            assert int(r["pairs"]) == 2 * int(in_bin.sum())
            head = int(r["head"])
            assert float(r["mean_attention"]) == pytest.approx(float(dense[:, head][:, in_bin].mean()), rel=1e-5)


@pytest.mark.parametrize("family", ["swin_unetr", "vit3d"])
def test_query_montage_data_is_the_recorded_attention_row(runs, family):
    run = runs(family)
    size = run.size
    g = torch.Generator().manual_seed(1)
    voxel = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in size)
    x = torch.rand(1, 1, *size, generator=g)
    with torch.no_grad(), models.record_attention(run.model, to_cpu=True) as rec:
        run.model(x)
    for view in models.blocks(run.model):
        grid, prefix = rec.grids[view.name], view.num_prefix_tokens
        dense = rec.dense(view.name)  # Swin: the windows scattered into token x token form, an independent path
        labels, maps, token = query_maps(rec, view, voxel, size)
        cell = [v * gr // n for v, gr, n in zip(voxel, grid, size)]  # the token whose voxels hold the query voxel
        q = prefix + (cell[0] * grid[1] + cell[1]) * grid[2] + cell[2]
        heads = dense.shape[1]
        assert list(token) == cell and labels[:heads + 1] == [f"head {h}" for h in range(heads)] + ["head mean"]
        assert torch.equal(maps[0, :heads], dense[0, :, q, prefix:])
        torch.testing.assert_close(maps[0, heads], dense[0, :, q, prefix:].mean(0))
        if prefix:
            assert labels[-1] == "class token (head mean)"
            torch.testing.assert_close(maps[0, -1], dense[0, :, 0, prefix:].mean(0))


def test_query_voxel_is_validated(root, runs):
    assert query_voxel(None, (32, 32, 16)) == (16, 16, 8)
    with pytest.raises(ValueError, match=r"--query I J K: voxel \(3, 40, 0\) is outside .*J in 0\.\.31"):
        query_voxel([3, 40, 0], (32, 32, 16))
    run = runs("vit3d")
    with pytest.raises(ValueError, match=r"--query I J K: .*K in 0\.\.15"):
        main(["attention", "--checkpoint", str(run.checkpoint), "--out", str(root / "bad"), "--num-images", "1", "--query", "0", "0", "16"])
