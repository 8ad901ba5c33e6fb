"""Readers and ingest on every supported layout: exact events, reasons and record numbers."""

import bz2
import gzip
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep import readers
from data_prep.errors import SchemaError
from data_prep.ingest import IngestConfig, event_schema, ingest_logs
from data_prep.presets import PRESETS
from data_prep.schema import SchemaConfig

ROWS = [
    "1700000000,1,paris,3.5,1,0.2",
    "1700000001,2,são paulo,4.0,0,0.1",
    "1700000002,3,tokyo,10,0,",
]
HEADER = "ts,user_id,city,price,click,p_true"
EXPECTED = [
    {"ts": 1700000000, "user_id": 1, "city": "paris", "price": 3.5, "click": 1, "p_true": 0.2},
    {"ts": 1700000001, "user_id": 2, "city": "são paulo", "price": 4.0, "click": 0, "p_true": 0.1},
    {"ts": 1700000002, "user_id": 3, "city": "tokyo", "price": 10.0, "click": 0, "p_true": None},
]


def run(tmp_path, schema, path, **options):
    """Ingest ``path``; return (result, events as rows, quarantine as rows)."""
    out = tmp_path / "out"
    options.setdefault("max_bad_fraction", 1.0)
    result = ingest_logs(IngestConfig(path=str(path), **options), schema, out)
    events = pq.read_table(out / "events") if (out / "events").exists() else None
    quarantine = pq.read_table(out / "quarantine").to_pylist() if result.bad_rows else []
    return result, events, quarantine


def reasons_by_location(quarantine):
    return {q["location"]: q["reason"] for q in quarantine}


@pytest.mark.parametrize(
    ("name", "options", "text"),
    [
        ("a.csv", {"header": False}, "\n".join(ROWS)),
        ("a.tsv", {"header": False}, "\n".join(r.replace(",", "\t") for r in ROWS)),
        ("a.tsv", {}, "\n".join([HEADER] + ROWS).replace(",", "\t")),
        (
            "a.txt",
            {"format": "csv", "delimiter": ";"},
            "\n".join([HEADER] + ROWS).replace(",", ";"),
        ),
        (
            "a.dat",
            {"format": "csv", "header": False, "delimiter": "::"},
            "\n".join(ROWS).replace(",", "::"),
        ),
        ("a.csv", {}, "\r\n".join([HEADER] + ROWS) + "\r\n"),
        ("a.csv", {}, "\ufeff" + "\n".join([HEADER] + ROWS)),  # byte-order mark, no final newline
    ],
    ids=["csv", "tsv", "tsv-header", "semicolon", "double-colon", "crlf", "bom"],
)
def test_delimited_layouts_give_the_same_events(tmp_path, schema, name, options, text):
    (tmp_path / name).write_text(text, encoding="utf-8")
    result, events, _ = run(tmp_path, schema, tmp_path / name, **options)
    assert result.bad_rows == 0
    assert events.to_pylist() == EXPECTED
    assert events.schema == event_schema(schema)


def test_headerless_rows_of_the_wrong_width_are_parse_errors_with_their_line(tmp_path, schema):
    lines = [ROWS[0], "1700000005,4,paris", ROWS[1], ROWS[2] + ",extra"]
    (tmp_path / "a.dat").write_text("\n".join(lines).replace(",", "::") + "\n")
    options = {"format": "csv", "header": False, "delimiter": "::"}
    result, events, quarantine = run(tmp_path, schema, tmp_path / "a.dat", **options)
    assert events.column("user_id").to_pylist() == [1, 2]
    assert reasons_by_location(quarantine) == {
        "line 2": "parse_error: expected 6 fields, got 3",
        "line 4": "parse_error: expected 6 fields, got 7",
    }
    assert [q["record"] for q in quarantine] == [1, 3]
    assert quarantine[0]["raw"] == "1700000005::4::paris"


def test_quoted_fields_keep_their_delimiters(tmp_path, schema):
    text = HEADER + '\n1700000000,1,"paris, france",3.5,1,0.2\n1700000001,2,"say ""hi""",1,0,\n'
    (tmp_path / "a.csv").write_text(text)
    _, events, _ = run(tmp_path, schema, tmp_path / "a.csv")
    assert events.column("city").to_pylist() == ["paris, france", 'say "hi"']


@pytest.mark.parametrize("suffix", [".gz", ".zst", ".bz2"])
def test_compressed_files_are_read_by_extension(tmp_path, schema, suffix):
    data = ("\n".join([HEADER] + ROWS) + "\n").encode()
    compress = {
        ".gz": gzip.compress,
        ".zst": zstandard.ZstdCompressor().compress,
        ".bz2": bz2.compress,
    }[suffix]
    (tmp_path / f"a.csv{suffix}").write_bytes(compress(data))
    _, events, _ = run(tmp_path, schema, tmp_path / f"a.csv{suffix}")
    assert events.to_pylist() == EXPECTED


def test_a_directory_glob_and_url_of_many_files(tmp_path, schema):
    fs = fsspec.filesystem("memory")
    for i, row in enumerate(ROWS):
        with fs.open(f"/many/day={i}/part.csv", "w") as handle:
            handle.write(HEADER + "\n" + row + "\n")
    _, events, _ = run(tmp_path, schema, "memory://many/*/part.csv")
    assert events.to_pylist() == EXPECTED
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "events").iterdir()) == [
        "part-00000-00000.parquet",
        "part-00001-00000.parquet",
        "part-00002-00000.parquet",
    ]


def test_blank_lines_are_not_records_and_line_numbers_stay_true(tmp_path, schema):
    lines = ["", HEADER, ROWS[0], "", "\r", "1700000009,x,paris,1,1,", ROWS[1], "", ROWS[2]]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n\n")
    result, events, quarantine = run(tmp_path, schema, tmp_path / "a.csv")
    assert result.rows == 4 and events.to_pylist() == EXPECTED
    assert quarantine == [
        {
            "source": str(tmp_path / "a.csv"),
            "location": "line 6",
            "reason": "not_int64:user_id",
            "raw": json.dumps(
                dict(zip(HEADER.split(","), "1700000009,x,paris,1,1,".split(","), strict=True))
            ),
            "record": 1,
        }
    ]


def test_a_file_that_does_not_parse_at_all_fails_early(tmp_path, schema, monkeypatch):
    monkeypatch.setattr(readers, "_MAX_LEADING_REJECTS", 500)
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 1024)
    (tmp_path / "a.csv").write_text("\n".join(r.replace(",", ";") for r in ROWS * 400) + "\n")
    with pytest.raises(
        SchemaError, match=r"a.csv: none of the first 500 lines .* ingest.delimiter"
    ):
        run(tmp_path, schema, tmp_path / "a.csv", header=False)


def test_rejected_lines_between_rows_do_not_pile_up(tmp_path, schema, monkeypatch):
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 1024)
    pending = []
    on_invalid = readers._CsvReader._on_invalid

    def spy(self, row):
        pending.append(len(self.events))
        return on_invalid(self, row)

    monkeypatch.setattr(readers._CsvReader, "_on_invalid", spy)
    lines = [ROWS[0]] + ["garbage"] * 3000 + [ROWS[1]] + ["x;y"] * 1000 + [ROWS[2]]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    result, events, quarantine = run(tmp_path, schema, tmp_path / "a.csv", header=False)
    assert events.to_pylist() == EXPECTED
    assert result.rows == 4003
    assert [q["record"] for q in quarantine] == list(range(1, 3001)) + list(range(3002, 4002))
    assert max(pending) < 1000  # settled block by block, not held until the next row


# --------------------------------------------------------------------------- invalid UTF-8


def test_one_invalid_utf8_byte_quarantines_only_its_row(tmp_path, schema):
    data = "\n".join([HEADER, ROWS[0], "1700000005,4,par\xffis,1,1,", ROWS[1], ROWS[2]]).encode()
    data = data.replace("\xff".encode(), b"\xff")
    (tmp_path / "a.csv").write_bytes(data + b"\n")
    result, events, quarantine = run(tmp_path, schema, tmp_path / "a.csv")
    assert events.to_pylist() == EXPECTED
    assert events.schema.field("city").type == pa.string()
    assert reasons_by_location(quarantine) == {"line 3": "invalid_utf8:city"}
    assert json.loads(quarantine[0]["raw"])["city"] == "par\\xffis"  # the byte, escaped


def test_invalid_utf8_in_a_malformed_row_or_an_unread_column(tmp_path, schema):
    header = HEADER + ",note"
    lines = [
        header.encode(),
        ROWS[0].encode() + b",ok",
        b"1700000005,4,par\xffis,1,1",  # too few fields as well
        ROWS[1].encode() + b",caf\xe9",  # the bad byte is in a column the schema does not read
        ROWS[2].encode() + b",",
    ]
    (tmp_path / "a.csv").write_bytes(b"\n".join(lines) + b"\n")
    _, events, quarantine = run(tmp_path, schema, tmp_path / "a.csv")
    assert events.to_pylist() == EXPECTED
    assert reasons_by_location(quarantine) == {"line 3": "parse_error: expected 7 fields, got 5"}
    assert quarantine[0]["raw"] == "1700000005,4,par\\xffis,1,1"


def test_invalid_utf8_in_a_jsonl_line(tmp_path, schema):
    good = [json.dumps(r, ensure_ascii=False).encode() for r in EXPECTED]
    bad = b'{"ts": 1700000004, "user_id": 4, "city": "par\xffis", "price": 1, "click": 1}'
    (tmp_path / "a.jsonl").write_bytes(b"\n".join([good[0], bad, b"", good[1], good[2]]))
    _, events, quarantine = run(tmp_path, schema, tmp_path / "a.jsonl")
    assert events.to_pylist() == EXPECTED
    assert [(q["location"], q["reason"], q["record"]) for q in quarantine] == [
        ("line 2", "invalid_utf8", 1)
    ]


def test_invalid_utf8_in_a_parquet_string_column(tmp_path, schema):
    table = pa.Table.from_pylist(EXPECTED).set_column(
        2, "city", pa.array([b"paris", b"s\xe3o", b"tokyo"], pa.binary())
    )
    pq.write_table(table, tmp_path / "a.parquet")
    _, events, quarantine = run(tmp_path, schema, tmp_path / "a.parquet")
    assert events.column("user_id").to_pylist() == [1, 3]
    assert reasons_by_location(quarantine) == {"row 2": "invalid_utf8:city"}


def test_a_line_longer_than_the_parser_block_is_quarantined(tmp_path, schema, monkeypatch):
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 256)
    long_row = "1700000005,4," + "x" * 1000 + ",1,1,"
    lines = [HEADER, ROWS[0], long_row, ROWS[1], "1700000006,4," + "y" * 70 + ",1,1,", ROWS[2]]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    _, events, quarantine = run(tmp_path, schema, tmp_path / "a.csv")
    assert events.to_pylist() == EXPECTED
    assert reasons_by_location(quarantine) == {
        "line 3": "parse_error: line of 1018 bytes, longer than 64",
        "line 5": "parse_error: line of 88 bytes, longer than 64",
    }


# --------------------------------------------------------------------------- multi-hot

MULTI_HOT = SchemaConfig(
    fields=[
        {"name": "ts", "dtype": "int64", "role": "timestamp"},
        {"name": "genres", "dtype": "int64", "role": "sparse", "multi_hot": True},
        {"name": "tags", "dtype": "string", "role": "sparse", "multi_hot": True, "separator": ";"},
        {"name": "click", "dtype": "int64", "role": "label"},
    ]
)
MULTI_HOT_EXPECTED = [
    {"ts": 1, "genres": [1, 2, 3], "tags": ["a", "b"], "click": 1},
    {"ts": 2, "genres": [], "tags": [], "click": 0},
    {"ts": 3, "genres": [7], "tags": ["only"], "click": 0},
]


def test_multi_hot_in_csv(tmp_path):
    lines = [
        "ts,genres,tags,click",
        "1,1|2|3,a;b,1",
        "2,,,0",
        "3,7,only,0",
        "4,1|x,a,1",
        "5,1||2,a,1",
        "6,99999999999999999999,a,1",
        "7,1,a;;b,1",
    ]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    _, events, quarantine = run(tmp_path, MULTI_HOT, tmp_path / "a.csv")
    assert events.to_pylist() == MULTI_HOT_EXPECTED
    assert events.schema.field("genres").type == pa.list_(pa.int64())
    assert events.schema.field("tags").type == pa.list_(pa.string())
    assert reasons_by_location(quarantine) == {
        "line 5": "not_int64:genres",
        "line 6": "empty_element:genres",
        "line 7": "int64_overflow:genres",
        "line 8": "empty_element:tags",
    }


def test_multi_hot_in_jsonl(tmp_path):
    lines = [
        {"ts": 1, "genres": [1, 2, 3], "tags": ["a", "b"], "click": 1},
        {"ts": 2, "genres": [], "tags": "", "click": 0},  # text is split, "" is empty
        {"ts": 3, "genres": 7, "tags": "only", "click": 0},  # one id, as in text
        {"ts": 4, "genres": [1, "x"], "tags": [], "click": 1},
        {"ts": 5, "genres": {"a": 1}, "tags": [], "click": 1},  # an object is not a list
        {"ts": 6, "genres": [1, None], "tags": [], "click": 1},
        {"ts": 7, "genres": [1], "tags": ["a", 5, True], "click": 1},
        {"ts": 8, "tags": [], "click": 1},
    ]
    text = "\n".join(json.dumps(r) for r in lines)
    (tmp_path / "a.jsonl").write_text(text)
    _, events, quarantine = run(tmp_path, MULTI_HOT, tmp_path / "a.jsonl")
    assert events.to_pylist() == MULTI_HOT_EXPECTED
    assert reasons_by_location(quarantine) == {
        "line 4": "not_int64:genres",
        "line 5": "not_int64:genres",
        "line 6": "not_int64:genres",
        "line 7": "not_string:tags",
        "line 8": "missing:genres",
    }


def test_multi_hot_in_parquet_lists_and_text(tmp_path):
    table = pa.table(
        {
            "ts": [1, 2, 3, 4],
            "genres": pa.array([[1, 2, 3], [], [7], None], pa.list_(pa.int64())),
            "tags": ["a;b", "", "only", "x"],
            "click": [1, 0, 0, 1],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    _, events, quarantine = run(tmp_path, MULTI_HOT, tmp_path / "a.parquet")
    assert events.to_pylist() == MULTI_HOT_EXPECTED
    assert reasons_by_location(quarantine) == {"row 4": "missing:genres"}


# --------------------------------------------------------------------------- generated, threshold

GENERATED = SchemaConfig(
    fields=[
        {"name": "label", "dtype": "int64", "role": "label"},
        {"name": "item", "dtype": "string", "role": "sparse"},
        {"name": "ts", "dtype": "int64", "role": "timestamp", "generated": "row_number"},
    ]
)


def test_generated_timestamps_number_every_record_across_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.tsv").write_text("0\ta\n1\n\n1\tb\n")  # a bad row, then a blank line
    (tmp_path / "d" / "b.tsv").write_text("2\tc\n0\td\n")
    result, events, quarantine = run(tmp_path, GENERATED, tmp_path / "d", header=False)
    assert result.rows == 5
    assert events.to_pylist() == [
        {"label": 0, "item": "a", "ts": 0},
        {"label": 1, "item": "b", "ts": 2},
        {"label": 0, "item": "d", "ts": 4},
    ]
    assert [(q["record"], q["reason"]) for q in quarantine] == [
        (1, "parse_error: expected 2 fields, got 1"),
        (3, "label_out_of_range:label"),
    ]


def test_thresholded_label_is_int_0_or_1(tmp_path):
    preset = PRESETS["movielens-ratings-csv"]
    text = (
        "userId,movieId,rating,timestamp\n"
        "1,10,4.0,964982703\n1,11,3.5,964982704\n2,10,5,964982705\n"
        "2,12,NaN,964982706\n2,13,good,964982707\n2,14,,964982708\n"
    )
    (tmp_path / "ratings.csv").write_text(text)
    out = tmp_path / "out"
    config = preset.ingest_config(str(tmp_path / "ratings.csv"), max_bad_fraction=1.0)
    ingest_logs(config, preset.schema_config(), out)
    events = pq.read_table(out / "events")
    assert events.schema.field("rating").type == pa.int64()
    assert events.column("rating").to_pylist() == [1, 0, 1]
    quarantine = pq.read_table(out / "quarantine").to_pylist()
    assert [q["reason"] for q in quarantine] == [
        "not_finite:rating",
        "not_float64:rating",
        "missing:rating",
    ]


def test_movielens_renditions_give_the_same_events(tmp_path):
    rows = [(1, 10, "4.0", 964982703), (1, 11, "3.5", 964982704), (2, 10, "5", 964982705)]
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows)
    )
    (tmp_path / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    (tmp_path / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    tables = []
    for name, file in [
        ("movielens-ratings-csv", "ratings.csv"),
        ("movielens-u-data", "u.data"),
        ("movielens-ratings-dat", "ratings.dat"),
    ]:
        preset = PRESETS[name]
        out = tmp_path / name
        ingest_logs(preset.ingest_config(str(tmp_path / file)), preset.schema_config(), out)
        tables.append(pq.read_table(out / "events"))
    assert tables[0].column("rating").to_pylist() == [1, 0, 1]
    assert tables[0].equals(tables[1]) and tables[0].equals(tables[2])


# --------------------------------------------------------------------------- duplicates


def test_exact_duplicate_rows_within_a_file_keep_the_first(tmp_path, schema):
    lines = [HEADER, ROWS[0], ROWS[1], ROWS[0], ROWS[2], ROWS[1].replace("4.0", "4.00"), ROWS[0]]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.csv").write_text("\n".join([HEADER, ROWS[0]]) + "\n")  # another file
    result, events, quarantine = run(tmp_path, schema, tmp_path, batch_rows=2)
    assert events.to_pylist() == EXPECTED + EXPECTED[:1]  # across files: not detected
    assert reasons_by_location(quarantine) == {
        "line 4": "duplicate_row",
        "line 6": "duplicate_row",  # 4.00 == 4.0: rows are compared by their typed values
        "line 7": "duplicate_row",
    }


def test_a_replayed_file_is_quarantined_without_parsing(tmp_path, schema, monkeypatch):
    text = "\n".join([HEADER] + ROWS) + "\n"
    for name in ("a.csv", "b.csv", "c.csv"):
        (tmp_path / name).write_text(text if name != "b.csv" else text.replace("paris", "lyon"))
    parsed = []
    original = readers.read_batches

    def counting(url, *args, **kwargs):
        parsed.append(url.rsplit("/", 1)[1])
        return original(url, *args, **kwargs)

    monkeypatch.setattr("data_prep.ingest.read_batches", counting)
    result, events, quarantine = run(tmp_path, schema, tmp_path)
    assert parsed == ["a.csv", "b.csv"]
    assert (result.rows, result.good_rows) == (9, 6)
    assert result.reasons == {f"duplicate_file:{tmp_path / 'a.csv'}": 3}
    # Records are numbered per file (from 0) unless a generated timestamp needs file order.
    assert [q["record"] for q in quarantine] == [0, 1, 2]
    report = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert report["files"][2]["duplicate_of"] == str(tmp_path / "a.csv")


# --------------------------------------------------------------------------- formats agree


def test_csv_jsonl_and_parquet_renditions_give_the_same_events(tmp_path):
    schema = SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user", "dtype": "int64", "role": "sparse"},
            {"name": "genres", "dtype": "string", "role": "sparse", "multi_hot": True},
            {"name": "price", "dtype": "float64", "role": "dense", "required": False},
            {"name": "rating", "dtype": "float64", "role": "label", "threshold": 4.0},
        ]
    )
    records = [
        {
            "ts": 10 + i,
            "user": i,
            "genres": ["g1", "g2"][: i % 3],
            "price": None if i % 4 else 0.5 * i,
            "rating": 1.0 + i % 5,
        }
        for i in range(12)
    ]
    csv_lines = ["ts,user,genres,price,rating"] + [
        f"{r['ts']},{r['user']},{'|'.join(r['genres'])},{'' if r['price'] is None else r['price']},"
        f"{r['rating']}"
        for r in records
    ]
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.csv").write_text("\n".join(csv_lines) + "\n")
    (tmp_path / "jsonl").mkdir()
    with gzip.open(tmp_path / "jsonl" / "a.jsonl.gz", "wt") as handle:
        handle.write("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "parquet" / "a.parquet")

    tables = []
    for kind in ("csv", "jsonl", "parquet"):
        out = tmp_path / f"out-{kind}"
        result = ingest_logs(IngestConfig(path=str(tmp_path / kind)), schema, out)
        assert result.bad_rows == 0
        tables.append(pq.read_table(out / "events"))
    assert tables[0].equals(tables[1]) and tables[0].equals(tables[2])
    assert tables[0].column("rating").to_pylist() == [int(r["rating"] >= 4) for r in records]


def test_missing_header_column_names_file_and_column(tmp_path, schema):
    (tmp_path / "a.tsv").write_text("ts\tuser_id\tcity\tprice\tclick\n1\t1\tc\t1\t1\n")
    with pytest.raises(SchemaError, match=r"a.tsv.*\['p_true'\].*ingest.header=false"):
        run(tmp_path, schema, tmp_path / "a.tsv")


def test_output_is_the_same_bytes_whatever_the_thread_count(tmp_path, schema):
    lines = [HEADER] + [f"{1700000000 + i},{i % 7},c{i % 3},{i}.5,{i % 2}," for i in range(3000)]
    lines[100] = "1700000000,x,c,1,1,"
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    outputs = []
    before = pa.cpu_count()
    try:
        for threads in (1, 4):
            pa.set_cpu_count(threads)
            out = tmp_path / f"out{threads}"
            ingest_logs(IngestConfig(path=str(tmp_path / "a.csv"), batch_rows=500), schema, out)
            outputs.append({p.relative_to(out): p.read_bytes() for p in out.rglob("*.*")})
    finally:
        pa.set_cpu_count(before)
    assert outputs[0] == outputs[1]
