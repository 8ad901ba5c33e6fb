"""Memory-plan primitives shared by the model families: sizes, the plan record, searches."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from artifacts.errors import ConfigError


def plan_record(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as `memory_plan.json` holds it (its notes only when it has any)."""
    record: dict[str, Any] = {
        "world_size": plan.world_size,
        "per_rank_bytes": dict(plan.per_rank),
        "host_offload_bytes": plan.host_offload,
        "total_per_rank_bytes": plan.total,
    }
    if plan.notes:
        record["notes"] = list(plan.notes)
    return record


KiB = 1 << 10


MiB = 1 << 20


GiB = 1 << 30


FP32_BYTES = 4


INT32_BYTES = 4


INT64_BYTES = 8


# Resident memory of one rank before any model state: python + torch + deepspeed +
# pyarrow imported, the process group and a DeepSpeed engine initialised. Measured peak
# RSS of a 1-rank CPU engine doing one step (torch 2.13, deepspeed 0.19.8): 242 MiB
# after the imports, 386 MiB after the step; rounded up for allocator slack.
RUNTIME_BYTES = 512 * MiB


# Bytes of table rows (or of a ZeRO-3 parameter) one rank reads and writes at a time
# when it streams its share of model.safetensors (`training.runtime.consolidate`).
CHUNK_BYTES = 64 * MiB


COMPONENTS = (
    "embeddings",
    "sparse_optimizer",
    "admission",
    "dense_params",
    "dense_grads",
    "dense_optimizer",
    "activations",
    "reader",
    "consolidation",
    "runtime",
)


@dataclass(frozen=True)
class MemoryPlan:
    """Planned memory of the worst rank (rank 0) of a training run.

    Attributes:
        world_size: Ranks the plan is for.
        per_rank: Bytes by component (every name in `COMPONENTS`) on the worst rank.
        host_offload: Bytes of dense optimizer state moved to CPU memory by
            offload_optimizer (0 otherwise). On the CPU accelerator they are also in
            per_rank["dense_optimizer"]; on an accelerator they are not.
        total: Sum of `per_rank`.
        table_sizes: Rows of each sparse feature's table (kept to re-plan suggestions).
        feature_names: Names of the sparse features, or () when unknown.
        num_dense_features: Dense input features.
        num_dense_params: Dense parameters, without embedding tables.
        accelerator: "cpu" or "cuda".
        notes: Lines the family's planner adds to the report: how train.zero_stage: auto
            was resolved, how many rows of the table would fit at each table precision.
    """

    world_size: int
    per_rank: dict[str, int]
    host_offload: int
    total: int
    table_sizes: tuple[int, ...] = ()
    feature_names: tuple[str, ...] = ()
    num_dense_features: int = 0
    num_dense_params: int = 0
    accelerator: str = "cpu"
    notes: tuple[str, ...] = ()

    def table(self) -> str:
        """A markdown table of the components, for logs and a Prefect artifact.

        Returns:
            A title line, then one row per component and the total, in GiB/MiB and bytes,
            then the host-offload line and the notes, if any.
        """
        lines = [
            f"Memory plan of the worst rank (rank 0 of {self.world_size}, "
            f"accelerator {self.accelerator})",
            "",
            "| component | size | bytes |",
            "|---|---:|---:|",
        ]
        for name in COMPONENTS:
            size = self.per_rank.get(name, 0)
            lines.append(f"| {name} | {human_bytes(size)} | {size:,} |")
        lines.append(f"| **total** | **{human_bytes(self.total)}** | **{self.total:,}** |")
        if self.host_offload:
            where = (
                "included in dense_optimizer: the CPU accelerator shares host memory"
                if self.accelerator == "cpu"
                else "not in the total: CPU memory, not the accelerator's"
            )
            lines += [
                "",
                f"offload_optimizer keeps {human_bytes(self.host_offload)} "
                f"({self.host_offload:,} bytes) of dense optimizer state in CPU memory ({where}).",
            ]
        for note in self.notes:  # a paragraph each in markdown
            lines += ["", note]
        return "\n".join(lines)


def smallest(low: int, high: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest x in [low, high] with ok(x), for ok False...False True...True."""
    if low > high or not ok(high):
        return None
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return low


def largest(low: int, high: int, ok: Callable[[int], bool]) -> int | None:
    """The largest x in [low, high] with ok(x), for ok True...True False...False."""
    if low > high or not ok(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def machine_memory_bytes() -> int:
    """Total physical memory of this machine.

    Returns:
        SC_PAGE_SIZE * SC_PHYS_PAGES in bytes.

    Raises:
        ConfigError: The platform does not report it; set train.memory_per_rank_gb.
    """
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        pages = os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError) as error:
        raise ConfigError(
            f"cannot read this machine's memory ({error}); set train.memory_per_rank_gb"
        ) from error
    if page <= 0 or pages <= 0:
        raise ConfigError(
            "this machine does not report its memory size; set train.memory_per_rank_gb"
        )
    return page * pages


def human_bytes(size: int) -> str:
    """Bytes as GiB from 1 GiB up (two decimals), MiB from 1 MiB up, KiB from 1 KiB up
    (one decimal), else bytes: a small part reads as its size, not as "0.0 MiB"."""
    if size >= GiB:
        return f"{size / GiB:.2f} GiB"
    if size >= MiB:
        return f"{size / MiB:.1f} MiB"
    if size >= KiB:
        return f"{size / KiB:.1f} KiB"
    return f"{size:,} bytes"
