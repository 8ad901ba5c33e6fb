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
  ``verify_s`` per manifest, averaged over many;
- with ``--demo-root ROOT`` (a root where ``recforge run configs/demo.yaml --root ROOT``
  finished), every signed record the demo run wrote there: how many, signing and
  verifying all of them once (``demo_sign_verify_ms``), next to the run's stage seconds
  from its run record (``demo_stage_s``) and the bytes it wrote.

The last line printed is one JSON object with these figures and the ratios
``sign_verify_vs_write`` (signing + verifying the checkpoint manifest over writing the
checkpoint) and ``exchange_hash_vs_write`` (one extra sha256 pass over writing).

Usage::

    .venv/bin/python bench/signing.py                      # 1 GB in 8 files
    .venv/bin/python bench/signing.py --checkpoint-gb 0.25
    .venv/bin/recforge run configs/demo.yaml --root /tmp/demo-root
    .venv/bin/python bench/signing.py --demo-root /tmp/demo-root
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
from artifacts.signing import KEY_ENV, loads_verified, place, sign  # noqa: E402
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


def demo_figures(root: Path) -> dict:
    """Signing and verifying every signed record of a finished demo run under `root`."""
    records = []
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in ("", ".json") and path.stat().st_size < 1 << 24:
            try:
                record = json.loads(path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(record, dict) and "signature" in record:
                records.append((path, path.read_text(), record))
    if not records:
        raise SystemExit(f"{root}: no signed records; run the demo there with a key set")
    start = time.perf_counter()
    for path, text, record in records:
        sign(record, place=record.get("place"))
        loads_verified(text, str(path), place=record.get("place"))
    sign_verify_s = time.perf_counter() - start
    summaries = sorted(root.glob("runs/*/summary.json"), key=lambda p: p.stat().st_mtime)
    stages = json.loads(summaries[-1].read_text()).get("stages", {}) if summaries else {}
    stage_s = sum(float(s.get("seconds") or 0) for s in stages.values())
    written = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return {
        "demo_records": len(records),
        "demo_sign_verify_ms": round(sign_verify_s * 1e3, 3),
        "demo_stage_s": round(stage_s, 2),
        "demo_bytes_written": written,
        "demo_sign_verify_vs_run": sign_verify_s / stage_s if stage_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-gb", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--manifest-files", type=int, default=1000)
    parser.add_argument("--demo-root", type=Path, help="a root the demo run finished in")
    args = parser.parse_args()
    if args.demo_root is not None and not os.environ.get(KEY_ENV):
        raise SystemExit(f"--demo-root: set {KEY_ENV} to the key the demo run signed with")
    os.environ.setdefault(KEY_ENV, os.urandom(32).hex())

    with tempfile.TemporaryDirectory(prefix="recforge-bench-signing-") as scratch:
        directory = Path(scratch)
        write_s = write_checkpoint(directory, int(args.checkpoint_gb * 1e9), args.files)
        start = time.perf_counter()
        files = describe_files(directory)
        sha256_s = time.perf_counter() - start
        manifest = {"step": 1000, "files": files, "meta": {"world_size": 2}}
        bound = place("checkpoint", fingerprint="f" * 64, step=1000)
        text = json.dumps(sign(manifest, place=bound))
        ckpt_sign_s = timed(lambda: sign(manifest, place=bound), 200)
        ckpt_verify_s = timed(lambda: loads_verified(text, "bench", place=bound), 200)
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
    at = place("stage-output", stage="shard", fingerprint="f" * 64)
    stage_text = json.dumps(sign(stage, place=at))
    stage_sign_s = timed(lambda: sign(stage, place=at), 50)
    stage_verify_s = timed(lambda: loads_verified(stage_text, "bench", place=at), 50)

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
    if args.demo_root is not None:
        result.update(demo_figures(args.demo_root))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
