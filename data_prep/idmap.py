"""Stable vocabularies that grow and expire: a day's transform extends yesterday's.

A refit vocabulary (`data_prep.transform.fit_transform`) orders ids by count, so an id
can move to another row between runs and a warm-started model would read another id's
embedding. `extend_transform` instead extends a fitted transform with the statistics of
one more partition (a day of logs):

- **Known ids keep their rows.** Vocabulary slot i is embedding row i + 1 (row 0 is
  out-of-vocabulary) for as long as its id lives.
- **New ids grow rows.** Ids absent from the vocabulary and seen at least `min_count`
  times in the partition are admitted, most frequent first (ties by value): into the
  lowest free slot first, then appended. `top_k` caps the live ids.
- **Stale ids expire.** Every slot remembers the ordinal of the partition that last
  saw its id (`last_seen`). With `ttl` set, an id not seen in the last `ttl`
  partitions is evicted before the new ids are admitted: its slot becomes a hole
  (null in `values`), which maps nothing, and the next admitted id takes it. So the
  table is bounded by the ids seen in any `ttl` consecutive partitions (plus holes
  that nobody reused yet), however many partitions go by.
- **What the trainer must reset.** `changes[feature]["reset_rows"]` lists the rows
  whose id changed in this extension (evicted, or reused by a new id): a warm start
  copies every other row of the parent model and gives these fresh initial values and
  a zero optimizer state. `history` keeps one record per partition (added, reused,
  evicted, live, num_embeddings per feature) for as long as the chain lives.

Hashed features have no fitted state and pass through unchanged. Dense features keep
the parent's normalisation (mean, std): re-standardising with the new day's moments
would shift every input the warm-started model was trained on.

Costs per partition and feature: a sort of the partition's distinct ids and a lookup
of them in the vocabulary (Arrow's hash `index_in`), O(V + d log d) for V slots and d
distinct ids; `last_seen` is one int per slot in the transform JSON.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data_prep.errors import SchemaError
from data_prep.schema import SchemaConfig
from data_prep.transform import _ARROW_TYPES, TRANSFORM_FORMAT, FitStats

# Keys that describe one link of the chain (against its parent), not carried forward.
_PER_LINK = ("changes", "parent_sizes", "parent_digest")


@dataclass(frozen=True)
class VocabularyChange:
    """What one partition did to one feature's vocabulary.

    Attributes:
        added: Ids admitted (into free slots or appended).
        reused: Of those, how many took a slot an evicted id had held.
        evicted: Ids evicted for not being seen in `ttl` partitions.
        reset_rows: Embedding rows whose id changed (sorted): evicted or reused.
        live: Ids in the vocabulary after the partition.
        num_embeddings: Rows of the feature's table (slots + the OOV row).
    """

    added: int
    reused: int
    evicted: int
    reset_rows: list[int]
    live: int
    num_embeddings: int

    def record(self) -> dict:
        """The change as stored in the transform's history (without the row list)."""
        return {
            "added": self.added,
            "reused": self.reused,
            "evicted": self.evicted,
            "live": self.live,
            "num_embeddings": self.num_embeddings,
        }


def extend_vocabulary(
    entry: dict,
    values: pa.Array,
    counts: np.ndarray,
    ordinal: int,
    ttl: int | None,
) -> tuple[dict, VocabularyChange]:
    """One vocabulary entry extended with one partition's distinct ids and counts.

    Args:
        entry: The parent's `transform["sparse"][name]` (kind "vocab"); not changed.
        values: (d,) the partition's distinct ids (nulls are ignored).
        counts: (d,) how often each occurred in the partition.
        ordinal: This partition's ordinal in the chain (the parent's partitions are
            0 .. ordinal - 1).
        ttl: Evict ids not seen in the last `ttl` partitions (this one included);
            None keeps every id.

    Returns:
        (the new entry, what changed).
    """
    slots = list(entry["values"])
    last_seen = np.asarray(entry.get("last_seen", [ordinal - 1] * len(slots)), dtype=np.int64)
    if len(last_seen) != len(slots):
        raise SchemaError(
            f"transform vocabulary has {len(slots)} values but {len(last_seen)} last_seen "
            "entries; the transform file was edited or truncated: refit it."
        )
    present = pc.invert(pc.is_null(values))
    values = values.filter(present)
    counts = np.asarray(counts)[present.to_numpy(zero_copy_only=False)]
    dtype = _ARROW_TYPES[entry["dtype"]]

    # Ids already in the vocabulary: seen now.
    live_slots = np.array([i for i, v in enumerate(slots) if v is not None], dtype=np.int64)
    live_values = pa.array([slots[i] for i in live_slots], dtype)
    found = pc.index_in(values, value_set=live_values)  # null where not in the vocabulary
    known = pc.is_valid(found).to_numpy(zero_copy_only=False)
    position = pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    seen_slots = live_slots[position[known]]
    last_seen[seen_slots] = ordinal

    # Expiry before admission, so today's new ids can take the freed slots.
    evicted: list[int] = []
    if ttl is not None:
        stale = live_slots[last_seen[live_slots] <= ordinal - ttl]
        for slot in stale.tolist():
            slots[slot] = None
            last_seen[slot] = ordinal
        evicted = stale.tolist()

    # New ids: count >= min_count, most frequent first, ties by value; top_k caps the live.
    new = ~known & (counts >= entry["min_count"])
    candidates = pa.table({"v": values.filter(pa.array(new)), "c": counts[new]})
    order = pc.sort_indices(candidates, [("c", "descending"), ("v", "ascending")])
    admitted = candidates["v"].take(order).to_pylist()
    live = len(live_slots) - len(evicted)
    if entry.get("top_k") is not None:
        admitted = admitted[: max(0, entry["top_k"] - live)]
    free = [i for i, v in enumerate(slots) if v is None]  # ascending
    reused_slots = free[: len(admitted)]
    for slot, value in zip(reused_slots, admitted, strict=False):
        slots[slot] = value
        last_seen[slot] = ordinal
    appended = admitted[len(reused_slots) :]
    slots.extend(appended)
    last_seen = np.concatenate([last_seen, np.full(len(appended), ordinal, dtype=np.int64)])

    reset_rows = sorted({slot + 1 for slot in (*evicted, *reused_slots)})
    new_entry = {
        **entry,
        "values": slots,
        "last_seen": last_seen.tolist(),
        "num_embeddings": len(slots) + 1,
    }
    change = VocabularyChange(
        added=len(admitted),
        reused=len(reused_slots),
        evicted=len(evicted),
        reset_rows=reset_rows,
        live=live + len(admitted),
        num_embeddings=len(slots) + 1,
    )
    return new_entry, change


def transform_digest(transform: dict) -> str:
    """sha256 of a transform's canonical JSON: what `parent_digest` names."""
    return hashlib.sha256(json.dumps(transform, sort_keys=True).encode()).hexdigest()


def start_chain(transform: dict, partition: str) -> dict:
    """A freshly fitted transform as the first link of a chain: fitted on `partition`.

    Every vocabulary id counts as seen in that partition (ordinal 0); the next
    partition extends it with `extend_transform`.
    """
    if "partitions" in transform:
        raise SchemaError("the transform already starts a chain (it has partitions)")
    chained = copy.deepcopy(transform)
    record: dict = {"partition": partition, "rows": None, "features": {}}
    for name, entry in chained["sparse"].items():
        if entry["kind"] == "vocab":
            entry["last_seen"] = [0] * len(entry["values"])
            live = sum(v is not None for v in entry["values"])
            record["features"][name] = VocabularyChange(
                live, 0, 0, [], live, entry["num_embeddings"]
            ).record()
    chained["partitions"] = [partition]
    chained["ttl"] = None
    chained["history"] = [record]
    chained["changes"] = {}
    return chained


def extend_transform(
    parent: dict,
    stats: FitStats,
    schema: SchemaConfig,
    partition: str,
    ttl: int | None,
) -> dict:
    """The parent transform extended with one partition's statistics (module docstring).

    Args:
        parent: The fitted or extended transform the serving model was trained with
            (`transform.json`); not changed.
        stats: Statistics of the partition's train rows (`collect_stats` folded with
            `merge_stats`).
        schema: The schema the parent was fitted with.
        partition: The partition's name (e.g. "dt=2026-12-05").
        ttl: Partitions an id may go unseen before it is evicted; None: never.

    Returns:
        The extended transform: the same format, plus `partitions` (every partition
        the chain has seen, in order), `ttl`, `history`, `changes` (this
        partition's `reset_rows` per vocabulary feature), `parent_sizes` (the parent's
        rows per sparse feature) and `parent_digest` (`transform_digest(parent)`): with
        these a model of the parent can be laid onto this transform's rows.

    Raises:
        SchemaError: The parent is of another format or schema, or has seen the
            partition already.
    """
    if parent.get("format") != TRANSFORM_FORMAT:
        raise SchemaError(
            f"cannot extend a transform of format {parent.get('format')!r} (this version "
            f"writes {TRANSFORM_FORMAT!r}): train the chain again from a fresh fit."
        )
    expected = [{"name": f.name, "role": f.role} for f in schema.fields]
    if parent["columns"] != expected:
        raise SchemaError(
            "the schema's fields differ from the parent transform's: an incremental run "
            "must keep the schema; start a new chain to change it."
        )
    partitions = list(parent.get("partitions", []))
    if partition in partitions:
        raise SchemaError(
            f"partition {partition!r} is already in the parent transform's history: "
            "each partition extends the chain once."
        )
    if ttl is not None and ttl < 1:
        raise SchemaError(f"ttl must be >= 1 partition, got {ttl}")
    ordinal = len(partitions)
    inherited = {k: v for k, v in parent.items() if k not in _PER_LINK}
    transform = copy.deepcopy(inherited)
    record: dict = {"partition": partition, "rows": stats.rows, "features": {}}
    changes: dict = {}
    for name, entry in parent["sparse"].items():
        if entry["kind"] != "vocab":
            continue
        values, counters = stats.counts[name].result()
        new_entry, change = extend_vocabulary(entry, values, counters[:, 0], ordinal, ttl)
        transform["sparse"][name] = new_entry
        record["features"][name] = change.record()
        changes[name] = {"reset_rows": change.reset_rows}
    transform["partitions"] = [*partitions, partition]
    transform["ttl"] = ttl
    transform["history"] = [*parent.get("history", []), record]
    transform["changes"] = changes
    transform["parent_sizes"] = {
        name: entry["num_embeddings"] for name, entry in parent["sparse"].items()
    }
    transform["parent_digest"] = transform_digest(parent)
    return transform
