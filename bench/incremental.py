"""Benchmark: a daily incremental chain against a frozen model and a full retrain.

`configs/daily.yaml`'s synthetic days (`--days` + 1 daily partitions with drift: a share
`--churn` of the item catalogue replaced by new items every day, a random walk of item
popularity), then for each day d of the first `--days`, through the real pipeline flow
and that config's model and gate (ingest, preprocess, shard, DCN-v2 on 2 CPU DeepSpeed
ranks, evaluate, export, gate):

- **incremental**: `ingest.partition=dt=<d>`, `train.init: champion`, `preprocess.ttl`:
  day 1 starts the chain, each later day extends the champion's transform and
  warm-starts from its weights and sparse optimizer state, trains one epoch on day d
  alone, and is promoted when the gate passes (the next day starts from the champion
  either way);
- **frozen**: the chain's day-1 model, never updated;
- **full retrain**: a model trained from scratch on every day so far (one epoch over
  days 1..d; its valid and test splits are the same last 6% of day d as the chain's,
  so both hold out the same tail of day d).

Each day's three models are scored by their own exported packages (`score.py`, the raw
records through each model's transform) on the whole next day, d + 1: AUC there is the
figure a serving model is judged by.

Per day the table shows next-day AUC of each arm, train seconds (the ranks' training
loop, `train_summary.json` `seconds`; and the train stage's wall time with process
start-up), and embedding rows (the sum of the tables' sizes).

Last-line figures (day = the last day):

- `auc_gap_vs_full_retrain`: full retrain AUC minus incremental AUC (target <= 0.002);
- `time_ratio_vs_full_retrain`: incremental over full-retrain training-loop seconds
  (target <= 0.3); `wall_ratio_vs_full_retrain`: the same with the stage's wall time,
  whose fixed start-up (launcher, imports, rendezvous: about 8 s here) does not grow
  with the data;
- `auc_gain_vs_frozen`: incremental AUC minus the frozen model's;
- `rows_ratio_day7_vs_day1`: the chain's embedding rows on the last day over day 1's
  (target <= 1.2 under churn).

Usage::

    .venv/bin/python bench/incremental.py            # 7 days of 200k rows
    .venv/bin/python bench/incremental.py --quick    # 3 days of 20k rows, smoke test

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pv

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from artifacts.registry import Registry  # noqa: E402
from data_prep.synthetic import GenerateConfig, generate_logs  # noqa: E402
from flows.config import load_config  # noqa: E402
from flows.pipeline import RunParams, pipeline  # noqa: E402
from training.ctr.metrics import roc_auc  # noqa: E402
from training.ctr.package_scorer import PackageScorer  # noqa: E402

# The days, the model and the gate (it lets a day through unless it is clearly worse
# than the champion on the day's own test rows).
CONFIG = str(REPO / "configs" / "daily.yaml")
SCORE_BATCH = 20_000


def common(args: argparse.Namespace) -> list[str]:
    """Overrides of every run: a batch for the day's size."""
    return [f"train.batch_size={args.batch_size}"]


def run(root: Path, overrides: list[str]) -> dict:
    params = RunParams(config=CONFIG, root=str(root), overrides=overrides)
    return json.loads(Path(pipeline(**params.model_dump())).read_text())


def train_seconds(record: dict) -> tuple[float, float]:
    """(the ranks' training loop seconds, the train stage's wall seconds) of a run."""
    summary_path = Path(record["stages"]["train"]["output"]) / "train_summary.json"
    summary = json.loads(summary_path.read_text())
    return float(summary["seconds"]), float(record["stages"]["train"]["seconds"])


def table_rows(package: Path) -> int:
    """Embedding rows of a package: the sum of its tables' sizes."""
    config = json.loads((package / "model_config.json").read_text())
    return int(sum(config["table_sizes"]))


def next_day_auc(package: Path, records: list[dict], labels: np.ndarray) -> float:
    """AUC of the package's own scorer on the raw records of the next day."""
    scorer = PackageScorer(package)
    scores = np.concatenate(
        [
            np.asarray(scorer.score(records[i : i + SCORE_BATCH])).reshape(-1)
            for i in range(0, len(records), SCORE_BATCH)
        ]
    )
    return roc_auc(labels, scores)


def day_records(raw: Path, day: str) -> tuple[list[dict], np.ndarray]:
    """The raw records of one partition (labels dropped), and their click labels."""
    files = sorted((raw / f"dt={day}").glob("*.csv"))
    table = pa.concat_tables([pv.read_csv(f) for f in files])
    labels = table.column("click").to_numpy().astype(np.float64)
    return table.drop(["click", "p_true"]).to_pylist(), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = load_config(CONFIG)
    assert base.generate is not None
    parser.add_argument("--days", type=int, default=base.generate.days - 1)
    parser.add_argument(
        "--rows-per-day", type=int, default=base.generate.num_rows // base.generate.days
    )
    parser.add_argument("--users", type=int, default=base.generate.num_users)
    parser.add_argument("--items", type=int, default=base.generate.num_items)
    parser.add_argument("--churn", type=float, default=base.generate.item_churn)
    parser.add_argument("--drift", type=float, default=base.generate.popularity_drift)
    parser.add_argument("--ttl", type=int, default=base.preprocess.ttl)
    parser.add_argument("--batch-size", type=int, default=base.train.batch_size)
    parser.add_argument("--seed", type=int, default=base.generate.seed)
    parser.add_argument("--quick", action="store_true", help="3 days of 20k rows")
    parser.add_argument("--keep", default=None, help="work directory to keep (default: temp)")
    args = parser.parse_args()
    if args.quick:
        args.days, args.rows_per_day, args.users, args.items = 3, 20_000, 1_000, 500
        args.batch_size = 256

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="recforge-incr-"))
    raw = work / "raw"
    if not raw.exists():
        generate_logs(
            GenerateConfig(
                out=str(raw),
                format="csv",
                num_rows=args.rows_per_day * (args.days + 1),
                num_users=args.users,
                num_items=args.items,
                days=args.days + 1,
                start_ts=base.generate.start_ts,
                daily_partitions=True,
                item_churn=args.churn,
                popularity_drift=args.drift,
                seed=args.seed,
            )
        )
    days = sorted(p.name.removeprefix("dt=") for p in raw.iterdir() if p.is_dir())
    bayes = json.loads((raw / "_bayes.json").read_text()).get("partitions", {})
    root = work / "artifacts"
    from prefect.testing.utilities import prefect_test_harness

    rows: list[dict] = []
    frozen: Path | None = None
    with prefect_test_harness(server_startup_timeout=120):
        for number, day in enumerate(days[: args.days], start=1):
            chain = run(
                root,
                [
                    f"ingest.path={raw}",
                    f"ingest.partition=dt={day}",
                    f"preprocess.ttl={args.ttl}",
                    "export.model_name=incremental",
                    *common(args),
                ],
            )
            registry = Registry(root, "incremental")
            champion_package = registry.path(registry.champion())
            frozen = frozen or champion_package
            # Days 1..d side by side (hard links), cut at the same tail of day d.
            so_far = work / f"so-far-{number}"
            if not so_far.exists():
                for earlier in days[:number]:
                    folder = f"dt={earlier}"
                    shutil.copytree(raw / folder, so_far / folder, copy_function=os.link)
            full = run(
                root,
                [
                    f"ingest.path={so_far}",
                    "train.init=null",
                    "preprocess.ttl=null",
                    f"preprocess.valid_fraction={base.preprocess.valid_fraction / number}",
                    f"preprocess.test_fraction={base.preprocess.test_fraction / number}",
                    f"export.model_name=full-{number}",
                    *common(args),
                ],
            )
            records, labels = day_records(raw, days[number])
            loop_inc, wall_inc = train_seconds(chain)
            loop_full, wall_full = train_seconds(full)
            row = {
                "day": number,
                "partition": f"dt={day}",
                "gate": chain["promotion"].get("status"),
                "auc_incremental": next_day_auc(champion_package, records, labels),
                "auc_frozen": next_day_auc(frozen, records, labels),
                "auc_full_retrain": next_day_auc(Path(full["model"]), records, labels),
                "auc_bayes_next_day": (
                    bayes.get(f"dt={days[number]}") or bayes.get(days[number]) or {}
                ).get("bayes_auc"),
                "train_s_incremental": loop_inc,
                "train_s_full_retrain": loop_full,
                "wall_s_incremental": wall_inc,
                "wall_s_full_retrain": wall_full,
                "rows_incremental": table_rows(champion_package),
                "rows_full_retrain": table_rows(Path(full["model"])),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    print("| day | gate | next-day AUC: incremental | frozen | full retrain | Bayes | "
          "train s: incremental | full | embedding rows: incremental | full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bayes_auc = r["auc_bayes_next_day"]
        bayes_text = "-" if bayes_auc is None else f"{bayes_auc:.4f}"
        print(
            f"| {r['day']} | {r['gate']} | {r['auc_incremental']:.4f} | {r['auc_frozen']:.4f} | "
            f"{r['auc_full_retrain']:.4f} | {bayes_text} | "
            f"{r['train_s_incremental']:.1f} | {r['train_s_full_retrain']:.1f} | "
            f"{r['rows_incremental']:,} | {r['rows_full_retrain']:,} |"
        )
    last, first = rows[-1], rows[0]
    figures = {
        "days": args.days,
        "rows_per_day": args.rows_per_day,
        "churn": args.churn,
        "ttl": args.ttl,
        "auc_gap_vs_full_retrain": last["auc_full_retrain"] - last["auc_incremental"],
        "time_ratio_vs_full_retrain": last["train_s_incremental"] / last["train_s_full_retrain"],
        "wall_ratio_vs_full_retrain": last["wall_s_incremental"] / last["wall_s_full_retrain"],
        "auc_gain_vs_frozen": last["auc_incremental"] - last["auc_frozen"],
        "rows_ratio_day7_vs_day1": last["rows_incremental"] / first["rows_incremental"],
        "per_day": rows,
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
