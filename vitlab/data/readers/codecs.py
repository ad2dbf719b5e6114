"""A pydicom decoder plugin for JPEG Extended (12-bit) and JPEG Lossless through imagecodecs.

pydicom's permissively licensed plugins do not cover these two: Pillow stops at 8-bit lossy JPEG,
the plugin that decodes both (``pylibjpeg-libjpeg``) is GPL-3.0, and GDCM's wheel aborts the whole
interpreter (an uncaught C++ exception) on some malformed JPEG streams, which would end a training
run instead of skipping one file. imagecodecs (BSD-3-Clause) bundles libjpeg-turbo 3, which
decodes 12-bit lossy and 2-16 bit lossless JPEG and reports a bad stream as a Python exception.

The plugin joins pydicom's own ``JPEGExtended12BitDecoder``, ``JPEGLosslessDecoder`` and
``JPEGLosslessSV1Decoder``, so pydicom's decoding pipeline (frames, dtype, sign, colour) stays
pydicom's; only the codestream -> samples step is libjpeg-turbo's.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from pydicom.uid import JPEGExtended12Bit, JPEGLossless, JPEGLosslessSV1

HAVE_IMAGECODECS = find_spec("imagecodecs") is not None  # imported on first use (~0.1 s)
LABEL = "vitlab-imagecodecs"
SYNTAXES = (JPEGExtended12Bit, JPEGLossless, JPEGLosslessSV1)
DECODER_DEPENDENCIES = dict.fromkeys(SYNTAXES, ("imagecodecs>=2024.1",))


def is_available(uid: str) -> bool:
    """pydicom's plugin protocol: True when this plugin can decode ``uid``."""
    return HAVE_IMAGECODECS and uid in SYNTAXES


def decode_frame(src: bytes, runner: Any) -> bytes:
    """One JPEG frame -> its samples as native-endian bytes, colour by pixel (pydicom's plugin protocol)."""
    import imagecodecs

    lossy = runner.transfer_syntax == JPEGExtended12Bit
    if lossy and runner.samples_per_pixel != 1:
        raise NotImplementedError("vitlab's imagecodecs plugin decodes monochrome JPEG Extended only")
    frame = imagecodecs.jpeg8_decode(src)  # (rows, columns[, samples]) uint8 or uint16
    expected = (runner.rows, runner.columns) + ((runner.samples_per_pixel,) if runner.samples_per_pixel > 1 else ())
    if frame.shape != expected:
        raise ValueError(f"JPEG frame is {frame.shape}, the header says {expected}")
    runner.set_option("bits_allocated", 8 * frame.dtype.itemsize)
    if runner.samples_per_pixel > 1:
        runner.set_option("planar_configuration", 0)  # libjpeg returns colour by pixel
    return frame.tobytes()


def register() -> None:
    """Add the plugin to pydicom's JPEG decoders (once; a no-op without imagecodecs)."""
    from pydicom.pixels import get_decoder

    for uid in SYNTAXES if HAVE_IMAGECODECS else ():
        decoder = get_decoder(uid)
        if LABEL not in decoder.available_plugins:
            decoder.add_plugin(LABEL, (__name__, "decode_frame"))
