import math

import pytest
from pydantic import ValidationError

from training.blessing import (
    CTR_THRESHOLDS,
    SEQUENCE_THRESHOLDS,
    BlessConfig,
    MetricThreshold,
    decide,
    thresholds_for,
)

GOOD = {"auc": 0.80, "logloss": 0.45}


def test_the_first_model_needs_only_the_floors() -> None:
    decision = decide(CTR_THRESHOLDS, GOOD, None, has_champion=False)
    assert decision.blessed
    assert {(c.metric, c.kind) for c in decision.checks} == {
        ("auc", "value"),
        ("auc", "change"),
        ("logloss", "change"),
    }
    assert all("no champion" in c.reason for c in decision.checks if c.kind == "change")


def test_a_model_on_shuffled_labels_fails_the_floor() -> None:
    decision = decide(CTR_THRESHOLDS, {"auc": 0.503, "logloss": 0.69}, None, False)
    assert not decision.blessed
    (failed,) = [c for c in decision.checks if not c.passed]
    assert failed.metric == "auc" and "0.503 must be >= 0.55" in failed.reason


def test_change_thresholds_compare_with_the_champion_in_the_better_direction() -> None:
    champion = {"auc": 0.80, "logloss": 0.45}
    better = {"auc": 0.81, "logloss": 0.44}
    assert decide(CTR_THRESHOLDS, better, champion, True).blessed
    # AUC within the tolerated regression of 0.001, logloss worse by 0.01 (> 0.002).
    worse = {"auc": 0.7995, "logloss": 0.46}
    decision = decide(CTR_THRESHOLDS, worse, champion, True)
    assert not decision.blessed
    assert [c.metric for c in decision.checks if not c.passed] == ["logloss"]
    # Demanding an improvement: +0.01 clears 0.005, not 0.02.
    assert decide({"auc": MetricThreshold(min_change=0.005)}, better, champion, True).blessed
    assert not decide({"auc": MetricThreshold(min_change=0.02)}, better, champion, True).blessed


@pytest.mark.parametrize("bad", [math.nan, None, "0.9", True, math.inf])
def test_nan_or_missing_metrics_are_not_blessed(bad) -> None:
    metrics = {"logloss": 0.4} if bad is None else {"auc": bad, "logloss": 0.4}
    decision = decide(CTR_THRESHOLDS, metrics, None, False)
    assert not decision.blessed
    assert any(c.metric == "auc" and not c.passed for c in decision.checks)
    # A champion whose metric is unknown fails the change check too.
    decision = decide(CTR_THRESHOLDS, GOOD, {"auc": bad, "logloss": 0.45}, True)
    assert not decision.blessed and "champion's auc" in decision.markdown("v2", "v1")


def test_a_champion_that_could_not_be_scored_blocks_the_change_checks() -> None:
    decision = decide(CTR_THRESHOLDS, GOOD, None, has_champion=True)
    assert not decision.blessed
    assert all(not c.passed for c in decision.checks if c.kind == "change")


def test_sequence_defaults_beat_the_popularity_baseline() -> None:
    assert thresholds_for(BlessConfig(), sequence_model=True) == SEQUENCE_THRESHOLDS
    metrics = {
        "ndcg@10_sampled": 0.47,
        "popularity/ndcg@10_sampled": 0.36,
        "hr@10_sampled": 0.72,
        "popularity/hr@10_sampled": 0.62,
    }
    assert decide(SEQUENCE_THRESHOLDS, metrics, None, False).blessed
    assert not decide(SEQUENCE_THRESHOLDS, {**metrics, "hr@10_sampled": 0.60}, None, False).blessed
    missing = {k: v for k, v in metrics.items() if k != "popularity/hr@10_sampled"}
    assert not decide(SEQUENCE_THRESHOLDS, missing, None, False).blessed


def test_no_thresholds_means_not_blessed_and_the_config_is_strict() -> None:
    assert not decide({}, GOOD, None, False).blessed
    custom = BlessConfig(thresholds={"auc": {"lower_bound": 0.7}})
    assert thresholds_for(custom, sequence_model=False) == {"auc": MetricThreshold(lower_bound=0.7)}
    with pytest.raises(ValidationError, match="needs lower_bound"):
        BlessConfig(thresholds={"auc": {"direction": "higher_is_better"}})
    with pytest.raises(ValidationError, match="extra"):
        BlessConfig(thresholds={"auc": {"lowerbound": 0.7}})
    with pytest.raises(ValidationError, match="lower_bound 0.9 > upper_bound 0.1"):
        MetricThreshold(lower_bound=0.9, upper_bound=0.1)


def test_the_markdown_report_names_every_check() -> None:
    text = decide(CTR_THRESHOLDS, {"auc": 0.5, "logloss": 0.7}, None, False).markdown("v2", None)
    assert "NOT BLESSED" in text and "none yet" in text and "| auc | value | FAIL |" in text
