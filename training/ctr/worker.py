"""One DeepSpeed training rank: `python -m training.ctr.worker LAUNCH.json` under the launcher.

Reads the launch spec written by `training.ctr.train` (train config, model config,
DeepSpeed config, paths, step plan) and the train split of the shard directory.
Writes, into the spec's `out_dir`:

- `checkpoints/final/`: the DeepSpeed checkpoint of the dense part (every rank writes
  its part) and, with sharded embeddings, `sparse-rank-RRRRR-of-WWWWW.safetensors`
  per rank (its rows, their optimizer state and admission counts);
- `model.safetensors`: consolidated weights of the whole `CTRModel` (the dense part
  fp32, the table at `train.table_precision`), streamed by every rank into one file
  (`training.runtime.consolidate`), never gathered on one rank;
- `train_log.jsonl`: one progress record per logging step (rank 0), also printed as
  `RECFORGE_PROGRESS {...}` lines for the parent to stream;
- `tensorboard/`: TensorBoard event files (rank 0) when `train.tensorboard` is on;
- `train_summary.json`: final loss, steps, throughput, time split, memory, and the step
  the run resumed from (rank 0);

and, with `train.checkpoint_every` or `train.checkpoint_every_s` (on by default),
crash-safe resume checkpoints under the spec's `checkpoint_root` (see
`save_resume_checkpoint`, `artifacts.checkpoints`): at start the ranks continue from the
newest valid one, on the same or another world size.

Embeddings: with `train.embeddings: sharded` the table lives in a `ShardedEmbedding`
(rows sharded over ranks, all-to-all lookups, row-wise sparse optimizer) and
DeepSpeed wraps only the `CTRArch` (MLPs, interaction, heads, default rows). With
`dense` the whole `CTRModel` (nn.Embedding inside) is the DeepSpeed module.
`train.grad_clip` is DeepSpeed's clip of the dense gradients' global norm and, with
`sharded`, also the row-wise clip of each updated row's gradient (`clip_row_norms`).

Each step's time is split into data (waiting for the reader), lookup (ids to rows,
both all-to-alls), dense (forward and backward) and optimizer (gradients to the
owners, the dense step, the sparse step).

Preemption: with resume checkpoints on, SIGTERM does not kill a rank. The ranks agree
at the next optimizer step (one all-reduce per step, which also carries rank 0's
checkpoint_every_s timer), save a resume checkpoint of that step, and exit with
`Preempted`, which the parent retries as a crash.

The only environment this process reads is what the launcher sets for
`deepspeed.init_distributed` (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); the
chaos tests' fault injection arrives in the spec's `chaos` (`training.ctr.train`'s
`chaos_settings`).
Any exception prints one `RECFORGE_ERROR {"rank": r, "error": "..."}` line and exits
non-zero; the launcher then stops the other ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from artifacts.checkpoints import CheckpointCorrupt, CheckpointStore
from artifacts.errors import ConfigError
from artifacts.signing import place
from artifacts.store import check_output_dir
from training.config import TrainConfig
from training.ctr.consolidate import table_chunks, table_tensors, write_table
from training.ctr.data import Batch, load_dataset_meta
from training.ctr.embedding import (
    WIRE_KINDS,
    InputDist,
    LookupContext,
    ShardedEmbedding,
    apply_delta,
    init_rows,
    reshard_state,
    table_offsets,
    warm_start_state,
)
from training.ctr.model import build_arch, build_model
from training.ctr.reader import ShardReader
from training.ctr.train import PHASES, TRAIN_SPLIT
from training.errors import Preempted
from training.runtime.consolidate import (
    CHUNK_BYTES,
    chunk_rows_for,
    create_file,
    finish_file,
    partial_path,
    plan_layout,
    write_dense,
)
from training.runtime.exchange import NodeExchange
from training.runtime.files import (
    CHECKPOINT_DIR,
    CHECKPOINT_TAG,
    SUMMARY_FILE,
    TENSORBOARD_DIR,
    TRAIN_LOG_FILE,
    WEIGHTS_FILE,
)
from training.runtime.launcher import RESUME_PREFIX
from training.runtime.memory import FP32_BYTES
from training.runtime.rank import (
    DENSE_TAG,
    CheckpointChain,
    CheckpointWriter,
    Preemption,
    ResumePoint,
    convert_to_universal,
    find_resume_point,
    gather_rss_mb,
    open_tensorboard,
    rank_main,
    rank_state_file,
    require_rank_key,
    save_resume_checkpoint,
    seed_everything,
    set_rng_state,
    sparse_delta_file,
    sparse_file,
    write_progress,
    write_scalars,
)


def load_rank_state(path: Path) -> dict[str, Any]:
    """One rank's RNG states and reader position from a resume checkpoint (`rank-RRRRR.pt`).

    The file comes back from shared storage, so it is read with `weights_only=True`:
    tensors and plain values only (`training.runtime.rank.rng_state`), never a pickle
    that could run code.

    Args:
        path: The checkpoint's `rank-RRRRR.pt`.

    Returns:
        {"rng": the `rng_state()` saved, "reader": the reader position (when saved)}.

    Raises:
        CheckpointCorrupt: The file holds anything else: objects other than tensors and
            plain values (a tampered file, or one written before this format), or not
            that dict.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointCorrupt(
            f"{path} holds objects a weights-only load refuses (a tampered file, or one "
            "written by an older recforge); it was not unpickled. Delete that checkpoint "
            f"directory ({path.parent}) to resume from an earlier one or start over"
        ) from error
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        raise CheckpointCorrupt(
            f"{path} is not a rank state ({{'rng': ..., 'reader': ...}}); delete that "
            f"checkpoint directory ({path.parent}) to resume from an earlier one"
        )
    return state


def load_sparse_chain(
    point: ResumePoint, num_rows: int, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """One rank's embedding shard state at a resume point: its base's shards (re-sharded
    when another world size wrote them), then each delta of its chain in order, keyed by
    global row (so the members may come from different world sizes).

    Raises:
        ValueError: A delta does not fit the base (`apply_delta`).
    """
    (base, base_world), *deltas = point.sparse_parts()
    if base_world == world_size:
        state = load_file(str(base / sparse_file(rank, world_size)))
    else:  # every old shard holds some of this rank's rows
        shards = [load_file(str(base / sparse_file(r, base_world))) for r in range(base_world)]
        state = reshard_state(shards, num_rows, rank, world_size)
    for path, member_world in deltas:
        for r in range(member_world):
            file = path / sparse_delta_file(r, member_world)
            apply_delta(state, load_file(str(file)), num_rows, rank, world_size, str(file))
    return state


def load_resume_point(
    point: ResumePoint,
    engine: deepspeed.DeepSpeedEngine,
    sparse: ShardedEmbedding | None,
    reader: ShardReader,
    num_rows: int,
    skip_restore: frozenset[str] = frozenset(),
    grad_accum_steps: int = 1,
) -> dict[str, int]:
    """Every rank: load the dense part, its embedding rows, RNG states and reader position.

    `skip_restore` ("rng", "reader") leaves those out: the chaos tests' negative control.
    The checkpoint may have split its steps into other micro batches (another world size,
    batch_size and grad_accum_steps with the same global batch): the reader position is
    kept in optimizer steps, and the counters are this run's.

    Returns:
        The counters of the checkpoint's step ({"step", "micro_done"}), in this run's
        micro batches (`grad_accum_steps` per step).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    old_world = int(point.meta["world_size"])
    engine.load_checkpoint(
        str(point.dense_dir),
        tag=DENSE_TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if sparse is not None:
        sparse.load_state_dict(load_sparse_chain(point, num_rows, rank, world_size))
    # The reader position is global (every rank takes the same steps), so rank 0's serves
    # any new rank; a new rank without a file of its own takes rank 0's RNG states.
    own = point.path / rank_state_file(rank)
    first = load_rank_state(point.path / rank_state_file(0))
    state = load_rank_state(own) if own.is_file() else first
    if "rng" not in skip_restore:
        set_rng_state(state["rng"])
    if "reader" not in skip_restore:
        # Both count micro batches; an epoch is whole optimizer steps for either.
        old_accum = int(point.meta.get("grad_accum_steps", grad_accum_steps))
        position = dict(first["reader"])
        position["step"] = position["step"] // old_accum * grad_accum_steps
        reader.restore(position)
    step = int(point.meta["step"])
    counters = {"step": step, "micro_done": step * grad_accum_steps}
    if rank == 0:
        record = {**counters, "checkpoint": str(point.path), "from_world_size": old_world}
        print(RESUME_PREFIX + json.dumps(record), flush=True)
    return counters


class SparseInputs:
    """A batch's ids mapped onto the unique rows of one sharded lookup.

    Args:
        batch: The reader's batch.
        offsets: (F,) start row of each feature in the fused table.
        store: The rank's embedding shard.
        with_features: Also compute each row's feature (for admission defaults).
        sent: The batch's ids as `distribute_ahead` sent them, or None to send them now.
    """

    def __init__(
        self,
        batch: Batch,
        offsets: torch.Tensor,
        store: ShardedEmbedding,
        with_features: bool,
        sent: InputDist | None = None,
    ) -> None:
        single, multi, valid = self._global_rows(batch, offsets)
        flat = torch.cat([single.flatten(), *valid])
        # `sent`: the ids went out ahead (`distribute_ahead`); the rows are read now.
        self.rows, inverse, self.context = store.lookup(flat if sent is None else sent)
        self.sparse_index = inverse[: single.numel()].view_as(single)  # (B, Fs)
        self.multi_index: list[torch.Tensor] = []
        start = single.numel()
        for ids, kept in zip(multi, valid, strict=True):
            index = torch.full_like(ids, -1)  # (B, L)
            index[ids >= 0] = inverse[start : start + kept.numel()]
            start += kept.numel()
            self.multi_index.append(index)
        self.row_admitted = self.context.admitted if with_features else None
        # One flag shared with the hook: set once the gradients went to their owners.
        self._sent = [False]
        if store.overlap:
            # The rows are the graph's first inputs: their gradient is ready near the end
            # of the backward, before DeepSpeed's all-reduce, which the exchange overlaps.
            # The hook must not hold `self` (or the rows): rows -> hook -> self -> rows
            # is a cycle that only the cyclic collector frees, which kept ~110 MB of
            # past batches alive per rank.
            self.rows.register_hook(_gradient_sender(store, self.context, self._sent))
        self.row_feature = (
            torch.searchsorted(offsets[1:], self.context.unique_ids, right=True)
            if with_features
            else None
        )

    @staticmethod
    def _global_rows(
        batch: Batch, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """(B, Fs) single-valued global rows, each multi-hot feature's (B, L) (-1 where
        padded) and its valid ones."""
        num_single = batch.sparse.shape[1]
        single = batch.sparse + offsets[:num_single]  # (B, Fs) global rows
        multi = [
            torch.where(ids >= 0, ids + offsets[num_single + i], ids)
            for i, ids in enumerate(batch.multi_hot)
        ]
        return single, multi, [ids[ids >= 0] for ids in multi]

    @classmethod
    def distribute_ahead(
        cls, batch: Batch, offsets: torch.Tensor, store: ShardedEmbedding
    ) -> InputDist:
        """Send `batch`'s ids to their owners now, for its `SparseInputs` later."""
        single, _, valid = cls._global_rows(batch, offsets)
        return store.distribute(torch.cat([single.flatten(), *valid]))

    def send_gradients(self, store: ShardedEmbedding) -> None:
        """Send the rows' gradients unless the hook did (None reached them: zeros)."""
        if not self._sent[0]:
            store.accumulate_gradients(self.rows.grad, self.context)
            self._sent[0] = True


def _gradient_sender(
    store: ShardedEmbedding, context: LookupContext, sent: list[bool]
) -> Callable[[torch.Tensor], None]:
    """The rows' gradient hook: send it to the owners as soon as autograd has it."""

    def send(grad: torch.Tensor) -> None:
        store.accumulate_gradients(grad, context)
        sent[0] = True

    return send


def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over tasks of the mean binary cross-entropy, in fp32.

    Args:
        logits: (B, T) in any float dtype.
        labels: (B, T) float32 0/1.
    """
    return (
        F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")
        .mean(dim=0)
        .sum()
    )


@dataclass
class _Counters:
    """Where a rank's run stands, and what its progress records have summed so far.

    Attributes:
        step: Optimizer steps done.
        micro_done: Micro batches done.
        window: Since the last record: summed loss, micro steps, then seconds per phase.
        totals: Milliseconds per step by phase, summed over the records.
        final_loss: The last record's mean loss.
        rows_updated: Embedding rows this rank's sparse optimizer updated.
        resumed_from_step: The checkpoint's step, None for a fresh start.
        resumed_from_world_size: The world size that wrote that checkpoint.
    """

    step: int = 0
    micro_done: int = 0
    window: torch.Tensor = field(
        default_factory=lambda: torch.zeros(2 + len(PHASES), dtype=torch.float64)
    )
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    final_loss: float = float("nan")
    rows_updated: int = 0
    resumed_from_step: int | None = None
    resumed_from_world_size: int | None = None


@dataclass
class _Rank:
    """What one rank trains with, handed to the steps of `run`.

    Attributes:
        spec: The parsed launch.json.
        config: Its train config.
        engine: The DeepSpeed engine of the dense part.
        store: This rank's embedding shard (sharded embeddings), else None.
        reader: This rank's train split reader.
        resume_store: The resume checkpoints (train.checkpoint_every or
            checkpoint_every_s), else None.
        preemption: SIGTERM and timer agreement (with resume checkpoints), else None.
        chain: Where the differential resume checkpoints stand (sharded embeddings
            with resume checkpoints), else None.
        saver: The background writer of asynchronous deltas (train.checkpoint_async),
            else None.
        counters: Where the run stands.
        checkpoints: This attempt's resume checkpoints by kind ("base", "delta",
            "whole"): how many, and the longest and total seconds the rank paused for
            them.
    """

    spec: dict[str, Any]
    config: TrainConfig
    engine: deepspeed.DeepSpeedEngine
    store: ShardedEmbedding | None
    reader: ShardReader
    resume_store: CheckpointStore | None
    preemption: Preemption | None
    chain: CheckpointChain | None = None
    saver: CheckpointWriter | None = None
    counters: _Counters = field(default_factory=_Counters)
    checkpoints: dict[str, dict[str, float]] = field(default_factory=dict)

    def checkpoint_summary(self) -> dict[str, Any]:
        """What `train_summary.json` says of this attempt's resume checkpoints."""
        summary: dict[str, Any] = {
            kind: {**figures, "stall_s_max": round(figures["stall_s_max"], 4)}
            for kind, figures in self.checkpoints.items()
        }
        if self.saver is not None:
            summary["waited_for_previous"] = self.saver.waits
            summary["wait_s"] = round(self.saver.wait_s, 4)
            summary["background_write_s_max"] = round(self.saver.write_s_max, 4)
        return summary


class _StartupClock:
    """Seconds of a rank's start-up by phase, from the process start (Linux's /proc).

    `laps["imports"]` is the process start to the clock's creation (interpreter, torch,
    DeepSpeed); each `lap(name)` adds the seconds since the previous one.
    """

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.laps: dict[str, float] = {"imports": round(_process_age_s(), 3)}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


def _process_age_s() -> float:
    """Seconds since this process started (0.0 where /proc is not there)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime in ticks
    return max(0.0, uptime - started)


def run(spec: dict[str, Any]) -> None:
    """Train one rank according to a launch spec.

    Args:
        spec: The parsed launch.json.

    Raises:
        ConfigError: The launcher started a different number of ranks than configured,
            or the spec's artifact root is remote and no run key is set.
        Preempted: SIGTERM arrived; the resume checkpoint of that step is committed.
    """
    # Before anything is read back: without the key nothing read would be verified.
    require_rank_key(spec)
    startup = _StartupClock()
    config = TrainConfig.model_validate(spec["train_config"])
    out_dir = Path(spec["out_dir"])
    rank, world_size = _start_rank(spec, config)
    startup.lap("rendezvous")
    module, store = _build_modules(spec, config, rank, world_size)
    if spec.get("warm_start") is not None and store is not None:
        # A retry's resume checkpoint (loaded below) replaces all of this.
        warm_start(spec["warm_start"], config, module, store, rank, world_size)
    startup.lap("table_init")
    engine, resume_store, resume_point, warm_note = _initialize_engine(spec, config, module)
    preemption = (
        Preemption(engine.device, config.checkpoint_every_s) if resume_store is not None else None
    )
    startup.lap("engine")
    reader = _open_reader(spec, config, rank, world_size)
    startup.lap("reader")
    on_rank0 = rank == 0
    writer = open_tensorboard(
        out_dir / TENSORBOARD_DIR if config.tensorboard and on_rank0 else None
    )
    log_file = (out_dir / TRAIN_LOG_FILE).open("a") if on_rank0 else None
    chain, saver = None, None
    if resume_store is not None and store is not None:
        chain = CheckpointChain(config.checkpoint_max_deltas, config.checkpoint_rebase_share, [])
        saver = CheckpointWriter(log=print) if config.checkpoint_async else None
    state = _Rank(spec, config, engine, store, reader, resume_store, preemption, chain, saver)
    counters = state.counters
    if resume_point is not None:
        skip = frozenset(spec.get("chaos", {}).get("skip_restore", []))
        table_rows = sum(spec["model_config"]["table_sizes"])
        resumed = load_resume_point(
            resume_point, engine, store, reader, table_rows, skip, config.grad_accum_steps
        )
        counters.step, counters.micro_done = resumed["step"], resumed["micro_done"]
        counters.resumed_from_step = resumed["step"]
        counters.resumed_from_world_size = int(resume_point.meta["world_size"])
        if chain is not None:
            chain.resumed(resume_point)
    startup.lap("resume")
    resumed_micro = counters.micro_done  # what this attempt's wire bytes are per
    engine.train()
    started = time.monotonic()
    try:
        _train_steps(state, log_file, writer)
        if saver is not None:
            saver.wait()  # the last asynchronous checkpoint is committed
    finally:
        reader.close()
    seconds = time.monotonic() - started
    wire = _wire_bytes_per_sample(engine, store, config, counters, resumed_micro, world_size)
    _save_final_checkpoint(spec, engine, store, reader, out_dir, rank, world_size)
    exchange = NodeExchange.from_spec(spec.get("node_exchange"))
    # Nodes without a shared disk: every node's final checkpoint gets every rank's part.
    exchange.share(out_dir / CHECKPOINT_DIR / CHECKPOINT_TAG, "final")
    table_sizes = list(spec["model_config"]["table_sizes"])
    _write_weights(
        engine,
        out_dir / CHECKPOINT_DIR / CHECKPOINT_TAG,
        out_dir / WEIGHTS_FILE,
        config,
        table_sizes if store is not None else None,
        exchange.output_writers(rank, world_size),
        world_size,
        spec.get("chaos", {}).get("consolidation_chunk_rows"),
    )
    if on_rank0:
        warm = spec.get("warm_start")
        _write_summary(
            out_dir, config, counters, reader, seconds, world_size, startup.laps, wire,
            state.checkpoint_summary() if resume_store is not None else None,
            None if warm is None else {
                "parent_world_size": warm["world_size"],
                "reset_rows": sum(len(rows) for rows in warm["reset_rows"]),
                "new_rows": sum(spec["model_config"]["table_sizes"]) - sum(warm["old_sizes"]),
                # None: a retry resumed from this run's own checkpoint instead.
                "dense_optimizer": warm_note,
                "table_rows": _table_rows_note(warm, config),
            },
        )  # fmt: skip
    if log_file is not None:
        log_file.close()
    if writer is not None:
        writer.close()
    dist.barrier()  # rank 0's files are written before any rank reports success


def _start_rank(spec: dict[str, Any], config: TrainConfig) -> tuple[int, int]:
    """Seed this process, set its threads and join the process group; returns (rank,
    world_size).

    Raises:
        ConfigError: The launched world size is not train.world_size.
    """
    seed_everything(config.seed)
    if spec.get("intra_op_threads"):
        # The rank's share of the machine's cores (train.threads_per_rank): torch's
        # default, every core, makes ranks that share a machine oversubscribe it.
        torch.set_num_threads(int(spec["intra_op_threads"]))
    deepspeed.init_distributed(dist_backend=spec.get("backend", "gloo"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != config.world_size:
        raise ConfigError(
            f"train.world_size={config.world_size} but the launcher started {world_size} ranks"
        )
    return rank, world_size


def _build_modules(
    spec: dict[str, Any], config: TrainConfig, rank: int, world_size: int
) -> tuple[torch.nn.Module, ShardedEmbedding | None]:
    """The DeepSpeed module and, with sharded embeddings, this rank's table shard.

    Sharded: the `CTRArch` (the table lives outside DeepSpeed). Dense: the whole
    `CTRModel`, its table initialised as the shards would be.
    """
    model_config = spec["model_config"]
    table_sizes = list(model_config["table_sizes"])
    if config.embeddings != "sharded":
        module = build_model(model_config)
        module.embedding.weight.data = init_rows(table_sizes, config.embedding_dim, config.seed)
        return module, None
    module = build_arch(model_config)
    # On GPUs the table's all-to-alls use a gloo group, since the rows stay in host
    # memory (the parameter-server layout). Overlapped, they need a group of their own
    # anyway: the dense all-reduce must not queue behind the gradient exchange.
    group = None
    separate = spec.get("backend", "gloo") != "gloo" or config.overlap_exchange
    if separate and world_size > 1:
        group = torch.distributed.new_group(backend="gloo")
    store = ShardedEmbedding(
        table_sizes,
        config.embedding_dim,
        config.sparse_optimizer,
        config.sparse_lr,
        config.admission_min_count,
        config.seed,
        rank,
        world_size,
        group,
        config.sparse_weight_decay,
        # train.grad_clip bounds each row's gradient too; DeepSpeed clips the dense side.
        max_grad_norm=config.grad_clip,
        table_precision=config.table_precision,
        comm_precision=config.comm_precision,
        # One rank exchanges nothing: nothing to overlap.
        overlap=config.overlap_exchange and world_size > 1,
    )
    return module, store


def warm_start(
    warm: dict[str, Any],
    config: TrainConfig,
    module: torch.nn.Module,
    store: ShardedEmbedding,
    rank: int,
    world_size: int,
) -> None:
    """Every rank, before DeepSpeed wraps `module`: start from a parent model (train.init).

    The dense weights (`CTRArch`: MLPs, interaction, heads, default rows) are the parent's
    `model.safetensors` `arch.*` tensors, read lazily by name (never the table, never a
    pickle); DeepSpeed then partitions or casts them as this run's config says. The
    table's rows, their sparse optimizer state and admission counts come from the parent's
    final sparse shards (any world size) mapped through the id changes
    (`warm_start_state`): kept rows carry over, new and reused rows start afresh. The
    dense optimizer state follows when the engine is built (`_initialize_engine`); the
    learning-rate schedule and the step counters start fresh.

    Raises:
        CheckpointCorrupt: The parent's train output no longer matches its signed
            manifest (rank 0 checks every file before any rank reads one).
        SignatureError: That manifest does not verify; `MisplacedRecord`: it is another
            output's, copied over it since the task verified it.
    """
    parent_dir = Path(warm["weights"]).parent
    if rank == 0:
        # Bound to the train output of the fingerprint the directory is named by
        # (`stages/train/<fp>`, or its local mirror): a copy of another output is refused.
        bound = place("stage-output", stage="train", fingerprint=parent_dir.name)
        problem = check_output_dir(parent_dir, bound)
        if problem:
            raise CheckpointCorrupt(
                f"train.init: the parent's train output changed since it was verified: "
                f"{problem}; nothing of it was loaded. Rerun to verify it again"
            )
    dist.barrier()  # verified before any rank opens a file of it
    with safe_open(warm["weights"], framework="pt") as weights:
        dense = {
            name.removeprefix("arch."): weights.get_tensor(name)
            for name in weights.keys()  # noqa: SIM118 (safe_open has no __iter__)
            if name.startswith("arch.")
        }
    # The architecture was matched before launch (`warm_start_spec`); strict all the same.
    module.load_state_dict(dense)
    old_world = int(warm["world_size"])
    shards = [
        load_file(str(Path(warm["checkpoint"]) / sparse_file(r, old_world)))
        for r in range(old_world)
    ]
    state = warm_start_state(
        shards,
        list(warm["old_sizes"]),
        list(store.table_sizes),
        [list(rows) for rows in warm["reset_rows"]],
        config.embedding_dim,
        config.seed,
        rank,
        world_size,
        config.table_precision,
    )
    store.load_state_dict(state)


def _initialize_engine(
    spec: dict[str, Any], config: TrainConfig, module: torch.nn.Module
) -> tuple[deepspeed.DeepSpeedEngine, CheckpointStore | None, ResumePoint | None, str | None]:
    """The DeepSpeed engine, with resume checkpoints on the resume store and point, and
    how a warm start's dense optimizer state was treated (None: no warm start).

    A checkpoint of another world size under ZeRO 1-3 loads as DeepSpeed's universal
    checkpoint, which the engine must be told of when it is built. A warm start with no
    resume point loads the parent's dense optimizer state (`_warm_dense`).
    """
    ds_config = spec["ds_config"]
    resume_store, resume_point = None, None
    if config.saves_resume_checkpoints():
        resume_store = CheckpointStore(
            Path(spec["checkpoint_root"]), keep=config.keep_checkpoints, log=print
        )
        resume_point = find_resume_point(
            resume_store,
            spec["config_fingerprint"],
            config.zero_stage,
            exchange=NodeExchange.from_spec(spec.get("node_exchange")),
        )
        if resume_point is not None and resume_point.universal:
            ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
    warm = spec.get("warm_start") if resume_point is None else None
    dense, note = _warm_dense(spec, config, warm) if warm is not None else (None, None)
    if dense is not None and dense[2]:
        ds_config = {**ds_config, "checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(), config=ds_config
    )
    if dense is not None:
        # DeepSpeed's loader unpickles: the parent's train output was verified against
        # its signed manifest by the task and again by rank 0 (`warm_start`). Its weights
        # are the parent's, already loaded; the schedule and step counters stay fresh.
        engine.load_checkpoint(
            dense[0], tag=dense[1], load_optimizer_states=True, load_lr_scheduler_states=False
        )
    return engine, resume_store, resume_point, note


def _warm_dense(
    spec: dict[str, Any], config: TrainConfig, warm: dict[str, Any]
) -> tuple[tuple[str, str, bool] | None, str]:
    """Where the parent's dense optimizer state loads from: (dir, tag, universal), or
    None when it cannot carry over, with the reason as the summary's note.

    The same ZeRO stage and precision load the parent's checkpoint as DeepSpeed wrote
    it; on another world size under ZeRO 1-3 rank 0 first converts it into DeepSpeed's
    universal format under this run's checkpoint root (the parent's is never written).
    """
    if (warm["zero_stage"], warm["precision"]) != (config.zero_stage, config.precision):
        return None, (
            f"fresh: the parent trained with zero_stage {warm['zero_stage']} and "
            f"{warm['precision']}, this run {config.zero_stage} and {config.precision}"
        )
    parent = Path(warm["checkpoint"])
    if warm["world_size"] == config.world_size or config.zero_stage == 0:
        return (str(parent.parent), parent.name, False), "carried"
    universal = Path(spec["checkpoint_root"]) / "warm-start-universal"
    if dist.get_rank() == 0 and not universal.is_dir():
        convert_to_universal(parent, universal)
    dist.barrier()  # the conversion is published
    return (str(universal), DENSE_TAG, True), "carried (universal)"


def _open_reader(
    spec: dict[str, Any], config: TrainConfig, rank: int, world_size: int
) -> ShardReader:
    """This rank's reader of the train split (its streams, prefetching in the background)."""
    shards_dir = Path(spec["shards_dir"])
    return ShardReader(
        shards_dir,
        load_dataset_meta(shards_dir),
        TRAIN_SPLIT,
        rank,
        world_size,
        config.batch_size,
        config.num_data_streams(),
        tasks=spec["model_config"]["tasks"],
        prefetch=config.prefetch_batches,
        grad_accum_steps=config.grad_accum_steps,
    )


def _train_steps(state: _Rank, log_file: IO[str] | None, writer: Any) -> None:
    """Every rank: the micro batches up to total_steps, with checkpoints and progress.

    Args:
        state: The rank's engine, embedding shard, reader and counters.
        log_file: Rank 0's open `train_log.jsonl`, else None.
        writer: Rank 0's TensorBoard writer, else None.

    Raises:
        Preempted: SIGTERM arrived; the resume checkpoint of that step is committed.
    """
    spec, config, engine, store = state.spec, state.config, state.engine, state.store
    counters = state.counters
    total_steps = int(spec["total_steps"])
    micro_total = total_steps * config.grad_accum_steps
    # Half-precision engines hold half weights: the dense input must match them.
    input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        config.precision, torch.float32
    )
    offsets = table_offsets(list(spec["model_config"]["table_sizes"]))
    with_features = config.admission_min_count >= 2
    window_started = time.monotonic()
    batches = iter(state.reader)
    # The next micro batch and its ids, sent while this one computes (overlap_exchange).
    ahead: tuple[Batch, InputDist] | None = None

    def distribute_next() -> None:
        nonlocal ahead
        if store is not None and store.overlap and counters.micro_done + 1 < micro_total:
            upcoming = next(batches)
            ahead = (upcoming, SparseInputs.distribute_ahead(upcoming, offsets, store))

    while counters.micro_done < micro_total:
        t0 = time.perf_counter()
        batch, sent = ahead if ahead is not None else (next(batches), None)
        ahead = None
        t1 = time.perf_counter()
        loss, inputs, t2, t3 = _forward_backward(
            engine, store, batch, input_dtype, offsets, with_features, sent, distribute_next
        )
        _optimizer_step(engine, store, inputs, config, counters)
        t4 = time.perf_counter()
        counters.window += torch.tensor(
            [float(loss.detach()), 1.0, t1 - t0, t2 - t1, t3 - t2, t4 - t3], dtype=torch.float64
        )
        counters.micro_done += 1
        if counters.micro_done % config.grad_accum_steps:
            continue
        counters.step += 1
        _checkpoint_step(state, held=0 if ahead is None else 1)
        if counters.step % config.log_every and counters.step != total_steps:
            continue
        record, now = _progress_record(state, window_started)
        if log_file is not None:
            write_progress(log_file, record)
        if writer is not None:
            write_scalars(writer, record)
        counters.window.zero_()
        window_started = now


def _forward_backward(
    engine: deepspeed.DeepSpeedEngine,
    store: ShardedEmbedding | None,
    batch: Batch,
    input_dtype: torch.dtype,
    offsets: torch.Tensor,
    with_features: bool,
    sent: InputDist | None = None,
    after_lookup: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, SparseInputs | None, float, float]:
    """One micro batch's loss and backward.

    With sharded embeddings the ids are first looked up (both all-to-alls, or only the
    rows' when `sent` holds the ids sent ahead); their `SparseInputs` carry the rows'
    gradients to `_optimizer_step`. `after_lookup` runs between the lookup and the
    forward: where the next batch's ids go out, to travel while this batch computes.

    Returns:
        (loss, the sparse inputs or None, perf_counter at the end of the lookup, at the
        end of the backward).
    """
    dense = batch.dense.to(engine.device, dtype=input_dtype)
    labels = batch.labels.to(engine.device)
    if store is not None:
        inputs = SparseInputs(batch, offsets, store, with_features, sent)
        if after_lookup is not None:
            after_lookup()
        device = engine.device
        t2 = time.perf_counter()
        logits = engine(
            inputs.rows.to(device),
            inputs.sparse_index.to(device),
            dense,
            [index.to(device) for index in inputs.multi_index],
            None if inputs.row_admitted is None else inputs.row_admitted.to(device),
            None if inputs.row_feature is None else inputs.row_feature.to(device),
        )  # (B, T)
    else:
        inputs = None
        t2 = time.perf_counter()
        multi_hot = [ids.to(engine.device) for ids in batch.multi_hot]
        logits = engine(batch.sparse.to(engine.device), dense, *multi_hot)
    loss = task_loss(logits, labels)
    engine.backward(loss)
    return loss, inputs, t2, time.perf_counter()


def _optimizer_step(
    engine: deepspeed.DeepSpeedEngine,
    store: ShardedEmbedding | None,
    inputs: SparseInputs | None,
    config: TrainConfig,
    counters: _Counters,
) -> None:
    """The dense step (DeepSpeed applies it at accumulation boundaries) and the sparse one."""
    boundary = engine.is_gradient_accumulation_boundary()
    scale = _loss_scale(engine, config)  # before step(): the step may change it
    if store is not None and inputs is not None:
        inputs.send_gradients(store)
    engine.step()
    if store is not None and boundary:
        if engine.was_step_applied():
            counters.rows_updated += store.step(grad_scale=scale)
        else:  # fp16 overflow: DeepSpeed skipped the dense step; skip ours too
            store.discard_gradients()


def _checkpoint_step(state: _Rank, held: int = 0) -> None:
    """Every rank, after a step: save a resume checkpoint when one is due or SIGTERM came.

    `held`: batches taken from the reader whose steps have not run (the next one, its
    ids sent ahead); the checkpoint's reader position leaves them unconsumed.

    One is due every train.checkpoint_every steps and once train.checkpoint_every_s
    seconds have passed on rank 0 since the start or the last save.

    Raises:
        Preempted: SIGTERM arrived (after the checkpoint is committed).
    """
    spec, step, resume_store = state.spec, state.counters.step, state.resume_store
    if resume_store is None or state.preemption is None:
        return
    decision = state.preemption.agreed()  # the same on every rank
    every, stop = state.config.checkpoint_every, decision.stop
    if not ((every and step % every == 0) or decision.timed or stop):
        return
    if step >= int(spec["total_steps"]):
        return  # the final state is saved anyway
    started = time.perf_counter()
    if stop and state.saver is not None:
        state.saver.wait()  # this save is written in the foreground, after that one
    kind = save_resume_checkpoint(
        resume_store,
        state.engine,
        state.store,
        _HeldBack(state.reader, held),
        {"step": step, "micro_done": state.counters.micro_done},
        spec["config_fingerprint"],
        spec.get("chaos", {}).get("checkpoint_fault", ""),
        NodeExchange.from_spec(spec.get("node_exchange")),
        # What a resume on another world size fits its batch to (`resume_layout`).
        extra_meta=state.config.checkpoint_layout(),
        chain=state.chain,
        # A save that stops the run is committed before it exits.
        writer=None if stop else state.saver,
    )
    stall = time.perf_counter() - started
    figures = state.checkpoints.setdefault(
        kind, {"count": 0, "stall_s_max": 0.0, "stall_s_total": 0.0}
    )
    figures["count"] += 1
    figures["stall_s_max"] = max(figures["stall_s_max"], stall)
    figures["stall_s_total"] += stall
    state.preemption.saved()
    if stop:
        raise Preempted(
            f"stopped by SIGTERM after step {step}; its resume checkpoint is "
            f"committed under {resume_store.root}"
        )


@dataclass(frozen=True)
class _HeldBack:
    """The reader as a resume checkpoint sees it: `held` taken batches not yet trained."""

    reader: ShardReader
    held: int

    def position(self) -> dict[str, int]:
        return self.reader.position(held=self.held)


def _progress_record(state: _Rank, window_started: float) -> tuple[dict[str, Any], float]:
    """Every rank, at the same step: the record of the steps since the last one.

    Sums the window over the ranks (collectives), updates the counters' final loss and
    phase totals.

    Returns:
        (the record, time.monotonic() after the collectives).
    """
    config, counters = state.config, state.counters
    world_size = dist.get_world_size()
    samples_per_micro = config.batch_size * world_size
    summed = counters.window.clone()
    dist.all_reduce(summed)
    rss_mb = gather_rss_mb(dist.get_rank(), world_size)
    now = time.monotonic()
    micro = float(summed[1]) / world_size
    counters.final_loss = float(summed[0] / summed[1])
    phase_ms = {
        name: 1000.0 * float(summed[2 + i]) / float(summed[1]) * config.grad_accum_steps
        for i, name in enumerate(PHASES)
    }
    for name in PHASES:
        counters.totals[name] += phase_ms[name] * micro / config.grad_accum_steps
    record = {
        "step": counters.step,
        "total_steps": int(state.spec["total_steps"]),
        "loss": counters.final_loss,
        "samples_per_s": micro * samples_per_micro / max(now - window_started, 1e-9),
        "epoch": counters.micro_done / state.reader.steps_per_epoch,
        "step_ms": phase_ms,
        "rss_mb": rss_mb,
    }
    return record, now


def _wire_bytes_per_sample(
    engine: deepspeed.DeepSpeedEngine,
    store: ShardedEmbedding | None,
    config: TrainConfig,
    counters: _Counters,
    resumed_micro: int,
    world_size: int,
) -> dict[str, float]:
    """Every rank (a collective): the bytes all ranks sent each other per sample, by kind.

    ids, rows and row_grads are what the embedding shards counted as they sent them (this
    attempt's exchanges, in-training validation's lookups included). dense_allreduce is
    computed from sizes, not counted: DeepSpeed's collectives are not ours to wrap. A
    ring all-reduce (ZeRO 0) sends 2 (W - 1) / W of the gradient's bytes per rank and
    step, as do ZeRO 1-2's reduce-scatter plus parameter all-gather; ZeRO 3 gathers the
    parameters again for the backward, 3 (W - 1) / W. The bytes are those of DeepSpeed's
    communication dtype (fp32, or the half type of train.precision).
    """
    kinds = (*WIRE_KINDS, "dense_allreduce")
    sent = torch.zeros(len(kinds), dtype=torch.float64)
    if store is not None:
        sent[: len(WIRE_KINDS)] = torch.tensor([store.wire_bytes[k] for k in WIRE_KINDS])
    steps = (counters.micro_done - resumed_micro) // config.grad_accum_steps
    # ZeRO 3 keeps a partition on the rank; ds_numel is the whole parameter.
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    dtype_bytes = torch.empty(0, dtype=engine.communication_data_type).element_size()
    passes = 3 if engine.zero_optimization_stage() == 3 else 2
    sent[-1] = steps * passes * (world_size - 1) / world_size * numel * dtype_bytes
    dist.all_reduce(sent)
    samples = max(1, (counters.micro_done - resumed_micro) * config.batch_size * world_size)
    per_sample = {kind: float(total) / samples for kind, total in zip(kinds, sent, strict=True)}
    return {"total": sum(per_sample.values()), **per_sample}


def _save_final_checkpoint(
    spec: dict[str, Any],
    engine: deepspeed.DeepSpeedEngine,
    store: ShardedEmbedding | None,
    reader: ShardReader,
    out_dir: Path,
    rank: int,
    world_size: int,
) -> None:
    """Every rank: its part of `checkpoints/final/` (dense part and embedding shard)."""
    checkpoint_dir = out_dir / CHECKPOINT_DIR
    engine.save_checkpoint(
        str(checkpoint_dir),
        tag=CHECKPOINT_TAG,
        client_state={
            "train_config": spec["train_config"],
            "model_config": spec["model_config"],
            "reader_position": reader.position(),
        },
    )
    if store is not None:
        save_file(
            {name: t.contiguous() for name, t in store.state_dict().items()},
            str(checkpoint_dir / CHECKPOINT_TAG / sparse_file(rank, world_size)),
        )
    dist.barrier()  # every rank's checkpoint part is on disk


def _write_summary(
    out_dir: Path,
    config: TrainConfig,
    counters: _Counters,
    reader: ShardReader,
    seconds: float,
    world_size: int,
    startup_s: dict[str, float],
    wire_bytes_per_sample: dict[str, float],
    checkpoints: dict[str, Any] | None,
    warm_start: dict[str, Any] | None = None,
) -> None:
    """Rank 0: `train_summary.json` (`checkpoints`: this attempt's resume checkpoints,
    `_Rank.checkpoint_summary`; `warm_start`: what a train.init run started from)."""
    samples = counters.micro_done * config.batch_size * world_size
    summary = {
        "final_loss": counters.final_loss,
        "steps": counters.step,
        "micro_steps": counters.micro_done,
        "samples": samples,
        "samples_per_s": samples / max(seconds, 1e-9),
        "seconds": seconds,
        "world_size": world_size,
        "embeddings": config.embeddings,
        **({"table_precision": config.table_precision} if config.embeddings == "sharded" else {}),
        **({"comm_precision": config.comm_precision} if config.embeddings == "sharded" else {}),
        "wire_bytes_per_sample": wire_bytes_per_sample,
        "step_ms": {name: counters.totals[name] / max(counters.step, 1) for name in PHASES},
        "sparse_rows_updated_rank0": counters.rows_updated,
        "peak_rss_mb_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "reader_position": reader.position(),
        "resumed_from_step": counters.resumed_from_step,
        "resumed_from_world_size": counters.resumed_from_world_size,
        **({"resume_checkpoints": checkpoints} if checkpoints is not None else {}),
        # Rank 0's seconds from its process start to the first step, by phase.
        "startup_s": startup_s,
        **({"warm_start": warm_start} if warm_start is not None else {}),
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _table_rows_note(warm: dict[str, Any], config: TrainConfig) -> str:
    """How a warm start took the parent's rows: carried, or converted to this precision."""
    parent = str(warm.get("table_precision", "fp32"))
    if parent == config.table_precision:
        return "carried"
    how = "exact" if config.table_precision == "fp32" else "rounded to nearest"
    return f"converted {parent} -> {config.table_precision} ({how})"


def _loss_scale(engine: deepspeed.DeepSpeedEngine, config: TrainConfig) -> float:
    """The factor engine.backward multiplied the loss by (fp16 loss scaling), else 1."""
    if config.precision != "fp16":
        return 1.0
    return float(engine.optimizer.loss_scale)


def _write_weights(
    engine: deepspeed.DeepSpeedEngine,
    tag_dir: Path,
    path: Path,
    config: TrainConfig,
    table_sizes: list[int] | None,
    writer: tuple[int, int] | None,
    world_size: int,
    chunk_rows: int | None = None,
) -> None:
    """Every rank: consolidate the checkpoint into `path` (`CTRModel` weights: the dense
    part fp32, the table at `train.table_precision`, `training.ctr.consolidate`).

    `writer` is (this rank's index, count) among the ranks that write `path` (every rank,
    or node 0's when nodes share no disk: `NodeExchange.output_writers`); None: this
    rank only keeps the others company in the collectives.

    Streams (`training.runtime.consolidate`): rank 0 plans the file and writes the dense
    tensors one at a time; with sharded embeddings (`table_sizes` given) every rank
    writes every W-th chunk of the table, read as row slices of the shard files, so no
    rank holds the table. Rows never admitted by frequency admission take their
    feature's default row, which is what training fed the model for them. `chunk_rows`
    (the chaos tests') overrides the 64 MiB chunks.
    """
    rank = dist.get_rank()
    dense: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    table_dtypes: dict[str, torch.dtype] = {}
    default_rows: torch.Tensor | None = None
    if table_sizes is not None:  # every rank: the same from the config
        table_shapes, table_dtypes = table_tensors(
            sum(table_sizes), config.embedding_dim, config.table_precision
        )
    if rank == 0:
        state = _fp32_state_dict(engine, tag_dir.parent, config.zero_stage)
        if table_sizes is not None:
            state = {f"arch.{name}": tensor for name, tensor in state.items()}
            shapes.update(table_shapes)
            rows = state["arch.default_rows"]  # (F, D), small
            default_rows = (rows if isinstance(rows, torch.Tensor) else rows.contiguous()).float()
        dense = state
        shapes.update({name: tuple(tensor.shape) for name, tensor in dense.items()})
    shared: list[Any] = [shapes, default_rows]
    dist.broadcast_object_list(shared, src=0)
    shapes, default_rows = shared
    layout = plan_layout(shapes, exact_dtypes=table_dtypes)
    if rank == 0:
        create_file(path, layout)
    dist.barrier()  # the file exists at its full size
    if writer is not None:
        with open(partial_path(path), "r+b") as file:
            if table_sizes is not None:
                shard_files = [tag_dir / sparse_file(r, world_size) for r in range(world_size)]
                chunks = table_chunks(
                    shard_files,
                    table_sizes,
                    default_rows,
                    config.admission_min_count,
                    *writer,
                    chunk_rows or chunk_rows_for(config.embedding_dim),
                )
                write_table(file, layout, chunks)
            if rank == 0:
                write_dense(file, layout, dense, CHUNK_BYTES // FP32_BYTES)
    dist.barrier()  # every rank's ranges are written
    if rank == 0:
        finish_file(path, layout)


def _fp32_state_dict(
    engine: deepspeed.DeepSpeedEngine, checkpoint_dir: Path, zero_stage: int
) -> dict[str, Any]:
    """The model's fp32 weights: the optimizer's fp32 master copies where there are any.

    ZeRO 1-2 consolidate the ranks' master partitions from the checkpoint; ZeRO 3's are
    returned lazily (DeepSpeed's `GatheredTensor`, streamed by `training.runtime.consolidate`
    from the memory-mapped partitions without being assembled). Stage 0
    reads the module; with bf16 its weights are bf16, so they are replaced by the fp32
    masters of DeepSpeed's bf16 wrapper (FP16_UnfusedOptimizer: `fp16_groups` holds the
    module's parameters, `fp32_groups` their masters, in the same order). Should a
    DeepSpeed version hold them elsewhere, the bf16 weights are saved upcast.
    """
    if zero_stage > 0:
        return get_fp32_state_dict_from_zero_checkpoint(
            str(checkpoint_dir), tag=CHECKPOINT_TAG, lazy_mode=zero_stage == 3
        )
    state = {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}
    low_groups = getattr(engine.optimizer, "fp16_groups", None)
    master_groups = getattr(engine.optimizer, "fp32_groups", None)
    if low_groups is None or master_groups is None:
        return state
    names = {id(param): name for name, param in engine.module.named_parameters()}
    for low_group, master_group in zip(low_groups, master_groups, strict=True):
        for low, master in zip(low_group, master_group, strict=True):
            state[names[id(low)]] = master.detach().cpu()
    return state


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.ctr.worker LAUNCH.json` (other launcher args ignored)."""
    return rank_main("training.ctr.worker", lambda path: run(json.loads(path.read_text())), argv)


if __name__ == "__main__":
    sys.exit(main())
