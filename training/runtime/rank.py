"""What every DeepSpeed rank does whatever it trains: the entry point, seeding and RNG
state, preemption on SIGTERM, crash-safe resume checkpoints, and progress records
(`train_log.jsonl`, `RECFORGE_PROGRESS` lines, TensorBoard scalars).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from safetensors.torch import save_file

from artifacts.checkpoints import (
    CHAIN,
    FAULT_POINTS,
    MANIFEST,
    CheckpointCorrupt,
    CheckpointStore,
    files_digest,
)
from artifacts.durable import fsync_tree
from artifacts.errors import ConfigError
from artifacts.locations import is_remote
from artifacts.signing import require_key
from training.runtime.exchange import NodeExchange
from training.runtime.launcher import (
    CHAOS_CHECKPOINT_FAULT,
    ERROR_PREFIX,
    PROGRESS_PREFIX,
)


class RankShard(Protocol):
    """A rank's own part of a sharded parameter (the CTR embedding rows and their state)."""

    num_rows: int

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def dirty_rows(self) -> int: ...

    def take_delta(self, whole: bool = False) -> dict[str, torch.Tensor]: ...

    def mark_clean(self) -> None: ...


@dataclass
class CheckpointChain:
    """Where a run's differential resume checkpoints stand; the same on every rank.

    A checkpoint is a base (every row of the sharded table) or a delta (the rows that
    changed since the checkpoint before it, keyed by global row, so a chain resumes on
    any world size). The dense part, RNG states and reader position are whole in both.
    A base is written first, after `max_deltas` deltas, and when the chain's deltas
    would hold more rows than `rebase_share` of the table.

    Attributes:
        max_deltas: train.checkpoint_max_deltas (0: every checkpoint is a base).
        rebase_share: train.checkpoint_rebase_share.
        members: The chain so far, base first: {"step", "files_sha256", "rows" (a
            delta's rows, 0 for the base), "world_size"}; empty before the first base.
    """

    max_deltas: int
    rebase_share: float
    members: list[dict[str, Any]]

    def next_is_delta(self, dirty_rows: int, num_rows: int) -> bool:
        """Whether the next checkpoint, with `dirty_rows` changed rows in all, is a delta."""
        if not self.members or len(self.members) > self.max_deltas:
            return False
        chain_rows = sum(int(m["rows"]) for m in self.members) + dirty_rows
        return chain_rows <= self.rebase_share * num_rows

    def committed(self, step: int, path: Path, delta_rows: int | None, world_size: int) -> None:
        """Record the checkpoint committed at `path` (`delta_rows` None: a base).

        Only rank 0's record decides (`save_resume_checkpoint`), and only it writes the
        chain into a manifest (`files_digest` of each member's, read from rank 0's own
        committed copy).
        """
        manifest = json.loads((path / MANIFEST).read_text())
        entry = {
            "step": step,
            "files_sha256": files_digest(manifest),
            "rows": delta_rows or 0,
            "world_size": world_size,
        }
        self.members = [entry] if delta_rows is None else [*self.members, entry]

    def resumed(self, point: ResumePoint) -> None:
        """Continue the chain of the checkpoint a run resumed from (a base or a delta)."""
        meta = point.meta
        self.members = [*meta.get(CHAIN, [])]
        self.committed(
            int(meta["step"]),
            point.path,
            int(meta["delta_rows"]) if self.members else None,
            int(meta["world_size"]),
        )


class ResumableReader(Protocol):
    """A data reader that can report where it is, for a resume checkpoint."""

    def position(self) -> dict[str, Any]: ...


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch; every rank uses the same seed, so the same init."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# DeepSpeed's tag inside a resume checkpoint (the store names the checkpoint by step).
DENSE_TAG = "dense"


def rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch random states, as tensors and plain values.

    A resume checkpoint's `rank-RRRRR.pt` holds it and comes back from shared storage, so
    it must load with `torch.load(..., weights_only=True)` (no pickle of numpy arrays or
    other objects): the Mersenne Twister words are int64 tensors, the rest ints, floats,
    strings and None.

    Returns:
        {"python": {"version", "words": (625,) int64, "gauss_next"}, "numpy":
        {"bit_generator", "key": (624,) int64, "pos", "has_gauss", "gauss"}, "torch":
        uint8 tensor}.
    """
    version, words, gauss_next = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": {
            "version": version,
            "words": torch.tensor(words, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`, bit for bit."""
    python, numpy_state = state["python"], state["numpy"]
    words = tuple(int(word) for word in python["words"].tolist())
    random.setstate((int(python["version"]), words, python["gauss_next"]))
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {
                "key": numpy_state["key"].numpy().astype(np.uint32),
                "pos": int(numpy_state["pos"]),
            },
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"])


MID_FILE = "mid-file"


def chaos_fault(step: int, setting: str) -> Callable[[str], None] | None:
    """Rank 0's fault hook for the checkpoint of `step` per `CHAOS_CHECKPOINT_FAULT`.

    Args:
        step: The step being saved.
        setting: "POINT@STEP" (see `CHAOS_CHECKPOINT_FAULT`), or "" for none.
    """
    if not setting or dist.get_rank() != 0:
        return None
    point, _, at = setting.partition("@")
    if point not in (MID_FILE, *FAULT_POINTS) or not at.isdigit():
        raise ConfigError(
            f"{CHAOS_CHECKPOINT_FAULT}={setting!r}: expected POINT@STEP with POINT one of "
            f"{[MID_FILE, *FAULT_POINTS]}"
        )
    if int(at) != step:
        return None

    def die(name: str) -> None:
        if name == point:
            # The whole launch, as a node failure would: the peers must not commit.
            os.killpg(os.getpgrp(), signal.SIGKILL)

    return die


@dataclass(frozen=True)
class StepDecision:
    """What every rank agreed on after an optimizer step.

    Attributes:
        stop: Some rank was sent SIGTERM: checkpoint this step and stop.
        timed: Rank 0's checkpoint interval (train.checkpoint_every_s) has elapsed.
    """

    stop: bool
    timed: bool


class Preemption:
    """SIGTERM as a request to checkpoint and stop at the next optimizer step, and the
    time trigger of resume checkpoints (train.checkpoint_every_s).

    Both are decided by one all-reduce per step, so every rank takes the same decision
    at the same step, whatever its own clock says: the time trigger is rank 0's.
    Installing it replaces the default SIGTERM action (exit at once) of this process.

    Args:
        device: Where the all-reduced flags live (the engine's device).
        checkpoint_every_s: Seconds between timed checkpoints; 0: none.
        clock: Rank 0's seconds (tests pass a fake one).
    """

    def __init__(
        self,
        device: torch.device,
        checkpoint_every_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requested = False
        self._device = device
        self._every_s = checkpoint_every_s
        self._clock = clock
        # Only rank 0's clock counts: the ranks' clocks differ.
        self._keeps_time = checkpoint_every_s > 0 and torch.distributed.get_rank() == 0
        self._last_saved = clock()
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self) -> StepDecision:
        """Every rank, at the same step: whether any rank has been asked to stop, and
        whether rank 0's checkpoint interval has elapsed (one all-reduce of both)."""
        due = self._keeps_time and self._clock() - self._last_saved >= self._every_s
        flags = torch.tensor([float(self.requested), float(due)], device=self._device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        stop, timed = flags.tolist()
        return StepDecision(stop=bool(stop), timed=bool(timed))

    def saved(self) -> None:
        """Every rank, after committing a resume checkpoint: the interval starts again."""
        self._last_saved = self._clock()


def rank_state_file(rank: int) -> str:
    """File of one rank's RNG states and reader position in a resume checkpoint."""
    return f"rank-{rank:05d}.pt"


def save_resume_checkpoint(
    store: CheckpointStore,
    engine: deepspeed.DeepSpeedEngine,
    sparse: RankShard | None,
    reader: ResumableReader | None,
    counters: dict[str, int],
    fingerprint: str,
    fault_setting: str = "",
    exchange: NodeExchange | None = None,
    extra_meta: dict[str, Any] | None = None,
    chain: CheckpointChain | None = None,
    writer: CheckpointWriter | None = None,
) -> str:
    """Every rank: write its part of a crash-safe checkpoint; rank 0 commits it.

    Layout: DeepSpeed's checkpoint under tag `dense` (a pipeline engine's: its layer
    files), one embedding shard (with `sparse`) and one `rank-RRRRR.pt` (RNG states, and
    the reader position with `reader`) per rank, and the store's manifest
    (sha256 of every file) whose meta holds the step counters, the config fingerprint
    and `extra_meta` (e.g. the valid curve so far, and the steps a mirror must keep:
    "pinned"). Nothing is visible to a resume until rank 0's commit renames it.

    With `chain` (and `sparse`) the embedding shard may be a delta instead
    (`sparse_delta_file`: the rows changed since the previous checkpoint), when
    `CheckpointChain.next_is_delta` says so on rank 0; its meta then names the chain it
    builds on (`CHAIN`) and holds "delta_rows", the changed rows of all ranks.

    With `writer` too, a delta is saved asynchronously: the ranks write the dense part
    and copy the changed rows, RNG states and reader position at the step, then go on
    training while `writer`'s thread writes the files; rank 0's thread commits once every
    rank's are on disk (`done_marker`), the manifest last. A base, a run whose nodes
    share no disk, and a save without `chain` are written before this returns. At most
    one save is in flight: the next waits for it (`CheckpointWriter.wait`).

    Returns:
        "delta" or "base" (the kind of the embedding shard written), or "whole" (no
        `chain`).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    step = counters["step"]
    exchange = exchange or NodeExchange.from_spec(None)
    if writer is not None:
        writer.wait(due_at=step)  # before prepare clears what the last save staged
    delta_rows: int | None = None  # None: the shard is written whole
    if chain is not None and sparse is not None:
        # Rank 0 decides (its chain is the one its commits recorded); the others follow.
        dirty = torch.tensor([sparse.dirty_rows()], dtype=torch.int64)
        dist.all_reduce(dirty)
        decision = torch.tensor([int(chain.next_is_delta(int(dirty[0]), sparse.num_rows))])
        dist.broadcast(decision, src=0)
        delta_rows = int(dirty[0]) if int(decision[0]) else None
    if exchange.leads(rank):
        store.prepare(step)
    dist.barrier()  # the staging directory exists (and stale files are gone)
    staging = store.staging_dir(step)
    engine.save_checkpoint(str(staging), tag=DENSE_TAG)
    fault = chaos_fault(step, fault_setting)
    if fault is not None:
        store = store.with_fault(fault)
    rank_state = {"rng": rng_state()}
    if reader is not None:
        rank_state["reader"] = reader.position()
    meta = {**(extra_meta or {}), **counters, "world_size": world_size}
    if delta_rows is not None and chain is not None:
        meta = {**meta, CHAIN: chain.members, "delta_rows": delta_rows}
    meta["fingerprint"] = fingerprint
    kind = "whole" if chain is None or sparse is None else "base"
    if sparse is not None and delta_rows is not None:
        kind = "delta"
        shard = (sparse_delta_file(rank, world_size), sparse.take_delta())  # copies
    elif sparse is not None:
        shard = (sparse_file(rank, world_size), sparse.state_dict())
    else:
        shard = None

    def write() -> None:
        written = [staging / rank_state_file(rank)]
        if shard is not None:
            written.append(staging / shard[0])
            save_file({n: t.contiguous() for n, t in shard[1].items()}, str(written[-1]))
        if fault is not None:
            fault(MID_FILE)
        torch.save(rank_state, written[0])
        fsync_tree(written)  # rank 0's commit fsyncs the rest; this rank's may be elsewhere

    def commit() -> None:
        target = store.commit(step, meta)
        if chain is not None and sparse is not None:
            chain.committed(step, target, delta_rows, world_size)

    if kind == "delta" and writer is not None and not exchange.active:

        def write_and_commit() -> None:
            try:
                write()
            except BaseException:
                done_marker(staging, rank, failed=True).touch()  # rank 0 stops waiting
                raise
            done_marker(staging, rank).touch()
            if rank == 0:
                markers = [done_marker(staging, r) for r in range(world_size)]
                failed = [done_marker(staging, r, failed=True) for r in range(world_size)]
                writer.await_files(markers, failed)
                for marker in markers:
                    marker.unlink()
                commit()

        writer.start(step, write_and_commit)
        return kind
    write()
    if sparse is not None and chain is not None and kind == "base":
        sparse.mark_clean()  # this base holds every row
    # Every rank's part is on disk (and, on nodes that share no disk, on every node).
    exchange.share(staging, staging.name)
    if exchange.leads(rank):
        if rank == 0:
            commit()
        else:  # another node's copy: committed there for its own resume
            store.commit(step, meta)
    dist.barrier()  # committed before anyone goes on (or dies)
    return kind


def done_marker(staging: Path, rank: int, failed: bool = False) -> Path:
    """The file a rank's asynchronous writer creates once its part of a save is on disk
    (rank 0's removes them all before it commits), or, `failed`, when writing it failed."""
    return staging / f".{'failed' if failed else 'done'}-rank-{rank:05d}"


class CheckpointWriter:
    """A rank's background thread for asynchronous resume checkpoints, one at a time.

    Args:
        log: Receives a line when a save is due while the last one is still writing.
        poll_s: How often rank 0's thread looks for the other ranks' `done_marker`s.

    Attributes:
        waits: Saves that were due while the previous one was still being written.
        wait_s: Seconds the training thread spent waiting for them.
        write_s_max: The longest a background save took, from its start to its end
            (rank 0's: to its commit).
    """

    def __init__(self, log: Callable[[str], None], poll_s: float = 0.005) -> None:
        self._log = log
        self._poll_s = poll_s
        self._thread: threading.Thread | None = None
        self._step = -1
        self._error: BaseException | None = None
        self.waits = 0
        self.wait_s = 0.0
        self.write_s_max = 0.0

    def start(self, step: int, work: Callable[[], None]) -> None:
        """Run `work` (the save of `step`) in the background."""

        def run() -> None:
            started = time.monotonic()
            try:
                work()
            except BaseException as error:  # re-raised on the training thread
                self._error = error
            self.write_s_max = max(self.write_s_max, time.monotonic() - started)

        self._step = step
        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def wait(self, due_at: int | None = None) -> None:
        """Wait for the save in flight, if any; re-raise what it failed with.

        Args:
            due_at: The step of a save that is due now (logged and counted when it has
                to wait); None when the run is stopping or ending.

        Raises:
            RuntimeError: The background save failed (its error chained).
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            if due_at is not None and thread.is_alive():
                started = time.monotonic()
                self._log(
                    f"checkpoint of step {due_at} is due while step {self._step}'s is still "
                    "being written; waiting for it (at most one save is in flight)"
                )
                thread.join()
                self.waits += 1
                self.wait_s += time.monotonic() - started
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                f"the asynchronous resume checkpoint of step {self._step} failed: {error}"
            ) from error

    def await_files(self, paths: list[Path], failures: list[Path]) -> None:
        """Block (in the writer thread) until every path exists.

        Raises:
            RuntimeError: One of `failures` appeared first (a rank's write failed; the
                save is not committed, and that rank re-raises its own error).
        """
        while not all(path.exists() for path in paths):
            failed = [path.name for path in failures if path.exists()]
            if failed:
                raise RuntimeError(f"another rank's write failed ({', '.join(failed)})")
            time.sleep(self._poll_s)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from.

    Attributes:
        path: The committed checkpoint directory.
        meta: Its manifest's meta (step counters, world_size, fingerprint).
        dense_dir: Where DeepSpeed loads the dense part from (`path`, or the universal
            conversion when the world size changed under ZeRO 1-3), under tag `dense`.
        universal: Whether `dense_dir` is a universal checkpoint.
        chain: A differential checkpoint's chain (its meta's `CHAIN`), base first:
            (directory, world size that wrote it); empty for a whole checkpoint.
    """

    path: Path
    meta: dict[str, Any]
    dense_dir: Path
    universal: bool
    chain: tuple[tuple[Path, int], ...] = ()

    def sparse_parts(self) -> list[tuple[Path, int]]:
        """(directory, world size) of every checkpoint whose embedding shards make up
        this one's rows: the base, then each delta in order."""
        return [*self.chain, (self.path, int(self.meta["world_size"]))]


def find_resume_point(
    store: CheckpointStore,
    fingerprint: str,
    zero_stage: int,
    exchange: NodeExchange | None = None,
    pipeline_layout: Mapping[str, Any] | None = None,
) -> ResumePoint | None:
    """Every rank: the newest valid checkpoint of this run, prepared for this world size.

    Rank 0 picks it (verifying every file's sha256, falling back past a partial or
    corrupt one with a log line) and tells the others its step. A checkpoint of another
    world size is resumable (the fingerprint holds the global batch): under ZeRO 1-3
    rank 0 converts its dense part into DeepSpeed's universal format once (next to the
    checkpoints, published by rename), ZeRO-0 loads as it is; the embedding rows are
    re-sharded when loaded.

    A pipeline run (`pipeline_layout` given) loads its checkpoint as it is: the layer
    files do not depend on the stage split, and under ZeRO-0 each stage's optimizer
    state is one file (`mp_rank_SS`) whatever the data-parallel degree. So it resumes
    on another data-parallel degree with the same stages, ZeRO-0 and micro batch
    (`_check_pipeline_layout` refuses the rest).

    Args:
        store: The run's resume checkpoints.
        fingerprint: The run's config fingerprint; another one's checkpoint is refused.
        zero_stage: train.zero_stage.
        exchange: Nodes that share no disk (`NodeExchange`); None: a shared one.
        pipeline_layout: A pipeline run's `TrainConfig.checkpoint_layout()`; None for a
            CTR run.

    Returns:
        The resume point, or None for a fresh start.

    Raises:
        ConfigError: The checkpoint was written by another config, or by a pipeline
            layout this one cannot load (another stage count, data-parallel degree under
            ZeRO-1, micro batch size); the message says what to set.
        CheckpointCorrupt: Checkpoints exist but none is valid (never a silent restart).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    exchange = exchange or NodeExchange.from_spec(None)
    chosen = torch.tensor([-1], dtype=torch.int64)
    if rank == 0:
        latest = store.latest_valid(strict=True)
        if latest is not None:
            chosen[0] = latest.step
    dist.broadcast(chosen, src=0)
    if int(chosen[0]) < 0:
        return None
    path = store.checkpoint_dir(int(chosen[0]))
    # Rank 0 verified every file; each rank reads the meta through the signed, bound
    # manifest, never a file another writer may have swapped since.
    meta = store.manifest(path)["meta"]
    # A delta's chain: rank 0 verified each member and that its manifest is the one the
    # chain recorded (`CheckpointStore.latest_valid`).
    chain = tuple(
        (store.checkpoint_dir(int(m["step"])), int(m["world_size"])) for m in meta.get(CHAIN, [])
    )
    if exchange.active:
        for member in (*(p for p, _ in chain), path):
            _check_every_node_has(store, member, exchange.leads(rank))
    if meta.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"{path} was written by another train config (or data); resuming it would mix "
            "two runs. Restore the config it was written with, or delete "
            f"{store.root} to start this config from scratch"
        )
    if pipeline_layout is not None:
        _check_pipeline_layout(path, meta, pipeline_layout, world_size, zero_stage, store.root)
        return ResumePoint(path, meta, path, universal=False)
    if meta["world_size"] == world_size or zero_stage == 0:
        # ZeRO-0 keeps the whole optimizer state in one file: any world size loads it.
        return ResumePoint(path, meta, path, universal=False, chain=chain)
    universal = store.root / "universal" / path.name
    if exchange.leads(rank) and not universal.is_dir():
        convert_to_universal(path / DENSE_TAG, universal)
    dist.barrier()  # the conversion is published
    return ResumePoint(path, meta, universal, universal=True, chain=chain)


def _check_pipeline_layout(
    path: Path,
    meta: Mapping[str, Any],
    layout: Mapping[str, Any],
    world_size: int,
    zero_stage: int,
    root: Path,
) -> None:
    """Refuse a pipeline checkpoint this run's layout cannot load as it is.

    Raises:
        ConfigError: Another stage count (the optimizer state is per stage), another
            data-parallel degree under ZeRO-1 (the stage's state is partitioned over the
            replicas, and pipeline checkpoints are not converted), or another micro batch
            size (a micro batch's loss is the mean over its positions, so regrouping the
            sequences trains other steps).
    """
    old_world = int(meta["world_size"])
    start_over = f"or delete {root} to start over"
    if "pipeline_stages" not in meta:  # written before the layout was recorded
        if old_world != world_size:
            raise ConfigError(
                f"{path} was written by {old_world} pipeline ranks and this run has "
                f"{world_size}, and it does not record its layout; set train.world_size="
                f"{old_world}, {start_over}"
            )
        return
    stages = int(meta["pipeline_stages"])
    if stages != layout["pipeline_stages"]:
        raise ConfigError(
            f"{path} was written with train.pipeline_stages={stages} and this run has "
            f"{layout['pipeline_stages']}: a pipeline checkpoint holds its optimizer state per "
            f"stage, which another stage split cannot load; set pipeline_stages: {stages} "
            f"(world_size a multiple of it), {start_over}"
        )
    if int(meta["batch_size"]) != layout["batch_size"]:
        raise ConfigError(
            f"{path} was written with train.batch_size={meta['batch_size']} sequences per "
            f"micro batch and this run has {layout['batch_size']}: a micro batch's loss is the "
            "mean over its positions, so other micro batches would train other steps; set "
            f"batch_size: {meta['batch_size']} and grad_accum_steps so that the global batch "
            f"stays {meta['global_batch_size']} ({start_over})"
        )
    if old_world != world_size and zero_stage != 0:
        raise ConfigError(
            f"{path} was written by {old_world} pipeline ranks with ZeRO-{zero_stage} and this "
            f"run has {world_size}: ZeRO-{zero_stage} partitions each stage's optimizer state "
            "over the data-parallel replicas, and pipeline checkpoints are not converted; "
            f"set train.world_size={old_world}, {start_over}"
        )


def _check_every_node_has(store: CheckpointStore, path: Path, leads: bool) -> None:
    """Refuse a resume point that some node's own checkpoint directory lacks.

    Nodes that share no disk each hold a copy of every checkpoint (`NodeExchange`); the
    train stage aligns them before it launches, so a node without rank 0's choice means
    that alignment failed, and resuming would mix two steps.
    """
    missing = torch.tensor([0 if not leads or store.verify(path) is None else 1])
    dist.all_reduce(missing)
    if int(missing[0]):
        raise CheckpointCorrupt(
            f"{path.name} is rank 0's newest valid checkpoint but {int(missing[0])} other "
            f"node(s) have no valid copy of it under their {store.root}; delete the train "
            "stage's checkpoints (locally and in the artifact root) to start over"
        )


def convert_to_universal(tag_dir: Path, out_dir: Path) -> None:
    """DeepSpeed's ds_to_universal into a staging directory, published by rename."""
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag_dir),
        "--output_folder",
        str(staging / DENSE_TAG),
        # Our model has no Megatron metadata: DeepSpeed fills in the defaults.
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ConfigError(
            f"converting {tag_dir} to a universal checkpoint failed (exit {result.returncode}):"
            f" {result.stderr[-1500:]}; resume with the world size that wrote it"
        )
    fsync_tree(staging)
    os.replace(staging, out_dir)


def sparse_file(rank: int, world_size: int) -> str:
    """File name of one rank's embedding shard in a checkpoint."""
    return f"sparse-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def sparse_delta_file(rank: int, world_size: int) -> str:
    """File name of one rank's changed embedding rows in a differential checkpoint."""
    return f"sparse-delta-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc), or its peak elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather_rss_mb(rank: int, world_size: int) -> list[float]:
    """Every rank: each rank's resident memory in MiB, rounded to 0.1 (an all-reduce).

    Args:
        rank: This rank.
        world_size: Number of ranks.

    Returns:
        world_size figures, rank order.
    """
    memory = torch.zeros(world_size, dtype=torch.float64)
    memory[rank] = rss_bytes() / 2**20
    dist.all_reduce(memory)
    return [round(float(m), 1) for m in memory]


def write_progress(log_file: IO[str], record: dict[str, Any]) -> None:
    """Rank 0: one progress record, printed for the parent to stream and appended to the log.

    Args:
        log_file: The open `train_log.jsonl`.
        record: {"step", "total_steps", "loss", "samples_per_s", "epoch", "step_ms",
            "rss_mb"}.
    """
    print(PROGRESS_PREFIX + json.dumps(record), flush=True)
    log_file.write(json.dumps(record) + "\n")
    log_file.flush()


def open_tensorboard(log_dir: Path | None) -> Any:
    """Rank 0: a TensorBoard writer into `log_dir`, or None without one (train.tensorboard off)."""
    if log_dir is None:
        return None
    from torch.utils.tensorboard import SummaryWriter  # imported only when used

    return SummaryWriter(log_dir=str(log_dir))


def write_scalars(writer: Any, record: dict[str, Any]) -> None:
    """Rank 0: a progress record's figures as TensorBoard scalars at its step."""
    step = record["step"]
    writer.add_scalar("train/loss", record["loss"], step)
    writer.add_scalar("train/samples_per_s", record["samples_per_s"], step)
    for name, value in record["step_ms"].items():
        writer.add_scalar(f"step_ms/{name}", value, step)
    for rank, value in enumerate(record["rss_mb"]):
        writer.add_scalar(f"memory_rss_mb/rank{rank}", value, step)
    writer.flush()


# Rank 0's rendezvous store, kept for the life of the process (see `bind_rendezvous`).
_RENDEZVOUS: list[torch.distributed.TCPStore] = []


def bind_rendezvous(env: MutableMapping[str, str]) -> None:
    """Keep the ranks' listeners off interfaces the job does not use; call it first.

    Rank 0: torch's env:// rendezvous (what `deepspeed.init_distributed` runs) starts
    its TCPStore server on every interface: it binds the port, not the address. A
    multi-tenant store started first on a socket bound to MASTER_ADDR is the server that
    rendezvous then reuses (a process shares one server per port).

    Every rank, when MASTER_ADDR is a loopback address (then every rank is on this
    machine): GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME default to the loopback
    interface, where gloo and NCCL would otherwise listen on the address the machine's
    hostname resolves to. Elsewhere they listen on ephemeral ports of that address (or of
    the interface those variables name): firewall them (docs/security.md).

    A process the launcher did not start (no RANK, MASTER_ADDR, MASTER_PORT) is left
    as it is.

    Args:
        env: The rank's environment as DeepSpeed's launcher sets it (RANK, MASTER_ADDR,
            MASTER_PORT); the process's own environment, which torch reads.

    Raises:
        ConfigError: MASTER_ADDR is not an address of this machine (rank 0 runs on node 0,
            so train.master_addr must be one of node 0's own).
        OSError: MASTER_PORT is taken.
    """
    if not env.get("RANK") or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    interface = _loopback_interface() if _is_loopback(host) else None
    if interface is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    if env["RANK"] != "0" or _RENDEZVOUS or torch.distributed.is_initialized():
        return
    listener = _listen_on(host, port)
    store = torch.distributed.TCPStore(
        host,
        port,
        None,  # no worker count: torch's rendezvous store, on this server, waits for them
        True,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),  # the server owns the socket from here on
        use_libuv=True,
    )
    _RENDEZVOUS.append(store)


def _is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (Linux: `lo`), None if none is found."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return None


def _listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` (its first address that binds).

    Raises:
        ConfigError: `host` does not resolve, or is no address of this machine.
        OSError: The port is taken (EADDRINUSE: as torch's own bind would fail, transient).
    """
    error: OSError | None = None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        addresses, error = [], err
    for family, kind, proto, _, address in addresses:
        listener = socket.socket(family, kind, proto)
        try:
            # As torch's own server does: a port in TIME_WAIT from an earlier attempt binds.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(socket.SOMAXCONN)
        except OSError as err:
            listener.close()
            if err.errno == errno.EADDRINUSE:
                raise
            error = err
            continue
        return listener
    raise ConfigError(
        f"train.master_addr={host!r}: rank 0 cannot listen there ({error}); master_addr must "
        "be an address of node 0 itself (the machine that runs rank 0), as every node reaches it"
    )


def require_rank_key(spec: Mapping[str, Any]) -> None:
    """Refuse to run a rank whose artifact root is shared storage without the run key.

    Without a key `artifacts.signing` accepts unsigned records (a local root's
    development mode), so such a rank would trust every checkpoint and parent output it
    reads back from the bucket. A spec that names no root (or a local one) runs as before.

    Args:
        spec: The launch spec; its ``artifact_root`` (when the train task set it) is the
            run's root, a path or a URL.

    Raises:
        ConfigError: The root is remote and no key is configured; the message says how
            to set one.
    """
    root = spec.get("artifact_root")
    if root is None:
        return
    require_key(str(root), is_remote(str(root)))


def rank_main(module: str, run_rank: Callable[[Path], None], argv: list[str] | None) -> int:
    """Shared entry point of the rank modules: `python -m MODULE SPEC.json`.

    A rank of a run on a remote root refuses to start without the run key
    (`require_rank_key`). Rank 0 then starts the rendezvous store on MASTER_ADDR only
    (`bind_rendezvous`).
    Other launcher arguments (`--local_rank=...`) are ignored. Any exception prints one
    `RECFORGE_ERROR {"rank": r, "error": "..."}` line, so the parent can name the root
    cause among the other ranks' follow-on errors (a peer's closed connection), and is
    raised again.

    Args:
        module: The module name, for the usage message.
        run_rank: Runs one rank from the spec file's path.
        argv: Command-line arguments; default sys.argv[1:].

    Returns:
        0 on success.
    """
    args = sys.argv[1:] if argv is None else argv
    spec_args = [arg for arg in args if arg.endswith(".json")]
    if len(spec_args) != 1:
        raise SystemExit(f"usage: python -m {module} SPEC.json (got {args})")
    try:
        spec = json.loads(Path(spec_args[0]).read_text())
        require_rank_key(spec if isinstance(spec, dict) else {})
        bind_rendezvous(os.environ)
        run_rank(Path(spec_args[0]))
    except Exception as error:
        rank = dist.get_rank() if dist.is_initialized() else None
        report = {"rank": rank, "error": f"{type(error).__name__}: {error}"[:2000]}
        # One write(2) of the whole line: the ranks share the pipe, and print's separate
        # write of the newline lets two ranks' reports run into one unparsable line.
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (ERROR_PREFIX + json.dumps(report) + "\n").encode())
        raise
    return 0
