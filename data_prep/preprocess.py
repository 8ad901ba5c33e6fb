"""Preprocess: clean events -> time split, fitted transform, transformed tables.

Reads ingest's ``events/*.parquet`` and writes

- ``transform.json``: the fitted transform (vocabularies per sparse feature with
  index 0 reserved for out-of-vocabulary ids, dense mean/std), fitted on the
  training split only, plus the split boundaries;
- ``train/``, ``valid/``, ``test/``: transformed Parquet tables with sparse
  features as int64 indices, dense features as standardised float32, the label
  as float32, the timestamp and (when the schema has one) the oracle column.

The split is by global event time: train < valid < test. Rows whose timestamp
equals a boundary go to the later split, so no training event is later than any
evaluation event. Memory is bounded by the batch size plus the vocabularies
(and the timestamp column, which the quantile split needs).
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_validator

from data_prep.errors import DataError, InputNotFoundError
from data_prep.schema import SchemaConfig

SPLITS = ("train", "valid", "test")


class PreprocessConfig(BaseModel):
    """How to split and transform clean events."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    valid_fraction: float = Field(
        default=0.1, gt=0.0, lt=1.0, description="Share of events (by time) in the valid split."
    )
    test_fraction: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="Share of events (latest in time) in the test split.",
    )
    min_count: int = Field(
        default=2,
        ge=1,
        description="Sparse ids seen fewer times in train map to the out-of-vocabulary index 0.",
    )
    batch_rows: int = Field(default=200_000, ge=1, description="Rows transformed per batch.")

    @model_validator(mode="after")
    def _train_remains(self) -> "PreprocessConfig":
        if self.valid_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                "valid_fraction + test_fraction must be below 1 so that a train split remains"
            )
        return self


@dataclass(frozen=True)
class PreprocessResult:
    """What preprocess wrote."""

    out_dir: Path
    rows: dict[str, int]
    vocab_sizes: dict[str, int]
    valid_start_ts: int
    test_start_ts: int


def preprocess_events(
    config: PreprocessConfig,
    schema: SchemaConfig,
    events_dir: Path,
    out_dir: Path,
    on_progress: Callable[[int], None] | None = None,
) -> PreprocessResult:
    """Split events by time, fit the transform on train, transform every split.

    Args:
        config: the preprocess section.
        schema: roles of the columns.
        events_dir: ingest's ``events`` directory.
        out_dir: an empty directory to write into (the caller publishes it).
        on_progress: called with the number of rows transformed so far.

    Returns:
        Row counts per split, vocabulary sizes and the split boundaries.

    Raises:
        InputNotFoundError: no event files.
        DataError: a split would be empty, or the split leaks future events.
    """
    files = sorted(Path(events_dir).glob("*.parquet"))
    if not files:
        raise InputNotFoundError(f"no event files under '{events_dir}'; run ingest first.")
    ts_name = schema.timestamp.name
    valid_start, test_start = _time_boundaries(files, ts_name, config)

    transform = fit_transform(config, schema, files, valid_start)
    transform["split"] = {"valid_start_ts": valid_start, "test_start_ts": test_start}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "transform.json").write_text(json.dumps(transform, indent=1))

    writers = {s: _SplitWriter(out_dir / s) for s in SPLITS}
    max_train_ts = -1
    min_eval_ts = None
    done = 0
    try:
        for batch in _batches(files, config.batch_rows):
            table = apply_transform(transform, schema, batch)
            ts = batch.column(ts_name)
            masks = {
                "train": pc.less(ts, valid_start),
                "valid": pc.and_(pc.greater_equal(ts, valid_start), pc.less(ts, test_start)),
                "test": pc.greater_equal(ts, test_start),
            }
            for split, mask in masks.items():
                part = table.filter(mask)
                if part.num_rows:
                    writers[split].write(part)
            train_ts = ts.filter(masks["train"])
            if len(train_ts):
                max_train_ts = max(max_train_ts, pc.max(train_ts).as_py())
            eval_ts = ts.filter(pc.invert(masks["train"]))
            if len(eval_ts):
                low = pc.min(eval_ts).as_py()
                min_eval_ts = low if min_eval_ts is None else min(min_eval_ts, low)
            done += batch.num_rows
            if on_progress:
                on_progress(done)
    finally:
        for writer in writers.values():
            writer.close()

    rows = {s: writers[s].rows for s in SPLITS}
    # Leakage guard: enforced on the written data, not assumed from the boundaries.
    if min_eval_ts is not None and max_train_ts >= min_eval_ts:
        raise DataError(
            f"time split leaks: latest train event {max_train_ts} >= earliest eval event "
            f"{min_eval_ts}."
        )
    return PreprocessResult(
        out_dir=out_dir,
        rows=rows,
        vocab_sizes={n: v["num_embeddings"] for n, v in transform["sparse"].items()},
        valid_start_ts=valid_start,
        test_start_ts=test_start,
    )


def _batches(files: list[Path], batch_rows: int) -> Iterator[pa.Table]:
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
            yield pa.Table.from_batches([batch])


def _time_boundaries(files: list[Path], ts_name: str, config: PreprocessConfig) -> tuple[int, int]:
    """Event-count quantiles of time: the first timestamps of valid and test."""
    ts = np.concatenate([pq.read_table(p, columns=[ts_name]).column(0).to_numpy() for p in files])
    if len(ts) == 0:
        raise DataError("no clean events to split; check ingest's quarantine report.")
    ts.sort()
    n = len(ts)
    valid_start = int(ts[min(n - 1, int(n * (1 - config.valid_fraction - config.test_fraction)))])
    test_start = int(ts[min(n - 1, int(n * (1 - config.test_fraction)))])
    # Rows at a boundary go to the later split, so ties can empty a split.
    rows = {
        "train": int(np.searchsorted(ts, valid_start, "left")),
        "valid": int(np.searchsorted(ts, test_start, "left") - np.searchsorted(ts, valid_start)),
        "test": int(n - np.searchsorted(ts, test_start, "left")),
    }
    empty = [s for s in SPLITS if rows[s] == 0]
    if empty:
        raise DataError(
            f"split(s) {empty} would be empty ({rows}): the events span too few distinct "
            "timestamps for preprocess.valid_fraction/test_fraction. Provide more data or "
            "change the fractions."
        )
    return valid_start, test_start


def fit_transform(
    config: PreprocessConfig, schema: SchemaConfig, files: list[Path], valid_start: int
) -> dict:
    """Fit vocabularies and dense statistics on events before ``valid_start``.

    One pass over the data counts every sparse feature and accumulates every
    dense statistic together, rather than one pass per feature.

    Returns:
        The transform as a JSON-able dict: ``sparse`` (name -> values, num_embeddings),
        ``dense`` (name -> log, mean, std), ``label``, ``timestamp``, ``oracle``.
    """
    sparse = schema.by_role("sparse")
    dense = schema.by_role("dense")
    counts: dict[str, list[pa.Table]] = {f.name: [] for f in sparse}
    sums = {f.name: np.zeros(3) for f in dense}  # count, sum, sum of squares
    for batch in _batches(files, config.batch_rows):
        train = batch.filter(pc.less(batch.column(schema.timestamp.name), valid_start))
        for f in sparse:
            col = train.column(f.name).drop_null()
            counts[f.name].append(pa.table({"v": col}).group_by("v").aggregate([("v", "count")]))
        for f in dense:
            values = _dense_values(train.column(f.name), f.log)
            sums[f.name] += (len(values), values.sum(), np.square(values).sum())

    transform: dict = {"sparse": {}, "dense": {}}
    for f in sparse:
        merged = pa.concat_tables(counts[f.name]).group_by("v").aggregate([("v_count", "sum")])
        keep = merged.filter(
            pc.greater_equal(merged["v_count_sum"], f.min_count or config.min_count)
        )
        # Most frequent first; ties by value, so the vocabulary is deterministic.
        order = pc.sort_indices(keep, [("v_count_sum", "descending"), ("v", "ascending")])
        values = keep["v"].take(order).to_pylist()
        transform["sparse"][f.name] = {
            "dtype": f.dtype,
            "values": values,
            "num_embeddings": len(values) + 1,
        }
    for f in dense:
        count, total, squares = sums[f.name]
        if count == 0:
            raise DataError(f"dense feature '{f.name}' has no values in the train split.")
        mean = total / count
        std = float(np.sqrt(max(squares / count - mean**2, 0.0)))
        transform["dense"][f.name] = {"log": f.log, "mean": float(mean), "std": std or 1.0}
    transform["label"] = schema.label.name
    transform["timestamp"] = schema.timestamp.name
    transform["oracle"] = schema.oracle.name if schema.oracle else None
    return transform


def _dense_values(column: pa.ChunkedArray, log: bool) -> np.ndarray:
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)
    values = values[~np.isnan(values)]
    return np.log1p(np.maximum(values, 0.0)) if log else values


def apply_transform(transform: dict, schema: SchemaConfig, batch: pa.Table) -> pa.Table:
    """Map raw typed events to model inputs with a fitted transform.

    Sparse values become int64 indices (0 = out of vocabulary), dense values
    ``(x' - mean) / std`` as float32 with ``x' = log1p(max(x, 0))`` where the field
    asks for it (missing values become the mean, i.e. 0), the label float32.
    """
    columns = {}
    for name, vocab in transform["sparse"].items():
        value_set = pa.array(
            vocab["values"], pa.int64() if vocab["dtype"] == "int64" else pa.string()
        )
        position = pc.index_in(batch.column(name), value_set=value_set)
        columns[name] = pc.add(pc.fill_null(position, -1), 1).cast(pa.int64())
    for name, stats in transform["dense"].items():
        raw = batch.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        if stats["log"]:
            raw = np.log1p(np.maximum(raw, 0.0))
        scaled = (raw - stats["mean"]) / stats["std"]
        columns[name] = pa.array(np.nan_to_num(scaled, nan=0.0).astype(np.float32))
    columns[transform["label"]] = batch.column(transform["label"]).cast(pa.float32())
    columns[transform["timestamp"]] = batch.column(transform["timestamp"])
    if transform.get("oracle"):
        columns[transform["oracle"]] = batch.column(transform["oracle"]).cast(pa.float64())
    return pa.table(columns)


class _SplitWriter:
    """Appends tables to one Parquet file per split."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.directory / "part-00000.parquet", table.schema)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
