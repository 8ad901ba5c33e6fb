"""Chaos: the process running the flow is killed during training; `recforge run` again."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_prep.synthetic import generate_logs
from flows.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
RESUMABLE = ["train.max_steps=120", "train.checkpoint_every=10", "train.log_every=10"]

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def recforge_run(root: Path, raw: Path) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # each run starts its own temporary Prefect API
    overrides = [arg for item in [f"ingest.path={raw}", *RESUMABLE] for arg in ("--set", item)]
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", TINY, "--root", str(root), *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its group: the flow and its temporary Prefect server
    )


def finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, (out + err)[-3000:]
    return json.loads(Path(out.strip().splitlines()[-1]).read_text())


def test_killing_the_flow_during_train_then_rerunning_gives_the_same_model(tmp_path: Path):
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    reference = finish(recforge_run(tmp_path / "reference", raw))

    root = tmp_path / "chaos"
    victim = recforge_run(root, raw)
    deadline = time.monotonic() + 300
    # Kill the flow's processes once the first resume checkpoint exists.
    while not list(root.glob("checkpoints/train/*/step-00000010/_manifest.json")):
        assert victim.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    # The flow process and its Prefect server die; the ranks, in a session of their own
    # (as the train stage starts them), live on until the rerun stops them.
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=60)

    record = finish(recforge_run(root, raw))
    stages = record["stages"]
    assert [stages[s]["status"] for s in ("ingest", "preprocess", "shard")] == ["cached"] * 3
    assert stages["train"]["status"] == "ran" and stages["train"]["resumed_from_step"] >= 10
    expected = load_file(Path(reference["stages"]["train"]["output"]) / "model.safetensors")
    actual = load_file(Path(stages["train"]["output"]) / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert record["metrics"] == reference["metrics"]
    # The killed attempt's orphaned ranks were stopped, and the spent checkpoints removed.
    assert not list(root.glob("checkpoints/train/*/step-*"))
    leftover = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
