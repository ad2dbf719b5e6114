"""Anatomy (blocks, Q/K/V views, embeddings) and attention recording, checked against hand computation."""

import math

import pytest
import torch

from tests.helpers.models import attention_by_hand, images, window_attention_by_hand
from vitlab.models import (
    blocks,
    build_model,
    capture,
    embeddings,
    out_proj,
    qkv,
    record_attention,
    select_blocks,
)
from vitlab.models.testing import TINY_IMAGE_SIZE, tiny_model

ATTENTION_FAMILIES = ["timm-vit", "timm-swin", "torchvision-vit", "torchvision-swin"]
ALL_FAMILIES = ATTENTION_FAMILIES + ["timm-mixer"]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# ---- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_attention_output_recomputed_from_qkv(family):
    model = tiny_model(family)
    weights, projections = qkv(model), out_proj(model)
    with torch.no_grad(), capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
        model(images())
    assert set(weights) == {view.name for view in blocks(model)}
    for view in blocks(model):
        h = record[view.name, "qkv_input"]  # (B, N, C) patch tokens
        if view.num_prefix_tokens:
            h = torch.cat([record.prefix[view.name]["qkv_input"], h], dim=1)
        if view.window_size is None:
            expected, probs = attention_by_hand(h, weights[view.name], projections[view.name], view.num_heads)
            assert torch.allclose(attention.attentions[view.name], probs, atol=1e-5)
            expected = expected[:, view.num_prefix_tokens:]
        else:
            height, width = record.grids[view.name]
            expected, probs, _ = window_attention_by_hand(h.unflatten(1, (height, width)), weights[view.name],
                                                           projections[view.name], view)
            assert torch.allclose(attention.attentions[view.name], probs, atol=1e-5)
            expected = expected.flatten(1, 2)
        actual = record[view.name, "attn"]
        assert actual.abs().max() > 1e-3  # not a trivially zero branch
        assert torch.allclose(actual, expected, atol=1e-5), (view.name, (actual - expected).abs().max())


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_recording_rows_sum_to_one_and_outputs_unchanged(family):
    model = tiny_model(family)
    x = images()
    with torch.no_grad():
        plain = model(x)
        with record_attention(model) as record:
            recorded = model(x)
            model(x[:1])  # accumulates over forwards
    assert torch.allclose(recorded, plain, atol=1e-5)
    for view in blocks(model):
        probs = record.attentions[view.name]
        windows = 1 if view.window_size is None else (view.grid[0] * view.grid[1]) // math.prod(view.window_size)
        assert probs.shape[0] == 3 * windows and probs.shape[1] == view.num_heads
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
        dense = record.dense(view.name)
        tokens = view.grid[0] * view.grid[1] + view.num_prefix_tokens
        assert dense.shape == (3, view.num_heads, tokens, tokens)
        assert torch.allclose(dense.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("family", ["timm-swin", "torchvision-swin"])
def test_dense_swin_form_times_values_gives_attention_output(family):
    model = tiny_model(family)
    weights, projections = qkv(model), out_proj(model)
    with torch.no_grad(), capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
        model(images())
    shifted = [view for view in blocks(model) if any(view.shift_size)]
    assert shifted  # the roll is exercised
    for view in blocks(model):
        dense = attention.dense(view.name)  # (B, heads, N, N) original token order
        h = record[view.name, "qkv_input"]  # (B, N, C)
        values = (h @ weights[view.name]["v"].T + weights[view.name]["v_bias"]).unflatten(-1, (view.num_heads, -1))
        mixed = (dense @ values.transpose(1, 2)).transpose(1, 2).flatten(2)  # (B, N, C)
        out = mixed @ projections[view.name]["weight"].T + projections[view.name]["bias"]
        assert torch.allclose(out, record[view.name, "attn"], atol=1e-5), view.name
        if any(view.shift_size):  # a shifted block's dense form is not block-diagonal in raster order
            height, width = view.grid
            wh, ww = view.window_size
            raster_windows = torch.arange(height * width).view(height, width)
            raster_windows = (raster_windows // width // wh) * (width // ww) + (raster_windows % width) // ww
            same_window = raster_windows.flatten()[:, None] == raster_windows.flatten()[None, :]
            assert dense[:, :, ~same_window].abs().max() > 0


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_recording_restored_after_exception(family):
    model = tiny_model(family)
    x = images()
    modules = list(model.modules())
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    fused_before = [getattr(m, "fused_attn", None) for m in modules]
    with torch.no_grad():
        plain = model(x)
        with pytest.raises(RuntimeError, match="boom"):
            with record_attention(model):
                model(x)
                raise RuntimeError("boom")
        after = model(x)
    assert torch.equal(after, plain)
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules] == hooks_before
    assert [getattr(m, "fused_attn", None) for m in modules] == fused_before
    assert all("forward" not in m.__dict__ for m in modules)


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_qkv_are_views_of_live_parameters(family):
    model = tiny_model(family)
    view = blocks(model)[-1]
    entry = qkv(model)[view.name]
    fused = next(p for name, p in model.named_parameters()
                 if name.startswith(view.qualname) and p.ndim == 2 and p.shape[0] == 3 * entry["q"].shape[0])
    width = entry["q"].shape[0]
    assert entry["q"].shape == entry["k"].shape == entry["v"].shape == (width, view.dim)
    assert width == view.num_heads * view.head_dim
    for index, key in enumerate("qkv"):
        assert torch.equal(entry[key], fused[index * width:(index + 1) * width])
        assert entry[key].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    with torch.no_grad():
        fused[width + 1, 2] += 5.0  # a live change shows through the K view
    assert entry["k"][1, 2] == fused[width + 1, 2]
    assert "q_bias" in entry and entry["v_bias"].shape == (width,)


def test_mixer_has_no_qkv_or_attention():
    model = tiny_model("timm-mixer")
    with pytest.raises(ValueError, match="no query/key/value: token mixing is an MLP"):
        qkv(model)
    with pytest.raises(ValueError, match="token mixing is an MLP"):
        with record_attention(model):
            pass
    assert not any(view.has_attention for view in blocks(model))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_embeddings(family):
    model = tiny_model(family)
    embed = embeddings(model)
    patch_h, patch_w = embed.patch_size
    assert embed.patch_weight.shape[1:] == (3, patch_h, patch_w)
    assert embed.grid == (TINY_IMAGE_SIZE // patch_h, TINY_IMAGE_SIZE // patch_w)
    first = blocks(model)[0]
    assert embed.num_prefix_tokens == first.num_prefix_tokens and embed.grid == first.grid
    if embed.pos_embed is not None:
        assert embed.pos_embed.shape == (embed.grid[0] * embed.grid[1], embed.patch_weight.shape[0])
    if embed.cls_token is not None:
        assert embed.cls_token.shape == (embed.patch_weight.shape[0],)
    assert (embed.pos_embed is not None) == family.endswith("vit")


def test_torchvision_grayscale_embedding_sums_rgb():
    rgb = tiny_model("torchvision-vit")
    gray = tiny_model("torchvision-vit", in_chans=1)
    assert torch.equal(embeddings(gray).patch_weight, gray.conv_proj.weight.sum(1, keepdim=True))
    assert embeddings(rgb).patch_weight.shape[1] == 3


@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "torchvision:swin_t"])
def test_swin_tiny_layout(name):
    """Swin-T: depths (2,2,6,2), heads (3,6,12,24), hd 32, window 7, odd blocks shifted by 3 but stage 3."""
    views = blocks(build_model(name, 2))
    assert [view.name for view in views][:3] == ["stage0.block0", "stage0.block1", "stage1.block0"]
    assert [sum(view.stage == s for view in views) for s in range(4)] == [2, 2, 6, 2]
    assert [view.global_index for view in views] == list(range(12))
    assert {view.stage: view.num_heads for view in views} == {0: 3, 1: 6, 2: 12, 3: 24}
    assert all(view.head_dim == 32 and view.window_size == (7, 7) for view in views)
    assert {view.stage: view.grid for view in views} == {0: (56, 56), 1: (28, 28), 2: (14, 14), 3: (7, 7)}
    for view in views:
        expected = (3, 3) if view.index % 2 == 1 and view.stage < 3 else (0, 0)
        assert view.shift_size == expected, view.name
        assert view.rel_pos_table.shape == (13 * 13, view.num_heads)


def test_select_blocks_errors():
    model = tiny_model("timm-swin")
    assert [view.name for view in select_blocks(model, ["stage1.block0", 0])] == ["stage0.block0", "stage1.block0"]
    with pytest.raises(ValueError, match="out of range: this model has blocks 0-3"):
        select_blocks(model, 4)
    with pytest.raises(ValueError, match="unknown block 'stage9.block0': valid names are stage0.block0"):
        select_blocks(model, "stage9.block0")
