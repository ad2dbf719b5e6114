"""vitlab.analysis.probing (k-NN / logistic-regression probes) and vitlab.analysis.moments (streamed kurtosis)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from sklearn.metrics import balanced_accuracy_score

from vitlab.analysis.moments import central_moments, merge_moments
from vitlab.analysis.probing import balanced_accuracy, knn_probe, linear_probe
from vitlab.analysis.stats import excess_kurtosis


def blobs(n: int, classes: int, dim: int, seed: int, spread: float = 1.0, scales: bool = True):
    """Gaussian class clusters with overlapping tails; columns on very different scales when ``scales``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    centres = torch.randn(classes, dim, generator=g, dtype=torch.float64) * 1.5
    x = centres[labels] + spread * torch.randn(n, dim, generator=g, dtype=torch.float64)
    if scales:
        x = x * torch.logspace(-1, 2, dim, dtype=torch.float64) + 3.0
    return x, labels


# ---------------------------------------------------------------------------------------------- k-NN


def brute_force_knn(train_x, train_y, test_x, k: int) -> torch.Tensor:
    """Independent k-NN: cosine similarity, top k, vote counted with bincount, ties to the smallest label."""
    a = train_x / train_x.norm(dim=1, keepdim=True)
    b = test_x / test_x.norm(dim=1, keepdim=True)
    nearest = (b @ a.T).topk(min(k, len(a)), dim=1).indices  # (M, k)
    classes = int(train_y.max()) + 1
    return torch.stack([torch.bincount(train_y[row], minlength=classes).argmax() for row in nearest])


@pytest.mark.parametrize("k", [1, 5, 500])
def test_knn_matches_brute_force(k):
    x, y = blobs(180, 3, 6, seed=0, spread=1.5)
    train_x, train_y, test_x, test_y = x[:120], y[:120], x[120:], y[120:]
    score = knn_probe(train_x, train_y, test_x, test_y, k=k)
    expected = brute_force_knn(train_x, train_y, test_x, k)
    assert torch.equal(score.predictions, expected)
    assert score.accuracy == pytest.approx(float((expected == test_y).double().mean()))
    assert score.balanced_accuracy == pytest.approx(balanced_accuracy_score(test_y.numpy(), expected.numpy()))
    if k == 500:  # capped at all 120 train samples: every test point gets the majority class
        assert torch.equal(score.predictions, torch.full_like(test_y, int(torch.bincount(train_y).argmax())))
    else:
        assert 0.0 < score.accuracy < 1.0  # the task is neither trivial nor hopeless


def test_balanced_accuracy_matches_sklearn():
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 4, (50,), generator=g)
    pred = torch.randint(0, 5, (50,), generator=g)  # includes a class absent from the labels
    with pytest.warns(UserWarning, match="not in y_true"):
        expected = balanced_accuracy_score(labels.numpy(), pred.numpy())
    assert balanced_accuracy(pred, labels) == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------- linear


def reference_logistic(train_x, train_y, test_x, c: float):
    """Independent fit of sklearn's objective: C * sum(log-loss) + |W|^2 / 2 on standardised features.

    Returns the predictions and the decision margin of each test point (to skip near-ties).
    """
    mean, std = train_x.mean(0), train_x.std(0, correction=0)
    xs, ts = (train_x - mean) / std, (test_x - mean) / std
    classes = int(train_y.max()) + 1
    binary = classes == 2
    w = torch.zeros(xs.shape[1], 1 if binary else classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1 if binary else classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = xs @ w + b
        if binary:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], train_y.double(), reduction="sum")
        else:
            loss = torch.nn.functional.cross_entropy(logits, train_y, reduction="sum")
        loss = c * loss + 0.5 * w.square().sum()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    with torch.no_grad():
        logits = ts @ w + b
        if binary:
            return (logits[:, 0] > 0).long(), logits[:, 0].abs()
        top2 = logits.topk(2, dim=1).values
        return logits.argmax(1), top2[:, 0] - top2[:, 1]


@pytest.mark.parametrize("classes", [2, 3])
def test_linear_probe_matches_independent_fit(classes):
    x, y = blobs(230, classes, 5, seed=10 + classes, spread=2.0)
    train_x, train_y, test_x, test_y = x[:150], y[:150], x[150:], y[150:]
    score = linear_probe(train_x, train_y, test_x, test_y, c=0.05, max_iter=5000)
    expected, margin = reference_logistic(train_x, train_y, test_x, c=0.05)
    clear = margin > 1e-3
    assert clear.sum() > 70
    assert torch.equal(score.predictions[clear], expected[clear])
    assert score.accuracy == pytest.approx(float((score.predictions == test_y).double().mean()))
    assert 0.4 < score.accuracy < 1.0


def test_linear_probe_separable_and_constant_features():
    x, y = blobs(60, 2, 4, seed=5, spread=0.05, scales=False)
    x = torch.cat([x, torch.ones(60, 1, dtype=torch.float64)], 1)  # a constant feature must not give NaN
    score = linear_probe(x[:40], y[:40], x[40:], y[40:])
    assert score.accuracy == 1.0 and score.balanced_accuracy == 1.0


def test_probe_bad_input():
    x, y = blobs(20, 2, 3, seed=0)
    with pytest.raises(ValueError, match="one class only"):
        linear_probe(x, torch.zeros(20, dtype=torch.long), x, y)
    with pytest.raises(ValueError, match="same D"):
        knn_probe(x, y, x[:, :2], y)
    with pytest.raises(ValueError, match="labels must be"):
        knn_probe(x, y[:5], x, y)
    with pytest.raises(ValueError, match="k must be"):
        knn_probe(x, y, x, y, k=0)


# ---------------------------------------------------------------------------------------------- moments


def test_merged_moments_equal_direct_and_scipy():
    g = torch.Generator().manual_seed(0)
    # heavy-tailed, skewed variables far from zero: the case where raw power sums lose precision
    x = 1e4 + torch.randn(997, 3, 5, generator=g, dtype=torch.float64).pow(3) * torch.rand(3, 5, generator=g, dtype=torch.float64)
    merged = None
    for part in torch.split(x, [1, 300, 17, 500, 179]):
        merged = merge_moments(merged, central_moments(part.float() if part.shape[0] == 17 else part))
    x[301:318] = x[301:318].float().double()  # the float32 chunk as it was merged
    direct = central_moments(x)
    assert merged.count == 997
    for field in ("mean", "m2", "m3", "m4"):
        torch.testing.assert_close(getattr(merged, field), getattr(direct, field), rtol=1e-8, atol=0)
    expected = scipy.stats.kurtosis(x.numpy(), axis=0)
    np.testing.assert_allclose(merged.excess_kurtosis.numpy(), expected, rtol=1e-8)
    torch.testing.assert_close(merged.excess_kurtosis, excess_kurtosis(x), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(merged.variance.numpy(), x.var(0, correction=0).numpy(), rtol=1e-9)
    assert float(merged.excess_kurtosis.min()) > 1.0  # cubes of Gaussians: clearly heavy-tailed


def test_moments_bad_input():
    with pytest.raises(ValueError, match="variables differ"):
        merge_moments(central_moments(torch.randn(4, 2)), central_moments(torch.randn(4, 3)))
    with pytest.raises(ValueError, match="at least 1 sample"):
        central_moments(torch.randn(0, 3))
