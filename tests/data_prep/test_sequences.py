import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import DataError
from data_prep.sequences import build_sequences


def write_splits(tmp_path, rows):
    """rows: (split, user, item, ts) tuples."""
    dirs = {}
    for split in ("train", "valid", "test"):
        part = [r for r in rows if r[0] == split]
        dirs[split] = tmp_path / split
        dirs[split].mkdir()
        pq.write_table(
            pa.table(
                {
                    "user_id": pa.array([r[1] for r in part], pa.int64()),
                    "item_id": pa.array([r[2] for r in part], pa.int64()),
                    "ts": pa.array([r[3] for r in part], pa.int64()),
                }
            ),
            dirs[split] / "part-00000.parquet",
        )
    return dirs


ROWS = [
    ("train", 1, 10, 100),
    ("train", 1, 11, 100),  # same timestamp: input order decides
    ("train", 1, 12, 105),
    ("train", 1, 13, 106),
    ("valid", 1, 14, 110),
    ("test", 1, 15, 120),
    ("train", 2, 20, 50),
    ("test", 2, 21, 60),
]


@pytest.mark.parametrize("partition_rows", [1, 1000])
def test_histories_are_time_ordered_and_never_hold_later_splits(tmp_path, partition_rows):
    dirs = write_splits(tmp_path, ROWS)
    result = build_sequences(
        dirs,
        "user_id",
        "item_id",
        "ts",
        max_length=2,
        out_dir=tmp_path / "seq",
        partition_rows=partition_rows,
    )
    assert result.users == 2 and result.rows == {"train": 2, "valid": 1, "test": 2}
    train = {
        r["user"]: r["history"]
        for r in pq.read_table(tmp_path / "seq" / "train.parquet").to_pylist()
    }
    assert train == {1: [11, 12, 13], 2: [20]}  # last max_length + 1 train items
    valid = pq.read_table(tmp_path / "seq" / "valid.parquet").to_pylist()
    assert valid == [
        {"user": 1, "history": [12, 13], "target": 14, "ts": 110, "seen": [10, 11, 12, 13, 14]}
    ]
    test = {r["user"]: r for r in pq.read_table(tmp_path / "seq" / "test.parquet").to_pylist()}
    assert test[1]["history"] == [13, 14] and test[1]["target"] == 15
    assert test[2]["history"] == [20] and test[2]["target"] == 21
    # seen is untruncated and includes the split's own events
    assert test[1]["seen"] == [10, 11, 12, 13, 14, 15] and test[2]["seen"] == [20, 21]
    counts = np.load(tmp_path / "seq" / "train_item_counts.npy")
    assert counts.tolist() == [0] * 10 + [1, 1, 1, 1] + [0] * 6 + [1]  # train items only


def test_all_windows_make_every_train_item_but_the_first_a_target_once(tmp_path):
    rows = [("train", 1, 100 + i, i) for i in range(9)] + [("test", 1, 200, 50)]
    rows += [("train", 2, 300, 1), ("test", 2, 301, 2)]
    dirs = write_splits(tmp_path, rows)
    last = build_sequences(dirs, "user_id", "item_id", "ts", 3, tmp_path / "last")
    every = build_sequences(dirs, "user_id", "item_id", "ts", 3, tmp_path / "all", windows="all")
    histories = pq.read_table(tmp_path / "all" / "train.parquet").to_pylist()
    assert [(r["user"], r["history"]) for r in histories] == [
        (1, [100, 101, 102]),  # the oldest window may be short
        (1, [102, 103, 104, 105]),  # windows overlap by one item: the first input
        (1, [105, 106, 107, 108]),
        (2, [300]),  # a single train item: one row, as with "last"
    ]
    targets = [item for r in histories for item in r["history"][1:]]
    assert sorted(targets) == list(range(101, 109))  # each train item but the first, once
    assert all(len(r["history"]) <= 4 for r in histories)
    assert histories[-1] == {"user": 2, "history": [300]}
    last_rows = pq.read_table(tmp_path / "last" / "train.parquet").to_pylist()
    assert last_rows[0]["history"] == histories[-2]["history"]  # the newest window
    assert every.users == last.users == 2
    assert every.rows["train"] == len(histories) == 4 and last.rows["train"] == 2
    assert json.loads((tmp_path / "all" / "sequences.json").read_text())["windows"] == "all"
    # the evaluation rows do not depend on the windows
    for split in ("valid", "test"):
        assert pq.read_table(tmp_path / "all" / f"{split}.parquet").equals(
            pq.read_table(tmp_path / "last" / f"{split}.parquet")
        )


def test_a_train_event_after_a_test_event_is_a_leak(tmp_path):
    leaky = [*ROWS, ("train", 2, 22, 70)]
    with pytest.raises(DataError, match="leaks"):
        build_sequences(
            write_splits(tmp_path, leaky), "user_id", "item_id", "ts", 5, tmp_path / "s"
        )


def test_ties_are_ordered_the_same_way_every_time(tmp_path):
    dirs = write_splits(tmp_path, ROWS)
    build_sequences(dirs, "user_id", "item_id", "ts", 3, tmp_path / "a")
    build_sequences(dirs, "user_id", "item_id", "ts", 3, tmp_path / "b", partition_rows=1)
    for name in ("train", "valid", "test"):
        assert pq.read_table(tmp_path / "a" / f"{name}.parquet").equals(
            pq.read_table(tmp_path / "b" / f"{name}.parquet")
        )


def test_item_features_take_each_items_most_frequent_train_value(tmp_path):
    dirs = {}
    rows = {
        # (user, item, ts, category): item 3 is category 2 twice, 1 once; item 4 ties 5/6.
        "train": [(1, 3, 1, 2), (1, 4, 2, 6), (2, 3, 1, 1), (2, 4, 2, 5), (3, 3, 5, 2)],
        "valid": [(1, 5, 9, 7)],
        "test": [(1, 2, 10, 3)],  # items only seen outside train get no feature
    }
    for split, part in rows.items():
        dirs[split] = tmp_path / split
        dirs[split].mkdir()
        columns = zip(*part, strict=True)
        names = ("user_id", "item_id", "ts", "category")
        pq.write_table(
            pa.table({n: pa.array(c, pa.int64()) for n, c in zip(names, columns, strict=True)}),
            dirs[split] / "part-00000.parquet",
        )
    build_sequences(
        dirs,
        "user_id",
        "item_id",
        "ts",
        4,
        tmp_path / "seq",
        num_items=6,
        item_features={"category": 8},
    )
    table = pq.read_table(tmp_path / "seq" / "item_features.parquet").to_pydict()
    assert table == {"item": [0, 1, 2, 3, 4, 5], "category": [0, 0, 0, 2, 5, 0]}
    meta = json.loads((tmp_path / "seq" / "sequences.json").read_text())
    assert meta["item_features"] == {"category": 8} and meta["num_items"] == 6
