"""Lightning callbacks that look inside the model while it trains (declare them under trainer.callbacks)."""

from vitlab.callbacks.drift import QKVDrift
from vitlab.callbacks.snapshot import QKVSnapshot
from vitlab.callbacks.spectra import QKSpectra

__all__ = ["QKVDrift", "QKVSnapshot", "QKSpectra"]
