import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from training.ctr.data import (
    DatasetMeta,
    iter_tables,
    load_dataset_meta,
    model_columns,
    pad_multi_hot,
    to_batch,
)


def rank_ts(shards_dir: Path, split: str, rank: int, world_size: int) -> np.ndarray:
    """The `ts` values (unique per split in the fabricated data) a rank reads."""
    meta = load_dataset_meta(shards_dir)
    tables = iter_tables(shards_dir, meta, split, rank, world_size, 50, ["ts"], drop_last=False)
    return np.concatenate([t.column("ts").to_numpy() for t in tables])


def meta_dict(**overrides: object) -> dict:
    """A minimal dataset.json content."""
    meta = {
        "label": "click",
        "sparse": [{"name": "user_id", "num_embeddings": 10}],
        "dense": ["price"],
        "splits": {"train": {"files": [], "rows": 0}},
    }
    return {**meta, **overrides}


@pytest.mark.parametrize(("num_files", "world_size"), [(4, 2), (3, 2), (1, 2), (2, 3), (5, 1)])
def test_ranks_read_disjoint_rows_that_cover_the_split(
    make_shards: Callable[..., Path], num_files: int, world_size: int
) -> None:
    shards_dir = make_shards(split_files={"train": num_files}, rows_per_file=100)
    parts = [rank_ts(shards_dir, "train", rank, world_size) for rank in range(world_size)]
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything)) == 100 * num_files


def test_batches_hold_the_shard_values_in_feature_order(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    table = next(iter_tables(shards_dir, meta, "train", 1, 2, 70, model_columns(meta)))
    sparse, dense, labels, multi_hot = to_batch(table, meta)
    assert sparse.shape == (70, 3) and dense.shape == (70, 2) and labels.shape == (70, 1)
    assert (sparse.dtype, dense.dtype, labels.dtype) == (torch.int64, torch.float32, torch.float32)
    assert multi_hot == ()
    # Rank 1 of 2 with 4 files reads train file 1 first; 70 rows cross a row group (64).
    expected = pq.read_table(shards_dir / meta.split("train").files[1].path).slice(0, 70)
    for i, name in enumerate(meta.sparse_names):
        np.testing.assert_array_equal(sparse[:, i].numpy(), expected.column(name).to_numpy())
    for i, name in enumerate(meta.dense):
        np.testing.assert_array_equal(dense[:, i].numpy(), expected.column(name).to_numpy())
    np.testing.assert_array_equal(labels[:, 0].numpy(), expected.column("click").to_numpy())


def test_to_batch_of_a_chunked_table_equals_that_of_the_combined_table(
    make_shards: Callable[..., Path],
) -> None:
    shards_dir = make_shards(multi_hot={"tags": 13, "genres": 5}, extra_labels=["purchase"])
    meta = load_dataset_meta(shards_dir)
    whole = pq.read_table(shards_dir / meta.split("train").files[0].path)
    chunked = pa.concat_tables([whole.slice(3, 50), whole.slice(53, 100), whole.slice(153, 7)])
    tasks = ["purchase", "click"]
    expected = to_batch(whole.slice(3, 157).combine_chunks(), meta, tasks)
    got = to_batch(chunked, meta, tasks)
    for want, have in zip(expected[:3], got[:3], strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
    for want, have in zip(expected.multi_hot, got.multi_hot, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0)


def test_labels_are_the_task_columns_in_task_order(make_shards: Callable[..., Path]) -> None:
    shards_dir = make_shards(extra_labels=["purchase"])
    meta = load_dataset_meta(shards_dir)
    table = pq.read_table(shards_dir / meta.split("train").files[0].path).slice(0, 20)
    labels = to_batch(table, meta, ["purchase", "click"]).labels
    assert labels.shape == (20, 2)
    np.testing.assert_array_equal(labels[:, 0].numpy(), table.column("purchase").to_numpy())
    np.testing.assert_array_equal(labels[:, 1].numpy(), table.column("click").to_numpy())


def test_multi_hot_lists_are_padded_with_minus_one() -> None:
    ids = pa.array([[1, 2, 3], [], None, [4], [5, None]], type=pa.list_(pa.int64()))
    expected = [[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [4, -1, -1], [5, -1, -1]]
    np.testing.assert_array_equal(pad_multi_hot(ids), expected)
    # A slice and a chunked column keep their own offsets; the width is this batch's longest.
    np.testing.assert_array_equal(pad_multi_hot(ids.slice(3, 2)), [[4, -1], [5, -1]])
    chunked = pa.chunked_array([ids.slice(1, 2), ids.slice(3, 1)])
    np.testing.assert_array_equal(pad_multi_hot(chunked), [[-1], [-1], [4]])


def test_all_empty_lists_give_one_column_of_minus_one() -> None:
    ids = pa.array([[], None, []], type=pa.list_(pa.int64()))
    padded = pad_multi_hot(ids)
    assert padded.shape == (3, 1) and padded.dtype == np.int64
    assert (padded == -1).all()


def test_batch_holds_multi_hot_features_in_meta_order(make_shards: Callable[..., Path]) -> None:
    shards_dir = make_shards(multi_hot={"tags": 13, "genres": 5}, max_list_length=3)
    meta = load_dataset_meta(shards_dir)
    table = pq.read_table(shards_dir / meta.split("train").files[0].path).slice(0, 30)
    batch = to_batch(table, meta)
    assert [t.shape for t in batch.multi_hot] == [(30, 3), (30, 3)]
    for tensor, name in zip(batch.multi_hot, meta.multi_hot_names, strict=True):
        assert tensor.dtype == torch.int64
        for row, ids in zip(tensor.tolist(), table.column(name).to_pylist(), strict=True):
            ids = ids or []
            assert row == ids + [-1] * (3 - len(ids))


def test_a_non_list_multi_hot_column_is_a_schema_error() -> None:
    with pytest.raises(SchemaError, match="'tags' has type int64"):
        pad_multi_hot(pa.array([1, 2]), "tags")


def test_meta_defaults_labels_to_the_primary_label() -> None:
    meta = DatasetMeta.model_validate(meta_dict())
    assert meta.labels == ["click"] and meta.multi_hot == []
    assert meta.task_labels(None) == ["click"]
    assert model_columns(meta) == ["user_id", "price", "click"]


def test_meta_describes_multi_hot_features_and_all_tables() -> None:
    meta = DatasetMeta.model_validate(
        meta_dict(
            labels=["click", "purchase"],
            multi_hot=[{"name": "tags", "num_embeddings": 50}],
        )
    )
    assert meta.multi_hot_names == ["tags"]
    assert meta.num_embeddings == [10]
    assert meta.table_sizes == [10, 50]
    assert meta.task_labels(["purchase", "click"]) == ["purchase", "click"]
    assert model_columns(meta, ["purchase"]) == ["user_id", "tags", "price", "purchase"]


def test_meta_may_have_only_multi_hot_features() -> None:
    meta = DatasetMeta.model_validate(
        meta_dict(sparse=[], multi_hot=[{"name": "tags", "num_embeddings": 50}])
    )
    assert meta.sparse_names == [] and meta.table_sizes == [50]


def test_meta_without_any_categorical_feature_is_a_schema_error(tmp_path: Path) -> None:
    (tmp_path / "dataset.json").write_text(json.dumps(meta_dict(sparse=[])))
    with pytest.raises(SchemaError, match="no sparse and no multi_hot feature"):
        load_dataset_meta(tmp_path)


def test_primary_label_must_be_among_the_labels(tmp_path: Path) -> None:
    (tmp_path / "dataset.json").write_text(json.dumps(meta_dict(labels=["purchase"])))
    with pytest.raises(SchemaError, match="primary label 'click' is not among labels"):
        load_dataset_meta(tmp_path)


def test_an_unknown_task_is_a_config_error_listing_the_labels() -> None:
    meta = DatasetMeta.model_validate(meta_dict(labels=["click", "purchase"]))
    with pytest.raises(ConfigError, match=r"train.tasks: \['like'\].*\['click', 'purchase'\]"):
        meta.task_labels(["click", "like"])


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
    with pytest.raises(SchemaError, match="train-00000-of-00004.parquet has 256 rows"):
        list(iter_tables(shards_dir, loaded, "train", 0, 2, 32, ["ts"]))


def test_a_missing_column_is_a_schema_error_naming_it(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    with pytest.raises(SchemaError, match=r"lacks the columns \['purchase'\]"):
        list(iter_tables(shards_dir, meta, "train", 0, 2, 32, ["ts", "purchase"]))


def test_unknown_split_is_a_schema_error(shards_dir: Path) -> None:
    with pytest.raises(SchemaError, match="no split 'holdout'"):
        load_dataset_meta(shards_dir).split("holdout")
