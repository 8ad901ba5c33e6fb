"""Prefect task for the evaluate stage."""

import json
import os
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
)
from training.config import EvaluateConfig
from training.ctr.evaluate import evaluate_model
from training.runtime.launcher import free_port
from training.sequence.evaluate import evaluate_sequence_model
from training.sequence.registry import SEQUENCE_MODEL_REGISTRY

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
    root: str,
    mode: Mode,
) -> StageOutput:
    """Score the test split and write metrics.json.

    CTR models: AUC and logloss over the shards, slices named through preprocess's
    transform.json, and scores_head.npy (export's infra validation reference).
    Sequence models (`model` in the sequence registry): leave-one-out ranking of
    preprocess's sequences, with the popularity baseline.
    """
    upstream = [train, shard, preprocess]
    fp = stage_fingerprint("evaluate", evaluate_section(config), upstream)

    def produce(out_dir: Path) -> dict:
        if model in SEQUENCE_MODEL_REGISTRY:
            sequences = local_dir(preprocess) / "sequences"
            result = evaluate_sequence_model(
                config,
                local_dir(train),
                sequences,
                out_dir,
                # Only used when evaluate.workers > 1 starts ranks.
                env=dict(os.environ),
                master_port=free_port(),
            )
        else:
            result = evaluate_model(
                config,
                local_dir(train),
                local_dir(shard),
                out_dir,
                # Names slice values by their raw value (slice/city=Paris, not #3).
                transform_path=local_dir(preprocess) / "transform.json",
                # Only used when evaluate.workers > 1 starts ranks.
                env=dict(os.environ),
                master_port=free_port(),
            )
        return {"metrics": json.loads(result.metrics_path.read_text())}

    output = run_stage("evaluate", fp, mode, root, produce)
    if output.status != "skipped":
        create_table_artifact(
            key="evaluate-metrics",
            table=[{"metric": k, "value": v} for k, v in output.meta["metrics"].items()],
            description=f"Metrics on the {config.split} split",
        )
    return as_state(output)
