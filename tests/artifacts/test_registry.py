import json
from pathlib import Path

import pytest

from artifacts.errors import ConfigError, CorruptOutput, InputNotFoundError
from artifacts.registry import CHAMPION, INFRA_REPORT, Registry
from artifacts.store import ArtifactStore
from flows.cli import main

OK = {"ok": True, "rows": 8}


def register(root: Path, version: str, infra: dict | None = OK) -> Path:
    """An export package (with an infra report) published into the registry as `version`."""
    store = ArtifactStore(root)
    staging = store.new_staging("export", version * 4)
    (staging / "model.onnx").write_bytes(b"onnx " + version.encode())
    (staging / "score.py").write_text("# scorer\n")
    if infra is not None:
        (staging / INFRA_REPORT).write_text(json.dumps(infra))
    store.publish("export", version * 4, staging, {})
    return Path(store.publish_model("ctr", version, store.output_dir("export", version * 4)))


def test_promote_and_rollback_move_one_pointer(tmp_path: Path) -> None:
    registry = Registry(tmp_path, "ctr")
    assert registry.champion() is None and registry.versions() == []
    for version in ("v1", "v2", "v3"):
        register(tmp_path, version)
    registry.promote("v1", "first")
    registry.promote("v2", "better")
    record = registry.promote("v3", "better again")
    assert record["previous"] == "v2" and registry.champion() == "v3"
    assert [v.name for v in registry.versions() if v.champion] == ["v3"]

    assert registry.rollback()["version"] == "v2"
    assert registry.rollback()["version"] == "v1"  # walks back in time
    with pytest.raises(InputNotFoundError, match="no earlier champion"):
        registry.rollback()
    events = [(h["event"], h["version"]) for h in registry.history()]
    assert events == [
        ("promote", "v1"),
        ("promote", "v2"),
        ("promote", "v3"),
        ("rollback", "v2"),
        ("rollback", "v1"),
    ]
    assert not list(registry.root.glob("*.tmp-*"))  # the pointer was replaced by rename


def test_a_package_that_fails_verification_leaves_the_champion(tmp_path: Path) -> None:
    registry = Registry(tmp_path, "ctr")
    register(tmp_path, "v1")
    registry.promote("v1", "first")
    pointer = (registry.root / CHAMPION).read_bytes()

    (register(tmp_path, "v2") / "model.onnx").write_bytes(b"flipped")
    with pytest.raises(CorruptOutput, match="does not match its manifest"):
        registry.promote("v2", "blessed")
    register(tmp_path, "v3", infra=None)
    with pytest.raises(ConfigError, match="never loaded and scored in a fresh process"):
        registry.promote("v3", "blessed")
    register(tmp_path, "v4", infra={"ok": False, "rows": 0})
    with pytest.raises(ConfigError, match="infra validation failed"):
        registry.promote("v4", "blessed")
    with pytest.raises(InputNotFoundError, match="no version 'v9'"):
        registry.promote("v9", "typo")
    assert (registry.root / CHAMPION).read_bytes() == pointer
    assert [h["version"] for h in registry.history()] == ["v1"]


def test_models_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path)
    register(tmp_path, "v1")
    register(tmp_path, "v2")
    Registry(tmp_path, "ctr").record_decision("v2", {"blessed": False, "checks": []})
    assert main(["models", "--root", root, "promote", "v1"]) == 0
    assert main(["models", "--root", root, "promote", "v2", "--reason", "by hand"]) == 0
    capsys.readouterr()
    assert main(["models", "--root", root, "list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].startswith("  v1") and listing[1].startswith("* v2 ")
    assert "not blessed" in listing[1]
    assert main(["models", "--root", root, "show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == "v2" and shown["champion"] and not shown["decision"]["blessed"]
    assert main(["models", "--root", root, "rollback"]) == 0
    assert "champion of ctr: v1 (was v2)" in capsys.readouterr().out
    assert main(["models", "--root", root, "show", "v7"]) == 2
    assert "no version 'v7'" in capsys.readouterr().err


def test_models_show_tells_the_table_precision_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CTR package keeps its table at train.table_precision: `models show` says which,
    with the table's rows and bytes, from the package's signed model_config.json."""
    store = ArtifactStore(tmp_path)
    staging = store.new_staging("export", "f" * 16)
    (staging / "model.onnx").write_bytes(b"onnx")
    (staging / "score.py").write_text("# scorer\n")
    (staging / INFRA_REPORT).write_text(json.dumps(OK))
    (staging / "model.safetensors").write_bytes(b"\0" * 4321)
    model_config = {"table_sizes": [100, 20], "embedding_dim": 16, "table_precision": "int8"}
    (staging / "model_config.json").write_text(json.dumps(model_config))
    store.publish("export", "f" * 16, staging, {})
    path = Path(store.publish_model("ctr", "v1", store.output_dir("export", "f" * 16)))
    register(tmp_path, "v2")  # a package without model_config.json

    assert main(["models", "--root", str(tmp_path), "show", "v1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["table"] == {
        "precision": "int8",
        "rows": 120,
        "embedding_dim": 16,
        "bytes": 120 * (16 + 8),  # uint8 codes, then the fp32 scale and bias of each row
    }
    assert shown["weights_bytes"] == 4321
    assert main(["models", "--root", str(tmp_path), "show", "v2"]) == 0
    assert "table" not in json.loads(capsys.readouterr().out)

    # Read only as its manifest lists it: an edited model_config.json is refused.
    (path / "model_config.json").write_text(json.dumps({**model_config, "table_precision": "fp32"}))
    assert main(["models", "--root", str(tmp_path), "show", "v1"]) == 2
    assert "does not match its size and sha256" in capsys.readouterr().err
