"""One evaluate rank: `python -m training.ctr.evaluate_worker SPEC.json` under the launcher.

Reads the launch spec written by `training.ctr.evaluate` (the `_ScoringPlan` as JSON, the
number of ranks, where the merged result goes), the model in the plan's `train_dir` and
this rank's files of the split: every `world_size`-th file from file `rank`, as one
process would score them (`training.ctr.evaluate._score_files`).

The ranks join one gloo process group (`deepspeed.init_distributed`, from the
launcher's RANK, WORLD_SIZE, MASTER_ADDR, ...), and rank 0 gathers every rank's
accumulators (`gather_object`), merges them in rank order and writes the merged
`_Accumulators` as a pickle to the spec's `result_file` (by rename, so the file is
either whole or absent). Nothing is written before the merge: a rank that fails leaves
no result, and the parent (`evaluate_model`) writes metrics.json from that pickle alone.

The only environment this process reads is what the launcher sets for
`deepspeed.init_distributed`; fault injection for the chaos tests arrives in the
spec's `chaos` (`{"kill_rank": r}`: rank r SIGKILLs itself before scoring, as the
out-of-memory killer would). Any exception prints one
`RECFORGE_ERROR {"rank": r, "error": "..."}` line (`training.runtime.rank.rank_main`) and exits
non-zero; the launcher then stops the other ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as torch_dist

from data_prep.errors import ConfigError
from training.ctr.data import load_dataset_meta
from training.ctr.evaluate import _Accumulators, _score_files, _ScoringPlan
from training.ctr.model import load_model
from training.runtime.rank import rank_main


def run(spec: dict[str, Any]) -> None:
    """Score one rank's files of the split; rank 0 merges every rank's part and saves it.

    Args:
        spec: The parsed launch spec (written by `training.ctr.evaluate._score_in_ranks`).

    Raises:
        ConfigError: The launcher started another number of ranks than the spec plans.
        InputNotFoundError: The model or one of this rank's shard files is missing.
        SchemaError: A shard file lacks a column, or the oracle holds values outside [0, 1].
        ValueError: The model predicts NaN.
    """
    plan = _ScoringPlan.from_json(spec["plan"])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    if world_size != spec["world_size"]:
        raise ConfigError(
            f"evaluate planned {spec['world_size']} ranks but the launcher started "
            f"{world_size}; the launcher's --num_gpus must equal min(evaluate.workers, files)"
        )
    # The ranks share this machine's cores (as one process would use them all).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if spec.get("chaos", {}).get("kill_rank") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    model, _ = load_model(plan.train_dir)
    meta = load_dataset_meta(plan.shards_dir)
    part = _score_files(plan, model, meta, rank, world_size)
    parts: list[_Accumulators | None] | None = [None] * world_size if rank == 0 else None
    torch_dist.gather_object(part, parts, dst=0)
    if rank == 0:
        assert parts is not None  # rank 0 passed the list above
        merged = parts[0]
        for other in parts[1:]:
            merged.merge(other)
        _write_result(Path(spec["result_file"]), merged)
    torch_dist.destroy_process_group()


def _write_result(path: Path, merged: _Accumulators) -> None:
    """Pickle the merged accumulators to `path`, by rename: whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as file:
        pickle.dump(merged, file, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.ctr.evaluate_worker SPEC.json` (launcher args ignored)."""
    return rank_main(
        "training.ctr.evaluate_worker", lambda path: run(json.loads(path.read_text())), argv
    )


if __name__ == "__main__":
    sys.exit(main())
