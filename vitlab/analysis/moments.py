"""Central moments of many variables accumulated batch by batch (for kurtosis over thousands of images).

:func:`excess_kurtosis` needs every sample at once; a ViT-B layer has 150k neurons, so probes over many
images instead take the moments of each batch and merge them with the pairwise update of Chan, Golub and
LeVeque (1979), extended to the third and fourth moments (Pébay 2008). The merge is exact in exact
arithmetic and, unlike raw power sums, does not lose precision when the mean is large against the spread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Moments", "central_moments", "merge_moments"]


@dataclass(frozen=True)
class Moments:
    """Sample count, mean and sums of powers of deviations from the mean, per variable (float64).

    Attributes:
        count: Samples N.
        mean: Mean per variable.
        m2: Sum of (x - mean)^2 per variable.
        m3: Sum of (x - mean)^3.
        m4: Sum of (x - mean)^4.
    """

    count: int
    mean: Tensor
    m2: Tensor
    m3: Tensor
    m4: Tensor

    @property
    def variance(self) -> Tensor:
        """Biased variance m2 / N."""
        return self.m2 / self.count

    @property
    def excess_kurtosis(self) -> Tensor:
        """N m4 / m2^2 - 3 (biased moments: ``scipy.stats.kurtosis``'s default); NaN for a constant variable."""
        return self.count * self.m4 / self.m2.square() - 3.0


def central_moments(x: Tensor, dim: int = 0) -> Moments:
    """Moments of ``x`` along ``dim`` (the sample dimension), computed in float64.

    Args:
        x: Samples; any real dtype.
        dim: Sample dimension.

    Returns:
        :class:`Moments` with tensors of ``x``'s shape without ``dim``.
    """
    if x.ndim == 0 or x.shape[dim] < 1:
        raise ValueError(f"central_moments: need at least 1 sample along dim {dim}, got shape {tuple(x.shape)}")
    x = x.detach().to(torch.float64)
    mean = x.mean(dim)
    centred = x - mean.unsqueeze(dim)
    sq = centred.square()
    return Moments(int(x.shape[dim]), mean, sq.sum(dim), (sq * centred).sum(dim), sq.square().sum(dim))


def merge_moments(a: Moments | None, b: Moments) -> Moments:
    """Moments of the union of two disjoint sample sets (``a`` None: ``b`` itself).

    Args:
        a: Moments of the first set, or None.
        b: Moments of the second set (same variables).

    Returns:
        The merged :class:`Moments`.
    """
    if a is None:
        return b
    if a.mean.shape != b.mean.shape:
        raise ValueError(f"merge_moments: variables differ in shape: {tuple(a.mean.shape)} vs {tuple(b.mean.shape)}")
    na, nb = float(a.count), float(b.count)
    n = na + nb
    delta = b.mean - a.mean
    d2 = delta.square()
    mean = a.mean + delta * (nb / n)
    m2 = a.m2 + b.m2 + d2 * (na * nb / n)
    m3 = a.m3 + b.m3 + d2 * delta * (na * nb * (na - nb) / n**2) + 3.0 * delta * (na * b.m2 - nb * a.m2) / n
    m4 = (
        a.m4
        + b.m4
        + d2.square() * (na * nb * (na * na - na * nb + nb * nb) / n**3)
        + 6.0 * d2 * (na * na * b.m2 + nb * nb * a.m2) / n**2
        + 4.0 * delta * (na * b.m3 - nb * a.m3) / n
    )
    return Moments(a.count + b.count, mean, m2, m3, m4)
