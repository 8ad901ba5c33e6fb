"""Fuzzing ingest: seeded dirty logs mixed with known-good rows.

Every bad record must land in the quarantine with the expected reason and its global
record number, every good row must come out typed and in order (nothing lost, nothing
extra), and the events keep the declared schema; across layouts (CSV with a header,
header-less TSV, ``::``, JSONL), compression, a replayed file, blank lines, and
read blocks and batches small enough that every file spans many of them.
"""

import gzip
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep import readers
from data_prep.ingest import QUARANTINE_SCHEMA, IngestConfig, event_schema, ingest_logs
from data_prep.schema import SchemaConfig

SCHEMA = SchemaConfig(
    fields=[
        {"name": "ts", "dtype": "int64", "role": "timestamp"},
        {"name": "user_id", "dtype": "int64", "role": "sparse"},
        {"name": "city", "dtype": "string", "role": "sparse"},
        {"name": "genres", "dtype": "int64", "role": "sparse", "multi_hot": True},
        {"name": "price", "dtype": "float64", "role": "dense"},
        {"name": "click", "dtype": "int64", "role": "label"},
        {"name": "p_true", "dtype": "float64", "role": "oracle", "required": False},
    ]
)
NAMES = [f.name for f in SCHEMA.fields]
CITIES = ["paris", "zürich", "são paulo", "tokyo", "new york"]

# (field, text cell, JSON value, reason). One field of an otherwise good row is replaced.
MUTATIONS = [
    ("ts", b"", b'""', "missing:ts"),
    ("ts", b"-5", b"-5", "timestamp_out_of_range:ts"),
    ("ts", b"9999999999", b"9999999999", "timestamp_out_of_range:ts"),
    ("ts", b"yesterday", b'"yesterday"', "not_int64:ts"),
    ("ts", b"1.7e9", b"1.7e9", "not_int64:ts"),
    ("user_id", b"99999999999999999999", b"99999999999999999999", "int64_overflow:user_id"),
    ("user_id", b"-9223372036854775809", b"-9223372036854775809", "int64_overflow:user_id"),
    ("user_id", b"u_17", b'"u_17"', "not_int64:user_id"),
    ("user_id", b"", b"null", "missing:user_id"),
    ("city", b"par\xffis", b'"par\xffis"', "invalid_utf8:city"),
    ("city", b"", b'""', "missing:city"),
    ("genres", b"1|x", b'[1, "x"]', "not_int64:genres"),
    ("genres", b"1||2", b'[1, "", 2]', "empty_element:genres"),
    ("genres", b"3|99999999999999999999", b"[3, 99999999999999999999]", "int64_overflow:genres"),
    ("price", b"nan", b"NaN", "not_finite:price"),
    ("price", b"inf", b"Infinity", "not_finite:price"),
    ("price", b"-1e400", b"-1e400", "not_finite:price"),
    ("price", b"n/a", b'"n/a"', "not_float64:price"),
    ("price", b"$29.99", b'"$29.99"', "not_float64:price"),
    ("click", b"2", b"2", "label_out_of_range:click"),
    ("click", b"yes", b"true", "not_int64:click"),
    ("p_true", b"abc", b'"abc"', "not_float64:p_true"),
    ("p_true", b"nan", b"NaN", "not_finite:p_true"),
]
# Layout: (file suffixes, text delimiter or None for JSONL, header, ingest options).
LAYOUTS = {
    "csv": ([".csv", ".csv.gz", ".csv"], b",", True, {}),
    "tsv": ([".tsv", ".tsv", ".tsv.zst"], b"\t", False, {"header": False}),
    "dat": (
        [".dat", ".dat", ".dat"],
        b"::",
        False,
        {"format": "csv", "header": False, "delimiter": "::"},
    ),
    "jsonl": ([".jsonl", ".jsonl.gz", ".jsonl"], None, False, {}),
}


class DirtyLogs:
    """Renders rows of one layout and remembers what ingest must make of each record."""

    def __init__(self, seed: int, layout: str) -> None:
        self.rng = np.random.default_rng(seed)
        self.suffixes, self.delimiter, self.header, self.options = LAYOUTS[layout]
        self.events: list[dict] = []  # the good rows, typed, in input order
        self.bad: dict[int, str] = {}  # global record number -> reason
        self.records = 0
        self.clock = 1_700_000_000  # unique timestamps: no accidental duplicate rows

    def good_cells(self) -> tuple[dict[str, bytes], dict[str, bytes], dict]:
        """(text cells, JSON values, typed row) of a fresh good row."""
        rng = self.rng
        self.clock += 1
        genres = [int(g) for g in rng.integers(0, 50, size=rng.integers(0, 4))]
        price = f"{rng.uniform(0, 1000):.2f}"
        p_true = None if rng.random() < 0.2 else round(float(rng.random()), 4)
        row = {
            "ts": self.clock,
            "user_id": int(rng.integers(0, 10**12)),
            "city": CITIES[rng.integers(len(CITIES))],
            "genres": genres,
            "price": float(price),
            "click": int(rng.integers(2)),
            "p_true": p_true,
        }
        text = {
            "ts": str(row["ts"]).encode(),
            "user_id": str(row["user_id"]).encode(),
            "city": row["city"].encode(),
            "genres": "|".join(map(str, genres)).encode(),
            "price": price.encode(),
            "click": str(row["click"]).encode(),
            "p_true": b"" if p_true is None else repr(p_true).encode(),
        }
        as_json = {
            **{k: v for k, v in text.items() if k not in ("city", "genres", "p_true")},
            "city": json.dumps(row["city"], ensure_ascii=False).encode(),
            "genres": json.dumps(genres).encode(),
            "p_true": b"null" if p_true is None else text["p_true"],
        }
        return text, as_json, row

    def line(self, cells: dict[str, bytes], names: list[str] = NAMES) -> bytes:
        if self.delimiter is None:
            return b"{" + b", ".join(b'"%s": %s' % (n.encode(), cells[n]) for n in names) + b"}"
        return self.delimiter.join(cells[n] for n in names)

    def record(self, line: bytes, reason: str | None, row: dict | None) -> bytes:
        if reason is None:
            self.events.append(row)
        else:
            self.bad[self.records] = reason
        self.records += 1
        return line

    def next_record(self, kept: list[tuple[bytes, dict]]) -> bytes:
        """One record: good, one field mutated, malformed, or a duplicate of a kept row."""
        text, as_json, row = self.good_cells()
        cells = as_json if self.delimiter is None else text
        draw = self.rng.random()
        if draw < 0.6:
            line = self.line(cells)
            kept.append((line, row))
            return self.record(line, None, row)
        if draw < 0.65 and kept:
            line, _ = kept[self.rng.integers(len(kept))]
            return self.record(line, "duplicate_row", None)
        if draw < 0.9:
            field, text_value, json_value, reason = MUTATIONS[self.rng.integers(len(MUTATIONS))]
            if self.delimiter is None:
                reason = "invalid_utf8" if reason.startswith("invalid_utf8") else reason
            cells = {**cells, field: json_value if self.delimiter is None else text_value}
            return self.record(self.line(cells), reason, None)
        if self.delimiter is None:
            return self.malformed_json(cells, row)
        return self.malformed_text(cells)

    def malformed_text(self, cells: dict[str, bytes]) -> bytes:
        kind = self.rng.integers(5)
        if kind == 0:
            return self.record(self.line(cells) + self.delimiter + b"extra", self.width(8), None)
        if kind == 1:
            return self.record(self.line(cells, NAMES[:5]), self.width(5), None)
        if kind == 2:
            return self.record(b"#### not a log line", self.width(1), None)
        if kind == 3:
            return self.record(b"\xfe\xff binary junk", self.width(1), None)
        cells = {**cells, "city": b"caf\xe9"}  # invalid UTF-8 in a row that is too short
        return self.record(self.line(cells, NAMES[:6]), self.width(6), None)

    @staticmethod
    def width(got: int) -> str:
        return f"parse_error: expected 7 fields, got {got}"

    def malformed_json(self, cells: dict[str, bytes], row: dict) -> bytes:
        kind = self.rng.integers(6)
        if kind == 0:  # an unknown key is ignored
            line = self.line({**cells, "extra": b'{"nested": [1]}'}, NAMES + ["extra"])
            return self.record(line, None, row)
        if kind == 1:  # an optional key may be absent
            return self.record(self.line(cells, NAMES[:-1]), None, {**row, "p_true": None})
        if kind == 2:
            line = self.line(cells)
            return self.record(line[: len(line) // 2], "parse_error: invalid JSON", None)
        if kind == 3:
            return self.record(b"#### not json", "parse_error: invalid JSON", None)
        if kind == 4:
            return self.record(b"[1, 2, 3]", "parse_error: not a JSON object", None)
        return self.record(b"\xfe\xff binary junk", "invalid_utf8", None)

    def file(self, rows: int) -> bytes:
        lines = [self.delimiter.join(n.encode() for n in NAMES)] if self.header else []
        kept: list[tuple[bytes, dict]] = []
        for _ in range(rows):
            if self.rng.random() < 0.03:
                lines.append(b"" if self.rng.random() < 0.5 else b"\r")  # blank: no record
            lines.append(self.next_record(kept))
        return b"\n".join(lines) + b"\n"


def write(path, data: bytes) -> None:
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(5))
def test_every_bad_record_is_quarantined_and_every_good_row_kept(
    tmp_path, monkeypatch, layout, seed
):
    # Small read blocks: every file spans many parser blocks and validation batches.
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 1024)
    logs = DirtyLogs(seed, layout)
    raw = tmp_path / "raw"
    raw.mkdir()
    names, records = [], []
    for i, suffix in enumerate(logs.suffixes):
        names.append(f"part-{i}{suffix}")
        before = logs.records
        write(raw / names[-1], logs.file(int(logs.rng.integers(60, 160))))
        records.append(logs.records - before)
    # A replayed delivery: the same bytes as an earlier file, under a later name.
    replayed = int(logs.rng.integers(len(names)))
    (raw / f"part-9{logs.suffixes[replayed]}").write_bytes((raw / names[replayed]).read_bytes())
    for _ in range(records[replayed]):
        logs.record(b"", f"duplicate_file:{raw / names[replayed]}", None)

    out = tmp_path / "out"
    config = IngestConfig(path=str(raw), max_bad_fraction=1.0, batch_rows=16, **logs.options)
    result = ingest_logs(config, SCHEMA, out)

    events = pq.read_table(out / "events")
    assert events.schema == event_schema(SCHEMA)
    assert events.to_pylist() == logs.events
    quarantine = pq.read_table(out / "quarantine")
    assert quarantine.schema == QUARANTINE_SCHEMA
    # DirtyLogs numbers records across files; ingest numbers them within each file.
    starts = np.cumsum([0, *records])
    files = [*names, f"part-9{logs.suffixes[replayed]}"]

    def local(record: int) -> tuple[str, int]:
        k = int(np.searchsorted(starts, record, side="right")) - 1
        return files[k], record - int(starts[k])

    got = {
        (q["source"].rsplit("/", 1)[1], q["record"]): q["reason"].split(" (")[0]
        for q in quarantine.to_pylist()
    }
    assert got == {local(record): reason for record, reason in logs.bad.items()}
    assert (result.rows, result.good_rows) == (logs.records, len(logs.events))
    assert result.bad_rows == quarantine.num_rows == len(logs.bad)
