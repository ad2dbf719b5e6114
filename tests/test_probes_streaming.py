"""Probes at dataset scale stream their images and keep only what each analysis needs (issue 12 §7).

The streamed results must equal the old all-in-memory computation: all images loaded at once, every
channel of every block captured, the channel subset drawn afterwards and the estimators applied to the lot.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from tests.test_probes_stats import image_dir, load, model_args, probe_images, read_csv, weights  # noqa: F401 - fixtures
from vitlab import models
from vitlab.probes import main
from vitlab.probes import mi as mi_probe
from vitlab.probes.common import LoadedModel, image_stream, load_images

pytestmark = pytest.mark.usefixtures("one_thread")


def test_image_stream_equals_loaded_images(tiny_dataset, image_dir):  # noqa: F811
    model = models.build_model("vit_tiny_patch16_224", 2, in_chans=3, img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2).eval()
    folder = argparse.Namespace(images=[str(image_dir)], num_images=11, split="val", seed=0)
    embedded = argparse.Namespace(images=None, num_images=9, split="train", seed=3)
    data = {"root": str(tiny_dataset), "in_chans": 3}
    for args in (folder, embedded):
        loaded = LoadedModel(model, "m", "test", data=data)
        whole = load_images(args, loaded, 1000)
        stream = image_stream(args, loaded, 1000)
        assert stream.count == whole.inputs.shape[0] == args.num_images
        assert torch.equal(torch.cat(list(stream.batches(4))), whole.inputs)  # uneven last batch
        pixels, labels = zip(*stream.pixel_batches(4))
        assert torch.equal(torch.cat(pixels), whole.pixels)
        assert (whole.labels is None and set(labels) == {None}) or torch.equal(torch.cat(labels), whole.labels)


def all_at_once_mi(family, weights, image_dir, args: argparse.Namespace):  # noqa: F811
    """The pre-streaming mi path: every image and channel in memory, then the channel subset and the estimators."""
    model = load(family, weights)
    inputs = probe_images(model, image_dir).inputs  # (N, C, H, W): all images
    views, sites = models.select_blocks(model, None), ["attn", "mlp"]
    parts = []
    with torch.no_grad():
        for start in range(0, inputs.shape[0], args.batch_size):  # the probe's batches: bit-identical outputs
            with models.capture(model, sites, dtype=torch.float16) as cap:
                model(inputs[start : start + args.batch_size])
            parts.append(cap)
    generator = torch.Generator().manual_seed(args.seed)
    rows, checks = [], []
    for view in views:
        for site in sites:
            acts = torch.cat([cap[view.name, site] for cap in parts])  # (N, T, C) all channels
            width = acts.shape[-1]
            keep = torch.randperm(width, generator=generator)[: args.centre_channels + args.cross_channels].sort().values
            acts, grid = acts[:, :, keep], tuple(parts[0].grids[view.name])
            seed = args.seed * 1000 + view.global_index
            result = mi_probe.estimate(acts, grid, args, seed)
            rows += mi_probe.result_rows(view, site, result, acts.shape[0], args.disagreement)
            checks += mi_probe.ksg_check(acts, grid, keep, args.ksg_pairs, seed, args.bins, view.name, site)
    return rows, checks


@pytest.mark.parametrize("family", ["timm-vit", "timm-swin"])
def test_streamed_mi_equals_all_in_memory(tmp_path, weights, image_dir, family):  # noqa: F811
    width = models.blocks(load(family, weights))[0].dim
    centre, cross = width // 2, 4  # a random subset of the channels: the draw must be the old one too
    out = tmp_path / "mi"
    with pytest.warns(UserWarning, match="noisy below 500"):
        main(["mi", *model_args(family, weights), "--images", str(image_dir), "--out", str(out), "--batch-size", "6",
              "--centre-channels", str(centre), "--cross-channels", str(cross), "--binned-channels", "4", "--binned-cross-channels", "2",
              "--bins", "4", "--ksg-pairs", "3"])
    args = argparse.Namespace(batch_size=6, seed=0, centre_channels=centre, cross_channels=cross, binned_channels=4,
                              binned_cross_channels=2, bins=4, disagreement=0.05, ksg_pairs=3)
    rows, checks = all_at_once_mi(family, weights, image_dir, args)
    got, got_checks = read_csv(out / "mi.csv"), read_csv(out / "mi_ksg.csv")
    assert len(got) == len(rows) > 0 and len(got_checks) == len(checks) > 0
    for mine, ref in [*zip(got, rows), *zip(got_checks, checks)]:
        assert set(mine) == set(ref)
        for key, value in ref.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(float(mine[key])), key
            elif isinstance(value, float):
                assert float(mine[key]) == pytest.approx(value, rel=1e-7, abs=1e-12), (key, mine, ref)  # the CSV keeps 8 digits
            else:
                assert mine[key] == str(value), key
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("events")) == ["mi.csv", "mi_ksg.csv"]  # no spill left


def test_capture_keeps_only_the_chosen_channels(weights):  # noqa: F811
    model = load("timm-vit", weights)
    x = torch.randn(3, 3, 32, 32)
    keep = torch.tensor([5, 1, 30])
    with torch.no_grad(), models.capture(model, ["attn", "mlp"]) as full:
        model(x)
    with torch.no_grad(), models.capture(model, ["attn", "mlp"], channels={("stage0.block1", "mlp"): keep}) as few:
        model(x)
    assert torch.equal(few["stage0.block1", "mlp"], full["stage0.block1", "mlp"][:, :, keep])
    assert torch.equal(few["stage0.block1", "attn"], full["stage0.block1", "attn"])  # other outputs untouched
    assert torch.equal(few.prefix["stage0.block1"]["mlp"], full.prefix["stage0.block1"]["mlp"][:, :, keep])
