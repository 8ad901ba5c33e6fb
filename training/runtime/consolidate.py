"""Streaming consolidation of a trained model's weights into one safetensors file.

Training leaves the weights in pieces: the row shards of a sharded embedding table
(`sparse-rank-RRRRR-of-WWWWW.safetensors`, rows g = j * W + r of the table in rank r's
file, row j) and DeepSpeed's checkpoint of the dense part (ZeRO 1-3: each rank's flat
fp32 master partitions). Export needs them as one `model.safetensors`. Gathering the
whole table into one process first would need the whole model's memory on rank 0,
however many ranks the table was sharded over; this module never does:

- The file's layout (every tensor's name, shape and byte range) is known before any
  weight is read, so rank 0 writes the header and sizes the file, and then every rank
  writes its share of the table into its byte range: chunk c of `chunk_rows` rows by
  rank c % W. A chunk is read from the W shard files as row slices (no shard is loaded
  whole), interleaved, and rows that frequency admission never admitted are replaced
  by their feature's default row (what training fed the model for them).
- Dense tensors are written by rank 0 one at a time. A ZeRO-3 parameter is streamed
  from the ranks' memory-mapped partitions in chunks (DeepSpeed's lazy `GatheredTensor`)
  without being assembled; ZeRO 0-2 keep every parameter whole on every rank during
  training, so assembling them costs no more than training did.

A rank's peak is two chunks (the rows read and the chunk written), not the model. The
file is written under a temporary name and renamed into place once complete, so a
crash never leaves a `model.safetensors` that looks whole.

Stored types: floating point tensors as fp32 and integer buffers as they are, except the
tensors a caller names in `plan_layout(exact_dtypes=...)`, which keep their dtype
(float16, bfloat16, uint8): a compact embedding table (`train.table_precision`) stays
2 bytes or 1 byte a value in the file, never upcast to 4.

Why by hand: safetensors' Python API writes a file only from tensors held whole in
memory (`save_file`), and has no ranged or concurrent writer. The format is a
little-endian u64 header length, a JSON header ({name: {dtype, shape, data_offsets}},
offsets relative to the end of the header) and the raw bytes; `safetensors.safe_open`
reads what this module writes (the tests read every tensor back with it).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from artifacts.durable import replace_file
from training.runtime.memory import CHUNK_BYTES, FP32_BYTES

_HEADER_ALIGN = 8  # safetensors pads its header so the data starts 8-byte aligned


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a planned safetensors file lies, and in which type.

    Attributes:
        header: The length prefix and the JSON header, padded to 8 bytes.
        spans: Per tensor, its (start, end) byte offsets in the file.
        shapes: Per tensor, its shape.
        dtypes: Per tensor, the numpy dtype its bytes are written in (bfloat16, which
            numpy lacks, as its raw 16 bits, uint16).
        size: Bytes of the whole file.
        exact: Per tensor stored exactly as given (`plan_layout(exact_dtypes=...)`), the
            torch dtype every piece of it must have; the others are converted.
    """

    header: bytes
    spans: dict[str, tuple[int, int]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    size: int
    exact: dict[str, torch.dtype] = field(default_factory=dict)


# Stored types: floating point tensors as fp32; integer buffers (a pipeline model's item
# -> feature index) keep their type, since fp32 holds integers exactly only up to 2**24.
_STORED = {
    torch.int64: ("I64", np.dtype("<i8")),
    torch.int32: ("I32", np.dtype("<i4")),
}


_FP32 = ("F32", np.dtype("<f4"))

# The dtypes a tensor can be stored in exactly (`plan_layout(exact_dtypes=...)`): a
# compact table's rows. bfloat16 bytes are written as the uint16 of its bits.
_EXACT = {
    torch.float32: _FP32,
    torch.float16: ("F16", np.dtype("<f2")),
    torch.bfloat16: ("BF16", np.dtype("<u2")),
    torch.uint8: ("U8", np.dtype("u1")),
}


def plan_layout(
    shapes: Mapping[str, Sequence[int]],
    metadata: dict[str, str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    exact_dtypes: Mapping[str, torch.dtype] | None = None,
) -> Layout:
    """The layout of a file of tensors of these shapes, in this order.

    Args:
        shapes: Tensor name -> shape.
        metadata: Optional string metadata for the header's `__metadata__`.
        dtypes: Tensor name -> the source dtype; int64/int32 are kept, the rest (and
            names not given) stored as fp32 (a bf16 training run's weights included).
        exact_dtypes: Tensor name -> the dtype it is stored in as it is: float32,
            float16, bfloat16 or uint8 (a compact embedding table's rows and codes).
            `write_pieces` refuses a piece of another dtype for these.

    Returns:
        The layout: header bytes and each tensor's byte range.

    Raises:
        ValueError: An exact dtype is none of those four.
    """
    entries: dict[str, Any] = {}
    stored: dict[str, np.dtype] = {}
    exact = dict(exact_dtypes or {})
    for name, dtype in exact.items():
        if dtype not in _EXACT:
            raise ValueError(
                f"tensor {name!r}: exact_dtypes takes {sorted(map(str, _EXACT))}, got {dtype}"
            )
    offset = 0
    for name, shape in shapes.items():
        if name in exact:
            code, dtype = _EXACT[exact[name]]
        else:
            code, dtype = _STORED.get((dtypes or {}).get(name, torch.float32), _FP32)
        nbytes = math.prod(shape) * dtype.itemsize
        entries[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        stored[name] = dtype
        offset += nbytes
    if metadata:
        entries["__metadata__"] = dict(metadata)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
    header = struct.pack("<Q", len(text)) + text
    base = len(header)
    spans = {
        name: (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
        for name, entry in entries.items()
        if name != "__metadata__"
    }
    return Layout(
        header=header,
        spans=spans,
        shapes={name: tuple(shape) for name, shape in shapes.items()},
        dtypes=stored,
        size=base + offset,
        exact={name: dtype for name, dtype in exact.items() if name in shapes},
    )


def partial_path(path: Path) -> Path:
    """Where `path` is written until it is complete."""
    return path.with_name(path.name + ".partial")


def create_file(path: Path, layout: Layout) -> Path:
    """Rank 0, first: write the header into `path`'s partial file, sized to the whole file.

    Returns:
        The partial file, which every rank then writes its byte ranges into.
    """
    partial = partial_path(path)
    with open(partial, "wb") as file:
        file.write(layout.header)
        file.truncate(layout.size)
    return partial


def finish_file(path: Path, layout: Layout) -> None:
    """Rank 0, last (after every rank's writes): check the size, fsync, rename into place.

    Raises:
        RuntimeError: The partial file is not the layout's size (a writer ran past its
            range).
    """
    partial = partial_path(path)
    size = partial.stat().st_size
    if size != layout.size:
        raise RuntimeError(f"{partial} is {size} bytes, its layout says {layout.size}")
    replace_file(partial, path)


def write_pieces(
    file: Any, layout: Layout, name: str, pieces: Iterator[tuple[int, torch.Tensor]]
) -> None:
    """Write (element offset, tensor) pieces of tensor `name` into its byte range, in
    the layout's dtype for it.

    Raises:
        RuntimeError: A piece falls outside the tensor (a layout/shape mismatch), or a
            tensor stored exactly (`Layout.exact`) gets a piece of another dtype (it
            would be converted silently otherwise).
    """
    start, end = layout.spans[name]
    dtype = layout.dtypes[name]
    exact = layout.exact.get(name)
    for element, piece in pieces:
        source = piece.detach()
        if exact is not None and source.dtype != exact:
            raise RuntimeError(
                f"tensor {name!r} is stored as {exact} in this layout but a piece is "
                f"{source.dtype}: the layout was planned for another table precision"
            )
        if exact is None and dtype == _FP32[1]:
            source = source.to(torch.float32)  # bf16 weights are stored fp32
        if source.dtype == torch.bfloat16:  # numpy has no bfloat16: write its 16 bits
            source = source.view(torch.int16)
        if exact is None:
            data = np.ascontiguousarray(source.numpy(), dtype=dtype)
        else:  # the piece's own bytes, seen as the stored type
            data = np.ascontiguousarray(source.numpy()).view(dtype)
        position = start + element * dtype.itemsize
        if element < 0 or position + data.nbytes > end:
            raise RuntimeError(
                f"piece of {data.size} elements at element {element} does not fit tensor "
                f"{name!r} of shape {layout.shapes[name]}"
            )
        file.seek(position)
        file.write(data.data)
        del piece, data  # before the next piece is made: one chunk alive, not two


def tensor_pieces(tensor: Any, chunk_numel: int) -> Iterator[tuple[int, torch.Tensor]]:
    """A dense tensor as flat (element offset, piece) pieces of at most chunk_numel.

    A DeepSpeed ZeRO-3 `GatheredTensor` (lazy mode of `get_fp32_state_dict_from_zero_
    checkpoint`) is read from its ranks' memory-mapped flat partitions, rank after
    rank, without being assembled: parameter p's partition on rank i is elements
    [offset, offset + partitioned_numel) of rank i's flat groups laid end to end, and
    the parameter is the ranks' partitions in rank order, cut to its numel (the last
    one is padded). Anything else is a tensor, flattened.
    """
    groups = getattr(tensor, "flat_groups", None)
    if groups is None:
        flat = (tensor if isinstance(tensor, torch.Tensor) else tensor.contiguous()).reshape(-1)
        for start in range(0, flat.numel(), chunk_numel):
            yield start, flat[start : start + chunk_numel]
        return
    group_offsets = [int(x) for x in tensor.flat_groups_offset]
    remaining = math.prod(tensor.shape)
    written = 0
    begin, end = int(tensor.offset), int(tensor.offset) + int(tensor.partitioned_numel)
    for rank_groups in groups:
        for index, flat in enumerate(rank_groups):
            g0, g1 = group_offsets[index], group_offsets[index + 1]
            lo, hi = max(begin, g0), min(end, g1)
            for start in range(lo, hi, chunk_numel):
                if remaining == 0:
                    return
                piece = flat[start - g0 : min(hi, start + chunk_numel) - g0][:remaining]
                yield written, piece
                written += piece.numel()
                remaining -= piece.numel()
    if remaining:
        raise ValueError(f"ZeRO-3 partitions hold {written} elements of a {tensor.shape} parameter")


def write_dense(file: Any, layout: Layout, tensors: Mapping[str, Any], chunk_numel: int) -> None:
    """Write each dense tensor (a tensor or a ZeRO-3 GatheredTensor) into its range."""
    for name, tensor in tensors.items():
        write_pieces(file, layout, name, tensor_pieces(tensor, chunk_numel))


def chunk_rows_for(dim: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Table rows of `dim` fp32 values in one chunk (at least 1)."""
    return max(1, chunk_bytes // (dim * FP32_BYTES))
