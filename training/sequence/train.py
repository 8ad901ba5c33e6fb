"""Train stage for the sequence models: a DeepSpeed PipelineModule over user sequences.

Reads `<sequences_dir>/sequences.json` and `train.parquet` (written by preprocess, see
`data_prep.sequences`). Writes to `out_dir`:

- `train_config.json`, `model_config.json` (the `SASRec` or `BST` constructor
  arguments plus `"model": "sasrec"` or `"bst"`), `memory_plan.json`, `launch.json`
  (the `PipelineSpec` the ranks read), `launcher.log`;
- from the ranks (see `training.sequence.pipeline_worker`): `train_log.jsonl`,
  `tensorboard/` (with `train.tensorboard`), `checkpoints/final/` (DeepSpeed's
  pipeline checkpoint: one file per layer and the optimizer states),
  `model.safetensors` (the stages consolidated into one fp32 model: with
  `train.eval_every_epochs`, the best validation step's) and `train_summary.json`.
  With validation the resume checkpoints' directory also holds `validation.json`.

Layout: `train.pipeline_stages` stages, `world_size / pipeline_stages` data-parallel
replicas (ZeRO stage 0 or 1; train.zero_stage: auto takes 0 unless only 1 fits the
memory budget, `resolve_sequence_zero_stage`), `train.batch_size` sequences per micro
batch and replica,
`train.grad_accum_steps` micro batches per optimizer step. The number of steps is
`train.max_steps`, or `train.epochs` passes over the train sequences. The model's
pieces (options, activation shape, optimizer betas) come from its
`training.sequence.registry` entry; the DeepSpeed config from the one builder
(`training.runtime.deepspeed_config`), so `train.grad_clip`, `train.warmup_steps` and
`train.weight_decay` apply as they do to the CTR models.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from artifacts.errors import ConfigError, InputNotFoundError
from training.config import TrainConfig
from training.runtime.deepspeed_config import build_deepspeed_config
from training.runtime.files import (
    CHECKPOINT_DIR,
    SUMMARY_FILE,
    TENSORBOARD_DIR,
    TRAIN_LOG_FILE,
    WEIGHTS_FILE,
    data_identity,
)
from training.runtime.launcher import NodeLaunch, TrainResult, chaos_settings
from training.runtime.memory import (
    CHUNK_BYTES,
    FP32_BYTES,
    RUNTIME_BYTES,
    MemoryPlan,
    human_bytes,
)
from training.runtime.stage import NOT_FINGERPRINTED, LaunchPlan, resume_root, run_train_stage
from training.sequence.evaluate import ITEM_COUNTS_FILE
from training.sequence.pipeline_worker import PipelineSpec
from training.sequence.registry import sequence_model
from training.sequence.validation import VALID_SPLIT, ValidationSpec, validation_protocol

WORKER = "training.sequence.pipeline_worker"
SEQUENCES_META_FILE = "sequences.json"
TRAIN_SEQUENCES_FILE = "train.parquet"
ITEM_FEATURES_FILE = "item_features.parquet"
# Tensors autograd keeps per position and block (inputs of the two LayerNorms, q/k/v,
# attention output, FFN input/hidden/output, residuals, dropout masks) with their
# gradients: about 12 D-wide tensors, x2 for the backward copies.
_BLOCK_TENSORS_PER_POSITION = 24
# The reader holds every train history on every rank as int64 items (and an offset each).
_HISTORY_ITEM_BYTES = 8


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

    The shared architecture plus the model's own options (its registry entry's
    `model_options`: SASRec's item features, BST's head MLP).

    Raises:
        ConfigError: train.sequence.max_length exceeds the sequences' length, or the
            model cannot take preprocess's item features (BST).
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
    model_config.update(sequence_model(config.model).model_options(config.sequence.mlp, features))
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


def plan_validation(
    config: TrainConfig, sequences_dir: Path, train_rows: int
) -> ValidationSpec | None:
    """How the ranks validate: every `train.eval_every_epochs` epochs, in steps.

    Args:
        config: The train config.
        sequences_dir: Preprocess's `sequences/` (valid.parquet, train_item_counts.npy).
        train_rows: Train sequences (an epoch is one pass over them).

    Returns:
        The validation spec, or None when `train.eval_every_epochs` is 0.

    Raises:
        InputNotFoundError: The valid split or the item counts are missing.
    """
    if not config.eval_every_epochs:
        return None
    for name in (f"{VALID_SPLIT}.parquet", ITEM_COUNTS_FILE):
        if not (sequences_dir / name).is_file():
            raise InputNotFoundError(
                f"{sequences_dir / name} does not exist, and train.eval_every_epochs="
                f"{config.eval_every_epochs} ranks the valid split; rerun preprocess with a "
                "valid split (e.g. preprocess.split: leave_last_out) or set "
                "train.eval_every_epochs: 0"
            )
    per_step = config.batch_size * config.grad_accum_steps * config.data_parallel_size()
    steps_per_epoch = train_rows / per_step
    return ValidationSpec(
        sequences_dir=sequences_dir,
        every_steps=max(1, round(config.eval_every_epochs * steps_per_epoch)),
        steps_per_epoch=steps_per_epoch,
        protocol=validation_protocol(config),
    )


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
    into model.safetensors. The rows, positions and candidate vectors of a micro batch
    are the model's (its registry entry's `activation_shape`: BST runs (1 + num_negatives)
    rows of L + 1 positions per sequence and gathers no candidate vectors); a head MLP
    is small and not counted.
    """
    if config.zero_stage == "auto":
        raise ValueError("train.zero_stage is 'auto': resolve_sequence_zero_stage first")
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
    batch, positions, per_position = sequence_model(model_config["model"]).activation_shape(
        config.batch_size, length, config.sequence.num_negatives
    )
    candidates = 2 * batch * positions * per_position * dim  # gathered vectors, grads
    if config.sequence.loss == "softmax":
        candidates = 2 * batch * positions * num_items  # every item's logit, and its grad
    elif config.sequence.shared_negatives:  # the shared vectors, each position's logits
        shared = config.sequence.num_negatives
        candidates = 2 * (shared * dim + batch * positions * (1 + shared + 2 * dim))
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
        "reader": train_rows * (length + 2) * _HISTORY_ITEM_BYTES,
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
    node: NodeLaunch | None = None,
    stop: threading.Event | None = None,
    artifact_root: str | None = None,
) -> TrainResult | None:
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
        checkpoint_root: Where the resume checkpoints go; a call with the
            same root and config resumes from the newest valid one (on the same stages and
            micro batch size, and under ZeRO-0 any data-parallel degree with the same global
            batch: `training.config.resume_layout`). Default `out_dir / "resume"`.

        node: Where the ranks run on more than one node (`training.runtime.launcher.
            NodeLaunch`); None: every rank on this machine.
        stop: Set by the caller to stop the ranks (another node of the run failed).
        artifact_root: The run's artifact root (a path or URL): a rank whose root is
            shared storage refuses to start without the run key.

    Returns:
        None for a node other than node 0 (node 0's ranks write the outputs); else
        the run's result (step_ms has one phase, "step"; `resumed_from_step`).

    Raises:
        InputNotFoundError: The sequences are missing.
        ConfigError: The model is not a sequence model, the data is too small, or the
            memory plan does not fit (the pipeline layout is checked when the config is
            parsed).
        TrainingCrashed: The launcher or a rank exited non-zero.
    """
    # Resolved before run_train_stage writes train_config.json and the launch spec, so
    # that the ranks and a resume see the stage that was trained with.
    if config.zero_stage == "auto":
        sequences_dir = Path(sequences_dir).resolve()
        model_config = sequence_model_config(config, read_sequences_meta(sequences_dir))
        train_rows = pq.ParquetFile(sequences_dir / TRAIN_SEQUENCES_FILE).metadata.num_rows
        config, reason = resolve_sequence_zero_stage(
            config, model_config, train_rows, memory_budget
        )
        if on_log is not None:
            on_log(reason)
    return run_train_stage(
        plan_sequence_run,
        WORKER,
        config,
        sequences_dir,
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


def plan_sequence_run(
    config: TrainConfig,
    sequences_dir: Path,
    out_dir: Path,
    accelerator: Literal["cpu", "cuda"],
    env: Mapping[str, str],
    memory_budget: tuple[int, str] | None = None,
    checkpoint_root: Path | None = None,
) -> LaunchPlan:
    """Everything `train_sequence_model` decides before it launches.

    Args:
        config: The train config (`model` one of SEQUENCE_MODELS).
        sequences_dir: Preprocess's `sequences/` directory.
        out_dir: The train output directory.
        accelerator: "cpu" or "cuda".
        env: The caller's environment (only the chaos tests' settings are read from it).
        memory_budget: As `train_sequence_model`.
        checkpoint_root: As `train_sequence_model`.

    Returns:
        The `PipelineSpec` (as JSON), the model config and the memory plan.

    Raises:
        InputNotFoundError: The sequences are missing.
        ConfigError: Not a sequence model, data too small for the replicas, or a memory
            plan over budget.
    """
    sequence_model(config.model)  # a ConfigError for a CTR model, before any I/O
    sequences_dir = Path(sequences_dir).resolve()
    out_dir = Path(out_dir).resolve()
    meta = read_sequences_meta(sequences_dir)
    model_config = sequence_model_config(config, meta)
    train_rows = pq.ParquetFile(sequences_dir / TRAIN_SEQUENCES_FILE).metadata.num_rows
    total_steps = plan_sequence_steps(config, train_rows)
    if config.zero_stage == "auto":
        config, _ = resolve_sequence_zero_stage(config, model_config, train_rows, memory_budget)
    memory_plan = plan_sequence_memory(config, model_config, train_rows)
    if config.memory_per_rank_gb is not None:
        budget = int(config.memory_per_rank_gb * 2**30)
        check_sequence_memory(memory_plan, budget, "train.memory_per_rank_gb")
    elif memory_budget is not None:
        check_sequence_memory(memory_plan, *memory_budget)
    root = resume_root(checkpoint_root, out_dir)
    spec = build_pipeline_spec(
        config,
        model_config,
        total_steps,
        out_dir,
        sequences_dir=sequences_dir,
        checkpoint_root=root,
        valid=plan_validation(config, sequences_dir, train_rows),
        # CPU ranks share this machine's cores; on GPUs torch's default is right.
        intra_op_threads=(
            config.intra_op_threads(os.cpu_count() or 1) if accelerator == "cpu" else None
        ),
        chaos=chaos_settings(env),
    )
    return LaunchPlan(spec.model_dump(mode="json"), model_config, memory_plan, root)


def resolve_sequence_zero_stage(
    config: TrainConfig,
    model_config: Mapping[str, Any],
    train_rows: int,
    memory_budget: tuple[int, str] | None = None,
) -> tuple[TrainConfig, str]:
    """`config` with train.zero_stage: auto replaced by 0, or by 1 when only 1 fits.

    The pipeline engine runs ZeRO 0 or 1. ZeRO 0 keeps each stage's optimizer state in
    one file, so a resume may change the data-parallel degree (`resume_layout`), and
    it skips the partitioned optimizer step; ZeRO 1 is taken only when the memory plan
    fits the budget (`train.memory_per_rank_gb`, else `memory_budget`) with Adam's state
    partitioned over the replicas and not without. With no budget: 0. When neither
    fits (the check then refuses it): the one with the smaller plan, 0 on a tie.

    Returns:
        (the config with an int zero_stage, one line that says which stage and why).
    """
    if config.zero_stage != "auto":
        return config, f"train.zero_stage: {config.zero_stage} (set in the config)"
    plans = {
        stage: plan_sequence_memory(
            config.model_copy(update={"zero_stage": stage}), model_config, train_rows
        )
        for stage in config.zero_stages()
    }
    if config.memory_per_rank_gb is not None:
        budget = (int(config.memory_per_rank_gb * 2**30), "train.memory_per_rank_gb")
    else:
        budget = memory_budget
    if budget is None:
        stage = min(plans)
    else:
        fitting = [s for s in plans if plans[s].total <= budget[0]]
        stage = fitting[0] if fitting else min(plans, key=lambda s: (plans[s].total, s))
    need = ", ".join(f"ZeRO {s} needs {human_bytes(plan.total)}" for s, plan in plans.items())
    within = (
        "no memory budget to plan against"
        if budget is None
        else f"the budget is {human_bytes(budget[0])} per rank (from {budget[1]})"
    )
    return config.model_copy(update={"zero_stage": stage}), (
        f"train.zero_stage: auto -> {stage}: {need} on the worst rank; {within}"
    )


def build_pipeline_spec(
    config: TrainConfig,
    model_config: Mapping[str, Any],
    steps: int,
    out_dir: Path,
    sequences_dir: Path | None = None,
    checkpoint_root: Path | None = None,
    intra_op_threads: int | None = None,
    chaos: Mapping[str, Any] | None = None,
    valid: ValidationSpec | None = None,
) -> PipelineSpec:
    """The launch spec of a pipeline run, with its outputs under `out_dir`.

    Args:
        config: The train config (`model` one of SEQUENCE_MODELS).
        model_config: The model's constructor arguments (`sequence_model_config`).
        steps: Optimizer steps (`plan_sequence_steps`).
        out_dir: Where the ranks write the log, checkpoint, weights and summary.
        sequences_dir: Preprocess's `sequences/`; None trains on synthetic sequences.
        checkpoint_root: The resume checkpoints' directory; default `out_dir/resume`.
        intra_op_threads: torch threads per rank; None: torch's default.
        chaos: The chaos tests' fault injection (`chaos_settings`).
        valid: In-training validation (`plan_validation`); None: none.

    Returns:
        The spec, its `config_fingerprint` set.
    """
    adam = sequence_model(config.model).adam
    ds_config = build_deepspeed_config(config, config.data_parallel_size(), steps, adam)
    features_file = None
    if sequences_dir is not None and model_config.get("item_features"):
        features_file = sequences_dir / ITEM_FEATURES_FILE
    spec = PipelineSpec(
        train_config=config,
        architecture=dict(model_config),
        ds_config=ds_config,
        steps=steps,
        intra_op_threads=intra_op_threads,
        sequences=None if sequences_dir is None else sequences_dir / TRAIN_SEQUENCES_FILE,
        item_features_file=features_file,
        out=out_dir / SUMMARY_FILE,
        train_log=out_dir / TRAIN_LOG_FILE,
        tensorboard_dir=out_dir / TENSORBOARD_DIR if config.tensorboard else None,
        checkpoint_dir=out_dir / CHECKPOINT_DIR,
        weights_file=out_dir / WEIGHTS_FILE,
        checkpoint_root=resume_root(checkpoint_root, out_dir),
        chaos=dict(chaos or {}),
        valid=valid,
    )
    return spec.model_copy(update={"config_fingerprint": sequence_fingerprint(spec)})


# Where a spec's files go, and how the run reports, saves and is tested: not what it
# trains, so a resume may change them.
_SPEC_NOT_FINGERPRINTED = (
    "out",
    "train_log",
    "tensorboard_dir",
    "checkpoint_dir",
    "weights_file",
    "checkpoint_root",
    "config_fingerprint",
    "chaos",
    "artifact_root",
    "intra_op_threads",  # torch threads per rank, which follow the world size
)
# How a step is laid out over the ranks: a resume may change it as long as the global
# batch stays (`find_resume_point` refuses the stage counts and micro batch sizes whose
# checkpoints it cannot load, naming them).
_LAYOUT_FIELDS = ("world_size", "pipeline_stages", "batch_size", "grad_accum_steps")
_LAYOUT_DS_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


def sequence_fingerprint(spec: PipelineSpec) -> str:
    """sha256 of what a resumed pipeline run must share with the one that wrote it.

    The spec less its output paths and thread count, with the train config less its
    reporting and saving fields (`NOT_FINGERPRINTED`) and its layout over the ranks
    (world_size, pipeline_stages, batch_size, grad_accum_steps), and the global batch
    (sequences per optimizer step over the replicas).
    """
    payload = spec.model_dump(mode="json", exclude=set(_SPEC_NOT_FINGERPRINTED))
    # The data by content where it is a published output: another cache or node resumes.
    for field in ("sequences", "item_features_file"):
        if payload[field] is not None:
            payload[field] = data_identity(Path(payload[field]))
    dropped = (*NOT_FINGERPRINTED, *_LAYOUT_FIELDS)
    payload["train_config"] = {k: v for k, v in payload["train_config"].items() if k not in dropped}
    payload["ds_config"] = {
        k: v for k, v in payload["ds_config"].items() if k not in _LAYOUT_DS_KEYS
    }
    config = spec.train_config
    payload["global_batch_size"] = config.global_batch_size(config.data_parallel_size())
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
