"""Read the shard directory: its `dataset.json` and one rank's rows of its Parquet files.

Reads `<shards_dir>/dataset.json` and the split's Parquet files (paths relative to
`shards_dir`), streamed one record batch at a time with pyarrow; a split is never
loaded whole. Writes nothing.

This module holds the `dataset.json` contract (`DatasetMeta`), the model input
(`Batch`) and its conversion from Arrow (`to_batch`), and the plain sequential reader
that evaluation and export use (`iter_tables`). Training reads through
`training.ctr.reader.ShardReader`, which streams the same files in lock-stepped streams.

Ranks and files (`rank_slices`): with at least `world_size` files, rank r reads files
r, r+W, ...; with fewer files every file is cut into `world_size` contiguous row
ranges and rank r reads range r of each.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError

DATASET_FILE = "dataset.json"

# dataset.json is another stage's output; unknown keys are ignored rather than
# rejected so the shard stage can add fields without breaking training.
_READ_MODEL = ConfigDict(frozen=True, extra="ignore")


class SparseFeature(BaseModel):
    """One categorical feature, stored as an int64 index column."""

    model_config = _READ_MODEL

    name: str = Field(description="Column name.")
    num_embeddings: int = Field(ge=1, description="Index range [0, num_embeddings); 0 is OOV.")


class ShardFile(BaseModel):
    """One Parquet file of a split."""

    model_config = _READ_MODEL

    path: str = Field(description="File path relative to the shard directory.")
    rows: int = Field(ge=0, description="Number of rows in the file.")


class SplitMeta(BaseModel):
    """The files of one split (train, valid or test)."""

    model_config = _READ_MODEL

    files: list[ShardFile] = Field(description="Files in read order.")
    rows: int = Field(ge=0, description="Total rows of the split.")


class DatasetMeta(BaseModel):
    """The parsed `dataset.json` of a shard directory."""

    model_config = _READ_MODEL

    label: str = Field(description="Primary label column (float32 0/1).")
    labels: list[str] = Field(
        min_length=1,
        description="Every label column, the primary one included; defaults to [label] "
        "when dataset.json predates multi-task datasets.",
    )
    sparse: list[SparseFeature] = Field(
        default_factory=list, description="Single-valued sparse features (int64), in order."
    )
    multi_hot: list[SparseFeature] = Field(
        default_factory=list,
        description="Multi-hot sparse features (list<int64> columns), in order.",
    )
    dense: list[str] = Field(description="Dense feature columns (float32), in order.")
    oracle: str | None = Field(
        None, description="Column with the true click probability (evaluation only), or None."
    )
    splits: dict[str, SplitMeta] = Field(description="Splits by name.")

    @model_validator(mode="before")
    @classmethod
    def _default_labels(cls, data: object) -> object:
        # Older dataset.json files have no "labels"; the primary label is then the only one.
        if isinstance(data, dict) and data.get("labels") is None and "label" in data:
            return {**data, "labels": [data["label"]]}
        return data

    @model_validator(mode="after")
    def _check_features(self) -> DatasetMeta:
        if not self.sparse and not self.multi_hot:
            raise ValueError(
                "dataset.json lists no sparse and no multi_hot feature; the model needs at "
                "least one categorical feature (mark a column as sparse in the schema)"
            )
        if self.label not in self.labels:
            raise ValueError(
                f"dataset.json: the primary label {self.label!r} is not among labels "
                f"{self.labels}; rebuild the shards"
            )
        return self

    @property
    def sparse_names(self) -> list[str]:
        """Single-valued sparse feature names in model input order."""
        return [feature.name for feature in self.sparse]

    @property
    def num_embeddings(self) -> list[int]:
        """Table sizes of the single-valued sparse features in model input order."""
        return [feature.num_embeddings for feature in self.sparse]

    @property
    def multi_hot_names(self) -> list[str]:
        """Multi-hot feature names in model input order."""
        return [feature.name for feature in self.multi_hot]

    @property
    def table_sizes(self) -> list[int]:
        """Table sizes of all embedding tables: single-valued features, then multi-hot ones."""
        return [*self.num_embeddings, *(feature.num_embeddings for feature in self.multi_hot)]

    def task_labels(self, tasks: list[str] | None) -> list[str]:
        """The label columns to train or score, one per task.

        Args:
            tasks: Label names (`train.tasks`), or None for the primary label only.

        Returns:
            `[label]` for None, else `tasks` in the given order.

        Raises:
            ConfigError: A task names a label the dataset does not have.
        """
        if tasks is None:
            return [self.label]
        unknown = [task for task in tasks if task not in self.labels]
        if unknown:
            raise ConfigError(
                f"train.tasks: {unknown} are not labels of this dataset; choose from {self.labels}"
            )
        return list(tasks)

    def split(self, name: str) -> SplitMeta:
        """The named split.

        Raises:
            SchemaError: dataset.json has no such split.
        """
        if name not in self.splits:
            raise SchemaError(f"{DATASET_FILE}: no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]


class Batch(NamedTuple):
    """One model input batch.

    B = rows, F = single-valued sparse features, Dn = dense features, T = tasks,
    L_f = the longest list of multi-hot feature f in this batch (at least 1).
    """

    sparse: torch.Tensor  # (B, F) int64, single-valued features in meta.sparse order
    dense: torch.Tensor  # (B, Dn) float32
    labels: torch.Tensor  # (B, T) float32, columns in the order of `tasks`
    multi_hot: tuple[torch.Tensor, ...]  # one (B, L_f) int64 per multi-hot feature, -1 padded


def load_dataset_meta(shards_dir: Path) -> DatasetMeta:
    """Read and validate `<shards_dir>/dataset.json`.

    Args:
        shards_dir: The shard directory.

    Returns:
        The parsed dataset description.

    Raises:
        InputNotFoundError: The file does not exist.
        SchemaError: The file is not valid JSON or misses required fields.
    """
    path = Path(shards_dir) / DATASET_FILE
    if not path.is_file():
        raise InputNotFoundError(f"{path} does not exist; run the shard stage first")
    try:
        return DatasetMeta.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as error:
        raise SchemaError(f"{path} is not a valid dataset description: {error}") from error


def rank_slices(split: SplitMeta, rank: int, world_size: int) -> list[tuple[str, int, int]]:
    """The row ranges of a split that one rank reads.

    Args:
        split: The split.
        rank: This rank, in [0, world_size).
        world_size: Number of ranks.

    Returns:
        (relative path, first row, end row) per file, in read order.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if len(split.files) >= world_size:
        return [(f.path, 0, f.rows) for f in split.files[rank::world_size]]
    return [
        (f.path, rank * f.rows // world_size, (rank + 1) * f.rows // world_size)
        for f in split.files
    ]


def iter_tables(
    shards_dir: Path,
    meta: DatasetMeta,
    split: str,
    rank: int,
    world_size: int,
    batch_size: int,
    columns: Sequence[str],
    drop_last: bool = True,
) -> Iterator[pa.Table]:
    """Stream one rank's rows of a split as tables of `batch_size` rows.

    Args:
        shards_dir: The shard directory.
        meta: Its dataset description.
        split: Split name.
        rank: This rank.
        world_size: Number of ranks.
        batch_size: Rows per yielded table.
        columns: Columns to read.
        drop_last: Drop a final table shorter than `batch_size`.

    Yields:
        Tables with `columns`, `batch_size` rows each (the last may be shorter
        when drop_last is False).

    Raises:
        InputNotFoundError: A file listed in dataset.json is missing.
        SchemaError: A file has fewer rows than dataset.json promises, or lacks a column.
    """
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    for relative, start, end in rank_slices(meta.split(split), rank, world_size):
        path = Path(shards_dir) / relative
        for record_batch in _read_rows(path, start, end, columns, batch_size):
            pending.append(record_batch)
            pending_rows += record_batch.num_rows
            while pending_rows >= batch_size:
                # Zero-copy: slices of a chunked table; to_batch copies once into tensors.
                table = pa.Table.from_batches(pending)
                yield table.slice(0, batch_size)
                rest = table.slice(batch_size)
                pending = rest.to_batches()
                pending_rows = rest.num_rows
    if pending_rows and not drop_last:
        yield pa.Table.from_batches(pending)


def _read_rows(
    path: Path, start: int, end: int, columns: Sequence[str], batch_size: int
) -> Iterator[pa.RecordBatch]:
    """Yield rows [start, end) of one Parquet file, reading only the row groups needed."""
    if not path.is_file():
        raise InputNotFoundError(f"{path} is listed in {DATASET_FILE} but does not exist")
    parquet = pq.ParquetFile(path)
    metadata = parquet.metadata
    if metadata.num_rows < end:
        raise SchemaError(
            f"{path} has {metadata.num_rows} rows but {DATASET_FILE} promises at least {end}; "
            "rebuild the shards"
        )
    missing = [name for name in columns if name not in parquet.schema_arrow.names]
    if missing:
        raise SchemaError(
            f"{path} lacks the columns {missing} that {DATASET_FILE} lists; rebuild the shards"
        )
    offset = 0
    for group in range(metadata.num_row_groups):
        group_rows = metadata.row_group(group).num_rows
        group_start, group_end = offset, offset + group_rows
        offset = group_end
        if group_end <= start or group_start >= end:
            continue
        position = group_start
        record_batches = parquet.iter_batches(
            batch_size=batch_size, row_groups=[group], columns=list(columns)
        )
        for record_batch in record_batches:
            lo = max(start - position, 0)
            hi = min(end - position, record_batch.num_rows)
            position += record_batch.num_rows
            if hi > lo:
                yield record_batch.slice(lo, hi - lo)
        if offset >= end:
            break


def to_batch(table: pa.Table, meta: DatasetMeta, tasks: list[str] | None = None) -> Batch:
    """Convert a table of shard rows to model tensors.

    Each column is copied once, chunk by chunk, straight into its place in the output
    arrays, so a table concatenated from many slices costs no extra copy.

    Args:
        table: B rows with the sparse, multi-hot, dense and task label columns of `meta`.
        meta: The dataset description.
        tasks: Label columns, in order (`train.tasks`); None for the primary label only.

    Returns:
        The batch: sparse (B, F) int64, dense (B, Dn) float32, labels (B, T) float32,
        multi_hot one (B, L_f) int64 per multi-hot feature, padded with -1.

    Raises:
        ConfigError: A task is not a label of the dataset.
        SchemaError: A multi-hot column is not a list column.
    """
    labels = meta.task_labels(tasks)
    rows = table.num_rows
    sparse = _fill_columns(table, meta.sparse_names, np.empty((rows, len(meta.sparse)), np.int64))
    dense = _fill_columns(table, meta.dense, np.empty((rows, len(meta.dense)), np.float32))
    # Copies into fresh, writable arrays: torch warns on read-only numpy memory.
    label_values = _fill_columns(table, labels, np.empty((rows, len(labels)), np.float32))
    multi_hot = tuple(
        torch.from_numpy(pad_multi_hot(table.column(name), name)) for name in meta.multi_hot_names
    )
    return Batch(
        torch.from_numpy(sparse), torch.from_numpy(dense), torch.from_numpy(label_values), multi_hot
    )


def _fill_columns(table: pa.Table, names: Sequence[str], out: np.ndarray) -> np.ndarray:
    """Copy the named scalar columns of `table` into the columns of `out` (B, len(names))."""
    for i, name in enumerate(names):
        position = 0
        for chunk in table.column(name).chunks:
            out[position : position + len(chunk), i] = chunk.to_numpy(zero_copy_only=False)
            position += len(chunk)
    return out


def pad_multi_hot(column: pa.ChunkedArray | pa.Array, name: str = "multi-hot") -> np.ndarray:
    """Pad a list<int64> column into a dense id matrix, without a Python loop per row.

    Args:
        column: B lists of ids (a list or large_list column, possibly chunked).
        name: Column name, for the error message.

    Returns:
        (B, L) int64, row i holding list i followed by -1s; L = the longest list, at
        least 1. Empty and null lists give a row of -1s, null ids give -1.

    Raises:
        SchemaError: The column is not a list column.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise SchemaError(
            f"multi-hot column {name!r} has type {column.type}, not list<int64>; rebuild the shards"
        )
    # Null lists count as empty; flatten() skips them (and honours slice offsets).
    lengths = [
        pc.fill_null(pc.list_value_length(chunk), 0).to_numpy().astype(np.int64, copy=False)
        for chunk in chunks
    ]
    width = max([1, *(int(part.max()) for part in lengths if len(part))])
    out = np.full((len(column), width), -1, dtype=np.int64)
    position = 0
    for chunk, length in zip(chunks, lengths, strict=True):
        values = chunk.flatten()
        if values.null_count:
            values = pc.fill_null(values, -1)
        values = values.to_numpy(zero_copy_only=False)
        # Element j of the flattened ids is in row repeat(arange(B), length)[j] at column
        # j - (start of that row's list).
        rows = np.repeat(np.arange(len(length)), length)
        starts = np.cumsum(length) - length
        cols = np.arange(len(values)) - np.repeat(starts, length)
        out[position + rows, cols] = values
        position += len(chunk)
    return out


def model_columns(meta: DatasetMeta, tasks: list[str] | None = None) -> list[str]:
    """The columns a batch needs: sparse, multi-hot, dense, then the task labels.

    Args:
        meta: The dataset description.
        tasks: Label columns (`train.tasks`); None for the primary label only.

    Returns:
        Column names, without duplicates.

    Raises:
        ConfigError: A task is not a label of the dataset.
    """
    columns = [*meta.sparse_names, *meta.multi_hot_names, *meta.dense, *meta.task_labels(tasks)]
    return list(dict.fromkeys(columns))
