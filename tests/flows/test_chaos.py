"""Chaos: the process running the flow is killed during shard, then during train; rerun."""

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

from artifacts.checkpoints import CheckpointStore
from artifacts.gc import collect_garbage
from artifacts.store import CHAOS_PUBLISH_FAULT, ArtifactStore
from data_prep.synthetic import generate_logs
from flows.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
# Long enough that the ranks a SIGKILLed run orphans cannot finish the whole run before
# the next attempt reaps them (each later attempt needs steps left to be preempted in).
# One chain of deltas on the first base, however many of tiny's few hundred rows each
# delta holds (by default a chain holding more than half the table's rows, or 8 deltas,
# is followed by a base) and however many checkpoints the killed run's orphaned ranks
# add before the next attempt reaps them.
RESUMABLE = [
    "train.max_steps=600",
    "train.checkpoint_every=10",
    "train.log_every=10",
    "train.checkpoint_rebase_share=1000",
    "train.checkpoint_max_deltas=1000",
]

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def recforge_run(root: Path, raw: Path, **extra_env: str) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra_env}
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


def test_killing_the_flow_during_shard_and_train_then_rerunning_gives_the_same_model(
    tmp_path: Path,
):
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    reference = finish(recforge_run(tmp_path / "reference", raw))
    shard_fp = reference["stages"]["shard"]["fingerprint"]

    root = tmp_path / "chaos"
    # The flow's process group is SIGKILLed while shard publishes: its files are written
    # and the manifest complete, the staging directory not yet renamed into place.
    victim = recforge_run(root, raw, **{CHAOS_PUBLISH_FAULT: "shard:before-rename"})
    victim.communicate(timeout=600)
    assert victim.returncode == -signal.SIGKILL
    store = ArtifactStore(root)
    assert store.verify("shard", shard_fp) == (
        None,
        f"no output at {store.output_dir('shard', shard_fp)}",
    )
    assert list((root / "stages" / "shard").glob(".staging-*"))  # left, and never used

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

    manifest, _ = store.verify("shard", shard_fp)  # the second run redid shard whole
    reference_manifest, _ = ArtifactStore(tmp_path / "reference").verify("shard", shard_fp)
    assert manifest["files"] == reference_manifest["files"]

    # Preemption: SIGTERM to the flow process alone. It exits in order: its train stage
    # stops the ranks with SIGTERM, and they save a checkpoint at their next step first.
    victim = recforge_run(root, raw)
    deadline = time.monotonic() + 600
    orphans = json.loads(next(root.glob("checkpoints/train/*/.ranks.json")).read_text())
    while json.loads(next(root.glob("checkpoints/train/*/.ranks.json")).read_text()) == orphans:
        assert victim.poll() is None and time.monotonic() < deadline, "no new launch"
        time.sleep(0.2)  # the new launch has reaped the killed run's orphaned ranks
    seen = committed_steps(root)
    while committed_steps(root) == seen:
        assert victim.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.2)
    periodic = max(committed_steps(root))
    # gc with no age limit while the run writes its chain of differential checkpoints:
    # the run's live lease keeps them, and the newest stays a whole resume point.
    during = collect_garbage(str(root), keep_runs=0, older_than_s=0)
    assert not [item for item in during.freed if item.category == "checkpoints"]
    assert during.kept["checkpoints a live lease keeps"] == 1
    checkpoints = CheckpointStore(next(root.glob("checkpoints/train/*/step-*")).parent)
    newest = checkpoints.latest_valid(strict=True)
    assert newest is not None and newest.step >= periodic
    assert newest.chain, "the periodic checkpoint should be a delta on the resumed base"
    victim.send_signal(signal.SIGTERM)
    victim.communicate(timeout=120)
    assert victim.returncode != 0
    assert not ranks_of(root), "the preempted run left ranks behind"
    preempted = max(committed_steps(root))
    assert preempted > periodic  # the checkpoint SIGTERM asked for

    record = finish(recforge_run(root, raw))
    stages = record["stages"]
    assert [stages[s]["status"] for s in ("ingest", "preprocess", "shard")] == ["cached"] * 3
    assert stages["train"]["status"] == "ran"
    assert stages["train"]["resumed_from_step"] == preempted
    # The run record carries the train figures, not only the stage output's summary.
    assert stages["train"]["world_size"] == stages["train"]["resumed_from_world_size"]
    assert stages["train"]["steps"] > preempted and stages["train"]["samples_per_s"] > 0
    assert set(stages["train"]["step_ms"]) and stages["train"]["final_loss"] > 0
    assert stages["train"]["table_precision"] == "fp32"  # the shipped default, recorded
    # Where the resumed run's time to its first step went, by phase.
    startup = stages["train"]["startup_s"]
    assert {"imports", "rendezvous", "table_init", "engine", "reader", "resume"} == set(startup)
    assert all(seconds >= 0 for seconds in startup.values()) and startup["imports"] > 0
    expected = load_file(Path(reference["stages"]["train"]["output"]) / "model.safetensors")
    actual = load_file(Path(stages["train"]["output"]) / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert record["metrics"] == reference["metrics"]
    # The killed attempt's orphaned ranks were stopped, and the spent checkpoints removed.
    assert not list(root.glob("checkpoints/train/*/step-*"))
    assert not ranks_of(root)


def committed_steps(root: Path) -> set[int]:
    """Steps of the committed resume checkpoints of the run under `root`."""
    return {
        int(path.parent.name.removeprefix("step-"))
        for path in root.glob("checkpoints/train/*/step-*/_manifest.json")
    }


def ranks_of(root: Path) -> str:
    """The processes whose command line names `root` (the ranks name their launch spec)."""
    leftover = subprocess.run(["pgrep", "-af", str(root)], capture_output=True, text=True)
    return leftover.stdout.strip()
