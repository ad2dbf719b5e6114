"""Lightning callbacks that look inside the model while it trains (declare them under trainer.callbacks).

The classes are imported on first use, so the probes can use the callbacks' Lightning-free helpers
(``vitlab.callbacks._state``, ``vitlab.callbacks.spectra``) without importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_CLASSES = {"QKVDrift": "vitlab.callbacks.drift", "QKVSnapshot": "vitlab.callbacks.snapshot", "QKSpectra": "vitlab.callbacks.spectra_callback",
            "RuntimeCallback": "vitlab.callbacks.runtime"}

__all__ = ["QKVDrift", "QKVSnapshot", "QKSpectra", "RuntimeCallback"]


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
