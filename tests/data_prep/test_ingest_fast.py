"""Ingest's fast paths: a clean column and files ingested in parallel change nothing."""

import numpy as np
import pyarrow as pa
import pytest

from data_prep import ingest, readers
from data_prep.ingest import IngestConfig, ingest_logs
from data_prep.schema import FieldSpec, SchemaConfig

SCHEMA = SchemaConfig(
    label_values=[0, 1],
    min_timestamp=0,
    max_timestamp=2_000_000_000,
    fields=[
        {"name": "ts", "dtype": "int64", "role": "timestamp"},
        {"name": "user_id", "dtype": "int64", "role": "sparse"},
        {"name": "city", "dtype": "string", "role": "sparse"},
        {"name": "price", "dtype": "float64", "role": "dense"},
        {"name": "click", "dtype": "int64", "role": "label"},
        {"name": "rating", "dtype": "float64", "role": "label", "threshold": 4.0},
        {"name": "p_true", "dtype": "float64", "role": "oracle", "required": False},
    ],
)
ALPHABET = list("0123456789+-.eExXnaNIifty() ") + ["nan", "inf", "0x", "9" * 18, "2" * 19]


def _spec(name: str) -> FieldSpec:
    return next(f for f in SCHEMA.fields if f.name == name)


def _full_path(text: pa.Array, spec: FieldSpec, monkeypatch) -> tuple:
    with monkeypatch.context() as patch:
        patch.setattr(ingest, "_parse_clean_scalar", lambda *args: None)
        return ingest._parse_scalar(text, spec, SCHEMA)


@pytest.mark.parametrize("name", [f.name for f in SCHEMA.fields])
def test_a_clean_column_parses_as_the_full_checks_do(name, monkeypatch):
    # Columns of mostly valid values with one random cell: wherever the clean path
    # answers, the full path must flag nothing and give the same values and hashes.
    rng = np.random.default_rng(1)
    spec = _spec(name)
    valid = {
        "string": ["a", "zürich", "b c"],
        "int64": ["0", "1", "17"] if name != "click" else ["0", "1"],
    }
    valid["float64"] = ["0.5", "1", "-2.25e3"] if name != "rating" else ["3.5", "4", "5.0"]
    answered = 0
    for _ in range(1_500):
        cells = list(rng.choice(valid[spec.dtype], size=5))
        cells[int(rng.integers(5))] = "".join(rng.choice(ALPHABET, size=rng.integers(0, 6)))
        text = pa.array(cells, pa.string())
        fast = ingest._parse_clean_scalar(text, spec, SCHEMA)
        if fast is None:
            continue
        answered += 1
        values, checks, key = _full_path(text, spec, monkeypatch)
        assert fast[1] == [], cells
        assert not any(mask.any() for _, mask in checks), cells
        assert fast[0].equals(values), cells
        assert np.array_equal(fast[2], key), cells
    assert answered >= 10  # the clean path was exercised


def test_the_clean_path_declines_what_the_patterns_reject():
    for name, cells in [
        ("user_id", ["1", "0x10"]),  # pyarrow parses hex; the patterns do not
        ("user_id", ["1", ""]),  # missing
        ("price", ["1", "nan(1)"]),
        ("price", ["1", "inf"]),  # not finite
        ("click", ["0", "2"]),  # label out of range
        ("ts", ["1", "-5"]),  # timestamp out of range
        ("p_true", ["0.5", ""]),  # allowed empty: null, left to the full path
        ("city", ["a", ""]),
    ]:
        assert ingest._parse_clean_scalar(pa.array(cells), _spec(name), SCHEMA) is None, cells


def _write_logs(directory) -> None:
    directory.mkdir()
    header = "ts,user_id,city,price,click,rating,p_true\n"
    for k in range(4):
        rows = [
            f"{1_700_000_000 + i},{i % 13},c{i % 5},{i % 7}.5,{i % 2},{i % 6},0.{i % 9}"
            for i in range(2_500)
        ]
        rows[7 * k + 3] = f"1700000000,x{k},c,1,1,1,"  # not_int64
        rows[100 + k] = rows[99 + k]  # duplicate_row
        rows[500] = "1,2,3"  # parse_error
        (directory / f"part-{k}.csv").write_text(header + "\n".join(rows) + "\n")
    # A replayed file: quarantined from the report of the file it repeats.
    (directory / "part-9.csv").write_bytes((directory / "part-1.csv").read_bytes())


def test_files_ingested_in_parallel_give_the_same_bytes(tmp_path):
    _write_logs(tmp_path / "raw")
    outputs, results = [], []
    for workers in (1, 2, 3):
        out = tmp_path / f"out{workers}"
        config = IngestConfig(path=str(tmp_path / "raw"), batch_rows=700, max_bad_fraction=0.5)
        progress: list[int] = []
        results.append(
            ingest_logs(config, SCHEMA, out, on_progress=progress.append, workers=workers)
        )
        assert progress[-1] == results[-1].rows
        outputs.append({p.relative_to(out): p.read_bytes() for p in out.rglob("*.*")})
    assert outputs[0] == outputs[1] == outputs[2]
    counts = [(r.rows, r.good_rows, r.reasons, r.files) for r in results]
    assert counts[0] == counts[1] == counts[2]
    reasons = results[0].reasons
    assert reasons["not_int64:user_id"] == 4 and reasons["duplicate_row"] == 4
    assert reasons["duplicate_file:" + str(tmp_path / "raw" / "part-1.csv")] == 2_500


def test_the_seen_rows_set_flags_every_repeat_but_the_first():
    # Against a Python set over random batches with many repeats, within and across batches.
    rng = np.random.default_rng(0)
    for _ in range(200):
        seen, rows = set(), ingest._SeenRows()
        for _ in range(int(rng.integers(1, 12))):
            batch = rng.integers(0, rng.integers(1, 300), rng.integers(0, 50)).astype(np.uint64)
            expected = []
            for value in batch.tolist():
                expected.append(value in seen)
                seen.add(value)
            assert rows.add(batch).tolist() == expected


def test_blank_line_search_agrees_with_the_substring_search():
    rng = np.random.default_rng(2)
    for _ in range(3_000):
        piece = bytes(rng.choice(list(b"ab\r\n,"), size=int(rng.integers(0, 12))))
        expected = b"\n\n" in piece or b"\n\r\n" in piece
        assert readers._has_blank_line(piece) == expected, piece


def test_prefetching_keeps_order_raises_the_readers_error_and_stops_early():
    assert list(ingest._prefetched(iter(range(50)))) == list(range(50))

    def failing():
        yield 1
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        list(ingest._prefetched(failing()))

    closed = []

    def endless():
        try:
            n = 0
            while True:
                yield n
                n += 1
        finally:
            closed.append(True)

    for item in ingest._prefetched(endless(), depth=2):
        if item == 3:
            break
    assert closed == [True]


def test_an_error_while_validating_stops_the_reader_thread(tmp_path, monkeypatch):
    import threading

    _write_logs(tmp_path / "raw")
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("validation broke")
        return real(*args, **kwargs)

    real = ingest.validate_batch
    monkeypatch.setattr(ingest, "validate_batch", failing)
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 1 << 12)  # several batches per file
    config = IngestConfig(path=str(tmp_path / "raw" / "part-0.csv"), batch_rows=200)
    with pytest.raises(RuntimeError, match="validation broke") as raised:
        ingest_logs(config, SCHEMA, tmp_path / "out", workers=1)
    # Checked while the traceback (and so the failed call's frames) is still alive.
    assert raised.traceback
    assert not [t for t in threading.enumerate() if t.name == "ingest-reader"]
