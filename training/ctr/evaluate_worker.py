"""One CTR evaluate rank: `python -m training.ctr.evaluate_worker SPEC.json` under the launcher.

Reads the launch spec written by `training.ctr.evaluate` (the `_ScoringPlan` as JSON, the
number of ranks, where the merged result goes), the model in the plan's `train_dir` and
this rank's files of the split: every `world_size`-th file from file `rank`, as one
process would score them (`training.ctr.evaluate._score_files`). Rank 0 merges every
rank's accumulators in rank order and writes the merged `_Accumulators` to the spec's
`result_file` as an .npz (`training.ctr.evaluate.write_accumulators`: arrays and a JSON
skeleton, no pickle); `evaluate_model` writes metrics.json from that file alone.

Everything else a rank does is `training.runtime.evaluate_ranks.run_evaluate_rank`'s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from training.ctr.data import load_dataset_meta
from training.ctr.evaluate import _Accumulators, _score_files, _ScoringPlan, write_accumulators
from training.ctr.model import load_model
from training.runtime.evaluate_ranks import run_evaluate_rank
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

    def score(rank: int, world_size: int) -> _Accumulators:
        model, _ = load_model(plan.train_dir)
        return _score_files(plan, model, load_dataset_meta(plan.shards_dir), rank, world_size)

    run_evaluate_rank(spec, "min(evaluate.workers, files)", score, _merge, write_accumulators)


def _merge(parts: Sequence[_Accumulators]) -> _Accumulators:
    merged = parts[0]
    for other in parts[1:]:
        merged.merge(other)
    return merged


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.ctr.evaluate_worker SPEC.json` (launcher args ignored)."""
    return rank_main(
        "training.ctr.evaluate_worker", lambda path: run(json.loads(path.read_text())), argv
    )


if __name__ == "__main__":
    sys.exit(main())
