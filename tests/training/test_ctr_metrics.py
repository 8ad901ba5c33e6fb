import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from training.metrics import BucketedAUC


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
    assert first.value() == whole.value() and first.error_bound() == whole.error_bound()
    with pytest.raises(ValueError, match="cannot merge"):
        whole.merge(BucketedAUC(8))


def test_canaries_constant_and_oracle_scorers() -> None:
    labels = np.array([0, 1, 0, 1, 1, 0, 0, 0])
    constant = BucketedAUC()
    constant.update(labels, np.full(8, 0.3))
    assert constant.value() == 0.5
    oracle = BucketedAUC()
    oracle.update(labels, labels.astype(np.float64))
    assert oracle.value() == 1.0 and oracle.error_bound() == 0.0


def test_bad_input_is_refused() -> None:
    auc = BucketedAUC()
    with pytest.raises(ValueError, match="probabilities"):
        auc.update([0, 1], [0.5, 1.5])
    with pytest.raises(ValueError, match="probabilities"):
        auc.update([0, 1], [0.5, float("nan")])
    with pytest.raises(ValueError, match="0 or 1"):
        auc.update([0, 2], [0.5, 0.5])
    auc.update([1, 1], [0.5, 0.6])
    with pytest.raises(ValueError, match="only one class"):
        auc.value()
    with pytest.raises(ValueError, match="num_buckets"):
        BucketedAUC(0)
