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


class BucketedAUC:
    """Streaming ROC AUC over probability buckets, mergeable across shards and ranks.

    Scores in [0, 1] are counted per class in `num_buckets` equal-width buckets, so
    memory is O(num_buckets) whatever the number of rows. Pairs in different buckets
    are ordered by bucket, which is exact; pairs sharing a bucket count one half. Only
    those shared-bucket pairs are unknown, and each one's true contribution is 0, 0.5
    or 1, so the bucketed AUC differs from the exact one (ties as one half) by at most
    `error_bound()` = sum_b pos_b * neg_b / (2 * P * N).

    Args:
        num_buckets: Buckets over [0, 1] (>= 1).
    """

    def __init__(self, num_buckets: int = 2**16) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.num_buckets = num_buckets
        self.positives = np.zeros(num_buckets, dtype=np.int64)
        self.negatives = np.zeros(num_buckets, dtype=np.int64)

    @property
    def rows(self) -> int:
        return int(self.positives.sum() + self.negatives.sum())

    def update(self, labels: ArrayLike, scores: ArrayLike) -> None:
        """Count a batch of (N,) 0/1 labels and (N,) probabilities in [0, 1]."""
        y = _binary_labels(labels)
        s = np.asarray(scores, dtype=np.float64).ravel()
        if y.shape != s.shape:
            raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
        if not np.all((s >= 0.0) & (s <= 1.0)):  # also false for NaN
            raise ValueError("scores must be probabilities in [0, 1] (no NaN)")
        bucket = np.minimum((s * self.num_buckets).astype(np.int64), self.num_buckets - 1)
        positive = y == 1.0
        self.positives += np.bincount(bucket[positive], minlength=self.num_buckets)
        self.negatives += np.bincount(bucket[~positive], minlength=self.num_buckets)

    def merge(self, other: BucketedAUC) -> None:
        """Add another accumulator's counts (another shard's or rank's)."""
        if other.num_buckets != self.num_buckets:
            raise ValueError(f"cannot merge {other.num_buckets} buckets into {self.num_buckets}")
        self.positives += other.positives
        self.negatives += other.negatives

    def _totals(self) -> tuple[float, float]:
        positives, negatives = float(self.positives.sum()), float(self.negatives.sum())
        if positives == 0 or negatives == 0:
            raise ValueError("AUC is undefined when only one class is present")
        return positives, negatives

    def value(self) -> float:
        """The bucketed AUC: pairs in one bucket count one half."""
        positives, negatives = self._totals()
        below = np.cumsum(self.negatives) - self.negatives  # negatives in lower buckets
        pairs = self.positives.astype(np.float64)
        wins = float((pairs * below).sum() + 0.5 * (pairs * self.negatives).sum())
        return wins / (positives * negatives)

    def error_bound(self) -> float:
        """A bound on |value() - exact AUC| (see the class docstring)."""
        positives, negatives = self._totals()
        shared = float((self.positives.astype(np.float64) * self.negatives).sum())
        return shared / (2.0 * positives * negatives)
