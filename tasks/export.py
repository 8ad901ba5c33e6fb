"""Prefect task for the export stage: model package + registry entry."""

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from artifacts.store import ArtifactStore
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    run_stage,
    stage_fingerprint,
    task_options,
    upstream_dirs,
)
from tasks.incremental import LINEAGE, Parent, lineage_record
from training.config import ExportConfig
from training.stages import export


@task(name="export", task_run_name="export", **task_options())
def export_task(
    config: ExportConfig,
    model: str,
    item_field: str | None,
    train: StageOutput,
    preprocess: StageOutput,
    shard: StageOutput,
    evaluate: StageOutput,
    store: ArtifactStore,
    mode: Mode,
    ingest: StageOutput | None = None,
    parent: Parent | None = None,
) -> StageOutput:
    """Package the trained model (`training.stages.export`) and register it.

    Given `ingest`, the package is infra-validated on raw test events where the model's
    family supports it. The package's `lineage.json` names the parent model (`parent`,
    an incremental run's), the partitions its transform has seen and the stage outputs
    it was made from: the next day's warm start finds this model's train output there.
    """
    upstream = [train, preprocess, shard, evaluate, *([ingest] if ingest is not None else [])]
    section = {**config.model_dump(), "model": model, "item_field": item_field}
    fp = stage_fingerprint("export", section, upstream)

    def produce(out_dir: Path) -> dict:
        meta = export(
            config,
            model,
            item_field,
            upstream_dirs(train, preprocess, shard, evaluate, ingest),
            out_dir,
            infra_validate=ingest is not None,
        )
        lineage = lineage_record(parent, preprocess.meta.get("partitions"), upstream)
        (out_dir / LINEAGE).write_text(json.dumps(lineage, indent=2) + "\n")
        return {**meta, "lineage": lineage}

    output = run_stage("export", fp, mode, store, produce)
    if output.status == "skipped":
        return as_state(output)
    model_dir = store.model_location(config.model_name, fp[:12])
    if output.status == "ran" or not store.is_model_published(config.model_name, fp[:12]):
        model_dir = store.publish_model(config.model_name, fp[:12], output.output)
    output = output.model_copy(update={"meta": {**output.meta, "model": str(model_dir)}})
    # The package's local side: itself, or its copy on this machine for a remote root.
    card = store.output_dir("export", fp) / "model_card.md"
    create_markdown_artifact(
        key="model-card",
        markdown=card.read_text() if card.exists() else f"Model package: {model_dir}",
        description=f"Model card of {model_dir}",
    )
    return as_state(output)
