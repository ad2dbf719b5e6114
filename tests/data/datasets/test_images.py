"""The integer box-filter pre-scale equals block means and keeps both sides >= the target."""

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
