import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import ConfigError, DataError
from data_prep import shard
from data_prep.preprocess import PreprocessConfig, preprocess_events
from data_prep.schema import SchemaConfig
from data_prep.shard import ShardConfig, shard_name, write_shards
from training.ctr.data import load_dataset_meta, rank_slices


def write_events(directory, n=1000, seed=0):
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    table = pa.table(
        {
            "ts": np.sort(rng.integers(1_700_000_000, 1_700_100_000, n)),
            "user_id": rng.integers(1, 50, n),
            "city": [f"c{i}" for i in rng.integers(0, 5, n)],
            "price": rng.lognormal(3, 1, n),
            "click": rng.integers(0, 2, n),
            "p_true": rng.random(n),
        }
    )
    # Two files, to exercise multi-file reads.
    pq.write_table(table.slice(0, n // 2), directory / "part-00000.parquet")
    pq.write_table(table.slice(n // 2), directory / "part-00001.parquet")
    return table


def test_time_split_has_no_leakage_and_vocab_fits_on_train_only(tmp_path, schema):
    events = write_events(tmp_path / "events")
    result = preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")

    split = {s: pq.read_table(tmp_path / "pre" / s) for s in ("train", "valid", "test")}
    assert sum(t.num_rows for t in split.values()) == events.num_rows
    assert max(split["train"]["ts"].to_pylist()) < min(split["valid"]["ts"].to_pylist())
    assert max(split["valid"]["ts"].to_pylist()) < min(split["test"]["ts"].to_pylist())
    assert result.rows["test"] == pytest.approx(100, abs=10)

    transform = json.loads((tmp_path / "pre" / "transform.json").read_text())
    train_raw = events.filter(pa.compute.less(events["ts"], result.valid_start_ts))
    counts = {}
    for uid in train_raw["user_id"].to_pylist():
        counts[uid] = counts.get(uid, 0) + 1
    expected = sorted((u for u, c in counts.items() if c >= 2), key=lambda u: (-counts[u], u))
    assert transform["sparse"]["user_id"]["values"] == expected
    assert transform["sparse"]["user_id"]["num_embeddings"] == len(expected) + 1

    prices = np.log1p(train_raw["price"].to_numpy())
    stats = transform["dense"]["price"]
    assert stats["mean"] == pytest.approx(prices.mean()) and stats["std"] == pytest.approx(
        prices.std()
    )
    # Transformed train prices are standardised with train statistics.
    assert split["train"]["price"].to_numpy().mean() == pytest.approx(0.0, abs=1e-4)
    assert split["train"]["click"].type == pa.float32()
    assert split["train"]["user_id"].type == pa.int64()


def test_unseen_ids_map_to_oov_zero(tmp_path, schema):
    write_events(tmp_path / "events")
    extra = pa.table(
        {
            "ts": [1_700_200_000],
            "user_id": [999],
            "city": ["nowhere"],
            "price": [5.0],
            "click": [1],
            "p_true": [0.5],
        }
    )
    pq.write_table(extra, tmp_path / "events" / "part-00002.parquet")
    preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")
    test = pq.read_table(tmp_path / "pre" / "test")
    last = test.slice(test.num_rows - 1).to_pylist()[0]
    assert last["user_id"] == 0 and last["city"] == 0


def test_a_split_with_no_rows_is_an_error(tmp_path, schema):
    directory = tmp_path / "events"
    directory.mkdir()
    same_time = pa.table(
        {
            "ts": [5] * 10,
            "user_id": list(range(10)),
            "city": ["a"] * 10,
            "price": [1.0] * 10,
            "click": [0, 1] * 5,
            "p_true": [0.5] * 10,
        }
    )
    pq.write_table(same_time, directory / "part-00000.parquet")
    with pytest.raises(DataError, match="empty"):
        preprocess_events(PreprocessConfig(), schema, directory, tmp_path / "pre")


def test_shards_are_balanced_deterministic_and_complete(tmp_path, schema):
    write_events(tmp_path / "events", n=1003)
    preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")
    config = ShardConfig(num_train_shards=4, num_eval_shards=2, row_group_size=50, seed=3)
    a = write_shards(config, tmp_path / "pre", tmp_path / "s1")
    b = write_shards(config, tmp_path / "pre", tmp_path / "s2")
    assert a.shards == b.shards and a.rows == b.rows

    dataset = json.loads((tmp_path / "s1" / "dataset.json").read_text())
    sizes = [e["rows"] for e in dataset["splits"]["train"]["files"]]
    assert max(sizes) - min(sizes) <= 1
    assert a.shards["train"][0] == shard_name("train", 0, 4) == "train-00000-of-00004.parquet"
    for name in a.shards["train"]:
        assert (tmp_path / "s1" / name).read_bytes() == (tmp_path / "s2" / name).read_bytes()

    original = pq.read_table(tmp_path / "pre" / "train")
    sharded = pa.concat_tables(pq.read_table(tmp_path / "s1" / n) for n in a.shards["train"])
    key = ["ts", "user_id", "p_true"]
    assert sorted(zip(*(original[k].to_pylist() for k in key), strict=True)) == sorted(
        zip(*(sharded[k].to_pylist() for k in key), strict=True)
    )
    # Shuffled: the first shard is not a time-ordered prefix of train.
    first = pq.read_table(tmp_path / "s1" / a.shards["train"][0])["ts"].to_numpy()
    assert not np.all(np.diff(first) >= 0)
    assert (
        pq.ParquetFile(tmp_path / "s1" / a.shards["train"][0]).metadata.row_group(0).num_rows == 50
    )

    # Eval shards keep time order and cover the split.
    test = pa.concat_tables(pq.read_table(tmp_path / "s1" / n) for n in a.shards["test"])
    assert test["ts"].to_pylist() == pq.read_table(tmp_path / "pre" / "test")["ts"].to_pylist()

    dataset = json.loads((tmp_path / "s1" / "dataset.json").read_text())
    assert dataset["label"] == "click" and dataset["oracle"] == "p_true"
    assert dataset["dense"] == ["price"]
    assert [s["name"] for s in dataset["sparse"]] == ["user_id", "city"]


def test_different_seed_shuffles_differently(tmp_path, schema):
    write_events(tmp_path / "events")
    preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")
    a = write_shards(ShardConfig(seed=0), tmp_path / "pre", tmp_path / "s1")
    write_shards(ShardConfig(seed=1), tmp_path / "pre", tmp_path / "s2")
    name = a.shards["train"][0]
    assert (tmp_path / "s1" / name).read_bytes() != (tmp_path / "s2" / name).read_bytes()


def test_spilled_shuffle_is_balanced_uniform_and_bounded(tmp_path, schema):
    write_events(tmp_path / "events", n=5003)
    preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")
    config = ShardConfig(
        num_train_shards=3, num_eval_shards=4, row_group_size=128, shuffle_buffer_rows=500
    )
    result = write_shards(config, tmp_path / "pre", tmp_path / "s")
    original = pq.read_table(tmp_path / "pre" / "train")

    # Bounded memory: ceil(rows / buffer) buckets, each about the buffer size.
    source = shard._Source(sorted((tmp_path / "pre" / "train").glob("*.parquet")), 1000)
    sizes = [t.num_rows for _, t in shard._buckets(source, config, tmp_path / "spill")]
    assert len(sizes) == -(-original.num_rows // 500) and max(sizes) < 1.5 * 500
    assert sum(sizes) == original.num_rows and not (tmp_path / "spill").exists()

    for split, count in (("train", 3), ("valid", 4), ("test", 4)):
        tables = [pq.read_table(tmp_path / "s" / name) for name in result.shards[split]]
        rows = [t.num_rows for t in tables]
        assert len(rows) == count and max(rows) - min(rows) <= 1
        for name in result.shards[split]:
            metadata = pq.ParquetFile(tmp_path / "s" / name).metadata
            groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            assert all(g == 128 for g in groups[:-1]) and 0 < groups[-1] <= 128

    train = pa.concat_tables(pq.read_table(tmp_path / "s" / n) for n in result.shards["train"])
    key = ["ts", "user_id", "p_true"]
    assert sorted(zip(*(original[k].to_pylist() for k in key), strict=True)) == sorted(
        zip(*(train[k].to_pylist() for k in key), strict=True)
    )
    # A uniform shuffle: the first rows of every shard span the whole train period.
    ts = original["ts"].to_numpy()
    for name in result.shards["train"]:
        head = pq.read_table(tmp_path / "s" / name)["ts"].to_numpy()[:300]
        assert abs(head.mean() - ts.mean()) < 0.1 * (ts.max() - ts.min())


def test_dataset_json_is_what_training_reads(tmp_path):
    rng = np.random.default_rng(0)
    n = 1200
    events = tmp_path / "events"
    events.mkdir()
    table = pa.table(
        {
            "ts": np.sort(rng.integers(0, 10_000, n)),
            "user_id": rng.integers(1, 50, n),
            "tags": pa.array([[int(t) for t in rng.integers(0, 9, 2)] for _ in range(n)]),
            "age": rng.uniform(0, 90, n),
            "price": rng.lognormal(3, 1, n),
            "click": rng.integers(0, 2, n),
            "like": rng.integers(0, 2, n),
            "session": rng.integers(0, 10**9, n),
        }
    )
    pq.write_table(table, events / "part-00000.parquet")
    schema = SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user_id", "dtype": "int64", "role": "sparse"},
            {"name": "tags", "dtype": "int64", "role": "sparse", "multi_hot": True},
            {"name": "age", "dtype": "float64", "role": "dense", "bucketize": [18.0, 65.0]},
            {"name": "price", "dtype": "float64", "role": "dense"},
            {"name": "click", "dtype": "int64", "role": "label"},
            {"name": "like", "dtype": "int64", "role": "label"},
            {"name": "session", "dtype": "int64", "role": "key"},
        ]
    )
    preprocess_events(PreprocessConfig(), schema, events, tmp_path / "pre")
    result = write_shards(ShardConfig(num_train_shards=4), tmp_path / "pre", tmp_path / "s")

    dataset = json.loads((tmp_path / "s" / "dataset.json").read_text())
    assert dataset["label"] == "click" and dataset["labels"] == ["click", "like"]
    assert dataset["sparse"] == [
        {"name": "user_id", "num_embeddings": dataset["sparse"][0]["num_embeddings"]},
        {"name": "age", "num_embeddings": 3},
    ]
    assert dataset["dense"] == ["price"] and dataset["keys"] == ["session"]
    assert dataset["multi_hot"] == [{"name": "tags", "num_embeddings": 10}]
    assert dataset["split"]["method"] == "time"
    shard0 = pq.read_table(tmp_path / "s" / result.shards["train"][0])
    assert shard0.schema.field("tags").type == pa.list_(pa.field("element", pa.int64()))
    assert shard0.schema.field("session").type == pa.int64()  # keys pass through

    meta = load_dataset_meta(tmp_path / "s")
    assert meta.sparse_names == ["user_id", "age"] and meta.dense == ["price"]
    # num_train_shards a multiple of the world size: disjoint files, balanced rows.
    ranks = [rank_slices(meta.split("train"), r, 2) for r in range(2)]
    assert {p for p, _, _ in ranks[0]}.isdisjoint({p for p, _, _ in ranks[1]})
    rows = [sum(end - start for _, start, end in slices) for slices in ranks]
    assert abs(rows[0] - rows[1]) <= 2

    # The training reader and a two-task model with a multi-hot feature consume it.
    from training.config import TrainConfig
    from training.ctr.model import build_model, model_config_from
    from training.ctr.reader import ShardReader

    with ShardReader(tmp_path / "s", meta, "train", 0, 1, 32, 1, tasks=["click", "like"]) as reader:
        batch = next(iter(reader))
    assert batch.sparse.shape == (32, 2) and batch.dense.shape == (32, 1)
    assert batch.labels.shape == (32, 2) and batch.multi_hot[0].shape == (32, 2)
    assert int(batch.multi_hot[0].max()) < 10
    config = TrainConfig(embedding_dim=8, bottom_mlp=[8], top_mlp=[8], tasks=["click", "like"])
    model = build_model(model_config_from(config, meta))
    assert model(batch.sparse, batch.dense, *batch.multi_hot).shape == (32, 2)


def test_too_many_spill_buckets_is_a_config_error(tmp_path, schema, monkeypatch):
    write_events(tmp_path / "events", n=1000)
    preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")
    monkeypatch.setattr(shard, "MAX_SPILL_BUCKETS", 3)
    with pytest.raises(ConfigError, match="shuffle_buffer_rows to at least 267"):
        write_shards(ShardConfig(shuffle_buffer_rows=100), tmp_path / "pre", tmp_path / "s")


def test_a_thousand_sparse_slots_in_one_counting_pass(tmp_path):
    from data_prep.schema import SchemaConfig

    rng = np.random.default_rng(0)
    n, slots = 2000, 1000
    columns = {"ts": np.arange(n) + 1_700_000_000, "click": rng.integers(0, 2, n)}
    for i in range(slots):
        columns[f"s{i}"] = rng.integers(0, 5 + i % 20, n)
    (tmp_path / "events").mkdir()
    pq.write_table(pa.table(columns), tmp_path / "events" / "part-00000.parquet")
    schema = SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "click", "dtype": "int64", "role": "label"},
            *({"name": f"s{i}", "dtype": "int64", "role": "sparse"} for i in range(slots)),
        ]
    )
    result = preprocess_events(PreprocessConfig(), schema, tmp_path / "events", tmp_path / "pre")
    train_rows = result.rows["train"]
    for i in (0, 7, 999):
        values, counts = np.unique(columns[f"s{i}"][:train_rows], return_counts=True)
        assert result.vocab_sizes[f"s{i}"] == int((counts >= 2).sum()) + 1


def test_a_day_extends_its_parents_transform_and_known_ids_keep_their_rows(tmp_path, schema):
    write_events(tmp_path / "day1", seed=0)
    first = preprocess_events(
        PreprocessConfig(min_count=1), schema, tmp_path / "day1", tmp_path / "pre1",
        partition="dt=2026-12-01",
    )  # fmt: skip
    assert first.partitions == ["dt=2026-12-01"]
    parent = json.loads((tmp_path / "pre1" / "transform.json").read_text())
    # Day 2: new users 50..79 arrive, users 1..19 stop; a refit would reorder the rows.
    day2 = write_events(tmp_path / "day2", seed=1)
    users = day2.column("user_id").to_numpy() + 30
    for name in ("part-00000.parquet", "part-00001.parquet"):
        path = tmp_path / "day2" / name
        table = pq.read_table(path)
        shifted = pa.array(table.column("user_id").to_numpy() + 30)
        pq.write_table(table.set_column(1, "user_id", shifted), path)
    config = PreprocessConfig(min_count=1, ttl=1)
    second = preprocess_events(
        config, schema, tmp_path / "day2", tmp_path / "pre2",
        partition="dt=2026-12-02", parent=parent,
    )  # fmt: skip
    child = json.loads((tmp_path / "pre2" / "transform.json").read_text())
    assert second.partitions == ["dt=2026-12-01", "dt=2026-12-02"]
    before, after = parent["sparse"]["user_id"]["values"], child["sparse"]["user_id"]["values"]
    # Ids seen on both days keep their slot (row = slot + 1); ids gone for ttl=1 day are
    # evicted and their slots taken by new ids, which the warm start must reset.
    still = [i for i, value in enumerate(before) if value in set(users.tolist())]
    assert still and all(after[i] == before[i] for i in still)
    reused = child["changes"]["user_id"]["reset_rows"]
    assert reused and all(before[row - 1] not in set(users.tolist()) for row in reused)
    assert second.vocabulary["user_id"]["evicted"] == len(before) - len(still)
    assert child["parent_sizes"]["user_id"] == parent["sparse"]["user_id"]["num_embeddings"]
    # The day's shards index through the extended vocabulary.
    train = pq.read_table(tmp_path / "pre2" / "train")
    assert train.num_rows == second.rows["train"]
    position = {value: slot + 1 for slot, value in enumerate(after) if value is not None}
    assert set(train.column("user_id").to_pylist()) <= set(position.values())
    with pytest.raises(ConfigError, match="ingest.partition"):
        preprocess_events(config, schema, tmp_path / "day2", tmp_path / "pre3", parent=parent)
