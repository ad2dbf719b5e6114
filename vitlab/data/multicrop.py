"""DINO's multi-crop on a batch of tensors: 2 global + N local views, grayscale-appropriate intensity changes.

Runs on the batch where it lives (GPU included): every view is a random resized crop of each image, sampled
with ``torchvision.ops.roi_align`` (one batched call per view, area-averaging when a view shrinks its crop), a
random horizontal flip, a random contrast / brightness change and Gaussian noise on the normalised intensities,
and a Gaussian blur with a view-dependent probability (DINO: 1.0 for the first global view, 0.1 for the second,
0.5 for local views). No colour jitter or solarisation: CT / MR intensities are one channel with a physical meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torchvision.ops import roi_align
from torchvision.transforms.v2.functional import gaussian_blur


@dataclass
class MultiCrop:
    """Callable ``images (B, C, H, W) -> [global_0, global_1, local_0, ...]``, each (B, C, s, s).

    Args:
        global_size: Side of the global views (the backbone's input size).
        local_size: Side of the local views (the backbone must accept it: timm ``dynamic_img_size`` for ViT).
        local_crops: Number of local views N (0 allowed).
        global_scale: Range of the crop area as a fraction of the image, global views (DINO: 0.4-1.0).
        local_scale: Same for local views (DINO: 0.05-0.4).
        contrast: Contrast factor drawn from [1 - contrast, 1 + contrast]; brightness shift from [-contrast, contrast].
        noise: Standard deviation of additive Gaussian noise (normalised units), drawn per view from [0, noise].
        blur_sigma: Range of the Gaussian blur sigma in pixels of the view.
        flip: Random horizontal flips.
        ratio: Range of the crop aspect ratio (width / height), sampled log-uniformly.
    """

    global_size: int = 64
    local_size: int = 32
    local_crops: int = 4
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_scale: tuple[float, float] = (0.1, 0.4)
    contrast: float = 0.3
    noise: float = 0.05
    blur_sigma: tuple[float, float] = (0.1, 1.5)
    flip: bool = True
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        for name in ("global_scale", "local_scale", "blur_sigma", "ratio"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"MultiCrop.{name} must be (low, high) with 0 < low <= high, got {(lo, hi)}")
        if self.global_scale[1] > 1 or self.local_scale[1] > 1:
            raise ValueError("MultiCrop scales are fractions of the image area: at most 1")
        if self.global_size < 4 or self.local_size < 4 or self.local_crops < 0:
            raise ValueError(f"MultiCrop: sizes must be >= 4 and local_crops >= 0, got {self.global_size}, {self.local_size}, {self.local_crops}")

    @property
    def sizes(self) -> list[int]:
        return [self.global_size] * 2 + [self.local_size] * self.local_crops

    def boxes(self, batch: int, height: int, width: int, scale: tuple[float, float], generator=None, device=None) -> Tensor:
        """(B, 4) crop boxes x0, y0, x1, y1 in pixels: area fraction ~ U(scale), aspect ratio log-uniform in ``ratio``."""
        area = torch.empty(batch, device=device).uniform_(*scale, generator=generator) * height * width
        log_ratio = torch.empty(batch, device=device).uniform_(math.log(self.ratio[0]), math.log(self.ratio[1]), generator=generator)
        w = (area * log_ratio.exp()).sqrt().clamp(1.0, width)
        h = (area / log_ratio.exp()).sqrt().clamp(1.0, height)
        x0 = torch.rand(batch, device=device, generator=generator) * (width - w)
        y0 = torch.rand(batch, device=device, generator=generator) * (height - h)
        return torch.stack([x0, y0, x0 + w, y0 + h], dim=1)

    def view(self, images: Tensor, size: int, scale: tuple[float, float], blur_p: float, generator=None) -> Tensor:
        b, _, hgt, wdt = images.shape
        dev = images.device
        boxes = self.boxes(b, hgt, wdt, scale, generator, dev).to(images.dtype)
        rois = torch.cat([torch.arange(b, device=dev, dtype=images.dtype)[:, None], boxes], dim=1)  # (B, 5)
        out = roi_align(images, rois, output_size=(size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        # (sampling_ratio -1: torchvision's adaptive ceil(crop / view) samples per output pixel: an area average when
        # a view shrinks its crop, one bilinear sample when it enlarges it)
        # (per-sample choices by torch.where, not by indexing: no host synchronisation on an accelerator)
        if self.flip:
            flip = torch.rand(b, device=dev, generator=generator) < 0.5
            out = torch.where(flip[:, None, None, None], out.flip(-1), out)
        if blur_p > 0:
            lo, hi = self.blur_sigma
            sigma = lo + (hi - lo) * float(torch.rand(1, generator=generator))
            kernel = 2 * math.ceil(2 * sigma) + 1
            if kernel > 1:
                blurred = gaussian_blur(out, [kernel, kernel], [sigma, sigma])
                pick = torch.rand(b, device=dev, generator=generator) < blur_p
                out = torch.where(pick[:, None, None, None], blurred, out)
        c = self.contrast
        gain = 1 + (2 * torch.rand(b, 1, 1, 1, device=dev, generator=generator) - 1) * c
        shift = (2 * torch.rand(b, 1, 1, 1, device=dev, generator=generator) - 1) * c
        mean = out.mean(dim=(1, 2, 3), keepdim=True)
        out = out.sub_(mean).mul_(gain).add_(mean).add_(shift)  # (x - mean) * gain + mean + shift, in place on this view
        if self.noise > 0:
            std = torch.rand(b, 1, 1, 1, device=dev, generator=generator) * self.noise
            out.add_(torch.randn(out.shape, device=dev, generator=generator, dtype=out.dtype).mul_(std))
        return out

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> list[Tensor]:
        if images.ndim != 4:
            raise ValueError(f"MultiCrop expects (B, C, H, W) images, got shape {tuple(images.shape)}")
        views = [self.view(images, self.global_size, self.global_scale, p, generator) for p in (1.0, 0.1)]
        views += [self.view(images, self.local_size, self.local_scale, 0.5, generator) for _ in range(self.local_crops)]
        return views
