"""Prefect task for the train stage: launches DeepSpeed ranks as separate processes.

The ranks keep their crash-safe resume checkpoints in a local directory per
fingerprint (`training.runtime.checkpoint`). With a remote artifact root
(`s3://...`) that directory is mirrored to ``<root>/checkpoints/train/<fp>/``
(`CheckpointMirror`): before the ranks start, the newest remote checkpoint that
verifies is downloaded (so a retry on another machine resumes); while they run,
each newly committed checkpoint is uploaded, files first and its manifest last. A
remote checkpoint is committed when its manifest object exists; no rename is needed.
"""

import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from data_prep.errors import DeterministicError, TrainingCrashed
from tasks.checkpoint_mirror import CheckpointMirror
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
)
from tasks.progress import format_resume_line, train_progress
from tasks.store import ArtifactStore, remove_tree
from training.config import SEQUENCE_MODELS, TrainConfig
from training.ctr.train import train_model
from training.runtime.files import SUMMARY_FILE
from training.runtime.hosts import check_ssh_hosts, node_hosts, read_hostfile, save_hostfile
from training.runtime.launcher import (
    ERROR_PREFIX,
    RESUME_PREFIX,
    NodeLaunch,
    TrainResult,
    free_port,
    is_protocol_line,
    parse_record,
)
from training.runtime.memory import machine_memory_bytes
from training.sequence.train import train_sequence_model

# Share of the machine's memory the ranks may plan for; the rest is the OS, Prefect
# and the page cache the reader lives on.
MEMORY_SHARE = 0.85


def memory_budget(config: TrainConfig, accelerator: str) -> tuple[int, str]:
    """Per-rank memory budget for the planner, and where the figure comes from.

    Planned per node: a node's memory is shared by its `ranks_per_node` ranks (on GPUs
    each rank has its own device). Every node is taken to be like this machine.
    """
    if accelerator == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of GPU 0's memory"
    total = machine_memory_bytes()
    ranks = config.node_ranks()
    where = "this machine's" if config.nodes == 1 else "each node's (as this machine's)"
    return (
        int(total * MEMORY_SHARE / ranks),
        f"{MEMORY_SHARE:.0%} of {where} {total / 2**30:.1f} GiB / {ranks} ranks per node",
    )


def ssh_launch(config: TrainConfig) -> NodeLaunch:
    """launcher 'ssh': the checked hostfile, every host answering ssh, as a `NodeLaunch`.

    Raises:
        InputNotFoundError: train.hostfile does not exist.
        ConfigError: The hostfile does not fit the layout, or a host does not answer
            (named), or pdsh is missing.
    """
    hostfile = Path(config.hostfile or "").expanduser().resolve()
    hosts = read_hostfile(hostfile, config.nodes, config.node_ranks())
    check_ssh_hosts([host for host, _ in hosts], config.ssh_port, hostfile)
    return NodeLaunch(
        hostfile, config.nodes, config.node_ranks(), config.master_addr, None, config.ssh_port
    )


class PerNodeRun:
    """launcher 'per_node': one Prefect task run per node, each launching its node's ranks.

    Every node has a working directory of its own (its resume checkpoints, and for
    nodes other than 0 the output directory the ranks need but nobody keeps); the nodes
    share only the artifact root. There, `<root>/checkpoints/train/<fp>` holds the
    resume checkpoints (node 0 uploads them; every node pulls the newest before its
    ranks start, dropping local ones that never got there, so all resume from one step)
    and `.../exchange/<attempt>` the files the ranks trade (`NodeExchange`). Node 0
    writes the stage's output. If one node fails, the others are stopped and the train
    task fails as a whole; its retry resumes every node from the shared checkpoint.

    Args:
        launch: The family's train function with config, data and budget bound.
        config: The train config (launcher 'per_node').
        store: The artifact store.
        fp: The train stage's fingerprint.
        env: The launcher's environment.
        logger: The train task's logger.
    """

    def __init__(
        self,
        launch: Callable[..., TrainResult | None],
        config: TrainConfig,
        store: ArtifactStore,
        fp: str,
        env: dict[str, str],
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> None:
        self.launch = launch
        self.config = config
        self.fp = fp
        self.env = env
        self.logger = logger
        self.work = store.root / "nodes" / "train" / fp
        self.remote = store.location("checkpoints", "train", fp)
        self.exchange = store.location("checkpoints", "train", fp, "exchange", uuid.uuid4().hex)
        self.stop = threading.Event()

    def run(self, out_dir: Path, on_progress: Callable[[dict], None]) -> TrainResult:
        """Run every node's task; node 0's result.

        Raises:
            The first node's deterministic error (a config or data problem is found by
            every node alike), else TrainingCrashed naming each failed node.
        """
        config = self.config
        hosts = (
            read_hostfile(Path(config.hostfile), config.nodes, config.node_ranks())
            if config.hostfile
            else node_hosts(config.nodes, config.node_ranks())
        )
        hostfile = save_hostfile(self.work / "hostfile", hosts)
        port = config.master_port or free_port()
        futures = [
            train_node_task.submit(self, index, hostfile, port, out_dir, on_progress)
            for index in range(config.nodes)
        ]
        wait(futures)
        failures: list[tuple[int, BaseException]] = []
        for index, future in enumerate(futures):
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - reported below, per node
                failures.append((index, error))
        for _, error in failures:
            if isinstance(error, DeterministicError):
                raise error
        if failures:
            lines = "".join(f"\n  node {index}: {error}" for index, error in failures)
            raise TrainingCrashed(f"{len(failures)} of {config.nodes} train nodes failed:{lines}")
        shutil.rmtree(self.work, ignore_errors=True)
        result = futures[0].result()
        assert result is not None  # node 0 collects
        return result

    def run_node(
        self,
        index: int,
        hostfile: Path,
        port: int,
        out_dir: Path,
        on_progress: Callable[[dict], None],
    ) -> TrainResult | None:
        """Node `index`: align its checkpoints with the store, launch its ranks."""
        node_dir = self.work / f"node-{index}"
        logger = self.logger
        mirror = CheckpointMirror(
            node_dir / "resume",
            self.remote,
            self.config.keep_checkpoints,
            lambda line: logger.info("node %d: %s", index, line),
        )
        node = NodeLaunch(
            hostfile,
            self.config.nodes,
            self.config.node_ranks(),
            self.config.master_addr,
            node_rank=index,
            exchange=self.exchange,
        )
        run = partial(
            self.launch,
            out_dir if index == 0 else node_dir / "out",
            master_port=port,
            env=self.env,
            on_log=partial(log_launcher_line, logger) if index == 0 else None,
            on_progress=on_progress if index == 0 else None,
            checkpoint_root=node_dir / "resume",
            node=node,
            stop=self.stop,
        )
        try:
            mirror.pull(exact=True)
            if index != 0:
                return run()
            with mirror.pushing():  # node 0's copy is whole after every exchange
                return run()
        except BaseException:
            self.stop.set()  # the other nodes' ranks would wait for this one's
            raise


@task(name="train-node", task_run_name="train-node-{index}", retries=0, cache_policy=NO_CACHE)
def train_node_task(
    nodes: PerNodeRun,
    index: int,
    hostfile: Path,
    port: int,
    out_dir: Path,
    on_progress: Callable[[dict], None],
) -> TrainResult | None:
    """One node of a per-node train run; the train task retries the whole run."""
    return nodes.run_node(index, hostfile, port, out_dir, on_progress)


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


# A crashed or killed rank is transient: retry after 10 s, 20 s.
@task(name="train", task_run_name="train", **task_options(backoff_seconds=10.0, retries=2))
def train_task(
    config: TrainConfig, shard: StageOutput, preprocess: StageOutput, root: str, mode: Mode
) -> StageOutput:
    """Train the model with DeepSpeed on `config.world_size` ranks.

    CTR models read the shards; sequence models (SASRec) preprocess's sequences/.
    """
    fp = stage_fingerprint("train", config.fingerprinted(), [shard, preprocess])
    logger = get_run_logger()
    store = ArtifactStore(root)
    # For a remote root this is the local mirror of <root>/checkpoints/train/<fp>.
    resume_root = store.root / "checkpoints" / "train" / fp
    mirror = (
        CheckpointMirror(
            resume_root,
            store.location("checkpoints", "train", fp),
            config.keep_checkpoints,
            logger.info,
        )
        if store.remote
        else None
    )

    def produce(out_dir: Path) -> dict:
        progress_id = create_progress_artifact(
            progress=0.0, key="train-progress", description="Training steps completed (%)"
        )
        history: list[dict] = []
        # The ranks' protocol lines drive the bar and become human lines in the log; the
        # raw records stay in the launcher log (launcher.log in the stage output).
        with train_progress(logger) as shown:

            def on_progress(record: dict) -> None:
                history.append(record)
                shown.on_progress(record)
                update_progress_artifact(
                    progress_id, progress=100.0 * record["step"] / record["total_steps"]
                )

            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
            if config.model in SEQUENCE_MODELS:
                train_fn, data_dir = train_sequence_model, local_dir(preprocess) / "sequences"
            else:
                train_fn, data_dir = train_model, local_dir(shard)

            launch = partial(
                train_fn,
                config,
                data_dir,
                accelerator=accelerator,
                memory_budget=memory_budget(config, accelerator),
            )
            if config.launcher == "per_node":
                nodes = PerNodeRun(launch, config, store, fp, dict(os.environ), logger)
                result = nodes.run(out_dir, on_progress)
            else:
                run = partial(
                    launch,
                    out_dir,
                    master_port=config.master_port or free_port(),
                    env=dict(os.environ),
                    on_log=partial(log_launcher_line, logger),
                    on_progress=on_progress,
                    # Outlives this attempt's staging directory, so that a retry resumes.
                    checkpoint_root=resume_root,
                    node=ssh_launch(config) if config.launcher == "ssh" else None,
                )
                if mirror is None:
                    result = run()
                else:
                    mirror.pull()
                    with mirror.pushing():
                        result = run()
        update_progress_artifact(progress_id, progress=100.0)
        # CTR runs split a step into data/lookup/dense/optimizer; pipelines report "step".
        phases = list(history[0]["step_ms"]) if history else []
        rows = "\n".join(
            f"| {r['step']} | {r['loss']:.5f} | {r['samples_per_s']:.0f} | "
            + " | ".join(f"{r['step_ms'][phase]:.1f}" for phase in phases)
            + f" | {' / '.join(f'{m:.0f}' for m in r['rss_mb'])} |"
            for r in history
        )
        create_markdown_artifact(
            key="train-loss",
            markdown="| step | loss | samples/s | "
            + " | ".join(f"{phase} ms" for phase in phases)
            + " | RSS MB per rank |\n|"
            + "---|" * (4 + len(phases))
            + "\n"
            + rows,
            description="Training loss, throughput, step time split and memory by step",
        )
        create_markdown_artifact(
            key="train-memory-plan",
            markdown=result.memory_plan.table(),
            description="Planned memory per rank (training.ctr.memory)",
        )
        if result.resumed_from_step is not None:
            create_markdown_artifact(
                key="train-resume",
                markdown=f"Resumed from the checkpoint of step {result.resumed_from_step} "
                f"under `{resume_root}`.",
                description="Where this training run continued from",
            )
        validation = _validation_record(out_dir)
        if validation is not None:
            create_markdown_artifact(
                key="train-validation",
                markdown=_validation_table(validation),
                description="Valid-split metric by step, the best step (its weights are "
                "the model) and why training stopped",
            )
        # The stage output holds the final checkpoint; the resume checkpoints are spent.
        shutil.rmtree(resume_root, ignore_errors=True)
        if mirror is not None or config.launcher == "per_node":
            remove_tree(store.location("checkpoints", "train", fp))
        return {
            "resumed_from_step": result.resumed_from_step,
            "final_loss": result.final_loss,
            "steps": result.steps,
            "samples_per_s": result.samples_per_s,
            "seconds": result.seconds,
            "step_ms": result.step_ms,
            # Sequence models with train.eval_every_epochs: best step, curve, stop reason.
            **({"validation": validation} if validation is not None else {}),
        }

    return as_state(run_stage("train", fp, mode, root, produce))


def _validation_record(out_dir: Path) -> dict | None:
    """The in-training validation the ranks summarised, or None when there was none."""
    summary_path = out_dir / SUMMARY_FILE
    if not summary_path.is_file():
        return None
    return json.loads(summary_path.read_text()).get("validation")


def _validation_table(validation: dict) -> str:
    """A markdown table of the valid curve, the best step marked."""
    metric = validation["metric"]
    rows = "\n".join(
        f"| {point['step']} | {point['epoch']:.1f} | {point['value']:.5f} | "
        f"{'best' if point['step'] == validation['best_step'] else ''} |"
        for point in validation["curve"]
    )
    return (
        f"| step | epoch | valid {metric} | |\n|---|---|---|---|\n{rows}\n\n"
        f"Best: step {validation['best_step']} (epoch {validation['best_epoch']:.1f}), "
        f"{metric} {validation['best_value']:.5f}. {validation['stop_reason']}"
    )
