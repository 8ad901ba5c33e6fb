"""DeepSpeed hostfiles: read and check one before a multi-node launch, or write one.

DeepSpeed's launcher reads the hostfile itself; this module checks it first so that a
wrong one fails with the file, line and field named instead of a launcher traceback,
and so that a host that does not answer fails the train stage naming that host (the
launcher's own check tries the first host only).

A host reaches ssh, pdsh's `-w` list and DeepSpeed's launcher, which joins it into
command lines a shell runs: every host must be a hostname or an IP address
(`host_problem`), so none can be read as an option or carry shell syntax.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
from pathlib import Path

from artifacts.errors import ConfigError, InputNotFoundError

# DeepSpeed's format: "hostname slots=N", comments with '#'.
_LINE = re.compile(r"(\S+)\s+slots=(\d+)")

# How long one host gets to answer ssh before the stage fails naming it.
SSH_TIMEOUT_S = 10

# One label of an RFC 1123 hostname: letters, digits and '-', not at either end.
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(host: str) -> str | None:
    """Why `host` is not a hostname (RFC 1123) or an IPv4/IPv6 address; None if it is one.

    Refused: a leading '-' (ssh and pdsh would read it as an option), spaces and shell
    characters, a comma (pdsh's host list separator), `user@`, and an IPv6 zone (`%eth0`).
    Messages put it as "HOST is not a hostname or an IP address (PROBLEM)".
    """
    if host.startswith("-"):
        return "it starts with '-', which ssh and pdsh read as an option"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        if getattr(address, "scope_id", None):
            return "an IPv6 zone ('%...') is not accepted; use a global address or a hostname"
        return None
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return (
            "RFC 1123: letters, digits and '-' in dot-separated labels of 1-63 characters, "
            "no '-' at either end of a label"
        )
    if all(label.isdigit() for label in labels):
        return "all digits, but not an IPv4 address"
    return None


def not_a_host(host: str, problem: str) -> str:
    """The message part for a refused host: "'HOST' is not a hostname or ... (PROBLEM)"."""
    return f"{host!r} is not a hostname or an IP address ({problem})"


def read_hostfile(path: Path, nodes: int, ranks_per_node: int) -> list[tuple[str, int]]:
    """The first `nodes` (host, slots) of a DeepSpeed hostfile, checked for the layout.

    Raises:
        InputNotFoundError: The file does not exist.
        ConfigError: A line is not `host slots=N`, a host is not a hostname or IP address
            (`host_problem`), a host repeats, there are fewer than
            `nodes` hosts, or one of them has fewer than `ranks_per_node` slots.
    """
    if not path.is_file():
        raise InputNotFoundError(
            f"train.hostfile: {path} does not exist; write DeepSpeed's `host slots=N` lines "
            "there, one per node"
        )
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise ConfigError(f"train.hostfile {path} line {number}: {raw!r} is not `host slots=N`")
        host, slots = match.group(1), int(match.group(2))
        problem = host_problem(host)
        if problem is not None:
            raise ConfigError(
                f"train.hostfile {path} line {number}: host {not_a_host(host, problem)}"
            )
        if host in (known for known, _ in hosts):
            raise ConfigError(f"train.hostfile {path} line {number}: host {host} repeats")
        hosts.append((host, slots))
    if len(hosts) < nodes:
        raise ConfigError(
            f"train.nodes={nodes} but train.hostfile {path} names {len(hosts)} host(s); add "
            "hosts or lower train.nodes"
        )
    short = [(host, slots) for host, slots in hosts[:nodes] if slots < ranks_per_node]
    if short:
        host, slots = short[0]
        raise ConfigError(
            f"train.hostfile {path}: host {host} has slots={slots} but every node runs "
            f"train.ranks_per_node={ranks_per_node} ranks; raise its slots or lower "
            "ranks_per_node"
        )
    return hosts[:nodes]


def save_hostfile(path: Path, hosts: list[tuple[str, int]]) -> Path:
    """Write `hosts` in DeepSpeed's format; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{host} slots={slots}\n" for host, slots in hosts))
    return path


def node_hosts(nodes: int, ranks_per_node: int) -> list[tuple[str, int]]:
    """Names for per-node launches without a hostfile: node-0 .. node-N-1.

    With `--no_ssh` DeepSpeed never contacts a host by its name; the names only order
    the nodes (node_rank i is the i-th line).
    """
    return [(f"node-{index}", ranks_per_node) for index in range(nodes)]


def check_ssh_hosts(hosts: list[str], ssh_port: int | None, hostfile: Path) -> None:
    """Fail naming the first host that does not answer ssh, before anything launches.

    Raises:
        ConfigError: A host is not a hostname or IP address (`host_problem`), ssh or
            DeepSpeed's pdsh launcher is not installed, or a host does not answer a
            non-interactive ssh within `SSH_TIMEOUT_S`.
    """
    for host in hosts:
        problem = host_problem(host)
        if problem is not None:
            raise ConfigError(f"train.hostfile {hostfile}: host {not_a_host(host, problem)}")
    if shutil.which("ssh") is None:
        raise ConfigError("train.launcher=ssh needs the ssh client on this machine; install it")
    for host in hosts:
        command = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={SSH_TIMEOUT_S}",
            "-o",
            "StrictHostKeyChecking=accept-new",
            *(["-p", str(ssh_port)] if ssh_port is not None else []),
            "--",  # whatever follows is the host and its command, never an option
            host,
            "true",
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 5
            )
        except subprocess.TimeoutExpired:
            detail = f"no answer within {SSH_TIMEOUT_S + 5} s"
        else:
            if result.returncode == 0:
                continue
            detail = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        port = f" port {ssh_port}" if ssh_port is not None else ""
        raise ConfigError(
            f"train.hostfile {hostfile}: host {host} does not answer ssh{port} ({detail}); "
            "fix the host or remove it from the hostfile (the launcher needs passwordless "
            "ssh to every host)"
        )
    if shutil.which("pdsh") is None:
        raise ConfigError(
            "train.launcher=ssh runs DeepSpeed's pdsh launcher, which is not installed "
            "here; install pdsh, or use train.launcher: per_node"
        )
