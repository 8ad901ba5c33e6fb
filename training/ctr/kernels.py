"""The compiled row update of compact tables (`rounding.cpp`), and its torch fallback.

Why by hand: a compact row's update is, per element, a decode, a subtract, a SplitMix64
draw and a stochastic rounding (`training.ctr.embedding`). As torch and numpy ops that is
about a dozen passes over the batch's (rows, D) values, each with its own temporary: at
20M rows in one process the fp16 step's optimizer phase took 3.6 ms against fp32's 1.9
(`bench/table_precision.py`, samples/s 0.80x fp32's). FBGEMM fuses the same work into
its table-batched kernels, but only behind its own table layout and optimizer; torch has
no stochastic rounding on the CPU. One C++ pass over each row does it all.

The extension is built on first use with torch's JIT builder (as DeepSpeed builds its
CPU ops), into `TORCH_EXTENSIONS_DIR`, and kept there. It computes exactly what the torch
path computes, bitwise (tests/training/ctr/test_kernels.py); where it cannot be built (no
compiler), the engine logs why once and takes the torch path, which is slower, not
different.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rounding.cpp")


@functools.cache
def rounding_kernel() -> ModuleType | None:
    """The compiled extension, built on first use; None where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="recforge_rounding",
            sources=[str(SOURCE)],
            # No fused multiply-adds: every operation rounds as the torch path's does.
            # Built on the machine that runs it, so its own instructions (F16C converts
            # fp16 in hardware); the conversions are exact, so results do not depend on
            # them.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off"],
            verbose=False,
        )
    except Exception as error:  # a missing compiler or headers: the torch path still works
        log.warning(
            "the compiled row update (%s) could not be built, so compact tables update "
            "through torch ops (same values, slower): %s",
            SOURCE.name,
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return None


def _int64(value: int) -> int:
    """`value` modulo 2**64, as the signed int64 of the same bits (what C++ reads)."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def subtract_rows(
    weight: torch.Tensor,
    scale_bias: torch.Tensor | None,
    rows: torch.Tensor,
    update: torch.Tensor,
    world_size: int,
    rank: int,
    seed: int,
    step: int,
) -> bool:
    """`weight[rows] -= update`, rounded stochastically, by the compiled kernel.

    Args:
        weight: (N, D) float16, bfloat16 or uint8 (int8 codes) rows, updated in place.
        scale_bias: (N, 2) float32 (scale, bias) of int8 rows, updated in place; else None.
        rows: (R,) unique int64 local rows.
        update: (R, D) float32.
        world_size: W; local row r of this rank is global row r * W + rank.
        rank: This rank.
        seed: The run's seed (keys the rounding bits).
        step: The optimizer step.

    Returns:
        False when the kernel is not available (nothing was changed): take the torch path.
    """
    kernel = rounding_kernel()
    if kernel is None:
        return False
    kernel.subtract_rows(
        weight,
        scale_bias,
        rows.contiguous(),
        update.float().contiguous(),
        world_size,
        rank,
        _int64(seed),
        _int64(step),
    )
    return True
