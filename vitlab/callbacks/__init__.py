"""Lightning callbacks that look inside the model while it trains (declare them under ``trainer.callbacks``),
and the one that runs the run-time machinery (``train.py`` adds it). What they share with the probes lives in
:mod:`vitlab.qkv`, importable without Lightning."""

from vitlab.callbacks.drift import QKVDrift
from vitlab.callbacks.progress import LogStepProgressBar
from vitlab.callbacks.runtime import RuntimeCallback
from vitlab.callbacks.snapshot import QKVSnapshot
from vitlab.callbacks.spectra import QKSpectra

__all__ = ["LogStepProgressBar", "QKVDrift", "QKVSnapshot", "QKSpectra", "RuntimeCallback"]
