"""The embedded synthetic datasets: generated once per parameter set into the cache folder, and their typed
options (``data.embedded_kwargs``).

The options are a dataclass, so LightningCLI converts command-line overrides to their types:
``--data.embedded_kwargs.patients 24`` and ``--data.embedded_kwargs '{patients: 24}'`` both reach
:func:`vitlab.data.synthetic.generate` as the int 24. Kept free of heavy imports (no numpy / pydicom):
the CLI reads it to build its parser.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
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


def embedded_dataset(**kwargs) -> Path:
    """Manifest of the synthetic dataset for these :func:`~vitlab.data.synthetic.slices.generate` arguments,
    generated once.

    Lives in ``$VITLAB_CACHE`` (or ``~/.cache/vitlab``) as ``embedded-<hash of the arguments>/``;
    written into a temporary folder beside it and renamed into place, so concurrent processes
    never see a half-written dataset (the loser of a race discards its copy).

    Raises:
        ValueError: An argument ``generate`` does not take.
    """
    from vitlab.data.synthetic import slices

    return _generated_once(slices.generate, slices.GENERATOR_VERSION, "embedded", kwargs)


def embedded_volumes(**kwargs) -> Path:
    """Manifest (NIfTI volumes with label maps) of the synthetic volumes for these
    :func:`~vitlab.data.synthetic.volumes.generate_volumes` arguments, generated once as :func:`embedded_dataset`
    (``embedded-volumes-<hash>/``; its ``manifest_dicom.csv`` lists the same patients as DICOM series)."""
    from vitlab.data.synthetic import volumes

    return _generated_once(volumes.generate_volumes, volumes.VOLUME_GENERATOR_VERSION, "embedded-volumes", kwargs)


def _generated_once(generator, version: int, prefix: str, kwargs: dict) -> Path:
    from vitlab.data.cache import cache_root  # (numpy: not at import, see the module docstring)

    params = dict(inspect.signature(generator).parameters)
    params.pop("out")
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"unknown embedded dataset argument(s) {unknown}; valid: {', '.join(params)}")
    values = {name: kwargs.get(name, p.default) for name, p in params.items()}
    values = {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}
    key = json.dumps({"version": version, **values}, sort_keys=True)
    root = cache_root()
    final = root / f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (final / "manifest.csv").is_file():
        return final / "manifest.csv"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        generator(tmp, **values)
        os.rename(tmp, final)
    except OSError:
        if not (final / "manifest.csv").is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "manifest.csv"
