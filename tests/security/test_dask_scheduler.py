"""An attack on `recforge run --dask ADDRESS` (issue 38): a plain-TCP scheduler elsewhere.

A Dask scheduler reached over `tcp://` neither encrypts nor authenticates: anyone on
the path reads the tasks (and the signing key's work), and anyone who can reach the
scheduler's port runs code on its workers. `recforge run` must not send a run to one
on another machine unless its user says so (`--dask-insecure`); `tls://` and loopback
are fine.
"""

from pathlib import Path

import pytest

import flows.cli as cli
from artifacts.signing import KEY_ENV

pytestmark = pytest.mark.security

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


class Stop(Exception):
    """Raised by the stand-in task runner: the run got as far as building it."""


@pytest.fixture
def runners(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The Dask addresses `recforge run` built a task runner for (none runs)."""
    built: list[str | None] = []

    def stand_in(workers: int | None, dask: str | None) -> None:
        built.append(dask)
        raise Stop

    monkeypatch.setattr(cli, "task_runner", stand_in)
    monkeypatch.delenv(KEY_ENV, raising=False)
    return built


def run(tmp_path: Path, *flags: str) -> int:
    return cli.main(["run", TINY, "--root", str(tmp_path / "root"), *flags])


@pytest.mark.parametrize(
    "address",
    ["tcp://10.0.0.1:8786", "10.0.0.1:8786", "tcp://scheduler.internal:8786", "ws://10.0.0.1:8786"],
)
def test_a_plain_tcp_scheduler_on_another_machine_is_refused(
    runners: list[str | None], tmp_path: Path, capsys: pytest.CaptureFixture, address: str
) -> None:
    assert run(tmp_path, "--dask", address) == 2
    error = capsys.readouterr().err
    assert "--dask" in error and "tls://" in error and "--dask-insecure" in error
    assert runners == []


@pytest.mark.parametrize(
    "address",
    ["tls://10.0.0.1:8786", "tcp://127.0.0.1:8786", "tcp://localhost:8786", "tcp://[::1]:8786"],
)
def test_tls_and_loopback_schedulers_are_used(
    runners: list[str | None], tmp_path: Path, address: str
) -> None:
    assert run(tmp_path, "--dask", address) == 1  # the stand-in stopped it
    assert runners == [address]


def test_dask_insecure_sends_the_run_and_says_so(
    runners: list[str | None], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert run(tmp_path, "--dask", "tcp://10.0.0.1:8786", "--dask-insecure") == 1
    assert runners == ["tcp://10.0.0.1:8786"]
    assert "warning" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["http://10.0.0.1:8786", "local:two", "local:0"])
def test_an_unknown_scheduler_address_is_refused(
    runners: list[str | None], tmp_path: Path, capsys: pytest.CaptureFixture, address: str
) -> None:
    assert run(tmp_path, "--dask", address) == 2
    assert "--dask" in capsys.readouterr().err
    assert runners == []
