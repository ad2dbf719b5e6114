"""Frozen-feature evaluation: k-NN and logistic-regression accuracy of features on a train/test split.

The Veta lecture (DINO's Table 10) judges a representation by how well a k-NN classifier and a linear classifier
on frozen features do; applied per block, it shows at which depth the classes become separable and how
fine-tuning moved that depth. Both use scikit-learn; features are float tensors (N, D), labels int (N,).
A segmenter is judged by the Dice of each class, pooled over volumes (:func:`dice_counts`, :func:`dice_from_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ProbeScore", "balanced_accuracy", "dice_counts", "dice_from_counts", "knn_probe", "linear_probe"]


@dataclass(frozen=True)
class ProbeScore:
    """Accuracy of a classifier fitted on train features, evaluated on test features.

    Attributes:
        accuracy: Fraction of test samples predicted right.
        balanced_accuracy: Mean over the classes present in the test labels of the per-class recall.
        predictions: (M,) int64 predicted label of every test sample.
    """

    accuracy: float
    balanced_accuracy: float
    predictions: Tensor


def balanced_accuracy(predictions: Tensor, labels: Tensor) -> float:
    """Mean per-class recall over the classes present in ``labels`` (= sklearn's ``balanced_accuracy_score``).

    Args:
        predictions: (M,) predicted labels.
        labels: (M,) true labels.

    Returns:
        The balanced accuracy in [0, 1].
    """
    predictions, labels = predictions.long().cpu(), labels.long().cpu()
    recalls = [(predictions[labels == c] == c).double().mean() for c in labels.unique()]
    return float(torch.stack(recalls).mean())


def _check(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, fn: str) -> None:
    if train_x.ndim != 2 or test_x.ndim != 2 or train_x.shape[1] != test_x.shape[1]:
        raise ValueError(
            f"{fn}: need train_x (N, D) and test_x (M, D) with the same D, got {tuple(train_x.shape)} and {tuple(test_x.shape)}"
        )
    if train_y.shape != (train_x.shape[0],) or test_y.shape != (test_x.shape[0],):
        raise ValueError(
            f"{fn}: labels must be (N,) = ({train_x.shape[0]},) and (M,) = ({test_x.shape[0]},), "
            f"got {tuple(train_y.shape)} and {tuple(test_y.shape)}"
        )
    if train_x.shape[0] < 1 or test_x.shape[0] < 1:
        raise ValueError(f"{fn}: need at least one train and one test sample, got {train_x.shape[0]} and {test_x.shape[0]}")


def _score(predictions, test_y: Tensor) -> ProbeScore:
    pred = torch.as_tensor(predictions, dtype=torch.int64)  # (M,)
    labels = test_y.long().cpu()
    return ProbeScore(float((pred == labels).double().mean()), balanced_accuracy(pred, labels), pred)


def knn_probe(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, k: int = 20) -> ProbeScore:
    """Majority vote of the k nearest train features by cosine similarity (DINO's k-NN evaluation, unweighted).

    Ties in the vote go to the smallest label. k is capped at the number of train samples.

    Args:
        train_x: (N, D) train features.
        train_y: (N,) integer train labels.
        test_x: (M, D) test features.
        test_y: (M,) integer test labels.
        k: Neighbours.

    Returns:
        :class:`ProbeScore` on the test samples.
    """
    from sklearn.neighbors import KNeighborsClassifier

    _check(train_x, train_y, test_x, test_y, "knn_probe")
    if k < 1:
        raise ValueError(f"knn_probe: k must be >= 1, got {k}")
    knn = KNeighborsClassifier(n_neighbors=min(k, train_x.shape[0]), metric="cosine", algorithm="brute")
    knn.fit(train_x.detach().double().cpu().numpy(), train_y.long().cpu().numpy())
    return _score(knn.predict(test_x.detach().double().cpu().numpy()), test_y)


def linear_probe(
    train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, c: float = 1.0, max_iter: int = 1000
) -> ProbeScore:
    """L2-regularised logistic regression on standardised features (the linear evaluation of frozen features).

    Features are standardised with the train mean and standard deviation, then sklearn's
    ``LogisticRegression(C=c)`` (L-BFGS; multinomial for three classes or more, binomial for two) is fitted.

    Args:
        train_x: (N, D) train features.
        train_y: (N,) integer train labels (at least two classes).
        test_x: (M, D) test features.
        test_y: (M,) integer test labels.
        c: Inverse regularisation strength (sklearn's ``C``).
        max_iter: L-BFGS iterations.

    Returns:
        :class:`ProbeScore` on the test samples.
    """
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    _check(train_x, train_y, test_x, test_y, "linear_probe")
    classes = train_y.unique()
    if classes.numel() < 2:
        raise ValueError(f"linear_probe: the train labels hold one class only ({classes.tolist()}); need at least two")
    if c <= 0:
        raise ValueError(f"linear_probe: c must be > 0, got {c}")
    train = train_x.detach().double().cpu()
    mean, std = train.mean(0), train.std(0, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))  # constant features stay 0
    model = LogisticRegression(C=c, max_iter=max_iter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a near-separable fit stops at max_iter: fine here
        model.fit(((train - mean) / std).numpy(), train_y.long().cpu().numpy())
    return _score(model.predict(((test_x.detach().double().cpu() - mean) / std).numpy()), test_y)


def weighted_knn(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, k: int = 20, temperature: float = 0.07) -> ProbeScore:
    """DINO's ``eval_knn`` (docs/dino.md): L2-normalised features, the k train features of highest cosine similarity
    vote for their label with weight exp(sim / temperature); the class with the largest summed weight wins
    (ties: smallest label). k is capped at the number of train samples.

    Args:
        train_x: (N, D) train features.  train_y: (N,) integer labels.
        test_x: (M, D) test features.  test_y: (M,) integer labels.
        k: Neighbours (DINO: 20).  temperature: Vote temperature (DINO: 0.07).
    """
    _check(train_x, train_y, test_x, test_y, "weighted_knn")
    if k < 1 or temperature <= 0:
        raise ValueError(f"weighted_knn: need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
    train = torch.nn.functional.normalize(train_x.detach().double().cpu(), dim=1)  # (N, D)
    test = torch.nn.functional.normalize(test_x.detach().double().cpu(), dim=1)  # (M, D)
    labels = train_y.long().cpu()
    sim, idx = (test @ train.T).topk(min(k, train.shape[0]), dim=1)  # (M, k)
    classes = int(max(labels.max(), test_y.long().max())) + 1
    votes = torch.zeros(test.shape[0], classes, dtype=torch.float64)
    votes.scatter_add_(1, labels[idx], (sim / temperature).exp())
    return _score(votes.argmax(dim=1), test_y)


def dice_counts(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(3, K) float64 voxel counts of classes 1..K: predicted and true (intersection), predicted, true; ``pred`` and
    ``truth`` are label maps of one shape (values 0 = background .. K)."""
    counts = torch.zeros(3, num_classes, dtype=torch.float64)
    for c in range(1, num_classes + 1):
        p, t = pred == c, truth == c
        counts[:, c - 1] = torch.stack([(p & t).sum(), p.sum(), t.sum()]).double()
    return counts


def dice_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """(K,) Dice 2|P∩T| / (|P| + |T|) per class from :func:`dice_counts` summed over volumes (training's torchmetrics
    ``DiceScore``, ``aggregation_level="global"``); NaN for a class neither predicted nor present."""
    inter, pred, true = counts
    total = pred + true
    return torch.where(total > 0, 2 * inter / total.clamp(min=1), torch.full_like(total, float("nan")))
