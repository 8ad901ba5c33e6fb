"""Issue 38, node workers and heartbeats: every exchange record is bound to its place.

The attacker can write any object under the artifact root and start task runs on the
Prefect API with any tags, but holds no run key. Each test is one attack from the issue
(docs/security.md), written first and seen to succeed against the code before its guard:

- a node run's tag names an exchange under another root: the worker followed it, and
  signed and wrote a failure outcome there with its own credentials;
- a spec that does not verify: the worker signed an outcome anyway (a signing oracle),
  and that outcome, with ``files: {}``, verified as an empty registry package;
- node 0's outcome names no output file: the train stage took it as a success;
- two old signed heartbeats written in turn (seq 5, 3, 5, 3...) kept a dead node alive;
- a signed heartbeat dropped in as the STOP object stopped the attempt;
- a worker with a remote root and no key started serving.
"""

import json
import logging
import uuid
from pathlib import Path

import fsspec
import pytest
from prefect.states import Completed

import tasks.train_nodes as train_nodes
from artifacts.durable import write_json
from artifacts.errors import ConfigError
from artifacts.registry import Registry
from artifacts.signing import KEY_ENV, MisplacedRecord, SignatureError, place, read_verified
from artifacts.store import ArtifactStore
from tasks.common import StageOutput
from training.config import TrainConfig
from training.errors import TrainingCrashed
from training.runtime import exchange as exchange_module
from training.runtime import nodes
from training.runtime.launcher import TrainResult
from training.runtime.memory import MemoryPlan

pytestmark = pytest.mark.security

FP = "ab" * 32
TIMEOUT_S = 30.0


def bucket() -> str:
    """A fresh prefix of an in-memory object store, standing in for a bucket."""
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/root"


def exchange_under(root: str) -> str:
    """A new attempt's exchange under `root`, as the train task names it."""
    return ArtifactStore(root).location("checkpoints", "train", FP, "exchange", uuid.uuid4().hex)


def listing(url: str) -> list[str]:
    """Every object under `url`."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(fs.find(path)) if fs.exists(path) else []


def spec_for(root: str) -> nodes.NodeRunSpec:
    """A two-node attempt on `root`."""
    config = TrainConfig(nodes=2, launcher="per_node", node_dispatch="workers")
    output = StageOutput(stage="shard", status="ran", fingerprint="cd" * 32, output=root)
    return nodes.new_spec(
        config, {"shard": output.model_dump(mode="json")}, ArtifactStore(root), FP
    )


def never_trains(spec: nodes.NodeRunSpec, index: int) -> nodes.NodeOutcome:
    raise AssertionError("the worker trained for a run it should have refused")


def trained(node: int, exchange: str, files: dict[str, str]) -> nodes.NodeOutcome:
    """A completed outcome, as a node of the job signs it."""
    plan = MemoryPlan(world_size=2, per_rank={}, host_offload=0, total=0)
    result = TrainResult(Path("/x"), 0.5, 4, 10.0, 1.0, {}, plan)
    return nodes.NodeOutcome(
        node=node, exchange=exchange, status="completed", result=result, files=files
    )


def test_a_tag_naming_another_root_is_refused_and_nothing_is_written_there():
    ours, theirs = bucket(), bucket()
    genuine = spec_for(ours)
    nodes.write_spec(genuine)
    # The attacker starts train-node-0 with a tag naming their bucket, a copy of a real
    # signed spec planted there.
    exchange = exchange_under(theirs)
    fs, path = fsspec.core.url_to_fs(f"{exchange}/{nodes.SPEC_OBJECT}")
    fs.pipe_file(path, fsspec.open(f"{genuine.exchange}/{nodes.SPEC_OBJECT}").open().read())
    planted = listing(theirs)
    tag = train_nodes.EXCHANGE_TAG + exchange
    with pytest.raises(ConfigError, match="lies under .*but this worker serves") as refused:
        train_nodes.run_worker_node(0, train_nodes.exchange_of([tag]), ours)
    assert theirs in str(refused.value) and ours in str(refused.value)
    assert listing(theirs) == planted  # no outcome, no STOP, no heartbeat written there


@pytest.mark.parametrize("spec_is", ["unsigned", "another attempt's", "missing"])
def test_a_spec_that_does_not_verify_gets_no_signed_outcome(tmp_path, spec_is):
    root = str(tmp_path / "root")
    exchange = exchange_under(root)
    where = Path(exchange) / nodes.SPEC_OBJECT
    if spec_is == "unsigned":
        write_json(where, spec_for(root).to_json() | {"exchange": exchange})
    elif spec_is == "another attempt's":
        other = spec_for(root)
        nodes.write_spec(other)
        where.parent.mkdir(parents=True)
        where.write_bytes((Path(other.exchange) / nodes.SPEC_OBJECT).read_bytes())
    with pytest.raises(SignatureError):
        nodes.run_worker_node(0, exchange, root, never_trains)
    assert not Path(nodes.outcome_location(exchange, 0)).exists()
    assert not (Path(exchange) / nodes.STOP_OBJECT).exists()


def test_an_outcome_with_no_files_does_not_pass_as_a_package(tmp_path):
    root = str(tmp_path)
    exchange = exchange_under(root)
    nodes.write_outcome(exchange, trained(1, exchange, files={}))
    package = tmp_path / "registry" / "ctr" / "v1"
    package.mkdir(parents=True)
    (package / "_manifest.json").write_bytes(Path(nodes.outcome_location(exchange, 1)).read_bytes())
    with pytest.raises(MisplacedRecord, match="exchange-outcome.*package") as refused:
        read_verified(package / "_manifest.json", place=place("package", model="ctr", version="v1"))
    assert "relocated copy" in str(refused.value)
    with pytest.raises(SignatureError):
        Registry(root, "ctr").verify("v1")


def test_node_zero_completed_with_no_files_is_not_a_success(tmp_path, monkeypatch):
    class NoWorker:
        def delay(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return type("Future", (), {"task_run_id": uuid.uuid4()})()

    monkeypatch.setattr(train_nodes, "node_task", lambda index: NoWorker())
    monkeypatch.setattr(train_nodes, "_await_nodes", lambda *args: [Completed(), Completed()])
    config = TrainConfig(nodes=2, launcher="per_node", node_dispatch="workers")
    output = StageOutput(stage="shard", status="ran")
    run = train_nodes.PerNodeRun(
        config, output, output, ArtifactStore(bucket()), FP, {}, logging.getLogger()
    )
    nodes.write_outcome(run.spec.exchange, trained(0, run.spec.exchange, files={}))
    with pytest.raises(TrainingCrashed, match="names no output file"):
        run.run(tmp_path / "out", lambda record: None)
    assert not (tmp_path / "out").exists()


def test_alternating_two_old_heartbeats_does_not_keep_a_node_alive(tmp_path):
    exchange = exchange_under(str(tmp_path))
    where = Path(nodes.heartbeat_location(exchange, 1))
    nodes.write_heartbeat(exchange, 1, 3)
    three = where.read_bytes()
    nodes.write_heartbeat(exchange, 1, 5)
    five = where.read_bytes()
    liveness = nodes.Liveness(exchange, TIMEOUT_S)
    liveness.started(1, now=0.0)
    assert liveness.lost(1, now=1.0) is None  # seq 5: the last real beat, at t=1
    # The node died; the attacker writes its two old heartbeats in turn, 5, 3, 5, 3...
    verdicts = []
    for step in range(1, 6):
        where.write_bytes(three if step % 2 else five)
        verdicts.append(liveness.lost(1, now=1.0 + 10.0 * step))
    assert verdicts[:2] == [None, None]  # silent for 20 s: not yet the timeout
    assert isinstance(verdicts[2], nodes.NodeLost) and "#5" in str(verdicts[2])


def test_records_copied_to_another_node_attempt_or_kind_are_refused(tmp_path, monkeypatch, caplog):
    exchange, earlier = exchange_under(str(tmp_path)), exchange_under(str(tmp_path))
    node_one = Path(nodes.heartbeat_location(exchange, 1))
    # A heartbeat: node 0's copied over node 1's, or node 1's of an earlier attempt.
    nodes.write_heartbeat(exchange, 0, 9)
    nodes.write_heartbeat(earlier, 1, 9)
    for source in (nodes.heartbeat_location(exchange, 0), nodes.heartbeat_location(earlier, 1)):
        node_one.write_bytes(Path(source).read_bytes())
        assert nodes.read_heartbeat(exchange, 1) is None
    # An outcome: node 0's copied over node 1's.
    nodes.write_outcome(exchange, trained(0, exchange, files={"model.safetensors": "0" * 64}))
    copied = Path(nodes.outcome_location(exchange, 0)).read_bytes()
    Path(nodes.outcome_location(exchange, 1)).write_bytes(copied)
    with pytest.raises(MisplacedRecord, match="relocated copy"):
        nodes.read_outcome(exchange, 1)
    # Another kind: a heartbeat, the spec or an outcome dropped in as the STOP object.
    nodes.write_spec(spec_for(str(tmp_path)))
    stop = Path(exchange) / nodes.STOP_OBJECT
    for source in (nodes.heartbeat_location(exchange, 0), nodes.outcome_location(exchange, 0)):
        stop.write_bytes(Path(source).read_bytes())
        nodes._ignored_records.discard(str(stop))
        with caplog.at_level(logging.WARNING):
            assert nodes.read_stop(exchange) is None
        assert "relocated copy" in caplog.text
    # An exchange index: node 0's own, planted as node 1's.
    monkeypatch.setattr(exchange_module, "dist", None)
    url = f"memory://bucket/exchange/{uuid.uuid4().hex}"
    fs, base = fsspec.core.url_to_fs(f"{url}/step-4")
    part = tmp_path / "part"
    part.mkdir()
    (part / "rank-0.pt").write_bytes(b"node 0's part")
    attempt = {"attempt": url, "name": "step-4"}
    exchange_module._upload_own(fs, base, 0, part, attempt)
    fs.pipe_file(f"{base}/node-00001.json", fs.cat_file(f"{base}/node-00000.json"))
    with pytest.raises(MisplacedRecord, match="relocated copy"):
        exchange_module._read_index(fs, base, 1, attempt)


def test_oversized_or_unparseable_small_records_count_as_none(tmp_path, caplog):
    exchange = exchange_under(str(tmp_path))
    Path(exchange).mkdir(parents=True)
    beat = Path(nodes.heartbeat_location(exchange, 1))
    beat.write_text(json.dumps({"seq": 1, "pad": "x" * nodes.SMALL_RECORD_BYTES}))
    with caplog.at_level(logging.WARNING):
        assert nodes.read_heartbeat(exchange, 1) is None
    assert f"larger than {nodes.SMALL_RECORD_BYTES} bytes" in caplog.text
    beat.write_text('{"seq": ' + "9" * 5000 + "}")
    assert nodes.read_heartbeat(exchange, 1) is None
    (Path(exchange) / nodes.STOP_OBJECT).write_bytes(b"\xff\xfe" * 10)
    assert nodes.read_stop(exchange) is None


def test_a_worker_with_a_remote_root_and_no_key_refuses_to_start(monkeypatch):
    import prefect.task_worker

    root = bucket()
    exchange = exchange_under(root)
    for name in (KEY_ENV, "RECFORGE_SIGNING_KEY_FILE", "RECFORGE_SIGNING_KEY_BLOCK"):
        monkeypatch.delenv(name, raising=False)
    served = []
    monkeypatch.setattr(prefect.task_worker, "serve", lambda *a, **k: served.append(a))
    with pytest.raises(ConfigError, match="shared storage"):
        train_nodes.serve_node_worker(0, root)
    assert served == []
    # Nor does a run reach the protocol without it: nothing is read or written.
    with pytest.raises(ConfigError, match="shared storage"):
        nodes.run_worker_node(0, exchange, root, never_trains)
    assert listing(root) == []
