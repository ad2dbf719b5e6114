"""vitlab.analysis.inversion (layer inversion, seed criterion) and vitlab.analysis.featurevis (blur, jitter, recipes)."""

import math

import pytest
import torch
import torch.nn.functional as F

from vitlab.analysis.featurevis import (
    VisRecipe,
    blur_schedule,
    class_maximization,
    gaussian_blur,
    neuron_maximization,
    optimize_input,
    roll_jitter,
)
from vitlab.analysis.inversion import invert, noise_baseline, sigma_label, total_variation, with_normalization
from vitlab.models import forward_until, normalization
from vitlab.models.testing import tiny_model

SIZE = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def _smooth_images(batch=2, channels=3, seed=0):
    """Natural-ish targets in [0, 1]: bilinear upsampling of random 4x4 images."""
    low = torch.rand(batch, channels, 4, 4, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(low, size=(SIZE, SIZE), mode="bilinear", align_corners=True).clamp(0, 1)


def _embedding_features(patch_size, embed_dim):
    """A randomised tiny ViT's patch + position embedding as a function of pixels in [0, 1]."""
    model = tiny_model("timm-vit", patch_size=patch_size, embed_dim=embed_dim, num_heads=2, seed=3)
    mean, std = normalization(model)
    return with_normalization(lambda x: forward_until(model, x, "embed"), mean, std)


@pytest.mark.slow
def test_injective_patch_embedding_passes_the_criterion_and_recovers_the_image():
    # patch 4 -> 3 * 4^2 = 48 input values per patch, embedded in 64 channels: injective
    features = _embedding_features(patch_size=4, embed_dim=64)
    target = _smooth_images()
    full = invert(features, target, steps=200, lr=0.05, tv_weight=0.0, early_stop=False,
                  generator=torch.Generator().manual_seed(0))
    assert full.steps_run == 200 and full.feature_error.shape == (201, 2) and full.image.shape == target.shape
    assert full.passed(1 / 18).all() and full.passed(1 / 20).all()
    assert (full.input_error[-1] < 0.01).all()  # injective: the image itself comes back
    assert (full.input_error[0] > 0.3).all()  # ... from a random start
    assert full.image.min() >= 0 and full.image.max() <= 1
    stopped = invert(features, target, steps=200, lr=0.05, sigma=1 / 20, check_every=1,
                     generator=torch.Generator().manual_seed(0))
    assert stopped.steps_run < 200  # early stop when the criterion holds
    assert stopped.passed().all() and stopped.sigma == pytest.approx(1 / 20)
    assert int(stopped.steps_to_pass[1 / 20].max()) == stopped.steps_run  # stops at the first step all pass


def test_non_injective_layer_feature_error_vanishes_while_input_error_stays():
    # 4x4 average pooling: 16 pixels -> 1 value, many inputs share one output (the Attentionless article's argument)
    target = _smooth_images()
    pooled = invert(lambda x: F.avg_pool2d(x, 4), target, steps=300, lr=0.05, tv_weight=0.0, early_stop=False,
                    generator=torch.Generator().manual_seed(1))
    assert (pooled.feature_error[-1] < 1e-3).all()
    assert pooled.passed(1 / 20).all()
    assert (pooled.input_error[-1] > 0.2).all()
    assert (pooled.input_error[-1] > 0.5 * pooled.input_error[0]).all()  # the input barely approached a


def test_criterion_bookkeeping_matches_an_independent_recount():
    features = _embedding_features(patch_size=8, embed_dim=32)  # 192 -> 32: not injective
    target = _smooth_images(batch=3, seed=2)
    result = invert(features, target, steps=40, lr=0.05, early_stop=False, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out_a, out_g = features(target), features(result.image)
    distance = (out_a - out_g).flatten(1).norm(dim=1) / out_a.flatten(1).norm(dim=1)
    torch.testing.assert_close(result.feature_error[-1], distance, rtol=1e-4, atol=1e-6)
    input_error = (target - result.image).flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1)
    torch.testing.assert_close(result.input_error[-1], input_error, rtol=1e-4, atol=1e-6)
    for sigma in (1 / 18, 1 / 20):
        below = (result.feature_error < result.noise_error[sigma]).tolist()  # (T+1, B)
        expected = [next((t for t, row in enumerate(below) if row[b]), -1) for b in range(3)]
        assert result.steps_to_pass[sigma].tolist() == expected
        assert result.passed(sigma).tolist() == (result.feature_error[-1] < result.noise_error[sigma]).tolist()
    row = result.per_image()[0]
    assert row["ratio_sigma_1_18"] == pytest.approx(float(result.ratio(1 / 18)[0]))
    assert row["steps_run"] == 40
    with pytest.raises(KeyError, match="not evaluated"):
        result.ratio(0.3)


def test_noise_baseline_of_a_linear_map_matches_the_closed_form():
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    scale = 1.7
    noise = noise_baseline(lambda x: scale * x, pixels, sigmas=(1 / 18, 1 / 20), draws=8,
                           generator=torch.Generator().manual_seed(0))
    n = pixels[0].numel()
    expected = scale * math.sqrt(n)  # E||eps|| ~= sigma * sqrt(n) for eps ~ N(0, sigma^2 I_n), n large
    assert torch.allclose(noise[1 / 18], torch.full((2,), expected / 18), rtol=0.02)
    # the same draws are scaled by each sigma: the ratio is exact for a linear map
    torch.testing.assert_close(noise[1 / 18] / noise[1 / 20], torch.full((2,), 20 / 18), rtol=1e-5, atol=0)


def test_total_variation_and_normalization_wrapper():
    checker = (torch.arange(8).view(1, 8) + torch.arange(8).view(8, 1)) % 2  # 0/1 checkerboard
    images = torch.stack([checker.float()[None], torch.full((1, 8, 8), 0.3)])  # (2, 1, 8, 8)
    torch.testing.assert_close(total_variation(images), torch.tensor([2.0, 0.0]))
    ramp = (0.1 * torch.arange(8.0)).view(1, 1, 1, 8).expand(1, 1, 8, 8)
    torch.testing.assert_close(total_variation(ramp), torch.tensor([0.01]))
    weight = torch.randn(5, 3 * 4 * 4, generator=torch.Generator().manual_seed(0))
    mean, std = [0.2, 0.4, 0.6], [0.5, 0.25, 2.0]
    wrapped = with_normalization(lambda x: x.flatten(1) @ weight.T, mean, std)
    x = torch.rand(2, 3, 4, 4)
    manual = ((x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)).flatten(1) @ weight.T
    torch.testing.assert_close(wrapped(x), manual)


def test_sigma_labels_and_bad_arguments():
    assert sigma_label(1 / 18) == "sigma_1_18" and sigma_label(0.05) == "sigma_1_20"
    assert sigma_label(0.3) == "sigma_3_10"
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        invert(lambda x: x, torch.rand(3, 8, 8))
    with pytest.raises(ValueError, match="lr > 0"):
        invert(lambda x: x, torch.rand(1, 3, 8, 8), lr=0)
    with pytest.raises(ValueError, match="draws must be >= 1"):
        noise_baseline(lambda x: x, torch.rand(1, 3, 8, 8), draws=0)


# ---------------------------------------------------------------------------------------- feature visualisation


def test_blur_schedule_anneals_linearly_and_skips_small_sigmas():
    sigmas = blur_schedule(100, start=2.4, end=0.0, min_sigma=0.3)
    assert sigmas.shape == (100,)
    assert sigmas[0] == pytest.approx(2.4) and sigmas[-1] == 0
    assert (sigmas[1:] <= sigmas[:-1]).all()  # annealed
    kept = sigmas[sigmas > 0]
    assert kept.min() >= 0.3 and (sigmas[len(kept):] == 0).all()
    steps = kept[:-1] - kept[1:]
    torch.testing.assert_close(steps, torch.full_like(steps, 2.4 / 99))  # linear
    assert len(kept) == sum(1 for i in range(100) if 2.4 * (1 - i / 99) >= 0.3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        blur_schedule(0)


@pytest.mark.parametrize("sigma", [0.5, 1.2, 2.4])
def test_gaussian_blur_matches_torchvision(sigma):
    from torchvision.transforms.functional import gaussian_blur as tv_blur

    x = torch.rand(2, 3, 12, 10, generator=torch.Generator().manual_seed(0))
    blurred = gaussian_blur(x, sigma, kernel_size=3)
    assert blurred.shape == x.shape
    torch.testing.assert_close(blurred, tv_blur(x, kernel_size=[3, 3], sigma=[sigma, sigma]), rtol=1e-5, atol=1e-6)
    constant = torch.full((1, 1, 6, 6), 0.4)
    torch.testing.assert_close(gaussian_blur(constant, sigma, kernel_size=5), constant)
    assert gaussian_blur(x, 0.0) is x


def test_roll_jitter_only_after_its_start_and_within_bounds():
    x = torch.rand(1, 3, 16, 16)
    generator = torch.Generator().manual_seed(0)
    same, shift = roll_jitter(x, step=4, start=5, max_shift=3, generator=generator)
    assert same is x and shift == (0, 0)
    shifts = set()
    for step in range(5, 60):
        rolled, (dy, dx) = roll_jitter(x, step, 5, 3, generator)
        assert rolled.shape == x.shape and abs(dy) <= 3 and abs(dx) <= 3
        torch.testing.assert_close(rolled, torch.roll(x, shifts=(dy, dx), dims=(2, 3)))
        shifts.add((dy, dx))
    assert len(shifts) > 5 and any(s != (0, 0) for s in shifts)


def test_optimizer_jitters_the_forward_input_only_after_jitter_from():
    recipe = VisRecipe(steps=12, lr=1e-9, jitter=3, jitter_from=6, snapshot_every=4)  # lr ~ 0: x stays put
    seen = []

    def objective(x):
        seen.append(x.detach().clone())
        return x.mean(dim=(1, 2, 3)), {"mean": x.mean(dim=(1, 2, 3))}

    result = optimize_input(objective, (2, 3, 16, 16), recipe, generator=torch.Generator().manual_seed(5))
    start = (0.7 + torch.randn((2, 3, 16, 16), generator=torch.Generator().manual_seed(5)) / 20).clamp(0, 1)
    assert all(torch.allclose(x, start, atol=1e-6) for x in seen[:6])  # no jitter before step 6
    rolls = [torch.allclose(x, start, atol=1e-6) for x in seen[6:]]
    assert not all(rolls)  # rolled afterwards ...
    torch.testing.assert_close(result.image, start, atol=1e-6, rtol=0)  # ... for the forward only
    assert result.snapshot_steps == [4, 8, 12] and result.snapshots.shape == (3, 2, 3, 16, 16)
    assert result.curves["mean"].shape == (12, 2)


def test_class_maximization_raises_the_logit_and_records_curves():
    weight = torch.randn(3, 3 * 16 * 16, generator=torch.Generator().manual_seed(0)) * 0.2
    logits_fn = lambda x: x.flatten(1) @ weight.T  # noqa: E731 - a linear "model"
    recipe = VisRecipe(steps=60, lr=0.02, blur_start=1.0, jitter=2, jitter_from=30, snapshot_every=20)
    result = class_maximization(logits_fn, [0, 2], (3, 16, 16), target=100.0, recipe=recipe,
                                generator=torch.Generator().manual_seed(1))
    logit, probability = result.curves["logit"], result.curves["probability"]  # (60, 2)
    start = (0.7 + torch.randn((2, 3, 16, 16), generator=torch.Generator().manual_seed(1)) / 20).clamp(0, 1)
    torch.testing.assert_close(logit[0], logits_fn(start)[[0, 1], [0, 2]])
    assert (logit[-1] > logit[0] + 1.0).all()
    final = logits_fn(result.image)
    assert (final[[0, 1], [0, 2]] > logits_fn(start)[[0, 1], [0, 2]]).all()
    assert ((probability >= 0) & (probability <= 1)).all() and (probability[-1] > probability[0]).all()
    assert result.image.shape == (2, 3, 16, 16) and 0 <= result.image.min() and result.image.max() <= 1


def test_neuron_maximization_raises_the_chosen_unit():
    weight = torch.randn(6, 3 * 4 * 4, generator=torch.Generator().manual_seed(0))

    def hidden_fn(x):  # patch tokens -> 6 GELU units: (K, 16, 6)
        patches = F.unfold(x, kernel_size=4, stride=4).transpose(1, 2)  # (K, 16, 48)
        return F.gelu(patches @ weight.T)

    recipe = VisRecipe(steps=50, lr=0.05, cosine=True, snapshot_every=25)
    result = neuron_maximization(hidden_fn, [1, 4], (3, 16, 16), recipe, generator=torch.Generator().manual_seed(2))
    activation = result.curves["activation"]  # (50, 2)
    start = (0.7 + torch.randn((2, 3, 16, 16), generator=torch.Generator().manual_seed(2)) / 20).clamp(0, 1)
    torch.testing.assert_close(activation[0], hidden_fn(start)[[0, 1], :, [1, 4]].mean(1))
    assert (activation[-1] > activation[0] + 0.5).all()
