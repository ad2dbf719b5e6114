"""Files a run or a probe writes: atomically (temp file + rename), so a kill never leaves a partial file under
its final name. Tables as CSV / JSON, tensors as safetensors."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path`` (atomic on POSIX).

    A crash or exception leaves no partial file under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the normal permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove the temp files :func:`atomic_path` left under ``directory`` (recursively) when a process was killed
    while writing (``qkv/.epoch_006.safetensors.k3j_x9a2.tmp``); returns them. Call it only where no other live
    process writes (a resumed run's own folder, before it writes)."""
    import re

    pattern = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")  # "." + final name + "." + mkstemp's 8 characters + ".tmp"
    removed = []
    for path in sorted(Path(directory).rglob(".*.tmp")):
        if path.is_file() and pattern.match(path.name):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write torch ``tensors`` to a safetensors file atomically; metadata values are stored as strings."""
    from safetensors.torch import save_file

    clean = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path) as tmp:
        save_file(clean, str(tmp), metadata=meta)
    return Path(path)


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]], fieldnames: Sequence[str] | None = None) -> Path:
    """Write dict rows to a CSV file atomically (columns from ``fieldnames`` or the first row)."""
    rows = list(rows)
    fieldnames = list(rows[0].keys() if rows else []) if fieldnames is None else list(fieldnames)
    known = set(fieldnames)
    for row in rows:
        if row.keys() - known:
            raise ValueError(f"{path}: row has columns {sorted(row.keys() - known)} not among {fieldnames}")
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(fieldnames)  # (csv.writer, not DictWriter: a table of every Q/K/V row each epoch)
            writer.writerows([_plain(row.get(k, "")) for k in fieldnames] for row in rows)
    return Path(path)


def write_csv_columns(path: str | os.PathLike, fieldnames: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    """Write rows already made of plain values (ints, strings, and floats through :func:`plain_floats`) to a CSV
    file atomically: the same file :func:`write_csv` writes for the same values, without a dict and a conversion per
    cell. For large tables written beside training (the Q/K/V drift's row of every weight row each epoch): this
    code holds the interpreter's lock, which a training thread on a GPU needs for every operation it launches."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(list(fieldnames))
            writer.writerows(rows)
    return Path(path)


def write_csv_arrays(path: str | os.PathLike, columns: Mapping[str, Any]) -> Path:
    """Write a table given as columns (name -> numpy array or list, all of one length) to a CSV file atomically:
    the file :func:`write_csv` writes for the same rows (floats at 8 significant digits; ints and strings as they
    are). Numpy arrays make a compact message for :class:`vitlab.table_worker.TableWorker`, which writes large
    tables in a child process."""
    values = []
    for name, column in columns.items():
        array = np.asarray(column)
        if array.ndim != 1:
            raise ValueError(f"table column {name!r} must be one-dimensional, got shape {array.shape}")
        values.append(plain_floats(array.tolist()) if array.dtype.kind == "f" else array.tolist())
    if len({len(v) for v in values}) > 1:
        raise ValueError(f"table columns differ in length: {dict(zip(columns, map(len, values)))}")
    return write_csv_columns(path, list(columns), zip(*values))


def plain_floats(values: Iterable[float]) -> list[float]:
    """Floats as :func:`write_csv` writes them (8 significant digits)."""
    return [float(f"{v:.8g}") for v in values]


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=_plain))
    return Path(path)


def _plain(value: Any) -> Any:
    """A JSON / CSV value: floats to 8 significant digits, tensors and numpy scalars to Python numbers / lists."""
    if isinstance(value, float):
        return float(f"{value:.8g}")
    if hasattr(value, "numel"):  # a torch tensor
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
