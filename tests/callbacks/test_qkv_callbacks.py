"""Q/K/V callbacks: argument validation, unsupported strategies and models, flat state layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vitlab.callbacks import QKSpectra, QKVDrift, QKVSnapshot
from vitlab.qkv.state import head_counts, qkv_state
from vitlab.models import qkv
from vitlab.models.testing import tiny_model


@pytest.mark.parametrize("cls", [QKVSnapshot, QKVDrift, QKSpectra])
def test_every_n_epochs_must_be_positive(cls):
    with pytest.raises(ValueError, match=f"{cls.__name__}.every_n_epochs must be >= 1, got 0"):
        cls(every_n_epochs=0)


def test_snapshot_dtype_is_checked():
    with pytest.raises(ValueError, match=r"one of \['bf16', 'fp16', 'fp32'\], got 'fp64'"):
        QKVSnapshot(dtype="fp64")


class FSDPStrategy:  # stands in for Lightning's: only the class name is inspected
    pass


@pytest.mark.parametrize("cls", [QKVSnapshot, QKVDrift, QKSpectra])
def test_sharded_strategies_it_cannot_read_are_refused_clearly(cls):
    trainer = SimpleNamespace(strategy=FSDPStrategy(), loggers=[])
    module = SimpleNamespace(model=tiny_model("timm-vit"))
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support FSDPStrategy .*ModelParallelStrategy"):
        cls().setup(trainer, module, "fit")


def test_models_without_attention_are_refused_clearly():
    trainer = SimpleNamespace(strategy=object(), loggers=[])
    module = SimpleNamespace(model=tiny_model("timm-mixer"))
    with pytest.raises(ValueError, match="QKVDrift: timm-mixer model has no attention blocks"):
        QKVDrift().setup(trainer, module, "fit")


@pytest.mark.parametrize("family", ["timm-vit", "timm-swin", "torchvision-vit", "torchvision-swin"])
def test_flat_state_holds_every_block_split_from_the_fused_projection(family):
    model = tiny_model(family, seed=3)
    state = qkv_state(model)
    views = qkv(model)
    assert set(head_counts(model)) == set(views)
    for block, parts in views.items():
        for m in "qkv":
            assert torch.equal(state[f"{block}.{m}.weight"], parts[m].float())
            assert state[f"{block}.{m}.weight"].data_ptr() != parts[m].data_ptr()  # a copy, not a view
        assert (f"{block}.rel_pos_table" in state) == family.endswith("swin")
