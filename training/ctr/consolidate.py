"""Consolidating a CTR checkpoint: the sharded embedding table written in chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from training.ctr.embedding import SCALE_BIAS, decode_rows, table_offsets
from training.runtime.consolidate import (
    Layout,
    chunk_rows_for,
    create_file,
    finish_file,
    plan_layout,
    write_dense,
    write_pieces,
)
from training.runtime.memory import CHUNK_BYTES, FP32_BYTES

TABLE_NAME = "embedding.weight"  # the consolidated table's name in CTRModel's state


def table_chunks(
    shard_files: Sequence[Path],
    table_sizes: Sequence[int],
    default_rows: torch.Tensor | None,
    admission_min_count: int,
    rank: int,
    world_size: int,
    chunk_rows: int,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Rank `rank`'s chunks of the interleaved embedding table, as (element offset, rows).

    Shard s holds global rows s, s + S, s + 2S, ... (S = len(shard_files)), so the
    table's rows [c * k * S, (c + 1) * k * S) are rows [c * k, (c + 1) * k) of every
    shard, with k = chunk_rows // S. Chunk c goes to rank c % world_size.

    Args:
        shard_files: The table's row shards, in shard order.
        table_sizes: Rows of each feature's table (their sum is the table's rows).
        default_rows: (F, D) per-feature default rows, substituted for rows never
            admitted; needed when admission_min_count >= 2.
        admission_min_count: The training run's frequency admission threshold; rows
            whose `counts` are below it (when >= 2) take their feature's default row.
        rank: This writer.
        world_size: Writers sharing the table.
        chunk_rows: Table rows per chunk (rounded down to a multiple of the shards).

    Yields:
        (first element of the chunk in the table, (rows, D) fp32 rows): 2-byte and int8
        shards (train.table_precision) upcast or decoded, which is exact.

    Raises:
        ValueError: The shards do not hold the table's rows.
    """
    shards = len(shard_files)
    num_rows = sum(table_sizes)
    per_shard = max(1, chunk_rows // shards)  # k: rows taken from every shard per chunk
    local_rows = -(-num_rows // shards)  # rows of shard 0, the longest
    admission = admission_min_count >= 2
    if admission and default_rows is None:
        raise ValueError("admission_min_count >= 2 needs the default rows to substitute")
    offsets = table_offsets(list(table_sizes))
    dim: int | None = None
    for chunk in range(rank, -(-local_rows // per_shard), world_size):
        lo = chunk * per_shard  # local row of every shard
        first = lo * shards  # global row of the chunk's first row
        rows = min(per_shard * shards, num_rows - first)
        block: torch.Tensor | None = None
        rejected = torch.zeros(rows, dtype=torch.bool) if admission else None
        for s, shard_file in enumerate(shard_files):
            have = -(-(num_rows - s) // shards)  # rows of shard s
            hi = min(lo + per_shard, have)
            if hi <= lo:
                continue
            with safe_open(str(shard_file), framework="pt") as shard:
                weight = shard.get_slice("weight")
                if weight.get_shape()[0] != have:
                    raise ValueError(
                        f"{shard_file} holds {weight.get_shape()[0]} rows; shard {s} of "
                        f"{shards} of a {num_rows}-row table holds {have}"
                    )
                part = weight[lo:hi]  # (hi - lo, D)
                if SCALE_BIAS in shard.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    part = decode_rows(part, shard.get_slice(SCALE_BIAS)[lo:hi])
                if block is None:
                    dim = part.shape[1]
                    block = torch.empty((rows, dim), dtype=torch.float32)
                block[s::shards] = part
                del part
                if rejected is not None:
                    rejected[s::shards] = shard.get_slice("counts")[lo:hi] < admission_min_count
        assert block is not None  # shard 0 has a row in every chunk
        if rejected is not None and default_rows is not None:
            # Feature by feature over the ones the chunk spans: filling with one (D,) row
            # needs no gathered copy of the rejected rows.
            last = int(torch.searchsorted(offsets[1:], first + rows - 1, right=True))
            for feature in range(int(torch.searchsorted(offsets[1:], first, right=True)), last + 1):
                a = max(int(offsets[feature]) - first, 0)
                b = min(int(offsets[feature + 1]) - first, rows)
                block[a:b][rejected[a:b]] = default_rows[feature].float()
        yield first * dim, block  # type: ignore[operator]
        del block


def consolidate_in_process(
    path: Path,
    dense: Mapping[str, Any],
    shard_files: Sequence[Path] | None,
    table_sizes: Sequence[int],
    admission_min_count: int,
    default_rows_name: str = "arch.default_rows",
    chunk_bytes: int = CHUNK_BYTES,
    before_finish: Callable[[], None] | None = None,
) -> Layout:
    """The whole consolidation by one writer (world size 1): what the ranks do together.

    `dense` maps names to tensors (or GatheredTensors) with their final names; with
    `shard_files` the table is written as TABLE_NAME first. For tests, benchmarks and
    offline use on a finished checkpoint.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    dim = 0
    if shard_files is not None:
        with safe_open(str(shard_files[0]), framework="pt") as shard:
            dim = shard.get_slice("weight").get_shape()[1]
        shapes[TABLE_NAME] = (sum(table_sizes), dim)
    shapes.update({name: tuple(tensor.shape) for name, tensor in dense.items()})
    layout = plan_layout(shapes)
    partial = create_file(path, layout)
    chunk_numel = max(1, chunk_bytes // FP32_BYTES)
    with open(partial, "r+b") as file:
        if shard_files is not None:
            default_rows = dense.get(default_rows_name)
            if default_rows is not None and not isinstance(default_rows, torch.Tensor):
                default_rows = default_rows.contiguous()
            chunks = table_chunks(
                shard_files,
                table_sizes,
                default_rows,
                admission_min_count,
                0,
                1,
                chunk_rows_for(dim, chunk_bytes),
            )
            write_pieces(file, layout, TABLE_NAME, chunks)
        write_dense(file, layout, dense, chunk_numel)
    if before_finish is not None:
        before_finish()
    finish_file(path, layout)
    return layout
