"""Typed options of the embedded synthetic dataset (``data.embedded_kwargs``).

A dataclass, so LightningCLI converts command-line overrides to their types:
``--data.embedded_kwargs.patients 24`` and ``--data.embedded_kwargs '{patients: 24}'`` both reach
:func:`vitlab.data.synthetic.generate` as the int 24. Kept free of heavy imports (no numpy / pydicom):
the CLI reads it to build its parser.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class EmbeddedOptions:
    """Arguments of :func:`vitlab.data.synthetic.generate` (same names and defaults).

    Args:
        seed: Everything is a deterministic function of the options.
        patients: Number of synthetic patients (>= 2).
        slices: Slices per patient (>= 2); the lesion shows on half of them.
        size: Image side in pixels (>= 16).
        difficulty: 0 (obvious lesions) to 1 (barely above the noise).
    """

    seed: int = 0
    patients: int = 48
    slices: int = 6
    size: int = 128
    difficulty: float = 0.15


def embedded_options(value: EmbeddedOptions | dict[str, Any] | None) -> EmbeddedOptions:
    """``value`` as :class:`EmbeddedOptions`; a dict with an unknown key is a one-line error naming it."""
    if value is None:
        return EmbeddedOptions()
    if isinstance(value, EmbeddedOptions):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"data.embedded_kwargs must be a mapping of {_names()}, got {value!r}")
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(EmbeddedOptions)})
    if unknown:
        raise ValueError(f"unknown embedded dataset argument(s) {unknown}; valid: {_names()}")
    return EmbeddedOptions(**value)


def _names() -> str:
    return ", ".join(f.name for f in dataclasses.fields(EmbeddedOptions))
