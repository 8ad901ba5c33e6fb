"""Benchmark: differential, asynchronous resume checkpoints (issue 41) against whole ones.

A resume checkpoint of a large sharded table writes every row, and the ranks wait for
it: at 20M rows of dim 16 that is ~1.4 GB on disk and seconds of stalled training each
time, so a short interval (what bounds the work a crash loses) costs throughput and
disk. Issue 41's checkpoints write a base (every row) and then deltas (only the rows
changed since the checkpoint before, keyed by global row), the deltas in the
background while training goes on. This bench measures what that saves, and that a
run killed in the middle of writing one still resumes to bitwise the same model.

Data and model: a synthetic shard directory (`bench/vs_torchrec.py`'s
`write_shard_dir`: 8 single-valued features whose tables sum to `--rows`, 20M, split
by `split_rows`; `--samples` rows, 4,194,304, about three intervals of training before
the reader cycles; a click label from a fixed logistic model), with ids drawn from a
bounded Zipf law of exponent 1.1 over each whole table (`zipf_exponent`: a few hot
ids, a long tail; uniform ids would make every delta as large as the rows a batch can
touch), cached under `--workdir`/data. The model is `bench/vs_torchrec.py`'s DLRM: dot
interaction, embedding_dim 16, bottom MLP [32, 16], top MLP [64, 32], row-wise Adagrad
rows (lr 0.05), AdamW dense side (lr 1e-3); 2 ranks (`world_size` 2, `embeddings:
sharded`), ZeRO 0 (DeepSpeed's torch Adam, as every CPU config: the train stage's
DeepSpeed config always sets `torch_adam`), `--batch-size` 2,048 rows per rank,
`train.seed` = `--seed`. No memory budget is passed: ZeRO 0 is set, not chosen.

Runs, one after the other (each with its own output and checkpoint root under
`--workdir`/runs and `--workdir`/roots; the heavy files are deleted once measured):

0. `calibration`: 60 steps without resume checkpoints; its median progress window
   (the first, warm-up, left out) gives steps/s, and `--minutes` of training at that
   speed is the step count S of both phases (`--steps` sets S instead). Both phases run
   the same S steps: the same work, so bytes, stalls and speed compare like with like.
   A phase stops at its last step rather than at a clock, because only a run that ends
   writes `train_summary.json` (a SIGTERM at the time limit would save one more
   checkpoint and stop with `Preempted`, and no summary).
1. `sync_full`: today's behaviour. A resume checkpoint every `--interval-s` seconds
   (`checkpoint_every_s`; `checkpoint_every` 0), each whole (`checkpoint_max_deltas`
   0) and written while the ranks wait (`checkpoint_async` false).
2. `async_delta`: the defaults (`checkpoint_max_deltas` 8, `checkpoint_rebase_share`
   0.5, `checkpoint_async` true) at the same interval: a base first, then deltas
   written in the background.

   Both keep every checkpoint (`keep_checkpoints` = S) so that each one's bytes can be
   measured: bytes per checkpoint = the sizes of every file in its committed
   `step-*` directory (the dense part, the RNG states and reader position, the
   embedding shards, the manifest); a delta is one whose manifest meta has a `chain`.
   The stalls (seconds rank 0's training loop paused for each save, the wait for a
   previous save still in flight included) and the background write times come from
   `train_summary.json`'s `resume_checkpoints`.
3. `kill` (unless `--skip-kill`): `checkpoint_every` K = `--kill-every-steps` (20)
   steps, no time trigger, the async defaults but `checkpoint_rebase_share` 1000 (a
   chain may hold up to 1,000 tables' rows, so its shape does not depend on how many
   rows K steps touch: a base at K, deltas at 2K, 3K, 4K, 5K). An uninterrupted
   reference run of 6K steps; then a run with
   `RECFORGE_CHAOS_CHECKPOINT_FAULT=mid-file@5K`, where rank 0's background writer
   SIGKILLs the whole launch once its delta shard file of step 5K is on disk, before
   the commit: it must fail (`TrainingCrashed`); then a run on the same checkpoint root,
   which must resume from step 4K (the newest committed checkpoint: the third delta on
   the base of K) and go on to 6K. Its `model.safetensors` is compared tensor by tensor
   with the reference's. Same data as the phases (`--rows`).

Why `training.ctr.train.train_model` (the train stage's library entry, what the train
task of `recforge run` calls with the same arguments) rather than `recforge run`: the
kill must land in the middle of writing one chosen checkpoint, which only the chaos
hook in the `env` the library takes can do (a signal from outside lands wherever the
run happens to be); the runs need an explicit checkpoint root, to list what each
wrote and to resume the killed run from; and the phases differ only in train fields
the stage's cache key leaves out (`NOT_IN_CACHE_KEY`), so through the pipeline the
second would be a cache hit or, forced, would resume the first's checkpoints from the
root the train task keeps per key.

Figures (the last line, one JSON object; MB = 10^6 bytes):

- `delta_bytes_ratio`: the mean bytes of `async_delta`'s delta checkpoints over the
  mean bytes of `sync_full`'s checkpoints. Target <= 0.2.
- `stall_ratio`: `async_delta`'s longest stall for a delta over `sync_full`'s longest
  stall (its checkpoints are bases of chains of one: kind `base`; `whole` in a run
  without chains). Target <= 0.1.
- `resume_bitwise`: the killed and resumed run's weights equal the reference's, bit for
  bit (null under `--skip-kill`); with `kill_resumed_from_step` (target 4K), and
  under `kill` the committed steps and kinds the crash left (`checkpoints_left`).
- `checkpoint_mb_per_min_sync_full`, `checkpoint_mb_per_min_async_delta`: MB the
  phase's checkpoints wrote per minute of training (the summary's `seconds`: the step
  loop, stalls and the wait for the last background save included).
- `work_lost_on_sigkill_s`: the most training time a SIGKILL can lose under
  `async_delta`: the interval plus its longest background write. The timer restarts when
  a save's foreground part ends, and training goes on while the files are written, so a
  kill just before the next save commits loses the interval and that save's write
  time, all of it spent training. `work_lost_on_sigkill_s_sync_full`: the interval
  (training is paused while a whole checkpoint is written, so the lost wall time is
  longer by the stall, but the lost training is not).
- `samples_per_s_sync_full`, `samples_per_s_async_delta` (the summary's: every step,
  stalls included) and `speed_ratio_async_vs_sync`.
- `phases` (each phase's checkpoints, bytes, stalls and summary figures), `kill`
  (with `fault_landed_in`: "delta" where the kill hit the background writer, as
  designed), `calibration`, `notes` (also on stderr: where a run did not go as
  designed, e.g. a table so small that every save rebased), the inputs, `seconds` (the
  whole bench), `cpus` and `loadavg` before and after: the machine is shared, so only
  figures within one run compare.

Usage::

    .venv/bin/python bench/checkpoint.py       # 20M rows, 5 min per phase: ~18 min
                                               # (estimated) on a 2-core box; sync_full
                                               # keeps ~10 whole checkpoints of ~1.4 GB
    .venv/bin/python bench/checkpoint.py --skip-kill --minutes 2
    .venv/bin/python bench/checkpoint.py --rows 2000000 --samples 400000 --minutes 0.5 \\
        --interval-s 2 --kill-every-steps 5   # a smoke run: ~3 min

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
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

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from artifacts.checkpoints import (  # noqa: E402
    CHAIN,
    MANIFEST,
    STAGING,
    checkpoint_name,
    parse_step,
)
from bench.vs_torchrec import (  # noqa: E402
    DENSE_LR,
    EMBEDDING_DIM,
    SPARSE_LR,
    TOP_MLP,
    base_env,
    bottom_mlp,
    free_port,
    split_rows,
    write_shard_dir,
)
from training.config import TrainConfig  # noqa: E402
from training.ctr.train import train_model  # noqa: E402
from training.errors import TrainingCrashed  # noqa: E402
from training.runtime.files import (  # noqa: E402
    CHECKPOINT_DIR,
    LAUNCHER_LOG_FILE,
    SUMMARY_FILE,
    TRAIN_LOG_FILE,
    WEIGHTS_FILE,
)
from training.runtime.launcher import CHAOS_CHECKPOINT_FAULT  # noqa: E402
from training.runtime.rank import sparse_delta_file, sparse_file  # noqa: E402

PHASES = ("sync_full", "async_delta")
FEATURES = 8
WORLD_SIZE = 2
ZIPF_EXPONENT = 1.1
CALIBRATION_STEPS = 60
LOG_EVERY = 10
# The kill test's run length and fault, in checkpoint intervals K: a base at K, deltas
# at 2K..5K; the fault at 5K, the reference and the resumed run end at 6K.
KILL_FAULT_AT = 5
KILL_RUN_LENGTH = 6
MB = 1e6


class BenchFailed(RuntimeError):
    """A run of the bench failed or did not do what the bench needs of it."""


def bench_config(batch_size: int, seed: int, **update: Any) -> TrainConfig:
    """bench/vs_torchrec.py's DLRM on 2 ranks at ZeRO 0, with `update` over it."""
    base: dict[str, Any] = {
        "interaction": "dot",
        "embedding_dim": EMBEDDING_DIM,
        "bottom_mlp": bottom_mlp(EMBEDDING_DIM),
        "top_mlp": TOP_MLP,
        "batch_size": batch_size,
        "lr": DENSE_LR,
        "sparse_optimizer": "rowwise_adagrad",
        "sparse_lr": SPARSE_LR,
        "embeddings": "sharded",
        "world_size": WORLD_SIZE,
        "zero_stage": 0,
        "log_every": LOG_EVERY,
        "tensorboard": False,
        "seed": seed,
    }
    return TrainConfig(**{**base, **update})


def phase_update(phase: str, interval_s: float, steps: int) -> dict[str, Any]:
    """The train fields of `phase` (`PHASES`) over `bench_config`.

    Both: a checkpoint every `interval_s` seconds and none by steps, every one kept.
    `sync_full`: whole checkpoints written in the foreground; `async_delta`: the
    defaults of the chain fields.
    """
    update: dict[str, Any] = {
        "max_steps": steps,
        "checkpoint_every": 0,
        "checkpoint_every_s": interval_s,
        # At most one checkpoint a step: every one is kept, to be measured.
        "keep_checkpoints": steps,
    }
    if phase == "sync_full":
        update |= {"checkpoint_max_deltas": 0, "checkpoint_async": False}
    elif phase != "async_delta":
        raise ValueError(f"phase {phase!r}: expected one of {PHASES}")
    return update


def kill_update(every_steps: int) -> dict[str, Any]:
    """The kill test's train fields: a checkpoint every K steps, a chain of 4 deltas."""
    return {
        "max_steps": KILL_RUN_LENGTH * every_steps,
        "checkpoint_every": every_steps,
        "checkpoint_every_s": 0.0,
        # Every checkpoint up to the fault stays in one chain, however many rows K
        # steps touch (a small table would otherwise be rebased part way).
        "checkpoint_rebase_share": 1000.0,
    }


# -- measuring ----------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_checkpoints(root: Path) -> list[dict[str, Any]]:
    """The committed checkpoints under `root`, by step: {"step", "kind", "bytes"}.

    Committed: a `step-*` directory with its manifest (a save in flight is under
    `.staging`). "kind": "delta" where the manifest's meta has a chain, else "full"
    (with "delta_rows": the changed rows of all ranks, for a delta).
    """
    found = []
    for path in root.glob("step-*"):
        step = parse_step(path.name)
        if step is None or not (path / MANIFEST).is_file():
            continue
        meta = json.loads((path / MANIFEST).read_text())["meta"]
        entry: dict[str, Any] = {"step": step, "kind": "delta" if CHAIN in meta else "full"}
        if CHAIN in meta:
            entry["delta_rows"] = int(meta["delta_rows"])
        found.append({**entry, "bytes": dir_bytes(path)})
    return sorted(found, key=lambda c: c["step"])


def mean_bytes(checkpoints: list[dict[str, Any]], kind: str) -> float | None:
    sizes = [c["bytes"] for c in checkpoints if c["kind"] == kind]
    return statistics.fmean(sizes) if sizes else None


def phase_figures(checkpoints: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """A phase's figures from its committed checkpoints and its `train_summary.json`."""
    total = sum(c["bytes"] for c in checkpoints)
    minutes = summary["seconds"] / 60
    return {
        "steps": summary["steps"],
        "train_s": round(summary["seconds"], 1),
        "samples_per_s": round(summary["samples_per_s"]),
        "checkpoints": checkpoints,
        "count": {kind: sum(c["kind"] == kind for c in checkpoints) for kind in ("full", "delta")},
        "mean_full_bytes": mean_bytes(checkpoints, "full"),
        "mean_delta_bytes": mean_bytes(checkpoints, "delta"),
        "checkpoint_bytes": total,
        "checkpoint_mb_per_min": round(total / MB / minutes, 1) if minutes > 0 else None,
        "resume_checkpoints": summary.get("resume_checkpoints"),
        "final_loss": round(summary["final_loss"], 4),
    }


def full_stall(resume_checkpoints: dict[str, Any] | None) -> float | None:
    """The longest stall for a checkpoint that wrote every row: a base's, or a whole one's."""
    for kind in ("base", "whole"):
        figures = (resume_checkpoints or {}).get(kind)
        if figures:
            return float(figures["stall_s_max"])
    return None


def ratio(numerator: float | None, denominator: float | None, digits: int = 4) -> float | None:
    """numerator / denominator, rounded; None where either is missing or the denominator 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, digits)


def summarize(
    phases: dict[str, dict[str, Any]], interval_s: float, kill: dict[str, Any] | None
) -> dict[str, Any]:
    """The headline figures from the phases' figures (`phase_figures`) and the kill test's.

    Args:
        phases: "sync_full" and "async_delta" figures.
        interval_s: The phases' checkpoint interval.
        kill: `measure_kill`'s result, or None (skipped).
    """
    sync, delta = phases["sync_full"], phases["async_delta"]
    delta_checkpoints = (delta["resume_checkpoints"] or {}).get("delta")
    background = (delta["resume_checkpoints"] or {}).get("background_write_s_max")
    return {
        "delta_bytes_ratio": ratio(delta["mean_delta_bytes"], sync["mean_full_bytes"]),
        "stall_ratio": ratio(
            None if delta_checkpoints is None else float(delta_checkpoints["stall_s_max"]),
            full_stall(sync["resume_checkpoints"]),
        ),
        "resume_bitwise": None if kill is None else kill["resume_bitwise"],
        "kill_resumed_from_step": None if kill is None else kill["resumed_from_step"],
        "checkpoint_mb_per_min_sync_full": sync["checkpoint_mb_per_min"],
        "checkpoint_mb_per_min_async_delta": delta["checkpoint_mb_per_min"],
        "work_lost_on_sigkill_s": (
            None if background is None else round(interval_s + float(background), 2)
        ),
        "work_lost_on_sigkill_s_sync_full": interval_s,
        "samples_per_s_sync_full": sync["samples_per_s"],
        "samples_per_s_async_delta": delta["samples_per_s"],
        "speed_ratio_async_vs_sync": ratio(delta["samples_per_s"], sync["samples_per_s"]),
    }


def steps_per_s(records: list[dict[str, Any]], samples_per_step: int) -> float:
    """Steps a second: the median progress window after the first (the warm-up)."""
    steady = records[1:] or records
    return statistics.median(r["samples_per_s"] for r in steady) / samples_per_step


def phase_steps(minutes: float, rate: float) -> int:
    """Steps that take `minutes` at `rate` steps/s; at least two progress windows."""
    return max(math.ceil(minutes * 60 * rate), 2 * LOG_EVERY)


def same_weights(expected: Path, actual: Path) -> bool:
    """Whether two safetensors files hold the same tensors, bit for bit (one at a time)."""
    with safe_open(str(expected), "pt") as left, safe_open(str(actual), "pt") as right:
        if set(left.keys()) != set(right.keys()):
            return False
        for name in left.keys():
            a, b = left.get_tensor(name), right.get_tensor(name)
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            # As bytes: a NaN equals itself, and -0.0 differs from 0.0.
            if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                return False
    return True


def fault_landed_in(root: Path, step: int) -> str | None:
    """What the save of `step` that a mid-file fault killed had written: "delta" or
    "base" (rank 0's embedding shard of that kind is in the staging directory, and no
    manifest), else None (the run died some other way)."""
    staging = root / STAGING / checkpoint_name(step)
    if (staging / MANIFEST).exists():
        return None
    for kind, name in (
        ("delta", sparse_delta_file(0, WORLD_SIZE)),
        ("base", sparse_file(0, WORLD_SIZE)),
    ):
        if (staging / name).is_file():
            return kind
    return None


# -- running -----------------------------------------------------------------------------


def drop_heavy_files(out: Path, root: Path | None) -> None:
    """A run's checkpoints and weights (GBs at 20M rows); its logs and summary stay."""
    (out / WEIGHTS_FILE).unlink(missing_ok=True)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def train(
    label: str,
    config: TrainConfig,
    data: Path,
    out: Path,
    root: Path,
    env: dict[str, str] | None = None,
) -> Any:
    """One `train_model` run into `out` (replaced), its checkpoints under `root` (a
    run resumes what `root` holds); its `TrainResult`.

    Raises:
        BenchFailed: The run failed (with where its log is).
    """
    shutil.rmtree(out, ignore_errors=True)
    try:
        return train_model(
            config, data, out, "cpu", free_port(), env or base_env(), checkpoint_root=root
        )
    except TrainingCrashed as error:
        raise BenchFailed(
            f"the {label} run failed: {error}\n(its log: {out / LAUNCHER_LOG_FILE})"
        ) from error


def read_summary(out: Path) -> dict[str, Any]:
    return json.loads((out / SUMMARY_FILE).read_text())


def calibrate(data: Path, workdir: Path, batch_size: int, seed: int) -> dict[str, Any]:
    """The calibration run: steps/s without resume checkpoints."""
    out = workdir / "runs" / "calibration"
    root = workdir / "roots" / "calibration"
    shutil.rmtree(root, ignore_errors=True)
    config = bench_config(
        batch_size,
        seed,
        max_steps=CALIBRATION_STEPS,
        checkpoint_every=0,
        checkpoint_every_s=0.0,
    )
    train("calibration", config, data, out, root)
    records = [json.loads(line) for line in (out / TRAIN_LOG_FILE).read_text().splitlines()]
    rate = steps_per_s(records, batch_size * WORLD_SIZE)
    drop_heavy_files(out, root)
    return {"steps": CALIBRATION_STEPS, "steps_per_s": round(rate, 3)}


def measure_phase(
    phase: str, data: Path, workdir: Path, batch_size: int, seed: int, interval_s: float, steps: int
) -> dict[str, Any]:
    """One phase's run; its figures (`phase_figures`)."""
    out = workdir / "runs" / phase
    root = workdir / "roots" / phase
    shutil.rmtree(root, ignore_errors=True)
    config = bench_config(batch_size, seed, **phase_update(phase, interval_s, steps))
    train(phase, config, data, out, root)
    figures = phase_figures(list_checkpoints(root), read_summary(out))
    drop_heavy_files(out, root)
    return figures


def measure_kill(
    data: Path, workdir: Path, batch_size: int, seed: int, every_steps: int
) -> dict[str, Any]:
    """The kill test: reference, a run killed mid-write of step 5K's delta, its resume.

    Raises:
        BenchFailed: A run failed, or the killed run did not.
    """
    config = bench_config(batch_size, seed, **kill_update(every_steps))
    runs, roots = workdir / "runs", workdir / "roots"
    for name in ("kill-reference", "kill"):
        shutil.rmtree(roots / name, ignore_errors=True)
    reference_out = runs / "kill-reference"
    train("kill reference", config, data, reference_out, roots / "kill-reference")
    fault_step = KILL_FAULT_AT * every_steps
    killed_out = runs / "kill-killed"
    env = {**base_env(), CHAOS_CHECKPOINT_FAULT: f"mid-file@{fault_step}"}
    shutil.rmtree(killed_out, ignore_errors=True)
    try:
        train_model(
            config, data, killed_out, "cpu", free_port(), env, checkpoint_root=roots / "kill"
        )
    except TrainingCrashed:
        pass  # rank 0 SIGKILLed the launch, as asked
    else:
        raise BenchFailed(
            f"the run with {CHAOS_CHECKPOINT_FAULT}=mid-file@{fault_step} finished instead of "
            f"being killed while writing step {fault_step}'s checkpoint (log: "
            f"{killed_out / LAUNCHER_LOG_FILE})"
        )
    landed = fault_landed_in(roots / "kill", fault_step)
    if landed is None:
        raise BenchFailed(
            f"the run with {CHAOS_CHECKPOINT_FAULT}=mid-file@{fault_step} failed before its "
            f"save of step {fault_step} had written rank 0's embedding shard (log: "
            f"{killed_out / LAUNCHER_LOG_FILE})"
        )
    left = [{k: c[k] for k in ("step", "kind", "bytes")} for c in list_checkpoints(roots / "kill")]
    resumed_out = runs / "kill-resumed"
    resumed = train("resumed", config, data, resumed_out, roots / "kill")
    expected_step = (KILL_FAULT_AT - 1) * every_steps
    bitwise = same_weights(reference_out / WEIGHTS_FILE, resumed_out / WEIGHTS_FILE)
    result = {
        "every_steps": every_steps,
        "steps": KILL_RUN_LENGTH * every_steps,
        "fault": f"mid-file@{fault_step}",
        "fault_landed_in": landed,
        "checkpoints_left": left,
        "resumed_from_step": resumed.resumed_from_step,
        "expected_resume_step": expected_step,
        "resume_bitwise": bitwise,
    }
    for out in (reference_out, killed_out, resumed_out):
        drop_heavy_files(out, None)
    for name in ("kill-reference", "kill"):
        shutil.rmtree(roots / name, ignore_errors=True)
    return result


# -- the bench ---------------------------------------------------------------------------


def notes(phases: dict[str, dict[str, Any]], kill: dict[str, Any] | None) -> list[str]:
    """What a reader of the figures must know where a run did not go as designed."""
    found = []
    delta = phases["async_delta"]
    if not delta["count"]["delta"]:
        found.append(
            "async_delta wrote no delta checkpoint (delta_bytes_ratio, stall_ratio and "
            "work_lost_on_sigkill_s are null or say nothing of deltas): each interval "
            "touched more rows than checkpoint_rebase_share of the table, or the run held "
            "one checkpoint; raise --rows or --minutes, or shorten --interval-s"
        )
    if kill is not None:
        if kill["fault_landed_in"] != "delta":
            found.append(
                f"the kill test's fault landed in a {kill['fault_landed_in']} (written in the "
                "foreground), not in the background writer of a delta: the chain's deltas "
                "held more rows than the table (a small --rows for --kill-every-steps)"
            )
        if kill["resumed_from_step"] != kill["expected_resume_step"]:
            found.append(
                f"the killed run resumed from step {kill['resumed_from_step']}, not from "
                f"{kill['expected_resume_step']}, the newest checkpoint committed before the fault"
            )
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's arguments, checked."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / ".bench" / "checkpoint")
    parser.add_argument("--rows", type=int, default=20_000_000, help="table rows in all")
    parser.add_argument(
        "--samples", type=int, default=4_194_304, help="rows of the synthetic shard directory"
    )
    parser.add_argument("--batch-size", type=int, default=2048, help="rows per rank per step")
    parser.add_argument(
        "--minutes", type=float, default=5.0, help="training time of each phase (calibrated)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps of each phase (default: from --minutes)"
    )
    parser.add_argument(
        "--interval-s", type=float, default=30.0, help="the phases' checkpoint_every_s"
    )
    parser.add_argument("--seed", type=int, default=0, help="train.seed of every run")
    parser.add_argument(
        "--kill-every-steps", type=int, default=20, help="the kill test's checkpoint_every (K)"
    )
    parser.add_argument("--skip-kill", action="store_true", help="no kill test")
    args = parser.parse_args(argv)
    if args.rows < FEATURES:
        parser.error(f"--rows {args.rows}: need at least one row per feature ({FEATURES})")
    if args.samples < args.batch_size * WORLD_SIZE:
        parser.error(f"--samples {args.samples}: need at least one step's rows")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: give at least 1")
    if not args.minutes > 0 or not args.interval_s > 0:
        parser.error("--minutes and --interval-s must be > 0")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    if args.kill_every_steps < 1:
        parser.error(f"--kill-every-steps {args.kill_every_steps}: give at least 1")
    args.workdir = args.workdir.resolve()
    return args


def describe_phase(name: str, figures: dict[str, Any]) -> str:
    """One readable line of a phase's figures."""
    stalls = figures["resume_checkpoints"] or {}
    stall = ", ".join(
        f"{kind} stall max {stalls[kind]['stall_s_max']:.2f} s"
        for kind in ("whole", "base", "delta")
        if kind in stalls
    )
    background = stalls.get("background_write_s_max")

    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value / MB:,.1f} MB"

    return (
        f"{name}: {figures['count']['full']} full ({mb(figures['mean_full_bytes'])} each) + "
        f"{figures['count']['delta']} delta ({mb(figures['mean_delta_bytes'])} each) "
        f"checkpoints, {figures['checkpoint_mb_per_min']} MB/min; {stall or 'no stalls'}"
        + ("" if background is None else f", background write max {background:.2f} s")
        + f"; {figures['samples_per_s']:,} samples/s over {figures['train_s']} s "
        f"({figures['steps']} steps)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loadavg_before = os.getloadavg()
    started = time.monotonic()
    sizes = split_rows(args.rows, FEATURES)
    key = f"f{FEATURES}-rows{args.rows}-n{args.samples}-zipf{ZIPF_EXPONENT}"
    data = write_shard_dir(args.workdir / "data" / key, sizes, args.samples, ZIPF_EXPONENT)
    print(f"data: {data} ({time.monotonic() - started:.1f} s)", flush=True)
    try:
        calibration = None
        steps = args.steps
        if steps is None:
            calibration = calibrate(data, args.workdir, args.batch_size, args.seed)
            steps = phase_steps(args.minutes, calibration["steps_per_s"])
            print(f"calibration: {json.dumps(calibration)}; {steps} steps a phase", flush=True)
        phases = {}
        for phase in PHASES:
            phases[phase] = measure_phase(
                phase, data, args.workdir, args.batch_size, args.seed, args.interval_s, steps
            )
            print(describe_phase(phase, phases[phase]), flush=True)
        kill = None
        if not args.skip_kill:
            kill = measure_kill(
                data, args.workdir, args.batch_size, args.seed, args.kill_every_steps
            )
            print(
                f"kill: killed at {kill['fault']}, left {kill['checkpoints_left']}, resumed from "
                f"step {kill['resumed_from_step']} (expected {kill['expected_resume_step']}), "
                f"bitwise {kill['resume_bitwise']}",
                flush=True,
            )
    except BenchFailed as error:
        raise SystemExit(f"bench/checkpoint.py: {error}") from None
    figures = summarize(phases, args.interval_s, kill)
    caveats = notes(phases, kill)
    for line in caveats:
        print(f"note: {line}", file=sys.stderr)
    figures.update(
        {
            "notes": caveats,
            "phases": phases,
            "kill": kill,
            "calibration": calibration,
            "rows": args.rows,
            "table_sizes": sizes,
            "samples": args.samples,
            "zipf_exponent": ZIPF_EXPONENT,
            "embedding_dim": EMBEDDING_DIM,
            "world_size": WORLD_SIZE,
            "batch_size_per_rank": args.batch_size,
            "minutes": args.minutes,
            "steps_per_phase": steps,
            "interval_s": args.interval_s,
            "kill_every_steps": None if args.skip_kill else args.kill_every_steps,
            "seed": args.seed,
            "seconds": round(time.monotonic() - started, 1),
            "cpus": os.cpu_count(),
            "loadavg": {
                "before": [round(x, 2) for x in loadavg_before],
                "after": [round(x, 2) for x in os.getloadavg()],
            },
        }
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
