"""probe.py mi / stats / attention / spectra / features end to end on tiny randomised models (the Veta lecture;
Philip et al.).

Each subcommand runs in-process on 32 px DICOMs; its CSV numbers are checked against an independent
computation (capture / record_attention / forward_until + the analysis functions called directly).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import yaml

from tests.helpers.probes import load, model_args, probe_images, read_csv
from tests.helpers.runs import events
from vitlab import models
from vitlab.analysis.mi import gaussian_copula_mi
from vitlab.analysis.probing import knn_probe
from vitlab.analysis.spectra import qk_spectra
from vitlab.analysis.stats import attention_vs_angle
from vitlab.probes import build_parser, main
from vitlab.probes.loading import LoadedModel
from vitlab.probes.streams import load_images
from vitlab.runs import config_data

SUBCOMMANDS = ("mi", "stats", "attention", "spectra", "features")


# ---------------------------------------------------------------------------------------------- help


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_explains_with_example(name):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[name]
    assert "example" in sub.description and f"probe.py {name}" in sub.description


# ---------------------------------------------------------------------------------------------- mi


@pytest.mark.slow
def test_mi_matches_direct_copula(tmp_path, weights, image_dir):
    """All channels as centres, no cross channels: mi_same = mean over channels and tokens of the copula MI."""
    out = tmp_path / "mi"
    with pytest.warns(UserWarning, match="noisy below 500"):
        main(["mi", *model_args("timm-swin", weights), "--images", str(image_dir), "--out", str(out), "--batch-size", "5",
              "--centre-channels", "1000", "--cross-channels", "0", "--ksg-pairs", "4", "--blocks", "stage0.block1", "stage1.block0",
              "--precision", "fp32"])
    rows = read_csv(out / "mi.csv")
    assert {"layer", "sublayer", "distance", "mi_same", "mi_cross", "n_images", "flag_nonmonotone"} <= set(rows[0])
    model = load("timm-swin", weights)
    inputs = probe_images(model, image_dir).inputs
    with torch.no_grad(), models.capture(model, ["attn", "mlp"], ["stage0.block1", "stage1.block0"], dtype=torch.float16) as cap:
        model(inputs)
    checked = 0
    for name in ("stage0.block1", "stage1.block0"):
        for site in ("attn", "mlp"):
            acts = cap[name, site]  # (32, T, C) fp16
            rows_h, cols_w = cap.grids[name]
            t0 = (rows_h // 2) * cols_w + cols_w // 2
            mi = torch.stack([gaussian_copula_mi(acts[:, t0, c].float(), acts[:, :, c].float()) for c in range(acts.shape[2])])  # (C, T)
            token = torch.arange(rows_h * cols_w)
            dist = ((token // cols_w - rows_h // 2) ** 2 + (token % cols_w - cols_w // 2) ** 2).double().sqrt()
            mine = [r for r in rows if r["layer"] == name and r["sublayer"] == site]
            assert [float(r["distance"]) for r in mine] == pytest.approx(sorted(set(dist.tolist())))
            for r in mine:
                assert int(r["n_images"]) == 32
                at = (dist - float(r["distance"])).abs() < 1e-6  # the CSV keeps 8 digits
                at[t0] = False
                if not at.any():
                    assert math.isnan(float(r["mi_same"]))
                    continue
                assert float(r["mi_same"]) == pytest.approx(float(mi[:, at].mean()), rel=1e-4, abs=1e-6)
                assert math.isnan(float(r["mi_cross"]))
                checked += 1
    assert checked > 10
    ksg = read_csv(out / "mi_ksg.csv")
    assert len(ksg) == 4 * 2 * 2 and all(math.isfinite(float(r["mi_ksg"])) for r in ksg)
    ev = events(out)
    assert {"mi/stage0.block1", "mi/stage1.block0", "mi_layers/attn/stage0", "mi_layers/mlp/stage1"} <= set(ev.Tags()["images"])
    assert [e.step for e in ev.Scalars("mi_nearest_same/attn")] == [1, 2]


def test_mi_flags_nonmonotone_dependence():
    """y = x^2 + noise between the centre token and its neighbours: the copula misses it, the binned check flags it."""
    from vitlab.probes.mi import estimate, result_rows

    g = torch.Generator().manual_seed(0)
    n = 2000
    x = torch.randn(n, generator=g)
    acts = torch.randn(n, 9, 2, generator=g)  # (N, 3x3 tokens, 2 channels)
    acts[:, 4, 0] = x  # centre token of channel 0
    view = models.BlockView("stage0.block0", 0, 0, 0, torch.nn.Identity(), "b", 2, None, None, False, None, None, None, (3, 3), 0)
    args = argparse.Namespace(centre_channels=2, cross_channels=0, binned_channels=2, binned_cross_channels=0, bins=16)
    # x^2 + noise: non-monotone; (x + noise)^3: a monotone map of a Gaussian pair (copula exact, bins coarse)
    for relation, flagged in ((lambda e: x.square() + e, True), (lambda e: (x + e).pow(3), False)):
        for t in (0, 1, 2, 3, 5, 6, 7, 8):
            acts[:, t, 0] = relation(0.5 * torch.randn(n, generator=g))
        rows = result_rows(view, "attn", estimate(acts.half(), (3, 3), args, seed=0), n, threshold=0.05)
        near = [r for r in rows if r["distance"] > 0]
        assert all(bool(r["flag_nonmonotone"]) == flagged for r in near)
        if flagged:  # copula blind (channel mean ~ 0), binned sees it (channel 0 ~ 0.6 nats, channel 1 ~ 0)
            assert all(abs(r["mi_same"]) < 0.02 and r["mi_same_binned"] > 0.2 for r in near)
        else:  # truth 0.80 nats on channel 0, 0 on channel 1: the copula mean is ~0.40
            assert all(abs(r["mi_same"] - 0.5 * 0.5 * math.log(5)) < 0.03 for r in near)


@pytest.mark.filterwarnings("ignore:probe.py mi. only 32 images")
def test_mi_bad_inputs(tmp_path, weights, image_dir):
    base = ["mi", *model_args("timm-vit", weights), "--images", str(image_dir)]
    with pytest.raises(ValueError, match=r"--num-images 100: the image source has only 32 images"):
        main([*base, "--num-images", "100", "--out", str(tmp_path / "a")])
    with pytest.raises(ValueError, match=r"--blocks: unknown block 'stage3.block0': valid names are stage0.block0"):
        main([*base, "--blocks", "stage3.block0", "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit):  # argparse: invalid choice, lists the valid sites
        main([*base, "--sublayers", "qkv", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # no empty folder left behind


# ---------------------------------------------------------------------------------------------- stats


@pytest.mark.slow
def test_stats_matches_scipy_on_mixer(tmp_path, weights, image_dir):
    """Kurtosis merged over uneven batches = scipy on all images; MLP-Mixer's token mixing is a valid site."""
    out = tmp_path / "stats"
    main(["stats", *model_args("timm-mixer", weights), "--images", str(image_dir), "--out", str(out), "--batch-size", "5",
          "--sublayers", "token_mixing", "mlp_hidden", "--histogram-values", "500"])
    rows = read_csv(out / "stats.csv")
    assert [(r["layer"], r["sublayer"]) for r in rows] == [(b, s) for b in ("stage0.block0", "stage0.block1") for s in ("attn", "mlp_hidden")]
    model = load("timm-mixer", weights)
    with torch.no_grad(), models.capture(model, ["attn", "mlp_hidden"]) as cap:
        model(probe_images(model, image_dir).inputs)
    for r in rows:
        acts = cap[r["layer"], r["sublayer"]].double().numpy()  # (32, T, C)
        kurt = scipy.stats.kurtosis(acts, axis=0).ravel()
        assert int(r["neurons"]) == kurt.size and int(r["n_images"]) == 32
        assert float(r["kurtosis_median"]) == pytest.approx(np.median(kurt), rel=1e-5)
        assert float(r["kurtosis_max"]) == pytest.approx(kurt.max(), rel=1e-5)
        assert float(r["activation_std"]) == pytest.approx(acts.std(), rel=1e-5)
    ev = events(out)
    assert "kurtosis/attn/stage0.block1" in ev.Tags()["histograms"] and "activations/mlp_hidden/stage0.block0" in ev.Tags()["histograms"]
    assert [e.step for e in ev.Scalars("kurtosis_median/attn")] == [0, 1]
    assert {"kurtosis_vs_depth/attn", "activation_distributions/mlp_hidden"} <= set(ev.Tags()["images"])


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.slow
def test_attention_vit_matches_single_pass(tmp_path, weights, image_dir):
    """Angle statistics merged over uneven batches = attention_vs_angle on all images at once."""
    out = tmp_path / "att"
    main(["attention", *model_args("torchvision-vit", weights), "--images", str(image_dir), "--out", str(out), "--batch-size", "5", "--show", "2", "--panel-px", "32"])
    model = load("torchvision-vit", weights)
    with torch.no_grad(), models.record_attention(model) as rec, models.capture(model, "qkv_input") as cap:
        model(probe_images(model, image_dir).inputs)
    bins, masses = read_csv(out / "attention_angle.csv"), read_csv(out / "attention_mass.csv")
    for name in ("stage0.block0", "stage0.block1"):
        expected = attention_vs_angle(rec.attentions[name][:, :, 1:, 1:], cap[name, "qkv_input"], 5.0)  # prefix dropped
        for head in range(2):
            mine = [r for r in bins if r["layer"] == name and int(r["head"]) == head]
            assert len(mine) == 36 and [int(r["pairs"]) for r in mine] == expected.bin_counts.tolist()
            got = np.array([float(r["mean_attention"]) for r in mine])
            np.testing.assert_allclose(got, expected.mean_attention[head].numpy(), rtol=1e-5, equal_nan=True)
            row = next(r for r in masses if r["layer"] == name and int(r["head"]) == head)
            for key in ("mass_below_90", "mass_above_90", "self_attention"):
                assert float(row[key]) == pytest.approx(float(getattr(expected, key)[head]), rel=1e-5)
    # attention vs distance in 2-D: pixels between token centres; mean attention distance by brute force
    size = models.input_size(model)[1:]
    means = {(r["layer"], int(r["head"])): r for r in read_csv(out / "attention_distance_mean.csv")}
    for name in ("stage0.block0", "stage0.block1"):
        grid, probs = rec.grids[name], rec.attentions[name][:, :, 1:, 1:].double()
        step = [n / g for n, g in zip(size, grid)]
        cells = [(i, j) for i in range(grid[0]) for j in range(grid[1])]
        dist = torch.tensor([[math.hypot((a[0] - b[0]) * step[0], (a[1] - b[1]) * step[1]) for b in cells] for a in cells], dtype=torch.float64)
        for head in range(2):
            row = means[name, head]
            assert row["unit"] == "px"
            assert float(row["mean_attention_distance"]) == pytest.approx(float((probs[:, head] * dist).sum() / probs[:, head].sum()), rel=1e-5)
    ev = events(out)
    images = ev.Tags()["images"]
    assert "attention_distance/stage0.block1 (x: query-key distance in px; lines: heads)" in images
    assert any(t.startswith("attention_map/stage0.block1") for t in images) and any(t.startswith("attention_rollout") for t in images)
    assert "attention_angle/stage0.block0" in images
    panel = ev.Images(next(t for t in images if t.startswith("attention_map/stage0.block0")))[0]
    assert panel.width > 4 * 32 and panel.height > 2 * 32  # 2 images x (image, 2 heads, head mean) of 32 px, labelled
    assert [e.step for e in ev.Scalars("attention_angle/mass_above_90")] == [0, 1]


@pytest.mark.slow
def test_attention_swin_windows_match_dense(tmp_path, weights, image_dir):
    """Swin: masses from the raw windows = from the dense token x token form (pairs across windows weigh 0)."""
    out = tmp_path / "att"
    main(["attention", *model_args("timm-swin", weights), "--images", str(image_dir), "--out", str(out), "--batch-size", "7", "--show", "1"])
    model = load("timm-swin", weights)
    with torch.no_grad(), models.record_attention(model) as rec, models.capture(model, "qkv_input") as cap:
        model(probe_images(model, image_dir).inputs)
    masses = read_csv(out / "attention_mass.csv")
    assert len(masses) == 1 + 1 + 2 + 2  # heads (1, 2) per stage, two blocks each
    for row in masses:
        dense = attention_vs_angle(rec.dense(row["layer"]), cap[row["layer"], "qkv_input"], 5.0)
        for key in ("mass_below_90", "mass_above_90", "self_attention"):
            assert float(row[key]) == pytest.approx(float(getattr(dense, key)[int(row["head"])]), rel=1e-5)
    assert any(t.startswith("attention_rollout") for t in events(out).Tags()["images"])


def test_patch_windows_equal_dense_entries(weights):
    """models addition: AttentionRecord.patch_windows slots index the dense matrix (ViT: prefix dropped)."""
    for family in ("timm-swin", "timm-vit"):
        model = load(family, weights)
        with torch.no_grad(), models.record_attention(model) as rec:
            model(torch.rand(2, 3, 32, 32))
        for name, view in rec.views.items():
            probs, slots = rec.patch_windows(name)
            prefix = view.num_prefix_tokens
            dense = rec.dense(name)[:, :, prefix:, prefix:]  # (2, H, T, T)
            groups = probs.reshape(2, slots.shape[0], *probs.shape[1:])
            for g in range(slots.shape[0]):
                torch.testing.assert_close(groups[:, g], dense[:, :, slots[g]][:, :, :, slots[g]])


def test_attention_refuses_mixer(tmp_path, weights, image_dir):
    with pytest.raises(ValueError, match=r"probe.py attention: timm-mixer has no attention .*timm SwinTransformer"):
        main(["attention", *model_args("timm-mixer", weights), "--images", str(image_dir), "--out", str(tmp_path / "x")])


# ---------------------------------------------------------------------------------------------- spectra


@pytest.mark.slow
def test_spectra_csv_and_figures(tmp_path, weights):
    out = tmp_path / "spec"
    main(["spectra", *model_args("timm-swin", weights), "--out", str(out)])
    rows = read_csv(out / "spectra.csv")
    model = load("timm-swin", weights)
    views = {v.name: v for v in models.blocks(model)}
    assert [(r["block"], r["head"]) for r in rows] == [(b, h) for b, v in views.items() for h in [*map(str, range(v.num_heads)), "sum"]]
    for name, parts in models.qkv(model).items():
        s = qk_spectra(parts["q"], parts["k"], views[name].num_heads)
        for r in (r for r in rows if r["block"] == name and r["head"] != "sum"):
            assert float(r["positive_mass"]) == pytest.approx(float(s.positive_mass[int(r["head"])]), rel=1e-5)
            assert float(r["top_singular_value"]) == pytest.approx(float(s.singular_values[int(r["head"]), 0]), rel=1e-5)
    ev = events(out)
    assert {"spectra_figure/stage0", "spectra_figure/stage1"} <= set(ev.Tags()["images"])
    assert "spectra/positive_mass/stage1.block1" in ev.Tags()["scalars"]
    with pytest.raises(ValueError, match="timm-mixer has no attention"):
        main(["spectra", *model_args("timm-mixer", weights), "--out", str(tmp_path / "m")])


# ---------------------------------------------------------------------------------------------- features


@pytest.fixture
def labelled_config(tmp_path, tiny_dataset) -> Path:
    """A training config whose data section is the labelled tiny dataset (train / val split by patient)."""
    path = tmp_path / "config.yaml"
    path.write_text(f"model:\n  model_name: vit_tiny_patch16_224\ndata:\n  root: {tiny_dataset}\n  in_chans: 3\n")
    return path


@pytest.mark.slow
def test_features_same_weights_give_cka_one(tmp_path, weights, labelled_config):
    """Second model = the same weights: identical accuracies, CKA 1; accuracies = k-NN on forward_until features."""
    out = tmp_path / "feat"
    main(["features", "--config", str(labelled_config), *model_args("timm-vit", weights), *model_args("timm-vit", weights, "second-"),
          "--out", str(out), "--knn-k", "3", "--cka-images", "5", "--batch-size", "7"])
    rows = read_csv(out / "features.csv")
    assert [(r["model"], r["layer"]) for r in rows] == [(m, b) for m in ("model", "second") for b in ("stage0.block0", "stage0.block1")]
    firsts, seconds = rows[:2], rows[2:]
    for a, b in zip(firsts, seconds):
        assert a["knn_accuracy"] == b["knn_accuracy"] and a["linear_accuracy"] == b["linear_accuracy"]
    model = load("timm-vit", weights)
    ns = argparse.Namespace(images=None, num_images=None, split="train", seed=0)
    loaded = LoadedModel(model, "m", "test", data=config_data(yaml.safe_load(labelled_config.read_text()), str(labelled_config)))
    train, val = load_images(ns, loaded, 1000), load_images(ns, loaded, 1000, split="val")
    assert int(rows[0]["n_train"]) == len(train.labels) and int(rows[0]["n_eval"]) == len(val.labels)
    with torch.no_grad():
        for r in firsts:
            f_train = models.forward_until(model, train.inputs, r["layer"])[:, 0]  # (N, C) class token
            f_val = models.forward_until(model, val.inputs, r["layer"])[:, 0]
            assert float(r["knn_accuracy"]) == pytest.approx(knn_probe(f_train, train.labels, f_val, val.labels, k=3).accuracy)
    cka = read_csv(out / "cka.csv")
    assert [float(r["cka_pooled"]) for r in cka] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert [float(r["cka_tokens"]) for r in cka] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert int(cka[0]["n_token_images"]) == 5
    ev = events(out)
    assert {"features/accuracy_vs_depth", "cka/vs_depth"} <= set(ev.Tags()["images"])
    assert [e.step for e in ev.Scalars("features/knn_accuracy/second")] == [0, 1]


def test_features_untrained_baseline_cka(tmp_path, weights, labelled_config):
    out = tmp_path / "feat"
    main(["features", "--config", str(labelled_config), *model_args("timm-swin", weights), "--second-untrained", "--out", str(out),
          "--knn-k", "3", "--cka-images", "0", "--blocks", "3"])
    rows, cka = read_csv(out / "features.csv"), read_csv(out / "cka.csv")
    assert [(r["model"], r["layer"], r["pool"]) for r in rows] == [("model", "stage1.block1", "mean"), ("second", "stage1.block1", "mean")]
    assert rows[1]["source"].startswith("untrained")
    assert 0.0 < float(cka[0]["cka_pooled"]) < 0.999 and math.isnan(float(cka[0]["cka_tokens"]))


def test_features_bad_inputs(tmp_path, weights, labelled_config, image_dir):
    base = ["features", "--config", str(labelled_config), *model_args("timm-vit", weights)]
    with pytest.raises(ValueError, match=r"second model swin_tiny\S* \(timm-swin.*another architecture than vit_tiny\S* \(timm-vit"):
        main([*base, *model_args("timm-swin", weights, "second-"), "--out", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="needs labelled train and evaluation splits"):
        main([*base, "--images", str(image_dir), "--out", str(tmp_path / "b")])
    with pytest.raises(ValueError, match="--pool cls: stage0.block0 has no class token"):
        main(["features", "--config", str(labelled_config), *model_args("timm-swin", weights), "--pool", "cls", "--out", str(tmp_path / "c")])

