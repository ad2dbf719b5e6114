"""Synthetic CT data, generated deterministically from a seed: no download, no patient data.

- :mod:`~vitlab.data.synthetic.slices`: :func:`generate`, 2-D CT slices as DICOM files with lesion labels and masks
  (the quickstart's data);
- :mod:`~vitlab.data.synthetic.volumes`: :func:`generate_volumes`, 3-D CT patients as NIfTI volumes with label maps
  and the same patients as DICOM series and enhanced multi-frame files;
- :mod:`~vitlab.data.synthetic.phantom`: the anatomy both draw from;
- :mod:`~vitlab.data.synthetic.embedded`: :func:`embedded_dataset` / :func:`embedded_volumes`, each generated once
  per parameter set into the cache folder (``data.root: null``), and :class:`EmbeddedOptions`.

Command line (:func:`main`): ``python -m vitlab.data.synthetic --out DIR [--volumes] [--seed ...]``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__all__ = ["EmbeddedOptions", "embedded_dataset", "embedded_volumes", "generate", "generate_volumes", "main"]

_LAZY = {"generate": "slices", "generate_volumes": "volumes", "embedded_dataset": "embedded",
         "embedded_volumes": "embedded", "EmbeddedOptions": "embedded"}


def __getattr__(name: str):
    """The generators on first use (numpy, pydicom): the CLI's parser reads :class:`EmbeddedOptions` only."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> Path:
    """Command line: ``python -m vitlab.data.synthetic --out DIR [--seed ...]``; ``--volumes`` writes the
    synthetic volumes of :mod:`vitlab.data.synthetic.volumes` (NIfTI and DICOM series) instead of 2-D slices."""
    import argparse
    import inspect

    from vitlab.data.synthetic import slices
    from vitlab.data.synthetic.volumes import generate_volumes

    generate = slices.generate
    parser = argparse.ArgumentParser(prog="python -m vitlab.data.synthetic", description=slices.__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="destination folder (new or empty)")
    parser.add_argument("--volumes", action="store_true", help="write 3-D volumes (NIfTI + DICOM series) instead")
    slices_only, volumes_only = inspect.signature(generate).parameters, inspect.signature(generate_volumes).parameters
    for name in ("seed", "patients", "slices", "size", "difficulty"):
        slice_default, volume_default = slices_only[name].default, volumes_only[name].default
        parser.add_argument(f"--{name}", type=type(slice_default), default=None,
                            help=f"default {slice_default} ({volume_default} with --volumes)")  # fmt: skip
    spacing = volumes_only["spacing"].default
    parser.add_argument("--spacing", type=float, nargs=3, default=None, metavar=("COLUMNS", "ROWS", "SLICES"),
                        help=f"voxel size in mm, with --volumes (default {' '.join(map(str, spacing))})")  # fmt: skip
    args = vars(parser.parse_args(argv))
    out, volumes = args.pop("out"), args.pop("volumes")
    if args["spacing"] is not None and not volumes:
        parser.error("--spacing applies to --volumes only")
    given = {name: value for name, value in args.items() if value is not None}
    manifest = generate_volumes(out, **given) if volumes else generate(out, **given)
    print(manifest)
    return manifest
