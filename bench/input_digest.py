"""Benchmark: what keying raw input by content costs, on bench/data_prep.py's 5M-row input.

ingest's fingerprint covers each raw file's sha256 (`data_prep.ingest.describe_inputs`,
memoized per version of a file by `artifacts.fingerprint.content_sha256`). This times,
on the same files in one run:

- ``stat_s``: what a path + size + mtime key cost (one ``fs.info`` per file), the old key;
- ``cold_s``: ``describe_inputs`` with an empty memo: every byte read and hashed once;
- ``warm_s``: ``describe_inputs`` again: every digest remembered, nothing read;
- ``touched_s``: after every file is touched (new mtime and ctime, same bytes): hashed
  again, and the key is the same as before (so every stage stays cached);
- ``ingest_s``: for scale, recforge's ingest of the same files (``ingest_logs``).

The last line printed is one JSON object with these figures, the input's size and
``cold_vs_ingest`` (cold_s / ingest_s).

Usage::

    .venv/bin/python bench/input_digest.py                 # 5M rows (CSV), generated once
    .venv/bin/python bench/input_digest.py --rows 1000000
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

from data_prep.ingest import IngestConfig, describe_inputs, ingest_logs, resolve_inputs  # noqa: E402
from data_prep.schema import SchemaConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/recforge-bench"))
    args = parser.parse_args()

    raw = _data_prep_bench().generate(args.workdir, args.rows, "csv")
    files = [url for url, _ in resolve_inputs(str(raw))]
    size = sum(Path(f).stat().st_size for f in files)

    start = time.perf_counter()
    for url in files:
        os.stat(url)
    stat_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory(prefix="recforge-digests-") as memo:
        os.environ["RECFORGE_CACHE_DIR"] = memo
        start = time.perf_counter()
        cold = describe_inputs(str(raw))
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = describe_inputs(str(raw))
        warm_s = time.perf_counter() - start
        for url in files:
            os.utime(url)
        start = time.perf_counter()
        touched = describe_inputs(str(raw))
        touched_s = time.perf_counter() - start
    if not cold == warm == touched:
        raise SystemExit("describe_inputs gave another key for the same bytes")

    schema = SchemaConfig.model_validate(_demo_schema())
    with tempfile.TemporaryDirectory(prefix="recforge-ingest-") as out:
        start = time.perf_counter()
        ingest_logs(IngestConfig(path=str(raw)), schema, Path(out))
        ingest_s = time.perf_counter() - start

    figures = {
        "rows": args.rows,
        "files": len(files),
        "input_mb": round(size / 2**20, 1),
        "stat_s": round(stat_s, 4),
        "cold_s": round(cold_s, 3),
        "cold_mb_per_s": round(size / 2**20 / cold_s, 1),
        "warm_s": round(warm_s, 4),
        "touched_s": round(touched_s, 3),
        "ingest_s": round(ingest_s, 2),
        "cold_vs_ingest": round(cold_s / ingest_s, 3),
    }
    print(json.dumps(figures))


def _data_prep_bench():  # noqa: ANN202 - a module
    """bench/data_prep.py (its input generator, and its cache of inputs under --workdir)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_data_prep", REPO / "bench" / "data_prep.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_schema() -> dict:
    """The demo pipeline's schema (configs/demo.yaml), as bench/data_prep.py uses it."""
    import yaml

    return yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["schema"]


if __name__ == "__main__":
    main()
