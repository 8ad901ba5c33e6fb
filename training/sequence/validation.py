"""Validation inside a sequence model's training: the valid curve, the best step, early stop.

With `train.eval_every_epochs` set, the pipeline ranks (`training.sequence.pipeline_worker`)
rank the valid split every `ValidationSpec.every_steps` optimizer steps and at the last
one, under the test evaluation's protocol (`training.sequence.evaluate`: seeded
negatives, `train.valid_num_negatives` of them, ranking blocks, the out-of-vocabulary
rule; no popularity baseline).
Every rank takes a contiguous run of whole ranking blocks, as the evaluate ranks do, and
all of them gather every rank's per-row ranks in rank order, so every rank computes the
same metric from the same ranks and takes the same decision without a broadcast.

What this module decides, the ranks only carry out:

- `select_best`: the best evaluation (the highest `train.select_metric`, the earlier one
  on a tie) and whether `train.patience` evaluations without improvement have passed;
- `read_curve` / `write_curve`: the valid curve, `validation.json` beside the resume
  checkpoints, replaced by rename (a reader sees the old curve or the new one, never
  half of one), so a resumed run keeps comparing against the best seen before a kill.

Reads the valid split's `valid.parquet` and `train_item_counts.npy` from preprocess's
`sequences/`; writes only `validation.json`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from artifacts.durable import write_json_atomic
from training.config import EvaluateConfig, TrainConfig
from training.sequence.evaluate import SplitInputs, rank_blocks, rank_rows
from training.sequence.ranking import metrics_from_ranks

CURVE_FILE = "validation.json"
VALID_SPLIT = "valid"


class ValidationSpec(BaseModel):
    """How a pipeline run validates (the `valid` of its launch spec); unknown keys refused.

    Derived by the train stage from `train.eval_every_epochs`, `train.select_metric`
    and the data; the ranks read `train.patience` and `train.select_metric` from the
    train config itself.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sequences_dir: Path = Field(description="Preprocess's sequences/ (valid.parquet).")
    every_steps: int = Field(ge=1, description="Optimizer steps between two validations.")
    steps_per_epoch: float = Field(gt=0, description="Optimizer steps per pass over train.")
    protocol: EvaluateConfig = Field(
        description="The ranking protocol: split 'valid', the metric's K and protocol, "
        "the test evaluation's negatives, seed and ranking blocks."
    )


def validation_protocol(config: TrainConfig) -> EvaluateConfig:
    """The valid-split ranking protocol of `train.select_metric`.

    The negatives and their seed are `train.valid_num_negatives` and
    `train.valid_negatives_seed` (the test evaluation's, when kept equal to the evaluate
    section's), the ranking blocks evaluate's default.

    Args:
        config: The train config (`select_metric` is checked at parse time).

    Returns:
        An evaluate config for split "valid" with the metric's K (evaluate's default
        for MRR) and the full protocol only when the metric is a `_full` one.
    """
    k, protocol = config.select_metric_protocol()
    return EvaluateConfig(
        split=VALID_SPLIT,
        ks=[k] if k is not None else EvaluateConfig().ks,
        num_negatives=config.valid_num_negatives,
        negatives_seed=config.valid_negatives_seed,
        full_ranking=protocol == "full",
    )


@dataclass(frozen=True)
class Selection:
    """What the valid curve says so far.

    Attributes:
        best_step: The step of the best evaluation.
        best_value: Its metric.
        stop: Whether training stops now (`patience` evaluations without improvement).
        reason: Why it stops, or "" when it goes on.
    """

    best_step: int
    best_value: float
    stop: bool
    reason: str


def select_best(curve: Sequence[tuple[int, float]], patience: int, metric: str) -> Selection:
    """The best point of a valid curve and whether to stop.

    Higher is better. Only a strictly higher value improves: on a tie the earlier
    step stays best (fewer steps, and the same choice whatever came after).

    Args:
        curve: (step, metric value) per evaluation, in step order; at least one.
        patience: Evaluations without improvement after which training stops; 0 never.
        metric: The metric's name, for the reason.

    Returns:
        The selection.

    Raises:
        ValueError: The curve is empty, out of step order, or holds NaN.
    """
    if not curve:
        raise ValueError("select_best needs at least one evaluation")
    steps = [step for step, _ in curve]
    if steps != sorted(set(steps)):
        raise ValueError(f"the valid curve's steps {steps} are not strictly increasing")
    best_step, best_value = curve[0]
    since_best = 0
    for step, value in curve:
        if np.isnan(value):
            raise ValueError(f"the valid {metric} of step {step} is NaN; the model diverged")
        if value > best_value:
            best_step, best_value, since_best = step, value, 0
        elif step != best_step:
            since_best += 1
    stop = patience > 0 and since_best >= patience
    reason = (
        f"early stop: {metric} did not improve on step {best_step}'s {best_value:.6g} "
        f"in {since_best} validations (train.patience={patience})"
        if stop
        else ""
    )
    return Selection(best_step, float(best_value), stop, reason)


def read_curve(root: Path, up_to_step: int) -> list[dict[str, float]]:
    """The valid curve recorded under `root`, the evaluations after `up_to_step` left out.

    A resumed run continues from the checkpoint of `up_to_step`: evaluations a killed
    run recorded after it belong to steps the resumed run trains again.

    Args:
        root: The resume checkpoints' directory.
        up_to_step: The step the run continues from (0: a fresh start).

    Returns:
        [{"step", "epoch", "value"}] in step order; empty without a curve file.

    Raises:
        ValueError: The file is not a valid curve (named).
    """
    path = root / CURVE_FILE
    if not path.is_file():
        return []
    try:
        curve = json.loads(path.read_text())["curve"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a valid curve ({error}); it is written by rename, so it was "
            "changed by hand: delete it with the checkpoints to start over"
        ) from error
    return [point for point in curve if point["step"] <= up_to_step]


def write_curve(root: Path, curve: list[dict[str, float]], metric: str) -> None:
    """Rank 0: replace `validation.json` under `root` by rename, fsynced.

    Args:
        root: The resume checkpoints' directory (it exists: a checkpoint was saved).
        curve: [{"step", "epoch", "value"}] in step order.
        metric: The metric the values are of.
    """
    write_json_atomic(root / CURVE_FILE, {"metric": metric, "curve": curve})


def rank_valid_split(
    model: nn.Module, inputs: SplitInputs, protocol: EvaluateConfig, metric: str
) -> float:
    """Every rank: the valid split's `metric` of `model`, ranked data-parallel over users.

    Each rank ranks a contiguous run of whole ranking blocks (`rank_blocks`), so every
    row is ranked as one evaluate process ranks it; the ranks' per-row ranks are
    gathered in rank order (row order) on every rank, which all compute the metric.

    Args:
        model: The whole model, in eval mode.
        inputs: The valid split (`load_split_inputs`; its model is replaced by `model`).
        protocol: `validation_protocol(config)`.
        metric: `train.select_metric`.

    Returns:
        The metric, the same float on every rank.

    Raises:
        TooFewNegativesError: A user has interacted with almost every item.
        ValueError: The model scores NaN.
    """
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    num_rows = len(inputs.targets)
    rows = rank_blocks(num_rows, protocol.ranking_block_users, rank, world_size)
    suffix = "full" if protocol.full_ranking else "sampled"
    if len(rows):
        inputs = dataclasses.replace(inputs, model=model)
        ranks = rank_rows(inputs, protocol, rows.start, rows.stop, baseline=False)[suffix]
    else:  # more ranks than ranking blocks: this one has no rows
        ranks = np.empty(0, dtype=np.int64)
    parts: list[np.ndarray | None] = [None] * world_size
    torch.distributed.all_gather_object(parts, ranks)
    merged = np.concatenate([part for part in parts if part is not None])
    return metrics_from_ranks(merged, protocol.ks, suffix)[metric]
