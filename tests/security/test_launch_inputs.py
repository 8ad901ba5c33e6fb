"""Attacks through the launch inputs: hostfile hosts, master_addr, the rendezvous listener.

A host or address reaches ssh, pdsh and a remote shell command line (DeepSpeed's pdsh
runner joins `--master_addr=...` into the command each host runs), so each test
plays one injection from issue 27 (finding 6) and checks that it is refused at parse
time, naming the file and line or the field, and that its payload never runs. The last
test checks that the rendezvous store listens on master_addr only (finding 7).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from artifacts.errors import ConfigError
from flows.config import load_config
from training.config import TrainConfig
from training.runtime.hosts import check_ssh_hosts, host_problem, read_hostfile
from training.runtime.launcher import NodeLaunch, free_port
from training.stages import ssh_launch

pytestmark = pytest.mark.security

REPO = Path(__file__).resolve().parents[2]


def proxy_command(pwned: Path) -> str:
    """An ssh option disguised as a host: ssh runs ProxyCommand through the shell, and
    `${IFS}` stands in for the space a hostfile line cannot hold."""
    return f"-oProxyCommand=touch${{IFS}}{pwned}"


def test_a_hostfile_host_that_is_an_ssh_option_is_refused_naming_the_line(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# cluster\n{proxy_command(pwned)} slots=2\nnode-1 slots=2\n")
    config = TrainConfig(launcher="ssh", hostfile=str(hostfile), nodes=2, master_addr="10.0.0.1")
    with pytest.raises(
        ConfigError, match=rf"{hostfile} line 2: host '-oProxyCommand=.*' is not a hostname"
    ):
        ssh_launch(config)  # the train stage's path: read the hostfile, then ssh every host
    assert not pwned.exists()


def test_ssh_never_takes_a_host_for_an_option(tmp_path: Path) -> None:
    """`check_ssh_hosts` refuses such a host itself, and passes `--` before the host."""
    pwned = tmp_path / "pwned"
    with pytest.raises(ConfigError, match=r"train.hostfile .*hosts: host '-oProxyCommand="):
        check_ssh_hosts([proxy_command(pwned)], None, tmp_path / "hosts")
    assert not pwned.exists()


@pytest.mark.parametrize(
    "host",
    [
        "a;touch${IFS}x",
        "$(touch${IFS}x)",
        "`id`",
        "a|b",
        "a&&b",
        "node-0,evil",  # pdsh -w takes a comma list: one host would smuggle in another
        "user@host",
        "a'b",
        "-",
        "host-.example",
        "256.1.1.1",
        "fe80::1%eth0",
        "x" * 64,
    ],
)
def test_hostfile_hosts_that_are_not_hostnames_or_addresses_are_refused(
    tmp_path: Path, host: str
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"good-host slots=1\n{host} slots=1\n")
    with pytest.raises(ConfigError, match=rf"train.hostfile {hostfile} line 2: host "):
        read_hostfile(hostfile, 2, 1)


@pytest.mark.parametrize(
    "host", ["node-0", "gpu01.cluster.internal", "10.0.0.1", "fd00::1", "::1", "localhost"]
)
def test_hostnames_and_addresses_are_accepted(host: str) -> None:
    assert host_problem(host) is None


@pytest.mark.parametrize("addr", ["127.0.0.1;touch x", "10.0.0.1 -x", "-oProxyCommand=x", "a$(id)"])
def test_a_master_addr_that_is_not_a_host_is_refused_at_parse_time(addr: str) -> None:
    with pytest.raises(ValidationError, match=r"train.master_addr=.* is not a hostname"):
        TrainConfig(launcher="ssh", hostfile="h", nodes=2, master_addr=addr)


def test_a_master_addr_override_from_the_ui_is_a_config_error_naming_the_field() -> None:
    """A deployment parameter is an override: it never reaches pdsh's remote command."""
    with pytest.raises(ConfigError, match=r"train.master_addr: .*'127.0.0.1;touch x'"):
        load_config(REPO / "configs/tiny.yaml", ["train.master_addr=127.0.0.1;touch x"])


def test_a_node_launch_refuses_a_master_addr_that_skipped_the_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"master_addr '10.0.0.1;touch x' is not a hostname"):
        NodeLaunch(tmp_path / "hosts", 2, 1, "10.0.0.1;touch x")


# Rank 0 as DeepSpeed's launcher starts it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in
# its environment): `rank_main`, then the env:// rendezvous every rank module runs (via
# deepspeed.init_distributed); it prints the local addresses listening on MASTER_PORT.
_RANK_ZERO = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    from training.runtime.rank import rank_main

    def listening(port):
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in open(table).read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
        return found

    def run(spec):
        dist.init_process_group("gloo", init_method="env://")
        print("LISTENING", ",".join(listening(int(os.environ["MASTER_PORT"]))), flush=True)
        print("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME"), flush=True)
        dist.destroy_process_group()

    rank_main("probe", run, ["spec.json"])
    """
)


def test_the_rendezvous_store_listens_on_master_addr_only(tmp_path: Path) -> None:
    port = free_port()
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    (tmp_path / "spec.json").write_text("{}")  # rank_main reads the spec (its root) first
    result = subprocess.run(
        [sys.executable, "-c", _RANK_ZERO],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env, "MASTER_PORT": str(port)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("LISTENING ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr
    # 127.0.0.1 in /proc/net/tcp (little-endian hex); never 0.0.0.0 or the IPv6 any address.
    assert lines[0].split()[1].split(",") == ["0100007F"]
    # A loopback master: gloo's own connections stay on the loopback interface too.
    assert "GLOO_SOCKET_IFNAME lo" in result.stdout.splitlines()


def test_rank_zero_refuses_a_master_addr_that_is_not_its_own(tmp_path: Path) -> None:
    """No fallback to every interface: 192.0.2.1 (TEST-NET-1) is no address of this host."""
    from training.runtime.rank import bind_rendezvous

    env = {"RANK": "0", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": str(free_port())}
    with pytest.raises(ConfigError, match=r"train.master_addr='192.0.2.1': rank 0 cannot listen"):
        bind_rendezvous(env)
    assert "GLOO_SOCKET_IFNAME" not in env
