"""vitlab: fine-tune Vision Transformers on medical images and see inside them while they learn."""

import os

# Waiting OpenMP threads sleep instead of spinning (effective when vitlab is imported before torch, as by
# train.py and probe.py): on a busy machine spinning multiplied the quickstart's CPU time (vitlab.threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
