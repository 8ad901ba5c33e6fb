import numpy as np
import pytest
from sklearn.calibration import calibration_curve
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from training.ctr.metrics import (
    AUCAccumulator,
    BucketedAUC,
    CTRStats,
    ExactAUC,
    GroupedAUC,
    ReliabilityBins,
    SliceMetrics,
    log_loss,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("buckets", [8, 256, 2**16])
def test_bucketed_auc_is_within_its_bound_of_the_exact_auc(seed: int, buckets: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=20_000)
    labels = (rng.random(20_000) < 1 / (1 + np.exp(-2 * logits))).astype(np.float64)
    scores = np.round(1 / (1 + np.exp(-logits)), 3)  # rounded: exact ties too
    auc = BucketedAUC(buckets)
    for start in range(0, 20_000, 3_000):  # streamed in uneven batches
        auc.update(labels[start : start + 3_000], scores[start : start + 3_000])
    exact = roc_auc_score(labels, scores)
    assert auc.rows == 20_000
    assert abs(auc.value() - exact) <= auc.error_bound() + 1e-12
    if buckets == 8:
        assert auc.error_bound() > 0.01  # few buckets: a real, non-trivial bound
    if buckets == 2**16:
        assert auc.error_bound() < 1e-3


def test_merging_two_halves_equals_one_pass() -> None:
    rng = np.random.default_rng(3)
    labels, scores = rng.integers(0, 2, 5_000), rng.random(5_000)
    whole, first, second = BucketedAUC(1024), BucketedAUC(1024), BucketedAUC(1024)
    whole.update(labels, scores)
    first.update(labels[:2_000], scores[:2_000])
    second.update(labels[2_000:], scores[2_000:])
    first.merge(second)
    assert np.array_equal(first.positives, whole.positives)
    assert np.array_equal(first.negatives, whole.negatives)
    assert first.rows == whole.rows == 5_000
    assert first.value() == whole.value() and first.error_bound() == whole.error_bound()
    with pytest.raises(ValueError, match="cannot merge"):
        whole.merge(BucketedAUC(8))


def test_canaries_constant_and_oracle_scorers() -> None:
    labels = np.array([0, 1, 0, 1, 1, 0, 0, 0])
    constant = BucketedAUC()
    constant.update(labels, np.full(8, 0.3))
    assert constant.value() == 0.5 and constant.error_bound() == 0.5
    oracle = BucketedAUC()
    oracle.update(labels, labels.astype(np.float64))
    assert oracle.value() == 1.0 and oracle.error_bound() == 0.0


def test_bad_input_is_refused() -> None:
    auc = BucketedAUC()
    with pytest.raises(ValueError, match="probabilities"):
        auc.update([0, 1], [0.5, 1.5])
    with pytest.raises(ValueError, match="probabilities"):
        auc.update([0, 1], [0.5, float("nan")])
    with pytest.raises(ValueError, match="probabilities"):
        auc.update([0, 1], [-0.1, 0.5])
    with pytest.raises(ValueError, match="0 or 1"):
        auc.update([0, 2], [0.5, 0.5])
    with pytest.raises(ValueError, match="differ in shape"):
        auc.update([0, 1, 1], [0.5, 0.5])
    assert auc.rows == 0  # a refused batch counts nothing
    auc.update([1, 1], [0.5, 0.6])
    with pytest.raises(ValueError, match="only one class"):
        auc.value()
    with pytest.raises(ValueError, match="num_buckets"):
        BucketedAUC(0)


def test_bucketed_auc_weights_count_like_repeated_rows() -> None:
    rng = np.random.default_rng(4)
    labels, scores = rng.integers(0, 2, 300), rng.random(300)
    counts = rng.integers(0, 4, 300)
    weighted, repeated = BucketedAUC(64), BucketedAUC(64)
    weighted.update(labels, scores, weights=counts)
    repeated.update(np.repeat(labels, counts), np.repeat(scores, counts))
    assert weighted.value() == pytest.approx(repeated.value(), abs=1e-12)
    assert weighted.error_bound() == pytest.approx(repeated.error_bound(), abs=1e-12)
    exact = roc_auc_score(labels, scores, sample_weight=counts)
    assert abs(weighted.value() - exact) <= weighted.error_bound() + 1e-12
    with pytest.raises(ValueError, match="non-negative"):
        weighted.update([0, 1], [0.1, 0.2], weights=[1.0, -1.0])


def test_exact_auc_matches_sklearn_and_keeps_its_own_copy() -> None:
    rng = np.random.default_rng(5)
    labels, scores = rng.integers(0, 2, 1_000), np.round(rng.random(1_000), 2)
    auc = ExactAUC()
    buffer = scores[:500].copy()
    auc.update(labels[:500], buffer)
    buffer[:] = 0.0  # the caller reuses its buffer
    auc.update(labels[500:], scores[500:])
    assert auc.value() == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert auc.error_bound() == 0.0 and auc.rows == 1_000


@pytest.mark.parametrize(
    ("mode", "rows", "expected"),
    [
        ("exact", 5_000, "exact"),
        ("bucketed", 10, "bucketed"),
        ("auto", 1_000, "exact"),
        ("auto", 1_001, "bucketed"),
    ],
)
def test_auc_accumulator_policy(mode: str, rows: int, expected: str) -> None:
    rng = np.random.default_rng(6)
    labels, scores = np.arange(rows) % 2, np.round(rng.random(rows), 3)
    auc = AUCAccumulator(mode, num_buckets=128, exact_max_rows=1_000)
    for start in range(0, rows, 300):
        auc.update(labels[start : start + 300], scores[start : start + 300])
    assert auc.mode == expected and auc.rows == rows
    exact = roc_auc_score(labels, scores)
    if expected == "exact":
        assert auc.value() == pytest.approx(exact, abs=1e-12) and auc.error_bound() == 0.0
    else:
        reference = BucketedAUC(128)
        reference.update(labels, scores)
        assert auc.value() == reference.value() and auc.error_bound() > 0
        assert abs(auc.value() - exact) <= auc.error_bound()


def test_auc_accumulator_merge_switches_when_the_sum_passes_the_limit() -> None:
    rng = np.random.default_rng(7)
    labels, scores = rng.integers(0, 2, 1_500), rng.random(1_500)
    whole = AUCAccumulator("auto", 256, 1_000)
    whole.update(labels, scores)
    first, second = AUCAccumulator("auto", 256, 1_000), AUCAccumulator("auto", 256, 1_000)
    first.update(labels[:700], scores[:700])
    second.update(labels[700:], scores[700:])
    assert first.mode == second.mode == "exact"
    first.merge(second)
    assert first.mode == whole.mode == "bucketed"
    assert first.value() == whole.value() and first.error_bound() == whole.error_bound()
    with pytest.raises(ValueError, match="settings"):
        first.merge(AUCAccumulator("bucketed", 256, 1_000))
    with pytest.raises(ValueError, match="probabilities"):
        AUCAccumulator("exact").update([0, 1], [0.2, 3.0])


def test_ctr_stats_match_sklearn_and_merge() -> None:
    rng = np.random.default_rng(8)
    labels = (rng.random(2_000) < 0.2).astype(np.float32)
    p = rng.uniform(0, 1, 2_000)
    p[:3] = [0.0, 1.0, 1.0]  # clipped like log_loss does
    whole, first, second = CTRStats(), CTRStats(), CTRStats()
    whole.update(labels, p)
    first.update(labels[:800], p[:800])
    second.update(labels[800:], p[800:])
    first.merge(second)
    for stats in (whole, first):
        assert stats.rows == 2_000
        assert stats.logloss() == pytest.approx(log_loss(labels, p), rel=1e-12)
        assert stats.logloss() == pytest.approx(
            sk_log_loss(labels, np.clip(p, 1e-7, 1 - 1e-7)), rel=1e-9
        )
        assert stats.click_rate() == pytest.approx(labels.mean(), rel=1e-12)
        assert stats.mean_prediction() == pytest.approx(p.mean(), rel=1e-12)
        assert stats.calibration() == pytest.approx(
            p.mean() / labels.mean(dtype=np.float64), rel=1e-12
        )
    with pytest.raises(ValueError, match="empty"):
        CTRStats().logloss()
    no_clicks = CTRStats()
    no_clicks.update([0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="positive"):
        no_clicks.calibration()


@pytest.mark.parametrize("num_bins", [5, 10])
def test_reliability_bins_match_sklearn_calibration_curve(num_bins: int) -> None:
    rng = np.random.default_rng(9)
    p = rng.beta(1, 4, 3_000)  # skewed: the top bins stay (nearly) empty
    labels = (rng.random(3_000) < p).astype(np.float64)
    bins = ReliabilityBins(num_bins)
    for start in range(0, 3_000, 700):
        bins.update(labels[start : start + 700], p[start : start + 700])
    prob_true, prob_pred = calibration_curve(labels, p, n_bins=num_bins, strategy="uniform")
    filled = [b for b in bins.bins() if b["count"]]
    assert [b["observed_rate"] for b in filled] == pytest.approx(prob_true, abs=1e-12)
    assert [b["mean_prediction"] for b in filled] == pytest.approx(prob_pred, abs=1e-12)
    assert sum(b["count"] for b in bins.bins()) == 3_000
    assert bins.bins()[0]["lower"] == 0.0 and bins.bins()[-1]["upper"] == 1.0


def test_reliability_bin_edges_follow_sklearn() -> None:
    bins = ReliabilityBins(10)
    bins.update([0, 1, 1, 0], [0.0, 0.1, 1.0, 0.15])  # 0.1 closes the first bin
    assert bins.counts.tolist() == [2, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert bins.bins()[2]["mean_prediction"] is None


def test_gauc_on_a_hand_computed_example() -> None:
    # User 7: pos 0.9 beats neg 0.2, loses to neg 0.95 -> AUC 0.5 over 3 rows.
    # User 3: pos 0.6 beats 0.3 and 0.1 (2); pos 0.3 ties 0.3 (0.5), beats 0.1 (1) -> 3.5/4
    #   over 4 rows. User 5: negatives only, left out.
    # GAUC = (3 * 0.5 + 4 * 0.875) / 7 = 5 / 7.
    users = [7, 3, 7, 3, 5, 3, 7, 3, 5]
    labels = [1, 1, 0, 1, 0, 0, 0, 0, 0]
    scores = [0.9, 0.6, 0.2, 0.3, 0.5, 0.3, 0.95, 0.1, 0.4]
    gauc = GroupedAUC()
    gauc.update(users[:4], labels[:4], scores[:4])
    rest = GroupedAUC()
    rest.update(users[4:], labels[4:], scores[4:])
    gauc.merge(rest)  # users span both halves
    result = gauc.value()
    assert result.gauc == pytest.approx(5 / 7, abs=1e-15)
    assert result.groups == 2 and result.rows == 7


def test_gauc_matches_per_user_sklearn_on_random_data() -> None:
    rng = np.random.default_rng(10)
    users = rng.integers(0, 40, 3_000)
    labels = rng.integers(0, 2, 3_000)
    scores = np.round(rng.random(3_000), 1)  # ties inside users
    gauc = GroupedAUC()
    gauc.update(users, labels, scores)
    numerator = denominator = 0.0
    for user in np.unique(users):
        rows = users == user
        if labels[rows].min() != labels[rows].max():
            numerator += rows.sum() * roc_auc_score(labels[rows], scores[rows])
            denominator += rows.sum()
    assert gauc.value().gauc == pytest.approx(numerator / denominator, abs=1e-12)
    with pytest.raises(ValueError, match="both classes"):
        one_class = GroupedAUC()
        one_class.update([1, 2], [1, 0], [0.3, 0.4])
        one_class.value()


def test_slice_metrics_match_sklearn_per_value() -> None:
    rng = np.random.default_rng(11)
    values = rng.integers(0, 4, 2_000)
    labels = rng.integers(0, 2, 2_000)
    labels[values == 3] = 0  # one class: no AUC
    p = rng.random(2_000)
    slices = SliceMetrics("exact")
    for start in range(0, 2_000, 512):
        batch = slice(start, start + 512)
        slices.update(values[batch], labels[batch], p[batch])
    result = slices.values()
    assert list(result) == [0, 1, 2, 3]
    for value in range(3):
        rows = values == value
        assert result[value].num_rows == rows.sum()
        assert result[value].auc == pytest.approx(roc_auc_score(labels[rows], p[rows]), abs=1e-12)
        assert result[value].logloss == pytest.approx(sk_log_loss(labels[rows], p[rows]), rel=1e-9)
        assert result[value].click_rate == pytest.approx(labels[rows].mean())
        assert result[value].mean_prediction == pytest.approx(p[rows].mean())
    assert result[3].auc is None and result[3].click_rate == 0.0
