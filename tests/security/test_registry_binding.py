"""Attacks on the registry by copying signed records (issue 38, finding 1).

A writer to the bucket without the run key cannot forge a record, but can copy one a key
holder signed to another place: an old version's package over the champion's directory,
one version's blessing decision to another, another model's CHAMPION or history line, a
champion score cached for another version. Every registry record names its place, and
every reader refuses a copy found anywhere else, naming both places.
"""

import json
import logging
import shutil
from pathlib import Path

import pytest

from artifacts.errors import CorruptOutput
from artifacts.registry import CHAMPION, DECISIONS, HISTORY, INFRA_REPORT, Registry
from artifacts.signing import KEY_ENV, MisplacedRecord, SignatureError, sign
from artifacts.store import MANIFEST, ArtifactStore
from tasks import promote

pytestmark = pytest.mark.security

MODEL = "ctr"


@pytest.fixture(autouse=True)
def run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 64)


def register(store: ArtifactStore, version: str, model: str = MODEL) -> Path:
    """A CTR export package published as `version` of `model` (its manifest signed for
    that place by `publish_model`)."""
    fp = (model + version).encode().hex().ljust(64, "0")[:64]
    staging = store.new_staging("export", fp)
    (staging / "model.onnx").write_bytes(b"onnx " + version.encode())
    (staging / "score.py").write_text("# scorer\n")
    (staging / INFRA_REPORT).write_text(json.dumps({"ok": True, "rows": 8}))
    store.publish("export", fp, staging, {})
    return Path(store.publish_model(model, version, store.output_dir("export", fp)))


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "root")


def test_an_old_version_copied_over_the_champion_is_refused_naming_both(
    store: ArtifactStore,
) -> None:
    registry = Registry(store, MODEL)
    v1, v2 = register(store, "v1"), register(store, "v2")
    registry.promote("v1", "first")
    registry.promote("v2", "better")
    # The attack: v1's signed package put where v2 (the champion) is served from.
    shutil.rmtree(v2)
    shutil.copytree(v1, v2)
    with pytest.raises(MisplacedRecord, match="version=v1.*version=v2"):
        registry.verify("v2")
    with pytest.raises(MisplacedRecord, match="relocated copy"):
        registry.path("v2")
    assert [v.name for v in registry.versions()] == ["v1"]  # the copy is no version


def test_an_old_version_copied_over_a_newer_one_cannot_be_promoted(
    store: ArtifactStore,
) -> None:
    registry = Registry(store, MODEL)
    v1, v3 = register(store, "v1"), register(store, "v3")
    shutil.rmtree(v3)
    shutil.copytree(v1, v3)
    with pytest.raises(MisplacedRecord, match="version=v1"):
        registry.promote("v3", "blessed")
    assert registry.champion() is None


def test_a_package_of_another_model_is_refused(store: ArtifactStore) -> None:
    other = register(store, "v1", model="other")
    target = Path(store.model_location(MODEL, "v1"))
    target.parent.mkdir(parents=True)
    shutil.copytree(other, target)
    with pytest.raises(MisplacedRecord, match="model=other.*model=ctr"):
        Registry(store, MODEL).verify("v1")


def test_an_unbound_package_is_refused_by_name_with_what_rebuilds_it(
    store: ArtifactStore,
) -> None:
    package = register(store, "v1")
    manifest = json.loads((package / MANIFEST).read_text())
    manifest.pop("place")
    (package / MANIFEST).write_text(json.dumps(sign(manifest)))
    with pytest.raises(MisplacedRecord, match="names no place.*--force export"):
        Registry(store, MODEL).verify("v1")


def test_registry_path_refuses_a_tampered_package(store: ArtifactStore) -> None:
    package = register(store, "v1")
    (package / "model.onnx").write_bytes(b"a model that scores what the attacker wants")
    with pytest.raises(CorruptOutput, match="model.onnx"):
        Registry(store, MODEL).path("v1")


def test_a_decision_copied_from_another_version_blesses_nothing(
    store: ArtifactStore, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry(store, MODEL)
    register(store, "v1")
    register(store, "v2")
    registry.record_decision("v1", {"blessed": True, "checks": []})
    registry.record_decision("v2", {"blessed": False, "checks": []})
    decisions = registry.root / DECISIONS
    shutil.copyfile(decisions / "v1.json", decisions / "v2.json")
    with caplog.at_level(logging.WARNING):
        assert registry.decision("v2") is None
    assert "version=v1" in caplog.text and "version=v2" in caplog.text
    assert registry.decision("v1")["blessed"] is True


def test_a_champion_pointer_copied_from_another_model_is_refused(
    store: ArtifactStore,
) -> None:
    register(store, "v1")
    register(store, "v1", model="other")
    Registry(store, "other").promote("v1", "theirs")
    ours = Registry(store, MODEL)
    ours.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Registry(store, "other").root / CHAMPION, ours.root / CHAMPION)
    with pytest.raises(MisplacedRecord, match="model=other.*model=ctr"):
        ours.champion()
    with pytest.raises(MisplacedRecord):
        ours.promote("v1", "first")  # a move reads the pointer it replaces


def test_a_history_line_copied_from_another_model_is_left_out(
    store: ArtifactStore, caplog: pytest.LogCaptureFixture
) -> None:
    register(store, "v1")
    register(store, "v9", model="other")
    Registry(store, "other").promote("v9", "theirs")
    ours = Registry(store, MODEL)
    ours.promote("v1", "first")
    theirs = (Registry(store, "other").root / HISTORY).read_text()
    with open(ours.root / HISTORY, "a") as handle:
        handle.write(theirs)
    with caplog.at_level(logging.WARNING):
        assert [h["version"] for h in ours.history()] == ["v1"]
    assert "model=other" in caplog.text


def test_a_champion_score_copied_from_another_version_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    v1 = tmp_path / "v1-key.json"
    v2 = tmp_path / "v2-key.json"
    promote.store_metrics(v1, {"auc": 0.99}, MODEL, "v1", "key")
    assert promote.cached_metrics(v1, MODEL, "v1", "key") == {"auc": 0.99}
    shutil.copyfile(v1, v2)
    with caplog.at_level(logging.WARNING):
        assert promote.cached_metrics(v2, MODEL, "v2", "key") is None
    assert "version=v1" in caplog.text
    # Scored on other test data (another cache key) under the same version: not ours either.
    assert promote.cached_metrics(v1, MODEL, "v1", "other-key") is None


def test_a_cached_score_that_does_not_parse_is_scored_again(tmp_path: Path) -> None:
    cached = tmp_path / "v1-key.json"
    cached.write_text('{"auc": ' + "9" * 5000 + "}")
    assert promote.cached_metrics(cached, MODEL, "v1", "key") is None
    cached.write_bytes(b"\xff\xfe not text")
    assert promote.cached_metrics(cached, MODEL, "v1", "key") is None


def test_a_champion_pointer_that_does_not_parse_is_refused_not_a_crash(
    store: ArtifactStore,
) -> None:
    registry = Registry(store, MODEL)
    registry.root.mkdir(parents=True)
    (registry.root / CHAMPION).write_text("[" * 100_000)
    with pytest.raises(SignatureError):
        registry.champion()
