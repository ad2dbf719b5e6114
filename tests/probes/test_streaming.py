"""Probes at dataset scale stream their images and keep only what each analysis needs.

The streamed results must equal the old all-in-memory computation: all images loaded at once, every
channel of every block captured, the channel subset drawn afterwards and the estimators applied to the lot.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from tests.helpers.probes import load, model_args, probe_images, read_csv
from vitlab import models
from vitlab.analysis.mi import mi_vs_distance
from vitlab.models.testing import tiny_model
from vitlab.probes import main
from vitlab.probes.activations import record_batches
from vitlab.probes import mi as mi_probe
from vitlab.probes.loading import LoadedModel
from vitlab.probes.streams import image_stream, load_images
from vitlab.run_record import DataRecord

pytestmark = pytest.mark.usefixtures("one_thread")


def test_image_stream_equals_loaded_images(tiny_dataset, image_dir):
    model = models.build_model("vit_tiny_patch16_224", 2, in_chans=3, img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2).eval()
    folder = argparse.Namespace(images=[str(image_dir)], num_images=11, split="val", seed=0)
    embedded = argparse.Namespace(images=None, num_images=9, split="train", seed=3)
    data = DataRecord("ImageData", {"root": str(tiny_dataset), "in_chans": 3})
    for args in (folder, embedded):
        loaded = LoadedModel(model, "m", "test", data=data)
        whole = load_images(args, loaded, 1000)
        stream = image_stream(args, loaded, 1000)
        assert stream.count == whole.inputs.shape[0] == args.num_images
        assert torch.equal(torch.cat(list(stream.batches(4))), whole.inputs)  # uneven last batch
        pixels, labels = zip(*stream.pixel_batches(4))
        assert torch.equal(torch.cat(pixels), whole.pixels)
        assert (whole.labels is None and set(labels) == {None}) or torch.equal(torch.cat(labels), whole.labels)


def all_at_once_mi(family, weights, image_dir, args: argparse.Namespace):
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
@pytest.mark.slow
def test_streamed_mi_equals_all_in_memory(tmp_path, weights, image_dir, family):
    width = models.blocks(load(family, weights))[0].dim
    centre, cross = width // 2, 4  # a random subset of the channels: the draw must be the old one too
    out = tmp_path / "mi"
    with pytest.warns(UserWarning, match="noisy below 500"):
        main(["mi", *model_args(family, weights), "--images", str(image_dir), "--out", str(out), "--batch-size", "6",
              "--centre-channels", str(centre), "--cross-channels", str(cross), "--binned-channels", "4", "--binned-cross-channels", "2",
              "--bins", "4", "--ksg-pairs", "3", "--precision", "fp32"])
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


def test_capture_keeps_only_the_chosen_channels(weights):
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


def test_forward_precision_choice(monkeypatch):
    """auto = bf16 autocast on a CPU that multiplies bf16 natively, fp32 elsewhere (and on GPUs); explicit choices win."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(mi_probe, "native_bf16_cpu", lambda native=native: native)
        assert mi_probe.forward_dtype("auto", cpu) == (torch.bfloat16 if native else None)
        assert mi_probe.forward_dtype("auto", gpu) is None
        assert mi_probe.forward_dtype("fp32", cpu) is None and mi_probe.forward_dtype("bf16", cpu) == torch.bfloat16


@pytest.mark.parametrize("family", ["timm-vit", "timm-swin"])
@pytest.mark.slow
def test_bf16_forward_keeps_the_mi_curves(family):
    """The bf16-autocast recording moves the MI curves by far less than their sampling error (documented in --help).

    Independent reference: the same images through the fp32 forward. Randomised tiny models, smooth random images
    (low-resolution noise upsampled: MI decays with distance), N = 400.
    """
    model = tiny_model(family, 2, seed=1)
    g = torch.Generator().manual_seed(0)
    images = torch.nn.functional.interpolate(torch.rand(400, 3, 4, 4, generator=g), size=32, mode="bicubic").sub(0.5).div(0.25)
    views, sites = models.select_blocks(model, None), ["attn", "mlp"]
    recorded = {}
    for autocast in (None, torch.bfloat16):
        batches = list(record_batches(model, images, sites, views, 64, torch.device("cpu"), "test", dtype=torch.float16, autocast=autocast))
        recorded[autocast] = {(v.name, s): torch.cat([b.capture[v.name, s] for b in batches]) for v in views for s in sites}
    grids = {v.name: tuple(batches[0].capture.grids[v.name]) for v in views}
    for (name, site), exact in recorded[None].items():
        approx = recorded[torch.bfloat16][name, site]
        error = (approx.float() - exact.float()).abs() / exact.float().std()
        assert 0 < error.mean() < 0.01 and error.max() < 0.1, (name, site)  # bf16 really ran, and stayed close
        for estimator, k, c, extra, tol_same, tol_cross in (("copula", 16, 8, {}, 0.005, 0.03), ("binned", 8, 4, {"bins": 7}, 0.01, 0.01)):
            curves = [mi_vs_distance(acts, grids[name], k, estimator, torch.Generator().manual_seed(0), c, **extra) for acts in (exact, approx)]
            same, cross = ((a - b).abs().nan_to_num().max().item() for a, b in zip(*[(x.mi_same, x.mi_cross) for x in curves]))
            assert same <= tol_same and cross <= tol_cross, (name, site, estimator, same, cross)
