"""Chaos: a training run killed mid-way resumes from its newest valid checkpoint."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_prep.errors import ConfigError
from training.checkpoint import MANIFEST, CheckpointStore
from training.config import TrainConfig
from training.train import train_model

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

# Lazy Adam rows, AdamW with warmup and decay on ZeRO-2: every piece of state counts.
CONFIG = {
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [16],
    "batch_size": 32,
    "max_steps": 16,
    "warmup_steps": 4,
    "zero_stage": 2,
    "sparse_optimizer": "lazy_adam",
    "world_size": 2,
    "checkpoint_every": 4,
    "log_every": 2,
    "tensorboard": False,
}


class Killed(Exception):
    """Raised from the progress callback: train_model then kills every rank."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu"}


def kill_at(step: int):
    def on_progress(record: dict) -> None:
        if record["step"] >= step:
            raise Killed(f"killed after step {record['step']}")

    return on_progress


def test_killed_runs_resume_to_bitwise_the_same_weights(shards_dir: Path, tmp_path: Path):
    config = TrainConfig(**CONFIG)
    clean = train_model(config, shards_dir, tmp_path / "clean", "cpu", free_port(), env())
    assert clean.resumed_from_step is None
    root = tmp_path / "resume"
    for attempt, step in enumerate((6, 11)):
        with pytest.raises(Killed):
            train_model(
                config,
                shards_dir,
                tmp_path / f"killed{attempt}",
                "cpu",
                free_port(),
                env(),
                on_progress=kill_at(step),
                checkpoint_root=root,
            )
    committed = sorted(p.name for p in root.glob("step-*"))
    assert committed and all((root / name / MANIFEST).is_file() for name in committed)
    resumed = train_model(
        config, shards_dir, tmp_path / "resumed", "cpu", free_port(), env(), checkpoint_root=root
    )
    # The kill lands a little after the progress record: at step 8 or 12.
    assert resumed.resumed_from_step in (8, 12)
    expected = load_file(tmp_path / "clean" / "model.safetensors")
    actual = load_file(tmp_path / "resumed" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    summary = json.loads((tmp_path / "resumed" / "train_summary.json").read_text())
    assert summary["steps"] == 16 and summary["resumed_from_step"] == resumed.resumed_from_step


def test_a_corrupt_newest_checkpoint_falls_back_and_another_config_is_refused(
    shards_dir: Path, tmp_path: Path
):
    config = TrainConfig(**{**CONFIG, "max_steps": 12})
    root = tmp_path / "resume"
    with pytest.raises(Killed):
        train_model(
            config,
            shards_dir,
            tmp_path / "killed",
            "cpu",
            free_port(),
            env(),
            on_progress=kill_at(10),
            checkpoint_root=root,
        )
    newest = CheckpointStore(root).latest_valid()
    assert newest is not None and newest.step == 8
    # Flip one byte of the newest checkpoint's embedding shard: it must not be used.
    victim = newest.path / "sparse-rank-00000-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    lines: list[str] = []
    resumed = train_model(
        config,
        shards_dir,
        tmp_path / "resumed",
        "cpu",
        free_port(),
        env(),
        on_log=lines.append,
        checkpoint_root=root,
    )
    assert resumed.resumed_from_step == 4
    assert any("step-00000008" in line and "sha256" in line for line in lines)

    # A finished run leaves its checkpoints; another learning rate must not resume them.
    with pytest.raises(ConfigError, match="another train config"):
        train_model(
            TrainConfig(**{**CONFIG, "max_steps": 12, "lr": 0.05}),
            shards_dir,
            tmp_path / "other",
            "cpu",
            free_port(),
            env(),
            checkpoint_root=root,
        )


@pytest.mark.parametrize(
    ("before", "after", "zero_stage"),
    [(2, 1, 2), (1, 2, 0)],
    ids=["2-to-1-ranks-zero2-universal", "1-to-2-ranks-zero0"],
)
def test_a_checkpoint_resumes_on_another_world_size(
    make_shards, tmp_path: Path, before: int, after: int, zero_stage: int
):
    shards_dir = make_shards(rows_per_file=1024)
    # Fixed data streams and global batch: every world size sees the same batches.
    common = {
        **CONFIG,
        "max_steps": 28,
        "checkpoint_every": 8,
        "log_every": 1,
        "data_streams": 2,
        "zero_stage": zero_stage,
    }

    def config(world_size: int) -> TrainConfig:
        return TrainConfig(**{**common, "world_size": world_size, "batch_size": 64 // world_size})

    reference: list[dict] = []
    train_model(
        config(before), shards_dir, tmp_path / "ref", "cpu", free_port(), env(),
        on_progress=reference.append,
    )  # fmt: skip
    root = tmp_path / "resume"
    with pytest.raises(Killed):
        train_model(
            config(before), shards_dir, tmp_path / "killed", "cpu", free_port(), env(),
            on_progress=kill_at(10), checkpoint_root=root,
        )  # fmt: skip
    continued: list[dict] = []
    resumed = train_model(
        config(after), shards_dir, tmp_path / "resumed", "cpu", free_port(), env(),
        on_progress=continued.append, checkpoint_root=root,
    )  # fmt: skip
    assert resumed.resumed_from_step == 8
    assert [r["step"] for r in continued] == list(range(9, 29))  # the next 20 steps
    expected = {r["step"]: r["loss"] for r in reference}
    for record in continued:
        assert record["loss"] == pytest.approx(expected[record["step"]], rel=1e-5), record
    if zero_stage:
        assert (root / "universal" / "step-00000008" / "dense").is_dir()
