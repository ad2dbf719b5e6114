"""The integer box-filter pre-scale equals block means and keeps both sides >= the target; a gray image kept with one
channel for a three-channel model gets, bit for bit, what its repetition to three channels got."""

from __future__ import annotations

import numpy as np
import pytest

from vitlab.data.datasets.images import integer_downscale


@pytest.mark.parametrize("shape,target,factor", [((512, 500, 1), 224, 2), ((700, 900, 3), 100, 7), ((300, 300, 1), 224, 1), ((64, 64, 1), 64, 1)])
def test_integer_downscale_is_a_block_mean(shape, target, factor):
    rng = np.random.default_rng(0)
    image = rng.random(shape, dtype=np.float32)
    out = integer_downscale(image, target)
    h, w = shape[0] // factor, shape[1] // factor
    expect = image[: h * factor, : w * factor].reshape(h, factor, w, factor, shape[2]).mean((1, 3))
    assert out.shape == (h, w, shape[2]) and min(h, w) >= target
    np.testing.assert_allclose(out, expect, atol=1e-6)


@pytest.mark.parametrize("factor", [2, 3, 4, 5])
def test_the_prescale_of_a_gray_image_kept_with_one_channel_is_its_repetitions(factor):
    rng = np.random.default_rng(factor)
    for height, width in ((factor * 16, factor * 16), (factor * 16 + 1, factor * 23 + 2), (factor * 40 + 1, factor * 17)):
        image = (rng.random((height, width, 1)) * rng.choice([1e-3, 1.0, 3e3])).astype(np.float32)
        expected = integer_downscale(np.repeat(image, 3, axis=2), 16)
        got = integer_downscale(image, 16, 3)
        assert got.shape == expected.shape[:2] + (1,) and got.flags["C_CONTIGUOUS"]
        for channel in range(3):
            np.testing.assert_array_equal(got[:, :, 0], expected[:, :, channel])
