"""Attacks on what a warm start reads back: the parent's package, lineage and train output.

`train.init` makes a day's run read the champion's package (its transform and
`lineage.json`) and, through the lineage, the parent's train output, whose final
checkpoint the ranks then load. A writer to the bucket without the run key must not be
able to steer that: every file is verified against its signed manifest before it is
read, and every stored name is checked before it is joined onto a path.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from artifacts.errors import ConfigError, CorruptOutput
from artifacts.locations import UnsafeName
from artifacts.registry import Registry
from artifacts.signing import KEY_ENV, SignatureError
from artifacts.store import ArtifactStore
from tasks.incremental import resolve_parent
from training.config import TrainConfig

pytestmark = pytest.mark.security

MODEL = "ctr"
HONEST_TRAIN = "a" * 64


@pytest.fixture(autouse=True)
def run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 64)


def config(init: str | None, partition: str = "dt=2026-12-02") -> SimpleNamespace:
    return SimpleNamespace(
        train=SimpleNamespace(init=init),
        ingest=SimpleNamespace(partition=partition),
        export=SimpleNamespace(model_name=MODEL),
    )


def register(store: ArtifactStore, version: str, files: dict[str, dict]) -> Path:
    """An export output of `files` (JSON), published as `version` and promoted."""
    fp = version.ljust(64, "0")
    staging = store.new_staging("export", fp)
    for name, content in files.items():
        (staging / name).write_text(json.dumps(content))
    store.publish("export", fp, staging, {})
    published = Path(store.publish_model(MODEL, version, store.output_dir("export", fp)))
    Registry(store, MODEL).promote(version, "test")
    return published


def publish_train(store: ArtifactStore, fp: str, world_size: int) -> Path:
    """A train output of fingerprint `fp` (its final weights stand in for the checkpoint)."""
    staging = store.new_staging("train", fp)
    (staging / "model.safetensors").write_bytes(b"weights of " + fp[:8].encode())
    store.publish("train", fp, staging, {"world_size": world_size})
    return store.output_dir("train", fp)


def publish(store: ArtifactStore, version: str, lineage: dict) -> Path:
    """A package with a chain's transform and a lineage, promoted."""
    transform = {"sparse": {}, "partitions": ["dt=2026-12-01"]}
    return register(store, version, {"transform.json": transform, "lineage.json": lineage})


def test_an_honest_champion_is_the_parent(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish(store, "v1", {"parent": None, "train": HONEST_TRAIN})
    parent = resolve_parent(config("champion"), store)
    assert parent is not None
    assert (parent.version, parent.train) == ("v1", HONEST_TRAIN)
    assert parent.partitions == ["dt=2026-12-01"]
    # A rerun of the partition the champion has seen starts where the chain started.
    assert resolve_parent(config("champion", "dt=2026-12-01"), store) is None


def test_a_lineage_rewritten_in_the_bucket_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    published = publish(store, "v1", {"parent": None, "train": HONEST_TRAIN})
    # The attacker points the warm start at a train output of their choosing.
    (published / "lineage.json").write_text(json.dumps({"parent": None, "train": "e" * 64}))
    with pytest.raises(CorruptOutput, match="lineage.json"):
        resolve_parent(config("champion"), store)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("train", "../../../../etc", CorruptOutput),
        ("train", "A" * 64, CorruptOutput),
        ("parent", "../../other-model/v9", UnsafeName),
    ],
)
def test_a_lineage_naming_a_path_is_refused(
    tmp_path: Path, field: str, value: str, error: type[Exception]
) -> None:
    """Even a signed lineage names a fingerprint and a version, never a path."""
    store = ArtifactStore(tmp_path / "root")
    lineage = {"parent": None, "train": HONEST_TRAIN, field: value}
    publish(store, "v1", lineage)
    with pytest.raises(error):
        resolve_parent(config("champion", "dt=2026-12-01"), store)


def test_a_ui_supplied_init_is_a_plain_version_or_champion() -> None:
    for hostile in ("../../registry/x", "/etc/passwd", "v1/../../x", "v 1", ""):
        with pytest.raises(ValidationError, match="train.init"):
            TrainConfig(init=hostile)
    assert TrainConfig(init="3f2a9c1e0b7d").init == "3f2a9c1e0b7d"
    # What cannot warm-start is refused by name, before anything runs.
    for unsupported, named in [
        ({"model": "sasrec"}, "sasrec cannot warm-start"),
        ({"embeddings": "dense"}, "embeddings: sharded"),
        ({"launcher": "per_node", "world_size": 2}, "per_node"),
    ]:
        with pytest.raises(ValidationError, match=named):
            TrainConfig(init="champion", **unsupported)


def test_a_champion_without_lineage_or_chain_is_refused_by_name(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    register(store, "old", {"transform.json": {"sparse": {}}})
    with pytest.raises(ConfigError, match="lineage.json"):
        resolve_parent(config("champion"), store)
    with pytest.raises(ConfigError, match="ingest.partition"):
        resolve_parent(config("champion", None), store)


def test_a_train_output_copied_over_the_lineages_is_refused(tmp_path: Path) -> None:
    """The attacker cannot sign, but can copy another signed train output (another
    parent's weights, another world size) over the one the champion's lineage names."""
    store = ArtifactStore(tmp_path / "root")
    honest = publish_train(store, HONEST_TRAIN, world_size=2)
    other = publish_train(store, "b" * 64, world_size=7)
    publish(store, "v1", {"parent": None, "train": HONEST_TRAIN})
    parent = resolve_parent(config("champion"), store)
    assert parent.train_output(store).meta["world_size"] == 2
    shutil.rmtree(honest)
    shutil.copytree(other, honest)
    with pytest.raises((SignatureError, CorruptOutput), match="bbbbbbbbbbbbbbbb"):
        parent.train_output(store)


def test_an_old_package_copied_over_the_champion_steers_no_warm_start(tmp_path: Path) -> None:
    """An old version's package (another lineage) copied over the champion's directory."""
    store = ArtifactStore(tmp_path / "root")
    old = publish(store, "v1", {"parent": None, "train": "b" * 64})
    champion = publish(store, "v2", {"parent": None, "train": HONEST_TRAIN})
    shutil.rmtree(champion)
    shutil.copytree(old, champion)
    with pytest.raises(SignatureError, match="version=v1.*version=v2"):
        resolve_parent(config("champion"), store)
