"""Preprocess: clean events -> split, fitted transform, transformed tables.

Reads ingest's ``events/*.parquet`` (in name order; that order, then row order, is the
*input order* below) and writes

- ``transform.json``: the fitted transform (see ``data_prep.transform``), fitted on
  train rows only, with the split and the label-leak figures;
- ``train/``, ``valid/``, ``test/``: transformed Parquet tables, one
  ``part-NNNNN.parquet`` per input file that has rows of that split.

Splits (``preprocess.split``):

- ``time``: global event time, train < valid < test. The boundaries are the exact
  event-count quantiles of time, found by histogram refinement (a fixed number of bins
  per pass, a few passes over the timestamp column) instead of sorting every timestamp.
  Rows at a boundary go to the later split.
- ``leave_last_out``: per user (``schema.user_key``): the user's last event goes to
  test, the second to last to valid, the rest to train; users with fewer than 3 events
  stay in train, as do rows without a user. Events are ordered by timestamp, ties by
  input order (the later row is the later event).

Leakage guards, enforced on the rows as written: for ``time``, every train timestamp is
below every valid/test timestamp and every valid timestamp below every test timestamp;
for ``leave_last_out``, per user, no valid or test event is earlier than a train event
and no test event earlier than a valid event. A feature whose single-feature train AUC
exceeds ``leakage_max_auc`` for some label fails the stage unless it is listed in
``leakage_allow``.

Passes over the events: the split plan (timestamps, or users and timestamps), one fused
counting pass for every vocabulary and dense statistic (partial statistics per file,
merged), one transform pass per file. Memory is bounded by ``batch_rows``, the
vocabularies and, for ``leave_last_out``, a few integers per user; it does not grow with
the number of events.

Input and output may be fsspec URLs (``artifacts.locations``): the per-file steps then
read and write through fsspec wherever they run, with the same bytes. Only the sequence
builder's sort spills to a local temporary directory of the process that calls
``preprocess_events``.
"""

import math
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_validator

from artifacts.errors import ConfigError, DataError, InputNotFoundError
from artifacts.locations import (
    Location,
    as_location,
    close_output,
    is_remote,
    join,
    list_files,
    open_output,
    open_parquet,
    read_bytes,
    write_bytes,
)
from data_prep.idmap import extend_transform, start_chain
from data_prep.schema import SchemaConfig
from data_prep.sequences import build_sequences
from data_prep.transform import (
    FitStats,
    TransformApplier,
    collect_stats,
    dictionary_columns,
    empty_stats,
    fit_transform,
    label_leaks,
    merge_stats,
    save_transform,
)

SPLITS = ("train", "valid", "test")
T = TypeVar("T")
# Runs a per-file step over file indices, yielding results in file order.
FileMapper = Callable[[Callable[[int], T], range], Iterator[T]]
TRAIN, VALID, TEST = 0, 1, 2
# Bins per refinement pass of the time split: 2**16 bins narrow a range of 2**32
# seconds (136 years) to single seconds in two passes.
SPLIT_HISTOGRAM_BINS = 1 << 16
# Per-user state is compacted once its pending rows exceed max(this, reduced size).
_MIN_COMPACT_ROWS = 1 << 16


class PreprocessConfig(BaseModel):
    """How to split and transform clean events."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    split: Literal["time", "leave_last_out"] = Field(
        default="time",
        description="time: global time split by event-count quantiles. leave_last_out: each "
        "user's last event is test, the second to last valid (needs schema.user_key).",
    )
    valid_fraction: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="Share of events (by time) in the valid split; time split only.",
    )
    test_fraction: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="Share of events (latest in time) in the test split; time split only.",
    )
    min_count: int = Field(
        default=2,
        ge=1,
        description="Sparse ids seen fewer times in train map to the out-of-vocabulary index 0 "
        "(fields may override it).",
    )
    leakage_max_auc: float = Field(
        default=0.999,
        gt=0.5,
        le=1.0,
        description="A feature whose single-feature train AUC for a label exceeds this fails "
        "the stage as a probable label leak.",
    )
    leakage_allow: list[str] = Field(
        default=[],
        description="Features exempt from the label-leak check (known to be legitimate).",
    )
    batch_rows: int = Field(
        default=200_000, ge=1, description="Rows read and transformed per batch."
    )
    sequence_length: int | None = Field(
        default=None,
        ge=1,
        description="When set, also write per-user behaviour sequences of at most this many "
        "items under sequences/ (needs schema.user_key and schema.item_key as sparse fields).",
    )
    sequence_windows: Literal["last", "all"] = Field(
        default="last",
        description="Train sequences per user: 'last', its newest sequence_length + 1 items "
        "(the SASRec paper's); 'all', as many windows of sequence_length + 1 items as cover "
        "every train item, so that long histories train on their older items too.",
    )
    sequence_item_features: list[str] = Field(
        default=[],
        description="Single-valued sparse fields that describe the item (e.g. category): "
        "each item's most frequent train value is written to sequences/item_features.parquet "
        "for the sequence models' side features. Needs sequence_length.",
    )

    ttl: int | None = Field(
        default=None,
        ge=1,
        description="Incremental runs (train.init): an id not seen for this many partitions "
        "is evicted, its row freed for a new id (data_prep.idmap). None keeps every id.",
    )

    @model_validator(mode="after")
    def _train_remains(self) -> "PreprocessConfig":
        if self.valid_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                "valid_fraction + test_fraction must be below 1 so that a train split remains"
            )
        return self


@dataclass(frozen=True)
class PreprocessResult:
    """What preprocess wrote.

    ``valid_start_ts``/``test_start_ts`` are the time split's boundaries (None for
    leave_last_out); ``leakage`` is the highest single-feature train AUC per feature.
    ``partitions`` (a chain's transform only) lists every partition the transform has
    seen, and ``vocabulary`` what this partition did to each vocabulary (its history
    record: added, reused, evicted, live, num_embeddings).
    """

    out_dir: Location
    rows: dict[str, int]
    vocab_sizes: dict[str, int]
    valid_start_ts: int | None
    test_start_ts: int | None
    split: str = "time"
    leakage: dict[str, float] | None = None
    sequences: dict[str, int] | None = None
    partitions: list[str] | None = None
    vocabulary: dict[str, dict] | None = None
    files: list[str] = field(default_factory=list)


def preprocess_events(
    config: PreprocessConfig,
    schema: SchemaConfig,
    events_dir: Location,
    out_dir: Location,
    on_progress: Callable[[int], None] | None = None,
    map_files: FileMapper | None = None,
    partition: str | None = None,
    parent: dict | None = None,
    files: list[Location] | None = None,
) -> PreprocessResult:
    """Split events, fit the transform on train (or extend `parent`'s), transform every split.

    Args:
        config: the preprocess section.
        schema: roles and transforms of the columns.
        events_dir: ingest's ``events`` directory (a path, or a URL read through fsspec).
        files: the event files to read, in order: those ingest's signed manifest lists
            (the task layer passes them; a file planted beside them is never read).
            None: the ``*.parquet`` files directly in `events_dir`, for a directory only
            this process writes (tests, benchmarks).
        out_dir: an empty directory to write into (the caller publishes it), or a URL:
            then every file is written through fsspec, by whoever runs the step.
        on_progress: called with the number of rows transformed so far (per file).
        map_files: runs the per-file counting and transform steps, ``map_files(fn,
            range(files))`` yielding results in file order; the default uses one thread
            per core. The task layer passes one that maps through the Prefect task
            runner (threads or Dask), so ``fn`` must stay picklable.
        partition: The partition the events are (``ingest.partition``): the transform
            records it, as the first link of a chain (`data_prep.idmap.start_chain`) or
            the next one.
        parent: The transform of the model this run warm-starts from: extended with
            this partition's train rows (`data_prep.idmap.extend_transform`, expiring ids
            after ``config.ttl`` partitions) instead of fitted afresh, so known ids keep
            their rows. Needs ``partition``.

    Returns:
        Row counts per split, vocabulary sizes, the split and the leak figures, and
        every file written (relative to `out_dir`), for the publisher.

    Raises:
        InputNotFoundError: no event files.
        ConfigError: the split needs a ``schema.user_key``, or ``leakage_allow`` names a
            field that is not a feature.
        DataError: a split would be empty, a feature leaks the label, or the written
            split leaks future events.
    """
    _check_config(config, schema)
    events = _Events.find(as_location(events_dir), config.batch_rows, schema, files)
    workers = pa.cpu_count()
    if map_files is None:
        map_files = partial(ordered_map, workers=workers)
    if config.split == "time":
        plan: _TimePlan | _UserPlan = _plan_time_split(events, schema, config)
    else:
        plan = _plan_leave_last_out(events, schema, workers)

    # One fused counting pass: every vocabulary and dense statistic at once, on train rows,
    # one partial per file, merged in file order (so the result does not depend on workers).
    stats = empty_stats(schema)
    count_file = partial(_count_file, events, plan=plan, schema=schema)
    for part in map_files(count_file, range(len(events.files))):
        merge_stats(stats, part)
    transform = fit_transform(stats, schema, config.min_count)
    if parent is not None:
        if partition is None:
            raise ConfigError(
                "an incremental run extends its parent's transform with one partition: "
                "set ingest.partition (e.g. dt=2026-12-05)"
            )
        leakage = transform["leakage"]  # today's rows: the leak check is about this day
        transform = extend_transform(parent, stats, schema, partition, config.ttl)
        transform["leakage"] = leakage
    elif partition is not None:
        transform = start_chain(transform, partition)
    transform["split"] = plan.describe()
    _check_label_leaks(transform, config)
    out_dir = as_location(out_dir)
    if isinstance(out_dir, Path):
        out_dir.mkdir(parents=True, exist_ok=True)
    save_transform(transform, join(out_dir, "transform.json"))

    applier = TransformApplier(transform)
    ts_name = schema.timestamp.name
    if isinstance(plan, _TimePlan):
        guard: _TimeGuard | _UserGuard = _TimeGuard(ts_name)
    else:
        guard = _UserGuard(schema.user_key, ts_name)
    transform_file = partial(
        _transform_file,
        events,
        plan=plan,
        applier=applier,
        guard=guard.empty,
        out_dir=out_dir,
    )
    rows = dict.fromkeys(SPLITS, 0)
    written = ["transform.json"]
    transformed = map_files(transform_file, range(len(events.files)))
    for index, (file_rows, file_guard) in enumerate(transformed):
        guard.merge(file_guard)
        for split in SPLITS:
            rows[split] += file_rows[split]
            if file_rows[split]:
                # _PartWriter creates a part file on its first non-empty table only.
                written.append(part_name(split, index))
        if on_progress is not None:
            on_progress(sum(rows.values()))
    guard.check()
    empty = [s for s in SPLITS if rows[s] == 0]
    if empty:
        raise DataError(f"split(s) {empty} are empty after transforming ({rows}).")
    sequences = None
    if config.sequence_length is not None and is_remote(out_dir):
        sequences, built = _build_sequences_remote(config, schema, transform, out_dir, written)
        written += built
    elif config.sequence_length is not None:
        built = build_sequences(
            {split: out_dir / split for split in SPLITS},
            schema.user_key,
            schema.item_key,
            ts_name,
            config.sequence_length,
            out_dir / "sequences",
            num_items=transform["sparse"][schema.item_key]["num_embeddings"],
            item_features={
                name: transform["sparse"][name]["num_embeddings"]
                for name in config.sequence_item_features
            },
            windows=config.sequence_windows,
        )
        sequences = built.rows
        # The staging directory is this process's own (0700): what build_sequences wrote.
        found = (out_dir / "sequences").rglob("*")
        written += sorted(p.relative_to(out_dir).as_posix() for p in found if p.is_file())
    time_plan = plan if isinstance(plan, _TimePlan) else None
    return PreprocessResult(
        out_dir=out_dir,
        rows=rows,
        vocab_sizes={n: v["num_embeddings"] for n, v in transform["sparse"].items()},
        partitions=transform.get("partitions"),
        vocabulary=transform["history"][-1]["features"] if "history" in transform else None,
        valid_start_ts=time_plan.valid_start if time_plan else None,
        test_start_ts=time_plan.test_start if time_plan else None,
        split=config.split,
        sequences=sequences,
        leakage={
            name: max(per_label.values(), default=0.5)
            for name, per_label in transform["leakage"]["single_feature_train_auc"].items()
        },
        files=written,
    )


def part_name(split: str, index: int) -> str:
    """``train/part-00003.parquet``: the transformed rows of event file `index` in `split`."""
    return f"{split}/part-{index:05d}.parquet"


def _build_sequences_remote(
    config: PreprocessConfig,
    schema: SchemaConfig,
    transform: dict,
    out_url: str,
    written: list[str],
) -> tuple[dict[str, int], list[str]]:
    """``build_sequences`` for an output URL: its sort spills to a local scratch directory.

    The sequence builder sorts every split by user with local spill files, so the
    transformed splits (the part files this run wrote, `written`: never a listing of the
    bucket, where someone else may have put a file) are copied into a temporary directory
    of the machine that runs preprocess, the sequences built there and uploaded under
    ``<out_url>/sequences``.

    Returns:
        Rows per sequence output, and the files uploaded (relative to `out_url`).
    """
    uploaded = []
    with tempfile.TemporaryDirectory(prefix="recforge-sequences-") as scratch:
        local = Path(scratch)
        for split in SPLITS:
            (local / split).mkdir(parents=True, exist_ok=True)
        for rel in written:
            if rel.endswith(".parquet") and rel.split("/", 1)[0] in SPLITS:
                write_bytes(local / rel, read_bytes(join(out_url, rel)))
        built = build_sequences(
            {split: local / split for split in SPLITS},
            schema.user_key,
            schema.item_key,
            schema.timestamp.name,
            config.sequence_length,
            local / "sequences",
            num_items=transform["sparse"][schema.item_key]["num_embeddings"],
            item_features={
                name: transform["sparse"][name]["num_embeddings"]
                for name in config.sequence_item_features
            },
            windows=config.sequence_windows,
        )
        for path in sorted(p for p in (local / "sequences").rglob("*") if p.is_file()):
            rel = path.relative_to(local).as_posix()
            write_bytes(join(out_url, rel), path.read_bytes())
            uploaded.append(rel)
    return built.rows, uploaded


def _check_label_leaks(transform: dict, config: PreprocessConfig) -> None:
    leaks = label_leaks(transform, config.leakage_max_auc, config.leakage_allow)
    if leaks:
        raise DataError(
            f"feature(s) {', '.join(leaks)} predict the label almost perfectly on train "
            f"(single-feature AUC > preprocess.leakage_max_auc={config.leakage_max_auc}): a "
            "probable label leak. Remove them from the schema, or list them in "
            "preprocess.leakage_allow if they are legitimate."
        )


def _check_config(config: PreprocessConfig, schema: SchemaConfig) -> None:
    features = {f.name for f in schema.fields if f.role in ("sparse", "dense")}
    unknown = sorted(set(config.leakage_allow) - features)
    if unknown:
        raise ConfigError(
            f"preprocess.leakage_allow names {unknown}, which are not sparse or dense fields "
            f"({sorted(features)}); fix the names or remove them."
        )
    if config.sequence_length is not None:
        for key in ("user_key", "item_key"):
            name = getattr(schema, key)
            spec = next((f for f in schema.fields if f.name == name), None)
            if spec is None or spec.role != "sparse" or spec.multi_hot:
                raise ConfigError(
                    f"preprocess.sequence_length needs schema.{key} naming a single-valued "
                    f"sparse field (got {name!r}); set it, or drop sequence_length."
                )
    if config.sequence_item_features and config.sequence_length is None:
        raise ConfigError(
            "preprocess.sequence_item_features needs preprocess.sequence_length; set it, or "
            "drop sequence_item_features."
        )
    if config.sequence_windows != "last" and config.sequence_length is None:
        raise ConfigError(
            f"preprocess.sequence_windows={config.sequence_windows!r} needs "
            "preprocess.sequence_length; set it, or drop sequence_windows."
        )
    for name in config.sequence_item_features:
        spec = next((f for f in schema.fields if f.name == name), None)
        keys = (schema.user_key, schema.item_key)
        if spec is None or spec.role != "sparse" or spec.multi_hot or name in keys:
            raise ConfigError(
                f"preprocess.sequence_item_features: {name!r} is not a single-valued sparse "
                "field other than the user and item keys; name fields of the schema that "
                "describe the item, e.g. its category."
            )
    if config.split == "leave_last_out":
        if schema.user_key is None:
            raise ConfigError(
                "preprocess.split=leave_last_out needs schema.user_key (the field that "
                "identifies the user); set it, or use split: time."
            )
        user = next(f for f in schema.fields if f.name == schema.user_key)
        if user.multi_hot:
            raise ConfigError(
                f"schema.user_key '{user.name}' is multi_hot; a user key must be single-valued."
            )


# ------------------------------------------------------------------------------ input


@dataclass(frozen=True)
class _Events:
    """The event files with their row counts and the input-order offset of each."""

    files: list[Location]
    offsets: list[int]
    total: int
    batch_rows: int
    dictionaries: tuple[str, ...] = ()

    @classmethod
    def find(
        cls,
        events_dir: Location,
        batch_rows: int,
        schema: SchemaConfig,
        listed: list[Location] | None = None,
    ) -> "_Events":
        files = list(listed) if listed is not None else list_files(events_dir, ".parquet")
        if not files:
            raise InputNotFoundError(f"no event files under '{events_dir}'; run ingest first.")
        counts = [open_parquet(p).metadata.num_rows for p in files]
        offsets = [0, *np.cumsum(counts).tolist()]
        if offsets[-1] == 0:
            raise DataError("no clean events to split; check ingest's quarantine report.")
        # String ids come back as the files' dictionaries: counting and lookups then work
        # on the distinct values instead of hashing every row again. Not the user key: the
        # per-user state concatenates batches, whose dictionaries differ.
        strings = tuple(
            f.name
            for f in schema.by_role("sparse")
            if f.dtype == "string" and not f.multi_hot and f.name != schema.user_key
        )
        return cls(files, offsets[:-1], offsets[-1], batch_rows, strings)

    def batches(
        self, index: int, columns: list[str] | None = None, dictionaries: bool = False
    ) -> Iterator[tuple[pa.RecordBatch, int]]:
        """(batch, input-order row number of its first row) over one file.

        With ``dictionaries`` the string sparse columns are dictionary arrays.
        """
        offset = self.offsets[index]
        parquet = open_parquet(
            self.files[index], read_dictionary=self.dictionaries if dictionaries else None
        )
        for batch in parquet.iter_batches(batch_size=self.batch_rows, columns=columns):
            yield batch, offset
            offset += batch.num_rows

    def column(self, name: str) -> Iterator[np.ndarray]:
        """One non-null int64 column, batch by batch, over every file."""
        for index in range(len(self.files)):
            for batch, _ in self.batches(index, [name]):
                yield batch.column(0).drop_null().to_numpy()


# ------------------------------------------------------------------------- time split


@dataclass(frozen=True)
class _TimePlan:
    ts_name: str
    valid_start: int
    test_start: int

    def describe(self) -> dict:
        return {
            "method": "time",
            "valid_start_ts": self.valid_start,
            "test_start_ts": self.test_start,
        }


@dataclass(frozen=True)
class OrderStatistics:
    """Exact order statistics of an integer column and what computing them took.

    Attributes:
        values: the k-th smallest value (0-based) per requested k.
        below: how many values are strictly smaller than each.
        passes: histogram passes over the column.
        bins: bins per histogram (fixed: the memory does not depend on the rows).
    """

    values: list[int]
    below: list[int]
    passes: int
    bins: int


def order_statistics(
    chunks: Callable[[], Iterator[np.ndarray]],
    low: int,
    high: int,
    ks: list[int],
    bins: int = SPLIT_HISTOGRAM_BINS,
) -> OrderStatistics:
    """The k-th smallest values of an integer column by histogram refinement.

    Each pass counts the values inside the current range of every k into ``bins``
    equal-width bins, then narrows the range to the bin holding the k-th value, until
    the range is a single value. Memory is ``bins`` counters per k; a range of R values
    needs ceil(log_bins(R)) passes.

    Args:
        chunks: returns a fresh iterator over the column's values in chunks.
        low: a lower bound of every value.
        high: an upper bound of every value.
        ks: 0-based ranks, each below the number of values.
        bins: bins per pass.

    Returns:
        The values, the counts below them, and the number of passes.
    """
    state = [[low, high, 0] for _ in ks]  # range [lo, hi] holds the k-th value; below = #(< lo)
    passes = 0
    while any(lo < hi for lo, hi, _ in state):
        active = [i for i, (lo, hi, _) in enumerate(state) if lo < hi]
        width = {i: -(-(state[i][1] - state[i][0] + 1) // bins) for i in active}
        # Ranks whose ranges coincide (all of them in the first pass) share one histogram.
        ranges = sorted({(state[i][0], state[i][1]) for i in active})
        counted = {r: np.zeros(bins, np.int64) for r in ranges}
        for x in chunks():
            for lo, hi in ranges:
                # The first pass's range holds every value: nothing to select.
                inside = x if lo <= low and hi >= high else x[(x >= lo) & (x <= hi)]
                step = -(-(hi - lo + 1) // bins)
                counted[(lo, hi)] += np.bincount((inside - lo) // step, minlength=bins)
        hist = {i: counted[(state[i][0], state[i][1])] for i in active}
        passes += 1
        for i in active:
            lo, hi, below = state[i]
            cumulative = below + np.cumsum(hist[i])
            j = int(np.searchsorted(cumulative, ks[i], side="right"))  # first bin with cum > k
            new_lo = lo + j * width[i]
            state[i] = [new_lo, min(hi, new_lo + width[i] - 1), below + int(hist[i][:j].sum())]
    return OrderStatistics([s[0] for s in state], [s[2] for s in state], passes, bins)


def _plan_time_split(events: _Events, schema: SchemaConfig, config: PreprocessConfig) -> _TimePlan:
    """Event-count quantiles of time: the first timestamps of valid and test."""
    ts_name = schema.timestamp.name
    n = events.total
    k_valid = min(n - 1, int(n * (1 - config.valid_fraction - config.test_fraction)))
    k_test = min(n - 1, int(n * (1 - config.test_fraction)))
    low, high = _column_range(events, ts_name)
    stats = order_statistics(lambda: events.column(ts_name), low, high, [k_valid, k_test])
    valid_start, test_start = stats.values
    # Rows at a boundary go to the later split, so ties can empty a split.
    rows = {
        "train": stats.below[0],
        "valid": stats.below[1] - stats.below[0],
        "test": n - stats.below[1],
    }
    empty = [s for s in SPLITS if rows[s] == 0]
    if empty:
        raise DataError(
            f"split(s) {empty} would be empty ({rows}): the events span too few distinct "
            "timestamps for preprocess.valid_fraction/test_fraction. Provide more data or "
            "change the fractions."
        )
    return _TimePlan(ts_name, valid_start, test_start)


def _column_range(events: _Events, name: str) -> tuple[int, int]:
    """(min, max) of an int64 column from the Parquet statistics, or a scan without them."""
    low, high = math.inf, -math.inf
    for path in events.files:
        metadata = open_parquet(path).metadata
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            if row_group.num_rows == 0:
                continue
            chunk = next(
                row_group.column(c)
                for c in range(row_group.num_columns)
                if row_group.column(c).path_in_schema == name
            )
            stats = chunk.statistics
            if stats is None or not stats.has_min_max:
                return _scan_range(events, name)
            low, high = min(low, stats.min), max(high, stats.max)
    if low > high:
        return _scan_range(events, name)
    return int(low), int(high)


def _scan_range(events: _Events, name: str) -> tuple[int, int]:
    low, high = math.inf, -math.inf
    for x in events.column(name):
        if len(x):
            low, high = min(low, int(x.min())), max(high, int(x.max()))
    if low > high:
        raise DataError(f"the timestamp column '{name}' holds no values.")
    return int(low), int(high)


# ------------------------------------------------------------------ leave-last-out split


@dataclass(frozen=True)
class _UserPlan:
    """Input-order row numbers of the valid and test events (sorted)."""

    valid_rows: np.ndarray
    test_rows: np.ndarray
    users: int
    users_split: int

    def describe(self) -> dict:
        return {
            "method": "leave_last_out",
            "users": self.users,
            "users_with_valid_and_test": self.users_split,
            "order": "timestamp, then input order",
        }


def _plan_leave_last_out(events: _Events, schema: SchemaConfig, workers: int) -> _UserPlan:
    """Find every user's last two events in one pass, keeping two candidates per user."""
    user, ts_name = schema.user_key, schema.timestamp.name

    def last_events(index: int) -> _LastEvents:
        state = _LastEvents()
        for batch, offset in events.batches(index, [user, ts_name]):
            state.add(_candidates(batch.column(0), batch.column(1), offset))
        return state

    state = _LastEvents()
    for part in ordered_map(last_events, range(len(events.files)), workers):
        state.merge(part)
    last = state.result()
    count, is_last = last.column("n").to_numpy(), last.column("last").to_numpy()
    rows = last.column("row").to_numpy()
    split_users = np.flatnonzero(is_last & (count >= 3))
    test_rows = np.sort(rows[split_users])
    valid_rows = np.sort(rows[split_users - 1])  # sorted by (user, ts, row): previous event
    if len(split_users) == 0:
        raise DataError(
            "leave_last_out leaves valid and test empty: no user has 3 or more events. "
            "Use split: time, or provide longer user histories."
        )
    return _UserPlan(valid_rows, test_rows, int(is_last.sum()), len(split_users))


def _candidates(users: pa.Array, ts: pa.Array, offset: int) -> pa.Table:
    keep = pc.is_valid(users)
    rows = np.arange(offset, offset + len(users), dtype=np.int64)
    table = pa.table({"u": users, "ts": ts, "row": rows, "n": np.ones(len(users), np.int64)})
    return table.filter(keep) if users.null_count else table


class _LastEvents:
    """Per user, the last two events (by timestamp, then input order) and the event count.

    Rows (u, ts, row, n, last), sorted by (u, ts, row), at most two per user; the user's
    count sits on the last row, 0 on the other. Compacted like the vocabulary counts.
    """

    def __init__(self) -> None:
        self._parts: list[pa.Table] = []
        self._pending = 0
        self._reduced = 0

    def add(self, candidates: pa.Table) -> None:
        self._add(_last_two(candidates))

    def merge(self, other: "_LastEvents") -> None:
        for part in other._parts:
            self._add(part)

    def _add(self, part: pa.Table) -> None:
        self._parts.append(part)
        self._pending += part.num_rows
        if self._pending > max(_MIN_COMPACT_ROWS, self._reduced):
            self._compact()

    def result(self) -> pa.Table:
        if not self._parts:
            return _last_two(_candidates(pa.array([], pa.int64()), pa.array([], pa.int64()), 0))
        self._compact()
        return self._parts[0]

    def _compact(self) -> None:
        self._parts = [_last_two(pa.concat_tables(self._parts))]
        self._reduced = self._parts[0].num_rows
        self._pending = 0


def _last_two(table: pa.Table) -> pa.Table:
    """Reduce candidate events (u, ts, row, n) to the last two per user, with counts."""
    table = table.select(["u", "ts", "row", "n"])
    order = pc.sort_indices(table, [("u", "ascending"), ("ts", "ascending"), ("row", "ascending")])
    table = table.take(order)
    k = table.num_rows
    if k == 0:
        return table.append_column("last", pa.array([], pa.bool_()))
    users = table.column("u").combine_chunks()
    is_last = np.ones(k, bool)
    is_last[:-1] = pc.not_equal(users.slice(1), users.slice(0, k - 1)).to_numpy(
        zero_copy_only=False
    )
    ends = np.flatnonzero(is_last)
    starts = np.concatenate([[0], ends[:-1] + 1])
    counts = np.add.reduceat(table.column("n").to_numpy(), starts)
    previous = ends[ends > starts] - 1
    keep = np.sort(np.concatenate([ends, previous]))
    n = np.zeros(k, np.int64)
    n[ends] = counts
    table = table.set_column(3, "n", pa.array(n)).append_column("last", pa.array(is_last))
    return table.take(keep)


# ----------------------------------------------------------------- split assignment


def _assign_splits(plan: "_TimePlan | _UserPlan", batch: pa.RecordBatch, offset: int) -> np.ndarray:
    """(N,) int8 split code (TRAIN, VALID, TEST) of each row of a batch.

    Args:
        plan: the split plan.
        batch: events with (at least) the timestamp column.
        offset: input-order row number of the batch's first row.
    """
    if isinstance(plan, _TimePlan):
        ts = batch.column(plan.ts_name).to_numpy()
        return (ts >= plan.valid_start).astype(np.int8) + (ts >= plan.test_start)
    codes = np.zeros(batch.num_rows, np.int8)
    end = offset + batch.num_rows
    for code, rows in ((VALID, plan.valid_rows), (TEST, plan.test_rows)):
        inside = rows[np.searchsorted(rows, offset) : np.searchsorted(rows, end)]
        codes[inside - offset] = code
    return codes


def _count_file(
    events: _Events, index: int, plan: "_TimePlan | _UserPlan", schema: SchemaConfig
) -> FitStats:
    """Partial fit statistics of one file's train rows (mergeable with merge_stats)."""
    columns = [f.name for f in schema.fields if f.role in ("sparse", "dense", "label")]
    if isinstance(plan, _TimePlan):
        columns.append(plan.ts_name)
    stats = empty_stats(schema)
    for batch, offset in events.batches(index, columns, dictionaries=True):
        codes = _assign_splits(plan, batch, offset)
        train = batch if not codes.any() else batch.filter(pa.array(codes == TRAIN))
        merge_stats(stats, collect_stats(schema, train))
    return stats


def _transform_file(
    events: _Events,
    index: int,
    plan: "_TimePlan | _UserPlan",
    applier: TransformApplier,
    guard: Callable[[], "_TimeGuard | _UserGuard"],
    out_dir: Location,
) -> tuple[dict[str, int], "_TimeGuard | _UserGuard"]:
    """Transform one file into ``<split>/part-<index>.parquet``; rows per split and its guard."""
    dictionary = dictionary_columns(applier.transform)
    # Statistics only where readers use them: the timestamp's min/max.
    statistics = [applier.transform["timestamp"]]
    writers = [
        _PartWriter(join(out_dir, part_name(split, index)), dictionary, statistics)
        for split in SPLITS
    ]
    checked = guard()
    try:
        for batch, offset in events.batches(index, dictionaries=True):
            codes = _assign_splits(plan, batch, offset)
            checked.update(batch, codes)
            table = applier(batch)
            for code, writer in enumerate(writers):
                mask = codes == code
                if mask.all():
                    writer.write(table)
                elif mask.any():
                    writer.write(table.filter(mask))
    finally:
        for writer in writers:
            writer.close()
    return {split: w.rows for split, w in zip(SPLITS, writers, strict=True)}, checked


def ordered_map(fn: Callable[[int], T], items: range, workers: int) -> Iterator[T]:
    """``map(fn, items)`` on up to ``workers`` threads, results in item order.

    At most ``workers + 1`` items are in flight, so memory grows with the workers, not
    with the items. Callers merge the results in item order, so the output does not
    depend on the number of workers.
    """
    if workers <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future[T]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# ------------------------------------------------------------------- leakage guards


class _TimeGuard:
    """Global time order of the splits, on the rows as assigned and written."""

    def __init__(self, ts_name: str) -> None:
        self.ts_name = ts_name
        self.max_ts: list[int | None] = [None, None, None]
        self.min_ts: list[int | None] = [None, None, None]

    def empty(self) -> "_TimeGuard":
        return _TimeGuard(self.ts_name)

    def merge(self, other: "_TimeGuard") -> None:
        for code in (TRAIN, VALID, TEST):
            self._extend(code, other.min_ts[code], other.max_ts[code])

    def _extend(self, code: int, lo: int | None, hi: int | None) -> None:
        if lo is None or hi is None:
            return
        self.max_ts[code] = hi if self.max_ts[code] is None else max(self.max_ts[code], hi)
        self.min_ts[code] = lo if self.min_ts[code] is None else min(self.min_ts[code], lo)

    def update(self, batch: pa.RecordBatch, codes: np.ndarray) -> None:
        ts = batch.column(self.ts_name).to_numpy()
        for code in (TRAIN, VALID, TEST):
            part = ts[codes == code]
            if len(part):
                self._extend(code, int(part.min()), int(part.max()))

    def check(self) -> None:
        for early, late in ((TRAIN, VALID), (TRAIN, TEST), (VALID, TEST)):
            hi, lo = self.max_ts[early], self.min_ts[late]
            if hi is not None and lo is not None and hi >= lo:
                raise DataError(
                    f"time split leaks: the latest {SPLITS[early]} event ({hi}) is not before "
                    f"the earliest {SPLITS[late]} event ({lo}). This is a bug in the split; "
                    "report it with the preprocess config."
                )


class _UserGuard:
    """Per user: no valid/test event before a train event, no test event before a valid one."""

    def __init__(self, user: str, ts_name: str) -> None:
        self.user = user
        self.ts_name = ts_name
        self._parts: list[pa.Table] = []
        self._pending = 0
        self._reduced = 0

    def empty(self) -> "_UserGuard":
        return _UserGuard(self.user, self.ts_name)

    def merge(self, other: "_UserGuard") -> None:
        for part in other._parts:
            self._add(part)

    def update(self, batch: pa.RecordBatch, codes: np.ndarray) -> None:
        ts = batch.column(self.ts_name)
        null = pa.scalar(None, ts.type)

        def where(code: int) -> pa.Array:
            return pc.if_else(pa.array(codes == code), ts, null)

        valid = where(VALID)
        part = pa.table(
            {
                "u": batch.column(self.user),
                "train_max": where(TRAIN),
                "valid_min": valid,
                "valid_max": valid,
                "test_min": where(TEST),
            }
        )
        self._add(_user_bounds(part))

    def _add(self, bounds: pa.Table) -> None:
        self._parts.append(bounds)
        self._pending += bounds.num_rows
        if self._pending > max(_MIN_COMPACT_ROWS, self._reduced):
            self._compact()

    def _compact(self) -> None:
        self._parts = [_user_bounds(pa.concat_tables(self._parts))]
        self._reduced = self._parts[0].num_rows
        self._pending = 0

    def check(self) -> None:
        if not self._parts:
            return
        self._compact()
        bounds = self._parts[0]
        pairs = (("train_max", "valid_min"), ("train_max", "test_min"), ("valid_max", "test_min"))
        for early, late in pairs:
            bad = pc.fill_null(pc.less(bounds[late], bounds[early]), False)
            if pc.any(bad).as_py():
                first = bounds.filter(bad).sort_by("u").slice(0, 1).to_pylist()[0]
                raise DataError(
                    f"leave_last_out split leaks for user {first['u']!r}: a "
                    f"{late.split('_')[0]} event at {first[late]} is earlier than a "
                    f"{early.split('_')[0]} event at {first[early]}. This is a bug in the "
                    "split; report it with the preprocess config."
                )


def _user_bounds(table: pa.Table) -> pa.Table:
    """Reduce (u, train_max, valid_min, valid_max, test_min) to one row per user."""
    aggregated = table.group_by("u", use_threads=False).aggregate(
        [("train_max", "max"), ("valid_min", "min"), ("valid_max", "max"), ("test_min", "min")]
    )
    return aggregated.rename_columns(
        {
            "train_max_max": "train_max",
            "valid_min_min": "valid_min",
            "valid_max_max": "valid_max",
            "test_min_min": "test_min",
        }
    )


# ------------------------------------------------------------------------------ output


class _PartWriter:
    """Writes one Parquet file, created on the first non-empty table."""

    def __init__(self, path: Location, dictionary: list[str], statistics: list[str]) -> None:
        self.path = path
        self._sink = None
        self.dictionary = dictionary
        self.statistics = statistics
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self._sink = open_output(self.path)
            self._writer = pq.ParquetWriter(
                self._sink,
                table.schema,
                use_dictionary=self.dictionary,
                write_statistics=self.statistics,
            )
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            close_output(self._sink)
            self._sink = None
