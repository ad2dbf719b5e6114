"""Files -> arrays, one module per format; nothing here knows of samples, datasets or training.

- :mod:`~vitlab.data.readers.image`: :func:`read_image` and :class:`ImageReader` (any 2-D file: the dispatch),
  PNG / JPEG / TIFF;
- :mod:`~vitlab.data.readers.dicom`: one DICOM file (display chain, fast path), its header checks in
  :mod:`~vitlab.data.readers.dicom_checks`, the imagecodecs JPEG plugin in :mod:`~vitlab.data.readers.codecs`;
- :mod:`~vitlab.data.readers.volume`: :func:`read_volume` and :class:`Volume` (any volume: the dispatch),
  :mod:`~vitlab.data.readers.nifti` and :mod:`~vitlab.data.readers.dicom_series` (series folders, multi-frame files);
- :mod:`~vitlab.data.readers.options` (:class:`ReadOptions`), :mod:`~vitlab.data.readers.window` (presets and window
  arithmetic), :mod:`~vitlab.data.readers.errors` (the error types).

The names users call are exported by :mod:`vitlab.data`; this package imports nothing itself, so reading one
module does not load the others (pydicom, nibabel).
"""
