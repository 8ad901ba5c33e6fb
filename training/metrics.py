"""Binary classification metrics in numpy: exact ROC AUC and log loss."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

LOGLOSS_EPS = 1e-7


def _binary_labels(labels: ArrayLike) -> np.ndarray:
    y = np.asarray(labels, dtype=np.float64).ravel()
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    return y


def roc_auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Exact area under the ROC curve (Mann-Whitney U), ties counted as one half.

    Tied scores get the average of the ranks they span, which equals the trapezoidal
    ROC area sklearn computes.

    Args:
        labels: (N,) 0/1 labels.
        scores: (N,) scores; higher means more likely positive.

    Returns:
        AUC in [0, 1].

    Raises:
        ValueError: Shapes differ, a label is not 0/1, or only one class is present.
    """
    y = _binary_labels(labels)
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
    positives = float(y.sum())
    negatives = float(y.size - positives)
    if positives == 0 or negatives == 0:
        raise ValueError("AUC is undefined when only one class is present")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Ranks 1..N; a group of tied scores spanning ranks a..b all get (a + b) / 2.
    ends = np.cumsum(counts)
    average_ranks = ends - (counts - 1) / 2.0
    rank_sum = float(average_ranks[inverse][y == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def log_loss(labels: ArrayLike, probabilities: ArrayLike, eps: float = LOGLOSS_EPS) -> float:
    """Mean binary cross-entropy of predicted probabilities.

    Args:
        labels: (N,) 0/1 labels.
        probabilities: (N,) predicted probabilities of label 1.
        eps: Probabilities are clipped to [eps, 1 - eps] so the loss stays finite.

    Returns:
        The mean log loss (natural log).

    Raises:
        ValueError: Shapes differ, inputs are empty, or a label is not 0/1.
    """
    y = _binary_labels(labels)
    p = np.clip(np.asarray(probabilities, dtype=np.float64).ravel(), eps, 1.0 - eps)
    if y.shape != p.shape:
        raise ValueError(f"labels {y.shape} and probabilities {p.shape} differ in shape")
    if y.size == 0:
        raise ValueError("log loss of an empty set is undefined")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
