"""The train stage's steps that both model families take around their own planning.

Writes into a train output directory: `memory_plan.json`, `train_config.json`,
`model_config.json` and `launch.json` (the spec the ranks read), then launches the
ranks (`training.runtime.launcher`) and turns rank 0's summary into a `TrainResult`.
What to plan and what the spec holds stays with the family (`training.ctr.train`,
`training.sequence.train`, as a `LaunchPlan`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from training.config import WHERE_FIELDS, TrainConfig
from training.runtime.files import (
    LAUNCH_FILE,
    LAUNCHER_LOG_FILE,
    MEMORY_PLAN_FILE,
    MODEL_CONFIG_FILE,
    RANKS_FILE,
    RESUME_DIR,
    SUMMARY_FILE,
    TRAIN_CONFIG_FILE,
    TRAIN_LOG_FILE,
    WEIGHTS_FILE,
    write_json,
)
from training.runtime.launcher import (
    NodeLaunch,
    TrainResult,
    launch_ranks,
    launcher_command,
    launcher_env,
)
from training.runtime.memory import MemoryPlan, plan_record

# Train config fields that say how a run reports and saves, not what it trains: a
# resume may change them, so they are left out of the resume fingerprints.
NOT_FINGERPRINTED = (
    "log_every",
    "tensorboard",
    "checkpoint_every",
    "checkpoint_every_s",
    "checkpoint_max_deltas",
    "checkpoint_rebase_share",
    "checkpoint_async",
    "threads_per_rank",
    "keep_checkpoints",
    "prefetch_batches",
    "memory_per_rank_gb",
    *WHERE_FIELDS,
)

# Outputs of an earlier run in the same directory that this run writes anew.
_STALE_FILES = (TRAIN_LOG_FILE, SUMMARY_FILE, WEIGHTS_FILE, LAUNCHER_LOG_FILE)


def resume_root(checkpoint_root: Path | None, out_dir: Path) -> Path:
    """Where a run's resume checkpoints go: `checkpoint_root`, default `out_dir/resume`."""
    return Path(checkpoint_root or out_dir / RESUME_DIR).resolve()


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a family planned before its ranks start.

    Attributes:
        spec: The launch spec the ranks read (JSON-able; saved as `launch.json`).
        model_config: The model's constructor arguments (`model_config.json`).
        memory_plan: The planner's per-rank estimate (`memory_plan.json`).
        checkpoint_root: The resume checkpoints' directory.
    """

    spec: Mapping[str, Any]
    model_config: Mapping[str, Any]
    memory_plan: MemoryPlan
    checkpoint_root: Path


class PlanRun(Protocol):
    """A family's planning: `plan_ctr_run` or `plan_sequence_run`."""

    def __call__(
        self,
        config: TrainConfig,
        data_dir: Path,
        out_dir: Path,
        accelerator: Literal["cpu", "cuda"],
        env: Mapping[str, str],
        memory_budget: tuple[int, str] | None,
        checkpoint_root: Path | None,
    ) -> LaunchPlan: ...


def run_train_stage(
    plan_run: PlanRun,
    module: str,
    config: TrainConfig,
    data_dir: Path,
    out_dir: Path,
    accelerator: Literal["cpu", "cuda"],
    master_port: int,
    env: Mapping[str, str],
    on_log: Callable[[str], None] | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
    python: str,
    memory_budget: tuple[int, str] | None,
    checkpoint_root: Path | None,
    node: NodeLaunch | None = None,
    stop: threading.Event | None = None,
    artifact_root: str | None = None,
) -> TrainResult | None:
    """Plan a run, write its files, launch `config.world_size` ranks of `module`, collect them.

    With `node` (launcher 'per_node'), this call starts one node's ranks and only node 0
    collects the run's result; the other nodes return None.

    Args:
        plan_run: The family's planning (launch spec, model config, memory plan).
        module: The rank module, e.g. "training.ctr.worker".
        config: The resolved train config (saved as `train_config.json`).
        data_dir: What the family trains on (shard or sequences directory).
        out_dir: The train output directory (created; stale outputs removed).
        accelerator: "cpu" (gloo, `DS_ACCELERATOR=cpu` for the ranks) or "cuda".
        master_port: A free TCP port for the ranks' rendezvous.
        env: The launcher's environment, built by the caller.
        on_log: Called with every output line of the launcher and the ranks.
        on_progress: Called with every parsed progress record.
        python: The interpreter that runs the launcher.
        memory_budget: Passed to `plan_run`.
        checkpoint_root: Passed to `plan_run`.
        node: Where the ranks run when they span nodes; None: all on this machine.
        stop: Set by the caller to stop the ranks early (another node failed).
        artifact_root: The run's artifact root, written into the launch spec: a rank
            whose root is shared storage refuses to start without the run key
            (`training.runtime.rank.require_rank_key`).

    Returns:
        The run's result, from rank 0's `train_summary.json` ("final_loss", "steps",
        "samples_per_s", "step_ms", "world_size", "resumed_from_step" and
        "resumed_from_world_size").

    Raises:
        ConfigError, InputNotFoundError, SchemaError: From `plan_run`, before any launch.
        TrainingCrashed: The launcher or a rank exited non-zero.
    """
    started = time.monotonic()
    out_dir = Path(out_dir).resolve()
    launch_env = launcher_env(env, accelerator)
    plan = plan_run(config, data_dir, out_dir, accelerator, env, memory_budget, checkpoint_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in _STALE_FILES:
        (out_dir / stale).unlink(missing_ok=True)
    write_json(out_dir / MEMORY_PLAN_FILE, plan_record(plan.memory_plan))
    write_json(out_dir / TRAIN_CONFIG_FILE, config.model_dump(mode="json"))
    write_json(out_dir / MODEL_CONFIG_FILE, plan.model_config)
    spec_path = out_dir / LAUNCH_FILE
    spec = dict(plan.spec)
    if node is not None and node.exchange is not None:
        spec["node_exchange"] = {"url": node.exchange, "ranks_per_node": node.ranks_per_node}
    if artifact_root is not None:
        spec["artifact_root"] = artifact_root
    write_json(spec_path, spec)
    command = launcher_command(python, config.world_size, master_port, module, spec_path, node)
    collects = node is None or node.node_rank in (None, 0)
    # Resumable runs share their checkpoints across attempts: record who writes them.
    # (Sequence models' in-training validation keeps its best weights there too.)
    resumable = config.saves_resume_checkpoints() or config.eval_every_epochs
    owner = plan.checkpoint_root / RANKS_FILE if resumable else None
    summary = launch_ranks(command, launch_env, out_dir, on_log, on_progress, owner, collects, stop)
    if summary is None:
        return None
    return TrainResult(
        out_dir=out_dir,
        # None: a resumed run had no step left (its validation had already stopped it).
        final_loss=float("nan") if summary["final_loss"] is None else float(summary["final_loss"]),
        steps=int(summary["steps"]),
        samples_per_s=float(summary["samples_per_s"]),
        seconds=time.monotonic() - started,
        step_ms=dict(summary.get("step_ms", {})),
        memory_plan=plan.memory_plan,
        resumed_from_step=summary.get("resumed_from_step"),
        world_size=summary.get("world_size", config.world_size),
        resumed_from_world_size=summary.get("resumed_from_world_size"),
        startup_s=dict(summary.get("startup_s", {})),
        table_precision=summary.get("table_precision"),
        comm_precision=summary.get("comm_precision"),
        wire_bytes_per_sample=summary.get("wire_bytes_per_sample"),
    )
