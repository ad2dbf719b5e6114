"""Dense targets: masks, instances and boxes move with the image; layouts (manifest, masks/ tree, COCO JSON); bad pairs."""

import json
import warnings

import albumentations as A
import numpy as np
import pytest

from tests.helpers.data import planted, write_manifest
from vitlab.data.datasets.targets import DenseDataset, dense_collate
from vitlab.data.masks import MaskError, boxes_of, instances
from vitlab.data.datamodule import DenseDataModule
from vitlab.data import ImageReadError
from vitlab.data.layouts import SkippedFileWarning

NORM = A.Normalize(mean=(0.0,), std=(1.0,), max_pixel_value=1.0)


def item(sample, *transforms, on_bad_file="error", num_classes=1):
    ds = DenseDataset([sample], ["a"], A.Compose([*transforms, NORM], seed=0), num_mask_classes=num_classes,
                      mask_classes=["lesion", "cyst"][:num_classes], on_bad_file=on_bad_file)
    return ds[0]


@pytest.mark.parametrize("transform", [
    A.HorizontalFlip(p=1.0),
    A.VerticalFlip(p=1.0),
    A.Affine(rotate=(90, 90), p=1.0),
    A.Affine(rotate=(30, 30), p=1.0),
    A.RandomResizedCrop((40, 40), scale=(0.6, 0.6), ratio=(1.0, 1.0), p=1.0),
    A.Crop(4, 6, 44, 40),
], ids=["hflip", "vflip", "rot90", "rot30", "resized_crop", "crop"])
def test_mask_box_and_image_stay_aligned(tmp_path, transform):
    image, target = item(planted(tmp_path, "s", [(8, 10, 12), (28, 26, 10)]), transform)
    bright = image[0].numpy() > 0.5  # (S, S) where the planted squares went
    mask = target["mask"].numpy()
    assert target["masks"].shape[0] == 2 and target["labels"].tolist() == [1, 1]
    assert (bright != (mask == 1)).mean() < 0.03  # only interpolated edge pixels may differ
    for box, inst in zip(target["boxes"], target["masks"]):
        ys, xs = np.nonzero(inst.numpy())
        assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        assert (mask[inst.numpy().astype(bool)] == 1).all()
    if isinstance(transform, A.HorizontalFlip):  # box moved exactly: x -> W - x
        assert sorted(target["boxes"].tolist()) == sorted([[48 - 22, 8, 48 - 10, 20], [48 - 36, 28, 48 - 26, 38]])


def test_instance_leaving_the_crop_is_dropped_and_empty_image_is_a_negative(tmp_path):
    _, target = item(planted(tmp_path, "s", [(2, 2, 8), (30, 30, 10)]), A.Crop(20, 20, 48, 48))
    assert target["boxes"].tolist() == [[10.0, 10.0, 20.0, 20.0]] and target["masks"].shape == (1, 28, 28)
    _, empty = item(planted(tmp_path, "e", []))
    assert empty["boxes"].shape == (0, 4) and empty["labels"].shape == (0,) and empty["masks"].shape == (0, 48, 48)
    images, targets = dense_collate([item(planted(tmp_path, "x", [(1, 1, 4)])), item(planted(tmp_path, "y", []))])
    assert images.shape == (2, 1, 48, 48) and [len(t["boxes"]) for t in targets] == [1, 0]


def test_instances_are_connected_components_per_class():
    mask = np.zeros((10, 10), np.int64)
    mask[0:2, 0:2] = 1
    mask[5:7, 5:9] = 1
    mask[0:3, 7:9] = 2
    inst, labels = instances(mask, 2)
    assert labels == [1, 1, 2]
    assert boxes_of(inst).tolist() == [[0, 0, 2, 2], [5, 5, 9, 7], [7, 0, 9, 3]]


@pytest.mark.parametrize("case", ["size", "value", "missing", "dicom_seg"])
def test_bad_pair_names_both_files_or_is_skipped(tmp_path, case):
    sample = planted(tmp_path, "b", [(4, 4, 6)], mask_size=40 if case == "size" else None, value=3 if case == "value" else 1)
    if case == "missing":
        sample.mask.unlink()
    if case == "dicom_seg":  # a DICOM file where a label map is expected (no SEG reader): named, not misread
        from pydicom.data import get_testdata_file

        sample.mask.write_bytes(open(get_testdata_file("CT_small.dcm", download=False), "rb").read())
    expected = {"size": "differs", "value": "label value(s) [3] not in the classes", "missing": "does not exist",
                "dicom_seg": "DICOM (SEG) masks are not read"}[case]
    with pytest.raises(MaskError) as err:
        item(sample)
    message = str(err.value)
    assert expected in message and str(sample.path) in message and str(sample.mask) in message
    assert "\n" not in message
    good = planted(tmp_path, "g", [(4, 4, 6)])
    ds = DenseDataset([sample, good], ["a"], A.Compose([NORM]), on_bad_file="skip")
    with pytest.warns(SkippedFileWarning, match="b_mask.png"):
        _, target = ds[0]  # the bad pair is skipped: the next one comes back
    assert target["boxes"].tolist() == [[4, 4, 10, 10]]


def test_manifest_with_masks_and_skip_of_bad_pairs(tmp_path):
    rows = []
    for i in range(8):
        s = planted(tmp_path, f"i{i}", [(4 + i, 6, 8)] if i % 2 else [])
        rows.append((s.path.name, "lesion" if i % 2 else "none", f"P{i // 2}", s.mask.name))
    rows.append(("i0.png", "none", "P9", "nope.png"))  # missing mask
    manifest = write_manifest(tmp_path / "m.csv", rows)
    dm = DenseDataModule(root=str(manifest), image_size=48, num_workers=0, batch_size=4, augment="none", val_fraction=0.25)
    with pytest.warns(SkippedFileWarning, match="nope.png"):
        dm.setup()
    assert dm.skipped_files == 1 and sum(len(dm.samples(s)) for s in ("train", "val")) == 8
    images, targets = next(iter(dm.val_dataloader()))
    assert images.shape[1:] == (1, 48, 48) and all(t["masks"].shape[1:] == (48, 48) for t in targets)
    strict = DenseDataModule(root=str(manifest), image_size=48, num_workers=0, on_bad_file="error")
    with pytest.raises(MaskError, match="nope.png.*i0.png|i0.png.*nope.png"):
        strict.setup()


def test_class_folders_with_parallel_masks_tree(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls / "sub").mkdir(parents=True)
        (tmp_path / "masks" / cls / "sub").mkdir(parents=True)
        for i in range(3):
            s = planted(tmp_path, "tmp", [(3 * i, 5, 7)])
            s.path.rename(tmp_path / cls / "sub" / f"{i}.png")
            s.mask.rename(tmp_path / "masks" / cls / "sub" / f"{i}.png")
    dm = DenseDataModule(root=str(tmp_path), image_size=32, num_workers=0, augment="none")
    assert dm.class_names == ["a", "b"]  # masks/ is not a class
    dm.setup()
    _, target = dm.dataset("train")[0]
    assert target["labels"].tolist() == [1] and target["masks"].shape == (1, 32, 32)


def test_coco_instances_json_layout(tmp_path, monkeypatch):
    images, annotations = [], []
    for i in range(6):
        planted(tmp_path, f"c{i}", [])
        images.append({"id": i, "file_name": f"c{i}.png", "height": 48, "width": 48})
        if i % 2:  # a polygon square and an RLE-free second category box
            annotations.append({"id": 10 + i, "image_id": i, "category_id": 7, "iscrowd": 0,
                                "segmentation": [[10, 10, 30, 10, 30, 20, 10, 20]], "bbox": [10, 10, 20, 10]})
            annotations.append({"id": 20 + i, "image_id": i, "category_id": 9, "iscrowd": 0,
                                "segmentation": [[35, 35, 45, 35, 45, 45, 35, 45]], "bbox": [35, 35, 10, 10]})
    coco = tmp_path / "instances.json"
    coco.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": 7, "name": "tumour"}, {"id": 9, "name": "cyst"}]}))
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    dm = DenseDataModule(coco_json=str(coco), image_size=48, num_workers=0, augment="none", val_fraction=0.3)
    assert dm.mask_classes == ["tumour", "cyst"]
    dm.setup()
    targets = [dm.dataset(s)[i][1] for s in ("train", "val") for i in range(len(dm.samples(s)))]
    with_objects = [t for t in targets if len(t["labels"])]
    assert len(with_objects) == 3 and len(targets) == 6
    for t in with_objects:
        assert t["labels"].tolist() == [1, 2]
        assert t["boxes"][0].tolist() == pytest.approx([10, 10, 30, 20], abs=1)
    bad = json.loads(coco.read_text())
    bad["annotations"][0]["category_id"] = 5
    coco.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="category_id 5"):
        DenseDataModule(coco_json=str(coco), coco_mask_dir=str(tmp_path / "m2"), num_workers=0)


def test_embedded_dataset_gives_lesion_boxes(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path))
    dm = DenseDataModule(embedded_kwargs=dict(patients=4, slices=4, size=32), image_size=32, num_workers=0,
                         augment="none")
    dm.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs = [(s.label, dm.dataset("train")[i][1]) for i, s in enumerate(dm.samples("train"))]
    assert all((label == "lesion") == (len(t["boxes"]) > 0) for label, t in pairs)


def boxed(sample, boxes, mask=True):
    """``sample`` with a manifest ``boxes`` cell (and without its mask when ``mask`` is False)."""
    from dataclasses import replace

    return replace(sample, boxes=boxes, mask=sample.mask if mask else None)


@pytest.mark.parametrize("with_mask", [False, True], ids=["boxes_only", "boxes_and_mask"])
def test_box_column_boxes_follow_a_flip(tmp_path, with_mask):
    # loose boxes around the two planted squares (rows 8-19 x cols 10-21, rows 28-37 x cols 26-35)
    sample = boxed(planted(tmp_path, "s", [(8, 10, 12), (28, 26, 10)]), "8 6 24 22 lesion; 26 28 36 38 1", with_mask)
    for flip, expected in [(None, [[8, 6, 24, 22], [26, 28, 36, 38]]),
                           (A.HorizontalFlip(p=1.0), [[48 - 24, 6, 48 - 8, 22], [48 - 36, 28, 48 - 26, 38]])]:
        image, target = item(sample, *([flip] if flip else []))
        assert target["boxes"].tolist() == expected and target["labels"].tolist() == [1, 1]  # the user's boxes, moved
        bright = image[0].numpy() > 0.5
        for box, inst in zip(target["boxes"].int().tolist(), target["masks"].numpy().astype(bool)):
            x0, y0, x1, y1 = box
            inside = np.zeros_like(inst)
            inside[y0:y1, x0:x1] = True
            # with a mask: the instance is the object's pixels in the box; without: the filled box
            assert (inst == (bright & inside)).all() if with_mask else (inst == inside).all()
        painted = target["mask"].numpy() == 1
        assert (painted == bright).all() if with_mask else painted.sum() == 16 * 16 + 10 * 10


def test_box_column_crop_drops_a_box_that_leaves_and_an_empty_cell_is_a_negative(tmp_path):
    sample = boxed(planted(tmp_path, "s", [(2, 2, 8), (30, 30, 10)]), "2 2 10 10 1;30 30 40 40 1", mask=False)
    _, target = item(sample, A.Crop(20, 20, 48, 48))
    assert target["boxes"].tolist() == [[10, 10, 20, 20]] and target["masks"].shape == (1, 28, 28)
    _, empty = item(boxed(sample, ""))
    assert empty["boxes"].shape == (0, 4) and empty["masks"].shape == (0, 48, 48) and not empty["mask"].any()
    _, from_mask = item(boxed(planted(tmp_path, "m", [(4, 6, 8)]), ""))  # empty cell with a mask: its components
    assert from_mask["boxes"].tolist() == [[6, 4, 14, 12]]


@pytest.mark.parametrize("cell,message", [
    ("1 2 3 lesion", "expected 'x0 y0 x1 y1 label'"),
    ("a 2 3 4 lesion", "not numbers"),
    ("1 2 3 4 lesion extra", "expected 'x0 y0 x1 y1 label'"),
    ("10 10 5 20 lesion", "x0 < x1 and y0 < y1"),
    ("0 0 10 10 tumour", "label 'tumour' is not a class"),
    ("0 0 10 10 2", "label '2' is not a class"),
    ("0 0 60 10 lesion", "outside the 48x48 image"),
])
def test_bad_box_is_named_in_one_line_or_skipped(tmp_path, cell, message):
    sample = boxed(planted(tmp_path, "s", [(4, 4, 8)]), f"4 4 12 12 lesion;{cell}", mask=False)
    with pytest.raises(MaskError) as info:
        ds = DenseDataset([sample], ["a"], A.Compose([NORM]), mask_classes=["lesion"], on_bad_file="error")
        ds[0]
    text = str(info.value)
    assert message in text and "s.png" in text and f"box 2 {cell!r}" in text and "\n" not in text
    good = planted(tmp_path, "g", [(4, 4, 8)])
    ds = DenseDataset([sample, good], ["a"], A.Compose([NORM]), mask_classes=["lesion"], on_bad_file="skip")
    with pytest.warns(SkippedFileWarning, match="box 2"):
        _, target = ds[0]  # the bad row is skipped: the next pair is read
    assert target["boxes"].tolist() == [[4, 4, 12, 12]]


def test_manifest_boxes_column(tmp_path):
    rows = []
    for i in range(8):
        s = planted(tmp_path, f"i{i}", [(4 + i, 6, 8)] if i % 2 else [])
        cell = f"6 {4 + i} 14 {12 + i} lesion" if i % 2 else ""
        rows.append((s.path.name, "lesion" if i % 2 else "none", f"P{i // 2}", s.mask.name if i < 4 else "", cell))
    manifest = write_manifest(tmp_path / "m.csv", rows, header=("path", "label", "patient_id", "mask", "boxes"))
    dm = DenseDataModule(root=str(manifest), image_size=48, num_workers=0, augment="none", val_fraction=0.25)
    dm.setup()
    pairs = [(s, dm.dataset(split)[i][1]) for split in ("train", "val") for i, s in enumerate(dm.samples(split))]
    assert len(pairs) == 8
    for s, target in pairs:
        i = int(s.path.stem[1:])
        assert target["boxes"].tolist() == ([[6, 4 + i, 14, 12 + i]] if i % 2 else [])
    bad = write_manifest(tmp_path / "bad.csv", [*rows, (rows[1][0], "lesion", "P9", "", "6 4 14 12 cyst")],
                         header=("path", "label", "patient_id", "mask", "boxes"))
    with pytest.raises(MaskError, match="label 'cyst' is not a class: use one of \\['lesion'\\]"):
        DenseDataModule(root=str(bad), image_size=48, num_workers=0, on_bad_file="error").setup()
    with pytest.warns(SkippedFileWarning, match="cyst"):
        skipping = DenseDataModule(root=str(bad), image_size=48, num_workers=0, on_bad_file="skip")
        skipping.setup()
    assert skipping.skipped_files == 1


def test_non_finite_image_tensor_is_named_or_skipped(tmp_path):
    """The dense datasets' last guard: a transform that makes NaN names the file, or skips it under skip."""
    def bright_to_nan(image, **kwargs):
        return np.where(image > 0.85, np.float32(np.nan), image).astype(np.float32)

    bright = planted(tmp_path, "bright", [(4, 4, 6)])  # 230 / 255 inside the square
    dark = planted(tmp_path, "dark", [])
    transform = A.Compose([A.Lambda(image=bright_to_nan), NORM])
    strict = DenseDataset([bright, dark], ["a"], transform, on_bad_file="error")
    with pytest.raises(ImageReadError, match=r"bright.png: 36 non-finite") as err:
        strict[0]
    assert "\n" not in str(err.value)
    skipping = DenseDataset([bright, dark], ["a"], transform, on_bad_file="skip")
    with pytest.warns(SkippedFileWarning, match="bright.png"):
        image, target = skipping[0]
    assert image.isfinite().all() and target["boxes"].shape == (0, 4) and skipping.bad_paths == {str(bright.path)}
