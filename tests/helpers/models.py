"""Tiny models and the hand oracles the model tests check vitlab against.

The oracles are written directly against the libraries' own modules (timm, torchvision, transformers), independently
of vitlab's adapters: each family's sub-layers (:data:`LIBRARY_PARTS`, :data:`LIBRARY_MIXER`), the output of a block
with parts removed (:func:`expected_block`), multi-head and shifted-window attention by hand
(:func:`attention_by_hand`, :func:`window_attention_by_hand`, :func:`shifted_window_partners`), and every block's
input and output from plain forward hooks (:func:`library_block_io`). Tiny Hugging Face models: :func:`tiny_hf`.
"""

from __future__ import annotations

import math

import torch

from vitlab.models import blocks, build_model
from vitlab.models.testing import TINY_IMAGE_SIZE, randomize_parameters


def images(batch=2, in_chans=3, seed=1, size=TINY_IMAGE_SIZE):
    """A seeded random batch (B, in_chans, size, size)."""
    return torch.randn(batch, in_chans, size, size, generator=torch.Generator().manual_seed(seed))


# ---- each family's sub-layers, and a block with parts removed --------------------------------------

def _gamma(gamma):
    """timm Eva / Beit LayerScale: ``gamma`` or 1 when the model has none."""
    return 1.0 if gamma is None else gamma


# the library's own sub-layers of each family, written directly against timm / torchvision modules
# (an oracle independent of vitlab's adapters): norm1, branch 1 on the normed input, norm2, branch 2
LIBRARY_PARTS = {
    "timm-vit": (lambda b: b.norm1, lambda b, h: b.ls1(b.attn(h)), lambda b: b.norm2, lambda b, h: b.ls2(b.mlp(h))),
    "timm-swin": (lambda b: b.norm1, lambda b, h: b._attn(h), lambda b: b.norm2, lambda b, h: b.mlp(h)),
    "timm-mixer": (lambda b: b.norm1, lambda b, h: b.mlp_tokens(h.transpose(1, 2)).transpose(1, 2),
                   lambda b: b.norm2, lambda b, h: b.mlp_channels(h)),
    "torchvision-vit": (lambda b: b.ln_1, lambda b, h: b.self_attention(h, h, h, need_weights=False)[0],
                        lambda b: b.ln_2, lambda b, h: b.mlp(h)),
    "torchvision-swin": (lambda b: b.norm1, lambda b, h: b.attn(h), lambda b: b.norm2, lambda b, h: b.mlp(h)),
    # res-post-norm Swin V2: x + norm1(attn(x)), x + norm2(mlp(x)) (see POST_NORM)
    "timm-swinv2": (lambda b: b.norm1, lambda b, h: b._attn(h), lambda b: b.norm2, lambda b, h: b.mlp(h)),
    "timm-swinv2-cr": (lambda b: b.norm1, lambda b, h: b._shifted_window_attn(h), lambda b: b.norm2,
                       lambda b, h: b.mlp(h)),
    "torchvision-swinv2": (lambda b: b.norm1, lambda b, h: b.attn(h), lambda b: b.norm2, lambda b, h: b.mlp(h)),
    "timm-eva": (lambda b: b.norm1, lambda b, h: _gamma(b.gamma_1) * b.attn(h), lambda b: b.norm2,
                 lambda b, h: _gamma(b.gamma_2) * b.mlp(h)),
    "timm-beit": (lambda b: b.norm1, lambda b, h: _gamma(b.gamma_1) * b.attn(h), lambda b: b.norm2,
                  lambda b, h: _gamma(b.gamma_2) * b.mlp(h)),
    "timm-vit-relpos": (lambda b: b.norm1, lambda b, h: b.ls1(b.attn(h)), lambda b: b.norm2,
                        lambda b, h: b.ls2(b.mlp(h))),
}
POST_NORM = {"timm-swinv2", "timm-swinv2-cr", "torchvision-swinv2"}
# a norm on the stream after both residual adds (Swin V2-Cr norm3: the model's last block), never ablated
MAIN_NORM = {"timm-swinv2-cr": lambda b: b.norm3}
# the attention / token-mixing branch on the normed input
# (kw: the keyword arguments the model passed to the block, e.g. Eva's rotary embedding ``rope``)
LIBRARY_MIXER = {
    "timm-vit": lambda b, x, **kw: b.ls1(b.attn(b.norm1(x))),
    "timm-swin": lambda b, x, **kw: b._attn(b.norm1(x)),
    "timm-mixer": lambda b, x, **kw: b.mlp_tokens(b.norm1(x).transpose(1, 2)).transpose(1, 2),
    "torchvision-vit": lambda b, x, **kw: b.self_attention(*(b.ln_1(x),) * 3, need_weights=False)[0],
    "torchvision-swin": lambda b, x, **kw: b.attn(b.norm1(x)),
    "timm-swinv2": lambda b, x, **kw: b.norm1(b._attn(x)),  # res-post-norm
    "timm-swinv2-cr": lambda b, x, **kw: b.norm1(b._shifted_window_attn(x)),
    "torchvision-swinv2": lambda b, x, **kw: b.norm1(b.attn(x)),
    "timm-eva": lambda b, x, **kw: _gamma(b.gamma_1) * b.attn(b.norm1(x), **kw),
    "timm-beit": lambda b, x, **kw: _gamma(b.gamma_1) * b.attn(b.norm1(x), **kw),
    "timm-vit-relpos": lambda b, x, **kw: b.ls1(b.attn(b.norm1(x), **kw)),
}

def expected_block(family, block, x, keep):
    """A removed branch is x -> x, a removed residual x -> f(x), a removed norm the identity."""
    norm1, branch1, norm2, branch2 = LIBRARY_PARTS[family]
    steps = ((keep["mixer"], norm1, branch1, keep["norm1"], keep["residual_mixer"]),
             (keep["mlp"], norm2, branch2, keep["norm2"], keep["residual_mlp"]))
    for on, norm, branch, norm_on, residual_on in steps:
        if not on:
            continue
        if family in POST_NORM:  # res-post-norm: the norm acts on the branch output
            f = branch(block, x)
            f = norm(block)(f) if norm_on else f
        else:
            f = branch(block, norm(block)(x) if norm_on else x)
        x = x + f if residual_on else f
    return MAIN_NORM[family](block)(x) if family in MAIN_NORM else x


SINGLE = {  # remove -> switches off
    "attention": ["mixer"], "mlp": ["mlp"], "norm1": ["norm1"], "norm2": ["norm2"],
    "residual_attention": ["residual_mixer"], "residual_mlp": ["residual_mlp"],
    "residual": ["residual_mixer", "residual_mlp"], "layernorm": ["norm1", "norm2"],
}
SWITCHES = ["mixer", "mlp", "norm1", "norm2", "residual_mixer", "residual_mlp"]


def library_block_io(model, x):
    """Inputs, outputs and keyword arguments of every block from plain forward hooks (the library forward)."""
    inputs, outputs, kwargs, handles = {}, {}, {}, []

    def keep(name):
        def hook(module, args, block_kwargs, out):
            inputs[name], outputs[name], kwargs[name] = args[0], out, block_kwargs
        return hook

    for view in blocks(model):
        handles.append(view.module.register_forward_hook(keep(view.name), with_kwargs=True))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs, kwargs


# ---- independent re-implementation of (shifted-window) multi-head attention -------------------------

def relative_position_bias(table, window):
    """(heads, T, T) bias: table[(r_i - r_j + wh - 1) * (2 ww - 1) + (c_i - c_j + ww - 1)]."""
    wh, ww = window
    rows, cols = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    index = (rows[:, None] - rows[None, :] + wh - 1) * (2 * ww - 1) + (cols[:, None] - cols[None, :] + ww - 1)
    return table[index].permute(2, 0, 1)


def attention_by_hand(h, weights, proj, heads, logit_bias=None):
    """h (B', T, C) -> (out (B', T, C), probs (B', heads, T, T)); logit_bias broadcast to (B', heads, T, T)."""
    def project(key):
        out = h @ weights[key].T
        if f"{key}_bias" in weights:
            out = out + weights[f"{key}_bias"]
        return out.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B', heads, T, hd)

    q, k, v = project("q"), project("k"), project("v")
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if logit_bias is not None:
        logits = logits + logit_bias
    probs = logits.softmax(dim=-1)
    out = (probs @ v).transpose(1, 2).flatten(2) @ proj["weight"].T  # (B', T, C)
    return out + proj.get("bias", 0), probs


def window_attention_by_hand(h, weights, proj, view):
    """Swin branch on h (B, H, W, C): roll by -shift, windows, masked attention + rel-pos bias, back."""
    batch, height, width, channels = h.shape
    (wh, ww), (sh, sw) = view.window_size, view.shift_size
    rolled = torch.roll(h, shifts=(-sh, -sw), dims=(1, 2))
    windows = rolled.view(batch, height // wh, wh, width // ww, ww, channels).permute(0, 1, 3, 2, 4, 5)
    windows = windows.reshape(-1, wh * ww, channels)  # (B*nW, T, C)
    # a slot of the rolled grid "wrapped" when it came from the other image edge; only equal flags attend
    wrapped_rows = (torch.arange(height) + sh >= height)[:, None].expand(height, width)
    wrapped_cols = (torch.arange(width) + sw >= width)[None, :].expand(height, width)
    region = (wrapped_rows.long() * 2 + wrapped_cols.long()).view(height // wh, wh, width // ww, ww)
    region = region.permute(0, 2, 1, 3).reshape(-1, wh * ww)  # (nW, T)
    mask = torch.zeros(region.shape[0], wh * ww, wh * ww)
    mask[region[:, :, None] != region[:, None, :]] = float("-inf")
    bias = relative_position_bias(view.rel_pos_table.detach(), (wh, ww))  # (heads, T, T)
    num_windows = region.shape[0]
    logit_bias = (bias[None, None] + mask[None, :, None]).expand(batch, -1, -1, -1, -1).flatten(0, 1)
    out, probs = attention_by_hand(windows, weights, proj, view.num_heads, logit_bias)
    out = out.view(batch, height // wh, width // ww, wh, ww, channels).permute(0, 1, 3, 2, 4, 5)
    out = torch.roll(out.reshape(batch, height, width, channels), shifts=(sh, sw), dims=(1, 2))
    return out, probs, num_windows


def shifted_window_partners(grid, window, shift):
    """Swin's rule, independently: roll the grid by -shift, cut it into windows; within a window the regions
    [0, G - w), [G - w, G - s), [G - s, G) of each axis (rolled coordinates) are masked apart."""
    def label(x, n, w, s):
        r = (x - s) % n
        return r // w, (0 if r < n - w else 1 if r < n - s else 2)
    cells = [tuple(c) for c in torch.cartesian_prod(*[torch.arange(n) for n in grid]).reshape(-1, len(grid)).tolist()]
    labels = [tuple(label(x, n, w, s) for x, n, w, s in zip(c, grid, window, shift)) for c in cells]
    return torch.tensor([[a == b for b in labels] for a in labels])


# ---- tiny Hugging Face transformers models (configs only, no download) -------------------------------

SIZE = TINY_IMAGE_SIZE
PLAIN = dict(image_size=SIZE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
HF_TINY = {
    "vit": ("hf:vit", dict(PLAIN, intermediate_size=64)),
    "dinov2": ("hf:dinov2", dict(PLAIN, mlp_ratio=2)),
    "dinov2-registers": ("hf:dinov2_with_registers", dict(PLAIN, mlp_ratio=2, num_register_tokens=2)),
    "swin": ("hf:swin", dict(image_size=SIZE, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[1, 2],
                             window_size=4)),
}
HF_VARIANTS = sorted(HF_TINY)


def tiny_hf(variant, num_classes=3, in_chans=3, seed=0):
    name, kwargs = HF_TINY[variant]
    return randomize_parameters(build_model(name, num_classes, in_chans=in_chans, **kwargs), seed).eval()

