"""Chaos: a pipeline-parallel SASRec run, SIGKILLed then SIGTERMed, resumes bitwise; a
data-parallel one resumes on another world size with the same global batch."""

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from artifacts.checkpoints import MANIFEST
from artifacts.errors import ConfigError
from training.config import TrainConfig, resume_layout
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


def train(
    tmp_path: Path,
    name: str,
    root: Path | None,
    on_progress=None,
    steps: int = STEPS,
    fingerprint: str | None = "test",
    **train,
) -> dict:
    """One real launch of training.sequence.pipeline_worker on CPU ranks; its summary.

    `fingerprint` replaces the spec's (one for every run, so that another layout meets
    its own check); None keeps the spec's own.
    """
    out = tmp_path / name
    out.mkdir()
    config = TrainConfig(**{**TRAIN, "checkpoint_every": 4 if root else 0, **train})
    spec = build_pipeline_spec(
        config, sequence_model_config(config, SIZES), steps, out, checkpoint_root=root
    )
    if fingerprint is not None:
        spec = spec.model_copy(update={"config_fingerprint": fingerprint})
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
    # The defaults' time trigger (600 s) saves nothing mid-way through a run this short.
    assert not list((tmp_path / "clean" / "resume").glob("step-*"))

    root = tmp_path / "resume"
    # Killed with the time trigger alone (about every step), the step trigger off.
    with pytest.raises(TrainingCrashed, match="exited with code"):
        train(
            tmp_path, "killed", root, signal_at(9, root, signal.SIGKILL),
            checkpoint_every=0, checkpoint_every_s=0.01,
        )  # fmt: skip
    timed = sorted(p.name for p in root.glob("step-*"))[-1]
    assert timed >= "step-00000008"
    # It resumes from the timed checkpoint (with the step trigger, checkpoint_every=4).
    steps: list[int] = []
    sigterm = signal_at(14, root, signal.SIGTERM)

    def on_progress(record: dict) -> None:
        steps.append(record["step"])
        sigterm(record)

    with pytest.raises(Preempted, match="stopped by SIGTERM after step") as error:
        train(tmp_path, "preempted", root, on_progress)
    assert steps[0] == int(timed.removeprefix("step-")) + 1
    preempted_at = int(str(error.value).split("after step ")[1].split(";")[0])
    assert preempted_at >= 14

    # The defaults (no step trigger) resume, and save nothing before the last step.
    before = sorted(p.name for p in root.glob("step-*"))
    resumed = train(tmp_path, "resumed", root, checkpoint_every=0)
    assert resumed["resumed_from_step"] == preempted_at
    assert sorted(p.name for p in root.glob("step-*")) == before
    # The losses it reports are its own steps', and equal the clean run's.
    assert resumed["losses"] == clean["losses"][preempted_at:]
    expected = load_file(tmp_path / "clean" / "model.safetensors")
    actual = load_file(tmp_path / "resumed" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name

    # The optimizer state is per stage: another stage count is refused, not converted.
    with pytest.raises(ConfigError, match="pipeline_stages=2 and this run has 1"):
        train(tmp_path, "other", root, world_size=1, pipeline_stages=1, zero_stage=0)


def test_two_replicas_resume_on_one_with_twice_the_micro_batches(tmp_path: Path) -> None:
    """ZeRO-0, 1 stage: 2 replicas x 1 micro batch, resumed on 1 rank x 2 micro batches.

    Dropout on: DeepSpeed seeds it from the micro batch counter, which counts the global
    micro batches (`micro_offset`), so the masks follow the micro batch, not the rank.
    """
    layout = {"pipeline_stages": 1, "zero_stage": 0, "grad_accum_steps": 1}
    root = tmp_path / "resume"
    # Uninterrupted, with the real fingerprint: the checkpoint of step 4 (step 8's is the
    # final one), as if the run had died after committing it.
    clean = train(tmp_path, "clean", root, steps=8, fingerprint=None, **layout)
    assert len(clean["losses"]) == 8
    meta = json.loads((root / "step-00000004" / MANIFEST).read_text())["meta"]
    assert (meta["world_size"], meta["global_batch_size"], meta["batch_size"]) == (2, 16, 8)
    # The train stage's fit of one rank to the checkpoint: the same micro batches, twice.
    one = resume_layout(TrainConfig(**{**TRAIN, **layout, "world_size": 1}), meta)
    assert (one.batch_size, one.grad_accum_steps) == (8, 2)
    resumed = train(
        tmp_path, "resumed", root, steps=8, fingerprint=None,
        **{**layout, "world_size": 1, "grad_accum_steps": one.grad_accum_steps},
    )  # fmt: skip
    assert (resumed["resumed_from_step"], resumed["resumed_from_world_size"]) == (4, 2)
    assert resumed["world_size"] == 1 and len(resumed["losses"]) == 4
    assert resumed["losses"] == pytest.approx(clean["losses"][4:], rel=1e-5)
