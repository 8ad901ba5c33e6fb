"""The per-node training protocol: what the nodes of one attempt and the train task trade
through the artifact root. No Prefect: `tasks.train_nodes` only dispatches the node runs.

With `train.launcher: per_node` every node has a working directory of its own (its
resume checkpoints, and for nodes other than 0 the output directory the ranks need but
nobody keeps); the nodes share only the artifact root. There,
`<root>/checkpoints/train/<key>` holds the resume checkpoints (node 0 uploads them; every
node pulls the newest before its ranks start, dropping local ones that never got there,
so all resume from one step) and `<root>/checkpoints/train/<key>/exchange/<attempt id>`
(the attempt's *exchange*, a fresh prefix per attempt) everything the attempt trades:

    spec.json            the attempt's `NodeRunSpec` (the train task writes it first)
    STOP                 written once any node has failed: the others stop
    heartbeat-<I>.json   node I's liveness, a sequence number that rises while it lives
    outcome-<I>.json     what node I's run left for the train task (`NodeOutcome`)
    output/              node 0's output files, named with their sha256 in its outcome
    <name>/node-XXXXX    the ranks' checkpoint parts (`training.runtime.exchange`)

The bucket is not trusted (docs/security.md). Every record above is signed with the run
key and bound to its place (`artifacts.signing.place`): its type, the attempt (the
exchange's URL) and, for per-node records, the node. A reader passes the place it read
from, so a record copied from another node, another attempt or another kind of record
(a heartbeat dropped in as the STOP object) is refused, and every read has a size cap.
A worker serves one configured root and refuses an exchange anywhere else; it leaves no
signed outcome for a spec that did not verify (it would be signing whatever the bucket
said); node 0's outcome must name the output it uploaded; a heartbeat counts only when
its number rises above the last one seen.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.durable import file_sha256, write_json
from artifacts.errors import (
    ConcurrentUpdate,
    ConfigError,
    CorruptOutput,
    DataError,
    DeterministicError,
    InputNotFoundError,
    StoreUnreachable,
)
from artifacts.locations import UnsafeName, download_files, join, upload_files
from artifacts.signing import PLACE, SIGNATURE, SignatureError, place, read_verified, sign
from artifacts.store import ArtifactStore, describe_files
from training.config import TrainConfig
from training.errors import ParityError, Preempted, TrainingCrashed
from training.runtime.hosts import node_hosts, read_hostfile, save_hostfile
from training.runtime.launcher import NodeLaunch, TrainResult, free_port

_logger = logging.getLogger(__name__)

# How often a node looks for the STOP object, and the train task at its node runs.
POLL_S = 2.0

# Once a node has failed, how long the others get to stop and report (their ranks get
# 60 s to save a checkpoint after SIGTERM) before the train task gives up on them.
STOP_WAIT_S = 150.0

STOP_OBJECT = "STOP"
SPEC_OBJECT = "spec.json"
OUTCOME_OBJECT = "outcome-{node}.json"
HEARTBEAT_OBJECT = "heartbeat-{node}.json"
OUTPUT_PREFIX = "output"

# A STOP object's message is kept this short: it ends up in every node's error and log.
STOP_MESSAGE_CHARS = 300

# Size caps of what is read back: a heartbeat or a STOP object is a few hundred bytes,
# a spec a few KiB (the train config and the hosts). An outcome (node 0's progress
# history) keeps the default cap of `artifacts.locations.MAX_RECORD_BYTES`.
SMALL_RECORD_BYTES = 64 << 10
SPEC_BYTES = 1 << 20

# A node beats every timeout / HEARTBEATS_PER_TIMEOUT seconds, at most every MAX_BEAT_S.
HEARTBEATS_PER_TIMEOUT = 6
MAX_BEAT_S = 20.0

# An attempt's exchange: `<root>/checkpoints/train/<key>/exchange/<uuid4 hex>`.
_EXCHANGE = re.compile(
    r"^(?P<root>.+)/checkpoints/train/(?P<key>[0-9a-f]{1,128})/exchange/(?P<attempt>[0-9a-f]{32})$"
)

# Failed attempts of the train stage in one flow run, kept beside the nodes' working
# directories so that the attempt that succeeds can name the nodes lost before it (the
# run record's `failed_attempts`) and a retry can go on without them (train.min_nodes).
# Per flow run: a new run starts with every node.
ATTEMPTS_FILE = "failed-attempts-{run}.jsonl"

# Records found forged or misplaced (STOP objects, heartbeats), each logged once per process.
_ignored_records: set[str] = set()

Logger = logging.Logger | logging.LoggerAdapter


class NodeUnavailable(DeterministicError):
    """A node's task run was not taken by its worker in time (retrying would wait again)."""


class NodeLost(TrainingCrashed):
    """A started node stopped beating (its worker or machine died): the retry resumes."""


@dataclass(frozen=True)
class NodeRunSpec:
    """What every node of one attempt needs; JSON (`to_json`), for a task worker elsewhere.

    Attributes:
        config: The train config (launcher 'per_node').
        inputs: The upstream stage outputs the ranks read, by stage, as the task layer
            records them (its `StageOutput` as JSON; the task layer reads them back).
        root: The artifact root (an object-store URL when nodes are other machines).
        fp: The train stage's resume key (`TrainConfig.resume_keyed`): names the resume
            checkpoints and the nodes' working directories, whatever the layout.
        exchange: This attempt's exchange (`<root>/checkpoints/train/<fp>/exchange/<id>`).
        hosts: The hostfile's (host, slots) of each node of this attempt.
        port: The rendezvous port on `config.master_addr`.
        workers: The worker (`recforge node-worker --node-rank W`) of each node of this
            attempt; None: node I's is worker I. Another list after `train.min_nodes`
            let a retry go on without lost nodes.
    """

    config: TrainConfig
    inputs: dict[str, dict[str, Any]]
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
    def from_json(cls, record: Any) -> NodeRunSpec:
        """The spec `to_json` gave, validated (the config by pydantic).

        Raises:
            pydantic.ValidationError: A field is missing, unknown to the config or mistyped.
        """
        return _SPEC.validate_python(record)


_SPEC = TypeAdapter(NodeRunSpec)


@dataclass(frozen=True)
class NodeOutcome:
    """What a node's run leaves in the exchange for the train task (signed JSON).

    Attributes:
        node: The node.
        exchange: The attempt's exchange.
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


# --- the attempt: its spec, and where a worker may find it ---


def new_spec(
    config: TrainConfig,
    inputs: dict[str, dict[str, Any]],
    store: ArtifactStore,
    fp: str,
    workers: list[int] | None = None,
) -> NodeRunSpec:
    """A fresh attempt's spec: a new exchange, the hosts of `workers` (default: all).

    Raises:
        ConfigError: The hostfile does not name enough valid hosts.
    """
    workers = workers or list(range(config.nodes))
    every = max(workers) + 1
    hosts = (
        read_hostfile(Path(config.hostfile), every, config.node_ranks())
        if config.hostfile
        else node_hosts(every, config.node_ranks())
    )
    return NodeRunSpec(
        config=config,
        inputs=inputs,
        root=store.url,
        fp=fp,
        exchange=store.location("checkpoints", "train", fp, "exchange", uuid.uuid4().hex),
        hosts=[hosts[worker] for worker in workers],
        port=config.master_port or free_port(),
        workers=None if workers == list(range(config.nodes)) else workers,
    )


def worker_exchange(root: str, named: str) -> str:
    """The exchange a node run names, once it lies under this worker's own root.

    A node run says where its attempt's exchange is, but whoever can start task runs on
    the Prefect API can name any place: a worker serves the root it was started with
    and reads or writes nowhere else.

    Args:
        root: The worker's configured artifact root (`recforge node-worker --root`).
        named: The exchange the node run names.

    Returns:
        The exchange, rebuilt under `root` from the key and attempt id it names.

    Raises:
        ConfigError: `named` is not an attempt's exchange, or lies under another root
            (both roots are named).
    """
    store = ArtifactStore(root)
    found = _EXCHANGE.match(named)
    if found is None:
        raise ConfigError(
            f"the node run names {named[:200]!r} as its exchange, which is not "
            "<root>/checkpoints/train/<key>/exchange/<id>; node runs are created by the "
            "train stage (train.node_dispatch: workers), not by hand"
        )
    if found["root"].rstrip("/") != store.url:
        raise ConfigError(
            f"the node run's exchange lies under {found['root'][:200]!r}, but this worker "
            f"serves the artifact root {store.url} (recforge node-worker --root): refusing "
            "it, nothing was read or written there. Start the flow with this root, or a "
            "worker with the flow's"
        )
    return store.location("checkpoints", "train", found["key"], "exchange", found["attempt"])


def write_spec(spec: NodeRunSpec) -> None:
    """Write the attempt's spec, signed and bound to its exchange (the train task, first)."""
    where = place("exchange-spec", attempt=spec.exchange)
    write_json(join(spec.exchange, SPEC_OBJECT), sign(spec.to_json(), place=where))


def read_spec(exchange: str) -> NodeRunSpec:
    """The attempt's spec, once its signature and place check out and its fields validate.

    Raises:
        SignatureError: `spec.json` is missing, too large, unsigned, forged, or bound to
            another attempt (`MisplacedRecord`).
        DataError: It is signed but does not validate (the flow runs other recforge code).
    """
    location = str(join(exchange, SPEC_OBJECT))
    record = read_verified(
        location, place=place("exchange-spec", attempt=exchange), limit=SPEC_BYTES
    )
    if record is None:
        raise SignatureError(f"{location} does not exist; the train task writes it first")
    try:
        spec = NodeRunSpec.from_json(
            {k: v for k, v in record.items() if k not in (SIGNATURE, PLACE)}
        )
    except ValidationError as err:
        raise DataError(
            f"{location} is signed but not a valid node spec ({err.error_count()} problem(s), "
            f"first: {err.errors()[0]['loc']}); run the same recforge on the flow's machine "
            "and the nodes"
        ) from err
    if spec.exchange != exchange:
        raise SignatureError(f"{location} is the spec of another attempt ({spec.exchange[:200]})")
    return spec


# --- outcomes ---


def outcome_location(exchange: str, index: int) -> str:
    """Where node `index` leaves its `NodeOutcome`."""
    return str(join(exchange, OUTCOME_OBJECT.format(node=index)))


def write_outcome(exchange: str, outcome: NodeOutcome) -> None:
    """Leave a node's outcome in the exchange, signed and bound to the attempt and node."""
    where = place("exchange-outcome", attempt=exchange, node=outcome.node)
    record = _OUTCOME.dump_python(outcome, mode="json")
    write_json(outcome_location(exchange, outcome.node), sign(record, place=where))


def read_outcome(exchange: str, index: int) -> NodeOutcome | None:
    """Node `index`'s outcome, once its signature and place check out; None when it left none.

    Raises:
        SignatureError: The outcome is too large, unsigned or forged, or bound to
            another node or attempt (`MisplacedRecord`).
        DataError: It is signed but does not validate.
    """
    location = outcome_location(exchange, index)
    record = read_verified(location, place=place("exchange-outcome", attempt=exchange, node=index))
    if record is None:
        return None
    try:
        outcome = _OUTCOME.validate_python(
            {k: v for k, v in record.items() if k not in (SIGNATURE, PLACE)}
        )
    except ValidationError as err:
        raise DataError(
            f"{location} is signed but not a valid node outcome ({err.error_count()} "
            f"problem(s)); run the same recforge on the flow's machine and the nodes"
        ) from err
    if (outcome.node, outcome.exchange) != (index, exchange):
        raise SignatureError(
            f"{location} names node {outcome.node} of another exchange, not node {index} of "
            "this attempt; refusing it"
        )
    return outcome


def node_failure(exchange: str, index: int, fallback: str) -> BaseException:
    """The error a failed node left in its signed outcome, rebuilt by name.

    Args:
        fallback: What stands for the failure when the node left no outcome (its machine
            died, the store failed, its spec did not verify): the run's final state.
    """
    try:
        outcome = read_outcome(exchange, index)
    except DataError as error:  # forged or garbled: that is the failure
        return error
    if outcome is None or outcome.status != "failed":
        return TrainingCrashed(fallback)
    kind = _KNOWN_ERRORS.get(outcome.error)
    if kind is not None:
        return kind(outcome.message)
    if outcome.deterministic:
        return DeterministicError(f"{outcome.error}: {outcome.message}")
    return TrainingCrashed(f"{outcome.error}: {outcome.message}")


def raise_failures(failures: list[tuple[int, BaseException]], nodes: int) -> None:
    """Raise for failed nodes: a deterministic error as it is, else TrainingCrashed."""
    for _, error in failures:
        if isinstance(error, DeterministicError):
            raise error
    if failures:
        lines = "".join(f"\n  node {index}: {error}" for index, error in failures)
        raise TrainingCrashed(f"{len(failures)} of {nodes} train nodes failed:{lines}")


def publish_output(out_dir: Path, exchange: str) -> dict[str, str]:
    """Upload node 0's output under `<exchange>/output`; {file: sha256}."""
    files = {rel: info["sha256"] for rel, info in describe_files(out_dir).items()}
    upload_files(out_dir, sorted(files), join(exchange, OUTPUT_PREFIX))
    return files


def fetch_output(exchange: str, files: dict[str, str], out_dir: Path) -> None:
    """Download node 0's output into `out_dir`, each file checked against its sha256.

    Only the files the signed outcome names are read (each joined with `safe_join`),
    never a listing of the prefix.

    Raises:
        TrainingCrashed: A file differs from what node 0 uploaded (the retry trains again).
        UnsafeName: The outcome names a file outside `out_dir`.
    """
    download_files(join(exchange, OUTPUT_PREFIX), sorted(files), out_dir)
    for rel, expected in files.items():
        digest = file_sha256(out_dir / rel)
        if digest != expected:
            raise TrainingCrashed(
                f"{join(exchange, OUTPUT_PREFIX, rel)}: sha256 {digest} differs from "
                f"the {str(expected)[:64]} node 0 uploaded"
            )


def collect_output(exchange: str, out_dir: Path) -> tuple[TrainResult, list[dict[str, Any]]]:
    """Node 0's result and progress history, its output fetched into `out_dir`.

    Returns:
        (node 0's TrainResult with `out_dir`, its progress records in order).

    Raises:
        TrainingCrashed: Node 0 left no completed outcome, or one that names no output
            file (a run that trained leaves its weights; an empty output is no success).
        SignatureError: Its outcome does not verify or belongs elsewhere.
    """
    location = outcome_location(exchange, 0)
    outcome = read_outcome(exchange, 0)
    if outcome is None or outcome.status != "completed" or outcome.result is None:
        raise TrainingCrashed(f"node 0: its run completed but left no result at {location}")
    if not outcome.files:
        raise TrainingCrashed(
            f"node 0: its outcome {location} names no output file, but node 0 writes the "
            "stage's output; the attempt counts as failed and the retry trains again"
        )
    fetch_output(exchange, outcome.files, out_dir)
    return replace(outcome.result, out_dir=out_dir), outcome.history


# --- the worker's side ---


def run_worker_node(
    worker: int, named: str, root: str, train: Callable[[NodeRunSpec, int], NodeOutcome]
) -> str:
    """In worker `worker`'s process: one node run of an attempt, its outcome left signed.

    The exchange must lie under the worker's own root (`worker_exchange`) and a remote
    root needs the run key. The spec must verify before anything is signed: a spec that
    does not (forged, misplaced, missing) fails the run and leaves no outcome, so the
    worker never signs what the bucket told it. Once it verified, the spec says which
    node of the attempt this worker runs (`NodeRunSpec.node_of`), and the node's outcome
    goes to the exchange, signed, also when its training fails (the train task rebuilds
    its error from it).

    Args:
        worker: The worker's node rank (`recforge node-worker --node-rank`).
        named: The exchange the node run names.
        root: The worker's configured artifact root.
        train: Trains node `index` of `spec` here; its outcome.

    Returns:
        Where the outcome is (`outcome_location`).

    Raises:
        ConfigError: The exchange lies under another root; a remote root and no key; the
            attempt has no node for this worker.
        SignatureError: The spec is not the train task's.
    """
    store = ArtifactStore(root)
    store.require_key()
    exchange = worker_exchange(store.url, named)
    spec = read_spec(exchange)
    if spec.root != store.url:
        raise ConfigError(
            f"{join(exchange, SPEC_OBJECT)} names the root {spec.root[:200]}, not this "
            f"worker's {store.url}; start the worker with --root {spec.root[:200]}"
        )
    index = spec.node_of(worker)
    try:
        outcome = train(spec, index)
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
            _logger.warning("could not leave node %d's outcome: %s", index, failure)
        raise
    write_outcome(exchange, outcome)
    return outcome_location(exchange, index)


def node_work_dir(root: str, fp: str, index: int) -> Path:
    """Node `index`'s working directory on the machine it runs on."""
    return ArtifactStore(root).root / "nodes" / "train" / fp / f"node-{index}"


def run_node(
    spec: NodeRunSpec,
    index: int,
    launch: Callable[..., TrainResult | None],
    out_dir: Path | None,
    env: dict[str, str],
    logger: Logger,
    on_log: Callable[[str], None] | None,
    on_progress: Callable[[dict], None] | None,
    stop: threading.Event,
) -> TrainResult | None:
    """Node `index`: align its checkpoints with the store, launch its ranks.

    Args:
        spec: The attempt.
        index: The node.
        launch: The family's launch (`training.stages.train_launch`).
        out_dir: Where node 0's ranks write the output (None: its working directory's
            out/, which every other node uses and nobody keeps).
        env: The launcher's environment.
        logger: Where the node's own lines go.
        on_log: The launcher's and ranks' lines (None: not logged).
        on_progress: The ranks' progress records (node 0).
        stop: Set by another node's failure (in this process or, via the STOP object,
            elsewhere); the ranks are stopped then.

    Returns:
        Node 0's TrainResult; None on the other nodes.

    Raises:
        TrainingCrashed: The attempt was stopped before this node started, or its ranks
            failed; whatever the launch raised (the STOP object is written first).
    """
    config = spec.config
    node_dir = node_work_dir(spec.root, spec.fp, index)
    # Named by the resume key, like the train task's own resume root: a checkpoint's
    # manifest is bound to the key of the directory it is written in.
    resume = node_dir / "resume" / spec.fp
    store = ArtifactStore(spec.root)
    mirror = CheckpointMirror(
        resume,
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
        on_log=on_log,
        on_progress=on_progress,
        checkpoint_root=resume,
        node=node,
        stop=stop,
        artifact_root=store.url,
    )
    done = threading.Event()
    watch = threading.Thread(
        target=watch_stop,
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


# --- STOP ---


def request_stop(exchange: str, index: int, error: BaseException) -> None:
    """Tell every node of the attempt to stop (best effort: the store may be the failure).

    The STOP object is signed and bound to its attempt: only a node of the job can stop
    the others, and only this attempt.
    """
    record = {
        "node": index,
        "error": type(error).__name__,
        "message": str(error)[:STOP_MESSAGE_CHARS],
    }
    where = place("exchange-stop", attempt=exchange)
    try:
        write_json(join(exchange, STOP_OBJECT), sign(record, place=where))
    except Exception as failure:  # noqa: BLE001 - the node's own error is what matters
        _logger.warning("could not write the STOP object: %s", failure)


def read_stop(exchange: str) -> str | None:
    """Why the attempt was stopped, from a STOP object a node of the job signed; else None.

    Anyone who can write to the bucket can write a STOP object: one that is unsigned,
    forged, too large, or bound elsewhere (another attempt's, a heartbeat copied over
    it) stops nothing and is logged once, without its text.
    """
    where = place("exchange-stop", attempt=exchange)
    record = _read_bound(str(join(exchange, STOP_OBJECT)), where, "STOP object")
    if record is None:
        return None
    reason = f"node {record.get('node')} failed ({record.get('error')}): {record.get('message')}"
    return reason[: STOP_MESSAGE_CHARS + 100]


def watch_stop(exchange: str, stop: threading.Event, done: threading.Event) -> None:
    """Set `stop` once the attempt has a signed STOP object; ends when `done` is set."""
    while not done.wait(POLL_S):
        try:
            if read_stop(exchange) is not None:
                stop.set()
        except Exception:  # noqa: BLE001, S112 - a store hiccup: look again
            continue


# --- heartbeats ---


def beat_interval_s(timeout_s: float) -> float:
    """How often a node writes its heartbeat, given the train task's timeout."""
    return min(MAX_BEAT_S, timeout_s / HEARTBEATS_PER_TIMEOUT)


def heartbeat_location(exchange: str, index: int) -> str:
    """Where node `index` leaves its heartbeat."""
    return str(join(exchange, HEARTBEAT_OBJECT.format(node=index)))


def write_heartbeat(exchange: str, index: int, seq: int) -> None:
    """Node `index`'s heartbeat number `seq`, signed and bound to the attempt and node."""
    where = place("heartbeat", attempt=exchange, node=index)
    write_json(heartbeat_location(exchange, index), sign({"seq": seq}, place=where))


def read_heartbeat(exchange: str, index: int) -> int | None:
    """The sequence number of node `index`'s heartbeat; None when there is none.

    A heartbeat that is unsigned, forged, too large or bound to another node, attempt
    or kind of record counts as none (logged once): nobody outside the job can make
    one. Whether its number is new is the reader's business (`Liveness`).
    """
    where = place("heartbeat", attempt=exchange, node=index)
    record = _read_bound(heartbeat_location(exchange, index), where, "heartbeat")
    seq = None if record is None else record.get("seq")
    return seq if type(seq) is int and seq >= 0 else None


def _read_bound(location: str, where: dict[str, str], what: str) -> dict[str, Any] | None:
    """The small signed record at `location` if it is bound to `where`; else None.

    None when there is none; one that is unsigned, forged, over `SMALL_RECORD_BYTES`,
    unparseable or bound elsewhere is logged once, without its text, and counts as none.
    """
    try:
        return read_verified(location, place=where, limit=SMALL_RECORD_BYTES)
    except SignatureError as err:
        if location not in _ignored_records:
            _ignored_records.add(location)
            _logger.warning("ignoring the %s: %s", what, err)
        return None


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
                _logger.warning("node %d: could not write its heartbeat: %s", index, error)
        if done.wait(interval_s):
            return


class Liveness:
    """The train task's view of each started node's heartbeat, by its own clock.

    A node's silence is measured from the later of when it was seen starting and when
    its heartbeat number last rose above every number seen before: the nodes' clocks
    play no part, and old signed heartbeats written again (one, or two in turn) never
    count as a new beat.
    """

    def __init__(self, exchange: str, timeout_s: float) -> None:
        self.exchange = exchange
        self.timeout_s = timeout_s
        self._seq: dict[int, int | None] = {}
        self._since: dict[int, float] = {}

    def started(self, index: int, now: float) -> None:
        """Node `index` was seen starting at `now` (its silence is counted from there)."""
        self._seq[index] = None
        self._since[index] = now

    def lost(self, index: int, now: float) -> NodeLost | None:
        """NodeLost when node `index` has been silent for the timeout, else None."""
        try:
            seq = read_heartbeat(self.exchange, index)
        except Exception:  # noqa: BLE001 - the store hiccuped: the clock runs on
            seq = None
        last = self._seq[index]
        if seq is not None and (last is None or seq > last):
            self._seq[index], self._since[index] = seq, now
            return None
        silent = now - self._since[index]
        if silent < self.timeout_s:
            return None
        heard = f"its last heartbeat was #{last}" if last is not None else "it never beat"
        return NodeLost(
            f"node {index}: lost, no heartbeat for {silent:.0f} s "
            f"(train.node_heartbeat_timeout_s={self.timeout_s:.0f}; {heard}); its worker "
            "or machine is gone. The other nodes were told to stop; the retry resumes "
            "from the last checkpoint"
        )


# --- layouts and failed attempts ---


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
        return (
            config,
            None,
            f"waiting for every node again: {len(survivors)} node(s) "
            + (f"would not be a valid layout ({err.errors()[0]['msg']})"),
        )
    line = (
        f"going on without lost node(s) {lost}: {len(survivors)} node(s) x {per_node} "
        f"rank(s) on workers {survivors} (train.min_nodes={config.min_nodes})"
    )
    return smaller, survivors, line


def attempts_file(work: Path, run: str) -> Path:
    """Flow run `run`'s failed-attempts file under `work`."""
    return work / ATTEMPTS_FILE.format(run=run)


def record_failed_attempt(work: Path, run: str, error: BaseException, lost: dict[int, str]) -> None:
    """Append one failed attempt to flow run `run`'s file in `work` (read by the next)."""
    record = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "error": type(error).__name__,
        "message": str(error)[: STOP_MESSAGE_CHARS * 2],
        "lost_nodes": [
            {"node": index, "why": why[:STOP_MESSAGE_CHARS]} for index, why in lost.items()
        ],
    }
    work.mkdir(parents=True, exist_ok=True)
    with attempts_file(work, run).open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def read_failed_attempts(work: Path, run: str) -> list[dict[str, Any]]:
    """The failed attempts `record_failed_attempt` kept in `work` for `run`, oldest first."""
    path = attempts_file(work, run)
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
