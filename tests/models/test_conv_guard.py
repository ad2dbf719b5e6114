"""vitlab.models.conv_guard: the 3-D convolutions whose bf16 weight gradient oneDNN gets wrong on the CPU computed in
float32, checked against float64 computations of the same convolutions; every other call torch's own, bit for bit.

(These tests never run oneDNN's wrong case: it can write past its buffers and abort the process.)"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.models.conv_guard import DepthSafeConv3d, DepthSafeConvTranspose3d, guard_conv3d, wrong_bf16_weight_gradient

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def _float64_grads(conv: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Output, input gradient and weight gradient of ``conv`` on ``x`` in float64, by the functional call."""
    x64, w64 = x.double().requires_grad_(), conv.weight.detach().double().requires_grad_()
    b64 = None if conv.bias is None else conv.bias.detach().double()
    if isinstance(conv, nn.ConvTranspose3d):
        y = F.conv_transpose3d(x64, w64, b64, conv.stride, conv.padding, conv.output_padding, conv.groups, conv.dilation)
    else:
        y = F.conv3d(x64, w64, b64, conv.stride, conv.padding, conv.dilation, conv.groups)
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad


WRONG_CASES = [  # (module, input depth): the kernel deeper than the input or the output
    (lambda: nn.Conv3d(16, 24, 3, padding=1), 2),  # a U-Net decoder's block at 2^3 voxels
    (lambda: nn.Conv3d(32, 16, (5, 3, 3), padding=(2, 1, 1), bias=False), 3),
    (lambda: nn.Conv3d(16, 16, (4, 3, 3), padding=(2, 1, 1)), 2),
    (lambda: nn.Conv3d(16, 16, (5, 3, 3), stride=(2, 1, 1), padding=(2, 1, 1)), 4),
    (lambda: nn.ConvTranspose3d(16, 16, 3, padding=1), 2),
    (lambda: nn.ConvTranspose3d(16, 16, (5, 3, 3), padding=(2, 1, 1)), 3),
    (lambda: nn.ConvTranspose3d(16, 16, 3, padding=(2, 1, 1)), 4),  # deep enough, its output (2) is not
]


@pytest.mark.parametrize("make, depth", WRONG_CASES, ids=range(len(WRONG_CASES)))
def test_the_cases_onednn_gets_wrong_match_float64_under_bf16_autocast(make, depth):
    torch.manual_seed(depth)
    conv = make()
    with torch.no_grad():
        for p in conv.parameters():
            p.normal_(0, 0.1)
    guard_conv3d(conv)
    x = torch.randn(2, conv.in_channels, depth, 4, 5, requires_grad=True)
    assert wrong_bf16_weight_gradient(conv, x, conv.weight) is False  # (float32, no autocast: torch's own call)
    with torch.autocast(**BF16):
        assert wrong_bf16_weight_gradient(conv, x, conv.weight)
        y = conv(x)
    assert y.dtype == torch.bfloat16  # the dtype a bf16 convolution returns
    g = torch.randn(y.shape).to(torch.bfloat16)
    y.backward(g)
    y64, gx64, gw64 = _float64_grads(conv, x.detach(), g)
    assert _rel(y.detach(), y64) < 0.01  # (rounded to bf16)
    assert torch.isfinite(conv.weight.grad).all() and _rel(conv.weight.grad, gw64) < 1e-4  # (float32 products)
    assert _rel(x.grad, gx64) < 1e-4


@pytest.mark.parametrize("make, depth, context", [
    (lambda: nn.Conv3d(16, 16, 3, padding=1), 4, "bf16"),  # deep enough: oneDNN's bf16 call is right
    (lambda: nn.Conv3d(16, 16, 3, padding=1), 2, "float32"),  # no bf16: right
    (lambda: nn.Conv3d(16, 16, 3, padding=1), 2, "no_grad"),  # no weight gradient: the forward is right
    (lambda: nn.Conv3d(8, 16, (2, 3, 3), stride=(2, 1, 1), padding=(0, 1, 1)), 4, "bf16"),
    (lambda: nn.ConvTranspose3d(16, 8, 2, stride=2), 2, "bf16"),  # SwinUNETR's upsampling
    (lambda: nn.Conv3d(16, 16, 3, padding=1, padding_mode="reflect"), 2, "bf16"),  # padded first: depth 4 to 2
    (lambda: nn.Conv3d(3, 16, (8, 4, 4), stride=(8, 4, 4)), 16, "bf16"),  # a 3-D patch embedding: out depth 2
], ids=["deep", "float32", "no_grad", "strided", "transposed", "reflect", "patches"])
def test_every_other_call_is_torchs_own_bit_for_bit(make, depth, context):
    torch.manual_seed(0)
    plain = make()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.1)
    guarded = copy.deepcopy(plain)
    assert guard_conv3d(guarded) == 1 and type(guarded) in (DepthSafeConv3d, DepthSafeConvTranspose3d)
    x = torch.randn(2, plain.in_channels, depth, 4, 4)
    outputs = []
    for conv in (plain, guarded):
        xi = x.clone().requires_grad_(context != "no_grad")
        with torch.autocast(**BF16, enabled=context != "float32"), torch.set_grad_enabled(context != "no_grad"):
            assert not wrong_bf16_weight_gradient(conv, xi, conv.weight)
            y = conv(xi)
        if context != "no_grad":
            y.float().square().sum().backward()
        outputs.append((y, xi.grad, conv.weight.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = outputs
    assert torch.equal(y0, y1) and y0.dtype == y1.dtype
    if context != "no_grad":
        assert torch.equal(gx0, gx1) and torch.equal(gw0, gw1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv3d(1, 16, 3, padding=1)
        self.up = nn.Sequential(nn.ConvTranspose3d(16, 8, 2, stride=2), nn.Conv3d(8, 4, 1))
        self.flat = nn.Conv2d(16, 4, 3)  # (2-D: left as it is)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(self.down(x))
        return self.flat(y.flatten(1, 2))


def test_a_guarded_model_keeps_its_parameters_keys_copies_and_pickles():
    torch.manual_seed(0)
    model = _Net()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    assert guard_conv3d(model) == 3 and guard_conv3d(model) == 0  # (once: already guarded)
    assert type(model.down) is DepthSafeConv3d and type(model.up[0]) is DepthSafeConvTranspose3d
    assert type(model.flat) is nn.Conv2d and isinstance(model.down, nn.Conv3d) and isinstance(model.up[0], nn.ConvTranspose3d)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    x = torch.randn(1, 1, 2, 4, 4)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(other.down) is DepthSafeConv3d and torch.equal(other(x), model(x))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = _Net()
    fresh.load_state_dict(torch.load(buffer))
    assert torch.equal(fresh(x), model(x))


@pytest.mark.slow  # (a SwinUNETR step in float64 and under bf16)
def test_a_swinunetr_built_by_vitlab_gets_its_weight_gradients_right_under_bf16_on_the_cpu():
    """MONAI's SwinUNETR on a 32^3 patch as the 3-D quickstart trains it (its bottleneck block at 1^3 voxels, its
    fifth decoder block at 2^3 with a 3^3 kernel: a depth oneDNN's bf16 kernel gets wrong), one backward under bf16
    autocast: every weight gradient finite, and those blocks' against the same network's float64 backward."""
    from vitlab.models import build_model

    torch.manual_seed(0)
    kwargs = {"img_size": 32, "feature_size": 12, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 4],
              "window_size": 4, "norm_name": ("group", {"num_groups": 4})}
    model = build_model("monai:swin_unetr", 2, 1, **kwargs)
    guarded = [m for m in model.modules() if type(m) in (DepthSafeConv3d, DepthSafeConvTranspose3d)]
    assert guarded and not any(type(m) in (nn.Conv3d, nn.ConvTranspose3d) for m in model.modules())
    x = torch.randn(2, 1, 32, 32, 32)
    reference = copy.deepcopy(model).double()
    reference(x.double()).square().mean().backward()
    with torch.autocast(**BF16):
        loss = model(x).float().square().mean()
    loss.backward()
    named = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    compared = 0
    for name, p in model.named_parameters():
        if name.startswith(("encoder10.", "decoder5.")) and name.endswith("conv.weight"):
            reference_grad = named[name].grad
            # bf16 elsewhere, and group norms over a voxel or eight, leave these 14-21 % off (oneDNN's call: 110 % or
            # 1e31 off in decoder5's second convolution); the blocks beside the input 1 %
            assert float((p.grad.double() - reference_grad).norm() / reference_grad.norm()) < 0.5, name
            compared += 1
    assert compared >= 6
