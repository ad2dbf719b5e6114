"""Hugging Face transformers ViT / DINOv2 (+ registers) / Swin: the same oracles as the timm and torchvision
families (docs/analyses.md#oracles-the-tests-use), on tiny random models built from configs (no download)."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from tests.helpers.models import HF_TINY, HF_VARIANTS, PLAIN, attention_by_hand, images, tiny_hf, window_attention_by_hand  # noqa: E402
from vitlab.models import (  # noqa: E402
    ablate,
    ablated,
    blocks,
    capture,
    embeddings,
    family_name,
    forward_until,
    out_proj,
    qkv,
    record_attention,
    restore,
    transplant,
)
from vitlab.models.testing import randomize_parameters  # noqa: E402

FAMILY = {"vit": "hf-vit", "dinov2": "hf-dinov2", "dinov2-registers": "hf-dinov2", "swin": "hf-swin"}


# the library's own sub-layers, written directly against transformers modules: norm1, branch1(h), norm2,
# branch2(h); Swin's attention branch is the independent window re-implementation of tests/helpers/models.py
def _swin_branch(model, view):
    weights, proj = qkv(model)[view.name], out_proj(model)[view.name]

    def branch(block, h):  # h (B, H*W, C)
        out, _, _ = window_attention_by_hand(h.unflatten(1, view.grid), weights, proj, view)
        return out.flatten(1, 2)
    return branch


def library_parts(variant, model, view):
    if variant == "vit":
        return (lambda b: b.layernorm_before, lambda b, h: b.attention(h)[0], lambda b: b.layernorm_after,
                lambda b, h: b.mlp(h))
    if variant == "swin":
        return (lambda b: b.layernorm_before, _swin_branch(model, view), lambda b: b.layernorm_after,
                lambda b, h: b.mlp(h))
    return (lambda b: b.norm1, lambda b, h: b.layer_scale1(b.attention(h)[0]), lambda b: b.norm2,
            lambda b, h: b.layer_scale2(b.mlp(h)))


def _call_block(view, x):
    out = view.module(x, view.grid) if view.window_size is not None else view.module(x)
    return out[0] if isinstance(out, tuple) else out


def _block_input(view, batch=2):
    tokens = view.grid[0] * view.grid[1] + view.num_prefix_tokens
    return torch.randn(batch, tokens, view.dim, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_attention_recomputed_from_qkv_views(variant):
    model = tiny_hf(variant)
    assert family_name(model) == FAMILY[variant]
    weights, projections = qkv(model), out_proj(model)
    with torch.no_grad(), capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
        model(images())
    if variant == "swin":
        assert any(any(view.shift_size) for view in blocks(model))  # the shift mask is exercised
    for view in blocks(model):
        h = record[view.name, "qkv_input"]
        if view.num_prefix_tokens:
            h = torch.cat([record.prefix[view.name]["qkv_input"], h], dim=1)
        if view.window_size is None:
            expected, probs = attention_by_hand(h, weights[view.name], projections[view.name], view.num_heads)
            expected = expected[:, view.num_prefix_tokens:]
            if variant != "vit":  # DINOv2 LayerScale on the branch
                expected = expected * view.module.layer_scale1.lambda1
        else:
            expected, probs, _ = window_attention_by_hand(h.unflatten(1, view.grid), weights[view.name],
                                                           projections[view.name], view)
            expected = expected.flatten(1, 2)
        assert torch.allclose(attention.attentions[view.name], probs, atol=1e-5), view.name
        actual = record[view.name, "attn"]
        assert actual.abs().max() > 1e-3
        assert torch.allclose(actual, expected, atol=1e-5), (view.name, (actual - expected).abs().max())


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_recording_leaves_outputs_and_restores(variant):
    model = tiny_hf(variant)
    x = images()
    configs = [view.module.attention.config for view in blocks(model)]
    hooks = [len(m._forward_hooks) for m in model.modules()]
    with torch.no_grad():
        plain = model(x)
        with record_attention(model) as record:
            recorded = model(x)
            model(x[:1])
        after = model(x)
    assert torch.allclose(recorded, plain, atol=1e-5) and torch.equal(after, plain)
    assert [view.module.attention.config for view in blocks(model)] == configs  # library attention back
    assert [len(m._forward_hooks) for m in model.modules()] == hooks
    for view in blocks(model):
        probs = record.attentions[view.name]
        windows = 1 if view.window_size is None else (view.grid[0] * view.grid[1]) // math.prod(view.window_size)
        assert probs.shape[:2] == (3 * windows, view.num_heads)
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
        tokens = view.grid[0] * view.grid[1] + view.num_prefix_tokens
        assert record.dense(view.name).shape == (3, view.num_heads, tokens, tokens)
        assert record.grids[view.name] == view.grid


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_qkv_views_of_live_projections(variant):
    model = tiny_hf(variant)
    view = blocks(model)[-1]
    entry, attn = qkv(model)[view.name], view.module.attention
    for key, layer in zip("qkv", (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert entry[key].shape == (view.num_heads * view.head_dim, view.dim)
        assert entry[key].untyped_storage().data_ptr() == layer.weight.untyped_storage().data_ptr()
        assert torch.equal(entry[f"{key}_bias"], layer.bias)
    with torch.no_grad():
        attn.k_proj.weight[1, 2] += 5.0
    assert entry["k"][1, 2] == attn.k_proj.weight[1, 2]
    embed = embeddings(model)
    assert embed.patch_weight.shape[1] == 3 and embed.grid == blocks(model)[0].grid
    if variant == "swin":
        assert embed.pos_embed is None and embed.cls_token is None
    else:
        assert embed.pos_embed.shape == (16, 32) and embed.cls_token.shape == (32,)
        assert embed.num_prefix_tokens == (3 if variant == "dinov2-registers" else 1)


SINGLE = {"attention": ["mixer"], "mlp": ["mlp"], "norm1": ["norm1"], "norm2": ["norm2"],
          "residual_attention": ["residual_mixer"], "residual_mlp": ["residual_mlp"],
          "residual": ["residual_mixer", "residual_mlp"], "layernorm": ["norm1", "norm2"]}


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_ablation_nothing_removed_bit_identical_and_formula(variant):
    model = tiny_hf(variant)
    x = images()
    with torch.no_grad():
        plain = model(x)
        ablate(model, [])
        assert all("forward" in view.module.__dict__ for view in blocks(model))
        assert torch.equal(model(x), plain)
        restore(model)
        assert torch.equal(model(x), plain)
        view = blocks(model)[-1]
        block_x = _block_input(view)
        norm1, branch1, norm2, branch2 = library_parts(variant, model, view)
        library_out = _call_block(view, block_x)
        for component, off in SINGLE.items():
            keep = {name: name not in off for name in ["mixer", "mlp", "norm1", "norm2", "residual_mixer",
                                                        "residual_mlp"]}
            y = block_x
            if keep["mixer"]:
                f = branch1(view.module, norm1(view.module)(y) if keep["norm1"] else y)
                y = y + f if keep["residual_mixer"] else f
            if keep["mlp"]:
                f = branch2(view.module, norm2(view.module)(y) if keep["norm2"] else y)
                y = y + f if keep["residual_mlp"] else f
            with ablated(model, component, blocks=view.global_index):
                actual = _call_block(view, block_x)
            assert not torch.allclose(actual, library_out, atol=1e-4), component
            assert torch.allclose(actual, y, atol=1e-5, rtol=0), (component, (actual - y).abs().max())
        with ablated(model, ["attention", "mlp"], blocks=view.name):
            assert torch.equal(_call_block(view, block_x), block_x)
        assert "forward" not in view.module.__dict__


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_capture_and_forward_until_match_library(variant):
    model = tiny_hf(variant)
    x = images()
    views = blocks(model)
    inputs, outputs, handles = {}, {}, []
    for view in views:
        def keep(module, args, out, name=view.name):
            inputs[name], outputs[name] = args[0], out[0] if isinstance(out, tuple) else out
        handles.append(view.module.register_forward_hook(keep))
    with torch.no_grad():
        plain = model(x)
    for handle in handles:
        handle.remove()
    with torch.no_grad(), capture(model, ["qkv_input", "attn", "mlp_hidden", "mlp", "resid"]) as record:
        assert torch.equal(model(x), plain)
    for view in views:
        prefix = view.num_prefix_tokens
        assert torch.equal(record[view.name, "resid"], outputs[view.name][:, prefix:])
        rebuilt = inputs[view.name][:, prefix:] + record[view.name, "attn"] + record[view.name, "mlp"]
        assert torch.allclose(rebuilt, record[view.name, "resid"], atol=1e-5)
        assert record[view.name, "mlp_hidden"].shape[2] > view.dim
    target = views[len(views) // 2 - 1]
    later = []
    handles = [v.module.register_forward_pre_hook(lambda m, a, n=v.name: later.append(n))
               for v in views[target.global_index + 1:]]
    with torch.no_grad():
        stream = forward_until(model, x, target.global_index)
        embed = forward_until(model, x, "embed")
        mid = forward_until(model, x, target.name, site="attn")
    for handle in handles:
        handle.remove()
    assert later == [] and torch.equal(stream, outputs[target.name]) and torch.equal(embed, inputs[views[0].name])
    assert mid.shape[1] == target.grid[0] * target.grid[1] + target.num_prefix_tokens
    pixels = x.clone().requires_grad_(True)
    forward_until(model, pixels, target.global_index).square().sum().backward()
    assert pixels.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", ["vit", "swin"])
def test_transplant_copies_only_the_parts(variant):
    source, target = tiny_hf(variant, seed=1), tiny_hf(variant, seed=2)
    before = {key: value.clone() for key, value in target.state_dict().items()}
    report = transplant(target, source, ["patch_embed", "norm1@0", "block@1", "head"])
    copied = {key for key, _ in report.copied}
    views = blocks(target)
    assert any(key.startswith(views[1].qualname + ".") for key in copied)
    assert any(key.startswith("hf.classifier.") for key in copied)
    assert {key for key in copied if key.startswith(views[0].qualname + ".")} == \
        {f"{views[0].qualname}.layernorm_before.weight", f"{views[0].qualname}.layernorm_before.bias"}
    for key, value in target.state_dict().items():
        assert torch.equal(value, source.state_dict()[key] if key in copied else before[key]), key


def test_swin_padded_windows_recomputed_by_hand():
    """40 px: grids 10 and 5 do not tile into 4-windows; the library pads (zeros after the norm), then rolls."""
    from vitlab.models import build_model

    name, kwargs = HF_TINY["swin"]
    model = randomize_parameters(build_model(name, 3, **dict(kwargs, image_size=40))).eval()
    weights, projections = qkv(model), out_proj(model)
    with torch.no_grad(), capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
        model(images(size=40))
    views = blocks(model)
    assert [view.grid for view in views] == [(10, 10), (10, 10), (5, 5), (5, 5)]
    for view in views:
        height, width = view.grid
        padded_h, padded_w = -(-height // 4) * 4, -(-width // 4) * 4
        h = record[view.name, "qkv_input"].unflatten(1, (height, width))
        h = torch.nn.functional.pad(h, (0, 0, 0, padded_w - width, 0, padded_h - height))
        expected, probs, _ = window_attention_by_hand(h, weights[view.name], projections[view.name], view)
        assert torch.allclose(attention.attentions[view.name], probs, atol=1e-5), view.name
        expected = expected[:, :height, :width].flatten(1, 2)
        assert torch.allclose(record[view.name, "attn"], expected, atol=1e-5), view.name
        dense = attention.dense(view.name)  # pad keys' share dropped: rows sum to at most 1
        assert dense.shape[-1] == height * width and (dense.sum(-1) <= 1 + 1e-5).all()
        # token order check: pad keys are zeros after the norm, so their value is v_bias alone
        w = weights[view.name]
        tokens = record[view.name, "qkv_input"]
        values = (tokens @ w["v"].T + w["v_bias"]).unflatten(-1, (view.num_heads, -1)).transpose(1, 2)
        pad_share = (1 - dense.sum(-1, keepdim=True))  # (B, heads, N, 1)
        mixed = dense @ values + pad_share * w["v_bias"].unflatten(-1, (view.num_heads, -1))[None, :, None]
        out = mixed.transpose(1, 2).flatten(2) @ projections[view.name]["weight"].T + projections[view.name]["bias"]
        assert torch.allclose(out, record[view.name, "attn"], atol=1e-5), view.name


def test_bare_library_models_open_too():
    """A bare Dinov2Model / a ViTForImageClassification made with transformers directly (no vitlab wrapper)."""
    import transformers

    bare = transformers.Dinov2Model(transformers.Dinov2Config(**dict(PLAIN, mlp_ratio=2)))
    classifier = transformers.ViTForImageClassification(transformers.ViTConfig(**dict(PLAIN, intermediate_size=64),
                                                                               num_labels=3))
    for model, qualname, head in [(bare, "encoder.layer.1", ["pooler."]),
                                  (classifier, "vit.layers.1", ["classifier.", "vit.pooler."])]:
        model = randomize_parameters(model).eval()
        view = blocks(model)[1]
        assert view.qualname == qualname and view.module is model.get_submodule(qualname)
        from vitlab.models import part_prefixes

        assert list(part_prefixes(model, "head")) == head
        x = images()
        with torch.no_grad(), record_attention(model) as record:
            model(x)
        assert record.attentions[view.name].shape == (2, 2, 17, 17)
        assert torch.equal(forward_until(model, x, 1), _call_block(view, forward_until(model, x, 0)))
        assert qkv(model)[view.name]["q"].data_ptr() == view.module.attention.q_proj.weight.data_ptr()
