"""Chaos: a pipeline-parallel SASRec run, SIGKILLed then SIGTERMed, resumes bitwise."""

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from artifacts.errors import ConfigError
from training.config import TrainConfig
from training.errors import Preempted, TrainingCrashed
from training.runtime.files import RANKS_FILE
from training.runtime.launcher import launch_ranks, launcher_command
from training.sequence.train import build_pipeline_spec, sequence_model_config

REPO = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

# 2 stages on 2 ranks, dropout on (DeepSpeed reseeds it per micro batch), synthetic data.
SIZES = {"num_items": 200, "max_length": 16}
TRAIN = {
    "model": "sasrec",
    "sequence": {"hidden_dim": 32, "num_blocks": 2, "num_heads": 2, "dropout": 0.1},
    "batch_size": 8,
    "grad_accum_steps": 2,
    "lr": 0.01,
    "seed": 3,
    "pipeline_stages": 2,
    "world_size": 2,
    "zero_stage": 1,
    "log_every": 1,
    "tensorboard": False,
}
STEPS = 24


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(tmp_path: Path, name: str, root: Path | None, on_progress=None, **train) -> dict:
    """One real launch of training.sequence.pipeline_worker on CPU ranks; its summary."""
    out = tmp_path / name
    out.mkdir()
    config = TrainConfig(**{**TRAIN, **train}, checkpoint_every=4 if root else 0)
    spec = build_pipeline_spec(
        config, sequence_model_config(config, SIZES), STEPS, out, checkpoint_root=root
    )
    # One fingerprint for every run, so that another world size meets its own check.
    spec = spec.model_copy(update={"config_fingerprint": "test"})
    spec_path = out / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ":".join(paths)}
    module = "training.sequence.pipeline_worker"
    command = launcher_command(sys.executable, config.world_size, free_port(), module, spec_path)
    owner = root / RANKS_FILE if root else None
    return launch_ranks(command, env, out, None, on_progress, owner)


def signal_at(step: int, root: Path, signum: int):
    sent = []

    def on_progress(record: dict) -> None:
        if record["step"] >= step and not sent:
            os.killpg(json.loads((root / RANKS_FILE).read_text())["pgid"], signum)
            sent.append(step)

    return on_progress


def test_a_killed_and_a_preempted_pipeline_run_resume_to_bitwise_the_same_weights(
    tmp_path: Path,
) -> None:
    clean = train(tmp_path, "clean", None)
    assert clean.get("resumed_from_step") is None and len(clean["losses"]) == 24

    root = tmp_path / "resume"
    with pytest.raises(TrainingCrashed, match="exited with code"):
        train(tmp_path, "killed", root, signal_at(9, root, signal.SIGKILL))
    assert sorted(p.name for p in root.glob("step-*"))[-1] >= "step-00000008"
    with pytest.raises(Preempted, match="stopped by SIGTERM after step") as error:
        train(tmp_path, "preempted", root, signal_at(14, root, signal.SIGTERM))
    preempted_at = int(str(error.value).split("after step ")[1].split(";")[0])
    assert preempted_at >= 14

    resumed = train(tmp_path, "resumed", root)
    assert resumed["resumed_from_step"] == preempted_at
    # The losses it reports are its own steps', and equal the clean run's.
    assert resumed["losses"] == clean["losses"][preempted_at:]
    expected = load_file(tmp_path / "clean" / "model.safetensors")
    actual = load_file(tmp_path / "resumed" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name

    # Pipeline checkpoints are per stage: another world size is refused, not converted.
    with pytest.raises(ConfigError, match="world size and stage count that wrote them"):
        train(tmp_path, "other", root, world_size=1, pipeline_stages=1, zero_stage=0)
