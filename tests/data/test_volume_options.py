"""vitlab.data.volume_options: every volume argument and every rule about which of them combine, checked in one place
with one line naming the config key; the checked values in one form."""

from __future__ import annotations

import pytest

from vitlab.data.volume_options import VolumeOptions

REFUSED = [
    (dict(sample="cube"), "data.sample must be one of ['image', 'slice', 'slab', 'volume'], got 'cube'"),
    (dict(sample="slice", slab_radius=-1), "data.slab_radius must be an int >= 0 (slices each side of the centre), got -1"),
    (dict(sample="slab", slab_radius=True), "data.slab_radius must be an int >= 0 (slices each side of the centre), got True"),
    (dict(sample="slice", slice_labels="organ"), "data.slice_labels must be one of ['volume', 'mask'], got 'organ'"),
    (dict(sample="slice", min_mask_voxels=0), "data.min_mask_voxels must be an int >= 1, got 0"),
    (dict(sample="slice", intensity="max"), "data.intensity must be one of ['window', 'percentile', 'zscore'], got 'max'"),
    (dict(sample="slab", volumes_in_memory=0), "data.volumes_in_memory must be an int >= 1, got 0"),
    (dict(sample="volume"), "data.sample volume needs data.volume_size: 3 positive voxel counts (i, j, k) (or null with "
                            "data.patch_size), got None"),
    (dict(sample="volume", volume_size=[32, 0, 32]), "data.sample volume needs data.volume_size: 3 positive voxel counts "
                                                     "(i, j, k) (or null with data.patch_size), got [32, 0, 32]"),
    (dict(sample="slab", patch_size=[8, 8, 4]), "data.patch_size applies to data.sample volume (random 3-D training patches), "
                                                "not 'slab'"),
    (dict(sample="volume", volume_size=[20, 18, 10], patch_size=[8, 8]), "data.patch_size must be 3 positive voxel counts "
                                                                         "(i, j, k), got [8, 8]"),
    (dict(sample="volume", volume_size=[20, 18, 10], patch_size=[24, 8, 4]),
     "data.patch_size [24, 8, 4] is larger than data.volume_size [20, 18, 10] along some axis; a patch lies inside the "
     "volume (or set volume_size null to keep each volume's own size)"),
    (dict(sample="volume", patch_size=[8, 8, 4], volume_size=None, patch_foreground=1.5),
     "data.patch_foreground must be a probability in [0, 1], got 1.5"),
    (dict(sample="volume", volume_size=[8, 8, 8], spacing=[1.0, -1.0, 2.0]),
     "data.spacing must be 3 positive numbers (mm along i, j, k) or null, got [1.0, -1.0, 2.0]"),
    (dict(sample="slab", volume_flip=True), "data.volume_flip flips whole volumes: set data.sample to volume"),
    (dict(sample="slice", volume_intensity={"scale": 0.1}), "data.volume_intensity jitters whole volumes: set data.sample to volume"),
    (dict(sample="volume", volume_size=[8, 8, 8], volume_intensity={"gain": 2}),
     "data.volume_intensity takes scale, scale_prob, shift, shift_prob (e.g. {scale: 0.1, scale_prob: 0.1, shift: 0.1, "
     "shift_prob: 0.5}), got ['gain']"),
    (dict(sample="volume", volume_size=[8, 8, 8], volume_intensity={"shift_prob": 1.5}),
     "data.volume_intensity.shift_prob must be a number in [0, 1], got 1.5"),
    # 2-D images take none of the volume arguments
    *[(dict(sample="image", **{key: value}), "data.slice_labels / data.intensity / data.spacing / data.volume_size / "
       "data.patch_size apply to volumes: set data.sample to slice, slab or volume")
      for key, value in (("slice_labels", "mask"), ("intensity", "zscore"), ("spacing", [1, 1, 1]), ("volume_size", [8, 8, 8]),
                         ("patch_size", [8, 8, 8]))],
    (dict(sample="image", volume_flip=True), "data.volume_flip flips whole volumes: set data.sample to volume"),
    (dict(sample="image", volume_intensity={}), "data.volume_intensity jitters whole volumes: set data.sample to volume"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_each_bad_value_or_combination_is_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ValueError) as error:
        VolumeOptions(**kwargs)
    assert str(error.value) == message


def test_checked_values_come_in_one_form():
    options = VolumeOptions("volume", spacing=[1, 1.5, 2], volume_size=None, patch_size=[8, 16, 4], volume_flip=1,
                            volume_intensity={"scale": 0.1})
    assert options.spacing == (1.0, 1.5, 2.0) and all(type(v) is float for v in options.spacing)
    assert options.volume_size is None and options.patch_size == (8, 16, 4) and options.volume_flip is True
    assert options.volume_intensity == {"scale": 0.1, "scale_prob": 1.0, "shift": 0.0, "shift_prob": 1.0}
    assert options.own_size and not VolumeOptions("volume", volume_size=[8, 8, 8]).own_size
    assert not VolumeOptions("slab").own_size and VolumeOptions("image").volume_intensity is None


@pytest.mark.parametrize("sample, radius, in_chans, channels", [
    ("image", 1, 1, 1), ("image", 1, 3, 3), ("slice", 1, 1, 1), ("slab", 2, 1, 5), ("slab", 2, 5, 5), ("slab", 0, 1, 1),
    ("volume", 1, 1, 1)])
def test_input_channels_follow_the_samples(sample, radius, in_chans, channels):
    size = [8, 8, 8] if sample == "volume" else None
    assert VolumeOptions(sample, radius, volume_size=size).input_channels(in_chans) == channels


def test_input_channels_that_do_not_fit_are_refused_in_one_line():
    with pytest.raises(ValueError) as error:
        VolumeOptions("slab", 2).input_channels(3)
    assert str(error.value) == ("data.in_chans 3 does not match data.sample 'slab' (slab_radius 2): its samples have 5 channel(s); "
                                "leave in_chans at 1")
    with pytest.raises(ValueError, match=r"^in_chans must be 1 \(grayscale\) or 3 \(colour\), got 2$"):
        VolumeOptions("image").input_channels(2)
