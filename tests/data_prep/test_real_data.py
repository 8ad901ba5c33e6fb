"""Real public data through ingest -> preprocess -> shard with the ready-made schemas.

Reads ``../shared/datasets`` (see its README); skipped where it is absent.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from data_prep.ingest import event_schema, ingest_logs
from data_prep.preprocess import preprocess_events
from data_prep.presets import PRESETS
from data_prep.shard import write_shards
from flows.config import load_config

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "datasets"  # as tests/conftest.py's SHARED
RATINGS = SHARED / "ml-latest-small" / "ratings.csv"
CRITEO = SHARED / "samples" / "criteo_sample.txt"

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/datasets is absent")


@pytest.mark.parametrize(
    ("config", "preset", "overrides"),
    [
        ("ml-latest-small.yaml", "movielens-ratings-csv", {}),
        # The shared sample is a CSV with a header, not the original header-less TSV.
        ("criteo-sample.yaml", "criteo", {"format": "csv", "header": True}),
    ],
)
def test_shipped_config_spells_out_its_preset(config, preset, overrides):
    loaded = load_config(REPO / "configs" / config)
    assert loaded.schema_ == PRESETS[preset].schema_config()
    expected = PRESETS[preset].ingest_config(loaded.ingest.path, **overrides)
    assert loaded.ingest.model_dump(exclude={"max_bad_fraction"}) == expected.model_dump(
        exclude={"max_bad_fraction"}
    )


def run_stages(config_name: str, data: Path, tmp_path: Path):
    """ingest -> preprocess -> shard with a shipped config; returns what each wrote."""
    config = load_config(REPO / "configs" / config_name, [f"ingest.path={data}"])
    ingest = ingest_logs(config.ingest, config.schema_, tmp_path / "ingest")
    events = pq.read_table(tmp_path / "ingest" / "events")
    assert events.schema == event_schema(config.schema_)
    preprocess = preprocess_events(
        config.preprocess, config.schema_, tmp_path / "ingest" / "events", tmp_path / "pre"
    )
    shard = write_shards(config.shard, tmp_path / "pre", tmp_path / "shards")
    dataset = json.loads((tmp_path / "shards" / "dataset.json").read_text())
    return ingest, events, preprocess, shard, dataset


def split_tables(dataset: dict, shard_dir: Path) -> dict[str, pa.Table]:
    tables = {}
    for split, entry in dataset["splits"].items():
        paths = [shard_dir / f["path"] for f in entry["files"]]
        tables[split] = pa.concat_tables([pq.read_table(p) for p in paths])
        assert tables[split].num_rows == entry["rows"]
    return tables


def assert_time_ordered_splits(tables: dict[str, pa.Table], ts: str) -> None:
    """No leakage: every train event is earlier than every valid event, and so on."""
    for earlier, later in (("train", "valid"), ("valid", "test")):
        latest = pc.max(tables[earlier].column(ts)).as_py()
        earliest = pc.min(tables[later].column(ts)).as_py()
        assert latest < earliest, (earlier, later, latest, earliest)


@needs_shared
def test_movielens_latest_small(tmp_path):
    ingest, events, preprocess, shard, dataset = run_stages(
        "ml-latest-small.yaml", RATINGS, tmp_path
    )

    assert (ingest.rows, ingest.good_rows, ingest.bad_rows) == (100_836, 100_836, 0)
    assert set(events.column("rating").to_pylist()) == {0, 1}
    positives = pc.sum(events.column("rating")).as_py()
    assert 0.4 < positives / events.num_rows < 0.6  # ratings of 4 and more are about half
    assert pc.count_distinct(events.column("userId")).as_py() == 610
    assert pc.count_distinct(events.column("movieId")).as_py() == 9_724

    assert sum(preprocess.rows.values()) == sum(shard.rows.values()) == 100_836
    assert dataset["label"] == "rating" and dataset["timestamp"] == "timestamp"
    sparse = {s["name"]: s["num_embeddings"] for s in dataset["sparse"]}
    assert set(sparse) == {"userId", "movieId"} and dataset["dense"] == []
    assert 2 < sparse["userId"] <= 611 and 2 < sparse["movieId"] <= 9_725
    tables = split_tables(dataset, tmp_path / "shards")
    assert_time_ordered_splits(tables, "timestamp")
    assert min(t.num_rows for t in tables.values()) > 5_000


@needs_shared
def test_criteo_sample(tmp_path):
    ingest, events, preprocess, shard, dataset = run_stages("criteo-sample.yaml", CRITEO, tmp_path)

    # Every row of the sample is well-formed: empty dense and categorical values are optional.
    assert (ingest.rows, ingest.good_rows, ingest.bad_rows) == (200, 200, 0)
    assert events.column("ts").to_pylist() == list(range(200))  # numbered in file order
    assert events.column("I3").null_count < 200 and events.column("C1").null_count == 0
    assert pc.min(events.column("I2")).as_py() == -1.0  # counts may be -1 in Criteo

    assert sum(preprocess.rows.values()) == sum(shard.rows.values()) == 200
    assert dataset["label"] == "label"
    assert dataset["dense"] == [f"I{i}" for i in range(1, 14)]
    assert [s["name"] for s in dataset["sparse"]] == [f"C{i}" for i in range(1, 27)]
    assert all(s["num_embeddings"] >= 1 for s in dataset["sparse"])
    tables = split_tables(dataset, tmp_path / "shards")
    assert_time_ordered_splits(tables, "ts")
    assert tables["train"].num_rows > tables["test"].num_rows > 0


@needs_shared
def test_movielens_leave_last_out_with_sequences(tmp_path):
    overrides = [
        f"ingest.path={RATINGS}",
        "preprocess.split=leave_last_out",
        "preprocess.sequence_length=50",
    ]
    config = load_config(REPO / "configs" / "ml-latest-small.yaml", overrides)
    ingest_logs(config.ingest, config.schema_, tmp_path / "ingest")
    result = preprocess_events(
        config.preprocess, config.schema_, tmp_path / "ingest" / "events", tmp_path / "pre"
    )
    # Every user in ml-latest-small has >= 20 ratings: one test and one valid event each.
    assert result.rows["test"] == result.rows["valid"] == 610
    assert result.sequences == {"train": 610, "valid": 610, "test": 610}
    seq = tmp_path / "pre" / "sequences"
    test = pq.read_table(seq / "test.parquet")
    train = {r["user"]: r["history"] for r in pq.read_table(seq / "train.parquet").to_pylist()}
    for row in test.to_pylist():
        assert 1 <= len(row["history"]) <= 50
        # The training sequence is a prefix of what the test event sees (plus valid).
        assert row["history"][-2] == train[row["user"]][-1]
