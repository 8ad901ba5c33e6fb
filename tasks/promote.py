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
import os
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from artifacts.durable import file_sha256
from artifacts.errors import DeterministicError
from artifacts.registry import Registry
from artifacts.signing import read_hint, sign
from artifacts.store import ArtifactStore
from tasks.common import StageOutput, local_dir, upstream_dirs
from training.blessing import BlessConfig, decide
from training.config import EvaluateConfig
from training.stages import bless_thresholds, champion_view, data_stage, evaluate

TRANSFORM = "transform.json"
CHAMPION_EVALS = "champion-evals"


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
    same = (package / TRANSFORM).is_file() and file_sha256(package / TRANSFORM) == file_sha256(
        ours
    )
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
    metrics = cached_metrics(cached)
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
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(sign(metrics), indent=2) + "\n")
    return metrics, f"champion {champion} scored on this run's {config.split} split"


def cached_metrics(path: Path) -> dict[str, Any] | None:
    """The champion's metrics scored earlier, or None: not scored, or not signed by us.

    A forged score in the registry could let a worse candidate through the gate, so a
    file whose signature does not verify is scored again (and logged), never trusted.
    """
    return read_hint(path, "scoring the champion again")


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
