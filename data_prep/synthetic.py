"""Synthetic CTR behaviour logs drawn from a hidden ground-truth click model.

This is the project's embedded default dataset. It reads nothing and writes:

- ``<out>/part-00000.<format>`` ... ``part-{num_files-1:05d}``: raw impression logs, globally
  ordered by ``ts``; file k holds the k-th contiguous (in time) portion of the rows.
- ``<out>/_bayes.json``: the Bayes-optimal AUC of the hidden model (all rows and the last
  ``test_fraction`` of time), the click rate and the full config.

With ``daily_partitions`` the data files are instead ``<out>/dt=YYYY-MM-DD/part-00000.<format>``,
one folder per UTC date of the rows, and ``_bayes.json`` adds each date's rows, Bayes AUC and
click rate under ``partitions``. With ``item_churn`` or ``popularity_drift`` the item catalogue
changes from date to date (``_Drift``): items stop and new ones (new ids) take their traffic,
and popularity takes a random walk, so yesterday's model meets ids it has never seen.

Labels are ``Bernoulli(sigmoid(z + eps))`` where ``z`` is a noise-free logit built from per-id
biases, categorical effects, dense effects and a low-rank user x item term, and ``eps`` is
per-impression noise no model can see. ``p_true = sigmoid(z)`` ranks exactly like the Bayes
predictor (eps is independent of the features), so ``AUC(p_true, click)`` is the best AUC any
model can reach. It is not calibrated when ``noise_scale > 0``: the true click probability is
``E[sigmoid(z + eps)]``, which is flatter than ``sigmoid(z)``.

Rows are generated and written chunk by chunk; memory is bounded by ``chunk_rows`` plus the
user and item tables (about ``24 * num_users`` floats for the diurnal sampler).
"""

from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, model_validator

from artifacts.errors import ConfigError

COLUMNS: tuple[str, ...] = (
    "ts",
    "user_id",
    "item_id",
    "city",
    "device",
    "hour",
    "category",
    "price",
    "position",
    "click",
    "p_true",
)
"""Raw column names, in file order. The pipeline's schema config depends on them."""

SCHEMA = pa.schema(
    [
        ("ts", pa.int64()),
        ("user_id", pa.int64()),
        ("item_id", pa.int64()),
        ("city", pa.string()),
        ("device", pa.string()),
        ("hour", pa.int64()),
        ("category", pa.string()),
        ("price", pa.float64()),
        ("position", pa.int64()),
        ("click", pa.int64()),
        ("p_true", pa.float64()),
    ]
)
"""Arrow types of the raw columns (Parquet output uses them as is)."""

DEVICES: tuple[str, ...] = ("ios", "android", "web", "tablet")
_DEVICE_SHARE = np.array([0.38, 0.42, 0.14, 0.06])
_DEVICE_SWITCH_PROB = 0.08
_NUM_POSITIONS = 10
_NUM_PREFERRED_CATEGORIES = 3
_SECONDS_PER_DAY = 86_400
_SECONDS_PER_HOUR = 3_600
_MEDIAN_PRICE = 30.0

# The Bayes AUC is computed from per-class histograms of z over [_Z_LO, _Z_HI]; values outside
# are clipped into the end bins. Ranking by z is ranking by p_true (sigmoid is monotone).
_Z_LO, _Z_HI, _Z_BINS = -16.0, 16.0, 20_000

_TABLE_STREAM = 0
_CHUNK_STREAM = 1
_MALFORMED_STREAM = 2
_DRIFT_STREAM = 3


class GenerateConfig(BaseModel):
    """How to generate the synthetic raw logs."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    out: str = "data/demo/raw"
    """Output directory; replaced atomically if it exists."""
    format: Literal["csv", "jsonl", "parquet"] = "csv"
    """File format of the data files."""
    num_rows: int = 600_000
    """Impressions to write, malformed rows included."""
    num_users: int = 10_000
    """Distinct users (ids 1..num_users)."""
    num_items: int = 5_000
    """Distinct items (ids 1..num_items)."""
    num_categories: int = 40
    """Distinct item categories ("cat_000", ...)."""
    num_cities: int = 30
    """Distinct user cities ("city_00", ...)."""
    num_files: int = 4
    """Data files; file k holds the k-th contiguous time window of the log."""
    days: int = 30
    """Time span of the log in days."""
    start_ts: int = 1_700_000_000
    """Unix seconds at which the log starts."""
    seed: int = 0
    """Seed of every random draw; the same config gives byte-identical output."""
    malformed_fraction: float = 0.0
    """Fraction of rows written malformed, in [0, 1)."""
    latent_dim: int = 8
    """Dimension of the hidden user and item latent factors."""
    chunk_rows: int = 100_000
    """Rows generated and written per chunk; bounds memory."""
    test_fraction: float = 0.1
    """Last fraction of the time span over which bayes_auc_test is reported, in (0, 1)."""
    base_logit: float = -2.4
    """Global bias of the click logit; sets the click rate (about 10% at the defaults)."""
    user_bias_scale: float = 0.35
    """Standard deviation of the per-user logit bias."""
    item_bias_scale: float = 0.6
    """Standard deviation of the per-item logit bias."""
    latent_scale: float = 0.3
    """Standard deviation of the user x item latent term of the logit."""
    noise_scale: float = 0.25
    """Standard deviation of the unobservable per-impression logit noise."""
    item_zipf_exponent: float = 1.1
    """Zipf exponent of item popularity."""
    user_zipf_exponent: float = 0.7
    """Zipf exponent of user activity."""
    preference_mix: float = 0.3
    """Fraction of impressions drawn from the user's preferred categories, in [0, 1]."""
    daily_partitions: bool = False
    """Write one folder per UTC date of the rows, ``dt=YYYY-MM-DD/part-00000.<format>``,
    instead of ``num_files`` flat files: what an incremental pipeline reads one day at a
    time (a ``start_ts`` off midnight makes the first and last dates partial)."""
    item_churn: float = 0.0
    """Fraction of the item catalogue replaced every day from the second on, in [0, 1):
    the replaced items stop and new ones (new ids, their own bias and latent factors, the
    same category and price) take their share of the traffic."""
    popularity_drift: float = 0.0
    """Standard deviation of each item's daily log-popularity random walk (0: fixed)."""

    @model_validator(mode="after")
    def _check(self) -> GenerateConfig:
        positive = (
            "num_rows",
            "num_users",
            "num_items",
            "num_categories",
            "num_cities",
            "num_files",
            "days",
            "latent_dim",
            "chunk_rows",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_files > self.num_rows:
            raise ConfigError(
                f"num_files ({self.num_files}) must be <= num_rows ({self.num_rows}); "
                "lower num_files or raise num_rows"
            )
        for name in (
            "start_ts",
            "seed",
            "user_bias_scale",
            "item_bias_scale",
            "latent_scale",
            "noise_scale",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("item_zipf_exponent", "user_zipf_exponent"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.malformed_fraction < 1.0:
            raise ConfigError(
                f"malformed_fraction must be in [0, 1), got {self.malformed_fraction}; "
                "use e.g. 0.01 for 1% malformed rows"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0.0 <= self.preference_mix <= 1.0:
            raise ConfigError(f"preference_mix must be in [0, 1], got {self.preference_mix}")
        if not 0.0 <= self.item_churn < 1.0:
            raise ConfigError(f"item_churn must be in [0, 1), got {self.item_churn}")
        if self.popularity_drift < 0:
            raise ConfigError(f"popularity_drift must be >= 0, got {self.popularity_drift}")
        if self.daily_partitions and "num_files" in self.model_fields_set:
            raise ConfigError(
                "num_files does not apply with daily_partitions (one file per day); "
                "remove num_files"
            )
        return self

    @property
    def drifts(self) -> bool:
        """Whether the item catalogue or its popularity changes from day to day."""
        return self.item_churn > 0 or self.popularity_drift > 0


@dataclass(frozen=True)
class GenerateResult:
    """What generate_logs wrote and the quality ceiling of the data."""

    out_dir: Path
    """The output directory."""
    files: list[Path]
    """Data files in time order (metadata files excluded)."""
    num_rows: int
    """Rows written, malformed included."""
    num_malformed: int
    """Rows written malformed."""
    bayes_auc: float
    """AUC of p_true against click over all well-formed rows (nan if one class is absent)."""
    bayes_auc_test: float
    """Same over well-formed rows in the last test_fraction of time."""
    click_rate: float
    """Mean click over well-formed rows."""


@dataclass(frozen=True)
class _World:
    """Fixed user, item and time tables every chunk samples from."""

    user_hour_cdf: np.ndarray  # (24, U) cumulative activity of each user in each hour of day
    user_city: np.ndarray  # (U,) city index
    user_device: np.ndarray  # (U,) primary device index
    user_pref_cats: np.ndarray  # (U, 3) preferred category indices
    user_bias: np.ndarray  # (U,)
    user_latent: np.ndarray  # (U, D)
    item_category: np.ndarray  # (I,) category index
    item_price: np.ndarray  # (I,) rounded to cents
    item_bias: np.ndarray  # (I,)
    item_latent: np.ndarray  # (I, D), scaled so a user . item dot has std latent_scale
    cat_latent: np.ndarray  # (C, D) each category's latent direction (unscaled)
    item_pop_cdf: np.ndarray  # (I,) cumulative Zipf popularity over item indices
    cat_items: np.ndarray  # (I,) item indices sorted by category
    cat_pop_cdf: np.ndarray  # (I,) cumulative popularity in cat_items order
    cat_lo: np.ndarray  # (C,) popularity mass before each category's segment
    cat_hi: np.ndarray  # (C,) popularity mass up to the end of each category's segment
    city_effect: np.ndarray  # (num_cities,)
    device_effect: np.ndarray  # (4,)
    hour_effect: np.ndarray  # (24,)
    category_effect: np.ndarray  # (C,)
    city_category_effect: np.ndarray  # (num_cities, C)
    position_p: np.ndarray  # (10,) probability of each slot
    slot_start: np.ndarray  # (S,) start second of each UTC-hour slot of the span
    slot_len: np.ndarray  # (S,) seconds of the span in each slot
    slot_cdf: np.ndarray  # (S,) cumulative event mass over slots


class _Drift:
    """The item catalogue of each UTC date, advanced one date at a time, in order.

    Item slot i (its category and price are fixed) holds one item at a time; its id is
    ``i + 1 + num_items * generation``, so a replaced item's successor has a new id. On
    each date after the first, ``item_churn`` of the slots get a new generation with a
    fresh bias and latent vector, and every item's log-popularity takes a normal step
    of ``popularity_drift``. Date d's tables depend only on (seed, d) and date d - 1's.
    """

    def __init__(self, config: GenerateConfig, world: _World) -> None:
        self._config = config
        self._world = world
        self.date = config.start_ts // _SECONDS_PER_DAY  # days since the epoch
        self.generation = np.zeros(config.num_items, dtype=np.int64)
        self.bias = world.item_bias.copy()
        self.latent = world.item_latent.copy()
        self._log_pop = np.log(np.diff(world.item_pop_cdf, prepend=0.0))
        self._tables()

    def advance(self, date: int) -> None:
        """Move the catalogue forward to `date` (never back)."""
        if date < self.date:
            raise ValueError(f"drift cannot go back from date {self.date} to {date}")
        config, world = self._config, self._world
        num_items, dim = config.num_items, config.latent_dim
        while self.date < date:
            self.date += 1
            rng = np.random.default_rng([config.seed, _DRIFT_STREAM, self.date])
            replaced = np.flatnonzero(rng.random(num_items) < config.item_churn)
            self.generation[replaced] += 1
            self.bias[replaced] = rng.normal(0.0, config.item_bias_scale, len(replaced))
            # A new item of the same category: the category's share of the latent
            # direction (as _build_world draws it), its own share redrawn.
            own = rng.normal(size=(len(replaced), dim))
            direction = world.cat_latent[world.item_category[replaced]]
            self.latent[replaced] = (np.sqrt(0.8) * direction + np.sqrt(0.2) * own) * (
                config.latent_scale / np.sqrt(dim)
            )
            self._log_pop += rng.normal(0.0, config.popularity_drift, num_items)
        self._tables()

    def _tables(self) -> None:
        world = self._world
        popularity = np.exp(self._log_pop - self._log_pop.max())
        self.item_pop_cdf = np.cumsum(popularity)
        self.cat_pop_cdf = np.cumsum(popularity[world.cat_items])
        cat_mass = np.bincount(
            world.item_category, weights=popularity, minlength=len(world.category_effect)
        )
        self.cat_hi = np.cumsum(cat_mass)
        self.cat_lo = self.cat_hi - cat_mass


@dataclass(frozen=True)
class _Chunk:
    """One chunk of generated rows (well-formed values) and its hidden logits."""

    columns: dict[str, np.ndarray]
    z: np.ndarray  # (n,) noise-free logit


def generate_logs(config: GenerateConfig) -> GenerateResult:
    """Generate the synthetic raw logs and their Bayes AUC, then publish them atomically.

    Args:
        config: What to generate and where.

    Returns:
        The written files, the malformed-row count, the Bayes AUC (all rows and test window)
        and the click rate.

    Raises:
        ConfigError: If ``config.out`` exists and is not a directory.
        OSError: If writing or renaming fails; ``config.out`` is then left as it was.
    """
    out_dir = Path(config.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"out={config.out!r} exists and is not a directory; choose another out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    staging = out_dir.parent / f"{out_dir.name}.tmp-{token}"
    staging.mkdir()
    try:
        names, stats = _write_all(config, staging)
        _publish(staging, out_dir, token)
    except BaseException:
        # Leave no half-written staging dir behind, whatever interrupted us.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return GenerateResult(
        out_dir=out_dir,
        files=[out_dir / name for name in names],
        num_rows=config.num_rows,
        num_malformed=stats["num_malformed"],
        bayes_auc=stats["bayes_auc"],
        bayes_auc_test=stats["bayes_auc_test"],
        click_rate=stats["click_rate"],
    )


def _write_all(config: GenerateConfig, staging: Path) -> tuple[list[str], dict]:
    """Write every data file and _bayes.json into ``staging``; return names and stats."""
    world = _build_world(config)
    drift = _Drift(config, world) if config.drifts else None
    span = config.days * _SECONDS_PER_DAY
    test_start = config.start_ts + (1.0 - config.test_fraction) * span
    names = [f"part-{k:05d}.{config.format}" for k in range(config.num_files)]
    file_bounds = [k * config.num_rows // config.num_files for k in range(config.num_files + 1)]
    # hist[split, click, bin]: split 0 = all well-formed rows, 1 = test window only.
    hist = np.zeros((2, 2, _Z_BINS), dtype=np.int64)
    daily: dict[str, np.ndarray] = {}  # partition -> hist[click, bin] of its rows
    num_malformed = 0
    num_chunks = -(-config.num_rows // config.chunk_rows)
    sink: _Sink | None = None
    file_index = -1
    if config.daily_partitions:
        names = []
    for chunk_index in range(num_chunks):
        lo = chunk_index * config.chunk_rows
        hi = min(config.num_rows, lo + config.chunk_rows)
        chunk = _generate_chunk(config, world, chunk_index, lo, hi, drift)
        malformed = _pick_malformed(config, chunk_index, hi - lo)
        num_malformed += len(malformed)
        _accumulate_histograms(hist, chunk, malformed, test_start)
        payload = _render(config.format, chunk, malformed, config, chunk_index)
        if config.daily_partitions:
            sink = _write_by_date(chunk, malformed, payload, config, staging, names, sink, daily)
            continue
        # A chunk may span several files and a file several chunks.
        row = lo
        while row < hi:
            while row >= file_bounds[file_index + 1]:
                if sink is not None:
                    sink.close()
                file_index += 1
                sink = _Sink(config.format, staging / names[file_index])
            stop = min(hi, file_bounds[file_index + 1])
            sink.write(payload, row - lo, stop - lo)
            row = stop
    if sink is not None:
        sink.close()
    total = hist[0].sum()
    stats = {
        "bayes_auc": _auc_from_histograms(hist[0, 1], hist[0, 0]),
        "bayes_auc_test": _auc_from_histograms(hist[1, 1], hist[1, 0]),
        "test_fraction": config.test_fraction,
        "test_start_ts": test_start,
        "click_rate": float(hist[0, 1].sum() / total) if total else float("nan"),
        "num_rows": config.num_rows,
        "num_malformed": num_malformed,
        "seed": config.seed,
        "config": config.model_dump(),
    }
    if config.daily_partitions:
        # Each day's own ceiling: what a model evaluated on that day can reach at best.
        stats["partitions"] = {
            name: {
                "rows": int(counts.sum()),
                "bayes_auc": _json_float(_auc_from_histograms(counts[1], counts[0])),
                "click_rate": float(counts[1].sum() / max(1, counts.sum())),
            }
            for name, counts in daily.items()
        }
    # JSON has no NaN; an undefined AUC (one class absent) is written as null.
    printable = {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in stats.items()}
    (staging / "_bayes.json").write_text(json.dumps(printable, indent=2) + "\n")
    return names, stats


def _json_float(value: float) -> float | None:
    """JSON has no NaN: an undefined figure is null."""
    return None if np.isnan(value) else value


def partition_name(date: int) -> str:
    """The folder of a UTC date (days since the epoch): ``dt=YYYY-MM-DD``."""
    day = np.datetime64(date, "D")
    return f"dt={day}"


def _write_by_date(
    chunk: _Chunk,
    malformed: np.ndarray,
    payload: pa.Table | list[str],
    config: GenerateConfig,
    staging: Path,
    names: list[str],
    sink: _Sink | None,
    daily: dict[str, np.ndarray],
) -> _Sink | None:
    """Append a chunk's rows to their dates' files (rows are in time order); returns the
    open sink. Adds the well-formed rows to their date's ``daily`` histogram."""
    well_formed = np.ones(len(chunk.z), dtype=bool)
    well_formed[malformed] = False
    bins, click = _z_bins(chunk.z), chunk.columns["click"]
    for date, start, stop in _date_runs(chunk.columns["ts"]):
        name = partition_name(date)
        relative = f"{name}/part-00000.{config.format}"
        if not names or names[-1] != relative:
            if sink is not None:
                sink.close()
            (staging / name).mkdir()
            names.append(relative)
            sink = _Sink(config.format, staging / relative)
            daily[name] = np.zeros((2, _Z_BINS), dtype=np.int64)
        sink.write(payload, start, stop)
        _add_rows(daily[name], bins[start:stop], click[start:stop], well_formed[start:stop])
    return sink


def _date_runs(ts: np.ndarray) -> list[tuple[int, int, int]]:
    """(UTC date, start, stop) of each run of rows on one date; `ts` is sorted."""
    dates = ts // _SECONDS_PER_DAY
    bounds = [0, *(np.flatnonzero(np.diff(dates)) + 1).tolist(), len(ts)]
    return [(int(dates[a]), a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _publish(staging: Path, out_dir: Path, token: str) -> None:
    """Rename ``staging`` to ``out_dir``, replacing an existing ``out_dir``."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    old = out_dir.parent / f"{out_dir.name}.old-{token}"
    out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except OSError:
        # Put the previous output back so a failed publish changes nothing.
        old.rename(out_dir)
        raise
    shutil.rmtree(old)


def _zipf_weights(n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Zipf weights 1/rank**exponent, assigned to ids in a random order; shape (n,)."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
    return weights[rng.permutation(n)]


def _hour_curve() -> np.ndarray:
    """Relative activity per hour of day: quiet at night, a lunch bump, an evening peak."""
    hours = np.arange(24, dtype=np.float64)
    evening = np.exp(1.6 * np.cos(2 * np.pi * (hours - 20.5) / 24))
    lunch = 0.8 * np.exp(-0.5 * ((hours - 12.5) / 1.2) ** 2)
    return evening + lunch + 0.15


def _build_world(config: GenerateConfig) -> _World:
    """Draw the fixed user, item and time tables from ``(seed, table stream)``."""
    rng = np.random.default_rng([config.seed, _TABLE_STREAM])
    num_users, num_items = config.num_users, config.num_items
    num_cats, dim = config.num_categories, config.latent_dim

    # Users: activity, diurnal profile, city, device.
    activity = _zipf_weights(num_users, config.user_zipf_exponent, rng)
    activity /= activity.sum()
    base = _hour_curve()
    base /= base.sum()
    peak = rng.choice(24, size=num_users, p=base)
    hours = np.arange(24)
    # Each user mixes the population curve with a personal bump around a peak hour: (24, U).
    bump = np.exp(2.0 * np.cos(2 * np.pi * (hours[:, None] - peak[None, :]) / 24))
    bump /= bump.sum(axis=0, keepdims=True)
    profile = 0.6 * base[:, None] + 0.4 * bump
    user_hour = profile * activity[None, :]  # (24, U) joint mass of (hour, user)
    hour_mass = user_hour.sum(axis=1)  # (24,) marginal hour distribution of events
    user_hour_cdf = np.cumsum(user_hour, axis=1)
    city_p = 1.0 / np.arange(1, config.num_cities + 1) ** 1.0
    user_city = rng.choice(config.num_cities, size=num_users, p=city_p / city_p.sum())
    user_device = rng.choice(len(DEVICES), size=num_users, p=_DEVICE_SHARE)

    # Items: category, price, popularity. Category sizes are skewed too.
    cat_p = 1.0 / np.arange(1, num_cats + 1) ** 0.8
    item_category = rng.choice(num_cats, size=num_items, p=cat_p / cat_p.sum())
    cat_log_median = np.log(_MEDIAN_PRICE) + rng.normal(0.0, 0.6, size=num_cats)
    log_price = cat_log_median[item_category] + rng.normal(0.0, 0.5, size=num_items)
    item_price = np.maximum(np.round(np.exp(log_price), 2), 0.5)
    popularity = _zipf_weights(num_items, config.item_zipf_exponent, rng)
    item_pop_cdf = np.cumsum(popularity)
    cat_items = np.argsort(item_category, kind="stable")
    cat_pop_cdf = np.cumsum(popularity[cat_items])
    cat_mass = np.bincount(item_category, weights=popularity, minlength=num_cats)
    cat_hi = np.cumsum(cat_mass)
    cat_lo = cat_hi - cat_mass

    # Latent factors: items share their category's direction, so a user's affinity is mostly
    # an affinity for categories, which per-user histories reveal.
    cat_latent = rng.normal(size=(num_cats, dim))
    item_latent = np.sqrt(0.8) * cat_latent[item_category] + np.sqrt(0.2) * rng.normal(
        size=(num_items, dim)
    )
    user_latent = rng.normal(size=(num_users, dim))
    # Each dot product of two standard normal D-vectors has std sqrt(D).
    item_latent *= config.latent_scale / np.sqrt(dim)

    # Preferred categories: top-3 of latent affinity plus Gumbel noise, empty categories
    # excluded; computed in blocks so (U, C) is never held at once.
    user_pref_cats = np.empty((num_users, _NUM_PREFERRED_CATEGORIES), dtype=np.int64)
    k = min(_NUM_PREFERRED_CATEGORIES, int((cat_mass > 0).sum()))
    empty = np.where(cat_mass > 0, 0.0, -np.inf)
    for start in range(0, num_users, 4096):
        block = user_latent[start : start + 4096]
        score = block @ cat_latent.T / np.sqrt(dim) + rng.gumbel(size=(len(block), num_cats))
        score += empty
        top = np.argsort(-score, axis=1, kind="stable")[:, :k]
        # With fewer than 3 non-empty categories, repeat the best one.
        user_pref_cats[start : start + 4096] = np.pad(top, ((0, 0), (0, 3 - k)), mode="edge")

    user_bias = rng.normal(0.0, config.user_bias_scale, size=num_users)
    item_bias = rng.normal(0.0, config.item_bias_scale, size=num_items)
    city_effect = rng.normal(0.0, 0.5, size=config.num_cities)
    device_effect = np.array([0.25, 0.0, -0.35, 0.15])
    hour_effect = 0.3 * np.cos(2 * np.pi * (hours - 21) / 24)
    category_effect = rng.normal(0.0, 0.6, size=num_cats)
    city_category_effect = rng.normal(0.0, 0.15, size=(config.num_cities, num_cats))
    position_p = 0.8 ** np.arange(_NUM_POSITIONS)
    position_p /= position_p.sum()

    # Time: one slot per UTC hour overlapping the span, weighted by the hour-of-day mass, a
    # weekend lift and the slot's length in seconds (the first and last may be partial).
    end_ts = config.start_ts + config.days * _SECONDS_PER_DAY
    first_hour = config.start_ts // _SECONDS_PER_HOUR
    last_hour = (end_ts - 1) // _SECONDS_PER_HOUR
    hour_starts = np.arange(first_hour, last_hour + 1, dtype=np.int64) * _SECONDS_PER_HOUR
    slot_start = np.maximum(hour_starts, config.start_ts)
    slot_len = np.minimum(hour_starts + _SECONDS_PER_HOUR, end_ts) - slot_start
    slot_hour = (hour_starts // _SECONDS_PER_HOUR) % 24
    weekday = (hour_starts // _SECONDS_PER_DAY + 3) % 7  # 1970-01-01 was a Thursday; Mon = 0
    weekend_lift = np.where(weekday >= 5, 1.15, 1.0)
    slot_cdf = np.cumsum(hour_mass[slot_hour] * weekend_lift * slot_len)

    return _World(
        user_hour_cdf=user_hour_cdf,
        user_city=user_city,
        user_device=user_device,
        user_pref_cats=user_pref_cats,
        user_bias=user_bias,
        user_latent=user_latent,
        item_category=item_category,
        item_price=item_price,
        item_bias=item_bias,
        item_latent=item_latent,
        cat_latent=cat_latent,
        item_pop_cdf=item_pop_cdf,
        cat_items=cat_items,
        cat_pop_cdf=cat_pop_cdf,
        cat_lo=cat_lo,
        cat_hi=cat_hi,
        city_effect=city_effect,
        device_effect=device_effect,
        hour_effect=hour_effect,
        category_effect=category_effect,
        city_category_effect=city_category_effect,
        position_p=position_p,
        slot_start=slot_start,
        slot_len=slot_len,
        slot_cdf=slot_cdf,
    )


def _sample_cdf(cdf: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """Indices i with cdf[i-1] <= mass < cdf[i], clipped to the table."""
    return np.minimum(np.searchsorted(cdf, mass, side="right"), len(cdf) - 1)


def _sample_items(
    rng: np.random.Generator,
    user: np.ndarray,
    world: _World,
    catalogue: _World | _Drift,
    preference_mix: float,
) -> np.ndarray:
    """Item slots for `user`'s impressions: mostly by global popularity, sometimes by
    popularity within one of the user's preferred categories (`catalogue`'s tables:
    the fixed world's, or one date's under drift)."""
    n = len(user)
    pop_cdf = catalogue.item_pop_cdf
    item = _sample_cdf(pop_cdf, rng.random(n) * pop_cdf[-1])
    prefer = np.flatnonzero(rng.random(n) < preference_mix)
    pick = rng.choice(_NUM_PREFERRED_CATEGORIES, size=len(prefer), p=[0.5, 0.3, 0.2])
    cat = world.user_pref_cats[user[prefer], pick]
    lo_mass, hi_mass = catalogue.cat_lo[cat], catalogue.cat_hi[cat]
    within = lo_mass + rng.random(len(prefer)) * (hi_mass - lo_mass)
    item[prefer] = world.cat_items[_sample_cdf(catalogue.cat_pop_cdf, within)]
    return item


def _generate_chunk(
    config: GenerateConfig,
    world: _World,
    chunk_index: int,
    lo: int,
    hi: int,
    drift: _Drift | None = None,
) -> _Chunk:
    """Generate rows ``[lo, hi)`` of the log from ``(seed, chunk stream, chunk_index)``;
    with `drift`, each date's rows draw from that date's item catalogue."""
    rng = np.random.default_rng([config.seed, _CHUNK_STREAM, chunk_index])
    n = hi - lo

    # Timestamps: the chunk owns quantiles [lo/N, hi/N) of the event-time distribution, so
    # sorted draws within it concatenate into a globally time-ordered log.
    quantile = (lo + np.sort(rng.random(n)) * n) / config.num_rows
    mass = quantile * world.slot_cdf[-1]
    slot = _sample_cdf(world.slot_cdf, mass)
    before = np.where(slot > 0, world.slot_cdf[slot - 1], 0.0)
    frac = np.clip((mass - before) / (world.slot_cdf[slot] - before), 0.0, 1.0)
    offset = np.minimum((frac * world.slot_len[slot]).astype(np.int64), world.slot_len[slot] - 1)
    ts = world.slot_start[slot] + offset
    hour = (ts % _SECONDS_PER_DAY) // _SECONDS_PER_HOUR

    # Users given the hour: who is online depends on the time of day.
    user = np.empty(n, dtype=np.int64)
    for h in range(24):
        rows = np.flatnonzero(hour == h)
        if len(rows):
            cdf = world.user_hour_cdf[h]
            user[rows] = _sample_cdf(cdf, rng.random(len(rows)) * cdf[-1])

    device = world.user_device[user].copy()
    switch = rng.random(n) < _DEVICE_SWITCH_PROB
    device[switch] = rng.choice(len(DEVICES), size=int(switch.sum()), p=_DEVICE_SHARE)

    if drift is None:
        item = _sample_items(rng, user, world, world, config.preference_mix)
        item_id, item_bias, item_latent = item + 1, world.item_bias[item], world.item_latent[item]
    else:  # the rows are in time order: one segment per date
        item = np.empty(n, dtype=np.int64)
        item_id = np.empty(n, dtype=np.int64)
        item_bias = np.empty(n)
        item_latent = np.empty((n, config.latent_dim))
        for date, start, stop in _date_runs(ts):
            drift.advance(date)
            part = _sample_items(rng, user[start:stop], world, drift, config.preference_mix)
            item[start:stop] = part
            item_id[start:stop] = part + 1 + config.num_items * drift.generation[part]
            item_bias[start:stop] = drift.bias[part]
            item_latent[start:stop] = drift.latent[part]

    position = rng.choice(_NUM_POSITIONS, size=n, p=world.position_p) + 1
    category = world.item_category[item]
    city = world.user_city[user]
    price = world.item_price[item]

    latent = np.einsum("nd,nd->n", world.user_latent[user], item_latent)
    z = (
        config.base_logit
        + world.user_bias[user]
        + item_bias
        + latent
        + world.city_effect[city]
        + world.device_effect[device]
        + world.hour_effect[hour]
        + world.category_effect[category]
        + world.city_category_effect[city, category]
        - 0.5 * np.log(price / _MEDIAN_PRICE)
        - 0.7 * np.log(position)
    )
    eps = rng.normal(0.0, config.noise_scale, size=n) if config.noise_scale > 0 else 0.0
    click = (rng.random(n) < _sigmoid(z + eps)).astype(np.int64)

    columns = {
        "ts": ts,
        "user_id": user + 1,
        "item_id": item_id,
        "city": city,
        "device": device,
        "hour": hour,
        "category": category,
        "price": price,
        "position": position,
        "click": click,
        "p_true": _sigmoid(z),
    }
    return _Chunk(columns=columns, z=z)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function, shape preserved."""
    return 1.0 / (1.0 + np.exp(-x))


def _pick_malformed(config: GenerateConfig, chunk_index: int, n: int) -> np.ndarray:
    """Sorted row offsets (within the chunk) to write malformed: round(fraction * n) of them."""
    count = int(round(config.malformed_fraction * n))
    if count == 0:
        return np.empty(0, dtype=np.int64)
    rng = np.random.default_rng([config.seed, _MALFORMED_STREAM, chunk_index])
    return np.sort(rng.choice(n, size=count, replace=False))


def _accumulate_histograms(
    hist: np.ndarray, chunk: _Chunk, malformed: np.ndarray, test_start: float
) -> None:
    """Add the chunk's well-formed rows to ``hist[split, click, bin]`` in place."""
    well_formed = np.ones(len(chunk.z), dtype=bool)
    well_formed[malformed] = False
    bins, click = _z_bins(chunk.z), chunk.columns["click"]
    in_test = chunk.columns["ts"] >= test_start
    for split, mask in enumerate((well_formed, well_formed & in_test)):
        _add_rows(hist[split], bins, click, mask)


def _z_bins(z: np.ndarray) -> np.ndarray:
    """The histogram bin of each logit (clipped into the end bins)."""
    return np.clip(((z - _Z_LO) * (_Z_BINS / (_Z_HI - _Z_LO))).astype(np.int64), 0, _Z_BINS - 1)


def _add_rows(hist: np.ndarray, bins: np.ndarray, click: np.ndarray, mask: np.ndarray) -> None:
    """Add the masked rows to ``hist[click, bin]`` in place."""
    for label in (0, 1):
        hist[label] += np.bincount(bins[mask & (click == label)], minlength=_Z_BINS)


def _auc_from_histograms(pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC of a score from per-class histograms over the same ordered bins.

    Pairs in different bins are ordered exactly; pairs in the same bin count 0.5 as ties. The
    exact AUC of the unbinned scores therefore differs by at most
    ``0.5 * sum(pos * neg) / (P * N)``: with 20,000 bins of width 0.0016 over a smooth logit
    density that is about 1e-4 (1.4e-4 at the defaults), well under the 1e-3 the tests allow.

    Args:
        pos: Positive counts per bin, shape (B,).
        neg: Negative counts per bin, shape (B,).

    Returns:
        The AUC, or nan when either class is empty.
    """
    num_pos, num_neg = float(pos.sum()), float(neg.sum())
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    pos_f, neg_f = pos.astype(np.float64), neg.astype(np.float64)
    neg_below = np.cumsum(neg_f) - neg_f
    wins = float(np.dot(pos_f, neg_below)) + 0.5 * float(np.dot(pos_f, neg_f))
    return wins / (num_pos * num_neg)


def _names(prefix: str, count: int, index: np.ndarray) -> pa.Array:
    """Zero-padded names like ``city_07`` for the given indices, as a string array."""
    width = max(2 if prefix == "city_" else 3, len(str(count - 1)))
    table = pa.array([f"{prefix}{i:0{width}d}" for i in range(count)], type=pa.string())
    return table.take(pa.array(index))


def _arrow_columns(chunk: _Chunk, config: GenerateConfig) -> dict[str, pa.Array]:
    """The chunk as typed Arrow arrays, one per raw column."""
    cols = chunk.columns
    out: dict[str, pa.Array] = {}
    for name in COLUMNS:
        if name == "city":
            out[name] = _names("city_", config.num_cities, cols[name])
        elif name == "category":
            out[name] = _names("cat_", config.num_categories, cols[name])
        elif name == "device":
            out[name] = pa.array(np.array(DEVICES, dtype=object)[cols[name]], type=pa.string())
        else:
            out[name] = pa.array(cols[name], type=SCHEMA.field(name).type)
    return out


def _text_cells(arrays: dict[str, pa.Array], chunk: _Chunk) -> dict[str, pa.Array]:
    """Each column formatted as text; prices always with two decimals (``30.00``)."""
    cells = {name: arr.cast(pa.string()) for name, arr in arrays.items()}
    cents = np.round(chunk.columns["price"] * 100).astype(np.int64)
    whole = pa.array(cents // 100).cast(pa.string())
    frac = pc.utf8_lpad(pa.array(cents % 100).cast(pa.string()), width=2, padding="0")
    cells["price"] = pc.binary_join_element_wise(whole, frac, ".")
    return cells


def _render(
    fmt: str, chunk: _Chunk, malformed: np.ndarray, config: GenerateConfig, chunk_index: int
) -> pa.Table | list[str]:
    """Format a chunk for writing: a typed table (Parquet) or one text line per row."""
    arrays = _arrow_columns(chunk, config)
    rng = np.random.default_rng([config.seed, _MALFORMED_STREAM, chunk_index, 1])
    if fmt == "parquet":
        return _corrupt_table(arrays, malformed, rng)
    cells = _text_cells(arrays, chunk)
    if fmt == "csv":
        lines = pc.binary_join_element_wise(*[cells[name] for name in COLUMNS], ",")
    else:
        # Strings are quoted, numbers bare; json.dumps' default separators, so corrupted rows
        # rendered by json.dumps look the same.
        parts: list[pa.Array | str] = []
        for i, name in enumerate(COLUMNS):
            quote = '"' if pa.types.is_string(SCHEMA.field(name).type) else ""
            parts += [("{" if i == 0 else ", ") + f'"{name}": {quote}', cells[name], quote]
        lines = pc.binary_join_element_wise(*parts, "}", "")
    text = lines.to_pylist()
    for row in malformed.tolist():
        values = {name: cells[name][row].as_py() for name in COLUMNS}
        text[row] = _corrupt_line(fmt, values, rng)
    return text


# Realistic junk for numeric columns: what upstream loggers and spreadsheets really emit.
_JUNK = {
    "ts": ("yesterday", "2023-11-14 22:13:20"),
    "user_id": ("u_1734", "anonymous"),
    "item_id": ("sku-88", "undefined"),
    "price": ("n/a", "free", "$29.99"),
    "position": ("top", "first"),
    "click": ("yes", "true"),
}
_REQUIRED = ("ts", "user_id", "item_id", "click")


def _corrupt_line(fmt: str, values: dict[str, str], rng: np.random.Generator) -> str:
    """One malformed text line from the row's cell text, corrupted one random way."""
    kinds = ("non_numeric", "empty_field", "bad_label", "bad_ts", "field_count")
    kind = kinds[rng.integers(len(kinds))]
    raw: dict[str, object] = {}
    for name, cell in values.items():
        is_str = pa.types.is_string(SCHEMA.field(name).type)
        raw[name] = cell if is_str else json.loads(cell)
    parsed = dict(raw)
    if kind == "non_numeric":
        name = list(_JUNK)[rng.integers(len(_JUNK))]
        raw[name] = _JUNK[name][rng.integers(len(_JUNK[name]))]
    elif kind == "empty_field":
        raw[_REQUIRED[rng.integers(len(_REQUIRED))]] = ""
    elif kind == "bad_label":
        raw["click"] = (2, -1)[rng.integers(2)]
    elif kind == "bad_ts":
        # A negative stamp, or milliseconds where seconds belong.
        raw["ts"] = (-1, int(values["ts"]) * 1000)[rng.integers(2)]
    if fmt == "csv":
        # Untouched cells keep their original text (prices with two decimals).
        fields = [str(raw[name]) if raw[name] != parsed[name] else values[name] for name in COLUMNS]
        if kind == "field_count":
            if rng.integers(2):
                fields.append("extra")
            else:
                fields = fields[: int(rng.integers(1, len(fields)))]
        return ",".join(fields)
    # JSON floats keep their shortest round-trip text via json.dumps.
    line = json.dumps(raw)
    if kind == "field_count":
        # A line cut short, as from a crashed writer: never valid JSON without its "}".
        line = line[: int(rng.integers(1, len(line) - 1))]
    return line


def _corrupt_table(
    arrays: dict[str, pa.Array], malformed: np.ndarray, rng: np.random.Generator
) -> pa.Table:
    """The chunk as a typed table with type-representable corruptions applied."""
    if len(malformed) == 0:
        return pa.Table.from_arrays(list(arrays.values()), schema=SCHEMA)
    kind = rng.integers(3, size=len(malformed))  # 0: null required field, 1: click 2, 2: ts -1
    null_col = rng.integers(len(_REQUIRED), size=len(malformed))
    columns = dict(arrays)
    for i, name in enumerate(_REQUIRED):
        values = arrays[name].to_numpy().copy()
        null_rows = malformed[(kind == 0) & (null_col == i)]
        if name == "click":
            values[malformed[kind == 1]] = 2
        if name == "ts":
            values[malformed[kind == 2]] = -1
        mask = np.zeros(len(values), dtype=bool)
        mask[null_rows] = True
        columns[name] = pa.array(values, type=pa.int64(), mask=mask)
    return pa.Table.from_arrays([columns[name] for name in COLUMNS], schema=SCHEMA)


class _Sink:
    """One open output data file; rows arrive in order, in slices of rendered chunks."""

    def __init__(self, fmt: str, path: Path) -> None:
        self._fmt = fmt
        self._file: IO[bytes] | None = None
        self._parquet: pq.ParquetWriter | None = None
        if fmt == "parquet":
            self._parquet = pq.ParquetWriter(path, SCHEMA)
        else:
            self._file = path.open("wb")
            if fmt == "csv":
                self._file.write((",".join(COLUMNS) + "\n").encode())

    def write(self, payload: pa.Table | list[str], start: int, stop: int) -> None:
        """Append rows ``[start, stop)`` of a rendered chunk."""
        if self._parquet is not None:
            self._parquet.write_table(payload.slice(start, stop - start))
        else:
            self._file.write(("\n".join(payload[start:stop]) + "\n").encode())

    def close(self) -> None:
        """Flush and close the file."""
        if self._parquet is not None:
            self._parquet.close()
        else:
            self._file.close()
