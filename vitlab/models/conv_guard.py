"""3-D convolutions whose bf16 weight gradient the CPU's oneDNN kernel gets wrong, computed in float32 instead.

On the CPU, torch hands bf16 convolutions to oneDNN. When the kernel is deeper than a convolution's input (padding in
depth makes up the rest, as in a U-Net's decoder at a small patch's bottleneck), or than a transposed convolution's
input or output, oneDNN's backward-weights kernel can return a wrong weight gradient: off by more than its own size,
often 1e30 or non-finite. It can also write past its buffers (glibc aborted a process with "double free or
corruption") or never return. Measured with torch 2.14.1 on an AMD EPYC with ``avx512_bf16``, bf16 against a
float64 computation of the same convolution, 16 channels or more: wrong for most such cases (kernel depths 2 to 7,
strides 1 and 2); right in all 768 configurations where the kernel is no deeper than the input and the output
(kernels 1 to 7, strides 1 to 3, paddings 0 to 3, depths 1 to 10, direct and transposed) and in all 264 direct ones
deeper than their output only (strided or unpadded, as a patch embedding); the forward pass, the input's gradient,
2-D convolutions and torch's reference kernel (``torch.backends.mkldnn`` off) were always right. A MONAI SwinUNETR
on 32^3 patches has such layers (its bottleneck block at 1^3 voxels and its fifth decoder block at 2^3, kernel 3),
which made bf16 training on the CPU turn its weights non-finite after a step or two.

:func:`guard_conv3d` turns every ``nn.Conv3d`` and ``nn.ConvTranspose3d`` of a model into a
:class:`DepthSafeConv3d` / :class:`DepthSafeConvTranspose3d`: the same module (its parameters, state dict keys,
``isinstance`` checks and arguments), which computes exactly those cases (CPU, a gradient for the weight, bf16 by
autocast or by dtype, the kernel deeper than a convolution's input or a transposed convolution's input or output)
in float32 and returns them in bf16, the dtype the bf16 call returns. Everything else, GPUs included, runs torch's
own call. Such a layer is a few slices deep, so float32 costs little there.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["DepthSafeConv3d", "DepthSafeConvTranspose3d", "guard_conv3d", "wrong_bf16_weight_gradient"]


def _depths(conv: nn.Module, depth: int) -> tuple[int, int]:
    """The input's and the output's depth as the convolution's kernel sees them."""
    span = conv.dilation[0] * (conv.kernel_size[0] - 1) + 1
    if isinstance(conv, nn.ConvTranspose3d):
        return depth, (depth - 1) * conv.stride[0] - 2 * conv.padding[0] + span + conv.output_padding[0]
    if conv.padding == "same":
        return depth, depth
    pad = 0 if conv.padding == "valid" else conv.padding[0]
    if conv.padding_mode != "zeros":  # (padded before the call: the kernel sees the padded input)
        depth, pad = depth + 2 * pad, 0
    return depth, (depth + 2 * pad - span) // conv.stride[0] + 1


def wrong_bf16_weight_gradient(conv: nn.Module, x: Tensor, weight: Tensor) -> bool:
    """Whether ``conv`` on ``x`` is a case oneDNN's bf16 backward-weights kernel gets wrong on the CPU: a CPU tensor, a
    weight that takes a gradient, bf16 (the input's or the weight's dtype, or CPU autocast's), and the kernel's depth
    span larger than the input's depth as the kernel sees it, or for a transposed convolution than its input's or
    its output's (module docstring)."""
    if x.device.type != "cpu" or not (weight.requires_grad and torch.is_grad_enabled()) or x.dim() != 5:
        return False
    bf16 = x.dtype == torch.bfloat16 or weight.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    if not bf16:
        return False
    depth, out = _depths(conv, int(x.shape[-3]))
    if isinstance(conv, nn.ConvTranspose3d):
        depth = min(depth, out)
    return depth < conv.dilation[0] * (conv.kernel_size[0] - 1) + 1


def _float(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.float()


class DepthSafeConv3d(nn.Conv3d):
    """``nn.Conv3d`` that computes the case :func:`wrong_bf16_weight_gradient` names in float32 (module docstring)."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        if not wrong_bf16_weight_gradient(self, input, weight):
            return super()._conv_forward(input, weight, bias)
        with torch.autocast("cpu", enabled=False):
            out = super()._conv_forward(input.float(), weight.float(), _float(bias))
        return out.to(torch.bfloat16)


class DepthSafeConvTranspose3d(nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` that computes the case :func:`wrong_bf16_weight_gradient` names in float32."""

    def forward(self, input: Tensor, output_size: Optional[list[int]] = None) -> Tensor:
        if not wrong_bf16_weight_gradient(self, input, self.weight):
            return super().forward(input, output_size)
        output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size, 3,
                                              self.dilation)
        with torch.autocast("cpu", enabled=False):
            out = nn.functional.conv_transpose3d(input.float(), self.weight.float(), _float(self.bias), self.stride,
                                                 self.padding, output_padding, self.groups, self.dilation)
        return out.to(torch.bfloat16)


_SAFE = {nn.Conv3d: DepthSafeConv3d, nn.ConvTranspose3d: DepthSafeConvTranspose3d}


def guard_conv3d(model: nn.Module) -> int:
    """Every plain ``nn.Conv3d`` / ``nn.ConvTranspose3d`` of ``model`` becomes a :class:`DepthSafeConv3d` /
    :class:`DepthSafeConvTranspose3d` (in place: the same objects, their class changed). Returns how many."""
    changed = 0
    for module in model.modules():
        safe = _SAFE.get(type(module))
        if safe is not None:
            module.__class__ = safe
            changed += 1
    return changed
