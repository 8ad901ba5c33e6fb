"""Consolidating a CTR checkpoint: the sharded embedding table written in chunks.

The table keeps the precision it trained at (`train.table_precision`): `TABLE_NAME`
holds float32, float16 or bfloat16 rows, or int8's uint8 codes with `SCALE_BIAS_NAME`
beside them ((N, 2) float32 scale and bias, value = code * scale + bias). Nothing is
upcast on the way: a row takes 2D bytes at fp16 and bf16, D + 8 at int8, against 4D
at fp32, in the file and in every package made from it; `CTRModel` holds the rows so
and decodes them after its gather (`training.ctr.model`).

Rows never admitted by frequency admission take their feature's default row (what
training fed the model for them). The default rows are a dense fp32 parameter, so at a
compact precision they are stored rounded to nearest: 2-byte rows by a plain cast, int8
rows quantized on their own grid (`quantize_int8` of the default row: scale = (max -
min) / 255, bias = min), which is how a warm start converts rows too. A never-admitted
id therefore scores with its default row to within that rounding (half a unit in the
last place; half a grid step for int8), while every admitted row is bitwise the trained
one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from training.ctr.embedding import (
    SCALE_BIAS,
    TABLE_DTYPES,
    TablePrecision,
    encode_rows,
    table_offsets,
)
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
# An int8 table's per-row (scale, bias), (N, 2) float32, beside TABLE_NAME's codes.
SCALE_BIAS_NAME = f"embedding.{SCALE_BIAS}"
# safetensors' dtype codes of the shards' "weight", by table precision.
_SHARD_CODES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "U8": "int8"}


@dataclass(frozen=True)
class TableChunk:
    """Consecutive rows of the consolidated table, at the table's precision.

    Attributes:
        first_row: The chunk's first global row.
        weight: (rows, D) rows as stored: float32, float16, bfloat16 or uint8 codes.
        scale_bias: (rows, 2) float32 (scale, bias) of int8 rows, else None.
    """

    first_row: int
    weight: torch.Tensor
    scale_bias: torch.Tensor | None


def table_tensors(
    num_rows: int, embedding_dim: int, precision: TablePrecision
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """The consolidated table's tensors: (name -> shape, name -> stored dtype).

    For `plan_layout(shapes, exact_dtypes=dtypes)`, ahead of the dense tensors; every
    rank computes the same from the train config alone.
    """
    shapes: dict[str, tuple[int, ...]] = {TABLE_NAME: (num_rows, embedding_dim)}
    dtypes = {TABLE_NAME: TABLE_DTYPES[precision]}
    if precision == "int8":
        shapes[SCALE_BIAS_NAME] = (num_rows, 2)
        dtypes[SCALE_BIAS_NAME] = torch.float32
    return shapes, dtypes


def shard_precision(shard_file: Path) -> TablePrecision:
    """The table precision of a row shard file, from its "weight" dtype (header only).

    Raises:
        ValueError: The rows are of no table precision's dtype.
    """
    with safe_open(str(shard_file), framework="pt") as shard:
        code = shard.get_slice("weight").get_dtype()
    if code not in _SHARD_CODES:
        raise ValueError(
            f"{shard_file}: embedding rows of dtype {code} are of no table precision "
            f"(expected one of {sorted(_SHARD_CODES)}); it is no sparse shard of this trainer"
        )
    return _SHARD_CODES[code]  # type: ignore[return-value]


def table_chunks(
    shard_files: Sequence[Path],
    table_sizes: Sequence[int],
    default_rows: torch.Tensor | None,
    admission_min_count: int,
    rank: int,
    world_size: int,
    chunk_rows: int,
) -> Iterator[TableChunk]:
    """Rank `rank`'s chunks of the interleaved embedding table, at the shards' precision.

    Shard s holds global rows s, s + S, s + 2S, ... (S = len(shard_files)), so the
    table's rows [c * k * S, (c + 1) * k * S) are rows [c * k, (c + 1) * k) of every
    shard, with k = chunk_rows // S. Chunk c goes to rank c % world_size. A chunk is
    built at the table's own dtype: no fp32 copy of the rows is ever made.

    Args:
        shard_files: The table's row shards, in shard order.
        table_sizes: Rows of each feature's table (their sum is the table's rows).
        default_rows: (F, D) per-feature default rows, substituted for rows never
            admitted; needed when admission_min_count >= 2. Stored at the table's
            precision, rounded to nearest (see the module docstring).
        admission_min_count: The training run's frequency admission threshold; rows
            whose `counts` are below it (when >= 2) take their feature's default row.
        rank: This writer.
        world_size: Writers sharing the table.
        chunk_rows: Table rows per chunk (rounded down to a multiple of the shards).

    Yields:
        The chunks, in table order: rows as the shards store them (fp32, fp16, bf16, or
        int8 codes with their scale and bias).

    Raises:
        ValueError: The shards do not hold the table's rows, or are of different
            precisions.
    """
    shards = len(shard_files)
    num_rows = sum(table_sizes)
    per_shard = max(1, chunk_rows // shards)  # k: rows taken from every shard per chunk
    local_rows = -(-num_rows // shards)  # rows of shard 0, the longest
    admission = admission_min_count >= 2
    precision = shard_precision(shard_files[0])
    dtype = TABLE_DTYPES[precision]
    int8 = precision == "int8"
    defaults: dict[str, torch.Tensor] = {}
    if admission:
        if default_rows is None:
            raise ValueError("admission_min_count >= 2 needs the default rows to substitute")
        # (F, D) at the table's dtype (and (F, 2) scale/bias for int8), encoded once.
        defaults = encode_rows(default_rows.float(), precision)
    offsets = table_offsets(list(table_sizes))
    for chunk in range(rank, -(-local_rows // per_shard), world_size):
        lo = chunk * per_shard  # local row of every shard
        first = lo * shards  # global row of the chunk's first row
        rows = min(per_shard * shards, num_rows - first)
        block: torch.Tensor | None = None  # (rows, D) at `dtype`
        scale_bias = torch.empty((rows, 2), dtype=torch.float32) if int8 else None
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
                if part.dtype != dtype:
                    raise ValueError(
                        f"{shard_file} holds {part.dtype} rows but {shard_files[0]} holds "
                        f"{dtype} ({precision}): the shards are of one run's final checkpoint"
                    )
                if block is None:
                    block = torch.empty((rows, part.shape[1]), dtype=dtype)
                block[s::shards] = part
                del part
                if scale_bias is not None:
                    scale_bias[s::shards] = shard.get_slice(SCALE_BIAS)[lo:hi]
                if rejected is not None:
                    rejected[s::shards] = shard.get_slice("counts")[lo:hi] < admission_min_count
        assert block is not None  # shard 0 has a row in every chunk
        if rejected is not None:
            # Feature by feature over the ones the chunk spans: filling with one (D,) row
            # needs no gathered copy of the rejected rows.
            last = int(torch.searchsorted(offsets[1:], first + rows - 1, right=True))
            for feature in range(int(torch.searchsorted(offsets[1:], first, right=True)), last + 1):
                a = max(int(offsets[feature]) - first, 0)
                b = min(int(offsets[feature + 1]) - first, rows)
                block[a:b][rejected[a:b]] = defaults["weight"][feature]
                if scale_bias is not None:
                    scale_bias[a:b][rejected[a:b]] = defaults[SCALE_BIAS][feature]
        yield TableChunk(first, block, scale_bias)
        del block, scale_bias


def write_table(file: Any, layout: Layout, chunks: Iterator[TableChunk]) -> None:
    """Write table chunks into their byte ranges: the rows, and an int8 table's scale/bias.

    Raises:
        RuntimeError: A chunk falls outside the table, or is of another dtype than the
            layout stores the table in (`write_pieces`).
    """
    for chunk in chunks:
        dim = chunk.weight.shape[1]
        write_pieces(file, layout, TABLE_NAME, iter([(chunk.first_row * dim, chunk.weight)]))
        if chunk.scale_bias is not None:
            pieces = iter([(chunk.first_row * 2, chunk.scale_bias)])
            write_pieces(file, layout, SCALE_BIAS_NAME, pieces)


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
    `shard_files` the table is written as TABLE_NAME (and SCALE_BIAS_NAME for int8)
    first, at the shards' precision. For tests, benchmarks and offline use on a finished
    checkpoint.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    exact: dict[str, torch.dtype] = {}
    dim = 0
    if shard_files is not None:
        with safe_open(str(shard_files[0]), framework="pt") as shard:
            dim = shard.get_slice("weight").get_shape()[1]
        shapes, exact = table_tensors(sum(table_sizes), dim, shard_precision(shard_files[0]))
    shapes.update({name: tuple(tensor.shape) for name, tensor in dense.items()})
    layout = plan_layout(shapes, exact_dtypes=exact)
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
            write_table(file, layout, chunks)
        write_dense(file, layout, dense, chunk_numel)
    if before_finish is not None:
        before_finish()
    finish_file(path, layout)
    return layout
