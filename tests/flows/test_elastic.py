"""Elastic resume through `recforge run`: a 2-rank run killed mid-train, rerun on 1 rank.

The resume checkpoints are named by what is trained, not by the layout, so the rerun
with `--set train.world_size=1` finds the killed run's newest checkpoint; the train task
refits the batch split to its global batch and the ranks convert the checkpoint. From
that step on the losses are those of an uninterrupted 1-rank run with that batch split
(within 1e-5: the sums run in another order), for CTR under ZeRO-2 and ZeRO-3 and for
SASRec's pipeline engine.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from data_prep.synthetic import generate_logs
from flows.config import load_config
from training.runtime.files import TRAIN_LOG_FILE

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
TINY_SEQUENCE = str(REPO / "configs" / "tiny-sasrec.yaml")
# Evaluate, export and the gate are not what this is about.
UP_TO_TRAIN = ("--only", "ingest,preprocess,shard,train")
STEPS = 20
COMMON = [f"train.max_steps={STEPS}", "train.checkpoint_every=5", "train.log_every=1"]

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.scaleout]

# (config, overrides of the 2-rank run, what the 1-rank rerun must be refitted to)
CTR_EXACT = ["train.data_streams=2", "train.comm_precision=fp32"]
CASES = {
    # Fixed data streams: the same rows make each step's global batch on any world size.
    # An exact exchange: a half-precision one rounds only where there is a wire, so 2 ranks
    # and 1 would differ slightly.
    "ctr-zero2": (TINY, [*CTR_EXACT, "train.zero_stage=2"], "grad_accum_steps=2"),
    "ctr-zero3": (TINY, [*CTR_EXACT, "train.zero_stage=3"], "grad_accum_steps=2"),
    # One pipeline stage, two data-parallel replicas under ZeRO-0; no dropout (its masks
    # are drawn per replica).
    "sasrec": (
        TINY_SEQUENCE,
        [
            "train.pipeline_stages=1",
            "train.zero_stage=0",
            "train.sequence.dropout=0",
        ],
        "grad_accum_steps=4",
    ),
}


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "raw"
    generate_logs(load_config(TINY, [f"generate.out={out}"]).generate)
    return out


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One artifact root per config: the cases share its data stages."""
    return {config: tmp_path_factory.mktemp("root") for config in (TINY, TINY_SEQUENCE)}


def recforge_run(config: str, root: Path, raw: Path, overrides: list[str]) -> subprocess.Popen:
    """`recforge run CONFIG --root ROOT` up to the train stage, with `overrides`, against
    the tests' Prefect API (a temporary one per run would cost ~14 s each)."""
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
    }
    items = [f"ingest.path={raw}", *COMMON, *overrides]
    sets = [arg for item in items for arg in ("--set", item)]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            config,
            "--root",
            str(root),
            *sets,
            *UP_TO_TRAIN,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, (out + err)[-3000:]
    return json.loads(Path(out.strip().splitlines()[-1]).read_text())


def losses(record: dict) -> dict[int, float]:
    """{step: loss} of the train stage's progress log (train.log_every=1)."""
    log = Path(record["stages"]["train"]["output"]) / TRAIN_LOG_FILE
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_two_rank_run_resumes_on_one_rank_and_continues_its_loss_curve(
    prefect_server: None, case: str, raw: Path, roots: dict[str, Path]
) -> None:
    config, layout, fitted = CASES[case]
    root = roots[config]
    two_ranks = [*layout, "train.world_size=2"]
    victim = recforge_run(config, root, raw, two_ranks)
    deadline = time.monotonic() + 400
    while not list(root.glob("checkpoints/train/*/step-00000005/_manifest.json")):
        assert victim.poll() is None, "".join(victim.communicate())[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)  # the flow
    victim.communicate(timeout=60)
    ranks = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True)
    for pid in ranks.stdout.split():  # the ranks, in a session of their own
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            continue
    killed_at = max(
        int(path.parent.name.removeprefix("step-"))
        for path in root.glob("checkpoints/train/*/step-*/_manifest.json")
    )

    # The rerun asks for 1 rank and nothing else: it resumes the 2-rank checkpoint.
    resumed = finish(recforge_run(config, root, raw, [*layout, "train.world_size=1"]))
    train = resumed["stages"]["train"]
    assert train["status"] == "ran"
    assert train["resumed_from_step"] >= killed_at > 0, train
    assert (train["resumed_from_world_size"], train["world_size"]) == (2, 1), train

    # An uninterrupted 1-rank run with the batch split the rerun was refitted to (the
    # rerun's success removed the checkpoints: nothing to resume).
    assert not list(root.glob("checkpoints/train/*/step-*"))
    reference = finish(
        recforge_run(config, root, raw, [*layout, "train.world_size=1", f"train.{fitted}"])
    )
    assert reference["stages"]["train"]["resumed_from_step"] is None
    expected, continued = losses(reference), losses(resumed)
    steps = sorted(continued)
    assert steps == list(range(train["resumed_from_step"] + 1, STEPS + 1)), steps
    for step in steps:
        assert continued[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step
