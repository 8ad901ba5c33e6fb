"""The gate end to end: a shuffled-label model is not blessed, a better one is promoted."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.csv as pv
import pytest

from artifacts.registry import Registry
from data_prep.synthetic import generate_logs
from flows.config import load_config
from flows.pipeline import RunParams, pipeline

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
# Above chance and no worse than the champion; the first, weak model needs no floor.
LENIENT = 'bless.thresholds={"auc": {"lower_bound": 0.5, "min_change": 0.0}}'
ANY = 'bless.thresholds={"auc": {"min_change": 0.0}}'

pytestmark = pytest.mark.slow


def run(root: Path, raw: Path, *overrides: str) -> dict:
    params = RunParams(config=TINY, root=str(root), overrides=[f"ingest.path={raw}", *overrides])
    return json.loads(Path(pipeline(**params.model_dump())).read_text())


def shuffled_labels(raw: Path, out: Path) -> Path:
    """A copy of the raw CSV logs with the click column permuted across all rows."""
    out.mkdir()
    files = sorted(raw.glob("*.csv"))
    tables = [pv.read_csv(path) for path in files]
    clicks = np.concatenate([t.column("click").to_numpy() for t in tables])
    np.random.default_rng(0).shuffle(clicks)
    start = 0
    for path, table in zip(files, tables, strict=True):
        part = clicks[start : start + table.num_rows]
        start += table.num_rows
        index = table.column_names.index("click")
        pv.write_csv(table.set_column(index, "click", [part]), out / path.name)
    return out


def test_the_gate_keeps_a_bad_model_out_and_promotes_a_better_one(
    prefect_server, tmp_path: Path
) -> None:
    raw = tmp_path / "raw"
    # 4x tiny's rows: 2,400 test rows put chance (AUC 0.5) well below the 0.55 floor.
    generate_logs(load_config(TINY, [f"generate.out={raw}", "generate.num_rows=24000"]).generate)
    root = tmp_path / "artifacts"
    registry = Registry(root, load_config(TINY).export.model_name)

    weak = run(root, raw, "train.max_steps=10", ANY)
    assert weak["promotion"]["status"] == "promoted"
    first = Path(weak["model"]).name
    assert registry.champion() == first

    bad = run(root, shuffled_labels(raw, tmp_path / "shuffled"))
    assert bad["promotion"]["status"] == "not_blessed"
    assert bad["metrics"]["auc"] < 0.55
    failed = [c for c in bad["promotion"]["decision"]["checks"] if not c["passed"]]
    assert any(c["metric"] == "auc" and c["kind"] == "value" for c in failed)
    assert registry.champion() == first  # the pointer did not move
    assert registry.decision(Path(bad["model"]).name)["blessed"] is False

    better = run(root, raw, LENIENT)
    assert better["promotion"]["status"] == "promoted", better["promotion"]
    decision = registry.decision(Path(better["model"]).name)
    # The champion was scored on the same test rows as the candidate.
    assert (
        decision["champion"] == first
        and decision["champion_metrics"]["auc"] < better["metrics"]["auc"]
    )
    assert decision["champion_metrics"]["num_rows"] == better["metrics"]["num_rows"]
    assert registry.champion() == Path(better["model"]).name
    assert [h["version"] for h in registry.history()] == [first, registry.champion()]

    again = run(root, raw, LENIENT)  # all cached: the champion stays, no new decision
    assert again["promotion"]["status"] == "champion"


def answer_when_paused(approve: bool, note: str, answered: list) -> threading.Thread:
    """A reviewer in the UI: waits for a paused flow run, then submits the approval form."""
    from prefect.client.orchestration import get_client
    from prefect.flow_runs import resume_flow_run

    def review() -> None:
        deadline = time.monotonic() + 300
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                paused = [r for r in client.read_flow_runs() if r.state and r.state.is_paused()]
                if paused:
                    resume_flow_run(paused[0].id, run_input={"approve": approve, "note": note})
                    answered.append(paused[0].id)
                    return
                time.sleep(0.5)

    thread = threading.Thread(target=review, daemon=True)
    thread.start()
    return thread


def test_a_blessed_model_waits_for_approval(prefect_server, tmp_path: Path) -> None:
    """Rejected, it stays out; the same run again (every stage cached) approved, it is in."""
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    root = tmp_path / "artifacts"
    registry = Registry(root, load_config(TINY).export.model_name)
    overrides = (ANY, "bless.require_approval=true", "bless.approval_timeout_s=300")

    rejected: list = []
    reviewer = answer_when_paused(False, "not this one", rejected)
    record = run(root, raw, *overrides)
    reviewer.join(timeout=10)
    assert rejected, "the flow never paused for approval"
    assert record["promotion"]["status"] == "not_approved"
    assert record["promotion"]["approval"] == "not this one"
    assert registry.champion() is None

    approved: list = []
    reviewer = answer_when_paused(True, "looked at the card", approved)
    again = run(root, raw, *overrides)
    reviewer.join(timeout=10)
    assert approved and approved != rejected, "the second run never paused for approval"
    assert {stage["status"] for stage in again["stages"].values()} == {"cached"}
    assert again["promotion"]["status"] == "promoted"
    assert again["promotion"]["approval"] == "looked at the card"
    assert registry.champion() == Path(again["model"]).name
