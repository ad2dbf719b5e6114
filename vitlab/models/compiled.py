"""``torch.compile`` of a network in place, with one graph for every batch size.

:func:`compile_in_place` compiles a network's forward the way ``nn.Module.compile`` does (the module keeps its
parameters, state-dict keys and hooks; nothing is wrapped, so checkpoints and the Q/K/V views see the plain
module), and by default marks the first dimension of its tensor inputs as dynamic before every call.

Why: ``torch.compile`` first specialises a graph to the shapes it sees. A training set whose size is not a
multiple of the batch size ends each epoch with a smaller batch, and sliding-window inference ends with a smaller
batch of windows; each such batch made dynamo compile the whole forward (and, in training, its backward) a second
time, now with a symbolic batch size (its "automatic dynamic" shapes), and that second graph then served every later
batch. Marked up front, the first compilation is that symbolic graph: one compilation per mode (training, and
inference for validation) instead of two. ``torch._dynamo.maybe_mark_dynamic`` is a hint: a network whose code
needs a fixed batch size still gets a specialised graph, and a batch of one is specialised as dynamo always does.
With ``mode: reduce-overhead`` CUDA graphs are still recorded once per batch size (torch's CUDA-graph trees).
A ``dynamic`` given by the user (``false``: every shape specialised; ``true``: every dimension symbolic) is
passed through untouched.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["compile_in_place", "is_compiled"]


def is_compiled(network: nn.Module) -> bool:
    """Whether ``network``'s forward runs through ``torch.compile`` (``nn.Module.compile`` or :func:`compile_in_place`)."""
    return getattr(network, "_compiled_call_impl", None) is not None


def compile_in_place(network: nn.Module, **options: Any) -> None:
    """Compile ``network``'s forward in place (``options``: ``torch.compile``'s keyword arguments); unless
    ``dynamic`` is given, the batch dimension of every tensor argument is marked dynamic before each call."""
    compiled = torch.compile(network._call_impl, **options)
    if options.get("dynamic") is not None:
        network._compiled_call_impl = compiled  # what nn.Module.compile sets
        return

    def call(*args: Any, **kwargs: Any) -> Any:
        for value in itertools.chain(args, kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        return compiled(*args, **kwargs)

    network._compiled_call_impl = call
