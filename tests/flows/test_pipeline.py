"""End-to-end: the whole flow through Prefect, 2 DeepSpeed ranks on CPU, tiny data."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from artifacts.errors import CorruptOutput, InputNotFoundError
from artifacts.store import ArtifactStore
from data_prep.errors import SchemaError
from data_prep.synthetic import generate_logs
from flows.config import load_config
from flows.pipeline import RunParams, pipeline

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
STAGES = ["ingest", "preprocess", "shard", "train", "evaluate", "export"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "raw"
    generate_logs(load_config(TINY, [f"generate.out={out}"]).generate)
    return out


@pytest.fixture(scope="module")
def first_run(prefect_server, raw_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    path = pipeline(config=TINY, root=str(root), overrides=[f"ingest.path={raw_dir}"])
    return root, json.loads(Path(path).read_text())


def run(root, raw_dir, **kwargs) -> dict:
    overrides = [f"ingest.path={raw_dir}", *kwargs.pop("overrides", [])]
    params = RunParams(config=TINY, root=str(root), overrides=overrides, **kwargs)
    return json.loads(Path(pipeline(**params.model_dump())).read_text())


def statuses(record: dict) -> list[str]:
    return [record["stages"][s]["status"] for s in STAGES]


def test_first_run_runs_all_stages_and_records_metrics(first_run):
    root, record = first_run
    assert record["status"] == "completed"
    assert statuses(record) == ["ran"] * 6
    metrics = record["metrics"]
    for key in ("auc", "logloss", "bayes_auc"):
        assert np.isfinite(metrics[key])
    assert 0.5 < metrics["auc"] <= 1.0 and metrics["auc"] <= metrics["bayes_auc"] + 0.05
    model = Path(record["model"])
    assert model.parent.parent == root / "registry"
    for name in ("model.safetensors", "model.onnx", "model.ts", "transform.json", "model_card.md"):
        assert (model / name).is_file(), name
    for stage in STAGES:
        out = Path(record["stages"][stage]["output"])
        assert out.parent == root / "stages" / stage and (out / "_manifest.json").is_file()


def test_second_run_is_all_cached_and_shows_as_cached_in_prefect(first_run, raw_dir):
    root, record = first_run
    params = RunParams(config=TINY, root=str(root), overrides=[f"ingest.path={raw_dir}"])
    state = pipeline(**params.model_dump(), return_state=True)
    again = json.loads(Path(state.result()).read_text())
    assert statuses(again) == ["cached"] * 6
    assert again["metrics"] == record["metrics"] and again["model"] == record["model"]
    assert set(task_runs(state).values()) == {("Cached", 1)}


def test_from_evaluate_reruns_only_evaluate_and_export(first_run, raw_dir):
    root, _ = first_run
    record = run(root, raw_dir, from_stage="evaluate")
    assert statuses(record) == ["cached"] * 4 + ["ran"] * 2


def test_training_hyperparameter_reruns_train_evaluate_export(first_run, raw_dir):
    root, record = first_run
    changed = run(root, raw_dir, overrides=["train.lr=0.01"])
    assert statuses(changed) == ["cached"] * 3 + ["ran"] * 3
    assert changed["stages"]["train"]["fingerprint"] != record["stages"]["train"]["fingerprint"]
    assert changed["model"] != record["model"]


def artifacts(state) -> dict[str, str]:
    """The flow run's artifacts by key (Markdown or table data as text)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: str(a.data) for a in found if a.key}


def test_the_plan_says_what_will_run_and_why_before_anything_runs(first_run, raw_dir):
    from flows.pipeline import plan_modes
    from tasks.plan import plan_run

    root, record = first_run
    overrides = [f"ingest.path={raw_dir}", "train.lr=0.02"]
    params = RunParams(config=TINY, root=str(root), overrides=overrides, force=["shard"])
    plans = {
        p.stage: p
        for p in plan_run(load_config(TINY, overrides), plan_modes(params), ArtifactStore(root))
    }
    assert [plans[s].action for s in STAGES] == ["cached", "cached", "run", "run", "run", "run"]
    assert plans["shard"].reason.startswith("selected")
    # Against the basis of the train output last published (an earlier test's lr, or tiny's).
    assert len(plans["train"].changes) == 1
    assert re.fullmatch(r"train\.lr: [0-9.e-]+ -> 0\.02", plans["train"].changes[0])
    assert plans["evaluate"].changes == ["upstream train changed"]
    assert plans["ingest"].fingerprint == record["stages"]["ingest"]["fingerprint"]

    state = pipeline(**params.model_dump(), return_state=True)
    ran = json.loads(Path(state.result()).read_text())
    assert statuses(ran) == ["cached", "cached", "ran", "ran", "ran", "ran"]
    for stage in STAGES:  # the plan's fingerprints are the tasks' own
        assert ran["stages"][stage]["fingerprint"] == plans[stage].fingerprint, stage
    shown = artifacts(state)
    assert "| train | **run** |" in shown["plan"] and "train.lr: " in shown["plan"]
    assert "| ingest | **cached** |" in shown["plan"]
    assert ran["model"] in shown["run-record"] and "failure" not in shown


def test_deleted_output_runs_again(first_run, raw_dir):
    root, record = first_run
    shutil.rmtree(record["stages"]["shard"]["output"])
    again = run(root, raw_dir)
    # Downstream fingerprints depend on upstream fingerprints, not bytes: still cached.
    assert statuses(again) == ["cached", "cached", "ran", "cached", "cached", "cached"]


def test_a_flipped_byte_in_a_cached_output_is_refused_until_forced(first_run, raw_dir):
    root, record = first_run
    victim = sorted(Path(record["stages"]["shard"]["output"]).glob("train-*.parquet"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptOutput, match=rf"{victim.name} does not match its sha256"):
        run(root, raw_dir)
    # The message says how to replace it; nothing downstream ran on the bad bytes.
    again = run(root, raw_dir, force=["shard"])
    assert statuses(again) == ["cached", "cached", "ran", "cached", "cached", "cached"]


def test_only_skips_downstream_stages(first_run, raw_dir):
    root, _ = first_run
    record = run(root, raw_dir, only=["preprocess"])
    assert statuses(record) == ["cached", "ran", "skipped", "skipped", "skipped", "skipped"]


def test_exported_onnx_matches_trained_model_without_training_code(first_run):
    root, record = first_run
    model = Path(record["model"])
    shard_dir = Path(record["stages"]["shard"]["output"])
    train_dir = Path(record["stages"]["train"]["output"])
    # Training-time scores of 1,000 test rows, from the trained weights.
    import torch

    from training.ctr.data import iter_tables, load_dataset_meta, model_columns, to_batch
    from training.ctr.model import load_model

    net, _ = load_model(train_dir)
    meta = load_dataset_meta(shard_dir)
    sparse, dense = [], []
    # The tiny test split has a few hundred rows; up to 1,000 of them, in batches of 50.
    columns = model_columns(meta)
    for table in iter_tables(shard_dir, meta, "test", 0, 1, 50, columns):
        batch = to_batch(table, meta)
        sparse.append(batch.sparse.numpy())
        dense.append(batch.dense.numpy())
    sparse = np.concatenate(sparse)[:1000]
    dense = np.concatenate(dense)[:1000]
    with torch.no_grad():
        logits = net(torch.from_numpy(sparse), torch.from_numpy(dense))[:, 0]
        expected = torch.sigmoid(logits).numpy()
    np.savez(root / "sample.npz", sparse=sparse, dense=dense, expected=expected)

    # A fresh interpreter that imports onnxruntime and numpy only.
    script = (
        "import sys, numpy as np, onnxruntime as ort\n"
        "d = np.load(sys.argv[2])\n"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "out = s.run(None, {'sparse': d['sparse'], 'dense': d['dense']})[0]\n"
        "assert 'training' not in sys.modules\n"
        "print(float(np.abs(out.reshape(-1) - d['expected']).max()), len(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(model / "model.onnx"), str(root / "sample.npz")],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    max_diff, rows = done.stdout.split()
    assert int(rows) == len(expected) >= min(1000, meta.split("test").rows - 50)
    assert float(max_diff) <= 1e-5


def test_cli_prints_run_record_last(first_run, raw_dir):
    root, _ = first_run
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            TINY,
            "--root",
            str(root),
            "--set",
            f"ingest.path={raw_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    record = json.loads(Path(last).read_text())
    assert last.endswith("summary.json") and statuses(record) == ["cached"] * 6


def task_runs(state) -> dict[str, tuple[str, int]]:
    """Task name -> (final state name, run count) of a flow run, read from the Prefect API."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
            )
        )
    stages = {r.name.split("-")[0]: (r.state.name, r.run_count) for r in runs}
    return {name: value for name, value in stages.items() if name in STAGES}


def test_missing_input_fails_once_without_output(prefect_server, tmp_path):
    params = RunParams(config=TINY, root=str(tmp_path), overrides=[f"ingest.path={tmp_path}/none"])
    state = pipeline(**params.model_dump(), return_state=True)
    assert state.is_failed()
    with pytest.raises(InputNotFoundError, match="does not exist"):
        state.result()
    # The plan fails before any stage starts, once (no retries).
    assert task_runs(state) == {}
    assert not (tmp_path / "stages" / "ingest").exists()
    record = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert record["status"] == "failed" and record["failed_at"] == "plan"
    assert {s["status"] for s in record["stages"].values()} == {"skipped"}
    failure = artifacts(state)["failure"]
    assert "before any stage ran" in failure and "does not exist" in failure


def test_all_malformed_rows_fail_once_and_keep_quarantine(prefect_server, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.csv").write_text(
        "ts,user_id,item_id,city,device,hour,category,price,position,click,p_true\n"
        + "yesterday,1,1,c,ios,1,k,1.0,1,0,0.1\n" * 20
    )
    params = RunParams(config=TINY, root=str(tmp_path / "art"), overrides=[f"ingest.path={raw}"])
    state = pipeline(**params.model_dump(), return_state=True)
    with pytest.raises(SchemaError, match="20 of 20 rows"):
        state.result()
    assert task_runs(state) == {"ingest": ("Failed", 1)}
    failure = artifacts(state)["failure"]
    assert "Stage `ingest` failed" in failure and "20 of 20 rows" in failure
    assert f"--root {tmp_path / 'art'} --set ingest.path={raw} --from ingest" in failure
    ingest_dir = tmp_path / "art" / "stages" / "ingest"
    assert [p for p in ingest_dir.iterdir() if not p.name.startswith(".")] == []
    kept = list((tmp_path / "art" / "failed" / "ingest").glob("*/quarantine/*.parquet"))
    assert kept, "the quarantine of a failed ingest is kept for inspection"


def test_drift_against_the_previous_run_warns_or_fails_by_policy(first_run, tmp_path):
    from artifacts.errors import DataError

    root, _ = first_run
    drifted = tmp_path / "raw"
    config = load_config(TINY, [f"generate.out={drifted}", "generate.num_cities=2"])
    generate_logs(config.generate)
    overrides = [f"ingest.path={drifted}", "drift.policy=fail"]
    params = RunParams(config=TINY, root=str(root), only=["ingest"], overrides=overrides)
    state = pipeline(**params.model_dump(), return_state=True)
    with pytest.raises(DataError, match=r"city psi"):
        state.result()

    warned = run(root, drifted, only=["ingest"], overrides=["drift.policy=warn"])
    assert warned["status"] == "completed"
    ingest = json.loads((Path(warned["stages"]["ingest"]["output"]) / "_manifest.json").read_text())
    assert any(f["column"] == "city" for f in ingest["meta"]["drift"])


def test_dask_cluster_gives_the_same_data_outputs_as_threads(first_run, raw_dir, tmp_path):
    from prefect_dask import DaskTaskRunner

    root, record = first_run
    cluster = {
        "n_workers": 2,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
    }
    params = RunParams(
        config=TINY,
        root=str(tmp_path),
        only=["ingest", "preprocess", "shard"],
        overrides=[f"ingest.path={raw_dir}"],
    )
    on_dask = pipeline.with_options(task_runner=DaskTaskRunner(cluster_kwargs=cluster))
    state = on_dask(**params.model_dump(), return_state=True)
    dask_record = json.loads(Path(state.result()).read_text())
    # The per-file steps ran as their own task runs on the cluster.
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
            )
        )
    names = {r.name.rsplit("-", 1)[0] for r in runs}
    assert {"read-file", "map-preprocess"} <= names, names
    for stage in ("ingest", "preprocess", "shard"):
        ours = Path(dask_record["stages"][stage]["output"]) / "_manifest.json"
        files = json.loads(ours.read_text())["files"]
        threads_dir = root / "stages" / stage
        threads = [
            json.loads((d / "_manifest.json").read_text())["files"]
            for d in threads_dir.iterdir()
            if (d / "_manifest.json").exists()
        ]
        assert files in threads, f"{stage}: Dask output differs from every threads output"
