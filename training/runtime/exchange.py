"""Files the ranks of nodes that share no disk need from each other, via object storage.

With `train.launcher: per_node` every node has its own working directory: a rank
writes its checkpoint part (DeepSpeed's files, its embedding shard, its RNG and reader
state) on its own node, but a resume, a re-shard and the consolidation of the final
weights read every rank's part. On a shared filesystem (one machine, or launcher
'ssh') that is one directory; here each node's first rank uploads what its node wrote
to a scratch prefix of the artifact root and downloads what the other nodes wrote,
between two barriers, so that afterwards every node's directory holds the whole
checkpoint, exactly as on one machine. The code that reads checkpoints stays the
same.

The train stage turns the exchange on with the launch spec's "node_exchange" ({"url":
the scratch prefix, "ranks_per_node"}); without it `NodeExchange.share` only
synchronises the ranks. Why a file exchange rather than torch.distributed: the parts
are files written by DeepSpeed's own `save_checkpoint`, streamed from disk to the
object store and back, never held whole in a rank's memory.

Nodes prove who they are (docs/security.md): after uploading its files, each node's
first rank writes a signed index beside them, ``node-XXXXX.json`` = {"attempt": the
scratch prefix (unique to the attempt), "name", "node", "files": {rel: {"size",
"sha256"}}}, bound to its place (``place("exchange-index", attempt=<prefix>,
node=<node>)``). A reader reads only the indexes of nodes ``0 .. nodes-1``, each up to
`INDEX_BYTES`, and only once their signature, place and name check out; it joins each name under the
directory with `safe_join`, downloads to a ``.part`` file and moves it into place only
once its size and sha256 match the index. Anything else under the prefix (a
``node-99999`` of someone with write access to the bucket, a file no index names) is
ignored and logged once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from artifacts.durable import file_sha256
from artifacts.errors import DataError, SignatureError
from artifacts.locations import MAX_RECORD_BYTES, safe_join
from artifacts.signing import loads_verified, place, sign

_logger = logging.getLogger(__name__)
_ignored: set[str] = set()  # what was logged as ignored, once each

# The most an index is read of: one entry per checkpoint file of a node.
INDEX_BYTES = MAX_RECORD_BYTES


class NodeExchange:
    """Every rank's view of the node exchange (a no-op on a shared filesystem).

    Args:
        url: The scratch prefix, or None when the nodes share the checkpoint directory.
        local_rank: This rank's index on its node (DeepSpeed's LOCAL_RANK).
        local_size: Ranks on each node.
        node: This rank's node index.
    """

    def __init__(self, url: str | None, local_rank: int, local_size: int, node: int) -> None:
        self.url = url.rstrip("/") if url else None
        self.local_rank = local_rank
        self.local_size = local_size
        self.node = node

    @classmethod
    def from_spec(cls, setting: Mapping[str, Any] | None) -> NodeExchange:
        """The exchange of a launch spec's "node_exchange" (call after joining the group).

        A node's ranks are consecutive (DeepSpeed's launcher numbers node i's ranks
        i * ranks_per_node onwards); None: one node, or nodes sharing a filesystem.
        """
        rank = dist.get_rank()
        if not setting:
            return cls(None, rank, dist.get_world_size(), 0)
        per_node = int(setting["ranks_per_node"])
        return cls(str(setting["url"]), rank % per_node, per_node, rank // per_node)

    @property
    def active(self) -> bool:
        """Whether nodes keep their own copies of the checkpoint directories."""
        return self.url is not None

    def leads(self, rank: int) -> bool:
        """Whether this rank manages the checkpoint directory it sees.

        Rank 0 on a shared filesystem; each node's first rank when every node has its own
        copy (all of them prepare, commit and prune theirs, identically).
        """
        return self.local_rank == 0 if self.active else rank == 0

    def output_writers(self, rank: int, world_size: int) -> tuple[int, int] | None:
        """(index, count) of this rank among the ranks that write the stage's output files.

        Every rank on a shared filesystem; node 0's ranks when each node has its own
        directory (the others' output directories are thrown away). None: not a writer.
        """
        if not self.active:
            return rank, world_size
        return (self.local_rank, self.local_size) if self.node == 0 else None

    def share(self, directory: Path, name: str) -> None:
        """Every rank: afterwards every node's `directory` holds every node's files.

        Call once all ranks' files in `directory` are written. `name` keys this
        directory's scratch prefix (e.g. the checkpoint's name); it is removed after.

        Raises:
            DataError: Two nodes wrote the same file with different sizes (a file both
                write must be identical, e.g. written by each node's first rank).
        """
        if self.url is None:
            dist.barrier()
            return
        import fsspec  # the ranks of a shared-disk run never need it

        fs, base = fsspec.core.url_to_fs(f"{self.url}/{name}")
        dist.barrier()  # every rank's part of `directory` is written
        if self.local_rank == 0:
            _upload_own(fs, base, self.node, directory, {"attempt": self.url, "name": name})
        dist.barrier()  # every node's part is uploaded
        if self.local_rank == 0:
            fs.invalidate_cache(base)
            nodes = dist.get_world_size() // self.local_size
            expected = {"attempt": self.url, "name": name}
            _download_others(fs, base, self.node, nodes, directory, expected)
        dist.barrier()  # every node holds every part
        if dist.get_rank() == 0:
            fs.rm(base, recursive=True)


def _node_dir(node: int) -> str:
    return f"node-{node:05d}"


def _upload_own(fs, base: str, node: int, directory: Path, attempt: dict[str, str]) -> None:  # noqa: ANN001
    """Upload this node's files under `base`, then its signed index (the commit)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        target = f"{base}/{_node_dir(node)}/{rel}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)  # local roots need it
        fs.put_file(str(path), target)
        files[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    where = place("exchange-index", attempt=attempt["attempt"], node=node)
    index = sign({**attempt, "node": node, "files": files}, place=where)
    with fs.open(f"{base}/{_node_dir(node)}.json", "w") as handle:
        handle.write(json.dumps(index, sort_keys=True))


def _read_index(fs, base: str, node: int, expected: dict[str, str]) -> dict[str, Any]:  # noqa: ANN001
    """Node `node`'s index once its signature, place and name check out.

    Raises:
        DataError: It is missing, or from another directory of the attempt.
        SignatureError: It is too large, does not parse, is forged, or is bound to
            another attempt or node (`MisplacedRecord`).
    """
    where = f"{base}/{_node_dir(node)}.json"
    try:
        # Ranged: the first INDEX_BYTES + 1 bytes, never the whole of a planted object.
        data = fs.cat_file(where, start=0, end=INDEX_BYTES + 1)
    except FileNotFoundError as err:
        raise DataError(
            f"{where} is missing: node {node} of this attempt uploaded no index (it failed, "
            "or the exchange prefix was changed); the attempt fails and a retry resumes"
        ) from err
    if len(data) > INDEX_BYTES:
        raise SignatureError(
            f"{where} is larger than {INDEX_BYTES} bytes, the cap for an exchange index: "
            "recforge never wrote it; refusing it"
        )
    bound = place("exchange-index", attempt=expected["attempt"], node=node)
    index = loads_verified(data, where, place=bound)
    claimed = {key: index.get(key) for key in (*expected, "node")}
    if claimed != {**expected, "node": node} or not isinstance(index.get("files"), dict):
        raise DataError(
            f"{where} names {claimed}, not node {node} of this attempt's {expected['name']!r}; "
            "refusing it (a replayed or misplaced index)"
        )
    return index


def _ignore_strangers(fs, base: str, nodes: int) -> None:  # noqa: ANN001
    """Log, once each, what lies under `base` that no node of this attempt wrote."""
    known = {_node_dir(n) for n in range(nodes)} | {f"{_node_dir(n)}.json" for n in range(nodes)}
    for entry in fs.ls(base, detail=False):
        leaf = entry.rstrip("/").rsplit("/", 1)[-1]
        if leaf not in known and f"{base}/{leaf}" not in _ignored:
            _ignored.add(f"{base}/{leaf}")
            _logger.warning(
                "ignoring %s/%s: not a node of this attempt (nodes 0..%d); someone else wrote it",
                base,
                leaf[:80],
                nodes - 1,
            )


def _download_others(  # noqa: ANN001
    fs, base: str, node: int, nodes: int, directory: Path, expected: dict[str, str]
) -> None:
    """Download the files of the other nodes of this attempt under `base` into `directory`.

    Only what a verified index names is read; each file is checked against the index's
    size and sha256 in a ``.part`` file before it takes its place.

    Raises:
        DataError: A node's index is missing or refused; a file does not match its index;
            two nodes wrote the same file with different sizes.
        UnsafeName: An index names a file outside `directory`.
    """
    _ignore_strangers(fs, base, nodes)
    for other in range(nodes):
        if other == node:
            continue
        index = _read_index(fs, base, other, expected)
        part = f"{base}/{_node_dir(other)}"
        where = f"{part}.json"
        for rel, info in sorted(index["files"].items()):
            target = Path(safe_join(directory, rel, f"a file name in {where}"))
            remote = f"{part}/{rel}"
            if target.is_file():
                if target.stat().st_size != info.get("size"):
                    raise DataError(
                        f"{target}: written by two nodes with different sizes "
                        f"({target.stat().st_size} here, {info.get('size')} in {remote}); "
                        "a checkpoint file must come from one rank"
                    )
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".part")
            fs.get_file(remote, str(partial))
            size, sha = partial.stat().st_size, file_sha256(partial)
            if size != info.get("size") or sha != info.get("sha256"):
                partial.unlink()
                raise DataError(
                    f"{remote} does not match {where} ({size} bytes, sha256 {sha[:12]}…); "
                    f"it was changed after node {other} uploaded it. Nothing was kept; the "
                    "attempt fails and a retry resumes from the last verified checkpoint"
                )
            os.replace(partial, target)
