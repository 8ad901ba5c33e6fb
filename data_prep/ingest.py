"""Ingest: raw behaviour logs -> clean typed events + quarantine.

Reads the files named by ``ingest.path`` (a file, directory, glob or fsspec URL;
CSV/TSV with or without a header and with any delimiter, JSONL or Parquet,
optionally gzip/zstd/bz2 compressed; see ``data_prep.readers``), types every column
as the schema declares (never inferred), and writes

- ``events/part-<file>-<k>.parquet``: well-formed rows, typed, in schema column order
  and input order (a multi-hot field as ``list<int64>``/``list<string>``, a thresholded
  label as int64 0/1, a generated timestamp as the global record number);
- ``quarantine/part-<file>-<k>.parquet``: bad rows with ``source``, ``location``,
  ``reason``, the ``raw`` content and the global ``record`` number, so nothing is
  silently dropped;
- ``validation.json``: row counts in total, per reason and per file, and examples.

Each bad row carries the first failed check, fields in schema order, e.g.
``not_int64:user_id``, ``invalid_utf8:city``, ``duplicate_row``. Besides type and
range checks:

- a row whose schema columns all equal those of an earlier row of the same file is a
  ``duplicate_row``; the first is kept. Values compare typed (``4.0`` equals ``4.00``; a
  thresholded label by its raw number; a generated timestamp not at all). Duplicates
  across files are not detected, so memory stays bounded per file: 8 bytes per distinct
  row, a 64-bit row hash (two different rows share one with probability about
  rows**2 / 2**65);
- a file whose bytes equal an earlier input file's is a replay: all its records are
  quarantined as ``duplicate_file:<earlier file>`` without parsing it.

The work is one call of ``ingest_file`` per input file (each writes its own parts)
and ``combine_reports`` over their reports, so that a task runner can map over files;
``ingest_logs`` runs them on a thread per core (in order when records are numbered
across files). The output is the same bytes for the same input, whatever pyarrow's
thread count or the number of files ingested at once. The output directory may be an
fsspec URL (``artifacts.locations``): then every file is written through fsspec by
whoever runs the step, with the same bytes.
"""

import json
import posixpath
import queue
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal, TypeVar

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from artifacts.errors import DataError, InputNotFoundError
from artifacts.fingerprint import content_sha256
from artifacts.locations import (
    Location,
    as_location,
    close_output,
    join,
    open_output,
    safe_join,
    write_text,
)
from data_prep.errors import SchemaError, preview
from data_prep.preprocess import ordered_map
from data_prep.readers import Format, TextBatch, read_batches
from data_prep.schema import FieldSpec, SchemaConfig
from data_prep.transform import splitmix64

# A partition folder name (ingest.partition): one segment, no path syntax.
_PARTITION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=-]*")

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
# nan and inf are floats, so they fail as not_finite rather than not_float64.
_FLOAT_RE = r"^\s*[+-]?((\d+\.?\d*|\.\d+)(e[+-]?\d+)?|nan|inf|infinity)\s*$"
# Longer digit strings may overflow int64 and are checked one by one.
_SAFE_INT_CHARS = 18
_EXAMPLES = 5
QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("location", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("raw", pa.string(), nullable=False),
        pa.field("record", pa.int64(), nullable=False),
    ]
)
T = TypeVar("T")
_ARROW_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}


class IngestConfig(BaseModel):
    """How to read the raw logs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(description="A file, directory, glob or fsspec URL of the raw logs.")
    partition: str | None = Field(
        default=None,
        max_length=128,
        description="One partition to ingest instead of all of `path`: a folder directly "
        "under the `path` directory, e.g. `dt=2026-12-05` (letters, digits, `_ . = -`; "
        "no `/`). Cached by content like any input.",
    )
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = Field(
        default="auto", description="File format; auto picks it from each file's extension."
    )
    header: bool = Field(
        default=True,
        description="CSV/TSV: the first line names the columns. Without a header the columns "
        "are the schema fields in order (generated fields excluded).",
    )
    delimiter: str | None = Field(
        default=None,
        min_length=1,
        description="CSV/TSV field delimiter (default ',' for csv, tab for tsv). It may be "
        "several characters, such as MovieLens '::'; quoting is then off.",
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

    @field_validator("partition")
    @classmethod
    def _partition_is_a_folder_name(cls, value: str | None) -> str | None:
        # A partition may come from the UI or a schedule: one plain folder name, never a
        # path that climbs out of ingest.path or names another location.
        if value is not None and not _PARTITION_NAME.fullmatch(value):
            raise ValueError(
                f"{value[:80]!r} is not a partition folder name: use letters, digits and "
                "'_ . = -', starting with a letter or digit (e.g. dt=2026-12-05)"
            )
        return value

    @model_validator(mode="after")
    def _partition_needs_a_directory(self) -> "IngestConfig":
        if self.partition is not None and any(ch in self.path for ch in "*?["):
            raise ValueError(
                f"ingest.partition names a folder under ingest.path, which is a glob "
                f"({self.path!r}); point ingest.path at the directory of the partitions"
            )
        return self

    def source(self) -> Location:
        """Where the raw logs are read from: `path`, or its `partition` folder (joined
        by `safe_join`: a symlinked partition that leads outside `path` is refused)."""
        if self.partition is None:
            return self.path
        return safe_join(self.path.rstrip("/"), self.partition, "ingest.partition")

    @field_validator("delimiter")
    @classmethod
    def _delimiter_is_usable(cls, value: str | None) -> str | None:
        if value is not None and any(ch in value for ch in '\r\n"\x1d\x1e\x1f'):
            raise ValueError(
                f"delimiter {value!r} may not contain a newline, a double quote or the control "
                "characters \\x1d-\\x1f"
            )
        return value


@dataclass(frozen=True)
class IngestResult:
    """What ingest wrote."""

    out_dir: Location
    rows: int
    good_rows: int
    bad_rows: int
    reasons: dict[str, int]
    files: list[str] = field(default_factory=list)

    @property
    def bad_fraction(self) -> float:
        return self.bad_rows / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class FileReport:
    """What ingesting one input file wrote.

    Attributes:
        path: the input file.
        part: its index among the inputs; its outputs are named ``part-<part>-<k>``.
        record_offset: records of the inputs before it (its first global record number).
        rows: its records, quarantined ones included.
        good_rows: records written to events.
        reasons: quarantined records per reason.
        examples: the first few quarantined rows.
        files: output files, relative to the ingest output directory.
        duplicate_of: the earlier input file with the same bytes, for a replayed file.
    """

    path: str
    part: int
    record_offset: int
    rows: int
    good_rows: int
    reasons: dict[str, int]
    examples: list[dict]
    files: list[str]
    duplicate_of: str | None = None

    @property
    def bad_rows(self) -> int:
        return self.rows - self.good_rows


def _input_base(root: str) -> str:
    """What input names are relative to: a glob's directory above its first wildcard
    segment (metadata names are looked for below it), else `root` itself."""
    if not any(ch in root for ch in "*?["):
        return root
    parts = root.split("/")
    return "/".join(parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))])


def resolve_inputs(path: str, fmt: str = "auto") -> list[tuple[str, Format]]:
    """Expand ``path`` into (url, format) pairs, sorted by name.

    Directories are searched recursively; names starting with ``_`` or ``.`` are
    metadata and skipped, as in Hive/Spark layouts.

    Raises:
        InputNotFoundError: the path does not exist or matches no data file.
        SchemaError: a file's format cannot be told from its extension.
    """
    fs, root = fsspec.core.url_to_fs(path)
    base = _input_base(root)
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
        if any(part.startswith(("_", ".")) for part in name[len(base) :].split("/") if part):
            continue
        if fs.isdir(name):
            continue
        url = name if fs.protocol in ("file", ("file", "local")) else fs.unstrip_protocol(name)
        files.append((url, _detect_format(name, fmt)))
    if not files:
        raise InputNotFoundError(f"ingest.path '{path}' matches no data files.")
    return files


def check_partition(config: IngestConfig) -> None:
    """A named `ingest.partition` must be a folder under `ingest.path`.

    Raises:
        InputNotFoundError: It is not; the message names the newest partitions there.
        UnsafeName: It leads outside `ingest.path` (a symlink).
    """
    if config.partition is None:
        return
    fs, root = fsspec.core.url_to_fs(str(config.source()))
    if fs.isdir(root):
        return
    base_fs, base = fsspec.core.url_to_fs(config.path)
    try:
        names = sorted(
            posixpath.basename(entry["name"].rstrip("/"))
            for entry in base_fs.ls(base, detail=True)
            if entry.get("type") == "directory"
        )
    except OSError:
        names = []
    shown = ", ".join(repr(name[:40]) for name in names[-5:]) or "none"
    raise InputNotFoundError(
        f"ingest.partition '{config.partition}' is not a folder under ingest.path "
        f"'{config.path}' (the newest there: {shown}); name one that has arrived, e.g. "
        f"--set ingest.partition={names[-1][:40] if names else 'dt=YYYY-MM-DD'}"
    )


def describe_inputs(path: str, fmt: str = "auto") -> list[dict]:
    """Name, size and sha256 of every input file, for cache fingerprints.

    Keyed by content, not by where the files are: the name is relative to ``path``
    (a directory, or a glob's directory), so the same files copied elsewhere, or touched,
    describe the same, and one changed byte does not (`artifacts.fingerprint.content_sha256`,
    computed once per version of a file).
    """
    fs, root = fsspec.core.url_to_fs(path)
    base = _input_base(root)
    if not any(ch in root for ch in "*?[") and not fs.isdir(root):
        base = root.rsplit("/", 1)[0]  # a single file is named by its base name
    described = []
    for url, _ in resolve_inputs(path, fmt):
        _, name = fsspec.core.url_to_fs(url)
        inside = name.startswith(base.rstrip("/") + "/")
        relative = name[len(base) :].lstrip("/") if inside else posixpath.basename(name)
        described.append(
            {"name": relative, "size": fs.info(name).get("size"), "sha256": content_sha256(url)}
        )
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


def event_schema(schema: SchemaConfig) -> pa.Schema:
    """The Arrow schema of the clean events ingest writes for ``schema``."""
    fields = []
    for spec in schema.fields:
        kind = pa.int64() if spec.threshold is not None else _ARROW_TYPES[spec.dtype]
        if spec.multi_hot:
            kind = pa.list_(kind)
        nullable = not spec.required and spec.generated is None
        fields.append(pa.field(spec.name, kind, nullable=nullable))
    return pa.schema(fields)


def ingest_logs(
    config: IngestConfig,
    schema: SchemaConfig,
    out_dir: Location,
    on_progress: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> IngestResult:
    """Validate raw logs into typed events and a quarantine.

    Files are ingested in parallel, one thread per core (pyarrow's parser, compute
    kernels and Parquet writer and numpy release the GIL), each into its own output
    files, and their reports combined in input order; the output is the same bytes
    whatever the number of threads. A schema with a generated timestamp numbers records
    across files, so then the files are read one after another, in order.

    Args:
        config: the ingest section.
        schema: the raw columns and their types.
        out_dir: an empty directory to write into (the caller publishes it), or a URL.
        on_progress: called with the number of rows read so far (per batch when the
            files are read in order, per file when they are read in parallel).
        workers: files ingested at once; default ``pyarrow.cpu_count()``.

    Returns:
        Row counts per outcome and reason.

    Raises:
        InputNotFoundError: no input files.
        SchemaError: a file lacks a schema column, or the quarantined fraction
            exceeds ``max_bad_fraction``.
        DataError: the inputs hold no rows at all.
    """
    inputs = resolve_inputs(str(config.source()), config.format)
    out_dir = as_location(out_dir)
    if isinstance(out_dir, Path):
        out_dir.mkdir(parents=True, exist_ok=True)
    originals = find_replays([url for url, _ in inputs])
    if workers is None:
        workers = pa.cpu_count()
    if not numbers_records_globally(schema) and workers > 1:
        return _ingest_in_parallel(config, schema, out_dir, inputs, originals, workers, on_progress)
    reports: list[FileReport] = []
    offset = 0
    for part, (url, fmt) in enumerate(inputs):
        start = offset if numbers_records_globally(schema) else 0
        if originals[part] is not None:
            report = quarantine_replayed_file(
                config, url, reports[originals[part]], out_dir, part, start
            )
            if on_progress is not None:
                on_progress(offset + report.rows)
        else:
            progress = None
            if on_progress is not None:
                done = offset

                def progress(rows: int, done: int = done) -> None:
                    on_progress(done + rows)

            report = ingest_file(config, schema, url, fmt, out_dir, part, start, progress)
        reports.append(report)
        offset += report.rows
    return combine_reports(config, out_dir, reports)


def _ingest_in_parallel(
    config: IngestConfig,
    schema: SchemaConfig,
    out_dir: Location,
    inputs: list[tuple[str, Format]],
    originals: list[int | None],
    workers: int,
    on_progress: Callable[[int], None] | None,
) -> IngestResult:
    """``ingest_logs`` for files that number their records from 0: any order, any threads."""
    originals_of = [part for part, original in enumerate(originals) if original is None]

    def ingest(index: int) -> FileReport:
        part = originals_of[index]
        url, fmt = inputs[part]
        return ingest_file(config, schema, url, fmt, out_dir, part)

    reports: dict[int, FileReport] = {}
    done = 0
    for report in ordered_map(ingest, range(len(originals_of)), workers):
        reports[report.part] = report
        done += report.rows
        if on_progress is not None:
            on_progress(done)
    for part, (url, _) in enumerate(inputs):
        if originals[part] is not None:
            reports[part] = quarantine_replayed_file(
                config, url, reports[originals[part]], out_dir, part
            )
            done += reports[part].rows
            if on_progress is not None:
                on_progress(done)
    return combine_reports(config, out_dir, [reports[p] for p in sorted(reports)])


def numbers_records_globally(schema: SchemaConfig) -> bool:
    """Whether record numbers run across files (a generated timestamp needs file order).

    Otherwise each file numbers its records from 1, so files can be ingested in any
    order, in parallel, with the same output.
    """
    return any(f.generated for f in schema.fields)


def find_replays(urls: list[str]) -> list[int | None]:
    """For each file, the index of an earlier file with the same bytes, or None.

    Only files of equal size are hashed.
    """
    finder = _ReplayFinder()
    found: list[int | None] = []
    for i, url in enumerate(urls):
        found.append(
            next(
                (j for j in range(i) if found[j] is None and finder.same_bytes(urls[j], url)),
                None,
            )
        )
    return found


def ingest_file(
    config: IngestConfig,
    schema: SchemaConfig,
    url: str,
    fmt: Format,
    out_dir: Location,
    part: int,
    record_offset: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> FileReport:
    """Validate one raw file into ``events/part-<part>-*`` and ``quarantine/part-<part>-*``.

    Args:
        config: the ingest section (reading options, batch and output file sizes).
        schema: the raw columns and their types.
        url: the file.
        fmt: its format.
        out_dir: the ingest output directory (shared by every file): a path, or a URL
            written through fsspec.
        part: the file's index among the inputs, naming its output files.
        record_offset: records of the inputs before this one; a generated timestamp
            is ``record_offset`` + the record's number in this file.
        on_progress: called with the number of this file's records read so far.

    Returns:
        The file's counts, examples and output files.

    Raises:
        SchemaError: a schema column is missing from the file.
    """
    out_dir = as_location(out_dir)
    name = f"part-{part:05d}"
    events = _RollingWriter(
        out_dir,
        "events",
        name,
        event_schema(schema),
        config.rows_per_file,
        use_dictionary=_dictionary_paths(schema),
        write_statistics=[f.name for f in schema.by_role("timestamp")],
    )
    quarantine = _RollingWriter(
        out_dir, "quarantine", name, QUARANTINE_SCHEMA, config.rows_per_file
    )
    read_fields = [f for f in schema.fields if f.generated is None]
    seen = _SeenRows()
    reasons: Counter[str] = Counter()
    examples: list[dict] = []
    rows = good_rows = 0
    batches = read_batches(
        url,
        fmt,
        read_fields,
        header=config.header,
        delimiter=config.delimiter,
        batch_rows=config.batch_rows,
    )
    # Three stages overlap: the next batch is parsed and the last one written while this
    # one is validated, one batch in flight each (bounded memory, same order, same bytes).
    writing: Future[None] | None = None
    try:
        # closing(): an error here stops the reader thread at once, not when the
        # generator is collected.
        with ThreadPoolExecutor(max_workers=1) as writer, closing(_prefetched(batches)) as ahead:
            for batch in ahead:
                good, bad = validate_batch(batch, schema, url, record_offset, seen)
                if writing is not None:
                    writing.result()
                writing = writer.submit(_write_both, events, good, quarantine, bad)
                rows += batch.num_records
                good_rows += good.num_rows
                reasons.update(bad.column("reason").to_pylist())
                if len(examples) < _EXAMPLES and bad.num_rows:
                    examples.extend(bad.slice(0, _EXAMPLES - len(examples)).to_pylist())
                if on_progress:
                    on_progress(rows)
            if writing is not None:
                writing.result()
    finally:
        events.close()
        quarantine.close()
    return FileReport(
        path=url,
        part=part,
        record_offset=record_offset,
        rows=rows,
        good_rows=good_rows,
        reasons=_sorted_counts(reasons),
        examples=examples,
        files=events.files + quarantine.files,
    )


def _write_both(
    events: "_RollingWriter", good: pa.Table, quarantine: "_RollingWriter", bad: pa.Table
) -> None:
    events.write(good)
    quarantine.write(bad)


_DONE = object()


def _prefetched(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Iterate ``items`` on a background thread, up to ``depth`` items ahead.

    The reader parses the next batch (pyarrow releases the GIL) while the caller works on
    this one. An exception in the reader is raised here; when the caller stops early the
    reader stops too and closes ``items``.
    """
    handoff: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        handoff.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            handoff.put((_DONE, None))
        except BaseException as error:  # handed to the consumer, which raises it
            handoff.put((_DONE, error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="ingest-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, error = handoff.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                handoff.get(timeout=0.1)  # unblock a reader waiting to hand over
            except queue.Empty:
                pass
        thread.join()


def quarantine_replayed_file(
    config: IngestConfig,
    url: str,
    original: FileReport,
    out_dir: Location,
    part: int,
    record_offset: int = 0,
) -> FileReport:
    """Quarantine every record of a replayed file (same bytes as ``original``) unparsed.

    The file has as many records as the original, so the global record numbers of
    later files do not depend on whether the replay was caught.

    Returns:
        The file's report: every record bad, reason ``duplicate_file:<original path>``.
    """
    reason = f"duplicate_file:{original.path}"
    raw = f"same bytes as {original.path}"
    writer = _RollingWriter(
        out_dir, "quarantine", f"part-{part:05d}", QUARANTINE_SCHEMA, config.rows_per_file
    )
    examples: list[dict] = []
    try:
        for start in range(0, original.rows, config.batch_rows):
            stop = min(start + config.batch_rows, original.rows)
            numbers = np.arange(start, stop, dtype=np.int64)
            table = pa.table(
                {
                    "source": pa.array([url] * len(numbers), pa.string()),
                    "location": pa.array([f"record {i + 1}" for i in numbers], pa.string()),
                    "reason": pa.array([reason] * len(numbers), pa.string()),
                    "raw": pa.array([raw] * len(numbers), pa.string()),
                    "record": pa.array(record_offset + numbers),
                }
            )
            writer.write(table)
            if len(examples) < _EXAMPLES:
                examples.extend(table.slice(0, _EXAMPLES - len(examples)).to_pylist())
    finally:
        writer.close()
    return FileReport(
        path=url,
        part=part,
        record_offset=record_offset,
        rows=original.rows,
        good_rows=0,
        reasons={reason: original.rows} if original.rows else {},
        examples=examples,
        files=writer.files,
        duplicate_of=original.path,
    )


def combine_reports(
    config: IngestConfig, out_dir: Location, reports: list[FileReport]
) -> IngestResult:
    """Write ``validation.json`` from the per-file reports and check the bad fraction.

    Raises:
        DataError: the files hold no rows at all.
        SchemaError: more than ``max_bad_fraction`` of the rows were quarantined.
    """
    out_dir = as_location(out_dir)
    reports = sorted(reports, key=lambda r: r.part)
    reasons: Counter[str] = Counter()
    for report in reports:
        reasons.update(report.reasons)
    examples = [e for r in reports for e in r.examples][:_EXAMPLES]
    total = sum(r.rows for r in reports)
    good_rows = sum(r.good_rows for r in reports)
    files = [f for r in reports for f in r.files]
    result = IngestResult(
        out_dir=out_dir,
        rows=total,
        good_rows=good_rows,
        bad_rows=total - good_rows,
        reasons=_sorted_counts(reasons),
        files=sorted(files, key=lambda f: (not f.startswith("events/"), f)),
    )
    report = {
        "rows": result.rows,
        "good_rows": result.good_rows,
        "bad_rows": result.bad_rows,
        "bad_fraction": result.bad_fraction,
        "max_bad_fraction": config.max_bad_fraction,
        "reasons": result.reasons,
        "files": [
            {
                "path": r.path,
                "rows": r.rows,
                "good_rows": r.good_rows,
                "bad_rows": r.bad_rows,
                "reasons": r.reasons,
                "duplicate_of": r.duplicate_of,
            }
            for r in reports
        ],
        "examples": examples,
    }
    write_text(join(out_dir, "validation.json"), json.dumps(report, indent=2))
    if total == 0:
        raise DataError(f"ingest.path '{config.source()}' holds no rows.")
    if result.bad_fraction > config.max_bad_fraction:
        top = ", ".join(f"{r} ({n})" for r, n in list(result.reasons.items())[:5])
        first = examples[0]
        # The reason names the column; the row itself stays in the quarantine (a message
        # reaches the logs, and the "row" may be a line of a credentials file).
        raise SchemaError(
            f"{result.bad_rows} of {total} rows ({result.bad_fraction:.1%}) failed validation, "
            f"above ingest.max_bad_fraction={config.max_bad_fraction}. Top reasons: {top}. "
            f"First bad row: {first['source']} {first['location']}: {first['reason']} "
            f"(raw: {preview(first['raw'])}). Every bad row is kept, with its reason, in "
            f"{join(out_dir, 'quarantine')}. Fix the schema or the data, or raise "
            "ingest.max_bad_fraction."
        )
    return result


def _sorted_counts(counts: Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


class _ReplayFinder:
    """Finds an earlier input file with the same bytes; hashes only files of equal size."""

    def __init__(self) -> None:
        self._sizes: dict[str, int | None] = {}
        self._digests: dict[str, str] = {}

    def same_bytes(self, first: str, second: str) -> bool:
        size = self._size(second)
        return (
            size is not None
            and self._size(first) == size
            and self._digest(first) == self._digest(second)
        )

    def _size(self, url: str) -> int | None:
        if url not in self._sizes:
            fs, name = fsspec.core.url_to_fs(url)
            self._sizes[url] = fs.info(name).get("size")
        return self._sizes[url]

    def _digest(self, url: str) -> str:
        if url not in self._digests:
            self._digests[url] = content_sha256(url)
        return self._digests[url]


def _dictionary_paths(schema: SchemaConfig) -> list[str]:
    """Event columns worth dictionary-encoding: ids, codes and labels. Timestamps and
    floats are mostly distinct, so trying a dictionary on them only costs time."""
    paths = []
    for spec in schema.fields:
        if spec.dtype == "float64" or spec.role == "timestamp" or spec.generated is not None:
            continue
        paths.append(f"{spec.name}.list.element" if spec.multi_hot else spec.name)
    return paths


class _RollingWriter:
    """Writes tables into ``<out_dir>/<subdir>/<name>-NNNNN.parquet`` files of at most
    ``rows_per_file`` rows (``out_dir`` a path or a URL).

    Keyword options go to ``pyarrow.parquet.ParquetWriter``.
    """

    def __init__(
        self,
        out_dir: Location,
        subdir: str,
        name: str,
        schema: pa.Schema,
        rows_per_file: int,
        **options,
    ) -> None:
        self.out_dir = out_dir
        self.subdir = subdir
        self.name = name
        self.schema = schema
        self.rows_per_file = rows_per_file
        self.options = options
        self.files: list[str] = []  # relative to out_dir
        self._writer: pq.ParquetWriter | None = None
        self._sink = None
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
        rel = f"{self.subdir}/{self.name}-{len(self.files):05d}.parquet"
        self._sink = open_output(join(self.out_dir, rel))
        self._writer = pq.ParquetWriter(self._sink, self.schema, **self.options)
        self.files.append(rel)
        self._rows_in_file = 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            close_output(self._sink)
            self._sink = None


# --------------------------------------------------------------------------- validation


def validate_batch(
    batch: TextBatch,
    schema: SchemaConfig,
    source: str,
    record_offset: int = 0,
    seen: "_SeenRows | None" = None,
) -> tuple[pa.Table, pa.Table]:
    """Type and check one batch of text columns.

    Args:
        batch: rows of one file as text, from ``data_prep.readers``.
        schema: the declared types and roles.
        source: file name recorded with quarantined rows.
        record_offset: records of the inputs before this file.
        seen: the rows kept so far in this file, for ``duplicate_row``; None skips it.

    Returns:
        (typed good rows in schema order, quarantined rows in record order). Each bad
        row carries the first failed check, e.g. ``not_float64:price``.
    """
    n = batch.num_rows
    reason_of = np.full(n, -1, dtype=np.int32)
    reasons: list[str] = []

    def flag(reason: str, mask: np.ndarray) -> None:
        new = mask & (reason_of < 0)
        if new.any():
            reasons.append(reason)
            reason_of[new] = len(reasons) - 1

    typed: dict[str, pa.Array] = {}
    row_hash = np.zeros(n, dtype=np.uint64)
    for spec in schema.fields:
        if spec.generated is not None:
            typed[spec.name] = pa.array(record_offset + batch.records, pa.int64())
            continue
        text, undecodable = _to_text(batch.columns[spec.name])
        if undecodable is not None:
            flag(f"invalid_utf8:{spec.name}", undecodable)
        parse = _parse_multi_hot if spec.multi_hot else _parse_scalar
        typed[spec.name], checks, key = parse(text, spec, schema)
        for reason, mask in checks:
            flag(reason, mask)
        _mix_into(row_hash, key)
    if seen is not None and n:
        good = reason_of < 0
        duplicate = np.zeros(n, dtype=bool)
        duplicate[good] = seen.add(row_hash[good])
        flag("duplicate_row", duplicate)

    good = reason_of < 0
    bad_idx = np.flatnonzero(~good)
    events = pa.table(typed)
    if len(bad_idx):
        events = events.filter(pa.array(good))
    rejected = batch.rejected
    quarantine = {
        "source": [source] * (len(bad_idx) + len(rejected)),
        "location": [f"{batch.unit} {line}" for line in batch.lines[bad_idx]]
        + [f"{batch.unit} {r.line}" for r in rejected],
        "reason": [reasons[i] for i in reason_of[bad_idx]] + [r.reason for r in rejected],
        "raw": _raw_rows(batch.columns, bad_idx) + [r.raw for r in rejected],
        "record": np.concatenate(
            [batch.records[bad_idx], np.array([r.record for r in rejected], dtype=np.int64)]
        )
        + record_offset,
    }
    table = pa.table(quarantine, schema=QUARANTINE_SCHEMA)
    if rejected and len(bad_idx):
        table = table.take(pc.sort_indices(table, [("record", "ascending")]))
    return events, table


def _raw_rows(columns: dict[str, pa.Array], idx: np.ndarray) -> list[str]:
    """The text of the given rows as JSON objects (undecodable bytes backslash-escaped)."""
    if len(idx) == 0:
        return []
    taken = {name: column.take(pa.array(idx)).to_pylist() for name, column in columns.items()}
    return [
        json.dumps({name: _printable(values[i]) for name, values in taken.items()})
        for i in range(len(idx))
    ]


def _printable(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value


def _mask(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A boolean pyarrow array as a numpy mask, null as False."""
    values = pc.fill_null(values, False)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if len(values) == 0:
        return np.zeros(0, dtype=bool)
    # Unpacking the bits directly; to_numpy() on booleans would import pandas.
    bits = np.frombuffer(values.buffers()[1], dtype=np.uint8)
    unpacked = np.unpackbits(bits, bitorder="little")
    return unpacked[values.offset : values.offset + len(values)].astype(bool)


def _list_parts(lists: pa.Array) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """(offsets from 0, the values they index, validity) of a list array, slices included."""
    offsets = lists.offsets.to_numpy().astype(np.int64)
    values = lists.values.slice(offsets[0], offsets[-1] - offsets[0])
    valid = _mask(lists.is_valid())
    return offsets - offsets[0], values, valid


def _to_text(column: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """Valid UTF-8 text (undecodable values as null) and a mask of those, None if none."""
    kind = column.type
    if pa.types.is_list(kind):
        offsets, values, valid = _list_parts(column)
        text, undecodable = _to_text(values)
        if undecodable is None and pa.types.is_string(kind.value_type):
            return column, None
        rebuilt = pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), text, mask=pa.array(~valid)
        )
        if undecodable is None:
            return rebuilt, None
        rows = np.zeros(len(column), dtype=bool)
        rows[np.repeat(np.arange(len(column)), np.diff(offsets))[undecodable]] = True
        return rebuilt, rows
    if not pa.types.is_binary(kind):
        return column, None
    try:
        return column.cast(pa.string()), None
    except pa.ArrowInvalid:
        pass
    # Only a batch with a bad value gets here: check value by value.
    decoded: list[str | None] = []
    undecodable = np.zeros(len(column), dtype=bool)
    for i, value in enumerate(column.to_pylist()):
        try:
            decoded.append(None if value is None else value.decode("utf-8"))
        except UnicodeDecodeError:
            decoded.append(None)
            undecodable[i] = True
    return pa.array(decoded, pa.string()), undecodable


Checks = list[tuple[str, np.ndarray]]


def _parse_scalar(
    text: pa.Array, spec: FieldSpec, schema: SchemaConfig
) -> tuple[pa.Array, Checks, np.ndarray]:
    """Parse one text column.

    Returns:
        (typed values, (reason, mask) checks in order, (N,) uint64 hash of each value for
        duplicate detection: of the number for numeric fields, so ``1.0`` and ``1.00``
        are the same, and of the raw number for a thresholded label).
    """
    fast = _parse_clean_scalar(text, spec, schema)
    if fast is not None:
        return fast
    missing = _mask(pc.or_kleene(pc.is_null(text), pc.equal(pc.utf8_length(text), 0)))
    checks: Checks = []
    if spec.required:
        checks.append((f"missing:{spec.name}", missing))
    if spec.dtype == "string":
        values = pc.if_else(pa.array(missing), pa.scalar(None, pa.string()), text)
        return values, checks, _hash_text(values)

    present = ~missing
    values, ok, value_checks = _parse_numbers(text, spec.dtype, spec.name)
    checks += [(reason, mask & present) for reason, mask in value_checks]
    key = np.where(missing, _NULL_HASH, _number_keys(values))
    if spec.threshold is not None:
        values = pc.cast(pc.greater_equal(values, spec.threshold), pa.int64())
    elif spec.role == "label":
        allowed = _mask(pc.is_in(values, value_set=pa.array(schema.label_values, pa.int64())))
        checks.append((f"label_out_of_range:{spec.name}", ok & ~allowed))
    elif spec.role == "timestamp":
        in_range = _mask(
            pc.and_(
                pc.greater_equal(values, schema.min_timestamp),
                pc.less_equal(values, schema.max_timestamp),
            )
        )
        checks.append((f"timestamp_out_of_range:{spec.name}", ok & ~in_range))
    return pc.if_else(pa.array(ok), values, pa.scalar(None, values.type)), checks, key


def _parse_clean_scalar(
    text: pa.Array, spec: FieldSpec, schema: SchemaConfig
) -> tuple[pa.Array, Checks, np.ndarray] | None:
    """``_parse_scalar`` for a column with nothing to flag, or None to take the full path.

    A column is clean when it is ``string`` without null or empty values, pyarrow's own
    parser accepts every value, and the raw bytes show nothing that parser accepts but
    the patterns of ``_parse_numbers`` reject (hex integers, ``nan(...)``), every float is
    finite and every label and timestamp in range. Each of these is one pass over the
    column's buffers (no per-value masks), and a column that fails any of them is parsed
    and checked value by value as before, so the result never differs.
    """
    if not pa.types.is_string(text.type) or text.null_count:
        return None
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)[
        text.offset : text.offset + len(text) + 1
    ]
    if len(text) == 0 or (offsets[1:] == offsets[:-1]).any():
        return None  # empty values: missing, or allowed and null
    if spec.dtype == "string":
        return text, [], _hash_text(text)
    data = np.frombuffer(text.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    try:
        values = pc.cast(text, _ARROW_TYPES[spec.dtype])
    except pa.ArrowInvalid:
        return None
    if spec.dtype == "int64":
        # Only '-' and digits (pyarrow's parser rejects '.', '/' and a '+'): no hex.
        if data.min() < ord("-") or data.max() > ord("9"):
            return None
    elif (data == ord("(")).any() or not np.isfinite(values.to_numpy()).all():
        return None
    key = _number_keys(values)
    if spec.threshold is not None:
        return pc.cast(pc.greater_equal(values, spec.threshold), pa.int64()), [], key
    if spec.role == "label":
        allowed = pa.array(schema.label_values, pa.int64())
        if not pc.all(pc.is_in(values, value_set=allowed)).as_py():
            return None
    elif spec.role == "timestamp":
        low, high = pc.min_max(values).values()
        if low.as_py() < schema.min_timestamp or high.as_py() > schema.max_timestamp:
            return None
    return values, [], key


def _parse_numbers(
    text: pa.Array, dtype: str, name: str, fast: bool = True
) -> tuple[pa.Array, np.ndarray, Checks]:
    """(values, mask of parsed values, checks of values that do not parse).

    Values that do not parse are 0, never null; null or empty text does not parse, so
    callers mask the checks where a missing value is allowed. ``fast=False`` skips the
    fast path (for tests: both paths must agree).
    """
    well_formed = None
    present = pc.if_else(pc.equal(pc.utf8_length(text), 0), pa.scalar(None, pa.string()), text)
    try:
        if not fast:
            raise pa.ArrowInvalid("fast path disabled")
        # Fast path for a clean batch: pyarrow's own parser, when it accepts every value and
        # accepts nothing the patterns below reject (hex integers, ``nan(...)``).
        values = pc.cast(present, _ARROW_TYPES[dtype])
        if dtype == "int64":
            clean = pc.all(pc.utf8_is_decimal(pc.utf8_ltrim(present, "-"))).as_py()
        else:
            clean = not pc.any(pc.match_substring(present, "(")).as_py()
        if clean:
            well_formed = _mask(values.is_valid())
            values = pc.fill_null(values, 0)
            overflow = np.zeros(len(text), dtype=bool)
    except pa.ArrowInvalid:
        pass
    if well_formed is None:
        trimmed = pc.utf8_trim_whitespace(text)
        if dtype == "int64":
            trimmed = pc.utf8_ltrim(trimmed, "+")  # pyarrow's cast rejects "+5"
            well_formed = _mask(pc.match_substring_regex(text, _INT_RE))
            too_long = _mask(pc.greater(pc.utf8_length(trimmed), _SAFE_INT_CHARS))
            overflow = _int64_overflow(trimmed, well_formed & too_long)
            values = pc.cast(
                pc.if_else(pa.array(well_formed & ~overflow), trimmed, "0"), pa.int64()
            )
        else:
            well_formed = _mask(pc.match_substring_regex(text, _FLOAT_RE, ignore_case=True))
            values = pc.cast(pc.if_else(pa.array(well_formed), trimmed, "0"), pa.float64())
    if dtype == "int64":
        checks = [(f"not_int64:{name}", ~well_formed), (f"int64_overflow:{name}", overflow)]
        return values, well_formed & ~overflow, checks
    finite = _mask(pc.is_finite(values))
    checks = [(f"not_float64:{name}", ~well_formed), (f"not_finite:{name}", ~finite)]
    return values, well_formed & finite, checks


def _parse_multi_hot(
    text: pa.Array, spec: FieldSpec, schema: SchemaConfig
) -> tuple[pa.Array, Checks, np.ndarray]:
    """Parse a multi-hot column (text to split, or lists); every element must parse."""
    n = len(text)
    if not pa.types.is_list(text.type):
        # Text formats: an empty value is an empty list.
        lists = pc.split_pattern(text, spec.separator)
        empty = pa.scalar([], pa.list_(pa.string()))
        lists = pc.if_else(pc.equal(pc.utf8_length(text), 0), empty, lists)
    else:
        lists = text
    offsets, elements, valid = _list_parts(lists)
    row_of = np.repeat(np.arange(n), np.diff(offsets))
    checks: Checks = []
    if spec.required:
        checks.append((f"missing:{spec.name}", ~valid))

    def rows_with(element_mask: np.ndarray) -> np.ndarray:
        rows = np.zeros(n, dtype=bool)
        rows[row_of[element_mask]] = True
        return rows

    empty_element = _mask(pc.equal(pc.utf8_length(elements), 0))
    checks.append((f"empty_element:{spec.name}", rows_with(empty_element)))
    if spec.dtype == "string":
        checks.append((f"not_string:{spec.name}", rows_with(_mask(pc.is_null(elements)))))
        values, element_keys = elements, _hash_text(elements)
    else:
        values, _, value_checks = _parse_numbers(elements, spec.dtype, spec.name)
        checks += [(reason, rows_with(mask)) for reason, mask in value_checks]
        element_keys = splitmix64(_number_keys(values))
    typed = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=pa.array(~valid))
    key = np.where(valid, _hash_sequences(offsets, element_keys), _NULL_HASH)
    return typed, checks, key


def _int64_overflow(text: pa.Array, candidates: np.ndarray) -> np.ndarray:
    """Mark long digit strings that do not fit int64 (rare, so checked in Python)."""
    flags = np.zeros(len(text), dtype=bool)
    for i in np.flatnonzero(candidates):
        value = int(text[int(i)].as_py())
        flags[i] = not (-(2**63) <= value < 2**63)
    return flags


# --------------------------------------------------------------------------- duplicates

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_NULL_HASH = np.uint64(0x5BD1E9955BD1E995)


@lru_cache(maxsize=8)
def _powers(size: int) -> np.ndarray:
    """_MULTIPLIER ** k mod 2**64 for k < size."""
    powers = np.full(size, _MULTIPLIER, dtype=np.uint64)
    powers[0] = 1
    return np.cumprod(powers, dtype=np.uint64)


def _number_keys(values: pa.Array) -> np.ndarray:
    """(N,) uint64 key of int64/float64 values without nulls (-0.0 as 0.0): their bits.

    Not mixed: ``_mix_into`` mixes each column's key into the row hash with splitmix64,
    a bijection, so distinct values of a column never meet before the mixing.
    """
    array = values.to_numpy()
    if array.dtype == np.float64:
        array = array + 0.0
    return array.view(np.uint64) ^ _MULTIPLIER


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix_into(row_hash: np.ndarray, key: np.ndarray) -> None:
    """``row_hash = splitmix64(row_hash * _MULTIPLIER + key)``, in place (no temporaries
    per step: this runs once per column and row)."""
    np.multiply(row_hash, _MULTIPLIER, out=row_hash)
    np.add(row_hash, key, out=row_hash)
    np.add(row_hash, _GOLDEN, out=row_hash)
    shifted = np.right_shift(row_hash, np.uint64(30))
    np.bitwise_xor(row_hash, shifted, out=row_hash)
    np.multiply(row_hash, _MIX1, out=row_hash)
    np.right_shift(row_hash, np.uint64(27), out=shifted)
    np.bitwise_xor(row_hash, shifted, out=row_hash)
    np.multiply(row_hash, _MIX2, out=row_hash)
    np.right_shift(row_hash, np.uint64(31), out=shifted)
    np.bitwise_xor(row_hash, shifted, out=row_hash)


def _hash_sequences(offsets: np.ndarray, items: np.ndarray) -> np.ndarray:
    """(N,) uint64 hash of each sequence ``items[offsets[i]:offsets[i + 1]]`` (offsets from 0).

    A polynomial in the items (mod 2**64) mixed with the length.
    """
    n = len(offsets) - 1
    start, lengths = offsets[:-1], np.diff(offsets)
    sums = np.zeros(n, dtype=np.uint64)
    nonempty = lengths > 0
    if nonempty.any():
        size = 1 << int(lengths.max()).bit_length()
        position = np.arange(offsets[-1]) - np.repeat(start, lengths)
        terms = items * _powers(size)[position]
        sums[nonempty] = np.add.reduceat(terms, start[nonempty])
    return splitmix64(sums ^ splitmix64(lengths.astype(np.uint64) + _MULTIPLIER))


def _hash_text(text: pa.Array) -> np.ndarray:
    """(N,) uint64 hash of each string's bytes; nulls share one hash.

    Each distinct string is hashed once (logs repeat their values; and even when they
    do not, encoding first costs less than the gathers hashing every row needs).
    """
    encoded = pc.dictionary_encode(text)
    distinct = encoded.dictionary
    wide = pa.types.is_large_string(distinct.type) or pa.types.is_large_binary(distinct.type)
    offsets = np.frombuffer(distinct.buffers()[1], dtype=np.int64 if wide else np.int32)
    offsets = offsets[distinct.offset : distinct.offset + len(distinct) + 1].astype(np.int64)
    data = distinct.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    items = data[offsets[0] : offsets[-1]].astype(np.uint64) + np.uint64(1)
    hashed = _hash_sequences(offsets - offsets[0], items)
    indices = encoded.indices
    rows = (
        hashed[pc.fill_null(indices, 0).to_numpy()]
        if len(hashed)
        else np.zeros(len(text), np.uint64)
    )
    rows[~_mask(indices.is_valid())] = _NULL_HASH
    return rows


class _SeenRows:
    """The set of row hashes kept so far in one file: sorted runs of geometric sizes.

    Looking up a batch costs a binary search per run (there are O(log rows) runs);
    adding merges runs like a binary counter, O(log rows) amortised per row.
    """

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def add(self, hashes: np.ndarray) -> np.ndarray:
        """Add a batch of hashes; return a mask of those seen before (earlier in the batch too)."""
        # Sorted queries: the binary searches walk each run in order (cache friendly). A plain
        # sort of the values is several times cheaper than an argsort; duplicates are rare,
        # so only their values are traced back to rows.
        ordered = np.sort(hashes)
        repeated = np.zeros(len(ordered), dtype=bool)
        repeated[1:] = ordered[1:] == ordered[:-1]
        known = np.zeros(len(ordered), dtype=bool)
        for run in self._runs:
            at = np.minimum(np.searchsorted(run, ordered), len(run) - 1)
            known |= run[at] == ordered
        new = ordered[~(repeated | known)]
        if len(new):
            self._runs.append(new)
            while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
                newest = self._runs.pop()
                # Disjoint sorted runs: timsort merges them in linear time.
                merged = np.concatenate([self._runs[-1], newest])
                self._runs[-1] = np.sort(merged, kind="stable")
        duplicate = np.zeros(len(hashes), dtype=bool)
        if known.any():
            # Every row with a hash kept in an earlier batch.
            duplicate |= np.isin(hashes, ordered[known])
        if repeated.any():
            # Repeats within the batch: every row but the first of its hash.
            within = np.flatnonzero(np.isin(hashes, ordered[1:][repeated[1:]]))
            _, first = np.unique(hashes[within], return_index=True)
            duplicate[within] = True
            duplicate[within[first]] &= np.isin(hashes[within[first]], ordered[known])
        return duplicate
