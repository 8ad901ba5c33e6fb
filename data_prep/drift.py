"""Dataset checks: compare this run's data statistics with the previous run's.

``compute_stats`` streams clean events once and summarises every column:
null rate, numeric range and moments, and the distribution of the most frequent
categorical values (the rest pooled as ``__other__``). ``compare_stats`` turns two
summaries into findings:

- categorical drift: the population stability index (PSI) over the previous run's
  top values plus ``__other__``;
- numeric range drift: the new min/max leave the old range widened by
  ``range_tolerance`` of its width, or the mean moves by more than
  ``mean_shift_std`` old standard deviations;
- null-rate drift: the null rate changes by more than ``null_rate_delta``.

The policy decides whether findings warn or fail the stage. Memory is bounded by
the number of distinct values per column (counted with pyarrow per batch and
merged), which the vocabularies need anyway.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from artifacts.locations import Location, list_files, open_parquet
from data_prep.schema import SchemaConfig

OTHER = "__other__"


class DriftConfig(BaseModel):
    """Dataset checks against the previous run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Literal["off", "warn", "fail"] = Field(
        default="warn", description="What findings do: nothing, log a warning, or fail ingest."
    )
    top_values: int = Field(
        default=50, ge=1, description="Categorical values tracked per column; the rest pool."
    )
    psi_threshold: float = Field(
        default=0.2, gt=0, description="Categorical drift when PSI exceeds this (0.2 = major)."
    )
    null_rate_delta: float = Field(
        default=0.05, gt=0, le=1, description="Null-rate drift when it changes by more than this."
    )
    range_tolerance: float = Field(
        default=0.5,
        ge=0,
        description="Numeric range drift when min/max leave the old range widened by this "
        "fraction of its width.",
    )
    mean_shift_std: float = Field(
        default=3.0, gt=0, description="Numeric drift when the mean moves by this many old stds."
    )


@dataclass(frozen=True)
class DriftReport:
    """Findings of one comparison."""

    findings: list[dict] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return bool(self.findings)

    def summary(self) -> str:
        return "; ".join(f"{f['column']}: {f['check']} {f['detail']}" for f in self.findings)


def compute_stats(
    events_dir: Location,
    schema: SchemaConfig,
    top_values: int = 50,
    files: list[Location] | None = None,
) -> dict:
    """Summarise the clean events under ``events_dir`` (``*.parquet``, recursively; a URL
    is read through fsspec).

    Args:
        events_dir: The events directory (named in messages; listed without `files`).
        schema: The raw columns.
        top_values: How many of the most frequent values each categorical keeps.
        files: The event files to read: those the ingest stage reports writing (the task
            layer passes them, so an object someone else put under a data prefix is never
            summarised). None: every ``*.parquet`` under `events_dir`, for a directory
            only this process writes.

    Returns:
        ``{"rows": n, "columns": {name: {...}}}`` with ``null_rate`` for every column,
        ``min``/``max``/``mean``/``std`` for numeric ones and ``top`` (value -> share,
        plus ``__other__``) for string and id-like ones (sparse and key roles).
    """
    if files is None:
        files = list_files(events_dir, ".parquet", recursive=True)
    categorical = [
        f.name for f in schema.fields if f.role in ("sparse", "key", "label") and not f.multi_hot
    ]
    numeric = [f.name for f in schema.fields if f.dtype != "string" and not f.multi_hot]
    nulls = {f.name: 0 for f in schema.fields if not f.generated}
    moments = {
        name: [0, 0.0, 0.0, math.inf, -math.inf] for name in numeric
    }  # n, sum, sumsq, lo, hi
    counts: dict[str, list[pa.Table]] = {name: [] for name in categorical}
    rows = 0
    for path in files:
        parquet = open_parquet(path)
        present = [n for n in nulls if n in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(columns=present):
            rows += batch.num_rows
            for name in present:
                column = batch.column(name)
                nulls[name] += column.null_count
                if name in moments and len(column) > column.null_count:
                    # Unsafe: a 64-bit id past 2**53 has no exact float64, and these
                    # moments are approximate anyway (the ids' counts stay exact).
                    values = pc.cast(column.drop_null(), pa.float64(), safe=False)
                    m = moments[name]
                    m[0] += len(values)
                    m[1] += pc.sum(values).as_py()
                    m[2] += pc.sum(pc.multiply(values, values)).as_py()
                    m[3] = min(m[3], pc.min(values).as_py())
                    m[4] = max(m[4], pc.max(values).as_py())
                if name in counts:
                    table = pa.table({"v": pc.cast(column, pa.string())})
                    counts[name].append(table.group_by("v").aggregate([("v", "count")]))
    columns: dict[str, dict] = {}
    for name, null_count in nulls.items():
        stats: dict = {"null_rate": null_count / rows if rows else 0.0}
        if name in moments and moments[name][0]:
            n, total, squares, lo, hi = moments[name]
            mean = total / n
            stats.update(min=lo, max=hi, mean=mean, std=math.sqrt(max(squares / n - mean**2, 0.0)))
        if name in counts and counts[name]:
            merged = pa.concat_tables(counts[name]).group_by("v").aggregate([("v_count", "sum")])
            order = pc.sort_indices(merged, [("v_count_sum", "descending"), ("v", "ascending")])
            merged = merged.take(order)
            top = merged.slice(0, top_values)
            total = pc.sum(merged["v_count_sum"]).as_py() or 1
            shares = {
                ("__null__" if v is None else v): c / total
                for v, c in zip(top["v"].to_pylist(), top["v_count_sum"].to_pylist(), strict=True)
            }
            shares[OTHER] = max(0.0, 1.0 - sum(shares.values()))
            stats["top"] = shares
        columns[name] = stats
    return {"rows": rows, "columns": columns}


def compare_stats(previous: dict, current: dict, config: DriftConfig) -> DriftReport:
    """Findings where ``current`` drifted from ``previous`` beyond the configured limits."""
    findings = []
    for name, old in previous["columns"].items():
        new = current["columns"].get(name)
        if new is None:
            findings.append({"column": name, "check": "missing", "detail": "column disappeared"})
            continue
        delta = abs(new["null_rate"] - old["null_rate"])
        if delta > config.null_rate_delta:
            findings.append(
                {
                    "column": name,
                    "check": "null_rate",
                    "detail": f"{old['null_rate']:.3f} -> {new['null_rate']:.3f}",
                }
            )
        if "top" in old and "top" in new:
            psi = population_stability_index(old["top"], new["top"])
            if psi > config.psi_threshold:
                findings.append({"column": name, "check": "psi", "detail": f"{psi:.3f}"})
        if "min" in old and "min" in new:
            width = max(old["max"] - old["min"], 1e-12)
            low = old["min"] - config.range_tolerance * width
            high = old["max"] + config.range_tolerance * width
            if new["min"] < low or new["max"] > high:
                findings.append(
                    {
                        "column": name,
                        "check": "range",
                        "detail": f"[{old['min']:g}, {old['max']:g}] -> "
                        f"[{new['min']:g}, {new['max']:g}]",
                    }
                )
            elif abs(new["mean"] - old["mean"]) > config.mean_shift_std * max(old["std"], 1e-12):
                findings.append(
                    {
                        "column": name,
                        "check": "mean",
                        "detail": f"{old['mean']:g} -> {new['mean']:g} (std {old['std']:g})",
                    }
                )
    return DriftReport(findings)


def population_stability_index(expected: dict[str, float], actual: dict[str, float]) -> float:
    """PSI over the union of both summaries' top values plus ``__other__``.

    Each summary knows only its own top values. A value tracked on one side only is
    given, on the other side, a share of that side's ``__other__`` mass no larger than
    that side's smallest tracked share (it was not in the top, so it is at most that).
    Shares are floored at 1e-4: an empty bucket gives a large but finite term.
    """
    values = (set(expected) | set(actual)) - {OTHER}
    sides = []
    for side in (expected, actual):
        missing = [v for v in values if v not in side]
        other = side.get(OTHER, 0.0)
        tracked = [share for v, share in side.items() if v != OTHER]
        each = min(other / (len(missing) + 1), min(tracked, default=0.0)) if missing else 0.0
        shares = {v: side.get(v, each) for v in values}
        shares[OTHER] = max(0.0, other - each * len(missing))
        sides.append(shares)
    psi = 0.0
    for value in sides[0]:
        e, a = max(sides[0][value], 1e-4), max(sides[1][value], 1e-4)
        psi += (a - e) * math.log(a / e)
    return psi
