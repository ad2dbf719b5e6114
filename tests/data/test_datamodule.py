"""vitlab.data.MedicalDataModule: attributes, batches, splits, bad files, workers, cache, CLI construction."""

from __future__ import annotations

import csv
import os
import shutil
import warnings
from pathlib import Path

import albumentations as A
import numpy as np
import pytest
import torch
from PIL import Image
from pydicom.data import get_testdata_file

import vitlab.data.datasets.images as dataset_module
import vitlab.data.readers.dicom as dicom_module
import vitlab.data.readers.image as io_module
from vitlab.data import MedicalDataModule, SkippedFileWarning, read_image
from vitlab.data import ImageReadError
from vitlab.data.layouts import patient_overlap

TRUNCATED = get_testdata_file("MR_truncated.dcm", download=False)


def png_folders(root: Path, per_class: int = 6, size: int = 16) -> Path:
    rng = np.random.default_rng(0)
    for label in ("benign", "malignant"):
        for i in range(per_class):
            (root / label).mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8)).save(root / label / f"{i}.png")
    return root


def module(root, **kwargs) -> MedicalDataModule:
    defaults = dict(image_size=32, batch_size=4, num_workers=0, augment="none", val_fraction=0.25)
    return MedicalDataModule(root=str(root), **{**defaults, **kwargs})


def test_attributes_exist_after_init_without_decoding(tiny_dataset, monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("__init__ must not decode pixels")

    monkeypatch.setattr(dataset_module.ImageReader, "__call__", no_decoding)
    dm = module(tiny_dataset, in_chans=3)
    assert (dm.num_classes, dm.class_names, dm.in_chans) == (2, ["lesion", "no_lesion"], 3)
    dm.setup("fit")  # header checks and the split need no decoding either
    assert len(dm.samples("train")) + len(dm.samples("val")) == 32


def test_headers_are_parsed_once_at_setup_and_reused_by_loaders(tiny_dataset, monkeypatch):
    dm = module(tiny_dataset)
    dm.setup("fit")
    expected = [read_image(s.path) for s in dm.samples("train")[:4]]

    def no_second_parse(path):
        raise AssertionError(f"header of {path} parsed again")

    monkeypatch.setattr(dicom_module, "dicom_header", no_second_parse)
    monkeypatch.setattr(io_module, "dicom_header", no_second_parse)
    dataset = dm.dataset("train")
    for i, image in enumerate(expected):
        np.testing.assert_array_equal(dataset.load_array(i), image)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1)
    assert next(iter(loader))[0].shape == (4, 1, 32, 32)  # the memory travels to workers too


@pytest.mark.parametrize("in_chans", [1, 3])
def test_batches_are_normalised_images_with_int64_labels(tiny_dataset, in_chans):
    mean, std = [0.3, 0.4, 0.5][:in_chans], [0.2, 0.25, 0.5][:in_chans]
    dm = module(tiny_dataset, in_chans=in_chans, mean=mean, std=std)  # image_size 32 = native size: no resize
    dm.setup("fit")
    images, labels = next(iter(dm.val_dataloader()))
    assert images.shape == (4, in_chans, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    samples = dm.samples("val")[:4]
    for image, label, sample in zip(images, labels, samples):
        raw = torch.from_numpy(read_image(sample.path))  # (32, 32) in [0, 1]
        expected = (raw[None] - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        torch.testing.assert_close(image, expected, atol=1e-5, rtol=0)
        assert dm.class_names[label] == sample.label


def test_default_stats_are_imagenet_averaged_for_one_channel(tiny_dataset):
    assert module(tiny_dataset).mean == pytest.approx((np.mean([0.485, 0.456, 0.406]),))
    assert module(tiny_dataset, in_chans=3).std == (0.229, 0.224, 0.225)


@pytest.mark.parametrize("augment", ["none", "light", "default", "strong"])
def test_every_recipe_resizes_to_image_size(tmp_path, augment):
    dm = module(png_folders(tmp_path, size=20), image_size=24, augment=augment, in_chans=3)
    dm.setup("fit")
    images, _ = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 24, 24) and torch.isfinite(images).all()


def test_user_transforms_get_resize_and_normalize_appended(tmp_path):
    root = png_folders(tmp_path, size=16)
    flip = A.Compose([A.HorizontalFlip(p=1.0)])
    dm = module(root, image_size=16, train_transforms=flip, mean=[0.5], std=[0.5])
    dataset = dm.dataset("train", augmented=True)
    image, _ = dataset[0]
    raw = torch.from_numpy(read_image(dataset.samples[0].path))
    torch.testing.assert_close(image[0], (raw.flip(-1) - 0.5) / 0.5, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="contains Normalize"):
        module(root, train_transforms=A.Compose([A.Normalize()]))


def _epoch_batches(dm, epoch: int) -> list[torch.Tensor]:
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)  # (as Lightning does before every training epoch)
    return [images for images, _ in loader]


def test_augmentations_are_a_function_of_seed_epoch_and_index_not_of_the_workers(tmp_path):
    root = png_folders(tmp_path, per_class=3, size=32)
    batches = {}
    for workers in (0, 1, 2):
        dm = module(root, augment="strong", num_workers=workers, batch_size=2, val_fraction=0.0)
        batches[workers] = [_epoch_batches(dm, epoch) for epoch in (0, 1)]
    for workers in (1, 2):
        for epoch in (0, 1):
            assert all(torch.equal(a, b) for a, b in zip(batches[0][epoch], batches[workers][epoch], strict=True))
    # a new order and new augmentations each epoch, the same ones for the same epoch again
    assert not all(torch.equal(a, b) for a, b in zip(batches[0][0], batches[0][1]))
    again = _epoch_batches(module(root, augment="strong", num_workers=0, batch_size=2, val_fraction=0.0), 1)
    assert all(torch.equal(a, b) for a, b in zip(again, batches[0][1], strict=True))


def test_one_image_drawn_twice_in_an_epoch_gets_two_augmentations(tmp_path):
    from vitlab.data.sampling import KeyedAugmentation

    root = png_folders(tmp_path, per_class=1, size=32)
    dataset = module(root, augment="strong", val_fraction=0.0).dataset("train", augmented=True)
    keyed = KeyedAugmentation(dataset, seed=0)
    first, second, first_again = keyed[(0, 0)][0], keyed[(0, 1)][0], keyed[(0, 0)][0]
    assert not torch.equal(first, second) and torch.equal(first, first_again)


def test_transforms_of_one_pipeline_draw_independently():
    """Two flips of probability 0.5 in one keyed pipeline: both or neither in about half the samples, not in all
    (one seed per transform would make every transform of a pipeline draw the same numbers)."""
    import albumentations as A
    import numpy as np

    from vitlab.data.sampling import KeyedAugmentation

    image = np.arange(64, dtype=np.float32).reshape(8, 8)

    class Flips(torch.utils.data.Dataset):
        transform = A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)])

        def __getitem__(self, index):
            return self.transform(image=image)["image"]

    keyed = KeyedAugmentation(Flips(), seed=0)
    outs = [keyed[(index, 0)] for index in range(400)]
    together = sum(np.array_equal(o, image) or np.array_equal(o, image[::-1, ::-1]) for o in outs)
    horizontal = sum(np.array_equal(o, image[:, ::-1]) or np.array_equal(o, image[::-1, ::-1]) for o in outs)
    assert 140 < together < 260 and 140 < horizontal < 260  # ~200 each (binomial sd 10)


@pytest.mark.slow
def test_workers_start_after_opencv_ran_threaded_in_the_parent(tmp_path):
    """OpenCV's thread pool, once running in the parent, is copied half-alive into forked loader workers; a worker
    that then touches OpenCV (albumentations, the reseeding hook) waited forever. Run in a child process: a
    regression hangs, and the timeout turns that into a failure."""
    import subprocess
    import sys

    root = png_folders(tmp_path, per_class=4, size=64)
    code = f"""
import cv2, numpy as np
cv2.setNumThreads(4)
big = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)
for _ in range(3):
    cv2.GaussianBlur(big, (31, 31), 5)  # the pool's threads are up
from vitlab.data import MedicalDataModule
dm = MedicalDataModule(root={str(root)!r}, image_size=32, batch_size=2, num_workers=2, augment="strong", val_fraction=0.0)
images, labels = next(iter(dm.train_dataloader()))
print("loaded", tuple(images.shape))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "loaded (2, 1, 32, 32)" in done.stdout, done.stderr[-2000:]


def test_patient_grouped_split_is_deterministic(tiny_dataset):
    first, second, other = module(tiny_dataset), module(tiny_dataset), module(tiny_dataset, seed=5)
    val = {s.path for s in first.samples("val")}
    assert val == {s.path for s in second.samples("val")}
    assert val != {s.path for s in other.samples("val")}
    samples = first.samples("train") + first.samples("val")
    assert patient_overlap(samples) == {}
    assert len({s.patient_id for s in first.samples("val")}) == 2  # 25 % of 8 patients
    assert first.split_counts()["val"] == {"lesion": 4, "no_lesion": 4}


def test_test_split_and_empty_validation(tiny_dataset):
    dm = module(tiny_dataset)
    assert not dm.has_test
    with pytest.raises(ValueError, match="no test split"):
        dm.test_dataloader()
    with_test = module(tiny_dataset, test_fraction=0.25)
    assert with_test.has_test and len(with_test.samples("test")) == 8
    assert next(iter(with_test.test_dataloader()))[0].shape == (4, 1, 32, 32)
    assert module(tiny_dataset, val_fraction=0.0).val_dataloader() == []


def test_manifest_split_column_is_used_and_leaks_are_warned(tiny_dataset, tmp_path):
    rows = list(csv.DictReader(open(tiny_dataset)))
    manifest = tmp_path / "split.csv"
    with open(manifest, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label", "split", "patient_id"])
        for i, row in enumerate(rows):  # alternate rows: every patient in train and val
            split = "train" if i % 2 else "val"
            writer.writerow([tiny_dataset.parent / row["path"], row["label"], split, row["patient_id"]])
    dm = module(manifest)
    with pytest.warns(UserWarning, match="appear in several splits"):
        dm.setup("fit")
    assert len(dm.samples("val")) == 16 and len(dm.samples("train")) == 16


def test_bad_files_are_skipped_and_counted(tmp_path):
    """(``data/skipped_files`` logs the count: tests/callbacks/test_runtime.py.)"""
    root = png_folders(tmp_path / "data")
    shutil.copy(TRUNCATED, root / "benign" / "broken.dcm")
    with pytest.raises(ImageReadError, match="broken.dcm"):
        module(root, on_bad_file="error").setup("fit")
    dm = module(root)
    with pytest.warns(SkippedFileWarning, match="broken.dcm: truncated"):
        dm.setup("fit")
    assert dm.skipped_files == 1
    assert all(s.path.name != "broken.dcm" for split in ("train", "val") for s in dm.samples(split))


@pytest.mark.parametrize("workers", [0, 2])
def test_files_failing_at_decode_in_loader_workers_are_counted_here(tmp_path, workers):
    """A file whose header reads but whose pixels do not is skipped by whichever process loads it; the data module
    counts it, loaded in this process or in a loader worker, once however many workers and epochs met it."""
    root = png_folders(tmp_path / "data")
    cut = []
    for path in (root / "benign" / "0.png", root / "malignant" / "3.png"):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # header intact, pixels cut
        cut.append(str(path))
    dm = module(root, val_fraction=0.0, num_workers=workers)
    dm.setup("fit")
    assert dm.skipped_files == 0 and dm.bad_paths == set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedFileWarning)  # (the workers' own warnings go to their stderr)
        for _ in range(2):
            assert sum(len(labels) for _, labels in dm.train_dataloader()) == 12
    assert dm.bad_paths == set(cut) and dm.skipped_files == 2


def test_file_failing_only_at_decode_is_replaced_with_a_warning(tmp_path):
    root = png_folders(tmp_path / "data")
    bad = root / "benign" / "0.png"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # header intact, pixels cut
    dm = module(root, val_fraction=0.0)
    dataset = dm.dataset("train")
    index = [s.path for s in dataset.samples].index(bad)
    with pytest.warns(SkippedFileWarning, match="0.png"):
        image, label = dataset[index]
    replacement, replacement_label = dataset[(index + 1) % len(dataset)]
    torch.testing.assert_close(image, replacement)
    assert label == replacement_label
    strict = module(root, val_fraction=0.0, on_bad_file="error").dataset("train")
    with pytest.raises(ImageReadError, match="0.png"):
        strict[index]


def test_decoded_array_cache(tiny_dataset, tmp_path):
    cache_dir = tmp_path / "cache"
    dm = module(tiny_dataset, cache=True, cache_dir=str(cache_dir), window="soft_tissue")
    dataset = dm.dataset("train")
    first = [dataset[i][0] for i in range(len(dataset))]
    entries = sorted(cache_dir.rglob("*.npy"))
    assert len(entries) == len(dataset)
    path = dataset.samples[0].path
    np.testing.assert_array_equal(dataset.load_array(0), read_image(path, window="soft_tissue"))
    stamps = [e.stat().st_mtime_ns for e in entries]
    second = [dataset[i][0] for i in range(len(dataset))]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert [e.stat().st_mtime_ns for e in entries] == stamps  # read back, not rewritten
    # other read options or a modified source file get their own entries
    module(tiny_dataset, cache=True, cache_dir=str(cache_dir)).dataset("train").load_array(0)
    assert len(list(cache_dir.rglob("*.npy"))) == len(dataset) + 1
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dataset.parent, copy)
    other = module(copy / "manifest.csv", cache=True, cache_dir=str(cache_dir), window="soft_tissue").dataset("train")
    before = other.cache.entry(other.samples[0].path)
    os.utime(other.samples[0].path, ns=(1, 1))
    assert other.cache.entry(other.samples[0].path) != before
    # never inside the data folder
    with pytest.raises(ValueError, match="inside the data folder"):
        module(tiny_dataset, cache=True, cache_dir=str(tiny_dataset.parent / "cache"))


def test_memory_cache_decodes_each_file_once_within_its_budget(tiny_dataset, monkeypatch):
    """Items from memory equal items decoded again; each file is decoded once; the budget holds; a transform that
    changes its input in place cannot change what is kept; 0 turns it off; a bad budget is one clear line."""
    from vitlab.data.cache import MemoryCache

    decoded: list[str] = []
    original = io_module.ImageReader.__call__

    def counting(self, path):
        decoded.append(str(path))
        return original(self, path)

    monkeypatch.setattr(io_module.ImageReader, "__call__", counting)
    plain = module(tiny_dataset, memory_cache_mb=0, augment="light")
    cached = module(tiny_dataset, augment="light")
    assert plain.memory is None and cached.memory.budget_bytes == 512 * 2**20
    for split, augmented in (("val", False), ("train", True)):
        expected_ds, ds = plain.dataset(split, augmented=augmented), cached.dataset(split, augmented=augmented)
        for epoch in range(2):  # the augmenting pipelines draw the same random numbers in both
            for i in range(len(ds)):
                (a, la), (b, lb) = expected_ds[i], ds[i]
                assert la == lb and torch.equal(a, b), (split, epoch, i)
    files = [str(s.path) for s in cached.samples("val") + cached.samples("train")]
    assert decoded.count(files[0]) == 2 + 1 and decoded.count(files[-1]) == 2 + 1  # plain: 2 epochs, cached: once
    # validation keeps finished tensors, training the images before augmentation
    kinds = {key[0] for key in cached.memory._items}
    assert kinds == {True, False} and len(cached.memory) == len(files)

    def scribble(image, **kwargs):  # an in-place user transform
        image[...] = 0
        return {"image": image}

    ds = cached.dataset("train", augmented=True)
    ds.transform = scribble
    ds[0]
    assert cached.memory.get((False, False, files[len(cached.samples("val"))]))[0].any()  # the kept image is intact

    small = MemoryCache(budget_bytes=3 * 32 * 32 * 4)  # three 32 x 32 float32 images
    ds = module(tiny_dataset).dataset("train", augmented=True)
    ds.memory = small
    for i in range(len(ds)):
        ds[i]
    assert len(small) == 3 and small.used_bytes <= small.budget_bytes
    with pytest.raises(ValueError, match="memory_cache_mb must be an int >= 0"):
        module(tiny_dataset, memory_cache_mb=-1)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"in_chans": 2}, "in_chans must be 1"),
        ({"frames": "all"}, "frames='all'"),
        ({"val_fraction": 0.6, "test_fraction": 0.4}, "sum to less than 1"),
        ({"on_bad_file": "ignore"}, "on_bad_file"),
        ({"window": "abdomen"}, "valid presets: brain"),
        ({"augment": "heavy"}, "valid: none, light, default, strong"),
        ({"mean": [0.1, 0.2]}, "mean has 2 values"),
        ({"image_size": 0}, "image_size must be a positive int"),
        ({"embedded_kwargs": {"colour": 1}}, "unknown embedded dataset argument"),
    ],
)
def test_bad_arguments_fail_at_construction(tiny_dataset, kwargs, pattern):
    root = None if "embedded_kwargs" in kwargs else tiny_dataset
    with pytest.raises(ValueError, match=pattern):
        MedicalDataModule(root=root if root is None else str(root), **kwargs)


def test_missing_root_is_one_line_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MedicalDataModule(root=str(tmp_path / "missing"))


def test_embedded_dataset_when_root_is_none(monkeypatch, tmp_path):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "vitlab-cache"))
    dm = MedicalDataModule(image_size=32, num_workers=0, embedded_kwargs={"patients": 4, "slices": 2, "size": 32})
    assert dm.root.parent.parent == tmp_path / "vitlab-cache"
    assert dm.class_names == ["lesion", "no_lesion"] and dm.num_classes == 2


def test_lightning_cli_style_construction_from_yaml(tiny_dataset):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MedicalDataModule, "data")
    config = parser.parse_string(f"""
data:
  root: {tiny_dataset}
  image_size: 32
  frames: 0
  mean: [0.5]
  std: [0.25]
  train_transforms:
    class_path: albumentations.Compose
    init_args:
      transforms:
        - class_path: albumentations.VerticalFlip
          init_args: {{p: 1.0}}
""")
    dm = parser.instantiate_classes(config).data
    assert isinstance(dm.user_transforms, A.Compose) and dm.read_options.frames == 0
    image, _ = dm.dataset("train", augmented=True)[0]
    assert image.shape == (1, 32, 32)


def _white_to_nan(image, **kwargs):
    """A user transform that makes NaN from saturated pixels (as a careless log or division would)."""
    return np.where(image >= 1.0, np.float32(np.nan), image).astype(np.float32)


@pytest.mark.parametrize("on_bad_file", ["skip", "error"])
def test_no_non_finite_tensor_reaches_a_batch(tmp_path, on_bad_file):
    """The last guard where samples become batches: a NaN made after decoding is refused, naming the file."""
    root = png_folders(tmp_path / "data")
    for path in root.rglob("*.png"):  # no saturated pixel anywhere ...
        Image.fromarray(np.minimum(np.asarray(Image.open(path)), 200).astype(np.uint8)).save(path)
    white = root / "malignant" / "white.png"  # ... but in this file
    Image.fromarray(np.full((16, 16), 255, np.uint8)).save(white)
    dm = module(root, val_fraction=0.0, on_bad_file=on_bad_file, train_transforms=A.Compose([A.Lambda(image=_white_to_nan)]))
    dm.setup("fit")
    assert dm.skipped_files == 0
    if on_bad_file == "error":
        with pytest.raises(ImageReadError) as error:
            list(dm.train_dataloader())
        message = str(error.value)
        assert message.startswith(f"{white}: ") and "non-finite" in message and "\n" not in message, message
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [batch for _ in range(2) for batch in dm.train_dataloader()]  # two epochs: warned once
    assert all(images.isfinite().all() for images, _ in batches)
    warned = [str(w.message) for w in caught if w.category is SkippedFileWarning]
    assert len(warned) == 1 and str(white) in warned[0] and "non-finite" in warned[0], warned
    assert dm.skipped_files == 1 and dm.bad_paths == {str(white)}


def test_the_finite_check_finds_every_non_finite_value_and_passes_sums_that_overflow():
    """finite_tensor clears a tensor by its sum and checks a non-finite sum element by element: a NaN, +inf, -inf or
    both infinities (whose sum is NaN) anywhere are found; finite values whose float32 sum overflows pass."""
    from vitlab.data.datasets.images import finite_tensor

    generator = torch.Generator().manual_seed(0)
    for shape in [(1, 16, 16), (3, 33, 17)]:
        clean = torch.randn(shape, generator=generator)
        assert finite_tensor("a.png", clean) is clean
        for bad in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]):
            tensor = clean.clone().flatten()
            places = torch.randperm(tensor.numel(), generator=generator)[: len(bad)]
            tensor[places] = torch.tensor(bad)
            with pytest.raises(ImageReadError, match=rf"a.png: {len(bad)} non-finite"):
                finite_tensor("a.png", tensor.view(shape))
    huge = torch.full((3, 8, 8), 3e38)
    assert not torch.isfinite(huge.sum()) and finite_tensor("a.png", huge) is huge
