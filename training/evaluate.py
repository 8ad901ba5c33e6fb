"""Evaluate stage: score a split of the shards with a trained model.

Reads `<train_dir>/model_config.json` and `<train_dir>/model.safetensors`, the split's
Parquet files (streamed in batches; predictions go into streaming accumulators of
`training.metrics`, never into one array of the split) and, when given, preprocess's
`transform.json` (only to name slice values). Writes two files into `out_dir`.

`metrics.json`, flat keys with JSON numbers unless said otherwise:

- `split` (string), `num_rows`; `auc`, `logloss`, `click_rate` (mean label) and
  `mean_prediction` of the first (primary) task; `auc/<label>`, `logloss/<label>` and
  `auc_error_bound/<label>` per task for a multi-task model.
- `auc_mode` (string): "exact" or "bucketed", how `auc` was counted (`evaluate.auc_mode`;
  "auto" is exact up to `evaluate.exact_auc_max_rows` rows). `auc_error_bound`: a
  rigorous bound on |auc - exact AUC|, 0.0 when exact (see `BucketedAUC`). The same
  counting applies to every AUC of the file.
- `bayes_auc`: the AUC of the dataset's oracle column (the best any model can do), when
  dataset.json names an oracle.
- `calibration`: mean prediction / click rate of the primary task (1.0 is calibrated).
- `gauc`, `gauc_users`: grouped AUC of the primary task (per-user AUC weighted by the
  user's rows, over users with both classes) and the number of users it averages
  (`gauc` is null when no user has both classes). Only when a user column is known
  (`evaluate.user_key`, else dataset.json's `user_key`); rows whose user is the
  vocabulary's out-of-vocabulary index 0 are left out (many users share that id).
- per value v of each `evaluate.slice_by` feature f: `slice/f=v/num_rows`,
  `slice/f=v/click_rate`, `slice/f=v/mean_prediction`, `slice/f=v/logloss`, and, when
  the slice holds both classes, `slice/f=v/auc` and `slice/f=v/auc_error_bound`. The
  shards hold encoded indices; v is the raw value when `transform_path` is given and f
  has a vocabulary (index 0 is `<oov>`), else `#<index>` (hashed and bucketized
  features always).

`calibration.json`: `split`, `num_bins` and `bins`, one per equal-width probability bin
of the primary task's predictions (`evaluate.calibration_bins`): `lower`, `upper`,
`count`, `mean_prediction`, `observed_rate` (null for an empty bin).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from data_prep.errors import ConfigError, SchemaError
from data_prep.transform import hash_strings, load_transform
from training.config import EvaluateConfig
from training.data import (
    DATASET_FILE,
    DatasetMeta,
    iter_tables,
    load_dataset_meta,
    model_columns,
    to_batch,
)
from training.metrics import (
    AUCAccumulator,
    CTRStats,
    GroupedAUC,
    ReliabilityBins,
    SliceMetrics,
)
from training.model import load_model

METRICS_FILE = "metrics.json"
CALIBRATION_FILE = "calibration.json"
# Slicing keeps an AUC accumulator per value and writes six keys per value: meant for
# features like city or device. Users go into GAUC instead.
MAX_SLICE_VALUES = 1000
# String user keys are hashed to int64 groups; two users collide with probability
# about users**2 / 2**63.
_USER_HASH_BUCKETS = 2**62


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
        auc_mode: "exact" or "bucketed": how the AUCs were counted.
        auc_error_bound: Bound on |auc - exact AUC| (0.0 when exact).
        calibration: mean_prediction / click_rate.
        gauc: Grouped AUC over users, or None without a user column.
        gauc_users: Users GAUC averages over, or None without a user column.
        calibration_path: The written calibration.json (reliability bins).
    """

    metrics_path: Path
    split: str
    num_rows: int
    auc: float
    logloss: float
    click_rate: float
    mean_prediction: float
    bayes_auc: float | None
    auc_mode: str
    auc_error_bound: float
    calibration: float
    gauc: float | None
    gauc_users: int | None
    calibration_path: Path


def evaluate_model(
    config: EvaluateConfig,
    train_dir: Path,
    shards_dir: Path,
    out_dir: Path,
    transform_path: Path | None = None,
) -> EvaluateResult:
    """Score every row of a split with the trained model and write its metrics.

    Args:
        config: The evaluate config (split, batch size, AUC counting, slices).
        train_dir: The train stage's output (model_config.json, model.safetensors).
        shards_dir: The shard directory.
        out_dir: Where metrics.json and calibration.json go; created if missing.
        transform_path: preprocess's transform.json, to name slice values by their raw
            value; None keys them by index.

    Returns:
        The metrics.

    Raises:
        InputNotFoundError: A model file, dataset.json or a shard file is missing.
        SchemaError: The split is empty or holds only one class, or the oracle column
            holds values outside [0, 1].
        ConfigError: `evaluate.slice_by` or `evaluate.user_key` names a column the
            shards do not have as a usable feature.
        ValueError: The model predicts NaN.
    """
    model, model_config = load_model(train_dir)
    tasks = list(model_config["tasks"])
    meta = load_dataset_meta(shards_dir)
    raw_meta = json.loads((Path(shards_dir) / DATASET_FILE).read_text())
    _check_slice_by(config, meta, shards_dir)
    user_key = _user_key(config, meta, raw_meta, shards_dir)
    transform = load_transform(transform_path) if transform_path is not None else None
    columns = model_columns(meta, tasks) + ([meta.oracle] if meta.oracle else [])
    columns = list(dict.fromkeys([*columns, *config.slice_by, *([user_key] if user_key else [])]))

    def new_auc() -> AUCAccumulator:
        return AUCAccumulator(config.auc_mode, config.auc_buckets, config.exact_auc_max_rows)

    aucs = [new_auc() for _ in tasks]
    stats = [CTRStats() for _ in tasks]
    oracle_auc = new_auc() if meta.oracle else None
    reliability = ReliabilityBins(config.calibration_bins)
    gauc = GroupedAUC() if user_key else None
    # A hashed user id (or a raw key column) has no OOV index: every id is a user.
    skip_oov_user = user_key in meta.sparse_names and _has_vocabulary(transform, user_key)
    slices = {
        feature: SliceMetrics(config.auc_mode, config.auc_buckets, config.exact_auc_max_rows)
        for feature in config.slice_by
    }
    tables = iter_tables(
        shards_dir, meta, config.split, 0, 1, config.batch_size, columns, drop_last=False
    )
    with torch.no_grad():
        for table in tables:
            batch = to_batch(table, meta, tasks)
            logits = model(batch.sparse, batch.dense, *batch.multi_hot)  # (B, T)
            probabilities = torch.sigmoid(logits.double()).numpy()  # (B, T)
            labels = batch.labels.numpy()  # (B, T)
            if np.isnan(probabilities).any():
                raise ValueError(f"the model in {train_dir} predicts NaN; its training diverged")
            for t in range(len(tasks)):
                aucs[t].update(labels[:, t], probabilities[:, t])
                stats[t].update(labels[:, t], probabilities[:, t])
            # The first task is the primary one: the rest of the metrics are about it.
            y, p = labels[:, 0], probabilities[:, 0]  # (B,)
            reliability.update(y, p)
            if oracle_auc is not None:
                _update_oracle(oracle_auc, y, table, meta.oracle, shards_dir)
            if gauc is not None:
                users, known = _user_groups(table.column(user_key), skip_oov_user)
                gauc.update(users[known], y[known], p[known])
            for feature, metrics in slices.items():
                metrics.update(table.column(feature).to_numpy(), y, p)
    if stats[0].rows == 0:
        raise SchemaError(f"split {config.split!r} of {shards_dir} has no rows to evaluate")
    try:
        task_aucs = [auc.value() for auc in aucs]
        bayes_auc = oracle_auc.value() if oracle_auc is not None else None
    except ValueError as error:
        raise SchemaError(
            f"split {config.split!r} of {shards_dir}: {error}; every task label needs "
            "positives and negatives"
        ) from error
    primary = stats[0]
    metrics: dict[str, object] = {
        "split": config.split,
        "num_rows": primary.rows,
        "auc": task_aucs[0],
        "logloss": primary.logloss(),
        "click_rate": primary.click_rate(),
        "mean_prediction": primary.mean_prediction(),
        "auc_mode": aucs[0].mode,
        "auc_error_bound": aucs[0].error_bound(),
        "calibration": primary.calibration(),
    }
    if bayes_auc is not None:
        metrics["bayes_auc"] = bayes_auc
    gauc_value = None
    if gauc is not None:
        try:
            gauc_value = gauc.value()
        except ValueError:
            gauc_value = None  # no user has both classes: nothing to average
        metrics["gauc"] = gauc_value.gauc if gauc_value else None
        metrics["gauc_users"] = gauc_value.groups if gauc_value else 0
    if len(tasks) > 1:
        for t, task in enumerate(tasks):
            metrics[f"auc/{task}"] = task_aucs[t]
            metrics[f"logloss/{task}"] = stats[t].logloss()
            metrics[f"auc_error_bound/{task}"] = aucs[t].error_bound()
    for feature, per_value in slices.items():
        names = _value_names(transform, feature)
        for value, result in per_value.values().items():
            prefix = f"slice/{feature}={names(value)}"
            metrics[f"{prefix}/num_rows"] = result.num_rows
            metrics[f"{prefix}/click_rate"] = result.click_rate
            metrics[f"{prefix}/mean_prediction"] = result.mean_prediction
            metrics[f"{prefix}/logloss"] = result.logloss
            if result.auc is not None:
                metrics[f"{prefix}/auc"] = result.auc
                metrics[f"{prefix}/auc_error_bound"] = result.auc_error_bound

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / METRICS_FILE
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    calibration_path = out_dir / CALIBRATION_FILE
    calibration = {
        "split": config.split,
        "num_bins": reliability.num_bins,
        "bins": reliability.bins(),
    }
    calibration_path.write_text(json.dumps(calibration, indent=2) + "\n")
    return EvaluateResult(
        metrics_path=metrics_path,
        split=config.split,
        num_rows=primary.rows,
        auc=task_aucs[0],
        logloss=primary.logloss(),
        click_rate=primary.click_rate(),
        mean_prediction=primary.mean_prediction(),
        bayes_auc=bayes_auc,
        auc_mode=aucs[0].mode,
        auc_error_bound=aucs[0].error_bound(),
        calibration=primary.calibration(),
        gauc=gauc_value.gauc if gauc_value else None,
        gauc_users=(gauc_value.groups if gauc_value else 0) if gauc is not None else None,
        calibration_path=calibration_path,
    )


def _check_slice_by(config: EvaluateConfig, meta: DatasetMeta, shards_dir: Path) -> None:
    """Every slice feature must be a single-valued sparse feature with few values."""
    source = Path(shards_dir) / DATASET_FILE
    for feature in config.slice_by:
        if feature in meta.multi_hot_names:
            raise ConfigError(
                f"evaluate.slice_by: {feature!r} is multi-hot (a row has several values) and "
                f"cannot slice; choose from the single-valued features {meta.sparse_names}"
            )
        if feature not in meta.sparse_names:
            raise ConfigError(
                f"evaluate.slice_by: {feature!r} is not a feature of {source}; choose from "
                f"{meta.sparse_names}"
            )
        size = meta.num_embeddings[meta.sparse_names.index(feature)]
        if size > MAX_SLICE_VALUES:
            raise ConfigError(
                f"evaluate.slice_by: {feature!r} has {size} values, more than "
                f"{MAX_SLICE_VALUES}; slice by a coarser feature (per-user quality is gauc)"
            )


def _user_key(
    config: EvaluateConfig, meta: DatasetMeta, raw_meta: dict, shards_dir: Path
) -> str | None:
    """The user column for GAUC: evaluate.user_key, else dataset.json's user_key."""
    user_key = config.user_key or raw_meta.get("user_key")
    if user_key is None:
        return None
    known = [*meta.sparse_names, *raw_meta.get("keys", [])]
    if user_key not in known:
        origin = "evaluate.user_key" if config.user_key else f"{DATASET_FILE} user_key"
        raise ConfigError(
            f"{origin}: {user_key!r} is not a single-valued sparse feature or key column of "
            f"{Path(shards_dir) / DATASET_FILE}; choose from {known}"
        )
    return user_key


def _has_vocabulary(transform: dict | None, feature: str) -> bool:
    """Whether index 0 of a sparse feature is the OOV bucket (dataset.json says it is
    unless the transform shows a hashed feature)."""
    if transform is None or feature not in transform["sparse"]:
        return True
    return transform["sparse"][feature]["kind"] == "vocab"


def _user_groups(column: pa.ChunkedArray, skip_oov: bool) -> tuple[np.ndarray, np.ndarray]:
    """(B,) int64 user groups and the (B,) mask of the rows to count."""
    array = column.combine_chunks()
    known = ~pc.is_null(array).to_numpy(zero_copy_only=False)
    if pa.types.is_integer(array.type):
        users = pc.fill_null(array, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    elif pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        users = hash_strings(array, _USER_HASH_BUCKETS)
    else:
        raise ConfigError(f"the user column has type {array.type}; GAUC needs integers or strings")
    if skip_oov:
        known &= users != 0
    return users, known


def _update_oracle(
    auc: AUCAccumulator, labels: np.ndarray, table: pa.Table, oracle: str, shards_dir: Path
) -> None:
    try:
        auc.update(labels, table.column(oracle).to_numpy())
    except ValueError as error:
        raise SchemaError(
            f"the oracle column {oracle!r} of {shards_dir}: {error}; it must hold true click "
            "probabilities"
        ) from error


def _value_names(transform: dict | None, feature: str) -> Callable[[int], str]:
    """index -> slice name: the raw value through the vocabulary, else `#<index>`."""
    entry = (transform or {}).get("sparse", {}).get(feature)
    if entry is None or entry["kind"] != "vocab":
        return lambda index: f"#{index}"
    values = entry["values"]

    def name(index: int) -> str:
        if index == 0:
            return "<oov>"
        return str(values[index - 1]) if index <= len(values) else f"#{index}"

    return name
