"""A pydicom decoder plugin for 12-bit JPEG Extended (1.2.840.10008.1.2.4.51) through imagecodecs.

pydicom's permissively licensed plugins cannot decode 12-bit JPEG Extended: Pillow and GDCM's
wheel stop at 8-bit samples, and the one that can (``pylibjpeg-libjpeg``) is GPL-3.0. imagecodecs
(BSD-3-Clause) bundles libjpeg-turbo 3, which decodes 12-bit lossy JPEG. The plugin is added to
pydicom's own ``JPEGExtended12BitDecoder`` after its built-in plugins, so pydicom's decoding
pipeline (frame splitting, dtype, modality LUT) stays pydicom's; only the codestream -> samples
step is libjpeg-turbo's. Monochrome only: a colour 12-bit stream is left to the other plugins.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from pydicom.uid import JPEGExtended12Bit

HAVE_IMAGECODECS = find_spec("imagecodecs") is not None  # imported on first use (~0.1 s)

LABEL = "vitlab-imagecodecs"
DECODER_DEPENDENCIES = {JPEGExtended12Bit: ("imagecodecs>=2024.1",)}


def is_available(uid: str) -> bool:
    """pydicom's plugin protocol: True when this plugin can decode ``uid``."""
    return HAVE_IMAGECODECS and uid == JPEGExtended12Bit


def decode_frame(src: bytes, runner: Any) -> bytes:
    """One JPEG Extended frame -> the stored values as native-endian bytes (pydicom's plugin protocol)."""
    if runner.samples_per_pixel != 1:
        raise NotImplementedError("vitlab's imagecodecs plugin decodes monochrome JPEG Extended only")
    import imagecodecs

    frame = imagecodecs.jpeg8_decode(src)  # (rows, columns) uint8 or uint16
    if frame.shape != (runner.rows, runner.columns):
        raise ValueError(f"JPEG frame is {frame.shape}, the header says ({runner.rows}, {runner.columns})")
    runner.set_option("bits_allocated", 8 * frame.dtype.itemsize)
    return frame.tobytes()


def register() -> None:
    """Add the plugin to pydicom's JPEG Extended decoder (once; a no-op without imagecodecs)."""
    from pydicom.pixels.decoders import JPEGExtended12BitDecoder

    if HAVE_IMAGECODECS and LABEL not in JPEGExtended12BitDecoder.available_plugins:
        JPEGExtended12BitDecoder.add_plugin(LABEL, (__name__, "decode_frame"))
