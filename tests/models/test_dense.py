"""Mask R-CNN and segmenter around timm Swin / ViT: the backbone view, weights transfer, pyramids."""

import pytest
import torch

from vitlab import models
from vitlab.qkv.state import qkv_state

SWIN = ("swin_tiny_patch4_window7_224", dict(patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4))
VIT = ("vit_tiny_patch16_224", dict(patch_size=8, embed_dim=32, depth=2, num_heads=2))


def randomise(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def targets(size=64):
    masks = torch.zeros(1, size, size, dtype=torch.uint8)
    masks[0, 10:30, 12:28] = 1
    one = {"boxes": torch.tensor([[12.0, 10, 28, 30]]), "labels": torch.tensor([1]), "masks": masks}
    none = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
            "masks": torch.zeros(0, size, size, dtype=torch.uint8)}
    return [one, none]


@pytest.mark.parametrize("name,kwargs", [SWIN, VIT], ids=["swin", "vit"])
def test_backbone_view_of_detector_and_segmenter(name, kwargs):
    detector = randomise(models.build_detector(name, 1, in_chans=1, image_size=64, model_kwargs=kwargs))
    classifier = models.build_model(name, num_classes=2, in_chans=1, img_size=64, **kwargs)
    body = detector.backbone.body
    for a, b in zip(models.qkv(detector).values(), models.qkv(body).values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert list(models.qkv(detector)) == list(models.qkv(body))
    assert qkv_state(detector).keys() == qkv_state(classifier).keys()  # the callbacks' snapshot keys
    segmenter = models.build_segmenter(name, 1, in_chans=1, image_size=64, model_kwargs=kwargs)
    assert qkv_state(segmenter).keys() == qkv_state(classifier).keys()
    assert models.family_name(detector) == models.family_name(classifier)

    x = torch.randn(2, 1, 64, 64)
    detector.eval()
    with models.record_attention(detector) as record, models.capture(detector, "resid") as cap, torch.no_grad():
        out = detector(x)
    assert len(out) == 2 and set(out[0]) == {"boxes", "labels", "scores", "masks"}
    assert set(record.attentions) == {b.name for b in models.blocks(classifier)}
    with models.capture(body, "resid") as direct, torch.no_grad():
        body.forward_intermediates(x, intermediates_only=True)
    for key in direct.outputs:  # the detector ran its backbone on the very images it was given
        assert torch.allclose(cap.outputs[key]["resid"], direct.outputs[key]["resid"], atol=1e-5)
    with models.ablated(detector, "attention", blocks=[0]), torch.no_grad():
        ablated = detector.backbone(x)["0"]
    assert not torch.allclose(ablated, detector.backbone(x)["0"])

    detector.train()
    losses = detector(x, targets())
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    sum(losses.values()).backward()
    assert all(p.grad is not None for p in models.blocks(detector)[0].module.parameters())
    assert segmenter(x).shape == (2, 2, 64, 64)


def test_pyramids_have_the_expected_strides():
    swin = models.build_detector(*SWIN[:1], 1, in_chans=1, image_size=64, model_kwargs=SWIN[1])
    shapes = {k: tuple(v.shape[-2:]) for k, v in swin.backbone(torch.randn(1, 1, 64, 64)).items()}
    assert shapes == {"0": (16, 16), "1": (8, 8), "pool": (4, 4)}
    vit = models.build_detector(*VIT[:1], 1, in_chans=1, image_size=64, model_kwargs=VIT[1])
    shapes = {k: tuple(v.shape[-2:]) for k, v in vit.backbone(torch.randn(1, 1, 64, 64)).items()}
    assert shapes == {"0": (32, 32), "1": (16, 16), "2": (8, 8), "3": (4, 4), "pool": (2, 2)}  # ViTDet: P/4 ... 2P
    assert vit.backbone.out_channels == 64 and len(vit.rpn.anchor_generator.sizes) == 5


def test_light_and_full_heads_and_bad_keys():
    light = models.build_detector(*SWIN[:1], 1, in_chans=1, image_size=64, model_kwargs=SWIN[1])
    full = models.build_detector(*SWIN[:1], 1, in_chans=1, image_size=64, heads="full", model_kwargs=SWIN[1])
    assert light.roi_heads.box_head.fc6.out_features == 128 and full.roi_heads.box_head.fc6.out_features == 1024
    assert light.rpn._post_nms_top_n["training"] == 100 and light.roi_heads.fg_bg_sampler.batch_size_per_image == 32
    assert full.backbone.out_channels == 256 and light.rpn.anchor_generator.sizes == ((8,), (16,), (32,))
    with pytest.raises(ValueError, match="unknown detection head key.*fpn_chans"):
        models.build_detector(*SWIN[:1], 1, image_size=64, model_kwargs=SWIN[1], fpn_chans=3)


def test_roi_sampling_ratio_reaches_both_roi_pools():
    from collections import OrderedDict

    default = models.build_detector(*SWIN[:1], 1, in_chans=1, image_size=64, model_kwargs=SWIN[1])
    cheap = models.build_detector(*SWIN[:1], 1, in_chans=1, image_size=64, model_kwargs=SWIN[1], roi_sampling_ratio=1)
    assert default.roi_heads.box_roi_pool.sampling_ratio == default.roi_heads.mask_roi_pool.sampling_ratio == 2
    assert cheap.roi_heads.box_roi_pool.sampling_ratio == cheap.roi_heads.mask_roi_pool.sampling_ratio == 1
    torch.manual_seed(0)
    feats = OrderedDict([("0", torch.randn(1, 3, 16, 16)), ("1", torch.randn(1, 3, 8, 8))])
    box = [torch.tensor([[0.0, 0.0, 42.0, 42.0]])]  # level "0" (stride 4): 7 x 7 bins of 1.5 feature pixels
    f = feats["0"][0]

    def bilinear(y: float, x: float) -> torch.Tensor:  # independent of torchvision: (3,) feature at (y, x)
        y0, x0 = int(y), int(x)
        wy, wx = y - y0, x - x0
        return ((1 - wy) * (1 - wx) * f[:, y0, x0] + (1 - wy) * wx * f[:, y0, x0 + 1]
                + wy * (1 - wx) * f[:, y0 + 1, x0] + wy * wx * f[:, y0 + 1, x0 + 1])

    for detector, n in ((cheap, 1), (default, 2)):  # n x n samples per bin, averaged
        pooled = detector.roi_heads.box_roi_pool(feats, box, [(64, 64)])[0]  # (3, 7, 7)
        offsets = [(s + 0.5) * 1.5 / n for s in range(n)]
        expected = torch.stack([torch.stack([
            torch.stack([bilinear(1.5 * i + dy, 1.5 * j + dx) for dy in offsets for dx in offsets]).mean(0)
            for j in range(7)], dim=-1) for i in range(7)], dim=-2)
        assert torch.allclose(pooled, expected, atol=1e-5), n
    with pytest.raises(ValueError, match="roi_sampling_ratio must be an int >= 0.*-1"):
        models.build_detector(*SWIN[:1], 1, image_size=64, model_kwargs=SWIN[1], roi_sampling_ratio=-1)


def test_parameter_groups_cover_heads_once():
    detector = models.build_detector(*SWIN[:1], 1, in_chans=1, image_size=64, model_kwargs=SWIN[1])
    for decay in (None, 0.8):
        groups = models.parameter_groups(detector, 0.05, layer_decay=decay)
        ids = [id(p) for g in groups for p in g["params"]]
        assert len(ids) == len(set(ids)) == len(list(detector.parameters()))
    heads = {id(p) for p in detector.roi_heads.parameters()}
    last = max(g["layer_id"] for g in groups)
    assert all(g["layer_id"] == last for g in groups if any(id(p) in heads for p in g["params"]))


def test_weights_move_between_classifier_and_detector(tmp_path):
    name, kwargs = SWIN
    classifier = randomise(models.build_model(name, num_classes=2, in_chans=1, img_size=64, **kwargs))
    torch.save({"state_dict": {f"model.{k}": v for k, v in classifier.state_dict().items()}}, tmp_path / "cls.ckpt")
    detector = models.build_detector(name, 1, in_chans=1, image_size=64, weights=str(tmp_path / "cls.ckpt"),
                                     model_kwargs=kwargs)
    moved = models.backbone_state(detector)
    assert moved and all(torch.equal(v, classifier.state_dict()[k]) for k, v in moved.items())
    report = detector.backbone.weights_report
    assert set(report.loaded_keys) == set(moved) and report.head_reset  # the 2-class head was left out

    detector = randomise(detector)
    torch.save({"state_dict": {f"model.{k}": v for k, v in detector.state_dict().items()}}, tmp_path / "det.ckpt")
    back = models.build_model(name, num_classes=3, in_chans=1, img_size=64, **kwargs)
    report = models.load_weights(back, tmp_path / "det.ckpt")
    assert set(report.loaded_keys) == set(models.backbone_state(detector))  # the keys moved: the backbone's
    assert all(torch.equal(back.state_dict()[k], v) for k, v in models.backbone_state(detector).items())
