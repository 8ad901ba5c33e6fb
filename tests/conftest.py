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


@pytest.fixture(autouse=True)
def _no_leaked_deepspeed_buffers():
    """Unlink the tmpfs buffers that DeepSpeed ranks a test started left in /dev/shm.

    Tests that run the DeepSpeed launcher themselves (not through `launch_ranks`, which
    releases them) would otherwise leak ~66 MiB of RAM per rank, enough over a suite to
    get the run OOM-killed. Only buffers no live process maps are removed: another test
    session's ranks may be starting up next to this one.
    """
    from training.train import SHM_DIR, unmapped_shm_buffers

    before = set(SHM_DIR.glob("deepspeed_allreduce_buffer_*"))
    yield
    for path in set(unmapped_shm_buffers()) - before:
        path.unlink(missing_ok=True)
