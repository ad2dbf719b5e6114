"""Representation inversion (Mahendran & Vedaldi 2015) and the Attentionless article's invertibility
criterion (docs/analyses.md).

Given a layer ``O`` and a target image ``a``, find ``a_g`` in [0, 1] minimising
``||O(a_g) - O(a)|| / ||O(a)|| + tv_weight * TV(a_g)`` with Adam and a cosine learning rate, starting from
U[0, 1] noise. The article's criterion says the layer represents ``a`` when ``||O(a) - O(a_g)||`` is below
``||O(a) - O(a')||`` for a slightly perturbed ``a' = a + eps``, ``eps ~ N(0, sigma^2)`` in pixel units; the article
is ambiguous between 1/18 and 1/20 (and between std and variance), so sigma is stored, the noise distance is
the mean over several draws, and both of the article's values are reported.

Reading (the Attentionless article): feature error -> 0 with input error staying large means many inputs give one output
(the layer is not invertible), not poor optimisation.

The image is parametrised directly in pixel units and projected back onto [0, 1] (``clamp``) after each Adam
step: no sigmoid, so black / saturated pixels (common in medical images) are reachable exactly and the
gradient never vanishes in saturation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

__all__ = [
    "SEED_SIGMAS",
    "FeatureFn",
    "InversionResult",
    "invert",
    "noise_baseline",
    "sigma_label",
    "total_variation",
    "with_normalization",
]

FeatureFn = Callable[[Tensor], Tensor]  # pixels (B, C, H, W) in [0, 1] -> features (B, ...)
SEED_SIGMAS = (1 / 18, 1 / 20)  # the Attentionless article's two noise levels (pixel units, [0, 1] images)


def sigma_label(sigma: float) -> str:
    """A name for a noise level usable in tags and CSV columns: ``1/18`` -> ``sigma_1_18``, 0.05 -> ``sigma_0.05``."""
    inverse = 1.0 / sigma
    if abs(inverse - round(inverse)) < 1e-6:
        return f"sigma_1_{round(inverse)}"
    fraction = Fraction(sigma).limit_denominator(1000)
    if abs(float(fraction) - sigma) < 1e-9:
        return f"sigma_{fraction.numerator}_{fraction.denominator}"
    return f"sigma_{sigma:g}"


def with_normalization(features: FeatureFn, mean: Sequence[float], std: Sequence[float]) -> FeatureFn:
    """Wraps a model-input function so it takes pixels in [0, 1]: ``features((x - mean) / std)``.

    Args:
        features: Function of the normalised model input (B, C, H, W).
        mean: Per-channel mean the model expects.
        std: Per-channel std the model expects.

    Returns:
        A function of pixels (B, C, H, W) in [0, 1].
    """
    mean_t = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)  # (1, C, 1, 1)
    inv_std = 1.0 / torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def normalized(pixels: Tensor) -> Tensor:
        return features((pixels - mean_t.to(pixels)) * inv_std.to(pixels))

    return normalized


def total_variation(x: Tensor) -> Tensor:
    """Squared-difference total variation (TV^2) per image: mean of vertical + horizontal neighbour differences².

    Args:
        x: Images (B, C, H, W).

    Returns:
        (B,) the mean over pixels of (x[i+1, j] - x[i, j])² plus the mean of (x[i, j+1] - x[i, j])².
    """
    vertical = (x[:, :, 1:, :] - x[:, :, :-1, :]).square().flatten(1).mean(1)  # (B,)
    horizontal = (x[:, :, :, 1:] - x[:, :, :, :-1]).square().flatten(1).mean(1)  # (B,)
    return vertical + horizontal


def _distance(a: Tensor, b: Tensor) -> Tensor:
    """Per-image Euclidean distance over all other dimensions: (B, ...) x (B, ...) -> (B,)."""
    return (a - b).flatten(1).norm(dim=1)


@torch.no_grad()
def noise_baseline(features: FeatureFn, pixels: Tensor, sigmas: Sequence[float] = SEED_SIGMAS, draws: int = 8,
                   target: Tensor | None = None, generator: torch.Generator | None = None) -> dict[float, Tensor]:
    """Mean distance ``||O(a) - O(a + eps)||`` over ``draws`` noise draws, for each sigma.

    The same standard-normal draws are scaled by every sigma (a' is not clamped to [0, 1]: the article adds the
    noise as is).

    Args:
        features: Pixels in [0, 1] -> features.
        pixels: Target images ``a`` (B, C, H, W).
        sigmas: Noise standard deviations in pixel units.
        draws: Number of noise draws averaged.
        target: ``O(a)`` when already computed.
        generator: CPU generator for the draws (reproducible on every device).

    Returns:
        ``{sigma: (B,) mean distance}`` in feature units (not relative).
    """
    if draws < 1:
        raise ValueError(f"noise draws must be >= 1, got {draws}")
    if any(s <= 0 for s in sigmas):
        raise ValueError(f"noise sigmas must be > 0, got {list(sigmas)}")
    target = features(pixels) if target is None else target
    totals = {float(s): torch.zeros(pixels.shape[0], dtype=torch.float64) for s in sigmas}
    for _ in range(draws):
        unit = torch.randn(pixels.shape, generator=generator).to(pixels)  # (B, C, H, W)
        for sigma in totals:
            totals[sigma] += _distance(features(pixels + sigma * unit), target).double().cpu()
    return {sigma: (total / draws).float() for sigma, total in totals.items()}


@dataclass(frozen=True)
class InversionResult:
    """An inversion run: the generated images, per-step errors and the article's criterion.

    Attributes:
        image: ``a_g`` (B, C, H, W) in [0, 1] after the last step.
        feature_error: (T + 1, B) ``||O(a) - O(a_t)|| / ||O(a)||`` of the iterate after t Adam steps.
        input_error: (T + 1, B) ``||a - a_t|| / ||a||``.
        noise_error: ``{sigma: (B,)}`` mean over draws of ``||O(a) - O(a')|| / ||O(a)||``.
        sigma: The sigma of the early-stop criterion.
        steps_to_pass: ``{sigma: (B,)}`` first t with feature error below the noise error; -1 = never.
        parametrization: How [0, 1] is enforced: ``"clamp"`` (projected Adam).
    """

    image: Tensor
    feature_error: Tensor
    input_error: Tensor
    noise_error: dict[float, Tensor]
    sigma: float
    steps_to_pass: dict[float, Tensor]
    parametrization: str = "clamp"

    @property
    def steps_run(self) -> int:
        """Adam steps taken (fewer than asked when the criterion stopped the run early)."""
        return self.feature_error.shape[0] - 1

    def ratio(self, sigma: float | None = None) -> Tensor:
        """(B,) final feature error over the noise error at ``sigma``: the criterion holds when < 1."""
        return self.feature_error[-1] / self.noise_error[self._sigma(sigma)]

    def passed(self, sigma: float | None = None) -> Tensor:
        """(B,) bool: the final ``a_g`` satisfies ``||O(a) - O(a_g)|| < ||O(a) - O(a')||`` at ``sigma``."""
        return self.ratio(sigma) < 1

    def per_image(self) -> list[dict[str, float | int | bool]]:
        """One flat dict per image: final errors and, per sigma, noise error, ratio, pass and steps to pass."""
        rows = []
        for i in range(self.image.shape[0]):
            row: dict[str, float | int | bool] = {
                "input_error": float(self.input_error[-1, i]),
                "feature_error": float(self.feature_error[-1, i]),
            }
            for sigma in self.noise_error:
                label = sigma_label(sigma)
                row[f"noise_error_{label}"] = float(self.noise_error[sigma][i])
                row[f"ratio_{label}"] = float(self.ratio(sigma)[i])
                row[f"passed_{label}"] = bool(self.passed(sigma)[i])
                row[f"steps_to_pass_{label}"] = int(self.steps_to_pass[sigma][i])
            row["steps_run"] = self.steps_run
            rows.append(row)
        return rows

    def _sigma(self, sigma: float | None) -> float:
        sigma = self.sigma if sigma is None else float(sigma)
        for known in self.noise_error:
            if abs(known - sigma) < 1e-12:
                return known
        raise KeyError(f"sigma {sigma} was not evaluated; known: {sorted(self.noise_error)}")


def invert(features: FeatureFn, target_pixels: Tensor, steps: int = 300, lr: float = 0.05, tv_weight: float = 0.01,
           sigma: float = 1 / 18, report_sigmas: Sequence[float] = SEED_SIGMAS, noise_draws: int = 8,
           early_stop: bool = True, check_every: int = 10, init: Tensor | None = None,
           generator: torch.Generator | None = None,
           progress: Callable[[Iterable[int]], Iterable[int]] | None = None) -> InversionResult:
    """Inverts a layer's representation of ``target_pixels`` by gradient descent on the input.

    Minimises ``sum_i ||O(a_g,i) - O(a_i)|| / ||O(a_i)|| + tv_weight * TV(a_g,i)`` with Adam, a cosine learning
    rate over ``steps`` and projection onto [0, 1]. Images in the batch are independent (Adam is elementwise,
    the loss a sum). With ``early_stop`` the run ends once every image has met the criterion at ``sigma``
    (checked every ``check_every`` steps, so the GPU is not synchronised each step; ``steps_to_pass`` is exact).

    Args:
        features: Pixels (B, C, H, W) in [0, 1] -> layer output (see :func:`with_normalization`).
        target_pixels: The images ``a`` (B, C, H, W) in [0, 1].
        steps: Maximum Adam steps.
        lr: Initial learning rate (pixel units).
        tv_weight: Weight of :func:`total_variation`.
        sigma: Noise level of the early-stop criterion (pixel units).
        report_sigmas: Further noise levels evaluated and reported (``sigma`` is always included).
        noise_draws: Noise draws averaged for the baseline.
        early_stop: Stop when the criterion holds for every image.
        check_every: Steps between early-stop checks.
        init: Starting images (B, C, H, W); default U[0, 1] noise from ``generator``.
        generator: CPU generator for the initial image and the noise draws.
        progress: Wrapper of the step range (e.g. a progress bar); None = plain range.

    Returns:
        An :class:`InversionResult`.

    Raises:
        ValueError: bad steps / lr / weights / shapes.
    """
    if target_pixels.ndim != 4:
        raise ValueError(f"target_pixels must be (B, C, H, W), got shape {tuple(target_pixels.shape)}")
    if steps < 0 or lr <= 0 or tv_weight < 0 or check_every < 1:
        raise ValueError(f"need steps >= 0, lr > 0, tv_weight >= 0, check_every >= 1; got steps={steps}, lr={lr}, "
                         f"tv_weight={tv_weight}, check_every={check_every}")
    pixels = target_pixels.detach()
    sigmas = list(dict.fromkeys([float(sigma), *map(float, report_sigmas)]))
    with torch.no_grad():
        target = features(pixels).detach()  # (B, ...)
    target_norm = target.flatten(1).norm(dim=1).clamp_min(1e-12)  # (B,)
    pixel_norm = pixels.flatten(1).norm(dim=1).clamp_min(1e-12)  # (B,)
    noise = noise_baseline(features, pixels, sigmas, noise_draws, target=target, generator=generator)
    noise_error = {s: (d.to(target_norm) / target_norm).cpu() for s, d in noise.items()}
    threshold = noise_error[float(sigma)].to(target_norm.device)  # (B,) relative

    if init is None:
        init = torch.rand(pixels.shape, generator=generator)
    elif init.shape != pixels.shape:
        raise ValueError(f"init shape {tuple(init.shape)} differs from target_pixels {tuple(pixels.shape)}")
    x = init.detach().to(pixels).clamp(0, 1).clone().requires_grad_(True)  # (B, C, H, W) the a_g iterate
    optimizer = torch.optim.Adam([x], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
    feature_error = torch.empty(steps + 1, pixels.shape[0], device=pixels.device)  # (T + 1, B)
    input_error = torch.empty_like(feature_error)
    ever_passed = torch.zeros(pixels.shape[0], dtype=torch.bool, device=pixels.device)

    step = 0
    for step in (progress or iter)(range(steps + 1)):
        last = step == steps
        with torch.set_grad_enabled(not last):
            relative = _distance(features(x), target) / target_norm  # (B,)
        with torch.no_grad():
            feature_error[step] = relative.detach()
            input_error[step] = _distance(x, pixels) / pixel_norm
            ever_passed |= feature_error[step] < threshold
        if last or (early_stop and step % check_every == 0 and bool(ever_passed.all())):
            break
        loss = relative.sum() + tv_weight * total_variation(x).sum() if tv_weight else relative.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            x.clamp_(0, 1)

    feature_error, input_error = feature_error[: step + 1].cpu(), input_error[: step + 1].cpu()
    steps_to_pass = {s: _first_true(feature_error < noise_error[s]) for s in sigmas}
    return InversionResult(image=x.detach(), feature_error=feature_error, input_error=input_error,
                           noise_error=noise_error, sigma=float(sigma), steps_to_pass=steps_to_pass)


def _first_true(mask: Tensor) -> Tensor:
    """(T, B) bool -> (B,) index of the first True along T, -1 where none."""
    hit = mask.any(0)
    first = mask.to(torch.int8).argmax(0)
    return torch.where(hit, first, torch.full_like(first, -1)).long()
