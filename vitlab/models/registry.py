"""The model families vitlab supports, in matching order, and the lookup of a model's adapter.

:func:`get_adapter` returns an instance of the first adapter class in :func:`families` whose
:meth:`~vitlab.models.adapter.FamilyAdapter.matches` accepts the model, so the order is part of the
contract: a narrower adapter comes before a broader one of the same library class, and the Hugging Face
families come last. The list is written out here once, in :func:`_builtin_families` and
:func:`_hugging_face_families`; adapters do not register themselves, so imports flow one way:
:mod:`vitlab.models.adapter` <- family modules <- this module <- the rest of :mod:`vitlab.models`.

The family modules are imported on first use, not when vitlab is imported: timm and torchvision are slow
to import and many entry points (``probe.py --help``) need neither. The Hugging Face families are optional
(the ``hf`` extra): they join the list once ``transformers`` is in use (a model built with ``hf:`` or made
with ``transformers`` directly), and :func:`families_table` lists them whenever ``transformers`` is
installed; importing vitlab never imports ``transformers``.

Adding a family:

1. write one :class:`~vitlab.models.adapter.FamilyAdapter` subclass in its own module of
   :mod:`vitlab.models`, importing only :mod:`vitlab.models.adapter` (and, for timm families,
   :mod:`vitlab.models.timm_common`) besides its library. Fill the class attributes that describe it for
   users: ``family`` (id), ``description`` (one line for error messages), ``library`` (``timm`` /
   ``torchvision`` / ``transformers`` / ``monai``), ``classes`` (the library class names), ``examples`` (model names
   that build it), ``supports`` (what works; the default lists every feature) and ``notes`` (position
   terms, norm placement, what is not supported);
2. import it in :func:`_builtin_families` (or :func:`_hugging_face_families` for a ``transformers`` model)
   and add it to the returned list, before any broader adapter of the same library class;
3. add a tiny configuration to :data:`vitlab.models.testing.TINY_MODELS` and its oracles to the tests, and
   paste the new :func:`families_table` into the README: ``tests/models/test_families.py`` fails when the
   README copy differs (print it with ``python -c "from vitlab.models import families_table;
   print(families_table())"`` and paste it between the ``<!-- families-table:start -->`` / ``end``
   markers).

There is no registration hook for adapters defined outside vitlab: a family is added here, with its
tests.
"""

from __future__ import annotations

import sys

from torch import nn

from vitlab.models.adapter import FamilyAdapter, unwrap_model
from vitlab.models.errors import UnsupportedModelError

__all__ = ["families", "families_table", "get_adapter", "supported_families"]

_FAMILIES: list[type[FamilyAdapter]] = []  # filled on first use: the built-ins, then Hugging Face
_optional_tried = False  # whether the Hugging Face families were imported (or found not installed)


def _builtin_families() -> list[type[FamilyAdapter]]:
    """The timm, torchvision and MONAI adapter classes, in matching order (the MONAI module imports no MONAI:
    its adapters match only models of an imported MONAI)."""
    from vitlab.models.monai_families import MonaiSwinUNETRAdapter, MonaiViTAdapter
    from vitlab.models.timm_families import Timm3DViTAdapter, TimmMixerAdapter, TimmSwinAdapter, TimmViTAdapter
    from vitlab.models.timm_relpos_families import TimmBeitAdapter, TimmEvaAdapter, TimmViTRelPosAdapter
    from vitlab.models.timm_swin_v2 import TimmSwinV2Adapter, TimmSwinV2CrAdapter
    from vitlab.models.torchvision_families import (
        TorchvisionSwinAdapter,
        TorchvisionSwinV2Adapter,
        TorchvisionViTAdapter,
    )

    return [
        Timm3DViTAdapter,  # a VisionTransformer whose patch embedding is vit3d's PatchEmbed3d
        TimmViTAdapter,
        TimmMixerAdapter,
        TimmSwinAdapter,
        TimmSwinV2Adapter,
        TimmSwinV2CrAdapter,
        TimmEvaAdapter,
        TimmBeitAdapter,
        TimmViTRelPosAdapter,
        TorchvisionViTAdapter,
        TorchvisionSwinAdapter,  # its matches() refuses V2 blocks; V2 subclasses it
        TorchvisionSwinV2Adapter,
        MonaiSwinUNETRAdapter,  # SwinUNETR or its bare SwinTransformer
        MonaiViTAdapter,  # UNETR or its bare ViT
    ]


def _hugging_face_families() -> list[type[FamilyAdapter]]:
    """The ``transformers`` adapter classes, in matching order (imports ``transformers``)."""
    from vitlab.models.hf_families import HFDinov2Adapter, HFSwinAdapter, HFViTAdapter

    return [HFViTAdapter, HFDinov2Adapter, HFSwinAdapter]


def families(include_optional: bool = False) -> list[type[FamilyAdapter]]:
    """The adapter classes in matching order.

    Args:
        include_optional: Also try the Hugging Face families when ``transformers`` is not imported yet
            (they are skipped when it is not installed). Without it they are listed once ``transformers``
            is in use.

    Returns:
        The registry's own list (do not modify it).
    """
    global _optional_tried
    if not _FAMILIES:
        _FAMILIES.extend(_builtin_families())
    if not _optional_tried and (include_optional or sys.modules.get("transformers") is not None):
        try:
            _FAMILIES.extend(_hugging_face_families())
        except ModuleNotFoundError as error:  # the optional extra is not installed
            if error.name != "transformers":
                raise
        _optional_tried = True
    return _FAMILIES


def supported_families() -> list[str]:
    """Descriptions of all supported families (for error messages)."""
    return [adapter.description for adapter in families()]


def families_table() -> str:
    """The registry as a Markdown table (library, class, example names, what is supported), one row per
    adapter in matching order: the README's "Supported model families" section (the Hugging Face rows
    when the ``hf`` extra is installed)."""
    lines = ["| library | class | example names | family id | supported |", "| --- | --- | --- | --- | --- |"]
    for adapter in families(include_optional=True):
        supported = adapter.supports + (f"; {adapter.notes}" if adapter.notes else "")
        cells = [adapter.library, adapter.classes, adapter.examples, f"`{adapter.family}`", supported]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def get_adapter(model: nn.Module) -> FamilyAdapter:
    """Returns the adapter for ``model`` (cached on the model).

    Raises:
        UnsupportedModelError: if no adapter matches; the message lists the supported families.
    """
    model = unwrap_model(model)
    cached = model.__dict__.get("_vitlab_adapter")
    if cached is not None:
        return cached
    for adapter_cls in families():
        if adapter_cls.matches(model):
            adapter = adapter_cls()
            model.__dict__["_vitlab_adapter"] = adapter
            return adapter
    raise UnsupportedModelError(
        f"unsupported model {type(model).__module__}.{type(model).__name__}: vitlab supports "
        + "; ".join(supported_families())
    )
