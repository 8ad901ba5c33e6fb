"""Shared fixtures: a tiny schema, and one Prefect test server per session."""

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect keeps its database under PREFECT_HOME (default ~/.prefect). The CLI runs the
# tests start as subprocesses, and their ephemeral APIs, would share that database with
# everything else on the machine that runs Prefect; one migrated by another Prefect
# version stops their server at start ("Can't locate revision"). Set before Prefect is
# imported, so this process and every subprocess use the session's own.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="recforge-tests-prefect-home-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
# The local side of remote roots and the raw-input digests the tests compute go to the
# session's own cache directory, not ~/.cache/recforge (tests that need another set it).
os.environ["RECFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="recforge-tests-cache-")
atexit.register(shutil.rmtree, os.environ["RECFORGE_CACHE_DIR"], ignore_errors=True)

# Every manifest the tests write is signed, as on shared storage; the tests of a run
# without a key (a local root works, a remote one refuses) unset it themselves.
os.environ["RECFORGE_SIGNING_KEY"] = "recforge-tests-" + "0123456789abcdef" * 3

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "datasets"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the compact tables' row-update kernel once, before any test times a rank.

    It is built on first use (~30 s on 2 cores, then cached in TORCH_EXTENSIONS_DIR); in
    a fresh clone that first use would otherwise fall inside a test that launches ranks
    under a timeout.
    """
    from training.ctr.kernels import rounding_kernel

    rounding_kernel()


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
    get the run OOM-killed. Only buffers no live process maps are removed, and only
    once they are a minute old: another test session's ranks may be starting up next to
    this one. Leftovers of this test's last minute go at a later test's teardown.
    """
    from training.runtime.launcher import unmapped_shm_buffers

    yield
    for path in unmapped_shm_buffers():
        path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto S3 server on 127.0.0.1 (a free port) for the object-store tests.

    Yields its endpoint URL; each test points AWS_ENDPOINT_URL at it with fake
    credentials, so no request can leave the machine.
    """
    server_module = pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
    # One log line per request would bury a failing test's own output.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
