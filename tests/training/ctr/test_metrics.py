import numpy as np
import pytest
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from training.ctr.metrics import log_loss, roc_auc


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_sklearn_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = (rng.random(2000) < 0.3).astype(np.float32)
    # Rounded scores: many ties, including ties between a positive and a negative.
    scores = np.round(rng.random(2000) + 0.3 * labels, 1)
    assert len(np.unique(scores)) < 20
    assert roc_auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_roc_auc_canaries() -> None:
    labels = np.array([0, 1, 0, 1, 1, 0, 0])
    assert roc_auc(labels, np.full(7, 0.3)) == 0.5
    assert roc_auc(labels, labels * 0.9) == 1.0
    assert roc_auc(labels, 1 - labels) == 0.0


def test_roc_auc_exact_small_case() -> None:
    # Pairs (pos, neg): (0.8 > 0.1), (0.8 > 0.4), (0.4 = 0.4) -> 0.5, (0.4 > 0.1) -> 3.5 / 4
    assert roc_auc([1, 1, 0, 0], [0.8, 0.4, 0.4, 0.1]) == 0.875


def test_roc_auc_rejects_one_class() -> None:
    with pytest.raises(ValueError, match="one class"):
        roc_auc([1, 1, 1], [0.1, 0.2, 0.3])


@pytest.mark.parametrize("seed", range(3))
def test_log_loss_matches_sklearn(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = (rng.random(1000) < 0.4).astype(np.float32)
    probabilities = rng.uniform(0.01, 0.99, size=1000)
    assert log_loss(labels, probabilities) == pytest.approx(
        sk_log_loss(labels, probabilities), rel=1e-12
    )


def test_log_loss_clips_certain_mistakes() -> None:
    loss = log_loss([1, 0], [0.0, 1.0])
    assert loss == pytest.approx(-np.log(1e-7))
