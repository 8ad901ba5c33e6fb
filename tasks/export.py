"""Prefect task for the export stage: model package + registry entry."""

import dataclasses
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from tasks.common import Mode, StageOutput, as_state, run_stage, stage_fingerprint, task_options
from tasks.store import ArtifactStore
from training.bst_export import export_bst_model
from training.config import SEQUENCE_MODELS, ExportConfig
from training.export import export_model
from training.sequence_export import export_sequence_model

MODULES = [
    "training/bst.py",
    "training/bst_export.py",
    "training/export.py",
    "training/model.py",
    "training/sequence_export.py",
    "training/sequence_model.py",
]


@task(name="export", **task_options())
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
) -> StageOutput:
    """Package the trained model (weights, ONNX, TorchScript, transform, card); register it.

    Sequence models (`model` in SEQUENCE_MODELS) export a top-K recommender: history ->
    the `config.top_k` best item indices and scores (`item_field` names the item ids).
    """
    upstream = [train, preprocess, shard, evaluate]
    section = {**config.model_dump(), "model": model, "item_field": item_field}
    fp = stage_fingerprint("export", section, upstream, MODULES)

    def produce(out_dir: Path) -> dict:
        transform = Path(preprocess.output) / "transform.json"
        metrics = Path(evaluate.output) / "metrics.json"
        if model in SEQUENCE_MODELS:
            sequences = Path(preprocess.output) / "sequences"
            args = (config, Path(train.output), transform, sequences, item_field, metrics, out_dir)
            if model == "bst":
                result = export_bst_model(*args)
            else:
                result = export_sequence_model(*args, k=config.top_k)
        else:
            result = export_model(
                config, Path(train.output), transform, Path(shard.output), metrics, out_dir
            )
        # The parity figures of the result, for the manifest and the run record.
        return {
            key: value
            for key, value in dataclasses.asdict(result).items()
            if key not in ("out_dir", "files")
        }

    output = run_stage("export", fp, mode, root, produce)
    if output.status == "skipped":
        return output
    store = ArtifactStore(root)
    model_dir = store.root / "registry" / config.model_name / fp[:12]
    if output.status == "ran" or not (model_dir / "_manifest.json").exists():
        model_dir = store.publish_model(config.model_name, fp[:12], Path(output.output))
    output = output.model_copy(update={"meta": {**output.meta, "model": str(model_dir)}})
    card = Path(output.output) / "model_card.md"
    create_markdown_artifact(
        key="model-card",
        markdown=card.read_text() if card.exists() else f"Model package: {model_dir}",
        description=f"Model card of {model_dir}",
    )
    return as_state(output)
