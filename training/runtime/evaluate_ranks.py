"""The evaluate ranks' skeleton, shared by the CTR and the sequence evaluation.

Parent side (`launch_and_collect`): start the family's rank module under DeepSpeed's
launcher on CPU (`launch_evaluate_ranks`: launch spec and launcher log in
`<out_dir>/ranks/`, typed rank errors), read the result rank 0 wrote and delete it (it
holds a part of every row, not an output to publish).

Rank side (`run_evaluate_rank`): join one gloo process group, check the launcher
started the planned number of ranks, share the machine's cores, compute this rank's
part, gather every part on rank 0, merge them in rank order and write the merged
result by rename (whole or absent: a rank that fails leaves no result).

Model-agnostic: what a part is, how parts merge and how the result is written and read
are the family's (`training.ctr.evaluate_worker`, `training.sequence.evaluate_worker`).
The only environment a rank reads is what the launcher sets for
`deepspeed.init_distributed`; fault injection for the chaos tests arrives in the
spec's `chaos` (`{"kill_rank": r}`: rank r SIGKILLs itself before computing, as the
out-of-memory killer would).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import deepspeed
import torch
import torch.distributed as torch_dist

from artifacts.errors import ConfigError
from training.runtime.files import RANKS_DIR
from training.runtime.launcher import (
    evaluate_chaos_settings,
    free_port,
    launch_evaluate_ranks,
    launcher_env,
)

Part = TypeVar("Part")
Result = TypeVar("Result")


@dataclass(frozen=True)
class RankLaunch:
    """How an evaluation starts its ranks: the caller's launch settings.

    Attributes:
        env: The launcher's environment, built by the caller (the libraries read none);
            DS_ACCELERATOR=cpu is added (evaluate runs on CPU). None: the launcher
            inherits this process's environment as it is.
        master_port: A free TCP port for the ranks' rendezvous; None picks one.
        python: The interpreter that runs the launcher.
        on_log: Called with every output line of the launcher and the ranks.
    """

    env: Mapping[str, str] | None = None
    master_port: int | None = None
    python: str = field(default=sys.executable)
    on_log: Callable[[str], None] | None = None


def launch_and_collect(
    spec: dict[str, Any],
    world_size: int,
    out_dir: Path,
    result_name: str,
    module: str,
    deterministic: Mapping[str, type[Exception]],
    doing: str,
    advice: str,
    launch: RankLaunch,
    read: Callable[[Path], Result],
) -> Result:
    """Run `module`'s ranks under the launcher; rank 0's merged result, read and removed.

    Args:
        spec: The family's part of the launch spec (JSON values).
        world_size: Ranks to start.
        out_dir: The stage output; the launch spec, the launcher log and the result go
            to its `ranks/` directory.
        result_name: The file name rank 0 writes the merged result to.
        module: The rank module (`python -m module SPEC.json`).
        deterministic: Rank error type names -> the exception raised for them.
        doing: What the ranks do, for messages ("scoring split 'test' of DIR").
        advice: The other field to lower when a rank dies (besides evaluate.workers).
        launch: The caller's launch settings.
        read: Reads the result file.

    Returns:
        What `read` returned.

    Raises:
        ConfigError: The chaos setting in `launch.env` is not a rank number.
        One of `deterministic`'s types: A rank refused its input (the message names the
            rank and the launcher log).
        TransientError: A rank died, or the launcher failed or left no result.
    """
    result_file = launch_evaluate_ranks(
        spec,
        world_size,
        Path(out_dir) / RANKS_DIR / result_name,
        module,
        deterministic,
        doing,
        advice,
        launcher_env(launch.env, "cpu") if launch.env is not None else None,
        launch.master_port if launch.master_port is not None else free_port(),
        launch.python,
        launch.on_log,
        evaluate_chaos_settings(launch.env or {}),
    )
    result = read(result_file)
    result_file.unlink()  # a part of every row: not an output to publish
    return result


def run_evaluate_rank(
    spec: Mapping[str, Any],
    planned: str,
    compute: Callable[[int, int], Part],
    merge: Callable[[Sequence[Part]], Result],
    write: Callable[[IO[bytes], Result], None],
) -> None:
    """One evaluate rank: compute this rank's part; rank 0 merges all parts and saves them.

    Args:
        spec: The parsed launch spec (`world_size`, `result_file`, `chaos`).
        planned: How the parent chose the number of ranks, for the mismatch message
            ("min(evaluate.workers, files)").
        compute: (rank, world_size) -> this rank's part.
        merge: Every rank's part, in rank order -> the merged result.
        write: Writes the merged result to an open binary file.

    Raises:
        ConfigError: The launcher started another number of ranks than the spec plans.
        Whatever `compute` raises.
    """
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    if world_size != spec["world_size"]:
        raise ConfigError(
            f"evaluate planned {spec['world_size']} ranks but the launcher started "
            f"{world_size}; the launcher's --num_gpus must equal {planned}"
        )
    # The ranks share this machine's cores (as one process would use them all).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if spec.get("chaos", {}).get("kill_rank") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    part = compute(rank, world_size)
    if rank == 0:
        parts: list[Any] = [None] * world_size
        torch_dist.gather_object(part, parts, dst=0)
        _write_by_rename(Path(spec["result_file"]), merge(parts), write)
    else:
        torch_dist.gather_object(part, None, dst=0)
    torch_dist.destroy_process_group()


def _write_by_rename(
    path: Path, result: Result, write: Callable[[IO[bytes], Result], None]
) -> None:
    """Write `result` to `path` through a `.partial` file and a rename: whole or absent.

    Args:
        path: The result file.
        result: What to write.
        write: Writes it to an open binary file.
    """
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as file:
        write(file, result)
    os.replace(partial, path)
