"""Incremental training end to end: a chain of days through the pipeline flow.

Day 1 starts the chain (train.init: champion, no champion yet) and is promoted. Day 2
extends day 1's transform and warm-starts from it on another world size; the gate
scores the champion on day 2's test rows through day 2's transform. Rerunning day 2 is
all cache hits. A missing partition and an invalid one fail the day at the plan and
leave the champion and its transform as they were; a backfill stops at the first.
"""

import json
from pathlib import Path

import pytest

from artifacts.errors import ConfigError, InputNotFoundError
from artifacts.registry import Registry
from data_prep.synthetic import GenerateConfig, generate_logs
from flows.config import load_config
from flows.pipeline import BackfillStopped, RunParams, backfill, pipeline

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
ANY = 'bless.thresholds={"auc": {"min_change": -1.0}}'

pytestmark = pytest.mark.slow


def chain(raw: Path) -> list[str]:
    return [
        f"ingest.path={raw}",
        "train.init=champion",
        "preprocess.ttl=2",
        "preprocess.min_count=1",
        # Pinned (tiny.yaml says auto, which picks 0 here): the chain carries day 1's
        # partitioned ZeRO-2 optimizer state onto 2 ranks as a universal checkpoint.
        "train.zero_stage=2",
        ANY,
    ]


def run_day(root: Path, raw: Path, day: str, *overrides: str) -> dict:
    params = RunParams(
        config=TINY,
        root=str(root),
        overrides=[*chain(raw), f"ingest.partition=dt={day}", *overrides],
    )
    return json.loads(Path(pipeline(**params.model_dump())).read_text())


def test_a_chain_of_days_warm_starts_from_the_champion(prefect_server, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    generate_logs(
        GenerateConfig(
            out=str(raw),
            format="csv",
            num_rows=9000,
            num_users=200,
            num_items=150,
            days=3,
            daily_partitions=True,
            item_churn=0.3,
            seed=1,
        )
    )
    days = sorted(p.name.removeprefix("dt=") for p in raw.iterdir() if p.is_dir())
    root = tmp_path / "artifacts"
    registry = Registry(root, load_config(TINY).export.model_name)

    first = run_day(root, raw, days[0], "train.world_size=1")
    assert first["promotion"]["status"] == "promoted", first["promotion"]
    assert first["lineage"] == {"parent": None, "partitions": [f"dt={days[0]}"]}
    day1 = Path(first["model"]).name
    day1_transform = json.loads((registry.path(day1) / "transform.json").read_text())

    # Day 2 by the backfill flow; tiny trains on 2 ranks: another world size.
    (path,) = backfill(TINY, days[1], days[1], str(root), chain(raw))
    second = json.loads(Path(path).read_text())
    assert second["status"] == "completed"
    assert second["lineage"] == {"parent": day1, "partitions": [f"dt={d}" for d in days[:2]]}
    day2 = Path(second["model"]).name
    package = registry.path(day2)
    lineage = json.loads((package / "lineage.json").read_text())
    assert lineage["parent"] == day1 and lineage["train"] == second["stages"]["train"][
        "fingerprint"
    ]
    summary = Path(second["stages"]["train"]["output"]) / "train_summary.json"
    warm = json.loads(summary.read_text())["warm_start"]
    # Day 1's ZeRO-2 optimizer state, written on 1 rank, loaded on 2 as a universal one.
    assert warm["parent_world_size"] == 1 and warm["dense_optimizer"] == "carried (universal)"
    transform = json.loads((package / "transform.json").read_text())
    # Known ids kept their rows: every live id of day 1 that is still live has its slot.
    items_then = day1_transform["sparse"]["item_id"]["values"]
    items_now = transform["sparse"]["item_id"]["values"]
    kept = [i for i, v in enumerate(items_then) if v is not None and items_now[i] == v]
    assert len(kept) > 0.5 * len(items_then)
    assert transform["history"][-1]["features"]["item_id"]["added"] > 0  # churned items
    # The gate scored the champion on day 2's test rows through day 2's transform.
    decision = registry.decision(day2)
    assert decision["champion"] == day1
    assert decision["champion_metrics"]["num_rows"] == second["metrics"]["num_rows"]
    assert decision["champion_metrics"]["auc"] != second["metrics"]["auc"]

    again = run_day(root, raw, days[1])
    assert {s["status"] for s in again["stages"].values()} == {"cached"}

    champion = registry.champion()
    champion_transform = (registry.path(champion) / "transform.json").read_bytes()
    with pytest.raises(BackfillStopped, match=r"stopped at 2099-01-01 \(day 1 of 2\)") as stop:
        backfill(TINY, "2099-01-01", "2099-01-02", str(root), chain(raw))
    assert isinstance(stop.value.__cause__, InputNotFoundError)
    assert "dt=2099-01-01" in str(stop.value)
    with pytest.raises(ConfigError, match="partition"):
        run_day(root, raw, "../" + days[2])
    assert registry.champion() == champion
    assert (registry.path(champion) / "transform.json").read_bytes() == champion_transform
