"""Feature transforms: fit on train rows, apply to any rows.

The fit side is a fold over batches: ``collect_stats`` turns one batch of train rows
into partial statistics, ``merge_stats`` combines partials (associative, so files can
be counted in parallel and merged in any grouping), ``fit_transform`` turns the merged
statistics into the fitted transform. The fitted transform is a JSON-able dict, written
as ``transform.json``; ``apply_transform`` needs nothing else, so export can load it.

What each schema role becomes (``apply_transform``):

- sparse with a vocabulary: int64 index, 0 = out of vocabulary. The vocabulary keeps
  ids seen at least ``min_count`` times in train, at most ``top_k`` of them, ordered by
  count descending then value ascending (deterministic), so index i is the i-th most
  frequent id.
- sparse with ``hash_buckets``: int64 bucket in [0, hash_buckets), no OOV row and no
  fitted state. int64 ids hash with splitmix64's finaliser (``hash_int64``), strings
  with 64-bit blake2b (``hash_strings``); both are stable across processes and runs.
  A missing id goes to bucket 0.
- multi_hot (either of the above): ``list<int64>`` of indices; the vocabulary is over
  elements. A missing list becomes an empty list, a missing element index 0.
- dense: fill -> clip -> log1p(max(x, 0)) -> standardise to float32. A missing value
  without ``fill`` becomes the train mean (0 after standardising).
- dense with ``bucketize``: fill -> clip -> log as above, then the int64 bucket index
  ``searchsorted(boundaries, x, side="right")`` in [0, len(boundaries)]: a sparse
  feature with ``len(boundaries) + 1`` values. The boundaries apply to the value after
  clip and log.
- labels: float32 (a label with a ``threshold`` is 1 where the raw value >= threshold).
- timestamp, oracle (float64) and key columns pass through.

Memory: the statistics hold one count row per distinct train id (which the vocabulary
needs anyway), fixed-size moment and histogram arrays per dense feature, and
``hash_buckets`` counters per hashed feature; nothing grows with the number of rows.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from artifacts.errors import DataError
from artifacts.locations import Location, write_text
from data_prep.errors import SchemaError
from data_prep.schema import FieldSpec, SchemaConfig

TRANSFORM_FORMAT = "recforge.transform/2"
HASH_SPEC = {
    "int64": "splitmix64 finaliser of the id as uint64, modulo hash_buckets",
    "string": "blake2b (digest_size=8) of the UTF-8 bytes, read little-endian, modulo hash_buckets",
}
# Dense label-leak histograms: the top 16 bits of an order-preserving integer key of the
# float64 value (sign, exponent and 4 mantissa bits), so no value range is needed up front.
DENSE_HISTOGRAM_BINS = 1 << 16
# Hashed features with more buckets than this get no single-feature label-leak check.
MAX_LEAK_CHECK_BUCKETS = 1 << 20
# A label needs this many positive and negative train rows for a meaningful leak check:
# on a handful of rows almost any feature separates the classes.
MIN_LEAK_CHECK_ROWS = 10
# Count tables are compacted once their pending rows exceed max(this, reduced size).
_MIN_COMPACT_ROWS = 1 << 16

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)


# ---------------------------------------------------------------------------- hashing


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function, vectorised: (N,) uint64 -> (N,) uint64.

    Multiplication wraps modulo 2**64 (numpy array arithmetic), exactly as in C.
    """
    z = x.astype(_U64, copy=False) + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _MIX1
    z = (z ^ (z >> _U64(27))) * _MIX2
    return z ^ (z >> _U64(31))


def hash_int64(values: np.ndarray, buckets: int) -> np.ndarray:
    """Stable buckets of int64 ids: (N,) int64 -> (N,) int64 in [0, buckets)."""
    mixed = splitmix64(np.ascontiguousarray(values, dtype=np.int64).view(_U64))
    return (mixed % _U64(buckets)).astype(np.int64)


def hash_strings(values: pa.Array, buckets: int) -> np.ndarray:
    """Stable buckets of strings: (N,) string -> (N,) int64 in [0, buckets); null -> 0.

    Only the distinct values of the batch are hashed (blake2b in Python, one call per
    distinct value); rows take their bucket through the dictionary indices.
    """
    encoded = dictionary_encoded(values)
    uniques = encoded.dictionary.to_pylist()
    digests = np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
            for s in uniques
        ),
        dtype=_U64,
        count=len(uniques),
    )
    table = np.append((digests % _U64(buckets)).astype(np.int64), 0)  # last slot: null
    return table[_indices_or(encoded.indices, len(uniques))]


def _hash_column(values: pa.Array, dtype: str, buckets: int) -> np.ndarray:
    if dtype == "string":
        return hash_strings(values, buckets)
    out = hash_int64(pc.fill_null(values, 0).to_numpy(zero_copy_only=False), buckets)
    if values.null_count:
        out[_null_mask(values)] = 0
    return out


# ----------------------------------------------------------------------------- fitting


class _Counts:
    """A mergeable table: distinct value -> int64 counters (count, positives per label).

    Parts are appended as they come and reduced (summed per value) once their total
    exceeds the reduced size, so the cost is amortised linear and the memory stays
    within a small multiple of the number of distinct values.
    """

    def __init__(self, value_type: pa.DataType, width: int) -> None:
        self.value_type = value_type
        self.width = width
        self._parts: list[tuple[pa.Array, np.ndarray]] = []
        self._pending = 0
        self._reduced = 0

    def add(self, values: pa.Array, counters: np.ndarray) -> None:
        """values (K,), distinct or not; counters (K, width) int64."""
        if len(values) == 0:
            return
        self._parts.append((values, counters))
        self._pending += len(values)
        if self._pending > max(_MIN_COMPACT_ROWS, self._reduced):
            self._compact()

    def merge(self, other: "_Counts") -> None:
        for values, counters in other._parts:
            self.add(values, counters)

    def result(self) -> tuple[pa.Array, np.ndarray]:
        """(distinct values (V,), counters (V, width)), in first-seen order."""
        self._compact()
        if not self._parts:
            return pa.array([], self.value_type), np.zeros((0, self.width), np.int64)
        return self._parts[0]

    @property
    def size(self) -> int:
        return sum(len(v) for v, _ in self._parts)

    def _compact(self) -> None:
        if len(self._parts) <= 1 and self._pending == 0:
            return
        values = pa.concat_arrays([v for v, _ in self._parts])
        counters = np.concatenate([c for _, c in self._parts])
        self._parts = [_sum_by_value(values, counters, counts_are_ones=False)]
        self._reduced = len(self._parts[0][0])
        self._pending = 0


def _sum_by_value(
    values: pa.Array, weights: np.ndarray, counts_are_ones: bool = True
) -> tuple[pa.Array, np.ndarray]:
    """Sum the rows of ``weights`` (N, W) per distinct non-null value of ``values`` (N,).

    With ``counts_are_ones`` the first weight column is known to be all ones and is
    counted without weights (faster).

    Returns:
        (distinct values (V,) in first-seen order, sums (V, W) int64).
    """
    dense = _compact_codes(values)
    if dense is not None:
        index, dictionary = dense
    else:
        encoded = dictionary_encoded(values)
        index = _indices_or(encoded.indices, len(encoded.dictionary))  # null: extra slot
        dictionary = encoded.dictionary
    distinct = len(dictionary)
    sums = np.empty((distinct, weights.shape[1]), np.int64)
    for column in range(weights.shape[1]):
        plain = counts_are_ones and column == 0
        # bincount sums weights in float64: exact for counts below 2**53.
        w = None if plain else weights[:, column]
        counted = np.bincount(index, weights=w, minlength=distinct + 1)
        sums[:, column] = counted[:distinct]
    if dense is not None or pa.types.is_dictionary(values.type):
        # The code space is a value range or a file's dictionary: keep the values that occur.
        seen = np.flatnonzero(sums[:, 0])
        return dictionary.take(pa.array(seen, pa.int64())), sums[seen]
    return dictionary, sums


def _compact_codes(values: pa.Array) -> tuple[np.ndarray, pa.Array] | None:
    """For int64 values without nulls in a narrow range: (value - min, the whole range).

    Counting by offset from the minimum skips hashing; the range may be at most a few
    times the number of values, so the counters stay as small as the batch.
    """
    if values.type != pa.int64() or values.null_count or len(values) == 0:
        return None
    x = values.to_numpy()
    low, high = int(x.min()), int(x.max())
    if high - low >= max(4 * len(x), 1 << 16):
        return None
    return x - low, pa.array(np.arange(low, high + 1, dtype=np.int64))


@dataclass
class _Moments:
    """count, mean and M2 (sum of squared deviations), merged with Chan's formula."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: np.ndarray) -> None:
        if len(x) == 0:
            return
        mean = float(x.mean())
        self.merge(_Moments(len(x), mean, float(np.square(x - mean).sum())))

    def merge(self, other: "_Moments") -> None:
        if other.count == 0:
            return
        total = self.count + other.count
        delta = other.mean - self.mean
        self.mean += delta * other.count / total
        self.m2 += other.m2 + delta * delta * self.count * other.count / total
        self.count = total


@dataclass
class FitStats:
    """Partial statistics of train rows; merge with ``merge_stats``.

    Attributes:
        rows: train rows seen.
        counts: vocabulary features -> per-value counters (count, positives per label;
            multi_hot: count only).
        buckets: hashed single-valued features -> (1 + L, hash_buckets) counters.
        moments: dense features -> moments of the value after fill/clip/log.
        histograms: dense features -> (1 + L, DENSE_HISTOGRAM_BINS) counters.
    """

    rows: int = 0
    counts: dict[str, _Counts] = field(default_factory=dict)
    buckets: dict[str, np.ndarray] = field(default_factory=dict)
    moments: dict[str, _Moments] = field(default_factory=dict)
    histograms: dict[str, np.ndarray] = field(default_factory=dict)

    def state_sizes(self) -> dict[str, int]:
        """Entries held per feature: what bounds the fit's memory."""
        sizes = {name: c.size for name, c in self.counts.items()}
        sizes |= {name: b.size for name, b in self.buckets.items()}
        sizes |= {name: h.size for name, h in self.histograms.items()}
        return sizes


def empty_stats(schema: SchemaConfig) -> FitStats:
    """Statistics of no rows: the identity of ``merge_stats``."""
    num_labels = len(schema.labels)
    stats = FitStats()
    for spec in schema.by_role("sparse"):
        if spec.hash_buckets is None:
            width = 1 if spec.multi_hot else 1 + num_labels
            stats.counts[spec.name] = _Counts(_ARROW_TYPES[spec.dtype], width)
        elif not spec.multi_hot and spec.hash_buckets <= MAX_LEAK_CHECK_BUCKETS:
            stats.buckets[spec.name] = np.zeros((1 + num_labels, spec.hash_buckets), np.int64)
    for spec in schema.by_role("dense"):
        stats.moments[spec.name] = _Moments()
        stats.histograms[spec.name] = np.zeros((1 + num_labels, DENSE_HISTOGRAM_BINS), np.int64)
    return stats


def collect_stats(schema: SchemaConfig, batch: pa.RecordBatch | pa.Table) -> FitStats:
    """Partial statistics of one batch of train rows (typed clean events).

    Args:
        schema: the fields and their transforms.
        batch: train rows only, with every sparse, dense and label column.

    Returns:
        Statistics to fold into the running total with ``merge_stats``.
    """
    stats = empty_stats(schema)
    n = batch.num_rows
    if n == 0:
        return stats
    positive = np.stack([label_values(_column(batch, s.name), s) for s in schema.labels], 1)
    stats.rows = n
    counters = np.concatenate([np.ones((n, 1), np.int64), positive.astype(np.int64)], 1)
    for spec in schema.by_role("sparse"):
        column = _column(batch, spec.name)
        if spec.hash_buckets is None:
            if spec.multi_hot:
                elements = pc.list_flatten(column)
                values, sums = _sum_by_value(elements, np.ones((len(elements), 1), np.int64))
            else:
                values, sums = _sum_by_value(column, counters)
            stats.counts[spec.name].add(values, sums)
        elif spec.name in stats.buckets:
            bucket = _hash_column(column, spec.dtype, spec.hash_buckets)
            target = stats.buckets[spec.name]
            for row in range(target.shape[0]):
                target[row] += np.bincount(
                    bucket, weights=counters[:, row], minlength=spec.hash_buckets
                ).astype(np.int64)
    for spec in schema.by_role("dense"):
        x = _dense_prepared(_column(batch, spec.name), spec.fill, spec.clip, spec.log)
        present = ~np.isnan(x)
        stats.moments[spec.name].add(x[present])
        bins = _sortable_bins(x[present])
        hist = stats.histograms[spec.name]
        for row in range(hist.shape[0]):
            hist[row] += np.bincount(
                bins, weights=counters[present, row], minlength=DENSE_HISTOGRAM_BINS
            ).astype(np.int64)
    return stats


def merge_stats(total: FitStats, part: FitStats) -> FitStats:
    """Fold ``part`` into ``total`` (in place) and return ``total``."""
    total.rows += part.rows
    for name, counts in part.counts.items():
        total.counts[name].merge(counts)
    for name, buckets in part.buckets.items():
        total.buckets[name] += buckets
    for name, moments in part.moments.items():
        total.moments[name].merge(moments)
    for name, hist in part.histograms.items():
        total.histograms[name] += hist
    return total


def fit_transform(stats: FitStats, schema: SchemaConfig, default_min_count: int) -> dict:
    """The fitted transform from merged train statistics.

    Args:
        stats: statistics of every train row.
        schema: the fields and their transforms.
        default_min_count: min_count of sparse fields that set none.

    Returns:
        The JSON-able transform (see the module docstring); ``leakage`` holds the
        single-feature train AUC per feature and label (see ``label_leaks``).

    Raises:
        DataError: a dense feature without ``fill`` has no value in train.
    """
    transform: dict = {
        "format": TRANSFORM_FORMAT,
        "columns": [{"name": f.name, "role": f.role} for f in schema.fields],
        "timestamp": schema.timestamp.name,
        "label": schema.label.name,
        "labels": [{"name": f.name, "threshold": f.threshold} for f in schema.labels],
        "oracle": schema.oracle.name if schema.oracle else None,
        "keys": [f.name for f in schema.by_role("key")],
        "hash": HASH_SPEC,
        "sparse": {},
        "dense": {},
    }
    auc: dict[str, dict[str, float]] = {}
    label_names = [f.name for f in schema.labels]
    for spec in schema.by_role("sparse"):
        entry: dict = {"dtype": spec.dtype, "multi_hot": spec.multi_hot}
        if spec.hash_buckets is not None:
            entry |= {"kind": "hash", "hash_buckets": spec.hash_buckets}
            entry["num_embeddings"] = spec.hash_buckets
            if spec.name in stats.buckets:
                b = stats.buckets[spec.name]
                auc[spec.name] = _grouped_auc(b[0], b[1:], label_names)
        else:
            min_count = spec.min_count or default_min_count
            values, counters = stats.counts[spec.name].result()
            keep = _vocabulary_order(values, counters[:, 0], min_count, spec.top_k)
            vocab = values.take(pa.array(keep, pa.int64()))
            entry |= {"kind": "vocab", "min_count": min_count, "top_k": spec.top_k}
            entry["num_embeddings"] = len(vocab) + 1
            entry["values"] = vocab.to_pylist()
            if not spec.multi_hot:
                auc[spec.name] = _vocab_auc(counters, keep, label_names)
        transform["sparse"][spec.name] = entry
    for spec in schema.by_role("dense"):
        moments = stats.moments[spec.name]
        if moments.count == 0:
            raise DataError(
                f"dense feature '{spec.name}' has no value in the train split; give it a "
                "`fill` value in the schema or drop it."
            )
        std = float(np.sqrt(moments.m2 / moments.count))
        transform["dense"][spec.name] = {
            "fill": spec.fill,
            "clip": list(spec.clip) if spec.clip else None,
            "log": spec.log,
            "standardize": spec.standardize,
            "mean": moments.mean,
            "std": std if std > 0 else 1.0,
            "bucketize": spec.bucketize,
            "num_embeddings": len(spec.bucketize) + 1 if spec.bucketize else None,
        }
        hist = stats.histograms[spec.name]
        auc[spec.name] = _grouped_auc(hist[0], hist[1:], label_names, ordered=True)
    transform["leakage"] = {"single_feature_train_auc": auc}
    return transform


def _vocabulary_order(
    values: pa.Array, counts: np.ndarray, min_count: int, top_k: int | None
) -> np.ndarray:
    """Positions of the kept values: count >= min_count, count desc then value asc, top_k."""
    frequent = np.flatnonzero(counts >= min_count)
    table = pa.table({"v": values.take(pa.array(frequent, pa.int64())), "c": counts[frequent]})
    order = pc.sort_indices(table, [("c", "descending"), ("v", "ascending")]).to_numpy()
    return frequent[order[:top_k] if top_k is not None else order]


def _vocab_auc(counters: np.ndarray, keep: np.ndarray, labels: list[str]) -> dict[str, float]:
    """Train AUC of the feature as the model sees it: in-vocabulary ids, the rest pooled."""
    kept = counters[keep]
    pooled = counters.sum(0) - kept.sum(0)
    groups = np.concatenate([kept, pooled[None, :]])
    return _grouped_auc(groups[:, 0], groups[:, 1:].T, labels)


def _grouped_auc(
    count: np.ndarray,
    positive: np.ndarray,
    labels: list[str],
    ordered: bool = False,
) -> dict[str, float]:
    """Best single-feature AUC per label from per-group counts.

    Args:
        count: (G,) rows per group (category, bucket or histogram bin).
        positive: (L, G) positive rows per group and label.
        labels: the L label names.
        ordered: groups are ordered values (dense bins): score by order, either
            direction; otherwise score each group by its positive rate (the best a
            categorical feature can do).

    Returns:
        label -> AUC in [0.5, 1]; labels with fewer than MIN_LEAK_CHECK_ROWS positive or
        negative rows are left out.
    """
    out = {}
    for i, label in enumerate(labels):
        pos = positive[i].astype(np.float64)
        neg = count.astype(np.float64) - pos
        p, n = pos.sum(), neg.sum()
        if min(p, n) < MIN_LEAK_CHECK_ROWS:
            continue
        if not ordered:
            occupied = count > 0
            pos, neg = pos[occupied], neg[occupied]
            order = np.argsort(pos / (pos + neg), kind="stable")
            pos, neg = pos[order], neg[order]
        below = np.cumsum(neg) - neg
        auc = float((pos * (below + 0.5 * neg)).sum() / (p * n))
        out[label] = max(auc, 1.0 - auc)
    return out


def label_leaks(transform: dict, threshold: float, allow: list[str]) -> list[str]:
    """Describe features whose single-feature train AUC exceeds ``threshold``.

    Returns:
        One line per leaking (feature, label) pair not in ``allow``.
    """
    found = []
    for feature, per_label in transform["leakage"]["single_feature_train_auc"].items():
        for label, auc in per_label.items():
            if auc > threshold and feature not in allow:
                found.append(f"'{feature}' (AUC {auc:.4f} for label '{label}')")
    return found


# ---------------------------------------------------------------------------- applying


class _Lookup:
    """Vocabulary lookup built once per transform: value -> index, 0 when absent."""

    def __init__(self, dtype: str, values: list) -> None:
        self.dtype = dtype
        self.direct: np.ndarray | None = None
        if dtype == "int64":
            # An extended vocabulary (data_prep.idmap) has holes (None): freed slots
            # that map nothing; slot i is index i + 1 either way.
            array = pa.array(values, pa.int64())
            valid = pc.is_valid(array).to_numpy(zero_copy_only=False)
            slot = np.flatnonzero(valid).astype(np.int64)
            ids = array.filter(pa.array(valid)).to_numpy(zero_copy_only=False)
            order = np.argsort(ids, kind="stable")
            self.sorted = ids[order]
            self.index = slot[order] + 1
            if len(ids) and int(ids.max()) - int(ids.min()) < max(4 * len(ids), 1 << 16):
                # A narrow id range: index by offset, no search (at most 4x the vocabulary).
                self.low = int(ids.min())
                self.direct = np.zeros(int(ids.max()) - self.low + 1, np.int64)
                self.direct[ids - self.low] = slot + 1
        else:
            # Holes stay in the value set as nulls, so a value's position is its slot;
            # lookups never ask for null (nulls are in the indices, not the dictionary).
            self.value_set = pa.array(values, pa.string())

    def __call__(self, column: pa.Array) -> np.ndarray:
        """(N,) values -> (N,) int64 indices; null and unseen -> 0."""
        if self.dtype != "int64":
            encoded = dictionary_encoded(column)
            # Look up each distinct value once; a null row takes the extra slot (index 0).
            position = pc.index_in(encoded.dictionary, value_set=self.value_set)
            codes = np.append(_indices_or(position, -1) + 1, 0)
            return codes[_indices_or(encoded.indices, len(encoded.dictionary))]
        ids = pc.fill_null(column, 0).to_numpy(zero_copy_only=False)
        if len(self.sorted) == 0:
            return np.zeros(len(ids), np.int64)
        if self.direct is not None:
            offset = ids - self.low
            inside = (offset >= 0) & (offset < len(self.direct))
            out = np.where(inside, self.direct[np.where(inside, offset, 0)], 0)
        else:
            slot = np.minimum(np.searchsorted(self.sorted, ids), len(self.sorted) - 1)
            out = np.where(self.sorted[slot] == ids, self.index[slot], 0)
        if column.null_count:
            out[_null_mask(column)] = 0
        return out


class TransformApplier:
    """A fitted transform with its lookups built, for applying to many batches."""

    def __init__(self, transform: dict) -> None:
        if transform.get("format") != TRANSFORM_FORMAT:
            raise SchemaError(
                f"transform format {transform.get('format')!r} is not {TRANSFORM_FORMAT!r}; "
                "rerun preprocess with this version of recforge."
            )
        self.transform = transform
        self._lookups = {
            name: _Lookup(entry["dtype"], entry["values"])
            for name, entry in transform["sparse"].items()
            if entry["kind"] == "vocab"
        }
        self._thresholds = {e["name"]: e["threshold"] for e in transform["labels"]}

    def __call__(self, batch: pa.RecordBatch | pa.Table) -> pa.Table:
        """Raw typed events -> model inputs, columns in schema order."""
        out = {}
        for column in self.transform["columns"]:
            name, role = column["name"], column["role"]
            raw = _column(batch, name)
            if role == "sparse":
                out[name] = self._sparse(name, raw)
            elif role == "dense":
                out[name] = _apply_dense(self.transform["dense"][name], raw)
            elif role == "label":
                out[name] = pa.array(_label_float(raw, self._thresholds[name]))
            elif role == "oracle":
                out[name] = pc.cast(raw, pa.float64())
            else:  # timestamp, key
                out[name] = raw
        return pa.table(out)

    def _sparse(self, name: str, raw: pa.Array) -> pa.Array:
        entry = self.transform["sparse"][name]
        if entry["multi_hot"]:
            lengths = pc.fill_null(pc.list_value_length(raw), 0).to_numpy(zero_copy_only=False)
            offsets = np.zeros(len(lengths) + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            # list_flatten skips null lists, whose length counts as 0 above.
            elements = self._index(name, entry, pc.list_flatten(raw))
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(elements))
        return pa.array(self._index(name, entry, raw))

    def _index(self, name: str, entry: dict, values: pa.Array) -> np.ndarray:
        if entry["kind"] == "hash":
            return _hash_column(values, entry["dtype"], entry["hash_buckets"])
        return self._lookups[name](values)


def apply_transform(transform: dict, batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """Map raw typed events to model inputs with a fitted transform.

    For many batches build a ``TransformApplier`` once instead: it keeps the lookups.

    Args:
        transform: the fitted transform (``transform.json``).
        batch: typed clean events with every column the transform names.

    Returns:
        The transformed columns, in schema order.
    """
    return TransformApplier(transform)(batch)


def _apply_dense(entry: dict, raw: pa.Array) -> pa.Array:
    x = _dense_prepared(raw, entry["fill"], entry["clip"], entry["log"])
    # Without a fill value a missing entry takes the train mean (0 after standardising).
    x = np.where(np.isnan(x), entry["mean"], x)
    if entry["bucketize"] is not None:
        return pa.array(np.searchsorted(np.asarray(entry["bucketize"]), x, side="right"))
    if entry["standardize"]:
        x = (x - entry["mean"]) / entry["std"]
    return pa.array(x.astype(np.float32))


def dictionary_columns(transform: dict) -> list[str]:
    """Parquet column paths worth dictionary-encoding: the index columns (sparse ids,
    multi-hot elements, buckets). Timestamps and floats are mostly distinct, so trying a
    dictionary on them only costs time."""
    paths = []
    for column in transform["columns"]:
        name, role = column["name"], column["role"]
        if role == "sparse":
            multi_hot = transform["sparse"][name]["multi_hot"]
            paths.append(f"{name}.list.element" if multi_hot else name)
        elif role == "dense" and transform["dense"][name]["bucketize"] is not None:
            paths.append(name)
    return paths


def save_transform(transform: dict, path: Location) -> None:
    """Write ``transform.json`` (deterministic bytes for the same transform); a URL too."""
    write_text(path, json.dumps(transform, indent=1))


def load_transform(path: Path) -> dict:
    """Read ``transform.json``.

    Raises:
        SchemaError: the file is not a transform of this format.
    """
    try:
        transform = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise SchemaError(f"{path} is not valid JSON ({err}); rerun preprocess.") from err
    TransformApplier(transform)  # validates the format
    return transform


# ------------------------------------------------------------------------------ helpers

_ARROW_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}


def _column(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    try:
        column = batch.column(name)
    except KeyError as err:
        raise SchemaError(
            f"column '{name}' named in the schema is missing from the events "
            f"(they have {batch.schema.names}); rerun ingest with this schema."
        ) from err
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def dictionary_encoded(values: pa.Array) -> pa.DictionaryArray:
    """``values`` as a dictionary array; one read from Parquet as a dictionary is reused."""
    return values if pa.types.is_dictionary(values.type) else pc.dictionary_encode(values)


def _indices_or(indices: pa.Array, fill: int) -> np.ndarray:
    """Integer indices as an int64 numpy array, nulls replaced by ``fill``."""
    return pc.fill_null(indices, fill).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _null_mask(values: pa.Array) -> np.ndarray:
    return pc.is_null(values).to_numpy(zero_copy_only=False)


def label_values(raw: pa.Array, spec: FieldSpec) -> np.ndarray:
    """(N,) 0/1 float64 of a label column: value > 0, or >= threshold for raw scores."""
    return _label_float(raw, spec.threshold).astype(np.float64)


def _label_float(raw: pa.Array, threshold: float | None) -> np.ndarray:
    x = raw.to_numpy(zero_copy_only=False)
    if threshold is not None and pa.types.is_floating(raw.type):
        # Ingest thresholds labels already; raw scores are accepted for older events.
        return (x >= threshold).astype(np.float32)
    return x.astype(np.float32)


def _dense_prepared(
    raw: pa.Array, fill: float | None, clip: tuple[float, float] | list | None, log: bool
) -> np.ndarray:
    """fill -> clip -> log1p(max(x, 0)) as float64; missing stays NaN without fill."""
    x = raw.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls become NaN
    if fill is not None:
        x = np.where(np.isnan(x), fill, x)
    if clip is not None:
        x = np.clip(x, clip[0], clip[1])
    if log:
        x = np.log1p(np.maximum(x, 0.0))
    return x


def _sortable_bins(x: np.ndarray) -> np.ndarray:
    """Order-preserving bin of each float64: top 16 bits of a monotone uint64 key."""
    bits = np.ascontiguousarray(x, dtype=np.float64).view(_U64)
    key = np.where(bits >> _U64(63) == 1, ~bits, bits | _U64(1 << 63))
    return (key >> _U64(48)).astype(np.intp)
