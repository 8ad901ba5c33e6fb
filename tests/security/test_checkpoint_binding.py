"""Attacks on resume checkpoints by copying signed manifests (issue 38, finding 9).

A writer to the bucket cannot sign a checkpoint manifest, but can copy one a key holder
signed: another run's checkpoint into this run's directory, or an older step's under a
newer step's name. The world size a retry refits its layout to is read from the newest
checkpoint manifest before any rank starts, so a copied one would steer it. Every
checkpoint manifest names its place (the resume key of its run, and its step); every
reader refuses one found elsewhere. And a rank whose artifact root is shared storage
refuses to start without the key: without it, it would verify nothing.
"""

import json
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest

from artifacts.checkpoint_mirror import CheckpointMirror, newest_checkpoint_meta
from artifacts.checkpoints import MANIFEST, CheckpointCorrupt, CheckpointStore, checkpoint_name
from artifacts.errors import ConfigError
from artifacts.signing import KEY_ENV, KEY_FILE_ENV, MisplacedRecord
from training.runtime.rank import require_rank_key

pytestmark = pytest.mark.security

OURS = "a" * 64
THEIRS = "b" * 64


@pytest.fixture(autouse=True)
def run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 64)


def save(root: Path, step: int, world_size: int) -> Path:
    """One committed checkpoint of `step` under `root` (named by its run's resume key)."""
    store = CheckpointStore(root)
    staging = store.prepare(step)
    (staging / "rank-00000.pt").write_bytes(b"state of step %d" % step)
    meta = {"step": step, "world_size": world_size, "global_batch_size": 64}
    return store.commit(step, meta)


def test_another_runs_checkpoint_copied_in_is_never_a_resume_point(tmp_path: Path) -> None:
    ours, theirs = tmp_path / OURS, tmp_path / THEIRS
    save(ours, 10, world_size=2)
    planted = save(theirs, 20, world_size=7)
    shutil.copytree(planted, ours / planted.name)
    store = CheckpointStore(ours)
    reason = store.verify(ours / planted.name)
    assert reason is not None and "relocated copy" in reason and "bbbbbbbb" in reason
    assert store.latest_valid(strict=True).step == 10


def test_an_old_step_copied_over_a_newer_name_is_refused(tmp_path: Path) -> None:
    ours = tmp_path / OURS
    old = save(ours, 10, world_size=2)
    shutil.copytree(old, ours / checkpoint_name(30))
    assert "step" in str(CheckpointStore(ours).verify(ours / checkpoint_name(30)))
    assert CheckpointStore(ours).latest_valid(strict=True).step == 10


def test_a_relocated_checkpoint_alone_is_refused_by_name(tmp_path: Path) -> None:
    ours, theirs = tmp_path / OURS, tmp_path / THEIRS
    planted = save(theirs, 20, world_size=7)
    shutil.copytree(planted, ours / planted.name)
    with pytest.raises(CheckpointCorrupt, match="relocated copy"):
        CheckpointStore(ours).latest_valid(strict=True)


def test_the_refit_world_size_is_not_taken_from_a_copied_manifest(tmp_path: Path) -> None:
    ours, theirs = tmp_path / OURS, tmp_path / THEIRS
    save(ours, 10, world_size=2)
    # Another run's newer checkpoint, and our own older one under a newer step's name.
    shutil.copytree(save(theirs, 20, world_size=7), ours / checkpoint_name(20))
    save(theirs, 5, world_size=9)
    (ours / checkpoint_name(40)).mkdir()
    shutil.copyfile(theirs / checkpoint_name(5) / MANIFEST, ours / checkpoint_name(40) / MANIFEST)
    (ours / checkpoint_name(50)).mkdir()
    shutil.copyfile(ours / checkpoint_name(10) / MANIFEST, ours / checkpoint_name(50) / MANIFEST)
    step, meta = newest_checkpoint_meta(str(ours))
    assert (step, meta["world_size"]) == (10, 2)
    assert newest_checkpoint_meta(str(ours), fingerprint="c" * 64) is None


def test_a_relocated_remote_checkpoint_is_not_pulled(tmp_path: Path) -> None:
    bucket = f"memory://bucket-{uuid.uuid4().hex[:8]}/root/checkpoints/train"
    planted = save(tmp_path / THEIRS, 20, world_size=7)
    fs, path = fsspec.core.url_to_fs(bucket)
    for file in planted.iterdir():
        fs.pipe_file(f"{path}/{OURS}/{planted.name}/{file.name}", file.read_bytes())
    lines: list[str] = []
    mirror = CheckpointMirror(tmp_path / "local" / OURS, f"{bucket}/{OURS}", 2, lines.append)
    assert mirror.pull() is None
    assert not (tmp_path / "local" / OURS / planted.name).exists()
    assert any("relocated copy" in line for line in lines)
    assert newest_checkpoint_meta(f"{bucket}/{OURS}") is None


def test_a_checkpoint_manifest_that_does_not_parse_is_skipped_not_a_crash(
    tmp_path: Path,
) -> None:
    ours = tmp_path / OURS
    save(ours, 10, world_size=2)
    (ours / checkpoint_name(20)).mkdir()
    (ours / checkpoint_name(20) / MANIFEST).write_text('{"step": ' + "9" * 5000 + "}")
    (ours / checkpoint_name(30)).mkdir()
    (ours / checkpoint_name(30) / MANIFEST).write_bytes(b"\xff\xfe")
    assert CheckpointStore(ours).latest_valid(strict=True).step == 10
    assert newest_checkpoint_meta(str(ours))[0] == 10


def test_an_unbound_checkpoint_is_refused_naming_what_rebuilds_it(tmp_path: Path) -> None:
    from artifacts.signing import sign

    ours = tmp_path / OURS
    path = save(ours, 10, world_size=2)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.pop("place")
    (path / MANIFEST).write_text(json.dumps(sign(manifest)))
    with pytest.raises(CheckpointCorrupt, match="names no place.*checkpoint"):
        CheckpointStore(ours).latest_valid(strict=True)
    with pytest.raises(MisplacedRecord):
        CheckpointStore(ours).manifest(path)


def test_a_rank_with_a_remote_root_and_no_key_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"shared storage.*{KEY_ENV}"):
        require_rank_key({"artifact_root": "s3://bucket/recforge"})
    # A local root (or a spec that names none) still works without a key, as before.
    require_rank_key({"artifact_root": "/tmp/store"})
    require_rank_key({})
    monkeypatch.setenv(KEY_ENV, "k" * 64)
    require_rank_key({"artifact_root": "s3://bucket/recforge"})
