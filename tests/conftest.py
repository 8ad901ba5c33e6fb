"""Shared fixtures: a tiny schema, and one Prefect test server per session."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for every flow test (starting one takes ~14 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
