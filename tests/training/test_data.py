import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data_prep.errors import InputNotFoundError, SchemaError
from training.data import (
    iter_batches,
    iter_tables,
    load_dataset_meta,
    rank_slices,
    steps_per_epoch,
)


def rank_ts(shards_dir: Path, split: str, rank: int, world_size: int) -> np.ndarray:
    """The `ts` values (unique per split in the fabricated data) a rank reads."""
    meta = load_dataset_meta(shards_dir)
    tables = iter_tables(shards_dir, meta, split, rank, world_size, 50, ["ts"], drop_last=False)
    return np.concatenate([t.column("ts").to_numpy() for t in tables])


@pytest.mark.parametrize(("num_files", "world_size"), [(4, 2), (3, 2), (1, 2), (2, 3), (5, 1)])
def test_ranks_read_disjoint_rows_that_cover_the_split(
    make_shards: Callable[..., Path], num_files: int, world_size: int
) -> None:
    shards_dir = make_shards(split_files={"train": num_files}, rows_per_file=100)
    parts = [rank_ts(shards_dir, "train", rank, world_size) for rank in range(world_size)]
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything)) == 100 * num_files


@pytest.mark.parametrize(("num_files", "world_size"), [(4, 2), (3, 2), (1, 2), (2, 3)])
def test_every_rank_runs_the_same_number_of_steps(
    make_shards: Callable[..., Path], num_files: int, world_size: int
) -> None:
    shards_dir = make_shards(split_files={"train": num_files}, rows_per_file=100)
    meta = load_dataset_meta(shards_dir)
    rows = [
        sum(end - start for _, start, end in rank_slices(meta.split("train"), r, world_size))
        for r in range(world_size)
    ]
    expected = min(rows) // 16
    assert steps_per_epoch(meta, "train", world_size, 16) == expected
    counts = [
        sum(1 for _ in iter_batches(shards_dir, meta, "train", r, world_size, 16))
        for r in range(world_size)
    ]
    assert counts == [expected] * world_size


def test_batches_hold_the_shard_values_in_feature_order(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    sparse, dense, label = next(iter_batches(shards_dir, meta, "train", 1, 2, 70))
    assert sparse.shape == (70, 3) and dense.shape == (70, 2) and label.shape == (70,)
    assert (sparse.dtype, dense.dtype, label.dtype) == (torch.int64, torch.float32, torch.float32)
    # Rank 1 of 2 with 4 files reads train file 1 first; 70 rows cross a row group (64).
    table = pq.read_table(shards_dir / meta.split("train").files[1].path).slice(0, 70)
    for i, name in enumerate(meta.sparse_names):
        np.testing.assert_array_equal(sparse[:, i].numpy(), table.column(name).to_numpy())
    for i, name in enumerate(meta.dense):
        np.testing.assert_array_equal(dense[:, i].numpy(), table.column(name).to_numpy())
    np.testing.assert_array_equal(label.numpy(), table.column("click").to_numpy())


def test_num_steps_stops_early(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    assert sum(1 for _ in iter_batches(shards_dir, meta, "train", 0, 2, 32, num_steps=3)) == 3


def test_missing_dataset_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match=str(tmp_path / "dataset.json")):
        load_dataset_meta(tmp_path)


def test_rows_missing_from_a_file_are_a_schema_error(shards_dir: Path) -> None:
    meta_path = shards_dir / "dataset.json"
    meta = json.loads(meta_path.read_text())
    meta["splits"]["train"]["files"][0]["rows"] = 300  # the file has 256
    meta["splits"]["train"]["rows"] = 300 + 3 * 256
    meta_path.write_text(json.dumps(meta))
    loaded = load_dataset_meta(shards_dir)
    with pytest.raises(SchemaError, match="256 rows"):
        list(iter_batches(shards_dir, loaded, "train", 0, 2, 32))


def test_unknown_split_is_a_schema_error(shards_dir: Path) -> None:
    with pytest.raises(SchemaError, match="no split 'holdout'"):
        load_dataset_meta(shards_dir).split("holdout")
