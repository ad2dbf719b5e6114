"""Building models, loading weights, normalisation, parameter groups and freezing (vitlab.models)."""

import time

import pytest
import torch
from safetensors.torch import save_file

from vitlab.models import (
    PretrainedWeightsUnavailable,
    UnsupportedModelError,
    WeightsMismatchError,
    blocks,
    build_model,
    family_name,
    freeze,
    input_size,
    layer_ids,
    load_weights,
    normalization,
    num_blocks,
    parameter_groups,
)
from vitlab.models.testing import TINY_IMAGE_SIZE, TINY_MODELS, randomize_parameters, tiny_model

FAMILIES = sorted(TINY_MODELS)
HEAD_PREFIX = {"timm-vit": "head.", "timm-swin": "head.", "timm-mixer": "head.",
               "torchvision-vit": "heads.", "torchvision-swin": "head.", "timm-swinv2": "head.",
               "timm-swinv2-cr": "head.", "torchvision-swinv2": "head.", "timm-eva": "head.", "timm-beit": "head.",
               "timm-vit-relpos": "head."}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)


def _images(in_chans=3, batch=2):
    return torch.randn(batch, in_chans, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE, generator=torch.Generator().manual_seed(1))


def _build(family, num_classes=3, in_chans=3):
    name, kwargs = TINY_MODELS[family]
    return build_model(name, num_classes, in_chans=in_chans, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_build_each_family(family):
    model = _build(family, num_classes=5).eval()
    assert family_name(model) == family
    assert model(_images()).shape == (2, 5)
    assert num_blocks(model) == len(blocks(model)) >= 2
    assert input_size(model) == (3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)
    assert input_size(_build(family, in_chans=1)) == (1, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)


@pytest.mark.parametrize("family", FAMILIES)
def test_grayscale_equals_summed_rgb_filters(family):
    """in_chans=1 must act like the 3-channel model with its RGB filters summed (timm's rule)."""
    rgb = randomize_parameters(_build(family)).eval()
    gray = _build(family, in_chans=1).eval()
    load_weights(gray, rgb.state_dict())
    x = _images(in_chans=1)
    with torch.no_grad():
        expected = rgb(x.expand(-1, 3, -1, -1))
        assert torch.allclose(gray(x), expected, atol=1e-5)
    mean, std = normalization(gray)
    assert len(mean) == len(std) == 1
    rgb_mean, rgb_std = normalization(rgb)
    assert mean[0] == pytest.approx(sum(rgb_mean) / 3) and std[0] == pytest.approx(sum(rgb_std) / 3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["pth", "safetensors", "lightning"])
def test_load_weights_files(family, kind, tmp_path):
    source = randomize_parameters(_build(family), seed=3).eval()
    state = source.state_dict()
    if kind == "pth":
        path = tmp_path / "weights.pth"
        torch.save(state, path)
    elif kind == "safetensors":
        path = tmp_path / "weights.safetensors"
        save_file({key: value.contiguous() for key, value in state.items()}, str(path))
    else:
        path = tmp_path / "last.ckpt"
        torch.save({"epoch": 1, "state_dict": {f"model.{key}": value for key, value in state.items()},
                    "hyper_parameters": {"lr": 1e-3}}, path)
    before = path.read_bytes()
    name, kwargs = TINY_MODELS[family]
    loaded = build_model(name, 3, weights=str(path), **kwargs).eval()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert path.read_bytes() == before  # the user's file is never modified


@pytest.mark.parametrize("family", FAMILIES)
def test_head_reset_on_class_count_change(family, tmp_path):
    source = randomize_parameters(_build(family, num_classes=3), seed=4)
    path = tmp_path / "w.pth"
    torch.save(source.state_dict(), path)
    name, kwargs = TINY_MODELS[family]
    torch.manual_seed(123)
    fresh = build_model(name, 7, **kwargs)
    torch.manual_seed(123)
    loaded = build_model(name, 7, weights=path, **kwargs)
    source_state, fresh_state = source.state_dict(), fresh.state_dict()
    for key, value in loaded.state_dict().items():
        if key.startswith(HEAD_PREFIX[family]):
            assert torch.equal(value, fresh_state[key]), key  # fresh head, right shape
            assert value.shape[0] == 7 or value.ndim == 0
        else:
            assert torch.equal(value, source_state[key]), key


@pytest.mark.parametrize("family", ["timm-vit", "timm-swin"])
def test_wrong_architecture_names_keys(family, tmp_path):
    name, kwargs = TINY_MODELS[family]
    other = dict(kwargs, embed_dim=kwargs["embed_dim"] * 2)
    path = tmp_path / "other.pth"
    torch.save(build_model(name, 3, **other).state_dict(), path)
    with pytest.raises(WeightsMismatchError, match=r"other\.pth does not fit .*patch_embed\.proj\.weight"):
        build_model(name, 3, weights=path, **kwargs)


def test_other_family_file_names_keys(tmp_path):
    path = tmp_path / "swin.pth"
    torch.save(_build("timm-swin").state_dict(), path)
    with pytest.raises(WeightsMismatchError, match=r"missing: .*unexpected: "):
        load_weights(_build("timm-vit"), path)


def test_missing_and_unreadable_weights(tmp_path):
    name, kwargs = TINY_MODELS["timm-vit"]
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        build_model(name, 3, weights=tmp_path / "nope.pth", **kwargs)
    bad = tmp_path / "bad.pth"
    bad.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="cannot read weights file .*bad.pth"):
        build_model(name, 3, weights=bad, **kwargs)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "torchvision:swin_t"])
def test_pretrained_offline_fails_fast(name):
    start = time.monotonic()
    with pytest.raises(PretrainedWeightsUnavailable) as info:
        build_model(name, 3, pretrained=True)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "model.weights: /path/to/file" in message and "model.pretrained: false" in message
    assert "\n" not in message


def test_bad_names_and_families():
    with pytest.raises(ValueError, match="unknown model 'vit_tiny_patch16_2244'.*did you mean"):
        build_model("vit_tiny_patch16_2244", 3)
    with pytest.raises(UnsupportedModelError, match="timm SwinTransformer"):
        build_model("resnet18", 3)
    with pytest.raises(ValueError, match="unknown library prefix"):
        build_model("keras:vit_b_16", 3)
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        build_model("vit_tiny_patch16_224", 0)
    with pytest.raises(UnsupportedModelError, match="torchvision VisionTransformer"):
        family_name(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer_decay", [None, 0.75])
def test_parameter_groups_cover_each_parameter_once(family, layer_decay):
    model = _build(family)
    freeze(model, ["patch_embed"])
    groups = parameter_groups(model, weight_decay=0.05, layer_decay=layer_decay)
    grouped = [id(param) for group in groups for param in group["params"]]
    trainable = [id(param) for param in model.parameters() if param.requires_grad]
    assert sorted(grouped) == sorted(trainable) and len(grouped) == len(set(grouped))
    names = {id(param): name for name, param in model.named_parameters()}
    library_no_decay = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    for group in groups:
        for param in group["params"]:
            leaf = names[id(param)].rsplit(".", 1)[-1]
            expect_no_decay = param.ndim <= 1 or leaf in {"pos_embed", "pos_embedding", "cls_token", "class_token",
                                                            "relative_position_bias_table", "logit_scale"} \
                or names[id(param)] in library_no_decay  # timm's own list (Swin V2: the CPB MLP)
            assert (group["weight_decay"] == 0.0) == expect_no_decay, names[id(param)]
    torch.optim.AdamW(groups, lr=1e-3)  # accepted as is
    if layer_decay is not None:
        ids, depth = layer_ids(model), num_blocks(model)
        for group in groups:
            assert group["lr_scale"] == pytest.approx(layer_decay ** (depth + 1 - group["layer_id"]))
        head = [name for name in ids if name.startswith(HEAD_PREFIX[family])]
        assert head and all(ids[name] == depth + 1 for name in head)
        for view in blocks(model):
            block_names = [name for name in ids if name.startswith(view.qualname + ".")]
            assert block_names and all(ids[name] == view.global_index + 1 for name in block_names)
        assert min(ids.values()) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_freeze_parts(family):
    model = _build(family)
    frozen = freeze(model, ["blocks:0-1"])
    views = blocks(model)
    assert frozen and all(name.startswith((views[0].qualname, views[1].qualname)) for name in frozen)
    model = _build(family)
    frozen = set(freeze(model, "all_but_head"))
    for name, param in model.named_parameters():
        assert param.requires_grad == name.startswith(HEAD_PREFIX[family]), name
        assert (name in frozen) != param.requires_grad
    with pytest.raises(ValueError, match="unknown freeze part 'bogus'.*valid parts are .*patch_embed.*all_but_head"):
        freeze(model, ["bogus"])
    with pytest.raises(ValueError, match="out of range"):
        freeze(model, [f"blocks:0-{num_blocks(model)}"])


def test_tiny_model_is_randomised():
    model = tiny_model("timm-vit")
    norm = model.blocks[0].norm1
    assert not torch.allclose(norm.weight, torch.ones_like(norm.weight))
    assert not torch.allclose(norm.bias, torch.zeros_like(norm.bias))
