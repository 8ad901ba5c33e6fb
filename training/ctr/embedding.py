"""Sharded embedding store: the parameter-server role inside PyTorch.

All sparse features share one fused table of N = sum(table_sizes) rows; feature f's
id i is global row `offsets[f] + i`. Rows are sharded row-wise over the W ranks:
global row g lives on rank `g % W` at local index `g // W`. Ids are vocabulary ranks
or hash buckets, so the modulo spreads hot rows evenly over the ranks.

One training step, seen from one rank (U = unique ids of this rank's batch):

1. `lookup`: the batch's global ids are deduplicated, sent to their owners with one
   all-to-all (`all_to_all_single` with uneven splits, gloo on CPU, NCCL on GPU), the
   owners gather the rows (and count the ids for frequency admission) and send them
   back with a second all-to-all. The caller gets a (U, D) leaf tensor that requires
   grad, so autograd of the dense model fills its `.grad`.
2. `accumulate_gradients`: the (U, D) gradient travels back to the owners, which sum
   the contributions of all ranks per row.
3. `step`: each owner applies the row-wise sparse optimizer to the rows it received
   gradients for. Nothing else is touched, so a step costs O(ids in the batch), not
   O(N): the table size only costs memory.

Gradient scale: every rank's loss is the mean over its own micro batch, and DeepSpeed
averages the dense gradients over ranks; the owners divide the summed row gradients
by W for the same global-mean semantics, so W ranks with batch b follow the same
trajectory as 1 rank with batch W*b.

Initial values depend only on (seed, global row), never on W (each rank draws the
same fixed-size chunks of the table and keeps its rows), so a table can be resharded
and runs with different world sizes start from the same weights.

Gradient clipping (`max_grad_norm` c > 0, the config's `train.grad_clip`): at `step`,
each row's gradient (summed over ranks and micro steps, divided as above) is scaled to
L2 norm c when it is longer, before the weight decay term and the optimizer; see
`clip_row_norms` for why row-wise and not FBGEMM's element-wise clamp.

Frequency admission (`admission_min_count` K >= 2): owners count every occurrence of
their rows; an id seen fewer than K times (this batch included) is reported as not
admitted, the caller substitutes its feature's shared default row (a dense
parameter), and its row gets no update.

Table precision (`table_precision`: fp32, fp16, bf16 or int8): the rows may be stored
in 2 bytes, or in 8-bit codes with a per-row fp32 scale and bias (`quantize_int8`); the
optimizer state stays fp32. The owner upcasts the rows it serves, so the
exchange, the model and the gradients are fp32. Each update is computed in fp32 and
rounded back to the table's precision stochastically (`stochastic_round`: up with the
probability of the discarded fraction, so updates far below one unit in the last place
still move a row on average, where rounding to nearest would drop them). Its random bits
are a function of (seed, step, global row, column) only (`rounding_bits`): a run is
reproducible, a resume is bitwise, and the world size does not change the result.
One-off conversions (init, a warm start from a parent of another precision) round to
nearest; a 2-byte value is exact in fp32, so upcasting never rounds. An int8 row keeps
its grid (scale and bias) while its updated values stay inside it, so an update moves
each value by a stochastically rounded number of steps and an untouched value keeps its
code; a value leaving the grid re-grids that row on its new minimum and maximum.

What travels (`comm_precision`: fp32, bf16 or fp16; issue 40's communication wall). Ids
go to their owner as its local row (`global // W`) in the narrowest integer type that
holds every local row (and the admission counts): int16 or int32 where int64 was sent.
The rows sent forward and the row gradients sent back are cast to `comm_precision`,
rounded to nearest. fp16 gradients carry a per-row power-of-two scale (`encode_grads`),
so that a row's largest value lands in [2^14, 2^15) and small gradients survive; bf16
has fp32's range and needs none. Owners decode to fp32, then sum and update in fp32, so
the table's precision is independent of the wire's. Only an exchange rounds: with one
rank nothing is sent and nothing is rounded. Every rank counts the bytes it sends to
the others, by kind (`wire_bytes`: ids, rows, row_grads).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from training.ctr.kernels import rounding_kernel, subtract_rows

CommPrecision = Literal["fp32", "bf16", "fp16"]
# A differential checkpoint's tensor of the global rows it holds (`take_delta`).
DELTA_ROWS = "global_rows"
# The rows and row gradients on the wire, by train.comm_precision.
COMM_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# What each rank counts it sends to the others (bytes): ids (with the split counts and
# admission counts), rows forward, row gradients back.
WIRE_KINDS = ("ids", "rows", "row_grads")
# fp16 gradients: a row's largest magnitude is scaled into [2^14, 2^15), below fp16's
# largest finite value (65504) with a margin for rounding up.
_FP16_TOP_EXPONENT = 15

# Rows drawn per RNG chunk at init; fixed so init does not depend on the world size.
INIT_CHUNK_ROWS = 1 << 16
ADAGRAD_EPS = 1e-8
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

SparseOptimizer = Literal["rowwise_adagrad", "lazy_adam"]
TablePrecision = Literal["fp32", "fp16", "bf16", "int8"]
# How each precision stores a row's values; int8 rows also keep SCALE_BIAS.
TABLE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.uint8,
}
_PRECISION_NAMES = {dtype: name for name, dtype in TABLE_DTYPES.items()}
# The int8 rows' per-row (scale, bias), fp32 (R, 2): value = code * scale + bias, as in
# FBGEMM's row-wise 8-bit format (codes 0..255, bias the row's minimum).
SCALE_BIAS = "scale_bias"
INT8_LEVELS = 255

# SplitMix64 (Steele et al., 2014) constants: the golden-ratio increment and the two
# multipliers of its finaliser. Counter-based: any (key, counter) maps to 64 bits
# without a generator's state, which is what makes the rounding bits a pure function
# of (seed, step, row, column).
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Keeps the rounding bits apart from other uses of the same seed.
_ROUNDING_DOMAIN = 0x5352


def table_offsets(table_sizes: list[int]) -> torch.Tensor:
    """(F + 1,) int64 start row of each feature in the fused table, then N."""
    sizes = torch.tensor([0, *table_sizes], dtype=torch.int64)
    return torch.cumsum(sizes, dim=0)


def init_rows(
    table_sizes: list[int],
    embedding_dim: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Initial values of the rows one rank owns, the same for any world size.

    Row g of feature f is drawn from U(-1/sqrt(n_f), 1/sqrt(n_f)) (the DLRM reference
    init; N(0, 1) would swamp the MLPs). The table is drawn in fixed chunks of
    `INIT_CHUNK_ROWS` rows, chunk c by its own generator seeded with (seed, c), so a
    row's value depends on neither the world size nor the other chunks, and a rank
    skips the chunks it owns no row of. numpy's SFC64 draws them, with the scaling in
    place: a 20M-row table in ~2.2 s instead of torch's generator's ~4.2 s here.

    Args:
        table_sizes: Rows per feature.
        embedding_dim: D.
        seed: Seed of the table (any int).
        rank: The owning rank.
        world_size: W; the rank owns rows rank, rank + W, ...
        dtype: float32, or a 2-byte table's float16 / bfloat16: each chunk is computed
            in fp32 and rounded to nearest, bitwise `init_rows(...).to(dtype)` without
            ever holding the fp32 table.

    Returns:
        (ceil((N - rank) / W), D) `dtype`: the rank's rows in local order.
    """
    local = torch.empty(
        (_local_rows(sum(table_sizes), rank, world_size), embedding_dim), dtype=dtype
    )
    out = local.numpy() if dtype == torch.float32 else None
    for span, values in _init_chunks(
        table_sizes, embedding_dim, seed, rank, world_size, None if out is None else out
    ):
        if out is None:
            local[span] = torch.from_numpy(values)  # rounded to nearest
    return local


def init_table(
    table_sizes: list[int],
    embedding_dim: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    precision: TablePrecision = "fp32",
) -> dict[str, torch.Tensor]:
    """`init_rows` stored at `precision`: {"weight"} and, for int8, {SCALE_BIAS}.

    int8 rows are quantized chunk by chunk (`quantize_int8`, to nearest), bitwise
    `quantize_int8(init_rows(...))` without ever holding the fp32 table.
    """
    if precision != "int8":
        return {
            "weight": init_rows(
                table_sizes, embedding_dim, seed, rank, world_size, TABLE_DTYPES[precision]
            )
        }
    rows = _local_rows(sum(table_sizes), rank, world_size)
    codes = torch.empty((rows, embedding_dim), dtype=torch.uint8)
    scale_bias = torch.empty((rows, 2), dtype=torch.float32)
    for span, values in _init_chunks(table_sizes, embedding_dim, seed, rank, world_size):
        codes[span], scale_bias[span] = quantize_int8(torch.from_numpy(values))
    return {"weight": codes, SCALE_BIAS: scale_bias}


def _init_chunks(
    table_sizes: list[int],
    embedding_dim: int,
    seed: int,
    rank: int,
    world_size: int,
    out: np.ndarray | None = None,
) -> Iterator[tuple[slice, np.ndarray]]:
    """`init_rows`' chunks: (local rows, fp32 values), written into `out` when given."""
    offsets = table_offsets(table_sizes)
    num_rows = int(offsets[-1])
    feature_bound = np.array([1.0 / n**0.5 for n in table_sizes], dtype=np.float32)
    ends = offsets[1:].numpy()
    entropy = seed % 2**64  # SeedSequence takes non-negative ints
    for chunk, start in enumerate(range(0, num_rows, INIT_CHUNK_ROWS)):
        end = min(start + INIT_CHUNK_ROWS, num_rows)
        first = start + (rank - start) % world_size  # first row >= start owned by rank
        if first >= end:
            continue
        generator = np.random.Generator(np.random.SFC64(np.random.SeedSequence([entropy, chunk])))
        drawn = generator.random((end - start, embedding_dim), dtype=np.float32)
        owned = np.arange(first, end, world_size)  # global rows
        span = slice((first - rank) // world_size, (end - 1 - rank) // world_size + 1)
        target = out[span] if out is not None else np.empty((len(owned), embedding_dim), np.float32)
        np.multiply(drawn[first - start :: world_size], 2, out=target)
        target -= 1
        target *= feature_bound[np.searchsorted(ends, owned, side="right")][:, None]
        yield span, target


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wraps modulo 2**64, as intended)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def rounding_bits(seed: int, step: int, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """The random bits that round the update of global rows `rows` at optimizer `step`.

    A pure function of (seed, step, global row, column): a row's bits depend on neither
    the other rows of the call, nor the rank that owns it, nor the world size. One
    SplitMix64 hash per (row, 4 columns) gives four 16-bit draws; numpy's uint64 arrays
    wrap on overflow (torch's int64 would be undefined), and the little-endian view
    gives the same bits on any host.

    Args:
        seed: The run's seed.
        step: The optimizer step (`ShardedEmbedding.steps`, global and restored on resume).
        rows: (R,) int64 global rows.
        dim: D, the columns.

    Returns:
        (R, D) int32 in [0, 2**16).
    """
    key = np.array([seed % 2**64, _ROUNDING_DOMAIN, step % 2**64], dtype=np.uint64)
    stream = _mix64(_mix64(key[:1] ^ key[1:2]) + key[2:] * _GAMMA)  # (1,)
    row_key = _mix64(rows.numpy().astype(np.uint64) * _GAMMA + stream)  # (R,)
    words = -(-dim // 4)
    counters = np.arange(1, words + 1, dtype=np.uint64) * _GAMMA
    z = _mix64(row_key[:, None] + counters)  # (R, words)
    u16 = z.astype("<u8", copy=False).view("<u2").reshape(len(rows), 4 * words)[:, :dim]
    return torch.from_numpy(u16.astype(np.int32))


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """`x` rounded to `dtype` up or down, up with the probability of the discarded fraction.

    Unbiased: E[result] = x (given uniform bits), for both signs. Values exact in
    `dtype` are returned unchanged.

    bf16 is fp32's top 16 bits: adding 16 random bits to the fp32 pattern and clearing
    the low 16 rounds the magnitude up with probability (low 16 bits) / 2**16; a carry
    into the exponent gives the right next value. fp16 keeps 10 of fp32's 23 mantissa
    bits: the same trick with 13 random bits (the top 13 of the 16) rounds every value
    in fp16's normal range. Below 2**-14 fp16's spacing is a fixed 2**-24, so cutting
    mantissa bits and casting would round twice and bias small values (about 6% of a
    million-row table's initial values are that small); those are rounded on the value
    line, in units of 2**-24 (exact in fp32: scaling by a power of two).

    Args:
        x: (R, D) float32.
        dtype: torch.bfloat16 or torch.float16.
        bits: (R, D) int32 in [0, 2**16), e.g. `rounding_bits`.

    Returns:
        (R, D) `dtype`; beyond the dtype's range, inf.
    """
    if dtype == torch.bfloat16:
        rounded = torch.bitwise_and(x.view(torch.int32) + bits, -65536)
        return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are 0
    if dtype != torch.float16:
        raise ValueError(f"stochastic_round rounds to float16 or bfloat16, not {dtype}")
    noise = torch.bitwise_right_shift(bits, 3)  # 13 bits
    rounded = torch.bitwise_and(x.view(torch.int32) + noise, -8192).view(torch.float32)
    flat = x.reshape(-1)
    tiny = torch.nonzero(flat.abs() < 2.0**-14).flatten()  # fp16's subnormals (and zero)
    if tiny.numel():
        scaled = flat.index_select(0, tiny) * 2.0**24  # in units of fp16's spacing there
        down = torch.floor(scaled)
        up = (scaled - down) * 65536 > bits.reshape(-1).index_select(0, tiny)  # P = fraction
        rounded.view(-1).index_copy_(0, tiny, torch.where(up, down + 1, down) * 2.0**-24)
    return rounded.to(torch.float16)  # exact


def quantize_int8(
    x: torch.Tensor, bits: torch.Tensor | None = None, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as 8-bit codes with a per-row (scale, bias): value = code * scale + bias.

    A row's grid spans its values: bias is its minimum and scale (max - min) / 255, so
    both ends are codes 0 and 255 (FBGEMM's row-wise 8-bit layout). With `grid` (the
    rows' current scale and bias) a row whose values all still lie inside its grid keeps
    it, so an update moves a value by a (stochastically rounded) number of grid steps
    and leaves the codes it did not move; a row with a value outside is re-gridded.

    Args:
        x: (R, D) float32.
        bits: (R, D) int32 in [0, 2**16) (`rounding_bits`): round up with the
            probability of the fraction of a grid step; None rounds to nearest.
        grid: (R, 2) float32 (scale, bias) to keep where the row fits it.

    Returns:
        ((R, D) uint8 codes, (R, 2) float32 (scale, bias)); a constant row has scale 0.
    """
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    scale_bias = torch.stack([(hi - lo) / INT8_LEVELS, lo], dim=1)
    if grid is not None:
        top = grid[:, 1] + INT8_LEVELS * grid[:, 0]
        fits = (grid[:, 0] > 0) & (lo >= grid[:, 1]) & (hi <= top)
        scale_bias = torch.where(fits[:, None], grid, scale_bias)
    scale, bias = scale_bias[:, :1], scale_bias[:, 1:]
    steps = (x - bias) / torch.where(scale > 0, scale, 1.0)  # in [0, 255] up to rounding
    if bits is None:
        codes = torch.round(steps)
    else:  # floor(v + u), u uniform in [0, 1): up with probability frac(v)
        codes = torch.floor(steps.add_(bits.float() * 2.0**-16))
    return codes.clamp_(0, INT8_LEVELS).to(torch.uint8), scale_bias


def decode_rows(weight: torch.Tensor, scale_bias: torch.Tensor | None = None) -> torch.Tensor:
    """(R, D) float32 values of stored rows: fp32 as is, 2-byte rows upcast (exact), int8
    codes times their row's scale plus its bias (a multiply, then an add: the exported
    graphs compute the same)."""
    if scale_bias is None:
        return weight.float()
    return weight.float() * scale_bias[:, :1] + scale_bias[:, 1:]


def precision_of(state: Mapping[str, torch.Tensor]) -> str:
    """The table precision of a shard state (`ShardedEmbedding.state_dict()`)."""
    dtype = state["weight"].dtype
    if dtype not in _PRECISION_NAMES:
        raise ValueError(f"embedding rows of dtype {dtype} are of no table precision")
    return _PRECISION_NAMES[dtype]


def encode_rows(values: torch.Tensor, precision: TablePrecision) -> dict[str, torch.Tensor]:
    """fp32 rows stored at `precision`, rounded to nearest: {"weight"[, SCALE_BIAS]}."""
    if precision == "int8":
        codes, scale_bias = quantize_int8(values)
        return {"weight": codes, SCALE_BIAS: scale_bias}
    return {"weight": values.to(TABLE_DTYPES[precision])}


def clip_row_norms(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row's gradient scaled down to L2 norm `max_norm` where it is longer.

    Why this rule: the dense side's `train.grad_clip` is DeepSpeed's clip of the global
    L2 norm, which keeps a gradient's direction. FBGEMM's TBE (`gradient_clipping`,
    `max_gradient`) clamps every element of the pooled output gradient to
    [-max_gradient, max_gradient] before the rows' gradients are summed: that turns the
    direction, depends on how the batch is split over ranks, and bounds an element, not
    what `grad_clip` says it bounds. A global norm over all rows would cost one more
    all-reduce per step and let one hot row's spike shrink every other row's update. So
    the clip is per row and by L2 norm, on the gradient the row-wise optimizer sees
    (every rank's and micro step's contributions summed, unscaled): W ranks with batch b
    still follow 1 rank with batch W*b, and Adagrad's accumulator and Adam's moments
    take in the clipped gradient, as DeepSpeed's optimizer does on the dense side.

    Args:
        grad: (R, D) gradients of R rows.
        max_norm: c > 0.

    Returns:
        (R, D): rows with norm <= c unchanged (bit for bit), the others times c / norm.
    """
    norms = torch.linalg.vector_norm(grad, dim=1, keepdim=True)  # (R, 1)
    return torch.where(norms > max_norm, grad * (max_norm / norms), grad)


def _packed_sort(values: torch.Tensor, bound: int) -> tuple[torch.Tensor, int] | None:
    """Each value packed with its position, `value << k | position`, sorted; with k.

    Why by hand: deduplicating the batch's ids is the one sort of a sparse step, and
    torch 2.13's CPU sort takes ~1.5 ms for 16k int64 ids on this machine where numpy's
    vectorised (SIMD) sort takes ~0.1 ms. The keys are distinct, so numpy's unstable
    sort is deterministic, and sorts by value, then by position.

    Returns:
        (sorted keys, k), or None when a key would not fit 63 bits (or no values).
    """
    m = values.numel()
    shift = max(1, (m - 1).bit_length())
    if m == 0 or max(1, bound - 1).bit_length() + shift > 63:
        return None
    keys = torch.bitwise_or(torch.bitwise_left_shift(values, shift), torch.arange(m))
    return torch.from_numpy(np.sort(keys.numpy())), shift


def _unpack(keys: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, positions, first-of-its-value mask) of sorted packed keys."""
    values = torch.bitwise_right_shift(keys, shift)
    position = torch.bitwise_and(keys, (1 << shift) - 1)
    first = torch.ones(len(keys), dtype=torch.bool)
    torch.ne(values[1:], values[:-1], out=first[1:])
    return values, position, first


def unique_inverse(
    ids: torch.Tensor, bound: int, with_counts: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`torch.unique(ids, sorted=True, return_inverse=True[, return_counts=True])`, faster.

    By `_packed_sort` (0.5-0.6 ms where torch.unique takes 1.4-1.7 ms for 16k ids); falls
    back to torch.unique when a key would not fit 63 bits.

    Args:
        ids: (M,) int64 ids in [0, bound).
        bound: Exclusive upper bound of the ids.
        with_counts: Also return how often each unique id occurs.

    Returns:
        (unique (U,) sorted, inverse (M,), counts (U,) or None).
    """
    packed = _packed_sort(ids, bound)
    if packed is None:
        if with_counts:
            return torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        return unique, inverse, None
    values, position, first = _unpack(*packed)
    inverse = torch.empty(len(values), dtype=torch.int64)
    inverse[position] = torch.cumsum(first, dim=0) - 1
    counts = None
    if with_counts:
        starts = torch.nonzero(first).flatten()
        counts = torch.diff(starts, append=torch.tensor([len(values)]))
    return values[first], inverse, counts


def sum_rows(
    rows: torch.Tensor, values: torch.Tensor, bound: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted unique rows and, for each, the sum of its values in the order given.

    Equal (but for the sign of a zero sum) to `torch.zeros(U, D).index_add_(0, inverse,
    values)` after `torch.unique(rows, sorted=True, return_inverse=True)`, but most rows
    occur once: the values are gathered in sorted order, each row's first value taken as
    is and only the repeats added (CPU's 2-D index_add_ costs a slice add per row).

    Args:
        rows: (M,) int64 row indices in [0, bound).
        values: (M, D) one value per index.
        bound: Exclusive upper bound of the rows.

    Returns:
        (unique rows (U,), sums (U, D)).
    """
    packed = _packed_sort(rows, bound)
    if packed is None:
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        summed = values.new_zeros((unique.numel(), *values.shape[1:]))
        return unique, summed.index_add_(0, inverse, values)
    ordered, position, first = _unpack(*packed)
    ordered_values = values.index_select(0, position)
    summed = ordered_values[first]
    repeat = ~first
    if bool(repeat.any()):
        slot = torch.cumsum(first, dim=0) - 1
        summed.index_add_(0, slot[repeat], ordered_values[repeat])
    return ordered[first], summed


def group_by_owner(owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """The stable permutation that groups positions by owner rank (owners in [0, W)):
    `torch.argsort(owner, stable=True)`, by `_packed_sort`."""
    packed = _packed_sort(owner, world_size)
    if packed is None:
        return torch.argsort(owner, stable=True)
    keys, shift = packed
    return torch.bitwise_and(keys, (1 << shift) - 1)


def _local_rows(num_rows: int, rank: int, world_size: int) -> int:
    return max(0, (num_rows - rank + world_size - 1) // world_size)


def reshard_state(
    shards: list[dict[str, torch.Tensor]], num_rows: int, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """One rank's shard state for `world_size` ranks, from the shards of another world size.

    Global row g lives on rank g % W at local index g // W, so the old shard r' of W'
    holds rows r', r' + W', ... ; the new rank takes every row g with g % W == rank.
    Per-row tensors (rows, optimizer state, admission counts) move with their row; the
    step counter is shared.

    Args:
        shards: `ShardedEmbedding.state_dict()` of every old rank, in rank order
            (callers may pass lazily loaded tensors; each is read once).
        num_rows: N, rows of the fused table.
        rank: The new rank.
        world_size: The new world size W.

    Returns:
        The state dict for `ShardedEmbedding.load_state_dict` on the new rank.

    Raises:
        ValueError: The shards disagree with num_rows or with each other.
    """
    old_world = len(shards)
    rows = torch.arange(rank, num_rows, world_size)  # (n,) global rows of the new shard
    result: dict[str, torch.Tensor] = {}
    for old_rank, shard in enumerate(shards):
        if int(shard["weight"].shape[0]) != _local_rows(num_rows, old_rank, old_world):
            raise ValueError(
                f"old shard {old_rank} of {old_world} has {shard['weight'].shape[0]} rows, "
                f"not the {_local_rows(num_rows, old_rank, old_world)} of a {num_rows}-row table"
            )
        mine = rows[rows % old_world == old_rank]  # new rows that old_rank held
        source = mine // old_world
        target = mine // world_size
        for name, tensor in shard.items():
            if name == "steps":
                result[name] = tensor.clone()
                continue
            if name not in result:
                result[name] = torch.empty((len(rows), *tensor.shape[1:]), dtype=tensor.dtype)
            result[name][target] = tensor[source]
    return result


def apply_delta(
    state: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
    num_rows: int,
    rank: int,
    world_size: int,
    where: str,
) -> None:
    """Write a differential checkpoint's rows (`ShardedEmbedding.take_delta`, of any
    world size) into one rank's shard state, in place.

    Args:
        state: The rank's `state_dict()`-shaped tensors (a base, deltas applied so far).
        delta: One old rank's delta: global rows and their per-row tensors, "steps".
        num_rows: N, rows of the fused table.
        rank: This rank.
        world_size: This run's world size W (global row g is local row g // W of rank
            g % W).
        where: The file the delta came from, for the error message.

    Raises:
        ValueError: The delta's tensors are not this table's (other names, shapes or
            dtypes, or rows outside it).
    """
    rows = delta.get(DELTA_ROWS)
    names = set(state) | {DELTA_ROWS}
    if (
        rows is None
        or set(delta) != names
        or rows.dim() != 1
        or rows.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"{where} is not a delta of this table's shard (tensors {sorted(delta)[:8]}, "
            f"expected {sorted(names)}): it was written with another sparse optimizer or "
            "admission setting; resume with the config that wrote the chain"
        )
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ValueError(
            f"{where} names rows outside the table's [0, {num_rows}): it is not this "
            "table's delta; resume with the config that wrote the chain"
        )
    rows = rows.long()
    mine = rows % world_size == rank
    local = rows[mine] // world_size
    for name, tensor in state.items():
        if name == "steps":
            tensor.copy_(delta[name])
            continue
        values = delta[name]
        if values.shape[1:] != tensor.shape[1:] or values.dtype != tensor.dtype:
            raise ValueError(
                f"{where}: {name} is {values.dtype} {tuple(values.shape[1:])} per row, this "
                f"shard's is {tensor.dtype} {tuple(tensor.shape[1:])}: resume with the "
                "table precision and embedding_dim that wrote the chain"
            )
        if values.shape[0] != rows.numel():
            raise ValueError(
                f"{where}: {name} has {values.shape[0]} rows and {DELTA_ROWS} {rows.numel()}"
            )
        tensor[local] = values[mine]


def warm_start_state(
    shards: list[dict[str, torch.Tensor]],
    old_sizes: list[int],
    new_sizes: list[int],
    reset_rows: list[list[int]],
    embedding_dim: int,
    seed: int,
    rank: int,
    world_size: int,
    table_precision: TablePrecision = "fp32",
) -> dict[str, torch.Tensor]:
    """One rank's shard state for a grown table, from a parent model's shards.

    An incremental day (`data_prep.idmap`) keeps every known id's row index within its
    feature, appends rows for new ids and names the rows whose id changed (evicted, or
    reused by a new id). Row i of feature f therefore carries over from the parent's
    row i of f unless it is new (i >= the parent's size) or reset; those get this
    table's initial values (`init_rows` of the new sizes, as a fresh run would) and a
    zero optimizer state and admission count. Features' offsets move when an earlier
    table grows, so rows are mapped per feature, not by global row. The result depends
    on neither the parent's world size nor this one.

    Args:
        shards: The parent's `ShardedEmbedding.state_dict()` of every rank, in order.
        old_sizes: The parent's rows per feature.
        new_sizes: This run's rows per feature (each >= the parent's).
        reset_rows: Per feature, the rows (indices within the feature) to start afresh.
        embedding_dim: D.
        seed: This run's init seed.
        rank: This rank.
        world_size: This run's world size W.
        table_precision: This run's; the parent's rows are converted to it (decoded to
            fp32, which is exact, and rounded to nearest).

    Returns:
        The state dict for `ShardedEmbedding.load_state_dict` (the parent's step count).

    Raises:
        ValueError: The feature counts differ, a table shrank, a reset row is out of its
            table, or a parent's row does not fit this precision (bf16 beyond fp16's
            65504).
    """
    if len(old_sizes) != len(new_sizes) or len(reset_rows) != len(new_sizes):
        raise ValueError(
            f"the parent has {len(old_sizes)} features and this run {len(new_sizes)} "
            f"({len(reset_rows)} reset lists): a warm start needs the same features"
        )
    for f, (old, new, reset) in enumerate(zip(old_sizes, new_sizes, reset_rows, strict=True)):
        if new < old or any(not 0 <= r < new for r in reset):
            raise ValueError(
                f"feature {f}: the parent's table has {old} rows and this one {new}, reset "
                "rows must be inside it; a warm start only grows tables"
            )
    old_offsets, new_offsets = table_offsets(old_sizes), table_offsets(new_sizes)
    old_world = len(shards)
    rows = torch.arange(rank, int(new_offsets[-1]), world_size)  # this rank's global rows
    feature = torch.searchsorted(new_offsets[1:], rows, right=True)
    within = rows - new_offsets[feature]
    reset_global = torch.cat(
        [new_offsets[f] + torch.tensor(r, dtype=torch.int64) for f, r in enumerate(reset_rows)]
    )
    keep = (within < torch.tensor(old_sizes)[feature]) & ~torch.isin(rows, reset_global)
    parent_row = old_offsets[feature] + within  # meaningful where keep

    result = init_table(new_sizes, embedding_dim, seed, rank, world_size, table_precision)
    rows_of = ("weight", SCALE_BIAS)  # the stored rows; converted, not copied, across precisions
    for name, tensor in shards[0].items():
        if name == "steps":
            result[name] = tensor.clone()
        elif name not in rows_of:
            result[name] = torch.zeros((len(rows), *tensor.shape[1:]), dtype=tensor.dtype)
    same = precision_of(shards[0]) == table_precision
    for old_rank, shard in enumerate(shards):
        mine = keep & (parent_row % old_world == old_rank)
        source = parent_row[mine] // old_world
        for name, tensor in shard.items():
            if name != "steps" and name not in rows_of:
                result[name][mine] = tensor[source]
        if same:  # the stored form itself: a carried row is bitwise the parent's
            parent = {name: shard[name][source] for name in rows_of if name in shard}
        else:  # decoded to fp32 (exact) and rounded to nearest at this precision
            sb = shard[SCALE_BIAS][source] if SCALE_BIAS in shard else None
            parent = encode_rows(decode_rows(shard["weight"][source], sb), table_precision)
        for name, tensor in parent.items():
            result[name][mine] = tensor
    if not bool(torch.isfinite(decode_rows(result["weight"], result.get(SCALE_BIAS))).all()):
        raise ValueError(
            f"a parent's row does not fit train.table_precision: {table_precision} (beyond "
            "its range); warm-start at bf16 or fp32"
        )
    return result


def narrowest_int(largest: int) -> torch.dtype:
    """The narrowest signed integer dtype that holds 0..largest (int16, int32 or int64)."""
    for dtype in (torch.int16, torch.int32):
        if largest <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def encode_grads(grad: torch.Tensor, precision: CommPrecision) -> torch.Tensor:
    """(N, D) fp32 row gradients as sent at `precision` (`decode_grads` inverts it).

    fp32 as is; bf16 rounded to nearest. fp16: each row is multiplied by 2^e, with e
    chosen so that its largest magnitude lies in [2^14, 2^15), then rounded to nearest;
    e travels as an extra fp16 column (an integer, exact in fp16). A power of two scales
    exactly, so the only rounding is fp16's 11-bit mantissa relative to the row's
    largest value: the gradient of a rare id is as precise as that of a hot one, where
    one scale for the whole message would flush small rows to zero.
    """
    if precision == "fp32":
        return grad
    if precision == "bf16":
        return grad.to(torch.bfloat16)
    largest = grad.abs().amax(dim=1)
    _, exponent = torch.frexp(largest)  # largest = m * 2^exponent, m in [0.5, 1)
    # At most 127: 2^shift must be a finite fp32 (only rows below 2^-112 are capped).
    shift = torch.where(largest > 0, _FP16_TOP_EXPONENT - exponent, 0).clamp_(max=127)
    shift = shift.to(torch.float32)
    scaled = torch.ldexp(grad, shift[:, None]).to(torch.float16)
    return torch.cat([scaled, shift.to(torch.float16)[:, None]], dim=1)


def decode_grads(sent: torch.Tensor, precision: CommPrecision) -> torch.Tensor:
    """`encode_grads`' (N, D) fp32 gradients back from what was received."""
    if precision == "fp32":
        return sent
    if precision == "bf16":
        return sent.float()
    return torch.ldexp(sent[:, :-1].float(), -sent[:, -1:].float())


@dataclass
class InputDist:
    """A batch's ids on their way to their owners (`ShardedEmbedding.distribute`).

    Attributes:
        unique_ids: (U,) sorted global ids of the batch.
        inverse: (M,) index of each id in unique_ids.
        id_counts: (U,) occurrences of each (admission, training), else None.
        send_order: (U,) permutation grouping unique_ids by owner; None with one rank.
        send_splits: Ids sent to each rank.
        recv_splits: Ids received from each rank (as owner).
        received: What arrives: (R, k) bytes of the narrowed local rows (and counts);
            None with one rank.
        work: The exchange to wait for before reading `received`; None once done.
    """

    unique_ids: torch.Tensor
    inverse: torch.Tensor
    id_counts: torch.Tensor | None
    send_order: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    received: torch.Tensor | None
    work: dist.Work | None


@dataclass
class LookupContext:
    """What `lookup` remembers for sending the gradients back.

    Attributes:
        unique_ids: (U,) sorted global ids of this rank's batch.
        send_order: (U,) permutation of unique_ids grouping them by owner rank; None
            with one rank (no exchange).
        send_splits: Ids sent to each rank.
        recv_splits: Ids received from each rank (as owner).
        recv_local: (R,) local row indices of the received ids.
        admitted: (U,) bool, whether each unique id has its own row.
    """

    unique_ids: torch.Tensor
    send_order: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    recv_local: torch.Tensor
    admitted: torch.Tensor


class ShardedEmbedding:
    """This rank's shard of the fused table and its row-wise optimizer state.

    Args:
        table_sizes: Rows per feature (single-valued, then multi-hot features).
        embedding_dim: D.
        optimizer: "rowwise_adagrad" or "lazy_adam".
        lr: Learning rate of the rows.
        admission_min_count: K; 0 or 1 admits every id.
        seed: Init seed (see `init_rows`).
        rank: This rank; with world_size 1 no collective is used.
        world_size: W.
        group: Process group of the all-to-alls (default: the world).
        weight_decay: L2 penalty added to the gradient of each row it updates.
        max_grad_norm: Largest L2 norm of a row's gradient (`clip_row_norms`), applied
            before the weight decay term; 0 disables.
        table_precision: How the rows are stored: "fp32", or "fp16" / "bf16" / "int8"
            with stochastically rounded updates (see the module docstring); the
            optimizer state is fp32 in every case.
        comm_precision: How the rows and row gradients travel between ranks: "fp32",
            "bf16" or "fp16" (see the module docstring); the owners sum and update in
            fp32 whatever it is.
        overlap: Send the row gradients without waiting for them to arrive: the caller
            goes on (the dense all-reduce and step) while they travel, and the next
            `lookup`, `step` or `discard_gradients` waits for them. The values are the
            same either way. Give the shard a process group of its own (`group`), so
            that the dense side's collectives do not queue behind its exchange.
    """

    def __init__(
        self,
        table_sizes: list[int],
        embedding_dim: int,
        optimizer: SparseOptimizer,
        lr: float,
        admission_min_count: int = 0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        table_precision: TablePrecision = "fp32",
        comm_precision: CommPrecision = "fp32",
        overlap: bool = False,
    ) -> None:
        if optimizer not in ("rowwise_adagrad", "lazy_adam"):
            raise ValueError(f"optimizer must be rowwise_adagrad or lazy_adam, got {optimizer!r}")
        if table_precision not in TABLE_DTYPES:
            raise ValueError(
                f"table_precision must be one of {sorted(TABLE_DTYPES)}, got {table_precision!r}"
            )
        if comm_precision not in COMM_DTYPES:
            raise ValueError(
                f"comm_precision must be one of {sorted(COMM_DTYPES)}, got {comm_precision!r}"
            )
        self.table_sizes = list(table_sizes)
        self.offsets = table_offsets(self.table_sizes)
        self.num_rows = int(self.offsets[-1])
        self.embedding_dim = embedding_dim
        self.optimizer = optimizer
        self.lr = lr
        self.admission_min_count = admission_min_count
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.rank, self.world_size, self.group = rank, world_size, group
        self.seed = seed  # also keys the stochastic rounding of 2-byte rows
        self.table_precision = table_precision
        self.comm_precision = comm_precision
        self.overlap = overlap
        # Gradient exchanges sent and not yet waited for: (work or None, what arrives,
        # the local rows it is for).
        self._in_flight: list[tuple[dist.Work | None, torch.Tensor, torch.Tensor]] = []
        # Bytes this rank sent to the other ranks since it was built, by kind (WIRE_KINDS).
        self.wire_bytes = dict.fromkeys(WIRE_KINDS, 0)
        rows = init_table(self.table_sizes, embedding_dim, seed, rank, world_size, table_precision)
        self.weight = rows["weight"]
        if table_precision != "fp32":
            rounding_kernel()  # built (or found built) now, not in the first step
        # int8 rows' (scale, bias) per row; None at the other precisions.
        self.scale_bias: torch.Tensor | None = rows.get(SCALE_BIAS)
        local = self.weight.shape[0]
        if optimizer == "rowwise_adagrad":
            self.state: dict[str, torch.Tensor] = {"sum_sq": torch.zeros(local)}
        else:  # fp32 whatever the rows' precision
            self.state = {"exp_avg": torch.zeros(self.weight.shape)}
            self.state["exp_avg_sq"] = torch.zeros(self.weight.shape)
        self.steps = 0  # optimizer steps taken (lazy Adam's bias correction)
        self.counts = torch.zeros(local, dtype=torch.int64) if self._admission else None
        # Local rows whose row, optimizer state or admission count changed since the
        # last `take_delta` (a differential checkpoint writes only those).
        self.dirty = torch.zeros(local, dtype=torch.bool)
        self._delta_buffers: dict[str, torch.Tensor] = {}  # see `take_delta`
        # Ids travel as their owner's local row; with admission the batch's counts of
        # them (at most every id a rank looks up at once, < 2^31) travel alongside.
        largest_local = -(-self.num_rows // world_size) - 1
        self._id_dtype = narrowest_int(
            max(largest_local, torch.iinfo(torch.int32).max if self._admission else 0)
        )
        self._pending_rows: list[torch.Tensor] = []
        self._pending_grads: list[torch.Tensor] = []

    @property
    def _admission(self) -> bool:
        return self.admission_min_count >= 2

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This shard's tensors (rows, optimizer state, admission counts, step)."""
        state = {"weight": self.weight, **self.state, "steps": torch.tensor(self.steps)}
        if self.scale_bias is not None:
            state[SCALE_BIAS] = self.scale_bias
        if self.counts is not None:
            state["counts"] = self.counts
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore this shard from `state_dict()` of a shard of the same table and rank.

        Raises:
            ValueError: A tensor is missing or of another shape (another table, world
                size or optimizer), or the rows are of another table precision.
        """
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing or any(state[k].shape != v.shape for k, v in expected.items() if k in state):
            raise ValueError(
                f"embedding shard state does not fit this rank's shard (missing {missing}, "
                "or shapes differ): it was saved with another table, world size or sparse "
                "optimizer"
            )
        if state["weight"].dtype != self.weight.dtype:
            saved = _PRECISION_NAMES.get(state["weight"].dtype, str(state["weight"].dtype))
            raise ValueError(
                f"embedding shard rows are {saved} but this run's train.table_precision is "
                f"{self.table_precision}: a warm start (train.init) converts, a resume does "
                f"not; resume with table_precision: {saved}"
            )
        with torch.no_grad():
            self.weight.copy_(state["weight"])
            if self.scale_bias is not None:
                self.scale_bias.copy_(state[SCALE_BIAS])
            for name in self.state:
                self.state[name].copy_(state[name])
            if self.counts is not None:
                self.counts.copy_(state["counts"])
        self.steps = int(state["steps"])
        self.dirty.zero_()  # what was loaded is the checkpoint's: nothing changed since
        self._pending_rows.clear()
        self._pending_grads.clear()

    def dirty_rows(self) -> int:
        """How many of this shard's rows changed since the last `take_delta`."""
        return int(torch.count_nonzero(self.dirty))  # 20x faster than a bool sum here

    def mark_clean(self) -> None:
        """Forget which rows changed (a whole checkpoint of them was just taken)."""
        self.dirty.zero_()

    def take_delta(self, whole: bool = False) -> dict[str, torch.Tensor]:
        """What a checkpoint writes of this shard, copied, and the dirty marks cleared.

        Args:
            whole: All rows (a base checkpoint) instead of the dirty ones.

        Returns:
            `DELTA_ROWS`: (n,) global rows, ascending (int32 when the table has fewer
            than 2^31 rows, else int64); each per-row tensor of `state_dict()` at those
            rows (rows, optimizer state, admission counts); and "steps". `apply_delta`
            puts it back on any world size. The per-row tensors of a delta are views of
            buffers this shard keeps and reuses: valid until the next `take_delta`
            (a checkpoint is written before the next is taken), and no page of them is
            faulted in anew while the ranks wait.
        """
        if whole:
            local = torch.arange(self.weight.shape[0])
        else:
            local = self.dirty.nonzero().squeeze(1)
        rows = local * self.world_size + self.rank
        narrow = self.num_rows <= torch.iinfo(torch.int32).max
        delta = {DELTA_ROWS: rows.to(torch.int32) if narrow else rows}
        for name, tensor in self.state_dict().items():
            if name == "steps":
                delta[name] = tensor.clone()
            elif whole:
                delta[name] = tensor.index_select(0, local)
            else:
                out = self._delta_buffer(name, tensor, local.numel())
                delta[name] = torch.index_select(tensor, 0, local, out=out)
        self.dirty.zero_()
        return delta

    def _delta_buffer(self, name: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """(rows, ...) view of the reused buffer for `name`'s delta, grown by a quarter
        beyond what is asked when it is too small."""
        buffer = self._delta_buffers.get(name)
        if buffer is None or buffer.shape[0] < rows:
            capacity = min(like.shape[0], rows + rows // 4)
            buffer = torch.empty((capacity, *like.shape[1:]), dtype=like.dtype)
            self._delta_buffers[name] = buffer
        return buffer[:rows]

    def admitted_rows(self) -> torch.Tensor:
        """(local rows,) bool: which of this shard's rows are admitted."""
        if self.counts is None:
            return torch.ones(self.weight.shape[0], dtype=torch.bool)
        return self.counts >= self.admission_min_count

    # -- forward --------------------------------------------------------------------
    def distribute(self, ids: torch.Tensor, train: bool = True) -> InputDist:
        """Send a batch's ids to their owners, without waiting for them to arrive.

        The first half of `lookup` (its input distribution): a caller that has the next
        batch can start it while the current one computes, and hand the result to
        `lookup` later. Ids do not change with the rows, so the rows looked up then are
        bitwise those of a `lookup` of the ids.

        Args:
            ids: (M,) int64 global ids (any order, duplicates allowed).
            train: Count the ids for admission (training); False only reads.
        """
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(
                f"embedding ids must be in [0, {self.num_rows}), got "
                f"[{int(ids.min())}, {int(ids.max())}]; the shards and the model disagree"
            )
        unique_ids, inverse, id_counts = unique_inverse(
            ids, self.num_rows, with_counts=self._admission and train
        )
        if self.world_size == 1:  # this rank owns every row: no exchange, no reordering
            splits = [unique_ids.numel()]
            return InputDist(unique_ids, inverse, id_counts, None, splits, splits, None, None)
        owner = unique_ids % self.world_size
        send_order = group_by_owner(owner, self.world_size)
        send_splits = torch.bincount(owner, minlength=self.world_size)
        recv_splits = self._exchange_counts(send_splits)
        send_splits_list, recv_splits_list = send_splits.tolist(), recv_splits.tolist()
        # Each owner gets its local rows, narrowed (the module docstring).
        payload = (unique_ids.index_select(0, send_order) // self.world_size).to(self._id_dtype)
        if id_counts is not None:
            counts = id_counts.index_select(0, send_order).to(self._id_dtype)
            payload = torch.stack([payload, counts], dim=1)
        else:
            payload = payload[:, None]
        # As raw bytes: neither gloo nor NCCL takes int16, a byte view travels anywhere.
        received, work = self._send(
            payload.view(torch.uint8), recv_splits_list, send_splits_list, "ids", wait=False
        )
        return InputDist(
            unique_ids, inverse, id_counts, send_order, send_splits_list, recv_splits_list,
            received, work,
        )  # fmt: skip

    def lookup(
        self, ids: torch.Tensor | InputDist, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, LookupContext]:
        """Fetch the rows of a batch's global ids from their owners.

        Args:
            ids: (M,) int64 global ids (any order, duplicates allowed), or what
                `distribute` returned for them.
            train: Count the ids for admission (training); False only reads. Ignored
                for a `distribute` result, which was given it.

        Returns:
            rows: (U, D) float32 leaf tensor with requires_grad, the rows of the
                unique ids (not-admitted ids get their stored row; the caller swaps
                in the default row).
            inverse: (M,) index of each id in the unique ids.
            context: For `accumulate_gradients`.
        """
        self._settle()  # the gradients of the last micro batch are in the sums
        sent = ids if isinstance(ids, InputDist) else self.distribute(ids, train)
        unique_ids, inverse, id_counts = sent.unique_ids, sent.inverse, sent.id_counts
        num_unique = unique_ids.numel()
        send_order = sent.send_order
        send_splits_list, recv_splits_list = sent.send_splits, sent.recv_splits
        if sent.received is None:  # one rank
            recv_local, recv_counts = unique_ids, id_counts
        else:
            if sent.work is not None:
                sent.work.wait()
            received = sent.received.view(self._id_dtype).long()
            recv_local = received[:, 0]
            recv_counts = received[:, 1] if id_counts is not None else None

        reply = self._read_rows(recv_local)  # (R, D) fp32
        if self.counts is not None:
            if recv_counts is not None:
                self.counts.index_add_(0, recv_local, recv_counts)
                self.dirty.index_fill_(0, recv_local, True)
            admitted_local = self.counts.index_select(0, recv_local) >= self.admission_min_count
            reply = torch.cat([reply, admitted_local[:, None].float()], dim=1)
        if send_order is None:
            rows = reply
        else:
            outgoing = reply.to(COMM_DTYPES[self.comm_precision])
            returned = self._all_to_all(outgoing, send_splits_list, recv_splits_list, "rows")
            returned = returned.float()
            rows = returned.new_empty((num_unique, returned.shape[1]))
            rows.index_copy_(0, send_order, returned)
        if self.counts is not None:
            admitted = rows[:, -1] > 0.5
            rows = rows[:, :-1].contiguous()
        else:
            admitted = torch.ones(num_unique, dtype=torch.bool)
        rows.requires_grad_(True)
        context = LookupContext(
            unique_ids, send_order, send_splits_list, recv_splits_list, recv_local, admitted
        )
        return rows, inverse, context

    # -- backward and update -----------------------------------------------------------
    def accumulate_gradients(self, grad: torch.Tensor | None, context: LookupContext) -> None:
        """Send a micro batch's row gradients to their owners and keep them for `step`.

        Args:
            grad: (U, D) gradient of the loss w.r.t. `lookup`'s rows (None: no
                gradient reached them; zeros are sent so every rank joins the exchange).
            context: The lookup's context.
        """
        if grad is None:
            grad = torch.zeros((context.unique_ids.numel(), self.embedding_dim))
        grad = grad.float()
        if context.send_order is None:
            self._pending_rows.append(context.recv_local)
            self._pending_grads.append(grad)
            return
        sent = encode_grads(grad.index_select(0, context.send_order), self.comm_precision)
        received, work = self._send(
            sent, context.recv_splits, context.send_splits, "row_grads", wait=not self.overlap
        )
        self._in_flight.append((work, received, context.recv_local))
        if not self.overlap:
            self._settle()

    def _settle(self) -> None:
        """Wait for the gradient exchanges in flight and keep what arrived for `step`."""
        for work, received, local in self._in_flight:
            if work is not None:
                work.wait()
            self._pending_rows.append(local)
            self._pending_grads.append(decode_grads(received, self.comm_precision))
        self._in_flight.clear()

    def discard_gradients(self) -> None:
        """Drop accumulated gradients (e.g. when fp16 overflow skips a step)."""
        self._settle()  # every rank took part in the exchange; it must end
        self._pending_rows.clear()
        self._pending_grads.clear()

    def step(self, grad_scale: float = 1.0) -> int:
        """Apply the row-wise optimizer to every row with accumulated gradients.

        Each row's summed gradient is clipped to `max_grad_norm` (when set), then the
        weight decay term is added.

        Args:
            grad_scale: Divides the summed gradients (the loss scale of fp16); the
                world size is divided out here as well.

        Returns:
            Number of rows updated on this rank.
        """
        self.steps += 1
        self._settle()
        if not self._pending_rows:
            return 0
        scale = self.world_size * grad_scale
        if len(self._pending_rows) == 1 and self.world_size == 1:
            # One micro batch on one rank: its rows are already unique and sorted.
            rows, summed = self._pending_rows[0], self._pending_grads[0] / scale
        else:
            local = torch.cat(self._pending_rows)
            grads = torch.cat(self._pending_grads)
            # (Ru, D): every rank's and micro step's gradient of each row, summed.
            rows, summed = sum_rows(local, grads, self.weight.shape[0])
            summed /= scale
        self.discard_gradients()
        if self.counts is not None:
            keep = self.counts.index_select(0, rows) >= self.admission_min_count
            rows, summed = rows[keep], summed[keep]
        if self.max_grad_norm:
            summed = clip_row_norms(summed, self.max_grad_norm)
        if self.weight_decay:
            summed += self.weight_decay * self._read_rows(rows)
        if self.optimizer == "rowwise_adagrad":
            self._rowwise_adagrad(rows, summed)
        else:
            self._lazy_adam(rows, summed)
        self.dirty.index_fill_(0, rows, True)
        return int(rows.numel())

    def _rowwise_adagrad(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        # One accumulator per row (FBGEMM's row-wise Adagrad): the mean squared gradient.
        sum_sq = self.state["sum_sq"]
        sum_sq.index_add_(0, rows, grad.pow(2).mean(dim=1))
        denom = sum_sq.index_select(0, rows).sqrt_().add_(ADAGRAD_EPS)  # (Ru,)
        self._subtract_rows(rows, self.lr * grad / denom[:, None])

    def _lazy_adam(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        # Adam on the rows in the batch only; bias correction by the global step (TF's
        # LazyAdam, torch's SparseAdam).
        beta1, beta2 = ADAM_BETAS
        exp_avg = self.state["exp_avg"].index_select(0, rows).mul_(beta1)
        exp_avg.add_(grad, alpha=1 - beta1)
        exp_avg_sq = self.state["exp_avg_sq"].index_select(0, rows).mul_(beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        self.state["exp_avg"].index_copy_(0, rows, exp_avg)
        self.state["exp_avg_sq"].index_copy_(0, rows, exp_avg_sq)
        correction1 = 1 - beta1**self.steps
        correction2 = 1 - beta2**self.steps
        denom = (exp_avg_sq / correction2).sqrt_().add_(ADAM_EPS)
        self._subtract_rows(rows, (self.lr / correction1) * exp_avg / denom)

    def _read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, D) fp32 values of local rows (upcast, or decoded from int8; exact)."""
        if self.scale_bias is None:
            return self.weight.index_select(0, rows).float()
        return decode_rows(self.weight.index_select(0, rows), self.scale_bias.index_select(0, rows))

    def _subtract_rows(self, rows: torch.Tensor, update: torch.Tensor) -> None:
        # weight[rows] -= update for unique rows, as gather, subtract, scatter: CPU's 2-D
        # index_add_ costs ~2.5x more (a slice add per row).
        if self.weight.dtype == torch.float32:
            self.weight.index_copy_(0, rows, self.weight.index_select(0, rows).sub_(update))
            return
        # Compact rows: the new value in fp32, rounded back stochastically with bits of
        # the global rows (local row r of rank k is global row r * W + k). The compiled
        # kernel does it in one pass; the torch ops below compute bitwise the same.
        if not subtract_rows(
            self.weight, self.scale_bias, rows, update, self.world_size, self.rank,
            self.seed, self.steps,
        ):  # fmt: skip
            self._subtract_rows_torch(rows, update)

    def _subtract_rows_torch(self, rows: torch.Tensor, update: torch.Tensor) -> None:
        """`_subtract_rows` of compact rows as torch ops (the kernel's reference)."""
        new = self._read_rows(rows).sub_(update)  # (Ru, D)
        bits = rounding_bits(
            self.seed, self.steps, rows * self.world_size + self.rank, self.embedding_dim
        )
        if self.scale_bias is None:
            self.weight.index_copy_(0, rows, stochastic_round(new, self.weight.dtype, bits))
            return
        grid = self.scale_bias.index_select(0, rows)
        codes, scale_bias = quantize_int8(new, bits, grid)
        self.weight.index_copy_(0, rows, codes)
        self.scale_bias.index_copy_(0, rows, scale_bias)

    # -- collectives ----------------------------------------------------------------------
    def _exchange_counts(self, send_splits: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return send_splits.clone()
        self.wire_bytes["ids"] += (self.world_size - 1) * send_splits.element_size()
        recv_splits = torch.empty_like(send_splits)
        dist.all_to_all_single(recv_splits, send_splits, group=self.group)
        return recv_splits

    def _all_to_all(
        self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], kind: str
    ) -> torch.Tensor:
        """Rows [input_splits] of `tensor` to each rank; rows from each rank, in rank order.

        `kind` (one of WIRE_KINDS) is what the bytes sent to the other ranks count as;
        this rank's own rows do not leave it.
        """
        if self.world_size == 1:
            return tensor
        return self._send(tensor, output_splits, input_splits, kind, wait=True)[0]

    def _send(
        self,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        kind: str,
        wait: bool,
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """`_all_to_all` (W >= 2); unless `wait`, returns before the data arrives, with
        the work to wait on before reading the output."""
        row_bytes = tensor[0].numel() * tensor.element_size() if tensor.numel() else 0
        self.wire_bytes[kind] += (sum(input_splits) - input_splits[self.rank]) * row_bytes
        output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        work = dist.all_to_all_single(
            output, tensor, output_splits, input_splits, group=self.group, async_op=not wait
        )
        return output, work
