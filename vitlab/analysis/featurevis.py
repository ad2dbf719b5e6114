"""Feature visualisation by input optimisation: class maximisation (the Attentionless article) and MLP
neurons (Ghiasi et al. 2022; docs/analyses.md).

Both optimise an image ``x`` in [0, 1] (pixel units; projected with ``clamp`` after every step) with Adam:

- class maximisation (the Attentionless article): loss ``(z_c(x) - T)^2`` with a large constant ``T`` (100), start
  ``N(0.7, (1/20)^2)``, a 3x3 Gaussian blur after every step with sigma annealed 2.4 -> 0 (skipped below
  ~0.3), and from iteration ~200 a random roll of the input by up to about a patch, for the forward only
  (the gradient flows back through the roll, so the update lands on the unrolled image);
- MLP-neuron visualisation (Ghiasi et al. 2022): maximise the mean over patch tokens of one MLP hidden unit
  (fc1 after GELU), with roll jitter, a random per-channel colour shift and decaying noise on the forward
  input, a small TV penalty and a cosine learning rate over ~400 steps.

The schedule and augmentations are small functions (:func:`blur_schedule`, :func:`gaussian_blur`,
:func:`roll_jitter`) shared by one optimiser, :func:`optimize_input`, driven by a :class:`VisRecipe`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from vitlab.analysis.inversion import total_variation

__all__ = [
    "CLASS_RECIPE",
    "NEURON_RECIPE",
    "VisRecipe",
    "VisResult",
    "blur_schedule",
    "class_maximization",
    "gaussian_blur",
    "neuron_maximization",
    "optimize_input",
    "recipe_with",
    "roll_jitter",
]

# objective(x) -> (loss (K,) to minimise, {curve name: (K,) value recorded each step})
Objective = Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]
Progress = Callable[[Iterable[int]], Iterable[int]]  # wraps the step range (e.g. a tqdm bar); identity by default


@dataclass(frozen=True)
class VisRecipe:
    """Settings of one input optimisation (see :data:`CLASS_RECIPE`, :data:`NEURON_RECIPE`).

    Attributes:
        steps: Adam steps.
        lr: Learning rate (pixel units).
        cosine: Cosine-decay the learning rate to 0 over ``steps``.
        init_mean: Mean of the Gaussian start image.
        init_std: Std of the Gaussian start image.
        blur_start: Blur sigma (pixels) after step 0; 0 = no blur.
        blur_end: Blur sigma after the last step (linear in between).
        min_blur: Sigmas below this are skipped.
        blur_kernel: Odd side of the square blur kernel (3 in the Attentionless article).
        jitter: Maximum roll in pixels along each axis; 0 = none.
        jitter_from: First step with jitter.
        color_shift: Per image and channel, the forward input is ``x * (1 + u) + v`` with u, v ~ U(-s, s).
        noise_start: Std of Gaussian noise added to the forward input at step 0, decaying linearly to 0.
        tv_weight: Weight of the TV^2 penalty on ``x``.
        snapshot_every: Keep the image every this many steps (and after the last).
    """

    steps: int = 400
    lr: float = 0.02
    cosine: bool = False
    init_mean: float = 0.7
    init_std: float = 1 / 20
    blur_start: float = 0.0
    blur_end: float = 0.0
    min_blur: float = 0.3
    blur_kernel: int = 3
    jitter: int = 0
    jitter_from: int = 0
    color_shift: float = 0.0
    noise_start: float = 0.0
    tv_weight: float = 0.0
    snapshot_every: int = 50

    def __post_init__(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.snapshot_every < 1:
            raise ValueError(f"need steps >= 1, lr > 0, snapshot_every >= 1; got steps={self.steps}, lr={self.lr}, "
                             f"snapshot_every={self.snapshot_every}")
        if self.blur_kernel < 1 or self.blur_kernel % 2 == 0:
            raise ValueError(f"blur_kernel must be a positive odd size, got {self.blur_kernel}")
        if min(self.blur_start, self.blur_end, self.jitter, self.jitter_from, self.color_shift, self.noise_start,
               self.tv_weight) < 0:
            raise ValueError("blur, jitter, colour shift, noise and TV settings must be >= 0")


CLASS_RECIPE = VisRecipe(steps=400, lr=0.02, blur_start=2.4, blur_end=0.0, jitter=16, jitter_from=200)
NEURON_RECIPE = VisRecipe(steps=400, lr=0.05, cosine=True, jitter=16, color_shift=0.1, noise_start=0.05,
                          tv_weight=0.05)


@dataclass(frozen=True)
class VisResult:
    """Result of :func:`optimize_input`.

    Attributes:
        image: Final images (K, C, H, W) in [0, 1].
        curves: ``{name: (steps, K)}`` values recorded at every step (e.g. ``logit``, ``probability``).
        snapshots: (S, K, C, H, W) images kept every ``snapshot_every`` steps and after the last.
        snapshot_steps: The step count after which each snapshot was taken.
    """

    image: Tensor
    curves: dict[str, Tensor]
    snapshots: Tensor
    snapshot_steps: list[int]


def blur_schedule(steps: int, start: float = 2.4, end: float = 0.0, min_sigma: float = 0.3) -> Tensor:
    """Blur sigma after each step: linear from ``start`` (step 0) to ``end`` (last step); 0 where below ``min_sigma``.

    Returns:
        (steps,) float sigmas in pixels.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sigmas = torch.linspace(start, end, steps) if steps > 1 else torch.tensor([float(start)])
    return torch.where(sigmas < min_sigma, torch.zeros_like(sigmas), sigmas)


def gaussian_blur(x: Tensor, sigma: float, kernel_size: int = 3) -> Tensor:
    """Per-channel Gaussian blur with a square ``kernel_size`` kernel (normalised; reflect padding).

    Args:
        x: Images (B, C, H, W).
        sigma: Std in pixels; <= 0 returns ``x`` unchanged.
        kernel_size: Odd kernel side.

    Returns:
        (B, C, H, W) blurred images (a constant image is unchanged).
    """
    if sigma <= 0:
        return x
    radius = kernel_size // 2
    offsets = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-0.5 * (offsets / sigma).square())
    kernel = kernel / kernel.sum()  # (k,)
    channels = x.shape[1]
    mode = "reflect" if min(x.shape[-2:]) > radius else "replicate"
    padded = F.pad(x, (radius, radius, radius, radius), mode=mode)
    rows = F.conv2d(padded, kernel.view(1, 1, -1, 1).repeat(channels, 1, 1, 1), groups=channels)  # vertical
    return F.conv2d(rows, kernel.view(1, 1, 1, -1).repeat(channels, 1, 1, 1), groups=channels)  # horizontal


def roll_jitter(x: Tensor, step: int, start: int, max_shift: int,
                generator: torch.Generator | None = None) -> tuple[Tensor, tuple[int, int]]:
    """Randomly rolls images along H and W by up to ``max_shift`` pixels, from step ``start`` on.

    Args:
        x: Images (B, C, H, W).
        step: The current step.
        start: First step with jitter; earlier steps return ``x`` itself.
        max_shift: Largest shift in pixels (uniform in [-max_shift, max_shift] per axis).
        generator: CPU generator for the shifts.

    Returns:
        (rolled images (B, C, H, W), (dy, dx)).
    """
    if step < start or max_shift <= 0:
        return x, (0, 0)
    dy, dx = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,), generator=generator))
    return torch.roll(x, shifts=(dy, dx), dims=(2, 3)), (dy, dx)


def _augment(x: Tensor, step: int, recipe: VisRecipe, generator: torch.Generator | None) -> Tensor:
    """The forward input of one step: roll jitter, colour shift and decaying noise of ``recipe``."""
    x, _ = roll_jitter(x, step, recipe.jitter_from, recipe.jitter, generator)
    if recipe.color_shift > 0:
        shift = recipe.color_shift * (2 * torch.rand((2, *x.shape[:2], 1, 1), generator=generator) - 1)
        shift = shift.to(x)  # (2, B, C, 1, 1): scale and offset
        x = x * (1 + shift[0]) + shift[1]
    noise_std = recipe.noise_start * (1 - step / recipe.steps)
    if noise_std > 0:
        x = x + noise_std * torch.randn(x.shape, generator=generator).to(x)
    return x


def optimize_input(objective: Objective, shape: Sequence[int], recipe: VisRecipe,
                   generator: torch.Generator | None = None, device: torch.device | str | None = None,
                   progress: Progress | None = None) -> VisResult:
    """Minimises ``objective`` over images in [0, 1] following ``recipe``.

    Per step: augment (jitter, colour shift, noise; forward only) -> loss = objective + TV -> Adam step ->
    blur (scheduled) -> clamp to [0, 1].

    Args:
        objective: Augmented images (K, C, H, W) -> (loss (K,), ``{curve: (K,)}``); images are independent.
        shape: (K, C, H, W).
        recipe: The settings.
        generator: CPU generator for the start image and the augmentations.
        device: Where to optimise.
        progress: Wrapper of the step range (a progress bar); None = plain range.

    Returns:
        A :class:`VisResult`.
    """
    start = recipe.init_mean + recipe.init_std * torch.randn(tuple(shape), generator=generator)
    x = start.clamp(0, 1).to(device).requires_grad_(True)  # (K, C, H, W)
    optimizer = torch.optim.Adam([x], lr=recipe.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=recipe.steps) if recipe.cosine else None
    sigmas = blur_schedule(recipe.steps, recipe.blur_start, recipe.blur_end, recipe.min_blur).tolist()
    curves: dict[str, Tensor] = {}
    snapshots, snapshot_steps = [], []
    for step in (progress or iter)(range(recipe.steps)):
        loss, values = objective(_augment(x, step, recipe, generator))
        if recipe.tv_weight:
            loss = loss + recipe.tv_weight * total_variation(x)
        optimizer.zero_grad(set_to_none=True)
        loss.sum().backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        with torch.no_grad():
            if sigmas[step] > 0:
                x.copy_(gaussian_blur(x, sigmas[step], recipe.blur_kernel))
            x.clamp_(0, 1)
        for name, value in values.items():
            curves.setdefault(name, torch.empty(recipe.steps, x.shape[0], device=x.device))[step] = value.detach()
        if (step + 1) % recipe.snapshot_every == 0 or step + 1 == recipe.steps:
            snapshots.append(x.detach().clone())
            snapshot_steps.append(step + 1)
    return VisResult(image=x.detach(), curves={k: v.cpu() for k, v in curves.items()},
                     snapshots=torch.stack(snapshots).cpu(), snapshot_steps=snapshot_steps)


def class_maximization(logits_fn: Callable[[Tensor], Tensor], classes: Sequence[int], shape: Sequence[int],
                       target: float = 100.0, recipe: VisRecipe = CLASS_RECIPE,
                       generator: torch.Generator | None = None, device: torch.device | str | None = None,
                       progress: Progress | None = None) -> VisResult:
    """The Attentionless article's class visualisation: images whose class logit is driven to ``target``, one per class.

    Args:
        logits_fn: Pixels (K, C, H, W) in [0, 1] -> logits (K, classes) (normalisation inside, see
            :func:`~vitlab.analysis.inversion.with_normalization`).
        classes: The class index of each image (length K).
        shape: One image's (C, H, W).
        target: The constant T of the loss ``(z_c - T)^2``.
        recipe: Settings (default :data:`CLASS_RECIPE`).
        generator: CPU generator.
        device: Where to optimise.
        progress: Wrapper of the step range (a progress bar).

    Returns:
        :class:`VisResult` with curves ``logit`` and ``probability`` (softmax) of each image's class.
    """
    index = torch.as_tensor(list(classes), dtype=torch.long, device=device).view(-1, 1)  # (K, 1)

    def objective(x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        logits = logits_fn(x)  # (K, classes)
        logit = logits.gather(1, index)[:, 0]  # (K,)
        probability = logits.softmax(1).gather(1, index)[:, 0]
        return (logit - target).square(), {"logit": logit, "probability": probability}

    return optimize_input(objective, (len(index), *shape), recipe, generator, device, progress)


def neuron_maximization(hidden_fn: Callable[[Tensor], Tensor], units: Sequence[int], shape: Sequence[int],
                        recipe: VisRecipe = NEURON_RECIPE, generator: torch.Generator | None = None,
                        device: torch.device | str | None = None, progress: Progress | None = None) -> VisResult:
    """MLP-neuron visualisation: images maximising the patch-token mean of one hidden unit each.

    Args:
        hidden_fn: Pixels (K, C, H, W) in [0, 1] -> MLP hidden activations (K, patch tokens, hidden) (prefix
            tokens already dropped).
        units: The hidden unit of each image (length K).
        shape: One image's (C, H, W).
        recipe: Settings (default :data:`NEURON_RECIPE`).
        generator: CPU generator.
        device: Where to optimise.
        progress: Wrapper of the step range (a progress bar).

    Returns:
        :class:`VisResult` with curve ``activation`` (the maximised mean).
    """
    index = torch.as_tensor(list(units), dtype=torch.long, device=device)  # (K,)

    def objective(x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        hidden = hidden_fn(x)  # (K, N, hidden)
        chosen = hidden.gather(2, index.view(-1, 1, 1).expand(-1, hidden.shape[1], 1))[..., 0]  # (K, N)
        activation = chosen.mean(1)  # (K,)
        return -activation, {"activation": activation}

    return optimize_input(objective, (len(index), *shape), recipe, generator, device, progress)


def recipe_with(recipe: VisRecipe, **changes) -> VisRecipe:
    """``recipe`` with some fields replaced (None values ignored), validated again."""
    return replace(recipe, **{k: v for k, v in changes.items() if v is not None})
