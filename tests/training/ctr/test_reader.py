import gc
import json
import threading
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import training.ctr.reader
from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from training.ctr.data import Batch, DatasetMeta, load_dataset_meta, rank_slices, to_batch
from training.ctr.reader import ShardReader, measure_throughput, steps_per_epoch, stream_slices

MULTI_HOT = {"tags": 13, "genres": 5}


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ShardReader-")]


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> None:
    """Every test must stop the worker threads it started."""
    yield
    assert reader_threads() == []


@pytest.fixture
def rich_shards(make_shards: Callable[..., Path]) -> Path:
    """4 train files of 256 rows (row groups of 64) with two multi-hot features, two labels."""
    return make_shards(multi_hot=MULTI_HOT, extra_labels=["purchase"])


def take(reader: ShardReader, count: int) -> list[Batch]:
    return list(islice(reader, count))


def pad_to(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad (B, L) multi-hot ids with -1 to (B, width)."""
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=-1)


def concat(batches: list[Batch]) -> Batch:
    """Rows of several batches, one after the other (multi-hot padded to a common width)."""
    multi_hot = []
    for parts in zip(*(b.multi_hot for b in batches), strict=True):
        width = max(p.shape[1] for p in parts)
        multi_hot.append(torch.cat([pad_to(p, width) for p in parts]))
    return Batch(
        torch.cat([b.sparse for b in batches]),
        torch.cat([b.dense for b in batches]),
        torch.cat([b.labels for b in batches]),
        tuple(multi_hot),
    )


def assert_batches_equal(got: Batch, want: Batch) -> None:
    for have, expected in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(have, expected, rtol=0, atol=0)
    assert len(got.multi_hot) == len(want.multi_hot)
    for have, expected in zip(got.multi_hot, want.multi_hot, strict=True):
        torch.testing.assert_close(have, expected, rtol=0, atol=0)


def stream_table(shards_dir: Path, meta: DatasetMeta, stream: int, num_streams: int) -> pa.Table:
    """All rows of one stream, read plainly with pyarrow."""
    parts = [
        pq.read_table(shards_dir / path).slice(start, end - start)
        for path, start, end in stream_slices(meta.split("train"), stream, num_streams)
    ]
    return pa.concat_tables(parts)


@pytest.mark.parametrize(("num_files", "num_streams"), [(4, 2), (5, 2), (1, 4), (3, 4), (4, 4)])
def test_streams_read_disjoint_rows_that_cover_the_split(
    make_shards: Callable[..., Path], num_files: int, num_streams: int
) -> None:
    shards_dir = make_shards(split_files={"train": num_files}, rows_per_file=100)
    split = load_dataset_meta(shards_dir).split("train")
    ts = [
        stream_table(shards_dir, load_dataset_meta(shards_dir), s, num_streams).column("ts")
        for s in range(num_streams)
    ]
    everything = np.concatenate([t.to_numpy() for t in ts])
    assert len(everything) == len(np.unique(everything)) == 100 * num_files
    for s in range(num_streams):
        assert stream_slices(split, s, num_streams) == rank_slices(split, s, num_streams)


def test_streams_take_whole_files_when_there_are_enough() -> None:
    split = DatasetMeta.model_validate(
        {
            "label": "y",
            "sparse": [{"name": "a", "num_embeddings": 2}],
            "dense": [],
            "splits": {
                "train": {
                    "files": [{"path": f"f{i}", "rows": 10 + i} for i in range(5)],
                    "rows": 60,
                }
            },
        }
    ).split("train")
    assert stream_slices(split, 0, 2) == [("f0", 0, 10), ("f2", 0, 12), ("f4", 0, 14)]
    assert stream_slices(split, 1, 2) == [("f1", 0, 11), ("f3", 0, 13)]
    assert stream_slices(split, 1, 8) == [
        (f"f{i}", (10 + i) // 8, 2 * (10 + i) // 8) for i in range(5)
    ]


def test_steps_per_epoch_is_the_smallest_stream_over_its_piece(
    make_shards: Callable[..., Path],
) -> None:
    shards_dir = make_shards(split_files={"train": 5}, rows_per_file=100)
    meta = load_dataset_meta(shards_dir)
    # Streams of 2 take files {0, 2, 4} (300 rows) and {1, 3} (200 rows).
    assert steps_per_epoch(meta, "train", 2, 30) == 200 // 30
    with ShardReader(shards_dir, meta, "train", 1, 2, batch_size=30, num_streams=2) as reader:
        assert reader.steps_per_epoch == 6 and reader.rows_per_stream == 30


def test_a_batch_is_the_pieces_of_the_rank_streams_in_stream_order(rich_shards: Path) -> None:
    meta = load_dataset_meta(rich_shards)
    tasks = ["purchase", "click"]
    # 4 streams over 2 ranks, 20 rows per stream and step: rank 1 reads streams 1 and 3.
    streams = [stream_table(rich_shards, meta, s, 4) for s in (1, 3)]
    with ShardReader(rich_shards, meta, "train", 1, 2, 40, 4, tasks=tasks) as reader:
        assert reader.streams == [1, 3]
        batches = take(reader, 5)  # rows 80..100 of each stream cross a row group (64)
    for step, batch in enumerate(batches):
        rows = pa.concat_tables([t.slice(20 * step, 20) for t in streams])
        assert_batches_equal(batch, to_batch(rows, meta, tasks))
        assert batch.labels.shape == (40, 2)


@pytest.mark.parametrize("num_files", [4, 1])
def test_one_rank_of_double_batch_yields_the_batches_of_two_ranks_side_by_side(
    make_shards: Callable[..., Path], num_files: int
) -> None:
    shards_dir = make_shards(split_files={"train": num_files}, multi_hot=MULTI_HOT)
    meta = load_dataset_meta(shards_dir)
    b = 24
    with (
        ShardReader(shards_dir, meta, "train", 0, 1, 2 * b, 2) as single,
        ShardReader(shards_dir, meta, "train", 0, 2, b, 2) as rank0,
        ShardReader(shards_dir, meta, "train", 1, 2, b, 2) as rank1,
    ):
        assert single.steps_per_epoch == rank0.steps_per_epoch == rank1.steps_per_epoch
        steps = single.steps_per_epoch + 3  # into the second epoch
        batches = zip(take(single, steps), take(rank0, steps), take(rank1, steps), strict=True)
        for one, zero, first in batches:
            assert_batches_equal(one, concat([zero, first]))


def test_global_steps_hold_the_same_rows_for_every_world_size(
    make_shards: Callable[..., Path],
) -> None:
    shards_dir = make_shards(split_files={"train": 3}, rows_per_file=200)
    meta = load_dataset_meta(shards_dir)
    global_batch, steps = 48, 10

    def global_steps(world_size: int) -> list[set[float]]:
        readers = [
            ShardReader(shards_dir, meta, "train", r, world_size, global_batch // world_size, 4)
            for r in range(world_size)
        ]
        per_rank = [take(reader, steps) for reader in readers]
        for reader in readers:
            reader.close()
        # The dense `price` values are random floats: they identify the rows.
        return [{float(x) for rank in per_rank for x in rank[k].dense[:, 0]} for k in range(steps)]

    reference = global_steps(1)
    assert all(len(rows) == global_batch for rows in reference)
    assert global_steps(2) == reference
    assert global_steps(4) == reference


@pytest.mark.parametrize("consumed", [0, 3, 9, 10, 23])
def test_restore_continues_exactly_where_the_position_was(rich_shards: Path, consumed: int) -> None:
    meta = load_dataset_meta(rich_shards)
    # 2 streams of 512 rows over 2 ranks, 50 rows per step: 10 steps per epoch.
    with ShardReader(rich_shards, meta, "train", 1, 2, 50, 2, tasks=["purchase"]) as reader:
        assert reader.steps_per_epoch == 10
        take(reader, consumed)
        position = json.loads(json.dumps(reader.position()))
        assert position == {"epoch": consumed // 10, "step": consumed % 10}
        expected = take(reader, 12)
    with ShardReader(rich_shards, meta, "train", 1, 2, 50, 2, tasks=["purchase"]) as resumed:
        resumed.restore(position)
        assert resumed.position() == position
        for got, want in zip(take(resumed, 12), expected, strict=True):
            assert_batches_equal(got, want)


def test_restore_while_running_drops_the_batches_decoded_ahead(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    with ShardReader(shards_dir, meta, "train", 0, 1, 32, 2, prefetch=2) as reader:
        first = take(reader, 4)
        reader.restore({"epoch": 0, "step": 1})
        assert_batches_equal(next(reader), first[1])
        assert reader.position() == {"epoch": 0, "step": 2}


def test_restore_skips_the_row_groups_before_the_position(
    make_shards: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    shards_dir = make_shards(split_files={"train": 1}, rows_per_file=512, row_group_size=64)
    meta = load_dataset_meta(shards_dir)
    decoded: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    def recording(self: pq.ParquetFile, *args: object, **kwargs: object) -> object:
        decoded.extend(kwargs["row_groups"])
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    with ShardReader(shards_dir, meta, "train", 0, 1, 16, 1, prefetch=1) as reader:
        reader.restore({"epoch": 0, "step": 20})  # row 320: the start of row group 5
        next(reader)
    assert decoded and min(decoded) == 5


def test_rows_past_the_last_full_step_are_skipped_each_epoch(
    make_shards: Callable[..., Path],
) -> None:
    shards_dir = make_shards(split_files={"train": 1}, rows_per_file=100)
    meta = load_dataset_meta(shards_dir)
    with ShardReader(shards_dir, meta, "train", 0, 1, 30, 1) as reader:
        batches = take(reader, 6)  # 3 steps per epoch; rows 90..99 never read
    for step in range(3):
        assert_batches_equal(batches[step + 3], batches[step])
    prices = torch.cat([b.dense[:, 0] for b in batches[:3]])
    table = pq.read_table(shards_dir / meta.split("train").files[0].path)
    np.testing.assert_array_equal(prices.numpy(), table.column("price").to_numpy()[:90])


def test_multi_hot_batches_are_padded_per_batch(rich_shards: Path) -> None:
    meta = load_dataset_meta(rich_shards)
    with ShardReader(rich_shards, meta, "train", 0, 1, 22, 1) as reader:
        batch = next(reader)
    table = pq.read_table(rich_shards / meta.split("train").files[0].path).slice(0, 22)
    for tensor, name in zip(batch.multi_hot, ["tags", "genres"], strict=True):
        lists = [ids or [] for ids in table.column(name).to_pylist()]
        width = max(len(ids) for ids in lists)
        assert tensor.tolist() == [ids + [-1] * (width - len(ids)) for ids in lists]
    assert (batch.multi_hot[0][3] == -1).all() and (batch.multi_hot[0][5] == -1).all()


def test_a_missing_file_is_named_before_any_thread_starts(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    (shards_dir / "train-00002-of-00004.parquet").unlink()
    with pytest.raises(InputNotFoundError, match="train-00002-of-00004.parquet"):
        ShardReader(shards_dir, meta, "train", 0, 2, 16, 2)
    # Rank 1 reads files 1 and 3 only.
    ShardReader(shards_dir, meta, "train", 1, 2, 16, 2).close()


def test_a_short_file_is_a_schema_error_raised_by_next(shards_dir: Path) -> None:
    meta_path = shards_dir / "dataset.json"
    meta = json.loads(meta_path.read_text())
    meta["splits"]["train"]["files"][2]["rows"] = 300  # the file has 256
    meta_path.write_text(json.dumps(meta))
    loaded = load_dataset_meta(shards_dir)
    with ShardReader(shards_dir, loaded, "train", 0, 1, 64, 4) as reader:
        with pytest.raises(SchemaError, match="train-00002-of-00004.parquet has 256 rows"):
            next(reader)
        with pytest.raises(SchemaError):  # and again: the reader stays failed
            next(reader)


@pytest.mark.parametrize(
    ("world_size", "batch_size", "num_streams", "message"),
    [
        (2, 16, 3, r"train.data_streams=3 must be a positive multiple of train.world_size=2"),
        (2, 15, 4, r"train.data_streams=4 must divide.*change train.batch_size"),
        (1, 2048, 2, r"split 'train' is too small.*lower train.batch_size"),
    ],
)
def test_impossible_layouts_are_config_errors(
    shards_dir: Path, world_size: int, batch_size: int, num_streams: int, message: str
) -> None:
    meta = load_dataset_meta(shards_dir)
    with pytest.raises(ConfigError, match=message):
        ShardReader(shards_dir, meta, "train", 0, world_size, batch_size, num_streams)


def test_unknown_task_is_a_config_error(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    with pytest.raises(ConfigError, match="train.tasks"):
        ShardReader(shards_dir, meta, "train", 0, 1, 16, 1, tasks=["purchase"])


def test_a_position_beyond_the_epoch_is_rejected(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    with ShardReader(shards_dir, meta, "train", 0, 1, 256, 1) as reader:
        with pytest.raises(ConfigError, match="beyond the 4 steps per epoch"):
            reader.restore({"epoch": 0, "step": 4})
        with pytest.raises(ValueError, match="position must be"):
            reader.restore({"step": 1})


def test_a_worker_exception_is_raised_by_the_next_call(
    shards_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0

    def flaky_to_batch(*args: object, **kwargs: object) -> Batch:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("decode failed")
        return to_batch(*args, **kwargs)

    monkeypatch.setattr(training.ctr.reader, "to_batch", flaky_to_batch)
    meta = load_dataset_meta(shards_dir)
    with ShardReader(shards_dir, meta, "train", 0, 1, 16, 1) as reader:
        assert len(take(reader, 2)) == 2
        with pytest.raises(RuntimeError, match="decode failed"):
            next(reader)
        assert reader_threads() == []  # the worker has exited
        assert reader.position() == {"epoch": 0, "step": 2}


def test_close_stops_a_worker_blocked_on_a_full_queue(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    reader = ShardReader(shards_dir, meta, "train", 0, 1, 16, 1, prefetch=2)
    next(reader)
    time.sleep(0.05)  # let the worker fill the queue and block
    assert [t.name for t in reader_threads()] == ["ShardReader-train-rank0"]
    reader.close()
    assert reader_threads() == []
    reader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        next(reader)


def test_a_dropped_reader_stops_its_worker(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    reader = ShardReader(shards_dir, meta, "train", 0, 1, 16, 1, prefetch=1)
    next(reader)
    (thread,) = reader_threads()
    del reader
    gc.collect()
    thread.join(timeout=1)
    assert not thread.is_alive()


def test_measure_throughput_counts_rows_per_second(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)
    with ShardReader(shards_dir, meta, "train", 0, 1, 64, 2) as reader:
        assert measure_throughput(reader, 5) > 0
        assert reader.position() == {"epoch": 0, "step": 6}
