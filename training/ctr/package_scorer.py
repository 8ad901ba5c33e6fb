"""Score raw records with a recforge CTR model package, without recforge.

Export copies this file into every CTR package as ``score.py``. It needs numpy,
onnxruntime and the standard library only, and reads from its own directory:
``transform.json`` (the fitted feature transform), ``model.onnx`` and, when present,
``signature.json`` (checked against the input layout derived from the transform).

A raw record is a dict keyed by the schema's raw field names, with the values as the
clean logs hold them, e.g. ``{"user_id": 123, "city": "Paris", "price": 9.5}``; other
keys (labels, timestamps) are ignored. ``RecordTransform`` maps records to the ONNX
inputs exactly as ``data_prep.transform.apply_transform`` maps typed events:

- vocabulary feature: index i + 1 of the value in the vocabulary, 0 for an unseen or
  missing value;
- hashed feature: int64 ids through splitmix64's finaliser, strings through 64-bit
  blake2b (little-endian), modulo ``hash_buckets``; a missing value is bucket 0;
- multi-hot feature: a list (or tuple) of values, each mapped as above; a missing list
  is empty; the model input is (B, L) padded with -1, L = the longest list (at least 1);
- dense feature: fill -> clip -> log1p(max(x, 0)) -> a missing value becomes the train
  mean -> standardise, float32; with ``bucketize`` the bucket index
  ``searchsorted(boundaries, x, side="right")`` joins the sparse input instead.

A missing value is an absent key, None or "" (as ingest reads an empty field). Ingest
would quarantine a row that misses a required field; here it maps as the transform maps
a null. int64 fields take ints, integral floats and decimal text; float64 fields take
finite numbers and numeric text; string fields take text (an int becomes its decimal
text). Anything else raises ValueError naming the field.

Library use::

    from score import score_records
    probabilities = score_records([{"user_id": 123, "city": "Paris", ...}])  # (B,) or (B, T)

Command line::

    python score.py records.jsonl                  # one JSON line of scores per record
    python score.py records.jsonl --benchmark 200  # one JSON line of latency figures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

TRANSFORM_FORMAT = "recforge.transform/2"
PACKAGE_DIR = Path(__file__).resolve().parent
OUTPUT_NAME = "score"

_INT_TEXT = re.compile(r"^\s*[+-]?\d+\s*$")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


# ---------------------------------------------------------------------- raw values


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "")


def _as_int(value: Any, name: str) -> int | None:
    if _missing(value):
        return None
    if isinstance(value, bool):
        raise ValueError(f"field {name!r}: {value!r} is a bool, not an int64 id")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and _INT_TEXT.match(value):
        value = int(value.strip())
    if not isinstance(value, int):
        raise ValueError(f"field {name!r}: {value!r} is not an int64")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"field {name!r}: {value} overflows int64")
    return value


def _as_float(value: Any, name: str) -> float:
    """The value as float64; NaN for a missing one."""
    if _missing(value):
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"field {name!r}: {value!r} is not a number")
    try:
        x = float(value)
    except ValueError as err:
        raise ValueError(f"field {name!r}: {value!r} is not a number") from err
    if not math.isfinite(x):
        raise ValueError(f"field {name!r}: {value!r} is not finite")
    return x


def _as_str(value: Any, name: str) -> str | None:
    if _missing(value):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"field {name!r}: {value!r} is not a string")


# ------------------------------------------------------------------------- hashing


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function on (N,) uint64; array arithmetic wraps mod 2**64."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _hash_ints(ids: list[int | None], buckets: int) -> np.ndarray:
    values = np.array([0 if i is None else i for i in ids], dtype=np.int64)
    out = (_splitmix64(values.view(np.uint64)) % np.uint64(buckets)).astype(np.int64)
    out[[i is None for i in ids]] = 0
    return out


def _hash_strings(values: list[str | None], buckets: int) -> np.ndarray:
    out = np.zeros(len(values), np.int64)
    for row, s in enumerate(values):
        if s is not None:
            digest = hashlib.blake2b(s.encode(), digest_size=8).digest()
            out[row] = int.from_bytes(digest, "little") % buckets
    return out


# ----------------------------------------------------------------------- transform


class _SparseFeature:
    """One sparse feature of transform.json: raw values -> int64 indices."""

    def __init__(self, name: str, entry: dict) -> None:
        self.name = name
        self.dtype = entry["dtype"]
        self.multi_hot = bool(entry["multi_hot"])
        self.buckets = entry["hash_buckets"] if entry["kind"] == "hash" else None
        self.vocabulary: dict = {}
        if self.buckets is None:
            # Holes (None: slots an incremental chain freed) map nothing.
            self.vocabulary = {
                value: i + 1 for i, value in enumerate(entry["values"]) if value is not None
            }

    def indices(self, values: list[Any]) -> np.ndarray:
        """(N,) raw values -> (N,) int64 indices: 0 for unseen/missing (vocabulary)."""
        if self.dtype == "int64":
            keys: list = [_as_int(v, self.name) for v in values]
        else:
            keys = [_as_str(v, self.name) for v in values]
        if self.buckets is not None:
            if self.dtype == "int64":
                return _hash_ints(keys, self.buckets)
            return _hash_strings(keys, self.buckets)
        return np.array([self.vocabulary.get(k, 0) for k in keys], dtype=np.int64)


def _dense_values(entry: dict, x: np.ndarray) -> np.ndarray:
    """(N,) float64 raw values (NaN = missing) -> float32 features or int64 buckets.

    The same operations, in the same order, as data_prep.transform's dense path.
    """
    if entry["fill"] is not None:
        x = np.where(np.isnan(x), entry["fill"], x)
    if entry["clip"] is not None:
        x = np.clip(x, entry["clip"][0], entry["clip"][1])
    if entry["log"]:
        x = np.log1p(np.maximum(x, 0.0))
    x = np.where(np.isnan(x), entry["mean"], x)
    if entry["bucketize"] is not None:
        return np.searchsorted(np.asarray(entry["bucketize"]), x, side="right").astype(np.int64)
    if entry["standardize"]:
        x = (x - entry["mean"]) / entry["std"]
    return x.astype(np.float32)


class RecordTransform:
    """A fitted transform (transform.json) applied to raw records.

    The input layout is the one the shard stage gives the model: ``sparse`` holds the
    single-valued sparse features and the bucketized dense features in schema order,
    ``dense`` the other dense features in schema order, then one ``multi_hot_<name>``
    per multi-hot feature.

    Args:
        transform: The parsed transform.json.

    Raises:
        ValueError: The transform is not of the format this scorer reads.
    """

    def __init__(self, transform: dict) -> None:
        if transform.get("format") != TRANSFORM_FORMAT:
            raise ValueError(
                f"transform format {transform.get('format')!r} is not {TRANSFORM_FORMAT!r}; "
                "this score.py belongs to another package version"
            )
        self.transform = transform
        self.sparse: list[str] = []  # input order of the `sparse` columns
        self.dense: list[str] = []
        self.multi_hot: list[str] = []
        self._features: dict[str, _SparseFeature] = {}
        for column in transform["columns"]:
            name, role = column["name"], column["role"]
            if role == "sparse":
                feature = _SparseFeature(name, transform["sparse"][name])
                self._features[name] = feature
                (self.multi_hot if feature.multi_hot else self.sparse).append(name)
            elif role == "dense":
                bucketized = transform["dense"][name]["bucketize"] is not None
                (self.sparse if bucketized else self.dense).append(name)

    @property
    def input_names(self) -> list[str]:
        """The ONNX input names, in order."""
        return ["sparse", "dense", *(f"multi_hot_{name}" for name in self.multi_hot)]

    def __call__(self, records: list[dict]) -> dict[str, np.ndarray]:
        """Raw records -> ONNX inputs.

        Returns:
            ``sparse`` (B, F) int64, ``dense`` (B, Dn) float32 and one
            ``multi_hot_<name>`` (B, L) int64 padded with -1 per multi-hot feature.
        """
        rows = len(records)
        sparse = np.empty((rows, len(self.sparse)), np.int64)
        for i, name in enumerate(self.sparse):
            sparse[:, i] = self._column(name, [r.get(name) for r in records])
        dense = np.empty((rows, len(self.dense)), np.float32)
        for i, name in enumerate(self.dense):
            dense[:, i] = self._column(name, [r.get(name) for r in records])
        inputs = {"sparse": sparse, "dense": dense}
        for name in self.multi_hot:
            inputs[f"multi_hot_{name}"] = self._lists(name, [r.get(name) for r in records])
        return inputs

    def column(self, name: str, values: list[Any]) -> np.ndarray | list[list[int]]:
        """One feature's model values: (N,) indices or floats, or N index lists."""
        if name in self.multi_hot:
            return [self._features[name].indices(v).tolist() for v in self._raw_lists(name, values)]
        return self._column(name, values)

    def _column(self, name: str, values: list[Any]) -> np.ndarray:
        if name in self._features:
            return self._features[name].indices(values)
        x = np.array([_as_float(v, name) for v in values], dtype=np.float64)
        return _dense_values(self.transform["dense"][name], x)

    def _raw_lists(self, name: str, values: list[Any]) -> list[list[Any]]:
        lists = []
        for value in values:
            if value is None:
                lists.append([])
            elif isinstance(value, list | tuple):
                lists.append(list(value))
            else:
                raise ValueError(f"field {name!r}: {value!r} is not a list (multi-hot feature)")
        return lists

    def _lists(self, name: str, values: list[Any]) -> np.ndarray:
        lists = self._raw_lists(name, values)
        lengths = [len(items) for items in lists]
        flat = self._features[name].indices([v for items in lists for v in items])
        out = np.full((len(lists), max([1, *lengths])), -1, dtype=np.int64)
        start = 0
        for row, length in enumerate(lengths):
            out[row, :length] = flat[start : start + length]
            start += length
        return out


# -------------------------------------------------------------------------- scorer


class PackageScorer:
    """The package's transform and ONNX model, loaded once.

    Args:
        package_dir: The package directory; default the directory of this file.

    Raises:
        FileNotFoundError: transform.json or model.onnx is missing.
        ValueError: The transform, signature.json and model.onnx disagree on the inputs.
    """

    def __init__(self, package_dir: str | Path | None = None) -> None:
        self.package_dir = Path(package_dir) if package_dir is not None else PACKAGE_DIR
        for name in ("transform.json", "model.onnx"):
            if not (self.package_dir / name).is_file():
                raise FileNotFoundError(f"{self.package_dir / name} is missing: not a package")
        self.transform = RecordTransform(
            json.loads((self.package_dir / "transform.json").read_text())
        )
        signature_path = self.package_dir / "signature.json"
        self.signature = json.loads(signature_path.read_text()) if signature_path.is_file() else {}
        self.tasks: list[str] = self.signature.get("tasks", [OUTPUT_NAME])
        self._check_signature()
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(
            str(self.package_dir / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        onnx_inputs = [i.name for i in self.session.get_inputs()]
        if onnx_inputs != self.transform.input_names:
            raise ValueError(
                f"model.onnx takes inputs {onnx_inputs}, the transform gives "
                f"{self.transform.input_names}; the package is inconsistent"
            )

    def _check_signature(self) -> None:
        expected = {
            "sparse": self.transform.sparse,
            "dense": self.transform.dense,
            **{f"multi_hot_{n}": [n] for n in self.transform.multi_hot},
        }
        for entry in self.signature.get("inputs", []):
            if expected.get(entry["name"]) != entry["features"]:
                raise ValueError(
                    f"signature.json input {entry['name']!r} has features {entry['features']}, "
                    f"the transform gives {expected.get(entry['name'])}; the package is "
                    "inconsistent"
                )

    def inputs(self, records: list[dict]) -> dict[str, np.ndarray]:
        """Raw records -> the ONNX inputs (see RecordTransform)."""
        return self.transform(records)

    def score(self, records: list[dict]) -> np.ndarray:
        """Probabilities of the raw records: (B,) float32 for one task, (B, T) for several.

        Raises:
            ValueError: No records, or a value that does not fit its field's type.
        """
        if not records:
            raise ValueError("no records to score")
        return self.session.run([OUTPUT_NAME], self.transform(records))[0]


_DEFAULT: PackageScorer | None = None


def score_records(records: list[dict], package_dir: str | Path | None = None) -> np.ndarray:
    """Score raw records with a package (default: the one this file lives in).

    Args:
        records: Raw records, dicts keyed by the raw field names.
        package_dir: Another package directory; the scorer of this file's own
            package is loaded once and kept.

    Returns:
        (B,) float32 probabilities for one task, (B, T) for several.
    """
    global _DEFAULT
    if package_dir is not None:
        return PackageScorer(package_dir).score(records)
    if _DEFAULT is None:
        _DEFAULT = PackageScorer()
    return _DEFAULT.score(records)


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    ms = np.asarray(seconds) * 1000.0
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def benchmark(scorer: PackageScorer, records: list[dict], repetitions: int) -> dict:
    """Wall-clock latency of scoring, raw records in, probabilities out.

    Times ``repetitions`` calls with one record each (cycling through the records) and
    ``repetitions`` calls with all records as one batch, after a few warm-up calls.

    Returns:
        ``p50_ms``/``p99_ms`` per one-record call, ``batch_p50_ms``/``batch_p99_ms``
        per call with the whole batch, ``rows`` and ``repetitions``.
    """
    for record in records[:5]:
        scorer.score([record])
    scorer.score(records)
    single = []
    for i in range(repetitions):
        started = time.perf_counter()
        scorer.score([records[i % len(records)]])
        single.append(time.perf_counter() - started)
    batch = []
    for _ in range(repetitions):
        started = time.perf_counter()
        scorer.score(records)
        batch.append(time.perf_counter() - started)
    p50, p99 = _percentiles(single)
    batch_p50, batch_p99 = _percentiles(batch)
    return {
        "rows": len(records),
        "repetitions": repetitions,
        "p50_ms": p50,
        "p99_ms": p99,
        "latency": "p50_ms/p99_ms: one call scoring one raw record (transform + onnxruntime)",
        "batch_p50_ms": batch_p50,
        "batch_p99_ms": batch_p99,
    }


def read_jsonl(path: str) -> list[dict]:
    """Records of a JSON-lines file ("-" reads stdin); blank lines are skipped."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    """The command line: score a JSON-lines file, or time the scorer on it."""
    parser = argparse.ArgumentParser(description="Score raw records with this model package.")
    parser.add_argument("records", help="JSON-lines file of raw records, or - for stdin")
    parser.add_argument(
        "--benchmark",
        type=int,
        metavar="N",
        help="instead of scores, print latency figures of N timed calls as one JSON line",
    )
    args = parser.parse_args(argv)
    records = read_jsonl(args.records)
    scorer = PackageScorer()
    if args.benchmark is not None:
        print(json.dumps(benchmark(scorer, records, max(args.benchmark, 1))))
        return 0
    scores = scorer.score(records).reshape(len(records), -1)  # (B, T)
    for row in scores.tolist():
        print(json.dumps(dict(zip(scorer.tasks, row, strict=True))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
