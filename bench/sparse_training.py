"""Benchmark: the sharded embedding engine against table size, dense Adam and its reader.

Writes synthetic shard directories (dataset.json + Parquet, no pipeline) with
`--features` single-valued sparse features whose tables hold N rows in all, ids drawn
uniformly over each whole table (the harshest case for memory locality), two dense
features and a click label from a fixed logistic model. Every run trains the same
DLRM (dot interaction) through the real stack: `training.ctr.train.train_model`, the
DeepSpeed launcher, `--world-size` gloo ranks, ZeRO-2 on the dense part.

Figures (steady state = the median of the logging windows after the first two):

- `step_time_ratio_20m_vs_1m`: sharded engine (row-wise Adagrad) step time at N = 20M
  over N = 1M, same batch size and model. Target <= 1.3.
- `speedup_vs_dense_adam_10m`: at N = 10M, step time of `embeddings: dense`
  (nn.EmbeddingBag in the DeepSpeed module, dense AdamW) over the sharded engine's.
  Target >= 5.
- `reader_to_trainer_ratio`: rows/s of one rank's `ShardReader` alone over the rows/s
  one rank consumes while training (1M run). Target >= 5. `data_wait_share` is the
  share of the trainer's step time spent waiting for the reader.

Usage::

    .venv/bin/python bench/sparse_training.py                # full (about 6 minutes)
    .venv/bin/python bench/sparse_training.py --quick        # small tables, smoke test

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.config import TrainConfig  # noqa: E402
from training.ctr.data import load_dataset_meta  # noqa: E402
from training.ctr.reader import ShardReader, measure_throughput  # noqa: E402
from training.ctr.train import train_model  # noqa: E402
from training.runtime.files import TRAIN_LOG_FILE  # noqa: E402

ROW_GROUP = 65_536


def write_shard_dir(root: Path, total_rows: int, num_features: int, num_samples: int) -> Path:
    """A shard directory whose tables sum to `total_rows` rows; cached by name."""
    if (root / "dataset.json").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sizes = [total_rows // num_features] * num_features
    sizes[0] += total_rows - sum(sizes)
    files = []
    num_files = 4
    for index in range(num_files):
        rows = num_samples // num_files
        columns: dict[str, np.ndarray] = {}
        logit = np.full(rows, -1.0)
        for f, size in enumerate(sizes):
            ids = rng.integers(0, size, rows, dtype=np.int64)
            columns[f"f{f}"] = ids
            # A learnable signal that does not need a table-sized weight vector.
            logit += 0.5 * np.sin(ids * 0.618 + f)
        for d in range(2):
            values = rng.normal(size=rows).astype(np.float32)
            columns[f"d{d}"] = values
            logit += 0.3 * values
        columns["click"] = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        path = f"train-{index:05d}-of-{num_files:05d}.parquet"
        pq.write_table(pa.table(columns), root / path, row_group_size=ROW_GROUP)
        files.append({"path": path, "rows": rows})
    dataset = {
        "label": "click",
        "sparse": [{"name": f"f{f}", "num_embeddings": n} for f, n in enumerate(sizes)],
        "dense": ["d0", "d1"],
        "splits": {"train": {"files": files, "rows": sum(f["rows"] for f in files)}},
    }
    (root / "dataset.json").write_text(json.dumps(dataset))
    return root


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_run(shards: Path, out: Path, config: TrainConfig) -> dict:
    """Train; return the steady-state step time and throughput from the progress log."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.monotonic()
    result = train_model(config, shards, out, "cpu", free_port(), env)
    records = [json.loads(line) for line in (out / TRAIN_LOG_FILE).read_text().splitlines()]
    steady = records[2:] or records
    step_ms = [sum(r["step_ms"].values()) for r in steady]
    return {
        "step_ms": statistics.median(step_ms),
        "phase_ms": {
            phase: statistics.median(r["step_ms"][phase] for r in steady)
            for phase in steady[0]["step_ms"]
        },
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "rss_mb": max(max(r["rss_mb"]) for r in steady),
        "steps": result.steps,
        "launch_seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / ".bench" / "sparse_training")
    parser.add_argument("--small-rows", type=int, default=1_000_000)
    parser.add_argument("--large-rows", type=int, default=20_000_000)
    parser.add_argument("--dense-rows", type=int, default=10_000_000)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--dense-steps", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="tiny tables and few steps")
    args = parser.parse_args()
    if args.quick:
        args.small_rows, args.large_rows, args.dense_rows = 50_000, 400_000, 200_000
        args.steps, args.dense_steps = 30, 12
    num_samples = args.batch_size * args.world_size * (args.steps + 10)
    base = TrainConfig(
        interaction="dot",
        embedding_dim=16,
        bottom_mlp=[32, 16],
        top_mlp=[64, 32],
        batch_size=args.batch_size,
        lr=0.001,
        zero_stage=2,
        world_size=args.world_size,
        log_every=10,
        tensorboard=False,
    )
    work = args.workdir
    small = write_shard_dir(
        work / f"rows-{args.small_rows}", args.small_rows, args.features, num_samples
    )
    large = write_shard_dir(
        work / f"rows-{args.large_rows}", args.large_rows, args.features, num_samples
    )
    mid = write_shard_dir(
        work / f"rows-{args.dense_rows}", args.dense_rows, args.features, num_samples
    )

    runs = {
        "sparse_small": train_run(
            small, work / "out-small", base.model_copy(update={"max_steps": args.steps})
        ),
        "sparse_large": train_run(
            large, work / "out-large", base.model_copy(update={"max_steps": args.steps})
        ),
        "sparse_mid": train_run(
            mid, work / "out-mid", base.model_copy(update={"max_steps": args.steps})
        ),
        "dense_mid": train_run(
            mid,
            work / "out-dense",
            base.model_copy(
                update={"max_steps": args.dense_steps, "embeddings": "dense", "log_every": 4}
            ),
        ),
    }
    for name, run in runs.items():
        print(name, json.dumps(run), flush=True)

    meta = load_dataset_meta(small)
    with ShardReader(
        small, meta, "train", 0, args.world_size, args.batch_size, args.world_size
    ) as reader:
        measure_throughput(reader, 5)  # warm the page cache and the decoder
    with ShardReader(
        small, meta, "train", 0, args.world_size, args.batch_size, args.world_size
    ) as reader:
        reader_rows_per_s = measure_throughput(reader, min(args.steps, reader.steps_per_epoch))
    trainer_rows_per_s_per_rank = runs["sparse_small"]["samples_per_s"] / args.world_size
    small_run = runs["sparse_small"]
    figures = {
        "step_time_ratio_20m_vs_1m": round(
            runs["sparse_large"]["step_ms"] / small_run["step_ms"], 3
        ),
        "speedup_vs_dense_adam_10m": round(
            runs["dense_mid"]["step_ms"] / runs["sparse_mid"]["step_ms"], 2
        ),
        "reader_to_trainer_ratio": round(reader_rows_per_s / trainer_rows_per_s_per_rank, 2),
        "data_wait_share": round(small_run["phase_ms"]["data"] / small_run["step_ms"], 4),
        "reader_rows_per_s": round(reader_rows_per_s),
        "trainer_rows_per_s_per_rank": round(trainer_rows_per_s_per_rank),
        "step_ms": {name: round(run["step_ms"], 2) for name, run in runs.items()},
        "phase_ms": {name: run["phase_ms"] for name, run in runs.items()},
        "rss_mb_max_rank": {name: run["rss_mb"] for name, run in runs.items()},
        "rows": {
            "small": args.small_rows,
            "large": args.large_rows,
            "dense_comparison": args.dense_rows,
        },
        "batch_size_per_rank": args.batch_size,
        "world_size": args.world_size,
        "features": args.features,
        "embedding_dim": base.embedding_dim,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
