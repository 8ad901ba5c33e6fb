"""Prefect task for the evaluate stage."""

import os
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from artifacts.store import ArtifactStore
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
    upstream_dirs,
)
from training.config import EvaluateConfig
from training.runtime.launcher import free_port
from training.stages import evaluate

# How many ranks score the split, not what they compute: the metrics are the same.
_NOT_FINGERPRINTED = {"workers"}


def evaluate_section(config: EvaluateConfig) -> dict:
    """The evaluate config as it enters evaluate's fingerprint (less `workers`)."""
    return config.model_dump(exclude=_NOT_FINGERPRINTED)


@task(name="evaluate", task_run_name="evaluate", **task_options())
def evaluate_task(
    config: EvaluateConfig,
    model: str,
    train: StageOutput,
    shard: StageOutput,
    preprocess: StageOutput,
    store: ArtifactStore,
    mode: Mode,
) -> StageOutput:
    """Score the test split and write metrics.json (`training.stages.evaluate`)."""
    upstream = [train, shard, preprocess]
    fp = stage_fingerprint("evaluate", evaluate_section(config), upstream)

    def produce(out_dir: Path) -> dict:
        metrics = evaluate(
            config,
            model,
            local_dir(train),
            upstream_dirs(shard, preprocess),
            out_dir,
            # Only used when evaluate.workers > 1 starts ranks.
            env=dict(os.environ),
            master_port=free_port(),
        )
        return {"metrics": metrics}

    output = run_stage("evaluate", fp, mode, store, produce)
    if output.status != "skipped":
        create_table_artifact(
            key="evaluate-metrics",
            table=[{"metric": k, "value": v} for k, v in output.meta["metrics"].items()],
            description=f"Metrics on the {config.split} split",
        )
    return as_state(output)
