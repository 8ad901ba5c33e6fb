"""The shard shuffle as tasks over URLs gives the in-process shuffle's bytes."""

import json
import uuid
from functools import partial

import fsspec
import pytest

from artifacts.errors import ConfigError
from artifacts.locations import join, list_files, read_bytes
from data_prep.preprocess import PreprocessConfig, ordered_map, preprocess_events
from data_prep.shard import ShardConfig, write_shards, write_shards_distributed
from tests.data_prep.test_preprocess_shard import write_events


class RecordingMapper:
    """``map_tasks`` on threads that records how many tasks each pass ran."""

    def __init__(self) -> None:
        self.passes: list[int] = []

    def __call__(self, fn, items):
        self.passes.append(len(items))
        return ordered_map(fn, items, workers=2)


def tree(location) -> dict[str, bytes]:
    files = list_files(location, "", recursive=True)
    return {str(f).removeprefix(str(location)).lstrip("/"): read_bytes(f) for f in files}


@pytest.mark.parametrize(
    ("buffer", "shards"), [(400, 3), (100_000, 4), (97, 5)], ids=["13-buckets", "1-bucket", "many"]
)
def test_shards_over_urls_are_byte_identical_to_the_in_process_shuffle(
    tmp_path, schema, buffer, shards
):
    write_events(tmp_path / "events", n=5003)
    # Small batches: several row groups per preprocessed file, so pass 1 has many units.
    pre_config = PreprocessConfig(batch_rows=700)
    preprocess_events(pre_config, schema, tmp_path / "events", tmp_path / "pre")
    url = f"memory://recforge-{uuid.uuid4().hex[:8]}"
    # preprocess writes through fsspec too, with the same bytes.
    preprocess_events(pre_config, schema, tmp_path / "events", f"{url}/pre")
    assert tree(f"{url}/pre") == tree(tmp_path / "pre")

    config = ShardConfig(
        num_train_shards=shards,
        num_eval_shards=2,
        row_group_size=128,
        shuffle_buffer_rows=buffer,
        batch_rows=333,
        seed=7,
    )
    local = write_shards(config, tmp_path / "pre", tmp_path / "shards")
    mapper = RecordingMapper()
    remote = write_shards_distributed(
        config, f"{url}/pre", f"{url}/shards", f"{url}/scratch", mapper
    )
    assert remote.shards == local.shards and remote.rows == local.rows
    expected = tree(tmp_path / "shards")
    assert set(expected) == {*(n for s in local.shards.values() for n in s), "dataset.json"}
    assert tree(f"{url}/shards") == expected
    # Every pass ran as tasks: one per row group, one per bucket, one per output.
    units, buckets, outputs = mapper.passes
    assert units >= 6 and outputs == shards + 2
    assert buckets == -(-local.rows["train"] // buffer)
    assert list_files(f"{url}/scratch", "", recursive=True) == []  # parts deleted

    # A local scratch and output work the same way.
    write_shards_distributed(
        config,
        tmp_path / "pre",
        tmp_path / "local-shards",
        tmp_path / "scratch",
        partial(ordered_map, workers=1),
    )
    assert tree(tmp_path / "local-shards") == expected


def test_distributed_shard_names_the_missing_input(tmp_path):
    from artifacts.errors import InputNotFoundError

    url = f"memory://recforge-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("memory").pipe(f"{url}/pre/transform.json", b"{}")
    with pytest.raises(Exception, match="transform.json"):
        write_shards_distributed(ShardConfig(), f"{url}/pre", f"{url}/s", f"{url}/t", map)
    with pytest.raises(InputNotFoundError, match=r"transform.json' is missing"):
        write_shards_distributed(ShardConfig(), f"{url}/nothing", f"{url}/s", f"{url}/t", map)
    assert join(url, "a", "b") == f"{url}/a/b"


@pytest.mark.parametrize("windows", ["last", "all"])
def test_preprocess_with_sequences_writes_the_same_files_to_a_url(tmp_path, windows):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.schema import SchemaConfig

    schema = SchemaConfig(
        user_key="user_id",
        item_key="item_id",
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user_id", "dtype": "int64", "role": "sparse"},
            {"name": "item_id", "dtype": "int64", "role": "sparse"},
            {"name": "click", "dtype": "int64", "role": "label"},
        ],
    )
    rng = np.random.default_rng(1)
    n = 3000
    (tmp_path / "events").mkdir()
    table = pa.table(
        {
            "ts": np.sort(rng.integers(0, 10_000, n)),
            "user_id": rng.integers(1, 60, n),
            "item_id": rng.integers(1, 40, n),
            "click": rng.integers(0, 2, n),
        }
    )
    pq.write_table(table.slice(0, n // 2), tmp_path / "events" / "part-00000.parquet")
    pq.write_table(table.slice(n // 2), tmp_path / "events" / "part-00001.parquet")
    config = PreprocessConfig(
        split="leave_last_out", min_count=1, sequence_length=5, sequence_windows=windows
    )
    if windows == "all":  # windows of what: refused without sequences
        no_sequences = config.model_copy(update={"sequence_length": None})
        with pytest.raises(ConfigError, match="sequence_windows='all' needs"):
            preprocess_events(no_sequences, schema, tmp_path / "events", tmp_path / "refused")
    local = preprocess_events(config, schema, tmp_path / "events", tmp_path / "pre")
    url = f"memory://recforge-{uuid.uuid4().hex[:8]}/pre"
    remote = preprocess_events(config, schema, tmp_path / "events", url)
    assert remote.sequences == local.sequences and local.sequences
    expected = tree(tmp_path / "pre")
    assert any(name.startswith("sequences/") for name in expected)
    assert tree(url) == expected
    meta = json.loads((tmp_path / "pre" / "sequences" / "sequences.json").read_text())
    assert meta["windows"] == windows
    users = meta["users"]
    assert (meta["rows"]["train"] > users) == (windows == "all")  # 50 events a user, L = 5
