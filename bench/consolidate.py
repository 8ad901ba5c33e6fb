"""Benchmark: streamed consolidation of a sharded embedding table against the in-memory way.

A synthetic sharded checkpoint: a (rows, dim) fp32 table split over `--shards` row
shards as training writes them (shard s holds rows s, s + S, ...; with `counts` for
frequency admission), plus the arch's per-feature default rows. Two child processes,
each fresh, turn it into one `model.safetensors`:

- `in_memory`: what rank 0 did before `training.runtime.consolidate`: build the whole table
  (reading one shard at a time), substitute the rejected rows, `safetensors.save_file`.
- `streamed`: `training.ctr.consolidate.consolidate_in_process` (one writer; in training
  every rank writes its share the same way).

Each child reports its peak RSS (VmHWM, which also counts the memory-mapped shard
pages it touched) and its seconds; a third child only imports, for the baseline
(`*_above_baseline_mb` is the consolidation's own memory). The parent checks that the
two files hold the same tensors, slice by slice, and prints `*_peak_rss_mb`,
`*_above_baseline_mb` and `*_seconds` of each, `rss_ratio` (in-memory / streamed),
`table_mb`, `chunk_mb` and `same_tensors`.

Usage::

    .venv/bin/python bench/consolidate.py                      # 4M x 64 = 1 GiB table
    .venv/bin/python bench/consolidate.py --rows 1000000       # quicker

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.ctr.consolidate import TABLE_NAME, consolidate_in_process
from training.ctr.embedding import table_offsets
from training.runtime.memory import CHUNK_BYTES

MIN_COUNT = 3
FEATURES = 4


def table_sizes(rows: int) -> list[int]:
    return [rows // FEATURES + (1 if f < rows % FEATURES else 0) for f in range(FEATURES)]


def write_checkpoint(directory: Path, rows: int, dim: int, shards: int) -> list[Path]:
    """The shard files, written one shard at a time (the parent never holds the table)."""
    files = []
    for s in range(shards):
        generator = torch.Generator().manual_seed(s)
        local = -(-(rows - s) // shards)
        path = directory / f"sparse-rank-{s:05d}-of-{shards:05d}.safetensors"
        save_file(
            {
                "weight": torch.randn(local, dim, generator=generator),
                "counts": torch.randint(0, 6, (local,), generator=generator, dtype=torch.int64),
            },
            str(path),
        )
        files.append(path)
    save_file(
        {"default_rows": torch.randn(FEATURES, dim, generator=torch.Generator().manual_seed(99))},
        str(directory / "arch.safetensors"),
    )
    return files


def in_memory(directory: Path, rows: int, shards: int, out: Path) -> None:
    """The previous rank-0 consolidation: the whole table in one tensor."""
    with safe_open(str(directory / "arch.safetensors"), framework="pt") as arch:
        defaults = arch.get_tensor("default_rows")
    table: torch.Tensor | None = None
    rejected = torch.zeros(rows, dtype=torch.bool)
    for s in range(shards):
        path = directory / f"sparse-rank-{s:05d}-of-{shards:05d}.safetensors"
        with safe_open(str(path), framework="pt") as shard:
            weight = shard.get_tensor("weight")
            if table is None:
                table = torch.empty((rows, weight.shape[1]), dtype=torch.float32)
            table[s::shards] = weight
            del weight
            rejected[s::shards] = shard.get_tensor("counts") < MIN_COUNT
    assert table is not None
    feature = torch.searchsorted(
        table_offsets(table_sizes(rows))[1:], torch.nonzero(rejected)[:, 0], right=True
    )
    table[rejected] = defaults[feature]
    save_file({TABLE_NAME: table, "arch.default_rows": defaults}, str(out))


def streamed(directory: Path, rows: int, shards: int, out: Path) -> None:
    with safe_open(str(directory / "arch.safetensors"), framework="pt") as arch:
        defaults = arch.get_tensor("default_rows")
    files = [directory / f"sparse-rank-{s:05d}-of-{shards:05d}.safetensors" for s in range(shards)]
    consolidate_in_process(
        out, {"arch.default_rows": defaults}, files, table_sizes(rows), MIN_COUNT
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): ru_maxrss would also count the
    parent's, which the child inherited at fork, across the exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(mode: str, directory: Path, rows: int, shards: int, out: Path) -> None:
    started = time.perf_counter()
    if mode != "baseline":  # baseline: the imports alone
        (in_memory if mode == "in_memory" else streamed)(directory, rows, shards, out)
    seconds = time.perf_counter() - started
    peak = peak_rss_mb()
    print(json.dumps({"peak_rss_mb": round(peak, 1), "seconds": round(seconds, 2)}))


def same_tensors(first: Path, second: Path, rows: int) -> bool:
    """Compare the two files tensor by tensor, the table in 1M-row slices."""
    with safe_open(str(first), framework="pt") as a, safe_open(str(second), framework="pt") as b:
        if set(a.keys()) != set(b.keys()):
            return False
        for start in range(0, rows, 1 << 20):
            end = min(rows, start + (1 << 20))
            if not torch.equal(
                a.get_slice(TABLE_NAME)[start:end], b.get_slice(TABLE_NAME)[start:end]
            ):
                return False
        return torch.equal(a.get_tensor("arch.default_rows"), b.get_tensor("arch.default_rows"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--child", choices=["baseline", "in_memory", "streamed"])
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, args.rows, args.shards, args.out)
        return

    with tempfile.TemporaryDirectory(prefix="recforge-consolidate-") as tmp:
        directory = Path(tmp)
        write_checkpoint(directory, args.rows, args.dim, args.shards)
        figures: dict[str, object] = {
            "rows": args.rows,
            "dim": args.dim,
            "shards": args.shards,
            "table_mb": round(args.rows * args.dim * 4 / 2**20, 1),
            "chunk_mb": round(CHUNK_BYTES / 2**20, 1),
        }
        for mode in ("baseline", "in_memory", "streamed"):
            out = directory / f"{mode}.safetensors"
            command = [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--dir",
                str(directory),
                "--out",
                str(out),
                "--rows",
                str(args.rows),
                "--shards",
                str(args.shards),
            ]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            figures[f"{mode}_peak_rss_mb"] = measured["peak_rss_mb"]
            figures[f"{mode}_seconds"] = measured["seconds"]
        figures["rss_ratio"] = round(
            float(figures["in_memory_peak_rss_mb"]) / float(figures["streamed_peak_rss_mb"]), 2
        )
        baseline = float(figures["baseline_peak_rss_mb"])
        for mode in ("in_memory", "streamed"):
            figures[f"{mode}_above_baseline_mb"] = round(
                float(figures[f"{mode}_peak_rss_mb"]) - baseline, 1
            )
        del figures["baseline_seconds"]
        figures["same_tensors"] = same_tensors(
            directory / "in_memory.safetensors", directory / "streamed.safetensors", args.rows
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
