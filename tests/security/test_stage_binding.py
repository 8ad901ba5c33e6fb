"""Attacks on where a stage output sits, and on what it holds (issue 38).

The attacker can write any object under the root but does not hold the run key. A
signed manifest proves that a key holder wrote it, not that it belongs where it was
found: each test copies a genuine, signed record (or plants an extra file next to the
genuine ones) and checks that recforge refuses it, runs the stage again, or never reads
the planted file. `memory://` stands for the bucket (an fsspec object store, no network).
"""

import json
import logging
import shutil
import uuid
from functools import partial
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import DataError, DeterministicError
from artifacts.locations import UnsafeName, join
from artifacts.signing import MisplacedRecord, SignatureError, place, sign
from artifacts.store import (
    MANIFEST,
    ArtifactStore,
    check_output_dir,
    describe_object,
    materialize,
)
from data_prep.preprocess import PreprocessConfig, ordered_map
from data_prep.schema import SchemaConfig
from data_prep.shard import ShardConfig

pytestmark = pytest.mark.security

FP_A = "a" * 64
FP_B = "b" * 64


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix of an in-memory object store (the bucket); its mirror under tmp."""
    monkeypatch.setenv("RECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/root"


@pytest.fixture
def run_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tasks' run logger outside a Prefect run: a plain logger caplog sees."""
    import tasks.common

    monkeypatch.setattr(tasks.common, "get_run_logger", lambda: logging.getLogger("tasks.common"))


def publish(store: ArtifactStore, stage: str, fp: str, files: dict[str, bytes], meta: dict) -> None:
    staging = store.new_staging(stage, fp)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    store.publish(stage, fp, staging, meta)


def copy_output(store: ArtifactStore, stage: str, source: str, target: str) -> None:
    """What the attacker does: copy one output's objects (manifest included) elsewhere."""
    if not store.remote:
        shutil.copytree(store.output_dir(stage, source), store.output_dir(stage, target))
        return
    fs, src = fsspec.core.url_to_fs(store.output_url(stage, source))
    _, dst = fsspec.core.url_to_fs(store.output_url(stage, target))
    for name in fs.find(src):
        fs.pipe_file(dst + name[len(src) :], fs.cat_file(name))


def evaluate_output(metrics: dict) -> tuple[dict[str, bytes], dict]:
    return {"metrics.json": json.dumps(metrics).encode()}, {"metrics": metrics}


@pytest.mark.parametrize("remote", [False, True], ids=["local", "memory"])
def test_a_manifest_copied_to_another_fingerprint_is_refused_naming_both(
    tmp_path: Path, bucket: str, remote: bool
) -> None:
    store = ArtifactStore(bucket if remote else tmp_path / "root")
    publish(store, "shard", FP_A, {"train-00000-of-00001.parquet": parquet_bytes(3)}, {})
    copy_output(store, "shard", FP_A, FP_B)

    with pytest.raises(MisplacedRecord) as refused:
        store.verify("shard", FP_B)
    assert FP_A[:16] in str(refused.value) and FP_B[:16] in str(refused.value)
    if remote:
        with pytest.raises(MisplacedRecord):
            materialize(store.output_url("shard", FP_B))
    else:
        with pytest.raises(MisplacedRecord):
            check_output_dir(store.output_dir("shard", FP_B))
    # The genuine output still verifies where it belongs.
    assert store.verify("shard", FP_A)[0] is not None


@pytest.mark.parametrize("remote", [False, True], ids=["local", "memory"])
def test_a_planted_evaluate_output_is_not_a_cache_hit_and_is_replaced(
    tmp_path: Path,
    bucket: str,
    remote: bool,
    run_logger: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A signed evaluate output of another config (a great AUC) copied to this config's
    fingerprint: the gate would read its metrics. The stage runs again instead."""
    from tasks.common import run_stage

    store = ArtifactStore(bucket if remote else tmp_path / "root")
    publish(store, "evaluate", FP_A, *evaluate_output({"auc": 0.99}))
    copy_output(store, "evaluate", FP_A, FP_B)

    def produce(out_dir: Path) -> dict:
        files, meta = evaluate_output({"auc": 0.61})
        (out_dir / "metrics.json").write_bytes(files["metrics.json"])
        return meta

    with caplog.at_level(logging.WARNING):
        outcome = run_stage("evaluate", FP_B, "auto", store, produce)

    assert outcome.status == "ran"
    assert outcome.meta["metrics"] == {"auc": 0.61}
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(FP_A[:16] in m and FP_B[:16] in m for m in warned), warned
    manifest, _ = store.verify("evaluate", FP_B)
    assert manifest["meta"]["metrics"] == {"auc": 0.61}


def test_an_unbound_manifest_is_refused_by_name_with_the_rebuild_command(tmp_path: Path) -> None:
    """An old-format manifest (signed, but naming no place) could come from anywhere."""
    store = ArtifactStore(tmp_path / "root")
    publish(store, "evaluate", FP_A, *evaluate_output({"auc": 0.7}))
    path = store.output_dir("evaluate", FP_A) / MANIFEST
    record = json.loads(path.read_text())
    record.pop("place", None)
    path.write_text(json.dumps(sign(record)))

    with pytest.raises(MisplacedRecord) as refused:
        store.verify("evaluate", FP_A)
    assert str(path) in str(refused.value)
    assert "--force" in str(refused.value)


def test_an_unbound_manifest_makes_the_stage_run_again(
    tmp_path: Path, run_logger: None, caplog: pytest.LogCaptureFixture
) -> None:
    from tasks.common import run_stage

    store = ArtifactStore(tmp_path / "root")
    publish(store, "evaluate", FP_A, *evaluate_output({"auc": 0.7}))
    path = store.output_dir("evaluate", FP_A) / MANIFEST
    record = json.loads(path.read_text())
    record.pop("place", None)
    path.write_text(json.dumps(sign(record)))

    def produce(out_dir: Path) -> dict:
        (out_dir / "metrics.json").write_text("{}")
        return {"metrics": {}}

    with caplog.at_level(logging.WARNING):
        assert run_stage("evaluate", FP_A, "auto", store, produce).status == "ran"
    assert any("names no place" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["place"] == place(
        "stage-output", stage="evaluate", fingerprint=FP_A
    )


def parquet_bytes(rows: int) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": np.arange(rows)}), sink)
    return sink.getvalue().to_pybytes()


def test_an_object_put_under_the_data_prefix_before_publishing_fails_the_publish(
    bucket: str,
) -> None:
    store = ArtifactStore(bucket)
    data = store.new_data_prefix("ingest", FP_A)
    fs, _ = fsspec.core.url_to_fs(data)
    honest = join(data, "events/part-00000-0.parquet")
    fs.pipe_file(fsspec.core.url_to_fs(honest)[1], parquet_bytes(10))
    files = {"events/part-00000-0.parquet": describe_object(honest)}
    # The attacker's rows, PUT while the stage runs, before the manifest is written.
    planted = join(data, "events/part-99999-0.parquet")
    fs.pipe_file(fsspec.core.url_to_fs(planted)[1], parquet_bytes(1000))

    with pytest.raises(DataError) as refused:
        store.publish_prefix("ingest", FP_A, data, files, {})
    assert "part-99999-0.parquet" in str(refused.value)
    assert not store.is_published("ingest", FP_A)


def test_an_object_added_under_a_published_data_prefix_fails_verification(bucket: str) -> None:
    store = ArtifactStore(bucket)
    publish(store, "shard", FP_A, {"train-00000-of-00001.parquet": parquet_bytes(5)}, {})
    fs, path = fsspec.core.url_to_fs(store.output_url("shard", FP_A))
    manifest = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
    fs.pipe_file(f"{path}/{manifest['data']}/train-00001-of-00001.parquet", parquet_bytes(9))

    with pytest.raises(DeterministicError) as refused:
        store.verify("shard", FP_A)
    assert "train-00001-of-00001.parquet" in str(refused.value)


def test_run_stage_at_signs_only_what_the_stage_wrote(bucket: str, data_tasks: None) -> None:
    """A file PUT under the fresh data prefix while a data stage runs is never signed."""
    from tasks.common import run_stage_at

    store = ArtifactStore(bucket)

    def produce(data: str) -> tuple[dict, list[str]]:
        fs, path = fsspec.core.url_to_fs(data)
        fs.pipe_file(f"{path}/events/part-00000-0.parquet", parquet_bytes(10))
        fs.pipe_file(f"{path}/transform.json", b'{"planted": true}')  # the attacker's
        return {}, ["events/part-00000-0.parquet"]

    with pytest.raises(DataError, match="transform.json"):
        run_stage_at("preprocess", FP_A, "auto", store, produce)
    assert not store.is_published("preprocess", FP_A)


SCHEMA = SchemaConfig(
    fields=[
        {"name": "ts", "dtype": "int64", "role": "timestamp"},
        {"name": "user_id", "dtype": "int64", "role": "sparse"},
        {"name": "price", "dtype": "float64", "role": "dense"},
        {"name": "click", "dtype": "int64", "role": "label"},
    ]
)


def events_table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "ts": np.sort(rng.integers(1_700_000_000, 1_700_100_000, n)),
            "user_id": rng.integers(1, 50, n),
            "price": rng.lognormal(3, 1, n),
            "click": rng.integers(0, 2, n),
        }
    )


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


@pytest.fixture
def data_tasks(monkeypatch: pytest.MonkeyPatch, run_logger: None) -> None:
    """The data stage tasks' bodies, outside Prefect: no artifacts, steps in this thread."""
    import tasks.common
    import tasks.preprocess
    import tasks.shard

    for module in (tasks.common, tasks.preprocess, tasks.shard):
        monkeypatch.setattr(
            module, "prefect_file_mapper", lambda stage: partial(ordered_map, workers=1)
        )
    for module in (tasks.preprocess, tasks.shard):
        monkeypatch.setattr(module, "create_table_artifact", lambda **_: None)


def test_a_file_planted_beside_the_listed_ones_is_never_read_by_preprocess_or_shard(
    tmp_path: Path, data_tasks: None
) -> None:
    from tasks.common import StageOutput
    from tasks.preprocess import preprocess_task
    from tasks.shard import shard_task

    store = ArtifactStore(tmp_path / "root")
    events = {
        f"events/part-0000{i}-0.parquet": table_bytes(events_table(500, seed=i)) for i in range(2)
    }
    publish(store, "ingest", FP_A, events, {"good_rows": 1000})
    ingest = StageOutput(
        stage="ingest",
        status="ran",
        fingerprint=FP_A,
        output=store.output_url("ingest", FP_A),
        meta={"good_rows": 1000},
    )
    # The attacker's rows, next to the listed event files of a genuine output.
    planted = store.output_dir("ingest", FP_A) / "events" / "part-00009-0.parquet"
    planted.write_bytes(table_bytes(events_table(700, seed=9)))

    pre = preprocess_task.fn(PreprocessConfig(), SCHEMA, ingest, store, "auto")
    assert sum(pre.meta["rows"].values()) == 1000

    out = store.output_dir("preprocess", pre.fingerprint)
    shutil.copy(out / "train" / "part-00000.parquet", out / "train" / "part-00009.parquet")
    shard = shard_task.fn(ShardConfig(), pre, store, "auto")
    assert shard.meta["rows"] == pre.meta["rows"]


@pytest.mark.parametrize("name", ["/etc/cron.d", "../outside", "a/../../b", ""])
def test_a_pipeline_name_cannot_write_outside_the_root(tmp_path: Path, name: str) -> None:
    store = ArtifactStore(tmp_path / "root")
    with pytest.raises(UnsafeName):
        store.location("latest", name, "plan.json")
    with pytest.raises(UnsafeName):
        store.write_latest_json(name, "plan.json", {"x": 1})
    assert not (tmp_path / "outside").exists()


def test_a_latest_pointer_copied_from_another_pipeline_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish(store, "ingest", FP_A, {"validation.json": b"{}"}, {})
    store.record_latest("other", "ingest", store.output_url("ingest", FP_A))
    target = Path(store.location("latest", "mine", "ingest.json"))
    target.parent.mkdir(parents=True)
    shutil.copy(store.location("latest", "other", "ingest.json"), target)

    with pytest.raises(MisplacedRecord):
        store.latest_output("mine", "ingest")
    assert store.latest_output("other", "ingest") == store.output_url("ingest", FP_A)


POISONS = {
    "huge": b'{"x": "' + b" " * (9 << 20) + b'"}',
    "deep": b"[" * 200_000 + b"]" * 200_000,
    "digits": b'{"ingest": ' + b"9" * 5000 + b"}",
    "not-utf8": b'{"ingest": "\xff\xfe"}',
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_plan_json_is_an_ignored_hint(
    tmp_path: Path, poison: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ArtifactStore(tmp_path / "root")
    path = Path(store.location("latest", "demo", "plan.json"))
    path.parent.mkdir(parents=True)
    path.write_bytes(POISONS[poison])

    with caplog.at_level(logging.WARNING):
        assert store.read_latest_json("demo", "plan.json") is None
    assert any("plan.json" in r.getMessage() for r in caplog.records)


def test_a_plan_json_copied_from_another_pipeline_is_ignored(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    store.write_latest_json("other", "plan.json", {"ingest": {"fingerprint": FP_A}})
    target = Path(store.location("latest", "demo", "plan.json"))
    target.parent.mkdir(parents=True)
    shutil.copy(store.location("latest", "other", "plan.json"), target)

    assert store.read_latest_json("demo", "plan.json") is None
    assert store.read_latest_json("other", "plan.json") == {"ingest": {"fingerprint": FP_A}}


@pytest.mark.parametrize("remote", [False, True], ids=["local", "memory"])
def test_a_registry_package_is_bound_to_its_model_and_version(
    tmp_path: Path, bucket: str, remote: bool
) -> None:
    store = ArtifactStore(bucket if remote else tmp_path / "root")
    publish(store, "export", FP_A, {"model.safetensors": b"weights"}, {})
    location = store.publish_model("ctr", "v1", store.output_url("export", FP_A))
    if remote:
        fs, path = fsspec.core.url_to_fs(str(location))
        manifest = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
    else:
        manifest = json.loads((Path(location) / MANIFEST).read_text())
        assert check_output_dir(Path(location)) == ""
    assert manifest["place"] == place("package", model="ctr", version="v1")
    # The export stage's own output stays bound to its stage-output place.
    assert store.verify("export", FP_A)[0]["place"]["type"] == "stage-output"


def test_a_run_record_names_its_run(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    path = store.write_run_record("r1", {"run_id": "r1", "status": "completed"})
    assert json.loads(Path(path).read_text())["place"] == place("run-record", run_id="r1")


def test_a_package_copied_to_another_version_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish(store, "export", FP_A, {"model.safetensors": b"weights"}, {})
    location = Path(store.publish_model("ctr", "v1", store.output_url("export", FP_A)))
    shutil.copytree(location, location.parent / "v2")
    with pytest.raises(SignatureError):
        check_output_dir(location.parent / "v2")


def test_on_a_bucket_the_data_stages_sign_exactly_what_they_wrote_and_refuse_a_planted_file(
    bucket: str, data_tasks: None
) -> None:
    from tasks.common import StageOutput
    from tasks.preprocess import preprocess_task
    from tasks.shard import shard_task

    store = ArtifactStore(bucket)
    events = {
        f"events/part-0000{i}-0.parquet": table_bytes(events_table(500, seed=i)) for i in range(2)
    }
    publish(store, "ingest", FP_A, events, {"good_rows": 1000})
    ingest = StageOutput(
        stage="ingest",
        status="ran",
        fingerprint=FP_A,
        output=store.output_url("ingest", FP_A),
        meta={"good_rows": 1000},
    )
    pre = preprocess_task.fn(PreprocessConfig(), SCHEMA, ingest, store, "auto")
    shard = shard_task.fn(ShardConfig(), pre, store, "auto")
    assert shard.meta["rows"] == pre.meta["rows"]
    assert sum(pre.meta["rows"].values()) == 1000

    # A file planted under preprocess's published data prefix: shard refuses the output.
    fs, path = fsspec.core.url_to_fs(pre.output)
    data = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))["data"]
    fs.pipe_file(f"{path}/{data}/train/part-00009.parquet", table_bytes(events_table(9, 9)))
    with pytest.raises(DataError, match="part-00009"):
        shard_task.fn(ShardConfig(), pre, store, "force")
