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

from training.ctr.consolidate import (
    SCALE_BIAS_NAME,
    TABLE_NAME,
    consolidate_in_process,
    table_chunks,
    table_tensors,
    write_table,
)
from training.ctr.embedding import (
    SCALE_BIAS,
    TABLE_DTYPES,
    decode_rows,
    encode_rows,
    quantize_int8,
    table_offsets,
)
from training.runtime.consolidate import (
    create_file,
    finish_file,
    partial_path,
    plan_layout,
    tensor_pieces,
    write_pieces,
)


def write_shards(
    tmp_path: Path,
    table: torch.Tensor,
    counts: torch.Tensor,
    shards: int,
    scale_bias: torch.Tensor | None = None,
) -> list[Path]:
    """Row shards as training writes them: rank r holds rows r, r + S, ..."""
    files = []
    for s in range(shards):
        path = tmp_path / f"sparse-rank-{s:05d}-of-{shards:05d}.safetensors"
        state = {"weight": table[s::shards].contiguous(), "counts": counts[s::shards].contiguous()}
        if scale_bias is not None:  # int8 rows
            state[SCALE_BIAS] = scale_bias[s::shards].contiguous()
        save_file(state, str(path))
        files.append(path)
    return files


def reference_table(
    table: dict[str, torch.Tensor],
    counts: torch.Tensor,
    defaults: torch.Tensor,
    sizes: list[int],
    min_count: int,
    precision: str = "fp32",
) -> dict[str, torch.Tensor]:
    """What the whole-table-in-memory consolidation gives: the stored rows, rejected ones
    replaced by their feature's default row encoded at the table's precision."""
    expected = {name: tensor.clone() for name, tensor in table.items()}
    if min_count >= 2:
        rejected = counts < min_count
        feature = torch.searchsorted(
            table_offsets(sizes)[1:], torch.nonzero(rejected)[:, 0], right=True
        )
        encoded = encode_rows(defaults, precision)  # type: ignore[arg-type]
        for name, tensor in encoded.items():
            expected[name][rejected] = tensor[feature]
    return expected


def random_rows(
    rows: int, dim: int, precision: str, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Rows as a shard of that precision stores them: {"weight"[, SCALE_BIAS]}."""
    values = torch.randn(rows, dim, generator=generator)
    if precision == "int8":  # codes that use the whole grid, and their rows' grids
        codes = torch.randint(0, 256, (rows, dim), generator=generator, dtype=torch.uint8)
        return {"weight": codes, SCALE_BIAS: quantize_int8(values)[1]}
    return {"weight": values.to(TABLE_DTYPES[precision])}


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
    ("shards", "writers", "chunk_rows", "min_count", "precision"),
    [
        (1, 1, 1_000, 0, "fp32"),  # one chunk
        (2, 2, 4, 3, "fp32"),  # ranks share the chunks, admission
        (3, 2, 6, 2, "fp32"),  # more shards than writers, rows not a multiple
        (3, 5, 3, 0, "fp32"),  # more writers than chunks: some write nothing
        (4, 1, 5, 4, "fp32"),  # chunk rows rounded down to whole rows per shard
        # Compact shards (train.table_precision): the table keeps their dtype.
        (2, 2, 4, 3, "bf16"),
        (3, 1, 6, 0, "fp16"),
        (2, 2, 4, 3, "fp16"),
        (3, 2, 6, 2, "int8"),  # codes and their scale/bias interleaved alike
        (1, 1, 1_000, 0, "int8"),
    ],
)
def test_the_table_is_interleaved_from_the_shards_in_chunks(
    tmp_path: Path, shards: int, writers: int, chunk_rows: int, min_count: int, precision: str
) -> None:
    sizes = [7, 5, 11]
    generator = torch.Generator().manual_seed(shards * 10 + writers)
    table = random_rows(sum(sizes), 4, precision, generator)  # (23, 4) as stored
    counts = torch.randint(0, 6, (sum(sizes),), generator=generator, dtype=torch.int32)
    defaults = torch.randn(len(sizes), 4, generator=generator)
    files = write_shards(tmp_path, table["weight"], counts, shards, table.get(SCALE_BIAS))

    out = tmp_path / "model.safetensors"
    shapes, dtypes = table_tensors(sum(sizes), 4, precision)  # type: ignore[arg-type]
    layout = plan_layout({**shapes, "arch.default_rows": (3, 4)}, exact_dtypes=dtypes)
    create_file(out, layout)
    written = 0
    with open(partial_path(out), "r+b") as file:
        for writer in range(writers):  # the ranks, one after another
            chunks = list(
                table_chunks(files, sizes, defaults, min_count, writer, writers, chunk_rows)
            )
            written += sum(chunk.weight.shape[0] for chunk in chunks)
            assert all(chunk.weight.numel() <= max(chunk_rows, shards) * 4 for chunk in chunks)
            # Built at the table's dtype: no fp32 copy of the rows.
            assert all(chunk.weight.dtype == TABLE_DTYPES[precision] for chunk in chunks)
            write_table(file, layout, iter(chunks))
        write_pieces(file, layout, "arch.default_rows", iter([(0, defaults)]))
    assert written == sum(sizes)  # every row once
    assert not out.exists()  # nothing at the final name before the finish
    finish_file(out, layout)

    loaded = load_file(str(out))
    expected = reference_table(table, counts, defaults, sizes, min_count, precision)
    assert loaded[TABLE_NAME].dtype == TABLE_DTYPES[precision]
    assert torch.equal(loaded[TABLE_NAME], expected["weight"])
    assert (SCALE_BIAS_NAME in loaded) == (precision == "int8")
    if precision == "int8":
        assert loaded[SCALE_BIAS_NAME].dtype == torch.float32
        assert torch.equal(loaded[SCALE_BIAS_NAME], expected[SCALE_BIAS])
    if min_count >= 2:
        assert not torch.equal(expected["weight"], table["weight"])  # the case substitutes rows
        # A rejected row decodes to its default row, to within the precision's rounding
        # to nearest: half a unit in the last place, half an int8 grid step.
        rejected = int(torch.nonzero(counts < min_count)[0, 0])
        feature = int(torch.searchsorted(table_offsets(sizes)[1:], rejected, right=True))
        row = slice(rejected, rejected + 1)
        scale_bias = loaded[SCALE_BIAS_NAME][row] if precision == "int8" else None
        decoded = decode_rows(loaded[TABLE_NAME][row], scale_bias)[0]
        relative = {"fp32": 0.0, "fp16": 2**-11, "bf16": 2**-8, "int8": 1 / 255}[precision]
        tolerance = relative * float(defaults[feature].abs().max()) + 1e-6
        assert (decoded - defaults[feature]).abs().max() <= tolerance


def test_the_table_bytes_follow_the_precision(tmp_path: Path) -> None:
    """model.safetensors of a 2-byte table is about half an fp32 one's; int8's holds D + 8
    bytes a row (codes, then the fp32 scale and bias)."""
    sizes, dim = [300, 200], 16
    generator = torch.Generator().manual_seed(0)
    counts = torch.ones(sum(sizes), dtype=torch.int32)
    size, table_bytes = {}, {}
    for precision in ("fp32", "fp16", "bf16", "int8"):
        table = random_rows(sum(sizes), dim, precision, generator)
        directory = tmp_path / precision
        directory.mkdir()
        files = write_shards(directory, table["weight"], counts, 2, table.get(SCALE_BIAS))
        out = directory / "model.safetensors"
        dense = {"arch.default_rows": torch.zeros(2, dim)}
        layout = consolidate_in_process(out, dense, files, sizes, 0)
        size[precision] = out.stat().st_size
        spans = layout.spans  # the table's tensors' byte ranges in the file
        table_bytes[precision] = sum(
            end - start for name, (start, end) in spans.items() if name.startswith("embedding.")
        )
        loaded = load_file(str(out))
        assert loaded[TABLE_NAME].dtype == TABLE_DTYPES[precision]
        assert torch.equal(loaded[TABLE_NAME], table["weight"])
    rows = sum(sizes)
    assert table_bytes == {
        "fp32": rows * dim * 4,
        "fp16": rows * dim * 2,
        "bf16": rows * dim * 2,
        "int8": rows * (dim + 8),
    }
    assert size["fp16"] < 0.52 * size["fp32"] and size["int8"] < 0.40 * size["fp32"]


def test_a_piece_of_another_dtype_is_refused_for_an_exact_tensor(tmp_path: Path) -> None:
    shapes, dtypes = table_tensors(4, 2, "fp16")
    layout = plan_layout(shapes, exact_dtypes=dtypes)
    partial = create_file(tmp_path / "m.safetensors", layout)
    with open(partial, "r+b") as file, pytest.raises(RuntimeError, match="another table precision"):
        write_pieces(file, layout, TABLE_NAME, iter([(0, torch.ones(4, 2))]))  # fp32 rows


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
