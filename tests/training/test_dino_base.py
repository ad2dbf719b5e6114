"""DINOModule on the shared TaskModule base: AdamW groups, warm-up + cosine, freezing, ablation, layer decay."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightly")

from tests.helpers.runs import DINO_TINY  # noqa: E402
from vitlab.training import ClassificationModule, DINOModule, TaskModule, warmup_cosine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class _Trainer:
    estimated_stepping_batches = 10
    max_epochs = 2
    global_step = 0


def optimiser(module: TaskModule):
    module._trainer = _Trainer()
    conf = module.configure_optimizers()
    return conf["optimizer"], conf["lr_scheduler"]["scheduler"]


def test_groups_cover_student_and_head_once_with_no_decay_on_norms_biases_and_position_tables():
    torch.manual_seed(0)
    module = DINOModule(**DINO_TINY, lr=2e-3, weight_decay=0.04, warmup_epochs=1.0, min_lr_ratio=0.1, freeze=["patch_embed"])
    assert isinstance(module, TaskModule)
    opt, sched = optimiser(module)
    names = {id(p): n for n, p in module.named_parameters()}
    seen = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert sorted(seen) == sorted(trainable) and len(seen) == len(set(seen))
    assert not any(n.startswith(("teacher_model.", "teacher_head.", "model.patch_embed.")) for n in seen)
    assert not any(p.requires_grad for p in module.model.patch_embed.parameters())
    assert any(n.startswith("head.") for n in seen) and "model.pos_embed" in seen
    for group in opt.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            no_decay = p.ndim <= 1 or name.endswith(("pos_embed", "cls_token"))
            assert group["weight_decay"] == (0.0 if no_decay else 0.04), name
    # the base's schedule: 5 steps per epoch, one warm-up epoch, then cosine down to min_lr_ratio
    factor = warmup_cosine(5, 10, 0.1)
    lrs = []
    for step in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2e-3 * factor(s) for s in range(10)])
    # the same groups as the classifier's for the same backbone
    torch.manual_seed(0)
    classifier = ClassificationModule(model_name=DINO_TINY["model_name"], model_kwargs=DINO_TINY["model_kwargs"], weight_decay=0.04)
    copt, _ = optimiser(classifier)
    cnames = {id(p): n for n, p in classifier.named_parameters()}
    backbone = {names[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"] if names[id(p)].startswith("model.")}
    ours = {cnames[id(p)]: g["weight_decay"] for g in copt.param_groups for p in g["params"] if not cnames[id(p)].startswith("model.head.")}
    assert {k: v for k, v in ours.items() if not k.startswith("model.patch_embed.")} == backbone


def test_layer_decay_head_at_full_lr_and_bad_value_named():
    module = DINOModule(**DINO_TINY, lr=1e-3, layer_decay=0.5, warmup_epochs=0.0)
    opt, _ = optimiser(module)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    depth = DINO_TINY["model_kwargs"]["depth"]
    head = [p for p in module.head.parameters() if p.requires_grad]
    assert head and all(lr_of[id(p)] == pytest.approx(1e-3) for p in head)  # the head trains as the last layer
    assert lr_of[id(module.model.pos_embed)] == pytest.approx(1e-3 * 0.5 ** (depth + 1))  # embedding: layer 0
    assert lr_of[id(module.model.blocks[0].attn.qkv.weight)] == pytest.approx(1e-3 * 0.5**depth)
    with pytest.raises(ValueError, match="model.layer_decay must be in"):
        DINOModule(**DINO_TINY, layer_decay=1.5)


def test_ablation_reaches_student_and_teacher():
    torch.manual_seed(3)
    plain = DINOModule(**DINO_TINY)
    torch.manual_seed(3)
    ablated = DINOModule(**DINO_TINY, ablate={"remove": ["attention"], "blocks": [0, 1]})
    images = torch.randn(3, 1, 32, 32)
    plain.eval(), ablated.eval()
    with torch.no_grad():
        a, b = ablated(images), plain(images)
        teacher = ablated.teacher_head(ablated.teacher_model.forward_features(images)[:, 0])
        student = ablated.head(ablated.model.forward_features(images)[:, 0])
    assert not torch.allclose(a, b, atol=1e-4)
    assert torch.allclose(teacher, student, atol=1e-6)  # the teacher is a copy of the ablated student


def test_picklable_for_ddp_spawn_and_deep_copyable_after_a_step():
    import copy
    import pickle

    torch.manual_seed(4)
    module = DINOModule(**DINO_TINY)
    x = torch.randn(3, 32)
    module.head(x).sum().backward()  # the weight-normed last layer now holds a non-leaf weight
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert torch.equal(clone.head(x), module.head(x))
        assert clone.state_dict().keys() == module.state_dict().keys()
        clone.head(x).sum().backward()
        assert clone.head.last_layer.weight_v.grad is not None  # the clone still trains its head
