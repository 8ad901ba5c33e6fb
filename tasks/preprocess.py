"""Prefect task for the preprocess stage."""

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from artifacts.locations import join
from artifacts.store import ArtifactStore
from data_prep.preprocess import PreprocessConfig, preprocess_events
from data_prep.schema import SchemaConfig
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    data_location,
    input_files,
    prefect_file_mapper,
    run_stage_at,
    stage_fingerprint,
    task_options,
)
from tasks.incremental import Parent
from tasks.progress import terminal_progress


def preprocess_section(
    config: PreprocessConfig,
    schema: SchemaConfig,
    partition: str | None = None,
    parent: Parent | None = None,
) -> dict:
    """What preprocess's fingerprint covers besides ingest's output.

    The partition (the transform records it) and the parent whose transform is extended
    count only when set, and ttl only when on: configs without them keep their keys.
    """
    section = {
        "preprocess": config.model_dump(exclude={"ttl"} if config.ttl is None else set()),
        "schema": schema.model_dump(),
    }
    if partition is not None:
        section["partition"] = partition
    if parent is not None:
        section["parent"] = parent.identity()
    return section


@task(name="preprocess", task_run_name="preprocess", **task_options())
def preprocess_task(
    config: PreprocessConfig,
    schema: SchemaConfig,
    ingest: StageOutput,
    store: ArtifactStore,
    mode: Mode,
    partition: str | None = None,
    parent: Parent | None = None,
) -> StageOutput:
    """Split clean events, fit the feature transform on train, transform every split.

    With a `parent` (an incremental run, `tasks.incremental`) the parent's transform is
    extended with this partition instead (known ids keep their rows).
    """
    section = preprocess_section(config, schema, partition, parent)
    fp = stage_fingerprint("preprocess", section, [ingest])

    def produce(out_dir: Path | str) -> tuple[dict, list[str]]:
        # Only the event files ingest's signed manifest lists, never a directory listing.
        events = input_files(ingest, "events", ".parquet")
        with terminal_progress("preprocess rows", ingest.meta.get("good_rows")) as advance:
            result = preprocess_events(
                config,
                schema,
                join(data_location(ingest), "events"),
                out_dir,
                on_progress=advance,
                map_files=prefect_file_mapper("preprocess"),
                partition=partition,
                parent=parent.transform() if parent is not None else None,
                files=events,
            )
        meta = {
            "rows": result.rows,
            "vocab_sizes": result.vocab_sizes,
            "valid_start_ts": result.valid_start_ts,
            "test_start_ts": result.test_start_ts,
            "split": result.split,
            "leakage": result.leakage,
            "sequences": result.sequences,
            **({"partitions": result.partitions} if result.partitions else {}),
            **({"vocabulary": result.vocabulary} if result.vocabulary else {}),
        }
        return meta, result.files

    output = run_stage_at("preprocess", fp, mode, store, produce)
    if output.status != "skipped":
        create_table_artifact(
            key="preprocess-summary",
            table=[{"split": s, "rows": n} for s, n in output.meta["rows"].items()]
            + [{"split": f"vocab:{f}", "rows": n} for f, n in output.meta["vocab_sizes"].items()],
            description="Rows per split and vocabulary sizes (fitted on train only).",
        )
    return as_state(output)
