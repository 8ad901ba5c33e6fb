"""Differential checkpoints: a delta is a resume point only with its whole chain.

A delta's signed meta lists the checkpoints it builds on, each with the sha256 of its
manifest; the store treats a delta as valid only when every member is committed,
verifies and is the one recorded. Retention and the bucket mirror keep the chains of
what they keep and drop a chain once a newer base replaces it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import fsspec
import pytest

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.checkpoints import (
    CHAIN,
    MANIFEST,
    CheckpointCorrupt,
    CheckpointStore,
    chain_members,
    checkpoint_name,
    files_digest,
    parse_step,
)
from artifacts.durable import fsync_tree

KEY = "c" * 64  # the run's resume key: the store's root is named by it


def save(store: CheckpointStore, step: int, chain: list[int] = (), payload: bytes = b"") -> Path:
    """A committed checkpoint of `step`; a delta of the steps in `chain` when given."""
    staging = store.prepare(step)
    (staging / "rows.bin").write_bytes(b"rows of step %d " % step + payload)
    fsync_tree(staging)
    meta: dict = {"step": step}
    if chain:
        meta[CHAIN] = [entry(store, s) for s in chain]
    return store.commit(step, meta)


def entry(store: CheckpointStore, step: int) -> dict:
    manifest = json.loads((store.checkpoint_dir(step) / MANIFEST).read_text())
    return {"step": step, "files_sha256": files_digest(manifest), "rows": 1, "world_size": 2}


def on_disk(root: Path) -> list[int]:
    return sorted(s for p in root.iterdir() if (s := parse_step(p.name)) is not None)


@pytest.fixture
def logs() -> list[str]:
    return []


@pytest.fixture
def store(tmp_path: Path, logs: list[str]) -> CheckpointStore:
    return CheckpointStore(tmp_path / KEY, keep=2, log=logs.append)


def test_a_delta_resumes_with_its_chain_base_first(store: CheckpointStore) -> None:
    save(store, 100)
    save(store, 200, chain=[100])
    save(store, 300, chain=[100, 200])
    latest = store.latest_valid(strict=True)
    assert latest.step == 300
    assert latest.chain == (store.checkpoint_dir(100), store.checkpoint_dir(200))
    assert store.latest_valid().chain  # the same without strict
    base = CheckpointStore(store.root).latest_valid()
    assert base is not None and base.step == 300


def test_retention_keeps_live_chains_and_drops_one_a_newer_base_replaced(
    store: CheckpointStore,
) -> None:
    save(store, 100)
    for step in (200, 300, 400):
        save(store, step, chain=list(range(100, step, 100)))
    # keep=2 keeps 300 and 400, and they need 100 and 200.
    assert on_disk(store.root) == [100, 200, 300, 400]
    save(store, 500)  # a new base
    assert on_disk(store.root) == [100, 200, 300, 400, 500]  # 400 is still kept
    save(store, 600, chain=[500])
    assert on_disk(store.root) == [500, 600]
    assert store.latest_valid(strict=True).chain == (store.checkpoint_dir(500),)


def test_a_pinned_delta_keeps_its_chain(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / KEY, keep=1, pinned=[200])
    save(store, 100)
    save(store, 200, chain=[100])
    save(store, 300)
    save(store, 400, chain=[300])
    assert on_disk(store.root) == [100, 200, 300, 400]


def test_a_tampered_delta_is_refused_by_name_and_the_chain_before_it_resumes(
    store: CheckpointStore, logs: list[str]
) -> None:
    save(store, 100)
    save(store, 200, chain=[100])
    save(store, 300, chain=[100, 200])
    rows = store.checkpoint_dir(200) / "rows.bin"
    data = bytearray(rows.read_bytes())
    data[0] ^= 1  # one flipped bit, same size
    rows.write_bytes(bytes(data))
    latest = store.latest_valid(strict=True)
    assert latest.step == 100 and latest.chain == ()
    named = [line for line in logs if "step-00000300" in line and "step-00000200" in line]
    assert named and "sha256 of rows.bin" in named[0]
    assert any("skipping invalid step-00000200" in line for line in logs)


def test_a_chain_member_swapped_for_another_valid_save_of_its_step_is_refused(
    tmp_path: Path, store: CheckpointStore, logs: list[str]
) -> None:
    save(store, 100)
    save(store, 200, chain=[100])
    save(store, 300, chain=[100, 200])
    # The same run saved step 200 again elsewhere (another attempt): signed, valid on
    # its own, but not the 200 that 300 was built on.
    other = CheckpointStore(tmp_path / "elsewhere" / KEY)
    save(other, 200, payload=b"another attempt")
    shutil.rmtree(store.checkpoint_dir(200))
    shutil.copytree(other.checkpoint_dir(200), store.checkpoint_dir(200))
    assert store.verify(store.checkpoint_dir(200)) is None
    latest = store.latest_valid(strict=True)
    assert latest.step == 200  # the swapped-in one is whole on its own; 300 is refused
    assert any("not the ones the chain recorded" in line for line in logs)


def test_another_nodes_own_commit_of_the_same_files_satisfies_the_chain(
    tmp_path: Path, store: CheckpointStore
) -> None:
    """Nodes that share no disk each commit their copy (their own manifest: another
    "created", another signature); rank 0's chain names the files, which match."""
    node1 = CheckpointStore(tmp_path / "node-1" / KEY)
    save(store, 100)
    save(store, 200, [100])
    time.sleep(1.1)  # a later "created": another manifest
    for step in (100, 200):
        staging = node1.prepare(step)
        shutil.copyfile(store.checkpoint_dir(step) / "rows.bin", staging / "rows.bin")
        meta = json.loads((store.checkpoint_dir(step) / MANIFEST).read_text())["meta"]
        node1.commit(step, meta)  # the chain entries are rank 0's
    assert (node1.checkpoint_dir(100) / MANIFEST).read_bytes() != (
        store.checkpoint_dir(100) / MANIFEST
    ).read_bytes()
    latest = node1.latest_valid(strict=True)
    assert latest.step == 200 and latest.chain == (node1.checkpoint_dir(100),)


def test_a_delta_whose_base_is_gone_is_no_resume_point(store: CheckpointStore) -> None:
    save(store, 100)
    save(store, 200, chain=[100])
    shutil.rmtree(store.checkpoint_dir(100))
    with pytest.raises(CheckpointCorrupt, match=r"step-00000200: it builds on step-00000100"):
        store.latest_valid(strict=True)
    # Saving its step again replaces it (a resume that fell back past it).
    save(store, 200)
    assert store.latest_valid(strict=True).step == 200


@pytest.mark.parametrize(
    "chain",
    [
        "not a list",
        [{"step": 100}],
        [{"step": 100, "files_sha256": "0" * 63}],
        [{"step": True, "files_sha256": "0" * 64}],
        [{"step": 200, "files_sha256": "0" * 64}, {"step": 100, "files_sha256": "0" * 64}],
    ],
)
def test_a_malformed_chain_is_refused(chain: object) -> None:
    with pytest.raises(ValueError, match=CHAIN):
        chain_members({CHAIN: chain})


def test_a_chain_naming_its_own_or_a_later_step_is_refused(
    store: CheckpointStore, logs: list[str]
) -> None:
    save(store, 100)
    staging = store.prepare(200)
    (staging / "rows.bin").write_bytes(b"x")
    loop = {"step": 200, "files_sha256": "0" * 64, "rows": 1, "world_size": 1}
    store.commit(200, {"step": 200, CHAIN: [entry(store, 100), loop]})
    assert store.latest_valid(strict=True).step == 100
    assert any("not older than it" in line for line in logs)


def remote_steps(fs: fsspec.AbstractFileSystem, path: str) -> list[int]:
    """Steps with a file in the bucket (memory:// keeps emptied directories)."""
    return sorted({parse_step(file.split("/")[-2]) for file in fs.find(path)})


def test_the_mirror_pulls_a_deltas_chain_and_prunes_around_live_chains(tmp_path: Path) -> None:
    bucket = f"memory://chains-{tmp_path.name}"
    local = CheckpointStore(tmp_path / "writer" / KEY, keep=2)
    lines: list[str] = []
    mirror = CheckpointMirror(local.root, f"{bucket}/{KEY}", keep=2, log=lines.append)
    save(local, 100)
    save(local, 200, chain=[100])
    save(local, 300, chain=[100, 200])
    mirror.push()
    fs, path = fsspec.core.url_to_fs(f"{bucket}/{KEY}")
    assert remote_steps(fs, path) == [100, 200, 300]  # keep=2 would prune 100 but for 300's chain

    # Another machine's retry pulls the newest and the chain it builds on.
    elsewhere = CheckpointMirror(tmp_path / "retry" / KEY, f"{bucket}/{KEY}", 2, lines.append)
    assert elsewhere.pull() == 300
    retry = CheckpointStore(tmp_path / "retry" / KEY).latest_valid(strict=True)
    assert retry.step == 300 and [p.name for p in retry.chain] == [
        checkpoint_name(100),
        checkpoint_name(200),
    ]

    save(local, 400)  # a new base, then a delta on it
    save(local, 500, chain=[400])
    mirror.push()
    assert remote_steps(fs, path) == [400, 500]
    manifest = json.loads(fs.cat_file(f"{path}/{checkpoint_name(500)}/{MANIFEST}"))
    assert [m["step"] for m in manifest["meta"][CHAIN]] == [400]


def test_a_tampered_delta_in_the_bucket_is_refused_by_name(tmp_path: Path) -> None:
    bucket = f"memory://tampered-{tmp_path.name}"
    local = CheckpointStore(tmp_path / "writer" / KEY, keep=3)
    mirror = CheckpointMirror(local.root, f"{bucket}/{KEY}", keep=3, log=print)
    save(local, 100)
    save(local, 200, chain=[100])
    save(local, 300, chain=[100, 200])
    mirror.push()
    fs, path = fsspec.core.url_to_fs(f"{bucket}/{KEY}")
    remote = f"{path}/{checkpoint_name(300)}/rows.bin"
    data = bytearray(fs.cat_file(remote))
    data[0] ^= 1  # another writer to the bucket flips a bit; the manifest is untouched
    fs.pipe_file(remote, bytes(data))

    lines: list[str] = []
    retry = CheckpointMirror(tmp_path / "retry" / KEY, f"{bucket}/{KEY}", 3, lines.append)
    assert retry.pull() == 200  # the newest delta that verifies, and its base
    assert any("step-00000300" in line and "sha256 of rows.bin" in line for line in lines)
    resumed = CheckpointStore(tmp_path / "retry" / KEY).latest_valid(strict=True)
    assert resumed.step == 200 and resumed.chain == (tmp_path / "retry" / KEY / "step-00000100",)
    assert not (tmp_path / "retry" / KEY / checkpoint_name(300)).exists()
