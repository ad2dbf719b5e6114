"""FSDP2 sharding of every family (a one-rank gloo group in this process): the family checks see through FSDP's
classes, the Q/K/V capture gathers each block and equals the unsharded copy, the shards are put back after; the
task module's one-line refusals. The two-process fit is in ``tests/callbacks/test_fsdp.py``."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.helpers.models import HF_VARIANTS
from vitlab import models
from vitlab.models.adapter import plain_type
from vitlab.models.testing import TINY_MODELS, randomize_parameters, tiny_model
from vitlab.qkv.state import QKVCapture, qkv_state

ATTENTION_FAMILIES = [f for f in TINY_MODELS if f != "timm-mixer"] + ["timm-vit3d"]
MONAI = {"monai-swinunetr": ("monai:swin_unetr", dict(img_size=32, feature_size=12, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4),
                                                       window_size=4, norm_name="batch")),
         "monai-unetr": ("monai:unetr", dict(img_size=32, feature_size=4, hidden_size=24, mlp_dim=48, num_heads=2))}


def network(family: str) -> torch.nn.Module:
    if family.startswith("hf-"):
        pytest.importorskip("transformers")
        from tests.helpers.models import tiny_hf

        return tiny_hf(family[3:], seed=3)
    if family in MONAI:
        name, kwargs = MONAI[family]
        return randomize_parameters(models.build_model(name, 2, in_chans=1, **kwargs), 3).eval()
    return tiny_model(family, seed=3)


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


@pytest.mark.parametrize("family", ATTENTION_FAMILIES + list(MONAI) + [f"hf-{v}" for v in HF_VARIANTS])
def test_a_sharded_network_is_read_block_by_block_as_the_unsharded_one(family, mesh):
    plain = network(family)
    sharded = models.shard(copy.deepcopy(plain), mesh)
    assert models.is_sharded(sharded) and not models.is_sharded(plain)
    views, plain_views = models.blocks(sharded), models.blocks(plain)
    assert [v.name for v in views] == [v.name for v in plain_views]
    for view, plain_view in zip(views, plain_views):
        assert type(view.module) is not type(plain_view.module) and plain_type(view.module) is type(plain_view.module)
        assert view.num_heads == plain_view.num_heads
    assert list(models.whole_blocks(plain)) == [None]  # every block, as they are
    assert [names for names in models.whole_blocks(sharded)] == [[v.name] for v in views]  # one block at a time

    expected = qkv_state(plain)
    capture = QKVCapture(sharded, step=7)
    assert list(capture.tensors) == list(expected) and capture.step == 7
    for key, value in expected.items():
        assert torch.equal(capture.tensors[key], value), key
    assert all(is_dtensor(p) for p in sharded.parameters())  # sharded again after the copy
    assert QKVCapture(sharded, keep=False).tensors == {}  # a rank that writes nothing joins the gathers only

    x = torch.randn(2, *models.input_size(plain))
    with torch.no_grad():
        assert torch.allclose(sharded(x), plain(x), atol=1e-5)


def test_a_network_sharded_whole_is_gathered_at_once(mesh):
    from torch.distributed.fsdp import fully_shard

    plain = tiny_model("timm-swin", seed=1)
    sharded = copy.deepcopy(plain)
    fully_shard(sharded, mesh=mesh)  # one group: the blocks are not groups of their own
    names = [v.name for v in models.blocks(plain)]
    assert list(models.whole_blocks(sharded)) == [names]
    expected = qkv_state(plain)
    capture = QKVCapture(sharded)
    assert all(torch.equal(capture.tensors[k], v) for k, v in expected.items())
    assert all(is_dtensor(p) for p in sharded.parameters())


def test_unsharded_is_nothing_outside_a_sharded_network():
    model = tiny_model("timm-vit")
    with models.unsharded(model) as inside:
        assert inside is model


def _module():
    from vitlab.training.classification import ClassificationModule

    return ClassificationModule(model_name="vit_tiny_patch16_224", num_classes=2,
                                model_kwargs=dict(img_size=32, patch_size=16, embed_dim=16, depth=1, num_heads=1))


class Mesh(dict):  # a stand-in for Lightning's 2-D device mesh: only its names and sizes are read
    mesh_dim_names = ("data_parallel", "tensor_parallel")


@pytest.mark.parametrize("tensor_parallel, distributed, shardable, message", [
    (2, False, True, "tensor_parallel_size 2: set trainer.strategy.init_args.tensor_parallel_size: 1"),
    (1, True, True, "one checkpoint file: set trainer.strategy.init_args.save_distributed_checkpoint: false"),
    (1, False, False, "the classification task does not shard its network; use strategy ddp"),
])
def test_what_vitlab_does_not_shard_is_refused_in_one_line(tensor_parallel, distributed, shardable, message):
    module = _module()
    module.shardable = shardable
    strategy = type("ModelParallelStrategy", (), {"_save_distributed_checkpoint": distributed})()
    module._trainer = SimpleNamespace(strategy=strategy)
    mesh = Mesh(data_parallel=SimpleNamespace(size=lambda: 2), tensor_parallel=SimpleNamespace(size=lambda: tensor_parallel))
    with pytest.raises(ValueError, match="^ModelParallelStrategy: .*" + message.replace("(", r"\(")) as error:
        module._shard(mesh)
    assert "\n" not in str(error.value)
    assert not models.is_sharded(module.model)


def test_dino_refuses_to_shard_in_one_line():
    pytest.importorskip("lightly")
    from tests.helpers.runs import DINO_TINY
    from vitlab.training.dino import DINOModule

    module = DINOModule(**DINO_TINY)
    mesh = Mesh(data_parallel=SimpleNamespace(size=lambda: 2), tensor_parallel=SimpleNamespace(size=lambda: 1))
    with pytest.raises(ValueError, match=r"^ModelParallelStrategy: the dino task does not shard its network; use strategy ddp$"):
        module._shard(mesh)
    assert not models.is_sharded(module.model)


@pytest.mark.parametrize("builder", ["build_detector", "build_segmenter"])
def test_a_sharded_detector_or_segmenter_is_read_as_its_unsharded_backbone(builder, mesh):
    from tests.helpers.runs import DENSE_SWIN

    plain = getattr(models, builder)(DENSE_SWIN["model_name"], 1, in_chans=1, image_size=32,
                                     model_kwargs=DENSE_SWIN["model_kwargs"])
    plain = randomize_parameters(plain, 2)
    sharded = models.shard(copy.deepcopy(plain), mesh)
    assert len(list(models.whole_blocks(sharded))) == len(models.blocks(plain)) == 4
    expected, capture = qkv_state(plain), QKVCapture(sharded)
    assert list(capture.tensors) == list(expected)
    assert all(torch.equal(capture.tensors[k], v) for k, v in expected.items())
