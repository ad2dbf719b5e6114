"""A network's parameters sharded across ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), and read whole.

:func:`shard` gives every transformer block (the blocks :func:`vitlab.models.blocks` finds) a parameter group of its
own, then the network the rest (embeddings, norms, heads): in a forward or backward pass one block's parameters are
whole at a time, as FSDP's usual wrapping of a transformer does. Lightning's ``ModelParallelStrategy`` calls it
through a task's ``configure_model``.

Between steps the parameters are sharded: each is a ``DTensor`` holding this rank's rows. :func:`unsharded` makes a
module's parameters whole for a moment (an all-gather every rank of the mesh joins) and shards them again after:
the Q/K/V callbacks copy a block's query, key and value weights there, one block at a time, so that no rank ever
holds more than one block's whole parameters beside its shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["is_sharded", "shard", "unsharded", "whole_blocks"]


def _fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """Whether any module of ``model`` is an FSDP2 module (its parameters sharded across ranks)."""
    if not any(type(module).__name__.startswith("FSDP") for module in model.modules()):
        return False  # (without importing torch.distributed.fsdp)
    fsdp = _fsdp_module()
    return any(isinstance(module, fsdp) for module in model.modules())


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` every transformer block of ``model`` over ``mesh`` (a 1-D device mesh), then ``model`` itself,
    with ``fully_shard``'s defaults (parameters kept in their dtype; resharded after each forward).

    Args:
        model: A supported network (or a task network whose backbone :func:`vitlab.models.blocks` finds).
        mesh: The data-parallel ``DeviceMesh`` the parameters are sharded over.

    Returns:
        ``model``, sharded in place (already sharded: as it is).
    """
    if is_sharded(model):
        return model
    from torch.distributed.fsdp import fully_shard

    from vitlab.models.anatomy import blocks

    for view in blocks(model):
        fully_shard(view.module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextmanager
def unsharded(module: nn.Module) -> Iterator[nn.Module]:
    """Inside: the parameters of every FSDP2 module in ``module`` whole (plain tensors), on every rank; after: sharded
    again. A collective: every rank of the mesh enters it at the same point. Outside a sharded network: nothing."""
    if not is_sharded(module):
        yield module
        return
    fsdp = _fsdp_module()
    groups = [m for m in module.modules() if isinstance(m, fsdp)]
    for group in groups:  # (``unshard`` is not recursive: each group gathers its own parameters)
        group.unshard()
    try:
        yield module
    finally:
        for group in reversed(groups):
            group.reshard()


def whole_blocks(model: nn.Module) -> Iterator[list[str] | None]:
    """Yields lists of block names (:func:`vitlab.models.blocks`) whose parameters are whole until the next step, None
    for every block: of a sharded network, each block alone where it is a group of its own (as :func:`shard` makes
    them), else every block at once with the whole network gathered; of any other network, None once. A collective
    under sharding: every rank iterates it to its end."""
    if not is_sharded(model):
        yield None
        return
    from vitlab.models.anatomy import blocks

    views = blocks(model)
    fsdp = _fsdp_module()
    if not all(isinstance(view.module, fsdp) for view in views):
        with unsharded(model):
            yield [view.name for view in views]
        return
    for view in views:
        with unsharded(view.module):
            yield [view.name]
