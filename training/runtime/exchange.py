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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from artifacts.errors import DataError


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
            for path in sorted(p for p in directory.rglob("*") if p.is_file()):
                target = f"{base}/node-{self.node:05d}/{path.relative_to(directory)}"
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)  # local roots need it
                fs.put_file(str(path), target)
        dist.barrier()  # every node's part is uploaded
        if self.local_rank == 0:
            fs.invalidate_cache(base)
            _download_others(fs, base, self.node, directory)
        dist.barrier()  # every node holds every part
        if dist.get_rank() == 0:
            fs.rm(base, recursive=True)


def _download_others(fs, base: str, node: int, directory: Path) -> None:  # noqa: ANN001
    """Download the other nodes' parts under `base` into `directory`."""
    own = f"node-{node:05d}"
    for part in sorted(fs.ls(base, detail=False)):
        if part.rstrip("/").rsplit("/", 1)[-1] == own:
            continue
        for remote, info in sorted(fs.find(part, detail=True).items()):
            target = directory / remote[len(part.rstrip("/")) + 1 :]
            if target.is_file():
                if target.stat().st_size != info["size"]:
                    raise DataError(
                        f"{target}: written by two nodes with different sizes "
                        f"({target.stat().st_size} here, {info['size']} in {remote}); a "
                        "checkpoint file must come from one rank"
                    )
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".part")
            fs.get_file(remote, str(partial))
            os.replace(partial, target)
