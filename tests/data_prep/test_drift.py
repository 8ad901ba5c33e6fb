import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.drift import DriftConfig, compare_stats, compute_stats, population_stability_index


def write_events(
    directory, seed=0, n=5000, city_weights=(0.5, 0.3, 0.2), price_scale=1.0, null_every=0
):
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    city = rng.choice(["a", "b", "c"], size=n, p=city_weights)
    price = rng.lognormal(3, 0.5, n) * price_scale
    p_true = [None if null_every and i % null_every == 0 else 0.5 for i in range(n)]
    table = pa.table(
        {
            "ts": np.arange(n) + 1_700_000_000,
            "user_id": rng.integers(1, 100, n),
            "city": city,
            "price": price,
            "click": rng.integers(0, 2, n),
            "p_true": pa.array(p_true, pa.float64()),
        }
    )
    pq.write_table(table, directory / "part-00000.parquet")


def test_stats_summarise_every_column(tmp_path, schema):
    write_events(tmp_path / "e")
    stats = compute_stats(tmp_path / "e", schema)
    assert stats["rows"] == 5000
    city = stats["columns"]["city"]
    assert set(city["top"]) == {"a", "b", "c", "__other__"}
    assert city["top"]["a"] == pytest.approx(0.5, abs=0.03)
    assert stats["columns"]["price"]["min"] > 0 and stats["columns"]["price"]["null_rate"] == 0


def test_same_distribution_does_not_drift(tmp_path, schema):
    write_events(tmp_path / "a", seed=0)
    write_events(tmp_path / "b", seed=1)
    report = compare_stats(
        compute_stats(tmp_path / "a", schema), compute_stats(tmp_path / "b", schema), DriftConfig()
    )
    assert not report.drifted, report.summary()


def test_categorical_numeric_and_null_drift_are_found(tmp_path, schema):
    write_events(tmp_path / "a")
    write_events(tmp_path / "b", city_weights=(0.05, 0.15, 0.8), price_scale=100.0, null_every=4)
    report = compare_stats(
        compute_stats(tmp_path / "a", schema), compute_stats(tmp_path / "b", schema), DriftConfig()
    )
    checks = {(f["column"], f["check"]) for f in report.findings}
    assert {("city", "psi"), ("price", "range"), ("p_true", "null_rate")} <= checks


def test_psi_of_identical_distributions_is_zero_and_new_values_pool():
    dist = {"a": 0.6, "b": 0.4, "__other__": 0.0}
    assert population_stability_index(dist, dist) == pytest.approx(0.0)
    assert population_stability_index(dist, {"z": 1.0}) > 1.0


def test_64_bit_hashed_ids_are_summarised(tmp_path, schema):
    # Upstream systems hand over 64-bit hashed ids: float64 cannot hold them exactly,
    # which must not fail the statistics (they are approximate by nature).
    write_events(tmp_path / "e")
    table = pq.read_table(tmp_path / "e" / "part-00000.parquet")
    ids = np.array([2**63 - 1, 2**53 + 1, -(2**62) - 3] * (table.num_rows // 3 + 1))
    table = table.set_column(1, "user_id", pa.array(ids[: table.num_rows], pa.int64()))
    pq.write_table(table, tmp_path / "e" / "part-00000.parquet")
    user = compute_stats(tmp_path / "e", schema)["columns"]["user_id"]
    assert user["max"] == pytest.approx(2.0**63) and user["min"] == pytest.approx(-(2.0**62))
    assert str(2**63 - 1) in user["top"]  # the ids themselves, exactly
