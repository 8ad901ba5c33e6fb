"""ingest.partition: one day of a partitioned log, read by content; hostile names refused."""

import os

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from artifacts.errors import InputNotFoundError
from artifacts.locations import UnsafeName
from data_prep.drift import DriftConfig
from data_prep.ingest import IngestConfig, check_partition, describe_inputs, ingest_logs
from tasks.ingest import ingest_section
from tests.data_prep.test_ingest import GOOD, write_csv


def partitioned(root):
    """Two days of logs plus a metadata file, as `recforge generate` daily partitions."""
    write_csv(root / "dt=2026-12-05" / "part-00000.csv", GOOD[:2])
    write_csv(root / "dt=2026-12-06" / "part-00000.csv", GOOD)
    (root / "_bayes.json").write_text("{}")
    return root


@pytest.mark.security
@pytest.mark.parametrize(
    "name", ["../raw-secrets", "dt=1/../../x", "/etc", "s3://other/raw", "..", ".hidden", "a/b", "",
             "dt\x00=1", "dt=2026-12-05\n"]
)
def test_a_partition_name_that_is_not_one_folder_is_refused(tmp_path, name):
    # UI and schedule parameters are hostile: a partition is one plain folder name.
    with pytest.raises(ValidationError, match="partition"):
        IngestConfig(path=str(tmp_path), partition=name)


@pytest.mark.security
def test_a_symlinked_partition_leading_outside_the_log_is_refused(tmp_path):
    secrets = tmp_path / "elsewhere"
    write_csv(secrets / "part-00000.csv", GOOD)
    root = partitioned(tmp_path / "raw")
    os.symlink(secrets, root / "dt=2026-12-07")
    config = IngestConfig(path=str(root), partition="dt=2026-12-07")
    with pytest.raises(UnsafeName, match="resolves outside"):
        config.source()


def test_a_partition_reads_only_its_folder(tmp_path, schema):
    root = partitioned(tmp_path / "raw")
    config = IngestConfig(path=str(root), partition="dt=2026-12-06")
    result = ingest_logs(config, schema, tmp_path / "out")
    assert result.good_rows == len(GOOD)
    events = pq.read_table(tmp_path / "out" / "events").to_pydict()
    assert events["user_id"] == [1, 2, 3]
    assert str(config.source()).endswith("dt=2026-12-06")


def test_a_partition_is_cached_by_its_content_not_its_name(tmp_path, schema):
    root = partitioned(tmp_path / "raw")
    write_csv(root / "dt=2026-12-08" / "part-00000.csv", GOOD)  # a replayed day
    section = {}
    for day in ("dt=2026-12-06", "dt=2026-12-08", "dt=2026-12-05"):
        config = IngestConfig(path=str(root), partition=day)
        inputs = describe_inputs(str(config.source()))
        section[day] = ingest_section(config, schema, DriftConfig(), inputs)
    assert section["dt=2026-12-06"] == section["dt=2026-12-08"]
    assert section["dt=2026-12-06"] != section["dt=2026-12-05"]
    # Configs without a partition keep their fingerprints (the field is not in them).
    plain = IngestConfig(path=str(root))
    assert "partition" not in ingest_section(plain, schema, DriftConfig(), [])["ingest"]


def test_a_missing_partition_names_the_newest_ones_there(tmp_path):
    root = partitioned(tmp_path / "raw")
    config = IngestConfig(path=str(root), partition="dt=2026-12-09")
    with pytest.raises(InputNotFoundError) as error:
        check_partition(config)
    message = str(error.value)
    assert "dt=2026-12-09" in message and "'dt=2026-12-06'" in message
    assert "--set ingest.partition=dt=2026-12-06" in message
    check_partition(IngestConfig(path=str(root), partition="dt=2026-12-05"))  # present: no error


def test_a_partition_of_a_glob_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="glob"):
        IngestConfig(path=str(tmp_path / "*.csv"), partition="dt=2026-12-05")

