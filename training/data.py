"""Read the shard directory: its `dataset.json` and per-rank batches from its Parquet files.

Reads `<shards_dir>/dataset.json` and the split's Parquet files (paths relative to
`shards_dir`), streamed one record batch at a time with pyarrow; a split is never
loaded whole. Writes nothing.

Ranks and files: with at least `world_size` files, rank r reads files r, r+W, ...;
with fewer files every file is cut into `world_size` contiguous row ranges and
rank r reads range r of each. Every rank must run the same number of training steps
(a rank that stops early leaves the others blocked in a collective), so
`steps_per_epoch` is computed from the row counts in `dataset.json` as the minimum
over ranks, and `iter_batches` stops every rank at that count.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data_prep.errors import InputNotFoundError, SchemaError

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

    label: str = Field(description="Label column (float32 0/1).")
    sparse: list[SparseFeature] = Field(min_length=1, description="Sparse features, in order.")
    dense: list[str] = Field(description="Dense feature columns (float32), in order.")
    oracle: str | None = Field(
        None, description="Column with the true click probability (evaluation only), or None."
    )
    splits: dict[str, SplitMeta] = Field(description="Splits by name.")

    @property
    def sparse_names(self) -> list[str]:
        """Sparse feature names in model input order."""
        return [feature.name for feature in self.sparse]

    @property
    def num_embeddings(self) -> list[int]:
        """Table sizes of the sparse features in model input order."""
        return [feature.num_embeddings for feature in self.sparse]

    def split(self, name: str) -> SplitMeta:
        """The named split.

        Raises:
            SchemaError: dataset.json has no such split.
        """
        if name not in self.splits:
            raise SchemaError(f"{DATASET_FILE}: no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]


class Batch(NamedTuple):
    """One model input batch. B = rows, F = sparse features, Dn = dense features."""

    sparse: torch.Tensor  # (B, F) int64
    dense: torch.Tensor  # (B, Dn) float32
    label: torch.Tensor  # (B,) float32


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


def steps_per_epoch(meta: DatasetMeta, split: str, world_size: int, batch_size: int) -> int:
    """Full micro batches per epoch that every rank can run.

    Args:
        meta: The dataset description.
        split: Split name.
        world_size: Number of ranks.
        batch_size: Rows per micro batch and rank.

    Returns:
        min over ranks of (rows of the rank // batch_size).
    """
    split_meta = meta.split(split)
    rows = [
        sum(end - start for _, start, end in rank_slices(split_meta, rank, world_size))
        for rank in range(world_size)
    ]
    return min(rows) // batch_size


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
        SchemaError: A file's row count differs from dataset.json.
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
    if offset < end:
        raise SchemaError(
            f"{path} has {offset} rows but {DATASET_FILE} promises at least {end}; "
            "rebuild the shards"
        )


def to_batch(table: pa.Table, meta: DatasetMeta) -> Batch:
    """Convert a table of shard rows to model tensors.

    Args:
        table: B rows with the sparse, dense and label columns of `meta`.
        meta: The dataset description.

    Returns:
        The batch: sparse (B, F) int64, dense (B, Dn) float32, label (B,) float32.
    """
    rows = table.num_rows
    sparse = np.empty((rows, len(meta.sparse)), dtype=np.int64)
    for i, name in enumerate(meta.sparse_names):
        sparse[:, i] = table.column(name).to_numpy()
    dense = np.empty((rows, len(meta.dense)), dtype=np.float32)
    for i, name in enumerate(meta.dense):
        dense[:, i] = table.column(name).to_numpy()
    label = np.empty(rows, dtype=np.float32)  # writable copy: torch warns on read-only
    label[:] = table.column(meta.label).to_numpy()
    return Batch(torch.from_numpy(sparse), torch.from_numpy(dense), torch.from_numpy(label))


def model_columns(meta: DatasetMeta) -> list[str]:
    """The columns a training batch needs: sparse, dense, label."""
    return [*meta.sparse_names, *meta.dense, meta.label]


def iter_batches(
    shards_dir: Path,
    meta: DatasetMeta,
    split: str,
    rank: int,
    world_size: int,
    batch_size: int,
    num_steps: int | None = None,
) -> Iterator[Batch]:
    """Yield one rank's training batches for one pass over a split.

    Args:
        shards_dir: The shard directory.
        meta: Its dataset description.
        split: Split name.
        rank: This rank.
        world_size: Number of ranks.
        batch_size: Rows per batch (micro batch per rank).
        num_steps: Batches to yield; defaults to `steps_per_epoch`, the same on every rank.

    Yields:
        Exactly `num_steps` full batches (sparse (B, F), dense (B, Dn), label (B,)).

    Raises:
        SchemaError: The rank's files hold fewer rows than dataset.json promises.
    """
    limit = steps_per_epoch(meta, split, world_size, batch_size)
    if num_steps is not None:
        if num_steps > limit:
            raise ValueError(f"num_steps={num_steps} exceeds the {limit} steps of one epoch")
        limit = num_steps
    if limit == 0:
        return
    tables = iter_tables(shards_dir, meta, split, rank, world_size, batch_size, model_columns(meta))
    produced = 0
    for table in tables:
        yield to_batch(table, meta)
        produced += 1
        if produced == limit:
            return
    raise SchemaError(
        f"rank {rank} read only {produced} batches of split {split!r} but {DATASET_FILE} "
        f"promises {limit}; rebuild the shards"
    )
