import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.errors import CorruptOutput, SignatureError
from artifacts.fingerprint import fingerprint
from artifacts.store import CHAOS_PUBLISH_FAULT, MANIFEST, PUBLISH_POINTS, ArtifactStore

REPO = Path(__file__).resolve().parents[2]


def test_fingerprint_changes_with_config_inputs_and_code():
    base = fingerprint("train", {"lr": 0.1}, ["a"], "code1")
    assert base == fingerprint("train", {"lr": 0.1}, ["a"], "code1")
    assert base != fingerprint("train", {"lr": 0.2}, ["a"], "code1")
    assert base != fingerprint("train", {"lr": 0.1}, ["b"], "code1")
    assert base != fingerprint("train", {"lr": 0.1}, ["a"], "code2")
    # Canonical JSON: key order does not matter.
    assert fingerprint("s", {"a": 1, "b": 2}, [], "c") == fingerprint(
        "s", {"b": 2, "a": 1}, [], "c"
    )


def test_publish_writes_manifest_last_and_verifies(tmp_path):
    store = ArtifactStore(tmp_path)
    staging = store.new_staging("shard", "f" * 64)
    pq.write_table(pa.table({"x": [1, 2, 3]}), staging / "train-00000-of-00001.parquet")
    (staging / "sub").mkdir()
    (staging / "sub" / "a.json").write_text("{}")
    manifest = store.publish("shard", "f" * 64, staging, {"rows": 3})

    final = store.output_dir("shard", "f" * 64)
    assert not staging.exists() and final.is_dir()
    assert manifest["files"]["train-00000-of-00001.parquet"]["rows"] == 3
    assert json.loads((final / "_manifest.json").read_text())["meta"] == {"rows": 3}
    found, why = store.verify("shard", "f" * 64)
    assert found is not None and why == ""


def test_verify_refuses_a_published_output_that_changed(tmp_path):
    store = ArtifactStore(tmp_path)
    assert store.verify("ingest", "0" * 64) == (
        None,
        f"no output at {store.output_dir('ingest', '0' * 64)}",
    )
    staging = store.new_staging("ingest", "0" * 64)
    (staging / "a.txt").write_text("hello")
    store.publish("ingest", "0" * 64, staging, {})
    out = store.output_dir("ingest", "0" * 64)
    path = out / "a.txt"

    path.write_text("hellO")  # same size, one flipped byte
    with pytest.raises(CorruptOutput, match=r"a\.txt does not match its sha256.*--force ingest"):
        store.verify("ingest", "0" * 64)
    path.write_text("hello!")
    with pytest.raises(CorruptOutput, match="6 bytes, the manifest 5"):
        store.verify("ingest", "0" * 64)
    path.unlink()
    with pytest.raises(CorruptOutput, match="missing"):
        store.verify("ingest", "0" * 64)
    (out / MANIFEST).write_text("{")
    with pytest.raises(SignatureError, match="not valid JSON"):
        store.verify("ingest", "0" * 64)
    (out / MANIFEST).unlink()
    with pytest.raises(CorruptOutput, match="_manifest.json is missing"):
        store.verify("ingest", "0" * 64)
    shutil.rmtree(out)  # deleted whole: simply no output, the stage runs again
    assert store.verify("ingest", "0" * 64)[0] is None


PUBLISH_SCRIPT = """
import sys
from pathlib import Path
from artifacts.store import ArtifactStore

store = ArtifactStore(Path(sys.argv[1]))
staging = store.new_staging("shard", "f" * 64)
for index in range(3):
    (staging / f"part-{index}.bin").write_bytes(bytes([index]) * 100_000)
store.publish("shard", "f" * 64, staging, {"version": sys.argv[2]})
"""


def publish_in_a_process(root: Path, version: str, fault: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != CHAOS_PUBLISH_FAULT}
    if fault is not None:
        env[CHAOS_PUBLISH_FAULT] = f"shard:{fault}"
    process = subprocess.run(
        [sys.executable, "-c", PUBLISH_SCRIPT, str(root), version],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # the fault kills the process's whole group
    )
    return process.returncode


@pytest.mark.chaos
@pytest.mark.parametrize("point", PUBLISH_POINTS)
@pytest.mark.parametrize("replacing", [False, True], ids=["first", "replacing"])
def test_sigkill_at_any_point_of_publish_leaves_old_or_new_whole(
    tmp_path: Path, point: str, replacing: bool
) -> None:
    store = ArtifactStore(tmp_path)
    if replacing:
        assert publish_in_a_process(tmp_path, "old", None) == 0
    reached = replacing or point != "after-aside"  # a first publish moves nothing aside
    returncode = publish_in_a_process(tmp_path, "new", point)
    assert returncode == (-signal.SIGKILL if reached else 0)

    manifest, _ = store.verify("shard", "f" * 64)  # never raises CorruptOutput
    renamed = PUBLISH_POINTS.index(point) >= PUBLISH_POINTS.index("after-rename")
    if renamed or not reached:
        expected = "new"
    elif replacing and point != "after-aside":
        expected = "old"
    else:  # nothing was there, or the old output was moved aside: no output, run again
        expected = None
    assert (manifest["meta"]["version"] if manifest else None) == expected
    # The rerun publishes cleanly over whatever the kill left.
    assert publish_in_a_process(tmp_path, "rerun", None) == 0
    manifest, _ = store.verify("shard", "f" * 64)
    assert manifest["meta"] == {"version": "rerun"}


def test_republish_replaces_the_old_output(tmp_path):
    store = ArtifactStore(tmp_path)
    for content in ("one", "two"):
        staging = store.new_staging("export", "e" * 64)
        (staging / "model.txt").write_text(content)
        store.publish("export", "e" * 64, staging, {})
    assert (store.output_dir("export", "e" * 64) / "model.txt").read_text() == "two"
    leftovers = [p.name for p in (tmp_path / "stages" / "export").iterdir()]
    assert leftovers == ["e" * 64]


def test_run_record_and_registry(tmp_path):
    store = ArtifactStore(tmp_path)
    path = store.write_run_record("r1", {"status": "completed"})
    assert path == tmp_path / "runs" / "r1" / "summary.json"
    record = json.loads(path.read_text())
    assert record.pop("signature")["key_id"]
    assert record.pop("place") == {"type": "run-record", "run_id": "r1"}
    assert record == {"status": "completed"}
    staging = store.new_staging("export", "e" * 64)
    (staging / "model.onnx").write_bytes(b"onnx")
    store.publish("export", "e" * 64, staging, {})
    model = store.publish_model("ctr", "abc", store.output_dir("export", "e" * 64))
    assert (model / "model.onnx").read_bytes() == b"onnx"


def test_a_package_without_a_verified_manifest_is_not_published(tmp_path):
    store = ArtifactStore(tmp_path)
    package = tmp_path / "stages" / "export" / ("e" * 64)
    package.mkdir(parents=True)
    (package / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(CorruptOutput, match="_manifest.json is missing"):
        store.publish_model("ctr", "abc", package)
    assert not (tmp_path / "registry" / "ctr" / "abc").exists()


@pytest.mark.parametrize("root", ["s3:/bucket/x", "s3:bucket/x", "s3://", "gs:///"])
def test_a_malformed_root_url_is_refused_not_made_a_local_folder(root, tmp_path, monkeypatch):
    from artifacts.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="artifact root"):
        ArtifactStore(root)
    assert list(tmp_path.iterdir()) == []
