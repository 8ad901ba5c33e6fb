"""Benchmark: recforge's sparse training against TorchRec + FBGEMM on the same model and data.

The peer is what a recsys team would pick instead of recforge's sharded embeddings:
TorchRec's `EmbeddingBagCollection` fed `KeyedJaggedTensor`s, FBGEMM's fused row-wise
Adagrad applied in the backward (`apply_optimizer_in_backward(RowWiseAdagrad, ...)`,
TorchRec's fused-params path), `DistributedModelParallel` over gloo ranks on the CPU
(table-wise sharding, the `fused` kernel: TorchRec on CPU shards table-wise only), and
`torchrec.models.dlrm.DLRM` around it, whose dot interaction and MLPs are recforge's.

Model (both engines): F single-valued sparse features, one table each, embedding_dim D
(`--embedding-dim`, 16); 2 dense features through a bottom MLP [32, D] (ReLU after every
layer; its output is one more vector of the dot interaction, so it is D wide); DLRM dot
interaction (pairwise dot products of the F + 1 vectors, upper triangle, concatenated
with the bottom output); top MLP [64, 32] (ReLU) and one linear logit; mean binary
cross-entropy. Embeddings: row-wise Adagrad, lr 0.05, eps 1e-8 (one accumulator per row:
the mean squared gradient). Dense part: AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, no
weight decay, constant learning rate.

Data (both engines read the same files): a synthetic shard directory (`dataset.json`
and 4 Parquet files, cached under `--workdir` by table sizes and row count), ids uniform
over each whole table (the harshest case for memory locality), a click label from a
fixed logistic model. Each engine reads it as it would: recforge through its
`ShardReader` (decoded ahead by a thread), TorchRec ranks through a small pyarrow reader
written here, also decoded ahead by a thread (files r, r + W, ... per rank), both
cycling the data when the steps outlast it.

Cells, `--batch-size` rows per rank (2,048):

| cell | tables | ranks |
|---|---|---|
| `1m_1proc` / `1m_2ranks` | 8 features, 1M rows in all | 1 process / 2 ranks |
| `20m_1proc` / `20m_2ranks` | 8 features, 20M rows in all | 1 process / 2 ranks |
| `1000slots_2ranks` | 1,000 features of 2,000 rows (2M rows) | 2 ranks |

The 1,000-slot cell keeps the model but not the batch: the dot interaction of 1,001
vectors is a (B, 1001, 1001) Gram matrix, 8 GiB per rank at B = 2,048 on either engine,
and its (B, 500500) pairs feed a 32M-parameter first top layer; recforge has no
interaction linear in F (`num_cross_layers` >= 1, and one DCN-v2 layer over 16,016
inputs is 256M parameters). So it runs at `--wide-batch-size` (64) rows per rank, and
its step time is mostly the dense side; its phase split shows the embedding engines.

How each engine runs (one after the other, in this process's tree, after an untimed
warm-up run of each, so both start with warm page caches and built extensions):

- recforge: `training.ctr.train.train_model`, the train stage's library entry that the
  `recforge run` train task calls with the same arguments: the DeepSpeed launcher, the
  CTR worker, `train.embeddings: sharded`, on the shard directory above (`--via-cli`,
  below: through `recforge run` instead). The config is `TrainConfig`'s defaults (its
  ZeRO stage, resume checkpoints every 600 s on) with the model above, `max_steps`,
  `log_every`, `table_precision` and `tensorboard: false`. Threads as shipped: what the
  train stage gives each rank (`threads_per_rank` in the figures, from its
  `launch.json`; torch's default where it sets none), unless `--recforge-threads` sets
  them (`train.threads_per_rank` where the config has that field, and
  `OMP_NUM_THREADS`).
- TorchRec: this file re-run as `--torchrec-rank SPEC` in W processes (gloo), at each
  of `--torchrec-threads` (1 and 2 per rank); the faster is the one compared. Under
  `--torchrec-qcomms` (which `--link` turns on), a 2-rank cell's TorchRec also runs a
  second form, `qcomms`: `QCommsConfig(forward_precision=FP16, backward_precision=FP16)`
  through `get_qcomm_codecs_registry` on the `EmbeddingBagCollectionSharder`, so the
  pooled embeddings' all-to-all and their gradients' travel as fp16 (what a TorchRec user
  turns on for a slow network), at the plain form's best thread count. The faster of
  `plain` and `qcomms` is TorchRec's figure; both are under `torchrec_by_form`. Where the
  codecs fail on CPU gloo, `torchrec_qcomms_error` keeps the failed rank's first error
  line and plain TorchRec is compared.

Modes, off by default, that combine with each other and with any cells:

- `--table-precision fp16` (default fp32): both engines store the embedding rows in
  fp16. recforge: `train.table_precision: fp16`. TorchRec: `data_type=DataType.FP16` on
  each `EmbeddingBagConfig`, which torchrec 1.8's fused kernel (`BatchedFusedEmbeddingBag`)
  hands to FBGEMM's CPU TBE as `weights_precision`. Both compute a row's update in fp32
  and round it back stochastically (recforge always; FBGEMM's `stochastic_rounding`,
  on by default), keep the row-wise Adagrad state in fp32 and give the dense side fp32
  pooled embeddings. The figures keep their names; `table_precision` says which ran,
  and each run says what held its rows (recforge's `table_precision` from its summary,
  TorchRec's `table_dtype` read back from its sharded tables).
- `--via-cli`: recforge runs as a new user runs it, `recforge run CONFIG --force train`
  (`python -m flows.cli`): ingest, preprocess, shard, train, evaluate, export. CONFIG is
  the shipped CTR config (`configs/demo.yaml`) with the bench's model, run length and
  `--recforge-threads` over it (`cli_train_overrides`; the rest of `train` as it ships:
  its ZeRO stage, precision, checkpoints, TensorBoard, seed), `generate` dropped, and a
  schema of the cell's columns: each feature a `hash_buckets` field with the
  cell's table size as its buckets (a hashed field has no OOV row, so the tables are the
  cell's sizes exactly; the run stops if they are not). Its input is the cell's rows as
  raw CSV logs (`ts`, ids, dense values, click; written once per data directory under
  `--workdir`/cli/raw), so recforge trains on the time split's first 80% of them, hashed
  (the shipped 10% valid, 10% test), while TorchRec reads all the rows as before; both
  cycle. The artifact root is `--workdir`/cli/store (ingest, preprocess and shard are
  cache hits after a cell's first run; evaluate and export run when the trained model
  is new there), Prefect's home `--workdir`/cli/prefect unless PREFECT_HOME is set.
  The untimed warm-up goes through `recforge run` too. Figures come from the train
  output the run record names: `samples_per_s`, `step_ms` and per-rank `peak_rss_mb`
  from the same progress windows as above (what the ratios use: TorchRec's figure
  leaves the warm-up steps out too), and the stage's own `train_summary.json` figures
  beside them (`summary_samples_per_s`, over every step, the first and slower ones
  included; `ru_maxrss_mb_rank0`, rank 0's only; `rank0_startup_s`), with
  `zero_stage` (what the shipped `train.zero_stage` came to), each stage's status and
  seconds, the test `metrics` and the whole run's wall time (`run_s`).
  `time_to_first_step_s` and its ratio are null: the launch happens inside the flow,
  where no clock of this process sees it.
- `--link RATE` (issue 40, "the communication wall"; a tc rate: `1gbit`, `200mbit`): the
  whole bench re-runs itself inside a network namespace of its own whose loopback is
  shaped to RATE by a tbf qdisc (`bench/shaped_link.py`), so every rank's gloo traffic of
  both engines, and under `--via-cli` the Prefect server `recforge run` starts, goes
  through a link of that rate; on one machine the loopback otherwise moves gigabytes a
  second and the bytes a step sends never show. Needs root (`unshare -n`, `tc`): without
  it the bench exits with status 2 and a line saying so. Turns `--torchrec-qcomms` on.
- `--comm-precision fp32|bf16|fp16` (default: recforge's own): recforge's
  `train.comm_precision`, the precision its ranks send rows and row gradients in (a tree
  whose `TrainConfig` has no such field runs as before, and says so on stderr).
  `--compare-comm-fp32` trains recforge once more per cell at fp32
  (`recforge_comm_fp32` in the cell) for `wire_bytes_ratio_vs_fp32_<cell>`.

Figures per cell and engine:

- `samples_per_s`: steady state, the steps after `--warmup-steps` (20) of `--steps`
  (120): recforge's progress windows (`train_log.jsonl`, every `log_every` steps) after
  the warm-up, TorchRec's rank 0 clock over the same steps.
- `step_ms`: milliseconds per steady step by phase. recforge's own split: data (waiting
  for the reader), lookup (ids to rows, both all-to-alls), dense (forward and backward
  of the MLPs), optimizer (row gradients to their owners, the dense step, the sparse
  step). TorchRec's: data (reader and KJT), lookup (the sharded EBC's forward: input
  all-to-all, FBGEMM lookup, output all-to-all), forward_backward (the rest of the
  forward and the whole backward, in which the fused kernel also updates the rows),
  optimizer (the dense AdamW step).
- `peak_rss_mb`: per rank, the largest resident set sampled every `log_every` steps
  while training (recforge's progress records; the same steps for TorchRec);
  `ru_maxrss_mb` adds each process's lifetime peak (recforge's rank 0 only, after its
  final checkpoint and weights file).
- `time_to_first_step_s`: from the launch to the start of the first step's clock
  (process start, imports, rendezvous, table init, sharding plan, reader open).
- `wire_bytes_per_sample`: bytes all ranks sent each other per training sample, by kind:
  `ids` (ids to the ranks that own their rows), `rows` (rows or pooled embeddings back),
  `row_grads` (their gradients), `dense_allreduce` (the dense gradients) and `total`.
  recforge's is its train stage's own count (`train_summary.json`; null in a tree that
  does not count them). TorchRec's is computed from the sizes of the tensors its
  collectives send, not counted on the wire (`torchrec_wire_bytes`): table-wise, the
  input all-to-all's ids (int64) and lengths (int32) of the features owned elsewhere,
  the pooled (B, F_r, D) embeddings of a rank's tables to the other ranks' samples
  forward and their gradients backward (fp32; fp16 in the `qcomms` form), and DDP's ring
  all-reduce of the fp32 dense gradients, 2 (W - 1) / W x their bytes per rank. One
  process sends nothing: all zero.

Last line, one JSON object: `vs_torchrec_<cell>` (recforge samples/s over TorchRec's,
target >= 1.0), `rss_ratio_vs_torchrec_<cell>` (recforge's largest per-rank peak RSS
over TorchRec's, target <= 1.1), `first_step_ratio_vs_torchrec_<cell>`,
`link_utilisation_<cell>` (recforge's wire bytes per sample x its samples/s x 8 over the
link's bit rate: all ranks' bytes over the rate of the one loopback they share, so 1.0
is a link that carried nothing else at full rate; null without `--link` or without the
bytes), `wire_bytes_ratio_vs_fp32_<cell>` (recforge's wire bytes per sample over its
bytes at comm_precision fp32; null without `--compare-comm-fp32` or either figure),
every raw figure under `cells`, `table_precision`, `comm_precision` (asked for; null:
recforge's default), `embedding_dim`, `link_mbit` (null without `--link`), `link` (the
loopback's qdisc read back after the runs, with the bytes it carried: it shows the
shaping was on; null without `--link`), `torchrec_qcomms`, and `recforge_entry` (the
library entry, or `recforge run` under `--via-cli`). The machine is shared and noisy:
only ratios within one run mean much, and `loadavg` says how busy it was.

TorchRec is an optional peer, never installed by this script: `make peers` installs
torchrec and fbgemm-gpu-cpu with `--no-deps` over the pinned torch (their metadata
asks for the CUDA `fbgemm-gpu`). Without it this script says so and exits with
status 2; `--recforge-only` measures recforge alone (ratios null).

Usage::

    make peers                                     # once
    .venv/bin/python bench/vs_torchrec.py          # five cells: ~35 min on a busy 2-core box
    .venv/bin/python bench/vs_torchrec.py --cells 1m_1proc,1m_2ranks,20m_1proc,20m_2ranks
    .venv/bin/python bench/vs_torchrec.py --cells 1000slots_2ranks --steps 40 \
        --warmup-steps 10 --torchrec-threads 1     # the 1,000-slot cell, shorter
    .venv/bin/python bench/vs_torchrec.py --quick  # 50k/400k rows, 100 slots, 512 rows per
                                                   # rank, 30 steps, 1 thread: ~3 minutes
    .venv/bin/python bench/vs_torchrec.py --cells 1m_1proc --table-precision fp16
    .venv/bin/python bench/vs_torchrec.py --cells 1m_1proc,1m_2ranks --via-cli
    sudo .venv/bin/python bench/vs_torchrec.py --cells 1m_2ranks --link 1gbit \
        --comm-precision bf16 --compare-comm-fp32  # a 1 Gbit/s link; TorchRec with QComms
    .venv/bin/python bench/vs_torchrec.py --cells 1m_2ranks --embedding-dim 64
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import queue
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parent.parent
# First, so that `data_prep` is the package and not bench/data_prep.py beside this file.
sys.path.insert(0, str(REPO))

from bench import shaped_link  # noqa: E402

EMBEDDING_DIM = 16  # --embedding-dim's default
BOTTOM_HIDDEN = 32  # the bottom MLP's first layer; its last is the embedding dim
TOP_MLP = [64, 32]
NUM_DENSE = 2
SPARSE_LR = 0.05
DENSE_LR = 1e-3
EPS = 1e-8
NUM_FILES = 4
PREFETCH_BATCHES = 4  # recforge's train.prefetch_batches default; the same for TorchRec
# Values generated per Parquet chunk: bounds the writer's memory at 1,000 columns.
CHUNK_VALUES = 8_000_000
ROW_GROUP = 65_536
# Seeds the rank-to-id permutations of skewed ids (`zipf_tables`), apart from the rows' draws.
ZIPF_PERMUTATION_SEED = 41

COMM_PRECISIONS = ("fp32", "bf16", "fp16")
# Bytes of one value of the pooled embeddings and their gradients in TorchRec's all-to-alls:
# fp32 as it ships, fp16 under its QComms codecs (the `qcomms` form).
TORCHREC_VALUE_BYTES = {"plain": 4, "qcomms": 2}
# What TorchRec's input all-to-all sends per id: the int64 id and its int32 length.
TORCHREC_ID_BYTES = 8 + 4
DENSE_VALUE_BYTES = 4  # fp32 dense gradients, all-reduced by DDP

# --via-cli: the CTR config that ships, whose defaults a new user's run takes.
SHIPPED_CTR_CONFIG = REPO / "configs" / "demo.yaml"
# The raw logs' first event time (unix seconds); one second per row after it.
RAW_FIRST_TS = 1_700_000_000
TABLE_PRECISIONS = ("fp32", "fp16")

CELLS = ("1m_1proc", "1m_2ranks", "20m_1proc", "20m_2ranks", "1000slots_2ranks")
PEER_MODULES = ("torchrec", "fbgemm_gpu", "tensordict")
INSTALL_HINT = (
    "install the pinned peers into this venv with `make peers` (pip install --no-deps "
    "torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 and their pure-Python dependencies, over the "
    "pinned torch), or pass --recforge-only to measure recforge alone"
)


@dataclass(frozen=True)
class Cell:
    """One measured configuration.

    Attributes:
        name: The cell's name in the figures (`CELLS`).
        table_sizes: Rows of each feature's table.
        world_size: Ranks (1: one process).
        batch_size: Rows per rank per step.
        data_dir: The shard directory both engines read.
        embedding_dim: Width of every table (and of the bottom MLP's output) on both
            engines.
    """

    name: str
    table_sizes: tuple[int, ...]
    world_size: int
    batch_size: int
    data_dir: Path
    embedding_dim: int = EMBEDDING_DIM


def bottom_mlp(embedding_dim: int) -> list[int]:
    """The bottom MLP's layer sizes: its output is one more vector of the dot interaction."""
    return [BOTTOM_HIDDEN, embedding_dim]


# -- data ------------------------------------------------------------------------------


def split_rows(total_rows: int, num_features: int) -> list[int]:
    """`num_features` table sizes summing to `total_rows` (the first takes the remainder)."""
    sizes = [total_rows // num_features] * num_features
    sizes[0] += total_rows - sum(sizes)
    return sizes


def zipf_tables(
    table_sizes: list[int], exponent: float
) -> tuple[dict[int, np.ndarray], list[np.ndarray]]:
    """What `write_shard_dir` draws skewed ids with: cumulative weights and rank-to-id maps.

    Rank r of a table of n rows has weight (r + 1)^-exponent (a bounded Zipf law over the
    whole table); each table maps ranks to ids through a permutation of its own, seeded
    by its index, so that the hot ids lie all over the table (and over the ranks that
    own its rows) and differ between features.

    Args:
        table_sizes: Rows of each feature's table.
        exponent: The Zipf exponent s (> 0).

    Returns:
        ({n: (n,) float64 cumulative weights ending at exactly 1.0} per distinct table
        size, shared by the tables of that size; one (n,) permutation per table, int32
        where the table fits, else int64).
    """
    cdfs: dict[int, np.ndarray] = {}
    for n in sorted(set(table_sizes)):
        cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)
        cdfs[n] = cdf / cdf[-1]
    perms = []
    for f, n in enumerate(table_sizes):
        perm = np.random.default_rng([ZIPF_PERMUTATION_SEED, f]).permutation(n)
        perms.append(perm.astype(np.int32) if n <= np.iinfo(np.int32).max else perm)
    return cdfs, perms


def write_shard_dir(
    root: Path, table_sizes: list[int], num_samples: int, zipf_exponent: float = 0.0
) -> Path:
    """A shard directory of `num_samples` rows over `table_sizes`; kept if it already matches.

    Writes `NUM_FILES` Parquet files (columns f0.., d0, d1, click) and `dataset.json`
    last, so a directory with a matching `dataset.json` is complete.

    Args:
        root: The directory (replaced unless its `dataset.json` matches).
        table_sizes: Rows of each feature's table.
        num_samples: Rows to write (rounded down to a multiple of `NUM_FILES`).
        zipf_exponent: 0: ids uniform over each whole table. s > 0: each feature's ids
            follow a bounded Zipf law of exponent s over its table (`zipf_tables`),
            drawn by inverse CDF; `dataset.json` records s as "zipf_exponent".

    Raises:
        ValueError: Fewer than `NUM_FILES` samples, or a negative exponent.
    """
    if zipf_exponent < 0:
        raise ValueError(f"zipf_exponent={zipf_exponent}: give 0 (uniform ids) or more")
    dataset_path = root / "dataset.json"
    if dataset_path.is_file():
        dataset = json.loads(dataset_path.read_text())
        if (
            [f["num_embeddings"] for f in dataset["sparse"]] == table_sizes
            and dataset["splits"]["train"]["rows"] == num_samples // NUM_FILES * NUM_FILES
            and dataset.get("zipf_exponent", 0.0) == zipf_exponent
        ):
            return root
    rows = num_samples // NUM_FILES
    if rows == 0:
        raise ValueError(f"num_samples={num_samples}: need at least {NUM_FILES} rows")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    num_features = len(table_sizes)
    schema = pa.schema(
        [(f"f{f}", pa.int64()) for f in range(num_features)]
        + [(f"d{d}", pa.float32()) for d in range(NUM_DENSE)]
        + [("click", pa.float32())]
    )
    rng = np.random.default_rng(0)
    sizes = np.array(table_sizes, dtype=np.int64)
    chunk = max(1024, min(ROW_GROUP, CHUNK_VALUES // num_features))
    # Keeps the label's signal about as strong at 1,000 features as at 8.
    signal_scale = 0.5 / max(1.0, math.sqrt(num_features / 8))
    zipf = zipf_tables(table_sizes, zipf_exponent) if zipf_exponent > 0 else None
    files = []
    for index in range(NUM_FILES):
        path = f"train-{index:05d}-of-{NUM_FILES:05d}.parquet"
        with pq.ParquetWriter(root / path, schema) as writer:
            for start in range(0, rows, chunk):
                n = min(chunk, rows - start)
                if zipf is None:
                    ids = rng.integers(0, sizes, size=(n, num_features))  # (n, F)
                else:
                    ids = zipf_ids(rng.random((n, num_features)), table_sizes, *zipf)
                # A learnable signal that needs no table-sized weight vector.
                logit = -1.0 + signal_scale * np.sin(ids * 0.618 + np.arange(num_features)).sum(1)
                columns = {f"f{f}": ids[:, f] for f in range(num_features)}
                for d in range(NUM_DENSE):
                    values = rng.normal(size=n).astype(np.float32)
                    columns[f"d{d}"] = values
                    logit += 0.3 * values
                columns["click"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
                writer.write_table(pa.table(columns, schema=schema), row_group_size=chunk)
        files.append({"path": path, "rows": rows})
    dataset: dict[str, Any] = {
        "label": "click",
        "sparse": [{"name": f"f{f}", "num_embeddings": n} for f, n in enumerate(table_sizes)],
        "dense": [f"d{d}" for d in range(NUM_DENSE)],
        "splits": {"train": {"files": files, "rows": sum(f["rows"] for f in files)}},
    }
    if zipf_exponent > 0:  # uniform directories keep the dataset.json they always had
        dataset["zipf_exponent"] = zipf_exponent
    dataset_path.write_text(json.dumps(dataset))
    return root


def zipf_ids(
    uniform: np.ndarray,
    table_sizes: list[int],
    cdfs: dict[int, np.ndarray],
    perms: list[np.ndarray],
) -> np.ndarray:
    """(n, F) int64 ids from (n, F) uniform draws in [0, 1), by inverse CDF (`zipf_tables`)."""
    ids = np.empty(uniform.shape, dtype=np.int64)
    for f, n in enumerate(table_sizes):
        # side="right": rank r takes [cdf[r - 1], cdf[r]); u < 1.0 = cdf[-1] keeps r < n.
        ranks = np.searchsorted(cdfs[n], uniform[:, f], side="right")
        ids[:, f] = perms[f][np.minimum(ranks, n - 1)]
    return ids


# -- shared helpers --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_mb() -> float:
    """This process's resident memory now, MiB (as recforge's progress records take it)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    """This process's lifetime peak resident memory, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def with_total(phase_ms: dict[str, float]) -> dict[str, float]:
    """The phases' milliseconds and their sum as "total", rounded to 0.01."""
    return {k: round(v, 2) for k, v in {**phase_ms, "total": sum(phase_ms.values())}.items()}


def base_env() -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    # As `make` does: DeepSpeed's CPU op is built once per venv, not once per run.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    return env


# -- recforge --------------------------------------------------------------------------


def run_recforge(
    cell: Cell,
    steps: int,
    warmup: int,
    log_every: int,
    threads: int | None,
    table_precision: str,
    out: Path,
    comm_precision: str | None = None,
) -> dict[str, Any]:
    """Train `cell` with recforge's train stage; its steady-state figures.

    `comm_precision` sets `train.comm_precision` (None: the config's default) in a tree
    whose `TrainConfig` has the field; a tree without it trains as it always has.
    """
    # Imported here, not at the top: the TorchRec ranks run this file too and must not
    # carry recforge's (and DeepSpeed's) modules in their resident memory.
    from training.config import TrainConfig
    from training.ctr.train import train_model
    from training.runtime.files import LAUNCH_FILE, SUMMARY_FILE, TRAIN_LOG_FILE

    config = TrainConfig(
        interaction="dot",
        embedding_dim=cell.embedding_dim,
        bottom_mlp=bottom_mlp(cell.embedding_dim),
        top_mlp=TOP_MLP,
        batch_size=cell.batch_size,
        lr=DENSE_LR,
        sparse_optimizer="rowwise_adagrad",
        sparse_lr=SPARSE_LR,
        world_size=cell.world_size,
        max_steps=steps,
        log_every=log_every,
        tensorboard=False,
        table_precision=table_precision,
    )
    env = base_env()
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        # Trees without the field leave the threads to OMP_NUM_THREADS alone.
        if "threads_per_rank" in TrainConfig.model_fields:
            config = TrainConfig(**{**config.model_dump(), "threads_per_rank": threads})
    if comm_precision is not None and "comm_precision" in TrainConfig.model_fields:
        config = TrainConfig(**{**config.model_dump(), "comm_precision": comm_precision})
    shutil.rmtree(out, ignore_errors=True)
    first_record: list[tuple[float, dict[str, Any]]] = []

    def on_progress(record: dict[str, Any]) -> None:
        if not first_record:
            first_record.append((time.time(), record))

    started = time.time()
    train_model(config, cell.data_dir, out, "cpu", free_port(), env, on_progress=on_progress)
    launch_to_exit = time.time() - started
    records = [json.loads(line) for line in (out / TRAIN_LOG_FILE).read_text().splitlines()]
    samples_per_window = log_every * cell.batch_size * cell.world_size
    # The first record's window began when the step loop did.
    arrived, first = first_record[0]
    loop_start = arrived - samples_per_window / first["samples_per_s"]
    summary = json.loads((out / SUMMARY_FILE).read_text())
    return {
        **steady_figures(records, warmup, samples_per_window, cell.world_size),
        "ru_maxrss_mb_rank0": round(summary["peak_rss_mb_rank0"], 1),
        "time_to_first_step_s": round(loop_start - started, 1),
        # Rank 0's own split of it from its process start (trees without it: null).
        "rank0_startup_s": summary.get("startup_s"),
        "launch_to_exit_s": round(launch_to_exit, 1),
        "final_loss": round(summary["final_loss"], 4),
        "threads_per_rank": rank_threads(json.loads((out / LAUNCH_FILE).read_text()), env),
        "table_precision": summary.get("table_precision", "fp32"),
        # What the run says it sent; a tree without the field: what it was configured to.
        "comm_precision": summary.get("comm_precision", getattr(config, "comm_precision", None)),
        "wire_bytes_per_sample": summary.get("wire_bytes_per_sample"),
    }


def comm_precision_default() -> str | None:
    """recforge's `train.comm_precision` default; None in a tree without the field."""
    from training.config import TrainConfig

    field = TrainConfig.model_fields.get("comm_precision")
    return None if field is None else field.default


def wire_total(run: dict[str, Any] | None) -> float | None:
    """A run's wire bytes per sample, all kinds; None where the run or its figure is missing."""
    wire = (run or {}).get("wire_bytes_per_sample")
    return None if not wire or wire.get("total") is None else float(wire["total"])


def link_utilisation(run: dict[str, Any], link_bit_per_s: int | None) -> float | None:
    """The share of the link's rate that a run's wire bytes fill at its samples/s.

    All ranks' bytes over the rate of the one loopback they share (the namespace's): 1.0
    means the link carried nothing but the run's collectives, at its full rate. None
    without a link or without the run's wire bytes.
    """
    total = wire_total(run)
    if link_bit_per_s is None or total is None:
        return None
    return round(total * run["samples_per_s"] * 8 / link_bit_per_s, 4)


def steady_figures(
    records: list[dict[str, Any]], warmup: int, samples_per_window: int, world_size: int
) -> dict[str, Any]:
    """Samples/s and phase ms over the progress windows after `warmup`; peak RSS per rank.

    Args:
        records: `train_log.jsonl`'s progress records, one per `log_every` steps.
        warmup: Steps left out (a multiple of `log_every`).
        samples_per_window: Samples of all ranks in one window.
        world_size: Ranks (the length of each record's `rss_mb`).
    """
    steady = [r for r in records if r["step"] > warmup] or records[-1:]
    seconds = [samples_per_window / r["samples_per_s"] for r in steady]
    # Every window has log_every steps: the mean of the windows is the mean step.
    phase_ms = {
        phase: sum(r["step_ms"][phase] for r in steady) / len(steady)
        for phase in steady[0]["step_ms"]
    }
    return {
        "samples_per_s": round(len(steady) * samples_per_window / sum(seconds)),
        "step_ms": with_total(phase_ms),
        "peak_rss_mb": [max(r["rss_mb"][rank] for r in records) for rank in range(world_size)],
    }


def rank_threads(spec: dict[str, Any], env: dict[str, str]) -> int | str:
    """The torch threads recforge's ranks ran with, as its launch spec and environment say."""
    if spec.get("intra_op_threads"):
        return int(spec["intra_op_threads"])
    if env.get("OMP_NUM_THREADS"):
        return int(env["OMP_NUM_THREADS"])
    return f"torch default ({torch.get_num_threads()})"


# -- recforge as a user runs it: `recforge run` (--via-cli) -----------------------------


def write_raw_logs(data_dir: Path, raw_root: Path) -> Path:
    """The shard directory's rows as raw CSV logs that `recforge run` ingests; kept if written.

    One CSV per Parquet file, in file order, as `recforge generate` writes its logs: a
    `ts` column first (one second per row, so that preprocess's time split keeps the
    order), then the ids, the dense values and the click as an integer. `done.json` (a
    copy of `dataset.json`) is written last, beside the `events/` folder ingest reads.

    Args:
        data_dir: The cell's shard directory (`write_shard_dir`).
        raw_root: Where the raw logs of every cell go; this one's under `data_dir`'s name.

    Returns:
        The `events/` folder: the pipeline's `ingest.path`.
    """
    dataset = json.loads((data_dir / "dataset.json").read_text())
    raw = raw_root / data_dir.name
    events, done = raw / "events", raw / "done.json"
    if done.is_file() and json.loads(done.read_text()) == dataset:
        return events
    shutil.rmtree(raw, ignore_errors=True)
    events.mkdir(parents=True)
    first_row = 0
    for file in dataset["splits"]["train"]["files"]:
        table = pq.read_table(data_dir / file["path"])
        rows = table.num_rows
        columns = {"ts": pa.array(RAW_FIRST_TS + first_row + np.arange(rows, dtype=np.int64))}
        columns |= {f["name"]: table[f["name"]] for f in dataset["sparse"]}
        columns |= {name: table[name].cast(pa.float64()) for name in dataset["dense"]}
        columns[dataset["label"]] = table[dataset["label"]].cast(pa.int64())
        pa_csv.write_csv(pa.table(columns), events / Path(file["path"]).with_suffix(".csv"))
        first_row += rows
    done.write_text(json.dumps(dataset))
    return events


def cli_train_overrides(
    cell: Cell,
    steps: int,
    log_every: int,
    table_precision: str,
    threads: int | None,
    comm_precision: str | None = None,
) -> dict[str, Any]:
    """The `train` fields the bench sets over the shipped CTR config: its model and run length.

    Everything else (ZeRO stage, precision, checkpoints, TensorBoard, seed, threads unless
    `threads` is given, `comm_precision` unless it is given) stays as `SHIPPED_CTR_CONFIG`
    ships it.
    """
    overrides: dict[str, Any] = {
        "interaction": "dot",
        "embedding_dim": cell.embedding_dim,
        "bottom_mlp": bottom_mlp(cell.embedding_dim),
        "top_mlp": TOP_MLP,
        "batch_size": cell.batch_size,
        "lr": DENSE_LR,
        # The bench's model trains at a constant learning rate on both engines.
        "warmup_steps": 0,
        "sparse_optimizer": "rowwise_adagrad",
        "sparse_lr": SPARSE_LR,
        "world_size": cell.world_size,
        "max_steps": steps,
        "log_every": log_every,
        "table_precision": table_precision,
    }
    if threads is not None:
        overrides["threads_per_rank"] = threads
    if comm_precision is not None:
        overrides["comm_precision"] = comm_precision
    return overrides


def write_pipeline_config(
    cell: Cell, events: Path, train_overrides: dict[str, Any], path: Path
) -> Path:
    """The shipped CTR config with the bench's schema, raw logs and model; written to `path`.

    The schema names the raw columns of `write_raw_logs`: one `hash_buckets` sparse field
    per feature with the cell's table size as its buckets (so that recforge's tables have
    the cell's sizes exactly: a hashed field has no OOV row), the dense values, the click
    label. `generate` is dropped (the logs are the bench's) and `num_cross_layers` (the
    model uses the dot interaction); every other section is the shipped one.
    """
    shipped = yaml.safe_load(SHIPPED_CTR_CONFIG.read_text())
    dataset = json.loads((cell.data_dir / "dataset.json").read_text())
    fields: list[dict[str, Any]] = [{"name": "ts", "dtype": "int64", "role": "timestamp"}]
    fields += [
        {"name": f["name"], "dtype": "int64", "role": "sparse", "hash_buckets": f["num_embeddings"]}
        for f in dataset["sparse"]
    ]
    fields += [{"name": name, "dtype": "float64", "role": "dense"} for name in dataset["dense"]]
    fields.append({"name": dataset["label"], "dtype": "int64", "role": "label"})
    train = {k: v for k, v in shipped["train"].items() if k != "num_cross_layers"}
    name = f"vs-torchrec-{cell.name}"
    config = {k: v for k, v in shipped.items() if k != "generate"}
    config |= {
        "name": name,
        "schema": {"fields": fields},
        "ingest": {**shipped.get("ingest", {}), "path": str(events)},
        "train": {**train, **train_overrides},
        # A registry entry per cell: the blessing gate compares like with like.
        "export": {**shipped.get("export", {}), "model_name": name},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_recforge_cli(
    cell: Cell,
    steps: int,
    warmup: int,
    log_every: int,
    threads: int | None,
    table_precision: str,
    workdir: Path,
    out: Path,
    comm_precision: str | None = None,
) -> dict[str, Any]:
    """Train `cell` through `recforge run CONFIG --force train`; its train stage's figures.

    The pipeline config (`write_pipeline_config`) goes to `out/pipeline.yaml`, the raw
    logs under `workdir/raw`, the artifact root is `workdir/store` and Prefect's home
    `workdir/prefect` (unless PREFECT_HOME is set), so the bench's runs stay out of the
    user's. Ingest, preprocess and shard are cache hits after the first run on a cell's
    data; train always runs (`--force train`); evaluate and export run when the trained
    model is new to the root. The figures come from the train output the run record
    names: `train_summary.json` and the progress windows of `train_log.jsonl` (the
    windows the library mode reads). `comm_precision` sets `train.comm_precision` (None:
    as shipped); the caller gives it only where the tree's `TrainConfig` has the field.

    Raises:
        RuntimeError: `recforge run` failed (with the tail of its stderr), or its run
            record says the train stage did not run.
    """
    from training.runtime.files import LAUNCH_FILE, SUMMARY_FILE, TRAIN_LOG_FILE

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    events = write_raw_logs(cell.data_dir, workdir / "raw")
    overrides = cli_train_overrides(
        cell, steps, log_every, table_precision, threads, comm_precision
    )
    config_path = write_pipeline_config(cell, events, overrides, out / "pipeline.yaml")
    env = base_env()
    env.setdefault("PREFECT_HOME", str(workdir / "prefect"))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, "-m", "flows.cli", "run", str(config_path)]
    command += ["--root", str(workdir / "store"), "--force", "train"]
    started = time.time()
    with (out / "stdout.log").open("wb") as stdout, (out / "stderr.log").open("wb") as stderr:
        finished = subprocess.run(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    run_s = time.time() - started
    if finished.returncode != 0:
        tail = (out / "stderr.log").read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(
            f"`{' '.join(command)}` exited with {finished.returncode} (logs in {out}):\n"
            + "\n".join(tail)
        )
    # The run record's path is the last line `recforge run` prints.
    record_path = Path((out / "stdout.log").read_text().split()[-1])
    record = json.loads(record_path.read_text())
    train = record["stages"]["train"]
    if train["status"] != "ran":
        raise RuntimeError(f"{record_path}: the train stage was {train['status']}, not ran")
    train_dir = Path(train["output"])
    records = [json.loads(line) for line in (train_dir / TRAIN_LOG_FILE).read_text().splitlines()]
    summary = json.loads((train_dir / SUMMARY_FILE).read_text())
    samples_per_window = log_every * cell.batch_size * cell.world_size
    # The launch spec, wherever in its output the stage keeps it.
    launch_specs = sorted(train_dir.rglob(LAUNCH_FILE))
    launch = json.loads(launch_specs[0].read_text()) if launch_specs else {}
    table_sizes = launch.get("model_config", {}).get("table_sizes")
    if table_sizes is not None and tuple(table_sizes) != cell.table_sizes:
        raise RuntimeError(
            f"{train_dir}: recforge's tables have {sum(table_sizes):,} rows, not the cell's "
            f"{sum(cell.table_sizes):,}: the hash_buckets schema no longer sets the table sizes"
        )
    return {
        **steady_figures(records, warmup, samples_per_window, cell.world_size),
        # The train stage's own figure, over every step (the first, slower ones too).
        "summary_samples_per_s": round(summary["samples_per_s"]),
        "ru_maxrss_mb_rank0": round(summary["peak_rss_mb_rank0"], 1),
        # The launch is inside the flow: no clock outside it sees the first step start.
        "time_to_first_step_s": None,
        "rank0_startup_s": summary.get("startup_s"),
        "train_stage_s": round(train["seconds"], 1),
        "run_s": round(run_s, 1),
        "stages": {
            stage: {k: info[k] for k in ("status", "seconds") if k in info}
            for stage, info in record["stages"].items()
        },
        "metrics": record.get("metrics", {}),
        "final_loss": round(summary["final_loss"], 4),
        "threads_per_rank": rank_threads(launch, env),
        # What the shipped config's train.zero_stage came to (the DeepSpeed config's).
        "zero_stage": launch.get("ds_config", {}).get("zero_optimization", {}).get("stage"),
        "table_precision": summary.get("table_precision", "fp32"),
        # What the run says it sent; a tree without the field: what it was configured to.
        "comm_precision": summary.get(
            "comm_precision",
            yaml.safe_load(config_path.read_text())["train"].get(
                "comm_precision", comm_precision_default()
            ),
        ),
        "wire_bytes_per_sample": summary.get("wire_bytes_per_sample"),
        "pipeline_config": str(config_path),
        "run_record": str(record_path),
    }


# -- TorchRec: the parent's side --------------------------------------------------------


def missing_peers() -> list[str]:
    return [name for name in PEER_MODULES if importlib.util.find_spec(name) is None]


def peer_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for dist_name in ("torch", "torchrec", "fbgemm-gpu-cpu", "tensordict", "deepspeed"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            versions[dist_name] = None
    return versions


class RankFailedError(RuntimeError):
    """A TorchRec rank exited with an error; `rank` is the first one seen to fail."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def torchrec_wire_bytes(
    batch_size: int,
    tables_per_rank: list[int],
    embedding_dim: int,
    dense_params: int,
    value_bytes: int = 4,
) -> dict[str, float]:
    """Bytes per sample that TorchRec's collectives send between ranks, by kind.

    Computed from the sizes of the tensors each collective sends, not counted on the
    wire: per rank, the bytes it sends to the other ranks in one step, summed over the
    ranks, over the step's samples (B x W). Table-wise sharding (TorchRec's on CPU), one
    id per feature and sample; rank r owns F_r of the F tables, D = `embedding_dim`:

    - `ids`: the input all-to-all: rank r sends the id (int64) and length (int32) of
      each of its B samples' F - F_r features owned elsewhere to their owner:
      B (F - F_r) x 12 bytes.
    - `rows`: the pooled embeddings' all-to-all, forward: rank r sends the pooled (B,
      F_r, D) vectors of each other rank's samples: (W - 1) B F_r D x `value_bytes`.
    - `row_grads`: their gradients, backward: rank r sends the (B, F - F_r, D) gradients
      of the vectors it received: B (F - F_r) D x `value_bytes`.
    - `dense_allreduce`: DDP's all-reduce of the fp32 dense gradients: a ring all-reduce
      sends 2 (W - 1) / W x the dense parameters' bytes per rank.

    The per-step split sizes (a few ints per feature and rank) are left out. One rank:
    all zero.

    Args:
        batch_size: B, samples per rank per step.
        tables_per_rank: F_r for each rank r (its length is W).
        embedding_dim: D.
        dense_params: Parameters DDP all-reduces (the MLPs: every non-embedding one).
        value_bytes: Bytes of one pooled value or gradient: 4 (fp32), 2 under QComms fp16.

    Returns:
        Bytes per sample: `ids`, `rows`, `row_grads`, `dense_allreduce` and their `total`.
    """
    world_size, features = len(tables_per_rank), sum(tables_per_rank)
    sent = dict.fromkeys(("ids", "rows", "row_grads", "dense_allreduce"), 0.0)
    for own in tables_per_rank:
        sent["ids"] += batch_size * (features - own) * TORCHREC_ID_BYTES
        sent["rows"] += (world_size - 1) * batch_size * own * embedding_dim * value_bytes
        sent["row_grads"] += batch_size * (features - own) * embedding_dim * value_bytes
        sent["dense_allreduce"] += (
            2 * (world_size - 1) / world_size * dense_params * DENSE_VALUE_BYTES
        )
    samples = batch_size * world_size
    per_sample = {kind: value / samples for kind, value in sent.items()}
    return {**per_sample, "total": sum(per_sample.values())}


def torchrec_spec(
    cell: Cell,
    steps: int,
    warmup: int,
    log_every: int,
    threads: int,
    table_precision: str,
    out: Path,
    qcomms: bool,
) -> dict[str, Any]:
    """What each TorchRec rank is told (`--torchrec-rank SPEC`): its data, model and run."""
    return {
        "data_dir": str(cell.data_dir),
        "embedding_dim": cell.embedding_dim,
        "qcomms": qcomms,
        "batch_size": cell.batch_size,
        "steps": steps,
        "warmup": warmup,
        "log_every": log_every,
        "threads": threads,
        "table_precision": table_precision,
        "out": str(out),
    }


def run_torchrec(
    cell: Cell,
    steps: int,
    warmup: int,
    log_every: int,
    threads: int,
    table_precision: str,
    out: Path,
    qcomms: bool = False,
) -> dict[str, Any]:
    """Train `cell` with TorchRec in `cell.world_size` rank processes; rank 0's figures.

    `qcomms`: the pooled embeddings' all-to-all sends fp16 both ways (TorchRec's QComms
    codecs on the sharder), the `qcomms` form; otherwise fp32, the `plain` form.

    Raises:
        RankFailedError: A rank failed (the message has its log's tail); each failed
            rank's first error line is in `out/rank-R.error` (`rank_error`).
    """
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    form = "qcomms" if qcomms else "plain"
    spec = torchrec_spec(cell, steps, warmup, log_every, threads, table_precision, out, qcomms)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    started = time.time()
    ranks: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(cell.world_size):
            env = {
                **base_env(),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(cell.world_size),
                "LOCAL_WORLD_SIZE": str(cell.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1",
            }
            log = out / f"rank-{rank}.log"
            with log.open("wb") as log_file:
                command = [sys.executable, str(Path(__file__).resolve()), "--torchrec-rank"]
                process = subprocess.Popen(
                    [*command, str(spec_path)], env=env, stdout=log_file, stderr=subprocess.STDOUT
                )
            ranks.append((process, log))
        wait_ranks(ranks)
    finally:
        for process, _ in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    launch_to_exit = time.time() - started
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(cell.world_size)]
    first = results[0]
    wire = torchrec_wire_bytes(
        cell.batch_size,
        [r["tables"] for r in results],
        cell.embedding_dim,
        first["dense_params"],
        TORCHREC_VALUE_BYTES[form],
    )
    return {
        "form": form,
        "samples_per_s": round(first["samples_per_s"]),
        "step_ms": first["step_ms"],
        "peak_rss_mb": [r["peak_rss_mb"] for r in results],
        "ru_maxrss_mb": [r["ru_maxrss_mb"] for r in results],
        "time_to_first_step_s": round(first["loop_start_unix"] - started, 1),
        "launch_to_exit_s": round(launch_to_exit, 1),
        "final_loss": first["final_loss"],
        "threads_per_rank": threads,
        "tables_per_rank": [r["tables"] for r in results],
        # What FBGEMM's kernels hold the rows in, read back from the sharded tables.
        "table_dtype": sorted({dtype for r in results for dtype in r["table_dtypes"]}),
        # From the sizes of the tensors the collectives send (torchrec_wire_bytes).
        "wire_bytes_per_sample": {kind: round(value, 2) for kind, value in wire.items()},
    }


def rank_error(out: Path, error: RankFailedError) -> str:
    """The first line of the error that stopped a TorchRec run, as its failed rank wrote it.

    Falls back to any rank's line, then to the first line of `error` itself (a rank killed
    before it could write one).
    """
    named = out / f"rank-{error.rank}.error"
    written = [named] if named.is_file() else sorted(out.glob("rank-*.error"))
    if written:
        return written[0].read_text().strip()
    return str(error).splitlines()[0]


def wait_ranks(ranks: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    """Wait for every rank; the first one to fail stops the rest (raises with its log)."""
    while True:
        codes = [process.poll() for process, _ in ranks]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            process, log = ranks[failed[0]]
            tail = log.read_text(errors="replace").splitlines()[-25:]
            raise RankFailedError(
                f"TorchRec rank {failed[0]} exited with {process.returncode} (log {log}):\n"
                + "\n".join(tail),
                failed[0],
            )
        if all(code == 0 for code in codes):
            return
        time.sleep(0.2)


# -- TorchRec: one rank -----------------------------------------------------------------


class ParquetBatches:
    """One rank's batches of the shard directory, decoded ahead by a thread, endlessly.

    Rank r of W reads files r, r + W, ... (every file with W = 1); a file's last rows
    that do not fill a batch are skipped.

    Yields:
        (dense (B, Dn) float32, values (F * B,) int64 feature-major as a KJT wants them,
        labels (B,) float32).
    """

    def __init__(self, data_dir: Path, rank: int, world_size: int, batch_size: int) -> None:
        dataset = json.loads((data_dir / "dataset.json").read_text())
        self.sparse = [f["name"] for f in dataset["sparse"]]
        self.dense = list(dataset["dense"])
        self.label = dataset["label"]
        files = dataset["splits"]["train"]["files"][rank::world_size]
        self.paths = [data_dir / f["path"] for f in files]
        self.batch_size = batch_size
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=PREFETCH_BATCHES)
        threading.Thread(target=self._decode, daemon=True, name="parquet-batches").start()

    def _decode(self) -> None:
        try:
            while True:
                for path in self.paths:
                    columns = [*self.sparse, *self.dense, self.label]
                    reader = pq.ParquetFile(path)
                    for batch in reader.iter_batches(batch_size=self.batch_size, columns=columns):
                        if batch.num_rows < self.batch_size:
                            continue
                        values = np.concatenate(
                            [batch.column(name).to_numpy() for name in self.sparse]
                        )
                        dense = np.stack([batch.column(n).to_numpy() for n in self.dense], axis=1)
                        labels = batch.column(self.label).to_numpy()
                        self.queue.put(
                            (
                                torch.from_numpy(dense.astype(np.float32)),
                                torch.from_numpy(values.astype(np.int64)),
                                torch.from_numpy(labels.astype(np.float32)),
                            )
                        )
        except Exception as error:  # handed to the training loop, which raises it
            self.queue.put(error)

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item


class PhaseTimer:
    """Seconds spent in a module's forward, summed; its hooks are `start` and `stop`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def start(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def stop(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._started


def torchrec_rank(spec_path: Path) -> None:
    """One TorchRec rank: DLRM with a sharded EBC over gloo; writes `rank-R.json`."""
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    data_dir = Path(spec["data_dir"])
    dataset = json.loads((data_dir / "dataset.json").read_text())
    # The fused kernel (FBGEMM's CPU TBE) stores the rows at the table's data_type and
    # rounds each row update back to it stochastically (its default), as recforge does;
    # the optimizer state stays fp32 and the pooled output is fp32 on both engines.
    data_type = {"fp32": DataType.FP32, "fp16": DataType.FP16}[spec["table_precision"]]
    tables = [
        EmbeddingBagConfig(
            name=f"t_{feature['name']}",
            embedding_dim=spec["embedding_dim"],
            num_embeddings=feature["num_embeddings"],
            feature_names=[feature["name"]],
            data_type=data_type,
        )
        for feature in dataset["sparse"]
    ]
    # On the meta device: DistributedModelParallel materialises each rank's own tables.
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cpu = torch.device("cpu")
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=len(dataset["dense"]),
        dense_arch_layer_sizes=bottom_mlp(spec["embedding_dim"]),
        over_arch_layer_sizes=[*TOP_MLP, 1],
        dense_device=cpu,
    )
    # FBGEMM's EXACT_ROWWISE_ADAGRAD, fused into the embedding backward.
    apply_optimizer_in_backward(
        RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": SPARSE_LR, "eps": EPS}
    )
    constraints = {
        table.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        for table in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    qcomm_codecs_registry = None
    if spec["qcomms"]:
        from torchrec.distributed.fbgemm_qcomm_codec import (
            CommType,
            QCommsConfig,
            get_qcomm_codecs_registry,
        )

        # The pooled embeddings' all-to-all (and its gradients') in fp16; gloo has no bf16.
        qcomm_codecs_registry = get_qcomm_codecs_registry(
            QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16),
            device=cpu,
        )
    sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry)]
    group = dist.group.WORLD
    plan = planner.collective_plan(model, sharders, group)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(group), device=cpu, plan=plan, sharders=sharders
    )
    # Every parameter the fused embedding backward does not update: the MLPs, which DDP
    # all-reduces.
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_optimizer = KeyedOptimizerWrapper(
        dense_params,
        lambda params: torch.optim.AdamW(
            params, lr=DENSE_LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0
        ),
    )
    own_tables = sum(
        rank in (sharding.ranks or [])
        for module_plan in plan.plan.values()
        for sharding in module_plan.values()
    )
    table_dtypes = sorted(
        {
            str(shard.tensor.dtype).removeprefix("torch.")
            for name, value in dmp.state_dict().items()
            if name.endswith(".weight") and isinstance(value, ShardedTensor)
            for shard in value.local_shards()
        }
    )
    # The sharded EBC's forward, all-to-alls included: SparseArch waits for its output.
    lookup = PhaseTimer()
    dmp.module.sparse_arch.register_forward_pre_hook(lookup.start)
    dmp.module.sparse_arch.register_forward_hook(lookup.stop)

    batch_size, steps, warmup = spec["batch_size"], spec["steps"], spec["warmup"]
    keys = [feature["name"] for feature in dataset["sparse"]]
    lengths = torch.ones(len(keys) * batch_size, dtype=torch.int32)
    batches = iter(ParquetBatches(data_dir, rank, world_size, batch_size))
    totals = dict.fromkeys(("data", "lookup", "forward_backward", "optimizer"), 0.0)
    rss_samples: list[float] = []
    loss = torch.zeros(())
    dmp.train()
    dist.barrier()
    loop_start_unix = time.time()
    steady_started = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        dense, values, labels = next(batches)
        features = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
        t1 = time.perf_counter()
        lookup.seconds = 0.0
        logits = dmp(dense, features).squeeze(1)  # (B,)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        t2 = time.perf_counter()
        dense_optimizer.step()
        dense_optimizer.zero_grad()
        t3 = time.perf_counter()
        if step > warmup:
            totals["data"] += t1 - t0
            totals["lookup"] += lookup.seconds
            totals["forward_backward"] += t2 - t1 - lookup.seconds
            totals["optimizer"] += t3 - t2
        if step == warmup:
            steady_started = t3
        if step % spec["log_every"] == 0:
            rss_samples.append(rss_mb())
    steady_seconds = time.perf_counter() - steady_started
    steady_steps = steps - warmup
    step_ms = {k: 1000 * v / steady_steps for k, v in totals.items()}
    result = {
        "rank": rank,
        "tables": own_tables,
        "table_dtypes": table_dtypes,
        "dense_params": sum(param.numel() for param in dense_params.values()),
        "samples_per_s": steady_steps * batch_size * world_size / steady_seconds,
        "step_ms": with_total(step_ms),
        "peak_rss_mb": round(max(rss_samples, default=rss_mb()), 1),
        "ru_maxrss_mb": round(peak_rss_mb(), 1),
        "loop_start_unix": loop_start_unix,
        "final_loss": round(float(loss.detach()), 4),
    }
    (Path(spec["out"]) / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the bench ---------------------------------------------------------------------------


def build_cells(args: argparse.Namespace, steps: int) -> list[Cell]:
    """The cells asked for, their data written (or found) under `args.workdir`."""
    wanted = [name for name in args.cells.split(",") if name]
    unknown = sorted(set(wanted) - set(CELLS))
    if unknown:
        raise SystemExit(f"--cells: unknown {unknown}; choose from {', '.join(CELLS)}")
    # Every cell's data covers its 2-rank run; a 1-process run reads all of it.
    narrow_samples = args.batch_size * 2 * (steps + 10)
    cells = []
    for name in wanted:
        if name.startswith("1000slots"):
            sizes = [args.wide_rows_per_table] * args.wide_features
            samples = args.wide_batch_size * 2 * (steps + 10)
            batch = args.wide_batch_size
        else:
            rows = args.small_rows if name.startswith("1m") else args.large_rows
            sizes, samples, batch = split_rows(rows, args.features), narrow_samples, args.batch_size
        key = f"f{len(sizes)}-rows{sum(sizes)}-n{samples}"
        data_dir = write_shard_dir(args.workdir / "data" / key, sizes, samples)
        world_size = 1 if name.endswith("1proc") else 2
        cells.append(Cell(name, tuple(sizes), world_size, batch, data_dir, args.embedding_dim))
    return cells


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3)


def write_rank_error(spec_path: Path, error: BaseException) -> None:
    """Leave a failed TorchRec rank's first error line beside its log (`rank_error` reads it)."""
    lines = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    out = Path(json.loads(spec_path.read_text())["out"])
    (out / f"rank-{os.environ.get('RANK', '0')}.error").write_text(line + "\n")


def link_rate(text: str) -> str:
    """`--link`'s argparse type: a tc bit rate (`shaped_link.parse_rate`), kept as given."""
    try:
        shaped_link.parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def enter_link(rate: str) -> dict[str, Any]:
    """Re-run this bench inside a loopback shaped to `rate`, or, already inside, check it.

    Outside the link this process is replaced (`shaped_link.run_inside`: exit status 2
    and one line on stderr where no link can be made here). Inside, it returns
    `shaped_link.describe_link()`.

    Raises:
        SystemExit: The link this process runs inside is not `rate`, or is not shaped.
    """
    inside = shaped_link.current_link()
    if inside is None:
        argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        shaped_link.run_inside(rate, argv, flag="--link")
    if inside != shaped_link.parse_rate(rate):
        raise SystemExit(
            f"--link {rate}: this process already runs inside a link of {inside:,} bit/s "
            f"({shaped_link.LINK_ENV} is set): unset {shaped_link.LINK_ENV} to measure a new one"
        )
    described = shaped_link.describe_link()
    if not described["shaped"]:
        raise SystemExit(
            f"--link {rate}: {shaped_link.LINK_ENV} is set but lo has no tbf qdisc "
            f"({described['qdisc']!r}): unset {shaped_link.LINK_ENV} and run again"
        )
    return described


def run_torchrec_forms(
    cell: Cell,
    args: argparse.Namespace,
    thread_counts: list[int],
    log_every: int,
    runs: Path,
) -> dict[str, Any]:
    """TorchRec's runs of `cell`: plain at each thread count, then QComms if asked for.

    Returns:
        The cell entry's TorchRec part: `torchrec` (the fastest form's best run),
        `torchrec_by_threads` (the plain form's runs), `torchrec_by_form` (`plain`, and
        `qcomms` under `--torchrec-qcomms` in a cell of 2 ranks: None where it failed)
        and with it `torchrec_qcomms_error` (the failed rank's first error line, or None).
    """
    precision = args.table_precision
    by_threads = {}
    for threads in thread_counts:
        by_threads[str(threads)] = run_torchrec(
            cell,
            args.steps,
            args.warmup_steps,
            log_every,
            threads,
            precision,
            runs / cell.name / f"torchrec-{threads}t",
        )
        print(f"{cell.name} torchrec {threads}t {json.dumps(by_threads[str(threads)])}", flush=True)
    plain = max(by_threads.values(), key=lambda run: run["samples_per_s"])
    part: dict[str, Any] = {"torchrec_by_threads": by_threads}
    by_form: dict[str, Any] = {"plain": plain}
    # One process sends nothing between ranks: the codecs have nothing to change there.
    if args.torchrec_qcomms and cell.world_size > 1:
        # At the plain form's best thread count: the codecs change what is sent, not the
        # compute that the thread count was chosen for.
        threads = plain["threads_per_rank"]
        out = runs / cell.name / f"torchrec-qcomms-{threads}t"
        try:
            by_form["qcomms"] = run_torchrec(
                cell, args.steps, args.warmup_steps, log_every, threads, precision, out, True
            )
            part["torchrec_qcomms_error"] = None
            print(f"{cell.name} torchrec qcomms {json.dumps(by_form['qcomms'])}", flush=True)
        except RankFailedError as error:
            # Compared without it: the plain form still stands for TorchRec.
            by_form["qcomms"] = None
            part["torchrec_qcomms_error"] = rank_error(out, error)
            print(
                f"{cell.name} torchrec qcomms failed, plain TorchRec compared: "
                f"{part['torchrec_qcomms_error']} (logs in {out})",
                file=sys.stderr,
                flush=True,
            )
    ran = [run for run in by_form.values() if run is not None]
    part["torchrec"] = max(ran, key=lambda run: run["samples_per_s"])
    part["torchrec_by_form"] = by_form
    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchrec-rank", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=REPO / ".bench" / "vs_torchrec")
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=120, help="steps per run")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps left out")
    parser.add_argument("--batch-size", type=int, default=2048, help="rows per rank")
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--small-rows", type=int, default=1_000_000)
    parser.add_argument("--large-rows", type=int, default=20_000_000)
    parser.add_argument("--wide-features", type=int, default=1000)
    parser.add_argument("--wide-rows-per-table", type=int, default=2000)
    parser.add_argument("--wide-batch-size", type=int, default=64, help="rows per rank")
    parser.add_argument(
        "--torchrec-threads", default="1,2", help="threads per TorchRec rank to try; best counts"
    )
    parser.add_argument(
        "--recforge-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for recforge's ranks (default: as shipped, torch's default)",
    )
    parser.add_argument(
        "--table-precision",
        choices=TABLE_PRECISIONS,
        default="fp32",
        help="embedding rows of both engines: recforge's train.table_precision, TorchRec's "
        "EmbeddingBagConfig.data_type",
    )
    parser.add_argument(
        "--via-cli",
        action="store_true",
        help="run recforge through `recforge run` on the shipped CTR config (ingest, "
        "preprocess, shard, train, ...) instead of its train stage's library entry",
    )
    parser.add_argument(
        "--embedding-dim",
        type=int,
        default=EMBEDDING_DIM,
        help="width of every table on both engines (and of the bottom MLP's output)",
    )
    parser.add_argument(
        "--comm-precision",
        choices=COMM_PRECISIONS,
        default=None,
        help="recforge's train.comm_precision: the rows and row gradients its ranks send "
        "(default: recforge's own default)",
    )
    parser.add_argument(
        "--compare-comm-fp32",
        action="store_true",
        help="train recforge once more per cell at comm_precision fp32: "
        "wire_bytes_ratio_vs_fp32_<cell>",
    )
    parser.add_argument(
        "--link",
        type=link_rate,
        default=None,
        metavar="RATE",
        help="run the whole bench inside a network namespace whose loopback is shaped to "
        "RATE (a tc rate: 1gbit, 200mbit); needs root",
    )
    parser.add_argument(
        "--torchrec-qcomms",
        action="store_true",
        help="also run TorchRec with fp16 QComms on its embedding all-to-alls (on under --link)",
    )
    parser.add_argument("--recforge-only", action="store_true", help="no TorchRec; no ratios")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    parser.add_argument("--quick", action="store_true", help="small tables, few steps")
    args = parser.parse_args()
    if args.torchrec_rank is not None:
        try:
            torchrec_rank(args.torchrec_rank)
        except BaseException as error:
            # The parent names a failed form (QComms on gloo) by this line.
            write_rank_error(args.torchrec_rank, error)
            raise
        return
    if args.quick:
        args.small_rows, args.large_rows = 50_000, 400_000
        args.wide_features, args.batch_size, args.wide_batch_size = 100, 512, 32
        args.steps, args.warmup_steps, args.torchrec_threads = 30, 10, "1"
    if not 0 <= args.warmup_steps < args.steps:
        raise SystemExit(f"--warmup-steps must be in [0, --steps={args.steps})")
    if args.embedding_dim < 1:
        raise SystemExit(f"--embedding-dim {args.embedding_dim}: give a width of at least 1")
    if args.compare_comm_fp32 and args.comm_precision == "fp32":
        raise SystemExit(
            "--compare-comm-fp32 compares a run against fp32: give --comm-precision bf16 or "
            "fp16 (or leave it at recforge's default)"
        )
    # Before anything runs: both engines (and `recforge run`'s Prefect server) run inside.
    link = enter_link(args.link) if args.link is not None else None
    args.torchrec_qcomms = args.torchrec_qcomms or args.link is not None
    # A tree whose TrainConfig has no comm_precision yet trains as it always has.
    comm_field = comm_precision_default() is not None
    if args.comm_precision is not None and not comm_field:
        print(
            f"--comm-precision {args.comm_precision}: this tree's TrainConfig has no "
            "comm_precision field; recforge runs as before (its comm_precision figure is null)",
            file=sys.stderr,
        )
    comm_precision = args.comm_precision if comm_field else None
    missing = missing_peers()
    if missing and not args.recforge_only:
        print(
            f"bench/vs_torchrec.py: TorchRec is not installed ({', '.join(missing)} missing "
            f"in {sys.executable}); {INSTALL_HINT}",
            file=sys.stderr,
        )
        sys.exit(2)
    thread_counts = [int(t) for t in args.torchrec_threads.split(",") if t]
    # Progress windows must end at the warm-up's last step and at the run's.
    log_every = math.gcd(args.warmup_steps, args.steps, 10)
    loadavg_before = os.getloadavg()
    cells = build_cells(args, args.steps)
    runs = args.workdir / "runs"
    precision = args.table_precision

    def recforge_run(
        cell: Cell, steps: int, warmup: int, every: int, out: Path, comm: str | None
    ) -> dict[str, Any]:
        threads = args.recforge_threads
        if args.via_cli:
            cli_root = args.workdir / "cli"
            return run_recforge_cli(
                cell, steps, warmup, every, threads, precision, cli_root, out, comm
            )
        return run_recforge(cell, steps, warmup, every, threads, precision, out, comm)

    if not args.no_warmup:
        first = cells[0]
        recforge_run(first, 4, 0, 2, runs / "warmup-recforge", comm_precision)
        if not args.recforge_only:
            run_torchrec(first, 4, 0, 2, thread_counts[0], precision, runs / "warmup-torchrec")

    figures: dict[str, Any] = {}
    cell_figures: dict[str, Any] = {}
    link_bit_per_s = shaped_link.current_link() if link is not None else None
    for cell in cells:
        recforge = recforge_run(
            cell,
            args.steps,
            args.warmup_steps,
            log_every,
            runs / cell.name / "recforge",
            comm_precision,
        )
        print(f"{cell.name} recforge {json.dumps(recforge)}", flush=True)
        entry: dict[str, Any] = {"recforge": recforge, "rows": sum(cell.table_sizes)}
        figures[f"link_utilisation_{cell.name}"] = link_utilisation(recforge, link_bit_per_s)
        fp32_total = None
        # Without the field both runs would be the same run: nothing to compare.
        if args.compare_comm_fp32 and comm_field:
            at_fp32 = recforge_run(
                cell,
                args.steps,
                args.warmup_steps,
                log_every,
                runs / cell.name / "recforge-comm-fp32",
                "fp32",
            )
            print(f"{cell.name} recforge comm fp32 {json.dumps(at_fp32)}", flush=True)
            entry["recforge_comm_fp32"] = at_fp32
            fp32_total = wire_total(at_fp32)
        total = wire_total(recforge)
        figures[f"wire_bytes_ratio_vs_fp32_{cell.name}"] = (
            ratio(total, fp32_total) if total is not None and fp32_total else None
        )
        if not args.recforge_only:
            entry |= run_torchrec_forms(cell, args, thread_counts, log_every, runs)
            torchrec = entry["torchrec"]
            figures[f"vs_torchrec_{cell.name}"] = ratio(
                recforge["samples_per_s"], torchrec["samples_per_s"]
            )
            figures[f"rss_ratio_vs_torchrec_{cell.name}"] = ratio(
                max(recforge["peak_rss_mb"]), max(torchrec["peak_rss_mb"])
            )
            # None under --via-cli: the launch is inside the flow.
            figures[f"first_step_ratio_vs_torchrec_{cell.name}"] = (
                ratio(recforge["time_to_first_step_s"], torchrec["time_to_first_step_s"])
                if recforge["time_to_first_step_s"] is not None
                else None
            )
        else:
            for prefix in ("vs_torchrec", "rss_ratio_vs_torchrec", "first_step_ratio_vs_torchrec"):
                figures[f"{prefix}_{cell.name}"] = None
        cell_figures[cell.name] = entry

    print()
    print(
        "cell              engine           samples/s  step ms  peak RSS MB/rank  first step s"
        "  wire B/sample"
    )
    for name, entry in cell_figures.items():
        for engine in ("recforge", "torchrec"):
            if engine in entry:
                run = entry[engine]
                first_step = run["time_to_first_step_s"]
                wire = wire_total(run)
                # TorchRec's figure is its faster form's.
                label = f"{engine} ({run['form']})" if "form" in run else engine
                print(
                    f"{name:<17} {label:<16} {run['samples_per_s']:>9,} "
                    f"{run['step_ms']['total']:>8.1f}  {max(run['peak_rss_mb']):>16,.0f}"
                    f"  {'-' if first_step is None else f'{first_step:.1f}':>12}"
                    f"  {'-' if wire is None else f'{wire:,.0f}':>13}"
                )
    if args.recforge_only:
        print("recforge only (--recforge-only): no TorchRec run, every ratio is null")
    figures.update(
        {
            "cells": cell_figures,
            "table_precision": precision,
            "recforge_entry": (
                f"recforge run ({SHIPPED_CTR_CONFIG.relative_to(REPO)})"
                if args.via_cli
                else "training.ctr.train.train_model"
            ),
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "batch_size_per_rank": args.batch_size,
            "wide_batch_size_per_rank": args.wide_batch_size,
            "features": args.features,
            "wide_features": args.wide_features,
            "wide_rows_per_table": args.wide_rows_per_table,
            "embedding_dim": args.embedding_dim,
            # What was asked for (None: recforge's default); each run says what it sent.
            "comm_precision": args.comm_precision,
            "link_mbit": None if link_bit_per_s is None else link_bit_per_s / 1e6,
            # Read after the runs: its counters are every byte the loopback carried.
            "link": shaped_link.describe_link() if link is not None else None,
            "torchrec_qcomms": args.torchrec_qcomms and not args.recforge_only,
            "recforge_threads": args.recforge_threads,
            "torchrec_threads_tried": thread_counts,
            "versions": peer_versions(),
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in loadavg_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "quick": args.quick,
        }
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
