"""launcher 'per_node': one Prefect task run per node, each launching its node's ranks.

Every node has a working directory of its own (its resume checkpoints, and for nodes
other than 0 the output directory the ranks need but nobody keeps); the nodes share
only the artifact root. There, `<root>/checkpoints/train/<fp>` holds the resume
checkpoints (node 0 uploads them; every node pulls the newest before its ranks start,
dropping local ones that never got there, so all resume from one step) and
`.../exchange/<attempt>` the files the ranks trade (`training.runtime.exchange`), a
`STOP` object once any node has failed, and with node task workers the output node 0
trained. Node 0 writes the stage's output. If one node fails, the others stop and the
train task fails as a whole; its retry resumes every node from the shared checkpoint.

Where the node task runs go (`train.node_dispatch`):
- 'local': threads of the train task, on this machine (one machine; the loopback test).
- 'workers': Prefect task workers, one per node (`recforge node-worker --node-rank I`,
  started on that node against the same Prefect API). Each node's task has a key of
  its own (`train_node_<I>`), so node I's run reaches node I's worker and node 0's the
  machine at `train.master_addr`. The run's parameters (`NodeRunSpec`) and results go
  through Prefect's task-scheduling and result storage, which a cluster points at
  shared storage (PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK,
  PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK). A node whose worker does not take its run
  within `train.node_pickup_timeout_s` fails the stage naming the node, without retries.
"""

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import ObjectNotFound
from prefect.futures import PrefectFuture, wait
from prefect.settings import PREFECT_API_URL
from prefect.states import State

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.durable import write_json
from artifacts.errors import ConfigError, DeterministicError
from artifacts.locations import download_files, is_remote, join, read_text_or_none, upload_files
from artifacts.store import ArtifactStore, describe_files
from tasks.common import StageOutput, upstream_dirs
from tasks.progress import format_resume_line, train_progress
from training.config import TrainConfig
from training.errors import TrainingCrashed
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


OUTPUT_PREFIX = "output"


Logger = logging.Logger | logging.LoggerAdapter


class NodeUnavailable(DeterministicError):
    """A node's task run was not taken by its worker in time (retrying would wait again)."""


@dataclass(frozen=True)
class NodeRunSpec:
    """What every node of one attempt needs; picklable, for a task worker elsewhere.

    Attributes:
        config: The train config (launcher 'per_node').
        shard: The shard stage's output.
        preprocess: The preprocess stage's output (the family picks what it reads).
        root: The artifact root (an object-store URL when nodes are other machines).
        fp: The train stage's fingerprint.
        exchange: This attempt's scratch prefix (`<root>/checkpoints/train/<fp>/exchange/<id>`).
        hosts: The hostfile's (host, slots) for the first `nodes` nodes.
        port: The rendezvous port on `config.master_addr`.
    """

    config: TrainConfig
    shard: StageOutput
    preprocess: StageOutput
    root: str
    fp: str
    exchange: str
    hosts: list[tuple[str, int]]
    port: int


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
        fp: The train stage's fingerprint.
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
    ) -> None:
        hosts = (
            read_hostfile(Path(config.hostfile), config.nodes, config.node_ranks())
            if config.hostfile
            else node_hosts(config.nodes, config.node_ranks())
        )
        self.spec = NodeRunSpec(
            config=config,
            shard=shard,
            preprocess=preprocess,
            root=store.url,
            fp=fp,
            exchange=store.location("checkpoints", "train", fp, "exchange", uuid.uuid4().hex),
            hosts=hosts,
            port=config.master_port or free_port(),
        )
        self.work = store.root / "nodes" / "train" / fp
        self.env = env
        self.logger = logger

    def run(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """Run every node; node 0's result, its output in `out_dir`.

        Raises:
            The first failed node's deterministic error (a config or data problem is
            found by every node alike); NodeUnavailable when a node's worker never took
            its run; else TrainingCrashed naming each failed node.
        """
        if self.spec.config.node_dispatch == "workers":
            result = self._run_on_workers(out_dir, on_progress)
        else:
            result = self._run_here(out_dir, on_progress)
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
        wait(futures)
        failures: list[tuple[int, BaseException]] = []
        for index, future in enumerate(futures):
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
        futures = [node_task(index).delay(spec, index) for index in range(nodes)]
        self.logger.info(
            "sent train-node-0 .. train-node-%d to the nodes' task workers "
            "(`recforge node-worker --node-rank I`); waiting up to %.0f s for each to start",
            nodes - 1,
            spec.config.pickup_timeout_s(),
        )
        states = _await_nodes(futures, spec, self.logger)
        failures: list[tuple[int, BaseException]] = []
        for index, state in enumerate(states):
            if isinstance(state, BaseException):
                failures.append((index, state))
            elif not state.is_completed():
                failures.append((index, _node_error(futures[index], state)))
        _raise_failures(failures, nodes)
        outcome: dict = futures[0].result()
        fetch_output(spec.exchange, outcome["files"], out_dir)
        for record in outcome["history"]:
            on_progress(record)
        return replace(outcome["result"], out_dir=out_dir)


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
    try:
        reason = read_text_or_none(join(spec.exchange, STOP_OBJECT))
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
    I's run is taken only by a worker started with `--node-rank I`.
    """

    def train_node(spec: NodeRunSpec, index: int) -> dict[str, Any]:
        return run_worker_node(spec, index)

    train_node.__name__ = train_node.__qualname__ = f"train_node_{index}"
    return task(
        name=f"train-node-{index}",
        task_run_name=f"train-node-{index}",
        retries=0,
        cache_policy=NO_CACHE,
    )(train_node)


def run_worker_node(spec: NodeRunSpec, index: int) -> dict[str, Any]:
    """In node `index`'s task worker: train this node's ranks; node 0 uploads the output.

    Returns:
        {"result": node 0's TrainResult (None elsewhere), "history": its progress
        records, "files": {output file: sha256} under `<exchange>/output`}.
    """
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
    return {"result": result, "history": history, "files": files}


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
    """Tell every node of the attempt to stop (best effort: the store may be the failure)."""
    try:
        write_json(
            join(exchange, STOP_OBJECT),
            {"node": index, "error": type(error).__name__, "message": str(error)[:2000]},
        )
    except Exception as failure:  # noqa: BLE001 - the node's own error is what matters
        logging.getLogger(__name__).warning("could not write the STOP object: %s", failure)


def _watch_stop(exchange: str, stop: threading.Event, done: threading.Event) -> None:
    """Set `stop` once the attempt's STOP object exists; ends when `done` is set."""
    location = join(exchange, STOP_OBJECT)
    while not done.wait(POLL_S):
        try:
            if read_text_or_none(location) is not None:
                stop.set()
        except Exception:  # noqa: BLE001, S112 - a store hiccup: look again
            continue


def _await_nodes(
    futures: list[PrefectFuture], spec: NodeRunSpec, logger: Logger
) -> list[State | BaseException]:
    """Each node run's final state, or the error that stands for it.

    A run that no worker takes within the pickup timeout becomes NodeUnavailable; once a
    node has failed, the rest get `STOP_WAIT_S` to report before they count as lost.
    """
    nodes = len(futures)
    outcome: dict[int, State | BaseException] = {}
    started: set[int] = set()
    pickup_deadline = time.monotonic() + spec.config.pickup_timeout_s()
    stop_deadline: float | None = None
    while len(outcome) < nodes:
        now = time.monotonic()
        for index, future in enumerate(futures):
            if index in outcome:
                continue
            state = _state_of(future)
            if state is not None and state.is_final():
                outcome[index] = state
                if not state.is_completed() and stop_deadline is None:
                    stop_deadline = now + STOP_WAIT_S
                continue
            if state is not None and not state.is_scheduled():  # taken by its worker
                if index not in started:
                    started.add(index)
                    logger.info("train-node-%d started on its worker", index)
                continue
            if index not in started and (now > pickup_deadline or stop_deadline is not None):
                error = NodeUnavailable(
                    f"node {index}: no task worker took its run (train-node-{index}) within "
                    f"{spec.config.pickup_timeout_s():.0f} s; start `recforge node-worker "
                    f"--node-rank {index}` on that node with this PREFECT_API_URL (node 0's "
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


def _state_of(future: PrefectFuture) -> State | None:
    """The run's state now; None while the API does not know the run yet."""
    try:
        return future.state
    except ObjectNotFound:
        return None


def _node_error(future: PrefectFuture, state: State) -> BaseException:
    """The exception a failed node run raised, or one made from its state's message."""
    try:
        future.result(raise_on_failure=True)
    except BaseException as error:  # noqa: BLE001 - the node's error, returned
        return error
    return TrainingCrashed(f"{state.name}: {state.message}")


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
