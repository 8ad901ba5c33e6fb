"""Prefect task for the ingest stage."""

from prefect import task
from prefect.artifacts import create_table_artifact

from data_prep.ingest import IngestConfig, describe_inputs, ingest_logs
from data_prep.schema import SchemaConfig
from tasks.common import Mode, StageOutput, as_state, run_stage, stage_fingerprint, task_options
from tasks.progress import terminal_progress

MODULES = ["data_prep/ingest.py", "data_prep/schema.py"]


@task(name="ingest", **task_options())
def ingest_task(config: IngestConfig, schema: SchemaConfig, root: str, mode: Mode) -> StageOutput:
    """Validate raw logs into clean events and a quarantine."""
    section = {
        "ingest": config.model_dump(),
        "schema": schema.model_dump(),
        "inputs": describe_inputs(config.path, config.format),
    }
    fp = stage_fingerprint("ingest", section, [], MODULES)

    def produce(out_dir):
        with terminal_progress("ingest rows", None) as advance:
            result = ingest_logs(config, schema, out_dir, on_progress=advance)
        return {
            "rows": result.rows,
            "good_rows": result.good_rows,
            "bad_rows": result.bad_rows,
            "bad_fraction": result.bad_fraction,
            "reasons": result.reasons,
        }

    output = run_stage("ingest", fp, mode, root, produce)
    meta = output.meta
    rows = [{"reason": "(clean)", "rows": meta["good_rows"]}] + [
        {"reason": reason, "rows": count} for reason, count in meta["reasons"].items()
    ]
    create_table_artifact(
        key="ingest-validation",
        table=rows,
        description=f"Validation: {meta['bad_rows']} of {meta['rows']} rows quarantined.",
    )
    return as_state(output)
