"""launcher 'per_node': one Prefect task run per node, each launching its node's ranks.

Every node has a working directory of its own (its resume checkpoints, and for nodes
other than 0 the output directory the ranks need but nobody keeps); the nodes share
only the artifact root. There, `<root>/checkpoints/train/<key>` holds the resume
checkpoints (node 0 uploads them; every node pulls the newest before its ranks start,
dropping local ones that never got there, so all resume from one step) and
`.../exchange/<attempt>` the files the ranks trade (`training.runtime.exchange`), a
signed `STOP` object once any node has failed, and with node task workers the signed
`spec.json` of the attempt, each node's signed `outcome-<I>.json` and the output node 0
trained. Node 0 writes the stage's output. If one node fails, the others stop and the
train task fails as a whole; its retry resumes every node from the shared checkpoint.

Where the node task runs go (`train.node_dispatch`):
- 'local': threads of the train task, on this machine (one machine; the loopback test).
- 'workers': Prefect task workers, one per node (`recforge node-worker --node-rank I`,
  started on that node against the same Prefect API). Each node's task has a key of
  its own (`train_node_<I>`), so node I's run reaches node I's worker and node 0's the
  machine at `train.master_addr`. A node whose worker does not take its run within
  `train.node_pickup_timeout_s` fails the stage naming the node, without retries.

What travels how, with workers: shared storage is not trusted (docs/security.md), and
Prefect reads a background task's stored parameters and result with whatever serializer
the stored record names, cloudpickle included, so no node run has Prefect parameters
and nobody reads a node run's Prefect result. The train task writes the attempt's
`NodeRunSpec` as signed JSON (`spec.json`) and tags each node run with the exchange
(`recforge-exchange:<url>`, kept by the Prefect API, not by storage); the worker reads
and verifies the spec, and each node leaves a signed `NodeOutcome` (node 0: its
`TrainResult`, progress and output files with their sha256), which the train task
verifies before it trusts a name in it. Everything is rebuilt with pydantic validation.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.exceptions import ObjectNotFound
from prefect.futures import PrefectFuture, wait
from prefect.settings import PREFECT_API_URL
from prefect.states import State
from pydantic import TypeAdapter, ValidationError

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.durable import write_json
from artifacts.errors import (
    ConcurrentUpdate,
    ConfigError,
    CorruptOutput,
    DataError,
    DeterministicError,
    InputNotFoundError,
    StoreUnreachable,
)
from artifacts.locations import (
    UnsafeName,
    check_name,
    download_files,
    is_remote,
    join,
    read_text_or_none,
    upload_files,
)
from artifacts.signing import SIGNATURE, SignatureError, loads_verified, sign
from artifacts.store import ArtifactStore, describe_files
from tasks.common import StageOutput, load_run_key, upstream_dirs
from tasks.progress import format_resume_line, train_progress
from training.config import TrainConfig
from training.errors import ParityError, Preempted, TrainingCrashed
from training.runtime.hosts import node_hosts, read_hostfile, save_hostfile
from training.runtime.launcher import (
    ERROR_PREFIX,
    RESUME_PREFIX,
    NodeLaunch,
    TrainResult,
    free_port,
    is_protocol_line,
    parse_record,
)
from training.stages import train_launch

# How often a node looks for the STOP object, and the train task at its node runs.
POLL_S = 2.0


# Once a node has failed, how long the others get to stop and report (their ranks get
# 60 s to save a checkpoint after SIGTERM) before the train task gives up on them.
STOP_WAIT_S = 150.0


STOP_OBJECT = "STOP"


# A STOP object's message is kept this short: it ends up in every node's error and log.
STOP_MESSAGE_CHARS = 300


SPEC_OBJECT = "spec.json"


# Each node's liveness, in its attempt's exchange (`write_heartbeat`).
HEARTBEAT_OBJECT = "heartbeat-{node}.json"


# A node beats every timeout / HEARTBEATS_PER_TIMEOUT seconds, at most every MAX_BEAT_S.
HEARTBEATS_PER_TIMEOUT = 6
MAX_BEAT_S = 20.0


OUTPUT_PREFIX = "output"


# The tag that tells a node's worker where its attempt's exchange is (see the docstring).
EXCHANGE_TAG = "recforge-exchange:"


# An attempt's exchange: `<root>/checkpoints/train/<key>/exchange/<uuid4 hex>`.
_EXCHANGE = re.compile(r"^(?P<root>.+)/checkpoints/train/[0-9a-f]+/exchange/[0-9a-f]{32}$")


# STOP objects and heartbeats found forged, each logged once per process.
_ignored_records: set[str] = set()


Logger = logging.Logger | logging.LoggerAdapter


class NodeUnavailable(DeterministicError):
    """A node's task run was not taken by its worker in time (retrying would wait again)."""


class NodeLost(TrainingCrashed):
    """A started node stopped beating (its worker or machine died): the retry resumes."""


# Failed attempts of the train stage in one flow run, kept beside the nodes' working
# directories so that the attempt that succeeds can name the nodes lost before it (the
# run record's `failed_attempts`) and a retry can go on without them (train.min_nodes).
# Per flow run: a new run starts with every node.
ATTEMPTS_FILE = "failed-attempts-{run}.jsonl"


def attempts_file(work: Path) -> Path:
    """This flow run's failed-attempts file under `work`."""
    from prefect.runtime import flow_run

    return work / ATTEMPTS_FILE.format(run=flow_run.id or "no-flow")


@dataclass(frozen=True)
class NodeRunSpec:
    """What every node of one attempt needs; JSON (`to_json`), for a task worker elsewhere.

    Attributes:
        config: The train config (launcher 'per_node').
        shard: The shard stage's output.
        preprocess: The preprocess stage's output (the family picks what it reads).
        root: The artifact root (an object-store URL when nodes are other machines).
        fp: The train stage's resume key (`TrainConfig.resume_keyed`): names the resume
            checkpoints and the nodes' working directories, whatever the layout.
        exchange: This attempt's scratch prefix (`<root>/checkpoints/train/<fp>/exchange/<id>`).
        hosts: The hostfile's (host, slots) of each node of this attempt.
        port: The rendezvous port on `config.master_addr`.
        workers: The worker (`recforge node-worker --node-rank W`) of each node of this
            attempt; None: node I's is worker I. Another list after `train.min_nodes`
            let a retry go on without lost nodes.
    """

    config: TrainConfig
    shard: StageOutput
    preprocess: StageOutput
    root: str
    fp: str
    exchange: str
    hosts: list[tuple[str, int]]
    port: int
    workers: list[int] | None = None

    def worker_of(self, node: int) -> int:
        """The worker that serves node `node` of this attempt."""
        return node if self.workers is None else self.workers[node]

    def node_of(self, worker: int) -> int:
        """The node worker `worker` runs in this attempt.

        Raises:
            ConfigError: The attempt has no node for it (the run reached the wrong worker).
        """
        if self.workers is None:
            return worker
        if worker not in self.workers:
            raise ConfigError(
                f"worker {worker} has no node in this attempt (its workers: {self.workers})"
            )
        return self.workers.index(worker)

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON-serializable data (the config via its pydantic dump)."""
        return _SPEC.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, record: Any) -> "NodeRunSpec":
        """The spec `to_json` gave, validated (the config and outputs by pydantic).

        Raises:
            pydantic.ValidationError: A field is missing, unknown to the config or mistyped.
        """
        return _SPEC.validate_python(record)


_SPEC = TypeAdapter(NodeRunSpec)


@dataclass(frozen=True)
class NodeOutcome:
    """What a node's task run leaves in the exchange for the train task (signed JSON).

    Attributes:
        node: The node.
        exchange: The attempt's exchange (an outcome copied from another attempt, signed
            with the same key, is refused).
        status: Whether its ranks trained to the end.
        result: Node 0's TrainResult (its `out_dir` is the worker's; None elsewhere).
        history: Node 0's progress records, in order.
        files: Node 0's output files under `<exchange>/output`: {name: sha256}.
        error: A failed node's exception type name.
        deterministic: Whether that error is a DeterministicError (no retry helps).
        message: The error's message, cut short.
    """

    node: int
    exchange: str
    status: Literal["completed", "failed"]
    result: TrainResult | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    error: str = ""
    deterministic: bool = False
    message: str = ""


_OUTCOME = TypeAdapter(NodeOutcome)


# A failed node's error comes back by name; these are rebuilt as themselves, others as
# DeterministicError or TrainingCrashed (by the outcome's `deterministic`).
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    kind.__name__: kind
    for kind in (
        ConfigError,
        InputNotFoundError,
        DataError,
        CorruptOutput,
        StoreUnreachable,
        ConcurrentUpdate,
        SignatureError,
        UnsafeName,
        ParityError,
        TrainingCrashed,
        Preempted,
    )
}


def failed_attempts_before(store: ArtifactStore, key: str) -> list[dict[str, Any]]:
    """The attempts of the train stage (resume key `key`) that failed on this machine."""
    return read_failed_attempts(store.root / "nodes" / "train" / key)


def node_work_dir(root: str, fp: str, index: int) -> Path:
    """Node `index`'s working directory on the machine it runs on."""
    return ArtifactStore(root).root / "nodes" / "train" / fp / f"node-{index}"


class PerNodeRun:
    """One attempt of a per-node train run, from the train task.

    Args:
        config: The train config (launcher 'per_node').
        shard: The shard stage's output.
        preprocess: The preprocess stage's output.
        store: The artifact store.
        fp: The train stage's resume key.
        env: The launcher's environment (dispatch 'local'; a worker uses its own).
        logger: The train task's logger.
    """

    def __init__(
        self,
        config: TrainConfig,
        shard: StageOutput,
        preprocess: StageOutput,
        store: ArtifactStore,
        fp: str,
        env: dict[str, str],
        logger: Logger,
        workers: list[int] | None = None,
    ) -> None:
        workers = workers or list(range(config.nodes))
        every = max(workers) + 1
        hosts = (
            read_hostfile(Path(config.hostfile), every, config.node_ranks())
            if config.hostfile
            else node_hosts(every, config.node_ranks())
        )
        self.spec = NodeRunSpec(
            config=config,
            shard=shard,
            preprocess=preprocess,
            root=store.url,
            fp=fp,
            exchange=store.location("checkpoints", "train", fp, "exchange", uuid.uuid4().hex),
            hosts=[hosts[worker] for worker in workers],
            port=config.master_port or free_port(),
            workers=None if workers == list(range(config.nodes)) else workers,
        )
        self.work = store.root / "nodes" / "train" / fp
        self.env = env
        self.logger = logger
        self.lost: dict[int, str] = {}

    def run(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """Run every node; node 0's result, its output in `out_dir`.

        Raises:
            The first failed node's deterministic error (a config or data problem is
            found by every node alike); NodeUnavailable when a node's worker never took
            its run; else TrainingCrashed naming each failed node.
        """
        try:
            if self.spec.config.node_dispatch == "workers":
                result = self._run_on_workers(out_dir, on_progress)
            else:
                result = self._run_here(out_dir, on_progress)
        except Exception as error:
            record_failed_attempt(self.work, error, self.lost)
            raise
        shutil.rmtree(self.work, ignore_errors=True)
        return result

    def _run_here(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """dispatch 'local': every node a task run in a thread of this process."""
        launch = train_launch(
            self.spec.config, upstream_dirs(self.spec.shard, self.spec.preprocess)
        )
        stop = threading.Event()
        futures = [
            train_node_task.submit(
                index,
                partial(
                    run_node,
                    self.spec,
                    index,
                    launch,
                    out_dir if index == 0 else None,
                    self.env,
                    self.logger,
                    on_progress if index == 0 else None,
                    stop,
                    log_ranks=index == 0,
                ),
            )
            for index in range(self.spec.config.nodes)
        ]
        # The threads end when their ranks do; once one has failed (and stopped the
        # others) the rest get STOP_WAIT_S, so that no path waits without a deadline.
        done, pending = wait(futures, timeout=POLL_S)
        while pending and not stop.is_set():
            done, pending = wait(futures, timeout=POLL_S)
        if pending:
            done, pending = wait(futures, timeout=STOP_WAIT_S)
        failures: list[tuple[int, BaseException]] = []
        for index, future in enumerate(futures):
            if future in pending:
                late = f"node {index}: did not stop within {STOP_WAIT_S:.0f} s of the stop"
                failures.append((index, TrainingCrashed(late)))
                continue
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - reported below, per node
                failures.append((index, error))
        _raise_failures(failures, self.spec.config.nodes)
        result = futures[0].result()
        assert result is not None  # node 0 collects
        return result

    def _run_on_workers(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """dispatch 'workers': every node a task run for its node's task worker."""
        spec = self.spec
        nodes = spec.config.nodes
        futures = send_node_runs(spec)
        self.logger.info(
            "sent train-node-0 .. train-node-%d to the nodes' task workers "
            "(`recforge node-worker --node-rank I`); waiting up to %.0f s for each to start",
            nodes - 1,
            spec.config.pickup_timeout_s(),
        )
        states = _await_nodes(futures, spec, self.logger)
        self.lost = {
            spec.worker_of(i): str(s) for i, s in enumerate(states) if isinstance(s, NodeLost)
        }
        failures: list[tuple[int, BaseException]] = []
        for index, state in enumerate(states):
            if isinstance(state, BaseException):
                failures.append((index, state))
            elif not state.is_completed():
                failures.append((index, _node_error(spec.exchange, index, state)))
        _raise_failures(failures, nodes)
        outcome = read_outcome(spec.exchange, 0)
        if outcome is None or outcome.result is None:
            raise TrainingCrashed(
                f"node 0: its run completed but left no result at "
                f"{outcome_location(spec.exchange, 0)}"
            )
        fetch_output(spec.exchange, outcome.files, out_dir)
        for record in outcome.history:
            on_progress(record)
        return replace(outcome.result, out_dir=out_dir)


def send_node_runs(spec: NodeRunSpec) -> list[PrefectFuture]:
    """Write the attempt's signed spec, then one run per node for the nodes' task workers.

    The runs take no parameters (a worker would read them from storage, see the module
    docstring); each is tagged with the exchange, where its worker finds the spec.
    """
    write_json(join(spec.exchange, SPEC_OBJECT), sign(spec.to_json()))
    with tags(EXCHANGE_TAG + spec.exchange):
        return [node_task(spec.worker_of(node)).delay() for node in range(spec.config.nodes)]


def exchange_of(run_tags: Iterable[str]) -> str:
    """The exchange a node run's tags name (`send_node_runs`).

    Raises:
        ConfigError: No tag, several, or one that is not an attempt's exchange (the run
            was not created by the train task).
    """
    found = [tag.removeprefix(EXCHANGE_TAG) for tag in run_tags if tag.startswith(EXCHANGE_TAG)]
    if len(found) != 1 or not _EXCHANGE.match(found[0]):
        raise ConfigError(
            f"this node run has no {EXCHANGE_TAG}<root>/checkpoints/train/<fp>/exchange/<id> "
            "tag; node runs are created by the train stage (train.node_dispatch: workers), "
            "not by hand"
        )
    exchange = found[0]
    check_name(exchange.partition("://")[2] or exchange.lstrip("/"), "the node run's exchange")
    return exchange


def read_spec(exchange: str) -> NodeRunSpec:
    """The attempt's spec, once its signature checks out and its fields validate.

    Raises:
        SignatureError: `spec.json` is missing, unsigned, forged, or names another exchange.
        DataError: It is signed but does not validate (the flow runs other recforge code).
    """
    location = join(exchange, SPEC_OBJECT)
    text = read_text_or_none(location)
    if text is None:
        raise SignatureError(f"{location} does not exist; the train task writes it first")
    record = loads_verified(text, str(location))
    try:
        spec = NodeRunSpec.from_json({k: v for k, v in record.items() if k != SIGNATURE})
    except ValidationError as err:
        raise DataError(
            f"{location} is signed but not a valid node spec ({err.error_count()} problem(s), "
            f"first: {err.errors()[0]['loc']}); run the same recforge on the flow's machine "
            "and the nodes"
        ) from err
    if spec.exchange != exchange:
        raise SignatureError(f"{location} is the spec of another attempt ({spec.exchange})")
    return spec


def outcome_location(exchange: str, index: int) -> str:
    """Where node `index` leaves its `NodeOutcome`."""
    return str(join(exchange, f"outcome-{index}.json"))


def write_outcome(exchange: str, outcome: NodeOutcome) -> None:
    """Leave a node's outcome in the exchange, signed with the run key."""
    write_json(
        outcome_location(exchange, outcome.node), sign(_OUTCOME.dump_python(outcome, mode="json"))
    )


def read_outcome(exchange: str, index: int) -> NodeOutcome | None:
    """Node `index`'s outcome, once its signature checks out; None when it left none.

    Raises:
        SignatureError: The outcome is unsigned or forged, or names another node.
        DataError: It is signed but does not validate.
    """
    location = outcome_location(exchange, index)
    text = read_text_or_none(location)
    if text is None:
        return None
    record = loads_verified(text, location)
    try:
        outcome = _OUTCOME.validate_python({k: v for k, v in record.items() if k != SIGNATURE})
    except ValidationError as err:
        raise DataError(
            f"{location} is signed but not a valid node outcome ({err.error_count()} "
            f"problem(s)); run the same recforge on the flow's machine and the nodes"
        ) from err
    if (outcome.node, outcome.exchange) != (index, exchange):
        raise SignatureError(
            f"{location} is node {outcome.node}'s outcome of {outcome.exchange}, not node "
            f"{index}'s of this attempt; it was copied here"
        )
    return outcome


def run_node(
    spec: NodeRunSpec,
    index: int,
    launch: Callable[..., TrainResult | None],
    out_dir: Path | None,
    env: dict[str, str],
    logger: Logger,
    on_progress: Callable[[dict], None] | None,
    stop: threading.Event,
    log_ranks: bool,
) -> TrainResult | None:
    """Node `index`: align its checkpoints with the store, launch its ranks.

    Args:
        out_dir: Where node 0's ranks write the output (None: its working directory's
            out/, which every other node uses and nobody keeps).
        log_ranks: Whether the launcher's and ranks' lines go to `logger`.
        stop: Set by another node's failure (in this process or, via the STOP object,
            elsewhere); the ranks are stopped then.
    """
    config = spec.config
    node_dir = node_work_dir(spec.root, spec.fp, index)
    store = ArtifactStore(spec.root)
    mirror = CheckpointMirror(
        node_dir / "resume",
        store.location("checkpoints", "train", spec.fp),
        config.keep_checkpoints,
        lambda line: logger.info("node %d: %s", index, line),
    )
    node = NodeLaunch(
        save_hostfile(node_dir / "hostfile", spec.hosts),
        config.nodes,
        config.node_ranks(),
        config.master_addr,
        node_rank=index,
        exchange=spec.exchange,
    )
    run = partial(
        launch,
        out_dir or node_dir / "out",
        master_port=spec.port,
        env=env,
        on_log=partial(log_launcher_line, logger) if log_ranks else None,
        on_progress=on_progress,
        checkpoint_root=node_dir / "resume",
        node=node,
        stop=stop,
    )
    done = threading.Event()
    watch = threading.Thread(
        target=_watch_stop,
        args=(spec.exchange, stop, done),
        name=f"stop-watch-{index}",
        daemon=True,
    )
    watch.start()
    beat = threading.Thread(
        target=_beat,
        args=(spec.exchange, index, beat_interval_s(config.node_heartbeat_timeout_s), done),
        name=f"heartbeat-{index}",
        daemon=True,
    )
    beat.start()
    try:
        reason = read_stop(spec.exchange)
        if reason is not None:
            raise TrainingCrashed(f"node {index}: not started, the attempt is stopped: {reason}")
        mirror.pull(exact=True)
        if index != 0:
            result = run()
        else:
            with mirror.pushing():  # node 0's copy is whole after every exchange
                result = run()
    except BaseException as error:
        stop.set()  # this process's other nodes; the STOP object tells the rest
        request_stop(spec.exchange, index, error)
        raise
    finally:
        done.set()
        watch.join()
        beat.join()
    shutil.rmtree(node_dir / "resume", ignore_errors=True)
    return result if index == 0 else None


@task(name="train-node", task_run_name="train-node-{index}", retries=0, cache_policy=NO_CACHE)
def train_node_task(index: int, body: Callable[[], TrainResult | None]) -> TrainResult | None:
    """One node of a per-node train run in this process; the train task retries the whole."""
    return body()


def node_task(index: int):  # noqa: ANN201 - a Prefect task
    """The task node `index`'s worker serves (dispatch 'workers'); its key names the node.

    Prefect routes a background task run to the workers serving its task key, which it
    derives from the function's name: each node's function has its own name, so node
    I's run is taken only by a worker started with `--node-rank I`. It takes no
    parameters and its result is JSON that nobody reads back (see the module docstring).
    """

    def train_node() -> str:
        run = TaskRunContext.get().task_run
        return run_worker_node(index, exchange_of(run.tags))

    train_node.__name__ = train_node.__qualname__ = f"train_node_{index}"
    return task(
        name=f"train-node-{index}",
        task_run_name=f"train-node-{index}",
        retries=0,
        cache_policy=NO_CACHE,
        result_serializer="json",
    )(train_node)


def run_worker_node(worker: int, exchange: str) -> str:
    """In worker `worker`'s process: train its node's ranks; node 0 uploads the output.

    The spec comes from the exchange, signed, and says which node of the attempt this
    worker runs (`NodeRunSpec.node_of`: itself, unless a retry went on without lost
    nodes); the outcome goes there, signed, also when the node fails (the train task
    rebuilds its error from it).

    Returns:
        Where the outcome is (`outcome_location`).

    Raises:
        ConfigError: A remote exchange and no signing key on this node.
        SignatureError: The spec is not the train task's.
    """
    load_run_key(ArtifactStore(_EXCHANGE.match(exchange)["root"]))
    index = worker
    try:
        spec = read_spec(exchange)
        index = spec.node_of(worker)
        outcome = _train_worker_node(spec, index)
    except BaseException as error:
        failed = NodeOutcome(
            node=index,
            exchange=exchange,
            status="failed",
            error=type(error).__name__,
            deterministic=isinstance(error, DeterministicError),
            message=str(error)[:2000],
        )
        try:
            write_outcome(exchange, failed)
        except Exception as failure:  # noqa: BLE001 - the node's own error is what matters
            logging.getLogger(__name__).warning(
                "could not leave node %d's outcome: %s", index, failure
            )
        raise
    write_outcome(exchange, outcome)
    return outcome_location(exchange, index)


def _train_worker_node(spec: NodeRunSpec, index: int) -> NodeOutcome:
    """Train node `index`'s ranks here; node 0's outcome names its uploaded output."""
    logger = get_run_logger()
    out_dir = node_work_dir(spec.root, spec.fp, index) / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    history: list[dict] = []
    with train_progress(logger) as shown:

        def on_progress(record: dict) -> None:
            history.append(record)
            shown.on_progress(record)

        launch = train_launch(spec.config, upstream_dirs(spec.shard, spec.preprocess))
        result = run_node(
            spec,
            index,
            launch,
            out_dir,
            dict(os.environ),
            logger,
            on_progress if index == 0 else None,
            threading.Event(),
            log_ranks=True,
        )
    files: dict[str, str] = {}
    if index == 0:
        files = publish_output(out_dir, spec.exchange)
    shutil.rmtree(out_dir.parent, ignore_errors=True)
    return NodeOutcome(
        node=index,
        exchange=spec.exchange,
        status="completed",
        result=result,
        history=history,
        files=files,
    )


def serve_node_worker(index: int) -> None:
    """Serve node `index`'s train runs in this process until interrupted (one at a time)."""
    from prefect.task_worker import serve

    serve(node_task(index), limit=1)


def publish_output(out_dir: Path, exchange: str) -> dict[str, str]:
    """Upload node 0's output under `<exchange>/output`; {file: sha256}."""
    files = {rel: info["sha256"] for rel, info in describe_files(out_dir).items()}
    upload_files(out_dir, sorted(files), join(exchange, OUTPUT_PREFIX))
    return files


def fetch_output(exchange: str, files: dict[str, str], out_dir: Path) -> None:
    """Download node 0's output into `out_dir`, each file checked against its sha256.

    Raises:
        TrainingCrashed: A file differs from what node 0 uploaded (the retry trains again).
    """
    download_files(join(exchange, OUTPUT_PREFIX), sorted(files), out_dir)
    for rel, expected in files.items():
        digest = hashlib.sha256((out_dir / rel).read_bytes()).hexdigest()
        if digest != expected:
            raise TrainingCrashed(
                f"{join(exchange, OUTPUT_PREFIX, rel)}: sha256 {digest} differs from "
                f"the {expected} node 0 uploaded"
            )


def request_stop(exchange: str, index: int, error: BaseException) -> None:
    """Tell every node of the attempt to stop (best effort: the store may be the failure).

    The STOP object is signed and names its attempt: only a node of the job can stop the
    others.
    """
    record = {
        "exchange": exchange,
        "node": index,
        "error": type(error).__name__,
        "message": str(error)[:STOP_MESSAGE_CHARS],
    }
    try:
        write_json(join(exchange, STOP_OBJECT), sign(record))
    except Exception as failure:  # noqa: BLE001 - the node's own error is what matters
        logging.getLogger(__name__).warning("could not write the STOP object: %s", failure)


def read_stop(exchange: str) -> str | None:
    """Why the attempt was stopped, from a STOP object a node of the job signed; else None.

    Anyone who can write to the bucket can write a STOP object: one that is unsigned,
    forged or copied from another attempt stops nothing and is logged once, without its
    text.
    """
    record = _read_claimed(str(join(exchange, STOP_OBJECT)), {"exchange": exchange}, "STOP object")
    if record is None:
        return None
    reason = f"node {record.get('node')} failed ({record.get('error')}): {record.get('message')}"
    return reason[: STOP_MESSAGE_CHARS + 100]


def _watch_stop(exchange: str, stop: threading.Event, done: threading.Event) -> None:
    """Set `stop` once the attempt has a signed STOP object; ends when `done` is set."""
    while not done.wait(POLL_S):
        try:
            if read_stop(exchange) is not None:
                stop.set()
        except Exception:  # noqa: BLE001, S112 - a store hiccup: look again
            continue


def beat_interval_s(timeout_s: float) -> float:
    """How often a node writes its heartbeat, given the train task's timeout."""
    return min(MAX_BEAT_S, timeout_s / HEARTBEATS_PER_TIMEOUT)


def heartbeat_location(exchange: str, index: int) -> str:
    """Where node `index` leaves its heartbeat."""
    return str(join(exchange, HEARTBEAT_OBJECT.format(node=index)))


def write_heartbeat(exchange: str, index: int, seq: int) -> None:
    """Node `index`'s heartbeat number `seq`, signed: only a node of the job can beat."""
    record = {"exchange": exchange, "node": index, "seq": seq}
    write_json(heartbeat_location(exchange, index), sign(record))


def read_heartbeat(exchange: str, index: int) -> int | None:
    """The sequence number of node `index`'s newest heartbeat; None when there is none.

    A heartbeat that is unsigned, forged or copied from another node or attempt counts
    as none (logged once): nobody outside the job can keep a dead node alive, and one
    replayed heartbeat does not advance the number.
    """
    claims = {"exchange": exchange, "node": index}
    record = _read_claimed(heartbeat_location(exchange, index), claims, "heartbeat")
    seq = None if record is None else record.get("seq")
    return seq if isinstance(seq, int) else None


def _read_claimed(location: str, claims: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The signed record at `location` if it makes `claims`; else None.

    None when there is none; one that is unsigned, forged or claims otherwise (copied
    from another attempt or node) is logged once, without its text, and counts as none.
    """
    text = read_text_or_none(location)
    if text is None:
        return None
    try:
        record = loads_verified(text, location)
        if {key: record.get(key) for key in claims} != claims:
            raise SignatureError(f"{location} is the {what} of another attempt or node")
    except SignatureError as err:
        if location not in _ignored_records:
            _ignored_records.add(location)
            logging.getLogger(__name__).warning("ignoring the %s: %s", what, err)
        return None
    return record


def _beat(exchange: str, index: int, interval_s: float, done: threading.Event) -> None:
    """Write node `index`'s heartbeat every `interval_s` until `done` is set."""
    seq = 0
    warned = False
    while True:
        try:
            write_heartbeat(exchange, index, seq)
            seq += 1
        except Exception as error:  # noqa: BLE001 - a store hiccup: the next beat may pass
            if not warned:
                warned = True
                logging.getLogger(__name__).warning(
                    "node %d: could not write its heartbeat: %s", index, error
                )
        if done.wait(interval_s):
            return


class _Liveness:
    """The train task's view of each started node's heartbeat, by its own clock.

    A node's silence is measured from the later of when it was seen starting and when
    its heartbeat number last advanced: the nodes' clocks play no part.
    """

    def __init__(self, exchange: str, timeout_s: float) -> None:
        self.exchange = exchange
        self.timeout_s = timeout_s
        self._seq: dict[int, int | None] = {}
        self._since: dict[int, float] = {}

    def started(self, index: int, now: float) -> None:
        self._seq[index] = None
        self._since[index] = now

    def lost(self, index: int, now: float) -> NodeLost | None:
        """NodeLost when node `index` has been silent for the timeout, else None."""
        try:
            seq = read_heartbeat(self.exchange, index)
        except Exception:  # noqa: BLE001 - the store hiccuped: the clock runs on
            seq = self._seq[index]
        if seq is not None and seq != self._seq[index]:
            self._seq[index], self._since[index] = seq, now
            return None
        silent = now - self._since[index]
        if silent < self.timeout_s:
            return None
        last = self._seq[index]
        heard = f"its last heartbeat was #{last}" if last is not None else "it never beat"
        return NodeLost(
            f"node {index}: lost, no heartbeat for {silent:.0f} s "
            f"(train.node_heartbeat_timeout_s={self.timeout_s:.0f}; {heard}); its worker "
            "or machine is gone. The other nodes were told to stop; the retry resumes "
            "from the last checkpoint"
        )


def _await_nodes(
    futures: list[PrefectFuture], spec: NodeRunSpec, logger: Logger
) -> list[State | BaseException]:
    """Each node run's final state, or the error that stands for it.

    A run that no worker takes within the pickup timeout, or that vanishes from the API,
    becomes NodeUnavailable; a started node whose heartbeat does not advance for
    `train.node_heartbeat_timeout_s` becomes NodeLost (transient: the retry resumes).
    Once a node has failed, the rest get `STOP_WAIT_S` to report before they count as
    lost. Every wait here has a deadline.
    """
    nodes = len(futures)
    outcome: dict[int, State | BaseException] = {}
    started: set[int] = set()
    known: set[int] = set()  # runs the API has answered for
    liveness = _Liveness(spec.exchange, spec.config.node_heartbeat_timeout_s)
    pickup_deadline = time.monotonic() + spec.config.pickup_timeout_s()
    stop_deadline: float | None = None
    while len(outcome) < nodes:
        now = time.monotonic()
        for index, future in enumerate(futures):
            if index in outcome:
                continue
            state = _state_of(future)
            if state is None and index in known:
                # Prefect's task worker deletes a run whose parameters it cannot read.
                error = NodeUnavailable(
                    f"node {index}: its run train-node-{index} vanished from the Prefect "
                    "API after it was created (a task worker deletes a run it cannot "
                    "submit); check `recforge node-worker` on that node: same recforge "
                    "version, same PREFECT_API_URL and auth string as this flow"
                )
                outcome[index] = error
                request_stop(spec.exchange, index, error)
                stop_deadline = stop_deadline or now + STOP_WAIT_S
                continue
            if state is not None:
                known.add(index)
            if state is not None and state.is_final():
                outcome[index] = state
                if not state.is_completed() and stop_deadline is None:
                    stop_deadline = now + STOP_WAIT_S
                continue
            if state is not None and not state.is_scheduled():  # taken by its worker
                if index not in started:
                    started.add(index)
                    liveness.started(index, now)
                    logger.info("train-node-%d started on its worker", index)
                lost = liveness.lost(index, now)
                if lost is not None:
                    logger.warning("%s", lost)
                    outcome[index] = lost
                    request_stop(spec.exchange, index, lost)
                    stop_deadline = stop_deadline or now + STOP_WAIT_S
                    continue
                if stop_deadline is None or now <= stop_deadline:
                    continue
            if index not in started and (now > pickup_deadline or stop_deadline is not None):
                error = NodeUnavailable(
                    f"node {index}: no task worker took its run (train-node-{index}) within "
                    f"{spec.config.pickup_timeout_s():.0f} s; start `recforge node-worker "
                    f"--node-rank {spec.worker_of(index)}` on that node with this "
                    "PREFECT_API_URL (node 0's "
                    f"on {spec.config.master_addr}), or raise train.node_pickup_timeout_s"
                    if stop_deadline is None
                    else f"node {index}: not started before another node failed"
                )
                outcome[index] = error
                request_stop(spec.exchange, index, error)
                stop_deadline = stop_deadline or now + STOP_WAIT_S
                continue
            if stop_deadline is not None and now > stop_deadline:
                outcome[index] = TrainingCrashed(
                    f"node {index}: did not report back within {STOP_WAIT_S:.0f} s of the "
                    "stop (its worker or machine may be gone)"
                )
        if len(outcome) < nodes:
            time.sleep(POLL_S)
    return [outcome[index] for index in range(nodes)]


def surviving_layout(
    config: TrainConfig, failed_attempts: list[dict[str, Any]]
) -> tuple[TrainConfig, list[int] | None, str]:
    """The layout of the next attempt: all nodes, or, with `train.min_nodes`, the workers
    that earlier attempts did not lose.

    Returns:
        (config, None, why) for every node (`why` says why not fewer, "" when nothing
        was lost); else (the config with `nodes` and `world_size` cut to the survivors,
        ranks_per_node kept; the survivors' worker indexes; a line for the log).
    """
    lost = sorted(
        {
            node["node"]
            for attempt in failed_attempts
            for node in attempt.get("lost_nodes", [])
            if isinstance(node, dict) and isinstance(node.get("node"), int)
        }
    )
    if not lost:
        return config, None, ""
    if config.min_nodes is None:
        return config, None, f"waiting for every node again (lost before: {lost})"
    survivors = [worker for worker in range(config.nodes) if worker not in lost]
    if 0 in lost or len(survivors) < config.min_nodes:
        why = (
            "node 0 holds the rendezvous on train.master_addr"
            if 0 in lost
            else f"{len(survivors)} are left, fewer than train.min_nodes={config.min_nodes}"
        )
        return config, None, f"waiting for every node again: lost {lost}, and {why}"
    per_node = config.node_ranks()
    record = {
        **config.model_dump(),
        "nodes": len(survivors),
        "world_size": len(survivors) * per_node,
        "ranks_per_node": per_node,
    }
    try:
        smaller = TrainConfig.model_validate(record)
    except ValidationError as err:
        return config, None, f"waiting for every node again: {len(survivors)} node(s) " + (
            f"would not be a valid layout ({err.errors()[0]['msg']})"
        )
    line = (
        f"going on without lost node(s) {lost}: {len(survivors)} node(s) x {per_node} "
        f"rank(s) on workers {survivors} (train.min_nodes={config.min_nodes})"
    )
    return smaller, survivors, line


def record_failed_attempt(work: Path, error: BaseException, lost: dict[int, str]) -> None:
    """Append one failed attempt to `work`'s `ATTEMPTS_FILE` (read by the next attempt)."""
    record = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "error": type(error).__name__,
        "message": str(error)[:STOP_MESSAGE_CHARS * 2],
        "lost_nodes": [
            {"node": index, "why": why[:STOP_MESSAGE_CHARS]} for index, why in lost.items()
        ],
    }
    work.mkdir(parents=True, exist_ok=True)
    with attempts_file(work).open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def read_failed_attempts(work: Path) -> list[dict[str, Any]]:
    """The failed attempts `record_failed_attempt` kept in `work`, oldest first."""
    path = attempts_file(work)
    if not path.is_file():
        return []
    attempts = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict):
            attempts.append(record)
    return attempts


def _state_of(future: PrefectFuture) -> State | None:
    """The run's state now; None while the API does not know the run yet."""
    try:
        return future.state
    except ObjectNotFound:
        return None


def _node_error(exchange: str, index: int, state: State) -> BaseException:
    """The error a failed node run left in its signed outcome, rebuilt by name.

    Without an outcome (the node's machine died, the store failed) the run's state
    stands for it. The run's Prefect result, which would hold the exception, is not read.
    """
    try:
        outcome = read_outcome(exchange, index)
    except DataError as error:  # forged or garbled: that is the failure
        return error
    if outcome is None or outcome.status != "failed":
        return TrainingCrashed(f"{state.name}: {state.message}")
    kind = _KNOWN_ERRORS.get(outcome.error)
    if kind is not None:
        return kind(outcome.message)
    if outcome.deterministic:
        return DeterministicError(f"{outcome.error}: {outcome.message}")
    return TrainingCrashed(f"{outcome.error}: {outcome.message}")


def _raise_failures(failures: list[tuple[int, BaseException]], nodes: int) -> None:
    """Raise for failed nodes: a deterministic error as it is, else TrainingCrashed."""
    for _, error in failures:
        if isinstance(error, DeterministicError):
            raise error
    if failures:
        lines = "".join(f"\n  node {index}: {error}" for index, error in failures)
        raise TrainingCrashed(f"{len(failures)} of {nodes} train nodes failed:{lines}")


def check_dispatch(config: TrainConfig, root: str) -> None:
    """Refuse node_dispatch 'workers' where workers on other machines could not work.

    Raises:
        ConfigError: The root is a local path (other machines cannot read it), or the
            flow runs on a temporary Prefect server (no worker can reach it).
    """
    if config.launcher != "per_node" or config.node_dispatch != "workers":
        return
    if not is_remote(root):
        raise ConfigError(
            f"train.node_dispatch=workers: the artifact root {root} is a local path, which "
            "the nodes' workers cannot read; use an object-store root (--root s3://bucket/x)"
        )
    if not PREFECT_API_URL.value():
        raise ConfigError(
            "train.node_dispatch=workers: the nodes' task workers take their runs from a "
            "Prefect server, but this run uses a temporary one; set PREFECT_API_URL to the "
            "server the `recforge node-worker` processes use"
        )


def log_launcher_line(logger: logging.Logger | logging.LoggerAdapter, line: str) -> None:
    """Log one output line of the launcher or a rank as people read it.

    Ordinary output goes on as it is. The ranks' machine records do not: progress records
    reach people through `TrainProgress` (the launcher parses them for `on_progress`), a
    resume record becomes a sentence, an error record a warning (the stage's error names
    it again). The launcher log keeps every line as it came.
    """
    if not is_protocol_line(line):
        logger.info(line)
        return
    resume = parse_record(line, RESUME_PREFIX)
    if resume is not None:
        logger.info(format_resume_line(resume))
    error = parse_record(line, ERROR_PREFIX)
    if error is not None:
        logger.warning("train rank %s failed: %s", error.get("rank"), error.get("error"))
