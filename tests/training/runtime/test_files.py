"""What a resume recognises the training data by (`training.runtime.files.data_identity`)."""

import json
import shutil
from pathlib import Path

from training.runtime.files import OUTPUT_MANIFEST, data_identity


def published(root: Path, files: dict[str, bytes]) -> Path:
    """A stage output with the store's manifest (sha256 of every file)."""
    import hashlib

    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    listed = {
        rel: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()
    }
    (root / OUTPUT_MANIFEST).write_text(json.dumps({"files": listed}))
    return root


def test_the_same_published_data_is_the_same_wherever_it_lies(tmp_path: Path) -> None:
    files = {"dataset.json": b"{}", "train-0.parquet": b"rows", "sequences/train.parquet": b"s"}
    one = published(tmp_path / "cache-one" / "out", files)
    other = published(tmp_path / "node-1" / "cache" / "out", files)
    assert data_identity(one) == data_identity(other)
    assert data_identity(one / "sequences") == data_identity(other / "sequences")
    assert data_identity(one / "sequences" / "train.parquet") == data_identity(
        other / "sequences" / "train.parquet"
    )
    assert data_identity(one / "sequences") != data_identity(one)
    changed = published(tmp_path / "changed", {**files, "train-0.parquet": b"other rows"})
    assert data_identity(changed) != data_identity(one)
    assert data_identity(changed / "sequences") == data_identity(one / "sequences")


def test_data_outside_a_published_output_is_known_by_its_path(tmp_path: Path) -> None:
    plain = tmp_path / "shards"
    plain.mkdir()
    assert data_identity(plain) == str(plain.resolve())
    shutil.copytree(plain, tmp_path / "copy")
    assert data_identity(tmp_path / "copy") != data_identity(plain)
