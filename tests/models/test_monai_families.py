"""MONAI's 3-D transformers (SwinUNETR's ``swinViT``, UNETR's / ViT's ``vit``): attention recomputed by hand from
vitlab's Q/K/V views (3-D relative-position bias, shifted windows with MONAI's mask, window shrinking), recording
and ablation identities, Q/K/V snapshots, transplants, weight files and the one-line errors."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("monai")

from monai.networks.blocks.transformerblock import TransformerBlock  # noqa: E402
from monai.networks.nets import ViT  # noqa: E402

from vitlab.models import (  # noqa: E402
    PretrainedWeightsUnavailable,
    WeightsMismatchError,
    ablate,
    blocks,
    build_model,
    capture,
    check_volume_size,
    embeddings,
    family_name,
    forward_until,
    input_size,
    load_weights,
    out_proj,
    part_prefixes,
    qkv,
    record_attention,
    restore,
    transplant,
)
from vitlab.models.testing import randomize_parameters  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# the tiny models: build name and kwargs (norm_name="batch": at 32^3 SwinUNETR's bottleneck is one voxel, where
# its default instance norm fails)
SWIN = dict(img_size=32, feature_size=12, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4), window_size=4, norm_name="batch")
SWIN_CONFIGS = {
    "3d-window4": SWIN,
    "3d-window344": {**SWIN, "window_size": (3, 4, 4)},  # padded windows; stage 2 shifts along D only
    "2d-window4": {**SWIN, "spatial_dims": 2},
}
UNETR = dict(img_size=32, feature_size=4, hidden_size=24, mlp_dim=48, num_heads=2)


def _swin(config="3d-window4", seed=0, **overrides):
    model = build_model("monai:swin_unetr", 2, in_chans=1, **{**SWIN_CONFIGS[config], **overrides})
    return randomize_parameters(model, seed).eval()


def _unetr(seed=0):
    return randomize_parameters(build_model("monai:unetr", 2, in_chans=1, **UNETR), seed).eval()


def _vit(separate=False, flash=False, seed=0):
    """A bare MONAI ViT with a class token over a 4^3 patch grid (optionally blocks with separate q/k/v
    projections, or running scaled_dot_product_attention)."""
    model = ViT(in_channels=1, img_size=32, patch_size=8, hidden_size=24, mlp_dim=48, num_layers=2, num_heads=2,
                classification=True, num_classes=3, qkv_bias=True)
    if separate or flash:
        model.blocks = nn.ModuleList([TransformerBlock(24, 48, 2, qkv_bias=True, use_combined_linear=not separate,
                                                       use_flash_attention=flash) for _ in range(2)])
    return randomize_parameters(model, seed).eval()


@pytest.fixture(scope="module")
def swin():
    return _swin()


@pytest.fixture(scope="module")
def unetr():
    return _unetr()


def _first(output):
    """The output tensor (a bare MONAI ViT returns (tokens, hidden states))."""
    return output[0] if isinstance(output, tuple) else output


def _volume(model, batch=2, seed=1):
    size = input_size(model)
    return torch.randn(batch, *size, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------- hand-written geometry


def _windows(t, window):
    """(B, *S, C) with every side a multiple of the window -> (B * nW, T, C): windows and slots row-major."""
    batch, channels, spatial = t.shape[0], t.shape[-1], t.shape[1:-1]
    axes = len(spatial)
    split = [batch] + [part for side, w in zip(spatial, window) for part in (side // w, w)] + [channels]
    order = [0] + [1 + 2 * a for a in range(axes)] + [2 + 2 * a for a in range(axes)] + [1 + 2 * axes]
    return t.reshape(split).permute(order).reshape(-1, math.prod(window), channels)


def _unwindows(w, window, padded, batch):
    """Inverse of :func:`_windows`: (B * nW, T, C) -> (B, *padded, C)."""
    axes = len(padded)
    counts = [side // s for side, s in zip(padded, window)]
    t = w.reshape(batch, *counts, *window, -1)
    order = [0] + [part for a in range(axes) for part in (1 + a, 1 + axes + a)] + [1 + 2 * axes]
    return t.permute(order).reshape(batch, *padded, -1)


def _geometry(grid, window, shift):
    """MONAI's rule: a side no larger than the window shrinks the window to it and is not shifted."""
    used = tuple(side if side <= w else w for side, w in zip(grid, window))
    return used, tuple(0 if side <= w else s for side, w, s in zip(grid, window, shift))


def _relative_index(window):
    """(T, T) index into the (2w_a - 1)-product table of a full window, axis 0 most significant."""
    coords = torch.stack(torch.meshgrid(*[torch.arange(w) for w in window], indexing="ij")).flatten(1).T
    rel = coords[:, None, :] - coords[None, :, :] + torch.tensor(window) - 1  # (T, T, axes), >= 0
    index = torch.zeros(rel.shape[:2], dtype=torch.long)
    for axis, w in enumerate(window):
        index = index * (2 * w - 1) + rel[..., axis]
    return index


def _shift_mask(padded, window, shift):
    """(nW, T, T): -100 between slots whose tokens wrapped around differently along some axis in the roll."""
    region = torch.zeros(padded, dtype=torch.long)
    for axis, (side, step) in enumerate(zip(padded, shift)):
        wrapped = (torch.arange(side) + step >= side).long() if step else torch.zeros(side, dtype=torch.long)
        shape = [1] * len(padded)
        shape[axis] = side
        region = region + wrapped.view(shape) * 2 ** axis
    slots = _windows(region[None, ..., None], window)[..., 0]  # (nW, T)
    return torch.where(slots[:, :, None] != slots[:, None, :], -100.0, 0.0)


def _project(h, entry, key, heads):
    out = h @ entry[key].T
    if f"{key}_bias" in entry:
        out = out + entry[f"{key}_bias"]
    return out.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B', heads, T, hd)


# ----------------------------------------------------------------------------------------------- layout


def test_build_names_layout_and_embeddings(swin, unetr):
    assert family_name(swin) == "monai-swin-unetr" and family_name(unetr) == "monai-vit"
    assert input_size(swin) == (1, 32, 32, 32) and input_size(unetr) == (1, 32, 32, 32)
    views = blocks(swin)
    assert [view.name for view in views] == [f"stage{s}.block{b}" for s in range(4) for b in range(2)]
    assert [view.grid for view in views[::2]] == [(16,) * 3, (8,) * 3, (4,) * 3, (2,) * 3]
    # shifted odd blocks where the grid exceeds the window; stage 3 (2^3 < 4^3) shrinks the window, no shift
    assert [view.shift_size for view in views] == [(0,) * 3, (2,) * 3] * 2 + [(0,) * 3] * 4
    assert [view.window_size for view in views] == [(4,) * 3] * 6 + [(2,) * 3] * 2
    assert views[3].qualname == "swinViT.layers2.0.blocks.1" and views[3].dim == 24 and views[3].head_dim == 12
    assert views[3].rel_pos_table is swin.swinViT.layers2[0].blocks[1].attn.relative_position_bias_table
    assert views[3].rel_pos_table.shape == (7 ** 3, 2)
    embed = embeddings(swin)
    assert embed.patch_weight.shape == (12, 1, 2, 2, 2) and embed.grid == (16,) * 3 and embed.patch_size == (2,) * 3
    vit_views = blocks(unetr)
    assert len(vit_views) == 12 and vit_views[0].grid == (2, 2, 2) and vit_views[0].num_prefix_tokens == 0
    assert vit_views[5].qualname == "vit.blocks.5" and vit_views[5].head_dim == 12
    embed = embeddings(unetr)
    assert embed.pos_embed.shape == (8, 24) and embed.patch_weight.shape == (24, 1, 16, 16, 16)
    assert part_prefixes(swin, "head")[-1] == "out." and "swinViT." not in part_prefixes(swin, "head")
    assert part_prefixes(unetr, "norm") == ("vit.norm.",)
    cls = _vit()
    assert blocks(cls)[0].num_prefix_tokens == 1 and blocks(cls)[0].grid == (4, 4, 4)
    assert embeddings(cls).cls_token.shape == (24,)
    flat = ViT(in_channels=2, img_size=(16, 24, 32), patch_size=(4, 8, 8), hidden_size=24, mlp_dim=48, num_layers=1,
               num_heads=2, proj_type="perceptron")
    flat.vitlab_img_size = (16, 24, 32)  # a bare ViT does not keep its size
    embed, x = embeddings(flat), torch.randn(1, 2, 16, 24, 32)
    assert embed.grid == (4, 3, 4) and input_size(flat) == (2, 16, 24, 32)
    conv = F.conv3d(x, embed.patch_weight, embed.patch_bias, stride=embed.patch_size).flatten(2).transpose(1, 2)
    assert torch.allclose(conv, flat.patch_embedding.patch_embeddings(x), atol=1e-5)  # the Linear as filters


def test_qkv_views_are_live_slices_of_the_fused_and_separate_projections(swin, unetr):
    block = swin.swinViT.layers2[0].blocks[1].attn
    entry = qkv(swin)["stage1.block1"]
    assert entry["k"].data_ptr() == block.qkv.weight[24:48].data_ptr() and torch.equal(entry["v_bias"], block.qkv.bias[48:])
    assert torch.equal(out_proj(swin)["stage1.block1"]["weight"], block.proj.weight)
    entry = qkv(unetr)["stage0.block3"]
    assert torch.equal(entry["q"], unetr.vit.blocks[3].attn.qkv.weight[:24]) and "q_bias" not in entry
    separate = _vit(separate=True)
    entry, attn = qkv(separate)["stage0.block1"], separate.blocks[1].attn
    assert entry["k"] is not None and torch.equal(entry["k"], attn.to_k.weight)
    assert torch.equal(entry["v_bias"], attn.to_v.bias)


# ----------------------------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("config", sorted(SWIN_CONFIGS))
def test_swin_attention_recomputed_from_qkv_views(config):
    model = _swin(config)
    x = _volume(model)
    views = blocks(model)
    with torch.no_grad():
        plain = model(x)
        with record_attention(model) as rec, capture(model, ["qkv_input", "attn"]) as cap:
            recorded_out = model(x)
    assert torch.equal(recorded_out, plain)  # recording and capture leave the output bit-identical
    weights, shifted, shrunk = qkv(model), 0, 0
    for view in views:
        block, grid = view.module, view.grid
        window, shift = _geometry(grid, block.window_size, block.shift_size)
        assert (window, shift) == (view.window_size, view.shift_size) and rec.grids[view.name] == grid
        shifted, shrunk = shifted + any(shift), shrunk + (window != tuple(block.window_size))
        padded = tuple(-(-side // w) * w for side, w in zip(grid, window))
        h = cap[view.name, "qkv_input"].reshape(x.shape[0], *grid, -1)
        h = F.pad(h, _pad_args(grid, padded))  # MONAI pads after norm1: pad tokens are zero vectors
        axes = tuple(range(1, len(grid) + 1))
        h = torch.roll(h, shifts=tuple(-s for s in shift), dims=axes)
        tokens = _windows(h, window)  # (B * nW, T, C)
        heads, count = view.num_heads, tokens.shape[1]
        q, k, v = (_project(tokens, weights[view.name], key, heads) for key in "qkv")
        logits = (q @ k.transpose(-2, -1)) * view.head_dim ** -0.5
        index = _relative_index(tuple(block.window_size))
        assert torch.equal(index, block.attn.relative_position_index)
        # the bias of n slots is table[index[:n, :n]] (for a shrunk window MONAI keeps the top-left block)
        logits = logits + view.rel_pos_table[index[:count, :count].reshape(-1)].reshape(count, count, -1).permute(2, 0, 1)
        if any(shift):
            mask = _shift_mask(padded, window, shift)
            logits = (logits.view(x.shape[0], -1, heads, count, count) + mask[None, :, None]).flatten(0, 1)
        probs = logits.softmax(-1)
        assert torch.allclose(probs, rec.attentions[view.name], atol=1e-5), view.name
        mixed = (probs @ v).transpose(1, 2).flatten(2) @ block.attn.proj.weight.T + block.attn.proj.bias
        mixed = torch.roll(_unwindows(mixed, window, padded, x.shape[0]), shifts=shift, dims=axes)
        mixed = mixed[(slice(None), *(slice(0, side) for side in grid))].flatten(1, -2)
        assert torch.allclose(mixed, cap[view.name, "attn"], atol=1e-5), view.name
        if math.prod(grid) <= 512:  # the dense token x token form: windows scattered back, shift undone
            ids = F.pad(torch.arange(math.prod(grid)).view(1, *grid, 1).float(), _pad_args(grid, padded),
                        value=math.prod(grid))
            slots = _windows(torch.roll(ids, shifts=tuple(-s for s in shift), dims=axes), window)[..., 0].long()
            dense = probs.new_zeros(x.shape[0], heads, math.prod(grid) + 1, math.prod(grid) + 1)
            per_window = probs.view(x.shape[0], -1, heads, count, count).transpose(1, 2)
            dense[:, :, slots[:, :, None], slots[:, None, :]] = per_window
            assert torch.allclose(rec.dense(view.name), dense[:, :, :-1, :-1], atol=1e-6), view.name
    assert shifted >= 2 and shrunk >= 2  # both MONAI rules were exercised


def _pad_args(grid, padded):
    """F.pad arguments padding the (B, *grid, C) sides at their end up to ``padded`` (last axis first)."""
    args = [0, 0]
    for side, target in zip(reversed(grid), reversed(padded)):
        args += [0, target - side]
    return args


@pytest.mark.parametrize("variant", ["unetr", "vit-cls", "vit-separate"])
def test_vit_attention_recomputed_from_qkv_views(variant, unetr):
    model = unetr if variant == "unetr" else _vit(separate=variant == "vit-separate")
    x = _volume(model)
    with torch.no_grad():
        plain = model(x)
        with record_attention(model) as rec, capture(model, ["qkv_input", "attn"]) as cap:
            recorded_out = model(x)
    assert torch.equal(_first(recorded_out), _first(plain))  # a bare ViT returns (tokens, hidden states)
    weights, projections = qkv(model), out_proj(model)
    for view in blocks(model):
        full = lambda site: torch.cat([cap.prefix[view.name][site], cap[view.name, site]], 1) \
            if view.num_prefix_tokens else cap[view.name, site]  # noqa: E731
        h = full("qkv_input")
        q, k, v = (_project(h, weights[view.name], key, view.num_heads) for key in "qkv")
        probs = ((q @ k.transpose(-2, -1)) * view.head_dim ** -0.5).softmax(-1)
        assert torch.allclose(probs, rec.attentions[view.name], atol=1e-5), view.name
        mixed = (probs @ v).transpose(1, 2).flatten(2) @ projections[view.name]["weight"].T
        mixed = mixed + projections[view.name]["bias"]
        assert torch.allclose(mixed, full("attn"), atol=1e-5), view.name
    assert rec.attentions["stage0.block1"].shape[-1] == math.prod(blocks(model)[0].grid) + blocks(model)[0].num_prefix_tokens


def test_recording_restores_flags_and_hooks_and_matches_the_flash_path():
    swin = _swin(use_flash_attention=True)
    vit = _vit(flash=True)
    x = _volume(swin, batch=1)
    for model, volume in ((swin, x), (vit, _volume(vit, batch=1))):
        modules = list(model.modules())
        state = lambda: [(len(m._forward_hooks), len(m._forward_pre_hooks), getattr(m, "use_flash_attention", None),  # noqa: E731
                          getattr(m, "save_attn", None)) for m in modules]
        before = state()
        with torch.no_grad():
            plain = model(volume)
            with pytest.raises(RuntimeError, match="boom"):
                with record_attention(model) as rec, capture(model, "attn"):
                    recorded = model(volume)
                    raise RuntimeError("boom")
        assert state() == before and all("forward" not in m.__dict__ for m in modules)
        first, base = _first(recorded), _first(plain)
        # the explicit path while recording vs SDPA (random decoders reach 1e5: a relative tolerance)
        assert torch.allclose(first, base, rtol=1e-4, atol=1e-6 * float(base.abs().max()))
        assert rec.attentions and all(p.shape[-1] == p.shape[-2] for p in rec.attentions.values())
    assert vit.blocks[0].attn.att_mat.numel() == 0  # save_attn was off: no probabilities left behind


# ---------------------------------------------------------------------------------------------- window masks


@pytest.mark.parametrize("padded, window, shift", [
    ((8, 8, 8), (4, 4, 4), (2, 2, 2)),
    ((6, 8, 8), (3, 4, 4), (1, 2, 0)),  # shifted along some axes only
    ((4, 4, 4), (4, 4, 4), (0, 0, 0)),  # one window, no shift (MONAI still builds the mask)
    ((8, 12), (4, 4), (2, 2)),  # 2-D
])
def test_kept_window_masks_are_monai_masks_and_made_once(padded, window, shift):
    from monai.networks.nets import swin_unetr

    from vitlab.models.monai_build import cached_window_masks

    monai_mask = swin_unetr.compute_mask
    monai_mask = getattr(monai_mask, "__wrapped__", monai_mask)
    masks = cached_window_masks(monai_mask)
    first = masks(list(padded), window, shift, torch.device("cpu"))
    assert torch.equal(first, monai_mask(list(padded), window, shift, torch.device("cpu")))
    assert torch.equal(first, _shift_mask(padded, window, shift))  # the hand-written oracle
    assert masks(tuple(padded), list(window), list(shift), "cpu") is first  # one mask a geometry, however spelled
    assert len(masks.masks) == 1
    with torch.inference_mode():  # an inference tensor cannot serve a training forward: made apart
        inference = masks(list(padded), window, shift, torch.device("cpu"))
    assert inference is not first and torch.equal(inference, first) and len(masks.masks) == 2


def test_kept_window_masks_stay_within_their_budget_and_are_not_kept_while_compiling(monkeypatch):
    from monai.networks.nets import swin_unetr

    from vitlab.models.monai_build import cached_window_masks

    monai_mask = getattr(swin_unetr.compute_mask, "__wrapped__", swin_unetr.compute_mask)
    one = monai_mask([12, 8, 8], (4, 4, 4), (2, 2, 2), "cpu")  # (12, 64, 64)
    size = one.numel() * one.element_size()
    masks = cached_window_masks(monai_mask, budget=2 * size)
    for grid in ([12, 8, 8], [8, 8, 12], [8, 12, 8]):  # three masks of the same size
        masks(grid, (4, 4, 4), (2, 2, 2), "cpu")
    assert [key[0] for key in masks.masks] == [(8, 8, 12), (8, 12, 8)]  # the least recently used went
    masks([8, 8, 12], (4, 4, 4), (2, 2, 2), "cpu")  # used again: now the most recent
    assert [key[0] for key in masks.masks] == [(8, 12, 8), (8, 8, 12)]
    large = masks([16, 16, 16], (4, 4, 4), (2, 2, 2), "cpu")  # (64, 64, 64): over the budget, made every time
    assert torch.equal(large, monai_mask([16, 16, 16], (4, 4, 4), (2, 2, 2), "cpu"))
    assert (16, 16, 16) not in [key[0] for key in masks.masks] and len(masks.masks) == 2
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # while torch.compile traces: MONAI's call
    traced = masks([8, 8, 12], (4, 4, 4), (2, 2, 2), "cpu")
    assert traced is not masks.masks[next(reversed(masks.masks))] and torch.equal(traced, masks.masks[next(reversed(masks.masks))])


@pytest.mark.slow
def test_swin_unetr_with_kept_masks_compiles(monkeypatch):
    """torch.compile traces through the kept masks' wrapper (MONAI's own call while tracing): the compiled forward
    equals the eager one, and tracing keeps no mask."""
    import torch._dynamo
    from monai.networks.nets import swin_unetr

    swin = _swin("3d-window4", seed=6)
    x = _volume(swin, seed=7)
    kept = swin_unetr.compute_mask
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.no_grad():
        eager = swin(x)
        kept.masks.clear()
        torch._dynamo.reset()
        try:
            compiled = torch.compile(swin, backend=backend)(x)
        finally:
            torch._dynamo.reset()
    assert graphs and not kept.masks  # traced (MONAI's call inside the graph), nothing kept
    assert len(graphs) == 1  # one graph: no break at the input-size check (MONAI's numpy check made two)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(32, 32, 32), (32, 33, 64), (31, 32, 30), (64, 64)])
def test_the_integer_input_check_refuses_what_monais_refuses_with_its_message(swin, shape):
    """``install_input_check``: the sides MONAI's numpy check refuses, with its message word for word."""
    from monai.networks.nets import swin_unetr

    ours = swin_unetr.SwinUNETR._check_input_size
    monai_check = ours.__wrapped__
    assert monai_check is not ours
    spatial = torch.Size(shape)
    try:
        monai_check(swin, spatial)
        expected = None
    except ValueError as error:
        expected = str(error)
    if expected is None:
        ours(swin, spatial)
    else:
        with pytest.raises(ValueError) as caught:
            ours(swin, spatial)
        assert str(caught.value) == expected


@pytest.mark.parametrize("config", list(SWIN_CONFIGS))
def test_swin_unetr_with_kept_masks_trains_bit_for_bit_as_with_monai_masks(config, monkeypatch):
    from monai.networks.nets import swin_unetr

    swin = _swin(config, seed=3).train()
    assert hasattr(swin_unetr.compute_mask, "masks")  # building it installed the kept masks
    x = _volume(swin, seed=4)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)  # (the relative-position table's gradient is accumulated by an index_put)
    try:
        def step(compute_mask):
            monkeypatch.setattr(swin_unetr, "compute_mask", compute_mask)
            swin.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            out = swin(x)
            out.square().mean().backward()
            return out.detach(), {name: p.grad.clone() for name, p in swin.named_parameters()}

        kept = swin_unetr.compute_mask
        plain, plain_grads = step(kept.__wrapped__)
        kept.masks.clear()
        for _ in range(2):  # the masks made, then handed out again
            out, grads = step(kept)
            assert torch.equal(out, plain)
            assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)
        assert kept.masks
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


# ----------------------------------------------------------------------------------------------- ablation


def _swin_branch1(block, h, mask):
    """The library's ``forward_part1`` without its leading ``norm1`` (an oracle outside vitlab)."""
    norm, block.norm1 = block.norm1, nn.Identity()
    try:
        return block.drop_path(block.forward_part1(h, mask))
    finally:
        block.norm1 = norm


SINGLE = {"attention": ["mixer"], "mlp": ["mlp"], "norm1": ["norm1"], "norm2": ["norm2"],
          "residual_attention": ["residual_mixer"], "residual_mlp": ["residual_mlp"],
          "residual": ["residual_mixer", "residual_mlp"], "layernorm": ["norm1", "norm2"]}


@pytest.mark.parametrize("family", ["swin", "unetr"])
def test_nothing_removed_is_bit_identical(family, swin, unetr):
    model = swin if family == "swin" else unetr
    x = _volume(model, batch=1)
    with torch.no_grad():
        plain = model(x)
        try:
            ablate(model, [])
            assert all("forward" in view.module.__dict__ for view in blocks(model))
            assert torch.equal(model(x), plain)
        finally:
            restore(model)
        assert all("forward" not in view.module.__dict__ for view in blocks(model))


@pytest.mark.parametrize("component", sorted(SINGLE))
@pytest.mark.parametrize("family", ["swin", "unetr"])
def test_single_removal_follows_the_block_formula(family, component, swin, unetr):
    model = swin if family == "swin" else unetr
    view = blocks(model)[3]  # swin: stage1.block1, a shifted block on an 8^3 grid
    block, generator = view.module, torch.Generator().manual_seed(5)
    if family == "swin":
        x = torch.randn(2, *view.grid, view.dim, generator=generator)
        args = (_shift_mask(view.grid, view.window_size, view.shift_size),)
        parts = (block.norm1, lambda h: _swin_branch1(block, h, args[0]), block.norm2, lambda h: block.mlp(h))
    else:
        x = torch.randn(2, math.prod(view.grid), view.dim, generator=generator)
        args = ()
        parts = (block.norm1, lambda h: block.attn(h), block.norm2, lambda h: block.mlp(h))
    off = set(SINGLE[component])
    with torch.no_grad():
        plain, expected = block(x, *args), x
        for switch, norm, branch, norm_switch, residual in (("mixer", parts[0], parts[1], "norm1", "residual_mixer"),
                                                            ("mlp", parts[2], parts[3], "norm2", "residual_mlp")):
            if switch in off:
                continue
            f = branch(norm(expected) if norm_switch not in off else expected)
            expected = expected + f if residual not in off else f
        try:
            ablate(model, component, blocks=[view.global_index])
            actual = block(x, *args)
        finally:
            restore(model)
    assert torch.allclose(actual, expected, atol=1e-5)
    assert not torch.allclose(actual, plain, atol=1e-4)


# ----------------------------------------------------------------------------- snapshots, drift, transplant


def test_qkv_state_drift_and_spectra(swin):
    from vitlab.analysis import block_spectra, drift_tables, extra_drift
    from vitlab.qkv.state import head_counts, qkv_state

    state, heads = qkv_state(swin), head_counts(swin)
    assert len(heads) == 8 and state["stage2.block0.rel_pos_table"].shape == (343, 4)
    assert state["stage3.block1.q.weight"].shape == (96, 96)
    changed = {key: value.clone() for key, value in state.items()}
    changed["stage1.block1.k.weight"][12:24] += 0.1  # head 1 of one block's K
    rows, summary = drift_tables(state, changed, list(heads))
    moved = {key for key, values in summary.items() if values["rel_frobenius"] > 0}
    assert moved == {("stage1.block1", "k")}
    assert set(extra_drift(state, changed)) >= {"stage0.block1.rel_pos_table", "stage0.block1.q.bias"}
    spectra = block_spectra(state, heads)
    assert spectra["stage3.block0"].positive_mass.shape == (4,)
    assert spectra["stage0.block0"].singular_values.shape[-1] == 6


def test_transplant_round_trip(swin):
    target = _swin(seed=1)
    original = copy.deepcopy(target.state_dict())
    parts = ["patch_embed", "head", "attn@stage1.block1", "block@stage3.block1", "mlp@0"]
    report = transplant(target, swin, parts)
    copied = dict(report.copied)
    assert "swinViT.layers2.0.blocks.1.attn.relative_position_bias_table" in copied and "out.conv.conv.weight" in copied
    source_state = swin.state_dict()
    for key, value in target.state_dict().items():
        assert torch.equal(value, source_state[key] if key in copied else original[key]), key
    back = _swin(seed=1)
    back.load_state_dict(original)
    transplant(target, back, parts)
    assert all(torch.equal(value, original[key]) for key, value in target.state_dict().items())


def test_forward_until_matches_the_captured_stream(swin):
    x = _volume(swin, batch=1)
    with torch.no_grad():
        with capture(swin, ["resid", "mlp_hidden"], blocks=["stage1.block1"]) as cap:
            swin(x)
        stream = forward_until(swin, x, "stage1.block1")
        hidden = forward_until(swin, x, "stage1.block1", site="mlp_hidden")
        embedded = forward_until(swin, x, "embed")
    assert torch.equal(stream, cap["stage1.block1", "resid"]) and stream.shape == (1, 512, 24)
    assert torch.equal(hidden, cap["stage1.block1", "mlp_hidden"]) and hidden.shape == (1, 512, 96)
    assert torch.allclose(embedded, swin.swinViT.patch_embed(x).flatten(2).transpose(1, 2))


def test_non_attention_stages_are_skipped(swin):
    class NoAttention(nn.Module):  # stands for MONAI 1.6's Hyena blocks (x, mask) -> x
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, dim)

        def forward(self, x, mask):
            return x + self.fc(x)

    model = copy.deepcopy(swin)
    model.__dict__.pop("_vitlab_adapter", None)
    model.swinViT.layers4[0].blocks = nn.ModuleList([NoAttention(96), NoAttention(96)])
    views = blocks(model)
    assert [view.name for view in views][-1] == "stage2.block1" and len(qkv(model)) == 6
    with torch.no_grad(), record_attention(model) as rec:
        model(_volume(model, batch=1))
    assert len(rec.attentions) == 6
    from vitlab.models import layer_ids

    assert layer_ids(model)["swinViT.layers4.0.blocks.0.fc.weight"] == 7  # joins the layer after the blocks


# ----------------------------------------------------------------------------------------------- weights


def test_self_supervised_swin_checkpoint_loads_into_the_encoder(tmp_path, swin):
    ssl = {f"module.{key[len('swinViT.'):]}".replace(".mlp.linear1.", ".mlp.fc1.").replace(".mlp.linear2.", ".mlp.fc2."): value
           for key, value in swin.state_dict().items() if key.startswith("swinViT.")}
    assert "module.layers1.0.blocks.0.mlp.fc1.weight" in ssl
    path = tmp_path / "model_swinvit.pt"
    torch.save({"epoch": 100, "state_dict": ssl}, path)
    target = _swin(seed=2)
    decoder = {key: value.clone() for key, value in target.state_dict().items() if not key.startswith("swinViT.")}
    report = load_weights(target, path)
    assert not report.head_reset and all(key.startswith("swinViT.") for key in report.loaded_keys)
    state, source = target.state_dict(), swin.state_dict()
    assert all(torch.equal(state[key], source[key]) for key in source if key.startswith("swinViT."))
    assert all(torch.equal(state[key], value) for key, value in decoder.items())
    built = build_model("monai:swin_unetr", 2, in_chans=1, weights=path, **SWIN)
    assert torch.equal(built.swinViT.layers3[0].blocks[1].attn.qkv.weight, swin.swinViT.layers3[0].blocks[1].attn.qkv.weight)
    broken = dict(ssl)
    del broken["module.layers2.0.blocks.0.norm1.bias"]
    broken["module.layers1.0.blocks.1.attn.relative_position_bias_table"] = torch.zeros(5, 2)
    torch.save({"state_dict": broken}, path)
    with pytest.raises(WeightsMismatchError) as error:
        load_weights(target, path)
    message = str(error.value)
    assert "\n" not in message and "swinViT.layers2.0.blocks.0.norm1.bias" in message
    assert "swinViT.layers1.0.blocks.1.attn.relative_position_bias_table file (5, 2)" in message


def test_full_model_file_round_trip_and_other_class_count(tmp_path, unetr):
    path = tmp_path / "unetr.pt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in unetr.state_dict().items()}}, path)  # a vitlab checkpoint
    same = build_model("monai:unetr", 2, in_chans=1, weights=path, **UNETR).eval()
    x = _volume(unetr, batch=1)
    with torch.no_grad():
        assert torch.equal(same(x), unetr(x))
    other = build_model("monai:unetr", 3, in_chans=1, **UNETR)
    report = load_weights(other, path)
    assert report.head_reset and not any(key.startswith(("out.", "decoder")) for key in report.loaded_keys)
    assert torch.equal(other.vit.blocks[4].attn.qkv.weight, unetr.vit.blocks[4].attn.qkv.weight)


# ----------------------------------------------------------------------------------------------- errors


def test_one_line_errors(swin, unetr):
    cases = [
        (lambda: check_volume_size(swin, 40), "nearest valid sizes: (32, 32, 32) or (64, 64, 64)"),
        (lambda: check_volume_size(swin, (32, 48, 64)), "nearest valid sizes: (32, 32, 64) or (32, 64, 64)"),
        (lambda: check_volume_size(swin, 16), "nearest valid sizes: (32, 32, 32)"),
        (lambda: check_volume_size(swin, (32, 32)), "takes 3-D inputs (D, H, W); got a 2-D size (32, 32)"),
        (lambda: forward_until(swin, torch.randn(1, 1, 32, 32), 0), "got a 4-D tensor of shape (1, 1, 32, 32) (a 2-D image batch?)"),
        (lambda: check_volume_size(unetr, 48), "the valid size is (32, 32, 32)"),
        (lambda: build_model("monai:swin_unetr", 2, img_size=(32, 32, 40), **{k: v for k, v in SWIN.items() if k != "img_size"}),
         "nearest valid sizes: (32, 32, 32) or (32, 32, 64)"),
        (lambda: build_model("monai:swin_unetr", 2, img_size=32, feature_size=12), "instance norm fails"),
        (lambda: build_model("monai:segresnet", 2), "use one of monai:swin_unetr, monai:unetr"),
        (lambda: build_model("monai:swin_unetr", 2, spatial_size=3), "bad keyword argument"),
    ]
    for make, words in cases:
        with pytest.raises(ValueError) as error:
            make()
        assert words in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert check_volume_size(swin, (64, 32, 96)) == (64, 32, 96) and check_volume_size(unetr, 32) == (32, 32, 32)
    with pytest.raises(PretrainedWeightsUnavailable) as error:
        build_model("monai:swin_unetr", 2, pretrained=True)
    assert "model.weights" in str(error.value) and "\n" not in str(error.value)
    from vitlab.models.testing import tiny_model

    with pytest.raises(ValueError, match="takes 2-D images"):
        check_volume_size(tiny_model("timm-vit"), 32)


@pytest.mark.slow
def test_adapter_lookup_of_other_families_imports_no_monai():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys\nfrom vitlab.models import blocks\nfrom vitlab.models.testing import tiny_model\n"
            "blocks(tiny_model('timm-swin'))\nprint('monai' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_2d_swin_weights_are_refused_with_the_reason(tmp_path):
    from safetensors.torch import save_file

    planar = build_model("swin_tiny_patch4_window7_224", 2, in_chans=1, img_size=32, embed_dim=12, depths=(2, 2),
                                num_heads=(1, 2), window_size=4)
    path = tmp_path / "swin2d.safetensors"
    save_file({k: v.contiguous() for k, v in planar.state_dict().items()}, str(path))
    with pytest.raises(WeightsMismatchError) as error:
        build_model("monai:swin_unetr", 2, in_chans=1, img_size=32, feature_size=12, norm_name="batch", weights=path)
    message = str(error.value)
    assert "\n" not in message and "swin2d.safetensors" in message and "2-D Swin weights" in message and "no inflation rule" in message
