"""Benchmark: streaming bucketed AUC against the exact AUC on 10M predictions.

Synthetic predictions: logits ~ Normal(0, 1.5), labels ~ Bernoulli(sigmoid(logit)),
scores = sigmoid(logit + noise), generated in chunks of 1M rows from a seeded numpy
Generator (so two processes draw the same rows).

- The bucketed AUC (`training.ctr.metrics.BucketedAUC`) runs streaming in a child process,
  which regenerates the chunks and reports its own peak RSS: the memory the streaming
  metric needs, whatever the row count.
- The exact AUC (sort-based, ties as one half) runs in this process on all rows.

Figures: `abs_error` = |bucketed - exact|, `bound` = the accumulator's stated error
bound, `within_bound`, `peak_rss_mb` (the streaming child's), `exact_peak_rss_mb`
(this process's), and the seconds of each (both include generating the rows).

Usage::

    .venv/bin/python bench/auc.py                 # 10M rows (about 10 s)
    .venv/bin/python bench/auc.py --rows 1000000  # quicker

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.ctr.metrics import BucketedAUC, roc_auc

CHUNK = 1_000_000


def chunks(rows: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(labels, scores) chunks of the synthetic predictions."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        logits = rng.normal(0.0, 1.5, n)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float64)
        scores = 1.0 / (1.0 + np.exp(-(logits + rng.normal(0.0, 1.0, n))))
        yield labels, scores


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def streaming(rows: int, seed: int, buckets: int) -> dict:
    """The child's part: the bucketed AUC over the chunks, and its own peak memory."""
    started = time.perf_counter()
    auc = BucketedAUC(buckets)
    for labels, scores in chunks(rows, seed):
        auc.update(labels, scores)
    return {
        "bucketed_auc": auc.value(),
        "bound": auc.error_bound(),
        "counted_rows": auc.rows,
        "seconds_bucketed": time.perf_counter() - started,
        "peak_rss_mb": peak_rss_mb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--buckets", type=int, default=2**16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(streaming(args.rows, args.seed, args.buckets)))
        return

    command = [sys.executable, __file__, "--child", f"--rows={args.rows}"]
    command += [f"--buckets={args.buckets}", f"--seed={args.seed}"]
    child = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])

    started = time.perf_counter()
    parts = list(chunks(args.rows, args.seed))
    labels = np.concatenate([p[0] for p in parts])
    scores = np.concatenate([p[1] for p in parts])
    del parts
    exact = roc_auc(labels, scores)
    seconds_exact = time.perf_counter() - started

    error = abs(result["bucketed_auc"] - exact)
    figures = {
        "rows": args.rows,
        "buckets": args.buckets,
        "exact_auc": exact,
        "bucketed_auc": result["bucketed_auc"],
        "abs_error": error,
        "bound": result["bound"],
        "within_bound": error <= result["bound"],
        "peak_rss_mb": round(result["peak_rss_mb"], 1),
        "exact_peak_rss_mb": round(peak_rss_mb(), 1),
        "seconds_bucketed": round(result["seconds_bucketed"], 2),
        "seconds_exact": round(seconds_exact, 2),
    }
    if result["counted_rows"] != args.rows:
        raise RuntimeError(f"the streaming child counted {result['counted_rows']} rows")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
