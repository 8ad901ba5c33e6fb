"""Binary classification metrics in numpy: exact and streaming AUC, log loss, calibration.

`roc_auc` and `log_loss` take whole arrays. The accumulators below take a split batch
by batch (`update`), combine with another accumulator of the same kind (`merge`, for
shards or ranks) and report at the end; none keeps a copy of the predictions unless
its docstring says so:

- `BucketedAUC`: AUC from per-class counts in equal-width probability buckets, with a
  rigorous error bound. O(num_buckets) memory.
- `ExactAUC`: keeps labels and scores (16 bytes per row) and calls `roc_auc`.
- `AUCAccumulator`: the policy between the two (`exact`, `bucketed`, or `auto`: exact
  up to a row limit, bucketed above it).
- `CTRStats`: rows, mean label, mean prediction, mean log loss, calibration. O(1).
- `ReliabilityBins`: count, mean prediction and observed rate per probability bin.
- `GroupedAUC`: GAUC, the impression-weighted mean of per-user AUCs. O(rows).
- `SliceMetrics`: `AUCAccumulator` + `CTRStats` per value of one categorical feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

AUCMode = Literal["auto", "exact", "bucketed"]

LOGLOSS_EPS = 1e-7
DEFAULT_AUC_BUCKETS = 2**16
DEFAULT_EXACT_AUC_MAX_ROWS = 1_000_000


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


def _probabilities(scores: ArrayLike, shape: tuple[int, ...]) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64).ravel()
    if s.shape != shape:
        raise ValueError(f"labels {shape} and scores {s.shape} differ in shape")
    if not np.all((s >= 0.0) & (s <= 1.0)):  # also false for NaN
        raise ValueError("scores must be probabilities in [0, 1] (no NaN)")
    return s


class BucketedAUC:
    """Streaming ROC AUC over probability buckets, mergeable across shards and ranks.

    Scores in [0, 1] are counted per class, optionally weighted, in `num_buckets`
    equal-width buckets (bucket b holds [b / B, (b + 1) / B), the last one also 1.0), so
    memory is O(num_buckets) (two float64 arrays) whatever the number of rows.

    Error bound: write P, N for the total positive and negative weight and pos_b, neg_b
    for bucket b's. The bucket index min(floor(s * B), B - 1) never decreases as s grows,
    so a (positive, negative) pair in different buckets is ordered by its buckets exactly
    as by its scores, and counts 0 or 1 in both. Only a pair sharing a bucket is unknown:
    its true contribution is 0 or 1 (0.5 if the two scores tie exactly, which counts 0.5
    in both) and `value()` counts 0.5, so it is off by at most 0.5 times its weight.
    Hence |value() - exact AUC (ties as one half)| <= `error_bound()` =
    sum_b pos_b * neg_b / (2 * P * N). The bound is computed from the data, so it is
    tight where scores crowd into few buckets and ~0 where they spread out.

    Args:
        num_buckets: Buckets over [0, 1] (>= 1).
    """

    def __init__(self, num_buckets: int = DEFAULT_AUC_BUCKETS) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.num_buckets = num_buckets
        self.positives = np.zeros(num_buckets, dtype=np.float64)  # (B,) weight per bucket
        self.negatives = np.zeros(num_buckets, dtype=np.float64)  # (B,)
        self.rows = 0

    def update(
        self, labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None
    ) -> None:
        """Count a batch.

        Args:
            labels: (N,) 0/1 labels.
            scores: (N,) probabilities in [0, 1].
            weights: (N,) non-negative row weights; None counts every row once.

        Raises:
            ValueError: Shapes differ, a label is not 0/1, a score is outside [0, 1] or
                NaN, or a weight is negative.
        """
        y = _binary_labels(labels)
        s = _probabilities(scores, y.shape)
        w = None
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64).ravel()
            if w.shape != y.shape:
                raise ValueError(f"labels {y.shape} and weights {w.shape} differ in shape")
            if not np.all(w >= 0.0):
                raise ValueError("weights must be non-negative (no NaN)")
        bucket = np.minimum((s * self.num_buckets).astype(np.int64), self.num_buckets - 1)
        positive = y == 1.0
        for counts, mask in ((self.positives, positive), (self.negatives, ~positive)):
            counts += np.bincount(
                bucket[mask], weights=None if w is None else w[mask], minlength=self.num_buckets
            )
        self.rows += int(y.size)

    def merge(self, other: BucketedAUC) -> None:
        """Add another accumulator's counts (another shard's or rank's)."""
        if other.num_buckets != self.num_buckets:
            raise ValueError(f"cannot merge {other.num_buckets} buckets into {self.num_buckets}")
        self.positives += other.positives
        self.negatives += other.negatives
        self.rows += other.rows

    def _totals(self) -> tuple[float, float]:
        positives, negatives = float(self.positives.sum()), float(self.negatives.sum())
        if positives == 0 or negatives == 0:
            raise ValueError("AUC is undefined when only one class is present")
        return positives, negatives

    def value(self) -> float:
        """The bucketed AUC: pairs in one bucket count one half.

        Raises:
            ValueError: Only one class has been counted.
        """
        positives, negatives = self._totals()
        below = np.cumsum(self.negatives) - self.negatives  # negatives in lower buckets
        wins = float((self.positives * below).sum() + 0.5 * (self.positives * self.negatives).sum())
        return wins / (positives * negatives)

    def error_bound(self) -> float:
        """A bound on |value() - exact AUC| (see the class docstring)."""
        positives, negatives = self._totals()
        shared = float((self.positives * self.negatives).sum())
        return shared / (2.0 * positives * negatives)


class ExactAUC:
    """Exact ROC AUC of a stream: keeps every label and score, then calls `roc_auc`.

    Memory: 16 bytes per row (float64 label and score), held until `value()`, which
    concatenates them (another 16 bytes per row) and sorts. For small splits only; see
    `AUCAccumulator` for the policy.
    """

    def __init__(self) -> None:
        self._labels: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self.rows = 0

    def update(self, labels: ArrayLike, scores: ArrayLike) -> None:
        """Keep a batch of (N,) 0/1 labels and (N,) scores (any real numbers, no NaN)."""
        y = _binary_labels(labels)
        s = np.array(scores, dtype=np.float64).ravel()  # a copy: callers reuse buffers
        if y.shape != s.shape:
            raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
        if np.isnan(s).any():
            raise ValueError("scores must not be NaN")
        self._labels.append(y)
        self._scores.append(s)
        self.rows += int(y.size)

    def merge(self, other: ExactAUC) -> None:
        """Take over another accumulator's rows (they are appended, not copied)."""
        self._labels.extend(other._labels)
        self._scores.extend(other._scores)
        self.rows += other.rows

    def chunks(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The kept (labels, scores) batches, in order."""
        return list(zip(self._labels, self._scores, strict=True))

    def value(self) -> float:
        """The exact AUC, ties counted as one half.

        Raises:
            ValueError: No rows, or only one class.
        """
        if not self._labels:
            raise ValueError("AUC is undefined when only one class is present")
        return roc_auc(np.concatenate(self._labels), np.concatenate(self._scores))

    def error_bound(self) -> float:
        """0.0: the value is exact."""
        return 0.0


class AUCAccumulator:
    """Streaming AUC with a choice of exact or bucketed counting.

    Modes:
        - "exact": `ExactAUC`, whatever the number of rows (16 bytes per row).
        - "bucketed": `BucketedAUC` with `num_buckets` buckets (16 bytes per bucket).
        - "auto": exact while at most `exact_max_rows` rows have been seen; on the
          first row beyond, the kept rows are counted into buckets and dropped, and the
          accumulator stays bucketed. Memory: at most max(16 * exact_max_rows,
          16 * num_buckets) bytes.

    `mode` says which one holds the rows now; `error_bound()` is 0.0 in exact mode.
    Scores must be probabilities in [0, 1] in every mode, so that switching is always
    possible.

    Args:
        mode: "auto", "exact" or "bucketed".
        num_buckets: Buckets of the bucketed counting.
        exact_max_rows: Row limit of exact counting in "auto" mode.
    """

    def __init__(
        self,
        mode: AUCMode = "auto",
        num_buckets: int = DEFAULT_AUC_BUCKETS,
        exact_max_rows: int = DEFAULT_EXACT_AUC_MAX_ROWS,
    ) -> None:
        if mode not in ("auto", "exact", "bucketed"):
            raise ValueError(f"mode must be auto, exact or bucketed, got {mode!r}")
        if exact_max_rows < 0:
            raise ValueError(f"exact_max_rows must be >= 0, got {exact_max_rows}")
        self.policy = mode
        self.num_buckets = num_buckets
        self.exact_max_rows = exact_max_rows
        self._exact: ExactAUC | None = None
        self._bucketed: BucketedAUC | None = None
        if mode == "bucketed":
            self._bucketed = BucketedAUC(num_buckets)
        else:
            BucketedAUC(num_buckets)  # validates num_buckets up front
            self._exact = ExactAUC()

    @property
    def mode(self) -> Literal["exact", "bucketed"]:
        """How the rows are counted now."""
        return "exact" if self._exact is not None else "bucketed"

    @property
    def rows(self) -> int:
        """Rows counted so far."""
        return self._exact.rows if self._exact is not None else self._bucketed.rows

    def update(self, labels: ArrayLike, scores: ArrayLike) -> None:
        """Count a batch of (N,) 0/1 labels and (N,) probabilities in [0, 1]."""
        y = _binary_labels(labels)
        s = _probabilities(scores, y.shape)
        if self._exact is not None:
            self._exact.update(y, s)
            self._maybe_switch()
        else:
            self._bucketed.update(y, s)

    def merge(self, other: AUCAccumulator) -> None:
        """Add another accumulator's rows; both must have the same settings.

        Raises:
            ValueError: The settings (mode, buckets, row limit) differ.
        """
        mine = (self.policy, self.num_buckets, self.exact_max_rows)
        theirs = (other.policy, other.num_buckets, other.exact_max_rows)
        if mine != theirs:
            raise ValueError(f"cannot merge an AUC accumulator with settings {theirs} into {mine}")
        if self._exact is not None and other._exact is not None:
            self._exact.merge(other._exact)
            self._maybe_switch()
            return
        self._to_bucketed()
        if other._exact is not None:
            for y, s in other._exact.chunks():
                self._bucketed.update(y, s)
        else:
            self._bucketed.merge(other._bucketed)

    def value(self) -> float:
        """The AUC (exact, or bucketed with pairs in one bucket as one half).

        Raises:
            ValueError: Only one class (or no row) has been counted.
        """
        return (self._exact or self._bucketed).value()

    def error_bound(self) -> float:
        """A bound on |value() - exact AUC|: 0.0 in exact mode, see `BucketedAUC`."""
        return (self._exact or self._bucketed).error_bound()

    def _maybe_switch(self) -> None:
        if self.policy == "auto" and self._exact.rows > self.exact_max_rows:
            self._to_bucketed()

    def _to_bucketed(self) -> None:
        if self._exact is None:
            return
        self._bucketed = BucketedAUC(self.num_buckets)
        for y, s in self._exact.chunks():
            self._bucketed.update(y, s)
        self._exact = None


class CTRStats:
    """Streaming rows, mean label, mean prediction and mean log loss. O(1) memory.

    Sums are float64: the per-row loss -[y log p + (1 - y) log(1 - p)] with p clipped
    to [eps, 1 - eps] exactly as `log_loss` does, the labels and the probabilities.

    Args:
        eps: Clipping of the probabilities in the log loss.
    """

    def __init__(self, eps: float = LOGLOSS_EPS) -> None:
        self.eps = eps
        self.rows = 0
        self.label_sum = 0.0
        self.prediction_sum = 0.0
        self.loss_sum = 0.0

    def update(self, labels: ArrayLike, probabilities: ArrayLike) -> None:
        """Count a batch of (N,) 0/1 labels and (N,) probabilities in [0, 1]."""
        y = _binary_labels(labels)
        p = _probabilities(probabilities, y.shape)
        clipped = np.clip(p, self.eps, 1.0 - self.eps)
        self.rows += int(y.size)
        self.label_sum += float(y.sum())
        self.prediction_sum += float(p.sum())
        self.loss_sum -= float((y * np.log(clipped) + (1.0 - y) * np.log1p(-clipped)).sum())

    def merge(self, other: CTRStats) -> None:
        """Add another accumulator's sums."""
        if other.eps != self.eps:
            raise ValueError(f"cannot merge log loss clipped at {other.eps} into {self.eps}")
        self.rows += other.rows
        self.label_sum += other.label_sum
        self.prediction_sum += other.prediction_sum
        self.loss_sum += other.loss_sum

    def _require_rows(self) -> None:
        if self.rows == 0:
            raise ValueError("metrics of an empty set are undefined")

    def logloss(self) -> float:
        """Mean log loss (natural log)."""
        self._require_rows()
        return self.loss_sum / self.rows

    def click_rate(self) -> float:
        """Mean label (the observed CTR)."""
        self._require_rows()
        return self.label_sum / self.rows

    def mean_prediction(self) -> float:
        """Mean predicted probability (the predicted CTR)."""
        self._require_rows()
        return self.prediction_sum / self.rows

    def calibration(self) -> float:
        """Predicted / observed CTR: 1.0 is calibrated, above 1 over-predicts.

        Raises:
            ValueError: No rows, or no positive label.
        """
        self._require_rows()
        if self.label_sum == 0:
            raise ValueError("calibration is undefined without a positive label")
        return self.prediction_sum / self.label_sum


class ReliabilityBins:
    """Reliability diagram data: per equal-width probability bin, count, mean prediction
    and observed rate. O(num_bins) memory.

    Bin edges are `linspace(0, 1, num_bins + 1)`; bin k holds (edge_k, edge_k+1], the
    first also 0.0, which is how `sklearn.calibration.calibration_curve` (uniform
    strategy) assigns them.

    Args:
        num_bins: Number of bins (>= 1).
    """

    def __init__(self, num_bins: int = 10) -> None:
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        self.edges = np.linspace(0.0, 1.0, num_bins + 1)  # (K + 1,)
        self.counts = np.zeros(num_bins, dtype=np.int64)  # (K,)
        self.prediction_sums = np.zeros(num_bins, dtype=np.float64)  # (K,)
        self.label_sums = np.zeros(num_bins, dtype=np.float64)  # (K,)

    @property
    def num_bins(self) -> int:
        return len(self.counts)

    def update(self, labels: ArrayLike, probabilities: ArrayLike) -> None:
        """Count a batch of (N,) 0/1 labels and (N,) probabilities in [0, 1]."""
        y = _binary_labels(labels)
        p = _probabilities(probabilities, y.shape)
        k = self.num_bins
        bins = np.searchsorted(self.edges[1:-1], p)
        self.counts += np.bincount(bins, minlength=k)
        self.prediction_sums += np.bincount(bins, weights=p, minlength=k)
        self.label_sums += np.bincount(bins, weights=y, minlength=k)

    def merge(self, other: ReliabilityBins) -> None:
        """Add another accumulator's bins."""
        if other.num_bins != self.num_bins:
            raise ValueError(f"cannot merge {other.num_bins} bins into {self.num_bins}")
        self.counts += other.counts
        self.prediction_sums += other.prediction_sums
        self.label_sums += other.label_sums

    def bins(self) -> list[dict[str, float | int | None]]:
        """One dict per bin: `lower`, `upper`, `count`, `mean_prediction`,
        `observed_rate` (the last two None for an empty bin)."""
        out = []
        for k in range(self.num_bins):
            count = int(self.counts[k])
            out.append(
                {
                    "lower": float(self.edges[k]),
                    "upper": float(self.edges[k + 1]),
                    "count": count,
                    "mean_prediction": float(self.prediction_sums[k] / count) if count else None,
                    "observed_rate": float(self.label_sums[k] / count) if count else None,
                }
            )
        return out


class GroupedAUCValue(NamedTuple):
    """GAUC and what it was computed over."""

    gauc: float
    groups: int  # groups (users) with both classes, the ones averaged
    rows: int  # their rows (the total weight)


class GroupedAUC:
    """Grouped AUC (GAUC): per-group exact AUC (ties as one half), averaged with each
    group's row count (impressions) as its weight, over the groups that have both a
    positive and a negative row. Groups with one class are left out and not counted.

    Memory: O(rows). Per-group AUC needs every score of the group, and a split's rows
    are not grouped by user, so the accumulator keeps (int64 group, float64 score,
    uint8 label) = 17 bytes per row; `value()` sorts them and needs about 8 more
    8-byte arrays of the rows at its peak. (A per-group histogram would be
    O(groups x buckets), larger still for any useful bucket count.)
    """

    def __init__(self) -> None:
        self._groups: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self.rows = 0

    def update(self, groups: ArrayLike, labels: ArrayLike, scores: ArrayLike) -> None:
        """Keep a batch of (N,) int group ids, (N,) 0/1 labels and (N,) scores (no NaN)."""
        y = _binary_labels(labels)
        g = np.array(groups, dtype=np.int64).ravel()
        s = np.array(scores, dtype=np.float64).ravel()
        if not g.shape == y.shape == s.shape:
            raise ValueError(f"groups {g.shape}, labels {y.shape}, scores {s.shape} differ")
        if np.isnan(s).any():
            raise ValueError("scores must not be NaN")
        self._groups.append(g)
        self._labels.append(y.astype(np.uint8))
        self._scores.append(s)
        self.rows += int(y.size)

    def merge(self, other: GroupedAUC) -> None:
        """Take over another accumulator's rows (a group may span both)."""
        self._groups.extend(other._groups)
        self._labels.extend(other._labels)
        self._scores.extend(other._scores)
        self.rows += other.rows

    def value(self) -> GroupedAUCValue:
        """GAUC over the groups with both classes.

        Raises:
            ValueError: No group has both a positive and a negative row.
        """
        if not self._groups:
            raise ValueError("GAUC is undefined: no group has both classes")
        g = np.concatenate(self._groups)
        s = np.concatenate(self._scores)
        order = np.lexsort((s, g))  # by group, then score
        g, s = g[order], s[order]
        y = np.concatenate(self._labels)[order].astype(np.float64)
        n = g.size
        position = np.arange(n)
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = g[1:] != g[:-1]
        new_tie = new_group.copy()
        new_tie[1:] |= s[1:] != s[:-1]
        group_start = np.maximum.accumulate(np.where(new_group, position, 0))
        tie_start = np.maximum.accumulate(np.where(new_tie, position, 0))
        tie_id = np.cumsum(new_tie) - 1
        tie_size = np.bincount(tie_id)[tie_id]
        # 1-based rank inside the group; tied scores share the mean of their ranks.
        rank = (tie_start - group_start + 1) + (tie_size - 1) / 2.0
        group_id = np.cumsum(new_group) - 1
        size = np.bincount(group_id).astype(np.float64)
        positives = np.bincount(group_id, weights=y)
        negatives = size - positives
        rank_sum = np.bincount(group_id, weights=rank * y)
        both = (positives > 0) & (negatives > 0)
        if not both.any():
            raise ValueError("GAUC is undefined: no group has both classes")
        p, q, r, w = positives[both], negatives[both], rank_sum[both], size[both]
        auc = (r - p * (p + 1) / 2.0) / (p * q)
        return GroupedAUCValue(
            gauc=float((w * auc).sum() / w.sum()), groups=int(both.sum()), rows=int(w.sum())
        )


@dataclass(frozen=True)
class SliceValue:
    """The metrics of one slice (rows with one value of a feature)."""

    num_rows: int
    click_rate: float
    mean_prediction: float
    logloss: float
    auc: float | None  # None when the slice holds one class
    auc_error_bound: float | None


class SliceMetrics:
    """`AUCAccumulator` and `CTRStats` per value of one categorical feature.

    Memory: per value seen, one `AUCAccumulator` (see its modes) and O(1) sums; so the
    number of distinct values must stay small (a city, a device, not a user).

    Args:
        mode, num_buckets, exact_max_rows: Settings of every slice's `AUCAccumulator`.
    """

    def __init__(
        self,
        mode: AUCMode = "auto",
        num_buckets: int = DEFAULT_AUC_BUCKETS,
        exact_max_rows: int = DEFAULT_EXACT_AUC_MAX_ROWS,
    ) -> None:
        self._settings = (mode, num_buckets, exact_max_rows)
        self._aucs: dict[int, AUCAccumulator] = {}
        self._stats: dict[int, CTRStats] = {}

    def update(self, values: ArrayLike, labels: ArrayLike, probabilities: ArrayLike) -> None:
        """Count a batch of (N,) int feature values, 0/1 labels and probabilities."""
        v = np.asarray(values, dtype=np.int64).ravel()
        y = _binary_labels(labels)
        p = _probabilities(probabilities, y.shape)
        if v.shape != y.shape:
            raise ValueError(f"values {v.shape} and labels {y.shape} differ in shape")
        uniques, inverse = np.unique(v, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(np.bincount(inverse, minlength=len(uniques)))[:-1]
        for value, rows in zip(uniques.tolist(), np.split(order, bounds), strict=True):
            if value not in self._aucs:
                self._aucs[value] = AUCAccumulator(*self._settings)
                self._stats[value] = CTRStats()
            self._aucs[value].update(y[rows], p[rows])
            self._stats[value].update(y[rows], p[rows])

    def merge(self, other: SliceMetrics) -> None:
        """Add another accumulator's slices."""
        for value, auc in other._aucs.items():
            if value in self._aucs:
                self._aucs[value].merge(auc)
                self._stats[value].merge(other._stats[value])
            else:
                self._aucs[value] = auc
                self._stats[value] = other._stats[value]

    def values(self) -> dict[int, SliceValue]:
        """The metrics of every value seen, by value, in ascending order."""
        out = {}
        for value in sorted(self._aucs):
            stats, auc = self._stats[value], self._aucs[value]
            one_class = stats.label_sum in (0, stats.rows)
            out[value] = SliceValue(
                num_rows=stats.rows,
                click_rate=stats.click_rate(),
                mean_prediction=stats.mean_prediction(),
                logloss=stats.logloss(),
                auc=None if one_class else auc.value(),
                auc_error_bound=None if one_class else auc.error_bound(),
            )
        return out
