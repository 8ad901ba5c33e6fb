"""Benchmark: recforge data preparation against idiomatic pandas and Polars jobs on the same files.

For each row count the script generates synthetic logs once (``data_prep.synthetic``,
fixed ``num_users``/``num_items`` so the vocabularies do not grow with the rows; cached
under ``--workdir``), then runs the same job in fresh subprocesses:

- recforge: ``ingest_logs`` -> ``preprocess_events`` -> ``write_shards`` with the demo
  schema (configs/demo.yaml) and default stage configs;
- pandas: ``pd.read_csv`` with explicit (string) dtypes, validation by
  ``to_numeric(errors="coerce")`` masks with a quarantine file, ``value_counts``
  vocabularies (min_count 2) and ``map``, log/standardised dense columns, a time split at
  event-count quantiles, a seeded shuffle and ``to_parquet`` shards (4 train, 2 valid,
  2 test);
- Polars, the same job as lazy queries (``scan_csv`` with every column as text, typed
  ``cast(strict=False)`` checks with a quarantine file, ``group_by().len()``
  vocabularies and ``replace_strict``, the same split, dense statistics, shuffle and
  shards), once collected with the in-memory engine (``polars``) and once with the
  streaming engine (``polars-streaming``).

The peers check less than recforge (no per-row reasons, no duplicate-row detection, no
line numbers), which only makes them faster. Each child reports its wall time (the job,
without interpreter start and imports), its peak RSS (``ru_maxrss``), its good rows and
rows per split; a peer whose good or split rows differ from recforge's fails the bench
(the JSON is still printed, then the script exits with status 1 and says which).

The last line printed is one JSON object with the raw figures and, at 5M rows (or the
measured size nearest to it):

- ``speedup_vs_polars``: Polars in-memory seconds / recforge seconds (target >= 1);
  ``speedup_vs_polars_streaming`` the same against the streaming engine;
- ``rss_ratio_vs_polars``: recforge peak RSS / Polars in-memory peak RSS (target <= 0.4);
- ``speedup_vs_pandas``: pandas seconds / recforge seconds (target >= 4);
- ``recforge_stages``: recforge's ingest/preprocess/shard seconds;

and ``rss_ratio_20m_vs_2m``: recforge peak RSS at the largest size / at the smallest
(20M and 2M by default; target <= 1.25).

Usage::

    .venv/bin/python bench/data_prep.py                       # 2M, 5M, 20M rows
    .venv/bin/python bench/data_prep.py --rows 200000,500000  # quick

pandas and Polars are optional dependencies: ``pip install -e '.[bench]'``.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROWS = (2_000_000, 5_000_000, 20_000_000)
SPEEDUP_ROWS = 5_000_000
NUM_USERS, NUM_ITEMS = 20_000, 10_000
SPARSE = ("user_id", "item_id", "city", "device", "hour", "category")
INTS = ("ts", "user_id", "item_id", "hour", "position", "click")
FLOATS = ("price", "p_true")
MIN_COUNT = 2
PEERS = ("pandas", "polars", "polars-streaming")
TARGETS = {
    "speedup_vs_polars": (">=", 1.0),
    "rss_ratio_vs_polars": ("<=", 0.4),
    "speedup_vs_pandas": (">=", 4.0),
    "rss_ratio_20m_vs_2m": ("<=", 1.25),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(str(r) for r in DEFAULT_ROWS))
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/recforge-bench"))
    parser.add_argument(
        "--peer-max-rows",
        type=int,
        default=SPEEDUP_ROWS,
        help="Skip the peers above this many rows (they hold the whole log in memory).",
    )
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"Comma-separated subset of {PEERS}."
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Rounds of one run per engine (order rotating), best run kept, at the sizes "
        "the peers run at (larger sizes, which only measure recforge's memory, run once).",
    )
    parser.add_argument("--child", choices=("recforge", *PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        jobs = {
            "recforge": run_recforge,
            "pandas": run_pandas,
            "polars": run_polars,
            "polars-streaming": lambda raw, out: run_polars(raw, out, engine="streaming"),
        }
        _import_engine(args.child)  # imports are not part of the job's time
        start = time.perf_counter()
        figures = jobs[args.child](args.input, args.out)
        figures["seconds"] = time.perf_counter() - start
        figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(figures))
        return

    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"--peers: unknown {unknown}; choose from {PEERS}")
    sizes = sorted(int(r) for r in args.rows.split(","))
    results = []
    for rows in sizes:
        raw = generate(args.workdir, rows, args.format)
        entry: dict = {"rows": rows, "raw_mb": _size_mb(raw)}
        with_peers = rows <= args.peer_max_rows
        engines = ["recforge"] + (peers if with_peers else [])
        repeat = args.repeat if with_peers else 1
        # Rounds of one run per engine, the order rotating each round, so that a burst of
        # load from other processes on the machine does not fall on one engine's runs only.
        for round_ in range(repeat):
            for engine in engines[round_ % len(engines) :] + engines[: round_ % len(engines)]:
                run = measure(engine, raw, args.workdir / f"out-{engine}")
                print(f"{rows:>11,} rows  {engine:<16} {_describe(run)}", file=sys.stderr)
                if engine not in entry or run["seconds"] < entry[engine]["seconds"]:
                    entry[engine] = run
        results.append(entry)
    summary = summarise(results, args)
    print(json.dumps(summary, indent=None))
    if summary["mismatches"]:
        raise SystemExit(
            "the engines disagree on the rows they kept: "
            + "; ".join(summary["mismatches"])
            + ". Fix the peer job (or recforge) before comparing times."
        )


def generate(workdir: Path, rows: int, fmt: str) -> Path:
    """Synthetic logs of ``rows`` rows, generated once per size and format."""
    from data_prep.synthetic import GenerateConfig, generate_logs

    out = workdir / f"raw-{rows}-{fmt}"
    if not (out / "_bayes.json").exists():
        print(f"generating {rows:,} rows ({fmt}) in {out}", file=sys.stderr)
        config = GenerateConfig(
            out=str(out),
            format=fmt,
            num_rows=rows,
            num_users=NUM_USERS,
            num_items=NUM_ITEMS,
            num_files=max(2, rows // 1_000_000),
            seed=0,
        )
        generate_logs(config)
    return out


def measure(engine: str, raw: Path, out: Path) -> dict:
    """Run one engine once in a fresh subprocess; its figures."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", engine]
    command += ["--input", str(raw), "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed on {raw}:\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["process_seconds"] = time.perf_counter() - start
    return figures


def summarise(results: list[dict], args: argparse.Namespace) -> dict:
    """The headline ratios at 5M rows (or the nearest size the peers ran at), and row checks."""
    mismatches = []
    for entry in results:
        ours = entry["recforge"]
        for peer in PEERS:
            if peer not in entry:
                continue
            for key in ("good_rows", "split_rows"):
                if entry[peer][key] != ours[key]:
                    mismatches.append(
                        f"{entry['rows']:,} rows: {peer} {key} {entry[peer][key]} != "
                        f"recforge {ours[key]}"
                    )

    def at_speedup_rows(peer: str) -> dict | None:
        both = [r for r in results if peer in r]
        return min(both, key=lambda r: abs(r["rows"] - SPEEDUP_ROWS)) if both else None

    def ratio(peer: str, key: str, ours_over_theirs: bool) -> float | None:
        entry = at_speedup_rows(peer)
        if entry is None:
            return None
        ours, theirs = entry["recforge"][key], entry[peer][key]
        return ours / theirs if ours_over_theirs else theirs / ours

    polars = at_speedup_rows("polars")
    headline = (
        polars
        or at_speedup_rows("pandas")
        or min(results, key=lambda r: abs(r["rows"] - SPEEDUP_ROWS))
    )
    small, large = results[0], results[-1]
    figures = {
        "speedup_vs_polars": ratio("polars", "seconds", False),
        "speedup_vs_polars_streaming": ratio("polars-streaming", "seconds", False),
        "rss_ratio_vs_polars": ratio("polars", "peak_rss_mb", True),
        "rss_ratio_vs_polars_streaming": ratio("polars-streaming", "peak_rss_mb", True),
        "speedup_vs_pandas": ratio("pandas", "seconds", False),
        "rss_ratio_20m_vs_2m": large["recforge"]["peak_rss_mb"] / small["recforge"]["peak_rss_mb"],
    }
    met = {}
    for key, (op, bound) in TARGETS.items():
        value = figures[key]
        met[key] = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return {
        "benchmark": "data_prep",
        "format": args.format,
        "cpu_count": os.cpu_count(),
        **figures,
        "ratio_rows": headline["rows"],
        "rss_ratio_rows": [small["rows"], large["rows"]],
        "recforge_stages": headline["recforge"]["stages"],
        "recforge_seconds": headline["recforge"]["seconds"],
        "polars_seconds": polars["polars"]["seconds"] if polars else None,
        "targets": {key: f"{op} {bound}" for key, (op, bound) in TARGETS.items()},
        "targets_met": met,
        "mismatches": mismatches,
        "results": results,
    }


def _import_engine(engine: str) -> None:
    if engine == "recforge":
        import pyarrow as pa

        import data_prep.ingest
        import data_prep.preprocess
        import data_prep.shard  # noqa: F401

        # pyarrow imports pandas (when installed, as here for the pandas job) on its first
        # conversion from Python objects or to numpy: an import like the others, kept out
        # of the job's time (its memory still counts).
        pa.array([0.0]).to_numpy()
    elif engine == "pandas":
        import pandas  # noqa: F401
        import pyarrow.parquet  # noqa: F401  (to_parquet's engine, imported on first use)
    else:
        import polars  # noqa: F401
    import data_prep.preprocess  # noqa: F401  (the split ranks)

    _demo_schema()


def _describe(figures: dict) -> str:
    return f"{figures['seconds']:7.2f} s  peak RSS {figures['peak_rss_mb']:7.0f} MB"


def _size_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.glob("part-*")) / 1e6


def _demo_schema():
    import yaml

    from data_prep.schema import SchemaConfig

    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    return SchemaConfig.model_validate(raw["schema"])


# ------------------------------------------------------------------------------ recforge


def run_recforge(raw: Path, out: Path) -> dict:
    """ingest -> preprocess -> shard with default configs; stage seconds and rows."""
    sys.path.insert(0, str(REPO))
    from data_prep.ingest import IngestConfig, ingest_logs
    from data_prep.preprocess import PreprocessConfig, preprocess_events
    from data_prep.shard import ShardConfig, write_shards

    schema = _demo_schema()
    stages = {}
    start = time.perf_counter()
    ingested = ingest_logs(IngestConfig(path=str(raw)), schema, out / "ingest")
    stages["ingest"] = time.perf_counter() - start
    preprocess_events(PreprocessConfig(), schema, out / "ingest" / "events", out / "pre")
    stages["preprocess"] = time.perf_counter() - start - stages["ingest"]
    sharded = write_shards(ShardConfig(), out / "pre", out / "shards")
    stages["shard"] = time.perf_counter() - start - stages["ingest"] - stages["preprocess"]
    return {"stages": stages, "good_rows": ingested.good_rows, "split_rows": sharded.rows}


# -------------------------------------------------------------------------------- pandas


def run_pandas(raw: Path, out: Path) -> dict:
    """The same job written the way a pandas user would, whole log in memory."""
    import numpy as np
    import pandas as pd

    schema = _demo_schema()
    out.mkdir(parents=True)
    files = sorted(raw.glob("part-*"))
    if files[0].suffix == ".parquet":
        frames = [pd.read_parquet(f).astype(str) for f in files]
    else:
        # Every column as text, so malformed values can be quarantined instead of failing.
        dtypes = {f.name: "string" for f in schema.fields}
        frames = [pd.read_csv(f, dtype=dtypes, keep_default_na=False) for f in files]
    # Which file each row came from: duplicate rows are looked for within a file.
    file_of = np.repeat(np.arange(len(frames)), [len(f) for f in frames])
    frame = pd.concat(frames, ignore_index=True)
    del frames

    bad = pd.Series(False, index=frame.index)
    typed = {}
    for name in INTS + FLOATS:
        values = pd.to_numeric(frame[name], errors="coerce")
        invalid = values.isna() if name != "p_true" else values.isna() & frame[name].ne("")
        if name in INTS:
            invalid |= values.notna() & (values % 1 != 0)
        bad |= invalid
        typed[name] = values
    bad |= ~typed["click"].isin(schema.label_values)
    bad |= (typed["ts"] < schema.min_timestamp) | (typed["ts"] > schema.max_timestamp)
    for name in ("city", "device", "category"):
        bad |= frame[name].eq("")
    frame.loc[bad].assign(reason="invalid").to_parquet(out / "quarantine.parquet", index=False)
    good = pd.DataFrame({name: typed[name][~bad] for name in INTS + FLOATS})
    for name in ("city", "device", "category"):
        good[name] = frame.loc[~bad, name]
    del frame, typed
    # A row equal (typed) to an earlier row of its file is a duplicate; the first is kept.
    good["file"] = file_of[~bad.to_numpy()]
    good = good[~good.duplicated(keep="first")].drop(columns="file")
    for name in INTS:
        good[name] = good[name].astype("int64")

    # Time split by event-count quantiles; rows at a boundary go to the later split.
    ranks = list(_split_ranks(len(good)))
    valid_start, test_start = good["ts"].sort_values().iloc[ranks].tolist()
    split = np.where(good["ts"] < valid_start, 0, np.where(good["ts"] < test_start, 1, 2))
    train = split == 0

    for name in SPARSE:
        counts = good.loc[train, name].value_counts()
        counts = counts[counts >= MIN_COUNT].rename("count").reset_index()
        ordered = counts.sort_values(["count", name], ascending=[False, True])[name]
        vocabulary = pd.Series(np.arange(1, len(ordered) + 1), index=ordered.to_numpy())
        good[name] = good[name].map(vocabulary).fillna(0).astype("int64")
    for name, log in (("price", True), ("position", False)):
        values = good[name].astype("float64")
        if log:
            values = np.log1p(values.clip(lower=0))
        mean, std = values[train].mean(), values[train].std(ddof=0)
        good[name] = ((values - mean) / (std or 1.0)).fillna(0).astype("float32")
    good["click"] = good["click"].astype("float32")

    shards = {}
    parts = {
        "train": good[train].sample(frac=1.0, random_state=0),
        "valid": good[split == 1],
        "test": good[split == 2],
    }
    for name, part in parts.items():
        count = 4 if name == "train" else 2
        shards[name] = []
        for index, rows in enumerate(np.array_split(np.arange(len(part)), count)):
            path = out / f"{name}-{index:05d}-of-{count:05d}.parquet"
            part.iloc[rows].to_parquet(path, index=False, row_group_size=65_536)
            shards[name].append({"path": path.name, "rows": len(rows)})
    (out / "dataset.json").write_text(json.dumps({"splits": shards}))
    return {
        "good_rows": len(good),
        "split_rows": {name: len(part) for name, part in parts.items()},
    }


# -------------------------------------------------------------------------------- Polars


def run_polars(raw: Path, out: Path, engine: str = "in-memory") -> dict:
    """The same job in idiomatic lazy Polars; every query collected with ``engine``.

    ``engine`` is ``in-memory`` or ``streaming``. The clean rows are collected once (both
    engines hold them: the time split and the shuffle need all of them), the vocabularies,
    statistics and transformed splits are lazy queries over them.
    """
    import polars as pl

    schema = _demo_schema()
    out.mkdir(parents=True)
    files = sorted(raw.glob("part-*"))
    names = [f.name for f in schema.fields]
    if files[0].suffix == ".parquet":
        text = pl.scan_parquet(files, include_file_paths="file")
        text = text.select(pl.col(names).cast(pl.String), "file")
    else:
        # Every column as text (empty cells stay ""), so malformed values can be quarantined.
        text = pl.scan_csv(
            files,
            schema=dict.fromkeys(names, pl.String),
            empty_string_is_null=False,
            include_file_paths="file",
        )

    typed = {name: pl.col(name).cast(pl.Int64, strict=False) for name in INTS}
    typed |= {name: pl.col(name).cast(pl.Float64, strict=False) for name in FLOATS}
    checks = [typed[name].is_null() for name in INTS]
    checks.append(typed["price"].is_null() | ~typed["price"].is_finite())
    checks.append(
        pl.col("p_true").ne("") & (typed["p_true"].is_null() | ~typed["p_true"].is_finite())
    )
    checks.append(~typed["click"].is_in(schema.label_values))
    checks.append(~typed["ts"].is_between(schema.min_timestamp, schema.max_timestamp))
    checks += [pl.col(name).eq("") for name in ("city", "device", "category")]
    bad = pl.any_horizontal(checks).fill_null(True)
    quarantine = text.filter(bad).with_columns(reason=pl.lit("invalid"))
    # A row equal (typed) to an earlier row of its file is a duplicate; the first is kept.
    good = (
        text.filter(~bad)
        .select(
            *[typed[name].alias(name) for name in INTS + FLOATS],
            *[pl.col(name) for name in ("city", "device", "category", "file")],
        )
        .unique(keep="first", maintain_order=True)
        .drop("file")
    )
    quarantine, good = pl.collect_all([quarantine, good], engine=engine)
    quarantine.write_parquet(out / "quarantine.parquet")
    del quarantine

    # Time split at event-count quantiles; rows at a boundary go to the later split.
    n = good.height
    k_valid, k_test = _split_ranks(n)
    bounds = good.lazy().select(pl.col("ts").sort().gather([k_valid, k_test]))
    valid_start, test_start = bounds.collect(engine=engine)["ts"].to_list()
    split = pl.when(pl.col("ts") < valid_start).then(0)
    split = split.when(pl.col("ts") < test_start).then(1).otherwise(2)
    train = good.lazy().filter(pl.col("ts") < valid_start)

    dense = {
        "price": pl.col("price").clip(lower_bound=0).log1p(),
        "position": pl.col("position").cast(pl.Float64),
    }
    queries = [
        train.group_by(name)
        .len()
        .filter(pl.col("len") >= MIN_COUNT)
        .sort(["len", name], descending=[True, False])
        .with_row_index("index", offset=1)
        for name in SPARSE
    ]
    queries.append(
        train.select(
            *[value.mean().alias(f"{name}_mean") for name, value in dense.items()],
            *[value.std(ddof=0).alias(f"{name}_std") for name, value in dense.items()],
        )
    )
    *vocabularies, moments = pl.collect_all(queries, engine=engine)
    columns = []
    for name, vocabulary in zip(SPARSE, vocabularies, strict=True):
        mapped = pl.col(name).replace_strict(
            vocabulary[name], vocabulary["index"], default=0, return_dtype=pl.Int64
        )
        columns.append(mapped)
    for name, value in dense.items():
        mean, std = moments[f"{name}_mean"][0], moments[f"{name}_std"][0]
        columns.append(((value - mean) / (std or 1.0)).fill_nan(0).cast(pl.Float32).alias(name))
    columns.append(pl.col("click").cast(pl.Float32))
    transformed = good.lazy().with_columns(*columns, split=split)
    parts = pl.collect_all(
        [transformed.filter(pl.col("split") == code).drop("split") for code in range(3)],
        engine=engine,
    )
    del good
    parts[0] = parts[0].sample(fraction=1.0, shuffle=True, seed=0)

    shards = {}
    for name, part in zip(("train", "valid", "test"), parts, strict=True):
        count = 4 if name == "train" else 2
        shards[name] = []
        for index in range(count):
            start, stop = index * part.height // count, (index + 1) * part.height // count
            path = out / f"{name}-{index:05d}-of-{count:05d}.parquet"
            part.slice(start, stop - start).write_parquet(path, row_group_size=65_536)
            shards[name].append({"path": path.name, "rows": stop - start})
    (out / "dataset.json").write_text(json.dumps({"splits": shards}))
    return {
        "good_rows": n,
        "split_rows": {
            name: part.height for name, part in zip(("train", "valid", "test"), parts, strict=True)
        },
    }


def _split_ranks(rows: int) -> tuple[int, int]:
    """0-based ranks of the first valid and first test timestamps (preprocess's definition)."""
    from data_prep.preprocess import PreprocessConfig

    config = PreprocessConfig()
    k_valid = min(rows - 1, int(rows * (1 - config.valid_fraction - config.test_fraction)))
    k_test = min(rows - 1, int(rows * (1 - config.test_fraction)))
    return k_valid, k_test


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
