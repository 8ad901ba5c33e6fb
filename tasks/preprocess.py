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
    prefect_file_mapper,
    run_stage_at,
    stage_fingerprint,
    task_options,
)
from tasks.progress import terminal_progress


def preprocess_section(config: PreprocessConfig, schema: SchemaConfig) -> dict:
    """What preprocess's fingerprint covers besides ingest's output."""
    return {"preprocess": config.model_dump(), "schema": schema.model_dump()}


@task(name="preprocess", task_run_name="preprocess", **task_options())
def preprocess_task(
    config: PreprocessConfig,
    schema: SchemaConfig,
    ingest: StageOutput,
    store: ArtifactStore,
    mode: Mode,
) -> StageOutput:
    """Split clean events, fit the feature transform on train, transform every split."""
    fp = stage_fingerprint("preprocess", preprocess_section(config, schema), [ingest])

    def produce(out_dir: Path | str) -> dict:
        with terminal_progress("preprocess rows", ingest.meta.get("good_rows")) as advance:
            result = preprocess_events(
                config,
                schema,
                join(data_location(ingest), "events"),
                out_dir,
                on_progress=advance,
                map_files=prefect_file_mapper("preprocess"),
            )
        return {
            "rows": result.rows,
            "vocab_sizes": result.vocab_sizes,
            "valid_start_ts": result.valid_start_ts,
            "test_start_ts": result.test_start_ts,
            "split": result.split,
            "leakage": result.leakage,
            "sequences": result.sequences,
        }

    output = run_stage_at("preprocess", fp, mode, store, produce)
    if output.status != "skipped":
        create_table_artifact(
            key="preprocess-summary",
            table=[{"split": s, "rows": n} for s, n in output.meta["rows"].items()]
            + [{"split": f"vocab:{f}", "rows": n} for f, n in output.meta["vocab_sizes"].items()],
            description="Rows per split and vocabulary sizes (fitted on train only).",
        )
    return as_state(output)
