"""Prefect task for the export stage: model package + registry entry."""

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
)
from tasks.store import ArtifactStore
from training.config import ExportConfig
from training.ctr.export import export_model
from training.packaging import ExportResult
from training.sequence.bst_export import export_bst_model
from training.sequence.export import export_sequence_model
from training.sequence.registry import SEQUENCE_MODEL_REGISTRY, sequence_model

# The infra validation figures kept in the stage's manifest (the package holds the rest).
INFRA_KEYS = (
    "rows",
    "p50_ms",
    "p99_ms",
    "batch_p50_ms",
    "batch_p99_ms",
    "max_abs_diff",
    "max_abs_diff_vs_evaluate",
)


@task(name="export", task_run_name="export", **task_options())
def export_task(
    config: ExportConfig,
    model: str,
    item_field: str | None,
    train: StageOutput,
    preprocess: StageOutput,
    shard: StageOutput,
    evaluate: StageOutput,
    root: str,
    mode: Mode,
    ingest: StageOutput | None = None,
) -> StageOutput:
    """Package the trained model (weights, ONNX, TorchScript, transform, card); register it.

    Sequence models (`model` in the sequence registry) that rank every item export a
    top-K recommender: history -> the `config.top_k` best item indices and scores; BST
    exports a candidate scorer (`item_field` names the item ids).
    CTR models given `ingest` are infra-validated: the package's own score.py scores raw
    test events in a fresh interpreter (`infra_validation.json`), and its scores of them
    must be the evaluate stage's (`scores_head.npy`) of the same rows.
    """
    upstream = [train, preprocess, shard, evaluate, *([ingest] if ingest is not None else [])]
    section = {**config.model_dump(), "model": model, "item_field": item_field}
    fp = stage_fingerprint("export", section, upstream)

    def produce(out_dir: Path) -> dict:
        preprocessed = local_dir(preprocess)
        if model in SEQUENCE_MODEL_REGISTRY:
            sequence_args = (
                local_dir(train),
                preprocessed / "transform.json",
                preprocessed / "sequences",
                item_field,
                local_dir(evaluate) / "metrics.json",
                out_dir,
            )
            if not sequence_model(model).full_ranking:
                # A model that scores given candidates (BST) ships as a candidate scorer.
                result = export_bst_model(config, *sequence_args)
                return {"parity_rows": result.parity_rows, **_diffs(result)}
            result = export_sequence_model(config, *sequence_args, k=config.top_k)
            return {
                "parity_rows": result.parity_rows,
                "top_k_match_onnx": result.top_k_match_onnx,
                "top_k_match_torchscript": result.top_k_match_torchscript,
                **_diffs(result),
            }
        result = export_model(
            config,
            local_dir(train),
            preprocessed / "transform.json",
            local_dir(shard),
            local_dir(evaluate) / "metrics.json",
            out_dir,
            events_dir=local_dir(ingest) / "events" if ingest is not None else None,
            evaluate_dir=local_dir(evaluate),
        )
        infra = result.infra_validation
        return {
            **_diffs(result),
            "infra_validation": None if infra is None else {key: infra[key] for key in INFRA_KEYS},
        }

    output = run_stage("export", fp, mode, root, produce)
    if output.status == "skipped":
        return as_state(output)
    store = ArtifactStore(root)
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


def _diffs(result: ExportResult) -> dict:
    """The package's parity figures kept in the stage's manifest."""
    return {
        "parity_max_abs_diff_onnx": result.parity_max_abs_diff_onnx,
        "parity_max_abs_diff_torchscript": result.parity_max_abs_diff_torchscript,
    }
