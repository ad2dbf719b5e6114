"""vitlab.data.resample: resample against scipy / nibabel on oblique grids, planted blobs, labels; crop_or_pad geometry.

The oracles map each new voxel centre into old voxel coordinates through the two affines
(``inv(old_affine) @ new_affine @ [i, j, k, 1]``) and interpolate there with ``scipy.ndimage.map_coordinates``
or nibabel's ``resample_from_to``; crop / pad is checked voxel by voxel through world positions.
"""

from __future__ import annotations

import math

import nibabel
import numpy as np
import pytest
from nibabel.processing import resample_from_to
from scipy.ndimage import map_coordinates

from vitlab.data.resample import crop_at, crop_or_pad, resample
from vitlab.data.readers.volume import Volume


def oblique_affine(rng: np.random.Generator, spacing) -> np.ndarray:
    """Voxel -> world with random unit axis directions (rotated and sheared, never near-degenerate)."""
    while True:
        directions = rng.normal(size=(3, 3))
        directions /= np.linalg.norm(directions, axis=0)
        if abs(np.linalg.det(directions)) > 0.4:
            break
    affine = np.eye(4)
    affine[:3, :3] = directions * np.asarray(spacing, float)
    affine[:3, 3] = rng.uniform(-100, 100, size=3)
    return affine


def random_volume(rng, shape=None, spacing=None, labels=False) -> Volume:
    shape = tuple(rng.integers(5, 12, size=3)) if shape is None else shape
    spacing = rng.uniform(0.6, 2.5, size=3) if spacing is None else spacing
    array = rng.integers(0, 4, size=shape) if labels else rng.uniform(-1, 1, size=shape)
    return Volume(array.astype(np.float32), oblique_affine(rng, spacing), "P1", "1.2.3", "CT", None)


def old_coordinates(old: Volume, new: Volume) -> np.ndarray:
    """(3, I', J', K') old voxel coordinates of every new voxel centre, through the affines."""
    ijk = np.indices(new.shape, dtype=np.float64).reshape(3, -1)
    homogeneous = np.vstack([ijk, np.ones((1, ijk.shape[1]))])
    return (np.linalg.inv(old.affine) @ new.affine @ homogeneous)[:3].reshape(3, *new.shape)


def away_from_ties(coords: np.ndarray) -> np.ndarray:
    """Voxels whose nearest old voxel is unambiguous (rounding of exact halves differs between libraries)."""
    return (np.abs(coords - np.floor(coords) - 0.5) > 1e-4).all(axis=0)  # float32 coordinates: ~1e-6 off


@pytest.mark.parametrize("seed", range(4))
def test_linear_matches_map_coordinates_on_oblique_grids(seed):
    rng = np.random.default_rng(seed)
    volume = random_volume(rng)
    out = resample(volume, rng.uniform(0.5, 3.0, size=3))
    coords = old_coordinates(volume, out)
    assert out.array.dtype == np.float32
    np.testing.assert_allclose(out.array, map_coordinates(volume.array, coords, order=1, mode="nearest"), atol=1e-4)
    fill = float(rng.uniform(-5, 5))
    filled = resample(volume, out.spacing, fill=fill)  # surrounded by voxels of value fill
    expected = map_coordinates(volume.array.astype(np.float64), coords, order=1, mode="grid-constant", cval=fill)
    np.testing.assert_allclose(filled.array, expected, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_nearest_matches_map_coordinates_order_0(seed):
    rng = np.random.default_rng(100 + seed)
    volume = random_volume(rng, labels=True)
    out = resample(volume, rng.uniform(0.5, 3.0, size=3), mode="nearest")
    coords = old_coordinates(volume, out)
    keep = away_from_ties(coords)
    assert keep.mean() > 0.9
    expected = map_coordinates(volume.array, coords, order=0, mode="nearest")
    np.testing.assert_array_equal(out.array[keep], expected[keep])
    filled = resample(volume, out.spacing, mode="nearest", fill=7.0)
    expected = map_coordinates(volume.array, coords, order=0, mode="grid-constant", cval=7.0)
    np.testing.assert_array_equal(filled.array[keep], expected[keep])


@pytest.mark.parametrize("seed", range(2))
def test_linear_matches_nibabel_resample_from_to(seed):
    rng = np.random.default_rng(200 + seed)
    volume = random_volume(rng)
    out = resample(volume, rng.uniform(0.5, 3.0, size=3))
    image = nibabel.Nifti1Image(volume.array, volume.affine)
    expected = resample_from_to(image, (out.shape, out.affine), order=1, mode="nearest").get_fdata()
    np.testing.assert_allclose(out.array, expected, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_geometry_planted_blob_spacing_directions_extent(seed):
    rng = np.random.default_rng(300 + seed)
    shape, spacing = (26, 24, 22), rng.uniform(1.0, 1.6, size=3)
    affine = oblique_affine(rng, spacing)
    position = affine @ np.append(np.array(shape) / 2 - 0.5 + rng.uniform(-2, 2, size=3), 1.0)  # world, mm
    ijk = np.indices(shape).reshape(3, -1)
    world = (affine[:3, :3] @ ijk + affine[:3, 3:]).T
    blob = np.exp(-np.sum((world - position[:3]) ** 2, axis=1) / (2 * 3.0**2)).reshape(shape)
    volume = Volume(blob.astype(np.float32), affine)
    new_spacing = rng.uniform(0.7, 2.5, size=3)
    out = resample(volume, new_spacing)

    weights = out.array.astype(np.float64)
    centroid = (np.indices(out.shape).reshape(3, -1) @ weights.ravel()) / weights.sum()
    expected = (np.linalg.inv(out.affine) @ position)[:3]
    assert np.abs(centroid - expected).max() < 0.2, (centroid, expected)  # half a voxel asked; ~0.06 seen

    np.testing.assert_allclose(out.spacing, new_spacing, rtol=1e-12)
    directions = [a[:3, :3] / np.linalg.norm(a[:3, :3], axis=0) for a in (out.affine, volume.affine)]
    np.testing.assert_allclose(*directions, atol=1e-12)
    np.testing.assert_allclose(out.affine[:, 3], volume.affine[:, 3], atol=1e-12)  # voxel 0 stays put
    span_old = (np.array(volume.shape) - 1) * spacing
    span_new = (np.array(out.shape) - 1) * new_spacing
    assert (np.abs(span_new - span_old) <= new_spacing / 2 + 1e-9).all()  # same extent to half a new voxel
    assert (out.patient_id, out.series_uid, out.modality) == (volume.patient_id, volume.series_uid, volume.modality)


def test_shape_rule_and_single_voxel_axis():
    volume = Volume(np.zeros((10, 6, 1), np.float32), np.diag([1.0, 1.0, 3.0, 1.0]))
    out = resample(volume, (0.5, 2.0, 1.0))  # 9 * 2 + 1; 2.5 rounds half up to 3, + 1; one voxel stays one
    assert out.shape == (19, 4, 1)
    assert resample(volume, (0.3, 20.0, 1.0)).shape == (31, 1, 1)  # 5 mm span at 20 mm: rounds to 0 steps


@pytest.mark.parametrize("seed", range(3))
def test_nearest_keeps_label_values(seed):
    rng = np.random.default_rng(400 + seed)
    volume = random_volume(rng, labels=True)
    for fill in (None, 0.0):
        out = resample(volume, rng.uniform(0.4, 3.0, size=3), mode="nearest", fill=fill)
        assert set(np.unique(out.array)) <= {0.0, 1.0, 2.0, 3.0}


def test_same_spacing_returns_the_volume():
    rng = np.random.default_rng(500)
    volume = random_volume(rng)
    assert resample(volume, volume.spacing) is volume
    same = resample(volume, np.array(volume.spacing) * (1 + 1e-7), mode="nearest")
    assert same is volume
    np.testing.assert_array_equal(same.array, volume.array)


@pytest.mark.parametrize("seed", range(4))
def test_crop_or_pad_keeps_world_positions(seed):
    rng = np.random.default_rng(600 + seed)
    volume = random_volume(rng, shape=tuple(rng.integers(6, 12, size=3)))
    grow, shrink = rng.choice(3, size=2, replace=False)  # at least one padded and one cropped axis
    size = [int(n + rng.integers(-4, 5)) for n in volume.shape]
    size[grow], size[shrink] = volume.shape[grow] + int(rng.integers(1, 6)), volume.shape[shrink] - int(rng.integers(1, 5))
    fill = float(rng.uniform(-3, 3))
    out = crop_or_pad(volume, size, fill=fill)
    assert out.shape == tuple(size) and out.array.dtype == volume.array.dtype
    np.testing.assert_array_equal(out.affine[:3, :3], volume.affine[:3, :3])
    coords = old_coordinates(volume, out)
    index = np.rint(coords).astype(int)
    np.testing.assert_allclose(coords, index, atol=1e-9)  # every new voxel centre is an old centre (or beyond)
    kept = ((index >= 0) & (index < np.array(volume.shape)[:, None, None, None])).all(axis=0)
    assert kept.sum() == math.prod(min(n, s) for n, s in zip(volume.shape, size))
    np.testing.assert_array_equal(out.array[kept], volume.array[tuple(index[:, kept])])
    assert (out.array[~kept] == np.float32(fill)).all()


def test_crop_or_pad_odd_differences_go_to_the_high_end():
    array = np.arange(5 * 8 * 4, dtype=np.float32).reshape(5, 8, 4)
    volume = Volume(array, np.diag([2.0, 1.0, 3.0, 1.0]))
    out = crop_or_pad(volume, (8, 5, 6), fill=-1.0)  # i: pad 3 = 1 + 2; j: crop 3 = 1 + 2; k: pad 2 = 1 + 1
    np.testing.assert_array_equal(out.array[1:6, :, 1:5], array[:, 1:6, :])
    assert (out.array[[0, 6, 7]] == -1).all() and (out.array[:, :, [0, 5]] == -1).all()
    np.testing.assert_array_equal(out.affine[:3, 3], [-2.0, 1.0, -3.0])  # world of old voxel (-1, 1, -1)
    even = crop_or_pad(volume, (3, 4, 4))  # i: crop 2 = 1 + 1; j: crop 4 = 2 + 2
    np.testing.assert_array_equal(even.array, array[1:4, 2:6, :])
    assert crop_or_pad(volume, [5, 8, 4]) is volume


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda v: resample(v, (1.0, 1.0)), "spacing"),
        (lambda v: resample(v, (1.0, 0.0, 1.0)), "spacing"),
        (lambda v: resample(v, (1.0, -2.0, 1.0)), "spacing"),
        (lambda v: resample(v, (1.0, float("nan"), 1.0)), "spacing"),
        (lambda v: resample(v, (1.0, float("inf"), 1.0)), "spacing"),
        (lambda v: resample(v, "abc"), "spacing"),
        (lambda v: resample(v, 1.0), "spacing"),
        (lambda v: resample(v, (1.0, 1.0, 1.0), mode="cubic"), "mode"),
        (lambda v: resample(v, (1.0, 1.0, 1.0), mode="bilinear"), "mode"),
        (lambda v: resample(v, (1.0, 1.0, 1.0), fill=float("nan")), "fill"),
        (lambda v: crop_or_pad(v, (4, 4)), "size"),
        (lambda v: crop_or_pad(v, (4, 0, 4)), "size"),
        (lambda v: crop_or_pad(v, (4, -1, 4)), "size"),
        (lambda v: crop_or_pad(v, (4, 4.5, 4)), "size"),
        (lambda v: crop_or_pad(v, (4, True, 4)), "size"),
        (lambda v: crop_or_pad(v, 4), "size"),
    ],
)
def test_bad_arguments_one_line(call, name):
    volume = Volume(np.zeros((4, 4, 4), np.float32), np.diag([2.0, 2.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match=rf"^{name} must be ") as caught:
        call(volume)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("seed", range(3))
def test_crop_at_is_the_block_at_its_origin_in_world_space(seed):
    rng = np.random.default_rng(700 + seed)
    volume = random_volume(rng, shape=tuple(rng.integers(6, 12, size=3)))
    size = [int(rng.integers(1, n + 1)) for n in volume.shape]
    origin = [int(rng.integers(0, n - s + 1)) for n, s in zip(volume.shape, size)]
    out = crop_at(volume, origin, size)
    np.testing.assert_array_equal(out.array, volume.array[tuple(slice(o, o + s) for o, s in zip(origin, size))])
    coords = old_coordinates(volume, out)  # every new voxel's centre is the old voxel it was cut from
    expected = np.stack(np.meshgrid(*[np.arange(o, o + s) for o, s in zip(origin, size)], indexing="ij"))
    np.testing.assert_allclose(coords, expected, atol=1e-9)
    with pytest.raises(ValueError, match=r"crop_at: origin .* must lie inside the volume's"):
        crop_at(volume, [volume.shape[0] - size[0] + 1, 0, 0], size)
