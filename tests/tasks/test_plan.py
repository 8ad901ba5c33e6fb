"""The run plan: fingerprints up front, cache hits, and what changed (no Prefect run)."""

import json
from pathlib import Path

import pytest

from artifacts.errors import InputNotFoundError
from artifacts.store import MANIFEST, STAGES, ArtifactStore
from flows.config import load_config
from flows.pipeline import RunParams, plan_modes
from tasks.common import StageOutput
from tasks.plan import check_plan, plan_markdown, plan_run, record_bases
from tasks.report import failure_markdown

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture
def raw(tmp_path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("a.csv", "b.csv"):
        (raw / name).write_text("ts,user_id\n1,2\n")
    return raw


def publish_all(root: Path, plans) -> dict[str, StageOutput]:
    """Pretend every planned stage ran: a manifest at each planned output."""
    outputs = {}
    for p in plans:
        out = ArtifactStore(root).output_dir(p.stage, p.fingerprint)
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).write_text(json.dumps({"files": [], "meta": {}}))
        outputs[p.stage] = StageOutput(
            stage=p.stage, status="ran", fingerprint=p.fingerprint, output=str(out)
        )
    return outputs


def plan(raw: Path, root: Path, *overrides: str, **selection):
    config = load_config(TINY, [f"ingest.path={raw}", *overrides])
    params = RunParams(config=TINY, root=str(root), **selection)
    return config, {p.stage: p for p in plan_run(config, plan_modes(params), ArtifactStore(root))}


def test_a_first_plan_runs_everything_then_everything_is_a_cache_hit(raw, tmp_path):
    root = tmp_path / "art"
    config, plans = plan(raw, root)
    assert [plans[s].action for s in STAGES] == ["run"] * 6
    assert plans["ingest"].reason == "no earlier output of this pipeline at this root"
    record_bases(
        config, ArtifactStore(root), list(plans.values()), publish_all(root, plans.values())
    )
    _, again = plan(raw, root)
    assert [again[s].action for s in STAGES] == ["cached"] * 6
    assert {s: p.fingerprint for s, p in again.items()} == {
        s: p.fingerprint for s, p in plans.items()
    }


def test_the_plan_names_what_changed(raw, tmp_path):
    root = tmp_path / "art"
    config, plans = plan(raw, root)
    record_bases(
        config, ArtifactStore(root), list(plans.values()), publish_all(root, plans.values())
    )

    _, changed = plan(raw, root, "train.lr=0.5", "evaluate.calibration_bins=7")
    assert [changed[s].action for s in STAGES] == ["cached"] * 3 + ["run"] * 3
    assert changed["train"].changes == [f"train.lr: {config.train.lr} -> 0.5"]
    assert changed["evaluate"].changes == [
        f"evaluate.calibration_bins: {config.evaluate.calibration_bins} -> 7",
        "upstream train changed",
    ]
    assert changed["export"].changes == ["upstream train changed", "upstream evaluate changed"]

    (raw / "c.csv").write_text("ts,user_id\n1,2\n")
    _, more = plan(raw, root)
    assert more["ingest"].action == "run"
    assert more["ingest"].changes == ["raw file added: c.csv"]
    assert more["preprocess"].changes == ["upstream ingest changed"]
    markdown = plan_markdown("tiny", list(more.values()))
    assert "| ingest | **run** |" in markdown and "raw file added" in markdown
    assert markdown.count("**run**") == 6


def test_selection_modes_and_a_missing_upstream_output(raw, tmp_path):
    root = tmp_path / "art"
    _, only = plan(raw, root, only=["train"])
    assert [only[s].action for s in STAGES] == ["missing"] * 3 + ["run"] + ["skip"] * 2
    with pytest.raises(InputNotFoundError, match="ingest, preprocess, shard has no valid output"):
        check_plan(list(only.values()))
    _, forced = plan(raw, root, force=["shard"])
    assert forced["shard"].reason.startswith("selected")
    # Deleting a published output: the plan says so.
    config, plans = plan(raw, root)
    record_bases(
        config, ArtifactStore(root), list(plans.values()), publish_all(root, plans.values())
    )
    (ArtifactStore(root).output_dir("shard", plans["shard"].fingerprint) / MANIFEST).unlink()
    _, again = plan(raw, root)
    assert again["shard"].action == "run" and "deleted" in again["shard"].reason
    assert again["train"].action == "cached"


def test_a_missing_input_path_fails_the_plan(tmp_path):
    config = load_config(TINY, [f"ingest.path={tmp_path / 'none'}"])
    with pytest.raises(InputNotFoundError, match="does not exist"):
        plan_run(config, plan_modes(RunParams(config=TINY)), ArtifactStore(tmp_path))


def test_the_failure_artifact_says_how_to_rerun_from_the_failed_stage():
    params = RunParams(config="configs/tiny.yaml", root="/art", overrides=["train.lr=0.1"])
    record = {
        "run_id": "r1",
        "stages": {s: {"status": "cached"} for s in STAGES[:3]}
        | {"train": {"status": "failed"}, "evaluate": {"status": "skipped"}},
        "error": "TrainingCrashed: rank 1 exited with -9",
        "failed_at": "train",
    }
    text = failure_markdown(record, params, "tiny")
    assert "Stage `train` failed" in text and "rank 1 exited with -9" in text
    assert "recforge run configs/tiny.yaml --root /art --set train.lr=0.1 --from train" in text
    assert "prefect deployment run 'recforge-rerun/tiny' -p stage=train" in text
    assert "recforge-rerun / tiny" in text

    before = failure_markdown(
        {**record, "failed_at": "config", "error": "ConfigError: x.yaml"}, params, None
    )
    assert "before any stage ran" in before and "--from" not in before
    assert "prefect deployment" not in before


# Each stage -> the stages whose fingerprints include it (itself and everything after).
DOWNSTREAM = {
    "ingest": set(STAGES),
    "preprocess": {"preprocess", "shard", "train", "evaluate", "export"},
    "shard": {"shard", "train", "evaluate", "export"},
    "train": {"train", "evaluate", "export"},
    "evaluate": {"evaluate", "export"},
    "export": {"export"},
}


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the first-party packages that the plan fingerprints the code from."""
    import shutil

    import tasks.common
    import tasks.plan
    from artifacts.fingerprint import FIRST_PARTY

    copy = tmp_path / "src"
    for package in FIRST_PARTY:
        shutil.copytree(
            REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    monkeypatch.setattr(tasks.common, "_ROOT", copy)
    monkeypatch.setattr(tasks.plan, "_ROOT", copy)
    return copy


@pytest.mark.parametrize("stage", STAGES)
def test_editing_a_stages_task_module_reruns_it_and_only_what_follows(
    stage, raw, tmp_path, source_copy
):
    root = tmp_path / "art"
    config, plans = plan(raw, root)
    record_bases(
        config, ArtifactStore(root), list(plans.values()), publish_all(root, plans.values())
    )
    task_module = source_copy / "tasks" / f"{stage}.py"
    task_module.write_text(task_module.read_text() + "\n# how the task calls its library\n")
    _, again = plan(raw, root)
    rerun = {s for s in STAGES if again[s].action == "run"}
    assert rerun == DOWNSTREAM[stage]
    assert {s for s in STAGES if again[s].action == "cached"} == set(STAGES) - rerun
    assert any(f"tasks/{stage}.py" in change for change in again[stage].changes)


@pytest.mark.parametrize(
    ("module", "first"),
    [
        ("artifacts/locations.py", "ingest"),  # every stage reads and writes through it
        ("training/stages.py", "train"),  # the family dispatch: train, evaluate, export
        ("training/ctr/export.py", "export"),
    ],
)
def test_editing_a_library_module_reruns_the_first_stage_that_runs_it(
    module, first, raw, tmp_path, source_copy
):
    root = tmp_path / "art"
    config, plans = plan(raw, root)
    record_bases(
        config, ArtifactStore(root), list(plans.values()), publish_all(root, plans.values())
    )
    path = source_copy / module
    path.write_text(path.read_text() + "\n# edited\n")
    _, again = plan(raw, root)
    assert {s for s in STAGES if again[s].action == "run"} == DOWNSTREAM[first]


def test_raw_input_is_keyed_by_content_not_by_path_or_mtime(raw, tmp_path):
    import os
    import shutil

    root = tmp_path / "art"
    config, plans = plan(raw, root)
    record_bases(
        config, ArtifactStore(root), list(plans.values()), publish_all(root, plans.values())
    )
    # The same bytes at another path: every stage is a cache hit.
    moved = tmp_path / "elsewhere" / "raw"
    shutil.copytree(raw, moved)
    _, copied = plan(moved, root)
    assert [copied[s].action for s in STAGES] == ["cached"] * 6
    # Touched (a new mtime, same bytes): still cached.
    stat = (raw / "a.csv").stat()
    os.utime(raw / "a.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**10))
    _, touched = plan(raw, root)
    assert [touched[s].action for s in STAGES] == ["cached"] * 6
    # One byte changed, same size, the mtime put back: ingest and everything after run.
    stat = (raw / "a.csv").stat()
    (raw / "a.csv").write_text("ts,user_id\n1,3\n")
    os.utime(raw / "a.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (raw / "a.csv").stat().st_mtime_ns == stat.st_mtime_ns
    _, changed = plan(raw, root)
    assert [changed[s].action for s in STAGES] == ["run"] * 6
    assert changed["ingest"].changes == ["raw file rewritten: a.csv"]
