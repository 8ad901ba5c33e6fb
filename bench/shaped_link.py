"""A slower network link for a bench: its process re-run inside a private, shaped loopback.

Why (issue 40, "the communication wall"): on one machine the ranks of a run talk over
the loopback, which moves gigabytes a second, so the bytes a training step sends never
show in its time. Between machines they are the wall. To see it here, a bench re-runs
itself inside a network namespace of its own whose loopback is rate-limited: every
rank's gloo traffic on 127.0.0.1, and the local Prefect API server that `recforge run`
starts, then go through a link of the rate asked for.

How: `run_inside(rate, argv)` replaces this process with

    unshare -n -- sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate R
                         burst 256kb latency 50ms && exec "$@"' shaped-link R argv...

so `argv` runs in a fresh network namespace (no interface but its own loopback, so
nothing inside can reach any other address) whose loopback sends at most R bits a
second, with `LINK_ENV` set in its environment: `current_link()` tells the re-run
process it is already inside, and at what rate. `describe_link()` reads the qdisc back
(with its byte counters) so that a bench's output shows the shaping really was on.

Why tbf, not netem: netem (delay, loss, rate) is not built into every kernel (it is
missing on the build machine's), while tbf, the token-bucket filter, is in every
kernel that has traffic control. It shapes the rate only; its `latency 50ms` bounds
how long a packet may queue for tokens, it adds no delay of its own. The 256 KB burst
is above the loopback's 64 KiB MTU (tbf drops packets bigger than its burst) and small
enough that a link of 100 Mbit/s or more is held to its rate within a few milliseconds.

Needs root (a network namespace and a qdisc both need CAP_SYS_ADMIN / CAP_NET_ADMIN)
and `unshare` (util-linux), `ip` and `tc` (iproute2) on PATH; `missing_requirements()`
says which is missing, and `run_inside` refuses with that sentence (exit status 2).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, NoReturn

# Set, to the rate's text, in the environment of the process re-run inside the namespace.
LINK_ENV = "RECFORGE_SHAPED_LINK"

# tc's bit-rate units (SI: kbit = 1,000 bit). Its byte units (`bps`, `mbps`, ...) are
# refused, not converted: `100mbps` reads as 100 Mbit/s and is 800.
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"(\d+(?:\.\d+)?)(" + "|".join(_UNITS) + r")", re.IGNORECASE)

# tbf's bucket and queueing bound; see the module docstring.
_BURST = "256kb"
_LATENCY = "50ms"

# Run by `sh -c` inside the new namespace. The rate and the command come in as
# positional arguments ($1, then "$@"), never pasted into this text.
_SHELL_SCRIPT = f"""\
rate=$1; shift
ip link set lo up || {{
    echo "$0: could not bring up lo in the new network namespace" >&2
    exit 2
}}
tc qdisc add dev lo root tbf rate "$rate" burst {_BURST} latency {_LATENCY} || {{
    echo "$0: could not add a tbf qdisc of rate $rate to lo (is sch_tbf in this kernel?)" >&2
    exit 2
}}
exec "$@"
"""


def parse_rate(text: str) -> int:
    """A tc bit rate to bits per second.

    Args:
        text: A number and a bit unit, case-insensitive: "1gbit", "200mbit", "500kbit",
            "1000000bit", "1.5gbit".

    Returns:
        The rate in bits per second (> 0).

    Raises:
        ValueError: `text` is not such a rate, or it is zero.
    """
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"link rate {text!r}: give a positive number and a bit unit, e.g. 1gbit, "
            f"200mbit, 500kbit or 1000000bit (units: {', '.join(_UNITS)})"
        )
    bits = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if bits <= 0:
        raise ValueError(f"link rate {text!r} is zero: give a rate of at least 1bit")
    return bits


def current_link() -> int | None:
    """Bits per second of the shaped link this process runs inside; None outside one.

    Raises:
        ValueError: `LINK_ENV` is set but is not a rate (`parse_rate`).
    """
    text = os.environ.get(LINK_ENV)
    if text is None:
        return None
    try:
        return parse_rate(text)
    except ValueError as error:
        raise ValueError(f"{LINK_ENV}={text!r} in the environment: {error}") from None


def missing_requirements(subject: str = "a shaped link") -> list[str]:
    """Why a shaped link cannot be made here, one sentence each; empty when it can.

    Args:
        subject: What needs the link, as the sentences name it (a bench passes its flag,
            e.g. "--link").
    """
    missing = []
    if os.geteuid() != 0:
        missing.append(
            f"{subject} needs root to make a network namespace (unshare -n) and shape its "
            "loopback (tc): run as root"
        )
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"{subject} needs `{tool}` on PATH: install {package}")
    return missing


def shaped_command(rate: str, argv: list[str]) -> list[str]:
    """The command that runs `argv` inside a new network namespace shaped to `rate`.

    Raises:
        ValueError: `rate` is not a rate (`parse_rate`) or `argv` is empty.
    """
    bits = parse_rate(rate)
    if not argv:
        raise ValueError("run a command inside the shaped link: argv is empty")
    # tc is given the rate as parsed here, so that it cannot read the text otherwise.
    return ["unshare", "-n", "--", "sh", "-c", _SHELL_SCRIPT, "shaped-link", f"{bits}bit", *argv]


def run_inside(rate: str, argv: list[str], flag: str = "--link") -> NoReturn:
    """Replace this process with `argv` run inside a new network namespace shaped to `rate`.

    The environment carries `LINK_ENV` = `rate`, so that the re-run process knows it is
    inside (`current_link()`) and does not re-run itself again.

    Args:
        rate: A tc bit rate ("1gbit"; `parse_rate`).
        argv: The command to run inside, e.g. `[sys.executable, script, *args]`.
        flag: What asked for the link, as the refusal names it.

    Raises:
        ValueError: `rate` is not a rate, or `argv` is empty (before anything runs).
        SystemExit: With status 2, after one line on stderr, where a shaped link cannot be
            made here (`missing_requirements`).
    """
    command = shaped_command(rate, argv)
    missing = missing_requirements(flag)
    if missing:
        print("; ".join(missing) + f", or drop {flag}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, {**os.environ, LINK_ENV: rate.strip()})


def describe_link(device: str = "lo") -> dict[str, Any]:
    """What the qdisc of `device` says, with its counters: whether the shaping was on.

    Returns:
        `device`; `rate_bit_per_s` (`current_link()`); `qdisc`: `tc -j -s qdisc show dev
        DEVICE` parsed (a list of qdiscs: kind, options with `rate` in bytes per second,
        and the bytes, packets and drops sent through it so far), or its text where tc
        has no JSON output, or None without tc; `shaped`: whether a tbf qdisc is on it.
    """
    described: dict[str, Any] = {"device": device, "rate_bit_per_s": current_link()}
    if shutil.which("tc") is None:
        return {**described, "qdisc": None, "shaped": False}
    shown = subprocess.run(
        ["tc", "-j", "-s", "qdisc", "show", "dev", device], capture_output=True, text=True
    )
    qdisc: Any
    try:
        qdisc = json.loads(shown.stdout) if shown.returncode == 0 else None
    except json.JSONDecodeError:
        qdisc = None
    if isinstance(qdisc, list):
        shaped = any(entry.get("kind") == "tbf" for entry in qdisc)
    else:
        # An iproute2 without -j: keep what it prints.
        text = subprocess.run(
            ["tc", "-s", "qdisc", "show", "dev", device], capture_output=True, text=True
        )
        qdisc = (text.stdout or text.stderr).strip()
        shaped = re.search(r"\btbf\b", qdisc) is not None
    return {**described, "qdisc": qdisc, "shaped": shaped}
