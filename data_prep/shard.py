"""Shard: transformed tables -> balanced train/valid/test Parquet shards.

Reads preprocess's ``train/``, ``valid/``, ``test/`` tables (files in name order) and
``transform.json``; writes ``<split>-NNNNN-of-MMMMM.parquet`` shards and
``dataset.json``, the contract the training library reads: the primary ``label``,
``sparse`` single-valued index columns with their ``num_embeddings`` (bucketized dense
features included), standardised ``dense`` columns, the ``oracle`` column and every
shard's rows; plus ``labels`` (all labels), ``multi_hot`` (list columns with their
``num_embeddings``), ``keys`` and the ``split`` that preprocess made.

Train rows are shuffled with bounded memory in two passes. Pass 1 scatters the rows
into ``B = ceil(rows / shuffle_buffer_rows)`` spill buckets by a seeded hash of their
row number (a uniform, stateless choice). Pass 2 loads one bucket at a time, permutes
it with a generator seeded by (seed, bucket), and deals its rows round-robin: the
p-th row dealt overall goes to shard ``p % N``. So every shard is a uniform sample of
the split, shard sizes differ by at most one row, and the bytes depend only on the
input, the config and the seed (not on thread counts). Valid and test keep their
order: shard k holds rows ``[k * rows // N, (k + 1) * rows // N)``.

Spill buckets are uncompressed Arrow IPC streams under ``.spill-train/``, deleted as
they are read; pass 1 keeps one open per bucket, so there may be at most
``MAX_SPILL_BUCKETS`` (raise ``shuffle_buffer_rows`` for bigger splits).

Every shard is written in row groups of exactly ``row_group_size`` rows (the last one
shorter). Memory: two buckets (about ``shuffle_buffer_rows`` rows each: one being
written while the next is permuted) plus one row group per shard, whatever the split's
size. valid and test are written while train is shuffled. With ``num_train_shards`` a
multiple of the training world size every rank reads its own files
(``training.ctr.data.rank_slices``).
"""

import json
import math
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from data_prep.errors import ConfigError, InputNotFoundError, SchemaError
from data_prep.preprocess import SPLITS
from data_prep.transform import TRANSFORM_FORMAT, dictionary_columns, splitmix64

# Pass 1 of the shuffle keeps one spill file per bucket open; stay below the usual
# limit of 1024 open files per process.
MAX_SPILL_BUCKETS = 1000


class ShardConfig(BaseModel):
    """How many shards to write and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_train_shards: int = Field(
        default=4,
        ge=1,
        description="Train shards; a multiple of the training world size gives each rank its "
        "own files and the same number of rows (within one per file).",
    )
    num_eval_shards: int = Field(default=2, ge=1, description="Shards for each of valid and test.")
    row_group_size: int = Field(default=65_536, ge=1, description="Rows per Parquet row group.")
    seed: int = Field(default=0, ge=0, description="Seed of the train shuffle.")
    batch_rows: int = Field(default=200_000, ge=1, description="Rows read per batch.")
    shuffle_buffer_rows: int = Field(
        default=500_000,
        ge=1,
        description="Rows the train shuffle holds in memory at once: the split is scattered "
        "into ceil(train rows / this) spill buckets, each permuted in memory.",
    )


@dataclass(frozen=True)
class ShardResult:
    """What shard wrote."""

    out_dir: Path
    rows: dict[str, int]
    shards: dict[str, list[str]]


def shard_name(split: str, index: int, count: int) -> str:
    """``train-00003-of-00004.parquet``."""
    return f"{split}-{index:05d}-of-{count:05d}.parquet"


def write_shards(
    config: ShardConfig,
    preprocessed_dir: Path,
    out_dir: Path,
    on_progress: Callable[[int], None] | None = None,
) -> ShardResult:
    """Write balanced shards of every split and the dataset description.

    Args:
        config: the shard section.
        preprocessed_dir: preprocess's output (split tables and ``transform.json``).
        out_dir: an empty directory to write into (the caller publishes it).
        on_progress: called with the number of rows sharded so far.

    Returns:
        Rows per split and shard file names.

    Raises:
        InputNotFoundError: the preprocessed tables or ``transform.json`` are missing.
        SchemaError: ``transform.json`` comes from another version of preprocess.
        ConfigError: the train split needs more than ``MAX_SPILL_BUCKETS`` spill files at
            this ``shuffle_buffer_rows``.
    """
    preprocessed_dir = Path(preprocessed_dir)
    transform = _read_transform(preprocessed_dir / "transform.json")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = {}
    for split in SPLITS:
        files = sorted((preprocessed_dir / split).glob("*.parquet"))
        if not files:
            raise InputNotFoundError(
                f"no '{split}' table under '{preprocessed_dir}'; run preprocess first."
            )
        sources[split] = _Source(files, config.batch_rows)

    def write(split: str) -> list:
        source = sources[split]
        layout = _Layout(source.schema, config.row_group_size, dictionary_columns(transform))
        if split == "train":
            return _write_shuffled(source, config, layout, out_dir)
        return _write_contiguous(source, split, config.num_eval_shards, layout, out_dir)

    # valid and test are written while train is shuffled: separate files, same bytes.
    splits = {}
    done = 0
    with ThreadPoolExecutor(max_workers=len(SPLITS) - 1) as pool:
        later = {split: pool.submit(write, split) for split in SPLITS if split != "train"}
        for split in SPLITS:
            entries = write(split) if split == "train" else later[split].result()
            splits[split] = {"files": entries, "rows": sources[split].rows}
            done += sources[split].rows
            if on_progress:
                on_progress(done)

    (out_dir / "dataset.json").write_text(json.dumps(describe_dataset(transform, splits), indent=2))
    return ShardResult(
        out_dir=out_dir,
        rows={s: splits[s]["rows"] for s in SPLITS},
        shards={s: [e["path"] for e in splits[s]["files"]] for s in SPLITS},
    )


def describe_dataset(transform: dict, splits: dict) -> dict:
    """The ``dataset.json`` content: column roles from the transform, files per split."""
    sparse, dense, multi_hot = [], [], []
    for column in transform["columns"]:
        name = column["name"]
        if column["role"] == "sparse":
            entry = transform["sparse"][name]
            target = multi_hot if entry["multi_hot"] else sparse
            target.append({"name": name, "num_embeddings": entry["num_embeddings"]})
        elif column["role"] == "dense":
            entry = transform["dense"][name]
            if entry["bucketize"] is None:
                dense.append(name)
            else:
                sparse.append({"name": name, "num_embeddings": entry["num_embeddings"]})
    return {
        "label": transform["label"],
        "labels": [label["name"] for label in transform["labels"]],
        "timestamp": transform["timestamp"],
        "sparse": sparse,
        "dense": dense,
        "multi_hot": multi_hot,
        "keys": transform["keys"],
        "oracle": transform["oracle"],
        "split": transform["split"],
        "splits": splits,
    }


def _read_transform(path: Path) -> dict:
    if not path.exists():
        raise InputNotFoundError(f"'{path}' is missing; run preprocess first.")
    transform = json.loads(path.read_text())
    if transform.get("format") != TRANSFORM_FORMAT:
        raise SchemaError(
            f"'{path}' has format {transform.get('format')!r}, not {TRANSFORM_FORMAT!r}; rerun "
            "preprocess with this version of recforge."
        )
    return transform


@dataclass(frozen=True)
class _Source:
    """One split's preprocessed files."""

    files: list[Path]
    batch_rows: int

    @property
    def rows(self) -> int:
        return sum(pq.ParquetFile(p).metadata.num_rows for p in self.files)

    @property
    def schema(self) -> pa.Schema:
        return pq.read_schema(self.files[0])

    def batches(self) -> Iterator[pa.Table]:
        for path in self.files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=self.batch_rows):
                yield pa.Table.from_batches([batch])


@dataclass(frozen=True)
class _Layout:
    """How every shard file of a split is written."""

    schema: pa.Schema
    row_group_size: int
    dictionary: list[str]  # column paths to dictionary-encode


class _ShardWriter:
    """Writes one shard in row groups of exactly ``row_group_size`` rows (the last shorter)."""

    def __init__(self, path: Path, layout: _Layout) -> None:
        self.path = path
        self.layout = layout
        self.rows = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self.rows += table.num_rows
        while self._pending_rows >= self.layout.row_group_size:
            self._flush(self.layout.row_group_size)

    def close(self) -> dict:
        """Write what is left (an empty shard keeps the file layout predictable)."""
        if self._pending_rows or self._writer is None:
            self._flush(self._pending_rows)
        self._writer.close()
        return {"path": self.path.name, "rows": self.rows}

    def _flush(self, rows: int) -> None:
        if self._pending:
            buffered = pa.concat_tables(self._pending)
        else:
            buffered = self.layout.schema.empty_table()
        # One contiguous chunk per row group: the bytes must not depend on how the rows
        # arrived (batch and bucket boundaries).
        group = buffered.slice(0, rows).combine_chunks()
        rest = buffered.slice(rows)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows
        if self._writer is None:
            self._writer = pq.ParquetWriter(
                self.path, self.layout.schema, use_dictionary=self.layout.dictionary
            )
        self._writer.write_table(group, row_group_size=max(rows, 1))


def _write_contiguous(
    source: _Source, split: str, count: int, layout: _Layout, out_dir: Path
) -> list:
    """Keep input (time) order: shard k holds rows [k * rows // N, (k + 1) * rows // N)."""
    total = source.rows
    ends = [(k + 1) * total // count for k in range(count)]
    entries = []
    shard = 0
    writer = _ShardWriter(out_dir / shard_name(split, 0, count), layout)
    position = 0
    for table in source.batches():
        start = 0
        while start < table.num_rows:
            while position == ends[shard] and shard < count - 1:
                entries.append(writer.close())
                shard += 1
                path = out_dir / shard_name(split, shard, count)
                writer = _ShardWriter(path, layout)
            take = min(table.num_rows - start, ends[shard] - position)
            writer.add(table.slice(start, take))
            start += take
            position += take
    entries.append(writer.close())
    for k in range(shard + 1, count):
        path = out_dir / shard_name(split, k, count)
        entries.append(_ShardWriter(path, layout).close())
    return entries


def _write_shuffled(source: _Source, config: ShardConfig, layout: _Layout, out_dir: Path) -> list:
    """Uniform seeded shuffle, dealt round-robin; see the module docstring."""
    count = config.num_train_shards
    writers = [_ShardWriter(out_dir / shard_name("train", k, count), layout) for k in range(count)]
    position = 0  # rows dealt so far; the next row goes to shard position % count
    writing: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=pa.cpu_count()) as pool:
        for bucket, table in _buckets(source, config, out_dir / ".spill-train"):
            # The next bucket is read and permuted while the last one is written.
            position, writing = _deal(table, bucket, position, writers, config.seed, pool, writing)
        for done in writing:
            done.result()
    return [writer.close() for writer in writers]


def _deal(
    table: pa.Table,
    bucket: int,
    position: int,
    writers: list[_ShardWriter],
    seed: int,
    pool: ThreadPoolExecutor,
    writing: list[Future[None]],
) -> tuple[int, list[Future[None]]]:
    """Permute one bucket and deal its rows round-robin from ``position``.

    Waits for the previous bucket's writes (``writing``) before handing this one's over.

    Returns:
        The new position and this bucket's pending writes.
    """
    count, n = len(writers), table.num_rows
    permutation = np.random.default_rng([seed, bucket]).permutation(n)
    firsts = [(k - position) % count for k in range(count)]
    # Rows of the permuted bucket grouped by shard, each shard's rows in dealing order.
    order = np.concatenate([permutation[first::count] for first in firsts])
    dealt = table.take(pa.array(order, pa.int64()))
    sizes = [len(range(first, n, count)) for first in firsts]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    parts = [dealt.slice(start, size) for start, size in zip(starts, sizes, strict=True)]
    # One task per shard and bucket, awaited before the next bucket's: every shard gets its
    # rows in the same order whatever the number of threads.
    for done in writing:
        done.result()
    return position + n, [pool.submit(w.add, part) for w, part in zip(writers, parts, strict=True)]


def bucket_of_rows(rows: np.ndarray, seed: int, buckets: int) -> np.ndarray:
    """Spill bucket of each row number: a seeded splitmix64 hash, (N,) -> (N,) in [0, buckets)."""
    key = splitmix64(np.array([seed], np.uint64))[0]
    return (splitmix64(rows.astype(np.uint64) ^ key) % np.uint64(buckets)).astype(np.intp)


def _buckets(
    source: _Source, config: ShardConfig, spill_dir: Path
) -> Iterator[tuple[int, pa.Table]]:
    """(bucket index, its rows in input order) for every non-empty bucket, one at a time."""
    total = source.rows
    buckets = max(1, math.ceil(total / config.shuffle_buffer_rows))
    if buckets > MAX_SPILL_BUCKETS:
        raise ConfigError(
            f"the train split has {total} rows: at shard.shuffle_buffer_rows="
            f"{config.shuffle_buffer_rows} the shuffle needs {buckets} spill files open at "
            f"once (at most {MAX_SPILL_BUCKETS}). Raise shard.shuffle_buffer_rows to at least "
            f"{math.ceil(total / MAX_SPILL_BUCKETS)}."
        )
    if buckets == 1:
        yield 0, pa.concat_tables(source.batches()) if total else source.schema.empty_table()
        return
    spill_dir.mkdir()
    try:
        paths = [spill_dir / f"bucket-{b:05d}.arrow" for b in range(buckets)]
        writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        offset = 0
        try:
            for table in source.batches():
                rows = np.arange(offset, offset + table.num_rows, dtype=np.int64)
                offset += table.num_rows
                bucket = bucket_of_rows(rows, config.seed, buckets)
                # Fewer than 2**16 buckets: a stable argsort of uint16 is a radix sort.
                order = np.argsort(bucket.astype(np.uint16), kind="stable")
                bounds = np.searchsorted(bucket[order], np.arange(buckets + 1))
                grouped = table.take(pa.array(order, pa.int64()))
                for b in np.flatnonzero(np.diff(bounds)).tolist():
                    if b not in writers:
                        writers[b] = pa.ipc.new_stream(str(paths[b]), table.schema)
                    writers[b].write_table(grouped.slice(bounds[b], bounds[b + 1] - bounds[b]))
        finally:
            for writer in writers.values():
                writer.close()
        for b, path in enumerate(paths):
            if b in writers:
                with pa.ipc.open_stream(str(path)) as reader:
                    spilled = reader.read_all()
                path.unlink()
                yield b, spilled
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
