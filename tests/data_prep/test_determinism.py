"""Same input and config, same bytes: whatever pyarrow's thread count."""

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.preprocess import PreprocessConfig, preprocess_events
from data_prep.schema import SchemaConfig
from data_prep.shard import ShardConfig, write_shards

SCHEMA = SchemaConfig(
    user_key="user",
    fields=[
        {"name": "ts", "dtype": "int64", "role": "timestamp"},
        {"name": "user", "dtype": "int64", "role": "sparse"},
        {"name": "city", "dtype": "string", "role": "sparse"},
        {"name": "device", "dtype": "string", "role": "sparse", "hash_buckets": 16},
        {"name": "tags", "dtype": "string", "role": "sparse", "multi_hot": True},
        {"name": "price", "dtype": "float64", "role": "dense", "log": True},
        {"name": "age", "dtype": "float64", "role": "dense", "bucketize": [20.0, 40.0]},
        {"name": "click", "dtype": "int64", "role": "label"},
        {"name": "like", "dtype": "int64", "role": "label"},
    ],
)
SHARD = ShardConfig(
    num_train_shards=4, num_eval_shards=2, row_group_size=1000, shuffle_buffer_rows=3000
)


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    n = 20_000
    directory = tmp_path_factory.mktemp("events")
    tags = [[f"t{j}" for j in rng.integers(0, 30, k)] for k in rng.integers(0, 4, n)]
    table = pa.table(
        {
            "ts": np.sort(rng.integers(0, 1_000_000, n)),
            "user": rng.integers(0, 500, n),
            "city": [f"c{i}" for i in rng.integers(0, 40, n)],
            "device": [f"d{i}" for i in rng.integers(0, 100, n)],
            "tags": pa.array(tags, pa.list_(pa.string())),
            "price": rng.lognormal(3, 1, n),
            "age": rng.uniform(10, 70, n),
            "click": rng.integers(0, 2, n),
            "like": rng.integers(0, 2, n),
        }
    )
    for k, start in enumerate(range(0, n, 7000)):
        pq.write_table(table.slice(start, 7000), directory / f"part-{k:05d}.parquet")
    return directory


def run(events: Path, out: Path, threads: int, preprocess: PreprocessConfig, shard: ShardConfig):
    before = pa.cpu_count()
    pa.set_cpu_count(threads)
    try:
        preprocess_events(preprocess, SCHEMA, events, out / "pre")
        write_shards(shard, out / "pre", out / "shards")
    finally:
        pa.set_cpu_count(before)
    return digests(out)


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("split", ["time", "leave_last_out"])
def test_output_bytes_do_not_depend_on_thread_count(events, tmp_path, split):
    config = PreprocessConfig(split=split, batch_rows=2500)
    one = run(events, tmp_path / "one", 1, config, SHARD)
    four = run(events, tmp_path / "four", 4, config, SHARD)

    assert one == four
    names = set(one)
    assert {"shards/dataset.json", "pre/transform.json"} <= names
    assert sum(n.startswith("shards/train-") for n in names) == 4
    assert sum(n.startswith("pre/train/") for n in names) == 3  # one part per input file
    assert not any(".spill" in n for n in names)


def test_the_comparison_catches_a_different_shuffle(events, tmp_path):
    """Negative control: the byte comparison above would notice a change."""
    config = PreprocessConfig(batch_rows=2500)
    base = run(events, tmp_path / "base", 1, config, SHARD)
    reseeded = run(events, tmp_path / "seeded", 4, config, SHARD.model_copy(update={"seed": 1}))

    assert base != reseeded
    differ = sorted(n for n in base if base[n] != reseeded[n])
    assert differ == [f"shards/train-{k:05d}-of-00004.parquet" for k in range(4)]
