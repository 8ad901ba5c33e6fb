import json

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.store import ArtifactStore, fingerprint


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


def test_verify_rejects_missing_or_corrupt_files(tmp_path):
    store = ArtifactStore(tmp_path)
    assert store.verify("ingest", "0" * 64)[0] is None
    staging = store.new_staging("ingest", "0" * 64)
    (staging / "a.txt").write_text("hello")
    store.publish("ingest", "0" * 64, staging, {})
    path = store.output_dir("ingest", "0" * 64) / "a.txt"

    path.write_text("hellO")  # same size, one flipped byte
    manifest, why = store.verify("ingest", "0" * 64)
    assert manifest is None and "sha256" in why
    path.unlink()
    assert "missing" in store.verify("ingest", "0" * 64)[1]


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
    assert json.loads(path.read_text()) == {"status": "completed"}
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "model.onnx").write_bytes(b"onnx")
    model = store.publish_model("ctr", "abc", package)
    assert (model / "model.onnx").read_bytes() == b"onnx"
