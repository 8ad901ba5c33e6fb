"""A flow run's lease on its artifact root: what `recforge gc` must leave alone while it runs.

```
<root>/leases/<run_id>.json   {"run_id", "host", "pid", "started", "heartbeat", "fingerprints"}
```

A pipeline run writes its lease before its plan reads the store, names the stage
fingerprints of its plan once they are known, rewrites it every `HEARTBEAT_S` seconds
from a daemon thread (`heartbeat`: this machine's wall clock, seconds since the epoch)
and deletes it when it ends, however it ends. A lease is signed with the run key like
every record recforge writes to the root (`artifacts.signing`), bound to its place
(`place("lease", run_id)`): gc reads a lease found under another run's name as one that
does not verify.

`recforge gc` (`artifacts.gc`) counts a lease as live while its heartbeat, or its
object's modification time, is younger than its staleness limit (`STALE_AFTER_S`, three
beats, so a missed write or two does not free anything). While a lease is live, gc
deletes no stage output the lease names, none written after the run started, and none
at all before the run has named its fingerprints; and nothing else a flow writes
(checkpoints, exchanges, staging directories, failed outputs). A process killed with
SIGKILL leaves its lease behind: it goes stale after `STALE_AFTER_S`, and gc deletes it
once it is older than gc's age limit.

Why fingerprints and not locations: every place a run writes or reads under the root
is named by the fingerprint of a stage of its plan (an output, its data prefix, its
staging directory), except the train stage's resume checkpoints, whose key leaves the
layout out; those gc leaves alone while any lease is live.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from artifacts.durable import write_json
from artifacts.locations import backend_errors, remove, safe_join
from artifacts.signing import place, sign

LEASES = "leases"
# How often a run rewrites its lease.
HEARTBEAT_S = 30.0
# A lease whose heartbeat is older than this is stale: its run is gone (gc's default).
STALE_AFTER_S = 3 * HEARTBEAT_S

_logger = logging.getLogger(__name__)


def lease_location(root: str, run_id: str) -> str | Path:
    """Where the lease of `run_id` lives under the artifact root `root` (a URL or a path).

    Raises:
        UnsafeName: `run_id` is not a plain name.
    """
    return safe_join(root, f"{LEASES}/{run_id}.json", "a run id")


def lease_place(run_id: str) -> dict[str, str]:
    """The place a lease is signed for (`artifacts.signing.place`): a lease copied to
    another run's name is refused by gc, and counts only as a lease that does not verify."""
    return place("lease", run_id=run_id)


class RunLease:
    """One flow run's lease: written by `start`, refreshed by a daemon thread, deleted by
    `release`.

    Args:
        root: The artifact root (`ArtifactStore.url`).
        run_id: The run's id (the run record's directory name).
        interval_s: Seconds between heartbeats.
        log: Receives one line when a heartbeat or the release fails; default: this
            module's logger at WARNING.
    """

    def __init__(
        self,
        root: str,
        run_id: str,
        interval_s: float = HEARTBEAT_S,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.location = lease_location(root, run_id)
        self.run_id = run_id
        self.interval_s = interval_s
        self._log = log if log is not None else _logger.warning
        self._started: float | None = None
        self._fingerprints: list[str] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Write the lease (protecting every stage output until `name`), start beating.

        Raises:
            OSError: The lease cannot be written (the run must not go on unprotected).
        """
        self._started = time.time()
        self._write()
        self._thread = threading.Thread(target=self._beat, name="recforge-lease", daemon=True)
        self._thread.start()

    def name(self, fingerprints: Iterable[str]) -> None:
        """Name the stage fingerprints the run uses (its plan's), and write the lease now.

        Raises:
            OSError: The lease cannot be written.
        """
        with self._lock:
            self._fingerprints = sorted(set(fingerprints))
        self._write()

    def release(self) -> None:
        """Stop beating and delete the lease; a failure is logged, never raised (a lease
        left behind goes stale on its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
        with self._lock:
            started, self._started = self._started, None
            if started is None:
                return
            try:
                remove([self.location])
            except (*backend_errors(), OSError) as err:
                self._log(f"could not delete the lease {self.location} ({err}); it goes stale")

    def record(self) -> dict[str, Any]:
        """The lease as written now (without its signature)."""
        return {
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self._started,
            "heartbeat": time.time(),
            # None until the plan is known: gc then keeps every stage output.
            "fingerprints": self._fingerprints,
        }

    def _write(self) -> None:
        with self._lock:
            if self._started is None:  # released: a late heartbeat must not bring it back
                return
            write_json(self.location, sign(self.record(), place=lease_place(self.run_id)))

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except (*backend_errors(), OSError) as err:
                self._log(f"lease heartbeat of run {self.run_id} failed ({err}); trying again")

    def __enter__(self) -> RunLease:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
