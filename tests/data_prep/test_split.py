"""The time and leave-last-out splits, and the bounded state behind them."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import ConfigError
from data_prep.preprocess import (
    SPLIT_HISTOGRAM_BINS,
    PreprocessConfig,
    _candidates,
    _LastEvents,
    order_statistics,
    preprocess_events,
)
from data_prep.schema import SchemaConfig
from data_prep.shard import ShardConfig, write_shards

LLO = PreprocessConfig(split="leave_last_out")


def user_schema(user_dtype: str = "int64", user_key: str | None = "user") -> SchemaConfig:
    return SchemaConfig(
        user_key=user_key,
        fields=[
            {"name": "event", "dtype": "int64", "role": "key"},
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user", "dtype": user_dtype, "role": "sparse"},
            {"name": "item", "dtype": "int64", "role": "sparse"},
            {"name": "price", "dtype": "float64", "role": "dense"},
            {"name": "click", "dtype": "int64", "role": "label"},
        ],
    )


def write_user_events(directory, users, ts, files=2):
    """Events in input order (event = position), split over ``files`` Parquet files."""
    n = len(users)
    table = pa.table(
        {
            "event": np.arange(n),
            "ts": np.asarray(ts, dtype=np.int64),
            "user": users,
            "item": np.arange(n) % 3,
            "price": np.linspace(1.0, 2.0, n),
            "click": np.arange(n) % 2,
        }
    )
    directory.mkdir(parents=True)
    cuts = np.linspace(0, n, files + 1).astype(int)
    for k in range(files):
        pq.write_table(table.slice(cuts[k], cuts[k + 1] - cuts[k]), directory / f"p{k}.parquet")
    return table


def events_by_split(out_dir) -> dict[str, list[int]]:
    return {
        split: sorted(pq.read_table(out_dir / split, columns=["event"])["event"].to_pylist())
        for split in ("train", "valid", "test")
    }


@pytest.mark.parametrize("user_dtype", ["int64", "string"])
def test_leave_last_out_per_user_with_ties_broken_by_input_order(tmp_path, user_dtype):
    # event: 0  1  2  3  4  5  6  7  8  9
    users = [1, 1, 2, 3, 3, 1, 2, 3, 1, 4]
    ts = [10, 30, 50, 5, 7, 20, 40, 6, 30, 1]
    if user_dtype == "string":
        users = [f"u{u}" for u in users]
    write_user_events(tmp_path / "events", users, ts)
    result = preprocess_events(LLO, user_schema(user_dtype), tmp_path / "events", tmp_path / "pre")

    split = events_by_split(tmp_path / "pre")
    # User 1: ts 10, 20, 30, 30; the two events at 30 tie and the later row (8) is the
    # last event. User 3: ts 5, 6, 7. Users 2 (two events) and 4 (one) stay in train.
    assert split["test"] == [4, 8]
    assert split["valid"] == [1, 7]
    assert split["train"] == [0, 2, 3, 5, 6, 9]
    assert result.split == "leave_last_out" and result.valid_start_ts is None
    assert result.rows == {"train": 6, "valid": 2, "test": 2}

    sharded = write_shards(
        ShardConfig(num_train_shards=2, num_eval_shards=1), tmp_path / "pre", tmp_path / "s"
    )
    assert sharded.rows == result.rows


def test_leave_last_out_needs_a_user_key(tmp_path):
    write_user_events(tmp_path / "events", [1, 1, 1], [1, 2, 3], files=1)
    with pytest.raises(ConfigError, match="user_key"):
        preprocess_events(LLO, user_schema(user_key=None), tmp_path / "events", tmp_path / "pre")


def test_leave_last_out_user_state_is_two_events_per_user():
    """Bounded memory: per user, two candidate events and a count, however many events."""
    rng = np.random.default_rng(0)
    users = 50
    for n in (1_000, 50_000):
        state = _LastEvents()
        for start in range(0, n, 997):
            size = min(997, n - start)
            batch_users = pa.array(rng.integers(0, users, size))
            batch_ts = pa.array(rng.integers(0, 1000, size))
            state.add(_candidates(batch_users, batch_ts, start))
        last = state.result()
        assert last.num_rows == 2 * users
        counts = last.column("n").to_numpy()
        assert counts.sum() == n and int(last.column("last").to_numpy().sum()) == users


def test_time_boundaries_are_exact_order_statistics():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.integers(-500, 10_000, 3000), np.full(500, 4242)])
    rng.shuffle(values)
    ks = [0, 1, 1500, 2000, 2999, len(values) - 1]
    chunks = lambda: iter(np.array_split(values, 7))  # noqa: E731
    stats = order_statistics(chunks, int(values.min()), int(values.max()), ks, bins=16)

    ordered = np.sort(values)
    assert stats.values == [int(ordered[k]) for k in ks]
    assert stats.below == [int(np.searchsorted(ordered, ordered[k])) for k in ks]
    span = int(values.max()) - int(values.min()) + 1
    assert stats.passes <= math.ceil(math.log(span, 16)) + 1


def test_time_boundary_state_does_not_depend_on_rows():
    """Bounded memory: a fixed number of bins per pass, and the passes depend on the range."""
    found = []
    for n in (1_000, 100_000):
        values = np.random.default_rng(n).integers(1_700_000_000, 1_702_592_000, n)
        stats = order_statistics(
            lambda v=values: iter(np.array_split(v, 10)),
            1_700_000_000,
            1_702_592_000,
            [int(n * 0.8), int(n * 0.9)],
        )
        assert stats.values == [int(np.sort(values)[int(n * q)]) for q in (0.8, 0.9)]
        found.append((stats.bins, stats.passes))
    assert found[0] == found[1] == (SPLIT_HISTOGRAM_BINS, 2)
