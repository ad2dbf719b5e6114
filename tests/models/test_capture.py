"""capture() sub-layer outputs and forward_until() truncated forwards, on every family."""

import pytest
import torch

from tests.helpers.models import LIBRARY_MIXER, MAIN_NORM, images, library_block_io
from vitlab.models import CAPTURE_SITES, blocks, capture, forward_until
from vitlab.models.testing import TINY_MODELS, tiny_model


FAMILIES = sorted(TINY_MODELS)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_shapes_prefix_and_unchanged_outputs(family):
    model = tiny_model(family)
    x = images()
    sites = list(CAPTURE_SITES)
    with torch.no_grad():
        plain = model(x)
        with capture(model, sites) as record:
            captured = model(x)
    assert torch.equal(captured, plain)  # bit-identical while capturing
    library_inputs, library_outputs, library_kwargs = library_block_io(model, x)
    for view in blocks(model):
        tokens = view.grid[0] * view.grid[1]
        assert record.grids[view.name] == view.grid
        for site in sites:
            out = record[view.name, site]
            assert out.shape[:2] == (2, tokens), (view.name, site, out.shape)
            assert out.shape[2] == (view.dim if site != "mlp_hidden" else out.shape[2])
        assert record[view.name, "mlp_hidden"].shape[2] > view.dim
        resid = library_outputs[view.name].flatten(1, -2) if library_outputs[view.name].ndim == 4 \
            else library_outputs[view.name]
        prefix = view.num_prefix_tokens
        assert torch.equal(record[view.name, "resid"], resid[:, prefix:])
        if prefix:
            assert torch.equal(record.prefix[view.name]["resid"], resid[:, :prefix])
            assert record.prefix[view.name]["attn"].shape == (2, prefix, view.dim)
        else:
            assert view.name not in record.prefix
        # attention / token-mixing branch (Swin: un-windowed, rolled back) equals the library's computation
        with torch.no_grad():
            branch = LIBRARY_MIXER[family](view.module, library_inputs[view.name],
                                           **library_kwargs[view.name])
        branch = branch.flatten(1, 2) if branch.ndim == 4 else branch
        assert torch.allclose(record[view.name, "attn"], branch[:, prefix:], atol=1e-6)
        # the block output is the input plus both branches
        library_in = library_inputs[view.name]
        library_in = library_in.flatten(1, 2) if library_in.ndim == 4 else library_in
        rebuilt = library_in[:, prefix:] + record[view.name, "attn"] + record[view.name, "mlp"]
        rebuilt = MAIN_NORM[family](view.module)(rebuilt) if family in MAIN_NORM else rebuilt
        assert torch.allclose(rebuilt, record[view.name, "resid"], atol=1e-5)


@pytest.mark.parametrize("family", ["timm-vit", "timm-swin"])
def test_capture_accumulates_selects_and_casts(family):
    model = tiny_model(family)
    first, second = images(seed=1), images(batch=3, seed=2)
    last = blocks(model)[-1].name
    with torch.no_grad():
        with capture(model, "mlp", blocks=[last], dtype=torch.float16) as both:
            model(first)
            model(second)
        with capture(model, ["token_mixing"], blocks=[0]) as single:
            model(second)
    assert set(both.outputs) == {last} and set(both.outputs[last]) == {"mlp"}
    out = both[last, "mlp"]
    assert out.dtype == torch.float16 and out.device.type == "cpu" and out.shape[0] == 5
    first_name = blocks(model)[0].name
    assert set(single.outputs[first_name]) == {"attn"}
    assert all("forward" not in view.module.__dict__ for view in blocks(model))  # released after the context
    with pytest.raises(ValueError, match="unknown capture site 'keys': valid are qkv_input, attn"):
        with capture(model, ["keys"]):
            pass


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_until_matches_intermediates_and_stops(family):
    model = tiny_model(family)
    x = images()
    library_inputs, library_outputs, _ = library_block_io(model, x)
    views = blocks(model)
    target = views[len(views) // 2 - 1]
    later_calls = []

    def note(name):
        def hook(module, args):
            later_calls.append(name)
        return hook

    handles = [view.module.register_forward_pre_hook(note(view.name)) for view in views[target.global_index + 1:]]
    try:
        with torch.no_grad():
            stream = forward_until(model, x, target.global_index)
            embed = forward_until(model, x, "embed")
            by_name = forward_until(model, x, target.name)
    finally:
        for handle in handles:
            handle.remove()
    assert later_calls == []  # later blocks never ran
    expected = library_outputs[target.name]
    assert torch.equal(stream, expected.flatten(1, 2) if expected.ndim == 4 else expected)
    assert torch.equal(by_name, stream)
    first_in = library_inputs[views[0].name]
    assert torch.equal(embed, first_in.flatten(1, 2) if first_in.ndim == 4 else first_in)
    pixels = x.clone().requires_grad_(True)
    forward_until(model, pixels, target.global_index).square().sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="out of range"):
        forward_until(model, x, len(views))
