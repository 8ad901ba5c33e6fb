"""Export stage: package a trained model for serving and prove the package scores like it.

Reads `<train_dir>/model_config.json`, `<train_dir>/model.safetensors` (and, for the
model card, `train_config.json` and `train_summary.json` when present), the fitted
transform file, `dataset.json` and the first test rows of the shards, optionally the
evaluation's metrics.json, the evaluate stage's output (its `scores_head.npy` is the
reference of infra validation) and the ingest output's `events/` (raw test records for
infra validation). Writes into `out_dir`:

- `model.safetensors`, `model_config.json`: the weights and how to rebuild the module
  (with its `table_precision`); the embedding table stays as training stored it
  (`train.table_precision`: fp32, fp16 / bf16 rows, or int8 codes with their per-row
  `embedding.scale_bias`), so a compact table's package is as small as its table;
- `model.onnx`: inputs `sparse` int64 (B, F), `dense` float32 (B, Dn) and, per
  multi-hot feature, `multi_hot_<name>` int64 (B, L) padded with -1; output `score`
  float32, the probability of each task's label: (B,) for one task, (B, T) for
  several; the batch axis (and L) are dynamic. A compact table is the graph's
  initializer at its own type (FLOAT16, BFLOAT16, or UINT8 plus a FLOAT scale/bias
  initializer), gathered and then cast (int8: times scale, plus bias) to float32, so
  the graph is no larger than the table (`training.ctr.model.CompactTable`); onnxruntime's
  CPU provider runs Gather and Cast on all three types (BFLOAT16 from opset 13, so a
  bf16 table needs `export.opset` >= 13);
- `model.ts`: the same graph as TorchScript (torch.jit.trace), the same compact buffers;
- `transform.json`: a copy of the fitted transform (raw values -> model inputs);
- `signature.json`: feature names in input order, dtypes, shapes, input/output names;
- `parity/inputs.npz` (keys = ONNX input names), `parity/scores.npy`: the trained
  model's scores on the first `parity_rows` test rows, for checks at serving time;
- `score.py`: scores raw records (transform.json + model.onnx) with numpy and
  onnxruntime only (`training/ctr/package_scorer.py`);
- `infra_validation.json` (when events are given): `score.py` run in a fresh interpreter
  on the raw events of the first `infra_validation_rows` rows of the evaluated split
  (test without an evaluate output) plus `infra_validation_unseen` records with
  never-seen ids and strings: its scores match the trained model's (`max_abs_diff`, all
  records) and, with an evaluate output, the evaluate stage's scores of the same rows
  (`max_abs_diff_vs_evaluate`, `evaluate_rows`, `evaluate_split`), and its latency (see
  `training.ctr.package.infra_validate`);
- `model_card.md`.

Parity: the torch model, onnxruntime and TorchScript score the parity sample; a
difference above `parity_atol` raises ParityError (the files written so far stay in
`out_dir`, which the caller treats as a failed staging directory). Infra validation
raises ParityError the same way, also when the package's scores of the raw records
differ from evaluate's `scores_head.npy` by more than `parity_atol`: scoring raw records
through the package gives the scores the evaluate stage reported metrics of.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from data_prep.transform import TransformApplier, load_transform
from training.config import ExportConfig
from training.ctr.data import DatasetMeta, iter_tables, load_dataset_meta, model_columns, to_batch
from training.ctr.evaluate import METRICS_FILE, SCORES_HEAD_FILE
from training.ctr.model import CTRModel, load_model, table_footprint
from training.ctr.package import (
    INFRA_VALIDATION_FILE,
    SCORER_FILE,
    event_files,
    infra_validate,
    raw_test_records,
    with_unseen_records,
    write_scorer,
)
from training.errors import ParityError
from training.packaging import (
    MODEL_CARD_FILE,
    PARITY_SPLIT,
    RUNTIME_FILES,
    ExportResult,
    Parity,
    ServedGraph,
    check_files_exist,
    max_abs_diff,
    metrics_lines,
    model_card,
    model_section,
    package_files,
    parity_table,
    read_metrics,
    write_package,
)
from training.runtime.files import SUMMARY_FILE, TRAIN_CONFIG_FILE

INPUT_NAMES = ("sparse", "dense")


OUTPUT_NAME = "score"

# The first ONNX opset whose Gather and Cast take BFLOAT16: a bf16 table needs it (fp16
# and uint8 tables export at any opset export.opset allows).
BF16_MIN_OPSET = 13


class ScoringModule(nn.Module):
    """The served graph: a CTR model followed by a sigmoid.

    Args:
        model: The trained model.
    """

    def __init__(self, model: CTRModel) -> None:
        super().__init__()
        self.model = model
        self.single_task = len(model.tasks) == 1

    def forward(
        self, sparse: torch.Tensor, dense: torch.Tensor, *multi_hot: torch.Tensor
    ) -> torch.Tensor:
        """Label probabilities.

        Args:
            sparse: (B, F) int64 indices.
            dense: (B, Dn) float32 features.
            *multi_hot: One (B, L) int64 per multi-hot feature, padded with -1.

        Returns:
            (B,) float32 probabilities for one task, (B, T) for several.
        """
        probabilities = torch.sigmoid(self.model(sparse, dense, *multi_hot))  # (B, T)
        return probabilities[:, 0] if self.single_task else probabilities


def export_model(
    config: ExportConfig,
    train_dir: Path,
    transform_path: Path,
    shards_dir: Path,
    metrics_path: Path | None,
    out_dir: Path,
    events_dir: Path | list[Path] | None = None,
    evaluate_dir: Path | None = None,
) -> ExportResult:
    """Write the model package and check that ONNX and TorchScript match torch.

    With `events_dir`, also infra-validate the package: its own `score.py`, in a fresh
    interpreter, scores the raw events of the first test rows and records with unseen
    ids like the trained model does. With `evaluate_dir` too, the rows are the first of
    the split evaluate scored, and their package scores must match evaluate's own
    (`scores_head.npy`).

    Args:
        config: The export config.
        train_dir: The train stage's output.
        transform_path: The fitted transform file of the preprocess stage.
        shards_dir: The shard directory (feature names; test rows for parity).
        metrics_path: The evaluation's metrics.json for the model card, or None.
        out_dir: The package directory; created if missing.
        events_dir: The event files ingest's signed manifest lists under `events/` (the
            stage layer passes them: `artifacts.store.listed_files`), or ingest's `events`
            directory when only this process wrote it (the clean events the shards were made
            from), or None to skip infra validation.
        evaluate_dir: The evaluate stage's output (metrics.json, scores_head.npy), the
            reference of infra validation; None compares with the trained model only.

    Returns:
        The package and its parity (and infra validation) figures.

    Raises:
        InputNotFoundError: A model file, the transform, the metrics, dataset.json or
            (with events_dir) evaluate's scores_head.npy or metrics.json is missing.
        ConfigError: evaluate saved fewer rows than infra validation needs, or the
            model's table is bf16 and export.opset is below 13.
        SchemaError: The test split has no rows, or the transform is not a fitted one
            (with events_dir).
        DataError: The events do not hold the shards' test rows.
        ParityError: ONNX or TorchScript scores differ from torch by more than
            parity_atol, or infra validation fails (also: the package's scores of raw
            records differ from the evaluate stage's).
    """
    train_dir, out_dir = Path(train_dir), Path(out_dir)
    check_files_exist(transform_path, metrics_path)
    model, model_config = load_model(train_dir)
    if model.table_precision == "bf16" and config.opset < BF16_MIN_OPSET:
        raise ConfigError(
            f"export.opset={config.opset}, but the model in {train_dir} holds its table as "
            f"bf16 rows (train.table_precision: bf16), and ONNX gathers and casts BFLOAT16 "
            f"from opset {BF16_MIN_OPSET}; set export.opset: {BF16_MIN_OPSET} or later"
        )
    meta = load_dataset_meta(shards_dir)
    scorer = ScoringModule(model).eval()
    graph = _served_graph(scorer, meta, shards_dir, config.parity_rows)
    (scores,) = graph.expected  # (N,) or (N, T)
    parity = write_package(
        graph,
        out_dir,
        opset=config.opset,
        atol=config.parity_atol,
        describe_failure=lambda parity: _parity_failure(parity, config.parity_atol),
        parity_files={"scores": scores.astype(np.float32)},
        train_dir=train_dir,
        transform_path=transform_path,
        signature=_signature(
            config, meta, list(model_config["tasks"]), list(graph.input_names), len(scores)
        ),
        model_config=model_config,
    )
    write_scorer(out_dir)
    infra = None
    if events_dir is not None:
        infra = _infra_validation(
            config, scorer, meta, transform_path, shards_dir, events_dir, evaluate_dir, out_dir
        )
    card = _model_card(
        config, meta, model_config, train_dir, read_metrics(metrics_path), parity, infra
    )
    (out_dir / MODEL_CARD_FILE).write_text(card)
    return ExportResult(out_dir, parity, package_files(out_dir), infra)


def _served_graph(
    scorer: ScoringModule, meta: DatasetMeta, shards_dir: Path, rows: int
) -> ServedGraph:
    """The scorer on the first `rows` test rows, with the trained model's scores of them."""
    sample = _parity_inputs(shards_dir, meta, rows)  # sparse, dense, multi-hot
    with torch.no_grad():
        scores = scorer(*sample).numpy()  # (N,) or (N, T)
    input_names = _input_names(meta)
    return ServedGraph(
        module=scorer,
        input_names=tuple(input_names),
        output_names=(OUTPUT_NAME,),
        sample=sample,
        expected=(scores,),
        # Traced on a slice smaller than the parity sample, so scoring the parity sample
        # also checks that the batch axis is really dynamic.
        example=tuple(tensor[:2] for tensor in sample),
        dynamic_axes={
            OUTPUT_NAME: {0: "batch"},
            **{name: {0: "batch"} for name in INPUT_NAMES},
            **{name: {0: "batch", 1: f"{name}_length"} for name in input_names[2:]},
        },
    )


def _parity_failure(parity: Parity, atol: float) -> str:
    return (
        f"exported model differs from the trained model on {parity.rows} test rows: "
        f"max |diff| ONNX {parity.max_abs_diff_onnx:.3g}, TorchScript "
        f"{parity.max_abs_diff_torchscript:.3g} > parity_atol {atol:g}; check the model for "
        "ops that export changes"
    )


def _infra_validation(
    config: ExportConfig,
    scorer: ScoringModule,
    meta: DatasetMeta,
    transform_path: Path,
    shards_dir: Path,
    events_dir: Path | list[Path],
    evaluate_dir: Path | None,
    out_dir: Path,
) -> dict[str, Any]:
    """Infra-validate the package on raw events (see `export_model`); the report."""
    reference = _evaluate_reference(evaluate_dir) if evaluate_dir is not None else None
    split = reference[0] if reference is not None else PARITY_SPLIT
    records, expected, test_rows = _validation_records(
        config, scorer, meta, transform_path, shards_dir, events_dir, split
    )
    return _run_infra_validation(config, out_dir, records, expected, test_rows, reference)


def _validation_records(
    config: ExportConfig,
    scorer: ScoringModule,
    meta: DatasetMeta,
    transform_path: Path,
    shards_dir: Path,
    events_dir: Path | list[Path],
    split: str,
) -> tuple[list[dict], np.ndarray, int]:
    """Raw records for infra validation and the trained model's scores of them.

    Returns:
        (records: the raw events of the split's first rows, then the unseen-id records;
        the torch model's scores of data_prep's transform of them; split records).
    """
    transform = load_transform(transform_path)
    test_records, _ = raw_test_records(
        events_dir, shards_dir, meta, transform, config.infra_validation_rows, split
    )
    records = with_unseen_records(test_records, transform, config.infra_validation_unseen)
    # Typed as ingest wrote the events; nullable, since unseen records miss dense values.
    event_schema = pq.read_schema(event_files(events_dir)[0])
    nullable = pa.schema([field.with_nullable(True) for field in event_schema])
    transformed = TransformApplier(transform)(pa.Table.from_pylist(records, schema=nullable))
    batch = to_batch(transformed, meta)
    with torch.no_grad():
        expected = scorer(batch.sparse, batch.dense, *batch.multi_hot).numpy()  # (N,) or (N, T)
    return records, expected, len(test_records)


def _run_infra_validation(
    config: ExportConfig,
    out_dir: Path,
    records: list[dict],
    expected: np.ndarray,
    test_records: int,
    reference: tuple[str, np.ndarray, Path] | None,
) -> dict[str, Any]:
    """Run infra validation, write infra_validation.json; the report without scores.

    `reference` is evaluate's (split, scores_head, path) or None (see
    `_evaluate_reference`): the package's scores of the first `test_records` records
    must match its first rows within parity_atol.

    Raises:
        ConfigError: The reference holds fewer rows than the records.
        ParityError: See `infra_validate`; or the scores differ from the reference.
    """
    if reference is not None and len(reference[1]) < test_records:
        raise ConfigError(
            f"{reference[2]} holds evaluate's scores of {len(reference[1])} rows, but infra "
            f"validation scores {test_records} (export.infra_validation_rows="
            f"{config.infra_validation_rows}); raise evaluate.score_sample_rows to at least "
            "that, or lower export.infra_validation_rows"
        )
    report = infra_validate(
        out_dir,
        records,
        expected,
        atol=config.parity_atol,
        repetitions=config.infra_validation_repetitions,
    )
    versus: dict[str, Any] = {}
    if reference is not None:
        split, head, path = reference
        diff = max_abs_diff(head[:test_records], np.asarray(report["scores"][:test_records]))
        if not diff <= config.parity_atol:
            raise ParityError(
                f"infra validation of {out_dir}: the package's scores of the raw events of the "
                f"first {test_records} {split} rows differ from the evaluate stage's scores of "
                f"the same rows ({path}): max |diff| {diff:.3g} > parity_atol "
                f"{config.parity_atol:g}; the evaluate output was made with another model or "
                "shards than this export (run evaluate again), or the package does not "
                "reproduce it"
            )
        versus = {
            "max_abs_diff_vs_evaluate": diff,
            "evaluate_rows": test_records,
            "evaluate_split": split,
        }
    # infra_validate raises on any failure, so a written report is a passed one.
    report = {
        "ok": True,
        **report,
        **versus,
        "test_records": test_records,
        "unseen_records": len(records) - test_records,
        "atol": config.parity_atol,
    }
    (out_dir / INFRA_VALIDATION_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return {key: value for key, value in report.items() if key != "scores"}


def _evaluate_reference(evaluate_dir: Path) -> tuple[str, np.ndarray, Path]:
    """Evaluate's split and its (N,) or (N, T) float32 scores of the split's first rows.

    Raises:
        InputNotFoundError: metrics.json or scores_head.npy is missing.
    """
    metrics_path = Path(evaluate_dir) / METRICS_FILE
    head_path = Path(evaluate_dir) / SCORES_HEAD_FILE
    for path in (metrics_path, head_path):
        if not path.is_file():
            raise InputNotFoundError(
                f"{path} does not exist; infra validation compares the package with the "
                "evaluate stage's scores: run evaluate (again) before export"
            )
    split = json.loads(metrics_path.read_text())["split"]
    return split, np.load(head_path), head_path


def _input_names(meta: DatasetMeta) -> list[str]:
    """The ONNX input names: sparse, dense, then one per multi-hot feature."""
    return [*INPUT_NAMES, *(f"multi_hot_{name}" for name in meta.multi_hot_names)]


def _parity_inputs(shards_dir: Path, meta: DatasetMeta, rows: int) -> tuple[torch.Tensor, ...]:
    """The first `rows` test rows as (sparse (N, F), dense (N, Dn), *multi-hot (N, L))."""
    columns = model_columns(meta)
    tables = iter_tables(shards_dir, meta, PARITY_SPLIT, 0, 1, rows, columns, drop_last=False)
    table = next(iter(tables), None)
    if table is None:
        raise SchemaError(f"the {PARITY_SPLIT} split of {shards_dir} has no rows for parity")
    batch = to_batch(table, meta)
    return (batch.sparse, batch.dense, *batch.multi_hot)


def _signature(
    config: ExportConfig,
    meta: DatasetMeta,
    tasks: list[str],
    input_names: list[str],
    parity_rows: int,
) -> dict[str, Any]:
    return {
        "model_name": config.model_name,
        "inputs": [
            {
                "name": "sparse",
                "dtype": "int64",
                "shape": ["batch", len(meta.sparse)],
                "features": meta.sparse_names,
                "num_embeddings": meta.num_embeddings,
                "oov_index": 0,
            },
            {
                "name": "dense",
                "dtype": "float32",
                "shape": ["batch", len(meta.dense)],
                "features": list(meta.dense),
            },
            *(
                {
                    "name": f"multi_hot_{feature.name}",
                    "dtype": "int64",
                    "shape": ["batch", "length"],
                    "features": [feature.name],
                    "num_embeddings": [feature.num_embeddings],
                    "padding": -1,
                }
                for feature in meta.multi_hot
            ),
        ],
        "outputs": [
            {
                "name": OUTPUT_NAME,
                "dtype": "float32",
                "shape": ["batch"] if len(tasks) == 1 else ["batch", len(tasks)],
                "description": " / ".join(f"probability that {task} = 1" for task in tasks),
            }
        ],
        "label": meta.label,
        "tasks": tasks,
        "files": {**RUNTIME_FILES, "scorer": SCORER_FILE},
        "parity": {
            "inputs": "parity/inputs.npz",
            "input_keys": input_names,
            "scores": "parity/scores.npy",
            "scores_dtype": "float32",
            "rows": parity_rows,
            "atol": config.parity_atol,
            "check": "onnxruntime(model.onnx) on inputs.npz vs scores.npy, max abs diff <= atol",
        },
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _model_card(
    config: ExportConfig,
    meta: DatasetMeta,
    model_config: dict[str, Any],
    train_dir: Path,
    metrics: dict[str, Any] | None,
    parity: Parity,
    infra: dict[str, Any] | None,
) -> str:
    interaction = "DLRM dot" if model_config["interaction"] == "dot" else "DCN-v2 cross"
    table = table_footprint(model_config)
    description = (
        f"CTR model ({interaction} interaction). Inputs `sparse` int64 "
        f"(B, {len(meta.sparse)}), `dense` float32 (B, {len(meta.dense)})"
        + "".join(f", `multi_hot_{name}` int64 (B, L)" for name in meta.multi_hot_names)
        + f"; output `score` float32, the probability of {model_config['tasks']}.\n\n"
        f"Embedding table: {table['rows']} rows of {table['embedding_dim']} values at "
        f"{table['precision']} ({table['bytes']} bytes), as training stored it; the "
        "ONNX and TorchScript graphs hold it so and decode the rows they gather to float32."
    )
    return model_card(
        config.model_name,
        [
            ("Model", model_section(description, model_config)),
            ("Features", _features_lines(meta)),
            ("Data", _data_lines(meta)),
            ("Metrics", metrics_lines(metrics)),
            ("Training", _training_lines(train_dir)),
            ("Parity", _parity_lines(config, parity)),
            ("Serving without recforge", _serving_lines(infra)),
        ],
    )


def _features_lines(meta: DatasetMeta) -> list[str]:
    return [
        "| input | position | feature | num_embeddings |",
        "|---|---|---|---|",
        *(f"| sparse | {i} | {f.name} | {f.num_embeddings} |" for i, f in enumerate(meta.sparse)),
        *(f"| dense | {i} | {name} | |" for i, name in enumerate(meta.dense)),
        *(f"| multi_hot_{f.name} | | {f.name} | {f.num_embeddings} |" for f in meta.multi_hot),
        "",
        "Raw values become model inputs through `transform.json`; index 0 is the OOV bucket.",
    ]


def _data_lines(meta: DatasetMeta) -> list[str]:
    return [
        "| split | rows | files |",
        "|---|---|---|",
        *(
            f"| {name} | {split.rows} | {len(split.files)} |"
            for name, split in sorted(meta.splits.items())
        ),
    ]


def _training_lines(train_dir: Path) -> list[str]:
    """The recorded train config and train summary, as JSON blocks."""
    train_config = _read_json(train_dir / TRAIN_CONFIG_FILE)
    summary = _read_json(train_dir / SUMMARY_FILE)
    if train_config is None:
        lines = ["Training config not recorded."]
    else:
        lines = ["```json", json.dumps(train_config, indent=2, sort_keys=True), "```"]
    if summary is not None:
        lines += ["", "```json", json.dumps(summary, indent=2, sort_keys=True), "```"]
    return lines


def _parity_lines(config: ExportConfig, parity: Parity) -> list[str]:
    return [
        f"Scores on the first {parity.rows} {PARITY_SPLIT} rows (`parity/`), compared with the "
        f"trained torch model (tolerance {config.parity_atol:g}):",
        "",
        *parity_table(parity, config.opset),
        "",
        "Repeat it anywhere: `onnxruntime.InferenceSession('model.onnx').run(['score'], "
        "dict(np.load('parity/inputs.npz')))` against `np.load('parity/scores.npy')`.",
    ]


def _serving_lines(infra: dict[str, Any] | None) -> list[str]:
    """How to serve without recforge, and the infra validation figures."""
    lines = [
        f"`{SCORER_FILE}` needs numpy and onnxruntime only: it maps raw records (dicts keyed "
        "by the raw field names, unseen ids and strings included) through `transform.json` "
        "and scores them with `model.onnx`. `from score import score_records`, or "
        f"`python {SCORER_FILE} records.jsonl` (add `--benchmark N` for latency).",
        "",
    ]
    if infra is None:
        return [*lines, "Infra validation: not run (no raw events given to export)."]
    versus_evaluate = (
        [
            f"| max abs diff vs the evaluate stage ({infra['evaluate_rows']} "
            f"{infra['evaluate_split']} rows) | {infra['max_abs_diff_vs_evaluate']:.3g} |"
        ]
        if "max_abs_diff_vs_evaluate" in infra
        else []
    )
    return [
        *lines,
        f"Infra validation (`{INFRA_VALIDATION_FILE}`): `{SCORER_FILE}` in a fresh "
        f"interpreter (python -I, cwd = the package; imported no recforge module) scored "
        f"{infra['rows']} raw records ({infra['test_records']} "
        f"{infra.get('evaluate_split', PARITY_SPLIT)} rows, "
        f"{infra['unseen_records']} with unseen ids) like the trained model:",
        "",
        "| figure | value |",
        "|---|---|",
        f"| max abs diff vs the trained model | {infra['max_abs_diff']:.3g} |",
        *versus_evaluate,
        f"| p50 / p99 latency, one record per call | {infra['p50_ms']:.3f} / "
        f"{infra['p99_ms']:.3f} ms |",
        f"| p50 / p99 latency, {infra['rows']} records per call | "
        f"{infra['batch_p50_ms']:.3f} / {infra['batch_p99_ms']:.3f} ms |",
        f"| timed calls per figure | {infra['repetitions']} |",
        f"| python / onnxruntime | {infra['python']} / {infra['onnxruntime']} |",
    ]
