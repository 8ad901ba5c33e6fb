"""Leakage guards: train-only fitting, the split order on written data, label leaks."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import ConfigError, DataError
from data_prep import preprocess
from data_prep.preprocess import TEST, TRAIN, PreprocessConfig, preprocess_events
from data_prep.schema import SchemaConfig


def events_table(n=2000, seed=0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "ts": np.sort(rng.integers(1_700_000_000, 1_700_100_000, n)),
            "user_id": rng.integers(1, 60, n),
            "city": [f"c{i}" for i in rng.integers(0, 5, n)],
            "price": rng.lognormal(3, 1, n),
            "click": rng.integers(0, 2, n),
            "p_true": rng.random(n),
        }
    )


def write(directory, table: pa.Table, parts: int = 2) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    cuts = np.linspace(0, table.num_rows, parts + 1).astype(int)
    for k in range(parts):
        part = table.slice(cuts[k], cuts[k + 1] - cuts[k])
        pq.write_table(part, directory / f"part-{k:05d}.parquet")


def with_fields(schema: SchemaConfig, *fields: dict) -> SchemaConfig:
    return SchemaConfig(fields=[*schema.model_dump()["fields"], *fields])


def test_vocabulary_and_dense_statistics_see_train_rows_only(tmp_path, schema):
    table = events_table()
    # Plant, in the latest (test) rows only, a new user, a new city and absurd prices.
    n = table.num_rows
    last = np.arange(n) >= n - 50
    table = table.set_column(1, "user_id", pa.array(np.where(last, 999_999, table["user_id"])))
    table = table.set_column(2, "city", pa.array(np.where(last, "atlantis", table["city"])))
    table = table.set_column(3, "price", pa.array(np.where(last, 1e9, table["price"])))
    write(tmp_path / "events", table)
    result = preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")

    transform = json.loads((tmp_path / "pre" / "transform.json").read_text())
    assert 999_999 not in transform["sparse"]["user_id"]["values"]
    assert "atlantis" not in transform["sparse"]["city"]["values"]
    train = table.filter(pa.compute.less(table["ts"], result.valid_start_ts))
    assert transform["dense"]["price"]["mean"] == pytest.approx(
        np.log1p(train["price"].to_numpy()).mean()
    )
    test = pq.read_table(tmp_path / "pre" / "test").slice(result.rows["test"] - 50)
    assert set(test["user_id"].to_pylist()) == {0} and set(test["city"].to_pylist()) == {0}


def test_a_planted_label_copy_fails_and_the_allow_list_passes(tmp_path, schema):
    table = events_table()
    table = table.append_column("leak", table["click"]).append_column(
        "leak_dense", pa.compute.multiply(table["click"].cast(pa.float64()), 2.0)
    )
    write(tmp_path / "events", table)
    leaky = with_fields(
        schema,
        {"name": "leak", "dtype": "int64", "role": "sparse"},
        {"name": "leak_dense", "dtype": "float64", "role": "dense"},
    )
    with pytest.raises(DataError, match="'leak' .*'leak_dense'.*leakage_allow") as err:
        preprocess_events(PreprocessConfig(), leaky, tmp_path / "events", tmp_path / "pre")
    assert "user_id" not in str(err.value)

    allowed = PreprocessConfig(leakage_allow=["leak", "leak_dense"])
    result = preprocess_events(allowed, leaky, tmp_path / "events", tmp_path / "pre2")
    assert result.leakage["leak"] == pytest.approx(1.0)
    assert result.leakage["user_id"] < 0.9


def test_leakage_allow_must_name_features(tmp_path, schema):
    write(tmp_path / "events", events_table(200))
    with pytest.raises(ConfigError, match="leakage_allow.*'clik'"):
        preprocess_events(
            PreprocessConfig(leakage_allow=["clik"]), schema, tmp_path / "events", tmp_path / "p"
        )


def test_a_test_event_before_a_train_event_is_caught(tmp_path, schema, monkeypatch):
    write(tmp_path / "events", events_table())
    assign = preprocess._assign_splits

    def misplaced(plan, batch, offset):
        codes = assign(plan, batch, offset)
        if offset == 0:  # plant: the very first (earliest) event goes to test
            codes[0] = TEST
        return codes

    monkeypatch.setattr(preprocess, "_assign_splits", misplaced)
    with pytest.raises(DataError, match="time split leaks"):
        preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")


def test_a_users_last_event_in_train_is_caught(tmp_path, monkeypatch):
    schema = SchemaConfig(
        user_key="user",
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user", "dtype": "int64", "role": "sparse"},
            {"name": "click", "dtype": "int64", "role": "label"},
        ],
    )
    users = np.repeat(np.arange(20), 5)
    click = np.random.default_rng(0).integers(0, 2, 100)
    table = pa.table({"ts": np.tile(np.arange(5), 20), "user": users, "click": click})
    write(tmp_path / "events", table)
    assign = preprocess._assign_splits

    def swapped(plan, batch, offset):
        codes = assign(plan, batch, offset)
        if offset == 0:  # plant: user 0's first event in test, its last event in train
            codes[0], codes[4] = TEST, TRAIN
        return codes

    monkeypatch.setattr(preprocess, "_assign_splits", swapped)
    config = PreprocessConfig(split="leave_last_out")
    with pytest.raises(DataError, match="leave_last_out split leaks for user 0"):
        preprocess_events(config, schema, tmp_path / "events", tmp_path / "pre")
