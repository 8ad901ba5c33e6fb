"""Evaluate stage for the sequence models: leave-one-out ranking against a popularity baseline.

Reads `<train_dir>/model_config.json` and `model.safetensors` (a SASRec), and
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
- `split`, `num_users` (rows ranked), `dropped_oov_targets` (rows whose target item is
  out of vocabulary, index 0: no model can rank it, so they are not counted).

The model scores in fp32. SASRec: the user's state is the hidden state at the last
position of its (left-padded) history, and an item's score its dot product with the
tied item table. BST: each candidate is appended to the history and scored by its own
Transformer pass, so only protocol (a) runs (full ranking would take one pass per item
and user). Ties are pessimistic (see `training.ranking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from data_prep.errors import InputNotFoundError, SchemaError
from training.bst import BST, score_candidates
from training.config import EvaluateConfig
from training.model import MODEL_CONFIG_FILE
from training.ranking import ScoreFn, evaluate_ranking, popularity_scores
from training.sequence_export import load_sequence_model, pad_histories
from training.sequence_model import SASRec

METRICS_FILE = "metrics.json"
ITEM_COUNTS_FILE = "train_item_counts.npy"
BASELINE_PREFIX = "popularity/"
# Histories encoded per forward pass when computing the users' states.
_ENCODE_BATCH = 256


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


def user_states(model: SASRec, histories: torch.Tensor, batch: int = _ENCODE_BATCH) -> np.ndarray:
    """The hidden state at the last position of each history, in fp32.

    Args:
        model: The trained model (eval mode).
        histories: (U, L) int64, left-padded with 0.
        batch: Histories per forward pass.

    Returns:
        (U, D) float32.
    """
    states = []
    with torch.no_grad():
        for start in range(0, len(histories), batch):
            states.append(model(histories[start : start + batch])[:, -1].float())  # (b, D)
    return torch.cat(states).numpy()


def model_scores(states: np.ndarray, table: np.ndarray) -> ScoreFn:
    """score_fn of the model for `training.ranking`: users are row indices into `states`.

    Args:
        states: (U, D) float32 user states.
        table: (V, D) float32 item table.

    Returns:
        score_fn(rows (b,), candidates (b, C)) -> (b, C) float32 dot products.
    """

    def score_fn(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        users = states[rows]  # (b, D)
        if candidates.strides[0] == 0:
            # Full ranking hands one row broadcast to every user: one matmul, no gather.
            return users @ table[candidates[0]].T  # (b, C)
        return np.einsum("bd,bcd->bc", users, table[candidates])  # (b, C)

    return score_fn


def bst_scores(model: BST, histories: torch.Tensor) -> ScoreFn:
    """score_fn of a BST: users are row indices into `histories` (U, L).

    Returns:
        score_fn(rows (b,), candidates (b, C)) -> (b, C) float32 logits.
    """

    def score_fn(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = score_candidates(
                model, histories[torch.from_numpy(rows)], torch.from_numpy(candidates)
            )  # (b, C)
        return logits.float().numpy()

    return score_fn


def evaluate_sequence_model(
    config: EvaluateConfig, train_dir: Path, sequences_dir: Path, out_dir: Path
) -> SequenceEvaluateResult:
    """Rank every evaluation row's target with the model and with popularity.

    Args:
        config: The evaluate config (split, ks, num_negatives, negatives_seed,
            full_ranking, ranking_block_users).
        train_dir: The train stage's output (a SASRec).
        sequences_dir: Preprocess's `sequences/` directory.
        out_dir: Where metrics.json goes; created if missing.

    Returns:
        The metrics.

    Raises:
        InputNotFoundError: A model file, the split's sequences or the item counts are
            missing.
        SchemaError: No row has an in-vocabulary target.
        TooFewNegativesError: A user has interacted with almost every item.
    """
    config_path = Path(train_dir) / MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise InputNotFoundError(f"{config_path} does not exist; run the train stage first")
    kind = json.loads(config_path.read_text()).get("model")
    model, model_config = load_sequence_model(train_dir, kind="bst" if kind == "bst" else "sasrec")
    sequences_dir = Path(sequences_dir)
    split_path = sequences_dir / f"{config.split}.parquet"
    counts_path = sequences_dir / ITEM_COUNTS_FILE
    for path in (split_path, counts_path):
        if not path.is_file():
            raise InputNotFoundError(
                f"{path} does not exist; rerun preprocess with preprocess.sequence_length set"
            )
    table = pq.read_table(split_path, columns=["history", "target", "seen"])
    targets = table.column("target").to_numpy()
    kept = np.flatnonzero(targets != 0)
    dropped = len(targets) - len(kept)
    if len(kept) == 0:
        raise SchemaError(
            f"{split_path}: all {len(targets)} targets are out of vocabulary (item 0); "
            "lower the item field's min_count so test items get indices"
        )
    table = table.take(kept)
    targets = targets[kept]
    seen = [np.asarray(items, dtype=np.int64) for items in table.column("seen").to_pylist()]
    histories = pad_histories(table.column("history").to_pylist(), model_config["max_length"])
    num_items = int(model_config["num_items"])
    counts = np.load(counts_path)
    if counts.shape != (num_items,):
        raise SchemaError(
            f"{counts_path} has {counts.shape} counts but the model has {num_items} items; "
            "the train and preprocess outputs are from different runs"
        )

    if kind == "bst":
        score_fn = bst_scores(model, histories)
    else:
        states = user_states(model, histories)
        with torch.no_grad():
            table = model.item_table().float().numpy()  # (V, D), side features included
        score_fn = model_scores(states, table)
    rows = np.arange(len(targets), dtype=np.int64)  # users are row indices (keys negatives)
    protocol = {
        "users": rows,
        "targets": targets,
        "seen": seen,
        "num_items": num_items,
        "ks": config.ks,
        "num_negatives": config.num_negatives,
        "seed": config.negatives_seed,
        "full": config.full_ranking and kind != "bst",
        "block_users": config.ranking_block_users,
    }
    ours = evaluate_ranking(score_fn, **protocol)
    baseline = evaluate_ranking(popularity_scores(counts), **protocol)
    metrics: dict[str, float | int | str] = {
        "split": config.split,
        "num_users": ours.num_users,
        "dropped_oov_targets": int(dropped),
        **ours.metrics,
        **{BASELINE_PREFIX + key: value for key, value in baseline.metrics.items()},
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / METRICS_FILE
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    return SequenceEvaluateResult(
        metrics_path=metrics_path, metrics=metrics, num_users=ours.num_users
    )
