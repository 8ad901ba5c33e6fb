import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from artifacts.errors import InputNotFoundError, TransientError
from data_prep.errors import SchemaError
from training.config import EvaluateConfig
from training.runtime.files import RANKS_DIR
from training.runtime.launcher import CHAOS_KILL_RANK
from training.sequence.bst import BST
from training.sequence.evaluate import evaluate_sequence_model, rank_blocks
from training.sequence.export import pad_histories
from training.sequence.ranking import TooFewNegativesError
from training.sequence.sasrec import SASRec

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
    rows[3]["target"] = 0  # out of vocabulary: a miss, counted
    counts = np.arange(40, dtype=np.int64)
    write_sequences(tmp_path / "seq", rows, counts)
    config = EvaluateConfig(ks=[1, 10], num_negatives=20, ranking_block_users=7)
    result = evaluate_sequence_model(config, tmp_path / "train", tmp_path / "seq", tmp_path / "o")
    metrics = json.loads(result.metrics_path.read_text())
    assert metrics == result.metrics
    assert metrics["num_users"] == 30 and metrics["oov_targets"] == 1

    with torch.no_grad():
        # One history at a time (no batching), the last position's state, all items;
        # the out-of-vocabulary target is in the denominator and contributes 0.
        ranks = []
        for r in rows:
            if r["target"] == 0:
                continue
            history = pad_histories([r["history"]], ARGS["max_length"])
            scores = model.score(model(history)[:, -1])[0]  # (V,)
            others = [
                item for item in range(1, 40) if item != r["target"] and item not in r["history"]
            ]
            ranks.append(int((scores[others] >= scores[r["target"]]).sum()))
    ranks = np.array(ranks)
    assert metrics["hr@10_full"] == pytest.approx(np.sum(ranks < 10) / 30)
    assert metrics["hr@1_full"] == pytest.approx(np.sum(ranks < 1) / 30)
    ndcg = np.sum([1 / math.log2(r + 2) if r < 10 else 0.0 for r in ranks]) / 30
    assert metrics["ndcg@10_full"] == pytest.approx(ndcg)
    assert metrics["mrr_full"] == pytest.approx(np.sum(1 / (ranks + 1)) / 30)
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


BST_ARGS = {**ARGS, "mlp": [8]}


def write_bst_model(train_dir: Path) -> None:
    torch.manual_seed(0)
    model = BST(**BST_ARGS).eval()
    train_dir.mkdir()
    (train_dir / "model_config.json").write_text(json.dumps({"model": "bst", **BST_ARGS}))
    save_file(model.state_dict(), str(train_dir / "model.safetensors"))


def split_with_an_oov_target(tmp_path: Path, kind: str) -> None:
    """30 users, one of them with an out-of-vocabulary target, and the model."""
    (write_bst_model if kind == "bst" else write_model)(tmp_path / "train")
    rows = rows_of(5, 30)
    rows[11]["target"] = 0  # a miss in the middle of a ranking block
    write_sequences(tmp_path / "seq", rows, np.arange(40, dtype=np.int64) % 7)


@pytest.mark.parametrize(
    ("rows", "block", "workers"),
    [(29, 7, 2), (29, 7, 3), (29, 7, 5), (29, 1024, 2), (3, 1, 8), (10, 3, 4)],
)
def test_rank_blocks_cover_the_rows_in_order_on_block_boundaries(
    rows: int, block: int, workers: int
) -> None:
    blocks = -(-rows // block)
    world_size = min(workers, blocks)
    parts = [rank_blocks(rows, block, rank, world_size) for rank in range(world_size)]
    assert [row for part in parts for row in part] == list(range(rows))  # rank order = row order
    assert all(len(part) > 0 and part.start % block == 0 for part in parts)
    sizes = [-(-len(part) // block) for part in parts]
    assert max(sizes) - min(sizes) <= 1  # whole blocks, balanced


def test_a_split_of_one_block_ranks_in_this_process(tmp_path: Path) -> None:
    split_with_an_oov_target(tmp_path, "sasrec")
    config = EvaluateConfig(ks=[1, 5], num_negatives=10, workers=4)  # 30 rows < 1024: 1 block
    result = evaluate_sequence_model(config, tmp_path / "train", tmp_path / "seq", tmp_path / "o")
    assert result.num_users == 30 and result.metrics["oov_targets"] == 1
    assert not (tmp_path / "o" / RANKS_DIR).exists()  # no launcher


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "workers", "world_size"),
    # 30 rows in blocks of 7 are 5 blocks: 2 ranks take 2 and 3 of them; BST with 3
    # workers and blocks of 15 (2 blocks) starts only 2 ranks.
    [("sasrec", 2, 2), ("bst", 3, 2)],
)
def test_ranks_give_the_bit_identical_metrics_of_one_process(
    tmp_path: Path, kind: str, workers: int, world_size: int
) -> None:
    split_with_an_oov_target(tmp_path, kind)
    block = 7 if kind == "sasrec" else 15
    base = {"ks": [1, 5, 10], "num_negatives": 10, "ranking_block_users": block}
    args = (tmp_path / "train", tmp_path / "seq")
    started = time.perf_counter()
    one = evaluate_sequence_model(EvaluateConfig(**base), *args, tmp_path / "one")
    one_s = time.perf_counter() - started
    many = evaluate_sequence_model(
        EvaluateConfig(**base, workers=workers), *args, tmp_path / "many"
    )
    many_s = time.perf_counter() - started - one_s
    print(f"{kind}: 1 process {one_s:.2f}s, {world_size} ranks {many_s:.2f}s")
    metrics_one = json.loads(one.metrics_path.read_text())
    metrics_many = json.loads(many.metrics_path.read_text())
    # Exactly equal (JSON round-trips floats bit for bit), key order included.
    assert list(metrics_many.items()) == list(metrics_one.items())
    assert metrics_many["num_users"] == 30 and metrics_many["oov_targets"] == 1
    assert ("hr@10_full" in metrics_many) == (kind == "sasrec")  # BST: sampled only
    assert "popularity/mrr_sampled" in metrics_many
    spec = json.loads((tmp_path / "many" / RANKS_DIR / "launch.json").read_text())
    assert spec["world_size"] == world_size
    assert not (tmp_path / "one" / RANKS_DIR).exists()  # one process: no launcher
    assert not list((tmp_path / "many" / RANKS_DIR).glob("ranks.npz*"))


@pytest.mark.slow
def test_a_rank_error_comes_back_as_its_type_naming_the_rank(tmp_path: Path) -> None:
    split_with_an_oov_target(tmp_path, "sasrec")
    # 38 negatives: every user has seen more than 1 of the 39 items. The sampler finds
    # it in the ranks, not before the launch.
    config = EvaluateConfig(num_negatives=38, ranking_block_users=7, workers=2)
    with pytest.raises(TooFewNegativesError, match=r"evaluate rank \d of 2: user \d+ has"):
        evaluate_sequence_model(config, tmp_path / "train", tmp_path / "seq", tmp_path / "e")
    assert not (tmp_path / "e" / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.chaos
def test_a_killed_rank_is_transient_and_writes_no_metrics(tmp_path: Path) -> None:
    split_with_an_oov_target(tmp_path, "sasrec")
    out_dir = tmp_path / "e"
    env = {**os.environ, CHAOS_KILL_RANK: "1"}  # rank 1 SIGKILLs itself, as the OOM killer
    config = EvaluateConfig(num_negatives=10, ranking_block_users=7, workers=2)
    with pytest.raises(TransientError, match="evaluate rank died") as error:
        evaluate_sequence_model(config, tmp_path / "train", tmp_path / "seq", out_dir, env=env)
    assert "evaluate.workers" in str(error.value)  # says what to change
    assert not (out_dir / "metrics.json").exists()
    assert not list((out_dir / RANKS_DIR).glob("ranks.npz*"))
