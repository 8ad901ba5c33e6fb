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

``write_shards_distributed`` writes the same files, byte for byte, as three passes of
tasks that share only locations (fsspec URLs on a cluster): scatter per train row
group, deal per bucket, write per shard (see "the shuffle as tasks" below).
"""

import json
import math
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from artifacts.errors import ConfigError, InputNotFoundError
from artifacts.locations import (
    Location,
    as_location,
    base_name,
    close_output,
    join,
    list_files,
    open_output,
    open_parquet,
    read_arrow,
    read_text,
    remove,
    write_arrow,
    write_text,
)
from data_prep.errors import SchemaError
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

    out_dir: Location
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
    listed: list[str] | None = None,
) -> ShardResult:
    """Write balanced shards of every split and the dataset description.

    Args:
        config: the shard section.
        preprocessed_dir: preprocess's output (split tables and ``transform.json``).
        out_dir: an empty directory to write into (the caller publishes it).
        on_progress: called with the number of rows sharded so far.
        listed: the file names preprocess's signed manifest lists (the task layer
            passes them): only those split tables are read, never a file planted beside
            them. None: the ``*.parquet`` files in each split directory, for a directory
            only this process writes (tests, benchmarks).

    Returns:
        Rows per split and shard file names.

    Raises:
        InputNotFoundError: the preprocessed tables or ``transform.json`` are missing.
        SchemaError: ``transform.json`` comes from another version of preprocess.
        ConfigError: the train split needs more than ``MAX_SPILL_BUCKETS`` spill files at
            this ``shuffle_buffer_rows``.
    """
    preprocessed_dir = Path(preprocessed_dir)
    transform = read_transform(preprocessed_dir / "transform.json")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = _find_sources(preprocessed_dir, config.batch_rows, listed)

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


def _find_sources(
    preprocessed: Location, batch_rows: int, listed: list[str] | None = None
) -> dict[str, "_Source"]:
    """Every split's preprocessed files, in name order: those `listed` (preprocess's
    manifest) under ``<split>/``, or, without a list, those found in each split directory.

    Raises:
        InputNotFoundError: a split has no files.
    """
    sources = {}
    for split in SPLITS:
        if listed is None:
            files = list_files(join(preprocessed, split), ".parquet")
        else:
            files = [
                join(preprocessed, rel)
                for rel in sorted(listed)
                if rel.startswith(f"{split}/")
                and "/" not in rel[len(split) + 1 :]
                and rel.endswith(".parquet")
            ]
        if not files:
            raise InputNotFoundError(
                f"no '{split}' table under '{preprocessed}'; run preprocess first."
            )
        sources[split] = _Source(files, batch_rows)
    return sources


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


def read_transform(path: Location) -> dict:
    """Preprocess's ``transform.json`` (a path or a URL).

    Raises:
        InputNotFoundError: it is missing.
        SchemaError: it comes from another version of preprocess.
    """
    try:
        transform = json.loads(read_text(path))
    except FileNotFoundError as err:
        raise InputNotFoundError(f"'{path}' is missing; run preprocess first.") from err
    if transform.get("format") != TRANSFORM_FORMAT:
        raise SchemaError(
            f"'{path}' has format {transform.get('format')!r}, not {TRANSFORM_FORMAT!r}; rerun "
            "preprocess with this version of recforge."
        )
    return transform


@dataclass(frozen=True)
class _Source:
    """One split's preprocessed files."""

    files: list[Location]
    batch_rows: int

    @property
    def rows(self) -> int:
        return sum(open_parquet(p).metadata.num_rows for p in self.files)

    @property
    def schema(self) -> pa.Schema:
        return open_parquet(self.files[0]).schema_arrow

    def batches(self) -> Iterator[pa.Table]:
        for path in self.files:
            for batch in open_parquet(path).iter_batches(batch_size=self.batch_rows):
                yield pa.Table.from_batches([batch])


@dataclass(frozen=True)
class _Layout:
    """How every shard file of a split is written."""

    schema: pa.Schema
    row_group_size: int
    dictionary: list[str]  # column paths to dictionary-encode


class _ShardWriter:
    """Writes one shard in row groups of exactly ``row_group_size`` rows (the last shorter)."""

    def __init__(self, path: Location, layout: _Layout) -> None:
        self.path = path
        self.layout = layout
        self._sink = None
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
        close_output(self._sink)
        return {"path": base_name(self.path), "rows": self.rows}

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
            self._sink = open_output(self.path)
            self._writer = pq.ParquetWriter(
                self._sink, self.layout.schema, use_dictionary=self.layout.dictionary
            )
        self._writer.write_table(group, row_group_size=max(rows, 1))


def _write_contiguous(
    source: _Source, split: str, count: int, layout: _Layout, out_dir: Location
) -> list:
    """Keep input (time) order: shard k holds rows [k * rows // N, (k + 1) * rows // N)."""
    total = source.rows
    ends = [(k + 1) * total // count for k in range(count)]
    entries = []
    shard = 0
    writer = _ShardWriter(join(out_dir, shard_name(split, 0, count)), layout)
    position = 0
    for table in source.batches():
        start = 0
        while start < table.num_rows:
            while position == ends[shard] and shard < count - 1:
                entries.append(writer.close())
                shard += 1
                path = join(out_dir, shard_name(split, shard, count))
                writer = _ShardWriter(path, layout)
            take = min(table.num_rows - start, ends[shard] - position)
            writer.add(table.slice(start, take))
            start += take
            position += take
    entries.append(writer.close())
    for k in range(shard + 1, count):
        path = join(out_dir, shard_name(split, k, count))
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
    parts = deal_rows(table, bucket, position, len(writers), seed)
    # One task per shard and bucket, awaited before the next bucket's: every shard gets its
    # rows in the same order whatever the number of threads.
    for done in writing:
        done.result()
    position += table.num_rows
    return position, [pool.submit(w.add, part) for w, part in zip(writers, parts, strict=True)]


def deal_rows(table: pa.Table, bucket: int, position: int, count: int, seed: int) -> list[pa.Table]:
    """One bucket's rows permuted and dealt round-robin: the rows each shard gets.

    The bucket (its rows in input order) is permuted by a generator seeded with
    ``(seed, bucket)``; the p-th row dealt overall goes to shard ``p % count``, and this
    bucket's first row is the ``position``-th.

    Returns:
        ``count`` tables, shard k's rows in dealing order.
    """
    n = table.num_rows
    permutation = np.random.default_rng([seed, bucket]).permutation(n)
    firsts = [(k - position) % count for k in range(count)]
    # Rows of the permuted bucket grouped by shard, each shard's rows in dealing order.
    order = np.concatenate([permutation[first::count] for first in firsts])
    dealt = table.take(pa.array(order, pa.int64()))
    sizes = [len(range(first, n, count)) for first in firsts]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    return [dealt.slice(start, size) for start, size in zip(starts, sizes, strict=True)]


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


# ------------------------------------------------------------ the shuffle as tasks
#
# The same shuffle, cut into tasks that share nothing but locations (object-store URLs on
# a cluster), so a task runner can spread them over machines:
#
#   pass 1, one task per row group of the train files (a "unit", whose first row number
#     is known from the Parquet footers): scatter its rows into the buckets by the same
#     seeded hash, one Arrow part per non-empty bucket, ``scatter/bucket-B/unit-U.arrow``;
#   pass 2, one task per non-empty bucket: read its parts in unit order (the bucket's rows
#     in input order, as pass 1 of the in-process shuffle spills them), permute and deal
#     them from the bucket's position (the rows of the buckets before it, from pass 1's
#     counts) exactly as ``deal_rows`` does in-process: ``dealt/shard-K/bucket-B.arrow``;
#   pass 3, one task per train shard: append its dealt parts in bucket order through the
#     same ``_ShardWriter`` (plus one task per eval split, written in order as in-process).
#
# Each shard gets the same rows in the same order as in ``write_shards``, and a shard
# file's bytes depend only on them (row groups are cut from one contiguous buffer), so
# the shards are byte-identical to the in-process shuffle's. Memory per task: one row
# group (pass 1), one bucket, about ``shuffle_buffer_rows`` rows, twice (pass 2), one
# dealt part plus one row group (pass 3). Parts are written whole (one PUT each) and
# deleted once read; pass 1 holds no files open, so ``MAX_SPILL_BUCKETS`` does not apply.


@dataclass(frozen=True)
class ShardPlan:
    """What every task of ``write_shards_distributed`` needs: locations, no open files."""

    config: ShardConfig
    files: dict[str, list[Location]]
    rows: dict[str, int]
    layouts: dict[str, _Layout]
    units: list[tuple[int, int, int, int]]  # train (file, row group, first row, rows)
    buckets: int
    out: Location
    scratch: Location

    def scatter_part(self, bucket: int, unit: int) -> Location:
        return join(self.scratch, "scatter", f"bucket-{bucket:05d}", f"unit-{unit:06d}.arrow")

    def dealt_part(self, shard: int, bucket: int) -> Location:
        return join(self.scratch, "dealt", f"shard-{shard:05d}", f"bucket-{bucket:05d}.arrow")


def plan_shards(
    config: ShardConfig,
    preprocessed: Location,
    out: Location,
    scratch: Location,
    listed: list[str] | None = None,
) -> tuple[ShardPlan, dict]:
    """Read the footers and the transform once: the plan of the shard tasks.

    Returns:
        The plan and the transform.

    Raises:
        InputNotFoundError: the preprocessed tables or ``transform.json`` are missing.
        SchemaError: ``transform.json`` comes from another version of preprocess.
    """
    preprocessed, out, scratch = map(as_location, (preprocessed, out, scratch))
    transform = read_transform(join(preprocessed, "transform.json"))
    sources = _find_sources(preprocessed, config.batch_rows, listed)
    dictionary = dictionary_columns(transform)
    units = []
    first = 0
    for index, path in enumerate(sources["train"].files):
        metadata = open_parquet(path).metadata
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if rows:
                units.append((index, group, first, rows))
            first += rows
    plan = ShardPlan(
        config=config,
        files={split: source.files for split, source in sources.items()},
        rows={split: source.rows for split, source in sources.items()},
        layouts={
            split: _Layout(source.schema, config.row_group_size, dictionary)
            for split, source in sources.items()
        },
        units=units,
        buckets=max(1, math.ceil(first / config.shuffle_buffer_rows)),
        out=out,
        scratch=scratch,
    )
    return plan, transform


def scatter_unit(plan: ShardPlan, unit: int) -> dict[int, int]:
    """Pass 1 for one row group: its rows into their buckets. Returns rows per bucket."""
    index, group, first, rows = plan.units[unit]
    parquet = open_parquet(plan.files["train"][index])
    table = pa.Table.from_batches(list(parquet.iter_batches(batch_size=rows, row_groups=[group])))
    numbers = np.arange(first, first + table.num_rows, dtype=np.int64)
    bucket = bucket_of_rows(numbers, plan.config.seed, plan.buckets)
    order = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[order], np.arange(plan.buckets + 1))
    grouped = table.take(pa.array(order, pa.int64()))
    counts = {}
    for b in np.flatnonzero(np.diff(bounds)).tolist():
        size = int(bounds[b + 1] - bounds[b])
        write_arrow(plan.scatter_part(b, unit), grouped.slice(bounds[b], size))
        counts[b] = size
    return counts


def deal_bucket(plan: ShardPlan, jobs: list[tuple[int, list[int], int]], job: int) -> list[int]:
    """Pass 2 for one bucket: gather, permute, deal. Returns the rows dealt to each shard.

    Args:
        plan: the plan.
        jobs: (bucket, units holding its rows in order, its position) per non-empty bucket.
        job: which of them.
    """
    bucket, units, position = jobs[job]
    parts = [plan.scatter_part(bucket, unit) for unit in units]
    table = pa.concat_tables([read_arrow(part) for part in parts])
    count = plan.config.num_train_shards
    sizes = []
    for shard, rows in enumerate(deal_rows(table, bucket, position, count, plan.config.seed)):
        if rows.num_rows:
            write_arrow(plan.dealt_part(shard, bucket), rows)
        sizes.append(rows.num_rows)
    remove(parts)
    return sizes


def write_part(plan: ShardPlan, dealt: list[list[int]], index: int) -> list[dict]:
    """Pass 3: train shard ``index`` from its dealt parts, or (after the train shards) one
    eval split's contiguous shards. Returns the shard entries (name, rows)."""
    count = plan.config.num_train_shards
    if index >= count:
        split = [s for s in SPLITS if s != "train"][index - count]
        source = _Source(plan.files[split], plan.config.batch_rows)
        layout = plan.layouts[split]
        return _write_contiguous(source, split, plan.config.num_eval_shards, layout, plan.out)
    writer = _ShardWriter(join(plan.out, shard_name("train", index, count)), plan.layouts["train"])
    for bucket in dealt[index]:
        part = plan.dealt_part(index, bucket)
        writer.add(read_arrow(part))
        remove([part])
    return [writer.close()]


def write_shards_distributed(
    config: ShardConfig,
    preprocessed: Location,
    out: Location,
    scratch: Location,
    map_tasks: Callable[[Callable[[int], object], range], Iterator],
    on_progress: Callable[[int], None] | None = None,
    listed: list[str] | None = None,
) -> ShardResult:
    """``write_shards`` as three passes of tasks; the same files, byte for byte.

    Args:
        config: the shard section.
        preprocessed: preprocess's output, a path or a URL.
        out: where the shards and ``dataset.json`` go, a path or a URL.
        scratch: where the passes exchange their parts (emptied again on return).
        map_tasks: ``map_tasks(fn, range(n))`` runs ``fn`` on each index and yields the
            results in index order (threads, or a Dask cluster through the task runner:
            ``fn`` is picklable and reads and writes only the locations above).
        on_progress: called with the number of rows sharded so far.
        listed: the file names preprocess's signed manifest lists (`write_shards`).

    Returns:
        Rows per split and shard file names.

    Raises:
        InputNotFoundError: the preprocessed tables or ``transform.json`` are missing.
        SchemaError: ``transform.json`` comes from another version of preprocess.
    """
    plan, transform = plan_shards(config, preprocessed, out, scratch, listed)
    try:
        counts = list(map_tasks(partial(scatter_unit, plan), range(len(plan.units))))
        jobs: list[tuple[int, list[int], int]] = []
        position = 0
        for bucket in range(plan.buckets):
            units = [u for u, found in enumerate(counts) if bucket in found]
            if units:
                jobs.append((bucket, units, position))
                position += sum(counts[u][bucket] for u in units)
        sizes = list(map_tasks(partial(deal_bucket, plan, jobs), range(len(jobs))))
        count = config.num_train_shards
        dealt = [
            [bucket for (bucket, _, _), per in zip(jobs, sizes, strict=True) if per[shard]]
            for shard in range(count)
        ]
        written = list(map_tasks(partial(write_part, plan, dealt), range(count + 2)))
    finally:
        remove(list_files(plan.scratch, ".arrow", recursive=True))
    entries = {"train": [e for shard in written[:count] for e in shard]}
    entries.update(zip([s for s in SPLITS if s != "train"], written[count:], strict=True))
    splits = {split: {"files": entries[split], "rows": plan.rows[split]} for split in SPLITS}
    if on_progress:
        on_progress(sum(plan.rows.values()))
    write_text(
        join(plan.out, "dataset.json"), json.dumps(describe_dataset(transform, splits), indent=2)
    )
    return ShardResult(
        out_dir=plan.out,
        rows=dict(plan.rows),
        shards={s: [e["path"] for e in splits[s]["files"]] for s in SPLITS},
    )
