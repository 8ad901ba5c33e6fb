"""Shard: transformed tables -> balanced train/valid/test Parquet shards.

Reads preprocess's ``train/``, ``valid/``, ``test/`` tables and ``transform.json``
and writes ``<split>-NNNNN-of-MMMMM.parquet`` shards plus ``dataset.json``, the
contract the training library reads: label, sparse features with their
``num_embeddings``, dense features, the oracle column, and every shard's rows.

Train rows are shuffled deterministically by a seeded permutation; row ``i``
goes to shard ``perm[i] % N`` at position ``perm[i] // N``, so shard sizes differ
by at most one row and the output is identical for the same seed. Each shard is
assembled from per-shard spill files, so memory is bounded by one shard.
"""

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from data_prep.errors import InputNotFoundError
from data_prep.preprocess import SPLITS


class ShardConfig(BaseModel):
    """How many shards to write and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_train_shards: int = Field(
        default=4,
        ge=1,
        description="Train shards; a multiple of the training world size balances ranks.",
    )
    num_eval_shards: int = Field(default=2, ge=1, description="Shards for each of valid and test.")
    row_group_size: int = Field(default=65_536, ge=1, description="Rows per Parquet row group.")
    seed: int = Field(default=0, description="Seed of the train shuffle.")
    batch_rows: int = Field(default=200_000, ge=1, description="Rows read per batch.")


@dataclass(frozen=True)
class ShardResult:
    """What shard wrote."""

    out_dir: Path
    rows: dict[str, int]
    shards: dict[str, list[str]]


def shard_name(split: str, index: int, count: int) -> str:
    """``train-00003-of-00004.parquet``."""
    return f"{split}-{index:05d}-of-{count:05d}.parquet"


def write_shards(
    config: ShardConfig,
    preprocessed_dir: Path,
    out_dir: Path,
    on_progress: Callable[[int], None] | None = None,
) -> ShardResult:
    """Write balanced shards of every split and the dataset description.

    Args:
        config: the shard section.
        preprocessed_dir: preprocess's output (split tables and ``transform.json``).
        out_dir: an empty directory to write into (the caller publishes it).
        on_progress: called with the number of rows sharded so far.

    Returns:
        Rows per split and shard file names.

    Raises:
        InputNotFoundError: the preprocessed tables are missing.
    """
    preprocessed_dir = Path(preprocessed_dir)
    transform_path = preprocessed_dir / "transform.json"
    if not transform_path.exists():
        raise InputNotFoundError(f"'{transform_path}' is missing; run preprocess first.")
    transform = json.loads(transform_path.read_text())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {}
    done = 0
    for split in SPLITS:
        files = sorted((preprocessed_dir / split).glob("*.parquet"))
        if not files:
            raise InputNotFoundError(f"no '{split}' table under '{preprocessed_dir}'.")
        count = config.num_train_shards if split == "train" else config.num_eval_shards
        entries = _shard_split(files, split, count, config, out_dir, shuffle=split == "train")
        splits[split] = {"files": entries, "rows": sum(e["rows"] for e in entries)}
        done += splits[split]["rows"]
        if on_progress:
            on_progress(done)

    dataset = {
        "label": transform["label"],
        "timestamp": transform["timestamp"],
        "sparse": [
            {"name": name, "num_embeddings": vocab["num_embeddings"]}
            for name, vocab in transform["sparse"].items()
        ],
        "dense": list(transform["dense"]),
        "oracle": transform.get("oracle"),
        "splits": splits,
    }
    (out_dir / "dataset.json").write_text(json.dumps(dataset, indent=2))
    return ShardResult(
        out_dir=out_dir,
        rows={s: splits[s]["rows"] for s in SPLITS},
        shards={s: [e["path"] for e in splits[s]["files"]] for s in SPLITS},
    )


def _shard_split(
    files: list[Path], split: str, count: int, config: ShardConfig, out_dir: Path, shuffle: bool
) -> list[dict]:
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in files)
    if shuffle:
        order = np.random.default_rng(config.seed).permutation(total)
    else:
        # Eval splits keep time order: contiguous blocks of rows per shard.
        order = _contiguous_order(total, count)
    spill_dir = out_dir / f".spill-{split}"
    spill_dir.mkdir()
    spills: dict[int, pq.ParquetWriter] = {}
    offset = 0
    schema = None
    try:
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=config.batch_rows):
                table = pa.Table.from_batches([batch])
                schema = table.schema
                keys = order[offset : offset + table.num_rows]
                offset += table.num_rows
                shard_of = keys % count
                for shard in np.unique(shard_of):
                    mask = shard_of == shard
                    part = table.filter(pa.array(mask)).append_column(
                        "_pos", pa.array(keys[mask] // count)
                    )
                    if shard not in spills:
                        spills[shard] = pq.ParquetWriter(
                            spill_dir / f"{shard}.parquet", part.schema
                        )
                    spills[shard].write_table(part)
    finally:
        for writer in spills.values():
            writer.close()

    entries = []
    for shard in range(count):
        name = shard_name(split, shard, count)
        spill = spill_dir / f"{shard}.parquet"
        if spill.exists():
            table = pq.read_table(spill)
            table = table.take(pc.sort_indices(table, [("_pos", "ascending")])).drop_columns("_pos")
        else:
            # More shards than rows: an empty shard keeps the file layout predictable.
            table = schema.empty_table()
        pq.write_table(table, out_dir / name, row_group_size=config.row_group_size)
        entries.append({"path": name, "rows": table.num_rows})
    shutil.rmtree(spill_dir)
    return entries


def _contiguous_order(total: int, count: int) -> np.ndarray:
    """Keys that put rows [k*total/count, (k+1)*total/count) into shard k, in order."""
    rows = np.arange(total)
    shard = rows * count // max(total, 1)
    start = (shard * total + count - 1) // count
    return (rows - start) * count + shard
