"""The errors every reader raises, and the net that turns a library's exception on a malformed file into one.

A problem with one *file* raises :class:`ImageReadError` (one line naming the file and the reason), which
``on_bad_file="skip"`` may skip; a wrong *option* (unknown preset, bad frame selector) raises a plain
``ValueError`` because it is not the file's fault and must never be skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

# What read_volume takes, said in the refusals of the volume readers (NIfTI, DICOM series, multi-frame DICOM).
VOLUME_SOURCES = "read_volume reads a .nii/.nii.gz file, a folder holding a DICOM series or an enhanced multi-frame DICOM file"


class ImageReadError(ValueError):
    """One image file cannot be read; the message names the file and the reason (one line)."""


class ImageNotFoundError(ImageReadError, FileNotFoundError):
    """The image file does not exist."""


class VolumeError(ImageReadError):
    """A volume (NIfTI file, DICOM series folder, multi-frame DICOM file) cannot be read as one; the message
    names the file or folder, what is wrong and what would be valid (one line)."""


def one_line(exc: BaseException) -> str:
    """An exception's message collapsed to one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def file_errors(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn any exception a malformed file provokes into an :class:`ImageReadError` naming the file.

    The readers raise :class:`ImageReadError` with a precise reason for every case known; this is
    the net under them, so that ``on_bad_file="skip"`` skips an unforeseen one too.
    """
    try:
        yield
    except ImageReadError:
        raise
    except Exception as exc:  # noqa: BLE001 - the file's fault, whatever the library raised
        raise ImageReadError(f"{path}: {what} ({type(exc).__name__}: {one_line(exc)})") from None
