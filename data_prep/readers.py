"""Readers: one raw file -> batches of text columns, each row with its record number.

A reader does not type anything: it splits a file into rows and rows into the
schema's columns, as text, and ingest types and checks them (so every format shares
one validation path). Each batch carries, per row,

- the record number: the 0-based position of the record in its file, counting every
  record (quarantined ones too) so that numbering never depends on which rows are bad;
  blank lines of text formats are not records;
- the line (text formats) or row (Parquet) number, 1-based, for messages.

Rows a reader cannot split into fields (a wrong field count, invalid JSON, an
undecodable JSON line) come back as ``Rejected`` with their record number.

Text columns are ``string`` when the reader has validated their UTF-8 and ``binary``
when it has not (ingest then checks them); multi-hot columns are ``list<string>``
when the format has lists (JSON arrays, Parquet lists) and text to split otherwise.

Formats:

- CSV/TSV, with or without a header, any delimiter. pyarrow's parser takes a single
  delimiter character, so a multi-character one (MovieLens ``::``) is rewritten to
  ``\\x1f`` line by line as the bytes stream in (quoting is then off). The parser runs
  single-threaded so that it reports the line number of every row it rejects, from
  which the number of every parsed row follows; the rejected row handler never sees
  invalid UTF-8 because such lines are set aside before parsing and split here.
- JSONL: one JSON object per line; numbers keep their original text.
- Parquet: columns are cast to text; list columns stay lists.

Every file may be gzip, zstd or bz2 compressed (by extension) and local or any fsspec URL.
Memory is bounded by the batch size plus one read block.
"""

import csv
import json
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal, TypeVar

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data_prep.errors import SchemaError, preview
from data_prep.schema import FieldSpec

Format = Literal["csv", "tsv", "jsonl", "parquet"]
T = TypeVar("T")

# Control characters that do not occur in text logs, used to rewrite lines before pyarrow
# parses them: a blank line, a line set aside for invalid UTF-8, a multi-character delimiter.
_BLANK = b"\x1e"
_SET_ASIDE = b"\x1d"
_UNIT_SEPARATOR = "\x1f"
_BLOCK_BYTES = 1 << 22
# pyarrow reads on until its first parsed row, holding every rejected line before it:
# a file whose first this many lines all fail to parse is read with the wrong options.
_MAX_LEADING_REJECTS = 1_000_000


@dataclass(frozen=True)
class Rejected:
    """A record the reader could not split into the schema's fields."""

    record: int
    line: int
    reason: str
    raw: str


@dataclass
class TextBatch:
    """Rows of one file as text, in record order.

    Attributes:
        columns: one array per read field: ``string`` (valid UTF-8) or ``binary``
            (unchecked); for a multi-hot field ``list<string>``, or text to split.
        records: (N,) int64, each row's 0-based record number in its file.
        lines: (N,) int64, each row's 1-based line (text) or row (Parquet) number.
        unit: ``line`` or ``row``, the word for ``lines`` in messages.
        rejected: records that could not be split into fields, with their reason.
    """

    columns: dict[str, pa.Array]
    records: np.ndarray
    lines: np.ndarray
    unit: str
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.records)

    @property
    def num_records(self) -> int:
        """Rows plus rejected records."""
        return len(self.records) + len(self.rejected)


def read_batches(
    url: str,
    fmt: Format,
    fields: list[FieldSpec],
    *,
    header: bool = True,
    delimiter: str | None = None,
    batch_rows: int = 100_000,
) -> Iterator[TextBatch]:
    """Read one raw file as text batches of about ``batch_rows`` rows.

    Args:
        url: a local path or fsspec URL; ``.gz``/``.zst``/``.bz2`` are decompressed.
        fmt: the file format.
        fields: the fields to read (the schema's, less generated ones), in file order
            for a header-less file.
        header: CSV/TSV only: the first line names the columns.
        delimiter: CSV/TSV only: the field delimiter (default ``,`` or tab).
        batch_rows: rows per batch (a batch may be one read block larger).

    Yields:
        Batches in record order; together they hold every record of the file once.

    Raises:
        SchemaError: a schema column is missing from the file, or the header is unreadable.
    """
    with fsspec.open(url, "rb", compression="infer") as handle:
        if fmt in ("csv", "tsv"):
            sep = delimiter or ("\t" if fmt == "tsv" else ",")
            yield from _CsvReader(handle, url, fields, header, sep, batch_rows).batches()
        elif fmt == "jsonl":
            yield from _read_jsonl(handle, fields, batch_rows)
        else:
            yield from _read_parquet(handle, url, fields, batch_rows)


# --------------------------------------------------------------------------- CSV / TSV


class _LineStream:
    """A file-like view of a byte stream whose lines are rewritten for pyarrow's CSV parser.

    The stream is cut at line ends, and each complete line is passed on unchanged
    except that

    - a blank line becomes ``\\x1e``: pyarrow hands it to the invalid-row handler with its
      line number (with ``ignore_empty_lines`` it would drop it without a number, and
      every later row's number could not be told);
    - a line with invalid UTF-8, or longer than a quarter of pyarrow's block (which
      pyarrow cannot parse), becomes ``\\x1d<key>``, and the line is kept in
      ``set_aside[key]`` until the caller takes it: its bytes, or for a long line its
      first bytes and its length; the rest of a long line is skipped as it streams by,
      so memory stays bounded;
    - a multi-character delimiter becomes ``\\x1f``.

    Line numbers are kept (one line in, one line out), except that blank lines before a
    header are dropped and counted in ``leading_blank_lines``.
    """

    def __init__(self, raw: BinaryIO, url: str, delimiter: str, header: bool) -> None:
        self._raw = raw
        self._url = url
        self._transcode = delimiter.encode() if len(delimiter) > 1 else None
        self._want_header = header
        self._max_line = _BLOCK_BYTES // 4
        self._pieces: deque[bytes] = deque()  # rewritten bytes, each ending at a line end
        self._carry = b""
        self._long: tuple[bytes, int] | None = None  # (head, length) of a long line in progress
        self._eof = False
        self._started = False
        self.header_line: bytes | None = None
        self.leading_blank_lines = 0
        self.set_aside: dict[int, bytes | tuple[bytes, int]] = {}
        self._next_key = 0
        self.closed = False

    # The file protocol pyarrow's PythonFile uses.
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def read(self, size: int = -1) -> bytes:
        # Whole rewritten pieces are handed over as they are (a read may return fewer bytes
        # than asked for; only b"" ends the stream): no copying while holding the GIL.
        if size < 0:
            while not self._eof:
                self._fill()
            data = b"".join(self._pieces)
            self._pieces.clear()
            return data
        while not self._pieces and not self._eof:
            self._fill()
        if not self._pieces or size == 0:
            return b""
        piece = self._pieces[0]
        if len(piece) <= size:
            return self._pieces.popleft()
        self._pieces[0] = piece[size:]
        return piece[:size]

    def read_header(self) -> bytes | None:
        """Process input until the header line is known; None for an empty file."""
        while self.header_line is None and not self._eof:
            self._fill()
        return self.header_line

    def _fill(self) -> None:
        block = self._raw.read(_BLOCK_BYTES)
        if self._long is not None:
            end = block.find(b"\n") if block else 0
            if block and end < 0:
                self._long = (self._long[0], self._long[1] + len(block))
                return
            head, length = self._long
            self._long = None
            self._emit(self._rewrite(self._set_aside((head, length + end)) + b"\n"))
            block = block[end + 1 :]
            if not block:
                return
        if not block:
            self._eof = True
            piece, self._carry = self._carry, b""
            if piece.strip(b"\r"):
                self._emit(self._rewrite(piece + b"\n"))
            return
        # The carry never holds a newline: the last line end is the block's.
        cut = block.rfind(b"\n")
        complete = None
        if cut < 0:
            self._carry += block
        else:
            complete = b"".join((self._carry, memoryview(block)[: cut + 1]))  # one copy
            self._carry = block[cut + 1 :]
        if len(self._carry) > self._max_line:
            self._long = (self._carry[:200], len(self._carry))
            self._carry = b""
        if complete is not None:
            self._emit(self._rewrite(complete))

    def _emit(self, piece: bytes) -> None:
        if piece:
            self._pieces.append(piece)

    def _rewrite(self, piece: bytes) -> bytes:
        """Rewrite complete lines (``piece`` ends with a newline)."""
        if not self._started:
            self._started = True
            piece = piece.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
        if self._want_header and self.header_line is None:
            piece = self._take_header(piece)
        odd = False
        if not piece.isascii():
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                odd = True
        odd = odd or piece.startswith((b"\n", b"\r\n")) or _has_blank_line(piece)
        if not odd and len(piece) > self._max_line:
            # A newline in every half-window keeps every line shorter than a window.
            half = self._max_line // 2
            odd = any(piece.find(b"\n", p, p + half) < 0 for p in range(0, len(piece), half))
        if odd:
            lines = piece.split(b"\n")[:-1]
            piece = b"\n".join(self._rewrite_line(line) for line in lines) + b"\n"
        if self._transcode is not None:
            piece = piece.replace(self._transcode, _UNIT_SEPARATOR.encode())
        return piece

    def _take_header(self, piece: bytes) -> bytes:
        lines = piece.split(b"\n")[:-1]
        for i, line in enumerate(lines):
            if line.strip(b"\r"):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise SchemaError(
                        f"{self._url}: the header line is not valid UTF-8 ({err}). Fix the file, "
                        "or set ingest.header=false if it has no header."
                    ) from err
                self.header_line = line.rstrip(b"\r")
                return b"\n".join(lines[i:]) + b"\n"
            self.leading_blank_lines += 1
        return b""

    def _rewrite_line(self, line: bytes) -> bytes:
        if not line.strip(b"\r"):
            return _BLANK
        if len(line) > self._max_line:
            return self._set_aside((line[:200], len(line)))
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return self._set_aside(line)
        return line

    def _set_aside(self, kept: bytes | tuple[bytes, int]) -> bytes:
        key = self._next_key
        self._next_key += 1
        self.set_aside[key] = kept
        return _SET_ASIDE + str(key).encode()


def _arrow_problem(err: Exception) -> str:
    """pyarrow's message for a message of ours, without the row it may quote.

    Its CSV parse errors end with the row ("Expected 6 columns, got 1: <row>").
    """
    text = (str(err).splitlines() or [type(err).__name__])[0]
    quoted = re.match(r"(CSV parse error: Expected \d+ columns?, got \d+)", text)
    return quoted.group(1) if quoted else preview(text, 120)


def _has_blank_line(piece: bytes) -> bool:
    """Whether ``piece`` holds ``\\n\\n`` or ``\\n\\r\\n``.

    From the newline positions: several times faster than bytes' own substring search,
    which crawls on a needle of frequent characters.
    """
    data = np.frombuffer(piece, dtype=np.uint8)
    newlines = np.flatnonzero(data == ord("\n"))
    gaps = np.diff(newlines)
    if (gaps == 1).any():
        return True
    carriage = newlines[:-1][gaps == 2] + 1
    return bool((data[carriage] == ord("\r")).any())


class _CsvReader:
    """Reads one CSV/TSV file; see the module docstring for how rows are numbered."""

    def __init__(
        self,
        handle: BinaryIO,
        url: str,
        fields: list[FieldSpec],
        header: bool,
        delimiter: str,
        batch_rows: int,
    ) -> None:
        self.url = url
        self.names = [f.name for f in fields]
        self.header = header
        self.delimiter = delimiter
        self.quoting = len(delimiter) == 1
        self.batch_rows = batch_rows
        self.stream = _LineStream(handle, url, delimiter, header)
        self.events: list[tuple[int, str, int, int]] = []  # (parser line, text, expected, got)
        self.file_columns = self.names
        # Parser line numbers: the first data line, the next line no parsed row has claimed.
        self.first_line = 2 if header else 1
        self.cursor = self.first_line
        self.blank_lines = 0
        self.parsed_any = False

    def batches(self) -> Iterator[TextBatch]:
        reader = self._open()
        if reader is None:
            return
        pending: list[TextBatch] = []
        pending_rows = 0
        for record_batch in self._iterate(reader):
            pending.append(self._number(record_batch, last=False))
            pending_rows += pending[-1].num_records
            if pending_rows >= self.batch_rows:
                yield _concat(pending, "line")
                pending, pending_rows = [], 0
        tail = self._number(None, last=True)
        if tail.num_records:
            pending.append(tail)
        if pending:
            yield _concat(pending, "line")

    def _open(self) -> pacsv.CSVStreamingReader | None:
        quote = '"' if self.quoting else False
        parse_delimiter = self.delimiter if self.quoting else _UNIT_SEPARATOR
        read_options = {"block_size": _BLOCK_BYTES, "use_threads": False}
        if self.header:
            line = self.stream.read_header()
            if line is None:
                return None
            text = line.decode("utf-8")
            self.file_columns = self._split(text)
            missing = [n for n in self.names if n not in self.file_columns]
            if missing:
                # The header's text, not its columns: a file that is no CSV at all (a
                # credentials file) has its first line there.
                number = self.stream.leading_blank_lines + 1
                raise SchemaError(
                    f"{self.url} line {number}: column(s) {missing} named in schema.fields are "
                    f"missing from the header ({len(self.file_columns)} column(s), "
                    f"text: {preview(text)}). Rename the schema fields, fix the file, or set "
                    "ingest.header=false (and ingest.delimiter) if it has no header."
                )
        else:
            read_options["column_names"] = self.names
        try:
            return self._checked(
                pacsv.open_csv,
                self.stream,
                read_options=pacsv.ReadOptions(**read_options),
                parse_options=pacsv.ParseOptions(
                    delimiter=parse_delimiter,
                    quote_char=quote,
                    ignore_empty_lines=False,
                    invalid_row_handler=self._on_invalid,
                ),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in self.names},
                    include_columns=self.names,
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as err:
            if "Empty CSV file" in str(err):
                return None
            raise SchemaError(
                f"{self.url}: cannot read the file as {self._describe()}: {_arrow_problem(err)}. "
                "Fix the file or set ingest.format, ingest.header and ingest.delimiter to "
                "match it."
            ) from err

    def _iterate(self, reader: pacsv.CSVStreamingReader) -> Iterator[pa.RecordBatch]:
        while (batch := self._checked(reader.read_next_batch)) is not None:
            yield batch

    def _checked(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Call into the parser; None at the end of the file; too many rejects: SchemaError."""
        try:
            return call(*args, **kwargs)
        except StopIteration:
            return None
        except pa.ArrowInvalid as err:
            if self.parsed_any or len(self.events) < _MAX_LEADING_REJECTS:
                raise
            number, _, expected, actual = self.events[0]
            raise SchemaError(
                f"{self.url}: none of the first {len(self.events)} lines parses as "
                f"{self._describe()} (line {number} has {actual} field(s), {expected} "
                "expected). Set ingest.format, ingest.header and ingest.delimiter to match "
                "the file."
            ) from err

    def _describe(self) -> str:
        head = "with a header" if self.header else "without a header"
        return f"delimited text {head}, delimiter {self.delimiter!r}"

    def _on_invalid(self, row: pacsv.InvalidRow) -> str:
        if row.number is None or row.number < 0:
            # Only a multi-threaded parse loses line numbers, and this one is single-threaded.
            raise RuntimeError(f"{self.url}: the CSV parser reported a row without a line number")
        self.events.append((row.number, row.text, row.expected_columns, row.actual_columns))
        if not self.parsed_any and len(self.events) >= _MAX_LEADING_REJECTS:
            return "error"  # _checked turns it into a SchemaError
        return "skip"

    def _split(self, text: str) -> list[str]:
        text = text.rstrip("\r")
        if not self.quoting:
            return text.split(self.delimiter)
        try:
            return next(csv.reader([text], delimiter=self.delimiter, quotechar='"'))
        except csv.Error:
            return [text]  # unsplittable: a parse error whatever the expected width

    def _number(self, batch: pa.RecordBatch | None, last: bool) -> TextBatch:
        """Number the parsed rows of ``batch`` and settle the rejected lines before them.

        The parser claims every line: either it parses it into ``batch`` or it reports it
        to ``_on_invalid``. So the parsed rows take, in order, the free line numbers from
        ``cursor`` on, skipping reported ones.
        """
        n = 0 if batch is None else batch.num_rows
        reported = np.array([e[0] for e in self.events], dtype=np.int64)
        gaps = reported - self.cursor - np.arange(len(reported))
        if n:
            self.parsed_any = True
            order = np.arange(n, dtype=np.int64)
            lines = self.cursor + order + np.searchsorted(gaps, order, side="right")
            self.cursor = int(lines[-1]) + 1
        else:
            # A block without parsed rows: the rejected lines right at the cursor come
            # before any row still to be parsed, so they settle now (memory stays bounded).
            lines = np.zeros(0, dtype=np.int64)
            self.cursor += int(np.searchsorted(gaps, 0, side="right"))
        settled = len(self.events) if last else int(np.searchsorted(reported, self.cursor))
        events, self.events = self.events[:settled], self.events[settled:]

        blank = np.array([e[0] for e in events if e[1] == _BLANK.decode()], dtype=np.int64)
        blanks_before = self.blank_lines
        self.blank_lines += len(blank)

        def record_of(parser_lines: np.ndarray) -> np.ndarray:
            return (
                parser_lines
                - self.first_line
                - blanks_before
                - np.searchsorted(blank, parser_lines, side="left")
            )

        offset = self.stream.leading_blank_lines
        rejected: list[Rejected] = []
        aside: list[tuple[int, list[bytes]]] = []  # (parser line, the read fields' bytes)
        for number, text, expected, actual in events:
            if text == _BLANK.decode():
                continue
            if text.startswith(_SET_ASIDE.decode()):
                raw_line = self.stream.set_aside.pop(int(text[1:]))
                if isinstance(raw_line, tuple):
                    head, length = raw_line
                    reason = f"parse_error: line of {length} bytes, longer than {_BLOCK_BYTES // 4}"
                    raw = head.decode("utf-8", errors="backslashreplace") + "..."
                    record = int(record_of(np.array([number]))[0])
                    rejected.append(Rejected(record, number + offset, reason, raw))
                    continue
                values = self._split(raw_line.decode("utf-8", errors="surrogateescape"))
                if len(values) == len(self.file_columns):
                    picked = [values[self.file_columns.index(n)] for n in self.names]
                    aside.append((number, [v.encode("utf-8", "surrogateescape") for v in picked]))
                    continue
                expected, actual = len(self.file_columns), len(values)
                text = raw_line.decode("utf-8", errors="backslashreplace")
            elif not self.quoting:
                text = text.replace(_UNIT_SEPARATOR, self.delimiter)
            record = int(record_of(np.array([number]))[0])
            reason = f"parse_error: expected {expected} fields, got {actual}"
            rejected.append(Rejected(record, number + offset, reason, text))

        if n:
            columns = {name: batch.column(name) for name in self.names}
        else:
            columns = {name: pa.array([], pa.string()) for name in self.names}
        if aside:
            columns, lines = _merge_set_aside(columns, lines, aside, self.names)
        return TextBatch(columns, record_of(lines), lines + offset, "line", rejected)


def _merge_set_aside(
    columns: dict[str, pa.Array],
    lines: np.ndarray,
    aside: list[tuple[int, list[bytes]]],
    names: list[str],
) -> tuple[dict[str, pa.Array], np.ndarray]:
    """Put set-aside rows (unchecked bytes) among the parsed rows, in line order."""
    aside_lines = np.array([number for number, _ in aside], dtype=np.int64)
    all_lines = np.concatenate([lines, aside_lines])
    order = pa.array(np.argsort(all_lines, kind="stable"))
    merged = {}
    for i, name in enumerate(names):
        extra = pa.array([values[i] for _, values in aside], pa.binary())
        both = pa.chunked_array([columns[name].cast(pa.binary()), extra]).combine_chunks()
        merged[name] = both.take(order)
    return merged, np.sort(all_lines, kind="stable")


def _concat(batches: list[TextBatch], unit: str) -> TextBatch:
    if len(batches) == 1:
        return batches[0]
    names = list(batches[0].columns)
    columns = {}
    for name in names:
        parts = [b.columns[name] for b in batches]
        if any(pa.types.is_binary(p.type) for p in parts):
            parts = [p.cast(pa.binary()) for p in parts]
        columns[name] = pa.chunked_array(parts, type=parts[0].type).combine_chunks()
    return TextBatch(
        columns,
        np.concatenate([b.records for b in batches]),
        np.concatenate([b.lines for b in batches]),
        unit,
        [r for b in batches for r in b.rejected],
    )


# --------------------------------------------------------------------------- JSONL


def _read_jsonl(handle: BinaryIO, fields: list[FieldSpec], batch_rows: int) -> Iterator[TextBatch]:
    names = [f.name for f in fields]
    multi_hot = {f.name: f.separator for f in fields if f.multi_hot}
    columns: dict[str, list] = {n: [] for n in names}
    records: list[int] = []
    lines: list[int] = []
    rejected: list[Rejected] = []
    record = 0
    for number, raw_line in enumerate(handle, start=1):
        raw_line = raw_line.strip()
        if not raw_line:
            continue
        problem = None
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError:
            text, problem = raw_line.decode("utf-8", errors="backslashreplace"), "invalid_utf8"
        else:
            try:
                # Numbers keep their text, so ingest types them exactly as in a CSV file.
                obj = json.loads(text, parse_int=str, parse_float=str, parse_constant=str)
            except json.JSONDecodeError as err:
                problem = f"parse_error: invalid JSON ({err.msg})"
            else:
                if not isinstance(obj, dict):
                    problem = "parse_error: not a JSON object"
        if problem:
            rejected.append(Rejected(record, number, problem, text))
        else:
            for n in names:
                value = obj.get(n)
                columns[n].append(
                    _json_list(value, multi_hot[n]) if n in multi_hot else _json_text(value)
                )
            records.append(record)
            lines.append(number)
        record += 1
        if len(records) >= batch_rows:
            yield _jsonl_batch(columns, records, lines, rejected, multi_hot)
            columns, records, lines, rejected = {n: [] for n in names}, [], [], []
    if records or rejected:
        yield _jsonl_batch(columns, records, lines, rejected, multi_hot)


def _json_text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    # JSON true/false is not a number; an object or array is kept as its JSON text.
    return json.dumps(value)


def _json_list(value: object, separator: str) -> list[str | None] | None:
    """A multi-hot value: a JSON array, or text to split; anything else holds a null element."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.split(separator) if value else []
    if isinstance(value, list):
        # str elements: JSON strings and numbers (kept as text); null, bool, object: invalid.
        return [v if isinstance(v, str) else None for v in value]
    return [None]


def _jsonl_batch(
    columns: dict[str, list],
    records: list[int],
    lines: list[int],
    rejected: list[Rejected],
    multi_hot: dict[str, str],
) -> TextBatch:
    arrays = {
        n: pa.array(v, pa.list_(pa.string()) if n in multi_hot else pa.string())
        for n, v in columns.items()
    }
    return TextBatch(
        arrays, np.array(records, dtype=np.int64), np.array(lines, dtype=np.int64), "line", rejected
    )


# --------------------------------------------------------------------------- Parquet


def _read_parquet(
    handle: BinaryIO, url: str, fields: list[FieldSpec], batch_rows: int
) -> Iterator[TextBatch]:
    parquet = pq.ParquetFile(handle)
    names = [f.name for f in fields]
    present = parquet.schema_arrow.names
    missing = [n for n in names if n not in present]
    if missing:
        raise SchemaError(
            f"{url}: column(s) {missing} named in schema.fields are missing from the file "
            f"(it has {present}). Rename the schema fields or fix the file."
        )
    start = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=names, use_threads=False):
        columns = {f.name: _parquet_text(batch.column(f.name), f, url) for f in fields}
        records = np.arange(start, start + batch.num_rows, dtype=np.int64)
        start += batch.num_rows
        yield TextBatch(columns, records, records + 1, "row")


def _parquet_text(column: pa.Array, spec: FieldSpec, url: str) -> pa.Array:
    """A Parquet column as text; strings as unchecked binary, lists as lists of text."""
    kind = column.type
    try:
        if pa.types.is_dictionary(kind):
            column = column.dictionary_decode()
            kind = column.type
        if spec.multi_hot and (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            return column.cast(pa.list_(_text_type(kind.value_type)))
        return column.cast(_text_type(kind))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise SchemaError(
            f"{url}: column '{spec.name}' has Parquet type {kind}, which cannot be read as "
            f"{spec.dtype}{' list' if spec.multi_hot else ''} ({err}). Write it as a number, "
            "string or list, or fix schema.fields."
        ) from err


def _text_type(kind: pa.DataType) -> pa.DataType:
    # Parquet does not guarantee valid UTF-8 in string columns, so they stay unchecked bytes.
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
        return pa.binary()
    if pa.types.is_large_binary(kind):
        return pa.binary()
    return pa.string()
