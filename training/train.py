"""Train stage: launch DeepSpeed ranks on a shard directory and collect their output.

Reads `<shards_dir>/dataset.json` (the train split's files are read by the ranks).
Writes to `out_dir`:

- `train_config.json`: the resolved train config;
- `model_config.json`: the `CTRModel` constructor arguments (see `training.model`);
- `memory_plan.json`: the memory planner's per-rank estimate (see `training.memory`);
- `launch.json`: the launch spec the ranks read (configs, paths, step plan);
- `launcher.log`: every line the launcher and its ranks printed;
- and, from the ranks (see `training.worker`): `train_log.jsonl`, `checkpoints/final/`,
  `model.safetensors` (consolidated fp32 weights), `tensorboard/` and
  `train_summary.json`.

Before anything is launched, the memory planner estimates each rank's memory for
the config and world size and refuses a config that cannot fit its budget.

The ranks run as `python -m deepspeed.launcher.runner ... --module training.worker`
in their own process group, which is killed if this function is interrupted, so
they are never orphaned.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from data_prep.errors import (
    ConfigError,
    DataError,
    DeterministicError,
    Preempted,
    SchemaError,
    TrainingCrashed,
)
from training.config import TrainConfig
from training.data import DatasetMeta, load_dataset_meta
from training.memory import MemoryPlan, check_memory, plan_memory
from training.model import MODEL_CONFIG_FILE, WEIGHTS_FILE, build_arch, model_config_from
from training.reader import steps_per_epoch

PROGRESS_PREFIX = "RECFORGE_PROGRESS "
ERROR_PREFIX = "RECFORGE_ERROR "
RESUME_PREFIX = "RECFORGE_RESUME "
RESUME_DIR = "resume"
RANKS_FILE = ".ranks.json"
# Fields that change how a run reports or saves, not what it computes: a retry may
# change them and still resume.
_DETERMINISTIC_RANK_ERRORS: dict[str, type[DeterministicError]] = {
    "ConfigError": ConfigError,
    "DataError": DataError,
    "SchemaError": SchemaError,
    "CheckpointCorrupt": DataError,
}
_PREEMPTED = "Preempted"
_NOT_FINGERPRINTED = (
    "log_every",
    "tensorboard",
    "checkpoint_every",
    "keep_checkpoints",
    "prefetch_batches",
    "memory_per_rank_gb",
)
LAUNCH_FILE = "launch.json"
TRAIN_CONFIG_FILE = "train_config.json"
TRAIN_LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "train_summary.json"
LAUNCHER_LOG_FILE = "launcher.log"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_TAG = "final"
TENSORBOARD_DIR = "tensorboard"
MEMORY_PLAN_FILE = "memory_plan.json"
# How each training step's time is split (see training.worker).
PHASES = ("data", "lookup", "dense", "optimizer")
TRAIN_SPLIT = "train"

_TAIL_LINES = 20
_KILL_GRACE_S = 10.0
# How long stopped ranks get before SIGKILL: with resume checkpoints on, SIGTERM makes
# them save one at their next step. DeepSpeed's launcher itself waits 30 s for its ranks
# once it gets SIGTERM.
_STOP_GRACE_S = 60.0
# DeepSpeed's CPU communication op maps one ~66 MiB tmpfs file per rank, named after
# the rendezvous address and port, and never unlinks it: every run would leak that much
# RAM until reboot (a test suite's runs fill /dev/shm and the OOM killer ends the job).
SHM_DIR = Path("/dev/shm")
# Fault injection for the chaos tests, read from the `env` a caller passes (never from
# this process's environment) into the launch spec's "chaos"; unset in real runs.
# "POINT@STEP": rank 0 SIGKILLs its launch while saving the checkpoint of step STEP, at
# POINT: "mid-file" (DeepSpeed's files written, the ranks' own not yet) or one of
# `training.checkpoint.FAULT_POINTS`.
CHAOS_CHECKPOINT_FAULT = "RECFORGE_CHAOS_CHECKPOINT_FAULT"
# "rng", "reader" or both, comma-separated: resume without restoring them (the negative
# control that shows the resume test would catch a missing restore).
CHAOS_SKIP_RESTORE = "RECFORGE_CHAOS_SKIP_RESTORE"
# N: consolidate the sharded table in chunks of N rows instead of 64 MiB, so that a
# test's small table still has chunks for every rank to write (`training.consolidate`).
CHAOS_CONSOLIDATION_CHUNK_ROWS = "RECFORGE_CHAOS_CONSOLIDATION_CHUNK_ROWS"
_SHM_BUFFER = "deepspeed_allreduce_buffer"
# The package root, put on the ranks' PYTHONPATH so they import this very `training`.
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced.

    Attributes:
        out_dir: The output directory (weights in `out_dir / "model.safetensors"`).
        final_loss: Mean train loss over the last logging window, averaged over ranks.
        steps: Optimizer steps taken.
        samples_per_s: Training throughput over all ranks.
        seconds: Wall-clock seconds of the whole launch, process start-up included.
        step_ms: Mean milliseconds per step in each phase (data, lookup, dense,
            optimizer), averaged over ranks.
        memory_plan: The planner's per-rank memory estimate.
        resumed_from_step: The checkpoint step the run continued from, None if fresh.
    """

    out_dir: Path
    final_loss: float
    steps: int
    samples_per_s: float
    seconds: float
    step_ms: dict[str, float]
    memory_plan: MemoryPlan
    resumed_from_step: int | None = None


def plan_total_steps(config: TrainConfig, meta: DatasetMeta) -> int:
    """Optimizer steps of a run: `max_steps` if set, else from `epochs` and the train rows.

    Args:
        config: The train config.
        meta: The dataset description.

    Returns:
        Number of optimizer steps (>= 1).

    Raises:
        ConfigError: The train split is too small for one optimizer step.
    """
    streams = config.num_data_streams()
    rows_per_stream = config.batch_size * config.world_size // streams
    micro_per_epoch = steps_per_epoch(meta, TRAIN_SPLIT, streams, rows_per_stream)
    if micro_per_epoch == 0:
        raise ConfigError(
            f"train.batch_size={config.batch_size}: the train split has "
            f"{meta.split(TRAIN_SPLIT).rows} rows in {streams} streams, fewer than one batch "
            f"of {config.batch_size} per rank for world_size={config.world_size}; lower "
            "batch_size, world_size or data_streams"
        )
    if config.max_steps is not None:
        return config.max_steps
    total = int(config.epochs * micro_per_epoch) // config.grad_accum_steps
    if total == 0:
        raise ConfigError(
            f"train.epochs={config.epochs}: {config.epochs} x {micro_per_epoch} micro batches "
            f"is less than one optimizer step of grad_accum_steps={config.grad_accum_steps}; "
            "raise epochs or lower grad_accum_steps"
        )
    return total


def build_deepspeed_config(
    config: TrainConfig, world_size: int, total_steps: int | None = None
) -> dict[str, Any]:
    """The DeepSpeed config dict; the only place one is built.

    Args:
        config: The train config.
        world_size: Number of ranks (data-parallel degree).
        total_steps: Optimizer steps of the run; with warmup_steps > 0 the learning rate
            warms up linearly then decays linearly to 0 at this step (without it, it
            stays at its peak after warmup).

    Returns:
        A JSON-able DeepSpeed config.
    """
    ds_config: dict[str, Any] = {
        "train_batch_size": config.global_batch_size(world_size),
        "train_micro_batch_size_per_gpu": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": config.lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": config.weight_decay,
                # torch's AdamW: DeepSpeed's fused Adam would be compiled at first use.
                "torch_adam": True,
            },
        },
        "gradient_clipping": config.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        "bf16": {"enabled": config.precision == "bf16"},
        "fp16": {
            "enabled": config.precision == "fp16",
            # 0 = dynamic loss scaling (DeepSpeed's default initial scale 2^16).
            "loss_scale": config.loss_scale,
            "initial_scale_power": 16,
        },
        # Progress is reported by the worker; silence DeepSpeed's own step prints.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.offload_optimizer:
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # Keep torch's AdamW on the offloaded state: DeepSpeedCPUAdam would be compiled.
        ds_config["zero_force_ds_cpu_optimizer"] = False
    if config.warmup_steps > 0:
        warmup = {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": config.lr,
            "warmup_num_steps": config.warmup_steps,
            "warmup_type": "linear",
        }
        if total_steps is None:
            ds_config["scheduler"] = {"type": "WarmupLR", "params": warmup}
        else:
            ds_config["scheduler"] = {
                "type": "WarmupDecayLR",
                "params": {**warmup, "total_num_steps": total_steps},
            }
    return ds_config


def train_model(
    config: TrainConfig,
    shards_dir: Path,
    out_dir: Path,
    accelerator: Literal["cpu", "cuda"],
    master_port: int,
    env: Mapping[str, str],
    on_log: Callable[[str], None] | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    python: str = sys.executable,
    memory_budget: tuple[int, str] | None = None,
    checkpoint_root: Path | None = None,
) -> TrainResult:
    """Train a CTR model with `config.world_size` DeepSpeed ranks on this machine.

    Args:
        config: The train config.
        shards_dir: The shard directory (with dataset.json).
        out_dir: Output directory; created if missing. Outputs of an earlier run there
            are replaced.
        accelerator: "cpu" (gloo, sets DS_ACCELERATOR=cpu for the ranks) or "cuda".
        master_port: A free TCP port for the ranks' rendezvous.
        env: The launcher's environment, built by the caller (this library reads none).
        on_log: Called with every output line of the launcher and the ranks.
        on_progress: Called with every parsed progress record
            ({"step", "total_steps", "loss", "samples_per_s", "epoch"}).
        python: The interpreter that runs the launcher.
        memory_budget: (bytes per rank, where that figure comes from) for the memory
            planner when `train.memory_per_rank_gb` (GiB) is unset; on CPU it is taken
            to be this machine's memory split over the ranks. None skips the check then.
        checkpoint_root: Where `train.checkpoint_every` checkpoints go (see
            `training.checkpoint`); a call with the same root and config resumes from
            the newest valid one. Pass a directory that outlives `out_dir` (the train
            task uses one per fingerprint) so that a retry resumes. Default
            `out_dir / "resume"`.

    Returns:
        The run's result (`resumed_from_step`: the checkpoint it continued from).

    Raises:
        InputNotFoundError: dataset.json or the shard directory is missing.
        SchemaError: dataset.json is invalid or has no train split.
        ConfigError: The train split is too small for the config, or the memory plan
            does not fit the budget (the message says what to change).
        TrainingCrashed: The launcher or a rank exited non-zero (message has the exit
            code and the last output lines).
    """
    started = time.monotonic()
    shards_dir = Path(shards_dir).resolve()
    out_dir = Path(out_dir).resolve()
    launch_env = _launcher_env(env, accelerator)
    if accelerator == "cpu" and config.precision == "fp16":
        raise ConfigError(
            "train.precision=fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 "
            "kernels; use precision: bf16 (no loss scaling needed) or fp32 on CPU"
        )
    meta = load_dataset_meta(shards_dir)
    total_steps = plan_total_steps(config, meta)

    model_config = model_config_from(config, meta)
    memory_plan = _plan_memory(config, meta, model_config, accelerator, memory_budget)

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (TRAIN_LOG_FILE, SUMMARY_FILE, WEIGHTS_FILE, LAUNCHER_LOG_FILE):
        (out_dir / stale).unlink(missing_ok=True)
    _write_json(out_dir / MEMORY_PLAN_FILE, _plan_record(memory_plan))
    spec = {
        "backend": "gloo" if accelerator == "cpu" else "nccl",
        "train_config": config.model_dump(mode="json"),
        "shards_dir": str(shards_dir),
        "out_dir": str(out_dir),
        "model_config": model_config,
        "ds_config": build_deepspeed_config(config, config.world_size, total_steps),
        "total_steps": total_steps,
        "checkpoint_root": str(Path(checkpoint_root or out_dir / RESUME_DIR).resolve()),
    }
    spec["config_fingerprint"] = config_fingerprint(spec)
    spec["chaos"] = chaos_settings(env)
    _write_json(out_dir / TRAIN_CONFIG_FILE, spec["train_config"])
    _write_json(out_dir / MODEL_CONFIG_FILE, model_config)
    spec_path = out_dir / LAUNCH_FILE
    _write_json(spec_path, spec)

    command = launcher_command(python, config.world_size, master_port, "training.worker", spec_path)
    # Resumable runs share their checkpoints across attempts: record who writes them.
    owner = Path(spec["checkpoint_root"]) / RANKS_FILE if config.checkpoint_every else None
    summary = launch_ranks(command, launch_env, out_dir, on_log, on_progress, owner)
    return TrainResult(
        out_dir=out_dir,
        final_loss=float(summary["final_loss"]),
        steps=int(summary["steps"]),
        samples_per_s=float(summary["samples_per_s"]),
        seconds=time.monotonic() - started,
        step_ms=dict(summary.get("step_ms", {})),
        memory_plan=memory_plan,
        resumed_from_step=summary.get("resumed_from_step"),
    )


def config_fingerprint(spec: Mapping[str, Any]) -> str:
    """sha256 of what a resumed run must share with the run that wrote the checkpoint.

    The train config (less reporting and saving fields, and the per-rank batch), the
    global batch and data streams, the model and DeepSpeed configs, the step plan and
    the data's location.
    """
    config = TrainConfig.model_validate(spec["train_config"])
    # The world size may change between runs (the checkpoint is converted and its rows
    # re-sharded) as long as the global batch and the data streams stay the same.
    dropped = (*_NOT_FINGERPRINTED, "world_size", "batch_size", "data_streams")
    train_config = {k: v for k, v in spec["train_config"].items() if k not in dropped}
    per_rank = ("train_batch_size", "train_micro_batch_size_per_gpu")
    ds_config = {k: v for k, v in spec["ds_config"].items() if k not in per_rank}
    payload = {
        "train_config": train_config,
        "global_batch_size": config.global_batch_size(),
        "data_streams": config.num_data_streams(),
        "model_config": spec["model_config"],
        "ds_config": ds_config,
        "total_steps": spec["total_steps"],
        "shards_dir": spec["shards_dir"],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def chaos_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The launch spec's "chaos" from the caller's `env` (see `CHAOS_CHECKPOINT_FAULT`)."""
    settings: dict[str, Any] = {}
    if env.get(CHAOS_CHECKPOINT_FAULT):
        settings["checkpoint_fault"] = env[CHAOS_CHECKPOINT_FAULT]
    if env.get(CHAOS_SKIP_RESTORE):
        settings["skip_restore"] = [s for s in env[CHAOS_SKIP_RESTORE].split(",") if s]
    if env.get(CHAOS_CONSOLIDATION_CHUNK_ROWS):
        settings["consolidation_chunk_rows"] = int(env[CHAOS_CONSOLIDATION_CHUNK_ROWS])
    return settings


def launcher_command(
    python: str, world_size: int, master_port: int, module: str, spec_path: Path
) -> list[str]:
    """The DeepSpeed launcher command that runs `module` on `world_size` local ranks."""
    return [
        python,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(world_size),
        "--master_port",
        str(master_port),
        "--module",
        module,
        str(spec_path),
    ]


def launch_ranks(
    command: list[str],
    env: dict[str, str],
    out_dir: Path,
    on_log: Callable[[str], None] | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
    owner_file: Path | None = None,
) -> dict[str, Any]:
    """Run the launcher, streaming its output, and return the ranks' train summary.

    Raises:
        TrainingCrashed: The launcher or a rank exited non-zero (with the ranks' error
            reports and the last lines), or it exited 0 without the summary and weights.
    """
    returncode, tail, rank_errors = _run_launcher(
        command, env, out_dir / LAUNCHER_LOG_FILE, on_log, on_progress, owner_file
    )
    if returncode != 0:
        errors = "".join(
            f"\n  rank {report.get('rank')}: {report.get('error')}" for report in rank_errors
        )
        # A rank that refused its input (config, data, checkpoint) fails the same way on
        # every retry: report it as deterministic, not as a crash.
        for report in rank_errors:
            kind, _, message = str(report.get("error", "")).partition(": ")
            if kind in _DETERMINISTIC_RANK_ERRORS:
                raise _DETERMINISTIC_RANK_ERRORS[kind](
                    f"rank {report.get('rank')}: {message} (log: {out_dir / LAUNCHER_LOG_FILE})"
                )
        preempted = [r for r in rank_errors if str(r.get("error", "")).startswith(_PREEMPTED)]
        if preempted:
            _, _, message = str(preempted[0]["error"]).partition(": ")
            raise Preempted(f"rank {preempted[0].get('rank')}: {message}; a retry resumes there")
        raise TrainingCrashed(
            f"DeepSpeed launcher exited with code {returncode} (log: "
            f"{out_dir / LAUNCHER_LOG_FILE}); rank errors, first one first:"
            f"{errors or ' none reported'}\nlast lines:\n" + "\n".join(tail)
        )
    summary_path = out_dir / SUMMARY_FILE
    if not summary_path.is_file() or not (out_dir / WEIGHTS_FILE).is_file():
        raise TrainingCrashed(
            f"the launcher exited 0 but {summary_path} or {out_dir / WEIGHTS_FILE} is "
            "missing; last lines:\n" + "\n".join(tail)
        )
    return json.loads(summary_path.read_text())


def _plan_memory(
    config: TrainConfig,
    meta: DatasetMeta,
    model_config: dict[str, Any],
    accelerator: str,
    memory_budget: tuple[int, str] | None,
) -> MemoryPlan:
    """Estimate per-rank memory and refuse a config that cannot fit (ConfigError)."""
    num_dense_params = sum(p.numel() for p in build_arch(model_config).parameters())
    plan = plan_memory(
        config,
        meta.table_sizes,
        len(meta.dense),
        num_dense_params,
        config.world_size,
        accelerator,
        feature_names=[*meta.sparse_names, *meta.multi_hot_names],
    )
    if config.memory_per_rank_gb is not None:
        budget = int(config.memory_per_rank_gb * 2**30)
        check_memory(plan, config, budget, "train.memory_per_rank_gb")
    elif memory_budget is not None:
        # One machine's memory shared by the ranks: more ranks would not add memory.
        check_memory(plan, config, *memory_budget, split_over_ranks=accelerator == "cpu")
    return plan


def _plan_record(plan: MemoryPlan) -> dict[str, Any]:
    return {
        "world_size": plan.world_size,
        "per_rank_bytes": dict(plan.per_rank),
        "host_offload_bytes": plan.host_offload,
        "total_per_rank_bytes": plan.total,
    }


def _launcher_env(env: Mapping[str, str], accelerator: str) -> dict[str, str]:
    """The caller's environment plus what the launcher and ranks need."""
    launch_env = dict(env)
    if accelerator == "cpu":
        launch_env["DS_ACCELERATOR"] = "cpu"
    elif accelerator != "cuda":
        raise ConfigError(f"accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    paths = [str(_PACKAGE_ROOT), *filter(None, launch_env.get("PYTHONPATH", "").split(":"))]
    launch_env["PYTHONPATH"] = ":".join(dict.fromkeys(paths))
    # Progress lines must arrive while training runs, not when a buffer fills.
    launch_env["PYTHONUNBUFFERED"] = "1"
    return launch_env


def _run_launcher(
    command: list[str],
    env: dict[str, str] | None,
    log_path: Path,
    on_log: Callable[[str], None] | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
    owner_file: Path | None = None,
) -> tuple[int, list[str], list[dict[str, Any]]]:
    """Run the launcher in its own process group, streaming its merged output.

    `env` is the launcher's whole environment; None inherits this process's.

    With `owner_file`, the ranks' process group is recorded there first, and whatever
    is left of the group an earlier attempt recorded is killed: when the process that
    ran the flow died, its ranks (in a session of their own) live on, and must not write
    into the checkpoints this attempt resumes from.

    Returns:
        (exit code, the last output lines, the ranks' error reports in arrival order).
    """
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    rank_errors: list[dict[str, Any]] = []
    master_port = int(command[command.index("--master_port") + 1])
    if owner_file is not None:
        _reap_previous_ranks(owner_file)
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        if owner_file is not None:
            owner_file.parent.mkdir(parents=True, exist_ok=True)
            record = {"pgid": process.pid, "master_port": master_port}
            # By rename: a reader (the next attempt's reaper) never sees it half written.
            partial = owner_file.with_name(owner_file.name + ".tmp")
            partial.write_text(json.dumps(record) + "\n")
            os.replace(partial, owner_file)
        try:
            assert process.stdout is not None  # stdout=PIPE above
            for raw_line in process.stdout:
                line = raw_line.rstrip("\n")
                tail.append(line)
                log_file.write(raw_line)
                log_file.flush()
                if on_log is not None:
                    on_log(line)
                if on_progress is not None:
                    progress = _parse_record(line, PROGRESS_PREFIX)
                    if progress is not None:
                        on_progress(progress)
                error = _parse_record(line, ERROR_PREFIX)
                if error is not None:
                    rank_errors.append(error)
            returncode = process.wait()
        finally:
            # On success this only reaps stragglers; on an exception or Ctrl-C it stops
            # the launcher and every rank, which share the launcher's process group.
            _kill_group(process)
            release_shm_buffers(master_port)
    return returncode, list(tail), rank_errors


def release_shm_buffers(master_port: int) -> list[Path]:
    """Unlink the shared-memory buffers DeepSpeed's ranks of `master_port` left behind.

    Call it once those ranks are gone (a live rank keeps its mapping, but a rank still
    starting up would not find its peers' buffers). Returns the files removed.
    """
    pattern = f"{_SHM_BUFFER}_{os.getuid()}_*_{master_port}_*"
    removed = []
    for path in SHM_DIR.glob(pattern):
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile
        removed.append(path)
    return removed


def _group_members(pgid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of the live (not zombie) processes in process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append((int(stat.parent.name), cmdline))
    return members


def unmapped_shm_buffers(min_age_s: float = 60.0) -> list[Path]:
    """This user's DeepSpeed shared-memory buffers that no live process has mapped.

    A rank maps its buffer once it has written it (~66 MiB, which takes a moment) and
    keeps it mapped until it exits, so a buffer unmapped and older than `min_age_s` is
    a leftover of a finished or killed run, safe to unlink.
    """
    cutoff = time.time() - min_age_s
    buffers = set()
    for path in SHM_DIR.glob(f"{_SHM_BUFFER}_{os.getuid()}_*"):
        try:
            if path.stat().st_mtime < cutoff:
                buffers.add(path)
        except FileNotFoundError:
            continue  # removed meanwhile
    if not buffers:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if _SHM_BUFFER in text:
            mapped.update(p for p in buffers if str(p) in text)
    return sorted(buffers - mapped)


def _reap_previous_ranks(owner_file: Path) -> None:
    """SIGKILL the process group an earlier attempt recorded, if any of it is alive.

    Only a group whose members run DeepSpeed (checked in /proc) is killed, so a reused
    group id of an unrelated process is left alone.
    """
    try:
        record = json.loads(owner_file.read_text())
        pgid = int(record["pgid"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # no earlier attempt, or nothing usable recorded
    try:
        _kill_recorded_group(pgid)
    finally:
        if isinstance(record.get("master_port"), int):
            release_shm_buffers(record["master_port"])


def _kill_recorded_group(pgid: int) -> None:
    """SIGKILL process group `pgid` if DeepSpeed ranks are in it, and wait for them."""
    ours = (b"deepspeed", b"training.worker", b"training.pipeline_worker")
    members = [pid for pid, cmdline in _group_members(pgid) if any(m in cmdline for m in ours)]
    if not members:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _KILL_GRACE_S
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in members):
        time.sleep(0.1)


def _parse_record(line: str, prefix: str) -> dict[str, Any] | None:
    """The JSON object after `prefix` in a line, or None."""
    start = line.find(prefix)
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(prefix) :])
    except json.JSONDecodeError:
        # Another rank's output can interleave with a record line; skip it.
        return None
    return record if isinstance(record, dict) else None


def _kill_group(process: subprocess.Popen[str]) -> None:
    """SIGTERM the launcher's process group, then SIGKILL whatever is left of it.

    The whole group gets the grace, not only the launcher: ranks that checkpoint on
    SIGTERM outlive the launcher's own exit.
    """
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        process.wait()
        return  # the group is empty: nothing left to stop
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline and _group_members(process.pid):
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every member exited on SIGTERM
    process.wait()


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
