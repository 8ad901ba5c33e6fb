"""Train stage: launch DeepSpeed ranks on a shard directory and collect their output.

Reads `<shards_dir>/dataset.json` (the train split's files are read by the ranks).
Writes to `out_dir`:

- `train_config.json`: the resolved train config (train.zero_stage: auto resolved to a
  stage);
- `model_config.json`: the `CTRModel` constructor arguments (see `training.ctr.model`);
- `memory_plan.json`: the memory planner's per-rank estimate (see `training.ctr.memory`);
- `launch.json`: the launch spec the ranks read (configs, paths, step plan);
- `launcher.log`: every line the launcher and its ranks printed;
- and, from the ranks (see `training.ctr.worker`): `train_log.jsonl`, `checkpoints/final/`,
  `model.safetensors` (consolidated fp32 weights), `tensorboard/` and
  `train_summary.json`.

Before anything is launched, the memory planner estimates each rank's memory for
the config and world size and refuses a config that cannot fit its budget. With
train.zero_stage: auto it first picks the lowest ZeRO stage that fits (the fastest:
`training.ctr.memory.choose_zero_stage`) and logs why; every consumer (the DeepSpeed
config, train_config.json, a resume, a warm start) sees that stage.

The ranks run as `python -m deepspeed.launcher.runner ... --module training.ctr.worker`
in their own process group, which is killed if this function is interrupted, so
they are never orphaned.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

from artifacts.errors import ConfigError
from training.config import TrainConfig
from training.ctr.data import DatasetMeta, load_dataset_meta
from training.ctr.memory import (
    check_memory,
    choose_zero_stage,
    plan_memory,
    rows_report,
    rows_that_fit,
)
from training.ctr.model import build_arch, extension_resets, model_config_from
from training.ctr.reader import steps_per_epoch
from training.runtime.deepspeed_config import build_deepspeed_config
from training.runtime.files import (
    CHECKPOINT_DIR,
    CHECKPOINT_TAG,
    MODEL_CONFIG_FILE,
    TRAIN_CONFIG_FILE,
    WEIGHTS_FILE,
    data_identity,
)
from training.runtime.launcher import NodeLaunch, TrainResult, chaos_settings
from training.runtime.memory import MemoryPlan, human_bytes
from training.runtime.stage import NOT_FINGERPRINTED, LaunchPlan, resume_root, run_train_stage

# The rank module `train_model` launches.
WORKER = "training.ctr.worker"

# How each training step's time is split (see training.ctr.worker).
PHASES = ("data", "lookup", "dense", "optimizer")


TRAIN_SPLIT = "train"


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


def warm_start_spec(
    parent_dir: Path,
    parent_world_size: int,
    transform_path: Path,
    meta: DatasetMeta,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    """What the ranks need to warm-start from a parent model's train output.

    The parent's tables map onto this run's through the extended transform
    (`data_prep.idmap`): per feature, rows below the parent's size carry over except
    `changes[feature].reset_rows`; the rest start afresh (`training.ctr.embedding.
    warm_start_state`). Dense weights come from the parent's `model.safetensors`.

    Args:
        parent_dir: The parent's train output (verified by the caller).
        parent_world_size: The world size it was trained on (its sparse shard count).
        transform_path: This run's transform (an extension of the parent's).
        meta: This run's dataset description (feature order and sizes).
        model_config: This run's model config (`model_config_from`).

    Raises:
        ConfigError: The parent's tables do not match the transform's record of them
            (another parent, or another set of features), or the parent is another
            architecture (named by its train fields), before anything is launched.
    """
    parent_config = json.loads((parent_dir / MODEL_CONFIG_FILE).read_text())
    changed = [
        key
        # The tables grow, and a parent of another table precision converts (a parent
        # exported before model_config.json recorded it holds fp32 rows).
        for key in sorted(model_config.keys() - {"table_sizes", "table_precision"})
        if parent_config.get(key) != model_config[key]
    ]
    if changed:
        raise ConfigError(
            f"train.init: the parent model in {parent_dir} has another "
            + ", ".join(f"{key} ({parent_config.get(key)!r}, here {model_config[key]!r})"
                        for key in changed)
            + "; a warm start keeps the architecture (train.bottom_mlp, top_mlp, "
            "embedding_dim, interaction, tasks, ...): unset train.init to change it"
        )  # fmt: skip
    old_sizes = [int(size) for size in parent_config["table_sizes"]]
    try:
        reset_rows = extension_resets(old_sizes, json.loads(transform_path.read_text()), meta)
    except ValueError as error:
        raise ConfigError(
            f"cannot warm-start from {parent_dir}: {error}. The preprocess output was made "
            "for another parent: rerun preprocess (--from preprocess), or unset train.init "
            "to start a new chain"
        ) from error
    parent_train = json.loads((parent_dir / TRAIN_CONFIG_FILE).read_text())
    return {
        "weights": str(parent_dir / WEIGHTS_FILE),
        # DeepSpeed's checkpoint of the dense part: its optimizer state carries over when
        # the parent trained with the same ZeRO stage and precision.
        "zero_stage": int(parent_train.get("zero_stage", 0)),
        "precision": str(parent_train.get("precision", "fp32")),
        # The parent's rows are converted when this run's table_precision differs.
        "table_precision": str(parent_train.get("table_precision", "fp32")),
        "checkpoint": str(parent_dir / CHECKPOINT_DIR / CHECKPOINT_TAG),
        "world_size": int(parent_world_size),
        "old_sizes": old_sizes,
        "reset_rows": reset_rows,
    }


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
    node: NodeLaunch | None = None,
    stop: threading.Event | None = None,
    warm_start: Callable[[DatasetMeta, dict[str, Any]], dict[str, Any]] | None = None,
    artifact_root: str | None = None,
) -> TrainResult | None:
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
            to be this machine's memory split over the ranks. None skips the check then
            (and train.zero_stage: auto takes ZeRO 0).
        checkpoint_root: Where the resume checkpoints go (see
            `artifacts.checkpoints`); a call with the same root and config resumes from
            the newest valid one. Pass a directory that outlives `out_dir` (the train
            task uses one per fingerprint) so that a retry resumes. Default
            `out_dir / "resume"`.

        node: Where the ranks run on more than one node (`training.runtime.launcher.
            NodeLaunch`); None: every rank on this machine.
        stop: Set by the caller to stop the ranks (another node of the run failed).
        artifact_root: The run's artifact root (a path or URL): a rank whose root is
            shared storage refuses to start without the run key.
        warm_start: train.init: builds the ranks' warm start from this run's dataset
            description and model config (`warm_start_spec` with the parent bound).

    Returns:
        None for a node other than node 0 (node 0's ranks write the outputs); else
        the run's result (`resumed_from_step`: the checkpoint it continued from).

    Raises:
        InputNotFoundError: dataset.json or the shard directory is missing.
        SchemaError: dataset.json is invalid or has no train split.
        ConfigError: The train split is too small for the config, or the memory plan
            does not fit the budget (the message says what to change).
        TrainingCrashed: The launcher or a rank exited non-zero (message has the exit
            code and the last output lines).
    """
    # train.zero_stage: auto is resolved here, before run_train_stage writes
    # train_config.json and the launch spec: the ranks, a resume and a later warm start
    # from this output must all see the stage that was trained with.
    reason = None
    if config.zero_stage == "auto":
        meta = load_dataset_meta(Path(shards_dir).resolve())
        model_config = model_config_from(config, meta)
        config, reason = resolve_zero_stage(config, meta, model_config, accelerator, memory_budget)
        if on_log is not None:
            on_log(reason)
    return run_train_stage(
        partial(plan_ctr_run, warm_start=warm_start, zero_stage_reason=reason),
        WORKER,
        config,
        shards_dir,
        out_dir,
        accelerator,
        master_port,
        env,
        on_log,
        on_progress,
        python,
        memory_budget,
        checkpoint_root,
        node,
        stop,
        artifact_root,
    )


def plan_ctr_run(
    config: TrainConfig,
    shards_dir: Path,
    out_dir: Path,
    accelerator: Literal["cpu", "cuda"],
    env: Mapping[str, str],
    memory_budget: tuple[int, str] | None = None,
    checkpoint_root: Path | None = None,
    warm_start: Callable[[DatasetMeta, dict[str, Any]], dict[str, Any]] | None = None,
    zero_stage_reason: str | None = None,
) -> LaunchPlan:
    """Everything `train_model` decides before it launches: the launch spec and its parts.

    A config with train.zero_stage: auto is planned at the stage `resolve_zero_stage`
    picks (the spec's train config holds that stage); `train_model` resolves it first,
    so that its train_config.json holds it too.

    Args:
        config: The train config.
        shards_dir: The shard directory (with dataset.json).
        out_dir: The train output directory.
        accelerator: "cpu" (gloo) or "cuda" (NCCL).
        env: The caller's environment (only the chaos tests' settings are read from it).
        memory_budget: As `train_model`.
        checkpoint_root: As `train_model`.
        warm_start: As `train_model`.
        zero_stage_reason: How `train_model` resolved train.zero_stage: auto, for the
            memory plan's notes.

    Returns:
        The launch spec (train, model and DeepSpeed configs, paths, step plan,
        fingerprint), the model config and the memory plan.

    Raises:
        InputNotFoundError: dataset.json or the shard directory is missing.
        SchemaError: dataset.json is invalid or has no train split.
        ConfigError: Not a CTR model, fp16 on CPU, a train split too small for the
            config, or a memory plan over budget.
    """
    if config.model != "dlrm":
        raise ConfigError(
            f"train.model={config.model!r} is a sequence model; training.sequence.train "
            "trains it (training.ctr.train takes train.model: dlrm)"
        )
    shards_dir = Path(shards_dir).resolve()
    out_dir = Path(out_dir).resolve()
    if accelerator == "cpu" and config.precision == "fp16":
        raise ConfigError(
            "train.precision=fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 "
            "kernels; use precision: bf16 (no loss scaling needed) or fp32 on CPU"
        )
    meta = load_dataset_meta(shards_dir)
    total_steps = plan_total_steps(config, meta)
    model_config = model_config_from(config, meta)
    if config.zero_stage == "auto":
        config, zero_stage_reason = resolve_zero_stage(
            config, meta, model_config, accelerator, memory_budget
        )
    memory_plan = _plan_memory(
        config, meta, model_config, accelerator, memory_budget, zero_stage_reason
    )
    root = resume_root(checkpoint_root, out_dir)
    spec = {
        "backend": "gloo" if accelerator == "cpu" else "nccl",
        "train_config": config.model_dump(mode="json"),
        "shards_dir": str(shards_dir),
        "out_dir": str(out_dir),
        "model_config": model_config,
        "ds_config": build_deepspeed_config(config, config.world_size, total_steps),
        "total_steps": total_steps,
        "checkpoint_root": str(root),
        # CPU ranks share this machine's cores; on GPUs torch's default is right.
        "intra_op_threads": (
            config.intra_op_threads(os.cpu_count() or 1) if accelerator == "cpu" else None
        ),
    }
    if warm_start is not None:
        spec["warm_start"] = warm_start(meta, model_config)
    spec["config_fingerprint"] = config_fingerprint(spec)
    spec["chaos"] = chaos_settings(env)
    return LaunchPlan(spec, model_config, memory_plan, root)


def config_fingerprint(spec: Mapping[str, Any]) -> str:
    """sha256 of what a resumed run must share with the run that wrote the checkpoint.

    The train config (less reporting and saving fields, and how a step is split into
    ranks and micro batches), the global batch and data streams, the model and DeepSpeed
    configs, the step plan and the data (its manifest's sha256s, or its location).
    """
    config = TrainConfig.model_validate(spec["train_config"])
    # The world size may change between runs (the checkpoint is converted and its rows
    # re-sharded) as long as the global batch and the data streams stay the same: a micro
    # batch's loss is the mean over its rows and the W x G micro batches of a step are
    # averaged, so any split of the step's rows into equal micro batches takes its step.
    split = ("world_size", "batch_size", "grad_accum_steps", "data_streams")
    dropped = (*NOT_FINGERPRINTED, *split)
    train_config = {k: v for k, v in spec["train_config"].items() if k not in dropped}
    per_rank = (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    )
    ds_config = {k: v for k, v in spec["ds_config"].items() if k not in per_rank}
    payload = {
        "train_config": train_config,
        "global_batch_size": config.global_batch_size(),
        "data_streams": config.num_data_streams(),
        "model_config": spec["model_config"],
        "ds_config": ds_config,
        "total_steps": spec["total_steps"],
        # By content where the shards are a published output: another cache or node resumes.
        "shards": data_identity(Path(spec["shards_dir"])),
    }
    if "warm_start" in spec:  # which rows start afresh (the parent is in the resume key)
        warm = spec["warm_start"]
        payload["warm_start"] = {"old_sizes": warm["old_sizes"], "reset": warm["reset_rows"]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def resolve_zero_stage(
    config: TrainConfig,
    meta: DatasetMeta,
    model_config: Mapping[str, Any],
    accelerator: str,
    memory_budget: tuple[int, str] | None = None,
) -> tuple[TrainConfig, str]:
    """`config` with train.zero_stage: auto replaced by the lowest stage that fits.

    The budget is the one the memory check uses (`train.memory_per_rank_gb`, else
    `memory_budget`); see `training.ctr.memory.choose_zero_stage` for why the lowest.

    Args:
        config: The train config (an explicit stage is kept).
        meta: The dataset description (table sizes, dense features).
        model_config: `model_config_from(config, meta)` (counts the dense parameters).
        accelerator: "cpu" or "cuda".
        memory_budget: As `train_model`.

    Returns:
        (the config with an int zero_stage, one line that says which stage and why).
    """
    budget = _budget(config, accelerator, memory_budget)
    stage, reason = choose_zero_stage(
        config,
        meta.table_sizes,
        len(meta.dense),
        _dense_params(model_config),
        config.world_size,
        accelerator,
        None if budget is None else budget[:2],
    )
    return config.model_copy(update={"zero_stage": stage}), reason


def _budget(
    config: TrainConfig, accelerator: str, memory_budget: tuple[int, str] | None
) -> tuple[int, str, bool] | None:
    """(bytes per rank, where from, whether it is one machine's memory split over the
    ranks) of the memory check, or None when there is none."""
    if config.memory_per_rank_gb is not None:
        return int(config.memory_per_rank_gb * 2**30), "train.memory_per_rank_gb", False
    if memory_budget is not None:
        # One machine's memory shared by the ranks: more ranks would not add memory.
        return (*memory_budget, accelerator == "cpu")
    return None


def _dense_params(model_config: Mapping[str, Any]) -> int:
    """Parameters of the dense module (no embedding table: `build_arch`)."""
    return sum(p.numel() for p in build_arch(model_config).parameters())


def _plan_memory(
    config: TrainConfig,
    meta: DatasetMeta,
    model_config: dict[str, Any],
    accelerator: str,
    memory_budget: tuple[int, str] | None,
    zero_stage_reason: str | None = None,
) -> MemoryPlan:
    """Estimate per-rank memory and refuse a config that cannot fit (ConfigError).

    The plan's notes say how train.zero_stage: auto was resolved and, for sharded
    embeddings with a budget, how many rows of this embedding_dim would fit at each
    table precision on this world size.
    """
    num_dense_params = _dense_params(model_config)
    plan = plan_memory(
        config,
        meta.table_sizes,
        len(meta.dense),
        num_dense_params,
        config.world_size,
        accelerator,
        feature_names=[*meta.sparse_names, *meta.multi_hot_names],
    )
    budget = _budget(config, accelerator, memory_budget)
    notes = [zero_stage_reason] if zero_stage_reason else []
    if budget is not None and config.embeddings == "sharded":
        fit = rows_that_fit(
            config,
            budget[0],
            num_tables=len(meta.table_sizes),
            num_dense_features=len(meta.dense),
            num_dense_params=num_dense_params,
            world_size=config.world_size,
            accelerator=accelerator,
        )
        where = (
            f"the {human_bytes(budget[0])} per-rank budget on {config.world_size} "
            f"{'rank' if config.world_size == 1 else 'ranks'} "
            f"(this table: {sum(meta.table_sizes):,} rows at {config.table_precision})"
        )
        notes.append(rows_report(fit, config.embedding_dim, where))
    plan = replace(plan, notes=tuple(notes))
    if budget is not None:
        limit, source, split_over_ranks = budget
        try:
            check_memory(plan, config, limit, source, split_over_ranks=split_over_ranks)
        except ConfigError as error:
            if zero_stage_reason is None:
                raise
            raise ConfigError(f"{error}\n{zero_stage_reason}") from None
    return plan
