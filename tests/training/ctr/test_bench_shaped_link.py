"""bench/shaped_link.py: the rates it reads, its refusal without root, and a link really shaped.

The shaped-link check runs only as root with unshare, ip and tc (it makes a network
namespace); it moves 2 MB over a 100 Mbit/s loopback, ~0.2 s. The whole file takes a
few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SHAPED_LINK = Path(__file__).resolve().parents[3] / "bench" / "shaped_link.py"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def load_shaped_link() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shaped_link", SHAPED_LINK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def driver(call: str) -> str:
    """Python source that loads the helper from its path and runs `call` with it as `link`."""
    return (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('shaped_link', {str(SHAPED_LINK)!r})\n"
        "link = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(link)\n"
        f"{call}\n"
    )


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1gbit", 1_000_000_000),
        ("200mbit", 200_000_000),
        ("500kbit", 500_000),
        ("1000000bit", 1_000_000),
        ("1GBit", 1_000_000_000),
        (" 100MBIT ", 100_000_000),
        ("1.5gbit", 1_500_000_000),
    ],
)
def test_parse_rate_reads_tc_bit_rates(text: str, bits: int) -> None:
    assert load_shaped_link().parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "-1mbit", "", "100", "100mbps", "0mbit", "1 gbit/s"])
def test_parse_rate_refuses_what_is_not_a_bit_rate(text: str) -> None:
    with pytest.raises(ValueError, match="link rate"):
        load_shaped_link().parse_rate(text)


def test_current_link_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    link = load_shaped_link()
    monkeypatch.delenv(link.LINK_ENV, raising=False)
    assert link.current_link() is None
    monkeypatch.setenv(link.LINK_ENV, "250mbit")
    assert link.current_link() == 250_000_000
    monkeypatch.setenv(link.LINK_ENV, "quick")
    with pytest.raises(ValueError, match=link.LINK_ENV):
        link.current_link()


def test_shaped_command_passes_the_command_as_arguments_never_as_shell_text() -> None:
    link = load_shaped_link()
    argv = [sys.executable, "-c", "print('$(touch /tmp/x); `id`')", "a b"]
    command = link.shaped_command("100mbit", argv)
    assert command[:6] == ["unshare", "-n", "--", "sh", "-c", link._SHELL_SCRIPT]
    # The rate tc gets is the one parse_rate read; the command follows it untouched.
    assert command[6:] == ["shaped-link", "100000000bit", *argv]
    assert "$(" not in link._SHELL_SCRIPT and 'exec "$@"' in link._SHELL_SCRIPT
    with pytest.raises(ValueError, match="link rate"):
        link.shaped_command("fast", argv)
    with pytest.raises(ValueError, match="argv is empty"):
        link.shaped_command("1gbit", [])


def test_run_inside_refuses_without_root_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    link = load_shaped_link()
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)

    def no_exec(*args: object) -> None:
        raise AssertionError(f"run_inside executed {args} without root")

    monkeypatch.setattr(link.os, "execvpe", no_exec)
    assert any("root" in reason for reason in link.missing_requirements())
    with pytest.raises(SystemExit) as exited:
        link.run_inside("1gbit", [sys.executable, "-c", "pass"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--link needs root" in err and "or drop --link" in err


def test_run_inside_refuses_a_non_root_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        prefix: list[str] = []
    elif shutil.which("setpriv") is not None:
        prefix = NOBODY
    else:
        pytest.skip("root without setpriv (util-linux): no way to run as another user here")
    marker = tmp_path / "ran"
    # The command inside would leave a file; a refusal runs nothing.
    call = f"link.run_inside('1gbit', ['touch', {str(marker)!r}])"
    result = subprocess.run(
        [*prefix, sys.executable, "-c", driver(call)],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "--link needs root to make a network namespace" in result.stderr
    assert "or drop --link" in result.stderr
    assert not marker.exists()


# Run inside the shaped namespace: what the process sees, and 2 MB over 127.0.0.1.
INSIDE = """\
import json, os, socket, subprocess, sys, threading, time
import importlib.util
spec = importlib.util.spec_from_file_location("shaped_link", sys.argv[1])
link = importlib.util.module_from_spec(spec)
spec.loader.exec_module(link)
payload = b"x" * 2_000_000
server = socket.create_server(("127.0.0.1", 0))
received = []

def receive():
    conn, _ = server.accept()
    with conn:
        got = 0
        while got < len(payload):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            got += len(chunk)
        received.append((got, time.perf_counter()))

reader = threading.Thread(target=receive)
reader.start()
with socket.create_connection(server.getsockname()) as client:
    started = time.perf_counter()
    client.sendall(payload)
    reader.join()
got, finished = received[0]
print(json.dumps({
    "env": os.environ.get(link.LINK_ENV),
    "current_link": link.current_link(),
    "qdisc": subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                            text=True).stdout,
    "described": link.describe_link(),
    "bytes": got,
    "seconds": finished - started,
}))
"""


def test_run_inside_shapes_the_loopback(tmp_path: Path) -> None:
    link = load_shaped_link()
    missing = link.missing_requirements()
    if missing:
        pytest.skip("; ".join(missing))
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -n fails here (a container without CAP_SYS_ADMIN?): {probe.stderr}")
    script = tmp_path / "inside.py"
    script.write_text(INSIDE)
    call = f"link.run_inside('100mbit', [sys.executable, {str(script)!r}, {str(SHAPED_LINK)!r}])"
    result = subprocess.run(
        [sys.executable, "-c", driver(call)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    inside = json.loads(result.stdout.strip().splitlines()[-1])
    assert inside["env"] == "100mbit"
    assert inside["current_link"] == 100_000_000
    assert "tbf" in inside["qdisc"] and "100Mbit" in inside["qdisc"]
    described = inside["described"]
    assert described["shaped"] is True and described["rate_bit_per_s"] == 100_000_000
    # tc reports the rate in bytes per second.
    assert described["qdisc"][0]["options"]["rate"] == 100_000_000 // 8
    assert inside["bytes"] == 2_000_000
    # 2 MB at 100 Mbit/s is 0.16 s (less the 256 KB burst: ~0.14 s); an unshaped loopback
    # moves it in ~2 ms. A functional check that the shaping is on, not a timing bench.
    assert inside["seconds"] >= 0.08, inside
