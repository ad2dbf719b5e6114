"""The 3-D ViT (docs/models.md): token order, the inflation oracle, Q/K/V views / recording / ablation / capture
against hand computation, and the weight paths of ``build_model("vit3d:...")``.

The hand oracles are the 2-D ViT's (``tests/helpers/models.py``):
a block is a block, only the token grid has three axes.
"""

import pytest
import torch

from tests.helpers.models import LIBRARY_MIXER, LIBRARY_PARTS, SINGLE, SWITCHES, attention_by_hand, expected_block, library_block_io
from vitlab.models import (
    PretrainedWeightsUnavailable,
    UnsupportedModelError,
    WeightsMismatchError,
    ablate,
    ablated,
    blocks,
    build_model,
    capture,
    embeddings,
    family_name,
    forward_until,
    input_size,
    load_weights,
    out_proj,
    qkv,
    record_attention,
    restore,
    transplant,
)
from vitlab.models.testing import TINY_MODELS, TINY_MODELS_3D, TINY_VOLUME_SIZE, randomize_parameters, tiny_model
from vitlab.models.vit3d import PatchEmbed3d, inflate_2d_state

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = (2, 4, 4)  # TINY_VOLUME_SIZE (8, 32, 32) over (4, 8, 8) patches
POOLED_2D = dict(global_pool="avg", class_token=False)  # the 2-D twin of the tiny 3-D ViT
WITH_CLASS_TOKEN = dict(class_token=True, global_pool="token")
VARIANTS = {"pooled": {}, "class-token": WITH_CLASS_TOKEN}


def _volumes(batch=2, in_chans=3, seed=1):
    return torch.randn(batch, in_chans, *TINY_VOLUME_SIZE, generator=torch.Generator().manual_seed(seed))


def _slices(batch=2, in_chans=3, seed=3):
    return torch.randn(batch, in_chans, *TINY_VOLUME_SIZE[1:], generator=torch.Generator().manual_seed(seed))


def _stacked(x2d):
    """(B, C, H, W) -> the volume (B, C, D, H, W) whose every slice is ``x2d``."""
    return x2d.unsqueeze(2).expand(-1, -1, TINY_VOLUME_SIZE[0], -1, -1).contiguous()


def _block_input(view, batch=2):
    """A random (B, prefix + d*h*w, C) input of a 3-D ViT block."""
    tokens = view.num_prefix_tokens + view.grid[0] * view.grid[1] * view.grid[2]
    return torch.randn(batch, tokens, view.dim, generator=torch.Generator().manual_seed(7))


# ---- the patch embedding -----------------------------------------------------------------------------

def test_tokens_come_in_depth_row_column_order():
    """Patch (z, i, j) of a (3, 4, 5) grid is token z*h*w + i*w + j: each patch is filled with its expected
    index and a mean-filter kernel reads it back."""
    embed = PatchEmbed3d(img_size=(6, 8, 20), patch_size=(2, 2, 4), in_chans=1, embed_dim=1)
    assert embed.grid_size == (3, 4, 5) and embed.num_patches == 60 and embed.feat_ratio() == 4
    with torch.no_grad():
        embed.proj.weight.fill_(1.0 / 16)
        embed.proj.bias.zero_()
    index = torch.arange(60, dtype=torch.float32).view(1, 1, 3, 4, 5)
    volume = index.repeat_interleave(2, 2).repeat_interleave(2, 3).repeat_interleave(4, 4)  # (1, 1, 6, 8, 20)
    with torch.no_grad():
        tokens = embed(volume)  # (1, 60, 1)
    assert torch.allclose(tokens[0, :, 0], torch.arange(60, dtype=torch.float32), atol=1e-5)


def test_planted_patch_lands_on_its_token_in_the_model():
    model = tiny_model("timm-vit3d", **WITH_CLASS_TOKEN)
    (_, height, width), (pd, ph, pw) = model.patch_embed.grid_size, model.patch_embed.patch_size
    zero = torch.zeros(1, 3, *TINY_VOLUME_SIZE)
    for z, i, j in [(0, 0, 1), (1, 2, 3), (1, 3, 0)]:
        planted = zero.clone()
        planted[..., z * pd:(z + 1) * pd, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw] = torch.randn(3, pd, ph, pw)
        with torch.no_grad():
            moved = (forward_until(model, planted, "embed") - forward_until(model, zero, "embed"))[0].abs().sum(-1)
        assert moved.nonzero().flatten().tolist() == [1 + z * height * width + i * width + j]  # after the class token


def test_bad_sizes_and_inputs():
    with pytest.raises(ValueError, match=r"patch_size \(4, 8, 8\) must divide img_size \(8, 30, 32\)"):
        PatchEmbed3d(img_size=(8, 30, 32), patch_size=(4, 8, 8))
    with pytest.raises(ValueError, match="img_size must be an int or"):
        PatchEmbed3d(img_size=(32, 32), patch_size=8)
    with pytest.raises(ValueError, match="dynamic_img_size"):
        PatchEmbed3d(img_size=16, patch_size=8, strict_img_size=False)
    model = tiny_model("timm-vit3d")
    with pytest.raises(ValueError, match=r"expects volumes \(B, C, 8, 32, 32\), got \(1, 3, 32, 32\)"):
        model(torch.zeros(1, 3, 32, 32))


def test_direct_timm_construction_and_anatomy():
    from timm.models.vision_transformer import VisionTransformer

    direct = VisionTransformer(img_size=(8, 16, 16), patch_size=(4, 8, 8), embed_layer=PatchEmbed3d, num_classes=2,
                               embed_dim=16, depth=1, num_heads=2)
    assert family_name(direct) == "timm-vit3d" and blocks(direct)[0].grid == (2, 2, 2)
    assert direct.pos_embed.shape == (1, 1 + 8, 16)
    model = tiny_model("timm-vit3d", in_chans=1)
    assert input_size(model) == (1, *TINY_VOLUME_SIZE)
    embed = embeddings(model)
    assert embed.patch_weight.shape == (32, 1, 4, 8, 8) and embed.grid == GRID and embed.patch_size == (4, 8, 8)
    assert embed.pos_embed.shape == (16 * 2, 32) and embed.cls_token is None
    assert all(view.grid == GRID and view.num_prefix_tokens == 0 for view in blocks(model))
    with pytest.raises(UnsupportedModelError, match="vit3d: builds timm VisionTransformer names"):
        build_model("vit3d:swin_tiny_patch4_window7_224", 2, img_size=32, patch_size=8)
    with pytest.raises(ValueError, match=r"needs img_size=\(D, H, W\) and patch_size"):
        build_model("vit3d:vit_tiny_patch16_224", 2, embed_dim=16, depth=1, num_heads=2)
    assert family_name(tiny_model("timm-vit")) == "timm-vit"  # the 2-D ViT keeps its adapter


# ---- inflation ---------------------------------------------------------------------------------------

def _twin_2d(seed=0, in_chans=3, **overrides):
    """The randomised 2-D ViT the tiny 3-D one inflates from (same width, depth, in-plane patch)."""
    return tiny_model("timm-vit", seed=seed, in_chans=in_chans, **{**POOLED_2D, **overrides})


@pytest.mark.parametrize("in_chans", [3, 1])
def test_inflation_oracle_identical_slices_give_the_2d_output(in_chans):
    """The inflation oracle: pooled ViT, identical slices -> the 3-D output is the 2-D output on the slice (grayscale:
    the 2-D model sees the slice repeated over its three channels)."""
    model_2d, model_3d = _twin_2d(), tiny_model("timm-vit3d", seed=5, in_chans=in_chans)
    report = load_weights(model_3d, model_2d.state_dict())
    assert report.input_conv_adapted == (in_chans == 1) and not report.head_reset
    x2d = _slices(in_chans=in_chans)
    with torch.no_grad():
        expected = model_2d(x2d.expand(-1, 3, -1, -1))
        inflated = model_3d(_stacked(x2d))
        varied = model_3d(_volumes(in_chans=in_chans))
    assert torch.allclose(inflated, expected, atol=1e-5), (inflated - expected).abs().max()
    assert (expected - model_2d(_slices(seed=4).expand(-1, 3, -1, -1)).detach()).abs().max() > 1e-2  # not constant
    assert varied.shape == expected.shape
    # the Q/K/V weights are the 2-D model's (epoch-0 snapshots of both agree)
    for name, entry in qkv(model_3d).items():
        assert all(torch.equal(entry[key], qkv(model_2d)[name][key]) for key in entry)


def test_class_token_breaks_the_identity():
    """With a class token its own key is not repeated over depth: the oracle does not hold (documented)."""
    model_2d = _twin_2d(**WITH_CLASS_TOKEN)
    model_3d = tiny_model("timm-vit3d", seed=5, **WITH_CLASS_TOKEN)
    load_weights(model_3d, model_2d.state_dict())
    x2d = _slices()
    with torch.no_grad():
        gap = (model_3d(_stacked(x2d)) - model_2d(x2d)).abs().max()
    assert gap > 1e-3


def test_inflation_rule_and_resampling():
    """W3 = W2 / pd over depth and the position embedding tiled over depth; a 2-D model of another patch
    size and grid is resampled in-plane with timm's functions first."""
    from timm.layers import resample_abs_pos_embed, resample_patch_embed

    model_3d = tiny_model("timm-vit3d", **WITH_CLASS_TOKEN)
    for patch in (8, 16):  # same in-plane patch / (16, 16) patches on a (2, 2) grid
        state_2d = _twin_2d(seed=2, patch_size=patch, **WITH_CLASS_TOKEN).state_dict()
        state = inflate_2d_state(state_2d, model_3d)
        kernel = state_2d["patch_embed.proj.weight"]
        kernel = kernel if patch == 8 else resample_patch_embed(kernel, [8, 8])
        assert state["patch_embed.proj.weight"].shape == (32, 3, 4, 8, 8)
        for z in range(4):
            assert torch.allclose(state["patch_embed.proj.weight"][:, :, z], kernel / 4, atol=1e-7)
        pos = state_2d["pos_embed"]
        pos = pos if patch == 8 else resample_abs_pos_embed(pos, new_size=[4, 4], old_size=[2, 2], num_prefix_tokens=1)
        assert state["pos_embed"].shape == (1, 1 + 32, 32) and torch.equal(state["pos_embed"][:, :1], pos[:, :1])
        for z in range(GRID[0]):
            assert torch.allclose(state["pos_embed"][:, 1 + 16 * z:1 + 16 * (z + 1)], pos[:, 1:], atol=1e-6)
        assert torch.equal(state["blocks.1.attn.qkv.weight"], state_2d["blocks.1.attn.qkv.weight"])
        model_3d.load_state_dict(state)  # fits exactly
    assert inflate_2d_state(model_3d.state_dict(), model_3d).keys() == model_3d.state_dict().keys()  # 3-D: as is
    with pytest.raises(ValueError, match="needs a 3-D ViT"):
        inflate_2d_state(state_2d, _twin_2d())


# ---- Q/K/V views, recording, capture, ablation, transplant --------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_attention_recomputed_from_qkv_views(variant):
    model = tiny_model("timm-vit3d", **VARIANTS[variant])
    weights, projections = qkv(model), out_proj(model)
    x = _volumes()
    with torch.no_grad():
        plain = model(x)
        with capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
            recorded_out = model(x)
    assert torch.allclose(recorded_out, plain, atol=1e-5)  # recording leaves outputs unchanged
    for view in blocks(model):
        prefix = view.num_prefix_tokens
        assert view.grid == GRID and record.grids[view.name] == GRID and attention.grids[view.name] == GRID
        h = record[view.name, "qkv_input"]  # (B, d*h*w, C)
        assert h.shape == (2, 32, 32)
        if prefix:
            h = torch.cat([record.prefix[view.name]["qkv_input"], h], dim=1)
        expected, probs = attention_by_hand(h, weights[view.name], projections[view.name], view.num_heads)
        assert attention.attentions[view.name].shape == (2, 2, prefix + 32, prefix + 32)
        assert torch.allclose(attention.attentions[view.name], probs, atol=1e-5)
        assert torch.allclose(record[view.name, "attn"], expected[:, prefix:], atol=1e-5)
        live = view.module.attn.qkv.weight
        assert weights[view.name]["k"].data_ptr() == live[32:64].data_ptr()  # views of the live parameters


def test_capture_and_forward_until_match_the_library_forward():
    model = tiny_model("timm-vit3d", **WITH_CLASS_TOKEN)
    x = _volumes()
    inputs, outputs, _ = library_block_io(model, x)
    with torch.no_grad(), capture(model, ["attn", "mlp", "resid"]) as record:
        model(x)
    for view in blocks(model):
        with torch.no_grad():
            branch = LIBRARY_MIXER["timm-vit"](view.module, inputs[view.name])
        assert torch.allclose(record[view.name, "attn"], branch[:, 1:], atol=1e-6)
        assert torch.equal(record[view.name, "resid"], outputs[view.name][:, 1:])
        assert torch.equal(record.prefix[view.name]["resid"], outputs[view.name][:, :1])
        with torch.no_grad():
            assert torch.equal(forward_until(model, x, view.global_index), outputs[view.name])


def test_ablations_follow_the_block_formula():
    model = tiny_model("timm-vit3d", **WITH_CLASS_TOKEN)
    x = _volumes()
    with torch.no_grad():
        plain = model(x)
        ablate(model, [])
        assert torch.equal(model(x), plain)  # ablating nothing is bit-identical
        restore(model)
    view = blocks(model)[-1]
    block_x = _block_input(view)
    for component, off in SINGLE.items():
        keep = {name: name not in off for name in SWITCHES}
        with torch.no_grad(), ablated(model, component, blocks=[view.global_index]):
            actual = view.module(block_x)
            expected = expected_block("timm-vit", view.module, block_x, keep)
        assert torch.allclose(actual, expected, atol=1e-6, rtol=0), component
    norm1, branch1, _, _ = LIBRARY_PARTS["timm-vit"]
    first = blocks(model)[0].module
    with torch.no_grad():
        with ablated(model, ["attention", "mlp"], blocks=0):
            assert torch.equal(first(block_x), block_x)  # both branches removed: the identity
        with ablated(model, ["mlp", "residual_attention"], blocks=0):
            assert torch.equal(first(block_x), branch1(first, norm1(first)(block_x)))  # ls1(attn(norm1(x)))
    with torch.no_grad():
        assert torch.equal(model(x), plain)


def test_transplant_between_3d_vits_and_not_from_2d():
    source, target = tiny_model("timm-vit3d", seed=1), tiny_model("timm-vit3d", seed=2)
    before = {key: value.clone() for key, value in target.state_dict().items()}
    report = transplant(target, source, ["patch_embed", "pos_embed", "block@1"])
    copied = {key for key, _ in report.copied}
    assert "patch_embed.proj.weight" in copied and "pos_embed" in copied
    for key, value in target.state_dict().items():
        expected = source.state_dict()[key] if key in copied else before[key]
        assert torch.equal(value, expected), key
    with pytest.raises(ValueError):
        transplant(target, _twin_2d(), ["patch_embed"])


def test_layer_decay_freezing_and_a_training_step_on_volumes():
    from vitlab.models import freeze, layer_ids, parameter_groups

    model = tiny_model("timm-vit3d", **WITH_CLASS_TOKEN).train()
    assert freeze(model, ["patch_embed"]) == ["patch_embed.proj.weight", "patch_embed.proj.bias"]
    ids = layer_ids(model)
    assert ids["pos_embed"] == ids["cls_token"] == 0 and ids["blocks.1.attn.qkv.weight"] == 2 and ids["head.weight"] == 3
    groups = parameter_groups(model, weight_decay=0.05, layer_decay=0.75)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    before = model.blocks[0].attn.qkv.weight.detach().clone()
    torch.nn.functional.cross_entropy(model(_volumes()), torch.tensor([0, 2])).backward()
    optimizer.step()
    assert model.patch_embed.proj.weight.grad is None and not torch.equal(model.blocks[0].attn.qkv.weight, before)


# ---- build_model weight paths ------------------------------------------------------------------------

def _tiny_3d(**overrides):
    name, kwargs = TINY_MODELS_3D["timm-vit3d"]
    return build_model(name, 3, **{**kwargs, **overrides})


def test_weights_2d_safetensors_and_checkpoint_inflate_3d_state_loads_directly(tmp_path):
    from safetensors.torch import save_file

    model_2d = _twin_2d(seed=4)
    name, kwargs = TINY_MODELS_3D["timm-vit3d"]
    path = tmp_path / "vit2d.safetensors"
    save_file({key: value.contiguous() for key, value in model_2d.state_dict().items()}, str(path))
    ckpt = tmp_path / "epoch_000.ckpt"  # a vitlab Lightning checkpoint of the 2-D model
    torch.save({"state_dict": {f"model.{key}": value for key, value in model_2d.state_dict().items()}}, ckpt)
    x2d = _slices()
    with torch.no_grad():
        expected = model_2d(x2d)
    for source in (path, ckpt):
        model = build_model(name, 3, weights=source, **kwargs).eval()
        for block, entry in qkv(model).items():  # epoch-0 Q/K/V are the 2-D model's
            assert all(torch.equal(entry[key], qkv(model_2d)[block][key]) for key in entry)
        with torch.no_grad():
            assert torch.allclose(model(_stacked(x2d)), expected, atol=1e-5)
    trained = randomize_parameters(_tiny_3d(), seed=9)
    torch.save(trained.state_dict(), tmp_path / "vit3d.pth")
    direct = build_model(name, 3, weights=tmp_path / "vit3d.pth", **kwargs)
    assert all(torch.equal(value, trained.state_dict()[key]) for key, value in direct.state_dict().items())
    gray = build_model(name, 3, in_chans=1, weights=tmp_path / "vit3d.pth", **kwargs)  # 3-D RGB -> grayscale
    assert torch.allclose(gray.patch_embed.proj.weight, trained.patch_embed.proj.weight.sum(1, keepdim=True))


def test_pretrained_inflates_timm_2d_weights_and_fails_fast_offline(tmp_path):
    model_2d = _twin_2d(seed=6)
    path = tmp_path / "timm_2d.pth"
    torch.save(model_2d.state_dict(), path)
    name, kwargs = TINY_MODELS_3D["timm-vit3d"]
    model = build_model(name, 3, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs).eval()
    x2d = _slices()
    with torch.no_grad():  # timm keeps a fresh head for pretrained weights (a 1000-class file): compare features
        features = model.forward_head(model.forward_features(_stacked(x2d)), pre_logits=True)
        expected = model_2d.forward_head(model_2d.forward_features(x2d), pre_logits=True)
    assert torch.allclose(features, expected, atol=1e-5)
    assert torch.equal(qkv(model)["stage0.block1"]["q"], qkv(model_2d)["stage0.block1"]["q"])
    with pytest.raises(PretrainedWeightsUnavailable) as info:
        build_model(name, 3, pretrained=True, **kwargs)
    assert "model.weights: /path/to/file" in str(info.value) and "\n" not in str(info.value)


def test_mismatched_weights_are_one_line_errors_naming_keys(tmp_path):
    name, kwargs = TINY_MODELS_3D["timm-vit3d"]
    cases = {
        "wide": (_twin_2d(embed_dim=64, num_heads=2).state_dict(), r"embed dim 64 \(patch_embed.proj.weight "
                 r"\(64, 3, 8, 8\)\).*embed dim 32 \(patch_embed.proj.weight \(32, 3, 4, 8, 8\)\)"),
        "deep": (_twin_2d(depth=3).state_dict(), r"3 blocks \(blocks.0 ... blocks.2\).*depth 2"),
        "cls": (_twin_2d(**WITH_CLASS_TOKEN).state_dict(), r"unexpected: cls_token \(1, 1, 32\).*pos_embed "
                r"file \(1, 33, 32\) vs model \(1, 32, 32\)"),
        "3d-wide": (_tiny_3d(embed_dim=64).state_dict(), r"patch_embed.proj.weight file \(64, 3, 4, 8, 8\) vs model"),
    }
    for case, (state, pattern) in cases.items():
        path = tmp_path / f"{case}.pth"
        torch.save(state, path)
        with pytest.raises(WeightsMismatchError, match=pattern) as info:
            build_model(name, 3, weights=path, **kwargs)
        assert str(path) in str(info.value) and "\n" not in str(info.value), case
    # 2-D weights into a 2-D model stay as they were; 3-D weights into a 2-D model fail as any other file
    name_2d, kwargs_2d = TINY_MODELS["timm-vit"]
    torch.save(_twin_2d().state_dict(), tmp_path / "plain2d.pth")
    build_model(name_2d, 3, weights=tmp_path / "plain2d.pth", **{**kwargs_2d, **POOLED_2D})
    torch.save(_tiny_3d().state_dict(), tmp_path / "plain3d.pth")
    with pytest.raises(WeightsMismatchError, match="patch_embed.proj.weight file"):
        build_model(name_2d, 3, weights=tmp_path / "plain3d.pth", **{**kwargs_2d, **POOLED_2D})
