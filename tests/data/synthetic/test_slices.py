"""vitlab.data.synthetic: deterministic, readable CT DICOM with meaningful, balanced lesion labels."""

from __future__ import annotations

import csv
import functools
import multiprocessing
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian
from scipy import ndimage

from vitlab.data import embedded_dataset, generate, modality_values, read_image
from vitlab.data.synthetic import main, slices

SMALL = dict(patients=4, slices=4, size=48)


def rows(manifest: Path) -> list[dict]:
    with open(manifest, newline="") as f:
        return list(csv.DictReader(f))


def test_deterministic_by_seed(tmp_path):
    a, b = generate(tmp_path / "a", seed=3, **SMALL), generate(tmp_path / "b", seed=3, **SMALL)
    c = generate(tmp_path / "c", seed=4, **SMALL)
    assert a.read_bytes() == b.read_bytes()
    files = sorted(p.relative_to(a.parent) for p in a.parent.rglob("*.dcm"))
    assert len(files) == 16
    assert all((a.parent / f).read_bytes() == (b.parent / f).read_bytes() for f in files)
    assert not np.array_equal(modality_values(a.parent / files[0]), modality_values(c.parent / files[0]))


def test_files_are_ct_dicom_with_patient_ids_and_tags(tmp_path):
    manifest = generate(tmp_path / "d", seed=0, **SMALL)
    table = rows(manifest)
    assert list(table[0]) == ["path", "label", "patient_id", "mask"]
    slices_per_patient = Counter(r["patient_id"] for r in table)
    assert len(slices_per_patient) == 4 and set(slices_per_patient.values()) == {4}
    for row in table:
        ds = pydicom.dcmread(manifest.parent / row["path"])  # strict read: preamble and file meta present
        assert ds.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
        assert ds.SOPClassUID == CTImageStorage == ds.file_meta.MediaStorageSOPClassUID
        assert ds.Modality == "CT" and ds.PatientID == row["patient_id"]
        assert ds.pixel_array.dtype == np.int16 and ds.pixel_array.shape == (48, 48)
        assert (float(ds.RescaleSlope), float(ds.RescaleIntercept)) == (1.0, -1024.0)
        assert (float(ds.WindowCenter), float(ds.WindowWidth)) == (40.0, 400.0)
    uids = [pydicom.dcmread(manifest.parent / r["path"]).SOPInstanceUID for r in table]
    assert len(set(uids)) == len(uids)


def test_hounsfield_units_look_like_ct(tmp_path):
    manifest = generate(tmp_path / "d", seed=1, patients=2, slices=2, size=64)
    hu = modality_values(manifest.parent / rows(manifest)[0]["path"])
    assert abs(np.median(hu[:4, :4]) - (-1000)) < 30  # air in the corner
    body = ndimage.binary_erosion(hu > -300, iterations=8)
    assert 10 < np.median(hu[body]) < 90  # soft tissue around 40 HU
    image = read_image(manifest.parent / rows(manifest)[0]["path"])  # soft-tissue window from the tags
    np.testing.assert_allclose(image, np.clip((hu - (40 - 200)) / 400, 0, 1), atol=1e-6)


def test_labels_are_balanced_per_patient_and_overall(tmp_path):
    table = rows(generate(tmp_path / "d", seed=2, patients=6, slices=6, size=32))
    assert Counter(r["label"] for r in table) == {"lesion": 18, "no_lesion": 18}
    per_patient = defaultdict(list)
    for r in table:
        per_patient[r["patient_id"]].append(r["label"])
    for labels in per_patient.values():
        assert labels.count("lesion") == 3
        runs = "".join("L" if label == "lesion" else "n" for label in labels)
        assert "LLL" in runs  # one contiguous run of lesion slices


def lesion_evidence(manifest: Path) -> tuple[list[float], list[float]]:
    """Peak smoothed |HU difference| of neighbouring slices: across the label boundary, and both lesion-free."""
    table, across, within = rows(manifest), [], []
    by_patient = defaultdict(list)
    for r in table:
        by_patient[r["patient_id"]].append(r)
    for patient_rows in by_patient.values():
        hu = [modality_values(manifest.parent / r["path"]) for r in patient_rows]
        for k in range(len(hu) - 1):
            soft_tissue = ndimage.binary_erosion((hu[k] > -500) & (hu[k + 1] > -500), iterations=4)
            soft_tissue &= ~ndimage.binary_dilation((hu[k] > 300) | (hu[k + 1] > 300), iterations=3)  # no bone
            peak = np.abs(ndimage.gaussian_filter(hu[k + 1] - hu[k], 1.5))[soft_tissue].max()
            labels = {patient_rows[k]["label"], patient_rows[k + 1]["label"]}
            if len(labels) == 2:
                across.append(peak)
            elif labels == {"no_lesion"}:
                within.append(peak)
    return across, within


def test_lesion_label_matches_image_content_and_difficulty_scales_contrast(tmp_path):
    params = dict(seed=5, patients=6, slices=4, size=64)
    easy_across, easy_within = lesion_evidence(generate(tmp_path / "easy", difficulty=0.0, **params))
    hard_across, _ = lesion_evidence(generate(tmp_path / "hard", difficulty=1.0, **params))
    assert min(easy_across) > 1.5 * max(easy_within)  # the lesion appears exactly where the label changes
    assert np.mean(hard_across) < 0.35 * np.mean(easy_across)


def test_bad_arguments_and_non_empty_destination(tmp_path):
    with pytest.raises(ValueError, match="difficulty must be in"):
        generate(tmp_path / "x", difficulty=1.5)
    with pytest.raises(ValueError, match="slices must be an int >= 2"):
        generate(tmp_path / "x", slices=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="non-empty"):
        generate(tmp_path / "full", **SMALL)
    assert (tmp_path / "full" / "keep.txt").read_text() == "user data"


def test_command_line(tmp_path, capsys):
    manifest = main(["--out", str(tmp_path / "cli"), "--seed", "1", "--patients", "2", "--slices", "2", "--size", "32"])
    assert capsys.readouterr().out.strip() == str(manifest)
    assert len(rows(manifest)) == 4


def _embedded_in_subprocess(cache: str) -> str:
    import os

    os.environ["VITLAB_CACHE"] = cache
    return str(embedded_dataset(patients=4, slices=2, size=32, seed=9))


def test_embedded_dataset_is_cached_and_atomic(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("VITLAB_CACHE", str(cache))
    with pytest.raises(ValueError, match=r"unknown embedded dataset argument\(s\) \['colour'\]"):
        embedded_dataset(colour=True)
    manifest = embedded_dataset(patients=4, slices=2, size=32)
    assert manifest.parent.parent == cache and manifest.parent.name.startswith("embedded-")
    stamp = manifest.stat().st_mtime_ns
    assert embedded_dataset(patients=4, slices=2, size=32) == manifest and manifest.stat().st_mtime_ns == stamp
    assert embedded_dataset(patients=4, slices=2, size=32, seed=1) != manifest
    # concurrent first use from several processes: one copy wins, nobody sees a partial folder
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_embedded_in_subprocess, [str(cache)] * 3)
    assert len(set(results)) == 1 and len(rows(Path(results[0]))) == 8
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # temp folders cleaned up


def test_embedded_dataset_losing_the_race_uses_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path))
    real_generate = slices.generate

    @functools.wraps(real_generate)
    def generate_while_another_process_wins(out, **kwargs):
        manifest = real_generate(out, **kwargs)
        winner = _final_folder(out)
        real_generate(winner, **kwargs)  # meanwhile another process renamed its copy into place
        (winner / "winner.txt").write_text("first")
        return manifest

    monkeypatch.setattr(slices, "generate", generate_while_another_process_wins)
    manifest = embedded_dataset(patients=2, slices=2, size=32)
    assert (manifest.parent / "winner.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == [manifest.parent.name]  # loser's copy removed


def _final_folder(tmp_out) -> Path:
    """``<root>/.embedded-<hash>-XXXX`` (the temp folder) -> ``<root>/embedded-<hash>``."""
    tmp_out = Path(tmp_out)
    return tmp_out.parent / tmp_out.name[1:].rsplit("-", 1)[0]


def test_masks_outline_the_lesions_of_lesion_slices_only(tmp_path):
    from PIL import Image
    from scipy import ndimage

    manifest = generate(tmp_path / "m", seed=2, patients=3, slices=4, size=64, difficulty=0.0)
    again = generate(tmp_path / "n", seed=2, patients=3, slices=4, size=64, difficulty=0.0)
    for row in rows(manifest):
        mask = np.asarray(Image.open(manifest.parent / row["mask"]))
        assert mask.dtype == np.uint8 and mask.shape == (64, 64) and set(np.unique(mask)) <= {0, 1}
        assert np.array_equal(mask, np.asarray(Image.open(again.parent / row["mask"])))  # deterministic
        assert mask.any() == (row["label"] == "lesion")
        if mask.any():  # at difficulty 0 lesions differ from the tissue around them by >= 150 HU
            hu = modality_values(manifest.parent / row["path"])
            ring = ndimage.binary_dilation(mask, iterations=4) & ~ndimage.binary_dilation(mask, iterations=2)
            assert np.abs(hu[mask.astype(bool)] - np.median(hu[ring])).mean() > 50
