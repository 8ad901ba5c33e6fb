"""Attacks that make recforge print a secret: a credentials file fed to ingest, secrets in
the launcher's environment and DeepSpeed's `.deepspeed_env` (issue 27, finding 8).

Messages and logs reach the Prefect UI and the artifact root; each test checks that the
secret is in neither, while nothing is lost: ingest's bad rows stay in the quarantine.
"""

import logging
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_prep.errors import SchemaError
from data_prep.ingest import IngestConfig, ingest_logs
from data_prep.schema import SchemaConfig
from training.runtime.launcher import (
    NodeLaunch,
    launcher_command,
    launcher_env,
    redact_line,
    run_launcher,
)

pytestmark = pytest.mark.security

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


@pytest.fixture
def schema() -> SchemaConfig:
    return SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user_id", "dtype": "int64", "role": "sparse"},
            {"name": "click", "dtype": "int64", "role": "label"},
        ]
    )


def assert_secret_absent(text: str) -> None:
    for secret in (SECRET, SECRET[:12], KEY_ID):
        assert secret not in text


@pytest.mark.parametrize("header", [True, False])
def test_a_credentials_file_fed_to_ingest_is_not_echoed(
    tmp_path: Path, schema: SchemaConfig, caplog: pytest.LogCaptureFixture, header: bool
) -> None:
    credentials = tmp_path / "credentials.csv"
    credentials.write_text(
        f"aws_secret_access_key = {SECRET}\naws_access_key_id = {KEY_ID}\n"
        f"{SECRET}\n1700000000,1,0\n"
    )
    out = tmp_path / "out"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SchemaError) as raised:
        ingest_logs(IngestConfig(path=str(credentials), header=header), schema, out)
    message = str(raised.value)
    assert_secret_absent(message + caplog.text)
    assert str(credentials) in message and "line 1" in message
    if not header:
        # Nothing is lost: every bad line is in the quarantine the message points to.
        assert "quarantine" in message
        raws = pq.read_table(out / "quarantine").column("raw").to_pylist()
        assert raws[0] == f"aws_secret_access_key = {SECRET}" and raws[2] == SECRET


def test_a_secret_in_a_jsonl_value_is_not_echoed(tmp_path: Path, schema: SchemaConfig) -> None:
    logs = tmp_path / "events.jsonl"
    logs.write_text(f'{{"ts": 1, "user_id": "{SECRET}", "click": 0}}\n')
    with pytest.raises(SchemaError, match=r"events.jsonl line 1: not_int64:user_id") as raised:
        ingest_logs(IngestConfig(path=str(logs)), schema, tmp_path / "out")
    assert_secret_absent(str(raised.value))
    assert SECRET in pq.read_table(tmp_path / "out" / "quarantine").column("raw")[0].as_py()


def test_the_launcher_log_holds_no_secret_of_the_environment(tmp_path: Path) -> None:
    """The ssh launcher: DeepSpeed's pdsh runner logs the `export NAME=VALUE;` command it
    sends every host, `.deepspeed_env` included. Stand-in pdsh and ssh (exit 0) let the
    runner go that far without a cluster; no rank starts."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    for tool in ("pdsh", "ssh"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    (home / ".deepspeed_env").write_text(
        f"AWS_SECRET_ACCESS_KEY={SECRET}\nPREFECT_API_AUTH_STRING=admin:hunter2hunter2\n"
    )
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    (tmp_path / "launch.json").write_text("{}\n")
    command = launcher_command(
        sys.executable,
        2,
        29511,
        "training.ctr.worker",
        tmp_path / "launch.json",
        NodeLaunch(hostfile, 2, 1, "10.0.0.1"),
    )
    env = launcher_env(
        {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(home),
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "RECFORGE_SIGNING_KEY": "s" * 48,
            "PYTHON_KEYRING_PASSWORD": "pw-in-the-environment",
        },
        "cpu",
    )
    log_path = tmp_path / "launcher.log"
    shown: list[str] = []
    returncode, tail, _ = run_launcher(command, env, log_path, shown.append, None)
    log = log_path.read_text()
    assert returncode == 0 and "export AWS_SECRET_ACCESS_KEY=***" in log, log
    for text in (log, "\n".join(shown), "\n".join(tail)):
        assert_secret_absent(text)
        assert "hunter2" not in text and "pw-in-the-environment" not in text


@pytest.mark.parametrize(
    ("line", "redacted"),
    [
        ("export AWS_SECRET_ACCESS_KEY=abc; export PLAIN=1;", "AWS_SECRET_ACCESS_KEY=***;"),
        ("0 NCCL_IB_TOKEN=x y", "0 NCCL_IB_TOKEN=*** y"),
        ('export PREFECT_API_KEY="a b c"; cd /', "export PREFECT_API_KEY=***; cd /"),
        ("prefect_api_auth_string=admin:pw", "prefect_api_auth_string=***"),
        ("db_password='p w'", "db_password=***"),
    ],
)
def test_secret_looking_assignments_are_redacted(line: str, redacted: str) -> None:
    assert redacted in redact_line(line)
    assert redact_line("--master_addr=10.0.0.1 --world_info=abc") == (
        "--master_addr=10.0.0.1 --world_info=abc"
    )
