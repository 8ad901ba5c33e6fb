import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from data_prep.errors import InputNotFoundError, SchemaError
from training.config import EvaluateConfig
from training.sequence_evaluate import evaluate_sequence_model
from training.sequence_export import pad_histories
from training.sequence_model import SASRec

ARGS = {
    "num_items": 40,
    "max_length": 5,
    "hidden_dim": 8,
    "num_blocks": 1,
    "num_heads": 2,
    "dropout": 0.0,
}


def write_model(train_dir: Path) -> SASRec:
    torch.manual_seed(0)
    model = SASRec(**ARGS).eval()
    train_dir.mkdir()
    (train_dir / "model_config.json").write_text(json.dumps({"model": "sasrec", **ARGS}))
    save_file(model.state_dict(), str(train_dir / "model.safetensors"))
    return model


def write_sequences(seq_dir: Path, rows: list[dict], counts: np.ndarray) -> None:
    seq_dir.mkdir()
    items = pa.list_(pa.int64())
    table = pa.table(
        {
            "user": pa.array([r["user"] for r in rows], pa.int64()),
            "history": pa.array([r["history"] for r in rows], items),
            "target": pa.array([r["target"] for r in rows], pa.int64()),
            "ts": pa.array([0] * len(rows), pa.int64()),
            "seen": pa.array([sorted({*r["history"], r["target"]}) for r in rows], items),
        }
    )
    pq.write_table(table, seq_dir / "test.parquet")
    np.save(seq_dir / "train_item_counts.npy", counts)


def rows_of(seed: int, users: int, target: int | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(users):
        items = rng.choice(np.arange(1, 40), size=int(rng.integers(2, 9)), replace=False)
        rows.append(
            {
                "user": user,
                "history": items[:-1].tolist(),
                "target": int(items[-1]) if target is None else target,
            }
        )
    return rows


def test_full_ranking_matches_a_hand_computation(tmp_path: Path) -> None:
    model = write_model(tmp_path / "train")
    rows = rows_of(0, 30)
    rows[3]["target"] = 0  # out of vocabulary: dropped and counted
    counts = np.arange(40, dtype=np.int64)
    write_sequences(tmp_path / "seq", rows, counts)
    config = EvaluateConfig(ks=[1, 10], num_negatives=20, ranking_block_users=7)
    result = evaluate_sequence_model(config, tmp_path / "train", tmp_path / "seq", tmp_path / "o")
    metrics = json.loads(result.metrics_path.read_text())
    assert metrics == result.metrics
    assert metrics["num_users"] == 29 and metrics["dropped_oov_targets"] == 1

    kept = [r for r in rows if r["target"]]
    with torch.no_grad():
        # One history at a time (no batching), the last position's state, all items.
        ranks = []
        for r in kept:
            history = pad_histories([r["history"]], ARGS["max_length"])
            scores = model.score(model(history)[:, -1])[0]  # (V,)
            others = [
                item for item in range(1, 40) if item != r["target"] and item not in r["history"]
            ]
            ranks.append(int((scores[others] >= scores[r["target"]]).sum()))
    ranks = np.array(ranks)
    assert metrics["hr@10_full"] == pytest.approx(np.mean(ranks < 10))
    assert metrics["hr@1_full"] == pytest.approx(np.mean(ranks < 1))
    ndcg = np.mean([1 / math.log2(r + 2) if r < 10 else 0.0 for r in ranks])
    assert metrics["ndcg@10_full"] == pytest.approx(ndcg)
    assert metrics["mrr_full"] == pytest.approx(np.mean(1 / (ranks + 1)))
    for key in ("hr@10_sampled", "ndcg@10_sampled", "mrr_sampled"):
        assert 0 <= metrics[key] <= 1 and 0 <= metrics["popularity/" + key] <= 1

    again = evaluate_sequence_model(config, tmp_path / "train", tmp_path / "seq", tmp_path / "p")
    assert again.metrics == result.metrics  # seeded negatives: the same every run


def test_popularity_baseline_is_ranked_under_the_same_protocol(tmp_path: Path) -> None:
    write_model(tmp_path / "train")
    counts = np.ones(40, dtype=np.int64)
    counts[7] = 1000  # every user's target is the most popular item: an oracle
    write_sequences(tmp_path / "seq", rows_of(1, 20, target=7), counts)
    result = evaluate_sequence_model(
        EvaluateConfig(ks=[1], num_negatives=20),
        tmp_path / "train",
        tmp_path / "seq",
        tmp_path / "o",
    )
    assert result.metrics["popularity/hr@1_sampled"] == 1.0
    assert result.metrics["popularity/hr@1_full"] == 1.0
    assert result.metrics["popularity/mrr_full"] == 1.0


def test_missing_inputs_are_named(tmp_path: Path) -> None:
    write_model(tmp_path / "train")
    write_sequences(tmp_path / "seq", rows_of(2, 5), np.ones(40, dtype=np.int64))
    (tmp_path / "seq" / "train_item_counts.npy").unlink()
    with pytest.raises(InputNotFoundError, match="train_item_counts.npy"):
        evaluate_sequence_model(
            EvaluateConfig(), tmp_path / "train", tmp_path / "seq", tmp_path / "o"
        )
    np.save(tmp_path / "seq" / "train_item_counts.npy", np.ones(39, dtype=np.int64))
    with pytest.raises(SchemaError, match="different runs"):
        evaluate_sequence_model(
            EvaluateConfig(), tmp_path / "train", tmp_path / "seq", tmp_path / "o"
        )
