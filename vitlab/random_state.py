"""Every global random stream a training process draws from, as checkpoint-safe values, and back.

Lightning saves no random state in a checkpoint: a run resumed from one continues torch's, NumPy's and Python's
global streams from ``seed_everything``, so its dropout / drop-path draws (and anything else drawn from them)
differ from the run that was never stopped. :func:`capture` takes the streams of this process (torch's CPU
generator, the generator of every CUDA device this process has initialised, NumPy's global ``RandomState``,
Python's ``random``) as tensors and plain numbers, so a checkpoint loaded with ``torch.load(weights_only=True)``
holds them; :func:`restore` puts them back. Generators vitlab keeps of its own are not here: the sampler's and
the augmentations' are functions of (seed, epoch, index) (:mod:`vitlab.data.sampling`), and the loaders' draws
only seed worker processes whose draws are keyed the same way. When to capture and restore (where an
uninterrupted run would be in the same state) is :class:`vitlab.callbacks.RuntimeCallback`'s business.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's random streams: ``torch`` (CPU generator state), ``cuda`` (one state per device, only once
    CUDA is initialised: a CPU run does not start it), ``numpy`` and ``python``; tensors, numbers and strings only."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # each device's generator state directly: torch.cuda.get_rng_state(i) would make a context on every device
        state["cuda"] = [generator.get_state() for generator in torch.cuda.default_generators]
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Put the streams of :func:`capture` back; returns what could not be (one phrase each, empty when all were)."""
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(int(v) for v in python_state["internal"].tolist()), python_state["gauss_next"]))
    saved = state.get("cuda") or []
    here = len(torch.cuda.default_generators) if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    for generator, value in zip(torch.cuda.default_generators[:here], saved):
        generator.set_state(value)
    if len(saved) != here and (saved or here):
        return [f"{len(saved)} CUDA device stream(s) saved, {here} in use here ({min(len(saved), here)} restored)"]
    return []
