"""Evaluate stage for the sequence models: leave-one-out ranking against a popularity baseline.

Reads `<train_dir>/model_config.json` and `model.safetensors` (a SASRec or a BST), and
`<sequences_dir>/<split>.parquet` (`user`, `history`, `target`, `seen`) and
`train_item_counts.npy` from preprocess's `sequences/` (see `data_prep.sequences`).
Writes `<out_dir>/metrics.json`:

- `hr@K_sampled`, `ndcg@K_sampled`, `mrr_sampled`: protocol (a), the target against
  `num_negatives` items sampled uniformly from those the user never interacted with
  (seeded: the same negatives every run);
- `hr@K_full`, `ndcg@K_full`, `mrr_full`: protocol (b), against every item, the user's
  other items masked;
- the same keys prefixed `popularity/`: the popularity baseline (train interaction
  counts) ranked in the same run against the same negatives;
- `split`, `num_users` (every row of the split: every evaluated user with a target),
  `oov_targets` (how many of them have a target out of the item vocabulary, index 0:
  an item never seen in training). Such a row is not removed: it is a miss for the
  model and for the baseline alike, 0 towards every HR@K, NDCG@K and MRR, in both
  protocols (`training.sequence.ranking.UNRANKED` says why).

The model scores in fp32. SASRec: the user's state is the hidden state at the last
position of its (left-padded) history, and an item's score its dot product with the
tied item table. BST: each candidate is appended to the history and scored by its own
Transformer pass, so only protocol (a) runs (full ranking would take one pass per item
and user). Each model's scorer and whether it ranks fully come from its entry in
`training.sequence.registry`. Ties are pessimistic (see `training.sequence.ranking`).

The rows (every row, in file order) are ranked in blocks of
`evaluate.ranking_block_users`: a block's histories are encoded and its candidates
scored together, and a row's negatives are keyed by its row number, so a row's ranks
depend only on the block it is in. Ranks: with `evaluate.workers` = P > 1 and a split
of B > 1 blocks, min(P, B) ranks rank the split (more would idle: lower
`evaluate.ranking_block_users` to use more), run as
`python -m training.sequence.evaluate_worker` by DeepSpeed's launcher in one gloo
process group, as the CTR evaluate does (`training.ctr.evaluate`). Rank r takes a
contiguous run of whole blocks (`rank_blocks`), so every block is computed exactly as
in one process; rank 0 gathers the ranks' per-row target ranks (model and popularity,
each protocol) and concatenates them in rank order, which is row order, and this
process computes the metrics from them by the same code as for one process: the
metrics are bit-equal to one process's. The launch spec (`ranks/launch.json`) and the
launcher's output (`ranks/launcher.log`) stay in `out_dir`; nothing is written to
metrics.json unless every rank finished. `evaluate.workers` = 1, or a split of one
block, ranks in this process without a launcher.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from torch import nn

from artifacts.errors import InputNotFoundError, TransientError
from data_prep.errors import SchemaError
from training.config import EvaluateConfig
from training.runtime.evaluate_ranks import RankLaunch, launch_and_collect
from training.runtime.files import RANKS_DIR
from training.runtime.launcher import EVALUATE_RANK_ERRORS
from training.sequence.export import load_sequence_model, pad_histories
from training.sequence.ranking import (
    TooFewNegativesError,
    metrics_from_ranks,
    popularity_scores,
    rank_targets,
)
from training.sequence.registry import SEQUENCE_MODEL_REGISTRY, SequenceModel

METRICS_FILE = "metrics.json"
ITEM_COUNTS_FILE = "train_item_counts.npy"
BASELINE_PREFIX = "popularity/"
# Rank 0's merged per-row ranks (an .npz: arrays only, loaded without pickle).
_RESULT_FILE = "ranks.npz"
_WORKER_MODULE = "training.sequence.evaluate_worker"
# The sampler's "too few negatives" is as deterministic as the CTR ranks' errors.
_RANK_ERRORS: dict[str, type[Exception]] = {
    **EVALUATE_RANK_ERRORS,
    "TooFewNegativesError": TooFewNegativesError,
}


@dataclass(frozen=True)
class SequenceEvaluateResult:
    """Ranking metrics of a sequence model and the popularity baseline on one split.

    Attributes:
        metrics_path: The written metrics.json.
        metrics: Everything metrics.json holds.
        num_users: Evaluation rows ranked.
    """

    metrics_path: Path
    metrics: dict[str, float | int | str]
    num_users: int


def evaluate_sequence_model(
    config: EvaluateConfig,
    train_dir: Path,
    sequences_dir: Path,
    out_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    master_port: int | None = None,
    python: str = sys.executable,
    on_log: Callable[[str], None] | None = None,
) -> SequenceEvaluateResult:
    """Rank every evaluation row's target with the model and with popularity.

    With `config.workers` > 1 the rows are ranked by up to that many DeepSpeed ranks
    (gloo), each taking a contiguous run of whole ranking blocks; their per-row ranks
    are concatenated in row order, which gives exactly the metrics of one process (see
    the module docstring).

    Args:
        config: The evaluate config (split, ks, num_negatives, negatives_seed,
            full_ranking, ranking_block_users, workers).
        train_dir: The train stage's output (a SASRec or a BST).
        sequences_dir: Preprocess's `sequences/` directory.
        out_dir: Where metrics.json goes; created if missing.
        env, master_port, python, on_log: How the ranks start, only used with ranks
            (see `training.runtime.evaluate_ranks.RankLaunch`; this library reads no
            environment: the caller builds `env`).

    Returns:
        The metrics.

    Raises:
        InputNotFoundError: A model file, the split's sequences or the item counts are
            missing.
        SchemaError: Every target is out of vocabulary, or the item counts do not fit
            the model.
        TooFewNegativesError: A user has interacted with almost every item.
        TransientError: A rank died (killed, or out of memory) or the launcher failed.

    A rank's InputNotFoundError, SchemaError, ConfigError, ValueError or
    TooFewNegativesError comes back as the same type, its message prefixed with the rank.
    """
    inputs = _load_inputs(config, Path(train_dir), Path(sequences_dir))
    num_rows, oov_targets = len(inputs.targets), inputs.oov_targets
    num_blocks = -(-num_rows // config.ranking_block_users)
    out_dir = Path(out_dir)
    world_size = min(config.workers, num_blocks)
    if world_size == 1:
        ranks = rank_rows(inputs, config, 0, num_rows)
    else:
        del inputs  # every rank loads its own copy
        launch = RankLaunch(env, master_port, python, on_log)
        ranks = _rank_in_ranks(
            config, Path(train_dir), Path(sequences_dir), num_rows, world_size, out_dir, launch
        )
    metrics = _metrics(config, ranks, num_rows, oov_targets)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / METRICS_FILE
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    return SequenceEvaluateResult(metrics_path=metrics_path, metrics=metrics, num_users=num_rows)


def _metrics(
    config: EvaluateConfig, ranks: dict[str, np.ndarray], num_rows: int, oov_targets: int
) -> dict[str, float | int | str]:
    """metrics.json's content from the per-row target ranks (model and baseline)."""
    # The same metrics code on the same (U,) ranks in row order, whoever ranked them.
    ours = metrics_from_ranks(ranks["sampled"], config.ks, "sampled")
    baseline = metrics_from_ranks(ranks[BASELINE_PREFIX + "sampled"], config.ks, "sampled")
    if "full" in ranks:
        ours |= metrics_from_ranks(ranks["full"], config.ks, "full")
        baseline |= metrics_from_ranks(ranks[BASELINE_PREFIX + "full"], config.ks, "full")
    return {
        "split": config.split,
        "num_users": num_rows,
        "oov_targets": oov_targets,
        **ours,
        **{BASELINE_PREFIX + key: value for key, value in baseline.items()},
    }


@dataclass(frozen=True)
class SplitInputs:
    """What ranking the split's rows needs, loaded and checked (`load_split_inputs`)."""

    entry: SequenceModel  # the model's registry entry (how it ranks)
    model: nn.Module
    max_length: int  # L, histories are left-padded to it
    num_items: int  # V, padding index 0 included
    targets: np.ndarray  # (U,) int64 targets in file order, 0 where out of vocabulary
    histories: list[list[int]]  # U histories, oldest item first
    seen: list[np.ndarray]  # U arrays of the user's items (untruncated)
    counts: np.ndarray  # (V,) train interactions per item
    oov_targets: int  # rows whose target is 0 (ranked as misses, see UNRANKED)


def _load_inputs(config: EvaluateConfig, train_dir: Path, sequences_dir: Path) -> SplitInputs:
    """Load the model, the split's rows and the item counts.

    Raises:
        InputNotFoundError: A model file, the split's sequences or the item counts are
            missing.
        SchemaError: Every target is out of vocabulary, or the counts do not fit the model.
    """
    model, model_config = load_sequence_model(train_dir, kind=None)
    return load_split_inputs(config.split, model, model_config, sequences_dir)


def load_split_inputs(
    split: str, model: nn.Module, model_config: Mapping[str, Any], sequences_dir: Path
) -> SplitInputs:
    """A split's rows and the item counts, ready to rank with `model`.

    Args:
        split: "valid" or "test".
        model: The model (eval mode), from `load_sequence_model` or built in training.
        model_config: Its `model_config.json` (`model`, `num_items`, `max_length`).
        sequences_dir: Preprocess's `sequences/` directory.

    Returns:
        Every row of the split, in file order (out-of-vocabulary targets included).

    Raises:
        InputNotFoundError: The split's sequences or the item counts are missing.
        SchemaError: Every target is out of vocabulary, or the counts do not fit the model.
    """
    split_path = sequences_dir / f"{split}.parquet"
    counts_path = sequences_dir / ITEM_COUNTS_FILE
    for path in (split_path, counts_path):
        if not path.is_file():
            raise InputNotFoundError(
                f"{path} does not exist; rerun preprocess with preprocess.sequence_length set"
            )
    table = pq.read_table(split_path, columns=["history", "target", "seen"])
    targets = table.column("target").to_numpy().astype(np.int64, copy=False)
    oov_targets = int((targets == 0).sum())
    if oov_targets == len(targets):
        # Every row would be a miss: figures of 0 that say nothing about the model.
        raise SchemaError(
            f"{split_path}: all {len(targets)} targets are out of vocabulary (item 0); "
            "lower the item field's min_count so test items get indices"
        )
    num_items = int(model_config["num_items"])
    counts = np.load(counts_path)
    if counts.shape != (num_items,):
        raise SchemaError(
            f"{counts_path} has {counts.shape} counts but the model has {num_items} items; "
            "the train and preprocess outputs are from different runs"
        )
    return SplitInputs(
        entry=SEQUENCE_MODEL_REGISTRY[model_config["model"]],
        model=model,
        max_length=int(model_config["max_length"]),
        num_items=num_items,
        targets=targets,
        histories=table.column("history").to_pylist(),
        seen=[np.asarray(items, dtype=np.int64) for items in table.column("seen").to_pylist()],
        counts=counts,
        oov_targets=oov_targets,
    )


def rank_blocks(num_rows: int, block_users: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s rows: a contiguous run of whole blocks of `block_users` rows.

    Args:
        num_rows: Rows of the split.
        block_users: Rows per ranking block.
        rank, world_size: This rank and the number of ranks.

    Returns:
        The rank's rows.


    Whole blocks, because a row's state and scores are computed with the rest of its
    block (a GEMM's result for a row may depend on the rows around it), so a row ranked
    in its one-process block gets its one-process ranks. Contiguous, so concatenating
    the ranks' rows in rank order is row order. Ranks get floor or ceil of B / P blocks.
    """
    num_blocks = -(-num_rows // block_users)
    first = rank * num_blocks // world_size
    last = (rank + 1) * num_blocks // world_size
    return range(first * block_users, min(last * block_users, num_rows))


def rank_rows(
    inputs: SplitInputs,
    config: EvaluateConfig,
    start: int,
    stop: int,
    *,
    baseline: bool = True,
) -> dict[str, np.ndarray]:
    """Target ranks of rows start..stop-1 (start on a block boundary), model and baseline.

    Args:
        inputs: The split (`load_split_inputs`).
        config: The protocol (num_negatives, negatives_seed, full_ranking,
            ranking_block_users).
        start, stop: The rows to rank.
        baseline: Also rank with popularity (training's validation does not).

    Returns:
        (stop - start,) int64 ranks under "sampled", and "full" when the full protocol
        runs (`evaluate.full_ranking` and a model with `full_ranking` in the registry),
        and with `baseline` the same keys prefixed `popularity/`; `UNRANKED` for a row
        whose target is out of vocabulary, in every protocol and for either scorer.

    Raises:
        TooFewNegativesError: A user has interacted with almost every item.
        ValueError: The model scores NaN.
    """
    block = config.ranking_block_users
    histories = pad_histories(inputs.histories[start:stop], inputs.max_length)  # (n, L)
    score_fn = inputs.entry.ranking_score_fn(inputs.model, histories, start, block)
    protocol = {
        "users": np.arange(start, stop, dtype=np.int64),  # row numbers key the negatives
        "targets": inputs.targets[start:stop],
        "seen": inputs.seen[start:stop],
        "num_items": inputs.num_items,
        "num_negatives": config.num_negatives,
        "seed": config.negatives_seed,
        "full": config.full_ranking and inputs.entry.full_ranking,
        "block_users": block,
    }
    ranks: dict[str, np.ndarray] = {}
    scorers = [("", score_fn)]
    if baseline:
        scorers.append((BASELINE_PREFIX, popularity_scores(inputs.counts)))
    # One rank_targets for both scorers: the same rows, negatives and OOV rule.
    for prefix, fn in scorers:
        result = rank_targets(fn, **protocol)
        ranks[prefix + "sampled"] = result.sampled
        if result.full is not None:
            ranks[prefix + "full"] = result.full
    return ranks


def _rank_in_ranks(
    config: EvaluateConfig,
    train_dir: Path,
    sequences_dir: Path,
    num_rows: int,
    world_size: int,
    out_dir: Path,
    launch: RankLaunch,
) -> dict[str, np.ndarray]:
    """Rank the split in `world_size` launcher ranks; their per-row ranks, in row order.

    Raises:
        InputNotFoundError, SchemaError, ConfigError, DataError, ValueError,
            TooFewNegativesError: A rank refused its input (the message names the rank
            and the launcher log).
        TransientError: A rank died, or the launcher failed or left no result.
    """
    spec = {
        "config": config.model_dump(mode="json"),
        "train_dir": str(train_dir.resolve()),
        "sequences_dir": str(sequences_dir.resolve()),
        "num_rows": num_rows,
    }
    ranks = launch_and_collect(
        spec,
        world_size,
        out_dir,
        _RESULT_FILE,
        _WORKER_MODULE,
        _RANK_ERRORS,
        f"ranking split {config.split!r} of {sequences_dir}",
        "evaluate.ranking_block_users",
        launch,
        _read_ranks,
    )
    short = {key: len(value) for key, value in ranks.items() if len(value) != num_rows}
    if short or "sampled" not in ranks:
        raise TransientError(
            f"rank 0's {out_dir / RANKS_DIR / _RESULT_FILE} holds {short or sorted(ranks)} "
            f"ranks, not {num_rows} per protocol for split {config.split!r} of "
            f"{sequences_dir}; the ranks did not cover the split, rerun"
        )
    return ranks


def _read_ranks(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as saved:
        return {key: saved[key] for key in saved.files}
