"""vitlab: fine-tune Vision Transformers on medical images and see inside them while they learn."""

import os

# How long torch's idle OpenMP threads spin before they sleep (effective when vitlab is imported before torch,
# as by train.py and probe.py; see vitlab.threads). GNU OpenMP's default, about 3 ms of spinning, multiplied the
# quickstart's CPU time on a busy machine; sleeping at once (OMP_WAIT_POLICY=PASSIVE) made every one of a
# step's thousands of small parallel operations wait for a thread to wake, so two threads trained slower than
# one. About 0.1 ms (GNU OpenMP counts ~100 000 spins per ms) keeps both. A policy the user set is kept.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
