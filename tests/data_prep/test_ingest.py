import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import DataError, InputNotFoundError
from data_prep.errors import SchemaError
from data_prep.ingest import (
    IngestConfig,
    _parse_numbers,
    describe_inputs,
    ingest_logs,
    resolve_inputs,
)

HEADER = "ts,user_id,city,price,click,p_true\n"
GOOD = [
    "1700000000,1,c1,3.5,1,0.2",
    "1700000001,2,c2,4.0,0,0.1",
    "1700000002,3,c1,10,0,",
]
BAD = {
    "1700000003,x,c1,3.5,1,0.2": "not_int64:user_id",
    "1700000004,,c1,3.5,1,0.2": "missing:user_id",
    "1700000005,4,c1,n/a,1,0.2": "not_float64:price",
    "1700000006,4,c1,1e400,1,0.2": "not_finite:price",
    "1700000007,4,c1,1.0,2,0.2": "label_out_of_range:click",
    "-3,4,c1,1.0,1,0.2": "timestamp_out_of_range:ts",
    "1700000008,99999999999999999999,c1,1.0,1,0.2": "int64_overflow:user_id",
    "1700000009,4,c1,1.0,1,0.2,extra": "parse_error: expected 6 fields, got 7",
}


def write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + "\n".join(rows) + "\n")


def test_csv_good_rows_typed_and_bad_rows_quarantined_with_reason(tmp_path, schema):
    write_csv(tmp_path / "raw" / "a.csv", GOOD + list(BAD))
    out = tmp_path / "out"
    result = ingest_logs(
        IngestConfig(path=str(tmp_path / "raw"), max_bad_fraction=0.9), schema, out
    )

    assert (result.rows, result.good_rows, result.bad_rows) == (11, 3, 8)
    events = pq.read_table(out / "events")
    assert events.schema.field("user_id").type == pa.int64()
    assert events.schema.field("price").type == pa.float64()
    assert events.column("user_id").to_pylist() == [1, 2, 3]
    assert events.column("p_true").to_pylist() == [0.2, 0.1, None]  # optional field may be empty
    quarantine = pq.read_table(out / "quarantine").to_pylist()
    assert sorted(q["reason"] for q in quarantine) == sorted(BAD.values())
    by_reason = {q["reason"]: q for q in quarantine}
    assert "x" in by_reason["not_int64:user_id"]["raw"]
    assert by_reason["not_int64:user_id"]["source"].endswith("a.csv")
    report = json.loads((out / "validation.json").read_text())
    assert report["bad_rows"] == 8 and report["reasons"]["missing:user_id"] == 1


def test_too_many_bad_rows_fails_with_reason_and_row(tmp_path, schema):
    write_csv(tmp_path / "raw.csv", GOOD + list(BAD))
    with pytest.raises(SchemaError, match=r"8 of 11 rows .* ingest.max_bad_fraction=0.01"):
        ingest_logs(IngestConfig(path=str(tmp_path / "raw.csv")), schema, tmp_path / "out")


def test_all_rows_malformed_fails(tmp_path, schema):
    write_csv(tmp_path / "raw.csv", list(BAD))
    with pytest.raises(SchemaError, match="8 of 8 rows"):
        ingest_logs(IngestConfig(path=str(tmp_path / "raw.csv")), schema, tmp_path / "out")


def test_missing_path_names_the_path(tmp_path, schema):
    missing = tmp_path / "nowhere"
    with pytest.raises(InputNotFoundError, match="nowhere"):
        ingest_logs(IngestConfig(path=str(missing)), schema, tmp_path / "out")


def test_missing_column_names_file_and_column(tmp_path, schema):
    (tmp_path / "a.csv").write_text("ts,user_id,price,click,p_true\n1,1,1.0,1,0.5\n")
    with pytest.raises(SchemaError, match="city"):
        ingest_logs(IngestConfig(path=str(tmp_path / "a.csv")), schema, tmp_path / "out")


def test_empty_input_is_a_data_error(tmp_path, schema):
    write_csv(tmp_path / "a.csv", [])
    (tmp_path / "a.csv").write_text(HEADER)
    with pytest.raises(DataError, match="no rows"):
        ingest_logs(IngestConfig(path=str(tmp_path / "a.csv")), schema, tmp_path / "out")


def test_jsonl_gzip_and_parquet_give_the_same_events(tmp_path, schema):
    records = [
        {
            "ts": 1700000000 + i,
            "user_id": i,
            "city": f"c{i % 2}",
            "price": 1.5 * i,
            "click": i % 2,
            "p_true": 0.5,
        }
        for i in range(5)
    ]
    lines = [json.dumps(r) for r in records] + ['{"ts": 17', '{"ts": 1700000009, "user_id": true}']
    (tmp_path / "j").mkdir()
    with gzip.open(tmp_path / "j" / "a.jsonl.gz", "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    (tmp_path / "p").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p" / "a.parquet")

    cfg = {"max_bad_fraction": 0.5}
    from_json = ingest_logs(IngestConfig(path=str(tmp_path / "j"), **cfg), schema, tmp_path / "o1")
    from_parquet = ingest_logs(
        IngestConfig(path=str(tmp_path / "p"), **cfg), schema, tmp_path / "o2"
    )

    assert from_json.good_rows == from_parquet.good_rows == 5
    assert from_json.bad_rows == 2
    assert sorted(r.split(" (")[0] for r in from_json.reasons) == [
        "not_int64:user_id",  # JSON true is not an integer
        "parse_error: invalid JSON",
    ]
    a = pq.read_table(tmp_path / "o1" / "events")
    b = pq.read_table(tmp_path / "o2" / "events")
    assert a.equals(b)


def test_resolve_skips_metadata_and_finds_globs(tmp_path):
    write_csv(tmp_path / "d" / "part-0.csv", GOOD)
    write_csv(tmp_path / "d" / "part-1.csv", GOOD)
    (tmp_path / "d" / "_bayes.json").write_text("{}")
    (tmp_path / "d" / "notes.txt").write_text("x")
    with pytest.raises(SchemaError, match="notes.txt"):
        resolve_inputs(str(tmp_path / "d"))
    names = [p for p, _ in resolve_inputs(str(tmp_path / "d" / "*.csv"))]
    assert [n.rsplit("/", 1)[1] for n in names] == ["part-0.csv", "part-1.csv"]
    described = describe_inputs(str(tmp_path / "d" / "*.csv"))
    # Named relative to the glob's directory, keyed by content: not by path or mtime.
    assert [d["name"] for d in described] == ["part-0.csv", "part-1.csv"]
    assert all(d["size"] > 0 and len(d["sha256"]) == 64 for d in described)
    assert described[0]["sha256"] == described[1]["sha256"]  # the same bytes


def test_reads_from_an_fsspec_url(schema, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/logs/day=1/a.csv", "w") as handle:
        handle.write(HEADER + "\n".join(GOOD) + "\n")
    inputs = resolve_inputs("memory://logs")
    assert inputs == [("memory:///logs/day=1/a.csv", "csv")]
    out = ingest_logs(IngestConfig(path="memory://logs"), schema, tmp_path / "out")
    assert out.good_rows == 3 and out.bad_rows == 0


@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_fast_and_pattern_number_parsing_agree(dtype):
    # A clean batch is parsed by pyarrow's cast alone; it must accept exactly what the
    # patterns accept, with the same values.
    rng = np.random.default_rng(0)
    alphabet = list("0123456789+-.eExXnaNIifty() ") + ["nan", "inf", "0x", "9" * 18, "2" * 19]
    texts = ["".join(rng.choice(alphabet, size=rng.integers(1, 6))) for _ in range(4_000)]
    texts += ["0x10", "nan(1)", "+5", "-0", "0005", "1e400", "-nan", "Infinity", " 5", "5."]
    texts += ["9223372036854775807", "9223372036854775808", "-9223372036854775809", "9" * 19]
    for text in texts:
        fast_values, fast_ok, fast_checks = _parse_numbers(pa.array([text]), dtype, "x")
        slow_values, slow_ok, slow_checks = _parse_numbers(pa.array([text]), dtype, "x", fast=False)
        assert fast_ok.tolist() == slow_ok.tolist(), text
        assert [(r, m.tolist()) for r, m in fast_checks] == [
            (r, m.tolist()) for r, m in slow_checks
        ], text
        if fast_ok[0]:
            assert fast_values.equals(slow_values), text
