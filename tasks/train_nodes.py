"""launcher 'per_node': one Prefect task run per node, each launching its node's ranks.

Prefect dispatch only. What the nodes trade through the artifact root (the attempt's
signed spec, STOP object, heartbeats, outcomes and node 0's output), how a node aligns
its checkpoints and launches its ranks, and how a worker checks where a run sends it
are the protocol in `training.runtime.nodes`, below this layer. Node 0 writes the
stage's output. If one node fails, the others stop and the train task fails as a whole;
its retry resumes every node from the shared checkpoint.

Where the node task runs go (`train.node_dispatch`):
- 'local': threads of the train task, on this machine (one machine; the loopback test).
- 'workers': Prefect task workers, one per node (`recforge node-worker --node-rank I
  --root ROOT`, started on that node against the same Prefect API). Each node's task
  has a key of its own (`train_node_<I>`), so node I's run reaches node I's worker and
  node 0's the machine at `train.master_addr`. A node whose worker does not take its
  run within `train.node_pickup_timeout_s` fails the stage naming the node, without
  retries.

What travels how, with workers: shared storage is not trusted (docs/security.md), and
Prefect reads a background task's stored parameters and result with whatever serializer
the stored record names, cloudpickle included, so no node run has Prefect parameters
and nobody reads a node run's Prefect result. The train task writes the attempt's spec
as signed JSON in its exchange and tags each node run with the exchange
(`recforge-exchange:<url>`, kept by the Prefect API, not by storage). Anyone who can
start task runs can write such a tag, so a worker serves only the exchanges under the
root it was started with; it verifies the spec before it trains or signs anything, and
leaves a signed outcome, which the train task verifies before it trusts a name in it.
"""

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from prefect import get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.exceptions import ObjectNotFound
from prefect.futures import PrefectFuture, wait
from prefect.settings import PREFECT_API_URL
from prefect.states import State
from pydantic import ValidationError

from artifacts.errors import ConfigError, DataError
from artifacts.locations import is_remote
from artifacts.store import ArtifactStore
from tasks.common import StageOutput, load_run_key, upstream_dirs
from tasks.progress import format_resume_line, train_progress
from training.config import TrainConfig
from training.errors import TrainingCrashed
from training.runtime import nodes
from training.runtime.launcher import (
    ERROR_PREFIX,
    RESUME_PREFIX,
    TrainResult,
    is_protocol_line,
    parse_record,
)
from training.runtime.nodes import NodeLost, NodeOutcome, NodeRunSpec, NodeUnavailable
from training.stages import train_launch

# The tag that tells a node's worker where its attempt's exchange is (see the docstring).
EXCHANGE_TAG = "recforge-exchange:"

Logger = logging.Logger | logging.LoggerAdapter


def flow_run_key() -> str:
    """The flow run whose failed attempts a train task reads and appends to."""
    from prefect.runtime import flow_run

    return flow_run.id or "no-flow"


def failed_attempts_before(store: ArtifactStore, key: str) -> list[dict]:
    """The attempts of the train stage (resume key `key`) that failed in this flow run."""
    return nodes.read_failed_attempts(store.root / "nodes" / "train" / key, flow_run_key())


def stage_inputs(spec: NodeRunSpec) -> list[StageOutput]:
    """The upstream outputs a signed spec names, as the task layer's records.

    Raises:
        DataError: A record is not a stage output (the flow runs other recforge code).
    """
    try:
        return [StageOutput.model_validate(record) for record in spec.inputs.values()]
    except ValidationError as err:
        raise DataError(
            f"{spec.exchange}/{nodes.SPEC_OBJECT} is signed but names an input that is not a "
            f"stage output ({err.error_count()} problem(s)); run the same recforge on the "
            "flow's machine and the nodes"
        ) from err


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
        workers: The workers of this attempt's nodes (`nodes.surviving_layout`); None: all.
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
        inputs = {out.stage: out.model_dump(mode="json") for out in (shard, preprocess)}
        self.spec = nodes.new_spec(config, inputs, store, fp, workers)
        self.upstream = (shard, preprocess)
        self.work = store.root / "nodes" / "train" / fp
        self.env = env
        self.logger = logger
        self.lost: dict[int, str] = {}

    def run(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """Run every node; node 0's result, its output in `out_dir`.

        Raises:
            The first failed node's deterministic error (a config or data problem is
            found by every node alike); NodeUnavailable when a node's worker never took
            its run; else TrainingCrashed naming each failed node (or node 0's output
            missing from its outcome).
        """
        try:
            if self.spec.config.node_dispatch == "workers":
                result = self._run_on_workers(out_dir, on_progress)
            else:
                result = self._run_here(out_dir, on_progress)
        except Exception as error:
            nodes.record_failed_attempt(self.work, flow_run_key(), error, self.lost)
            raise
        shutil.rmtree(self.work, ignore_errors=True)
        return result

    def _run_here(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """dispatch 'local': every node a task run in a thread of this process."""
        launch = train_launch(self.spec.config, upstream_dirs(*self.upstream))
        stop = threading.Event()
        on_log = partial(log_launcher_line, self.logger)
        futures = [
            train_node_task.submit(
                index,
                partial(
                    nodes.run_node,
                    self.spec,
                    index,
                    launch,
                    out_dir if index == 0 else None,
                    self.env,
                    self.logger,
                    on_log if index == 0 else None,
                    on_progress if index == 0 else None,
                    stop,
                ),
            )
            for index in range(self.spec.config.nodes)
        ]
        # The threads end when their ranks do; once one has failed (and stopped the
        # others) the rest get STOP_WAIT_S, so that no path waits without a deadline.
        done, pending = wait(futures, timeout=nodes.POLL_S)
        while pending and not stop.is_set():
            done, pending = wait(futures, timeout=nodes.POLL_S)
        if pending:
            done, pending = wait(futures, timeout=nodes.STOP_WAIT_S)
        failures: list[tuple[int, BaseException]] = []
        for index, future in enumerate(futures):
            if future in pending:
                late = f"node {index}: did not stop within {nodes.STOP_WAIT_S:.0f} s of the stop"
                failures.append((index, TrainingCrashed(late)))
                continue
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - reported below, per node
                failures.append((index, error))
        nodes.raise_failures(failures, self.spec.config.nodes)
        result = futures[0].result()
        if result is None:
            raise TrainingCrashed("node 0: its ranks finished but returned no result")
        return result

    def _run_on_workers(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """dispatch 'workers': every node a task run for its node's task worker."""
        spec = self.spec
        count = spec.config.nodes
        futures = send_node_runs(spec)
        self.logger.info(
            "sent train-node-0 .. train-node-%d to the nodes' task workers "
            "(`recforge node-worker --node-rank I --root ROOT`); waiting up to %.0f s for "
            "each to start",
            count - 1,
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
                fallback = f"{state.name}: {state.message}"
                failures.append((index, nodes.node_failure(spec.exchange, index, fallback)))
        nodes.raise_failures(failures, count)
        result, history = nodes.collect_output(spec.exchange, out_dir)
        for record in history:
            on_progress(record)
        return result


def send_node_runs(spec: NodeRunSpec) -> list[PrefectFuture]:
    """Write the attempt's signed spec, then one run per node for the nodes' task workers.

    The runs take no parameters (a worker would read them from storage, see the module
    docstring); each is tagged with the exchange, where its worker finds the spec.
    """
    nodes.write_spec(spec)
    with tags(EXCHANGE_TAG + spec.exchange):
        return [node_task(spec.worker_of(node)).delay() for node in range(spec.config.nodes)]


def exchange_of(run_tags: Iterable[str]) -> str:
    """The exchange a node run's tags name (`send_node_runs`); the worker checks where
    it lies (`nodes.worker_exchange`).

    Raises:
        ConfigError: No tag, or several (the run was not created by the train task).
    """
    found = [tag.removeprefix(EXCHANGE_TAG) for tag in run_tags if tag.startswith(EXCHANGE_TAG)]
    if len(found) != 1:
        raise ConfigError(
            f"this node run has {len(found)} {EXCHANGE_TAG}<root>/checkpoints/train/<fp>/"
            "exchange/<id> tags, not one; node runs are created by the train stage "
            "(train.node_dispatch: workers), not by hand"
        )
    return found[0]


@task(name="train-node", task_run_name="train-node-{index}", retries=0, cache_policy=NO_CACHE)
def train_node_task(index: int, body: Callable[[], TrainResult | None]) -> TrainResult | None:
    """One node of a per-node train run in this process; the train task retries the whole."""
    return body()


def node_task(index: int, root: str | None = None):  # noqa: ANN201 - a Prefect task
    """The task node `index`'s worker serves (dispatch 'workers'); its key names the node.

    Prefect routes a background task run to the workers serving its task key, which it
    derives from the function's name: each node's function has its own name, so node
    I's run is taken only by a worker started with `--node-rank I`. It takes no
    parameters and its result is JSON that nobody reads back (see the module docstring).

    Args:
        index: The worker's node rank.
        root: The artifact root the worker serves (`serve_node_worker`); the train task,
            which only sends runs, leaves it out. A run served without one is refused.
    """

    def train_node() -> str:
        if root is None:
            raise ConfigError(
                f"train-node-{index} is served without an artifact root; start the worker "
                "with `recforge node-worker --node-rank I --root ROOT`"
            )
        run = TaskRunContext.get().task_run
        return run_worker_node(index, exchange_of(run.tags), root)

    train_node.__name__ = train_node.__qualname__ = f"train_node_{index}"
    return task(
        name=f"train-node-{index}",
        task_run_name=f"train-node-{index}",
        retries=0,
        cache_policy=NO_CACHE,
        result_serializer="json",
    )(train_node)


def run_worker_node(worker: int, exchange: str, root: str) -> str:
    """In worker `worker`'s process: the node run whose tag names `exchange`
    (`nodes.run_worker_node`: under `root` only, the spec verified before anything is
    signed).

    Returns:
        Where the node's outcome is.

    Raises:
        ConfigError: The exchange lies under another root; a remote root and no key.
        SignatureError: The spec is not the train task's.
    """
    load_run_key(ArtifactStore(root))
    return nodes.run_worker_node(worker, exchange, root, _train_worker_node)


def _train_worker_node(spec: NodeRunSpec, index: int) -> NodeOutcome:
    """Train node `index`'s ranks here; node 0's outcome names its uploaded output."""
    logger = get_run_logger()
    out_dir = nodes.node_work_dir(spec.root, spec.fp, index) / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    history: list[dict] = []
    with train_progress(logger) as shown:

        def on_progress(record: dict) -> None:
            history.append(record)
            shown.on_progress(record)

        launch = train_launch(spec.config, upstream_dirs(*stage_inputs(spec)))
        result = nodes.run_node(
            spec,
            index,
            launch,
            out_dir,
            dict(os.environ),
            logger,
            partial(log_launcher_line, logger),
            on_progress if index == 0 else None,
            threading.Event(),
        )
    files: dict[str, str] = {}
    if index == 0:
        files = nodes.publish_output(out_dir, spec.exchange)
    shutil.rmtree(out_dir.parent, ignore_errors=True)
    return NodeOutcome(
        node=index,
        exchange=spec.exchange,
        status="completed",
        result=result,
        history=history,
        files=files,
    )


def serve_node_worker(index: int, root: str) -> None:
    """Serve node `index`'s train runs on `root` in this process until interrupted (one
    at a time).

    Raises:
        ConfigError: `root` is an object-store URL and no run key is configured (the
            worker could not tell the train task's spec from a forged one).
    """
    from prefect.task_worker import serve

    load_run_key(ArtifactStore(root))
    serve(node_task(index, ArtifactStore(root).url), limit=1)


def _await_nodes(
    futures: list[PrefectFuture], spec: NodeRunSpec, logger: Logger
) -> list[State | BaseException]:
    """Each node run's final state, or the error that stands for it.

    A run that no worker takes within the pickup timeout, or that vanishes from the API,
    becomes NodeUnavailable; a started node whose heartbeat does not advance for
    `train.node_heartbeat_timeout_s` becomes NodeLost (transient: the retry resumes).
    Once a node has failed, the rest get `nodes.STOP_WAIT_S` to report before they count
    as lost. Every wait here has a deadline.
    """
    count = len(futures)
    outcome: dict[int, State | BaseException] = {}
    started: set[int] = set()
    known: set[int] = set()  # runs the API has answered for
    liveness = nodes.Liveness(spec.exchange, spec.config.node_heartbeat_timeout_s)
    pickup_deadline = time.monotonic() + spec.config.pickup_timeout_s()
    stop_deadline: float | None = None
    while len(outcome) < count:
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
                nodes.request_stop(spec.exchange, index, error)
                stop_deadline = stop_deadline or now + nodes.STOP_WAIT_S
                continue
            if state is not None:
                known.add(index)
            if state is not None and state.is_final():
                outcome[index] = state
                if not state.is_completed() and stop_deadline is None:
                    stop_deadline = now + nodes.STOP_WAIT_S
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
                    nodes.request_stop(spec.exchange, index, lost)
                    stop_deadline = stop_deadline or now + nodes.STOP_WAIT_S
                    continue
                if stop_deadline is None or now <= stop_deadline:
                    continue
            if index not in started and (now > pickup_deadline or stop_deadline is not None):
                error = NodeUnavailable(
                    f"node {index}: no task worker took its run (train-node-{index}) within "
                    f"{spec.config.pickup_timeout_s():.0f} s; start `recforge node-worker "
                    f"--node-rank {spec.worker_of(index)} --root {spec.root}` on that node "
                    "with this PREFECT_API_URL (node 0's "
                    f"on {spec.config.master_addr}), or raise train.node_pickup_timeout_s"
                    if stop_deadline is None
                    else f"node {index}: not started before another node failed"
                )
                outcome[index] = error
                nodes.request_stop(spec.exchange, index, error)
                stop_deadline = stop_deadline or now + nodes.STOP_WAIT_S
                continue
            if stop_deadline is not None and now > stop_deadline:
                outcome[index] = TrainingCrashed(
                    f"node {index}: did not report back within {nodes.STOP_WAIT_S:.0f} s of the "
                    "stop (its worker or machine may be gone)"
                )
        if len(outcome) < count:
            time.sleep(nodes.POLL_S)
    return [outcome[index] for index in range(count)]


def _state_of(future: PrefectFuture) -> State | None:
    """The run's state now; None while the API does not know the run yet."""
    try:
        return future.state
    except ObjectNotFound:
        return None


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
