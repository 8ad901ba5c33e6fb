"""A CTR package's own scorer: raw test records for it, and infra validation.

The package carries `score.py` (a copy of `training/ctr/package_scorer.py`: numpy,
onnxruntime and the standard library only) that maps raw records through
`transform.json` and scores them with `model.onnx`. This module

- writes that file into a package (`write_scorer`);
- finds the raw (clean, typed, pre-transform) events of the first test rows in the
  ingest output (`raw_test_records`), and adds records with never-seen ids and strings
  (`with_unseen_records`);
- starts a fresh interpreter in the package directory that imports nothing but the
  scorer, scores the records, times it and reports (`infra_validate`).

Reads ingest's `events/*.parquet`, the shard directory and `transform.json`; writes only
`score.py` into the package. No Prefect, no environment reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from artifacts.errors import DataError
from data_prep.transform import TransformApplier
from training.ctr.data import DatasetMeta, iter_tables, model_columns
from training.errors import ParityError

SCORER_FILE = "score.py"
# The scorer ships as the package's own file, so the module is named, not imported (the
# stage fingerprints follow module names in strings as imports).
SCORER_MODULE = "training.ctr.package_scorer"
SCORER_SOURCE = Path(__file__).with_name(SCORER_MODULE.rpartition(".")[2] + ".py")
INFRA_VALIDATION_FILE = "infra_validation.json"
# Top-level modules the package's scorer must not pull in: this repository's packages,
# and torch (the package serves through onnxruntime).
FORBIDDEN_MODULES = ("training", "data_prep", "tasks", "flows", "torch")

# Runs in the fresh interpreter (python -I: no PYTHONPATH, no user site, and neither the
# working directory nor a script directory on sys.path), with cwd = the package.
# stdin: {"records": [...], "repetitions": n}; stdout: one JSON object.
_DRIVER = """
import json, sys
sys.path.insert(0, ".")
request = json.load(sys.stdin)
import score
scorer = score.PackageScorer(".")
records = request["records"]
scores = scorer.score(records)
report = score.benchmark(scorer, records, request["repetitions"])
forbidden = tuple(request["forbidden"])
report["leaked_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
report["scores"] = scores.tolist()
report["score_shape"] = list(scores.shape)
report["score_dtype"] = str(scores.dtype)
report["python"] = sys.version.split()[0]
report["onnxruntime"] = score.onnxruntime.__version__
print(json.dumps(report))
"""


def write_scorer(package_dir: Path) -> Path:
    """Copy the raw-record scorer into a package as `score.py`; returns its path."""
    target = Path(package_dir) / SCORER_FILE
    shutil.copyfile(SCORER_SOURCE, target)
    return target


def raw_test_records(
    events_dir: Path | Sequence[Path],
    shards_dir: Path,
    meta: DatasetMeta,
    transform: dict,
    rows: int,
    split: str = "test",
) -> tuple[list[dict], pa.Table]:
    """The raw events of the first `rows` test rows of the shards, in test order.

    The test (and valid) shards keep preprocess's input order (event files in name
    order, then row order), so the first test rows are a subsequence of the events in
    input order. The events whose timestamp is one of those rows' are transformed with
    the fitted transform and matched in order against the shard rows (every model
    column, the labels and the timestamp equal): the first match is taken. So each
    record returned transforms exactly into its shard row, whatever the split method.
    The rows are those `iter_tables(shards_dir, meta, split, 0, 1, ...)` yields first,
    the rows whose scores the evaluate stage saves (`scores_head.npy`).

    Args:
        events_dir: The clean typed event files ingest's manifest lists under `events/`
            (`event_files`), or, for a directory only this process wrote, that directory.
        shards_dir: The shard directory.
        meta: Its dataset description.
        transform: The fitted transform the shards were made with.
        rows: How many test rows (fewer when the split is shorter).
        split: The split to take them from: "test", or the split evaluate scored.

    Returns:
        (records as dicts of raw field values, the matching shard rows).

    Raises:
        DataError: No event files, or the events do not hold the shards' test rows
            (they come from another ingest output).
    """
    ts_name = transform["timestamp"]
    columns = model_columns(meta, list(meta.labels))
    tables = iter_tables(shards_dir, meta, split, 0, 1, rows, [*columns, ts_name], False)
    shard_rows = next(iter(tables), None)
    files = event_files(events_dir)
    if shard_rows is None or not files:
        raise DataError(f"no {split} rows in {shards_dir} or no event files in {events_dir}")
    wanted = shard_rows.to_pylist()
    keys = [tuple(row[c] for c in [*columns, ts_name]) for row in wanted]
    timestamps = pa.array(sorted({row[ts_name] for row in wanted}), pa.int64())
    low, high = timestamps[0].as_py(), timestamps[-1].as_py()
    applier = TransformApplier(transform)
    records: list[dict] = []
    for path in files:
        parquet = pq.ParquetFile(path)
        for group in _row_groups_within(parquet, ts_name, low, high):
            for batch in parquet.iter_batches(row_groups=[group]):
                batch = batch.filter(pc.is_in(batch.column(ts_name), value_set=timestamps))
                if batch.num_rows == 0:
                    continue
                transformed = applier(batch).select([*columns, ts_name]).to_pylist()
                for raw, row in zip(batch.to_pylist(), transformed, strict=True):
                    if tuple(row.values()) == keys[len(records)]:
                        records.append(raw)
                        if len(records) == len(keys):
                            return records, shard_rows
    raise DataError(
        f"only {len(records)} of the first {len(keys)} {split} rows of {shards_dir} were found "
        f"among the events of {events_dir}; pass the ingest output these shards were made from"
    )


def event_files(events: Path | Sequence[Path]) -> list[Path]:
    """The event files to read: the given list, which the stage layer takes from ingest's
    signed manifest (`artifacts.store.listed_files`: a file planted beside the listed
    ones is never read), or, given a directory only this process wrote (tests), its
    ``*.parquet`` files, in name order."""
    if isinstance(events, Path | str):
        return sorted(Path(events).glob("*.parquet"))
    return sorted(Path(path) for path in events)


def _row_groups_within(parquet: pq.ParquetFile, ts_name: str, low: int, high: int) -> list[int]:
    """Row groups whose timestamp statistics overlap [low, high] (all, without statistics)."""
    metadata = parquet.metadata
    paths = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
    position = paths.index(ts_name)
    groups = []
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(position).statistics
        if stats is not None and stats.has_min_max and (stats.max < low or stats.min > high):
            continue
        groups.append(group)
    return groups


def with_unseen_records(records: list[dict], transform: dict, count: int) -> list[dict]:
    """`records` plus `count` copies of its first records with never-seen values.

    Every vocabulary feature gets a value outside its vocabulary (an int above the
    largest id, or a new string), every hashed feature a new value; multi-hot lists get
    an unseen element beside a known one, and every third copy an empty list and
    missing dense values (the train-mean fill).

    Args:
        records: Raw records (at least one when count > 0).
        transform: The fitted transform.
        count: How many records to add.

    Returns:
        A new list: the records, then the altered copies.
    """
    added = []
    for k in range(count):
        record = dict(records[k % len(records)])
        for name, entry in transform["sparse"].items():
            known = entry.get("values") or []
            if entry["dtype"] == "int64":
                ints = [v for v in known if v is not None]
                unseen: Any = (max(ints) if ints else 0) + 1 + k
                if entry["kind"] == "hash":
                    unseen = (1 << 62) + 7919 * k
            else:
                unseen = f"never-seen-{name}-{k}"
            if entry["multi_hot"]:
                record[name] = [] if k % 3 == 2 else [unseen, *known[:1]]
            else:
                record[name] = unseen
        if k % 3 == 2:
            record.update(dict.fromkeys(transform["dense"], None))
        added.append(record)
    return [*records, *added]


def infra_validate(
    package_dir: Path,
    records: list[dict],
    expected: np.ndarray | None = None,
    atol: float = 1e-5,
    repetitions: int = 100,
    timeout_s: float = 600.0,
) -> dict:
    """Score raw records with the package's own scorer in a fresh Python process.

    The process is `sys.executable -I -B` (no PYTHONPATH, no user site packages, nothing
    of this repository on its path but what the interpreter itself installs, no .pyc
    written into the package) with the package directory as its working directory; it
    imports `score.py` only, scores the records, times `repetitions` one-record calls
    and `repetitions` whole-batch calls, and lists the FORBIDDEN_MODULES it imported.

    Args:
        package_dir: The package directory.
        records: Raw records (dicts of raw field values, JSON-serialisable).
        expected: The trained model's scores of the same records, to compare with.
        atol: Largest allowed |score - expected|.
        repetitions: Timed calls per latency figure.
        timeout_s: Seconds the process may take.

    Returns:
        The report: `rows`, `p50_ms`/`p99_ms` (one-record call latency),
        `batch_p50_ms`/`batch_p99_ms` (one call with all rows), `repetitions`,
        `scores`, `score_shape`, `max_abs_diff` (with `expected`), `leaked_modules`,
        `python`, `onnxruntime`.

    Raises:
        ParityError: The process fails or times out, imports recforge (or torch),
            returns the wrong number of scores or non-finite ones, or scores differ
            from `expected` by more than `atol`.
    """
    package_dir = Path(package_dir)
    request = {"records": records, "repetitions": repetitions, "forbidden": FORBIDDEN_MODULES}
    try:
        process = subprocess.run(
            [sys.executable, "-I", "-B", "-c", _DRIVER],
            cwd=package_dir,
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as err:
        raise ParityError(
            f"infra validation of {package_dir}: scoring {len(records)} records took over "
            f"{timeout_s:g} s in a fresh process"
        ) from err
    except OSError as err:  # e.g. the package directory does not exist
        raise ParityError(f"infra validation of {package_dir} could not start: {err}") from err
    if process.returncode != 0:
        tail = "\n".join(process.stderr.strip().splitlines()[-8:])
        raise ParityError(
            f"infra validation of {package_dir}: the package's {SCORER_FILE} failed in a fresh "
            f"process (exit {process.returncode}):\n{tail}"
        )
    report = json.loads(process.stdout.strip().splitlines()[-1])
    if report["leaked_modules"]:
        raise ParityError(
            f"infra validation of {package_dir}: {SCORER_FILE} imported "
            f"{report['leaked_modules']}; a package must score with numpy and onnxruntime only"
        )
    scores = np.asarray(report["scores"], dtype=np.float64)
    if len(scores) != len(records) or not np.all(np.isfinite(scores)):
        raise ParityError(
            f"infra validation of {package_dir}: {len(scores)} scores for {len(records)} "
            f"records, finite: {bool(np.all(np.isfinite(scores)))}"
        )
    if expected is not None:
        expected = np.asarray(expected, dtype=np.float64)
        diff = float(np.max(np.abs(scores - expected))) if scores.shape == expected.shape else None
        if diff is None or not diff <= atol:
            worst = "shape" if diff is None else f"{diff:.3g}"
            raise ParityError(
                f"infra validation of {package_dir}: the package's scores of {len(records)} raw "
                f"records differ from the trained model's (max |diff| {worst} > {atol:g}, "
                f"shapes {list(scores.shape)} vs {list(expected.shape)}); the package's "
                "transform does not reproduce data_prep's"
            )
        report["max_abs_diff"] = diff
    return report
