"""Attacks by a writer to the bucket on what recforge reads back: each must be refused.

The attacker can write any object under the root but does not hold the run key. Each
test plays one attack from issue 27 (docs/security.md) and checks that nothing named
by the forged record is opened, nothing is written outside the root, and no payload
runs. `memory://` stands for the bucket (an fsspec object store, no network).
"""

import hashlib
import json
import pickle
import uuid
from pathlib import Path

import fsspec
import pytest

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.checkpoints import MANIFEST, CheckpointCorrupt, CheckpointStore
from artifacts.errors import ConfigError, DeterministicError
from artifacts.locations import UnsafeName, safe_join
from artifacts.registry import CHAMPION, INFRA_REPORT, Registry
from artifacts.signing import KEY_ENV, SignatureError, sign
from artifacts.store import ArtifactStore, check_output_dir, materialize

pytestmark = pytest.mark.security

KEY = "k" * 64


@pytest.fixture(autouse=True)
def run_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


@pytest.fixture
def bucket() -> str:
    """A fresh prefix of an in-memory object store, standing in for the bucket."""
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/root"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Payload:
    """A pickle whose loading creates `marker` (what a remote code execution would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


def publish_output(store: ArtifactStore, stage: str = "shard", fp: str = "f" * 64) -> str:
    staging = store.new_staging(stage, fp)
    (staging / "part.txt").write_text("honest bytes\n")
    store.publish(stage, fp, staging, {})
    return store.output_url(stage, fp)


def test_a_manifest_naming_dot_dot_writes_nothing_outside_the_cache(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    store = ArtifactStore(bucket)
    url = publish_output(store)
    fs, path = fsspec.core.url_to_fs(url)
    manifest = json.loads(fs.cat_file(f"{path}/_manifest.json"))
    evil = b"written by the attacker\n"
    rel = "../../../../../../escaped.txt"
    fs.pipe_file(f"{path}/{manifest['data']}/{rel}", evil)
    manifest["files"][rel] = {"bytes": len(evil), "sha256": sha(evil)}
    fs.pipe_file(f"{path}/_manifest.json", json.dumps(manifest).encode())

    with pytest.raises(DeterministicError):
        materialize(url)
    assert not list(tmp_path.rglob("escaped.txt"))


def test_a_forged_stage_manifest_without_the_key_is_refused(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    store = ArtifactStore(bucket)
    url = publish_output(store)
    fs, path = fsspec.core.url_to_fs(url)
    manifest = json.loads(fs.cat_file(f"{path}/_manifest.json"))
    forged = b"the attacker's data\n"
    fs.pipe_file(f"{path}/{manifest['data']}/part.txt", forged)
    manifest["files"]["part.txt"].update(bytes=len(forged), sha256=sha(forged), etag=None)
    manifest.pop("signature", None)  # without the key it cannot be signed again
    fs.pipe_file(f"{path}/_manifest.json", json.dumps(manifest).encode())

    with pytest.raises(SignatureError, match="not signed"):
        store.verify("shard", "f" * 64)
    with pytest.raises(SignatureError):
        materialize(url)


def test_a_local_stage_manifest_rewritten_without_the_key_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish_output(store)
    out = store.output_dir("shard", "f" * 64)
    (out / "part.txt").write_text("swapped\n")
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["part.txt"].update(bytes=8, sha256=sha(b"swapped\n"))
    manifest["signature"]["hmac"] = "0" * 64
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SignatureError, match="does not match"):
        store.verify("shard", "f" * 64)


def forge_checkpoint(root: Path, marker: Path) -> Path:
    """A committed checkpoint whose state file is swapped for a pickle payload, its
    manifest's sha256 rewritten to match (what a bucket writer can do)."""
    store = CheckpointStore(root)
    store.prepare(7)
    (store.staging_dir(7) / "state.pt").write_bytes(b"honest tensors")
    path = store.commit(7, meta={"cursor": 7})
    payload = pickle.dumps(Payload(marker))
    (path / "state.pt").write_bytes(payload)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["state.pt"] = {"size": len(payload), "sha256": sha(payload)}
    manifest.pop("signature", None)
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def test_a_forged_checkpoint_is_never_a_resume_point(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    forge_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(CheckpointCorrupt, match="not signed"):
        CheckpointStore(tmp_path / "ckpt").latest_valid(strict=True)
    assert not marker.exists()


def test_a_forged_remote_checkpoint_is_not_pulled(bucket: str, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    forged = forge_checkpoint(tmp_path / "attacker", marker)
    fs, path = fsspec.core.url_to_fs(bucket)
    for file in forged.iterdir():
        fs.pipe_file(f"{path}/{forged.name}/{file.name}", file.read_bytes())
    lines: list[str] = []
    mirror = CheckpointMirror(tmp_path / "local", bucket, keep=2, log=lines.append)
    assert mirror.pull() is None
    assert not (tmp_path / "local" / forged.name).exists()
    assert any("not signed" in line for line in lines)
    assert not marker.exists()


def test_a_checkpoint_manifest_naming_dot_dot_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    store.prepare(3)
    (store.staging_dir(3) / "a.pt").write_bytes(b"x")
    path = store.commit(3, meta={})
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["../../outside.bin"] = {"size": 6, "sha256": sha(b"secret")}
    (path / MANIFEST).write_text(json.dumps(sign(manifest)))  # even signed by a key holder
    assert "outside" in str(store.verify(path))


def register(root: str | Path, version: str) -> None:
    store = ArtifactStore(root)
    staging = store.new_staging("export", version * 8)
    (staging / "model.onnx").write_bytes(b"onnx " + version.encode())
    (staging / "score.py").write_text("# scorer\n")
    (staging / INFRA_REPORT).write_text(json.dumps({"ok": True, "rows": 8}))
    store.publish("export", version * 8, staging, {})
    store.publish_model("ctr", version, store.output_dir("export", version * 8))


@pytest.mark.parametrize("absolute", [False, True])
def test_a_champion_pointing_outside_the_registry_is_refused(
    tmp_path: Path, absolute: bool
) -> None:
    root = tmp_path / "root"
    register(root, "v1")
    Registry(root, "ctr").promote("v1", "first")
    # The attacker has a package of their own outside the registry, and points CHAMPION
    # at it (a relative or an absolute path).
    register(tmp_path / "elsewhere", "v9")
    version = (
        str(tmp_path / "elsewhere" / "registry" / "ctr" / "v9")
        if absolute
        else "../../../elsewhere/registry/ctr/v9"
    )
    champion = root / "registry" / "ctr" / CHAMPION
    record = json.loads(champion.read_text())
    champion.write_text(json.dumps(sign({**record, "version": version})))
    registry = Registry(root, "ctr")
    with pytest.raises(DeterministicError):
        registry.path(registry.champion())


def test_a_remote_champion_with_dot_dot_writes_nothing_outside_the_mirror(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RECFORGE_CACHE_DIR", str(cache))
    register(bucket, "v1")
    fs, path = fsspec.core.url_to_fs(bucket)
    escape = "../" * 12 + "escaped"
    # A whole package under the literal key the traversal names, and CHAMPION naming it.
    source = f"{path}/registry/ctr/v1"
    for name in fs.find(source):
        fs.pipe_file(name.replace(source, f"{path}/registry/ctr/{escape}"), fs.cat_file(name))
    # Signed as if by a key holder: the safe join must stop it on its own.
    record = sign({"version": escape, "promoted_at": "", "reason": "", "previous": None})
    fs.pipe_file(f"{path}/registry/ctr/{CHAMPION}", json.dumps(record).encode())
    registry = Registry(bucket, "ctr")
    with pytest.raises(DeterministicError):
        registry.path(registry.champion())
    assert not list(tmp_path.rglob("escaped"))


def test_a_champion_previous_outside_the_registry_cannot_be_rolled_back_to(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    register(root, "v1")
    Registry(root, "ctr").promote("v1", "first")
    champion = root / "registry" / "ctr" / CHAMPION
    record = json.loads(champion.read_text())
    register(tmp_path / "elsewhere", "v9")
    forged = {**record, "previous": "../../../elsewhere/registry/ctr/v9"}
    champion.write_text(json.dumps(sign(forged)))
    before = champion.read_text()
    with pytest.raises(DeterministicError):
        Registry(root, "ctr").rollback()
    assert champion.read_text() == before


def test_a_latest_pointer_to_another_location_is_not_followed(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store.record_latest("demo", "ingest", elsewhere)  # as if the attacker wrote it
    pointer = tmp_path / "root" / "latest" / "demo" / "ingest.json"
    pointer.write_text(json.dumps({"output": str(elsewhere)}))
    with pytest.raises(DeterministicError):
        store.latest_output("demo", "ingest")


@pytest.mark.parametrize(
    "name",
    ["../x", "a/../../x", "/etc/passwd", "a\\..\\x", "s3://other/x", "file:///etc", "a//b", ""],
)
def test_safe_join_refuses_names_that_leave_the_root(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafeName):
        safe_join(tmp_path, name, "a manifest entry")
    with pytest.raises(UnsafeName):
        safe_join("s3://bucket/root", name, "a manifest entry")


def test_safe_join_refuses_a_symlink_out_of_the_root(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafeName, match="resolves outside"):
        safe_join(tmp_path / "root", "link/x", "a manifest entry")
    assert safe_join(tmp_path / "root", "a/b.pt", "x") == tmp_path / "root" / "a" / "b.pt"


def test_a_remote_root_without_a_key_refuses_to_start(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ConfigError, match="RECFORGE_SIGNING_KEY"):
        ArtifactStore(bucket).require_key()


def test_a_local_root_without_a_key_works_unsigned_with_one_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(KEY_ENV)
    store = ArtifactStore(tmp_path)
    with caplog.at_level("WARNING", logger="artifacts.signing"):
        assert store.require_key() is None
        assert store.require_key() is None
    notices = [r.getMessage() for r in caplog.records if "no signing key" in r.getMessage()]
    assert len(notices) == 1 and str(tmp_path) in notices[0]
    publish_output(store)
    manifest = json.loads((store.output_dir("shard", "f" * 64) / "_manifest.json").read_text())
    assert "signature" not in manifest
    assert check_output_dir(store.output_dir("shard", "f" * 64)) == ""


def test_a_rotated_key_still_reads_what_the_old_one_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(tmp_path)
    publish_output(store)
    output = store.output_dir("shard", "f" * 64)
    monkeypatch.setenv(KEY_ENV, "n" * 64)
    with pytest.raises(SignatureError, match="not among the configured keys"):
        check_output_dir(output)
    monkeypatch.setenv("RECFORGE_SIGNING_KEYS_RETIRED", KEY)
    assert check_output_dir(output) == ""


def test_a_short_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "password")
    with pytest.raises(ConfigError, match="8 characters"):
        sign({"a": 1})


def test_a_forged_champion_score_is_not_trusted_by_the_gate(tmp_path: Path) -> None:
    from tasks.promote import cached_metrics, store_metrics

    cached = tmp_path / "champion-evals" / "v1-0123.json"
    cached.parent.mkdir()
    cached.write_text(json.dumps({"auc": 0.01, "logloss": 9.0}))  # makes any candidate win
    assert cached_metrics(cached, "ctr", "v1", "0123") is None
    store_metrics(cached, {"auc": 0.71, "logloss": 0.52}, "ctr", "v1", "0123")
    assert cached_metrics(cached, "ctr", "v1", "0123") == {"auc": 0.71, "logloss": 0.52}
