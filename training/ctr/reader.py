"""The streaming training reader: one rank's batches of the train split, decoded ahead.

Reads `<shards_dir>/dataset.json` (already parsed into a `DatasetMeta`) and the
split's Parquet files; writes nothing.

Streams. The split is cut into `num_streams` streams by `stream_slices` (the same rule
as `data.rank_slices`: with at least S files stream s reads files s, s+S, ...; with
fewer, every file is cut into S contiguous row ranges and stream s reads range s of
each). At every step each stream hands out its next `rows_per_stream = batch_size *
world_size // num_streams` consecutive rows. Rank r owns streams r, r+W, r+2W, ... and
its batch is the concatenation of its streams' pieces in increasing stream order. The
streams and their pieces depend only on the split, `num_streams` and the global rows
per step, never on the world size: with `num_streams` fixed, the rows of global step k
(the union over ranks) are the same for every world size that divides it, so a run can
resume on a different number of ranks and see the same data in the same order.

Epochs. Every rank must run the same number of steps (a rank that stops early leaves
the others blocked in a collective), so an epoch is `steps_per_epoch` = the minimum
over streams of (stream rows // rows_per_stream), computed from the row counts in
`dataset.json`; the rows of a stream past that are not read. The reader is endless:
epoch after epoch, each in the same order; the caller decides when to stop.

Background decoding. A daemon thread reads the Parquet files (pyarrow releases the
GIL while decoding), converts each step's rows with `data.to_batch` and puts the
batches into a queue of `prefetch` batches, so decoding overlaps the training step.
Record batches of up to `_DECODE_ROWS` rows are decoded at once and sliced without
copying; `to_batch` copies each column once, into the output tensors. An exception in
the thread is handed through the queue and raised by the caller's next `next()`.

Resume. `position()` counts the batches the caller has consumed (not those decoded
ahead); `restore(position)` restarts the thread there. Seeking skips whole files by
their row counts and whole row groups by Parquet metadata, so a resume never decodes
the row groups before the position (only the rows of the row group it falls in).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pyarrow as pa

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from training.ctr.data import (
    DATASET_FILE,
    Batch,
    DatasetMeta,
    SplitMeta,
    _read_rows,
    model_columns,
    rank_slices,
    to_batch,
)

# Rows decoded per Parquet record batch: large enough to amortise pyarrow's per-call
# cost, small enough that a stream holds only a few MB of decoded columns.
_DECODE_ROWS = 65536

# How often a blocked queue put/get wakes up to check for close() or a dead worker.
_POLL_S = 0.05


def stream_slices(split: SplitMeta, stream: int, num_streams: int) -> list[tuple[str, int, int]]:
    """The row ranges of a split that one stream reads.

    Args:
        split: The split.
        stream: The stream, in [0, num_streams).
        num_streams: Number of streams (`train.data_streams`).

    Returns:
        (relative path, first row, end row) per file, in read order: files s, s+S, ...
        when the split has at least S files, else range s of every file cut into S
        contiguous ranges.

    Raises:
        ValueError: `stream` is out of range.
    """
    return rank_slices(split, stream, num_streams)


def steps_per_epoch(meta: DatasetMeta, split: str, num_streams: int, rows_per_stream: int) -> int:
    """Steps of one epoch: as many as every stream can feed.

    Args:
        meta: The dataset description.
        split: Split name.
        num_streams: Number of streams.
        rows_per_stream: Rows each stream contributes per step
            (batch_size * world_size // num_streams).

    Returns:
        min over streams of (stream rows // rows_per_stream); the same on every rank.

    Raises:
        SchemaError: dataset.json has no such split.
        ValueError: `rows_per_stream` is below 1.
    """
    if rows_per_stream < 1:
        raise ValueError(f"rows_per_stream must be >= 1, got {rows_per_stream}")
    split_meta = meta.split(split)
    return min(_stream_rows(split_meta, num_streams)) // rows_per_stream


def _stream_rows(split: SplitMeta, num_streams: int) -> list[int]:
    """Rows of each stream of a split."""
    return [
        sum(end - start for _, start, end in stream_slices(split, stream, num_streams))
        for stream in range(num_streams)
    ]


@dataclass(frozen=True)
class _Plan:
    """What the worker thread needs; it holds no reference to the ShardReader."""

    shards_dir: Path
    meta: DatasetMeta
    tasks: list[str]
    columns: list[str]
    slices: list[list[tuple[str, int, int]]]  # per owned stream, in stream order
    rows_per_stream: int
    steps_per_epoch: int


@dataclass(frozen=True)
class _Failure:
    """An exception raised in the worker, to be re-raised by the consumer."""

    error: Exception


class _StreamCursor:
    """One stream's rows from a row offset on, handed out in pieces of consecutive rows."""

    def __init__(
        self, shards_dir: Path, slices: list[tuple[str, int, int]], skip: int, columns: list[str]
    ) -> None:
        self._record_batches = self._read(shards_dir, slices, skip, columns)
        self._current: pa.RecordBatch | None = None
        self._offset = 0

    @staticmethod
    def _read(
        shards_dir: Path, slices: list[tuple[str, int, int]], skip: int, columns: list[str]
    ) -> Iterator[pa.RecordBatch]:
        for relative, start, end in slices:
            if skip >= end - start:  # the whole slice lies before the position
                skip -= end - start
                continue
            # _read_rows skips the row groups before start + skip by their metadata.
            yield from _read_rows(shards_dir / relative, start + skip, end, columns, _DECODE_ROWS)
            skip = 0

    def take(self, rows: int) -> list[pa.RecordBatch]:
        """The next `rows` rows, as zero-copy slices of the decoded record batches.

        Raises:
            SchemaError: The stream's files hold fewer rows than dataset.json promises.
        """
        pieces = []
        while rows:
            if self._current is None or self._offset == self._current.num_rows:
                self._current = next(self._record_batches, None)
                self._offset = 0
                if self._current is None:
                    raise SchemaError(
                        f"a stream's files hold fewer rows than {DATASET_FILE} promises; "
                        "rebuild the shards"
                    )
            count = min(rows, self._current.num_rows - self._offset)
            pieces.append(self._current.slice(self._offset, count))
            self._offset += count
            rows -= count
        return pieces


def _produce(
    plan: _Plan, consumed: int, out: queue.Queue[Batch | _Failure], stop: threading.Event
) -> None:
    """Worker thread: put the batches from global step `consumed` on, until `stop` is set."""
    try:
        epoch, step = divmod(consumed, plan.steps_per_epoch)
        while not stop.is_set():
            skip = step * plan.rows_per_stream
            cursors = [
                _StreamCursor(plan.shards_dir, slices, skip, plan.columns) for slices in plan.slices
            ]
            for _ in range(step, plan.steps_per_epoch):
                # Stream order within the rank: the rows of a world_size=1 reader are the
                # ranks' batches of a larger world, one after the other.
                pieces = [part for cursor in cursors for part in cursor.take(plan.rows_per_stream)]
                batch = to_batch(pa.Table.from_batches(pieces), plan.meta, plan.tasks)
                if not _put(out, batch, stop):
                    return
            epoch, step = epoch + 1, 0
    except Exception as error:  # handed to the consumer, which raises it at its next next()
        _put(out, _Failure(error), stop)


def _put(out: queue.Queue[Batch | _Failure], item: Batch | _Failure, stop: threading.Event) -> bool:
    """Put `item` once there is room; False if `stop` was set first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class ShardReader:
    """One rank's endless stream of training batches, decoded in a background thread.

    Usage::

        with ShardReader(shards_dir, meta, "train", rank, world_size, batch_size=512,
                         num_streams=config.num_data_streams()) as reader:
            reader.restore(checkpoint_position)  # optional, before iterating
            for step, batch in zip(range(num_steps), reader):
                ...
                position = reader.position()  # save with the checkpoint

    Attributes:
        steps_per_epoch: Batches per epoch, the same on every rank.
        rows_per_stream: Rows each stream contributes per step.
        streams: The streams this rank reads, in batch order.
    """

    def __init__(
        self,
        shards_dir: Path,
        meta: DatasetMeta,
        split: str,
        rank: int,
        world_size: int,
        batch_size: int,
        num_streams: int,
        tasks: list[str] | None = None,
        prefetch: int = 4,
        grad_accum_steps: int = 1,
    ) -> None:
        """Plan the streams of this rank; the worker starts on the first `next()`.

        Args:
            shards_dir: The shard directory.
            meta: Its dataset description.
            split: Split name.
            rank: This rank, in [0, world_size).
            world_size: Number of ranks.
            batch_size: Rows per batch of this rank (the micro batch).
            num_streams: Streams the split is read as (`train.num_data_streams()`).
            tasks: Label columns (`train.tasks`); None for the primary label only.
            prefetch: Batches decoded ahead (`train.prefetch_batches`).
            grad_accum_steps: Batches per optimizer step (`train.grad_accum_steps`): an
                epoch is whole optimizer steps, so its rows (stream rows // the rows a
                step takes from a stream) do not depend on how a step is split into
                ranks and micro batches, and a resume on another split sees the same
                rows.

        Raises:
            ConfigError: num_streams is not a multiple of world_size, batch_size * world_size
                is not a multiple of num_streams, a task is not a label, or the split is
                too small for one step.
            InputNotFoundError: A file this rank reads is missing.
            SchemaError: dataset.json has no such split.
            ValueError: rank or world_size is out of range.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, {world_size=}")
        if num_streams < 1 or num_streams % world_size:
            raise ConfigError(
                f"train.data_streams={num_streams} must be a positive multiple of "
                f"train.world_size={world_size}; every rank reads the same number of streams"
            )
        if batch_size < 1 or batch_size * world_size % num_streams:
            raise ConfigError(
                f"train.data_streams={num_streams} must divide the rows of one step over all "
                f"ranks (train.batch_size * world_size = {batch_size} * {world_size}); "
                "change train.batch_size or train.data_streams"
            )
        if prefetch < 1:
            raise ConfigError(f"train.prefetch_batches must be >= 1, got {prefetch}")
        split_meta = meta.split(split)
        labels = meta.task_labels(tasks)
        self.rows_per_stream = batch_size * world_size // num_streams
        per_epoch = steps_per_epoch(meta, split, num_streams, self.rows_per_stream)
        self.steps_per_epoch = per_epoch // grad_accum_steps * grad_accum_steps
        if self.steps_per_epoch == 0:
            smallest = min(_stream_rows(split_meta, num_streams))
            raise ConfigError(
                f"split {split!r} is too small for batch_size * world_size = "
                f"{batch_size * world_size} rows per step: its smallest of {num_streams} "
                f"streams has {smallest} rows, fewer than the "
                f"{self.rows_per_stream * grad_accum_steps} each stream gives per optimizer "
                "step; lower train.batch_size or grad_accum_steps (or train.world_size)"
            )
        self.streams = list(range(rank, num_streams, world_size))
        slices = [stream_slices(split_meta, stream, num_streams) for stream in self.streams]
        for relative in dict.fromkeys(path for per_stream in slices for path, _, _ in per_stream):
            if not (Path(shards_dir) / relative).is_file():
                raise InputNotFoundError(
                    f"{Path(shards_dir) / relative} is listed in {DATASET_FILE} but does not "
                    "exist; rebuild the shards"
                )
        self._plan = _Plan(
            shards_dir=Path(shards_dir),
            meta=meta,
            tasks=labels,
            columns=model_columns(meta, labels),
            slices=slices,
            rows_per_stream=self.rows_per_stream,
            steps_per_epoch=self.steps_per_epoch,
        )
        self._prefetch = prefetch
        self._name = f"ShardReader-{split}-rank{rank}"
        self._consumed = 0  # batches handed to the caller since epoch 0, step 0
        self._queue: queue.Queue[Batch | _Failure] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None
        self._failure: Exception | None = None
        self._closed = False

    def __iter__(self) -> Iterator[Batch]:
        """The reader itself: an endless iterator of batches."""
        return self

    def __next__(self) -> Batch:
        """The next batch of this rank.

        Returns:
            sparse (B, F) int64, dense (B, Dn) float32, labels (B, T) float32 and one
            (B, L_f) int64 tensor per multi-hot feature; B = batch_size.

        Raises:
            Exception: Whatever the worker raised (InputNotFoundError, SchemaError, ...),
                again on every later call.
            RuntimeError: The reader is closed.
        """
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")
        if self._failure is not None:
            raise self._failure
        thread = self._thread if self._thread is not None else self._start()
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                # The worker puts a batch or a _Failure before it exits; this only
                # guards against a thread killed without doing either.
                if not thread.is_alive() and self._queue.empty():
                    self._failure = RuntimeError(f"{self._name}'s worker thread died")
                    raise self._failure from None
        if isinstance(item, _Failure):
            self._failure = item.error
            self._stop_worker()
            raise item.error
        self._consumed += 1
        return item

    def position(self, held: int = 0) -> dict[str, int]:
        """Where the caller is: batches consumed so far, decoded-ahead ones not counted.

        Args:
            held: Batches the caller took but has not trained yet (a batch whose ids
                went out ahead of its step): they count as not consumed, so that a
                resume reads them again.

        Returns:
            {"epoch": e, "step": k}: k batches of epoch e consumed, 0 <= k < steps_per_epoch.
        """
        epoch, step = divmod(self._consumed - held, self.steps_per_epoch)
        return {"epoch": epoch, "step": step}

    def restore(self, position: dict[str, int]) -> None:
        """Continue from a `position()`: the next batch is the one that followed it.

        Stops the worker if it runs (dropping the batches it decoded ahead); the next
        `next()` starts a new one at the position.

        Args:
            position: {"epoch": e, "step": k} as returned by `position()`.

        Raises:
            ConfigError: The step is beyond this split's steps_per_epoch (the position
                was saved for another dataset, batch size or stream count).
            ValueError: The position is not of the form {"epoch": int >= 0, "step": int >= 0}.
            RuntimeError: The reader is closed.
        """
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")
        epoch, step = position.get("epoch"), position.get("step")
        if not (isinstance(epoch, int) and isinstance(step, int) and epoch >= 0 and step >= 0):
            raise ValueError(
                f"position must be {{'epoch': int >= 0, 'step': int >= 0}}, got {position}"
            )
        if step >= self.steps_per_epoch:
            raise ConfigError(
                f"reader position step {step} is beyond the {self.steps_per_epoch} steps per "
                "epoch of this split; the position was saved with another dataset, "
                "train.batch_size, train.world_size or train.data_streams"
            )
        self._stop_worker()
        self._failure = None
        self._consumed = epoch * self.steps_per_epoch + step

    def close(self) -> None:
        """Stop the worker thread and drop the batches decoded ahead; idempotent."""
        self._stop_worker()
        self._closed = True

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> threading.Thread:
        self._queue = queue.Queue(maxsize=self._prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(self._plan, self._consumed, self._queue, self._stop),
            name=self._name,
            daemon=True,
        )
        # A reader dropped without close() still stops its thread (which holds no
        # reference to the reader, so the reader can be collected).
        self._finalizer = weakref.finalize(self, self._stop.set)
        self._thread.start()
        return self._thread

    def _stop_worker(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        while not self._queue.empty():
            self._queue.get_nowait()


def measure_throughput(reader: ShardReader, num_batches: int) -> float:
    """Rows per second the reader delivers to a consumer that does nothing else.

    One batch is consumed first, untimed, to start the worker and open the files;
    then `num_batches` batches are timed. Compare with the trainer's rows per second
    to see whether input is the bottleneck.

    Args:
        reader: The reader; it is advanced by num_batches + 1 batches.
        num_batches: Batches to time.

    Returns:
        Rows per second.

    Raises:
        ValueError: num_batches is below 1.
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    next(reader)
    rows = 0
    start = time.perf_counter()
    for _ in range(num_batches):
        rows += next(reader).labels.shape[0]
    return rows / (time.perf_counter() - start)
