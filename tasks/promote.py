"""Prefect tasks of the blessing gate and the champion promotion (after export).

`bless_task` decides whether the exported candidate may replace the champion: it
scores the champion on the *same* test data (when both use the same fitted
transform, so that the shard ids mean the same to both), applies the thresholds
(`training.blessing`) and writes the decision into the registry and a Markdown
artifact. `promote_task` then moves the CHAMPION pointer, after verifying the
package (manifest and infra validation). Neither is cached: the champion is state
outside the artifact store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from artifacts.durable import file_sha256
from artifacts.errors import DeterministicError
from artifacts.registry import Registry
from artifacts.signing import PLACE, place, read_hint, sign
from artifacts.store import ArtifactStore
from tasks.common import StageOutput, local_dir, upstream_dirs
from training.blessing import BlessConfig, decide
from training.config import EvaluateConfig
from training.stages import bless_thresholds, champion_view, data_stage, evaluate

TRANSFORM = "transform.json"
CHAMPION_EVALS = "champion-evals"
# A cached champion score is a metrics summary: small.
SCORE_BYTES = 4 << 20
# The field of a cached score naming the test data and evaluate config it was scored on.
SCORED_ON = "scored_on"
_logger = logging.getLogger(__name__)


def champion_metrics_on(
    registry: Registry,
    champion: str,
    config: EvaluateConfig,
    model_kind: str,
    shard: StageOutput,
    preprocess: StageOutput,
) -> tuple[dict[str, Any] | None, str]:
    """The champion's metrics on this run's test data, and how they were obtained.

    Returns:
        (metrics, note); metrics None when the champion cannot be scored on this data
        (another fitted transform: its ids mean other values), with the reason.
    """
    package = registry.path(champion)
    ours = local_dir(preprocess) / TRANSFORM
    same = (package / TRANSFORM).is_file() and file_sha256(package / TRANSFORM) == file_sha256(ours)
    with tempfile.TemporaryDirectory(prefix="recforge-champion-") as scratch:
        view = None
        if not same and (package / TRANSFORM).is_file():
            # An incremental day extends the champion's transform: score the champion on
            # this run's rows, new ids through its out-of-vocabulary rows.
            view = champion_view(
                model_kind, package, upstream_dirs(shard, preprocess), Path(scratch) / "view"
            )
        if not same and view is None:
            return None, (
                f"champion {champion} was trained with another fitted transform, so it "
                "cannot be scored on this test data; promote by hand (`recforge models "
                "promote`) if the new model should replace it"
            )
        return _score_champion(
            registry, champion, view or package, config, model_kind, shard, preprocess, scratch
        )


def _score_champion(
    registry: Registry,
    champion: str,
    package: Path,
    config: EvaluateConfig,
    model_kind: str,
    shard: StageOutput,
    preprocess: StageOutput,
    scratch: str,
) -> tuple[dict[str, Any] | None, str]:
    """The champion's metrics on this run's data, scored once and kept in the registry."""
    # Scored once per (champion, test data, evaluate config); kept in the registry.
    data = {"shard": shard, "preprocess": preprocess}[data_stage(model_kind)].fingerprint
    key = hashlib.sha256(
        json.dumps([champion, data, config.model_dump(mode="json")], sort_keys=True).encode()
    ).hexdigest()[:16]
    cached = registry.root / CHAMPION_EVALS / f"{champion}-{key}.json"
    metrics = cached_metrics(cached, registry.model_name, champion, key)
    if metrics is not None:
        return metrics, f"champion {champion} scored earlier ({cached})"
    try:
        # Slices are named through this run's transform, so slice thresholds compare
        # the same values.
        metrics = evaluate(
            config,
            model_kind,
            package,
            upstream_dirs(shard, preprocess),
            Path(scratch),
            env=dict(os.environ),  # for the launcher, when evaluate.workers > 1
        )
    except DeterministicError as error:
        return None, f"champion {champion} could not be scored on this data: {error}"
    store_metrics(cached, metrics, registry.model_name, champion, key)
    return metrics, f"champion {champion} scored on this run's {config.split} split"


def store_metrics(path: Path, metrics: dict[str, Any], model: str, version: str, key: str) -> None:
    """Keep the champion's metrics, signed for `model` `version` and scored on `key`.

    Args:
        path: The cache file (``champion-evals/<version>-<key>.json``).
        metrics: What `evaluate` returned.
        model: The registry's model name.
        version: The champion's version that was scored.
        key: The test data and evaluate config it was scored on (the file's key).
    """
    record = sign({**metrics, SCORED_ON: key}, place=_score_place(model, version))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def cached_metrics(path: Path, model: str, version: str, key: str) -> dict[str, Any] | None:
    """The champion's metrics scored earlier, or None: not scored, or not ours to trust.

    A forged score in the registry could let a worse candidate through the gate, so a
    file that does not verify, was signed for another model or version (a copy), was
    scored on other test data than `key`, or does not parse is scored again (logged),
    never trusted.

    Args:
        path: The cache file.
        model: The registry's model name.
        version: The champion's version.
        key: The test data and evaluate config this run scores on.
    """
    record = read_hint(
        path, "scoring the champion again", place=_score_place(model, version), limit=SCORE_BYTES
    )
    if record is None:
        return None
    if record.pop(SCORED_ON, None) != key:
        _logger.warning(
            "scoring the champion again: %s was scored on other test data or another "
            "evaluate config than this run's (%s); ignoring it",
            path,
            key,
        )
        return None
    record.pop(PLACE, None)
    return record


def _score_place(model: str, version: str) -> dict[str, str]:
    return place("champion-score", model=model, version=version)


@task(name="bless", task_run_name="bless", retries=0, persist_result=False)
def bless_task(
    config: BlessConfig,
    evaluate_config: EvaluateConfig,
    model_kind: str,
    model_name: str,
    evaluate: StageOutput,
    export: StageOutput,
    shard: StageOutput,
    preprocess: StageOutput,
    store: ArtifactStore,
) -> dict[str, Any]:
    """Decide on the exported candidate; the decision goes to the registry and an artifact.

    Returns:
        {"status": "blessed" | "not_blessed" | "champion" | "skipped", "version",
        "champion", "decision", "note"}.
    """
    if "model" not in export.meta or export.status == "skipped":
        return {"status": "skipped"}
    registry = Registry(store, model_name)
    version = Path(export.meta["model"]).name
    champion = registry.champion()
    if champion == version:
        return {"status": "champion", "version": version, "champion": champion}
    candidate = dict(evaluate.meta.get("metrics", {}))
    champion_metrics, note = (None, "no champion yet")
    if champion is not None:
        champion_metrics, note = champion_metrics_on(
            registry, champion, evaluate_config, model_kind, shard, preprocess
        )
    thresholds = bless_thresholds(config, model_kind)
    decision = decide(thresholds, candidate, champion_metrics, champion is not None)
    registry.record_decision(
        version,
        {
            **decision.record(),
            "champion": champion,
            "champion_metrics": champion_metrics,
            "candidate_metrics": candidate,
            "note": note,
        },
    )
    create_markdown_artifact(
        key="blessing",
        markdown=decision.markdown(version, champion) + f"\n{note}.\n",
        description=f"Blessing decision for {model_name} {version}",
    )
    get_run_logger().info(
        "%s %s: %s (%s)",
        model_name,
        version,
        "blessed" if decision.blessed else "not blessed",
        "; ".join(c.reason for c in decision.checks if not c.passed) or note,
    )
    return {
        "status": "blessed" if decision.blessed else "not_blessed",
        "version": version,
        "champion": champion,
        "decision": decision.record(),
        "note": note,
    }


@task(name="promote", task_run_name="promote", retries=0, persist_result=False)
def promote_task(
    model_name: str, version: str, store: ArtifactStore, reason: str
) -> dict[str, Any]:
    """Move CHAMPION to `version` after verifying its package; unchanged on any failure."""
    record = Registry(store, model_name).promote(version, reason)
    get_run_logger().info(
        "%s: champion is now %s (was %s)", model_name, version, record["previous"]
    )
    return record
