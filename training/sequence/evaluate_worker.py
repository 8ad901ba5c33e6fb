"""One sequence-evaluate rank: `python -m training.sequence.evaluate_worker SPEC.json`.

Reads the launch spec written by `training.sequence.evaluate` (the evaluate config, the
train and sequences directories, the rows the parent counted, the number of ranks,
where the merged result goes), the model and the split's sequences, and ranks this
rank's rows: a contiguous run of whole ranking blocks (`_rank_blocks`), each block
computed as one process computes it (`_rank_rows`).

The ranks join one gloo process group (`deepspeed.init_distributed`, from the
launcher's RANK, WORLD_SIZE, MASTER_ADDR, ...), and rank 0 gathers every rank's per-row
target ranks (`gather_object`), concatenates them in rank order (row order) and writes
them as an .npz to the spec's `result_file` (by rename, so the file is either whole or
absent). Nothing is written before the merge: a rank that fails leaves no result, and
the parent (`evaluate_sequence_model`) computes metrics.json from that file alone.

The only environment this process reads is what the launcher sets for
`deepspeed.init_distributed`; fault injection for the chaos tests arrives in the
spec's `chaos` (`{"kill_rank": r}`: rank r SIGKILLs itself before ranking, as the
out-of-memory killer would). Any exception prints one
`RECFORGE_ERROR {"rank": r, "error": "..."}` line (`training.runtime.rank.rank_main`) and exits
non-zero; the launcher then stops the other ranks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as torch_dist

from data_prep.errors import ConfigError, SchemaError
from training.config import EvaluateConfig
from training.runtime.rank import rank_main
from training.sequence.evaluate import _load_inputs, _rank_blocks, _rank_rows


def run(spec: dict[str, Any]) -> None:
    """Rank one rank's rows of the split; rank 0 merges every rank's ranks and saves them.

    Args:
        spec: The parsed launch spec (written by `training.sequence.evaluate._rank_in_ranks`).

    Raises:
        ConfigError: The launcher started another number of ranks than the spec plans.
        InputNotFoundError: The model, the split's sequences or the item counts are missing.
        SchemaError: The split changed since the parent counted its rows, or the counts
            do not fit the model.
        TooFewNegativesError: A user of this rank has interacted with almost every item.
        ValueError: The model scores NaN.
    """
    config = EvaluateConfig.model_validate(spec["config"])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    if world_size != spec["world_size"]:
        raise ConfigError(
            f"sequence evaluate planned {spec['world_size']} ranks but the launcher started "
            f"{world_size}; the launcher's --num_gpus must equal min(evaluate.workers, blocks)"
        )
    # The ranks share this machine's cores (as one process would use them all).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if spec.get("chaos", {}).get("kill_rank") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    sequences_dir = Path(spec["sequences_dir"])
    inputs = _load_inputs(config, Path(spec["train_dir"]), sequences_dir)
    if len(inputs.targets) != spec["num_rows"]:
        raise SchemaError(
            f"{sequences_dir / (config.split + '.parquet')} has {len(inputs.targets)} rows "
            f"with in-vocabulary targets, the parent counted {spec['num_rows']}: it changed "
            "during the evaluation; rerun evaluate"
        )
    rows = _rank_blocks(len(inputs.targets), config.ranking_block_users, rank, world_size)
    part = _rank_rows(inputs, config, rows.start, rows.stop)
    parts: list[dict[str, np.ndarray] | None] | None = [None] * world_size if rank == 0 else None
    torch_dist.gather_object(part, parts, dst=0)
    if rank == 0:
        assert parts is not None  # rank 0 passed the list above
        merged = {key: np.concatenate([p[key] for p in parts]) for key in part}
        _write_result(Path(spec["result_file"]), merged)
    torch_dist.destroy_process_group()


def _write_result(path: Path, ranks: dict[str, np.ndarray]) -> None:
    """Save the merged ranks to `path` as an .npz, by rename: whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as file:  # a file object: np.savez adds no ".npz" to it
        np.savez(file, **ranks)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.sequence.evaluate_worker SPEC.json` (launcher args
    ignored)."""
    return rank_main(
        "training.sequence.evaluate_worker", lambda path: run(json.loads(path.read_text())), argv
    )


if __name__ == "__main__":
    sys.exit(main())
