"""Train stage for the sequence models: a DeepSpeed PipelineModule over user sequences.

Reads `<sequences_dir>/sequences.json` and `train.parquet` (written by preprocess, see
`data_prep.sequences`). Writes to `out_dir`:

- `train_config.json`, `model_config.json` (the `SASRec` or `BST` constructor
  arguments plus `"model": "sasrec"` or `"bst"`), `memory_plan.json`, `launch.json`
  (the `PipelineSpec` the ranks read), `launcher.log`;
- from the ranks (see `training.sequence.pipeline_worker`): `train_log.jsonl`,
  `checkpoints/final/` (DeepSpeed's pipeline checkpoint: one file per layer and the
  optimizer states), `model.safetensors` (the stages consolidated into one fp32
  model) and `train_summary.json`.

Layout: `train.pipeline_stages` stages, `world_size / pipeline_stages` data-parallel
replicas (ZeRO stage 0 or 1), `train.batch_size` sequences per micro batch and replica,
`train.grad_accum_steps` micro batches per optimizer step. The number of steps is
`train.max_steps`, or `train.epochs` passes over the train sequences.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from data_prep.errors import ConfigError, InputNotFoundError
from training.config import SEQUENCE_MODELS, TrainConfig, check_pipeline_config
from training.runtime.files import (
    CHECKPOINT_DIR,
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
    TrainResult,
    chaos_settings,
    launch_ranks,
    launcher_command,
    launcher_env,
)
from training.runtime.memory import (
    CHUNK_BYTES,
    FP32_BYTES,
    RUNTIME_BYTES,
    MemoryPlan,
    human_bytes,
    plan_record,
)

SEQUENCES_META_FILE = "sequences.json"
TRAIN_SEQUENCES_FILE = "train.parquet"
ITEM_FEATURES_FILE = "item_features.parquet"
# Tensors autograd keeps per position and block (inputs of the two LayerNorms, q/k/v,
# attention output, FFN input/hidden/output, residuals, dropout masks) with their
# gradients: about 12 D-wide tensors, x2 for the backward copies.
_BLOCK_TENSORS_PER_POSITION = 24
# Python ints in the lists the reader holds the train histories in: ~36 bytes each.
_HISTORY_ITEM_BYTES = 36


def read_sequences_meta(sequences_dir: Path) -> dict[str, Any]:
    """`sequences.json` of a preprocess output's `sequences/`.

    Raises:
        InputNotFoundError: The directory, its sequences.json or train.parquet is missing
            (the message says to set preprocess.sequence_length).
        SchemaError: sequences.json lacks num_items.
    """
    sequences_dir = Path(sequences_dir)
    for name in (SEQUENCES_META_FILE, TRAIN_SEQUENCES_FILE):
        if not (sequences_dir / name).is_file():
            raise InputNotFoundError(
                f"{sequences_dir / name} does not exist: the sequence models read preprocess's "
                "per-user sequences; set preprocess.sequence_length (and schema.user_key, "
                "schema.item_key) and rerun preprocess"
            )
    meta = json.loads((sequences_dir / SEQUENCES_META_FILE).read_text())
    if not meta.get("num_items"):
        raise ConfigError(
            f"{sequences_dir / SEQUENCES_META_FILE} has no num_items (written by an older "
            "preprocess); rerun preprocess with --force preprocess"
        )
    return meta


def sequence_model_config(config: TrainConfig, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The model's constructor arguments (what `model_config.json` holds).

    Raises:
        ConfigError: train.sequence.max_length exceeds the sequences' length.
    """
    max_length = config.sequence.max_length or int(meta["max_length"])
    if max_length > int(meta["max_length"]):
        raise ConfigError(
            f"train.sequence.max_length={max_length} exceeds preprocess.sequence_length="
            f"{meta['max_length']}, the longest history written; lower it or raise "
            "preprocess.sequence_length"
        )
    model_config = {
        "model": config.model,
        "num_items": int(meta["num_items"]),
        "max_length": max_length,
        "hidden_dim": config.sequence.hidden_dim,
        "num_blocks": config.sequence.num_blocks,
        "num_heads": config.sequence.num_heads,
        "dropout": config.sequence.dropout,
    }
    features = dict(meta.get("item_features") or {})
    if config.model == "bst":
        if features:
            raise ConfigError(
                f"train.model=bst takes no item side features, but preprocess wrote "
                f"{sorted(features)} (preprocess.sequence_item_features); remove them or use "
                "train.model: sasrec"
            )
        model_config["mlp"] = list(config.sequence.mlp)
    else:
        model_config["item_features"] = features
    return model_config


def plan_sequence_steps(config: TrainConfig, train_rows: int) -> int:
    """Optimizer steps: `max_steps`, or enough for `epochs` passes over the sequences.

    Raises:
        ConfigError: There are fewer train sequences than data-parallel replicas.
    """
    replicas = config.data_parallel_size()
    if train_rows < replicas:
        raise ConfigError(
            f"the train split has {train_rows} user sequences, fewer than the "
            f"{replicas} data-parallel replicas (world_size / pipeline_stages); use fewer ranks"
        )
    if config.max_steps is not None:
        return config.max_steps
    per_step = config.batch_size * config.grad_accum_steps * replicas
    return max(1, math.ceil(config.epochs * train_rows / per_step))


def plan_sequence_memory(
    config: TrainConfig, model_config: Mapping[str, Any], train_rows: int
) -> MemoryPlan:
    """Estimate the worst rank's memory: the first stage (it holds the item table).

    Counts the item table (on the first and the last stage, tied), the rest of the
    parameters spread over the stages, fp32 grads and Adam state (ZeRO-1 partitions
    the Adam state over the data-parallel replicas), the activations of the micro
    batches a stage keeps in flight (up to pipeline_stages under DeepSpeed's 1F1B
    schedule), the train histories the reader holds, and the piece of at most
    CHUNK_BYTES rank 0 converts at a time when it streams the memory-mapped layer files
    into model.safetensors. BST runs (1 + num_negatives) rows of L + 1
    positions per sequence and gathers no candidate vectors; its head MLP is small and
    not counted.
    """
    num_items, length = model_config["num_items"], model_config["max_length"]
    dim, blocks = model_config["hidden_dim"], model_config["num_blocks"]
    heads = model_config["num_heads"]
    stages = config.pipeline_stages
    table = num_items * dim
    per_block = 4 * dim * dim + 4 * dim + 2 * dim * dim + 2 * dim + 4 * dim  # attn, ffn, norms
    other = length * dim + blocks * per_block + 2 * dim
    params = table + math.ceil(other / stages)
    param_bytes = 2 if config.precision == "bf16" else FP32_BYTES
    adam_bytes = (12 if config.precision == "bf16" else 8) * params
    if config.zero_stage >= 1:
        adam_bytes = math.ceil(adam_bytes / config.data_parallel_size())
    in_flight = min(stages, config.grad_accum_steps)
    negatives = config.sequence.num_negatives
    if model_config["model"] == "bst":
        batch, positions = config.batch_size * (1 + negatives), length + 1
        candidates = 0
    else:
        batch, positions = config.batch_size, length
        candidates = 2 * batch * length * (1 + negatives) * dim  # gathered vectors, grads
    blocks_here = math.ceil(blocks / stages)
    activations = (
        in_flight
        * FP32_BYTES
        * (
            batch * positions * dim * (_BLOCK_TENSORS_PER_POSITION * blocks_here + 4)
            + 3 * batch * heads * positions * positions * blocks_here  # attention, grads
            + candidates
        )
    )
    total_params = table + other
    per_rank = {
        "embeddings": table * param_bytes,
        "dense_params": (params - table) * param_bytes,
        "dense_grads": params * param_bytes,
        "dense_optimizer": adam_bytes,
        "activations": activations,
        "reader": train_rows * (length + 1) * _HISTORY_ITEM_BYTES // config.data_parallel_size(),
        "consolidation": min(total_params * FP32_BYTES, CHUNK_BYTES),
        "runtime": RUNTIME_BYTES,
    }
    return MemoryPlan(
        world_size=config.world_size,
        per_rank=per_rank,
        host_offload=0,
        total=sum(per_rank.values()),
        num_dense_params=total_params,
    )


def check_sequence_memory(plan: MemoryPlan, budget_bytes: int, budget_source: str) -> None:
    """Refuse a plan over budget, naming the largest parts and what to change.

    Raises:
        ConfigError: plan.total > budget_bytes.
    """
    if plan.total <= budget_bytes:
        return
    largest = sorted(((size, name) for name, size in plan.per_rank.items()), reverse=True)[:3]
    raise ConfigError(
        f"train: the sequence model needs {human_bytes(plan.total)} on its worst rank but the "
        f"budget is {human_bytes(budget_bytes)} per rank (from {budget_source}). Largest parts: "
        + ", ".join(f"{name} {human_bytes(size)}" for size, name in largest)
        + ". Lower train.batch_size or train.sequence.max_length (activations), "
        "train.sequence.hidden_dim (every part), raise train.pipeline_stages (splits the "
        "blocks), or use zero_stage: 1 with more replicas (partitions Adam's state)."
    )


def train_sequence_model(
    config: TrainConfig,
    sequences_dir: Path,
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
    """Train a sequence model with `config.world_size` DeepSpeed pipeline ranks.

    Args:
        config: The train config (`model` one of SEQUENCE_MODELS).
        sequences_dir: Preprocess's `sequences/` directory.
        out_dir: Output directory; created if missing.
        accelerator: "cpu" (gloo) or "cuda".
        master_port: A free TCP port for the ranks' rendezvous.
        env: The launcher's environment, built by the caller (this library reads none).
        on_log: Called with every output line of the launcher and the ranks.
        on_progress: Called with every parsed progress record.
        python: The interpreter that runs the launcher.
        memory_budget: (bytes per rank, where the figure comes from) when
            `train.memory_per_rank_gb` is unset; None skips the check then.
        checkpoint_root: Where `train.checkpoint_every` checkpoints go; a call with the
            same root and config resumes from the newest valid one (on the same world
            size). Default `out_dir / "resume"`.

    Returns:
        The run's result (step_ms has one phase, "step"; `resumed_from_step`).

    Raises:
        InputNotFoundError: The sequences are missing.
        ConfigError: The model is not a sequence model, the layout cannot run, the
            data is too small, or the memory plan does not fit.
        TrainingCrashed: The launcher or a rank exited non-zero.
    """
    started = time.monotonic()
    if config.model not in SEQUENCE_MODELS:
        raise ConfigError(f"train.model={config.model!r} is not one of {list(SEQUENCE_MODELS)}")
    check_pipeline_config(config.world_size, config.pipeline_stages, config.zero_stage)
    sequences_dir = Path(sequences_dir).resolve()
    out_dir = Path(out_dir).resolve()
    launch_env = launcher_env(env, accelerator)
    meta = read_sequences_meta(sequences_dir)
    model_config = sequence_model_config(config, meta)
    train_rows = pq.ParquetFile(sequences_dir / TRAIN_SEQUENCES_FILE).metadata.num_rows
    total_steps = plan_sequence_steps(config, train_rows)
    plan = plan_sequence_memory(config, model_config, train_rows)
    if config.memory_per_rank_gb is not None:
        check_sequence_memory(
            plan, int(config.memory_per_rank_gb * 2**30), "train.memory_per_rank_gb"
        )
    elif memory_budget is not None:
        check_sequence_memory(plan, *memory_budget)

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (TRAIN_LOG_FILE, SUMMARY_FILE, WEIGHTS_FILE, LAUNCHER_LOG_FILE):
        (out_dir / stale).unlink(missing_ok=True)
    write_json(out_dir / MEMORY_PLAN_FILE, plan_record(plan))
    write_json(out_dir / TRAIN_CONFIG_FILE, config.model_dump(mode="json"))
    write_json(out_dir / MODEL_CONFIG_FILE, model_config)
    spec = {
        **model_config,
        "loss": config.sequence.loss,
        "num_negatives": config.sequence.num_negatives,
        "num_stages": config.pipeline_stages,
        "partition_method": config.sequence.partition_method,
        # CPU ranks share this machine's cores; on GPUs torch's default is right.
        "intra_op_threads": (
            max(1, (os.cpu_count() or 1) // config.world_size) if accelerator == "cpu" else None
        ),
        "micro_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "steps": total_steps,
        "lr": config.lr,
        "seed": config.seed,
        "fp32": config.precision == "fp32",
        "zero_stage": config.zero_stage,
        "sequences": str(sequences_dir / TRAIN_SEQUENCES_FILE),
        "item_features_file": (
            str(sequences_dir / ITEM_FEATURES_FILE) if model_config.get("item_features") else None
        ),
        "out": str(out_dir / SUMMARY_FILE),
        "log_every": config.log_every,
        "train_log": str(out_dir / TRAIN_LOG_FILE),
        "checkpoint_dir": str(out_dir / CHECKPOINT_DIR),
        "weights_file": str(out_dir / WEIGHTS_FILE),
        "checkpoint_every": config.checkpoint_every,
        "checkpoint_root": str(Path(checkpoint_root or out_dir / RESUME_DIR).resolve()),
        "keep_checkpoints": config.keep_checkpoints,
    }
    spec["config_fingerprint"] = sequence_fingerprint(spec)
    spec["chaos"] = chaos_settings(env)
    spec_path = out_dir / LAUNCH_FILE
    write_json(spec_path, spec)
    command = launcher_command(
        python, config.world_size, master_port, "training.sequence.pipeline_worker", spec_path
    )
    owner = Path(spec["checkpoint_root"]) / RANKS_FILE if config.checkpoint_every else None
    summary = launch_ranks(command, launch_env, out_dir, on_log, on_progress, owner)
    return TrainResult(
        out_dir=out_dir,
        final_loss=float(summary["final_loss"]),
        steps=int(summary["steps"]),
        samples_per_s=float(summary["samples_per_s"]),
        seconds=time.monotonic() - started,
        step_ms={"step": 1000.0 * summary["seconds"] / max(int(summary["steps"]), 1)},
        memory_plan=plan,
        resumed_from_step=summary.get("resumed_from_step"),
    )


# Where a pipeline spec's files go, and how often it reports and saves: not what it trains.
_SPEC_NOT_FINGERPRINTED = (
    "out",
    "train_log",
    "log_every",
    "checkpoint_dir",
    "weights_file",
    "checkpoint_every",
    "checkpoint_root",
    "keep_checkpoints",
    "config_fingerprint",
)


def sequence_fingerprint(spec: Mapping[str, Any]) -> str:
    """sha256 of what a resumed pipeline run must share with the one that wrote it."""
    payload = {k: v for k, v in spec.items() if k not in _SPEC_NOT_FINGERPRINTED}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
