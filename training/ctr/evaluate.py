"""Evaluate stage: score a split of the shards with a trained model.

Reads `<train_dir>/model_config.json` and `<train_dir>/model.safetensors`, the split's
Parquet files (streamed in batches; predictions go into streaming accumulators of
`training.ctr.metrics`, never into one array of the split) and, when given, preprocess's
`transform.json` (only to name slice values). Writes three files into `out_dir`.

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
- `table_precision` (string): how the scored model's embedding table is stored ("fp32",
  "fp16", "bf16" or "int8", `train.table_precision`); the model gathers the rows at
  that precision and decodes them, as its package's ONNX graph does, so these are the
  metrics of what the package serves.
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

`scores_head.npy`: float32 probabilities of the first `evaluate.score_sample_rows` rows
of the split (fewer when it is shorter), in the order `iter_tables(shards_dir, meta,
split, 0, 1, ...)` yields them (the split's files in dataset.json order, rows in file
order); shape (N,) for one task, (N, T) for several, like the exported package's
`score`. Export's infra validation scores the raw events of the same rows through the
package and compares (`training.ctr.export`): the evaluate stage is the reference.

Rows are scored in batches of `evaluate.batch_size` that never cross a shard file.
Ranks: with `evaluate.workers` = P > 1 and a split of F > 1 files, min(P, F) ranks score
the split (more would idle: write more eval shards, `shard.num_eval_shards`, to use
more), run as `python -m training.ctr.evaluate_worker` by DeepSpeed's launcher in one gloo
process group, the way training runs. Rank r scores every min(P, F)-th file from file r
(as `rank_slices` assigns files to ranks), rank 0 gathers the ranks' accumulators and
merges them in rank order, and this process writes the files from the merged state by
the same code as for one process. The launch spec (`ranks/launch.json`) and the
launcher's output (`ranks/launcher.log`) stay in `out_dir`. Every row is scored in the
same batch as in one process, so it gets the same score, and counts and AUCs are those
of one process: the exact AUC and GAUC keep every (label, score) row and rank them after
the merge (a user whose rows two ranks scored is one group), the bucketed AUC and the
bins add integer counts. Only the float sums behind logloss, click rate and mean
prediction are added in another order (they agree to ~1e-15). `evaluate.workers` = 1,
or a split of one file, scores in this process without a launcher.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from artifacts.errors import ConfigError
from data_prep.errors import SchemaError
from data_prep.transform import hash_strings, load_transform
from training.config import EvaluateConfig
from training.ctr.data import (
    DATASET_FILE,
    DatasetMeta,
    SplitMeta,
    iter_tables,
    load_dataset_meta,
    model_columns,
    to_batch,
)
from training.ctr.metrics import (
    AUCAccumulator,
    BucketedAUC,
    CTRStats,
    ExactAUC,
    GroupedAUC,
    ReliabilityBins,
    SliceMetrics,
)
from training.ctr.model import CTRModel, load_model
from training.runtime.evaluate_ranks import RankLaunch, launch_and_collect
from training.runtime.launcher import EVALUATE_RANK_ERRORS

METRICS_FILE = "metrics.json"


CALIBRATION_FILE = "calibration.json"


SCORES_HEAD_FILE = "scores_head.npy"


# Slicing keeps an AUC accumulator per value and writes six keys per value: meant for
# features like city or device. Users go into GAUC instead.
MAX_SLICE_VALUES = 1000


# String user keys are hashed to int64 groups; two users collide with probability
# about users**2 / 2**63.
_USER_HASH_BUCKETS = 2**62


# Rank 0's merged accumulators (an .npz: arrays and one JSON skeleton, loaded without
# pickle; see `write_accumulators`).
_RESULT_FILE = "merged.npz"


_WORKER_MODULE = "training.ctr.evaluate_worker"


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
        scores_head_path: The written scores_head.npy (scores of the first rows).
        table_precision: How the scored model's embedding table is stored.
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
    scores_head_path: Path
    table_precision: str


def evaluate_model(
    config: EvaluateConfig,
    train_dir: Path,
    shards_dir: Path,
    out_dir: Path,
    transform_path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    master_port: int | None = None,
    python: str = sys.executable,
    on_log: Callable[[str], None] | None = None,
) -> EvaluateResult:
    """Score every row of a split with the trained model and write its metrics.

    With `config.workers` > 1 the split is scored by up to that many DeepSpeed ranks
    (gloo), each reading a disjoint set of its files; their accumulators are merged in
    rank order, which gives the metrics one process would (see the module docstring).

    Args:
        config: The evaluate config (split, batch size, AUC counting, slices, workers).
        train_dir: The train stage's output (model_config.json, model.safetensors).
        shards_dir: The shard directory.
        out_dir: Where metrics.json, calibration.json and scores_head.npy go; created
            if missing.
        transform_path: preprocess's transform.json, to name slice values by their raw
            value; None keys them by index.
        env, master_port, python, on_log: How the ranks start, only used with ranks
            (see `training.runtime.evaluate_ranks.RankLaunch`; this library reads no
            environment: the caller builds `env`).

    Returns:
        The metrics.

    Raises:
        InputNotFoundError: A model file, dataset.json or a shard file is missing.
        SchemaError: The split is empty or holds only one class, or the oracle column
            holds values outside [0, 1].
        ConfigError: `evaluate.slice_by` or `evaluate.user_key` names a column the
            shards do not have as a usable feature.
        ValueError: The model predicts NaN.
        TransientError: A rank died (killed, or out of memory) or the launcher failed.

    A rank's InputNotFoundError, SchemaError, ConfigError or ValueError comes back as the
    same type, its message prefixed with the rank.
    """
    plan, model, meta, transform = _plan_scoring(config, train_dir, shards_dir, transform_path)
    table_precision = model.table_precision
    out_dir = Path(out_dir)
    num_files = len(meta.split(config.split).files)
    if config.workers == 1 or num_files <= 1:
        merged = _score_files(plan, model, meta, 0, 1)
    else:
        del model  # every rank loads its own copy
        launch = RankLaunch(env, master_port, python, on_log)
        merged = _score_in_ranks(plan, min(config.workers, num_files), out_dir, launch)
    metrics = {
        **_split_metrics(plan, merged),
        "table_precision": table_precision,
        **_slice_metrics(merged.slices, transform),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / METRICS_FILE
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    calibration_path = _write_calibration(out_dir, config.split, merged.reliability)
    scores_head_path = _write_scores_head(out_dir, plan, merged)
    return EvaluateResult(
        metrics_path=metrics_path,
        split=config.split,
        num_rows=metrics["num_rows"],
        auc=metrics["auc"],
        logloss=metrics["logloss"],
        click_rate=metrics["click_rate"],
        mean_prediction=metrics["mean_prediction"],
        bayes_auc=metrics.get("bayes_auc"),
        auc_mode=metrics["auc_mode"],
        auc_error_bound=metrics["auc_error_bound"],
        calibration=metrics["calibration"],
        gauc=metrics.get("gauc"),
        # Absent without a user column; 0 when no user has both classes.
        gauc_users=metrics.get("gauc_users"),
        calibration_path=calibration_path,
        scores_head_path=scores_head_path,
        table_precision=table_precision,
    )


def _plan_scoring(
    config: EvaluateConfig, train_dir: Path, shards_dir: Path, transform_path: Path | None
) -> tuple[_ScoringPlan, CTRModel, DatasetMeta, dict | None]:
    """Load the model, the dataset and the transform; check the slices and the user key.

    Returns:
        (the scoring plan, the model, the dataset meta, the transform or None).

    Raises:
        InputNotFoundError: A model file or dataset.json is missing.
        ConfigError: `evaluate.slice_by` or `evaluate.user_key` names a column the
            shards do not have as a usable feature.
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
    plan = _ScoringPlan(
        config=config,
        train_dir=Path(train_dir),
        shards_dir=Path(shards_dir),
        tasks=tasks,
        columns=columns,
        user_key=user_key,
        # A hashed user id (or a raw key column) has no OOV index: every id is a user.
        skip_oov_user=user_key in meta.sparse_names and _has_vocabulary(transform, user_key),
        head_rows=min(config.score_sample_rows, meta.split(config.split).rows),
    )
    return plan, model, meta, transform


def _split_metrics(plan: _ScoringPlan, merged: _Accumulators) -> dict[str, Any]:
    """The split's metrics of the primary task, oracle AUC, GAUC and per-task figures.

    Raises:
        SchemaError: The split has no rows, or a task label holds one class only.
    """
    config, aucs, stats = plan.config, merged.aucs, merged.stats
    if stats[0].rows == 0:
        raise SchemaError(f"split {config.split!r} of {plan.shards_dir} has no rows to evaluate")
    try:
        task_aucs = [auc.value() for auc in aucs]
        bayes_auc = merged.oracle_auc.value() if merged.oracle_auc is not None else None
    except ValueError as error:
        raise SchemaError(
            f"split {config.split!r} of {plan.shards_dir}: {error}; every task label needs "
            "positives and negatives"
        ) from error
    primary = stats[0]
    metrics: dict[str, Any] = {
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
    if merged.gauc is not None:
        try:
            gauc_value = merged.gauc.value()
        except ValueError:
            gauc_value = None  # no user has both classes: nothing to average
        metrics["gauc"] = gauc_value.gauc if gauc_value else None
        metrics["gauc_users"] = gauc_value.groups if gauc_value else 0
    if len(plan.tasks) > 1:
        for t, task in enumerate(plan.tasks):
            metrics[f"auc/{task}"] = task_aucs[t]
            metrics[f"logloss/{task}"] = stats[t].logloss()
            metrics[f"auc_error_bound/{task}"] = aucs[t].error_bound()
    return metrics


def _slice_metrics(slices: Mapping[str, SliceMetrics], transform: dict | None) -> dict[str, Any]:
    """`slice/f=v/...` keys per value v of each slice feature f (see the module docstring)."""
    metrics: dict[str, Any] = {}
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
    return metrics


def _write_calibration(out_dir: Path, split: str, reliability: ReliabilityBins) -> Path:
    """Write calibration.json (the primary task's reliability bins); its path."""
    path = out_dir / CALIBRATION_FILE
    calibration = {"split": split, "num_bins": reliability.num_bins, "bins": reliability.bins()}
    path.write_text(json.dumps(calibration, indent=2) + "\n")
    return path


def _write_scores_head(out_dir: Path, plan: _ScoringPlan, merged: _Accumulators) -> Path:
    """Write scores_head.npy: (N,) for one task, (N, T) for several; its path."""
    head = merged.head_scores(plan.head_rows, len(plan.tasks))  # (N, T)
    path = out_dir / SCORES_HEAD_FILE
    np.save(path, head[:, 0] if len(plan.tasks) == 1 else head)
    return path


@dataclass(frozen=True)
class _ScoringPlan:
    """What scoring a part of the split needs; a rank rebuilds it from `to_json()`."""

    config: EvaluateConfig
    train_dir: Path
    shards_dir: Path
    tasks: list[str]
    columns: list[str]  # shard columns to read
    user_key: str | None  # GAUC's user column, None without GAUC
    skip_oov_user: bool  # leave rows of user index 0 (OOV) out of GAUC
    head_rows: int  # first rows of the split whose scores go to scores_head.npy

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON values, for the ranks' launch spec."""
        return {
            "config": self.config.model_dump(mode="json"),
            "train_dir": str(self.train_dir.resolve()),
            "shards_dir": str(self.shards_dir.resolve()),
            "tasks": list(self.tasks),
            "columns": list(self.columns),
            "user_key": self.user_key,
            "skip_oov_user": self.skip_oov_user,
            "head_rows": self.head_rows,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _ScoringPlan:
        """The plan `to_json()` wrote."""
        return cls(
            config=EvaluateConfig.model_validate(data["config"]),
            train_dir=Path(data["train_dir"]),
            shards_dir=Path(data["shards_dir"]),
            tasks=list(data["tasks"]),
            columns=list(data["columns"]),
            user_key=data["user_key"],
            skip_oov_user=bool(data["skip_oov_user"]),
            head_rows=int(data["head_rows"]),
        )


class _Accumulators:
    """The mergeable metric state of one part of a split (see `training.ctr.metrics`).

    `aucs` and `stats` hold one accumulator per task; reliability, oracle AUC, GAUC and
    slices are about the primary task. `head` keeps the scores of the part's rows that
    are among the split's first `head_rows`, with their positions in the split.
    """

    def __init__(self, plan: _ScoringPlan, oracle: bool) -> None:
        config = plan.config
        settings = (config.auc_mode, config.auc_buckets, config.exact_auc_max_rows)
        self.aucs = [AUCAccumulator(*settings) for _ in plan.tasks]
        self.stats = [CTRStats() for _ in plan.tasks]
        self.oracle_auc = AUCAccumulator(*settings) if oracle else None
        self.reliability = ReliabilityBins(config.calibration_bins)
        self.gauc = GroupedAUC() if plan.user_key else None
        self.slices = {feature: SliceMetrics(*settings) for feature in config.slice_by}
        self.head: list[tuple[np.ndarray, np.ndarray]] = []  # ((n,) positions, (n, T) scores)

    def merge(self, other: _Accumulators) -> None:
        """Add another part's state. GAUC keeps every row, so a user whose rows two
        parts scored is one group after the merge, as in one process."""
        for mine, theirs in zip(self.aucs, other.aucs, strict=True):
            mine.merge(theirs)
        for mine, theirs in zip(self.stats, other.stats, strict=True):
            mine.merge(theirs)
        if self.oracle_auc is not None:
            self.oracle_auc.merge(other.oracle_auc)
        self.reliability.merge(other.reliability)
        if self.gauc is not None:
            self.gauc.merge(other.gauc)
        for feature, metrics in self.slices.items():
            metrics.merge(other.slices[feature])
        self.head.extend(other.head)

    def head_scores(self, rows: int, num_tasks: int) -> np.ndarray:
        """(rows, T) float32 scores of the split's first rows, in split order."""
        scores = np.zeros((rows, num_tasks), dtype=np.float32)
        seen = np.zeros(rows, dtype=bool)
        for positions, part in self.head:
            scores[positions] = part
            seen[positions] = True
        if not seen.all():
            raise RuntimeError(
                f"evaluate scored {int(seen.sum())} of the split's first {rows} rows; the "
                "ranks' files do not cover the split"
            )
        return scores


def _score_in_ranks(
    plan: _ScoringPlan, world_size: int, out_dir: Path, launch: RankLaunch
) -> _Accumulators:
    """Score the split in `world_size` launcher ranks; their accumulators, merged.

    Raises:
        InputNotFoundError, SchemaError, ConfigError, DataError, ValueError: A rank
            refused its input (the message names the rank and the launcher log).
        TransientError: A rank died, or the launcher failed or left no result.
    """
    return launch_and_collect(
        {"plan": plan.to_json()},
        world_size,
        out_dir,
        _RESULT_FILE,
        _WORKER_MODULE,
        EVALUATE_RANK_ERRORS,
        f"scoring split {plan.config.split!r} of {plan.shards_dir}",
        "evaluate.batch_size",
        launch,
        read_accumulators,
    )


# The classes an accumulators file may hold: its skeleton names nothing else.
_STATE_CLASSES = {
    cls.__name__: cls
    for cls in (
        AUCAccumulator,
        BucketedAUC,
        CTRStats,
        ExactAUC,
        GroupedAUC,
        ReliabilityBins,
        SliceMetrics,
        _Accumulators,
    )
}
_SKELETON = "skeleton"


def write_accumulators(file: IO[bytes], merged: _Accumulators) -> None:
    """Write accumulators as an .npz: their arrays, and a JSON skeleton of the rest.

    The skeleton holds every attribute of every accumulator (JSON numbers are exact for
    Python floats and ints), each array as the name of its .npz member; a list of arrays
    (a part's batches) goes as one concatenated member and its lengths. The reader
    rebuilds the same state, so the metrics are those of the accumulators rank 0 merged.
    No pickle either way: the file loads with `np.load(allow_pickle=False)`.

    Args:
        file: An open binary file (np.savez adds no ".npz" to a file object).
        merged: The accumulators.

    Raises:
        TypeError: An accumulator holds a value the format has no place for.
    """
    arrays: dict[str, np.ndarray] = {}
    skeleton = json.dumps(_encode(merged, arrays))
    np.savez(file, **arrays, **{_SKELETON: np.array(skeleton)})


def read_accumulators(path: Path) -> _Accumulators:
    """The accumulators `write_accumulators` wrote to `path`.

    Raises:
        ValueError: The file is not such an .npz (it names a class outside the metric
            accumulators, or an array it lacks).
    """
    with np.load(path, allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    try:
        skeleton = json.loads(str(arrays.pop(_SKELETON)))
        merged = _decode(skeleton, arrays)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is not an evaluate accumulators file: {error}") from error
    if not isinstance(merged, _Accumulators):
        raise ValueError(f"{path} holds a {type(merged).__name__}, not evaluate accumulators")
    return merged


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """`value` as JSON values, its arrays moved into `arrays` (see `write_accumulators`)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.ndarray | np.generic):
        name = f"a{len(arrays)}"
        arrays[name] = np.asarray(value)
        return {"array": name}
    if isinstance(value, list) and _are_batches(value):
        name = f"a{len(arrays)}"
        arrays[name] = np.concatenate(value)
        return {"batches": name, "lengths": [len(batch) for batch in value]}
    if isinstance(value, list | tuple):
        return {type(value).__name__: [_encode(item, arrays) for item in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if type(value).__name__ in _STATE_CLASSES:
        fields = {name: _encode(field, arrays) for name, field in vars(value).items()}
        return {"object": type(value).__name__, "fields": fields}
    raise TypeError(f"cannot write a {type(value).__name__} into an accumulators file")


def _are_batches(value: list) -> bool:
    """A non-empty list of arrays that concatenate along axis 0 (same dtype and rows)."""
    if not value or not all(isinstance(item, np.ndarray) and item.ndim for item in value):
        return False
    first = value[0]
    return all(item.dtype == first.dtype and item.shape[1:] == first.shape[1:] for item in value)


def _decode(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The value `_encode` wrote; objects only of `_STATE_CLASSES`, built without __init__."""
    if not isinstance(value, dict):
        return value
    if "array" in value:
        array = arrays[value["array"]]
        return array[()] if array.ndim == 0 else array
    if "batches" in value:
        ends = np.cumsum(value["lengths"])[:-1]
        return list(np.split(arrays[value["batches"]], ends))
    if "list" in value:
        return [_decode(item, arrays) for item in value["list"]]
    if "tuple" in value:
        return tuple(_decode(item, arrays) for item in value["tuple"])
    if "dict" in value:
        return {_decode(k, arrays): _decode(v, arrays) for k, v in value["dict"]}
    cls = _STATE_CLASSES[value["object"]]
    obj = cls.__new__(cls)
    vars(obj).update({name: _decode(field, arrays) for name, field in value["fields"].items()})
    return obj


def _score_files(
    plan: _ScoringPlan, model: CTRModel, meta: DatasetMeta, rank: int, world_size: int
) -> _Accumulators:
    """Stream every `world_size`-th file of the split, from file `rank`, through the model.

    Batches never cross a file: each file is read alone (`iter_tables` over a split of
    that one file), so a row is scored in the same batch whichever rank reads its
    file, and gets the same float32 score (a GEMM's result for a row depends on the
    batch around it).

    Returns:
        The part's accumulators.

    Raises:
        ValueError: The model predicts NaN.
        SchemaError: The oracle column holds values outside [0, 1].
    """
    config = plan.config
    part = _Accumulators(plan, oracle=meta.oracle is not None)
    split = meta.split(config.split)
    starts = np.cumsum([0, *(entry.rows for entry in split.files)])  # split row of each file
    for index in range(rank, len(split.files), world_size):
        entry = split.files[index]
        one_file = meta.model_copy(
            update={"splits": {config.split: SplitMeta(files=[entry], rows=entry.rows)}}
        )
        tables = iter_tables(
            plan.shards_dir, one_file, config.split, 0, 1, config.batch_size, plan.columns, False
        )
        position = int(starts[index])  # split row of the next table's first row
        for table in tables:
            probabilities = _score_table(plan, model, meta, table, part)  # (B, T)
            head = min(plan.head_rows, position + len(probabilities)) - position
            if head > 0:
                part.head.append((np.arange(position, position + head), probabilities[:head]))
            position += len(probabilities)
    return part


def _score_table(
    plan: _ScoringPlan, model: CTRModel, meta: DatasetMeta, table: pa.Table, part: _Accumulators
) -> np.ndarray:
    """Score one table of shard rows into `part`; returns its (B, T) float64 probabilities."""
    batch = to_batch(table, meta, plan.tasks)
    with torch.no_grad():
        logits = model(batch.sparse, batch.dense, *batch.multi_hot)  # (B, T)
    probabilities = torch.sigmoid(logits.double()).numpy()  # (B, T)
    labels = batch.labels.numpy()  # (B, T)
    if np.isnan(probabilities).any():
        raise ValueError(f"the model in {plan.train_dir} predicts NaN; its training diverged")
    for t in range(len(plan.tasks)):
        part.aucs[t].update(labels[:, t], probabilities[:, t])
        part.stats[t].update(labels[:, t], probabilities[:, t])
    # The first task is the primary one: the rest of the metrics are about it.
    y, p = labels[:, 0], probabilities[:, 0]  # (B,)
    part.reliability.update(y, p)
    if part.oracle_auc is not None:
        _update_oracle(part.oracle_auc, y, table, meta.oracle, plan.shards_dir)
    if part.gauc is not None:
        users, known = _user_groups(table.column(plan.user_key), plan.skip_oov_user)
        part.gauc.update(users[known], y[known], p[known])
    for feature, metrics in part.slices.items():
        metrics.update(table.column(feature).to_numpy(), y, p)
    return probabilities


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
        if index > len(values) or values[index - 1] is None:  # a hole: freed slot
            return f"#{index}"
        return str(values[index - 1])

    return name
