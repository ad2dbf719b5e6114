"""Volumes as training data (docs/volumes.md): slices and slabs against the arrays they come from, labels from masks,
patient-grouped splits, the bounded volume store, refusals and skip mode, whole volumes."""

from __future__ import annotations

import csv
import gzip
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from vitlab.data.image_data import ImageData
from vitlab.data.layouts import Sample
from vitlab.data import ReadOptions, VolumeError
from vitlab.data.sampling import EpochSampler
from vitlab.data.synthetic import generate_volumes
from vitlab.data.datasets.slices import VolumeStore
from vitlab.data.volume_layouts import check_volumes
from vitlab.data.volume_options import VolumeOptions

AFFINE = np.array([[0.8, 0.1, 0, -20], [0, 0.7, 0.2, 5], [0, 0, 2.5, 30], [0, 0, 0, 1]])  # non-diagonal


def nifti(path: Path, array: np.ndarray, affine: np.ndarray = AFFINE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(np.asarray(array, dtype=np.float32), affine), path)
    return path


def lesion_volume(rng, shape=(16, 16, 8), present=(2, 3)) -> tuple[np.ndarray, np.ndarray]:
    array = rng.uniform(0, 1000, shape).astype(np.float32)
    mask = np.zeros(shape, np.uint8)
    for k in present:
        mask[4:7, 5:9, k] = 1
    return array, mask


def manifest(root: Path, rows: list[dict]) -> Path:
    path = root / "manifest.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def windowed(array: np.ndarray) -> np.ndarray:
    """The window centre 500 / width 1000 by hand: x / 1000 clipped to [0, 1]."""
    return np.clip(array / 1000.0, 0.0, 1.0)


def test_slab_channels_are_the_neighbouring_slices_with_ends_repeated(tmp_path):
    rng = np.random.default_rng(0)
    array = rng.uniform(-100, 1100, (16, 12, 6)).astype(np.float32)
    path = nifti(tmp_path / "v.nii.gz", array)
    store = VolumeStore(VolumeOptions("slab", 2, volumes_in_memory=1), ReadOptions(window_center=500, window_width=1000))
    for k in range(6):
        slab = store.image(Sample(path, "a", slice=k))  # (J, I, 5)
        assert slab.shape == (12, 16, 5)
        for c, kk in enumerate(range(k - 2, k + 3)):
            np.testing.assert_allclose(slab[:, :, c], windowed(array[:, :, min(max(kk, 0), 5)]).T, atol=1e-6)
    assert store.decodes == 1  # one volume read for every slab
    single = VolumeStore(VolumeOptions("slice"), ReadOptions(window_center=500, window_width=1000)).image(Sample(path, "a", slice=3))
    np.testing.assert_allclose(single[:, :, 0], windowed(array[:, :, 3]).T, atol=1e-6)


def test_slabs_through_the_data_module_labels_from_masks_and_patient_split(tmp_path):
    rng = np.random.default_rng(1)
    rows, arrays = [], {}
    for p in range(8):
        for visit in range(2):  # two volumes per patient: both must land in one split
            array, mask = lesion_volume(rng, present=(2, 3) if p % 2 == 0 else ())
            name = f"p{p}_{visit}"
            nifti(tmp_path / f"{name}.nii.gz", array)
            nifti(tmp_path / f"{name}_mask.nii.gz", mask)
            arrays[name] = array
            rows.append({"path": f"{name}.nii.gz", "mask": f"{name}_mask.nii.gz", "label": "x", "patient_id": f"P{p}"})
    data = ImageData(str(manifest(tmp_path, rows)), image_size=16, sample="slab", slab_radius=1, slice_labels="mask",
                     classes=["no_lesion", "lesion"], window_center=500, window_width=1000, mean=[0.5], std=[0.25],
                     augment="none", val_fraction=0.25, batch_size=4)
    assert data.in_chans == 3 and data.class_names == ["no_lesion", "lesion"]
    data.setup()
    splits = {}
    for split in ("train", "val"):
        for s in data.samples(split):
            splits.setdefault(s.patient_id, set()).add(split)
            assert s.label == ("lesion" if s.patient_id in ("P0", "P2", "P4", "P6") and s.slice in (2, 3) else "no_lesion")
    assert all(len(v) == 1 for v in splits.values()) and len(splits) == 8
    assert sum(len(data.samples(s)) for s in ("train", "val")) == 16 * 8
    fewer = ImageData(str(manifest(tmp_path, rows)), image_size=16, sample="slice", slice_labels="mask", min_mask_voxels=13)
    kept, _ = check_volumes(fewer._layout.samples, fewer.volume_options)
    assert {s.label for s in kept} == {"absent"}  # each lesion slice holds 3 x 4 = 12 voxels
    dataset = data.dataset("val")
    for index in (0, 5, 7):
        sample = dataset.samples[index]
        tensor, label = dataset[index]
        array = arrays[sample.path.name.split(".")[0]]
        for c, kk in enumerate(range(sample.slice - 1, sample.slice + 2)):
            expected = (windowed(array[:, :, min(max(kk, 0), 7)]).T - 0.5) / 0.25
            np.testing.assert_allclose(tensor[c].numpy(), expected, atol=1e-5)
        assert label == data.class_names.index(sample.label)


def test_the_store_holds_a_bounded_number_of_volumes_and_reads_each_once_per_epoch(tmp_path):
    rng = np.random.default_rng(2)
    for c in ("a", "b"):
        for p in range(6):
            nifti(tmp_path / c / f"{p}.nii.gz", rng.uniform(0, 1000, (16, 16, 5)))
    data = ImageData(str(tmp_path), image_size=16, sample="slice", volumes_in_memory=2, memory_cache_mb=0,
                     augment="light", val_fraction=0.25, batch_size=4)
    data.setup()
    train_volumes = {s.path for s in data.samples("train")}
    loader = data.train_dataloader()
    for epoch in range(2):
        labels = [int(y) for _, ys in loader for y in ys]
        assert len(labels) == 5 * len(train_volumes)
        assert data.volumes.decodes == (epoch + 1) * len(train_volumes)  # once per epoch, whatever the order
    assert data.volumes.most_held == 2
    # without blocks a shuffled slice order would reread volumes: the bound is what the block order buys
    unordered = VolumeStore(data.volume_options, data.read_options)  # (volumes_in_memory 2)
    samples = data.samples("train")
    for i in torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist():
        unordered.image(samples[i])
    assert unordered.decodes > 2 * len(train_volumes)


def test_block_order_is_a_seeded_permutation_visiting_groups_block_by_block():
    groups = [g for g in range(7) for _ in range(3 + g % 2)]
    sampler = EpochSampler(len(groups), seed=3, groups=groups, block=2)
    sampler.set_epoch(0)
    order = [i for i, _ in sampler]
    assert sorted(order) == list(range(len(groups))) and order == [i for i, _ in sampler]
    held, loads = [], 0  # a store of 2 groups, least recently used out, reads each group once
    for i in order:
        if groups[i] in held:
            held.remove(groups[i])
        else:
            loads += 1
            held = held[-1:]
        held.append(groups[i])
    assert loads == 7
    plain = EpochSampler(len(groups), seed=3)  # (without groups: one shuffle, many more loads)
    assert sorted(i for i, _ in plain) == list(range(len(groups)))
    other = EpochSampler(len(groups), seed=3, groups=groups, block=2)
    other.set_epoch(1)
    assert [i for i, _ in other] != order


def test_dicom_series_and_nifti_twins_give_the_same_slabs(tmp_path):
    csv_path = generate_volumes(tmp_path / "v", patients=4, size=16, slices=5, seed=4)
    kwargs = dict(image_size=16, sample="slab", slab_radius=1, window="soft_tissue", augment="none", val_fraction=0.5, batch_size=4)
    from_nifti = ImageData(str(csv_path), **kwargs)
    from_dicom = ImageData(str(csv_path.parent / "manifest_dicom.csv"), **kwargs)
    for split in ("train", "val"):
        a, b = from_nifti.dataset(split), from_dicom.dataset(split)
        assert [(s.patient_id, s.slice, s.label) for s in a.samples] == [(s.patient_id, s.slice, s.label) for s in b.samples]
        for i in range(0, len(a), 3):
            torch.testing.assert_close(a[i][0], b[i][0], atol=1e-5, rtol=0)
    # class folders of series: root/<class>/<patient>/ holds DICOM files; the patient id is the DICOM PatientID
    root = tmp_path / "folders"
    for row in csv.DictReader(open(csv_path.parent / "manifest_dicom.csv")):
        shutil.copytree(csv_path.parent / row["path"], root / row["label"] / Path(row["path"]).name)
    folders = ImageData(str(root), **kwargs)
    assert sorted({s.patient_id for s in folders._prepare()}) == sorted({s.patient_id for s in from_dicom._prepare()})


def test_bad_volumes_are_skipped_whole_or_refused_in_one_line(tmp_path):
    rng = np.random.default_rng(5)
    for c in ("a", "b"):
        for p in range(3):
            nifti(tmp_path / c / f"{p}.nii.gz", rng.uniform(0, 1000, (8, 8, 4)))
    bad_nan = rng.uniform(0, 1000, (8, 8, 4))
    bad_nan[1, 2, 3] = np.nan
    nifti(tmp_path / "a" / "nan.nii.gz", bad_nan)
    good = (tmp_path / "a" / "0.nii.gz").read_bytes()
    (tmp_path / "b" / "truncated.nii.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "b" / "text.nii").write_text("not a volume\n")
    data = ImageData(str(tmp_path), image_size=8, sample="slice", val_fraction=0.34, augment="none")
    data.setup()
    used = {s.path.name for split in ("train", "val") for s in data.samples(split)}
    assert used == {"0.nii.gz", "1.nii.gz", "2.nii.gz"} and data.skipped_files == 3
    with pytest.raises(VolumeError) as error:
        ImageData(str(tmp_path), image_size=8, sample="slice", on_bad_file="error")._prepare()
    message = str(error.value)
    assert "\n" not in message and "nan.nii.gz" in message and "NaN" in message


def test_mask_that_does_not_fit_its_image_names_both_grids(tmp_path):
    rng = np.random.default_rng(6)
    array, mask = lesion_volume(rng)
    nifti(tmp_path / "v.nii.gz", array)
    nifti(tmp_path / "m.nii.gz", mask[:, :, :6])
    nifti(tmp_path / "shifted.nii.gz", mask, AFFINE + np.diag([0, 0, 0.5, 0]))
    nifti(tmp_path / "fractional.nii.gz", mask * 0.5)
    rows = [{"path": "v.nii.gz", "mask": m, "label": "a"} for m in ("m.nii.gz", "shifted.nii.gz", "fractional.nii.gz")]
    for row, expected in zip(rows, ("(16, 16, 6) vs (16, 16, 8)", "affine", "not labels")):
        data = ImageData(str(manifest(tmp_path, [row, {**row, "label": "b"}])), sample="slice", slice_labels="mask", on_bad_file="error")
        with pytest.raises(VolumeError, match=r"mask .* of .*v\.nii\.gz") as error:
            data._prepare()
        assert expected in str(error.value) and "\n" not in str(error.value)


def test_volume_options_are_checked_in_one_line(tmp_path):
    nifti(tmp_path / "a" / "0.nii.gz", np.zeros((8, 8, 3)))
    nifti(tmp_path / "b" / "0.nii.gz", np.ones((8, 8, 3)))
    cases = [
        (dict(sample="slab", slab_radius=2, in_chans=3), "in_chans 3"),
        (dict(sample="slice", slab_radius=-1), "slab_radius"),
        (dict(sample="cube"), "data.sample"),
        (dict(slice_labels="mask"), "apply to volumes"),
        (dict(sample="volume"), "volume_size"),
        (dict(sample="slice", intensity="max"), "data.intensity"),
        (dict(sample="slice", volumes_in_memory=0), "volumes_in_memory"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(ValueError, match=expected):
            ImageData(str(tmp_path), **kwargs)


def test_whole_volumes_resampled_and_cropped(tmp_path):
    rng = np.random.default_rng(7)
    arrays = {}
    for c in ("a", "b"):
        for p in range(2):
            arrays[(c, p)] = rng.uniform(0, 1000, (12, 10, 6)).astype(np.float32)
            nifti(tmp_path / c / f"{p}.nii.gz", arrays[(c, p)], np.diag([0.8, 0.8, 2.5, 1.0]))
    native = ImageData(str(tmp_path), sample="volume", volume_size=[12, 10, 6], window_center=500, window_width=1000,
                       val_fraction=0.5, batch_size=2)
    dataset = native.dataset("train")
    for i, sample in enumerate(dataset.samples):
        tensor, _ = dataset[i]
        expected = windowed(arrays[(sample.path.parent.name, int(sample.path.name[0]))])
        np.testing.assert_allclose(tensor[0].numpy(), expected, atol=1e-6)
    images, labels = next(iter(ImageData(str(tmp_path), sample="volume", spacing=[1.6, 1.6, 2.5], volume_size=[8, 8, 8],
                                         val_fraction=0.5, batch_size=2).train_dataloader()))
    assert images.shape == (2, 1, 8, 8, 8) and labels.tolist() in ([0, 1], [1, 0])
    assert torch.isfinite(images).all()


def test_unlabelled_volumes_and_a_gzip_check(tmp_path):
    rng = np.random.default_rng(8)
    for p in range(3):
        nifti(tmp_path / "scans" / f"s{p}" / "ct.nii.gz", rng.uniform(0, 1000, (8, 8, 4)))
    data = ImageData(str(tmp_path / "scans"), sample="slab", slab_radius=1, labels=False, image_size=8, batch_size=4)
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 8, 8) and (labels == -1).all() and len(data.samples("train")) == 12
    assert gzip.open(tmp_path / "scans" / "s0" / "ct.nii.gz").read(4)  # (the data is untouched)


def patch_volumes(root: Path, patients: int = 4, shape=(20, 18, 10)) -> Path:
    """Volumes with one small lesion each (a 3 x 3 x 2 block at a random place) and their label maps, in a manifest."""
    rng = np.random.default_rng(11)
    rows = []
    for p in range(patients):
        array = rng.uniform(0, 1000, shape).astype(np.float32)
        mask = np.zeros(shape, np.uint8)
        corner = [int(rng.integers(0, n - s)) for n, s in zip(shape, (3, 3, 2))]
        mask[corner[0]:corner[0] + 3, corner[1]:corner[1] + 3, corner[2]:corner[2] + 2] = 1
        nifti(root / f"v{p}.nii.gz", array, np.diag([0.8, 0.8, 2.5, 1.0]))
        nifti(root / f"m{p}.nii.gz", mask, np.diag([0.8, 0.8, 2.5, 1.0]))
        rows.append({"path": f"v{p}.nii.gz", "mask": f"m{p}.nii.gz", "label": "ab"[p % 2], "patient_id": f"P{p}"})
    return manifest(root, rows)


def test_random_patches_are_blocks_of_the_whole_volume_keyed_by_seed_epoch_index(tmp_path):
    from vitlab.data.dense_data import DenseImageData
    from vitlab.data.sampling import KeyedAugmentation

    root = patch_volumes(tmp_path)
    common = dict(sample="volume", volume_size=[20, 18, 10], window_center=500, window_width=1000, val_fraction=0.5, seed=3)
    whole = DenseImageData(str(root), **common).dataset("train")
    data = DenseImageData(str(root), **common, patch_size=[8, 8, 4], patch_foreground=1.0)
    patches = KeyedAugmentation(data.dataset("train", augmented=True), seed=3)
    assert data.dataset("val")[0][0].shape == (1, 20, 18, 10)  # validation keeps whole volumes
    seen = set()
    for index in range(len(whole)):
        image, target = whole[index]
        for epoch in range(3):
            patch, patch_target = patches[index, epoch]
            assert patch.shape == (1, 8, 8, 4) and patch_target["mask"].shape == (8, 8, 4)
            assert patch_target["mask"].sum() > 0  # patch_foreground 1: centred on the lesion
            # the patch is the block of the whole volume (values and labels) at some origin
            hits = [(i, j, k) for i in range(13) for j in range(11) for k in range(7)
                    if torch.equal(image[:, i:i + 8, j:j + 8, k:k + 4], patch)]
            assert len(hits) == 1
            i, j, k = hits[0]
            assert torch.equal(target["mask"][i:i + 8, j:j + 8, k:k + 4], patch_target["mask"])
            seen.add((index, hits[0]))
            again, _ = KeyedAugmentation(data.dataset("train", augmented=True), seed=3)[index, epoch]  # a fresh worker
            assert torch.equal(again, patch)
    assert len(seen) > len(whole)  # the epochs draw different patches


def test_patch_foreground_is_the_share_of_patches_centred_on_a_lesion(tmp_path):
    from vitlab.data.dense_data import DenseImageData
    from vitlab.data.sampling import KeyedAugmentation

    root = patch_volumes(tmp_path, shape=(40, 40, 12))
    share = {}
    for fraction in (0.0, 0.5):
        data = DenseImageData(str(root), sample="volume", volume_size=[40, 40, 12], patch_size=[8, 8, 4], patch_foreground=fraction,
                              window_center=500, window_width=1000, val_fraction=0.5)
        patches = KeyedAugmentation(data.dataset("train", augmented=True), seed=0)
        hits = [bool(patches[i, e][1]["mask"][4, 4, 2]) for i in range(len(patches)) for e in range(100)]  # the centre voxel
        share[fraction] = sum(hits) / len(hits)
    # uniform placement hits an 18-voxel lesion in a 40 x 40 x 12 volume about 18 / 19200 of the time
    assert share[0.0] < 0.05 and 0.4 < share[0.5] < 0.6, share


def test_patches_without_a_volume_size_and_bad_patch_options(tmp_path):
    from vitlab.data.dense_data import DenseImageData

    root = patch_volumes(tmp_path)
    data = DenseImageData(str(root), sample="volume", volume_size=None, patch_size=[24, 8, 4], window_center=500,
                          window_width=1000, val_fraction=0.5, batch_size=2)
    images, targets = next(iter(data.train_dataloader()))
    assert images.shape == (2, 1, 24, 8, 4)  # i padded from 20 to the patch's 24
    val = list(data.val_dataloader())
    assert [batch[0].shape for batch in val] == [(1, 1, 20, 18, 10)] * 2  # whole volumes, one per batch
    cases = [(dict(sample="volume", volume_size=[20, 18, 10], patch_size=[24, 8, 4]), r"data.patch_size \[24, 8, 4\] is larger than data.volume_size"),
             (dict(sample="slab", patch_size=[8, 8, 4]), "data.patch_size applies to data.sample volume"),
             (dict(sample="volume", volume_size=[20, 18, 10], patch_size=[8, 8]), "data.patch_size must be 3 positive voxel counts"),
             (dict(sample="volume", volume_size=[20, 18, 10], patch_size=[8, 8, 4], patch_foreground=1.5), r"data.patch_foreground must be a probability in \[0, 1\]"),
             (dict(sample="volume", volume_size=None), r"needs data.volume_size: .*or null with data.patch_size"),
             (dict(patch_size=[8, 8, 4]), "data.patch_size apply to volumes|apply to volumes")]
    for kwargs, expected in cases:
        with pytest.raises(ValueError, match=expected):
            DenseImageData(str(root), **kwargs)


def test_volume_flips_are_keyed_by_seed_epoch_and_index():
    """data.volume_flip: a training volume and its label map flipped along the same axes, the same for the same
    (seed, epoch, index) whatever the process, different across epochs; validation volumes never flipped."""
    from itertools import combinations

    from vitlab.data.datamodule import DenseDataModule
    from vitlab.data.sampling import KeyedAugmentation

    kwargs = dict(root=None, embedded_kwargs={"patients": 4, "size": 32, "slices": 8}, sample="volume",
                  volume_size=[32, 32, 8], mask_classes=["lesion"], window="soft_tissue", num_workers=0, batch_size=2)
    plain, flipped = DenseDataModule(**kwargs), DenseDataModule(**kwargs, volume_flip=True)
    plain.setup("fit")
    flipped.setup("fit")
    base = plain.dataset("train", augmented=True)
    keyed = KeyedAugmentation(flipped.dataset("train", augmented=True), seed=0)
    again = KeyedAugmentation(flipped.dataset("train", augmented=True), seed=0)  # (another loader process)
    subsets = [list(c) for n in range(4) for c in combinations(range(3), n)]
    seen = set()
    for epoch in range(4):
        for index in range(len(base)):
            image, target = base[index]
            out, out_target = keyed[(index, epoch)]
            other, _ = again[(index, epoch)]
            assert torch.equal(out, other)
            axes = [a for a in subsets if torch.equal(image.flip([i + 1 for i in a]) if a else image, out)][0]
            assert torch.equal(target["mask"].flip(axes) if axes else target["mask"], out_target["mask"])
            seen.add(tuple(axes))
    assert len(seen) > 2
    val_plain, val_flipped = plain.dataset("val"), flipped.dataset("val")
    for index in range(len(val_plain)):
        assert torch.equal(val_plain[index][0], val_flipped[index][0])
    with pytest.raises(ValueError, match="volume_flip"):
        DenseDataModule(**{**kwargs, "sample": "slice", "volume_size": None}, volume_flip=True)


def test_volume_intensity_jitter_is_keyed_and_follows_its_formula():
    """data.volume_intensity: each training item is the plain item * (1 + u) + v, u and v recomputed here from the
    keyed generator's draws (after the 3 flip draws), the same for the same (seed, epoch, index), with about the
    configured share of items scaled / shifted; validation volumes untouched; bad keys or values in one line."""
    import numpy as np

    from vitlab.data.datamodule import DenseDataModule
    from vitlab.data.sampling import KeyedAugmentation, mixed_seed

    jitter = {"scale": 0.3, "scale_prob": 0.5, "shift": 0.2, "shift_prob": 0.75}
    kwargs = dict(root=None, embedded_kwargs={"patients": 4, "size": 32, "slices": 8}, sample="volume",
                  volume_size=[32, 32, 8], mask_classes=["lesion"], window="soft_tissue", num_workers=0, batch_size=2)
    plain, jittered = DenseDataModule(**kwargs), DenseDataModule(**kwargs, volume_flip=True, volume_intensity=jitter)
    plain.setup("fit")
    jittered.setup("fit")
    base = plain.dataset("train", augmented=True)
    keyed = KeyedAugmentation(jittered.dataset("train", augmented=True), seed=3)
    again = KeyedAugmentation(jittered.dataset("train", augmented=True), seed=3)
    scaled = shifted = 0
    for epoch in range(6):
        for index in range(len(base)):
            image, target = base[index]
            out, out_target = keyed[(index, epoch)]
            assert torch.equal(out, again[(index, epoch)][0])
            draws = np.random.default_rng(mixed_seed(3, epoch, index)).random(7)  # flips (3), then scale?, u, shift?, v
            axes = [a for a in range(3) if draws[a] < 0.5]
            factor = 1 + (2 * draws[4] - 1) * 0.3 if draws[3] < 0.5 else 1.0
            offset = (2 * draws[6] - 1) * 0.2 if draws[5] < 0.75 else 0.0
            expected = image * factor + offset
            torch.testing.assert_close(out, expected.flip([a + 1 for a in axes]) if axes else expected)
            assert torch.equal(out_target["mask"], target["mask"].flip(axes) if axes else target["mask"])
            scaled, shifted = scaled + (factor != 1.0), shifted + (offset != 0.0)
    n = 6 * len(base)
    assert 0.2 < scaled / n < 0.8 and shifted / n > 0.5
    for index in range(len(plain.dataset("val"))):
        assert torch.equal(plain.dataset("val")[index][0], jittered.dataset("val")[index][0])
    for bad, message in (({"scale": 0.1, "gamma": 1.0}, r"takes scale, scale_prob, shift, shift_prob .*\['gamma'\]"),
                         ({"shift_prob": 1.5}, r"data.volume_intensity.shift_prob must be a number in \[0, 1\], got 1.5"),
                         ({"scale": -0.1}, r"data.volume_intensity.scale must be a number >= 0, got -0.1")):
        with pytest.raises(ValueError, match=message):
            DenseDataModule(**kwargs, volume_intensity=bad)
    with pytest.raises(ValueError, match="volume_intensity jitters whole volumes"):
        DenseDataModule(**{**kwargs, "sample": "slice", "volume_size": None}, volume_intensity=jitter)


def test_class_folders_with_a_masks_tree_label_slices_by_their_masks(tmp_path):
    """slice_labels: mask on class folders: each volume's label map at the same relative path under masks/."""
    rng = np.random.default_rng(3)
    root = tmp_path / "data"
    for p in range(6):
        cls = "lesion" if p % 2 == 0 else "clear"
        array, mask = lesion_volume(rng, present=(2, 3) if p % 2 == 0 else ())
        nifti(root / cls / f"p{p}.nii.gz", array)
        nifti(root / "masks" / cls / f"p{p}.nii.gz", mask)
    data = ImageData(str(root), image_size=16, sample="slice", slice_labels="mask", window_center=500,
                     window_width=1000, augment="none", val_fraction=0.34, batch_size=4)
    data.setup()
    samples = [s for split in ("train", "val") for s in data.samples(split)]
    assert len(samples) == 6 * 8 and data.class_names == ["absent", "present"]
    for s in samples:
        lesion = s.path.parent.name == "lesion" and s.slice in (2, 3)
        assert s.label == ("present" if lesion else "absent"), (s.path, s.slice)
    (root / "masks" / "clear" / "p1.nii.gz").unlink()  # a volume without its label map: skipped, in one line
    again = ImageData(str(root), image_size=16, sample="slice", slice_labels="mask", window_center=500,
                      window_width=1000, augment="none", val_fraction=0.34, batch_size=4)
    again.setup()
    assert sum(len(again.samples(split)) for split in ("train", "val")) == 5 * 8
