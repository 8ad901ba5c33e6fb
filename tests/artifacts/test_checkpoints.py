"""Crash-safe checkpoint directories: commit, retention, corruption fallback, crashes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.checkpoints import (
    FAULT_POINTS,
    MANIFEST,
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointStore,
    checkpoint_name,
    parse_step,
)
from artifacts.durable import fsync_tree
from artifacts.errors import ConfigError, DataError, InputNotFoundError

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "model/weights.bin"


def write_payload(staging: Path, step: int) -> None:
    """Files like a rank would write: a nested binary and a small JSON."""
    (staging / "model").mkdir(exist_ok=True)
    (staging / WEIGHTS).write_bytes(bytes(range(256)) * 4 + step.to_bytes(8, "little"))
    (staging / "client_state.json").write_text(json.dumps({"step": step}))


def save(store: CheckpointStore, step: int) -> Path:
    """The whole single-rank protocol: prepare, write, fsync, commit."""
    staging = store.prepare(step)
    write_payload(staging, step)
    fsync_tree(staging)
    return store.commit(step, {"step": step, "config": {"embedding_dim": 8}})


def steps_on_disk(root: Path) -> list[int]:
    return sorted(s for p in root.iterdir() if (s := parse_step(p.name)) is not None)


@pytest.fixture
def logs() -> list[str]:
    return []


@pytest.fixture
def store(tmp_path: Path, logs: list[str]) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", keep=2, log=logs.append)


# --- commit, pointer, retention ----------------------------------------------------


def test_commit_writes_manifest_pointer_and_keeps_newest_two(store: CheckpointStore) -> None:
    for step in (100, 200, 300, 400):
        path = save(store, step)
        assert path == store.root / checkpoint_name(step)
    assert steps_on_disk(store.root) == [300, 400]
    assert (store.root / "latest").read_text() == "step-00000400\n"
    assert list((store.root / ".staging").iterdir()) == []

    manifest = json.loads((store.root / "step-00000400" / MANIFEST).read_text())
    assert manifest["step"] == 400
    assert manifest["meta"] == {"step": 400, "config": {"embedding_dim": 8}}
    assert set(manifest["files"]) == {WEIGHTS, "client_state.json"}
    weights = (store.root / "step-00000400" / WEIGHTS).read_bytes()
    assert manifest["files"][WEIGHTS] == {
        "size": len(weights),
        "sha256": hashlib.sha256(weights).hexdigest(),
    }
    assert manifest["created"].endswith("+00:00")

    latest = store.latest_valid()
    assert latest is not None
    assert (latest.step, latest.path, latest.meta["step"]) == (
        400,
        store.root / "step-00000400",
        400,
    )


def test_keep_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1, log=lambda line: None)
    save(store, 1)
    save(store, 2)
    assert steps_on_disk(tmp_path) == [2]


def test_a_pinned_checkpoint_survives_retention_until_unpinned(store: CheckpointStore) -> None:
    save(store, 100)
    store.pin([100])  # e.g. the best validation step
    for step in (200, 300, 400):
        save(store, step)
    assert steps_on_disk(store.root) == [100, 300, 400]
    assert store.with_fault(lambda point: None)._pinned == {100}  # the fault hook keeps pins
    assert store.latest_valid().step == 400  # a pin does not change the resume point
    store.pin([300])
    save(store, 500)
    assert steps_on_disk(store.root) == [300, 400, 500]
    save(store, 600)
    assert steps_on_disk(store.root) == [300, 500, 600]


def test_retention_never_counts_invalid_checkpoints(store: CheckpointStore) -> None:
    save(store, 100)
    save(store, 200)
    with open(store.root / "step-00000200" / WEIGHTS, "r+b") as handle:
        handle.truncate(10)
    save(store, 300)
    # 200 is invalid, so 100 is the second valid one and stays; 200 is kept for inspection.
    assert steps_on_disk(store.root) == [100, 200, 300]
    save(store, 400)
    assert steps_on_disk(store.root) == [300, 400]


def test_retention_never_deletes_the_checkpoint_just_committed(
    store: CheckpointStore, logs: list[str]
) -> None:
    save(store, 300)
    save(store, 400)
    save(store, 150)
    assert steps_on_disk(store.root) == [150, 300, 400]
    assert any("below newer step-00000400" in line for line in logs)
    assert store.latest_valid().step == 400


def test_saving_a_committed_step_again_raises(store: CheckpointStore) -> None:
    save(store, 100)
    with pytest.raises(CheckpointExists, match="already committed"):
        store.prepare(100)
    store.staging_dir(100).mkdir(parents=True)
    with pytest.raises(CheckpointExists, match="save under a new step"):
        store.commit(100, {})


def test_prepare_replaces_an_invalid_checkpoint_of_the_same_step(
    store: CheckpointStore, logs: list[str]
) -> None:
    save(store, 100)
    save(store, 200)
    (store.root / "step-00000200" / MANIFEST).unlink()
    assert store.latest_valid().step == 100  # the resume falls back, training reaches 200 again
    save(store, 200)
    assert any("replacing invalid step-00000200" in line for line in logs)
    assert store.latest_valid().step == 200


def test_commit_needs_prepare(store: CheckpointStore) -> None:
    with pytest.raises(InputNotFoundError, match=r"call prepare\(7\)"):
        store.commit(7, {})


def test_commit_rejects_a_caller_file_named_like_the_manifest(store: CheckpointStore) -> None:
    staging = store.prepare(1)
    (staging / MANIFEST).write_text("{}")
    with pytest.raises(DataError, match="reserved"):
        store.commit(1, {})


def test_commit_rejects_meta_that_is_not_json(store: CheckpointStore) -> None:
    store.prepare(1)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        store.commit(1, {"path": Path("x")})
    assert store.latest_valid() is None


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="keep"):
        CheckpointStore(Path("unused"), keep=0)
    with pytest.raises(ValueError, match="step"):
        checkpoint_name(-1)
    with pytest.raises(InputNotFoundError, match="does not exist"):
        fsync_tree(Path("/nonexistent/recforge-checkpoint"))
    assert parse_step("step-00000100") == 100
    assert parse_step("step-100") is None
    assert parse_step("latest") is None


# --- verification and fallback -----------------------------------------------------


def flip_byte(path: Path) -> None:
    file = path / WEIGHTS
    data = bytearray(file.read_bytes())
    data[17] ^= 0x01
    file.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path / WEIGHTS, "r+b") as handle:
        handle.truncate(100)


def delete_manifest(path: Path) -> None:
    (path / MANIFEST).unlink()


def delete_file(path: Path) -> None:
    (path / WEIGHTS).unlink()


def torn_manifest(path: Path) -> None:
    text = (path / MANIFEST).read_text()
    (path / MANIFEST).write_text(text[: len(text) // 2])


DAMAGE = {
    "flipped byte": (flip_byte, f"sha256 of {WEIGHTS} does not match"),
    "truncated file": (truncate, f"size of {WEIGHTS} is 100 bytes"),
    "deleted manifest": (delete_manifest, f"missing {MANIFEST}"),
    "deleted file": (delete_file, f"missing file {WEIGHTS}"),
    "torn manifest": (torn_manifest, f"{MANIFEST} is not valid JSON"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back_with_a_log_line(
    store: CheckpointStore, logs: list[str], damage: str
) -> None:
    corrupt, reason = DAMAGE[damage]
    save(store, 100)
    newest = save(store, 200)
    assert store.verify(newest) is None
    corrupt(newest)
    assert reason in store.verify(newest)

    latest = store.latest_valid(strict=True)
    assert latest is not None and latest.step == 100
    skipped = [line for line in logs if "skipping invalid" in line]
    assert len(skipped) == 1
    assert "step-00000200" in skipped[0] and reason in skipped[0]
    assert any("latest names step-00000200, which is invalid" in line for line in logs)


def test_all_invalid_strict_raises_listing_each(store: CheckpointStore, logs: list[str]) -> None:
    save(store, 100)
    save(store, 200)
    flip_byte(store.root / "step-00000100")
    delete_manifest(store.root / "step-00000200")
    assert store.latest_valid() is None
    assert len([line for line in logs if "skipping invalid" in line]) == 2
    with pytest.raises(CheckpointCorrupt) as raised:
        store.latest_valid(strict=True)
    message = str(raised.value)
    assert "step-00000100: sha256 of model/weights.bin" in message
    assert f"step-00000200: missing {MANIFEST}" in message
    assert "delete the directory to train from scratch" in message


def test_empty_or_missing_root_is_a_fresh_start(tmp_path: Path, logs: list[str]) -> None:
    assert CheckpointStore(tmp_path / "absent", log=logs.append).latest_valid(strict=True) is None
    assert CheckpointStore(tmp_path, log=logs.append).latest_valid(strict=True) is None
    assert logs == []


def test_a_first_save_that_never_committed_is_a_fresh_start(
    store: CheckpointStore, logs: list[str]
) -> None:
    staging = store.prepare(100)
    write_payload(staging, 100)
    assert store.latest_valid(strict=True) is None
    assert any("ignoring unfinished saves" in line and "step-00000100" in line for line in logs)


def test_extra_files_and_a_renamed_directory(store: CheckpointStore) -> None:
    path = save(store, 100)
    (path / "notes.txt").write_text("added after the commit")
    assert store.verify(path) is None  # extras are ignored, see verify's docstring
    moved = path.rename(store.root / "step-00000300")
    # Signed for step 100: a copy under another step's name names both places.
    assert "step=100" in store.verify(moved) and "step=300" in store.verify(moved)


POINTERS = {
    "missing": (None, "no latest pointer"),
    "garbage": (b"\xff\xfe\x00garbage", "cannot read the latest pointer"),
    "not a name": (b"hello\n", "latest pointer holds 'hello'"),
    "names a missing one": (b"step-00000999\n", "step-00000999, which does not exist"),
    "lags behind": (b"step-00000100\n", "latest names step-00000100 but step-00000200"),
}


@pytest.mark.parametrize("case", sorted(POINTERS))
def test_the_latest_pointer_is_only_a_hint(
    store: CheckpointStore, logs: list[str], case: str
) -> None:
    content, logged = POINTERS[case]
    save(store, 100)
    save(store, 200)
    pointer = store.root / "latest"
    if content is None:
        pointer.unlink()
    else:
        pointer.write_bytes(content)
    assert store.latest_valid().step == 200
    assert any(logged in line for line in logs), logs


# --- several ranks, crashes --------------------------------------------------------

RANK_SCRIPT = """
import sys
from pathlib import Path
from artifacts.durable import fsync_tree

staging, rank = Path(sys.argv[1]), int(sys.argv[2])
(staging / "shared").mkdir(exist_ok=True)
(staging / f"rank-{rank}").mkdir()
files = [staging / "shared" / f"optim-{rank}.bin", staging / f"rank-{rank}" / "rows.bin"]
for file in files:
    file.write_bytes(bytes([rank]) * (1000 + rank))
fsync_tree(files)
sys.exit(3 if "torch" in sys.modules else 0)
"""


def test_several_ranks_write_into_one_staging_dir(store: CheckpointStore) -> None:
    staging = store.prepare(50)
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(staging), str(rank)], cwd=REPO)
        for rank in range(3)
    ]
    assert [rank.wait(timeout=60) for rank in ranks] == [0, 0, 0]
    store.commit(50, {"world_size": 3})

    latest = store.latest_valid(strict=True)
    assert latest is not None and latest.meta == {"world_size": 3}
    files = json.loads((latest.path / MANIFEST).read_text())["files"]
    assert files == {
        path: {
            "size": 1000 + rank,
            "sha256": hashlib.sha256(bytes([rank]) * (1000 + rank)).hexdigest(),
        }
        for rank in range(3)
        for path in (f"shared/optim-{rank}.bin", f"rank-{rank}/rows.bin")
    }


CRASH_SCRIPT = """
import os
import sys
from pathlib import Path
from artifacts.checkpoints import CheckpointStore
from artifacts.durable import fsync_tree

root, point, step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])


def fault(name):
    if name == point:
        os._exit(1)  # like SIGKILL: no finally blocks, no atexit, no flushing


store = CheckpointStore(root, keep=2, log=lambda line: None, fault=fault)
staging = store.prepare(step)
(staging / "model").mkdir()
with open(staging / "model" / "weights.bin", "wb") as handle:
    handle.write(b"half of the weights")
    if point == "mid-file":
        handle.flush()
        os._exit(1)
    handle.write(b" and the rest")
fsync_tree(staging)
if "torch" in sys.modules:
    sys.exit(3)
store.commit(step, {"step": step})
sys.exit(0)
"""

COMMITTED_FROM = FAULT_POINTS.index("before-pointer")


@pytest.mark.chaos
@pytest.mark.parametrize("point", ["mid-file", *FAULT_POINTS])
def test_a_crash_at_any_point_resumes_from_the_last_commit(
    tmp_path: Path, logs: list[str], point: str
) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, keep=2, log=logs.append)
    save(store, 100)
    save(store, 200)
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(root), point, "300"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert crashed.returncode == 1, crashed.stderr  # it died at the point, not elsewhere

    committed = point in FAULT_POINTS and FAULT_POINTS.index(point) >= COMMITTED_FROM
    latest = store.latest_valid(strict=True)
    assert latest is not None
    if not committed:
        assert latest.step == 200
        assert any("ignoring unfinished saves" in line for line in logs)
        save(store, 300)  # the same step saves cleanly over the crash's garbage
        assert any(".staging/step-00000300" in line and "removing" in line for line in logs)
        expected = [200, 300]
    else:
        assert latest.step == 300
        assert latest.meta == {"step": 300}
        if point in ("before-pointer", "mid-pointer"):
            assert any("latest names step-00000200 but step-00000300" in line for line in logs)
        with pytest.raises(CheckpointExists):
            store.prepare(300)
        save(store, 400)
        expected = [300, 400]
    assert steps_on_disk(root) == expected
    assert list((root / ".staging").iterdir()) == []
    assert (root / "latest").read_text() == checkpoint_name(expected[-1]) + "\n"
    assert store.latest_valid(strict=True).step == expected[-1]


def test_fault_points_are_all_reached(store: CheckpointStore) -> None:
    save(store, 1)
    save(store, 2)
    reached: list[str] = []
    faulty = CheckpointStore(store.root, keep=2, log=lambda line: None, fault=reached.append)
    save(faulty, 3)
    assert reached == list(FAULT_POINTS)
