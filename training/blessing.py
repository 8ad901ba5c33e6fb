"""The blessing gate: may a candidate model replace the champion?

TFMA-style thresholds, per metric of the evaluate stage's metrics.json:

- a **value threshold** (`lower_bound`, `upper_bound`): an absolute floor or ceiling,
  or `lower_bound_metric`: at least another metric of the same evaluation (a
  baseline's, e.g. `popularity/ndcg@10_sampled`);
- a **change threshold** (`direction`, `min_change`): the candidate's value minus the
  champion's *on the same test data*, counted in the metric's better direction, must
  be at least `min_change` (0: no worse; 0.002: better by 0.002; -0.001: a regression
  of up to 0.001 is tolerated).

A candidate is blessed only when every configured check passes. A missing or NaN
metric fails its checks (never a silent pass). Without a champion (the first model),
change thresholds pass with that reason; with a champion whose metrics on this test
data are unknown (`champion_metrics` None while a champion exists), they fail.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MetricThreshold(BaseModel):
    """Checks of one metric."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lower_bound: float | None = Field(None, description="The value must be >= this.")
    upper_bound: float | None = Field(None, description="The value must be <= this.")
    lower_bound_metric: str | None = Field(
        None,
        description="The value must be >= this other metric of the same evaluation, e.g. "
        "a baseline's (popularity/ndcg@10_sampled).",
    )
    direction: Literal["higher_is_better", "lower_is_better"] = Field(
        "higher_is_better", description="Which way the metric improves (change threshold)."
    )
    min_change: float | None = Field(
        None,
        description="Change threshold: (candidate - champion), in the better direction, "
        "must be >= this; 0 means no worse than the champion. None: no comparison.",
    )

    @model_validator(mode="after")
    def _some_check(self) -> MetricThreshold:
        checks = (self.lower_bound, self.upper_bound, self.lower_bound_metric, self.min_change)
        if all(check is None for check in checks):
            raise ValueError(
                "a metric threshold needs lower_bound, upper_bound, lower_bound_metric or "
                "min_change; "
                "remove the metric to not check it"
            )
        if (
            self.lower_bound is not None
            and self.upper_bound is not None
            and self.lower_bound > self.upper_bound
        ):
            raise ValueError(f"lower_bound {self.lower_bound} > upper_bound {self.upper_bound}")
        return self


# Defaults by model family: CTR models by AUC and logloss; sequence models must beat the
# popularity baseline of the same run and not fall behind the champion (protocol (a),
# which SASRec and BST both report).
CTR_THRESHOLDS = {
    "auc": MetricThreshold(lower_bound=0.55, min_change=-0.001),
    "logloss": MetricThreshold(direction="lower_is_better", min_change=-0.002),
}
SEQUENCE_THRESHOLDS = {
    "ndcg@10_sampled": MetricThreshold(
        lower_bound_metric="popularity/ndcg@10_sampled", min_change=-0.001
    ),
    "hr@10_sampled": MetricThreshold(lower_bound_metric="popularity/hr@10_sampled"),
}


class BlessConfig(BaseModel):
    """The `bless` section: when a new model may become the champion."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thresholds: dict[str, MetricThreshold] | None = Field(
        None,
        description="Metric name (a key of metrics.json, e.g. auc, logloss, "
        "ndcg@10_full) -> its value and change thresholds. None: the defaults of the "
        "model family (CTR: auc >= 0.55 and no worse than the champion by 0.001, logloss "
        "no worse by 0.002; sequence models: beat popularity on hr@10/ndcg@10 sampled, "
        "ndcg@10_sampled no worse than the champion by 0.001).",
    )
    require_approval: bool = Field(
        False,
        description="Pause the flow for a person's approval in the Prefect UI before a "
        "blessed model is promoted.",
    )
    approval_timeout_s: int = Field(
        3600, ge=1, description="How long the paused flow waits; no answer means no."
    )


def thresholds_for(config: BlessConfig, sequence_model: bool) -> dict[str, MetricThreshold]:
    """The configured thresholds, or the model family's defaults."""
    if config.thresholds is not None:
        return dict(config.thresholds)
    return dict(SEQUENCE_THRESHOLDS if sequence_model else CTR_THRESHOLDS)


@dataclass(frozen=True)
class Check:
    """One threshold check and its outcome."""

    metric: str
    kind: Literal["value", "change"]
    passed: bool
    reason: str


@dataclass(frozen=True)
class Decision:
    """The gate's verdict with a reason per check."""

    blessed: bool
    checks: list[Check] = field(default_factory=list)

    def markdown(self, candidate: str, champion: str | None) -> str:
        """The decision as a Markdown report (the Prefect artifact)."""
        verdict = "**BLESSED**" if self.blessed else "**NOT BLESSED**"
        lines = [
            f"# Blessing: {verdict}",
            "",
            f"Candidate `{candidate}`; champion `{champion or 'none yet'}`.",
            "",
            "| metric | check | result | why |",
            "|---|---|---|---|",
        ]
        for check in self.checks:
            result = "pass" if check.passed else "FAIL"
            lines.append(f"| {check.metric} | {check.kind} | {result} | {check.reason} |")
        return "\n".join(lines) + "\n"

    def record(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "blessed": self.blessed,
            "checks": [
                {"metric": c.metric, "kind": c.kind, "passed": c.passed, "reason": c.reason}
                for c in self.checks
            ],
        }


def _number(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    """metrics[name] as a finite float, or None (missing, not a number, NaN, inf)."""
    if metrics is None:
        return None
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def decide(
    thresholds: Mapping[str, MetricThreshold],
    candidate_metrics: Mapping[str, Any],
    champion_metrics: Mapping[str, Any] | None,
    has_champion: bool,
) -> Decision:
    """Apply every threshold.

    Args:
        thresholds: Metric name -> its checks (`thresholds_for`).
        candidate_metrics: The candidate's metrics on the test data.
        champion_metrics: The champion's metrics on the same test data; None when there
            is no champion or it could not be scored on this data.
        has_champion: Whether a champion exists.

    Returns:
        The decision; blessed only if every check passed (and there was one).
    """
    checks: list[Check] = []
    for name, threshold in sorted(thresholds.items()):
        value = _number(candidate_metrics, name)
        shown = "missing" if name not in candidate_metrics else repr(candidate_metrics[name])
        if threshold.lower_bound is not None or threshold.upper_bound is not None:
            if value is None:
                checks.append(Check(name, "value", False, f"the candidate's {name} is {shown}"))
            else:
                low, high = threshold.lower_bound, threshold.upper_bound
                too_low = low is not None and value < low
                too_high = high is not None and value > high
                bounds = " and ".join(
                    part
                    for part in (
                        f">= {low}" if low is not None else "",
                        f"<= {high}" if high is not None else "",
                    )
                    if part
                )
                passed = not (too_low or too_high)
                checks.append(Check(name, "value", passed, f"{value:.6g} must be {bounds}"))
        if threshold.lower_bound_metric is not None:
            other = threshold.lower_bound_metric
            baseline = _number(candidate_metrics, other)
            if value is None or baseline is None:
                whose = name if value is None else other
                checks.append(Check(name, "value", False, f"{whose} is missing or not a number"))
            else:
                checks.append(
                    Check(
                        name,
                        "value",
                        value >= baseline,
                        f"{value:.6g} must be >= {other} ({baseline:.6g})",
                    )
                )
        if threshold.min_change is None:
            continue
        if not has_champion:
            checks.append(Check(name, "change", True, "no champion yet: nothing to compare"))
            continue
        champion = _number(champion_metrics, name)
        if value is None or champion is None:
            whose = "candidate's" if value is None else "champion's"
            checks.append(
                Check(name, "change", False, f"the {whose} {name} on this test data is unknown")
            )
            continue
        sign = 1.0 if threshold.direction == "higher_is_better" else -1.0
        change = sign * (value - champion)
        passed = change >= threshold.min_change
        checks.append(
            Check(
                name,
                "change",
                passed,
                f"{value:.6g} vs champion {champion:.6g}: {change:+.6g} in the better "
                f"direction, needs >= {threshold.min_change:+g}",
            )
        )
    return Decision(blessed=bool(checks) and all(c.passed for c in checks), checks=checks)
