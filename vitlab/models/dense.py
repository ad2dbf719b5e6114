"""Task models around a timm ViT / Swin backbone: torchvision Mask R-CNN and a semantic segmenter.

Both keep the timm model itself at ``backbone.body`` (its state-dict keys are the classifier's, minus
the head) and expose it through ``vitlab_backbone()``, which :func:`vitlab.models.adapter.unwrap_model`
follows: every anatomy / attention / capture / ablation function and the Q/K/V callbacks see the same
blocks in a detector, a segmenter and a classifier with the same backbone.

Multi-scale features: a Swin gives one map per stage (``forward_intermediates``, NCHW; timm permutes
Swin's NHWC stages itself) fed to torchvision's ``FeaturePyramidNetwork``; a plain ViT gives one
stride-P map from its last block, turned into four scales by ViTDet's simple feature pyramid
(strided deconvolutions up, max-pooling down; Li et al. 2022).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from vitlab.models.build import build_model
from vitlab.models.errors import UnsupportedModelError
from vitlab.models.networks import backbone_call
from vitlab.models.weights import load_weights

__all__ = ["BACKBONE_PREFIX", "DETECTION_HEADS", "FeatureBackbone", "build_detector", "build_segmenter"]

BACKBONE_PREFIX = "backbone.body."  # where the timm model's state dict sits inside a detector / segmenter

# Head sizes: "light" fits 2 CPU cores (0.36 s vs 2.9 s per step at 128 px, batch 8: docs/dense.md);
# "full" is torchvision's Mask R-CNN defaults (the Drotos poster's MMDetection recipe).
DETECTION_HEADS: dict[str, dict[str, Any]] = {
    "light": dict(fpn_channels=64, box_head_dim=128, mask_channels=[64, 64], anchor_base=8,
                  rpn_post_nms_top_n_train=100, rpn_post_nms_top_n_test=100, box_batch_size_per_image=32,
                  rpn_pre_nms_top_n_train=500, rpn_pre_nms_top_n_test=300, roi_sampling_ratio=2),
    "full": dict(fpn_channels=256, box_head_dim=1024, mask_channels=[256, 256, 256, 256], anchor_base=32,
                 rpn_post_nms_top_n_train=2000, rpn_post_nms_top_n_test=1000, box_batch_size_per_image=512,
                 rpn_pre_nms_top_n_train=2000, rpn_pre_nms_top_n_test=1000, roi_sampling_ratio=2),
}


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's pyramid from one stride-P map: scales 4, 2, 1, 1/2 of it, each to ``out_channels``."""

    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__()
        half, quarter = max(dim // 2, 1), max(dim // 4, 1)
        self.scales = nn.ModuleList([
            nn.Sequential(nn.ConvTranspose2d(dim, half, 2, 2), nn.GroupNorm(1, half), nn.GELU(),
                          nn.ConvTranspose2d(half, quarter, 2, 2)),
            nn.ConvTranspose2d(dim, half, 2, 2),
            nn.Identity(),
            nn.MaxPool2d(2, 2),
        ])
        in_dims = [quarter, half, dim, dim]
        self.outputs = nn.ModuleList([
            nn.Sequential(nn.Conv2d(c, out_channels, 1, bias=False), nn.GroupNorm(1, out_channels),
                          nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
                          nn.GroupNorm(1, out_channels))
            for c in in_dims
        ])

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":  # (B, D, h, w) -> 4 maps (B, out, ...)
        maps = OrderedDict((str(i), out(scale(x))) for i, (scale, out) in enumerate(zip(self.scales, self.outputs)))
        maps["pool"] = F.max_pool2d(maps["3"], 1, 2, 0)
        return maps


class FeatureBackbone(nn.Module):
    """timm ViT / Swin (``body``) + a feature pyramid (``fpn``): image -> OrderedDict of NCHW maps.

    ``out_channels`` is what torchvision's detection heads read. Swin: one FPN level per stage (strides
    4, 8, ...) plus a max-pooled level; ViT: the simple feature pyramid (strides P/4 ... 2P).
    """

    def __init__(self, body: nn.Module, out_channels: int) -> None:
        super().__init__()
        self.body = body
        self.out_channels = out_channels
        self.is_plain = not hasattr(body, "layers")  # timm Swin has stages in .layers; ViT has .blocks only
        if self.is_plain:
            self.fpn = SimpleFeaturePyramid(body.embed_dim, out_channels)
            self.strides = [body.patch_embed.patch_size[0] * s for s in (0.25, 0.5, 1, 2)]
        else:
            channels = [info["num_chs"] for info in body.feature_info]
            self.fpn = FeaturePyramidNetwork(channels, out_channels, extra_blocks=LastLevelMaxPool())
            self.strides = [info["reduction"] for info in body.feature_info]

    @property
    def num_levels(self) -> int:
        """Feature maps given to the RPN (the pyramid levels plus the pooled one)."""
        return len(self.strides) + 1

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        if self.is_plain:
            (last,) = self.body.forward_intermediates(x, indices=1, intermediates_only=True)  # (B, D, h, w)
            return self.fpn(last)
        stages = self.body.forward_intermediates(x, intermediates_only=True)  # [(B, C_s, H_s, W_s)]
        return self.fpn(OrderedDict((str(i), s) for i, s in enumerate(stages)))


def _backbone(name: str, in_chans: int, pretrained: bool, weights: Optional[str], model_kwargs: dict,
              out_channels: int) -> FeatureBackbone:
    """The timm model without its head (weights: a classifier / detector checkpoint or timm weights)."""
    body = build_model(name, num_classes=1, in_chans=in_chans, pretrained=pretrained and weights is None,
                       **model_kwargs)
    report = load_weights(body, weights) if weights is not None else None
    if not hasattr(body, "forward_intermediates") or not hasattr(body, "reset_classifier"):
        raise UnsupportedModelError(f"model {name!r}: detection / segmentation need a timm ViT or Swin "
                                    "backbone (forward_intermediates)")
    if not hasattr(body, "layers") and not hasattr(body, "embed_dim"):
        raise UnsupportedModelError(f"model {name!r} is neither a timm ViT nor a timm Swin")
    body.reset_classifier(0)
    backbone = FeatureBackbone(body, out_channels)
    backbone.weights_report = report  # which keys moved (None without ``weights``)
    return backbone


class MaskRCNNDetector(MaskRCNN):
    """torchvision Mask R-CNN whose backbone is a :class:`FeatureBackbone` (``vitlab_backbone()`` is the timm model)."""

    def vitlab_backbone(self) -> nn.Module:
        return self.backbone.body


def build_detector(name: str, num_classes: int, in_chans: int = 1, image_size: int = 224, pretrained: bool = False,
                   weights: Optional[str] = None, heads: str = "light", model_kwargs: Optional[dict] = None,
                   **overrides: Any) -> MaskRCNNDetector:
    """Mask R-CNN over a timm Swin / ViT.

    Args:
        name: timm model name (``swin_*``, ``vit_*``).
        num_classes: Foreground classes (the background class is added).
        in_chans: Image channels.
        image_size: Input side; images arrive already normalised and resized, so torchvision's
            transform keeps them as they are (identity mean/std, min_size = max_size = image_size).
        pretrained: timm ImageNet weights for the backbone.
        weights: A classifier's (or detector's) checkpoint / state dict; its backbone is loaded.
        heads: ``"light"`` or ``"full"`` (see :data:`DETECTION_HEADS`); keys of it can be overridden.
        model_kwargs: Backbone constructor arguments (tiny test models, ``img_size``, ``drop_path_rate``).
        overrides: Keys of :data:`DETECTION_HEADS` entries.
    """
    if heads not in DETECTION_HEADS:
        raise ValueError(f"heads must be one of {list(DETECTION_HEADS)}, got {heads!r}")
    unknown = sorted(set(overrides) - set(DETECTION_HEADS[heads]))
    if unknown:
        raise ValueError(f"unknown detection head key(s) {unknown}; valid: {', '.join(DETECTION_HEADS[heads])}")
    cfg = {**DETECTION_HEADS[heads], **overrides}
    if not isinstance(cfg["roi_sampling_ratio"], int) or cfg["roi_sampling_ratio"] < 0:
        raise ValueError(f"roi_sampling_ratio must be an int >= 0 (samples per RoI bin side; 0: adaptive), "
                         f"got {cfg['roi_sampling_ratio']!r}")
    kwargs = {"img_size": image_size, **(model_kwargs or {})}
    backbone = _backbone(name, in_chans, pretrained, weights, kwargs, cfg["fpn_channels"])
    sizes = tuple((int(cfg["anchor_base"] * 2**i),) for i in range(backbone.num_levels))
    anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * backbone.num_levels)
    names = [str(i) for i in range(backbone.num_levels - 1)]
    c, dim = cfg["fpn_channels"], cfg["box_head_dim"]
    return MaskRCNNDetector(
        backbone, num_classes=None, min_size=image_size, max_size=image_size,
        image_mean=[0.0] * in_chans, image_std=[1.0] * in_chans,
        rpn_anchor_generator=anchors,
        rpn_pre_nms_top_n_train=cfg["rpn_pre_nms_top_n_train"], rpn_pre_nms_top_n_test=cfg["rpn_pre_nms_top_n_test"],
        rpn_post_nms_top_n_train=cfg["rpn_post_nms_top_n_train"],
        rpn_post_nms_top_n_test=cfg["rpn_post_nms_top_n_test"],
        box_roi_pool=MultiScaleRoIAlign(names, 7, cfg["roi_sampling_ratio"]), box_head=TwoMLPHead(c * 7 * 7, dim),
        box_predictor=FastRCNNPredictor(dim, num_classes + 1),
        box_batch_size_per_image=cfg["box_batch_size_per_image"],
        mask_roi_pool=MultiScaleRoIAlign(names, 14, cfg["roi_sampling_ratio"]), mask_head=MaskRCNNHeads(c, cfg["mask_channels"], 1),
        mask_predictor=MaskRCNNPredictor(cfg["mask_channels"][-1], cfg["mask_channels"][-1], num_classes + 1),
    )


class Segmenter(nn.Module):
    """Semantic segmentation: :class:`FeatureBackbone` + an FPN-style fusion head (sum of the upsampled
    pyramid levels, 3x3 conv, 1x1 classifier), logits at the input resolution.

    ``forward(images (B, C, H, W)) -> logits (B, num_classes + 1, H, W)`` (class 0 = background).
    """

    def __init__(self, backbone: FeatureBackbone, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        c = backbone.out_channels
        self.fuse = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.GroupNorm(1, c), nn.GELU())
        self.classifier = nn.Conv2d(c, num_classes + 1, 1)

    def vitlab_backbone(self) -> nn.Module:
        return self.backbone.body

    def forward(self, images: Tensor) -> Tensor:
        maps = [m for key, m in self.backbone(images).items() if key != "pool"]
        size = maps[0].shape[-2:]
        fused = sum(F.interpolate(m, size=size, mode="bilinear", align_corners=False) if m.shape[-2:] != size else m
                    for m in maps)
        logits = self.classifier(self.fuse(fused))  # (B, K+1, h, w)
        return F.interpolate(logits, size=images.shape[-2:], mode="bilinear", align_corners=False)


def build_segmenter(name: str, num_classes: int, in_chans: int = 1, image_size: int = 224, pretrained: bool = False,
                    weights: Optional[str] = None, decoder_channels: int = 64,
                    model_kwargs: Optional[dict] = None) -> Segmenter:
    """Segmenter over a timm Swin / ViT (arguments as :func:`build_detector`; ``decoder_channels`` = FPN width).
    A ``monai:`` name (``monai:swin_unetr``, ``monai:unetr``) is already a segmenter with its own decoder: it is
    built with ``num_classes + 1`` outputs and ``model_kwargs`` (``image_size`` and ``decoder_channels`` unused)."""
    call, whole = backbone_call("build_segmenter", dict(name=name, num_classes=num_classes, in_chans=in_chans, pretrained=pretrained,
                                                         weights=weights, model_kwargs=model_kwargs))
    if whole:
        return build_model(**call)
    kwargs = {"img_size": image_size, **(model_kwargs or {})}
    return Segmenter(_backbone(name, in_chans, pretrained, weights, kwargs, decoder_channels), num_classes)


def backbone_state(model: nn.Module) -> dict[str, Tensor]:
    """The timm backbone's state dict of a detector / segmenter (classifier key names)."""
    return {k[len(BACKBONE_PREFIX):]: v for k, v in model.state_dict().items() if k.startswith(BACKBONE_PREFIX)}
