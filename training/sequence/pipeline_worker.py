"""One rank of a sequence model's (SASRec, BST) pipeline-parallel run.

`python -m training.sequence.pipeline_worker SPEC.json`.

Run under the DeepSpeed launcher (`python -m deepspeed.launcher.runner --num_gpus W
--master_port P --module training.sequence.pipeline_worker SPEC.json`). Reads the spec (see
`PipelineSpec`) and, when `sequences` is set, a `data_prep.sequences` train.parquet.
Writes, on rank 0:

- `out`: JSON `{"losses": [...], "final_loss", "steps", "samples", "samples_per_s",
  "world_size", "num_stages", "parts", "seconds", "peak_rss_mb_rank0"}`, one loss per
  optimizer step (the mean over its micro batches, which DeepSpeed's pipeline engine
  broadcasts from the last stage to every rank);
- `train_log` (when set): one progress record per `log_every` steps, also printed as
  `RECFORGE_PROGRESS {...}` lines for the parent (`training.ctr.train`) to stream;

when `checkpoint_dir` is set, DeepSpeed's pipeline checkpoint `checkpoint_dir/final/`
(one `layer_NN-model_states.pt` per layer, written by each stage's first data-parallel
rank, plus the optimizer states), and when `weights_file` is also set, that checkpoint
consolidated into one fp32 `SASRec` state dict (safetensors), by rank 0 after every
stage has written its layers.

Reproducibility: every layer is built from its own seed (`seed_layers`: layer i is
seeded with `layer_base_seed(spec.seed) + i`), so the weights do not depend on how the layers are
split into stages; the micro batches come from generators seeded by the spec's seed and
the data-parallel replica, identical on the first and the last stage of a replica
(replicas get different synthetic streams, or every replicas-th Parquet row). A
1-stage and a 2-stage run of the same spec thus train the same model on the same data.

Resume: with `checkpoint_every` set, the ranks save crash-safe resume checkpoints
under `checkpoint_root` every that many steps and on SIGTERM (`training.ctr.worker`'s
`save_resume_checkpoint` and `Preemption`: DeepSpeed's pipeline checkpoint, each rank's
RNG states, a manifest with the config fingerprint). At start they continue from the
newest valid one, on the world size that wrote it. The micro batch stream is replayed
from its seed up to the step (drawing batches costs no model compute), and the
pipeline module's micro batch counter is set to match, since DeepSpeed reseeds every
layer's forward from it: the resumed run trains on the same batches with the same
dropout masks.

The only environment this process reads is what the launcher sets for
`deepspeed.init_distributed`; fault injection arrives in the spec's `chaos`.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import deepspeed
import deepspeed.comm as dist
import numpy as np
import pyarrow.parquet as pq
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import set_random_seed
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data_prep.errors import ConfigError, Preempted
from training.config import check_pipeline_config
from training.runtime.checkpoint import CheckpointStore
from training.runtime.consolidate import create_file, finish_file, plan_layout, write_dense
from training.runtime.launcher import PROGRESS_PREFIX, RESUME_PREFIX
from training.runtime.memory import CHUNK_BYTES, FP32_BYTES
from training.runtime.rank import (
    DENSE_TAG,
    Preemption,
    find_resume_point,
    rank_main,
    rss_bytes,
    save_resume_checkpoint,
)
from training.sequence.bst import (
    BST,
    bst_batch,
    bst_loss,
    bst_pipeline_batch,
    bst_pipeline_state_to_model,
    build_bst_pipeline_layers,
)
from training.sequence.sasrec import (
    LOSSES,
    SASRec,
    build_pipeline_layers,
    next_item_batch,
    pipeline_batch,
    pipeline_state_to_sasrec,
    sample_negatives,
)

CHECKPOINT_TAG = "final"


class PipelineSpec(BaseModel):
    """What one pipeline run trains; unknown keys are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Literal["sasrec", "bst"] = Field(
        default="sasrec",
        description="sasrec: next-item at every position; bst: one (history, target, label) "
        "CTR sample per sequence and num_negatives sampled negative targets.",
    )
    num_items: int = Field(ge=2, description="V, including the padding item 0.")
    max_length: int = Field(ge=1, description="Input sequence length L.")
    hidden_dim: int = Field(ge=1)
    num_blocks: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    loss: Literal["bce", "sampled_softmax"] = Field(
        default="bce", description="SASRec's loss (BST always uses BCE on its labels)."
    )
    mlp: list[int] = Field(default=[64, 32], description="BST: hidden sizes of the head MLP.")
    item_features: dict[str, int] = Field(
        default={}, description="SASRec: item side features, name -> number of indices."
    )
    item_features_file: Path | None = Field(
        default=None, description="item_features.parquet of data_prep.sequences (item lookups)."
    )
    num_negatives: int = Field(default=1, ge=1, description="Negatives per position.")
    num_stages: int = Field(ge=1, description="Pipeline stages; must divide the world size.")
    partition_method: Literal["blocks", "uniform", "parameters"] = "uniform"
    intra_op_threads: int | None = Field(
        default=None, ge=1, description="torch threads per rank; None: torch's default."
    )
    micro_batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro batches/step.")
    steps: int = Field(ge=1, description="Optimizer steps (engine.train_batch calls).")
    lr: float = Field(default=1e-3, gt=0.0)
    seed: int = 0
    fp32: bool = Field(default=True, description="fp32 weights; False trains in bf16.")
    zero_stage: int = Field(default=0, ge=0, le=3)
    sequences: Path | None = Field(
        default=None, description="A train.parquet of data_prep.sequences; None: synthetic."
    )
    out: Path = Field(description="Where rank 0 writes the per-step losses (JSON).")
    log_every: int = Field(default=20, ge=1, description="Steps between progress records.")
    train_log: Path | None = Field(
        default=None, description="Progress records (JSON lines); None: no progress output."
    )
    checkpoint_dir: Path | None = Field(
        default=None, description="DeepSpeed pipeline checkpoint root; None: no checkpoint."
    )
    weights_file: Path | None = Field(
        default=None,
        description="Consolidated fp32 SASRec weights (safetensors); needs checkpoint_dir.",
    )
    checkpoint_every: int = Field(
        default=0, ge=0, description="Steps between resume checkpoints; 0: none, no resume."
    )
    checkpoint_root: Path | None = Field(
        default=None, description="Resume checkpoints' directory (training.runtime.checkpoint)."
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="Valid resume checkpoints kept.")
    config_fingerprint: str = Field(
        default="", description="What a resume must match (training.sequence.train)."
    )
    chaos: dict[str, Any] = Field(
        default={}, description="Fault injection of the chaos tests (training.ctr.train)."
    )


def synthetic_sequences(
    num_items: int, max_length: int, generator: np.random.Generator
) -> Iterator[list[int]]:
    """Endless learnable sequences: each item is 1-3 items after the previous one.

    Args:
        num_items: V; items are drawn from 1..V-1, wrapping around.
        max_length: L; sequences hold 2..L+1 items (the rest is padding).
        generator: The random source.

    Yields:
        Item lists, oldest first.
    """
    while True:
        length = int(generator.integers(2, max_length + 2))
        steps = generator.integers(1, 4, size=length - 1)
        start = int(generator.integers(1, num_items))
        offsets = np.concatenate([[0], np.cumsum(steps)])
        yield [1 + (start - 1 + int(o)) % (num_items - 1) for o in offsets]


def parquet_sequences(
    path: Path,
    replica: int,
    replicas: int,
    generator: np.random.Generator,
    min_items: int = 1,
) -> Iterator[list[int]]:
    """Endless train histories of one data-parallel replica, reshuffled every epoch.

    Args:
        path: A `data_prep.sequences` train.parquet.
        replica: This replica's index (rows replica, replica + replicas, ...).
        replicas: Data-parallel degree.
        generator: The shuffling source.
        min_items: Shorter histories are left out (BST needs a history and a target).

    Raises:
        ConfigError: The file has no `history` column or too few rows for the replicas.
    """
    table = pq.read_table(path, columns=["history"])
    histories = [
        items
        for items in table.column("history").to_pylist()[replica::replicas]
        if len(items) >= min_items
    ]
    if not histories:
        raise ConfigError(
            f"sequences={path}: {table.num_rows} rows cannot feed {replicas} data-parallel "
            "replicas; use more data or fewer ranks per stage"
        )
    while True:
        for index in generator.permutation(len(histories)):
            yield histories[index]


def micro_batches(
    spec: PipelineSpec, replica: int = 0, replicas: int = 1
) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Endless pipeline micro batches.

    SASRec: ((history, positives, negatives), positives). BST: ((history, target),
    label) with micro_batch_size x (1 + num_negatives) rows: each sequence's positive
    target, then its negatives.

    The stream depends on spec.seed and the replica only, so the first and the last
    stage of a pipeline (which both read it) see the same batches, whatever num_stages.

    Args:
        spec: The run's spec.
        replica: Data-parallel replica index of the calling rank.
        replicas: Data-parallel degree (world_size / num_stages).
    """
    rng = np.random.default_rng((spec.seed, replica))
    negatives_rng = torch.Generator().manual_seed(spec.seed * 65_537 + replica)
    if spec.sequences is None:
        source = synthetic_sequences(spec.num_items, spec.max_length, rng)
    else:
        min_items = 2 if spec.model == "bst" else 1
        source = parquet_sequences(spec.sequences, replica, replicas, rng, min_items)
    while True:
        rows = [next(source) for _ in range(spec.micro_batch_size)]
        if spec.model == "bst":
            samples = bst_batch(
                rows, spec.max_length, spec.num_items, spec.num_negatives, negatives_rng
            )  # history (B', L), target (B',), label (B',)
            yield bst_pipeline_batch(*samples)
            continue
        history, positives = next_item_batch(rows, spec.max_length)  # (B, L) each
        negatives = sample_negatives(
            positives, spec.num_items, spec.num_negatives, negatives_rng
        )  # (B, L, N)
        yield pipeline_batch(history, positives, negatives)


def seed_layer(seed: int) -> None:
    """PipelineModule's `seed_fn`: seed python, numpy and torch.

    With partition_method="parameters" DeepSpeed passes a numpy integer, which
    `random.seed` refuses; hence the cast.
    """
    set_random_seed(int(seed))


def layer_base_seed(seed: int) -> int:
    """The PipelineModule `base_seed` of a spec seed (nonzero, distinct per seed)."""
    return 1_000_003 * (seed + 1)


def deepspeed_config(spec: PipelineSpec, data_parallel: int) -> dict[str, Any]:
    """The DeepSpeed config of a pipeline run (global batch = micro x accum x dp)."""
    return {
        "train_batch_size": spec.micro_batch_size
        * spec.gradient_accumulation_steps
        * data_parallel,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "optimizer": {
            "type": "Adam",
            # torch's Adam: DeepSpeed's fused Adam would be compiled at first use.
            "params": {"lr": spec.lr, "betas": [0.9, 0.98], "eps": 1e-8, "torch_adam": True},
        },
        "zero_optimization": {"stage": spec.zero_stage},
        "bf16": {"enabled": not spec.fp32},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run(spec: PipelineSpec) -> None:
    """Train one rank of the pipeline.

    Raises:
        ConfigError: The stage count or ZeRO stage does not fit the launched ranks.
    """
    if spec.intra_op_threads is not None:
        # Ranks sharing a machine's cores: torch's default (every core per rank)
        # oversubscribes them.
        torch.set_num_threads(spec.intra_op_threads)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_pipeline_config(world_size, spec.num_stages, spec.zero_stage)

    layers = build_layers(spec)
    # seed_layers: layer i is built right after seeding with base + i, on whichever
    # stage holds it, so the initial weights do not depend on num_stages. DeepSpeed
    # also reseeds before every layer's forward with base * micro_batch + i, which makes
    # dropout masks stage-independent; a large base keeps those seeds distinct per micro
    # batch (base 0 would repeat one mask).
    module = PipelineModule(
        layers=layers,
        num_stages=spec.num_stages,
        loss_fn=bst_loss if spec.model == "bst" else LOSSES[spec.loss],
        # DeepSpeed's "type:" method balances the layers whose class name matches.
        partition_method=(
            "type:TransformerBlockPipe"
            if spec.partition_method == "blocks"
            else spec.partition_method
        ),
        seed_layers=True,
        seed_fn=seed_layer,
        base_seed=layer_base_seed(spec.seed),
    )
    # Every stage holding the tied item table gets the same (untrained) item lookups.
    index = item_feature_index(spec)
    for tied in module.tied_modules.values():
        if index:
            tied.item_features.set_index(index)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=deepspeed_config(spec, world_size // spec.num_stages),
    )
    replica, replicas = (
        engine.grid.get_data_parallel_rank(),
        engine.grid.get_data_parallel_world_size(),
    )
    data = micro_batches(spec, replica, replicas)
    resume_store, preemption, start = None, None, 0
    if spec.checkpoint_every:
        if spec.checkpoint_root is None:
            raise ConfigError("checkpoint_every needs checkpoint_root in the pipeline spec")
        resume_store = CheckpointStore(spec.checkpoint_root, keep=spec.keep_checkpoints, log=print)
        start = _resume(resume_store, spec, engine, module)
        for _ in range(start * spec.gradient_accumulation_steps):
            next(data)  # replay the stream up to the checkpoint
        preemption = Preemption(engine.device)
    # Sequences per step over all replicas; an epoch is one pass over the train rows.
    samples_per_step = spec.micro_batch_size * spec.gradient_accumulation_steps * replicas
    rows = pq.ParquetFile(spec.sequences).metadata.num_rows if spec.sequences else None
    log_file = spec.train_log.open("a") if spec.train_log is not None and rank == 0 else None
    losses: list[float] = []
    started = window_started = time.monotonic()
    try:
        for step in range(start + 1, spec.steps + 1):
            # The last stage computes the loss; the engine broadcasts it to every stage.
            losses.append(float(engine.train_batch(data_iter=data)))
            stop = preemption is not None and preemption.agreed()
            if resume_store is not None and step < spec.steps:
                if step % spec.checkpoint_every == 0 or stop:
                    counters = {"step": step, "micro_done": step * spec.gradient_accumulation_steps}
                    save_resume_checkpoint(
                        resume_store,
                        engine,
                        None,
                        None,
                        counters,
                        spec.config_fingerprint,
                        spec.chaos.get("checkpoint_fault", ""),
                    )
                if stop:
                    raise Preempted(
                        f"stopped by SIGTERM after step {step}; its resume checkpoint is "
                        f"committed under {resume_store.root}"
                    )
            if spec.train_log is None or (step % spec.log_every and step != spec.steps):
                continue
            # Every rank reaches this collective at the same step.
            memory = torch.zeros(world_size, dtype=torch.float64)
            memory[rank] = rss_bytes() / 2**20
            dist.all_reduce(memory)
            now = time.monotonic()
            # The steps since the last record (fewer right after a resume).
            window = losses[
                -min(step - (step - 1) // spec.log_every * spec.log_every, step - start) :
            ]
            record = {
                "step": step,
                "total_steps": spec.steps,
                "loss": sum(window) / len(window),
                "samples_per_s": len(window) * samples_per_step / max(now - window_started, 1e-9),
                "epoch": step * samples_per_step / rows if rows else None,
                "step_ms": {"step": 1000.0 * (now - window_started) / len(window)},
                "rss_mb": [round(float(m), 1) for m in memory],
            }
            window_started = now
            if log_file is not None:
                print(PROGRESS_PREFIX + json.dumps(record), flush=True)
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
    finally:
        if log_file is not None:
            log_file.close()
    seconds = time.monotonic() - started

    if spec.checkpoint_dir is not None:
        # Every rank calls it: each stage's first replica writes its layers, every rank
        # its optimizer state.
        engine.save_checkpoint(
            str(spec.checkpoint_dir),
            tag=CHECKPOINT_TAG,
            client_state={"spec": spec.model_dump(mode="json")},
        )
    dist.barrier()  # every stage's layer files are on disk
    if rank == 0:
        if spec.checkpoint_dir is not None and spec.weights_file is not None:
            to_model = bst_pipeline_state_to_model if spec.model == "bst" else None
            state = consolidate_pipeline_checkpoint(
                spec.checkpoint_dir / CHECKPOINT_TAG, to_model or pipeline_state_to_sasrec
            )
            spec.weights_file.parent.mkdir(parents=True, exist_ok=True)
            write_model_weights(state, spec, spec.weights_file)
        window = min(len(losses), spec.log_every)
        done = spec.steps - start  # this run's steps
        record = {
            "losses": losses,  # from step start + 1 on
            "final_loss": sum(losses[-window:]) / window,
            "steps": spec.steps,
            "samples": spec.steps * samples_per_step,
            "samples_per_s": done * samples_per_step / max(seconds, 1e-9),
            "resumed_from_step": start or None,
            "world_size": world_size,
            "num_stages": spec.num_stages,
            "parts": [int(part) for part in module.parts],
            "seconds": seconds,
            "peak_rss_mb_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        spec.out.parent.mkdir(parents=True, exist_ok=True)
        spec.out.write_text(json.dumps(record, indent=2) + "\n")
    dist.barrier()  # rank 0's files are written before any rank exits


def _resume(store: CheckpointStore, spec: PipelineSpec, engine: Any, module: PipelineModule) -> int:
    """Every rank: load the newest valid resume checkpoint, if any; returns its step (or 0)."""
    point = find_resume_point(store, spec.config_fingerprint, spec.zero_stage, convertible=False)
    if point is None:
        return 0
    engine.load_checkpoint(
        str(point.path), tag=DENSE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    step = int(point.meta["step"])
    # PipelineModule reseeds each layer's forward from its count of micro batches.
    module.micro_offset = step * spec.gradient_accumulation_steps
    if dist.get_rank() == 0:
        record = {
            "step": step,
            "checkpoint": str(point.path),
            "from_world_size": point.meta["world_size"],
        }
        print(RESUME_PREFIX + json.dumps(record), flush=True)
    return step


def _architecture(spec: PipelineSpec) -> tuple[int, int, int, int, int, float]:
    """The constructor arguments SASRec and BST share, in their order."""
    return (
        spec.num_items,
        spec.max_length,
        spec.hidden_dim,
        spec.num_blocks,
        spec.num_heads,
        spec.dropout,
    )


def build_layers(spec: PipelineSpec) -> list:
    """The spec's model as `deepspeed.pipe` layer specs."""
    args = _architecture(spec)
    if spec.model == "bst":
        return build_bst_pipeline_layers(*args, spec.mlp)
    return build_pipeline_layers(*args, spec.item_features)


def build_model(spec: PipelineSpec) -> SASRec | BST:
    """The spec's model as one module (what the consolidated weights load into)."""
    args = _architecture(spec)
    return BST(*args, spec.mlp) if spec.model == "bst" else SASRec(*args, spec.item_features)


def item_feature_index(spec: PipelineSpec) -> dict[str, torch.Tensor]:
    """The item -> feature index lookups of `spec.item_features`, from its Parquet file.

    Raises:
        ConfigError: Features are named but the file is missing or lacks one of them.
    """
    if not spec.item_features:
        return {}
    path = spec.item_features_file
    if path is None or not path.is_file():
        raise ConfigError(
            f"item_features {sorted(spec.item_features)} need item_features_file, got {path}"
        )
    table = pq.read_table(path)
    missing = sorted(set(spec.item_features) - set(table.column_names))
    if missing:
        raise ConfigError(f"{path} has no column(s) {missing}; rerun preprocess")
    return {name: torch.from_numpy(table.column(name).to_numpy()) for name in spec.item_features}


def consolidate_pipeline_checkpoint(
    tag_dir: Path,
    to_model: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = (
        pipeline_state_to_sasrec
    ),
) -> dict[str, torch.Tensor]:
    """The model's state dict from a DeepSpeed pipeline checkpoint's layer files.

    Each stage wrote `layer_NN-model_states.pt` for its layers (the tied item table as
    layer 00, on the first stage; a later layer that shares it has no file). The files
    are memory-mapped, not read: the tensors are views of them, so `write_model_weights`
    streams them into one file without the model ever being in memory.

    Args:
        tag_dir: The checkpoint tag directory, e.g. `checkpoints/final`.
        to_model: Maps `<layer>.<name>` keys to the model's names
            (`pipeline_state_to_sasrec` or `bst.bst_pipeline_state_to_model`).

    Returns:
        Model parameter names -> tensors in their saved dtype (bf16 weights of a bf16
        run; `write_model_weights` stores them as fp32).

    Raises:
        ValueError: No layer files, or layers missing (see `pipeline_state_to_sasrec`).
    """
    files = sorted(tag_dir.glob("layer_*-model_states.pt"))
    if not files:
        raise ValueError(f"{tag_dir} holds no layer_*-model_states.pt: not a pipeline checkpoint")
    merged: dict[str, torch.Tensor] = {}
    for path in files:
        index = int(path.name.split("-")[0].removeprefix("layer_"))
        layer = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in layer.items():
            merged[f"{index}.{name}"] = tensor
    return to_model(merged)


def write_model_weights(state: dict[str, torch.Tensor], spec: PipelineSpec, path: Path) -> None:
    """Stream `state` into `path` as the model's safetensors weights (floats as fp32).

    Refuses a state that does not rebuild the model exactly: the names and shapes are
    checked against the model built on the meta device (no memory), which is what a
    strict `load_state_dict` checks.

    Raises:
        ValueError: A parameter is missing, unexpected or of another shape (named).
    """
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build_model(spec).state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        shapes = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        raise ValueError(
            f"the pipeline checkpoint does not rebuild the {spec.model} model: missing "
            f"{missing}, unexpected {unexpected}, other shapes {shapes}"
        )
    layout = plan_layout(got, dtypes={name: t.dtype for name, t in state.items()})
    partial = create_file(path, layout)
    with open(partial, "r+b") as file:
        write_dense(file, layout, state, CHUNK_BYTES // FP32_BYTES)
    finish_file(path, layout)


def load_spec(path: Path) -> PipelineSpec:
    """Parse a spec file.

    Raises:
        ConfigError: Unknown keys, missing keys or invalid values (named).
    """
    try:
        return PipelineSpec.model_validate_json(path.read_text())
    except ValidationError as error:
        raise ConfigError(f"{path}: invalid pipeline spec: {error}") from error


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.sequence.pipeline_worker SPEC.json` (other args ignored)."""
    return rank_main("training.sequence.pipeline_worker", lambda path: run(load_spec(path)), argv)


if __name__ == "__main__":
    sys.exit(main())
