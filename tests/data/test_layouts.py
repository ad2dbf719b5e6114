"""vitlab.data.layouts: class folders, manifests, header checks and the patient-grouped split."""

from __future__ import annotations

import shutil
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file

from vitlab.data import ImageReadError
from vitlab.data.layouts import Sample, SkippedFileWarning, check_files, patient_overlap, scan, split_by_patient

CT = get_testdata_file("CT_small.dcm", download=False)
TRUNCATED = get_testdata_file("MR_truncated.dcm", download=False)


def write_png(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8), dtype=np.uint8)).save(path)
    return path


def write_dicom(path: Path, patient_id: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = pydicom.dcmread(CT)
    ds.PatientID = patient_id
    ds.save_as(path)
    return path


def write_manifest(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- class folders
def test_class_folders_recursive_with_dicom_without_extension(tmp_path):
    write_png(tmp_path / "benign" / "a.png")
    write_png(tmp_path / "benign" / "deep" / "er" / "b.PNG")
    write_dicom(tmp_path / "malignant" / "IM0001", "P1")  # no extension, DICM preamble
    write_dicom(tmp_path / "malignant" / "s" / "c.dcm", "P2")
    (tmp_path / "malignant" / "notes.txt").write_text("ignored")
    (tmp_path / "malignant" / ".hidden.png").write_bytes(b"ignored")
    (tmp_path / "malignant" / "README").write_text("no preamble: ignored")
    layout = scan(tmp_path)
    assert layout.class_names == ["benign", "malignant"]
    found = {(s.path.relative_to(tmp_path).as_posix(), s.label) for s in layout.samples}
    assert found == {
        ("benign/a.png", "benign"), ("benign/deep/er/b.PNG", "benign"),
        ("malignant/IM0001", "malignant"), ("malignant/s/c.dcm", "malignant"),
    }  # fmt: skip
    assert all(s.path.is_absolute() and s.patient_id is None and s.split is None for s in layout.samples)


def test_class_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        scan(tmp_path / "missing")
    write_png(tmp_path / "a" / "x.png")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("no images")
    with pytest.raises(ValueError, match=r"class folder .*b contains no image files"):
        scan(tmp_path)
    shutil.rmtree(tmp_path / "b")
    with pytest.raises(ValueError, match=r"found 1 class\(es\) \['a'\]; need at least two"):
        scan(tmp_path)
    (tmp_path / "manifest.csv").write_text("path,label\n")
    with pytest.raises(ValueError, match="pass its path as root"):
        scan(tmp_path)


def test_classes_argument_fixes_order_and_rejects_others(tmp_path):
    for name in ("cat", "dog"):
        write_png(tmp_path / name / "x.png")
    assert scan(tmp_path, classes=["dog", "cat"]).class_names == ["dog", "cat"]
    with pytest.raises(ValueError, match=r"\['dog'\] are not among the classes \['cat', 'fish'\]"):
        scan(tmp_path, classes=["cat", "fish"])


# ---------------------------------------------------------------- manifests
def test_manifest_paths_splits_and_patients(tmp_path):
    write_png(tmp_path / "img" / "a.png")
    write_png(tmp_path / "img" / "b.png")
    outside = write_png(tmp_path.parent / f"{tmp_path.name}-outside" / "c.png")
    manifest = write_manifest(tmp_path / "m.csv", [
        "path,label,split,patient_id,comment",
        "img/a.png,tumour,train,p1,anything",
        "img/b.png, normal ,val,,",
        "",
        f"{outside},normal,test,p3,",
    ])  # fmt: skip
    layout = scan(manifest)
    assert layout.has_split_column and layout.class_names == ["normal", "tumour"]
    assert [(s.path, s.label, s.split, s.patient_id) for s in layout.samples] == [
        ((tmp_path / "img" / "a.png").resolve(), "tumour", "train", "p1"),
        ((tmp_path / "img" / "b.png").resolve(), "normal", "val", None),
        (outside.resolve(), "normal", "test", "p3"),
    ]


@pytest.mark.parametrize(
    "lines, pattern",
    [
        (["file,label", "a.png,x"], r"lacks column\(s\) \['path'\]"),
        (["path,label", "a.png,x,extra"], r"line 2: expected 2 fields, got 3"),
        (["path,label", "a.png,x", "a.png,"], r"line 3: empty 'label'"),
        (["path,label,split", "a.png,x,train", "a.png,y,training"], r"line 3: split 'training' is not one of"),
        (["path,label,split", "a.png,x,train", "a.png,y,"], r"line 3: split '' is not one of"),
        ([], r"is empty"),
        (["path,label"], r"lists no usable image files"),
    ],
)
def test_manifest_errors_name_the_line(tmp_path, lines, pattern):
    write_png(tmp_path / "a.png")
    with pytest.raises(ValueError, match=pattern) as error:
        scan(write_manifest(tmp_path / "m.csv", lines))
    assert "\n" not in str(error.value)


def test_manifest_label_not_among_classes(tmp_path):
    write_png(tmp_path / "a.png")
    manifest = write_manifest(tmp_path / "m.csv", ["path,label", "a.png,x", "a.png,y", "a.png,z"])
    with pytest.raises(ValueError, match=r"\['z'\] are not among the classes \['x', 'y'\]"):
        scan(manifest, classes=["x", "y"])


def test_manifest_missing_file_error_or_skip(tmp_path):
    write_png(tmp_path / "a.png")
    write_png(tmp_path / "b.png")
    manifest = write_manifest(tmp_path / "m.csv", ["path,label", "a.png,x", "gone.png,x", "b.png,y", "c.bmp,y"])
    with pytest.raises(FileNotFoundError, match=r"m.csv line 3: .*gone.png does not exist"):
        scan(manifest, on_bad_file="error")
    with pytest.warns(SkippedFileWarning) as record:
        layout = scan(manifest, on_bad_file="skip")
    assert [s.path.name for s in layout.samples] == ["a.png", "b.png"]
    assert len(layout.skipped) == 2 and len(record) == 2
    assert "gone.png" in layout.skipped[0] and "c.bmp" in layout.skipped[1]


# ---------------------------------------------------------------- header check
def test_check_files_patient_ids_and_bad_files(tmp_path):
    good = [write_dicom(tmp_path / "a" / f"{i}.dcm", f"PAT{i % 2}") for i in range(3)]
    png = write_png(tmp_path / "b" / "x.png")
    shutil.copy(TRUNCATED, tmp_path / "b" / "broken.dcm")
    layout = scan(tmp_path)
    with pytest.raises(ImageReadError, match=r"broken.dcm: truncated pixel data"):
        check_files(layout.samples, on_bad_file="error")
    with pytest.warns(SkippedFileWarning, match="broken.dcm"):
        kept, skipped = check_files(layout.samples, on_bad_file="skip")
    assert len(skipped) == 1 and "broken.dcm" in skipped[0]
    ids = {s.path: s.patient_id for s in kept}
    assert ids == {good[0]: "PAT0", good[1]: "PAT1", good[2]: "PAT0", png: str(png)}
    # a manifest's patient_id wins over the DICOM tag
    assert check_files([Sample(good[0], "a", "from-manifest")])[0][0].patient_id == "from-manifest"


# ---------------------------------------------------------------- split
def random_samples(seed: int, patients: int = 80) -> list[Sample]:
    """Patients with 1-6 images; labels from 3 classes with unequal frequencies, some patients mixed."""
    rng = np.random.default_rng(seed)
    samples = []
    for p in range(patients):
        main = rng.choice(["a", "b", "c"], p=[0.5, 0.3, 0.2])
        for i in range(rng.integers(1, 7)):
            label = main if rng.random() < 0.85 else rng.choice(["a", "b", "c"])
            samples.append(Sample(Path(f"/d/p{p}_{i}.png"), str(label), f"p{p}"))
    return samples


def test_split_has_no_patient_leakage_and_is_deterministic():
    samples = random_samples(0)
    split = split_by_patient(samples, val_fraction=0.2, test_fraction=0.1, seed=7)
    assert patient_overlap(split) == {}
    assert Counter(s.split for s in split).keys() == {"train", "val", "test"}
    assert [s.path for s in split] == [s.path for s in samples]  # order kept
    again = split_by_patient(samples[::-1], val_fraction=0.2, test_fraction=0.1, seed=7)
    assert {s.path: s.split for s in again} == {s.path: s.split for s in split}  # independent of input order
    other = split_by_patient(samples, val_fraction=0.2, test_fraction=0.1, seed=8)
    assert {s.path: s.split for s in other} != {s.path: s.split for s in split}


def test_split_is_stratified_by_patient_label():
    samples = random_samples(1, patients=120)
    split = split_by_patient(samples, val_fraction=0.25, test_fraction=0.0, seed=3)
    per_patient: dict[str, tuple[str, Counter]] = {}
    for s in split:
        per_patient.setdefault(s.patient_id, (s.split, Counter()))[1][s.label] += 1
    by_stratum = defaultdict(Counter)
    for split_name, counts in per_patient.values():
        majority = min(counts, key=lambda label: (-counts[label], label))
        by_stratum[majority][split_name] += 1
    for label, counts in by_stratum.items():
        n = sum(counts.values())
        assert counts["val"] == round(0.25 * n), (label, counts)
        assert "test" not in counts


def test_split_small_strata_keep_a_training_patient():
    samples = [Sample(Path(f"/d/{p}.png"), "rare" if p < 2 else "common", f"p{p}") for p in range(12)]
    split = {s.patient_id: s.split for s in split_by_patient(samples, val_fraction=0.1, test_fraction=0.1, seed=0)}
    assert sorted(split[p] for p in ("p0", "p1")) == ["train", "val"]  # 2 patients: one each, none to test
    assert Counter(split.values())["train"] >= 9
    only = split_by_patient(samples[:1], val_fraction=0.5, test_fraction=0.3, seed=0)
    assert only[0].split == "train"
    all_train = split_by_patient(samples, val_fraction=0.0, test_fraction=0.0, seed=0)
    assert {s.split for s in all_train} == {"train"}
