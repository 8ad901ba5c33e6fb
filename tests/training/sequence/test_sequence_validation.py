"""Validation inside sequence training: best-step selection, patience, the curve file, a
2-rank pipeline run killed after its best was saved that resumes to the same best, and
the same run on 2 nodes that share no disk."""

import json
import os
import signal
import socket
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from training.config import EvaluateConfig, TrainConfig
from training.errors import TrainingCrashed
from training.runtime.files import RANKS_FILE
from training.runtime.hosts import node_hosts, save_hostfile
from training.runtime.launcher import NodeLaunch
from training.sequence.evaluate import evaluate_sequence_model, load_split_inputs
from training.sequence.registry import SEQUENCE_MODEL_REGISTRY
from training.sequence.train import train_sequence_model
from training.sequence.validation import (
    CURVE_FILE,
    VALID_SPLIT,
    rank_valid_split,
    read_curve,
    select_best,
    validation_protocol,
    write_curve,
)

REPO = Path(__file__).resolve().parents[3]

# --- select_best: a planted curve -------------------------------------------------------

# Valid NDCG per validation: up to step 30, then 3 validations without improvement (a
# tie with the best at step 50 is no improvement).
PLANTED = [(10, 0.20), (20, 0.31), (30, 0.35), (40, 0.34), (50, 0.35), (60, 0.33)]


def test_the_best_step_is_the_highest_metric_and_a_tie_keeps_the_earlier() -> None:
    selection = select_best(PLANTED, patience=0, metric="ndcg@10_sampled")
    assert (selection.best_step, selection.best_value) == (30, 0.35)
    assert not selection.stop and selection.reason == ""


@pytest.mark.parametrize(
    ("patience", "stops_after"),
    # With patience p, training stops at the p-th validation after step 30's.
    [(1, 40), (2, 50), (3, 60), (4, None)],
)
def test_patience_stops_at_the_planted_validation(patience: int, stops_after: int | None) -> None:
    stopped = None
    for seen in range(1, len(PLANTED) + 1):
        selection = select_best(PLANTED[:seen], patience, "ndcg@10_sampled")
        if selection.stop:
            stopped = PLANTED[seen - 1][0]
            break
    assert stopped == stops_after
    if stopped is not None:
        assert selection.best_step == 30
        assert "did not improve on step 30's 0.35" in selection.reason
        assert f"train.patience={patience}" in selection.reason


def test_select_best_refuses_a_curve_it_cannot_rank() -> None:
    with pytest.raises(ValueError, match="at least one"):
        select_best([], 1, "mrr_sampled")
    with pytest.raises(ValueError, match="not strictly increasing"):
        select_best([(20, 0.1), (10, 0.2)], 1, "mrr_sampled")
    with pytest.raises(ValueError, match="step 20 is NaN"):
        select_best([(10, 0.1), (20, float("nan"))], 1, "mrr_sampled")


def test_the_curve_file_round_trips_and_a_resume_forgets_later_steps(tmp_path: Path) -> None:
    assert read_curve(tmp_path, 100) == []  # a fresh run
    curve = [{"step": s, "epoch": s / 10, "value": v} for s, v in PLANTED]
    write_curve(tmp_path, curve, "ndcg@10_sampled")
    assert read_curve(tmp_path, 60) == curve
    # Resuming from step 40's checkpoint: steps 50 and 60 are trained again.
    assert read_curve(tmp_path, 40) == curve[:4]
    assert not (tmp_path / (CURVE_FILE + ".tmp")).exists()
    (tmp_path / CURVE_FILE).write_text("{")
    with pytest.raises(ValueError, match="is not a valid curve"):
        read_curve(tmp_path, 40)


# --- the in-training metric is evaluate's ----------------------------------------------


@pytest.fixture
def process_group():
    """A one-process gloo group, as the ranks have (rank_valid_split all-gathers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kind", ["sasrec", "bst"])
def test_the_valid_metric_equals_evaluate_on_the_valid_split(
    kind: str, tmp_path: Path, process_group: None
) -> None:
    seq_dir = tmp_path / "seq"
    write_sequences(seq_dir)
    model_config = {
        "model": kind,
        "num_items": NUM_ITEMS,
        "max_length": MAX_LENGTH,
        "hidden_dim": 8,
        "num_blocks": 1,
        "num_heads": 2,
        "dropout": 0.0,
        **({"mlp": [8]} if kind == "bst" else {}),
    }
    torch.manual_seed(0)
    model = SEQUENCE_MODEL_REGISTRY[kind].build_model(model_config).eval()
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "model_config.json").write_text(json.dumps(model_config))
    save_file(model.state_dict(), str(tmp_path / "train" / "model.safetensors"))
    config = TrainConfig(
        model=kind,
        eval_every_epochs=1,
        select_metric="ndcg@5_sampled",
        valid_num_negatives=10,
        valid_negatives_seed=3,
    )
    protocol = validation_protocol(config).model_copy(update={"ranking_block_users": 32})
    inputs = load_split_inputs(VALID_SPLIT, model, model_config, seq_dir)
    value = rank_valid_split(model, inputs, protocol, config.select_metric)
    evaluated = evaluate_sequence_model(protocol, tmp_path / "train", seq_dir, tmp_path / "o")
    assert value == evaluated.metrics["ndcg@5_sampled"]  # bit for bit
    assert evaluated.metrics["num_users"] == USERS and evaluated.metrics["oov_targets"] == 1


# --- a real 2-stage pipeline run, killed and resumed -----------------------------------

NUM_ITEMS, MAX_LENGTH, USERS = 60, 8, 96
TRAIN = {
    "model": "sasrec",
    "sequence": {"hidden_dim": 16, "num_blocks": 2, "num_heads": 2, "dropout": 0.1},
    "batch_size": 8,
    "grad_accum_steps": 2,
    "lr": 0.01,
    # A seed whose micro batches (`micro_batches`: one stream, seeds per micro batch) show
    # the planted fall below as a clear curve: best at step 4, then patience runs out.
    "seed": 1,
    "pipeline_stages": 2,
    "world_size": 2,
    "zero_stage": 1,
    "log_every": 1,
    "tensorboard": True,
    "max_steps": 16,
    "patience": 2,
    # 96 sequences, 16 a step: 6 steps an epoch; every 2/3 epoch is every 4 steps.
    "eval_every_epochs": 2 / 3,
    "select_metric": "ndcg@5_sampled",
    "valid_num_negatives": 20,
    # Retention alone would delete the best checkpoint after the next save.
    "keep_checkpoints": 1,
}


def write_sequences(seq_dir: Path) -> None:
    """Learnable sequences (each item 1-2 after the previous) and a valid split whose
    target is the item half the catalogue away from the last one, which training learns
    to rank low: the valid curve falls after its first point. One valid target is out of
    vocabulary."""
    rng = np.random.default_rng(0)
    histories, targets = [], []
    for _ in range(USERS):
        items = [int(rng.integers(1, NUM_ITEMS))]
        for _ in range(int(rng.integers(3, MAX_LENGTH + 2))):
            items.append(1 + (items[-1] - 1 + int(rng.integers(1, 3))) % (NUM_ITEMS - 1))
        histories.append(items)
        targets.append(1 + (items[-1] - 1 + NUM_ITEMS // 2) % (NUM_ITEMS - 1))
    targets[7] = 0
    seq_dir.mkdir()
    items_type = pa.list_(pa.int64())
    train = {"user": pa.array(range(USERS), pa.int64()), "history": pa.array(histories)}
    pq.write_table(pa.table(train), seq_dir / "train.parquet")
    valid = {
        **train,
        "history": pa.array(histories, items_type),
        "target": pa.array(targets, pa.int64()),
        "ts": pa.array([0] * USERS, pa.int64()),
        "seen": pa.array(
            [sorted({*h, t} - {0}) for h, t in zip(histories, targets, strict=True)], items_type
        ),
    }
    pq.write_table(pa.table(valid), seq_dir / "valid.parquet")
    counts = np.bincount(np.concatenate(histories), minlength=NUM_ITEMS).astype(np.int64)
    np.save(seq_dir / "train_item_counts.npy", counts)
    (seq_dir / "sequences.json").write_text(
        json.dumps({"num_items": NUM_ITEMS, "max_length": MAX_LENGTH})
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(seq_dir: Path, out: Path, root: Path, on_progress=None) -> dict:
    """One real train stage (2 CPU ranks); its summary."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {**os.environ, "PYTHONPATH": ":".join(paths)}
    train_sequence_model(
        TrainConfig(**TRAIN),
        seq_dir,
        out,
        "cpu",
        free_port(),
        env,
        on_progress=on_progress,
        checkpoint_root=root,
    )
    return json.loads((out / "train_summary.json").read_text())


def kill_at(step: int, root: Path):
    sent = []

    def on_progress(record: dict) -> None:
        if record["step"] >= step and not sent:
            os.killpg(json.loads((root / RANKS_FILE).read_text())["pgid"], signal.SIGKILL)
            sent.append(step)

    return on_progress


@pytest.mark.slow
@pytest.mark.chaos
def test_a_killed_run_resumes_to_the_same_best_step_and_weights(tmp_path: Path) -> None:
    seq_dir = tmp_path / "seq"
    write_sequences(seq_dir)
    clean = train(seq_dir, tmp_path / "clean", tmp_path / "clean-root")
    validation = clean["validation"]
    values = {p["step"]: p["value"] for p in validation["curve"]}
    # The planted fall: step 4 is best, steps 8 and 12 exhaust patience 2.
    assert list(values) == [4, 8, 12] and values[4] > max(values[8], values[12])
    assert validation["best_step"] == 4 and validation["best_epoch"] == 4 / 6
    assert validation["stopped_early"] and "train.patience=2" in validation["stop_reason"]
    assert clean["steps"] == 12 and clean["planned_steps"] == 16 and len(clean["losses"]) == 12

    # The valid metric is evaluate's: the same protocol ranks the consolidated (best)
    # weights to the same float.
    evaluated = evaluate_sequence_model(
        EvaluateConfig(split="valid", ks=[5], num_negatives=20, full_ranking=False),
        tmp_path / "clean",
        seq_dir,
        tmp_path / "evaluated",
    )
    assert evaluated.metrics["ndcg@5_sampled"] == validation["best_value"]
    assert evaluated.metrics["num_users"] == USERS and evaluated.metrics["oov_targets"] == 1

    # Killed after the validations of steps 4 and 8 were saved and recorded.
    root = tmp_path / "root"
    with pytest.raises(TrainingCrashed):
        train(seq_dir, tmp_path / "killed", root, kill_at(9, root))
    # keep_checkpoints=1 would have deleted step 4's checkpoint: the best is pinned.
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000008"]
    # As if the kill had come between step 8's checkpoint and its curve record: the
    # resumed run evaluates step 8's checkpoint before it trains on.
    write_curve(root, read_curve(root, 4), "ndcg@5_sampled")

    resumed = train(seq_dir, tmp_path / "resumed", root)
    assert resumed["resumed_from_step"] == 8
    assert resumed["validation"]["curve"] == validation["curve"]
    assert resumed["validation"]["best_step"] == validation["best_step"]
    expected = load_file(tmp_path / "clean" / "model.safetensors")
    actual = load_file(tmp_path / "resumed" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert list((tmp_path / "clean" / "tensorboard").iterdir())  # the valid curve is there


@pytest.mark.slow
@pytest.mark.scaleout
def test_two_nodes_that_share_no_disk_train_the_one_node_pipeline(tmp_path: Path) -> None:
    """2 nodes x 1 rank (a pipeline stage each, launcher 'per_node'), each node its own
    checkpoint and output directories, trading checkpoint files through an exchange
    directory only: the curve, the best step and the weights of 1 node x 2 ranks."""
    seq_dir = tmp_path / "seq"
    write_sequences(seq_dir)
    reference = train(seq_dir, tmp_path / "one-node", tmp_path / "one-node-root")

    config = TrainConfig(**TRAIN, nodes=2, launcher="per_node")
    hostfile = save_hostfile(tmp_path / "hosts", node_hosts(2, 1))
    port, exchange = free_port(), str(tmp_path / "exchange")
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {**os.environ, "PYTHONPATH": ":".join(paths)}
    errors: dict[int, BaseException] = {}

    def node(index: int) -> None:
        try:
            train_sequence_model(
                config,
                seq_dir,
                tmp_path / f"node-{index}" / "out",
                "cpu",
                port,
                env,
                checkpoint_root=tmp_path / f"node-{index}" / "resume",
                node=NodeLaunch(hostfile, 2, 1, "127.0.0.1", node_rank=index, exchange=exchange),
            )
        except BaseException as error:  # noqa: BLE001 - reported below
            errors[index] = error

    threads = [threading.Thread(target=node, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    summary = json.loads((tmp_path / "node-0" / "out" / "train_summary.json").read_text())
    assert summary["validation"]["curve"] == reference["validation"]["curve"]
    assert summary["validation"]["best_step"] == reference["validation"]["best_step"] == 4
    expected = load_file(tmp_path / "one-node" / "model.safetensors")
    actual = load_file(tmp_path / "node-0" / "out" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    # Each node kept its own whole copy of the checkpoints, the pinned best included.
    kept = [
        sorted(p.name for p in (tmp_path / f"node-{i}" / "resume").glob("step-*")) for i in (0, 1)
    ]
    assert kept[0] == kept[1] and "step-00000004" in kept[0], kept
    assert not (tmp_path / "node-1" / "out" / "model.safetensors").exists()  # node 0 writes
