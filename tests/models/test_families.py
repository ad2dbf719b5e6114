"""Swin V2 (timm, V2-Cr, torchvision), Eva, Beit and ViT-RelPos: attention recomputed by hand from the Q/K/V
views and each family's own position terms; the README's family table generated from the registry."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vitlab.models import blocks, capture, embeddings, out_proj, qkv, record_attention
from vitlab.models.registry import families_table, get_adapter
from vitlab.models.testing import TINY_IMAGE_SIZE, tiny_model

SWIN_V2 = ["timm-swinv2", "timm-swinv2-cr", "torchvision-swinv2"]
TOKEN_VITS = ["timm-eva", "timm-beit", "timm-vit-relpos"]
README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def _images(batch=2, seed=1):
    return torch.randn(batch, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _project(h, weights, key, heads):
    """h (B', T, C) -> (B', heads, T, hd) with the Q/K/V view (and bias when present)."""
    out = h @ weights[key].T
    if f"{key}_bias" in weights:
        out = out + weights[f"{key}_bias"]
    return out.unflatten(-1, (heads, -1)).transpose(1, 2)


def _pair_displacements(window):
    """(T, T, 2) row/column displacement r_i - r_j, c_i - c_j of the slots of a (wh, ww) window."""
    rows, cols = torch.meshgrid(torch.arange(window[0]), torch.arange(window[1]), indexing="ij")
    coords = torch.stack([rows.flatten(), cols.flatten()], -1).float()  # (T, 2)
    return coords[:, None, :] - coords[None, :, :]


def _cpb_bias(family, attn, window):
    """Continuous position bias (heads, T, T), evaluated pair by pair with the block's own MLP."""
    d = _pair_displacements(window)
    if family == "timm-swinv2-cr":  # log-spaced coordinates, raw meta-MLP output
        return attn.meta_mlp(torch.sign(d) * torch.log1p(d.abs())).permute(2, 0, 1)
    scaled = 8 * d / torch.tensor([max(window[0] - 1, 1), max(window[1] - 1, 1)])  # normalised to [-8, 8]
    coords = torch.sign(scaled) * torch.log2(scaled.abs() + 1) / 3  # log2(8) = 3
    return 16 * torch.sigmoid(attn.cpb_mlp(coords)).permute(2, 0, 1)


def _shift_mask(grid, window, shift):
    """(nW, T, T) additive mask: -100 between slots that came from different regions of the rolled grid."""
    (height, width), (wh, ww), (sh, sw) = grid, window, shift
    wrapped_rows = (torch.arange(height) + sh >= height)[:, None].expand(height, width)
    wrapped_cols = (torch.arange(width) + sw >= width)[None, :].expand(height, width)
    region = (wrapped_rows.long() * 2 + wrapped_cols.long()).view(height // wh, wh, width // ww, ww)
    region = region.permute(0, 2, 1, 3).reshape(-1, wh * ww)
    return (region[:, :, None] != region[:, None, :]).float() * -100.0


def _swin_v2_probs(family, block, h, weights, grid, window, shift):
    """Cosine window attention by hand: exp(min(s, log 100)) cos(q, k) + bias + shift mask, softmax."""
    batch, channels = h.shape[0], h.shape[-1]
    (height, width), (wh, ww) = grid, window
    attn = block.attn
    rolled = torch.roll(h.view(batch, height, width, channels), shifts=(-shift[0], -shift[1]), dims=(1, 2))
    windows = rolled.view(batch, height // wh, wh, width // ww, ww, channels).permute(0, 1, 3, 2, 4, 5)
    windows = windows.reshape(-1, wh * ww, channels)  # (B*nW, T, C)
    heads = attn.num_heads
    q, k = _project(windows, weights, "q", heads), _project(windows, weights, "k", heads)
    cosine = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    scale = attn.logit_scale.detach().reshape(1, heads, 1, 1).clamp(max=math.log(100.0)).exp()
    logits = cosine * scale + _cpb_bias(family, attn, window)
    mask = _shift_mask(grid, window, shift)  # (nW, T, T)
    logits = (logits.unflatten(0, (batch, -1)) + mask[None, :, None]).flatten(0, 1)
    return logits.softmax(-1)


def _library_geometry(family, block, grid):
    """Window and shift as the library's block holds them (torchvision drops a shift one window covers)."""
    if family == "torchvision-swinv2":
        window, shift = list(block.attn.window_size), list(block.attn.shift_size)
        shift = [0 if window[axis] >= grid[axis] else shift[axis] for axis in range(2)]
        return tuple(window), tuple(shift)
    return tuple(block.window_size), tuple(block.shift_size)


@pytest.mark.parametrize("family", SWIN_V2)
def test_swin_v2_cosine_attention_by_hand(family):
    model = tiny_model(family)
    first = blocks(model)[0].module
    with torch.no_grad():
        first.attn.logit_scale.view(-1)[0] = 6.0  # above log(100): the clamp is exercised
    weights, projections = qkv(model), out_proj(model)
    with torch.no_grad(), capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
        plain = model(_images())
    views = blocks(model)
    assert any(any(view.shift_size) for view in views)  # shifted windows exercised
    for view in views:
        grid = record.grids[view.name]
        window, shift = _library_geometry(family, view.module, grid)
        assert (window, shift) == (view.window_size, get_adapter(model).window_geometry(view.module, grid)[1])
        h = record[view.name, "qkv_input"]  # post-norm: the block input itself
        with torch.no_grad():
            probs = _swin_v2_probs(family, view.module, h, weights[view.name], grid, window, shift)
        recorded = attention.attentions[view.name]
        assert recorded.shape == probs.shape
        assert torch.allclose(recorded, probs, atol=1e-5), (view.name, (recorded - probs).abs().max())
        # dense token form x V -> proj -> norm1 is the (post-norm) attention branch
        dense = attention.dense(view.name)
        values = _project(h, weights[view.name], "v", view.num_heads)
        mixed = (dense @ values).transpose(1, 2).flatten(2) @ projections[view.name]["weight"].T
        with torch.no_grad():
            branch = view.module.norm1(mixed + projections[view.name]["bias"])
        assert torch.allclose(branch, record[view.name, "attn"], atol=1e-5), view.name
    with torch.no_grad():
        assert torch.equal(model(_images()), plain)


def test_swin_v2_zero_k_bias_in_qkv_views():
    for family in SWIN_V2:
        model = tiny_model(family)
        entry = next(iter(qkv(model).values()))
        assert entry["q_bias"].abs().sum() > 0 and entry["v_bias"].abs().sum() > 0
        if family == "timm-swinv2-cr":  # V2-Cr keeps a learned K bias
            assert entry["k_bias"].abs().sum() > 0
        else:  # timm: zero k_bias buffer; torchvision zeroes the K third of qkv.bias inside the attention
            assert torch.equal(entry["k_bias"], torch.zeros_like(entry["k_bias"]))


def _rotary(x, emb):
    """timm's interleaved rotary embedding by hand: x * cos + rot(x) * sin, rot(x)_{2i,2i+1} = (-x_{2i+1}, x_{2i})."""
    sin, cos = emb.chunk(2, -1)
    rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
    return x * cos + rotated * sin


def _token_bias(family, model, block, view):
    """(heads, N, N) logit bias from the family's own position terms (None for Eva: rotary instead)."""
    if family == "timm-beit":  # table[(dr + wh - 1)(2ww - 1) + dc + ww - 1]; class token rows/columns at the end
        table = block.attn.relative_position_bias_table.detach()
        wh, ww = view.grid
        distances = table.shape[0]
        d = _pair_displacements(view.grid).long()
        index = torch.full((wh * ww + 1,) * 2, distances - 2)  # token -> cls column
        index[0, :] = distances - 3  # cls -> token row
        index[0, 0] = distances - 1
        index[1:, 1:] = (d[..., 0] + wh - 1) * (2 * ww - 1) + d[..., 1] + ww - 1
        return table[index].permute(2, 0, 1)
    if family == "timm-vit-relpos":  # log-coordinate MLP ('cr' mode) over every token pair, zero on prefix tokens
        rel_pos = block.attn.rel_pos
        assert rel_pos.mode == "cr" and rel_pos.bias_gain is None
        d = _pair_displacements(view.grid)
        bias = rel_pos.mlp(torch.sign(d) * torch.log1p(d.abs())).permute(2, 0, 1)
        prefix = view.num_prefix_tokens
        return F.pad(bias, [prefix, 0, prefix, 0])
    return None


@pytest.mark.parametrize("variant", TOKEN_VITS + ["timm-eva-separate-qkv", "timm-vit-relpos-cls"])
def test_token_vit_attention_by_hand(variant):
    family = variant.replace("-separate-qkv", "").replace("-cls", "")
    overrides = {"timm-eva-separate-qkv": dict(qkv_fused=False), "timm-vit-relpos-cls": dict(class_token=True,
                                                                                             global_pool="token")}
    model = tiny_model(family, **overrides.get(variant, {}))
    weights, projections = qkv(model), out_proj(model)
    with torch.no_grad(), capture(model, ["qkv_input", "attn"]) as record, record_attention(model) as attention:
        recorded_out = model(_images())
    with torch.no_grad():
        assert torch.allclose(recorded_out, model(_images()), atol=1e-5)  # unchanged up to fused-kernel rounding
    for view in blocks(model):
        block, prefix = view.module, view.num_prefix_tokens
        h = torch.cat([record.prefix[view.name]["qkv_input"], record[view.name, "qkv_input"]], 1) if prefix \
            else record[view.name, "qkv_input"]
        q, k, v = (_project(h, weights[view.name], key, view.num_heads) for key in "qkv")
        bias = _token_bias(family, model, block, view)
        with torch.no_grad():
            if family == "timm-eva":
                emb = model.rope.get_embed()  # (patches, 2 hd): sin | cos of the model's own rotary table
                assert not block.attn.rotate_half
                plain_logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
                q = torch.cat([q[:, :, :prefix], _rotary(q[:, :, prefix:], emb)], 2)
                k = torch.cat([k[:, :, :prefix], _rotary(k[:, :, prefix:], emb)], 2)
            logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if family == "timm-eva":
                assert (logits - plain_logits).abs().max() > 1e-3  # the rotary path matters
            probs = (logits if bias is None else logits + bias).softmax(-1)
        recorded = attention.attentions[view.name]
        assert torch.allclose(recorded, probs, atol=1e-5), (view.name, (recorded - probs).abs().max())
        if bias is not None:
            assert bias.abs().max() > 1e-3 and not torch.allclose(logits.softmax(-1), probs, atol=1e-4)
        # attention branch: probs V -> (Eva's scale norm) -> proj -> LayerScale
        with torch.no_grad():
            mixed = getattr(block.attn, "norm", torch.nn.Identity())((probs @ v).transpose(1, 2).flatten(2))
            out = mixed @ projections[view.name]["weight"].T + projections[view.name]["bias"]
            if hasattr(block, "ls1"):  # ViT-RelPos LayerScale module (Identity without init_values)
                out = block.ls1(out)
            elif block.gamma_1 is not None:  # Eva / Beit LayerScale parameter
                out = out * block.gamma_1
        assert torch.allclose(out[:, prefix:], record[view.name, "attn"], atol=1e-5), view.name


def test_eva_separate_qkv_views_and_beit_k_bias():
    separate = tiny_model("timm-eva", qkv_fused=False)
    block = separate.blocks[0].attn
    entry = qkv(separate)["stage0.block0"]
    assert torch.equal(entry["q"], block.q_proj.weight) and torch.equal(entry["k"], block.k_proj.weight)
    assert torch.equal(entry["v_bias"], block.v_proj.bias)
    assert torch.equal(entry["k_bias"], torch.zeros_like(entry["k_bias"]))  # EVA has no K bias
    beit = tiny_model("timm-beit")
    entry = qkv(beit)["stage0.block1"]
    attn = beit.blocks[1].attn
    assert torch.equal(entry["q_bias"], attn.q_bias) and torch.equal(entry["v_bias"], attn.v_bias)
    assert torch.equal(entry["k_bias"], torch.zeros_like(entry["k_bias"]))
    view = blocks(beit)[1]
    assert view.rel_pos_table is beit.blocks[1].attn.relative_position_bias_table
    embed = embeddings(beit)
    assert embed.pos_embed is None and embed.cls_token is not None and embed.num_prefix_tokens == 1
    eva_embed = embeddings(tiny_model("timm-eva"))
    assert eva_embed.pos_embed.shape == (16, 32) and eva_embed.grid == (4, 4)


def test_unsupported_variants_name_the_supported_families():
    from vitlab.models import UnsupportedModelError, build_model

    with pytest.raises(UnsupportedModelError, match="timm Eva"):
        build_model("vit_relpos_base_patch16_rpn_224", 2, img_size=32, patch_size=8, embed_dim=32, depth=1,
                    num_heads=2)


@pytest.mark.slow
def test_registry_lists_hugging_face_last_and_importing_vitlab_models_loads_no_family_library():
    from vitlab.models.registry import families

    optional = [adapter.library.startswith("transformers") for adapter in families(include_optional=True)]
    assert optional == sorted(optional), "the Hugging Face families must come last"
    code = ("import sys, vitlab.models\n"
            "print(sorted({'timm', 'torchvision', 'transformers', 'monai'} & {m.split('.')[0] for m in sys.modules}))")
    env = {**os.environ, "PYTHONPATH": str(README.parent), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=README.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "[]", done.stdout


def test_readme_family_table_is_generated_from_the_registry():
    text = README.read_text()
    match = re.search(r"<!-- families-table:start -->\n(.*?)\n<!-- families-table:end -->", text, re.S)
    assert match, "README.md lacks the <!-- families-table:start/end --> markers"
    assert match.group(1).strip() == families_table().strip(), (
        "README family table is stale: replace it with the output of "
        "`python -c \"from vitlab.models import families_table; print(families_table())\"`")
    rows = families_table().splitlines()[2:]
    for family in SWIN_V2 + TOKEN_VITS + ["timm-vit", "torchvision-swin"]:
        assert any(f"`{family}`" in row for row in rows), family


def test_cosine_blocks_are_flagged_and_their_qk_spectra_are_those_of_wq_wk():
    from vitlab.analysis import qk_spectra

    forms = {family: {view.attention_form for view in blocks(tiny_model(family))} for family in SWIN_V2 + TOKEN_VITS}
    assert forms == {family: {"cosine" if family in SWIN_V2 else "dot"} for family in forms}
    model = tiny_model("timm-swinv2")
    view = blocks(model)[-1]
    entry = qkv(model)[view.name]
    spectra = qk_spectra(entry["q"], entry["k"], view.num_heads)
    for head in range(view.num_heads):  # the per-head form Wq_h^T Wk_h, whatever the cosine normalisation
        rows = slice(head * view.head_dim, (head + 1) * view.head_dim)
        form = (entry["q"][rows].T @ entry["k"][rows]).double()
        sym = torch.linalg.eigvalsh((form + form.T) / 2)
        expected = sym.abs().sum()
        mass = sym.clamp(min=0).sum() / expected
        assert torch.allclose(spectra.positive_mass[head], mass, atol=1e-6)
        singular = torch.linalg.svdvals(form)[: view.head_dim]
        assert torch.allclose(spectra.singular_values[head], singular, atol=1e-6)


@pytest.mark.parametrize("family", SWIN_V2 + TOKEN_VITS)
def test_recording_restores_hooks_and_flags_after_an_exception(family):
    model = tiny_model(family)
    x = _images()
    modules = list(model.modules())
    state = lambda: [(len(m._forward_hooks), len(m._forward_pre_hooks), getattr(m, "fused_attn", None))  # noqa: E731
                     for m in modules]
    before = state()
    with torch.no_grad():
        plain = model(x)
        with pytest.raises(RuntimeError, match="boom"):
            with record_attention(model), capture(model, "attn"):
                model(x)
                raise RuntimeError("boom")
        assert torch.equal(model(x), plain)
    assert state() == before
    assert all("forward" not in m.__dict__ for m in modules)


@pytest.mark.parametrize("name, grids", [("swinv2_tiny_window8_256", [(64, 64), (32, 32), (16, 16), (8, 8)]),
                                         ("swin_v2_t", [(56, 56), (28, 28), (14, 14), (7, 7)])])
def test_swin_v2_tiny_layout(name, grids):
    """Swin V2-T: depths (2,2,6,2), heads (3,6,12,24), window 8, shifted odd blocks except a one-window stage."""
    from vitlab.models import build_model

    views = blocks(build_model(name, 2))
    assert [sum(view.stage == s for view in views) for s in range(4)] == [2, 2, 6, 2]
    assert {view.stage: view.num_heads for view in views} == {0: 3, 1: 6, 2: 12, 3: 24}
    assert [view.grid for view in views if view.index == 0] == grids
    for view in views:
        one_window = view.grid[0] <= 8
        assert view.window_size == ((8, 8) if not one_window or name == "swin_v2_t" else view.grid), view.name
        expected = (4, 4) if view.index % 2 == 1 and not one_window else (0, 0)
        assert view.shift_size == expected and view.attention_form == "cosine", view.name


@pytest.mark.parametrize("overrides", [{}, {"scale_mlp": True}])
def test_eva_swiglu_hidden_layer_is_gate_times_value(overrides):
    """EVA-02 SwiGLU: packed GluMlp (silu(first half) * second half), or with ``scale_mlp`` separate
    fc1_g / fc1_x and a norm before fc2; ``mlp_hidden`` is silu(gate) * value."""
    model = tiny_model("timm-eva", **overrides)
    mlp = model.blocks[1].mlp
    with torch.no_grad(), capture(model, ["mlp_input", "mlp_hidden", "mlp"], blocks=1) as record:
        model(_images())
    name = blocks(model)[1].name
    h = record[name, "mlp_input"]
    with torch.no_grad():
        if hasattr(mlp, "fc1_g"):
            gate, value = h @ mlp.fc1_g.weight.T + mlp.fc1_g.bias, h @ mlp.fc1_x.weight.T + mlp.fc1_x.bias
        else:
            gate, value = (h @ mlp.fc1.weight.T + mlp.fc1.bias).chunk(2, dim=-1)
        hidden = F.silu(gate) * value
        out = mlp.norm(hidden) @ mlp.fc2.weight.T + mlp.fc2.bias
    assert isinstance(mlp.norm, torch.nn.LayerNorm) == bool(overrides)
    assert torch.allclose(record[name, "mlp_hidden"], hidden, atol=1e-5)
    assert torch.allclose(record[name, "mlp"], out, atol=1e-5)  # no LayerScale in EVA-02 tiny
