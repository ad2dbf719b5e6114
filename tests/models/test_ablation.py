"""Ablation identities (docs/analyses.md) and transplanting parts, on randomised tiny models of every family."""

import pytest
import torch

from tests.helpers.models import LIBRARY_PARTS, POST_NORM, SINGLE, SWITCHES, expected_block
from vitlab.models import (
    ablate,
    ablated,
    ablation_components,
    ablation_state,
    blocks,
    build_model,
    load_weights,
    restore,
    transplant,
)
from vitlab.models.testing import TINY_IMAGE_SIZE, TINY_MODELS, tiny_model


VARIANTS = {family: (family, {}) for family in TINY_MODELS}
VARIANTS["timm-vit-layerscale"] = ("timm-vit", {"init_values": 0.1})


def _model(variant, seed=0):
    family, overrides = VARIANTS[variant]
    return tiny_model(family, seed=seed, **overrides), family


def _block_input(view, batch=2):
    """A random input of the block's own layout: (B, N, C) or Swin (B, H, W, C)."""
    generator = torch.Generator().manual_seed(7)
    if view.window_size is not None:
        return torch.randn(batch, *view.grid, view.dim, generator=generator)
    tokens = view.grid[0] * view.grid[1] + view.num_prefix_tokens
    return torch.randn(batch, tokens, view.dim, generator=generator)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_nothing_removed_is_bit_identical(variant):
    model, _ = _model(variant)
    x = torch.randn(2, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)
    with torch.no_grad():
        plain = model(x)
        ablate(model, [])
        assert all("forward" in view.module.__dict__ for view in blocks(model))  # the patched path runs
        assert torch.equal(model(x), plain)
        restore(model)
        assert all("forward" not in view.module.__dict__ for view in blocks(model))
        assert torch.equal(model(x), plain)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("component", sorted(SINGLE))
def test_single_removal_matches_formula(variant, component):
    model, family = _model(variant)
    if family == "timm-mixer":
        component = component.replace("attention", "token_mixing")
    view = blocks(model)[-1]
    x = _block_input(view)
    keep = {name: name not in SINGLE[component.replace("token_mixing", "attention")] for name in SWITCHES}
    with torch.no_grad():
        expected = expected_block(family, view.module, x, keep)
        ablate(model, component, blocks=[view.global_index])
        actual = view.module(x)
    assert not torch.allclose(actual, view.module.__class__.forward(view.module, x), atol=1e-4)  # it changed
    assert torch.allclose(actual, expected, atol=1e-6, rtol=0), (actual - expected).abs().max()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exact_identities(variant):
    model, family = _model(variant)
    mixer = "token_mixing" if family == "timm-mixer" else "attention"
    norm1, branch1, _, _ = LIBRARY_PARTS[family]
    view = blocks(model)[0]
    x = _block_input(view)
    with torch.no_grad():
        with ablated(model, [mixer, "mlp"], blocks=0):
            assert torch.equal(view.module(x), x)  # both branches removed: exact identity
        with ablated(model, ["mlp", f"residual_{mixer}"], blocks=view.name):
            expected = norm1(view.module)(branch1(view.module, x)) if family in POST_NORM \
                else branch1(view.module, norm1(view.module)(x))  # ls1(attn(norm1(x))) / norm1(attn(x))
            assert torch.equal(view.module(x), expected)
    assert ablation_state(model) == {} and "forward" not in view.module.__dict__


@pytest.mark.parametrize("variant", ["timm-vit", "timm-swin", "torchvision-vit"])
def test_only_selected_blocks_change_and_weights_load(variant, tmp_path):
    model, family = _model(variant)
    reference, _ = _model(variant)
    keys = list(model.state_dict())
    ablate(model, "residual", blocks=[1])
    ablate(model, "norm2", blocks=[1])  # cumulative
    assert ablation_state(model) == {blocks(model)[1].name: ["norm2", "residual_mixer", "residual_mlp"]}
    assert list(model.state_dict()) == keys
    trained, _ = _model(variant, seed=5)
    path = tmp_path / "trained.pth"
    torch.save(trained.state_dict(), path)
    load_weights(model, path)  # trained weights load into the ablated model
    ablate(reference, ["residual", "norm2"], blocks=1)
    reference.load_state_dict(trained.state_dict())
    x = torch.randn(2, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        first = blocks(model)[0]
        block_x = _block_input(first)
        assert torch.equal(first.module(block_x), first.module.__class__.forward(first.module, block_x))


def test_bad_ablation_requests():
    vit, mixer = tiny_model("timm-vit"), tiny_model("timm-mixer")
    with pytest.raises(ValueError, match="unknown ablation component 'attn'.*valid are residual, residual_attention"):
        ablate(vit, "attn")
    with pytest.raises(ValueError, match="MLP-Mixer.*no attention: token mixing is an MLP; use 'token_mixing'"):
        ablate(mixer, "attention")
    with pytest.raises(ValueError, match="use 'residual_token_mixing'"):
        ablate(mixer, ["residual_attention"])
    with pytest.raises(ValueError, match="block index 2 out of range"):
        ablate(vit, "mlp", blocks=[2])
    assert "token_mixing" in ablation_components(mixer) and "attention" not in ablation_components(mixer)
    assert ablation_state(vit) == {} and ablation_state(mixer) == {}


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_transplant_copies_only_the_parts(family):
    source, target = tiny_model(family, seed=1), tiny_model(family, seed=2)
    before = {key: value.clone() for key, value in target.state_dict().items()}
    parts = ["patch_embed", "norm1@0", "block@1", "head"]
    if family.endswith("vit"):
        parts += ["pos_embed", "cls_token"]
    report = transplant(target, source, parts)
    copied = {key for key, _ in report.copied}
    source_state = source.state_dict()
    views = blocks(target)
    assert any(key.startswith(views[1].qualname + ".") for key in copied)
    assert any(".norm1." in key or ".ln_1." in key for key in copied if key.startswith(views[0].qualname + "."))
    for key, value in target.state_dict().items():
        if key in copied:
            assert torch.equal(value, source_state[key]), key
            assert dict(report.copied)[key] == tuple(value.shape)
        else:
            assert torch.equal(value, before[key]), key  # bit-identical to the fresh init
    assert not any(key.startswith(views[0].qualname + ".") and ("mlp" in key) for key in copied)


def test_transplant_errors():
    name, kwargs = TINY_MODELS["timm-vit"]
    small = build_model(name, 3, **kwargs)
    deeper = build_model(name, 3, **dict(kwargs, depth=3))
    with pytest.raises(ValueError, match="different architectures: first mismatch at 'blocks.2.norm1.weight'"):
        transplant(deeper, small, ["patch_embed"])
    with pytest.raises(ValueError, match="cannot transplant from timm SwinTransformer"):
        transplant(small, tiny_model("timm-swin"), ["patch_embed"])
    with pytest.raises(ValueError, match="unknown transplant part 'stem'.*valid are cls_token, head"):
        transplant(small, small, ["stem"])
    with pytest.raises(ValueError, match="MLP-Mixer .*use 'token_mixing@0'"):
        mixer = tiny_model("timm-mixer")
        transplant(mixer, mixer, ["attn@0"])
    with pytest.raises(ValueError, match="out of range"):
        transplant(small, small, ["block@7"])


@pytest.mark.parametrize("family", ["timm-swin", "torchvision-vit"])
def test_ablated_model_copies_and_pickles(family, tmp_path):
    import copy

    model = tiny_model(family)
    ablate(model, "mlp", blocks=0)
    x = torch.randn(2, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)
    with torch.no_grad():
        ablated_out = model(x)
        clone = copy.deepcopy(model)
        assert torch.equal(clone(x), ablated_out) and ablation_state(clone) == ablation_state(model)
        restore(clone)  # the copy is independent
        assert ablation_state(model) and torch.equal(model(x), ablated_out)
        assert not torch.equal(clone(x), ablated_out)
        torch.save(model, tmp_path / "whole.pt")
        loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
        assert torch.equal(loaded(x), ablated_out)
