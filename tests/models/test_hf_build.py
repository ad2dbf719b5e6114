"""Hugging Face models: hf: names, save_pretrained folders through weights:, normalisation, parameter groups,
errors, and a tiny fit with the Q/K/V callbacks (no download: HF_HUB_OFFLINE=1, configs only)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.models import HF_TINY, HF_VARIANTS, images, tiny_hf  # noqa: E402
from vitlab.models import (  # noqa: E402
    PretrainedWeightsUnavailable,
    UnsupportedModelError,
    blocks,
    build_model,
    embeddings,
    family_name,
    input_size,
    layer_ids,
    normalization,
    parameter_groups,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_save_pretrained_folder_round_trip(variant, tmp_path):
    name, kwargs = HF_TINY[variant]
    model = tiny_hf(variant)
    model.hf.save_pretrained(tmp_path)
    x = images()
    with torch.no_grad():
        expected = model(x)
        via_weights = build_model(name, 3, weights=tmp_path, **kwargs).eval()
        assert torch.equal(via_weights(x), expected)
        via_name = build_model(f"hf:{tmp_path}", 3, pretrained=True).eval()  # architecture from config.json
        assert torch.equal(via_name(x), expected)
        fresh = build_model(f"hf:{tmp_path}", 3).eval()  # same architecture, new weights
        assert fresh.state_dict().keys() == model.state_dict().keys() and not torch.equal(fresh(x), expected)
    assert input_size(via_name) == (3, 32, 32)


def test_folder_into_other_head_grayscale_and_size(tmp_path):
    name, kwargs = HF_TINY["vit"]
    model = tiny_hf("vit")
    model.hf.save_pretrained(tmp_path)
    source = model.state_dict()
    five = build_model(name, 5, weights=tmp_path, **kwargs).eval()  # another class count: fresh head
    state = five.state_dict()
    assert state["hf.classifier.weight"].shape == (5, 32)
    assert all(torch.equal(state[key], value) for key, value in source.items() if not key.startswith("hf.classifier."))
    gray = build_model(name, 3, in_chans=1, weights=tmp_path, **kwargs).eval()  # RGB filters summed
    conv = "hf.vit.embeddings.patch_embeddings.projection.weight"
    assert torch.allclose(embeddings(gray).patch_weight, source[conv].sum(1, keepdim=True))
    x = images(in_chans=1)
    with torch.no_grad():
        assert torch.allclose(gray(x), model(x.expand(-1, 3, -1, -1)), atol=1e-5)
    larger = build_model(name, 3, weights=tmp_path, **dict(kwargs, image_size=48)).eval()  # positions resampled
    assert larger.hf.vit.embeddings.position_embeddings.shape == (1, 1 + 36, 32)
    assert larger(images(size=48)).shape == (2, 3) and blocks(larger)[0].grid == (6, 6)


def test_base_model_folder_gives_backbone_and_fresh_head(tmp_path):
    name, kwargs = HF_TINY["dinov2"]
    classifier = tiny_hf("dinov2")
    classifier.hf.dinov2.save_pretrained(tmp_path)  # a bare Dinov2Model folder, as encoders are published
    loaded = build_model(name, 3, weights=tmp_path, **kwargs)
    for key, value in classifier.state_dict().items():
        if key.startswith("hf.dinov2."):
            assert torch.equal(loaded.state_dict()[key], value), key
    assert not torch.equal(loaded.hf.classifier.weight, classifier.hf.classifier.weight)


def test_vitlab_checkpoint_file_and_normalization(tmp_path):
    name, kwargs = HF_TINY["swin"]
    model = tiny_hf("swin")
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{key}": value for key, value in model.state_dict().items()}}, path)
    loaded = build_model(name, 3, weights=path, **kwargs).eval()
    with torch.no_grad():
        assert torch.equal(loaded(images()), model(images()))
    assert normalization(loaded) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    folder = tmp_path / "folder"
    model.hf.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.1, 0.2, 0.3],
                                                                 "image_std": [0.4, 0.5, 0.6]}))
    assert normalization(build_model(f"hf:{folder}", 3)) == ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])
    gray_mean, gray_std = normalization(build_model(f"hf:{folder}", 3, in_chans=1))
    assert gray_mean == pytest.approx([0.2]) and gray_std == pytest.approx([0.5])


def test_errors_are_clear(tmp_path):
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="is a 'bert' model: vitlab supports the model types vit"):
        build_model(f"hf:{tmp_path}", 3)
    with pytest.raises(PretrainedWeightsUnavailable, match="'hf:some-org/no-such-model' is not available"):
        build_model("hf:some-org/no-such-model", 3)
    with pytest.raises(ValueError, match="bad keyword argument 'embed_dim' for Hugging Face model 'hf:vit'"):
        build_model("hf:vit", 3, embed_dim=32)
    with pytest.raises(ValueError, match="names an architecture, not weights"):
        build_model("hf:vit", 3, pretrained=True)
    with pytest.raises(FileNotFoundError, match="or a save_pretrained folder for hf: models"):
        build_model("hf:vit", 3, weights=tmp_path / "missing")


def test_missing_extra_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r'need the optional extra: pip install -e "\.\[hf\]"'):
        build_model("hf:vit", 3)
    assert family_name(tiny_timm_vit()) == "timm-vit"  # the other families are unaffected


def tiny_timm_vit():
    from vitlab.models.testing import tiny_model

    return tiny_model("timm-vit")


@pytest.mark.parametrize("variant", ["dinov2-registers", "swin"])
def test_parameter_groups_and_layer_ids(variant):
    model = tiny_hf(variant)
    groups = parameter_groups(model, weight_decay=0.05, layer_decay=0.75)
    grouped = [id(param) for group in groups for param in group["params"]]
    assert sorted(grouped) == sorted(id(param) for param in model.parameters() if param.requires_grad)
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    assert frozen == (["hf.dinov2_with_registers.embeddings.mask_token"] if variant != "swin" else [])
    no_decay = {id(param) for group in groups if group["weight_decay"] == 0 for param in group["params"]}
    ids, views = layer_ids(model), blocks(model)
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("position_embeddings", "cls_token", "register_tokens",
                                       "relative_position_bias_table"):
            assert id(param) in no_decay, name
        if ".embeddings." in name:
            assert ids[name] == 0, name
        if name.startswith("hf.classifier."):
            assert ids[name] == len(views) + 1
    for view in views:
        assert ids[f"{view.qualname}.mlp.fc1.weight"] == view.global_index + 1
    if variant == "swin":  # patch merging at the end of stage 0 joins the first block of stage 1
        assert ids["hf.swin.encoder.layers.0.downsample.reduction.weight"] == 3


@pytest.mark.slow
def test_fit_hf_model_with_qkv_callbacks(tiny_dataset, tmp_path):
    """A tiny fit through the ClassificationModule and the CLI: grayscale DICOMs, snapshots, drift, spectra."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers.runs import tiny_args
    from vitlab.qkv.state import load_snapshot, qkv_state
    from vitlab.cli import fit

    args = tiny_args(tiny_dataset, tmp_path / "runs", epochs=1)
    config = yaml.safe_load(open(args[1]))
    name, kwargs = HF_TINY["dinov2-registers"]
    config["model"].update(model_name=name, model_kwargs=kwargs)
    open(args[1], "w").write(yaml.safe_dump(config))
    cli = fit(args)
    run = tmp_path / "runs" / "tiny" / "version_0"
    snapshot, meta = load_snapshot(run / "qkv" / "epoch_001.safetensors")
    live = qkv_state(cli.model.model)
    assert snapshot.keys() == live.keys() and all(torch.equal(snapshot[key], live[key]) for key in live)
    assert meta["heads"] == {"stage0.block0": 2, "stage0.block1": 2}
    reference, _ = load_snapshot(run / "qkv" / "epoch_000.safetensors")
    assert not torch.equal(reference["stage0.block0.q.weight"], snapshot["stage0.block0.q.weight"])
    assert input_size(cli.model.model)[0] == 1
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ["val/acc", "drift/rel_frobenius/stage0.block1.k", "spectra/positive_mass/stage0.block0"]:
        assert tag in events.Tags()["scalars"], tag


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Randomised tiny grayscale HF models saved as save_pretrained folders (what --weights points at)."""
    root, folders = tmp_path_factory.mktemp("hf-weights"), {}
    for variant in ("dinov2-registers", "swin"):
        tiny_hf(variant, num_classes=2, in_chans=1, seed=1).hf.save_pretrained(root / variant)
        folders[variant] = root / variant
    return folders


def _probe_args(variant, folders):
    name, kwargs = HF_TINY[variant]
    return ["--model", name, "--model-kwargs", json.dumps(kwargs), "--weights", str(folders[variant]),
            "--num-classes", "2", "--in-chans", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dinov2-registers", "swin"])
def test_attention_and_spectra_probes_match_direct_computation(variant, hf_folders, tiny_dataset, tmp_path):
    import csv
    from pathlib import Path

    from vitlab.analysis.spectra import qk_spectra
    from vitlab.analysis.stats import attention_vs_angle
    from vitlab.probes import main
    from vitlab.probes.loading import LoadedModel
    from vitlab.probes.streams import load_images

    images = Path(tiny_dataset).parent
    main(["attention", *_probe_args(variant, hf_folders), "--images", str(images), "--num-images", "4",
          "--out", str(tmp_path / "att")])
    main(["spectra", *_probe_args(variant, hf_folders), "--out", str(tmp_path / "spec")])
    name, kwargs = HF_TINY[variant]
    model = build_model(name, 2, in_chans=1, weights=hf_folders[variant], **kwargs).eval()
    import argparse

    namespace = argparse.Namespace(images=[str(images)], num_images=4, split="val", seed=0)
    inputs = load_images(namespace, LoadedModel(model, "m", "test"), 10_000).inputs
    from vitlab.models import capture, qkv, record_attention

    with torch.no_grad(), record_attention(model) as rec, capture(model, "qkv_input") as cap:
        model(inputs)
    masses = list(csv.DictReader(open(tmp_path / "att" / "attention_mass.csv")))
    spectra = list(csv.DictReader(open(tmp_path / "spec" / "spectra.csv")))
    views = {view.name: view for view in blocks(model)}
    assert {row["layer"] for row in masses} == set(views)
    for row in masses:
        view = views[row["layer"]]
        prefix = view.num_prefix_tokens  # DINOv2 registers: class token + 2 registers dropped
        probs = rec.dense(view.name)[:, :, prefix:, prefix:]
        expected = attention_vs_angle(probs, cap[view.name, "qkv_input"], 5.0)
        for key in ("mass_below_90", "mass_above_90", "self_attention"):
            assert float(row[key]) == pytest.approx(float(getattr(expected, key)[int(row["head"])]), rel=1e-4)
    for block, parts in qkv(model).items():
        result = qk_spectra(parts["q"], parts["k"], views[block].num_heads)
        for row in (row for row in spectra if row["block"] == block and row["head"] != "sum"):
            assert float(row["positive_mass"]) == pytest.approx(float(result.positive_mass[int(row["head"])]), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("subcommand, extra", [
    ("mi", ["--num-images", "8", "--blocks", "0"]), ("stats", ["--num-images", "8"]), ("filters", []),
    ("ablate", ["--ablate", "residual", "--num-images", "2", "--steps", "3", "--noise-draws", "1", "--layers", "embed"]),
    ("invert", ["--num-images", "2", "--steps", "3", "--noise-draws", "1", "--layers", "embed,0"]),
    ("transplant", ["--parts", "patch_embed", "--num-images", "2", "--steps", "3", "--noise-draws", "1",
                    "--layers", "embed"]),
    ("visualize", ["--steps", "3", "--classes", "0", "--every", "3"]),
])
def test_other_probes_run_on_hf_models(subcommand, extra, hf_folders, tiny_dataset, tmp_path):
    from pathlib import Path

    from vitlab.probes import main

    images = [] if subcommand in ("filters", "visualize") else ["--images", str(Path(tiny_dataset).parent)]
    out = tmp_path / subcommand
    main([subcommand, *_probe_args("dinov2-registers", hf_folders), *images, *extra, "--out", str(out)])
    written = {path.suffix for path in out.iterdir()}
    assert ".csv" in written and any(path.name.startswith("events.out.tfevents") for path in out.iterdir())
