"""Benchmark: what signed manifests and the node exchange's checks cost, next to the I/O.

Issue 27 signs every manifest with an HMAC-SHA256 of its canonical JSON and verifies it
on every read; the node exchange now also hashes each file it uploads and downloads.
This times, in one run:

- a checkpoint of ``--checkpoint-gb`` GB in ``--files`` files (DeepSpeed's shards and
  recforge's rank files), written to disk with fsync: ``write_s``, the I/O it costs
  anyway; ``sha256_s``: hashing every file once (what the exchange adds per side, and
  what a checkpoint commit already did); ``sign_s`` / ``verify_s``: signing and
  verifying its manifest (``CheckpointStore.commit``'s and ``_check``'s new work);
- a stage manifest of ``--manifest-files`` entries (a large shard output): ``sign_s`` and
  ``verify_s`` per manifest, averaged over many.

The last line printed is one JSON object with these figures and the ratios
``sign_verify_vs_write`` (signing + verifying the checkpoint manifest over writing the
checkpoint) and ``exchange_hash_vs_write`` (one extra sha256 pass over writing).

Usage::

    .venv/bin/python bench/signing.py                      # 1 GB in 8 files
    .venv/bin/python bench/signing.py --checkpoint-gb 0.25
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from artifacts.durable import file_sha256, fsync_file  # noqa: E402
from artifacts.signing import KEY_ENV, loads_verified, sign  # noqa: E402
from artifacts.store import describe_files  # noqa: E402


def write_checkpoint(directory: Path, total_bytes: int, files: int) -> float:
    """Random bytes in `files` files, fsynced; the seconds it took."""
    block = os.urandom(1 << 22)
    per_file = total_bytes // files
    start = time.perf_counter()
    for index in range(files):
        path = directory / f"zero_pp_rank_{index}_mp_rank_00_optim_states.pt"
        with path.open("wb") as handle:
            written = 0
            while written < per_file:
                chunk = block[: min(len(block), per_file - written)]
                handle.write(chunk)
                written += len(chunk)
        fsync_file(path)
    return time.perf_counter() - start


def timed(function, repeat: int) -> float:  # noqa: ANN001
    """Mean seconds of `repeat` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-gb", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--manifest-files", type=int, default=1000)
    args = parser.parse_args()
    os.environ.setdefault(KEY_ENV, os.urandom(32).hex())

    with tempfile.TemporaryDirectory(prefix="recforge-bench-signing-") as scratch:
        directory = Path(scratch)
        write_s = write_checkpoint(directory, int(args.checkpoint_gb * 1e9), args.files)
        start = time.perf_counter()
        files = describe_files(directory)
        sha256_s = time.perf_counter() - start
        manifest = {"step": 1000, "files": files, "meta": {"world_size": 2}}
        text = json.dumps(sign(manifest))
        ckpt_sign_s = timed(lambda: sign(manifest), 200)
        ckpt_verify_s = timed(lambda: loads_verified(text, "bench"), 200)
        # The exchange hashes what it uploads and what it downloads: one more pass each.
        start = time.perf_counter()
        for path in directory.iterdir():
            file_sha256(path)
        exchange_hash_s = time.perf_counter() - start

    entries = {
        f"train/part-{i:05d}.parquet": {"bytes": 1 << 26, "sha256": "ab" * 32, "rows": 500_000}
        for i in range(args.manifest_files)
    }
    stage = {"stage": "shard", "fingerprint": "f" * 64, "files": entries, "meta": {}}
    stage_text = json.dumps(sign(stage))
    stage_sign_s = timed(lambda: sign(stage), 50)
    stage_verify_s = timed(lambda: loads_verified(stage_text, "bench"), 50)

    result = {
        "checkpoint_gb": args.checkpoint_gb,
        "checkpoint_files": args.files,
        "write_s": round(write_s, 3),
        "sha256_s": round(sha256_s, 3),
        "checkpoint_sign_ms": round(ckpt_sign_s * 1e3, 4),
        "checkpoint_verify_ms": round(ckpt_verify_s * 1e3, 4),
        "exchange_hash_s": round(exchange_hash_s, 3),
        "stage_manifest_files": args.manifest_files,
        "stage_manifest_kb": round(len(stage_text) / 1e3, 1),
        "stage_sign_ms": round(stage_sign_s * 1e3, 3),
        "stage_verify_ms": round(stage_verify_s * 1e3, 3),
        "sign_verify_vs_write": (ckpt_sign_s + ckpt_verify_s) / write_s,
        "exchange_hash_vs_write": exchange_hash_s / write_s,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
