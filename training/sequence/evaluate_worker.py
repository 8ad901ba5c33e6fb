"""One sequence-evaluate rank: `python -m training.sequence.evaluate_worker SPEC.json`.

Reads the launch spec written by `training.sequence.evaluate` (the evaluate config, the
train and sequences directories, the rows the parent counted, the number of ranks,
where the merged result goes), the model and the split's sequences, and ranks this
rank's rows: a contiguous run of whole ranking blocks (`rank_blocks`), each block
computed as one process computes it (`rank_rows`). Rank 0 concatenates every rank's
per-row target ranks in rank order (row order) and writes them as an .npz to the
spec's `result_file`; `evaluate_sequence_model` computes metrics.json from it alone.

Everything else a rank does is `training.runtime.evaluate_ranks.run_evaluate_rank`'s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from data_prep.errors import SchemaError
from training.config import EvaluateConfig
from training.runtime.evaluate_ranks import run_evaluate_rank
from training.runtime.rank import rank_main
from training.sequence.evaluate import _load_inputs, rank_blocks, rank_rows


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

    def rank_this_rank(rank: int, world_size: int) -> dict[str, np.ndarray]:
        sequences_dir = Path(spec["sequences_dir"])
        inputs = _load_inputs(config, Path(spec["train_dir"]), sequences_dir)
        if len(inputs.targets) != spec["num_rows"]:
            raise SchemaError(
                f"{sequences_dir / (config.split + '.parquet')} has {len(inputs.targets)} rows, "
                f"the parent counted {spec['num_rows']}: it "
                "changed during the evaluation; rerun evaluate"
            )
        rows = rank_blocks(len(inputs.targets), config.ranking_block_users, rank, world_size)
        return rank_rows(inputs, config, rows.start, rows.stop)

    run_evaluate_rank(spec, "min(evaluate.workers, blocks)", rank_this_rank, _concatenate, _savez)


def _concatenate(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def _savez(file: IO[bytes], ranks: dict[str, np.ndarray]) -> None:
    np.savez(file, **ranks)  # a file object: np.savez adds no ".npz" to it


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.sequence.evaluate_worker SPEC.json` (launcher args
    ignored)."""
    return rank_main(
        "training.sequence.evaluate_worker", lambda path: run(json.loads(path.read_text())), argv
    )


if __name__ == "__main__":
    sys.exit(main())
