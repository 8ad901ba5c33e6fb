"""Tests for data_prep.synthetic: formats, ordering, determinism, Bayes AUC, corruption."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from sklearn.metrics import roc_auc_score

from artifacts.errors import ConfigError
from data_prep import synthetic
from data_prep.synthetic import COLUMNS, SCHEMA, GenerateConfig, GenerateResult, generate_logs

DAY = 86_400


def _config(tmp_path: Path, **overrides: object) -> GenerateConfig:
    """A tiny config: a few thousand rows, several chunks and files."""
    fields: dict[str, object] = {
        "out": str(tmp_path / "raw"),
        "num_rows": 3_000,
        "num_users": 200,
        "num_items": 300,
        "num_categories": 8,
        "num_cities": 5,
        "num_files": 3,
        "days": 7,
        "chunk_rows": 700,
    }
    fields.update(overrides)
    return GenerateConfig(**fields)


def _read(result: GenerateResult, fmt: str) -> pa.Table:
    """All data files of a well-formed output as one table."""
    if fmt == "csv":
        tables = [pacsv.read_csv(f) for f in result.files]
    elif fmt == "jsonl":
        tables = [pajson.read_json(f) for f in result.files]
    else:
        tables = [pq.read_table(f) for f in result.files]
    return pa.concat_tables(tables)


def _data_bytes(out_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out_dir.glob("part-*"))}


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_formats_read_back_with_exact_schema(tmp_path: Path, fmt: str) -> None:
    config = _config(tmp_path, format=fmt)
    result = generate_logs(config)

    assert [f.name for f in result.files] == [f"part-{k:05d}.{fmt}" for k in range(3)]
    assert sorted(p.name for p in result.out_dir.iterdir()) == sorted(
        ["_bayes.json"] + [f.name for f in result.files]
    )
    table = _read(result, fmt)
    assert table.schema.names == list(COLUMNS)
    assert table.schema == SCHEMA
    assert table.num_rows == result.num_rows == 3_000
    # Rows split evenly over files: 1000 each (CSV: plus a header line).
    for path in result.files:
        if fmt == "parquet":
            assert pq.read_metadata(path).num_rows == 1_000
        else:
            lines = path.read_text().splitlines()
            assert len(lines) == 1_000 + (fmt == "csv")
    if fmt == "csv":
        assert result.files[0].read_text().splitlines()[0] == ",".join(COLUMNS)
    if fmt == "jsonl":
        first = json.loads(result.files[0].read_text().splitlines()[0])
        assert list(first) == list(COLUMNS)


def test_formats_hold_the_same_rows(tmp_path: Path) -> None:
    tables = {}
    for fmt in ("csv", "jsonl", "parquet"):
        result = generate_logs(_config(tmp_path, out=str(tmp_path / fmt), format=fmt))
        tables[fmt] = _read(result, fmt)
    assert tables["csv"].equals(tables["parquet"])
    assert tables["jsonl"].equals(tables["parquet"])


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    for fmt in ("csv", "parquet"):
        a = generate_logs(_config(tmp_path, out=str(tmp_path / f"a_{fmt}"), format=fmt))
        b = generate_logs(_config(tmp_path, out=str(tmp_path / f"b_{fmt}"), format=fmt))
        c = generate_logs(_config(tmp_path, out=str(tmp_path / f"c_{fmt}"), format=fmt, seed=1))
        assert _data_bytes(a.out_dir) == _data_bytes(b.out_dir)
        assert (a.bayes_auc, a.click_rate) == (b.bayes_auc, b.click_rate)
        for name, data in _data_bytes(c.out_dir).items():
            assert data != _data_bytes(a.out_dir)[name]


def test_timestamps_ordered_in_range_and_hour_matches(tmp_path: Path) -> None:
    config = _config(tmp_path, format="parquet", start_ts=1_700_000_123)
    table = _read(generate_logs(config), "parquet")
    ts = table["ts"].to_numpy()

    assert np.all(np.diff(ts) >= 0)
    assert ts.min() >= config.start_ts
    assert ts.max() < config.start_ts + config.days * DAY
    # The log spans the whole window, not just its start.
    assert ts.max() - ts.min() > 0.95 * config.days * DAY
    np.testing.assert_array_equal(table["hour"].to_numpy(), (ts % DAY) // 3600)
    # Diurnal activity: the busiest hour is far busier than the quietest.
    per_hour = np.bincount(table["hour"].to_numpy(), minlength=24)
    assert per_hour.max() > 3 * per_hour.min()


def test_value_domains_and_per_entity_attributes(tmp_path: Path) -> None:
    config = _config(tmp_path, format="parquet")
    table = _read(generate_logs(config), "parquet").to_pylist()

    users = {row["user_id"] for row in table}
    items = {row["item_id"] for row in table}
    assert min(users) >= 1 and max(users) <= config.num_users
    assert min(items) >= 1 and max(items) <= config.num_items
    assert {row["position"] for row in table} <= set(range(1, 11))
    assert {row["click"] for row in table} == {0, 1}
    assert {row["device"] for row in table} <= {"ios", "android", "web", "tablet"}
    assert {row["city"] for row in table} <= {f"city_{i:02d}" for i in range(5)}
    assert {row["category"] for row in table} <= {f"cat_{i:03d}" for i in range(8)}

    city_of: dict[int, set[str]] = {}
    item_attrs: dict[int, set[tuple[str, float]]] = {}
    for row in table:
        city_of.setdefault(row["user_id"], set()).add(row["city"])
        item_attrs.setdefault(row["item_id"], set()).add((row["category"], row["price"]))
    assert all(len(cities) == 1 for cities in city_of.values())
    assert all(len(attrs) == 1 for attrs in item_attrs.values())
    prices = np.array([next(iter(attrs))[1] for attrs in item_attrs.values()])
    assert np.all(prices > 0)
    np.testing.assert_array_equal(prices, np.round(prices, 2))
    p_true = np.array([row["p_true"] for row in table])
    assert np.all((p_true > 0) & (p_true < 1))


def test_devices_mostly_fixed_per_user(tmp_path: Path) -> None:
    table = _read(generate_logs(_config(tmp_path, format="parquet")), "parquet")
    users = table["user_id"].to_numpy()
    devices = np.array(table["device"].to_pylist())
    on_main_device = 0
    for user in np.unique(users):
        _, counts = np.unique(devices[users == user], return_counts=True)
        on_main_device += counts.max()
    # About 8% of impressions switch to a random device (which may be the main one).
    assert 0.85 < on_main_device / len(users) < 0.99


def test_popularity_and_activity_are_skewed(tmp_path: Path) -> None:
    config = _config(tmp_path, format="parquet", num_rows=20_000, num_items=1_000)
    table = _read(generate_logs(config), "parquet")

    item_counts = np.sort(np.bincount(table["item_id"].to_numpy()))[::-1]
    top_share = item_counts[: config.num_items // 100].sum() / item_counts.sum()
    assert top_share > 0.2  # top 1% of items: far more than 1% of impressions
    user_counts = np.sort(np.bincount(table["user_id"].to_numpy()))[::-1]
    assert user_counts[: config.num_users // 10].sum() / user_counts.sum() > 0.25
    # Active users have histories spanning many days.
    top_user = int(np.argmax(np.bincount(table["user_id"].to_numpy())))
    user_ts = table["ts"].to_numpy()[table["user_id"].to_numpy() == top_user]
    assert len(np.unique(user_ts // DAY)) >= config.days - 1


def test_bayes_auc_matches_sklearn_and_bayes_json(tmp_path: Path) -> None:
    config = _config(tmp_path, format="parquet", num_rows=30_000, test_fraction=0.2)
    result = generate_logs(config)
    table = _read(result, "parquet")
    click = table["click"].to_numpy()
    p_true = table["p_true"].to_numpy()
    ts = table["ts"].to_numpy()
    test = ts >= config.start_ts + 0.8 * config.days * DAY

    assert 0.7 < result.bayes_auc < 0.9
    assert result.bayes_auc == pytest.approx(roc_auc_score(click, p_true), abs=1e-3)
    assert result.bayes_auc_test == pytest.approx(
        roc_auc_score(click[test], p_true[test]), abs=1e-3
    )
    assert result.click_rate == pytest.approx(click.mean(), abs=1e-12)
    assert 0.04 < result.click_rate < 0.2

    meta = json.loads((result.out_dir / "_bayes.json").read_text())
    assert meta["bayes_auc"] == result.bayes_auc
    assert meta["bayes_auc_test"] == result.bayes_auc_test
    assert meta["click_rate"] == result.click_rate
    assert meta["test_fraction"] == 0.2
    assert (meta["num_rows"], meta["num_malformed"], meta["seed"]) == (30_000, 0, 0)
    assert GenerateConfig(**meta["config"]) == config


def test_auc_from_histograms_exact_math() -> None:
    # Scores 0 < 1 < 2 in bins 0, 1, 2; positives at bins 1 and 2, negatives at bins 0 and 1.
    pos = np.array([0, 1, 1])
    neg = np.array([1, 1, 0])
    # Pairs (pos, neg): (1,0) win, (1,1) tie, (2,0) win, (2,1) win -> 3.5 / 4.
    assert synthetic._auc_from_histograms(pos, neg) == 0.875
    assert np.isnan(synthetic._auc_from_histograms(pos, np.zeros(3, dtype=np.int64)))


def _csv_row_is_valid(fields: list[str], config: GenerateConfig) -> bool:
    """Whether a CSV record parses into the raw types and domains."""
    if len(fields) != len(COLUMNS):
        return False
    row = dict(zip(COLUMNS, fields, strict=True))
    try:
        ints = {name: int(row[name]) for name in ("ts", "user_id", "item_id", "hour", "position")}
        click = int(row["click"])
        float(row["price"])
        float(row["p_true"])
    except ValueError:
        return False
    end_ts = config.start_ts + config.days * DAY
    return (
        config.start_ts <= ints["ts"] < end_ts
        and 1 <= ints["user_id"] <= config.num_users
        and 1 <= ints["item_id"] <= config.num_items
        and click in (0, 1)
        and all(row[name] for name in ("city", "device", "category"))
    )


def test_malformed_csv_rows_fail_parsing(tmp_path: Path) -> None:
    config = _config(tmp_path, num_rows=10_000, malformed_fraction=0.1)
    clean = generate_logs(_config(tmp_path, out=str(tmp_path / "clean"), num_rows=10_000))
    result = generate_logs(config)

    assert result.num_malformed == 1_000
    assert result.num_rows == 10_000
    invalid = 0
    records = 0
    for path in result.files:
        with path.open(newline="") as f:
            reader = csv.reader(f)
            assert next(reader) == list(COLUMNS)
            for fields in reader:
                records += 1
                invalid += not _csv_row_is_valid(fields, config)
    assert records == 10_000
    assert invalid == result.num_malformed
    # Malformed rows are left out of the statistics, but the well-formed ones are unchanged.
    assert result.click_rate != clean.click_rate
    assert abs(result.bayes_auc - clean.bayes_auc) < 0.03


def test_malformed_csv_uses_several_corruptions(tmp_path: Path) -> None:
    config = _config(tmp_path, num_rows=5_000, malformed_fraction=0.2)
    text = "\n".join(p.read_text() for p in generate_logs(config).files)
    lines = text.splitlines()
    assert any(line.count(",") > len(COLUMNS) - 1 for line in lines)  # extra field
    assert any(0 < line.count(",") < len(COLUMNS) - 1 for line in lines)  # truncated
    assert any(line.startswith("-1,") for line in lines)  # negative timestamp
    assert any(",," in line for line in lines)  # empty required field
    assert any(junk in text for junk in ("n/a", "yesterday", "top", "undefined", "yes"))


def test_malformed_jsonl_rows_fail_parsing(tmp_path: Path) -> None:
    config = _config(tmp_path, format="jsonl", num_rows=5_000, malformed_fraction=0.1)
    result = generate_logs(config)
    end_ts = config.start_ts + config.days * DAY
    invalid = 0
    broken = 0
    for path in result.files:
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                invalid += 1
                continue
            ints_ok = all(
                isinstance(row[name], int) for name in ("ts", "user_id", "item_id", "position")
            )
            valid = (
                list(row) == list(COLUMNS)
                and ints_ok
                and isinstance(row["price"], float)
                and row["click"] in (0, 1)
                and config.start_ts <= row["ts"] < end_ts
            )
            invalid += not valid
    assert invalid == result.num_malformed == 500
    assert 0 < broken < invalid


def test_malformed_parquet_rows_use_typed_corruptions(tmp_path: Path) -> None:
    config = _config(tmp_path, format="parquet", num_rows=5_000, malformed_fraction=0.1)
    result = generate_logs(config)
    table = _read(result, "parquet")
    assert table.schema == SCHEMA
    rows = table.to_pylist()
    nulls = sum(any(row[c] is None for c in ("ts", "user_id", "item_id", "click")) for row in rows)
    bad_label = sum(row["click"] == 2 for row in rows)
    bad_ts = sum(row["ts"] == -1 for row in rows)
    assert nulls > 0 and bad_label > 0 and bad_ts > 0
    assert nulls + bad_label + bad_ts == result.num_malformed == 500


def test_existing_output_is_replaced_atomically(tmp_path: Path) -> None:
    config = _config(tmp_path, num_files=2)
    out = Path(config.out)
    out.mkdir()
    (out / "part-00009.csv").write_text("stale\n")

    result = generate_logs(config)
    assert sorted(p.name for p in out.iterdir()) == [
        "_bayes.json",
        "part-00000.csv",
        "part-00001.csv",
    ]
    generate_logs(_config(tmp_path, num_files=2, format="jsonl"))
    assert sorted(p.name for p in out.iterdir()) == [
        "_bayes.json",
        "part-00000.jsonl",
        "part-00001.jsonl",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]  # no .tmp- or .old- sibling
    assert result.out_dir == out


def test_failure_leaves_previous_output_and_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path)
    generate_logs(config)
    before = _data_bytes(Path(config.out))

    calls = 0
    real_write = synthetic._Sink.write

    def failing_write(self: synthetic._Sink, *args: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError("disk full")
        real_write(self, *args)

    monkeypatch.setattr(synthetic._Sink, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        generate_logs(_config(tmp_path, seed=7))
    assert _data_bytes(Path(config.out)) == before
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"malformed_fraction": 1.5}, "malformed_fraction"),
        ({"malformed_fraction": 1.0}, "malformed_fraction"),
        ({"num_rows": 0}, "num_rows"),
        ({"num_files": 10, "num_rows": 5}, "num_files"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"chunk_rows": -1}, "chunk_rows"),
        ({"seed": -3}, "seed"),
        ({"item_churn": 1.0}, "item_churn"),
        ({"popularity_drift": -0.1}, "popularity_drift"),
        ({"daily_partitions": True, "num_files": 2}, "num_files"),
    ],
)
def test_invalid_config_raises_config_error(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        GenerateConfig(**overrides)


def test_config_is_frozen_strict_and_documented() -> None:
    with pytest.raises(ValidationError):
        GenerateConfig(num_row=5)
    config = GenerateConfig()
    with pytest.raises(ValidationError):
        config.num_rows = 5
    undocumented = [name for name, f in GenerateConfig.model_fields.items() if not f.description]
    assert undocumented == []


def test_out_that_is_a_file_raises_config_error(tmp_path: Path) -> None:
    path = tmp_path / "raw"
    path.write_text("not a directory")
    with pytest.raises(ConfigError, match="out"):
        generate_logs(_config(tmp_path))


def test_files_may_hold_several_chunks_or_part_of_one(tmp_path: Path) -> None:
    for num_files, chunk_rows in ((7, 1_000), (2, 137), (1, 3_000), (300, 500)):
        out = tmp_path / f"raw_{num_files}_{chunk_rows}"
        config = _config(
            tmp_path, out=str(out), format="parquet", num_files=num_files, chunk_rows=chunk_rows
        )
        result = generate_logs(config)
        assert len(result.files) == num_files
        table = _read(result, "parquet")
        assert table.num_rows == 3_000
        assert np.all(np.diff(table["ts"].to_numpy()) >= 0)


def test_daily_partitions_hold_each_date_and_its_own_ceiling(tmp_path: Path) -> None:
    fields = {  # not _config: it sets num_files, which daily partitions refuse
        "out": str(tmp_path / "raw"), "num_rows": 3_000, "num_users": 200, "num_items": 300,
        "num_categories": 8, "num_cities": 5, "days": 7, "chunk_rows": 700,
        "daily_partitions": True, "format": "parquet", "start_ts": 20_000 * DAY,
    }
    result = generate_logs(GenerateConfig(**fields))
    names = [f.parent.name for f in result.files]
    assert names == [f"dt=2024-10-{d:02d}" for d in range(4, 11)]  # day 20,000 = 2024-10-04
    total = 0
    partitions = json.loads((result.out_dir / "_bayes.json").read_text())["partitions"]
    for date, path in enumerate(result.files, start=20_000):
        ts = pq.read_table(path)["ts"].to_numpy()
        assert (ts // DAY == date).all()  # every row in its date's folder
        total += len(ts)
        assert partitions[path.parent.name]["rows"] == len(ts)
        assert 0.6 < partitions[path.parent.name]["bayes_auc"] < 1.0
    assert total == 3_000


def test_item_churn_brings_new_ids_every_day_and_none_without_it(tmp_path: Path) -> None:
    def items_by_day(**drift: float) -> list[set[int]]:
        fields = {
            "out": str(tmp_path / f"raw-{len(drift)}"), "num_rows": 20_000, "num_users": 300,
            "num_items": 400, "num_categories": 8, "num_cities": 5, "days": 7,
            "chunk_rows": 3_000, "daily_partitions": True, "format": "parquet",
            "start_ts": 20_000 * DAY, **drift,
        }
        result = generate_logs(GenerateConfig(**fields))
        return [set(pq.read_table(f)["item_id"].to_pylist()) for f in result.files]

    fixed = items_by_day()
    assert max(max(day) for day in fixed) <= 400  # the same catalogue every day
    churned = items_by_day(item_churn=0.2, popularity_drift=0.3)
    assert churned[0] <= set(range(1, 401))  # day 1 is the base catalogue
    for day in range(1, len(churned)):
        today, yesterday = churned[day], churned[day - 1]
        new = today - set().union(*churned[:day])
        assert len(new) / len(today) > 0.05  # ids never seen before, every day
        assert len(today & yesterday) / len(today) > 0.3  # most of the catalogue goes on
    # After 6 days of 20% churn, ~74% of the base catalogue has stopped.
    assert len(churned[-1] & churned[0]) < 0.6 * len(churned[0])


def test_drift_is_deterministic(tmp_path: Path) -> None:
    fields = {
        "num_rows": 4_000, "num_users": 100, "num_items": 200, "num_categories": 4,
        "num_cities": 3, "days": 3, "chunk_rows": 900, "daily_partitions": True,
        "item_churn": 0.3, "popularity_drift": 0.5, "format": "csv",
    }
    first = generate_logs(GenerateConfig(out=str(tmp_path / "a"), **fields))
    second = generate_logs(GenerateConfig(out=str(tmp_path / "b"), **fields))
    assert [f.read_bytes() for f in first.files] == [f.read_bytes() for f in second.files]
