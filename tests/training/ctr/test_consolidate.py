"""Streaming consolidation: the file safetensors reads, the interleaved table, ZeRO-3 pieces."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import GatheredTensor
from safetensors.torch import load_file, save_file

from training.ctr.consolidate import TABLE_NAME, consolidate_in_process, table_chunks
from training.ctr.embedding import table_offsets
from training.runtime.consolidate import (
    create_file,
    finish_file,
    partial_path,
    plan_layout,
    tensor_pieces,
    write_pieces,
)


def write_shards(
    tmp_path: Path, table: torch.Tensor, counts: torch.Tensor, shards: int
) -> list[Path]:
    """Row shards as training writes them: rank r holds rows r, r + S, ..."""
    files = []
    for s in range(shards):
        path = tmp_path / f"sparse-rank-{s:05d}-of-{shards:05d}.safetensors"
        save_file(
            {"weight": table[s::shards].contiguous(), "counts": counts[s::shards].contiguous()},
            str(path),
        )
        files.append(path)
    return files


def reference_table(
    table: torch.Tensor,
    counts: torch.Tensor,
    defaults: torch.Tensor,
    sizes: list[int],
    min_count: int,
) -> torch.Tensor:
    """What the whole-table-in-memory consolidation gave: rejected rows take their default."""
    expected = table.clone()
    if min_count >= 2:
        rejected = counts < min_count
        feature = torch.searchsorted(
            table_offsets(sizes)[1:], torch.nonzero(rejected)[:, 0], right=True
        )
        expected[rejected] = defaults[feature]
    return expected


def test_the_file_is_what_safetensors_writes(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    state = {
        "b.weight": torch.randn(3, 5, generator=generator),
        "a.bias": torch.randn(7, generator=generator),
        "scalar": torch.tensor(2.5),
    }
    ours = tmp_path / "ours.safetensors"
    layout = consolidate_in_process(ours, state, None, [], 0, chunk_bytes=8)  # 2 per piece
    loaded = load_file(str(ours))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor)
    assert ours.stat().st_size == layout.size
    assert not partial_path(ours).exists()
    # The header starts the data 8-byte aligned, as safetensors' own writer does.
    (length,) = struct.unpack("<Q", ours.read_bytes()[:8])
    assert (8 + length) % 8 == 0
    assert set(json.loads(ours.read_bytes()[8 : 8 + length])) == set(state)


@pytest.mark.parametrize(
    ("shards", "writers", "chunk_rows", "min_count", "dtype"),
    [
        (1, 1, 1_000, 0, torch.float32),  # one chunk
        (2, 2, 4, 3, torch.float32),  # ranks share the chunks, admission
        (3, 2, 6, 2, torch.float32),  # more shards than writers, rows not a multiple
        (3, 5, 3, 0, torch.float32),  # more writers than chunks: some write nothing
        (4, 1, 5, 4, torch.float32),  # chunk rows rounded down to whole rows per shard
        # 2-byte shards (train.table_precision): the table is written upcast, exactly.
        (2, 2, 4, 3, torch.bfloat16),
        (3, 1, 6, 0, torch.float16),
    ],
)
def test_the_table_is_interleaved_from_the_shards_in_chunks(
    tmp_path: Path, shards: int, writers: int, chunk_rows: int, min_count: int, dtype: torch.dtype
) -> None:
    sizes = [7, 5, 11]
    generator = torch.Generator().manual_seed(shards * 10 + writers)
    table = torch.randn(sum(sizes), 4, generator=generator).to(dtype)  # (23, 4)
    counts = torch.randint(0, 6, (sum(sizes),), generator=generator, dtype=torch.int32)
    defaults = torch.randn(len(sizes), 4, generator=generator)
    files = write_shards(tmp_path, table, counts, shards)
    table = table.float()  # every 2-byte value is exact in fp32

    out = tmp_path / "model.safetensors"
    layout = plan_layout({TABLE_NAME: (sum(sizes), 4), "arch.default_rows": (3, 4)})
    create_file(out, layout)
    written = 0
    with open(partial_path(out), "r+b") as file:
        for writer in range(writers):  # the ranks, one after another
            chunks = list(
                table_chunks(files, sizes, defaults, min_count, writer, writers, chunk_rows)
            )
            written += sum(block.shape[0] for _, block in chunks)
            assert all(block.numel() <= max(chunk_rows, shards) * 4 for _, block in chunks)
            write_pieces(file, layout, TABLE_NAME, iter(chunks))
        write_pieces(file, layout, "arch.default_rows", iter([(0, defaults)]))
    assert written == sum(sizes)  # every row once
    assert not out.exists()  # nothing at the final name before the finish
    finish_file(out, layout)

    loaded = load_file(str(out))
    expected = reference_table(table, counts, defaults, sizes, min_count)
    assert loaded[TABLE_NAME].dtype == torch.float32
    assert torch.equal(loaded[TABLE_NAME], expected)
    if min_count >= 2:
        assert not torch.equal(expected, table)  # the case substitutes rows


def test_a_shard_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    table = torch.randn(10, 2)
    files = write_shards(tmp_path, table, torch.zeros(10, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="holds 5 rows; shard 0 of 2 of a 12-row table holds 6"):
        list(table_chunks(files, [12], None, 0, 0, 1, 100))


def test_zero3_parameters_are_streamed_without_being_assembled() -> None:
    # Two ranks, two flat groups of 6 and 4 elements each; parameter a (3, 5) has 8
    # elements per partition, crossing rank 0's group boundary, b (4,) has 2.
    world = 2
    a, b = torch.arange(15.0).reshape(3, 5), 100 + torch.arange(4.0)
    partitions = []
    for rank in range(world):
        a_part = torch.cat([a.reshape(-1), torch.zeros(1)])[rank * 8 : rank * 8 + 8]
        flat = torch.cat([a_part, b[rank * 2 : rank * 2 + 2]])  # (10,)
        partitions.append([flat[:6].clone(), flat[6:].clone()])
    group_offsets = [0, 6, 10]
    lazy_a = GatheredTensor(partitions, group_offsets, 0, 8, a.shape)
    lazy_b = GatheredTensor(partitions, group_offsets, 8, 2, b.shape)
    for lazy, expected in ((lazy_a, a), (lazy_b, b)):
        assert torch.equal(lazy.contiguous(), expected)  # DeepSpeed's own assembly
        for chunk in (1, 3, 100):
            pieces = list(tensor_pieces(lazy, chunk))
            assert all(piece.numel() <= chunk for _, piece in pieces)
            offsets = [offset for offset, _ in pieces]
            flat = torch.cat([piece for _, piece in pieces])
            assert offsets == sorted(offsets) and offsets[0] == 0
            assert torch.equal(flat, expected.reshape(-1))


def test_a_crash_before_the_finish_leaves_no_weights_file(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"

    def crash() -> None:
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        consolidate_in_process(out, {"w": torch.ones(3)}, None, [], 0, before_finish=crash)
    assert not out.exists()
    assert partial_path(out).exists()  # the partial file never has the final name


def test_a_piece_outside_its_tensor_is_refused(tmp_path: Path) -> None:
    layout = plan_layout({"w": (4,)})
    partial = create_file(tmp_path / "m.safetensors", layout)
    with open(partial, "r+b") as file, pytest.raises(RuntimeError, match="does not fit tensor 'w'"):
        write_pieces(file, layout, "w", iter([(2, torch.ones(3))]))


def test_the_benchmark_runs_and_both_ways_agree() -> None:
    bench = Path(__file__).resolve().parents[3] / "bench" / "consolidate.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--rows", "30001", "--dim", "8", "--shards", "3"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["same_tensors"] is True
    assert figures["table_mb"] == round(30001 * 8 * 4 / 2**20, 1)
    assert figures["in_memory_peak_rss_mb"] > 0 and figures["streamed_peak_rss_mb"] > 0
