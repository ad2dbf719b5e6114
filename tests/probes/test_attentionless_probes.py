"""probe.py ablate / invert / visualize / filters / transplant (the Attentionless article), end to end on tiny models."""

import argparse
import csv
import io
import json
import re

import pytest
import torch

from vitlab import models
from vitlab.models.testing import TINY_MODELS, randomize_parameters, tiny_model
from vitlab.probes import main
from vitlab.probes.filters import filter_pca, minmax, position_similarity, similarity_mosaic
from vitlab.probes.invert import Layer, Variant, invert_layer

VIT_KWARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}
VIT = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(VIT_KWARGS), "--num-classes", "3"]
FAST = ["--steps", "10", "--noise-draws", "2"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A 'trained' tiny ViT: every parameter randomised (so it differs from a fresh model), saved as a state dict."""
    model = models.build_model("vit_tiny_patch16_224", 3, **VIT_KWARGS)
    path = tmp_path_factory.mktemp("weights") / "trained.pt"
    torch.save(randomize_parameters(model, seed=7).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_dataset):
    """A training config (untrained grayscale model) whose data section gives labelled images."""
    import yaml

    path = tmp_path_factory.mktemp("config") / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"model_name": "vit_tiny_patch16_224", "model_kwargs": VIT_KWARGS},
                                    "data": {"root": str(tiny_dataset), "image_size": 32}}))
    return path


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _steps(acc, tag):
    return [event.step for event in acc.Scalars(tag)]


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_ablate_survey_end_to_end(tmp_path, config, figures):
    out = tmp_path / "ablate"
    main(["--ablate", "attention", "--ablate", "mlp+layernorm", "--config", str(config), "--num-images", "2",
          "--accuracy-images", "6", "--layers", "embed,1", *FAST, "--out", str(out)])
    summary = _rows(out / "summary.csv")
    assert [(r["variant"], r["layer"], r["depth"]) for r in summary] == [
        (v, layer, d) for layer, d in (("embed", "0"), ("stage0.block1", "2"))
        for v in ("intact", "no attention", "no mlp+layernorm")]
    embed, block = summary[:3], summary[3:]
    # the embedding is untouched by block ablations: identical runs (same seed, same function)
    assert len({(r["feature_error"], r["input_error"], r["noise_error_sigma_1_18"]) for r in embed}) == 1
    assert len({r["noise_error_sigma_1_18"] for r in block}) == 3  # ablations change the layer
    accuracy = _rows(out / "accuracy.csv")
    assert [r["variant"] for r in accuracy] == ["intact", "no attention", "no mlp+layernorm"]
    assert all(r["images"] == "6" and float(r["accuracy"]) * 6 == pytest.approx(round(float(r["accuracy"]) * 6)) for r in accuracy)
    acc = _events(out)
    assert _steps(acc, "intact/input_error") == [0, 2]
    assert _steps(acc, "no_mlp_layernorm/passed_sigma_1_20") == [0, 2]
    assert {"accuracy/intact", "accuracy/no_attention", "no_attention/optimisation/stage0.block1/feature_error"} <= set(acc.Tags()["scalars"])
    assert "inversion/depth02_stage0.block1" in acc.Tags()["images"]
    panels = [ax for ax in figures["inversion/depth02_stage0.block1"].axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["original", "intact", "no attention", "no mlp+layernorm"] + [""] * 4  # 2 images
    assert "inversion/curves_vs_depth" in acc.Tags()["images"]
    assert json.loads((out / "inversion.json").read_text())["variants"] == ["intact", "no attention", "no mlp+layernorm"]


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["log-file", "terminal"])
def test_ablate_progress_is_one_bar_on_a_terminal_and_none_in_a_file(tmp_path, weights, tiny_dataset, monkeypatch,
                                                                     terminal):
    """Nested tqdm bars (layers, then each variant's inversion steps) wrote cursor-movement escapes into log files."""
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    main(["ablate", "--ablate", "attention", *VIT, "--weights", str(weights), "--images", str(tiny_dataset.parent),
          "--num-images", "1", "--layers", "embed,0", "--steps", "3", "--noise-draws", "1", "--accuracy-images", "0",
          "--out", str(tmp_path / "ablate")])
    written = stderr.getvalue()
    assert "\x1b[" not in written  # no cursor movement: no second bar
    if not terminal:
        assert "\r" not in written and "it/s" not in written and "inverting layers" not in written, written
        return
    frames = [frame for frame in re.split(r"[\r\n]", written) if "|" in frame]  # every drawing of a bar
    assert frames and {frame.split(":")[0] for frame in frames} == {"inverting layers"}, written  # one bar
    assert any("intact @ embed" in frame for frame in frames)  # the inner loops' progress, in its postfix


def test_invert_end_to_end_per_image_rows(tmp_path, weights, tiny_dataset):
    out = tmp_path / "invert"
    main(["invert", *VIT, "--weights", str(weights), "--images", str(tiny_dataset.parent), "--num-images", "3",
          "--layers", "0,embed", "--no-early-stop", *FAST, "--out", str(out)])
    per_image = _rows(out / "inversion_images.csv")
    summary = _rows(out / "summary.csv")
    assert [(r["layer"], r["depth"]) for r in summary] == [("embed", "0"), ("stage0.block0", "1")]
    assert len(per_image) == 6 and {r["steps_run"] for r in per_image} == {"10"}
    for row in per_image:
        for label in ("sigma_1_18", "sigma_1_20"):
            assert (row[f"passed_{label}"] == "True") == (float(row[f"ratio_{label}"]) < 1)
            assert int(row[f"steps_to_pass_{label}"]) <= 10
    for layer in ("embed", "stage0.block0"):
        mean = sum(float(r["input_error"]) for r in per_image if r["layer"] == layer) / 3
        assert float(next(r for r in summary if r["layer"] == layer)["input_error"]) == pytest.approx(mean, rel=1e-5)
    acc = _events(out)
    assert _steps(acc, "model/optimisation/embed/feature_error") == list(range(11))
    assert _steps(acc, "model/feature_error") == [0, 1]
    assert {"inversion/depth00_embed", "inversion/depth01_stage0.block0"} <= set(acc.Tags()["images"])


def test_visualize_end_to_end(tmp_path, weights):
    out = tmp_path / "visualize"
    main(["visualize", *VIT, "--weights", str(weights), "--steps", "8", "--every", "4", "--jitter-from", "4",
          "--classes", "0,2", "--neurons", "1:0-1", "--neurons", "stage0.block0:3", "--out", str(out)])
    rows = _rows(out / "visualize.csv")
    assert [(r["group"], r["target"]) for r in rows] == [
        ("class", "class0"), ("class", "class2"), ("neuron/stage0.block1", "unit0"), ("neuron/stage0.block1", "unit1"),
        ("neuron/stage0.block0", "unit3")]
    assert all(0 <= float(r["final_probability"]) <= 1 for r in rows[:2])
    acc = _events(out)
    assert [event.step for event in acc.Images("class/class2")] == [4, 8]
    assert _steps(acc, "class/class0/logit") == list(range(1, 9))
    assert _steps(acc, "class/class0/probability") == list(range(1, 9))
    assert _steps(acc, "neuron/stage0.block0/unit3/activation") == list(range(1, 9))
    assert {"class/all_final", "neuron/stage0.block1/unit1", "neuron/stage0.block1/all_final"} <= set(acc.Tags()["images"])


def test_filters_end_to_end_with_compare(tmp_path, weights):
    out = tmp_path / "filters"
    main(["filters", *VIT, "--weights", str(weights), "--compare", "--out", str(out)])
    acc = _events(out)
    images = set(acc.Tags()["images"])
    for label in ("model", "untrained"):
        assert {f"{label}/patch_filters", f"{label}/pca", f"{label}/pos_similarity"} <= images
    assert {"compare/patch_filters", "compare/pca", "compare/pos_similarity"} <= images
    assert "compare/filter_cosine" in acc.Tags()["histograms"]
    pca = _rows(out / "pca.csv")
    assert len(pca) == 2 * 32  # min(D=32, 3 * 8 * 8) components per model
    assert float(pca[31]["cumulative"]) == pytest.approx(1.0, abs=1e-5)
    summary = json.loads((out / "filters.json").read_text())
    assert summary["model"]["filters"] == 32 and summary["model"]["patch_size"] == [8, 8]
    assert abs(summary["untrained"]["filter_cosine_to_model_mean"]) < 0.5  # randomised vs fresh filters


def test_filters_without_position_embedding(tmp_path):
    name, kwargs = TINY_MODELS["timm-swin"]
    out = tmp_path / "swin"
    main(["filters", "--model", name, "--model-kwargs", json.dumps(kwargs), "--out", str(out)])
    summary = json.loads((out / "filters.json").read_text())["model"]
    assert summary["pos_embed"].startswith("none")
    assert "model/pos_similarity" not in _events(out).Tags()["images"]


def test_filter_math_against_independent_computations():
    from sklearn.decomposition import PCA

    weight = torch.randn(40, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    components, ratio = filter_pca(weight, 5)
    reference = PCA().fit(weight.flatten(1).double().numpy())
    torch.testing.assert_close(ratio.double(), torch.from_numpy(reference.explained_variance_ratio_), rtol=1e-5, atol=1e-7)
    flat = components.flatten(1).double()
    torch.testing.assert_close(flat @ flat.T, torch.eye(5, dtype=torch.float64), atol=1e-5, rtol=0)
    alignment = (flat * torch.from_numpy(reference.components_[:5])).sum(1).abs()  # equal up to sign
    torch.testing.assert_close(alignment, torch.ones(5, dtype=torch.float64), atol=1e-5, rtol=0)
    scaled = minmax(weight)
    assert torch.allclose(scaled.flatten(1).min(1).values, torch.zeros(40)) and torch.allclose(scaled.flatten(1).max(1).values, torch.ones(40))
    pos = torch.randn(6, 8)
    similarity = position_similarity(pos)
    manual = torch.tensor([[float(torch.dot(a, b) / (a.norm() * b.norm())) for b in pos] for a in pos])
    torch.testing.assert_close(similarity, manual, atol=1e-6, rtol=0)
    mosaic = similarity_mosaic(similarity, (2, 3))  # cell (r, c) = row r * 3 + c on the (2, 3) grid
    assert mosaic.shape == (2 * 3 - 1, 3 * 4 - 1)
    torch.testing.assert_close(mosaic[3:5, 4:7], similarity[4].view(2, 3))
    assert torch.isnan(mosaic[2]).all() and torch.isnan(mosaic[:, 3]).all()


@pytest.mark.slow
def test_transplant_end_to_end(tmp_path, weights, tiny_dataset, figures):
    out = tmp_path / "transplant"
    main(["transplant", *VIT, "--weights", str(weights), "--images", str(tiny_dataset.parent), "--num-images", "2",
          "--parts", "patch_embed,pos_embed,cls_token", "--parts", "norm1@0", "--include-trained", *FAST, "--out", str(out)])
    copied = json.loads((out / "transplant.json").read_text())["copied"]
    assert sorted(key for key, _ in copied["untrained+patch_embed,pos_embed,cls_token"]) == [
        "cls_token", "patch_embed.proj.bias", "patch_embed.proj.weight", "pos_embed"]
    assert sorted(key for key, _ in copied["untrained+norm1@0"]) == ["blocks.0.norm1.bias", "blocks.0.norm1.weight"]
    summary = {(r["variant"], r["layer"]): r for r in _rows(out / "summary.csv")}
    assert {layer for _, layer in summary} == {"embed", "stage0.block0"}  # the default layers
    keys = ("input_error", "feature_error", "noise_error_sigma_1_18", "steps_run")
    pick = lambda variant, layer: tuple(summary[variant, layer][k] for k in keys)  # noqa: E731
    # with the trained embedding the recipient's embed layer IS the trained one: identical inversion
    assert pick("untrained+patch_embed,pos_embed,cls_token", "embed") == pick("trained", "embed")
    assert pick("untrained", "embed") != pick("trained", "embed")
    assert pick("untrained+norm1@0", "embed") == pick("untrained", "embed")  # norm1 acts after the embedding
    assert pick("untrained+norm1@0", "stage0.block0") != pick("untrained", "stage0.block0")
    acc = _events(out)
    assert "inversion/depth00_embed" in acc.Tags()["images"]
    columns = [ax.get_title() for ax in figures["inversion/depth00_embed"].axes if ax.get_images()][:5]
    assert [title.replace("\n", "") for title in columns] == [
        "original", "untrained", "untrained+patch_embed,pos_embed,cls_token", "untrained+norm1@0", "trained"]


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_truncated_forward_never_calls_later_blocks(family):
    model = tiny_model(family)
    views = models.blocks(model)
    pixels = torch.rand(2, *models.input_size(model))
    calls = {view.name: 0 for view in views}
    handles = [view.module.register_forward_pre_hook(lambda m, a, name=view.name: calls.__setitem__(name, calls[name] + 1))
               for view in views]
    args = argparse.Namespace(steps=3, lr=0.05, tv_weight=0.01, sigma=1 / 18, noise_draws=1, no_early_stop=True,
                              check_every=1, seed=0)
    try:
        result = invert_layer(Variant("m", model), Layer(views[0].name, 0, 1), pixels, args)
        hidden = models.forward_until(model, pixels, 1, site="mlp_hidden")
    finally:
        for handle in handles:
            handle.remove()
    assert result.steps_run == 3
    assert calls[views[0].name] > 0 and all(calls[view.name] == 0 for view in views[2:])
    assert calls[views[1].name] == 1  # only the mlp_hidden forward reached block 1
    with models.capture(model, "mlp_hidden", blocks=1) as record:
        model(pixels)
    prefix = views[1].num_prefix_tokens
    torch.testing.assert_close(hidden[:, prefix:], record[views[1].name, "mlp_hidden"], atol=1e-5, rtol=1e-5)
    assert all("forward" not in view.module.__dict__ for view in views)  # nothing left patched
    with pytest.raises(ValueError, match="only the site 'resid'"):
        models.forward_until(model, pixels, "embed", site="attn")


# ---------------------------------------------------------------------------------------------- bad input


def _bad_png(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"not an image")
    return path


@pytest.mark.parametrize("extra, error, message", [
    (["invert", "--layers", "7"], ValueError, r"--layers: block index 7 out of range: this model has blocks 0-1"),
    (["invert", "--layers", "embed,stage2.block0"], ValueError, r"--layers: unknown block 'stage2.block0'"),
    (["transplant", "--parts", "patch_embed,wings"], ValueError, r"unknown transplant part 'wings'.*valid are"),
    (["ablate", "--ablate", "attention", "--blocks", "5"], ValueError, r"--blocks: block index 5 out of range"),
    (["visualize", "--neurons", "1:999"], ValueError, r"--neurons '1:999' \(MLP hidden units\): '999' is out of range: valid are 0-127"),
    (["visualize", "--classes", "0,3"], ValueError, r"--classes: '3' is out of range: valid are 0-2"),
])
def test_bad_layers_parts_blocks_units_name_what_is_valid(tmp_path, tiny_dataset, extra, error, message):
    out = tmp_path / "out"
    argv = [extra[0], *VIT, *extra[1:], "--out", str(out)]
    if extra[0] != "visualize":
        argv += ["--images", str(tiny_dataset.parent), "--num-images", "1", *FAST]
    with pytest.raises(error, match=message):
        main(argv)
    assert not out.exists()  # a failed start leaves no folder that would block a rerun


def test_ablation_that_does_not_apply_to_the_family(tmp_path, tiny_dataset):
    name, kwargs = TINY_MODELS["timm-mixer"]
    with pytest.raises(ValueError, match=r"--ablate attention: .*has no attention.*'token_mixing'"):
        main(["--ablate", "attention", "--model", name, "--model-kwargs", json.dumps(kwargs), "--images",
              str(tiny_dataset.parent), "--out", str(tmp_path / "mixer")])


def test_unknown_ablation_name_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--ablate", "wings", *VIT])
    assert exit_info.value.code == 2
    assert "unknown ablation 'wings': choose from residual" in capsys.readouterr().err


def test_unreadable_image_checkpoint_of_another_architecture_and_existing_out(tmp_path, weights, tiny_dataset, capsys):
    from vitlab.cli import probe_main
    from vitlab.data import ImageReadError

    with pytest.raises(ImageReadError, match="broken.png: cannot decode image"):
        main(["invert", *VIT, "--images", str(_bad_png(tmp_path)), "--out", str(tmp_path / "a")])
    other = json.dumps({**VIT_KWARGS, "embed_dim": 48})
    with pytest.raises(models.WeightsMismatchError, match="pos_embed|patch_embed|cls_token"):
        main(["invert", "--model", "vit_tiny_patch16_224", "--model-kwargs", other, "--weights", str(weights),
              "--out", str(tmp_path / "b")])
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "summary.csv").write_text("earlier results\n")
    argv = ["filters", *VIT, "--out", str(existing)]
    with pytest.raises(SystemExit) as exit_info:
        probe_main(argv)  # the CLI entry point: one line, exit status 2
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already holds results; pass --overwrite" in err
    assert (existing / "summary.csv").read_text() == "earlier results\n"  # untouched
    main([*argv, "--overwrite"])
    assert (existing / "filters.json").exists() and not (existing / "summary.csv").exists()


def test_ctrl_c_keeps_the_finished_layers(tmp_path, weights, tiny_dataset, monkeypatch):
    import vitlab.probes.invert as invert_module

    calls, original = [], invert_module.invert

    def interrupted_on_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second layer
        return original(*args, **kwargs)

    monkeypatch.setattr(invert_module, "invert", interrupted_on_second_layer)
    out = tmp_path / "interrupted"
    with pytest.raises(SystemExit) as exit_info:
        main(["invert", *VIT, "--weights", str(weights), "--images", str(tiny_dataset.parent), "--num-images", "1",
              "--layers", "embed,0", *FAST, "--out", str(out)])
    assert exit_info.value.code == 130
    assert [row["layer"] for row in _rows(out / "summary.csv")] == ["embed"]  # the finished layer is kept
    assert "inversion/depth00_embed" in _events(out).Tags()["images"]
