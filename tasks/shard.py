"""Prefect task for the shard stage.

With a local root the shards are written in this process (``write_shards``). With an
object-store root the shuffle's three passes run as tasks on the flow's task runner
(Dask workers with ``--dask``), reading and writing only URLs under the root: their
parts go to a scratch prefix next to the output's data prefix, deleted at the end.
"""

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from artifacts.locations import remove_tree
from artifacts.store import ArtifactStore
from data_prep.shard import ShardConfig, write_shards, write_shards_distributed
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    data_location,
    listed_names,
    prefect_file_mapper,
    run_stage_at,
    stage_fingerprint,
    task_options,
)
from tasks.progress import terminal_progress

# write_shards writes it beside the shards: the dataset description training reads.
DATASET_FILE = "dataset.json"


@task(name="shard", task_run_name="shard", **task_options())
def shard_task(
    config: ShardConfig, preprocess: StageOutput, store: ArtifactStore, mode: Mode
) -> StageOutput:
    """Write balanced, shuffled train/valid/test shards and dataset.json."""
    fp = stage_fingerprint("shard", config.model_dump(), [preprocess])

    def produce(out_dir: Path | str) -> tuple[dict, list[str]]:
        total = sum(preprocess.meta.get("rows", {}).values()) or None
        source = data_location(preprocess)
        # Only the tables preprocess's signed manifest lists, never a directory listing.
        listed = listed_names(preprocess)
        with terminal_progress("shard rows", total) as advance:
            if isinstance(out_dir, Path):
                result = write_shards(config, source, out_dir, on_progress=advance, listed=listed)
            else:
                scratch = f"{out_dir}-scratch"
                try:
                    result = write_shards_distributed(
                        config,
                        source,
                        out_dir,
                        scratch,
                        prefect_file_mapper("shard"),
                        on_progress=advance,
                        listed=listed,
                    )
                finally:
                    remove_tree(scratch)
        written = [name for names in result.shards.values() for name in names]
        return {"rows": result.rows, "shards": result.shards}, [*written, DATASET_FILE]

    output = run_stage_at("shard", fp, mode, store, produce)
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
