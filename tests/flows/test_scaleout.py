"""Leaving the single machine, on loopback: two DeepSpeed "nodes" that share no disk.

`train.launcher: per_node` runs one Prefect task run per node, each launching its
node's ranks with `deepspeed --no_ssh --node_rank=i` (master 127.0.0.1) in a working
directory of its own; checkpoints and outputs go to a moto S3 root. The model must be
bitwise the one 1 node x 2 ranks trains: when the node runs are threads of the train
task (also when one node is killed mid-run and the retry resumes both from the
checkpoint in S3), and when each goes to its node's Prefect task worker, a process of
its own with its own current and cache directories. When such a worker dies mid-run,
its silent heartbeat names it lost within the timeout, and with `train.min_nodes` the
retry goes on with the node that is left, continuing the same loss curve on 1 rank.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from artifacts.locations import CACHE_DIR_ENV, read_text_or_none
from artifacts.store import materialize
from data_prep.synthetic import generate_logs
from flows.config import load_config
from tests.flows.test_object_store import (  # noqa: F401 - s3_root is a fixture
    committed_in_s3,
    objects,
    recforge_run,
    s3_environment,
    s3_root,
)
from training.runtime.files import TRAIN_LOG_FILE

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
TWO_NODES = ("train.nodes=2", "train.ranks_per_node=1", "train.launcher=per_node")


def command_lines() -> dict[int, list[str]]:
    """pid -> argv of this user's live processes."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        found[int(cmdline.parent.name)] = [arg.decode(errors="replace") for arg in argv if arg]
    return found


def node_processes(node: int, cache: Path) -> list[int]:
    """The launcher and ranks of `node` (their command lines name its working directory)."""
    marker = f"/node-{node}/out/launch.json"
    return [
        pid
        for pid, argv in command_lines().items()
        if any(arg.startswith(str(cache)) and arg.endswith(marker) for arg in argv)
    ]


def rank_launch_files() -> set[str]:
    """The launch.json of every running CTR rank."""
    return {
        argv[-1]
        for argv in command_lines().values()
        if "training.ctr.worker" in argv and argv[-1].endswith("launch.json")
    }


def train_losses(record: dict) -> dict[int, float]:
    """{step: loss} of the train stage's progress log (a path or a URL)."""
    log = materialize(record["stages"]["train"]["output"]) / TRAIN_LOG_FILE
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def weights_sha256(record: dict) -> str:
    """sha256 of the train stage's model.safetensors (its output: a path or a URL)."""
    local = materialize(record["stages"]["train"]["output"])
    return hashlib.sha256((local / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(raw logs, run record) of the reference: 1 node x 2 ranks, local root, uninterrupted."""
    tmp_path = tmp_path_factory.mktemp("one-node")
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    one = recforge_run(str(tmp_path / "root"), raw, {"RECFORGE_CACHE_DIR": str(tmp_path / "c")})
    out, err = one.communicate(timeout=600)
    assert one.returncode == 0, (out + err)[-3000:]
    return raw, json.loads(Path(out.strip().splitlines()[-1]).read_text())


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.scaleout
def test_two_nodes_killed_one_resume_both_from_s3_and_train_the_one_node_model(
    s3_root: str,  # noqa: F811 - the fixture imported above
    moto_endpoint: str,
    tmp_path: Path,
    one_node: tuple[Path, dict],
) -> None:
    raw, reference = one_node

    # 2 nodes x 1 rank on S3; node 1 is SIGKILLed once a checkpoint is committed in S3.
    cache = tmp_path / "flow-machine"
    run = recforge_run(s3_root, raw, s3_environment(moto_endpoint, cache), TWO_NODES)
    deadline = time.monotonic() + 400
    while not committed_in_s3(s3_root) or len(rank_launch_files()) < 2:
        assert run.poll() is None, "".join(run.communicate())[-3000:]
        assert time.monotonic() < deadline, "no checkpoint reached S3"
        time.sleep(0.3)
    # Node 1's ranks run from its own working directory, not node 0's nor the stage's.
    launch_files = rank_launch_files()
    assert any("/node-1/out/launch.json" in name for name in launch_files), launch_files
    assert any("/stages/train/" in name for name in launch_files), launch_files
    for pid in node_processes(1, cache):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    killed_at = max(max(steps) for steps in committed_in_s3(s3_root).values())
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, (out + err)[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{s3_root}/runs/") and last.endswith("/summary.json")
    record = json.loads(read_text_or_none(last))
    train = record["stages"]["train"]
    assert train["status"] == "ran"
    # The retry resumed both nodes from a checkpoint in S3 (the newest, or a newer one
    # node 0 uploaded before it saw node 1 die).
    assert train["resumed_from_step"] is not None and train["resumed_from_step"] >= killed_at
    assert "node 1" in err or "node-1" in err  # the failed attempt named the node
    # Bitwise the model of 1 node x 2 ranks, and the same cache key (where != what).
    assert weights_sha256(record) == weights_sha256(reference)
    assert train["fingerprint"] == reference["stages"]["train"]["fingerprint"]
    assert record["metrics"] == reference["metrics"]
    # Spent: the checkpoints, the exchange scratch and the nodes' working directories.
    assert objects(f"{s3_root}/checkpoints/train") == []
    assert not list(cache.rglob("nodes/train/*/node-*"))


def start_node_worker(index: int, home: Path, env: dict[str, str], root: str) -> subprocess.Popen:
    """`recforge node-worker --node-rank index --root root` in `home` (its current
    directory, cache and Prefect result storage: a node run takes no parameters and
    nobody reads its result, so the workers need no storage shared with the flow)."""
    home.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "node-worker", "--node-rank", str(index)]
        + ["--root", root],
        cwd=home,
        env={
            **os.environ,
            **env,
            CACHE_DIR_ENV: str(home / "cache"),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "prefect-results"),
            "PYTHONPATH": str(REPO),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        },
        stdout=(home / "worker.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.scaleout
def test_node_runs_go_to_each_nodes_task_worker_a_lost_node_is_found_and_the_rest_go_on(
    prefect_server: None,
    s3_root: str,  # noqa: F811 - the fixture imported above
    moto_endpoint: str,
    tmp_path: Path,
    one_node: tuple[Path, dict],
) -> None:
    raw, reference = one_node
    api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
    env = {**s3_environment(moto_endpoint, tmp_path / "flow-machine"), **api}
    homes = [tmp_path / "node-0", tmp_path / "node-1"]
    workers = [start_node_worker(index, homes[index], {**env}, s3_root) for index in range(2)]
    timeout_s = 10
    try:
        run = recforge_run(
            s3_root,
            raw,
            env,
            (
                *TWO_NODES,
                "train.node_dispatch=workers",
                f"train.node_heartbeat_timeout_s={timeout_s}",
                "train.min_nodes=1",
                # Both "machines" are this one: their ranks share its cores.
                "train.threads_per_rank=1",
            ),
        )
        # Node 1's machine dies once a checkpoint is in S3: its worker and ranks are
        # SIGKILLed (its Prefect run stays "Running"), and no worker takes its place.
        deadline = time.monotonic() + 400
        while not committed_in_s3(s3_root) or len(rank_launch_files()) < 2:
            assert run.poll() is None, "".join(run.communicate())[-3000:]
            assert time.monotonic() < deadline, "no checkpoint reached S3"
            time.sleep(0.3)
        killed_at = max(max(steps) for steps in committed_in_s3(s3_root).values())
        os.killpg(workers[1].pid, signal.SIGKILL)
        for pid in node_processes(1, homes[1] / "cache"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        killed = time.time()
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, (out + err)[-3000:]
    finally:
        for worker in workers:
            try:
                os.killpg(worker.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for worker in workers:
            worker.wait(timeout=60)
    record = json.loads(read_text_or_none(out.strip().splitlines()[-1]))
    train = record["stages"]["train"]
    assert train["status"] == "ran"
    # The first attempt failed naming node 1, lost by its silent heartbeat, within the
    # timeout plus a margin (polls, the other node's stop); the retry went on with node 0
    # alone (train.min_nodes=1), resuming the 2-rank checkpoint from S3 on 1 rank.
    assert len(train.get("failed_attempts", [])) == 1, (train, err[-6000:])
    (failed,) = train["failed_attempts"]
    assert [lost["node"] for lost in failed["lost_nodes"]] == [1], failed
    assert "no heartbeat for" in failed["lost_nodes"][0]["why"], failed
    failed_after = datetime.fromisoformat(failed["at"]).timestamp() - killed
    assert failed_after < timeout_s + 20, failed_after
    assert train["resumed_from_step"] is not None and train["resumed_from_step"] >= killed_at
    assert (train["resumed_from_world_size"], train["world_size"]) == (2, 1), train
    # Same global batch, same data streams: the loss curve of 1 node x 2 ranks goes on.
    expected, continued = train_losses(reference), train_losses(record)
    assert continued and set(continued) <= set(expected), (continued, expected)
    for step, loss in continued.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    # Node i's ranks ran under its worker's own cache, launched by that worker alone.
    for index, home in enumerate(homes):
        log = (home / "worker.log").read_text()
        cache = home / "cache"
        work = re.escape(f"{cache}/s3/{s3_root.removeprefix('s3://')}/nodes/train/")
        assert f"train-node-{index}" in log and f"train-node-{1 - index}" not in log, log[-3000:]
        assert re.search(f"{work}[0-9a-f]{{64}}/node-{index}/out/launch.json", log), log[-3000:]
    assert "spawned with command" not in err  # no DeepSpeed launch on the flow's machine
    assert objects(f"{s3_root}/checkpoints/train") == []

    # No worker for the nodes: the stage fails once, naming each node, and waits no more.
    started = time.monotonic()
    again = recforge_run(
        s3_root,
        raw,
        env,
        (*TWO_NODES, "train.node_dispatch=workers", "train.node_pickup_timeout_s=5"),
        ("--force", "train"),
    )
    out, err = again.communicate(timeout=300)
    assert again.returncode != 0
    assert "node 0: no task worker took its run (train-node-0) within 5 s" in err, err[-3000:]
    assert "recforge node-worker --node-rank 0" in err
    assert "AwaitingRetry" not in err and time.monotonic() - started < 200, err[-3000:]
