"""The exceptions :mod:`vitlab.models` raises to its callers.

They live apart from the code that raises them so that any module of the package (the builders, the
weight loader, the registry, the optional Hugging Face builder) can raise or catch them without importing
another; this module imports nothing of vitlab. All are re-exported by :mod:`vitlab.models`.
"""

from __future__ import annotations

__all__ = ["PretrainedWeightsUnavailable", "UnsupportedModelError", "WeightsMismatchError"]


class UnsupportedModelError(ValueError):
    """Raised for a model whose family vitlab has no adapter for."""


class PretrainedWeightsUnavailable(RuntimeError):
    """Pretrained weights cannot be obtained (no network and nothing cached).

    Attributes:
        reason: Set by the builders when known: why the download failed, without the advice on what to do
            instead (the probe CLI words its own advice).
    """


class WeightsMismatchError(ValueError):
    """A weights file does not fit the model's architecture."""
