"""Ingest: raw behaviour logs -> clean typed events + quarantine.

Reads the files named by ``ingest.path`` (a file, directory, glob or fsspec URL;
CSV, TSV, JSONL or Parquet, optionally gzip/zstd/bz2 compressed), parses every
column with the type the schema declares (never inferred), and splits rows into

- ``events/part-NNNNN.parquet``: well-formed rows, typed, schema column order;
- ``quarantine/part-NNNNN.parquet``: bad rows with ``source``, ``location``,
  ``reason`` and the ``raw`` content, so nothing is silently dropped;
- ``validation.json``: row counts per file and per reason, and examples.

Every batch is read as text and validated column by column with vectorised
pyarrow kernels, so one bad value costs one quarantined row, not a failed read.
Memory is bounded by ``batch_rows``.
"""

import json
import posixpath
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from data_prep.errors import DataError, InputNotFoundError, SchemaError
from data_prep.schema import FieldSpec, SchemaConfig

Format = Literal["csv", "tsv", "jsonl", "parquet"]

_EXTENSIONS: dict[str, Format] = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_COMPRESSIONS = (".gz", ".zst", ".bz2")
_INT_RE = r"^\s*[+-]?\d+\s*$"
_FLOAT_RE = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"
# Longer digit strings may overflow int64 and are checked one by one.
_SAFE_INT_CHARS = 18
_QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("location", pa.string()),
        ("reason", pa.string()),
        ("raw", pa.string()),
    ]
)
_ARROW_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}


class IngestConfig(BaseModel):
    """How to read the raw logs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(description="A file, directory, glob or fsspec URL of the raw logs.")
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = Field(
        default="auto", description="File format; auto picks it from each file's extension."
    )
    max_bad_fraction: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Fail (without retry) when more than this fraction of rows is quarantined.",
    )
    batch_rows: int = Field(default=100_000, ge=1, description="Rows validated per batch.")
    rows_per_file: int = Field(
        default=1_000_000, ge=1, description="Clean rows per output Parquet file."
    )


@dataclass(frozen=True)
class IngestResult:
    """What ingest wrote."""

    out_dir: Path
    rows: int
    good_rows: int
    bad_rows: int
    reasons: dict[str, int]
    files: list[str] = field(default_factory=list)

    @property
    def bad_fraction(self) -> float:
        return self.bad_rows / self.rows if self.rows else 0.0


def resolve_inputs(path: str, fmt: str = "auto") -> list[tuple[str, Format]]:
    """Expand ``path`` into (url, format) pairs, sorted by name.

    Directories are searched recursively; names starting with ``_`` or ``.`` are
    metadata and skipped, as in Hive/Spark layouts.

    Raises:
        InputNotFoundError: the path does not exist or matches no data file.
        SchemaError: a file's format cannot be told from its extension.
    """
    fs, root = fsspec.core.url_to_fs(path)
    if any(ch in root for ch in "*?["):
        candidates = sorted(fs.glob(root))
    elif fs.isdir(root):
        candidates = sorted(fs.find(root))
    elif fs.isfile(root):
        candidates = [root]
    else:
        raise InputNotFoundError(
            f"ingest.path '{path}' does not exist. Point ingest.path at a file, directory or "
            "glob of raw logs (or create the synthetic default with `recforge generate CONFIG`)."
        )
    files = []
    for name in candidates:
        if any(part.startswith(("_", ".")) for part in name[len(root) :].split("/") if part):
            continue
        if fs.isdir(name):
            continue
        url = name if fs.protocol in ("file", ("file", "local")) else fs.unstrip_protocol(name)
        files.append((url, _detect_format(name, fmt)))
    if not files:
        raise InputNotFoundError(f"ingest.path '{path}' matches no data files.")
    return files


def describe_inputs(path: str, fmt: str = "auto") -> list[dict]:
    """Name, size and modification stamp of every input file, for cache fingerprints.

    Rewriting the raw logs in place changes the stamp, so ingest runs again.
    """
    described = []
    for url, _ in resolve_inputs(path, fmt):
        fs, name = fsspec.core.url_to_fs(url)
        info = fs.info(name)
        stamp = next((info[k] for k in ("mtime", "LastModified", "ETag", "md5") if k in info), None)
        described.append({"path": url, "size": info.get("size"), "stamp": stamp})
    return described


def _detect_format(name: str, fmt: str) -> Format:
    if fmt != "auto":
        return fmt  # type: ignore[return-value]
    stem = name
    for suffix in _COMPRESSIONS:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    ext = posixpath.splitext(stem)[1].lower()
    if ext not in _EXTENSIONS:
        raise SchemaError(
            f"cannot tell the format of '{name}' from its extension; set ingest.format "
            f"to one of csv, tsv, jsonl, parquet."
        )
    return _EXTENSIONS[ext]


def ingest_logs(
    config: IngestConfig,
    schema: SchemaConfig,
    out_dir: Path,
    on_progress: Callable[[int], None] | None = None,
) -> IngestResult:
    """Validate raw logs into typed events and a quarantine.

    Args:
        config: the ingest section.
        schema: the raw columns and their types.
        out_dir: an empty directory to write into (the caller publishes it).
        on_progress: called with the number of rows read so far.

    Returns:
        Row counts per outcome and reason.

    Raises:
        InputNotFoundError: no input files.
        SchemaError: a file lacks a schema column, or the quarantined fraction
            exceeds ``max_bad_fraction``.
        DataError: the inputs hold no rows at all.
    """
    inputs = resolve_inputs(config.path, config.format)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    events = _RollingWriter(out_dir / "events", _typed_schema(schema), config.rows_per_file)
    quarantine = _RollingWriter(out_dir / "quarantine", _QUARANTINE_SCHEMA, config.rows_per_file)
    reasons: Counter[str] = Counter()
    examples: list[dict] = []
    per_file = []
    total = 0
    try:
        for url, fmt in inputs:
            file_rows = file_bad = 0
            for batch, bad in _read_batches(url, fmt, schema, config.batch_rows):
                good, rejected = validate_batch(batch, schema, source=url, offset=file_rows)
                file_rows += batch.num_rows + bad.num_rows
                rejected = pa.concat_tables([bad, rejected])
                file_bad += rejected.num_rows
                events.write(good)
                quarantine.write(rejected)
                reasons.update(rejected.column("reason").to_pylist())
                if len(examples) < 5 and rejected.num_rows:
                    examples.extend(rejected.slice(0, 5 - len(examples)).to_pylist())
                if on_progress:
                    on_progress(total + file_rows)
            total += file_rows
            per_file.append({"path": url, "rows": file_rows, "bad_rows": file_bad})
    finally:
        events.close()
        quarantine.close()

    bad_rows = sum(reasons.values())
    result = IngestResult(
        out_dir=out_dir,
        rows=total,
        good_rows=total - bad_rows,
        bad_rows=bad_rows,
        reasons=dict(reasons.most_common()),
        files=[str(p.relative_to(out_dir)) for p in events.paths + quarantine.paths],
    )
    report = {
        "rows": result.rows,
        "good_rows": result.good_rows,
        "bad_rows": result.bad_rows,
        "bad_fraction": result.bad_fraction,
        "max_bad_fraction": config.max_bad_fraction,
        "reasons": result.reasons,
        "files": per_file,
        "examples": examples,
    }
    (out_dir / "validation.json").write_text(json.dumps(report, indent=2))
    if total == 0:
        raise DataError(f"ingest.path '{config.path}' holds no rows.")
    if result.bad_fraction > config.max_bad_fraction:
        top = ", ".join(f"{r} ({n})" for r, n in list(result.reasons.items())[:5])
        first = examples[0]
        raise SchemaError(
            f"{bad_rows} of {total} rows ({result.bad_fraction:.1%}) failed validation, above "
            f"ingest.max_bad_fraction={config.max_bad_fraction}. Top reasons: {top}. First bad "
            f"row: {first['source']} {first['location']}: {first['reason']}: "
            f"{first['raw'][:200]}. Fix the schema or the data, or raise ingest.max_bad_fraction."
        )
    return result


def _typed_schema(schema: SchemaConfig) -> pa.Schema:
    return pa.schema(
        [pa.field(f.name, _ARROW_TYPES[f.dtype], nullable=not f.required) for f in schema.fields]
    )


class _RollingWriter:
    """Writes tables into part-NNNNN.parquet files of at most ``rows_per_file`` rows."""

    def __init__(self, directory: Path, schema: pa.Schema, rows_per_file: int) -> None:
        self.directory = directory
        self.schema = schema
        self.rows_per_file = rows_per_file
        self.paths: list[Path] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0

    def write(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            if self._writer is None or self._rows_in_file >= self.rows_per_file:
                self._open_next()
            take = min(table.num_rows - offset, self.rows_per_file - self._rows_in_file)
            self._writer.write_table(table.slice(offset, take).cast(self.schema))
            self._rows_in_file += take
            offset += take

    def _open_next(self) -> None:
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"part-{len(self.paths):05d}.parquet"
        self._writer = pq.ParquetWriter(path, self.schema)
        self.paths.append(path)
        self._rows_in_file = 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _read_batches(
    url: str, fmt: Format, schema: SchemaConfig, batch_rows: int
) -> Iterator[tuple[pa.Table, pa.Table]]:
    """Yield (text batch with one string column per schema field, unparseable rows)."""
    names = [f.name for f in schema.fields]
    with fsspec.open(url, "rb", compression="infer") as handle:
        if fmt in ("csv", "tsv"):
            yield from _read_csv(handle, url, names, "\t" if fmt == "tsv" else ",", batch_rows)
        elif fmt == "jsonl":
            yield from _read_jsonl(handle, url, names, batch_rows)
        else:
            yield from _read_parquet(handle, url, names, batch_rows)


def _read_csv(handle, url: str, names: list[str], delimiter: str, batch_rows: int):
    unparseable: list[dict] = []

    def on_invalid(row: pacsv.InvalidRow) -> str:
        unparseable.append(
            {
                "source": url,
                "location": f"line {row.number}" if row.number and row.number > 0 else "line ?",
                "reason": f"parse_error: expected {row.expected_columns} fields, "
                f"got {row.actual_columns}",
                "raw": row.text,
            }
        )
        return "skip"

    try:
        reader = pacsv.open_csv(
            handle,
            read_options=pacsv.ReadOptions(block_size=1 << 22),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, invalid_row_handler=on_invalid),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.string() for n in names},
                include_columns=names,
                strings_can_be_null=True,
                null_values=[""],
            ),
        )
    except (pa.ArrowInvalid, KeyError) as err:
        raise SchemaError(
            f"{url}: cannot read the header with the schema's columns {names}: {err}. "
            "Rename the schema fields or fix the file."
        ) from err
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    for batch in reader:
        pending.append(batch)
        pending_rows += batch.num_rows
        if pending_rows >= batch_rows:
            yield _flush(pending, names), _take_unparseable(unparseable)
            pending, pending_rows = [], 0
    if pending or unparseable:
        yield _flush(pending, names), _take_unparseable(unparseable)


def _flush(batches: list[pa.RecordBatch], names: list[str]) -> pa.Table:
    if not batches:
        return pa.table({n: pa.array([], pa.string()) for n in names})
    return pa.Table.from_batches(batches).select(names)


def _take_unparseable(rows: list[dict]) -> pa.Table:
    table = pa.Table.from_pylist(list(rows), schema=_QUARANTINE_SCHEMA)
    rows.clear()
    return table


def _check_columns(url: str, expected: list[str], present: list[str]) -> None:
    missing = [n for n in expected if n not in present]
    if missing:
        raise SchemaError(
            f"{url}: column(s) {missing} named in schema.fields are missing from the file "
            f"(it has {present}). Rename the schema fields or fix the file."
        )


def _read_jsonl(handle, url: str, names: list[str], batch_rows: int):
    columns: dict[str, list[str | None]] = {n: [] for n in names}
    unparseable: list[dict] = []
    for number, raw_line in enumerate(handle, start=1):
        line = raw_line.decode("utf-8", errors="replace").strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            record, problem = None, f"parse_error: invalid JSON ({err.msg})"
        else:
            problem = None if isinstance(record, dict) else "parse_error: not a JSON object"
        if problem:
            unparseable.append(
                {"source": url, "location": f"line {number}", "reason": problem, "raw": line}
            )
            continue
        for n in names:
            columns[n].append(_json_text(record.get(n)))
        if len(columns[names[0]]) >= batch_rows:
            yield _text_table(columns), _take_unparseable(unparseable)
            columns = {n: [] for n in names}
    if columns[names[0]] or unparseable:
        yield _text_table(columns), _take_unparseable(unparseable)


def _json_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        # JSON true/false is not a number: keep it textual so the type check rejects it.
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


def _text_table(columns: dict[str, list[str | None]]) -> pa.Table:
    return pa.table({n: pa.array(v, pa.string()) for n, v in columns.items()})


def _read_parquet(handle, url: str, names: list[str], batch_rows: int):
    parquet = pq.ParquetFile(handle)
    _check_columns(url, names, parquet.schema_arrow.names)
    empty = pa.Table.from_pylist([], schema=_QUARANTINE_SCHEMA)
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=names):
        # Going through text keeps one validation path for every format.
        table = pa.table({n: pc.cast(batch.column(n), pa.string()) for n in names})
        yield table, empty


def validate_batch(
    batch: pa.Table, schema: SchemaConfig, source: str, offset: int = 0
) -> tuple[pa.Table, pa.Table]:
    """Type and check one batch of text columns.

    Args:
        batch: one string column per schema field.
        schema: the declared types and roles.
        source: file name recorded with quarantined rows.
        offset: records of this file before the batch, for 1-based record numbers.

    Returns:
        (typed good rows in schema order, quarantined rows with reasons). Each bad row
        carries the first failed check, e.g. ``not_float64:price``.
    """
    n = batch.num_rows
    reason = pa.nulls(n, pa.string())
    typed = {}
    for spec in schema.fields:
        text = batch.column(spec.name).combine_chunks() if n else pa.array([], pa.string())
        values, problems = _parse_column(text, spec, schema)
        typed[spec.name] = values
        for label, mask in problems:
            reason = pc.if_else(pc.and_(pc.is_null(reason), mask), label, reason)
    good_mask = pc.is_null(reason)
    good = pa.table(typed).filter(good_mask)
    bad_mask = pc.invert(good_mask)
    bad_idx = pc.indices_nonzero(bad_mask).to_numpy()
    if len(bad_idx) == 0:
        return good, pa.Table.from_pylist([], schema=_QUARANTINE_SCHEMA)
    raw_rows = batch.take(bad_idx).to_pylist()
    bad = pa.table(
        {
            "source": [source] * len(bad_idx),
            "location": [f"record {offset + int(i) + 1}" for i in bad_idx],
            "reason": reason.filter(bad_mask),
            "raw": [json.dumps(r) for r in raw_rows],
        },
        schema=_QUARANTINE_SCHEMA,
    )
    return good, bad


def _parse_column(
    text: pa.Array, spec: FieldSpec, schema: SchemaConfig
) -> tuple[pa.Array, list[tuple[str, pa.Array]]]:
    """Parse one text column; return typed values and (reason, mask) checks in order."""
    missing = pc.or_(pc.is_null(text), pc.equal(pc.utf8_length(pc.fill_null(text, "")), 0))
    missing = pc.fill_null(missing, True)
    checks: list[tuple[str, pa.Array]] = []
    if spec.required:
        checks.append((f"missing:{spec.name}", missing))
    if spec.dtype == "string":
        return pc.if_else(missing, pa.scalar(None, pa.string()), text), checks

    present = pc.invert(missing)
    if spec.dtype == "int64":
        well_formed = pc.fill_null(pc.match_substring_regex(text, _INT_RE), False)
        trimmed = pc.utf8_trim_whitespace(text)
        too_long = pc.greater(pc.utf8_length(pc.fill_null(trimmed, "")), _SAFE_INT_CHARS + 1)
        overflow = _int64_overflow(trimmed, pc.and_(well_formed, too_long))
        ok = pc.and_(well_formed, pc.invert(overflow))
        checks.append((f"not_int64:{spec.name}", pc.and_(present, pc.invert(well_formed))))
        checks.append((f"int64_overflow:{spec.name}", pc.and_(present, overflow)))
        values = pc.cast(pc.if_else(ok, trimmed, "0"), pa.int64())
    else:
        well_formed = pc.fill_null(pc.match_substring_regex(text, _FLOAT_RE), False)
        values = pc.cast(pc.if_else(well_formed, pc.utf8_trim_whitespace(text), "0"), pa.float64())
        finite = pc.is_finite(values)
        ok = pc.and_(well_formed, finite)
        checks.append((f"not_float64:{spec.name}", pc.and_(present, pc.invert(well_formed))))
        checks.append((f"not_finite:{spec.name}", pc.and_(present, pc.invert(finite))))

    if spec.role == "label":
        allowed = pc.is_in(values, value_set=pa.array(schema.label_values, pa.int64()))
        checks.append((f"label_out_of_range:{spec.name}", pc.and_(ok, pc.invert(allowed))))
    elif spec.role == "timestamp":
        in_range = pc.and_(
            pc.greater_equal(values, schema.min_timestamp),
            pc.less_equal(values, schema.max_timestamp),
        )
        checks.append((f"timestamp_out_of_range:{spec.name}", pc.and_(ok, pc.invert(in_range))))
    return pc.if_else(ok, values, pa.scalar(None, values.type)), checks


def _int64_overflow(text: pa.Array, candidates: pa.Array) -> pa.Array:
    """Mark long digit strings that do not fit int64 (rare, so checked in Python)."""
    flags = [False] * len(text)
    for i in pc.indices_nonzero(pc.fill_null(candidates, False)).to_pylist():
        value = int(text[i].as_py())
        flags[i] = not (-(2**63) <= value < 2**63)
    return pa.array(flags, pa.bool_())
