"""Vocabularies extended day by day: stable rows, growth, expiry with reuse, bounded size."""

import json

import numpy as np
import pyarrow as pa
import pytest

from data_prep.errors import SchemaError
from data_prep.idmap import extend_transform, start_chain
from data_prep.schema import SchemaConfig
from data_prep.transform import (
    TransformApplier,
    apply_transform,
    collect_stats,
    empty_stats,
    fit_transform,
    merge_stats,
)
from training.ctr.package_scorer import _SparseFeature

SCHEMA = SchemaConfig(
    fields=[
        {"name": "ts", "dtype": "int64", "role": "timestamp"},
        {"name": "item", "dtype": "int64", "role": "sparse", "min_count": 2},
        {"name": "city", "dtype": "string", "role": "sparse"},
        {"name": "hid", "dtype": "int64", "role": "sparse", "hash_buckets": 10},
        {"name": "price", "dtype": "float64", "role": "dense"},
        {"name": "click", "dtype": "int64", "role": "label"},
    ]
)


def day(items: list[int], cities: list[str] | None = None) -> pa.Table:
    n = len(items)
    return pa.table(
        {
            "ts": range(n),
            "item": pa.array(items, pa.int64()),
            "city": cities if cities is not None else ["x"] * n,
            "hid": range(n),
            "price": [float(i) for i in range(n)],
            "click": [i % 2 for i in range(n)],
        }
    )


def stats(table: pa.Table):
    return merge_stats(empty_stats(SCHEMA), collect_stats(SCHEMA, table))


def first_day(table: pa.Table) -> dict:
    return start_chain(fit_transform(stats(table), SCHEMA, 1), "d1")


def rows_of(transform: dict, items: list[int]) -> list[int]:
    return apply_transform(transform, day(items))["item"].to_pylist()


def test_known_ids_keep_their_rows_and_new_ids_grow_rows():
    t1 = first_day(day([5, 5, 5, 7, 7, 9, 9]))
    before = rows_of(t1, [5, 7, 9])
    # Day 2: 7 is now the most frequent; 11 is new (x2), 13 is below min_count.
    t2 = extend_transform(t1, stats(day([7, 7, 7, 7, 11, 11, 13])), SCHEMA, "d2", ttl=None)
    assert rows_of(t2, [5, 7, 9]) == before  # a refit would reorder by count
    assert rows_of(t2, [11, 13]) == [4, 0]  # appended; below min_count: OOV
    item = t2["sparse"]["item"]
    assert item["num_embeddings"] == 5 and item["last_seen"] == [0, 1, 0, 1]
    assert t2["partitions"] == ["d1", "d2"]
    assert t2["history"][-1]["features"]["item"] == {
        "added": 1, "reused": 0, "evicted": 0, "live": 4, "num_embeddings": 5
    }
    assert t2["changes"]["item"]["reset_rows"] == []  # nothing to reset at warm start
    # Hashed features and the dense normalisation are the parent's.
    assert t2["sparse"]["hid"] == t1["sparse"]["hid"]
    assert t2["dense"] == t1["dense"]


def test_an_expired_id_frees_its_row_for_the_next_new_id():
    t1 = first_day(day([5, 5, 7, 7, 9, 9]))  # rows: 5 -> 1, 7 -> 2, 9 -> 3
    t2 = extend_transform(t1, stats(day([5, 5, 9, 9])), SCHEMA, "d2", ttl=2)
    assert rows_of(t2, [7]) == [2]  # unseen for 1 partition: still alive
    # Day 3: 7 unseen for 2 partitions -> evicted; 21 and 23 are new, 21 more frequent.
    t3 = extend_transform(t2, stats(day([5, 5, 9, 9, 21, 21, 21, 23, 23])), SCHEMA, "d3", ttl=2)
    assert rows_of(t3, [7, 21, 23, 5, 9]) == [0, 2, 4, 1, 3]  # 21 took 7's row
    assert t3["changes"]["item"]["reset_rows"] == [2]  # the trainer resets row 2's state
    assert t3["history"][-1]["features"]["item"] == {
        "added": 2, "reused": 1, "evicted": 1, "live": 4, "num_embeddings": 5
    }
    # Ids evicted and not replaced leave holes that map nothing, in every reader: on
    # day 5, 5 and 9 were last seen on day 3 (23 on day 4 lives on).
    t4 = extend_transform(t3, stats(day([21, 21, 23, 23])), SCHEMA, "d4", ttl=2)
    t5 = extend_transform(t4, stats(day([21, 21])), SCHEMA, "d5", ttl=2)
    item = t5["sparse"]["item"]
    assert item["values"] == [None, 21, None, 23]
    assert t5["changes"]["item"]["reset_rows"] == [1, 3]
    assert rows_of(t5, [5, 9, 23, 21]) == [0, 0, 4, 2]
    assert _SparseFeature("item", item).indices([5, None, 21]).tolist() == [0, 0, 2]
    # It survives transform.json (null) and maps a missing id to 0, not to a hole.
    reloaded = json.loads(json.dumps(t5))
    missing = day([21]).set_column(1, "item", pa.array([None], pa.int64()))
    assert TransformApplier(reloaded)(missing)["item"].to_pylist() == [0]


def test_string_vocabularies_keep_rows_and_reuse_holes():
    t1 = first_day(day([1] * 4, ["a", "a", "b", "b"]))
    t2 = extend_transform(t1, stats(day([1] * 2, ["b", "c"])), SCHEMA, "d2", ttl=1)
    assert t2["sparse"]["city"]["values"] == ["c", "b"]  # a expired, c took its row
    cities = apply_transform(t2, day([1] * 3, ["a", "b", "c"]))["city"].to_pylist()
    assert cities == [0, 2, 1]


def test_the_table_stays_bounded_while_ids_churn():
    # 30 days, 100 ids a day, a fifth of them replaced every day: with ttl 3 the table
    # never exceeds the ids of 3 consecutive days; without expiry it grows every day.
    rng = np.random.default_rng(0)
    active = list(range(100))
    next_id = 100
    bounded = first_day(day(active * 2))
    unbounded = bounded
    for d in range(2, 31):
        for k in rng.choice(len(active), 20, replace=False):
            active[k] = next_id
            next_id += 1
        table = day(active * 2)
        bounded = extend_transform(bounded, stats(table), SCHEMA, f"d{d}", ttl=3)
        unbounded = extend_transform(unbounded, stats(table), SCHEMA, f"d{d}", ttl=None)
        assert bounded["sparse"]["item"]["num_embeddings"] <= 100 + 3 * 20 + 1
        assert rows_of(bounded, active).count(0) == 0  # today's ids all have rows
    assert unbounded["sparse"]["item"]["num_embeddings"] == next_id + 1


def test_a_partition_extends_the_chain_once_and_the_schema_must_match():
    t1 = first_day(day([5, 5]))
    with pytest.raises(SchemaError, match="already in the parent"):
        extend_transform(t1, stats(day([5, 5])), SCHEMA, "d1", ttl=None)
    other = SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "item", "dtype": "int64", "role": "sparse"},
            {"name": "click", "dtype": "int64", "role": "label"},
        ]
    )
    with pytest.raises(SchemaError, match="schema's fields differ"):
        extend_transform(t1, stats(day([5, 5])), other, "d2", ttl=None)
    with pytest.raises(SchemaError, match="ttl must be"):
        extend_transform(t1, stats(day([5, 5])), SCHEMA, "d2", ttl=0)
    with pytest.raises(SchemaError, match="already starts a chain"):
        start_chain(t1, "d0")
