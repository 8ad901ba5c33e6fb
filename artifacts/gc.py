"""Garbage collection of an artifact root: delete what no kept run, model or running flow needs.

Reads: the whole root's listing (one walk locally, one recursive listing remotely), the
run records, the registry's version names, CHAMPION, each version's package manifest
and `lineage.json`, the `latest/` pointers and records, the leases of running flows
(`artifacts.lease`) and, for each kept remote output, its manifest. Deletes (unless dry
run), by category, in this order:

- run records, `runs/<id>/`: those not among the newest `keep_runs` (by run id, which
  starts with the run's start time) and older than the age limit;
- stage outputs, `stages/<stage>/<fp>/`: those nothing below keeps;
- data prefixes, `stages/<stage>/<fp>/data-<id>/` of a kept object-store output that
  its manifest does not name (a killed upload, a replaced output);
- checkpoints, `checkpoints/train/<key>/` and `nodes/train/<key>/` (resume state;
  the key leaves the layout out, so nothing a record names finds them);
- exchanges, `checkpoints/train/<key>/exchange/<attempt>/` (STOP objects, specs,
  outcomes, heartbeats, node 0's output);
- staging: `.staging-*` and `.trash-*` leftovers under `stages/<stage>/` and
  `registry/<model>/`, a checkpoint's `.staging/<step>`, and gc's own `.gc-*` (always);
- failed outputs, `failed/<stage>/<fp>-<time>/`;
- leases, `leases/<run_id>.json`: stale ones.

Each of them only once its newest file is older than the age limit, and, but for
run records and stale leases, only while no live lease keeps it.

What is kept (the roots):

- the newest `keep_runs` run records that verify, and every run record younger than the
  age limit; each keeps the stage outputs its `stages.*.fingerprint` name;
- every registry version (never deleted) and CHAMPION's version and `previous`: each
  keeps the export output it was published from (`stages/export/<fp>`, the version
  being `fp[:12]`), so that the export stage stays a cache hit and a rerun never
  republishes (replaces) a registered package;
- the stage outputs each registry version's `lineage.json` names (its train output
  above all: the next warm start from that version loads it), however many runs
  came since;
- the output each `latest/<pipeline>/<stage>.json` pointer names (the baseline the next
  run's drift check reads), and the fingerprints other `latest/` records hold (the
  last plan of each pipeline);
- nothing younger than the age limit, whatever it is ("older than" means: its newest
  file was last written longer ago than the limit);
- while a lease is live (`artifacts.lease`): no stage output the lease names or that was
  written after its run started, no stage output at all before the run named its plan's
  fingerprints, and nothing of the other categories but run records and stale leases.
  Before each deletion the leases are listed again, so a run that starts meanwhile is
  seen before gc deletes one more thing.

The bucket is not trusted (docs/security.md), so whatever gc reads back from it can only
make it keep more, never delete more:

- the keep set comes from records that verify for their place (`artifacts.signing`):
  a run record for ``place("run-record", run_id)``, a pointer for ``place("latest",
  pipeline, name)``, CHAMPION for ``place("champion", model)``, a package manifest for
  ``place("package", model, version)`` (and `lineage.json` against its sha256 there), a
  lease for ``place("lease", run_id)``; a record copied from elsewhere is refused;
- a record that does not verify (unsigned, forged, copied from another place, written
  before records were bound, too large, or one that does not parse) keeps every output
  it could have named, of any age (a run names the cache hits an older run wrote): a run
  record, a package or a plan every stage output, a `<stage>.json` pointer every output
  of its stage, CHAMPION every export output. The run record itself is not deleted and
  does not count among the newest. A lease that does not verify counts as live while its
  object is fresh and then keeps every stage output (as a wrong or missing run key would
  otherwise make every real lease look forged). Each is logged once and named in the
  report's notes, with what it made gc keep;
- a data prefix is deleted only when the manifest beside it verifies for that very
  output (``place("stage-output", stage, fp)``): a manifest copied from another output
  names that output's prefix, and would make this output's own look like garbage;
- every read has a size cap (`_POINTER_BYTES`, `_RECORD_BYTES`, a manifest
  `locations.MAX_RECORD_BYTES`): an object planted too large, not UTF-8, or nested or
  numbered to break the parser is a record that does not verify, never a crash;
- names read back (record fingerprints, versions, pointer targets, lease fingerprints)
  are only compared with names gc listed itself; they are never joined into a location;
- every deletion is a name from gc's own listing, through `safe_join` under the root
  (a symlink out of a local root is refused).

With a run key, records signed before they were bound to their place (recforge before
issue 38) do not verify either, so on such a root gc keeps more until they are replaced
or removed, and its notes name each one: a past run's record (delete `runs/<id>/` by
hand once it is not needed), a package (export it again: `recforge run CONFIG --force
export`), a pointer or plan (the pipeline's next run writes it again), CHAMPION (promote
again).

Nothing read back is unpickled; records are JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from artifacts.errors import ConfigError, InputNotFoundError
from artifacts.fingerprint import FINGERPRINT
from artifacts.lease import LEASES, STALE_AFTER_S, lease_place
from artifacts.locations import (
    UnsafeName,
    backend_errors,
    check_name,
    filesystem,
    join,
    read_text_or_none,
    safe_join,
)
from artifacts.registry import CHAMPION, DECISIONS
from artifacts.signing import SignatureError, place, read_verified
from artifacts.store import MANIFEST, STAGES, ArtifactStore

# In the order gc reports and deletes them.
CATEGORIES = (
    "run records",
    "stage outputs",
    "data prefixes",
    "checkpoints",
    "exchanges",
    "staging",
    "failed outputs",
    "leases",
)
# Categories a live lease keeps whole (a running flow may write or read any of them).
_LEASED = frozenset(CATEGORIES) - {"run records", "stage outputs", "leases"}
# Where gc looks under a root; anything else is left alone.
_TOPS = ("runs", "stages", "checkpoints", "nodes", "failed", "leases", "latest", "registry")
_STAGING = (".staging-", ".trash-")
# What gc renames a directory to before deleting it (readers see it gone at once).
_TOMB = ".gc-"
_KEY = re.compile(r"[0-9a-f]{16,64}")
# Size caps of what gc reads back (a manifest gets `locations.MAX_RECORD_BYTES`): a
# `latest/<pipeline>/<stage>.json` pointer, a lease or CHAMPION is a few lines; a run
# record, other `latest/` JSON (the plan's) and a package's lineage.json are larger.
_POINTER_BYTES = 64 << 10
_RECORD_BYTES = 8 << 20
# The package file that names the stage outputs a registry version was made from
# (`tasks.incremental.LINEAGE`; `artifacts` imports no task module).
_LINEAGE = "lineage.json"
# The report holds at most this many notes about records that do not verify (each is
# logged; a bucket full of planted records must not make the report unbounded).
_MAX_NOTES = 100
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

_logger = logging.getLogger(__name__)
# Records and leases found not to verify, each logged once per process.
_noted: set[str] = set()


def parse_duration(text: str, what: str) -> float:
    """Seconds in a duration like ``30s``, ``30m``, ``12h``, ``7d`` or ``2w`` (or ``0``).

    Args:
        text: The duration as typed.
        what: What it is, for the message (the flag: ``--older-than``).

    Raises:
        ConfigError: Naming `what` and the value.
    """
    value = str(text).strip().lower()
    if value == "0":
        return 0.0
    match = _DURATION.fullmatch(value)
    if match is None:
        raise ConfigError(
            f"{what} {text!r} is not a duration; write a number and a unit: 30s, 30m, 12h, 7d or 2w"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Freed:
    """One thing gc deleted (or would delete, in a dry run)."""

    category: str
    location: str  # relative to the root: stages/ingest/<fp>
    bytes: int


@dataclass
class GcReport:
    """What one gc pass freed and kept.

    Attributes:
        root: The artifact root.
        dry_run: Nothing was deleted; `freed` is what would have been.
        freed: Each thing deleted, in `CATEGORIES` order.
        kept: Why things were kept: reason -> how many.
        notes: What gc refused or could not delete, one line each.
    """

    root: str
    dry_run: bool
    freed: list[Freed] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, tuple[int, int]]:
        """category -> (items, bytes), every category."""
        totals = dict.fromkeys(CATEGORIES, (0, 0))
        for item in self.freed:
            items, size = totals[item.category]
            totals[item.category] = (items + 1, size + item.bytes)
        return totals

    @property
    def total_bytes(self) -> int:
        return sum(item.bytes for item in self.freed)

    def lines(self) -> list[str]:
        """The report a person reads: each item, what was kept, the sums, the total."""
        verb = "would free" if self.dry_run else "freed"
        head = f"recforge gc {self.root}" + (": dry run, nothing deleted" if self.dry_run else "")
        lines = [head]
        lines += [f"{verb} {item.location} ({item.bytes:,} bytes)" for item in self.freed]
        lines += [f"kept: {count} {reason}" for reason, count in self.kept.items() if count]
        lines += [f"note: {note}" for note in self.notes]
        width = max(len(c) for c in CATEGORIES)
        for category, (items, size) in self.totals().items():
            lines.append(f"{category:<{width}}  {items:>6} items  {size:>16,} bytes")
        lines.append(
            f"{'total':<{width}}  {len(self.freed):>6} items  {self.total_bytes:>16,} bytes"
        )
        return lines


@dataclass
class _Unit:
    """Something gc may delete whole: a prefix under the root and the files in it."""

    category: str
    location: str  # relative to the root
    key: str = ""  # a stage output's fingerprint, a checkpoint's key
    files: dict[str, tuple[int, float]] = field(default_factory=dict)  # rel -> (bytes, mtime)
    tomb: bool = False  # gc's own leftover: always deleted

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    @property
    def newest(self) -> float:
        return max((mtime for _, mtime in self.files.values()), default=math.inf)


@dataclass(frozen=True)
class _Lease:
    """A lease as gc reads it."""

    location: str
    live: bool
    started: float  # -inf when unknown (it then keeps everything anyway)
    fingerprints: frozenset[str] | None  # None: keeps every stage output
    verified: bool = True


def collect_garbage(
    root: str | Path,
    keep_runs: int,
    older_than_s: float,
    dry_run: bool = False,
    stale_after_s: float = STALE_AFTER_S,
    now: float | None = None,
) -> GcReport:
    """Delete what no kept run record, registry version or live lease needs (module doc).

    Args:
        root: The artifact root: a directory or an fsspec URL.
        keep_runs: How many of the newest run records to keep, >= 0 (and every run record
            younger than `older_than_s`).
        older_than_s: The age limit: nothing last written more recently is deleted.
        dry_run: Report what would be freed, delete nothing.
        stale_after_s: A lease whose heartbeat is older than this is stale (its run is
            gone); clocks must agree to within this.
        now: The time to measure ages against (tests); default: now.

    Returns:
        What was freed, per item, and why things were kept.

    Raises:
        ConfigError: A negative count or duration; a remote root without a signing key.
        InputNotFoundError: A local root that does not exist.
    """
    if keep_runs < 0 or older_than_s < 0 or stale_after_s < 0:
        raise ConfigError(
            f"gc: keep_runs={keep_runs}, older_than_s={older_than_s} and "
            f"stale_after_s={stale_after_s} must be >= 0"
        )
    store = ArtifactStore(root)
    store.require_key()
    if not store.remote and not Path(store.url).is_dir():
        raise InputNotFoundError(f"gc: there is no artifact root at {store.url}; check the path")
    collector = _Collector(store, older_than_s, stale_after_s, time.time() if now is None else now)
    return collector.run(keep_runs, dry_run)


class _Collector:
    def __init__(self, store: ArtifactStore, older_than_s: float, stale_after_s: float, now: float):
        self.store = store
        self.older_than_s = older_than_s
        self.stale_after_s = stale_after_s
        self.now = now
        self.report = GcReport(root=store.url, dry_run=False)
        self.leases: list[_Lease] = []
        self._lease_listing: dict[str, float] = {}
        # What the kept run records name.
        self.record_fingerprints: set[str] = set()
        # What the lineage of registry versions names (`_read_registry`).
        self.lineage_fingerprints: set[str] = set()
        # What verified `latest/` records name.
        self.pointed: set[str] = set()
        # Stages every output of which is kept: a record that could have named any of
        # them does not verify (a run record, a pointer, a package, CHAMPION).
        self.keep_stages: set[str] = set()
        # The records this report has named as unverifiable, and how many more it left
        # out (over `_MAX_NOTES`).
        self._told: set[str] = set()
        self._untold = 0

    def run(self, keep_runs: int, dry_run: bool) -> GcReport:
        self.report.dry_run = dry_run
        index = self._list()
        units = _units(index, self.store.remote)
        self._lease_listing = {k: m for k, (_, m) in index.items() if k.startswith(LEASES + "/")}
        self.leases = self._read_leases(self._lease_listing)
        self._count("live leases of running flows", sum(x.live for x in self.leases))
        self._count(
            "leases that do not verify (kept; while fresh they keep more)",
            sum(not x.verified for x in self.leases),
        )
        doomed = self._doomed_records(units, keep_runs)
        versions = self._read_registry(index)
        self._read_latest(index)
        doomed += self._doomed_outputs(units, versions)
        doomed += self._doomed_rest(units)
        doomed.sort(key=lambda unit: (CATEGORIES.index(unit.category), unit.location))
        if self._untold:
            self.report.notes.append(
                f"... and {self._untold} more records that do not verify (each is logged by "
                "the artifacts.gc logger)"
            )
        for unit in doomed:
            if dry_run or self._delete(unit):
                self.report.freed.append(Freed(unit.category, unit.location, unit.bytes))
        return self.report

    # -- reading the root ------------------------------------------------------------------

    def _list(self) -> dict[str, tuple[int, float]]:
        """Every file (and, locally, directory) under the root's own prefixes: rel -> (bytes,
        mtime). Local: a walk that follows no symlink below a top directory."""
        found: dict[str, tuple[int, float]] = {}
        if self.store.remote:
            fs, path = filesystem(self.store.url)
            fs.invalidate_cache(path)
            prefix = path.rstrip("/") + "/"
            listing = fs.find(path, detail=True) if fs.exists(path) else {}
            for name, info in listing.items():
                rel = name.removeprefix(prefix).rstrip("/")
                if name.startswith(prefix) and rel.split("/", 1)[0] in _TOPS:
                    found[rel] = (int(info.get("size") or 0), _mtime(info))
            return found
        root = Path(self.store.url)
        for top in _TOPS:
            for directory, dirnames, filenames in os.walk(root / top):
                for names, is_dir in ((dirnames, True), (filenames, False)):
                    for name in names:
                        path = Path(directory, name)
                        try:
                            stat = path.lstat()
                        except FileNotFoundError:
                            continue  # deleted meanwhile
                        size = 0 if is_dir else stat.st_size
                        found[path.relative_to(root).as_posix()] = (size, stat.st_mtime)
        return found

    def _where(self, rel: str) -> str | Path:
        """The location of a listed name, through `safe_join` (a symlink out of a local
        root is refused).

        Raises:
            SignatureError: The name is unsafe: whatever it holds cannot be trusted.
        """
        try:
            return safe_join(self.store.url, rel, f"a record listed under {self.store.url}")
        except UnsafeName as err:
            raise SignatureError(str(err)) from err

    def _read_record(
        self, rel: str, bound: dict[str, str], limit: int | None = None
    ) -> dict[str, Any] | None:
        """A listed record, read up to `limit` bytes, parsed and verified for its place
        `bound` (`signing.read_verified`); None when it is gone.

        Raises:
            SignatureError: It does not verify, is bound to another place or to none,
                is too large, does not parse, cannot be read, or its name is unsafe.
        """
        location = self._where(rel)
        try:
            return read_verified(location, place=bound, limit=limit)
        except (*backend_errors(), OSError) as err:
            # A directory planted where a record belongs, a permission, a lost read.
            raise SignatureError(f"{location} cannot be read ({type(err).__name__})") from err

    def _old(self, mtime: float) -> bool:
        return self.now - mtime >= self.older_than_s

    def _note_once(self, key: str, message: str) -> None:
        key = f"{self.store.url}|{key}"
        if key not in _noted:
            _noted.add(key)
            _logger.warning("gc: %s", message)

    def _unverifiable(self, key: str, message: str) -> None:
        """Say that a record does not verify and what gc keeps for it: logged once per
        process, and in the report (up to `_MAX_NOTES` of them)."""
        self._note_once(key, message)
        if key in self._told:  # read again (the leases, before a deletion)
            return
        self._told.add(key)
        if len(self.report.notes) < _MAX_NOTES:
            self.report.notes.append(message)
        else:
            self._untold += 1

    def _count(self, reason: str, count: int = 1) -> None:
        self.report.kept[reason] = self.report.kept.get(reason, 0) + count

    # -- leases ----------------------------------------------------------------------------

    def _read_leases(self, listing: dict[str, float]) -> list[_Lease]:
        leases = []
        for rel, mtime in sorted(listing.items()):
            if rel.count("/") == 1 and rel.endswith(".json"):
                lease = self._read_lease(rel, mtime)
                if lease is not None:
                    leases.append(lease)
        return leases

    def _read_lease(self, rel: str, mtime: float) -> _Lease | None:
        fresh = self.now - mtime <= self.stale_after_s
        run_id = rel.split("/", 1)[1].removesuffix(".json")
        try:
            record = self._read_record(rel, lease_place(run_id), _POINTER_BYTES)
            if record is None:
                return None  # released meanwhile
            if record.get("run_id") != run_id:
                raise SignatureError(f"it is the lease of run {str(record.get('run_id'))[:80]!r}")
            started, heartbeat = _seconds(record.get("started")), _seconds(record.get("heartbeat"))
            names = record.get("fingerprints")
            if names is not None and not (
                isinstance(names, list) and all(isinstance(n, str) for n in names)
            ):
                raise SignatureError("its fingerprints are not names")
        except SignatureError as err:
            self._unverifiable(
                f"lease:{rel}",
                f"the lease {rel} does not verify ({err}); while it is fresh gc keeps every "
                "stage output and everything a flow writes",
            )
            return _Lease(rel, fresh, -math.inf, None, verified=False)
        live = self.now - max(heartbeat, mtime) <= self.stale_after_s
        fingerprints = None if names is None else frozenset(names)
        return _Lease(rel, live, started, fingerprints)

    def _refresh_leases(self) -> None:
        """List the leases again; read them again when that changed (a run started)."""
        listing: dict[str, float] = {}
        if self.store.remote:
            fs, path = filesystem(str(join(self.store.url, LEASES)))
            fs.invalidate_cache(path)
            if fs.exists(path):
                for name, info in fs.find(path, detail=True).items():
                    listing[f"{LEASES}/{name.rstrip('/').rsplit('/', 1)[-1]}"] = _mtime(info)
        else:
            directory = Path(self.store.url, LEASES)
            if directory.is_dir():
                for entry in os.scandir(directory):
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    listing[f"{LEASES}/{entry.name}"] = stat.st_mtime
        if listing != self._lease_listing:
            self._lease_listing = listing
            self.leases = self._read_leases(listing)

    def _live_lease_at(self, location: str) -> bool:
        """Whether `leases/<run_id>.json`, or the lease a file `leases/<run_id>.tmp-*` is
        being written for, is live."""
        run_id = location.split("/", 1)[-1].split(".", 1)[0]
        return any(x.live and x.location == f"{LEASES}/{run_id}.json" for x in self.leases)

    def _lease_keeps(self, unit: _Unit) -> bool:
        """Whether a live lease keeps `unit` (see the module doc)."""
        if unit.tomb or unit.category in ("run records", "leases"):
            return False
        live = [lease for lease in self.leases if lease.live]
        if unit.category != "stage outputs":
            return bool(live)
        for lease in live:
            if lease.fingerprints is None or unit.key in lease.fingerprints:
                return True
            if unit.newest >= lease.started - self.stale_after_s:  # written by the run
                return True
        return False

    # -- what is kept, what goes -------------------------------------------------------------

    def _doomed_records(self, units: dict[str, _Unit], keep_runs: int) -> list[_Unit]:
        """Run records beyond the newest `keep_runs` and older than the limit; fills
        `self.record_fingerprints` with what the kept ones name.

        A record that does not verify for its place (`place("run-record", run_id)`) is
        kept, does not count among the newest, and keeps every stage output: it may
        have named any of them (a cache hit names an output an older run wrote)."""
        verified: list[tuple[str, _Unit, set[str]]] = []
        for unit in units.values():
            summary = f"{unit.location}/summary.json"
            if unit.category != "run records" or summary not in unit.files:
                continue
            run_id = unit.location.split("/", 1)[1]
            try:
                record = self._read_record(
                    summary, place("run-record", run_id=run_id), _RECORD_BYTES
                )
                if record is None:
                    continue  # deleted meanwhile
                names = _record_names(record, summary, run_id)
            except SignatureError as err:
                self._unverifiable(
                    f"record:{summary}",
                    f"the run record {summary} does not verify ({err}); gc keeps it, and "
                    "keeps every stage output (it may have named any). If it is not a record "
                    f"of yours, delete {unit.location} by hand",
                )
                self._count("run records that do not verify (kept; they keep every stage output)")
                self.keep_stages.update(STAGES)
                continue
            verified.append((run_id, unit, names))
        verified.sort(key=lambda item: item[0], reverse=True)
        doomed = []
        for rank, (_, unit, names) in enumerate(verified):
            if rank < keep_runs:
                self._count(f"run records (the newest {keep_runs})")
            elif not self._old(unit.files[f"{unit.location}/summary.json"][1]):
                self._count("run records younger than the age limit")
            else:
                doomed.append(unit)
                continue
            self.record_fingerprints |= names
        return doomed

    def _read_registry(self, index: dict[str, tuple[int, float]]) -> set[str]:
        """The registry's version names (each keeps its export output), CHAMPION's
        `version` and `previous`; fills `self.lineage_fingerprints` with the stage outputs
        each version's verified lineage names."""
        versions: set[str] = set()
        for rel in sorted(index):
            parts = rel.split("/")
            if parts[0] != "registry" or len(parts) < 3:
                continue
            model, name = parts[1], parts[2]
            if len(parts) == 3 and name == CHAMPION:
                versions |= self._champion_names(rel, model)
            elif name.startswith(".") or name == DECISIONS or len(parts) < 4:
                continue
            else:
                versions.add(name)
                if len(parts) == 4 and parts[3] == MANIFEST:
                    self._read_lineage(rel, model, name)
        return versions

    def _champion_names(self, rel: str, model: str) -> set[str]:
        """CHAMPION's `version` and `previous`, when it verifies for its place; when it does
        not, every export output is kept (it may have named any version)."""
        try:
            record = self._read_record(rel, place("champion", model=model), _POINTER_BYTES)
        except SignatureError as err:
            self._unverifiable(
                f"champion:{rel}",
                f"{rel} does not verify ({err}); gc keeps every export output (it may have "
                "named any version)",
            )
            self.keep_stages.add("export")
            return set()
        if record is None:
            return set()
        return {v for v in (record.get("version"), record.get("previous")) if isinstance(v, str)}

    def _read_lineage(self, manifest_rel: str, model: str, version: str) -> None:
        """Keep the stage outputs the lineage of one registry version names.

        The package manifest must verify for ``place("package", model, version)``, and
        `lineage.json` must match its sha256 there; otherwise every stage output
        is kept (the lineage may have named any). A package without a lineage (exported
        before incremental training) names nothing."""
        base = manifest_rel.rsplit("/", 1)[0]
        try:
            manifest = self._read_record(
                manifest_rel, place("package", model=model, version=version)
            )
            if manifest is None:
                return  # deleted meanwhile
            files = manifest.get("files")
            if not isinstance(files, dict):
                raise SignatureError(f"{manifest_rel} lists no files")
            entry = files.get(_LINEAGE)
            if entry is None:
                return
            data = f"{_data_prefix(manifest, manifest_rel)}/" if self.store.remote else ""
            rel = f"{base}/{data}{_LINEAGE}"
            lineage = _lineage(self._where(rel), rel, entry)
        except SignatureError as err:
            self._unverifiable(
                f"package:{manifest_rel}",
                f"the package of {model} {version} does not verify ({err}); gc keeps every "
                "stage output (its lineage may have named any)",
            )
            self.keep_stages.update(STAGES)
            return
        self.lineage_fingerprints |= {
            lineage[stage]
            for stage in STAGES
            if isinstance(lineage.get(stage), str) and FINGERPRINT.fullmatch(lineage[stage])
        }

    def _read_latest(self, index: dict[str, tuple[int, float]]) -> None:
        """Keep what each `latest/<pipeline>/<name>.json` names: a stage pointer's output
        (the baseline the next run's drift check reads), the plan's fingerprints. One that
        does not verify for its place keeps every output of its stage (a pointer) or
        every stage output (any other record)."""
        for rel in sorted(index):
            parts = rel.split("/")
            if parts[0] != "latest" or len(parts) != 3 or not parts[2].endswith(".json"):
                continue  # a pipeline's directory, a write's temporary file
            pipeline, name = parts[1], parts[2]
            stage = name.removesuffix(".json")
            pointer = stage in STAGES
            try:
                record = self._read_record(
                    rel,
                    place("latest", pipeline=pipeline, name=name),
                    _POINTER_BYTES if pointer else _RECORD_BYTES,
                )
                if record is None:
                    continue
                if pointer:
                    output = str(record.get("output", "")).rstrip("/").rsplit("/", 2)
                    if output[-2:-1] != [stage] or not FINGERPRINT.fullmatch(output[-1]):
                        raise SignatureError(f"{rel} names no {stage} output")
                    self.pointed.add(output[-1])
                else:
                    self.pointed |= _fingerprints(record)
            except SignatureError as err:
                what = f"every {stage} output" if pointer else "every stage output"
                self._unverifiable(
                    f"latest:{rel}",
                    f"{rel} does not verify ({err}); gc keeps {what} (it may have named any)",
                )
                self.keep_stages.update([stage] if pointer else STAGES)

    def _doomed_outputs(self, units: dict[str, _Unit], versions: set[str]) -> list[_Unit]:
        doomed = []
        for unit in units.values():
            if unit.category != "stage outputs":
                continue
            stage = unit.location.split("/")[1]
            if unit.key in self.record_fingerprints:
                self._count("stage outputs the kept run records name")
            elif stage == "export" and unit.key[:12] in versions:
                self._count("export outputs of registry versions")
            elif unit.key in self.lineage_fingerprints:
                self._count("stage outputs the lineage of registry versions names")
            elif unit.key in self.pointed:
                self._count("stage outputs latest/ records name")
            elif not self._old(unit.newest):
                self._count("stage outputs younger than the age limit")
            elif stage in self.keep_stages:
                self._count("stage outputs kept because a record does not verify")
            elif self._lease_keeps(unit):
                self._count("stage outputs a live lease keeps")
            else:
                doomed.append(unit)
                continue
            if self.store.remote:
                doomed += self._doomed_data_prefixes(unit)
        return doomed

    def _doomed_data_prefixes(self, unit: _Unit) -> list[_Unit]:
        """The data prefixes of a kept remote output that its manifest does not name.

        Only a manifest bound to this very output (``place("stage-output", stage, fp)``)
        says which prefix is live: one copied here from another output names that
        output's prefix, and would make this one's own look like garbage."""
        prefixes = _subunits(unit, "data prefixes", lambda part: part.startswith("data-"))
        rel = f"{unit.location}/{MANIFEST}"
        if not prefixes or rel not in unit.files:
            return []  # unpublished: which prefix is live is unknown
        stage = unit.location.split("/")[1]
        try:
            manifest = self._read_record(
                rel, place("stage-output", stage=stage, fingerprint=unit.key)
            )
            if manifest is None:
                return []
            current = f"{unit.location}/{_data_prefix(manifest, rel)}"
        except SignatureError as err:
            self._unverifiable(
                f"manifest:{rel}",
                f"{err}; gc keeps every data prefix of {unit.location}",
            )
            self._count(
                "data prefixes kept because their output's manifest does not verify", len(prefixes)
            )
            return []
        return [p for p in prefixes if p.location != current and self._goes(p)]

    def _doomed_rest(self, units: dict[str, _Unit]) -> list[_Unit]:
        """Checkpoints, exchanges, staging, failed outputs and stale leases."""
        doomed = []
        for unit in units.values():
            if unit.category in ("run records", "stage outputs"):
                continue
            if unit.category == "leases":
                if not self._live_lease_at(unit.location) and self._old(unit.newest):
                    doomed.append(unit)
            elif self._goes(unit):
                doomed.append(unit)
            elif unit.category == "checkpoints":
                inside = ("exchange", ".staging").__contains__
                doomed += [sub for sub in _subunits(unit, "", inside) if self._goes(sub)]
        return doomed

    def _goes(self, unit: _Unit) -> bool:
        """Whether a unit of the age-limited categories goes (counting why it stays)."""
        if unit.tomb:
            return True
        if not self._old(unit.newest):
            return False
        if self._lease_keeps(unit):
            self._count(f"{unit.category} a live lease keeps")
            return False
        return True

    # -- deleting -------------------------------------------------------------------------

    def _delete(self, unit: _Unit) -> bool:
        """Delete one unit, after looking at the leases again; whether it went."""
        if unit.category in _LEASED or unit.category in ("stage outputs", "leases"):
            self._refresh_leases()
            if self._lease_keeps(unit) or self._live_lease_at(unit.location):
                self._count(f"{unit.category} a flow started using meanwhile")
                return False
        try:
            # The guard: a name from gc's own listing, proven to stay under the root.
            location = safe_join(self.store.url, unit.location, f"gc: {unit.location}")
            if self.store.remote:
                self._remove_objects(unit, str(location))
            else:
                _remove_local(Path(location))
        except UnsafeName as err:
            self.report.notes.append(f"refused {unit.location}: {err}")
            _logger.warning("gc: %s", err)
            return False
        except (*backend_errors(), OSError) as err:
            self.report.notes.append(f"could not delete {unit.location}: {err}")
            return False
        return True

    def _remove_objects(self, unit: _Unit, location: str) -> None:
        """Delete a unit's listed objects, every manifest first (the commit points: a
        reader then sees no output, never half of one)."""
        fs, path = filesystem(location)
        base = path[: len(path) - len(unit.location)].rstrip("/")
        keys = []
        for rel in sorted(unit.files, key=lambda r: (r.rsplit("/", 1)[-1] != MANIFEST, r)):
            try:
                check_name(rel, f"an object listed under {self.store.url}")
            except UnsafeName as err:
                self.report.notes.append(f"left {rel}: {err}")
                continue
            keys.append(f"{base}/{rel}")
        manifests = [k for k in keys if k.rsplit("/", 1)[-1] == MANIFEST]
        for batch in (manifests, keys[len(manifests) :]):
            if batch:
                fs.rm(batch)
        fs.invalidate_cache(path)


def _remove_local(path: Path) -> None:
    """Rename a directory aside (readers see it gone at once), then delete it; a file or a
    symlink is unlinked (never followed)."""
    if path.is_dir() and not path.is_symlink():
        tomb = path.parent / f"{_TOMB}{path.name[:16]}-{uuid.uuid4().hex[:8]}"
        os.replace(path, tomb)
        shutil.rmtree(tomb)
    else:
        path.unlink(missing_ok=True)


def _units(index: dict[str, tuple[int, float]], remote: bool) -> dict[str, _Unit]:
    """The listing grouped into units (location -> unit); names gc does not know are left
    out, so gc never touches them."""
    units: dict[str, _Unit] = {}
    for rel, entry in index.items():
        found = _classify(rel.split("/"), remote)
        if found is None:
            continue
        category, location, key, tomb = found
        unit = units.setdefault(location, _Unit(category, location, key, tomb=tomb))
        unit.files[rel] = entry
    return units


def _classify(parts: list[str], remote: bool) -> tuple[str, str, str, bool] | None:
    """(category, unit location, key, tomb) of a listed name, or None when gc leaves it."""
    top, size = parts[0], len(parts)
    if top == "latest":
        return None
    # gc's own tombs sit beside the units it renamed (`_remove_local`).
    for depth in {"runs": (1,), LEASES: (1,), "checkpoints": (2, 4)}.get(top, (2,)):
        if size > depth and parts[depth].startswith(_TOMB):
            return "staging", "/".join(parts[: depth + 1]), "", True
    if top == "runs" and size >= 2:
        return "run records", "/".join(parts[:2]), "", False
    if top == LEASES and size == 2:
        return "leases", "/".join(parts), "", False
    if top == "stages" and size >= 3 and parts[1] in STAGES:
        if parts[2].startswith(_STAGING):
            return "staging", "/".join(parts[:3]), "", False
        if FINGERPRINT.fullmatch(parts[2]):
            return "stage outputs", "/".join(parts[:3]), parts[2], False
        return None
    if top in ("checkpoints", "nodes") and size >= 3 and parts[1] == "train":
        if _KEY.fullmatch(parts[2]):
            return "checkpoints", "/".join(parts[:3]), parts[2], False
        return None
    if top == "failed" and size >= 3 and parts[1] in STAGES:
        return "failed outputs", "/".join(parts[:3]), "", False
    if top == "registry" and size >= 3 and parts[2].startswith(_STAGING):
        return "staging", "/".join(parts[:3]), "", False
    return None


def _subunits(unit: _Unit, category: str, picks: Callable[[str], bool]) -> list[_Unit]:
    """The prefixes one level below `unit` (two for a named folder such as `exchange/`)
    whose first part `picks` accepts, as units of `category` (default: by that folder)."""
    depth = unit.location.count("/") + 1
    subs: dict[str, _Unit] = {}
    for rel, entry in unit.files.items():
        parts = rel.split("/")
        if len(parts) <= depth or not picks(parts[depth]):
            continue
        if category:  # a data prefix: data-<id>/...
            if len(parts) < depth + 2:
                continue
            location, kind = "/".join(parts[: depth + 1]), category
        else:  # exchange/<attempt>, .staging/<step>
            if len(parts) < depth + 2:
                continue
            location = "/".join(parts[: depth + 2])
            kind = "exchanges" if parts[depth] == "exchange" else "staging"
        subs.setdefault(location, _Unit(kind, location, unit.key)).files[rel] = entry
    return list(subs.values())


def _record_names(record: dict[str, Any], where: str, run_id: str) -> set[str]:
    """The fingerprints a verified run record's `stages` name.

    Raises:
        SignatureError: It is the record of another run, or has no stages.
    """
    if record.get("run_id") != run_id:
        raise SignatureError(f"{where} is the record of run {str(record.get('run_id'))[:80]!r}")
    stages = record.get("stages")
    if not isinstance(stages, dict):
        raise SignatureError(f"{where} has no stages")
    return {
        info["fingerprint"]
        for info in stages.values()
        if isinstance(info, dict) and isinstance(info.get("fingerprint"), str)
    }


def _fingerprints(record: Any) -> set[str]:
    """Every fingerprint a verified record holds: a string that is one, or a location
    that ends in one (``.../stages/<stage>/<fp>``)."""
    found: set[str] = set()
    stack = [record]
    while stack:  # not recursive: a record may be nested as deep as the parser allowed
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            last = value.rstrip("/").rsplit("/", 1)[-1]
            if FINGERPRINT.fullmatch(last):
                found.add(last)
    return found


def _data_prefix(manifest: dict[str, Any], where: str) -> str:
    """The data prefix a verified remote manifest names: one plain ``data-*`` name.

    Raises:
        SignatureError: It names none, or a name that is not one plain segment.
    """
    data = manifest.get("data")
    if not isinstance(data, str) or not data.startswith("data-") or "/" in data:
        raise SignatureError(f"{where} names no data prefix ({str(data)[:80]!r})")
    try:
        check_name(data, f"the data prefix in {where}")
    except UnsafeName as err:
        raise SignatureError(str(err)) from err
    return data


def _lineage(location: str | Path, where: str, entry: Any) -> dict[str, Any]:
    """A package's lineage.json, read up to its cap, checked against its `entry` in the
    verified package manifest (sha256), parsed.

    Raises:
        SignatureError: It is missing, too large, not UTF-8, differs from its sha256,
            cannot be read, or does not parse as an object.
    """
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise SignatureError(f"{where} has no sha256 in its package manifest")
    try:
        text = read_text_or_none(location, _RECORD_BYTES)
    except (*backend_errors(), OSError) as err:
        raise SignatureError(f"{where} cannot be read ({type(err).__name__})") from err
    if text is None:
        raise SignatureError(f"{where} is listed in its package manifest but missing")
    if hashlib.sha256(text.encode()).hexdigest() != entry["sha256"]:
        raise SignatureError(f"{where} does not match its sha256 in the package manifest")
    try:
        lineage = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise SignatureError(f"{where} does not parse ({type(err).__name__})") from err
    if not isinstance(lineage, dict):
        raise SignatureError(f"{where} is not a JSON object")
    return lineage


def _seconds(value: Any) -> float:
    """A time in a verified lease (seconds since the epoch).

    Raises:
        SignatureError: It is not a finite number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SignatureError(f"its time {str(value)[:40]!r} is not a number")
    try:
        seconds = float(value)
    except OverflowError as err:
        raise SignatureError("its time is out of range") from err
    if not math.isfinite(seconds):
        raise SignatureError("its time is not finite")
    return seconds


def _mtime(info: dict[str, Any]) -> float:
    """When an object was last written, from an fsspec listing; +inf when unknown (then it
    is never old enough to delete)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return math.inf
