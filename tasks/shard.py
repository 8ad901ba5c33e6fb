"""Prefect task for the shard stage."""

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from data_prep.shard import ShardConfig, write_shards
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
)
from tasks.progress import terminal_progress


@task(name="shard", task_run_name="shard", **task_options())
def shard_task(config: ShardConfig, preprocess: StageOutput, root: str, mode: Mode) -> StageOutput:
    """Write balanced, shuffled train/valid/test shards and dataset.json."""
    fp = stage_fingerprint("shard", config.model_dump(), [preprocess])

    def produce(out_dir: Path) -> dict:
        total = sum(preprocess.meta.get("rows", {}).values()) or None
        with terminal_progress("shard rows", total) as advance:
            result = write_shards(config, local_dir(preprocess), out_dir, on_progress=advance)
        return {"rows": result.rows, "shards": result.shards}

    output = run_stage("shard", fp, mode, root, produce)
    if output.status != "skipped":
        create_table_artifact(
            key="shard-stats",
            table=[
                {"split": split, "rows": rows, "shards": len(output.meta["shards"][split])}
                for split, rows in output.meta["rows"].items()
            ],
            description=f"Shards under {output.output}",
        )
    return as_state(output)
