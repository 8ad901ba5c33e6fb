"""Fit/apply of the feature transforms on tiny in-memory tables."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.errors import SchemaError
from data_prep.schema import SchemaConfig
from data_prep.transform import (
    DENSE_HISTOGRAM_BINS,
    TransformApplier,
    apply_transform,
    collect_stats,
    empty_stats,
    fit_transform,
    hash_int64,
    hash_strings,
    label_leaks,
    load_transform,
    merge_stats,
    save_transform,
    splitmix64,
)

MASK = (1 << 64) - 1
REPO = Path(__file__).resolve().parents[2]


def reference_splitmix64(x: int) -> int:
    """splitmix64's output function, one value at a time, as in the C reference."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def fit(schema: SchemaConfig, table: pa.Table, min_count: int = 1) -> dict:
    return fit_transform(
        merge_stats(empty_stats(schema), collect_stats(schema, table)), schema, min_count
    )


def make_schema(*fields: dict, labels: tuple[dict, ...] = ()) -> SchemaConfig:
    return SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            *fields,
            *(labels or ({"name": "click", "dtype": "int64", "role": "label"},)),
        ]
    )


def test_splitmix64_matches_the_reference_implementation():
    values = [0, 1, 2, 12345, 2**63 - 1, 2**63, 2**64 - 1]
    mixed = splitmix64(np.array(values, dtype=np.uint64))
    assert [int(v) for v in mixed] == [reference_splitmix64(v) for v in values]
    # The first output of SplitMix64 seeded with 0, a published constant.
    assert int(mixed[0]) == 0xE220A8397B1DCDAF


def test_hashes_are_stable_across_calls_batches_and_processes():
    ids = np.array([-5, 0, 1, 7, 2**40, 123456789], dtype=np.int64)
    words = pa.array(["a", "b", None, "a", "zürich"])
    here_ids = hash_int64(ids, 1000)
    here_words = hash_strings(words, 1000)
    assert here_ids.min() >= 0 and here_ids.max() < 1000
    assert here_words[2] == 0 and here_words[0] == here_words[3]
    # The same value hashes the same whatever else is in the batch.
    assert hash_int64(ids[::-1], 1000).tolist() == here_ids[::-1].tolist()
    assert hash_strings(pa.array(["zürich"]), 1000).tolist() == [here_words[4]]

    code = (
        "import json, numpy as np, pyarrow as pa\n"
        "from data_prep.transform import hash_int64, hash_strings\n"
        f"ids = np.array({ids.tolist()}, dtype=np.int64)\n"
        "words = pa.array(['a', 'b', None, 'a', 'zürich'])\n"
        "print(json.dumps([hash_int64(ids, 1000).tolist(), hash_strings(words, 1000).tolist()]))"
    )
    # A fresh interpreter with a different string-hash seed: no dependence on PYTHONHASHSEED.
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=REPO
    )
    assert json.loads(out.stdout) == [here_ids.tolist(), here_words.tolist()]


def test_vocabulary_keeps_frequent_ids_in_count_then_value_order():
    schema = make_schema(
        {"name": "item", "dtype": "int64", "role": "sparse", "min_count": 2},
        {"name": "city", "dtype": "string", "role": "sparse", "top_k": 2},
    )
    # item counts: 7 x3, 3 x3, 9 x2, 5 x1; city counts: b x3, a x3, c x2, d x1
    items = [7, 3, 9, 7, 3, 5, 9, 7, 3]
    cities = ["b", "a", "c", "a", "b", "d", "c", "b", "a"]
    table = pa.table({"ts": range(9), "item": items, "city": cities, "click": [0, 1] * 4 + [0]})
    transform = fit(schema, table, min_count=1)

    item = transform["sparse"]["item"]
    assert item["values"] == [3, 7, 9]  # 5 is below min_count; ties by value
    assert item["num_embeddings"] == 4 and item["min_count"] == 2
    city = transform["sparse"]["city"]
    assert city["values"] == ["a", "b"] and city["num_embeddings"] == 3

    out = apply_transform(transform, pa.table({**table.to_pydict()}).slice(0, 6))
    assert out["item"].to_pylist() == [2, 1, 3, 2, 1, 0]
    assert out["city"].to_pylist() == [2, 1, 0, 1, 2, 0]
    assert out["item"].type == pa.int64()


def test_dense_fill_clip_log_and_standardise():
    schema = make_schema(
        {
            "name": "spend",
            "dtype": "float64",
            "role": "dense",
            "required": False,
            "fill": 1.0,
            "clip": [0.0, 99.0],
            "log": True,
        },
        {"name": "age", "dtype": "float64", "role": "dense", "required": False},
        {"name": "raw", "dtype": "int64", "role": "dense", "standardize": False},
    )
    spend = [None, -4.0, 3.0, 500.0]
    table = pa.table(
        {
            "ts": range(4),
            "spend": pa.array(spend, pa.float64()),
            "age": pa.array([20.0, None, 40.0, 30.0]),
            "raw": [1, 2, 3, 10],
            "click": [0, 1, 0, 1],
        }
    )
    transform = fit(schema, table)

    prepared = np.log1p(np.clip([1.0, -4.0, 3.0, 500.0], 0.0, 99.0))  # fill, clip, log
    stats = transform["dense"]["spend"]
    assert stats["mean"] == pytest.approx(prepared.mean())
    assert stats["std"] == pytest.approx(prepared.std())
    out = apply_transform(transform, table)
    expected = (prepared - prepared.mean()) / prepared.std()
    assert out["spend"].to_numpy() == pytest.approx(expected.astype(np.float32), abs=1e-6)
    assert out["spend"].type == pa.float32()
    # No fill: the mean of the present values, so 0 after standardising.
    assert transform["dense"]["age"]["mean"] == pytest.approx(30.0)
    assert out["age"].to_pylist()[1] == 0.0
    assert out["raw"].to_pylist() == [1.0, 2.0, 3.0, 10.0]


def test_bucketize_makes_a_categorical_index():
    schema = make_schema(
        {
            "name": "age",
            "dtype": "float64",
            "role": "dense",
            "required": False,
            "bucketize": [18.0, 30.0, 50.0],
        }
    )
    table = pa.table(
        {
            "ts": range(6),
            "age": pa.array([10.0, 18.0, 29.9, 30.0, 80.0, None]),
            "click": [0, 1] * 3,
        }
    )
    transform = fit(schema, table)
    entry = transform["dense"]["age"]
    assert entry["num_embeddings"] == 4
    out = apply_transform(transform, table)
    # side="right": a value equal to a boundary goes to the bucket above it; missing
    # takes the train mean (33.58), bucket 2.
    assert out["age"].to_pylist() == [0, 1, 1, 2, 3, 2]
    assert out["age"].type == pa.int64()


def test_multi_hot_vocabulary_over_elements_and_hashed_lists():
    schema = make_schema(
        {"name": "tags", "dtype": "string", "role": "sparse", "multi_hot": True},
        {
            "name": "ids",
            "dtype": "int64",
            "role": "sparse",
            "multi_hot": True,
            "hash_buckets": 8,
        },
    )
    tags = pa.array([["a", "b"], None, ["b", "b"], [], ["c", None]], pa.list_(pa.string()))
    ids = pa.array([[1, 2], [3], None, [4, 5, 6], []], pa.list_(pa.int64()))
    table = pa.table({"ts": range(5), "tags": tags, "ids": ids, "click": [0, 1, 0, 1, 0]})
    transform = fit(schema, table)
    assert transform["sparse"]["tags"]["values"] == ["b", "a", "c"]
    assert transform["sparse"]["ids"]["num_embeddings"] == 8

    out = apply_transform(transform, table.slice(1))  # a sliced list column
    assert out["tags"].type == pa.list_(pa.int64())
    assert out["tags"].to_pylist() == [[], [1, 1], [], [3, 0]]
    hashed = out["ids"].to_pylist()
    assert [len(x) for x in hashed] == [1, 0, 3, 0]
    assert hashed[0] == hash_int64(np.array([3]), 8).tolist()


def test_thresholded_and_multiple_labels_become_float32():
    schema = make_schema(
        {"name": "item", "dtype": "int64", "role": "sparse"},
        labels=(
            {"name": "click", "dtype": "int64", "role": "label"},
            {"name": "rating", "dtype": "float64", "role": "label", "threshold": 4.0},
        ),
    )
    table = pa.table(
        {"ts": range(4), "item": [1, 2, 1, 2], "click": [1, 0, 0, 1], "rating": [5.0, 3.0, 4.0, 1]}
    )
    transform = fit(schema, table)
    assert transform["label"] == "click"
    assert [label["name"] for label in transform["labels"]] == ["click", "rating"]
    out = apply_transform(transform, table)
    assert out["click"].type == out["rating"].type == pa.float32()
    assert out["rating"].to_pylist() == [1.0, 0.0, 1.0, 0.0]
    # Ingest already thresholds: int64 0/1 passes through as is.
    ingested = table.set_column(3, "rating", pa.array([1, 0, 1, 0]))
    assert apply_transform(transform, ingested)["rating"].to_pylist() == [1.0, 0.0, 1.0, 0.0]


def test_parquet_dictionary_strings_map_like_plain_strings(tmp_path):
    schema = make_schema({"name": "city", "dtype": "string", "role": "sparse"})
    cities = ["a", "b", "a", None, "c", "b", "a"]
    table = pa.table({"ts": range(7), "city": cities, "click": [0, 1, 0, 1, 0, 1, 0]})
    pq.write_table(table, tmp_path / "t.parquet")
    encoded = pq.read_table(tmp_path / "t.parquet", read_dictionary=["city"])
    assert pa.types.is_dictionary(encoded.schema.field("city").type)

    assert fit(schema, encoded, min_count=2) == fit(schema, table, min_count=2)
    transform = fit(schema, table, min_count=2)
    applier = TransformApplier(transform)
    assert applier(encoded).equals(applier(table))
    assert applier(table)["city"].to_pylist() == [1, 2, 1, 0, 0, 2, 1]


def test_merged_partial_statistics_equal_one_pass():
    rng = np.random.default_rng(0)
    schema = make_schema(
        {"name": "item", "dtype": "int64", "role": "sparse"},
        {"name": "price", "dtype": "float64", "role": "dense", "log": True},
    )
    n = 5000
    table = pa.table(
        {
            "ts": np.arange(n),
            "item": rng.integers(0, 3000, n) * 1_000_003,  # a wide id range: the hashed path
            "price": rng.lognormal(3, 1, n),
            "click": rng.integers(0, 2, n),
        }
    )
    whole = fit(schema, table)
    parts = empty_stats(schema)
    for start in range(0, n, 777):
        merge_stats(parts, collect_stats(schema, table.slice(start, 777)))
    merged = fit_transform(parts, schema, 1)
    assert merged["sparse"] == whole["sparse"]
    assert merged["dense"]["price"]["mean"] == pytest.approx(whole["dense"]["price"]["mean"])
    assert merged["dense"]["price"]["std"] == pytest.approx(whole["dense"]["price"]["std"])
    assert parts.rows == n


def test_fit_state_does_not_grow_with_rows():
    """Bounded memory: the statistics hold one entry per distinct id and fixed arrays."""
    schema = make_schema(
        {"name": "item", "dtype": "int64", "role": "sparse"},
        {"name": "city", "dtype": "string", "role": "sparse"},
        {"name": "user", "dtype": "int64", "role": "sparse", "hash_buckets": 64},
        {"name": "price", "dtype": "float64", "role": "dense"},
    )

    def state(n: int) -> dict[str, int]:
        rng = np.random.default_rng(n)
        table = pa.table(
            {
                "ts": np.arange(n),
                "item": np.arange(n) % 100,
                "city": [f"c{i % 7}" for i in range(n)],
                "user": rng.integers(0, 10**9, n),
                "price": rng.random(n),
                "click": rng.integers(0, 2, n),
            }
        )
        stats = empty_stats(schema)
        for start in range(0, n, 1000):
            merge_stats(stats, collect_stats(schema, table.slice(start, 1000)))
        stats.counts["item"].result()
        stats.counts["city"].result()
        return stats.state_sizes()

    small, large = state(2_000), state(40_000)
    assert small == large
    assert small["item"] == 100 and small["city"] == 7
    assert small["price"] == 2 * DENSE_HISTOGRAM_BINS  # (1 + labels) fixed-size histograms


def test_label_copy_has_auc_one_and_noise_does_not():
    rng = np.random.default_rng(1)
    n = 2000
    click = rng.integers(0, 2, n)
    schema = make_schema(
        {"name": "copy", "dtype": "int64", "role": "sparse"},
        {"name": "copy_dense", "dtype": "float64", "role": "dense"},
        {"name": "noise", "dtype": "float64", "role": "dense"},
        {"name": "item", "dtype": "int64", "role": "sparse"},
    )
    table = pa.table(
        {
            "ts": np.arange(n),
            "copy": click,
            "copy_dense": click * 3.5 - 1.0,
            "noise": rng.random(n),
            "item": rng.integers(0, 50, n),
            "click": click,
        }
    )
    transform = fit(schema, table)
    auc = transform["leakage"]["single_feature_train_auc"]
    assert auc["copy"]["click"] == pytest.approx(1.0)
    assert auc["copy_dense"]["click"] == pytest.approx(1.0)
    assert auc["noise"]["click"] < 0.6 and auc["item"]["click"] < 0.7
    assert label_leaks(transform, 0.999, []) == [
        "'copy' (AUC 1.0000 for label 'click')",
        "'copy_dense' (AUC 1.0000 for label 'click')",
    ]
    assert label_leaks(transform, 0.999, ["copy", "copy_dense"]) == []


def test_transform_json_round_trip_and_format_check(tmp_path):
    schema = make_schema({"name": "city", "dtype": "string", "role": "sparse"})
    table = pa.table({"ts": range(4), "city": ["a", "b", "a", "c"], "click": [0, 1, 0, 1]})
    transform = fit(schema, table)
    save_transform(transform, tmp_path / "transform.json")
    loaded = load_transform(tmp_path / "transform.json")
    assert loaded == transform
    assert apply_transform(loaded, table).equals(apply_transform(transform, table))

    (tmp_path / "old.json").write_text(json.dumps({"sparse": {}, "dense": {}}))
    with pytest.raises(SchemaError, match="rerun preprocess"):
        load_transform(tmp_path / "old.json")
