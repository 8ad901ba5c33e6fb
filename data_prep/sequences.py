"""Per-user behaviour sequences for SASRec/BST-style models.

Reads the transformed ``train``/``valid``/``test`` tables (user and item already
mapped to indices) and writes, under ``out_dir``:

- ``train.parquet``: ``user``, ``history`` (the user's train items, oldest first,
  the last ``max_length + 1`` of them, so that next-item training has
  ``max_length`` inputs and targets; with ``windows="all"`` a user whose train
  items do not fit gets more rows: consecutive windows of ``max_length + 1``
  items that overlap by one, newest last, so that every train item but the
  user's first is a target exactly once per pass);
- ``valid.parquet`` / ``test.parquet``: one row per evaluation event with
  ``user``, ``history`` (the last ``max_length`` items the user interacted with
  *before* the event: train items for valid, train + valid items for test),
  ``target`` (the item), the event time and ``seen`` (every distinct item of the
  user up to and including this split, untruncated: the items a ranking protocol
  must not sample as negatives);
- ``train_item_counts.npy``: int64 interactions per item index in the train split
  (index 0 included), for the popularity baseline;
- ``item_features.parquet`` (when item features are named): one row per item index
  0..num_items-1 with each feature's most frequent train value for that item (ties
  to the smaller index; 0 for items never seen in train and for the padding item);
- ``sequences.json``: ``max_length``, ``num_items`` (the item vocabulary size, when
  given), ``item_features`` (name -> number of indices), ``users`` and rows per output.

Order within a user is by timestamp, ties broken by the row order of the
transformed tables, which preprocess writes deterministically. A training
sequence never holds an evaluation interaction: histories are built from the
earlier splits only, and ``build_sequences`` checks that each history's events
precede its target.

Memory is bounded: rows are spilled into partitions by user, and one partition
at a time is grouped.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from artifacts.errors import DataError

EVAL_SPLITS = ("valid", "test")
TRAIN_WINDOWS = ("last", "all")


@dataclass(frozen=True)
class SequenceResult:
    """What build_sequences wrote."""

    out_dir: Path
    users: int
    rows: dict[str, int]


def build_sequences(
    split_dirs: dict[str, Path],
    user: str,
    item: str,
    timestamp: str,
    max_length: int,
    out_dir: Path,
    partition_rows: int = 2_000_000,
    num_items: int | None = None,
    item_features: dict[str, int] | None = None,
    windows: str = "last",
) -> SequenceResult:
    """Write train sequences and evaluation (history, target) rows.

    Args:
        split_dirs: ``{"train": dir, "valid": dir, "test": dir}`` of transformed Parquet.
        user: the user index column.
        item: the item index column.
        timestamp: the event time column.
        max_length: the longest history kept.
        out_dir: where the three Parquet files go.
        partition_rows: rows per spill partition; bounds memory.
        num_items: the item vocabulary size (index 0 included), recorded in
            sequences.json and the length of train_item_counts.npy; None: max item + 1.
        item_features: item-describing index columns -> their number of indices, for
            item_features.parquet; needs num_items.
        windows: "last": one train row per user, its newest ``max_length + 1`` items
            (the SASRec paper's); "all": as many rows as cover every train item.

    Returns:
        Users with a train sequence and rows per output.

    Raises:
        DataError: an evaluation event is not later than the history it is given.
    """
    if windows not in TRAIN_WINDOWS:
        raise ValueError(f"windows={windows!r}: expected one of {TRAIN_WINDOWS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(_rows(split_dirs[s]) for s in ("train", *EVAL_SPLITS))
    partitions = max(1, -(-total // partition_rows))
    spill = out_dir / ".spill"
    counts = _spill_by_user(split_dirs, user, item, timestamp, partitions, spill)
    if num_items is not None:
        if counts.size > num_items:
            raise DataError(
                f"item index {counts.size - 1} in the train split is not below "
                f"num_items={num_items}; the item vocabulary and the tables disagree, "
                "rerun preprocess"
            )
        counts = np.pad(counts, (0, num_items - counts.size))
    np.save(out_dir / "train_item_counts.npy", counts)
    features = dict(item_features or {})
    if features:
        if num_items is None:
            raise ValueError("item_features need num_items")
        _write_item_features(split_dirs["train"], item, features, num_items, out_dir)

    writers: dict[str, pq.ParquetWriter] = {}
    rows = dict.fromkeys(("train", *EVAL_SPLITS), 0)
    users = 0
    try:
        for part in range(partitions):
            path = spill / f"{part}.parquet"
            if not path.exists():
                continue
            outputs = _sequences_of_partition(pq.read_table(path), max_length, windows)
            users += len(pc.unique(outputs["train"].column("user")))
            for name, table in outputs.items():
                if name not in writers:
                    writers[name] = pq.ParquetWriter(out_dir / f"{name}.parquet", table.schema)
                writers[name].write_table(table)
                rows[name] += table.num_rows
    finally:
        for writer in writers.values():
            writer.close()
    for path in spill.glob("*.parquet"):
        path.unlink()
    spill.rmdir()
    (out_dir / "sequences.json").write_text(
        json.dumps(
            {
                "max_length": max_length,
                "windows": windows,
                "num_items": num_items,
                "item_features": features,
                "users": users,
                "rows": rows,
            },
            indent=2,
        )
    )
    return SequenceResult(out_dir=out_dir, users=users, rows=rows)


def _write_item_features(
    train_dir: Path, item: str, features: dict[str, int], num_items: int, out_dir: Path
) -> None:
    """Each item's most frequent train value of every feature -> item_features.parquet.

    Counts live in one (item, value) -> count table per feature, the size of the
    distinct pairs (an item usually has one category), merged file by file.
    """
    pairs: dict[str, pa.Table] = {}
    for path in sorted(Path(train_dir).glob("*.parquet")):
        table = pq.read_table(path, columns=[item, *features])
        for name in features:
            counted = table.group_by([item, name]).aggregate([([], "count_all")])
            counted = counted.rename_columns(["item", "value", "count"])
            merged = counted if name not in pairs else pa.concat_tables([pairs[name], counted])
            pairs[name] = merged.group_by(["item", "value"]).aggregate([("count", "sum")])
            pairs[name] = pairs[name].rename_columns(["item", "value", "count"])
    columns = {"item": pa.array(np.arange(num_items, dtype=np.int64))}
    for name, size in features.items():
        index = np.zeros(num_items, dtype=np.int64)
        if name in pairs and pairs[name].num_rows:
            table = pairs[name]
            items = table.column("item").to_numpy().astype(np.int64)
            values = table.column("value").to_numpy().astype(np.int64)
            counts = table.column("count").to_numpy()
            # Sort by item, then count descending, then value: the first row per item wins.
            order = np.lexsort((values, -counts, items))
            items, values = items[order], values[order]
            first = np.r_[True, items[1:] != items[:-1]]
            index[items[first]] = values[first]
        if index.max(initial=0) >= size or (index < 0).any():
            raise DataError(f"item feature {name}: indices outside [0, {size}); rerun preprocess")
        index[0] = 0  # the padding item has no features
        columns[name] = pa.array(index)
    pq.write_table(pa.table(columns), out_dir / "item_features.parquet")


def _rows(directory: Path) -> int:
    return sum(
        pq.ParquetFile(p).metadata.num_rows for p in sorted(Path(directory).glob("*.parquet"))
    )


def _spill_by_user(
    split_dirs: dict[str, Path], user: str, item: str, ts: str, partitions: int, spill: Path
) -> np.ndarray:
    """Spill events into partitions by user; return the train split's item counts."""
    spill.mkdir()
    writers: dict[int, pq.ParquetWriter] = {}
    order = 0
    counts = np.zeros(0, dtype=np.int64)
    try:
        for split_code, split in enumerate(("train", *EVAL_SPLITS)):
            for path in sorted(Path(split_dirs[split]).glob("*.parquet")):
                for batch in pq.ParquetFile(path).iter_batches(columns=[user, item, ts]):
                    n = batch.num_rows
                    table = pa.table(
                        {
                            "user": batch.column(user).cast(pa.int64()),
                            "item": batch.column(item).cast(pa.int64()),
                            "ts": batch.column(ts).cast(pa.int64()),
                            "split": pa.array(np.full(n, split_code, np.int8)),
                            # Global row order breaks timestamp ties deterministically.
                            "order": pa.array(np.arange(order, order + n, dtype=np.int64)),
                        }
                    )
                    order += n
                    if split_code == 0 and n:
                        batch_counts = np.bincount(table.column("item").to_numpy())
                        if batch_counts.size > counts.size:
                            counts = np.pad(counts, (0, batch_counts.size - counts.size))
                        counts[: batch_counts.size] += batch_counts
                    part_of = table.column("user").to_numpy() % partitions
                    for part in np.unique(part_of):
                        piece = table.filter(pa.array(part_of == part))
                        if part not in writers:
                            writers[part] = pq.ParquetWriter(
                                spill / f"{part}.parquet", piece.schema
                            )
                        writers[part].write_table(piece)
    finally:
        for writer in writers.values():
            writer.close()
    return counts


def train_windows(items: np.ndarray, max_length: int, windows: str) -> list[np.ndarray]:
    """A user's train rows: windows of at most ``max_length + 1`` items, oldest first.

    "last" keeps the newest window only. "all" steps back ``max_length`` items at a
    time, so that consecutive windows share one item (the input of the newer window's
    first target) and every item but the first is a target exactly once. A user
    with no train item gets no row; one with a single item gets that one (as "last").
    """
    if not len(items):
        return []
    ends = [len(items)]
    if windows == "all" and len(items) > 1:
        ends = list(range(len(items), 1, -max_length))[::-1]
    return [items[max(0, end - max_length - 1) : end] for end in ends]


def _sequences_of_partition(
    table: pa.Table, max_length: int, windows: str = "last"
) -> dict[str, pa.Table]:
    """Group one partition's events by user, in time order."""
    table = table.take(
        pc.sort_indices(table, [("user", "ascending"), ("ts", "ascending"), ("order", "ascending")])
    )
    users = table.column("user").to_numpy()
    items = table.column("item").to_numpy()
    ts = table.column("ts").to_numpy()
    split = table.column("split").to_numpy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]

    train = {"user": [], "history": []}
    evals = {
        s: {"user": [], "history": [], "target": [], "ts": [], "seen": []} for s in EVAL_SPLITS
    }
    for start, end in zip(starts, ends, strict=True):
        u_items, u_ts, u_split = items[start:end], ts[start:end], split[start:end]
        in_train = u_split == 0
        train_items = u_items[in_train]
        for window in train_windows(train_items, max_length, windows):
            train["user"].append(int(users[start]))
            train["history"].append(window.tolist())
        for code, name in enumerate(EVAL_SPLITS, start=1):
            # Valid events see train history; test events see train + valid history.
            allowed = u_split < code
            for i in np.flatnonzero(u_split == code):
                later = np.flatnonzero(allowed[i + 1 :] & (u_ts[i + 1 :] > u_ts[i]))
                if len(later):
                    raise DataError(
                        f"user {users[start]}: an earlier-split event at "
                        f"{u_ts[i + 1 + later[0]]} is later than its {name} event at {u_ts[i]}; "
                        "the split leaks future interactions into training sequences."
                    )
                history = np.flatnonzero(allowed[:i])
                evals[name]["user"].append(int(users[start]))
                evals[name]["history"].append(u_items[history[-max_length:]].tolist())
                evals[name]["target"].append(int(u_items[i]))
                evals[name]["ts"].append(int(u_ts[i]))
                evals[name]["seen"].append(np.unique(u_items[u_split <= code]).tolist())
    history_type = pa.list_(pa.int64())
    out = {
        "train": pa.table(
            {
                "user": pa.array(train["user"], pa.int64()),
                "history": pa.array(train["history"], history_type),
            }
        )
    }
    for name in EVAL_SPLITS:
        cols = evals[name]
        out[name] = pa.table(
            {
                "user": pa.array(cols["user"], pa.int64()),
                "history": pa.array(cols["history"], history_type),
                "target": pa.array(cols["target"], pa.int64()),
                "ts": pa.array(cols["ts"], pa.int64()),
                "seen": pa.array(cols["seen"], history_type),
            }
        )
    return out
