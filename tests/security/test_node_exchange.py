"""Finding 3: the node exchange reads only what the nodes of this attempt signed.

Each test plays node 0 of a two-node per-node launch (one rank per node) after node 1
uploaded its checkpoint part, with `torch.distributed` stood in for by a single process
(the barriers are the only collectives `share` uses). The attacker can write anything
under the exchange prefix in the bucket, but holds no signing key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path

import fsspec
import pytest

from artifacts.errors import DataError
from artifacts.locations import UnsafeName
from artifacts.signing import SignatureError, sign
from training.runtime import exchange as exchange_module
from training.runtime.exchange import NodeExchange

NAME = "step-00000004"


class OneProcessGroup:
    """torch.distributed as rank 0 of a world of `world_size` sees it, barriers no-ops."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def barrier(self) -> None:
        pass

    def get_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return self.world_size


@pytest.fixture
def attempt(monkeypatch):
    """A fresh exchange prefix in fsspec's memory filesystem, and the two-node group."""
    monkeypatch.setattr(exchange_module, "dist", OneProcessGroup(world_size=2))
    url = f"memory://bucket/exchange/{uuid.uuid4().hex}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def node_one_uploads(url: str, tmp_path: Path, files: dict[str, bytes]) -> None:
    """Node 1's first rank: its part of the checkpoint, uploaded with its signed index."""
    part = tmp_path / "node1"
    for rel, data in files.items():
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        (part / rel).write_bytes(data)
    fs, base = fsspec.core.url_to_fs(f"{url}/{NAME}")
    exchange_module._upload_own(fs, base, 1, part, {"attempt": url, "name": NAME})


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(url: str, rel: str, data: bytes) -> None:
    """The attacker writes an object under the attempt's prefix."""
    fs, base = fsspec.core.url_to_fs(f"{url}/{NAME}")
    fs.pipe_file(f"{base}/{rel}", data)


def node_zero_shares(url: str, tmp_path: Path) -> Path:
    """Node 0's first rank runs `share`; its checkpoint directory afterwards."""
    directory = tmp_path / "node0" / NAME
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rank-0.pt").write_bytes(b"node 0's own part")
    NodeExchange(url, local_rank=0, local_size=1, node=0).share(directory, NAME)
    return directory


def test_the_other_nodes_signed_parts_arrive(attempt, tmp_path):
    node_one_uploads(attempt, tmp_path, {"rank-1.pt": b"node 1's part", "ds/shard-1": b"s"})
    directory = node_zero_shares(attempt, tmp_path)
    assert (directory / "rank-1.pt").read_bytes() == b"node 1's part"
    assert (directory / "ds" / "shard-1").read_bytes() == b"s"
    assert not list(directory.rglob("*.part"))


def test_a_node_outside_the_job_is_ignored_and_logged_once(attempt, tmp_path, caplog):
    node_one_uploads(attempt, tmp_path, {"rank-1.pt": b"node 1's part"})
    put(attempt, "node-99999/rank-0.pt", b"the attacker's payload")
    with caplog.at_level(logging.WARNING, logger=exchange_module.__name__):
        directory = node_zero_shares(attempt, tmp_path)
    assert (directory / "rank-0.pt").read_bytes() == b"node 0's own part"
    assert (directory / "rank-1.pt").read_bytes() == b"node 1's part"
    ignored = [r.getMessage() for r in caplog.records if "node-99999" in r.getMessage()]
    assert len(ignored) == 1 and "not a node of this attempt" in ignored[0]


def test_a_file_no_index_names_is_not_downloaded(attempt, tmp_path):
    node_one_uploads(attempt, tmp_path, {"rank-1.pt": b"node 1's part"})
    put(attempt, "node-00001/extra.pt", b"the attacker's payload")
    directory = node_zero_shares(attempt, tmp_path)
    assert not (directory / "extra.pt").exists()


def test_a_part_replaced_after_its_node_uploaded_it_is_refused(attempt, tmp_path):
    node_one_uploads(attempt, tmp_path, {"rank-1.pt": b"node 1's part"})
    put(attempt, "node-00001/rank-1.pt", b"the attacker's payload")
    with pytest.raises(DataError, match="does not match"):
        node_zero_shares(attempt, tmp_path)
    assert not (tmp_path / "node0" / NAME / "rank-1.pt").exists()
    assert not list((tmp_path / "node0").rglob("*.part"))


def test_an_index_rewritten_without_the_key_is_refused(attempt, tmp_path):
    node_one_uploads(attempt, tmp_path, {"rank-1.pt": b"node 1's part"})
    payload = b"the attacker's payload"
    forged = {
        "attempt": attempt,
        "name": NAME,
        "node": 1,
        "files": {"rank-1.pt": {"size": len(payload), "sha256": sha256(payload)}},
    }
    put(attempt, "node-00001/rank-1.pt", payload)
    put(attempt, "node-00001.json", json.dumps(forged).encode())
    with pytest.raises(SignatureError, match="not signed"):
        node_zero_shares(attempt, tmp_path)
    assert not (tmp_path / "node0" / NAME / "rank-1.pt").exists()


def test_an_index_replayed_from_another_attempt_is_refused(attempt, tmp_path):
    earlier = f"memory://bucket/exchange/{uuid.uuid4().hex}"
    node_one_uploads(earlier, tmp_path, {"rank-1.pt": b"last week's part"})
    fs, _ = fsspec.core.url_to_fs(earlier)
    old_index = fs.cat_file(fsspec.core.url_to_fs(f"{earlier}/{NAME}/node-00001.json")[1])
    put(attempt, "node-00001/rank-1.pt", b"last week's part")
    put(attempt, "node-00001.json", old_index)
    with pytest.raises(SignatureError, match="relocated copy"):
        node_zero_shares(attempt, tmp_path)
    assert not (tmp_path / "node0" / NAME / "rank-1.pt").exists()


def test_a_name_that_climbs_out_of_the_checkpoint_is_refused(attempt, tmp_path, monkeypatch):
    # Even a signed index (here: node 1 signs what its disk holds) cannot name a file
    # outside the directory: the one safe join refuses it before anything is written.
    node_one_uploads(attempt, tmp_path, {"rank-1.pt": b"node 1's part"})
    fs, base = fsspec.core.url_to_fs(f"{attempt}/{NAME}")
    index = json.loads(fs.cat_file(f"{base}/node-00001.json"))
    index["files"]["../../escaped.txt"] = index["files"].pop("rank-1.pt")
    fs.pipe_file(f"{base}/node-00001/../../escaped.txt", b"node 1's part")
    put(attempt, "node-00001.json", json.dumps(sign(index, place=index["place"])).encode())
    with pytest.raises(UnsafeName, match="'..'"):
        node_zero_shares(attempt, tmp_path)
    assert not (tmp_path / "escaped.txt").exists()
    assert not (tmp_path / "node0" / "escaped.txt").exists()
