"""Cache folder and the decoded-array cache.

Decoding and windowing a DICOM costs about a millisecond; loading the resulting float32 array
from a ``.npy`` file is several times cheaper. Each array is keyed by a hash of the file's
absolute path, modification time, size and the read options, so editing a file or changing the
window invalidates its entry. Entries are written atomically (temp file + ``os.replace``), so
concurrent workers and processes never see partial files. Nothing is ever written next to the data.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

CACHE_FORMAT = 1  # bump when the meaning of cached arrays changes


def cache_root() -> Path:
    """``$VITLAB_CACHE`` or ``~/.cache/vitlab``."""
    return Path(os.environ.get("VITLAB_CACHE") or Path.home() / ".cache" / "vitlab").expanduser()


class ArrayCache:
    """Decoded arrays on disk, one ``.npy`` per (file, read options).

    Args:
        folder: Where the entries go (created on first write).
        options_key: A string describing the read options (part of every key).
    """

    def __init__(self, folder: str | os.PathLike, options_key: str) -> None:
        self.folder = Path(folder).expanduser()
        self.options_key = options_key

    def entry(self, path: str | os.PathLike) -> Path:
        """Cache file for ``path`` with the current options and the file's current mtime/size."""
        stat = os.stat(path)
        text = f"{CACHE_FORMAT}|{os.path.abspath(path)}|{stat.st_mtime_ns}|{stat.st_size}|{self.options_key}"
        key = hashlib.sha256(text.encode()).hexdigest()[:32]
        return self.folder / key[:2] / f"{key}.npy"

    def load(self, path: str | os.PathLike, decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The cached array for ``path``, or ``decode()`` stored for next time."""
        entry = self.entry(path)
        try:
            return np.load(entry, allow_pickle=False)
        except (OSError, ValueError, EOFError):  # missing (or unreadable: rewrite it)
            pass
        array = decode()
        self._write(entry, array)
        return array

    def _write(self, entry: Path, array: np.ndarray) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(array), allow_pickle=False)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class MemoryCache:
    """Items kept in this process's memory up to a byte budget (then nothing more is added; no eviction).

    Loaders draw indices in a new random order every epoch, so an evicting cache (LRU) would hit no more
    often than one that keeps the first items it saw; this one costs nothing once full. Each loader worker
    process holds its own cache (at most ``budget_bytes`` each).

    Args:
        budget_bytes: Most bytes of arrays / tensors kept (0 keeps nothing).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"memory cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._items: dict = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key):
        """The item stored under ``key``, or None."""
        return self._items.get(key)

    def put(self, key, item, nbytes: int) -> None:
        """Keep ``item`` (``nbytes`` large) when it fits in what is left of the budget."""
        if key not in self._items and self.used_bytes + nbytes <= self.budget_bytes:
            self._items[key] = item
            self.used_bytes += nbytes

    def __getstate__(self) -> dict:
        """A copy sent to a spawned worker starts empty (its items would be pickled through a pipe)."""
        return {"budget_bytes": self.budget_bytes, "used_bytes": 0, "_items": {}}
