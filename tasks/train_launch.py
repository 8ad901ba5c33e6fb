"""What every way of launching the train stage's ranks shares.

The family's train function with its data and memory budget bound (`family_launch`),
the per-rank memory budget of a node (`memory_budget`), launcher 'ssh''s checked
hostfile (`ssh_launch`) and how a launcher's output lines reach the task's log
(`log_launcher_line`). Used by the train task (`tasks.train`) and by each node of a
per-node run (`tasks.train_nodes`), which may run on another machine.
"""

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from tasks.common import StageOutput, local_dir
from tasks.progress import format_resume_line
from training.config import SEQUENCE_MODELS, TrainConfig
from training.ctr.train import train_model
from training.runtime.hosts import check_ssh_hosts, read_hostfile
from training.runtime.launcher import (
    ERROR_PREFIX,
    RESUME_PREFIX,
    NodeLaunch,
    TrainResult,
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

    Planned per node, on the machine that calls it (each node of a per-node run plans
    on its own): a node's memory is shared by its `ranks_per_node` ranks (on GPUs each
    rank has its own device).
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


def family_launch(
    config: TrainConfig, shard: StageOutput, preprocess: StageOutput
) -> Callable[..., TrainResult | None]:
    """The family's train function with config, local data and memory budget bound.

    CTR models read the shards; sequence models (SASRec, BST) preprocess's sequences/.
    The data is downloaded here when the root is remote (`local_dir`).
    """
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if config.model in SEQUENCE_MODELS:
        train_fn, data_dir = train_sequence_model, local_dir(preprocess) / "sequences"
    else:
        train_fn, data_dir = train_model, local_dir(shard)
    return partial(
        train_fn,
        config,
        data_dir,
        accelerator=accelerator,
        memory_budget=memory_budget(config, accelerator),
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
