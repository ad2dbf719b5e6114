"""vitlab.models: the only package that knows how timm, torchvision, MONAI and Hugging Face lay out vision transformers.

Building and weights: :func:`build_model`, :func:`load_weights`, :func:`normalization`,
:func:`parameter_groups`, :func:`freeze`, :func:`compile_in_place`. Anatomy: :func:`blocks`, :func:`qkv`, :func:`embeddings`.
Interventions and recording: :func:`ablate`, :func:`transplant`, :func:`record_attention`,
:func:`capture`, :func:`forward_until`. Task models: :func:`build_detector` (Mask R-CNN) and
:func:`build_segmenter` around a timm ViT / Swin; every function above sees their backbone
(``vitlab_backbone()``). Errors: :class:`UnsupportedModelError`, :class:`PretrainedWeightsUnavailable`,
:class:`WeightsMismatchError` (all in :mod:`vitlab.models.errors`).

Supported families (:func:`families_table`): timm ViT/DeiT, Swin V1, Swin V2 / V2-Cr, Eva, Beit,
ViT-RelPos, MLP-Mixer, and the timm ViT over volumes (``vit3d:``, :mod:`vitlab.models.vit3d`, which also
inflates 2-D ViT weights); torchvision ViT, Swin V1 and V2; MONAI's 3-D SwinUNETR (its ``swinViT``) and
UNETR / ViT (``monai:swin_unetr``, ``monai:unetr``; token grids (D, H, W), :func:`check_volume_size`);
Hugging Face ViT, DINOv2, Swin with the ``hf`` extra. Imports flow one way: :mod:`~vitlab.models.adapter`
(the :class:`~vitlab.models.adapter.FamilyAdapter` base and the views it returns) <- one adapter per family
in ``timm_families`` / ``timm_swin_v2`` / ``timm_relpos_families`` / ``torchvision_families`` /
``monai_families`` / ``hf_families`` <- :mod:`~vitlab.models.registry` (the ordered list of families and
:func:`~vitlab.models.registry.get_adapter`) <- everything else here. Adding a family is one adapter class
in its own module plus its entry in that list (see :mod:`vitlab.models.registry`). Importing this package
imports neither timm, torchvision, MONAI nor ``transformers``: the registry imports the family modules on
first use, and the MONAI adapters import no MONAI (only ``monai:`` builds and MONAI models do).
"""

from vitlab.models.ablation import ablate, ablated, ablation_components, ablation_state, restore
from vitlab.models.adapter import BlockView, Embeddings
from vitlab.models.anatomy import (
    blocks,
    check_volume_size,
    embeddings,
    family_name,
    input_size,
    num_blocks,
    out_proj,
    part_prefixes,
    qkv,
    select_blocks,
)
from vitlab.models.attention import AttentionRecord, dense_window_attention, record_attention
from vitlab.models.build import build_model, normalization
from vitlab.models.capture import CAPTURE_SITES, Capture, capture, forward_until
from vitlab.models.compiled import compile_in_place, compile_notice, is_compiled
from vitlab.models.dino import drop_classifier, feature_dim, pooled_features
from vitlab.models.errors import PretrainedWeightsUnavailable, UnsupportedModelError, WeightsMismatchError
from vitlab.models.optim import freeze, layer_ids, parameter_groups
from vitlab.models.registry import families_table, supported_families
from vitlab.models.sharding import is_sharded, shard, unsharded, whole_blocks
from vitlab.models.transplant import TransplantReport, transplant, transplant_parts
from vitlab.models.weights import LoadReport, load_weights, read_state_dict

__all__ = [
    "AttentionRecord",
    "drop_classifier",
    "feature_dim",
    "pooled_features",
    "BlockView",
    "CAPTURE_SITES",
    "DETECTION_HEADS",
    "Capture",
    "Embeddings",
    "LoadReport",
    "PretrainedWeightsUnavailable",
    "TransplantReport",
    "UnsupportedModelError",
    "WeightsMismatchError",
    "ablate",
    "ablated",
    "ablation_components",
    "ablation_state",
    "backbone_state",
    "blocks",
    "build_detector",
    "build_model",
    "build_segmenter",
    "capture",
    "check_volume_size",
    "compile_in_place",
    "compile_notice",
    "dense_window_attention",
    "embeddings",
    "families_table",
    "family_name",
    "forward_until",
    "freeze",
    "input_size",
    "is_compiled",
    "is_sharded",
    "layer_ids",
    "load_weights",
    "normalization",
    "num_blocks",
    "out_proj",
    "parameter_groups",
    "part_prefixes",
    "qkv",
    "read_state_dict",
    "record_attention",
    "restore",
    "select_blocks",
    "shard",
    "supported_families",
    "transplant",
    "transplant_parts",
    "unsharded",
    "whole_blocks",
]


_DENSE = ("DETECTION_HEADS", "backbone_state", "build_detector", "build_segmenter")


def __getattr__(name: str):
    if name in _DENSE:  # imported on first use: torchvision's detection models are slow to import (probe start-up)
        from vitlab.models import dense

        return getattr(dense, name)
    raise AttributeError(f"module 'vitlab.models' has no attribute {name!r}")
