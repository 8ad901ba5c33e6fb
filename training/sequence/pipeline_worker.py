"""One rank of a sequence model's (SASRec, BST) pipeline-parallel run.

`python -m training.sequence.pipeline_worker SPEC.json`.

Run under the DeepSpeed launcher (`python -m deepspeed.launcher.runner --num_gpus W
--master_port P --module training.sequence.pipeline_worker SPEC.json`). Reads the spec (see
`PipelineSpec`) and, when `sequences` is set, a `data_prep.sequences` train.parquet.
Writes, on rank 0:

- `out`: JSON `{"losses": [...], "final_loss", "steps", "samples", "samples_per_s",
  "resumed_from_step", "world_size", "num_stages", "parts", "seconds", "step_ms",
  "peak_rss_mb_rank0"}`, one loss per
  optimizer step (the mean over its micro batches, which DeepSpeed's pipeline engine
  broadcasts from the last stage to every rank);
- `train_log` (when set): one progress record per `train.log_every` steps, also printed
  as `RECFORGE_PROGRESS {...}` lines for the parent (`training.sequence.train`) to stream;
- `tensorboard_dir` (when set): the same records as TensorBoard scalars;

when `checkpoint_dir` is set, DeepSpeed's pipeline checkpoint `checkpoint_dir/final/`
(one `layer_NN-model_states.pt` per layer, written by each stage's first data-parallel
rank, plus the optimizer states), and when `weights_file` is also set, that checkpoint
consolidated into one fp32 model state dict (safetensors), by rank 0 after every
stage has written its layers.

The model's pieces (pipeline layers, loss, micro batches, the layer-to-model name
mapping) come from its `training.sequence.registry` entry; what to train from the
spec's resolved train config and DeepSpeed config.

Reproducibility: every layer is built from its own seed (`seed_layers`: layer i is
seeded with `layer_base_seed(train.seed) + i`), so the weights do not depend on how the
layers are split into stages. Every optimizer step takes replicas x grad_accum_steps micro
batches of one global stream, each drawn from seeds of its own (train.seed and its number
in the stream: `micro_batches`); replica r runs that step's micro batches r x G .. r x G +
G - 1, on its first and its last stage alike. DeepSpeed reseeds every layer's forward
(dropout) from the module's micro batch counter, which is set to the same global number
before every step. So a step trains on the same micro batches with the same dropout masks
whatever the stages and however its micro batches are split into replicas and
accumulation steps: 1 stage or 2, 2 replicas x 1 or 1 replica x 2 train the same model.

Resume: with `train.checkpoint_every` or `train.checkpoint_every_s` set (the latter is by
default) and a `checkpoint_root`, the ranks save crash-safe resume checkpoints there every
that many steps, every that many seconds (rank 0's clock, agreed by every rank at the
same step) and on SIGTERM (`training.runtime.rank`'s
`save_resume_checkpoint` and `Preemption`: DeepSpeed's pipeline checkpoint, each rank's
RNG states, a manifest with the config fingerprint and the layout). At start they
continue from the newest valid one, on the same stages and micro batch size with any
data-parallel degree under ZeRO-0 (only the one that wrote it under ZeRO-1:
`find_resume_point`), the global batch kept by grad_accum_steps. The micro batch stream
starts at the step (each micro batch has seeds of its own): the resumed run trains on the
same batches with the same dropout masks.

Validation (`valid` in the spec, from `train.eval_every_epochs`): at every validation
step the ranks save a resume checkpoint, rebuild the whole model from its layer files,
rank the valid split data-parallel over users and agree on the metric
(`training.sequence.validation`); the best step's checkpoint is pinned against
retention and is what `weights_file` is consolidated from, the curve is
`validation.json` beside the resume checkpoints, and after `train.patience` validations
without improvement the ranks stop early. `out` then also holds `validation` (the curve,
the best step and epoch, why training stopped) and `steps` is the steps trained
(`planned_steps` the plan).

The only environment this process reads is what the launcher sets for
`deepspeed.init_distributed`; fault injection arrives in the spec's `chaos`.
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as dist
import numpy as np
import pyarrow.parquet as pq
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import set_random_seed
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from artifacts.checkpoints import CheckpointStore
from artifacts.errors import ConfigError
from training.config import TrainConfig
from training.errors import Preempted
from training.runtime.consolidate import create_file, finish_file, plan_layout, write_dense
from training.runtime.exchange import NodeExchange
from training.runtime.launcher import RESUME_PREFIX
from training.runtime.memory import CHUNK_BYTES, FP32_BYTES
from training.runtime.rank import (
    DENSE_TAG,
    Preemption,
    find_resume_point,
    gather_rss_mb,
    open_tensorboard,
    rank_main,
    save_resume_checkpoint,
    write_progress,
    write_scalars,
)
from training.sequence.evaluate import SplitInputs, load_split_inputs
from training.sequence.registry import sequence_model
from training.sequence.sasrec import ARCHITECTURE_ARGS
from training.sequence.validation import (
    VALID_SPLIT,
    Selection,
    ValidationSpec,
    rank_valid_split,
    read_curve,
    select_best,
    write_curve,
)

CHECKPOINT_TAG = "final"


class PipelineSpec(BaseModel):
    """What one pipeline run trains (`launch.json`); unknown keys are refused.

    What to train comes from the resolved train config and the DeepSpeed config built
    from it (`training.runtime.deepspeed_config`); the spec adds only what the train
    stage derived from the data and the machine: the model's constructor arguments
    (`num_items`, `max_length`, item features), the step count, the paths, the
    resume fingerprint and the chaos tests' fault injection.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    train_config: TrainConfig = Field(description="The resolved `train` section.")
    architecture: dict[str, Any] = Field(
        description="The model's constructor arguments plus its name under 'model' "
        "(`model_config.json`, see `training.sequence.registry`)."
    )
    ds_config: dict[str, Any] = Field(
        description="The DeepSpeed config, from `build_deepspeed_config`."
    )
    steps: int = Field(ge=1, description="Optimizer steps (engine.train_batch calls).")
    intra_op_threads: int | None = Field(
        default=None, ge=1, description="torch threads per rank; None: torch's default."
    )
    sequences: Path | None = Field(
        default=None, description="A train.parquet of data_prep.sequences; None: synthetic."
    )
    item_features_file: Path | None = Field(
        default=None, description="item_features.parquet of data_prep.sequences (item lookups)."
    )
    out: Path = Field(description="Where rank 0 writes the per-step losses (JSON).")
    train_log: Path | None = Field(
        default=None, description="Progress records (JSON lines); None: no progress output."
    )
    tensorboard_dir: Path | None = Field(
        default=None, description="TensorBoard event files (rank 0); None: none."
    )
    checkpoint_dir: Path | None = Field(
        default=None, description="DeepSpeed pipeline checkpoint root; None: no checkpoint."
    )
    weights_file: Path | None = Field(
        default=None,
        description="Consolidated fp32 model weights (safetensors); needs checkpoint_dir.",
    )
    checkpoint_root: Path | None = Field(
        default=None,
        description="Resume checkpoints' directory (artifacts.checkpoints); needed "
        "by train.checkpoint_every (without one, train.checkpoint_every_s saves nothing).",
    )
    config_fingerprint: str = Field(
        default="", description="What a resume must match (training.sequence.train)."
    )
    valid: ValidationSpec | None = Field(
        default=None,
        description="In-training validation (train.eval_every_epochs); None: none, the "
        "last weights are the model.",
    )
    chaos: dict[str, Any] = Field(
        default={}, description="Fault injection of the chaos tests (training.runtime.launcher)."
    )
    artifact_root: str | None = Field(
        default=None,
        description="The run's artifact root; on shared storage a rank needs the run key.",
    )
    node_exchange: dict[str, Any] | None = Field(
        default=None,
        description="launcher 'per_node': {url, ranks_per_node} of the scratch prefix through "
        "which nodes that share no disk trade checkpoint files (training.runtime.exchange); "
        "None: the ranks share the checkpoint directories.",
    )

    @model_validator(mode="after")
    def _check_architecture(self) -> PipelineSpec:
        missing = sorted(set(ARCHITECTURE_ARGS) - set(self.architecture))
        if missing:
            raise ValueError(f"architecture lacks {missing}; rebuild the spec with train")
        if self.architecture.get("model") != self.train_config.model:
            raise ValueError(
                f"architecture.model={self.architecture.get('model')!r} but "
                f"train_config.model={self.train_config.model!r}; rebuild the spec with train"
            )
        if self.train_config.checkpoint_every and self.checkpoint_root is None:
            raise ValueError("train_config.checkpoint_every needs checkpoint_root")
        if self.valid is not None and self.checkpoint_root is None:
            # The best weights are kept as a resume checkpoint.
            raise ValueError("valid (train.eval_every_epochs) needs checkpoint_root")
        return self


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


# Seed streams of `micro_seed`: every micro batch draws its sequences and its negatives
# from seeds of its own, and every pass over the Parquet rows from one.
_SYNTHETIC, _NEGATIVES, _EPOCH = 1, 2, 3


def micro_seed(seed: int, purpose: int, index: int) -> int:
    """A 64-bit seed of (train.seed, purpose, index), independent across all three.

    Args:
        seed: train.seed (>= 0).
        purpose: Which draw (`_SYNTHETIC`, `_NEGATIVES`, `_EPOCH`; nonzero, since numpy's
            SeedSequence reads a trailing 0 like none).
        index: The micro batch's number in the global stream, or the epoch.
    """
    return int(np.random.SeedSequence((seed, purpose, index)).generate_state(1, np.uint64)[0])


class ShuffledHistories:
    """The train histories of a `data_prep.sequences` train.parquet as one endless stream.

    Position p of the stream is row `order(e)[p % N]` of epoch e = p // N, where
    `order(e)` is a permutation of the N kept rows seeded by train.seed and e: every
    epoch is one pass over the rows in a fresh order, and any position is found without
    reading the ones before it. The items are held as one int64 array and row offsets
    (8 bytes an item), the whole file on every rank.

    Args:
        path: The train.parquet.
        seed: train.seed.
        min_items: Shorter histories are left out (BST needs a history and a target).

    Raises:
        ConfigError: No history of the file has min_items items.
    """

    def __init__(self, path: Path, seed: int, min_items: int = 1) -> None:
        histories = pq.read_table(path, columns=["history"]).column("history").combine_chunks()
        self._items = histories.values.to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = histories.offsets.to_numpy()
        self._starts, self._ends = offsets[:-1], offsets[1:]
        self._kept = np.flatnonzero(self._ends - self._starts >= min_items)
        if not len(self._kept):
            raise ConfigError(
                f"sequences={path}: none of its {len(histories)} histories has {min_items} "
                "item(s) to train on; rerun preprocess with more data"
            )
        self._seed = seed
        self._order: tuple[int, np.ndarray] = (-1, self._kept)

    def rows(self, start: int, count: int) -> list[list[int]]:
        """Positions start .. start + count - 1 of the stream: item lists, oldest first."""
        rows = []
        for position in range(start, start + count):
            epoch, index = divmod(position, len(self._kept))
            if self._order[0] != epoch:
                shuffle = np.random.default_rng(micro_seed(self._seed, _EPOCH, epoch))
                self._order = (epoch, self._kept[shuffle.permutation(len(self._kept))])
            row = self._order[1][index]
            rows.append(self._items[self._starts[row] : self._ends[row]].tolist())
        return rows


def micro_batches(
    spec: PipelineSpec, replica: int = 0, replicas: int = 1, first_step: int = 0
) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """One data-parallel replica's endless pipeline micro batches, from `first_step` on.

    SASRec: ((history, positives, negatives), positives). BST: ((history, target),
    label) with batch_size x (1 + num_negatives) rows: each sequence's positive
    target, then its negatives.

    Every optimizer step takes M = replicas x grad_accum_steps micro batches of batch_size
    sequences from one global stream: micro batch k of step s is number j = s x M + k,
    and replica r runs k = r x G .. r x G + G - 1 in order. Micro batch j has seeds of its
    own (`micro_seed` of train.seed and j): its synthetic sequences, or positions
    j x B .. j x B + B - 1 of the shuffled Parquet rows (`ShuffledHistories`), and its
    negatives. So a step's micro batches depend on the seed and M only: the same for
    every split of M into replicas and accumulation steps, on the first and the last
    stage of a replica, and from any step on without replaying the ones before.

    Args:
        spec: The run's spec.
        replica: Data-parallel replica index of the calling rank.
        replicas: Data-parallel degree (world_size / pipeline_stages).
        first_step: The optimizer step (0-based) whose micro batches come first.

    Raises:
        ConfigError: The Parquet file has no history to train on.
    """
    config, architecture = spec.train_config, spec.architecture
    entry = sequence_model(config.model)
    num_items, max_length = architecture["num_items"], architecture["max_length"]
    batch, accum = config.batch_size, config.grad_accum_steps
    histories = None
    if spec.sequences is not None:
        histories = ShuffledHistories(spec.sequences, config.seed, entry.min_items)
    # loss 'softmax' samples no negatives: every item is one.
    negatives = 0 if config.sequence.loss == "softmax" else config.sequence.num_negatives
    for step in itertools.count(first_step):
        for k in range(replica * accum, (replica + 1) * accum):
            index = step * replicas * accum + k  # j, the micro batch's global number
            if histories is None:
                rng = np.random.default_rng(micro_seed(config.seed, _SYNTHETIC, index))
                source = synthetic_sequences(num_items, max_length, rng)
                rows = [next(source) for _ in range(batch)]
            else:
                rows = histories.rows(index * batch, batch)
            generator = torch.Generator().manual_seed(micro_seed(config.seed, _NEGATIVES, index))
            yield entry.micro_batch(
                rows, max_length, num_items, negatives, generator, config.sequence.shared_negatives
            )


def micro_offset(step: int, replica: int, replicas: int, grad_accum_steps: int) -> int:
    """The PipelineModule micro batch counter of `replica` before optimizer step `step`.

    DeepSpeed seeds every layer's forward (its dropout masks) from the module's count of
    micro batches: set to the global number of the replica's first micro batch of the
    step (`micro_batches`), the masks of a micro batch do not depend on the replicas.

    Args:
        step: The optimizer step about to run, 0-based.
        replica: This rank's data-parallel replica.
        replicas: Data-parallel degree.
        grad_accum_steps: Micro batches per replica and step.
    """
    return (step * replicas + replica) * grad_accum_steps


def seed_layer(seed: int) -> None:
    """PipelineModule's `seed_fn`: seed python, numpy and torch.

    With partition_method="parameters" DeepSpeed passes a numpy integer, which
    `random.seed` refuses; hence the cast.
    """
    set_random_seed(int(seed))


def layer_base_seed(seed: int) -> int:
    """The PipelineModule `base_seed` of a spec seed (nonzero, distinct per seed)."""
    return 1_000_003 * (seed + 1)


@dataclass
class _Resume:
    """A run's resume state: the store and SIGTERM and timer agreement (None without
    resume checkpoints or validation), the step it continues from (0: a fresh
    start) and the node exchange that keeps every node's copy of the store whole."""

    store: CheckpointStore | None
    preemption: Preemption | None
    start: int
    exchange: NodeExchange
    from_world_size: int | None = None  # the world size that wrote the checkpoint


@dataclass
class _Validation:
    """A run's in-training validation (every rank holds the same): the valid curve so
    far, as `validation.json` records it, the valid split once loaded, and the
    reason training stopped early ("" while it goes on)."""

    spec: ValidationSpec
    curve: list[dict[str, float]]
    inputs: SplitInputs | None = None
    stop_reason: str = ""


def run(spec: PipelineSpec) -> None:
    """Train one rank of the pipeline.

    Raises:
        ConfigError: The launcher started another number of ranks than configured.
        Preempted: SIGTERM arrived; the resume checkpoint of that step is committed.
    """
    rank, world_size = _start_rank(spec)
    exchange = NodeExchange.from_spec(spec.node_exchange)
    module = build_pipeline_module(spec)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=spec.ds_config,
    )
    replica, replicas = (
        engine.grid.get_data_parallel_rank(),
        engine.grid.get_data_parallel_world_size(),
    )
    resume = _start_resume(spec, engine, exchange)
    data = micro_batches(spec, replica, replicas, first_step=resume.start)
    validation = _start_validation(spec, resume, rank)
    losses, seconds = _train_steps(
        spec, engine, data, resume, validation, rank, world_size, replicas
    )
    _save_pipeline_checkpoint(spec, engine)
    if spec.checkpoint_dir is not None:
        # Every stage's layer files are on disk, and on node 0's too (rank 0 reads them).
        exchange.share(spec.checkpoint_dir / CHECKPOINT_TAG, CHECKPOINT_TAG)
    dist.barrier()
    if rank == 0:
        _write_outputs(spec, module, losses, seconds, resume, validation, world_size, replicas)
    dist.barrier()  # rank 0's files are written before any rank exits


def _start_rank(spec: PipelineSpec) -> tuple[int, int]:
    """Join the process group; returns (rank, world_size).

    Raises:
        ConfigError: The launched world size is not train.world_size.
    """
    if spec.intra_op_threads is not None:
        # Ranks sharing a machine's cores: torch's default (every core per rank)
        # oversubscribes them.
        torch.set_num_threads(spec.intra_op_threads)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != spec.train_config.world_size:
        raise ConfigError(
            f"train.world_size={spec.train_config.world_size} but the launcher started "
            f"{world_size} ranks"
        )
    return rank, world_size


def build_pipeline_module(spec: PipelineSpec) -> PipelineModule:
    """The model's `PipelineModule` over train.pipeline_stages, item lookups set."""
    config = spec.train_config
    entry = sequence_model(config.model)
    # seed_layers: layer i is built right after seeding with base + i, on whichever
    # stage holds it, so the initial weights do not depend on num_stages. DeepSpeed
    # also reseeds before every layer's forward with base * micro_batch + i, which makes
    # dropout masks stage-independent; a large base keeps those seeds distinct per micro
    # batch (base 0 would repeat one mask).
    partition = config.sequence.partition_method
    module = PipelineModule(
        layers=entry.build_pipeline_layers(spec.architecture),
        num_stages=config.pipeline_stages,
        loss_fn=entry.losses[config.sequence.loss],
        # DeepSpeed's "type:" method balances the layers whose class name matches.
        partition_method="type:TransformerBlockPipe" if partition == "blocks" else partition,
        seed_layers=True,
        seed_fn=seed_layer,
        base_seed=layer_base_seed(config.seed),
    )
    # Every stage holding the tied item table gets the same (untrained) item lookups.
    index = item_feature_index(spec)
    for tied in module.tied_modules.values():
        if index:
            tied.item_features.set_index(index)
    return module


def _start_resume(
    spec: PipelineSpec,
    engine: Any,
    exchange: NodeExchange,
) -> _Resume:
    """Every rank: continue from the newest valid resume checkpoint, if resuming is on.

    Resuming is on with train.checkpoint_every or checkpoint_every_s and with validation
    (whose best weights are resume checkpoints).
    """
    config = spec.train_config
    if spec.checkpoint_root is None or not (config.saves_resume_checkpoints() or spec.valid):
        return _Resume(None, None, 0, exchange)
    store = CheckpointStore(spec.checkpoint_root, keep=config.keep_checkpoints, log=print)
    start, from_world_size = _resume(store, spec, engine, exchange)
    preemption = Preemption(engine.device, config.checkpoint_every_s)
    return _Resume(store, preemption, start, exchange, from_world_size)


def _start_validation(spec: PipelineSpec, resume: _Resume, rank: int) -> _Validation | None:
    """Every rank: the valid curve up to the resume step; the best step's checkpoint pinned.

    A run killed after saving a validation step's checkpoint but before recording its
    evaluation resumes from that checkpoint: its evaluation is done now, on the same
    weights the uninterrupted run evaluated.
    """
    if spec.valid is None or resume.store is None:
        return None
    config = spec.train_config
    validation = _Validation(spec.valid, _resumed_curve(resume))
    evaluated = {point["step"] for point in validation.curve}
    if resume.start and _is_validation_step(spec, resume.start) and resume.start not in evaluated:
        _validate(spec, resume.store, validation, resume.start, rank, None)
    elif validation.curve:
        selection = _selection(validation, config)
        resume.store.pin([selection.best_step])
        validation.stop_reason = selection.reason
    return validation


def _resumed_curve(resume: _Resume) -> list[dict[str, float]]:
    """The valid curve a resumed run continues: the one in its checkpoint's meta.

    The meta holds the evaluations before the checkpoint's step (a validation step's
    own evaluation comes after its checkpoint, and is done again on resume). A
    checkpoint written before the meta held the curve falls back to `validation.json`.
    """
    if resume.store is None or not resume.start:
        return []
    # Signed for this run and step (rank 0 verified every file before the resume).
    meta = resume.store.manifest(resume.store.checkpoint_dir(resume.start))["meta"]
    if "curve" in meta:
        return [point for point in meta["curve"] if point["step"] <= resume.start]
    return read_curve(resume.store.root, resume.start)


def _selection(validation: _Validation, config: TrainConfig) -> Selection:
    """The best step of the curve so far and whether to stop (`select_best`)."""
    curve = [(point["step"], point["value"]) for point in validation.curve]
    return select_best(curve, config.patience, config.select_metric)


def _is_validation_step(spec: PipelineSpec, step: int) -> bool:
    """Whether the ranks evaluate the valid split after `step` (always at the last)."""
    return spec.valid is not None and (step % spec.valid.every_steps == 0 or step == spec.steps)


def _train_steps(
    spec: PipelineSpec,
    engine: Any,
    data: Iterator[Any],
    resume: _Resume,
    validation: _Validation | None,
    rank: int,
    world_size: int,
    replicas: int,
) -> tuple[list[float], float]:
    """Every rank: the optimizer steps after resume.start; returns their losses and seconds.

    Saves resume checkpoints every train.checkpoint_every steps, every
    train.checkpoint_every_s seconds, at every validation step and on SIGTERM; validates
    (stopping early when train.patience says so); reports progress every
    train.log_every steps (rank 0 writes it).

    Raises:
        Preempted: SIGTERM arrived; the resume checkpoint of that step is committed.
    """
    config = spec.train_config
    # Sequences per step over all replicas; an epoch is one pass over the train rows.
    samples_per_step = config.batch_size * config.grad_accum_steps * replicas
    rows = pq.ParquetFile(spec.sequences).metadata.num_rows if spec.sequences else None
    on_rank0 = rank == 0
    log_file = spec.train_log.open("a") if spec.train_log is not None and on_rank0 else None
    writer = open_tensorboard(spec.tensorboard_dir) if on_rank0 else None
    losses: list[float] = []
    started = window_started = time.monotonic()
    try:
        for step in range(resume.start + 1, spec.steps + 1):
            if validation is not None and validation.stop_reason:
                break  # a resumed run whose curve had already stopped it
            # Dropout masks by the micro batches' global numbers, as the data (micro_batches).
            engine.module.micro_offset = micro_offset(
                step - 1, engine.grid.get_data_parallel_rank(), replicas, config.grad_accum_steps
            )
            # The last stage computes the loss; the engine averages it over the replicas
            # (the global mean of the step's micro batches) and broadcasts it to every stage.
            losses.append(float(engine.train_batch(data_iter=data)))
            _checkpoint_step(spec, engine, resume, step, validation)
            if validation is not None and resume.store is not None:
                if _is_validation_step(spec, step):
                    _validate(spec, resume.store, validation, step, rank, writer)
            if spec.train_log is None or (
                step % config.log_every and step != spec.steps and not _stopping(validation)
            ):
                continue
            # Every rank reaches this collective at the same step.
            rss_mb = gather_rss_mb(rank, world_size)
            now = time.monotonic()
            # The steps since the last record (fewer right after a resume).
            since = step - (step - 1) // config.log_every * config.log_every
            window = losses[-min(since, step - resume.start) :]
            record = {
                "step": step,
                "total_steps": spec.steps,
                "loss": sum(window) / len(window),
                "samples_per_s": len(window) * samples_per_step / max(now - window_started, 1e-9),
                "epoch": step * samples_per_step / rows if rows else None,
                "step_ms": {"step": 1000.0 * (now - window_started) / len(window)},
                "rss_mb": rss_mb,
            }
            window_started = now
            if log_file is not None:
                write_progress(log_file, record)
            if writer is not None:
                write_scalars(writer, record)
    finally:
        if log_file is not None:
            log_file.close()
        if writer is not None:
            writer.close()
    return losses, time.monotonic() - started


def _stopping(validation: _Validation | None) -> bool:
    return validation is not None and bool(validation.stop_reason)


def _validate(
    spec: PipelineSpec,
    store: CheckpointStore,
    validation: _Validation,
    step: int,
    rank: int,
    writer: Any,
) -> None:
    """Every rank: rank the valid split with the weights of step's checkpoint; record it.

    Every rank rebuilds the whole model from the checkpoint's layer files (each stage
    holds only its layers) and ranks its share of the valid users
    (`rank_valid_split`); all get the same metric, so all take the same decision.
    Rank 0 appends it to `validation.json` (by rename) and TensorBoard; every rank pins
    the best step's checkpoint against retention and sets `stop_reason` when
    train.patience validations passed without improvement.
    """
    config = spec.train_config
    model = _checkpoint_model(spec, store.checkpoint_dir(step) / DENSE_TAG)
    if validation.inputs is None:
        validation.inputs = load_split_inputs(
            VALID_SPLIT, model, spec.architecture, validation.spec.sequences_dir
        )
    value = rank_valid_split(
        model, validation.inputs, validation.spec.protocol, config.select_metric
    )
    epoch = step / validation.spec.steps_per_epoch
    validation.curve.append({"step": step, "epoch": epoch, "value": value})
    selection = _selection(validation, config)
    store.pin([selection.best_step])
    validation.stop_reason = selection.reason
    if rank == 0:
        write_curve(store.root, validation.curve, config.select_metric)
        print(
            f"validation at step {step} (epoch {epoch:.2f}): {config.select_metric}={value:.6g}, "
            f"best step {selection.best_step} ({selection.best_value:.6g})"
            + (f"; {selection.reason}" if selection.stop else ""),
            flush=True,
        )
    if writer is not None:
        writer.add_scalar(f"valid/{config.select_metric}", value, step)
        writer.add_scalar(f"valid/best_{config.select_metric}", selection.best_value, step)
        writer.add_scalar("valid/best_step", selection.best_step, step)
        if selection.stop:
            writer.add_text("valid/stop_reason", selection.reason, step)
        writer.flush()


def _checkpoint_model(spec: PipelineSpec, tag_dir: Path) -> nn.Module:
    """The whole model (fp32, eval mode) from a pipeline checkpoint's layer files."""
    to_model = sequence_model(spec.train_config.model).pipeline_state_to_model
    state = consolidate_pipeline_checkpoint(tag_dir, to_model)
    model = build_model(spec)
    # bf16 runs save bf16 weights; the evaluation scores in fp32, as evaluate does.
    model.load_state_dict(
        {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    )
    return model.eval()


def _checkpoint_step(
    spec: PipelineSpec,
    engine: Any,
    resume: _Resume,
    step: int,
    validation: _Validation | None,
) -> None:
    """Every rank, after a step: save a resume checkpoint when one is due or SIGTERM came.

    One is due every train.checkpoint_every steps, once train.checkpoint_every_s seconds
    have passed on rank 0 since the start or the last save, and at every validation step
    (the validation ranks its weights, and the best of them is kept), the last included.
    Its meta carries the valid curve so far (the steps before it) and, as "pinned", the
    best step's checkpoint: wherever the checkpoint travels (a mirror in object storage,
    another machine), a resume gets the curve and the best weights with it.

    Raises:
        Preempted: SIGTERM arrived (after the checkpoint is committed).
    """
    if resume.store is None or resume.preemption is None:
        return
    # Every rank takes part in the agreement, even at the last step.
    decision = resume.preemption.agreed()
    stop = decision.stop
    validating = _is_validation_step(spec, step)
    if step >= spec.steps and not validating:
        return  # the final state is saved anyway
    every = spec.train_config.checkpoint_every
    if (every and step % every == 0) or decision.timed or stop or validating:
        counters = {"step": step, "micro_done": step * spec.train_config.grad_accum_steps}
        # The layout, for a resume on another world size (`resume_layout`).
        extra: dict[str, Any] = spec.train_config.checkpoint_layout()
        if validation is not None:
            extra["curve"] = list(validation.curve)
            if validation.curve:
                extra["pinned"] = [_selection(validation, spec.train_config).best_step]
        save_resume_checkpoint(
            resume.store,
            engine,
            None,
            None,
            counters,
            spec.config_fingerprint,
            spec.chaos.get("checkpoint_fault", ""),
            exchange=resume.exchange,
            extra_meta=extra,
        )
        resume.preemption.saved()
    if stop:
        raise Preempted(
            f"stopped by SIGTERM after step {step}; its resume checkpoint is "
            f"committed under {resume.store.root}"
        )


def _save_pipeline_checkpoint(spec: PipelineSpec, engine: Any) -> None:
    """Every rank: DeepSpeed's final pipeline checkpoint, when checkpoint_dir is set.

    Each stage's first replica writes its layers, every rank its optimizer state.
    """
    if spec.checkpoint_dir is None:
        return
    engine.save_checkpoint(
        str(spec.checkpoint_dir),
        tag=CHECKPOINT_TAG,
        client_state={"spec": spec.model_dump(mode="json")},
    )


def _write_outputs(
    spec: PipelineSpec,
    module: PipelineModule,
    losses: list[float],
    seconds: float,
    resume: _Resume,
    validation: _Validation | None,
    world_size: int,
    replicas: int,
) -> None:
    """Rank 0: the consolidated weights (with weights_file) and the run summary (`out`).

    With validation the weights are the best validation step's checkpoint, not the
    last step's.
    """
    config = spec.train_config
    start = resume.start
    last_step = start + len(losses)  # below spec.steps when stopped early
    selection = None
    if validation is not None and validation.curve:
        selection = _selection(validation, config)
    if spec.checkpoint_dir is not None and spec.weights_file is not None:
        to_model = sequence_model(config.model).pipeline_state_to_model
        if selection is not None and resume.store is not None:
            tag_dir = resume.store.checkpoint_dir(selection.best_step) / DENSE_TAG
        else:
            tag_dir = spec.checkpoint_dir / CHECKPOINT_TAG
        state = consolidate_pipeline_checkpoint(tag_dir, to_model)
        spec.weights_file.parent.mkdir(parents=True, exist_ok=True)
        write_model_weights(state, spec, spec.weights_file)
    samples_per_step = config.batch_size * config.grad_accum_steps * replicas
    window = min(len(losses), config.log_every)
    record = {
        "losses": losses,  # from step start + 1 on
        "final_loss": sum(losses[-window:]) / window if window else None,
        "steps": last_step,
        "planned_steps": spec.steps,
        "samples": last_step * samples_per_step,
        "samples_per_s": len(losses) * samples_per_step / max(seconds, 1e-9),
        "resumed_from_step": start or None,
        "resumed_from_world_size": resume.from_world_size,
        "world_size": world_size,
        "num_stages": config.pipeline_stages,
        "parts": [int(part) for part in module.parts],
        "seconds": seconds,
        # One phase: the pipeline engine runs forward, backward and step as one call.
        "step_ms": {"step": 1000.0 * seconds / max(len(losses), 1)},
        "peak_rss_mb_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if validation is not None and selection is not None:
        best_epoch = selection.best_step / validation.spec.steps_per_epoch
        record["validation"] = {
            "metric": config.select_metric,
            "split": VALID_SPLIT,
            "every_steps": validation.spec.every_steps,
            "curve": validation.curve,
            "best_step": selection.best_step,
            "best_epoch": best_epoch,
            "best_value": selection.best_value,
            "stopped_early": selection.stop,
            "stop_reason": selection.reason
            or f"trained every planned step ({spec.steps}); the weights are step "
            f"{selection.best_step}'s, the best {config.select_metric}",
        }
    spec.out.parent.mkdir(parents=True, exist_ok=True)
    spec.out.write_text(json.dumps(record, indent=2) + "\n")


def _resume(
    store: CheckpointStore,
    spec: PipelineSpec,
    engine: Any,
    exchange: NodeExchange,
) -> tuple[int, int | None]:
    """Every rank: load the newest valid resume checkpoint, if any.

    Returns:
        (its step, the world size that wrote it), or (0, None) for a fresh start.
    """
    config = spec.train_config
    point = find_resume_point(
        store,
        spec.config_fingerprint,
        config.zero_stage,
        exchange=exchange,
        pipeline_layout=config.checkpoint_layout(),
    )
    if point is None:
        return 0, None
    engine.load_checkpoint(
        str(point.path), tag=DENSE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    step = int(point.meta["step"])
    if dist.get_rank() == 0:
        record = {
            "step": step,
            "checkpoint": str(point.path),
            "from_world_size": point.meta["world_size"],
        }
        print(RESUME_PREFIX + json.dumps(record), flush=True)
    return step, int(point.meta["world_size"])


def build_model(spec: PipelineSpec) -> nn.Module:
    """The spec's model as one module (what the consolidated weights load into)."""
    return sequence_model(spec.train_config.model).build_model(spec.architecture)


def item_feature_index(spec: PipelineSpec) -> dict[str, torch.Tensor]:
    """The item -> feature index lookups of the model's item features, from their Parquet file.

    Raises:
        ConfigError: Features are named but the file is missing or lacks one of them.
    """
    features = dict(spec.architecture.get("item_features") or {})
    if not features:
        return {}
    path = spec.item_features_file
    if path is None or not path.is_file():
        raise ConfigError(f"item_features {sorted(features)} need item_features_file, got {path}")
    table = pq.read_table(path)
    missing = sorted(set(features) - set(table.column_names))
    if missing:
        raise ConfigError(f"{path} has no column(s) {missing}; rerun preprocess")
    return {name: torch.from_numpy(table.column(name).to_numpy()) for name in features}


def consolidate_pipeline_checkpoint(
    tag_dir: Path,
    to_model: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The model's state dict from a DeepSpeed pipeline checkpoint's layer files.

    Each stage wrote `layer_NN-model_states.pt` for its layers (the tied item table as
    layer 00, on the first stage; a later layer that shares it has no file). The files
    are memory-mapped, not read: the tensors are views of them, so `write_model_weights`
    streams them into one file without the model ever being in memory.

    Args:
        tag_dir: The checkpoint tag directory, e.g. `checkpoints/final`.
        to_model: Maps `<layer>.<name>` keys to the model's names (the registry
            entry's `pipeline_state_to_model`).

    Returns:
        Model parameter names -> tensors in their saved dtype (bf16 weights of a bf16
        run; `write_model_weights` stores them as fp32).

    Raises:
        ValueError: No layer files, or layers missing (see `to_model`).
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
            f"the pipeline checkpoint does not rebuild the {spec.train_config.model} model: "
            f"missing {missing}, unexpected {unexpected}, other shapes {shapes}"
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
