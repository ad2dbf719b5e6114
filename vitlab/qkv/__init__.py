"""Q/K/V reporting shared by the training callbacks and the probes, importable without Lightning: the flat Q/K/V
state and its snapshot files (:mod:`~vitlab.qkv.state`), the drift report (:mod:`~vitlab.qkv.drift`) and the
QK-spectra report (:mod:`~vitlab.qkv.spectra`). The formulas live in :mod:`vitlab.analysis`."""
