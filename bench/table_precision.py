"""Benchmark: train.table_precision (fp16, bf16, int8 rows) against fp32 rows.

What a 2-byte or 8-bit table costs in model quality and speed, and what it saves in
memory and on disk, measured through recforge as a user runs it. Four parts:

1. `bytes`: a `ShardedEmbedding` of `--bytes-rows` rows (dim 16, row-wise Adagrad) per
   precision; bytes per row = the nbytes of its per-row state tensors (rows, optimizer
   state and, for int8, the fp32 (scale, bias)) over the rows.
2. `speed` (and checkpoints): a synthetic shard directory (`bench/vs_torchrec.py`'s
   `write_shard_dir`: 8 single-valued features whose tables sum to `--speed-rows`, 20M,
   ids uniform over each whole table, a click label from a fixed logistic model) trained
   by the train stage's library entry (`training.ctr.train.train_model`, what the train
   task calls, with the task's memory budget, `training.stages.memory_budget`) in one
   process, the config's defaults otherwise (threads as shipped): DLRM dot interaction,
   embedding_dim 16, bottom MLP [32, 16], top MLP [64, 32], 2,048 rows a step,
   `--speed-steps` steps. The machine is shared and noisy, so the precisions run in a
   palindrome (fp32 fp16 bf16 int8 int8 bf16 fp16 fp32, `--speed-passes` 2): each one
   twice, drifts cancel. samples/s = the median of the steady
   progress windows (`train_log.jsonl`, 10 steps each) after `--warmup-steps`, both runs
   pooled: a window slowed by another process moves a median less than a mean (with 2
   OpenMP threads on 2 busy cores a window can be 10x slower). Each run saves one
   resume checkpoint (`train.checkpoint_every` = steps - 1; the last window, which
   holds it, is left out of the speed); its sparse shard file's size and the whole
   checkpoint's are the checkpoint figures.
3. `largest`: `--largest-rows` rows (200M, 8 features, dim 16) at fp16 in one process,
   `--largest-steps` steps on ids hashed uniformly over the table (the same writer), the
   rest as in `speed`, no resume checkpoint. Measured: rank 0's lifetime peak RSS
   (`train_summary.json`'s `peak_rss_mb_rank0`, which includes the end of the run: the
   final checkpoint and model.safetensors), the largest RSS sampled while training (the
   progress records), and the planner's figure for the same config
   (`training.ctr.memory.plan_memory(...).total` as the train stage calls it: the run's
   resolved `train_config.json`, one process, the dense parameter count of its
   `model_config.json`). The run's heavy files (final checkpoint and model.safetensors,
   about 3 x the table) are deleted once measured, unless `--keep`.
4. `quality`: `make demo`'s data (`recforge generate configs/demo.yaml` with
   `generate.num_rows` = `--auc-rows`) and `recforge run configs/demo.yaml` with
   `--set train.table_precision=P --set train.seed=S` for each seed and precision (12
   runs), on one artifact root, so ingest, preprocess and shard run once and are cached
   for the rest; the test AUC is the run record's `metrics.auc` (the evaluate stage on
   the test split). The first run forces train (a bench rerun on the same root trains
   again); the others are `--only train,evaluate` (export skipped: it does not change
   the AUC). The runs go through `flows.cli.main`, the `recforge` command's own entry,
   in this process: one Prefect temporary server and one import of the stack for all
   of them, where 12 `recforge` processes would pay ~25 s each on a 2-core machine (5
   of the 20 minutes) for nothing the figures depend on.

Figures (the last line, one JSON object; GB = 10^9 bytes):

- `auc_delta_{fp16,bf16,int8}`: test AUC minus fp32's at the same seed, the mean over
  the seeds. Targets: fp16, bf16 >= -0.001; int8 >= -0.002.
- `bytes_per_row_ratio_{fp16,bf16,int8}`: table plus optimizer-state bytes per row over
  fp32's. Targets: fp16 <= 0.55, int8 <= 0.45.
- `checkpoint_bytes_ratio_{fp16,bf16,int8}`: bytes on disk of the resume checkpoint's
  sparse shard file over fp32's (`checkpoint_total_bytes_ratio_*`: the whole checkpoint
  directory). Target fp16 <= 0.6.
- `speed_ratio_{fp16,bf16,int8}`: steady samples/s over fp32's. Target fp16 >= 0.95.
- `largest_rows`, `largest_steps`, `largest_peak_rss_gb`, `largest_train_rss_gb`,
  `largest_planner_gb`, `planner_rss_error` (|planner - peak| / peak, target <= 0.10),
  `largest_planner_components_gb` (the plan's parts) and
  `largest_planner_vs_measured_gb` (table and optimizer state / the rest while training
  / growth at the end of the run, planned and measured) to say which part the planner
  misses when it does.
- The inputs (rows, dims, seeds, steps) and `seconds` per part.

Usage::

    .venv/bin/python bench/table_precision.py            # all parts: ~15 min on a busy
                                                         # 2-core box (8 GB RAM at peak)
    .venv/bin/python bench/table_precision.py --parts largest           # ~3 min
    .venv/bin/python bench/table_precision.py --parts bytes,speed --precisions fp32,fp16
    .venv/bin/python bench/table_precision.py --quick    # tiny sizes, 1 seed: ~3 min

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# First, so that `data_prep` is the package and not bench/data_prep.py beside this file.
sys.path.insert(0, str(REPO))

from bench.vs_torchrec import base_env, free_port, split_rows, write_shard_dir  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.ctr.data import load_dataset_meta  # noqa: E402
from training.ctr.embedding import ShardedEmbedding  # noqa: E402
from training.ctr.memory import plan_memory  # noqa: E402
from training.ctr.model import build_arch  # noqa: E402
from training.ctr.train import train_model  # noqa: E402
from training.runtime.files import (  # noqa: E402
    CHECKPOINT_DIR,
    MEMORY_PLAN_FILE,
    MODEL_CONFIG_FILE,
    SUMMARY_FILE,
    TRAIN_CONFIG_FILE,
    TRAIN_LOG_FILE,
    WEIGHTS_FILE,
)
from training.runtime.rank import sparse_file  # noqa: E402
from training.stages import memory_budget  # noqa: E402

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
PARTS = ("bytes", "speed", "largest", "quality")
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
EMBEDDING_DIM = 16
FEATURES = 8
GB = 1e9
MiB = 2**20


def synthetic_config(**update: Any) -> TrainConfig:
    """The speed and largest parts' model (bench/vs_torchrec.py's), one process."""
    base = {
        "interaction": "dot",
        "embedding_dim": EMBEDDING_DIM,
        "bottom_mlp": [32, 16],
        "top_mlp": [64, 32],
        "batch_size": 2048,
        "lr": 1e-3,
        "sparse_optimizer": "rowwise_adagrad",
        "sparse_lr": 0.05,
        "world_size": 1,
        "log_every": 10,
        "tensorboard": False,
    }
    return TrainConfig(**{**base, **update})


def budget(config: TrainConfig) -> tuple[int, str]:
    """The memory budget the train task gives the train stage (its check refuses what
    does not fit, and train.zero_stage: auto is resolved against it)."""
    return memory_budget(config, "cpu")


def read_progress(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / TRAIN_LOG_FILE).read_text().splitlines()]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def safetensors_nbytes(path: Path) -> dict[str, tuple[list[int], int]]:
    """{tensor: (shape, nbytes)} from a safetensors file's header (no tensor is read)."""
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
    return {
        name: (entry["shape"], entry["data_offsets"][1] - entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def drop_heavy_files(out: Path) -> None:
    """A train output's checkpoints and weights (GBs at these table sizes); keeps the logs."""
    (out / WEIGHTS_FILE).unlink(missing_ok=True)
    for name in (CHECKPOINT_DIR, "resume"):
        shutil.rmtree(out / name, ignore_errors=True)


# -- part 1: bytes per row ----------------------------------------------------------------


def measure_row_bytes(precisions: list[str], rows: int) -> dict[str, dict[str, float]]:
    """Per precision: bytes per row of each per-row state tensor of a `ShardedEmbedding`."""
    result = {}
    for precision in precisions:
        store = ShardedEmbedding(
            [rows], EMBEDDING_DIM, "rowwise_adagrad", 0.05, table_precision=precision
        )
        per_row = {
            name: tensor.nbytes / rows
            for name, tensor in store.state_dict().items()
            if tensor.dim() and tensor.shape[0] == rows
        }
        result[precision] = {**per_row, "total": sum(per_row.values())}
        del store
    return result


# -- part 2: speed and checkpoints --------------------------------------------------------


def speed_run(data: Path, out: Path, precision: str, steps: int, warmup: int) -> dict[str, Any]:
    """One 1-process run at `precision`: steady throughput and its resume checkpoint's bytes."""
    config = synthetic_config(
        table_precision=precision, max_steps=steps, checkpoint_every=steps - 1
    )
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    train_model(config, data, out, "cpu", free_port(), base_env(), memory_budget=budget(config))
    seconds = time.monotonic() - started
    records = read_progress(out)
    # Left out: the warm-up, and the last window (it holds the resume checkpoint's save).
    steady = [r for r in records if warmup < r["step"] < steps]
    checkpoint = out / "resume" / f"step-{steps - 1:08d}"
    shard = checkpoint / sparse_file(0, 1)
    tensors = safetensors_nbytes(shard)
    rows = tensors["weight"][0][0]
    summary = json.loads((out / SUMMARY_FILE).read_text())
    result = {
        "precision": precision,
        "window_samples_per_s": [round(r["samples_per_s"]) for r in steady],
        "samples_per_s": round(statistics.median(r["samples_per_s"] for r in steady)),
        "step_ms": {k: round(v, 2) for k, v in summary["step_ms"].items()},
        "checkpoint_sparse_bytes": shard.stat().st_size,
        "checkpoint_total_bytes": dir_bytes(checkpoint),
        "checkpoint_bytes_per_row": {
            name: nbytes / rows for name, (shape, nbytes) in tensors.items() if shape[:1] == [rows]
        },
        "table_init_s": summary["startup_s"].get("table_init"),
        "launch_to_exit_s": round(seconds, 1),
        "final_loss": round(summary["final_loss"], 4),
    }
    drop_heavy_files(out)
    return result


def measure_speed(
    workdir: Path, precisions: list[str], rows: int, steps: int, warmup: int, passes: int
) -> dict[str, Any]:
    """`passes` runs of every precision, in palindromes; per precision the pooled figures."""
    batch = synthetic_config().batch_size
    data = write_shard_dir(
        workdir / "data" / f"f{FEATURES}-rows{rows}-n{batch * (steps + 10)}",
        split_rows(rows, FEATURES),
        batch * (steps + 10),
    )
    # fp32 fp16 bf16 int8 int8 bf16 fp16 fp32 ...: a drift of the machine's speed over
    # the part weighs on every precision alike.
    order = [p for i in range(passes) for p in (precisions if i % 2 == 0 else precisions[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
    for index, precision in enumerate(order):
        out = workdir / "runs" / f"speed-{index}-{precision}"
        run = speed_run(data, out, precision, steps, warmup)
        print(f"speed run {index + 1}/{len(order)} {json.dumps(run)}", flush=True)
        runs[precision].append(run)
    pooled = {}
    for precision, both in runs.items():
        windows = [rate for r in both for rate in r["window_samples_per_s"]]
        pooled[precision] = {
            "samples_per_s": round(statistics.median(windows)),
            "best_window_samples_per_s": max(windows),
            "samples_per_s_runs": [r["samples_per_s"] for r in both],
            "checkpoint_sparse_bytes": both[0]["checkpoint_sparse_bytes"],
            "checkpoint_total_bytes": both[0]["checkpoint_total_bytes"],
            "checkpoint_bytes_per_row": both[0]["checkpoint_bytes_per_row"],
            "step_ms_runs": [r["step_ms"] for r in both],
            "launch_to_exit_s_runs": [r["launch_to_exit_s"] for r in both],
        }
    return {"order": order, "by_precision": pooled}


# -- part 3: the largest table ------------------------------------------------------------


def measure_largest(workdir: Path, rows: int, steps: int, keep: bool) -> dict[str, Any]:
    """Train `rows` fp16 rows for `steps` steps in one process; its memory and the plan's."""
    config = synthetic_config(
        table_precision="fp16",
        max_steps=steps,
        checkpoint_every=0,
        checkpoint_every_s=0.0,  # no resume checkpoint: it would write the table once more
    )
    sizes = split_rows(rows, FEATURES)
    samples = config.batch_size * (steps + 10)
    data = write_shard_dir(workdir / "data" / f"f{FEATURES}-rows{rows}-n{samples}", sizes, samples)
    out = workdir / "runs" / "largest"
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    train_model(config, data, out, "cpu", free_port(), base_env(), memory_budget=budget(config))
    seconds = time.monotonic() - started
    summary = json.loads((out / SUMMARY_FILE).read_text())
    records = read_progress(out)
    # The planner as the train stage calls it (`training.ctr.train`), on the config the
    # run resolved (train_config.json: e.g. zero_stage auto made a stage).
    meta = load_dataset_meta(data)
    resolved = TrainConfig.model_validate_json((out / TRAIN_CONFIG_FILE).read_text())
    model_config = json.loads((out / MODEL_CONFIG_FILE).read_text())
    num_dense_params = sum(p.numel() for p in build_arch(model_config).parameters())
    plan = plan_memory(resolved, meta.table_sizes, len(meta.dense), num_dense_params, 1, "cpu")
    stage_plan = json.loads((out / MEMORY_PLAN_FILE).read_text())
    peak = summary["peak_rss_mb_rank0"] * MiB
    train_rss = max(max(r["rss_mb"]) for r in records) * MiB
    # What the table and its optimizer state measure at this size (part 1's layout).
    table_bytes = measure_row_bytes(["fp16"], 1 << 16)["fp16"]
    state_bytes = rows * table_bytes["total"]
    measured = {
        # The rows and their optimizer state, at the bytes per row measured in part 1.
        "table_and_state": state_bytes,
        # Everything else resident while training: interpreter, torch, DeepSpeed, the
        # dense model, activations, reader.
        "rest_while_training": train_rss - state_bytes,
        # Growth after the last step: the final checkpoint and model.safetensors.
        "end_of_run": peak - train_rss,
    }
    parts = plan.per_rank
    table_part = parts["embeddings"] + parts["sparse_optimizer"] + parts.get("admission", 0)
    planned = {
        "table_and_state": table_part,
        "rest_while_training": plan.total - table_part - parts["consolidation"],
        "end_of_run": parts["consolidation"],
    }
    result = {
        "rows": rows,
        "table_sizes": sizes,
        "steps": summary["steps"],
        "peak_rss_gb": round(peak / GB, 3),
        "train_rss_gb": round(train_rss / GB, 3),
        "planner_gb": round(plan.total / GB, 3),
        # What the train stage planned when it launched (the same function, at launch).
        "train_stage_planner_gb": round(stage_plan["total_per_rank_bytes"] / GB, 3),
        # The train stage's notes on its plan (e.g. the rows that fit the budget).
        "planner_notes": stage_plan.get("notes", []),
        "planner_rss_error": round(abs(plan.total - peak) / peak, 4),
        "planner_components_gb": {k: round(v / GB, 4) for k, v in plan.per_rank.items()},
        # Where planner and measurement part, in the same three groups (GB).
        "planner_vs_measured_gb": {
            group: {"planner": round(planned[group] / GB, 3), "measured": round(b / GB, 3)}
            for group, b in measured.items()
        },
        "samples_per_s": round(summary["samples_per_s"]),
        "startup_s": summary["startup_s"],
        "train_seconds": round(summary["seconds"], 1),
        "launch_to_exit_s": round(seconds, 1),
        "final_loss": round(summary["final_loss"], 4),
    }
    if not keep:
        drop_heavy_files(out)
    return result


# -- part 4: test AUC through `recforge run` ------------------------------------------------


def recforge(argv: list[str], log: Path) -> str:
    """`recforge ARGV` in this process (`flows.cli.main`); its stdout, also appended to `log`."""
    from flows.cli import main as recforge_main

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = recforge_main(argv)
    with log.open("a") as file:
        file.write(f"$ recforge {' '.join(argv)}\n{captured.getvalue()}\n")
    if code != 0:
        raise RuntimeError(f"recforge {' '.join(argv)} exited with {code}; see {log}")
    return captured.getvalue()


def generate_demo(raw: Path, rows: int, log: Path) -> dict[str, Any]:
    """`recforge generate configs/demo.yaml` at `rows` rows into `raw`; kept if it matches."""
    from flows.config import load_config

    overrides = [f"generate.out={raw}", f"generate.num_rows={rows}"]
    wanted = load_config(DEMO_CONFIG, overrides).generate
    bayes_path = raw / "_bayes.json"
    if bayes_path.is_file():
        bayes = json.loads(bayes_path.read_text())
        if bayes.get("config") == wanted.model_dump(mode="json"):
            return bayes
    recforge(["generate", str(DEMO_CONFIG), *[a for o in overrides for a in ("--set", o)]], log)
    return json.loads(bayes_path.read_text())


def measure_quality(
    workdir: Path, precisions: list[str], seeds: list[int], rows: int
) -> dict[str, Any]:
    """Test AUC of `recforge run configs/demo.yaml` per seed and precision."""
    # The stages' progress bars and plans go to the log; Prefect's INFO lines are noise here.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "recforge.log"
    raw = workdir / "raw"
    bayes = generate_demo(raw, rows, log)
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        for precision in precisions:
            selection = ["--force", "train"] if not runs else ["--only", "train,evaluate"]
            argv = [
                "run", str(DEMO_CONFIG), "--root", str(workdir / "store"),
                "--set", f"ingest.path={raw}",
                "--set", f"train.seed={seed}",
                "--set", f"train.table_precision={precision}",
                *selection,
            ]  # fmt: skip
            started = time.monotonic()
            record_path = recforge(argv, log).strip().splitlines()[-1]
            record = json.loads(Path(record_path).read_text())
            train = record["stages"]["train"]
            run = {
                "seed": seed,
                "precision": precision,
                "auc": record["metrics"]["auc"],
                "logloss": record["metrics"]["logloss"],
                "test_rows": record["metrics"].get("num_rows"),
                "stages": {name: info["status"] for name, info in record["stages"].items()},
                "train_steps": train.get("steps"),
                "train_seconds": round(train["seconds"], 1),
                "seconds": round(time.monotonic() - started, 1),
                "record": record_path,
            }
            count = f"{len(runs) + 1}/{len(seeds) * len(precisions)}"
            print(f"quality run {count} {json.dumps(run)}", flush=True)
            runs.append(run)
    auc = {(r["seed"], r["precision"]): r["auc"] for r in runs}
    deltas = {
        precision: [auc[seed, precision] - auc[seed, "fp32"] for seed in seeds]
        for precision in precisions
        if precision != "fp32"
    }
    return {
        "runs": runs,
        "auc_by_precision": {
            p: round(statistics.mean(auc[s, p] for s in seeds), 5) for p in precisions
        },
        "auc_deltas": {p: [round(d, 5) for d in ds] for p, ds in deltas.items()},
        "bayes_auc_test": bayes.get("bayes_auc_test"),
        "generated_rows": bayes.get("num_rows"),
    }


# -- the bench ------------------------------------------------------------------------------


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / ".bench" / "table_precision")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset")
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="fp32 and any of fp16, bf16, int8"
    )
    parser.add_argument(
        "--seeds", default=None, help="train.seed of the quality runs (default 0,1,2; --quick 0)"
    )
    parser.add_argument("--auc-rows", type=int, default=1_000_000, help="generate.num_rows")
    parser.add_argument("--bytes-rows", type=int, default=1 << 20)
    parser.add_argument("--speed-rows", type=int, default=20_000_000)
    parser.add_argument("--speed-steps", type=int, default=120)
    parser.add_argument("--warmup-steps", type=int, default=20, help="speed: steps left out")
    parser.add_argument(
        "--speed-passes", type=int, default=2, help="speed: runs of each precision, alternating"
    )
    parser.add_argument("--largest-rows", type=int, default=200_000_000)
    parser.add_argument("--largest-steps", type=int, default=100)
    parser.add_argument("--keep", action="store_true", help="keep the largest run's files")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps")
    args = parser.parse_args()
    if args.quick:
        args.auc_rows, args.bytes_rows = 40_000, 1 << 14
        args.speed_rows, args.speed_steps, args.warmup_steps = 200_000, 30, 10
        args.speed_passes = 1
        args.largest_rows, args.largest_steps = 400_000, 20
    parts = [p for p in args.parts.split(",") if p]
    precisions = [p for p in args.precisions.split(",") if p]
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if s]
    if set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if "fp32" not in precisions or set(precisions) - set(PRECISIONS):
        raise SystemExit(f"--precisions: fp32 and any of {PRECISIONS[1:]}, got {precisions}")
    # One steady progress window at least: the last one holds the resume checkpoint.
    if not 0 <= args.warmup_steps <= args.speed_steps - 2 * synthetic_config().log_every:
        raise SystemExit("--warmup-steps: leave at least two progress windows of --speed-steps")
    precisions = [p for p in PRECISIONS if p in precisions]  # fp32 first
    workdir = args.workdir.resolve()
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    loadavg_before = os.getloadavg()

    if "bytes" in parts:
        started = time.monotonic()
        row_bytes = measure_row_bytes(precisions, args.bytes_rows)
        details["bytes_per_row"] = row_bytes
        for p in precisions[1:]:
            figures[f"bytes_per_row_ratio_{p}"] = ratio(
                row_bytes[p]["total"], row_bytes["fp32"]["total"]
            )
        seconds["bytes"] = round(time.monotonic() - started, 1)

    if "speed" in parts:
        started = time.monotonic()
        speed = measure_speed(
            workdir,
            precisions,
            args.speed_rows,
            args.speed_steps,
            args.warmup_steps,
            args.speed_passes,
        )
        details["speed"] = speed
        by = speed["by_precision"]
        for p in precisions[1:]:
            figures[f"speed_ratio_{p}"] = ratio(by[p]["samples_per_s"], by["fp32"]["samples_per_s"])
            figures[f"checkpoint_bytes_ratio_{p}"] = ratio(
                by[p]["checkpoint_sparse_bytes"], by["fp32"]["checkpoint_sparse_bytes"]
            )
            figures[f"checkpoint_total_bytes_ratio_{p}"] = ratio(
                by[p]["checkpoint_total_bytes"], by["fp32"]["checkpoint_total_bytes"]
            )
        seconds["speed"] = round(time.monotonic() - started, 1)

    if "largest" in parts:
        started = time.monotonic()
        largest = measure_largest(workdir, args.largest_rows, args.largest_steps, args.keep)
        details["largest"] = largest
        figures.update(
            {
                "largest_rows": largest["rows"],
                "largest_steps": largest["steps"],
                "largest_peak_rss_gb": largest["peak_rss_gb"],
                "largest_train_rss_gb": largest["train_rss_gb"],
                "largest_planner_gb": largest["planner_gb"],
                "planner_rss_error": largest["planner_rss_error"],
                "largest_planner_components_gb": largest["planner_components_gb"],
                "largest_planner_vs_measured_gb": largest["planner_vs_measured_gb"],
            }
        )
        seconds["largest"] = round(time.monotonic() - started, 1)

    if "quality" in parts:
        started = time.monotonic()
        quality = measure_quality(workdir / "quality", precisions, seeds, args.auc_rows)
        details["quality"] = quality
        for p, deltas in quality["auc_deltas"].items():
            figures[f"auc_delta_{p}"] = round(statistics.mean(deltas), 5)
        seconds["quality"] = round(time.monotonic() - started, 1)

    print()
    print_table(precisions, details)
    figures.update(
        {
            "details": details,
            "inputs": {
                "precisions": precisions,
                "seeds": seeds,
                "auc_rows": args.auc_rows,
                "bytes_rows": args.bytes_rows,
                "speed_rows": args.speed_rows,
                "speed_steps": args.speed_steps,
                "warmup_steps": args.warmup_steps,
                "speed_passes": args.speed_passes,
                "largest_rows": args.largest_rows,
                "largest_steps": args.largest_steps,
                "features": FEATURES,
                "embedding_dim": EMBEDDING_DIM,
                "batch_size": synthetic_config().batch_size,
                "quick": args.quick,
            },
            "seconds": {**seconds, "total": round(sum(seconds.values()), 1)},
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in loadavg_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        }
    )
    print(json.dumps(figures))


def print_table(precisions: list[str], details: dict[str, Any]) -> None:
    """The figures per precision, for a person; the JSON line below has them all."""
    print("precision  bytes/row  ckpt sparse MB  samples/s  test AUC (mean)  AUC delta (mean)")
    for p in precisions:
        row_bytes = details.get("bytes_per_row", {}).get(p, {}).get("total")
        speed = details.get("speed", {}).get("by_precision", {}).get(p, {})
        quality = details.get("quality", {})
        auc = quality.get("auc_by_precision", {}).get(p)
        deltas = quality.get("auc_deltas", {}).get(p)
        cells = [
            f"{row_bytes:9.1f}" if row_bytes is not None else f"{'-':>9}",
            f"{speed['checkpoint_sparse_bytes'] / 1e6:14.1f}" if speed else f"{'-':>14}",
            f"{speed['samples_per_s']:9,}" if speed else f"{'-':>9}",
            f"{auc:15.5f}" if auc is not None else f"{'-':>15}",
            f"{statistics.mean(deltas):+16.5f}" if deltas else f"{'-':>16}",
        ]
        print(f"{p:<9}  " + "  ".join(cells))
    largest = details.get("largest")
    if largest:
        print(
            f"largest: {largest['rows']:,} fp16 rows x {EMBEDDING_DIM}, {largest['steps']} steps: "
            f"peak RSS {largest['peak_rss_gb']:.2f} GB ({largest['train_rss_gb']:.2f} GB while "
            f"training), planner {largest['planner_gb']:.2f} GB, error "
            f"{largest['planner_rss_error']:.1%}"
        )


if __name__ == "__main__":
    main()
