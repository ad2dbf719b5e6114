"""``torch.compile`` of a network in place, optionally with a symbolic batch size from the first compilation.

:func:`compile_in_place` compiles a network's forward the way ``nn.Module.compile`` does (the module keeps its
parameters, state-dict keys and hooks; nothing is wrapped, so checkpoints and the Q/K/V views see the plain
module). With ``symbolic_batch`` it also marks the first dimension of the network's tensor inputs as dynamic before
every call.

Why: ``torch.compile`` first specialises a graph to the shapes it sees. A training set whose size is not a
multiple of the batch size ends each epoch with a smaller batch; at the first such batch dynamo compiles the whole
forward (in training, and its backward) a second time, now with a symbolic batch size (its "automatic dynamic"
shapes), and that second graph then serves every later batch. Marked up front, the first compilation is that
symbolic graph: one compilation per mode (training, and inference for validation) instead of two. Where every
batch has one size, a specialised graph needs no symbol and traces faster (a volume run's fit traced 1.2-1.3x as long
with the batch marked), so the caller asks for the mark only when the batch sizes vary
(:meth:`vitlab.data.image_data.ImageData.batch_sizes_vary`). ``torch._dynamo.maybe_mark_dynamic`` is a hint: a
network whose code needs a fixed batch size still gets a specialised graph, and a batch of one is specialised as
dynamo always does. With ``mode: reduce-overhead`` CUDA graphs are still recorded once per batch size (torch's
CUDA-graph trees). A ``dynamic`` given in ``options`` (``false``: every shape specialised; ``true``: every dimension
symbolic) is passed through untouched and no mark is made.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from torch import nn

__all__ = ["compile_in_place", "compile_notice", "is_compiled"]


def is_compiled(network: nn.Module) -> bool:
    """Whether ``network``'s forward runs through ``torch.compile`` (``nn.Module.compile`` or :func:`compile_in_place`)."""
    return getattr(network, "_compiled_call_impl", None) is not None


def compile_in_place(network: nn.Module, symbolic_batch: bool = False, **options: Any) -> None:
    """Compile ``network``'s forward in place (``options``: ``torch.compile``'s keyword arguments); with
    ``symbolic_batch`` (and no ``dynamic`` in ``options``) the batch dimension of every tensor argument is marked
    dynamic before each call."""
    compiled = torch.compile(network._call_impl, **options)
    if not symbolic_batch or options.get("dynamic") is not None:
        network._compiled_call_impl = compiled  # what nn.Module.compile sets
        return

    def call(*args: Any, **kwargs: Any) -> Any:
        for value in itertools.chain(args, kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        return compiled(*args, **kwargs)

    network._compiled_call_impl = call


def compile_notice(options: dict[str, Any]) -> str:
    """One line for the user of a compiled fit: when the compilation happens, and where torch keeps it for later runs
    (inductor, the default backend: ``TORCHINDUCTOR_CACHE_DIR``, else torch's default folder)."""
    line = ("vitlab: model.compile: the network compiles at the first batches of training and of validation (ViT-B/16's "
            "took about 80 s on an H200")
    if options.get("backend", "inductor") != "inductor":
        return line + ")"
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            folder = default_cache_dir()
        except Exception:  # (an internal of torch's that may move: the variable still names it)
            folder = "TORCHINDUCTOR_CACHE_DIR"
    return line + f"); torch keeps it in {folder}, where later runs of this model and batch size find it"
