"""Prefect task for the evaluate stage."""

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks.common import Mode, StageOutput, as_state, run_stage, stage_fingerprint, task_options
from training.config import EvaluateConfig
from training.evaluate import evaluate_model

MODULES = ["training/evaluate.py", "training/metrics.py", "training/model.py"]


@task(name="evaluate", **task_options())
def evaluate_task(
    config: EvaluateConfig, train: StageOutput, shard: StageOutput, root: str, mode: Mode
) -> StageOutput:
    """Score the test split and write metrics.json."""
    fp = stage_fingerprint("evaluate", config.model_dump(), [train, shard], MODULES)

    def produce(out_dir: Path) -> dict:
        result = evaluate_model(config, Path(train.output), Path(shard.output), out_dir)
        return {"metrics": json.loads(result.metrics_path.read_text())}

    output = run_stage("evaluate", fp, mode, root, produce)
    if output.status != "skipped":
        create_table_artifact(
            key="evaluate-metrics",
            table=[{"metric": k, "value": v} for k, v in output.meta["metrics"].items()],
            description=f"Metrics on the {config.split} split",
        )
    return as_state(output)
