"""Evaluate stage: score a split of the shards with a trained model.

Reads `<train_dir>/model_config.json` and `<train_dir>/model.safetensors`, and the
split's Parquet files (streamed in batches). Writes `<out_dir>/metrics.json`:
`split`, `num_rows`, `auc`, `logloss`, `click_rate`, `mean_prediction` of the
first (primary) task, `bayes_auc` (the AUC of the dataset's oracle column, the best
any model can do) when dataset.json names an oracle, and `auc/<label>`,
`logloss/<label>` per task for a multi-task model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_prep.errors import SchemaError
from training.config import EvaluateConfig
from training.data import iter_tables, load_dataset_meta, model_columns, to_batch
from training.metrics import log_loss, roc_auc
from training.model import load_model

METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class EvaluateResult:
    """Metrics of a trained model on one split.

    Attributes:
        metrics_path: The written metrics.json.
        split: The evaluated split.
        num_rows: Rows scored.
        auc: ROC AUC of the model's scores.
        logloss: Mean log loss of the model's probabilities.
        click_rate: Mean label.
        mean_prediction: Mean predicted probability (compare with click_rate for calibration).
        bayes_auc: AUC of the oracle column, or None when the dataset has no oracle.
    """

    metrics_path: Path
    split: str
    num_rows: int
    auc: float
    logloss: float
    click_rate: float
    mean_prediction: float
    bayes_auc: float | None


def evaluate_model(
    config: EvaluateConfig, train_dir: Path, shards_dir: Path, out_dir: Path
) -> EvaluateResult:
    """Score every row of a split with the trained model and write its metrics.

    Args:
        config: The evaluate config (split, batch size).
        train_dir: The train stage's output (model_config.json, model.safetensors).
        shards_dir: The shard directory.
        out_dir: Where metrics.json goes; created if missing.

    Returns:
        The metrics.

    Raises:
        InputNotFoundError: A model file, dataset.json or a shard file is missing.
        SchemaError: The split is empty or holds only one class.
    """
    model, model_config = load_model(train_dir)
    tasks = list(model_config["tasks"])
    meta = load_dataset_meta(shards_dir)
    columns = model_columns(meta, tasks) + ([meta.oracle] if meta.oracle else [])
    tables = iter_tables(
        shards_dir, meta, config.split, 0, 1, config.batch_size, columns, drop_last=False
    )
    labels: list[np.ndarray] = []
    probabilities: list[np.ndarray] = []
    oracle: list[np.ndarray] = []
    with torch.no_grad():
        for table in tables:
            batch = to_batch(table, meta, tasks)
            logits = model(batch.sparse, batch.dense, *batch.multi_hot)  # (B, T)
            probabilities.append(torch.sigmoid(logits.double()).numpy())
            labels.append(batch.labels.numpy())
            if meta.oracle:
                oracle.append(table.column(meta.oracle).to_numpy())
    if not labels:
        raise SchemaError(f"split {config.split!r} of {shards_dir} has no rows to evaluate")
    y_all = np.concatenate(labels)  # (N, T)
    p_all = np.concatenate(probabilities)  # (N, T)
    # The first task is the primary one: its metrics are the unprefixed keys.
    y, p = y_all[:, 0], p_all[:, 0]
    try:
        auc = roc_auc(y, p)
        bayes_auc = roc_auc(y, np.concatenate(oracle)) if meta.oracle else None
        task_aucs = {task: roc_auc(y_all[:, t], p_all[:, t]) for t, task in enumerate(tasks)}
    except ValueError as error:
        raise SchemaError(
            f"split {config.split!r} of {shards_dir}: {error}; every task label needs "
            "positives and negatives"
        ) from error

    logloss = log_loss(y, p)
    click_rate = float(y.mean())
    mean_prediction = float(p.mean())
    metrics: dict[str, object] = {
        "split": config.split,
        "num_rows": int(y.size),
        "auc": auc,
        "logloss": logloss,
        "click_rate": click_rate,
        "mean_prediction": mean_prediction,
    }
    if bayes_auc is not None:
        metrics["bayes_auc"] = bayes_auc
    if len(tasks) > 1:
        for t, task in enumerate(tasks):
            metrics[f"auc/{task}"] = task_aucs[task]
            metrics[f"logloss/{task}"] = log_loss(y_all[:, t], p_all[:, t])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / METRICS_FILE
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    return EvaluateResult(
        metrics_path=metrics_path,
        split=config.split,
        num_rows=int(y.size),
        auc=auc,
        logloss=logloss,
        click_rate=click_rate,
        mean_prediction=mean_prediction,
        bayes_auc=bayes_auc,
    )
