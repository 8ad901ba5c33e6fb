"""The model registry: versioned packages and an atomic CHAMPION pointer.

```
<root>/registry/<model>/<version>/        an export package (its _manifest.json verifies it)
<root>/registry/<model>/CHAMPION          {"version", "promoted_at", "reason", "previous"}
<root>/registry/<model>/history.jsonl     every pointer move, oldest first
<root>/registry/<model>/decisions/        the blessing decision of every candidate
```

Every record here is bound to its place (`artifacts.signing.place`): a package manifest
to its model and version, CHAMPION and each history line to the model, a decision to its
model and version. A signed record copied elsewhere in the bucket (an old version over
the champion's directory, another model's pointer, one version's decision to another) is
refused by every reader, naming both places.

The root may be local or an fsspec URL (`s3://bucket/prefix`, see artifacts/store.py).
The pointer is one JSON object replaced whole (a rename locally, one PUT remotely):
readers see the old or the new champion, never a torn one. It moves only through
`promote` (which verifies the package first) and `rollback`, by a conditional write
against the version that was read (S3 `If-Match` / `If-None-Match: *`; locally an
exclusive lock around read-compare-rename): of two concurrent promotions exactly one
wins, the other fails with `ChampionMoved` and changes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from artifacts.durable import read_object, write_json, write_json_if, write_text_if
from artifacts.errors import (
    ConcurrentUpdate,
    ConfigError,
    CorruptOutput,
    DeterministicError,
    InputNotFoundError,
)
from artifacts.locations import UnsafeName, check_name, filesystem, join, read_text_or_none
from artifacts.signing import (
    SIGNATURE,
    SignatureError,
    loads_verified,
    place,
    read_hint,
    read_verified,
    sign,
)
from artifacts.store import MANIFEST, ArtifactStore, check_output_dir, materialize, remote_manifest

CHAMPION = "CHAMPION"
HISTORY = "history.jsonl"
DECISIONS = "decisions"
INFRA_REPORT = "infra_validation.json"
# Size caps of the registry's small records (a manifest keeps the default cap).
POINTER_BYTES = 64 << 10
DECISION_BYTES = 4 << 20
# A history append that loses a race reads the file again and retries, this many times.
HISTORY_ATTEMPTS = 5
_logger = logging.getLogger(__name__)


def check_version(version: Any, where: str) -> str:
    """A version name read back from storage (CHAMPION, its `previous`, a listing),
    refused unless it is one plain name: it is joined onto the registry's directory.

    Raises:
        UnsafeName: Naming `where`.
    """
    check_name(version, where)
    if "/" in version:
        raise UnsafeName(f"{where}: {version[:80]!r} is not one plain version name; refusing it")
    return version


class ChampionMoved(DeterministicError):
    """Another promotion or rollback moved CHAMPION between this one's read and write."""


@dataclass(frozen=True)
class Version:
    """One registered package."""

    name: str
    path: Path | str  # a URL for a remote root
    created: str
    champion: bool
    blessed: bool | None  # None: no decision recorded (e.g. registered before the gate)


class Registry:
    """The versions and champion of one model name under an artifact root.

    Attributes:
        url: The registry of this model: a directory, or a URL for a remote root.
        root: Its local directory (for a remote root, the local cache of it).
    """

    def __init__(self, root: ArtifactStore | str | Path, model_name: str) -> None:
        store = root if isinstance(root, ArtifactStore) else ArtifactStore(root)
        self.remote = store.remote
        self.url = store.location("registry", model_name)
        self.root = store.root / "registry" / model_name
        self.model_name = model_name

    def _at(self, *parts: str) -> str:
        return join(self.url, *parts)

    def package_place(self, version: str) -> dict[str, str]:
        """The place a package manifest of `version` of this model is signed for."""
        return place("package", model=self.model_name, version=version)

    def versions(self) -> list[Version]:
        """Registered versions, oldest first."""
        champion = self.champion()
        found = []
        for name, manifest in self._manifests():
            decision = self.decision(name)
            found.append(
                Version(
                    name=name,
                    path=self._at(name) if self.remote else self.root / name,
                    created=str(manifest.get("created", "")),
                    champion=name == champion,
                    blessed=None if decision is None else bool(decision["blessed"]),
                )
            )
        return sorted(found, key=lambda v: (v.created, v.name))

    def _manifests(self) -> list[tuple[str, dict[str, Any]]]:
        """(version, package manifest) of every published version, in no order."""
        if not self.remote:
            if not self.root.is_dir():
                return []
            found = []
            for path in self.root.iterdir():
                if path.name.startswith(".") or not (path / MANIFEST).is_file():
                    continue
                try:
                    check_version(path.name, f"a version listed under {self.url}")
                    manifest = read_verified(path / MANIFEST, place=self.package_place(path.name))
                except (SignatureError, UnsafeName) as err:
                    _logger.warning("registry: ignoring %s: %s", path.name, err)
                    continue
                if manifest is not None:
                    found.append((path.name, manifest))
            return found
        fs, path = filesystem(self.url)
        fs.invalidate_cache(path)
        if not fs.exists(path):
            return []
        found = []
        for entry in fs.ls(path, detail=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["type"] != "directory" or name.startswith(".") or name == DECISIONS:
                continue
            try:
                check_version(name, f"a version listed under {self.url}")
            except UnsafeName as err:
                _logger.warning("registry: %s", err)
                continue
            # One that does not verify, or was signed for another place, is logged there.
            manifest = remote_manifest(self._at(name), strict=False, place=self.package_place(name))
            if manifest is not None:
                found.append((name, manifest))
        return found

    def location(self, version: str) -> Path | str:
        """Where the package of `version` is published (a URL for a remote root).

        Raises:
            InputNotFoundError: No such version.
            UnsafeName: `version` is not one plain name.
        """
        check_version(version, f"model {self.model_name!r} version")
        published = (
            remote_manifest(self._at(version), strict=False, place=self.package_place(version))
            is not None
            if self.remote
            else (self.root / version / MANIFEST).is_file()
        )
        if not published:
            known = ", ".join(v.name for v in self.versions()) or "none"
            raise InputNotFoundError(
                f"model {self.model_name!r} has no version {version!r} under {self.url} "
                f"(registered: {known}); `recforge models list` shows them"
            )
        return self._at(version) if self.remote else self.root / version

    def path(self, version: str) -> Path:
        """The package directory of `version`, local and verified: its manifest signed and
        bound to this model and version, every file's size and sha256 as it lists them
        (a remote package is materialized, each object checked as it is downloaded).

        Raises:
            InputNotFoundError: No such version.
            CorruptOutput: A file differs from the manifest.
            SignatureError: The manifest is unsigned or forged.
            MisplacedRecord: The manifest was signed for another model or version (a
                copy of another package), or for none (exported before packages were
                bound: the message says how to export it again).
        """
        location = self.location(version)
        expected = self.package_place(version)
        if self.remote:
            # The place first: nothing of another version's package is downloaded here.
            remote_manifest(str(location), place=expected)
            local = materialize(location)  # every object's sha256 checked
            # What was downloaded is bound to this version too.
            read_verified(local / MANIFEST, place=expected)
            return local
        local = Path(location)
        problem = check_output_dir(local, expected)
        if problem:
            raise CorruptOutput(
                f"registry package {self._at(version)} does not match its manifest: "
                f"{problem}; export it again (`recforge run CONFIG --force export`)"
            )
        return local

    def manifest(self, version: str) -> dict[str, Any]:
        """The signed package manifest of `version` (its files' sizes and sha256s),
        verified and bound to this model and version; nothing else is read.

        Raises:
            InputNotFoundError: No such version.
            SignatureError, MisplacedRecord, UnsafeName: As `path`.
        """
        location = self.location(version)
        expected = self.package_place(version)
        if self.remote:
            manifest = remote_manifest(str(location), place=expected)
        else:
            manifest = read_verified(Path(location) / MANIFEST, place=expected)
        if manifest is None or not isinstance(manifest.get("files"), dict):
            raise CorruptOutput(
                f"{self._at(version)} has no valid {MANIFEST}; export it again "
                "(`recforge run CONFIG --force export`)"
            )
        return manifest

    def package_json(
        self, version: str, name: str, limit: int = DECISION_BYTES
    ) -> dict[str, Any] | None:
        """A small JSON file of the package of `version` (e.g. `model_config.json`), read
        without downloading the package and checked against its signed manifest.

        Args:
            version: The version.
            name: The file's name in the package, as the manifest lists it.
            limit: The most bytes to read.

        Returns:
            The parsed file; None when the manifest lists no such file.

        Raises:
            InputNotFoundError: No such version.
            CorruptOutput: The file is missing, larger than `limit`, or differs from its
                size and sha256 in the manifest.
        """
        manifest = self.manifest(version)
        entry = manifest["files"].get(name)
        if entry is None:
            return None
        location = self.location(version)
        # A remote package's objects lie under its manifest's data prefix (`remote_manifest`
        # checked that it is one plain name).
        source = (
            join(location, str(manifest.get("data", "")), name)
            if self.remote
            else Path(location) / name
        )
        try:
            text = read_text_or_none(source, limit)
        except SignatureError as err:  # larger than the cap, or not text
            raise CorruptOutput(f"{source}: {err}") from err
        data = b"" if text is None else text.encode()
        listed = text is not None and len(data) == entry["bytes"]
        if not listed or sha256(data).hexdigest() != entry["sha256"]:
            raise CorruptOutput(
                f"{source} is missing or does not match its size and sha256 in "
                f"{self._at(version, MANIFEST)}; export the version again"
            )
        return json.loads(data)

    def champion(self) -> str | None:
        """The champion's version, or None before the first promotion."""
        record = self.champion_record()
        return None if record is None else str(record["version"])

    def champion_record(self) -> dict[str, Any] | None:
        """CHAMPION, verified: signed with the run key for this model, its versions plain
        names.

        Raises:
            SignatureError: CHAMPION is unsigned, forged, over its size cap or does not
                parse.
            MisplacedRecord: It is another model's pointer (copied here), or names no
                place.
            UnsafeName: Its `version` or `previous` would leave the registry.
        """
        text = read_text_or_none(self._at(CHAMPION), POINTER_BYTES)
        return None if text is None else self._checked_champion(text)

    def _checked_champion(self, text: str) -> dict[str, Any]:
        where = str(self._at(CHAMPION))
        if len(text) > POINTER_BYTES:
            raise SignatureError(
                f"{where} has {len(text)} characters, more than a CHAMPION pointer "
                f"({POINTER_BYTES}); recforge never wrote it. Promote a version again"
            )
        record = loads_verified(text, where, place=place("champion", model=self.model_name))
        check_version(record.get("version"), f"{where} 'version'")
        if record.get("previous") is not None:
            check_version(record["previous"], f"{where} 'previous'")
        return record

    def history(self) -> list[dict[str, Any]]:
        """Every pointer move of this model, oldest first (lines that do not verify, or
        were signed for another model's history, are left out, logged)."""
        text = read_text_or_none(self._at(HISTORY)) or ""
        expected = place("history", model=self.model_name)
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = loads_verified(line, f"{self._at(HISTORY)} line {number}", place=expected)
                entries.append({k: v for k, v in entry.items() if k != SIGNATURE})
            except SignatureError as err:
                _logger.warning("registry: %s", err)
        return entries

    def record_decision(self, version: str, decision: dict[str, Any]) -> Path | str:
        """Keep the blessing decision of `version` (the latest one wins)."""
        check_version(version, "a model version")
        location = self._at(DECISIONS, f"{version}.json")
        record = {"version": version, "decided_at": _now(), **decision}
        write_json(location, sign(record, place=self._decision_place(version)))
        return location if self.remote else Path(location)

    def decision(self, version: str) -> dict[str, Any] | None:
        """The blessing decision recorded for `version`; None when there is none, or when
        it does not verify (logged: a forged decision, or one copied from another version
        or model, blesses nothing)."""
        location = self._at(DECISIONS, f"{check_version(version, 'a model version')}.json")
        return read_hint(
            location, "registry", place=self._decision_place(version), limit=DECISION_BYTES
        )

    def _decision_place(self, version: str) -> dict[str, str]:
        return place("decision", model=self.model_name, version=version)

    def verify(self, version: str) -> Path:
        """The package of `version`, checked against its manifest and infra report.

        Returns:
            The package's local directory (materialized from a remote root).

        Raises:
            InputNotFoundError: No such version.
            CorruptOutput: A file differs from the manifest.
            SignatureError, MisplacedRecord: As `path` (another version's package copied
                here is refused, naming both).
            ConfigError: The package's infra validation is missing or failed.
        """
        path = self.path(version)
        report_path = path / INFRA_REPORT
        if (path / "model.onnx").is_file() and (path / "score.py").is_file():
            # CTR packages score raw records: they must have passed infra validation.
            if not report_path.is_file():
                raise ConfigError(
                    f"{self._at(version)} has no {INFRA_REPORT}: the package was never "
                    "loaded and scored in a fresh process; export it again"
                )
            report = json.loads(report_path.read_text())
            if not report.get("ok", True) or not report.get("rows"):
                raise ConfigError(f"{self._at(version)}: infra validation failed: {report}")
        return path

    def promote(self, version: str, reason: str) -> dict[str, Any]:
        """Make `version` the champion (after verifying it), by one conditional write.

        Returns:
            The new CHAMPION record.

        Raises:
            ChampionMoved: Another promotion moved CHAMPION since it was read here;
                nothing changed.
        """
        current, tag = self._read_champion()
        self.verify(version)
        record = {
            "version": version,
            "promoted_at": _now(),
            "reason": reason,
            "previous": None if current is None else current["version"],
        }
        self._move(record, tag)
        self._append_history({"event": "promote", **record})
        return record

    def rollback(self, reason: str = "rollback") -> dict[str, Any]:
        """Point CHAMPION back at the version before the current one.

        Raises:
            InputNotFoundError: There is no earlier champion to go back to.
            ChampionMoved: Another promotion moved CHAMPION meanwhile; nothing changed.
        """
        current, tag = self._read_champion()
        if current is None or not current.get("previous"):
            raise InputNotFoundError(
                f"model {self.model_name!r} has no earlier champion to roll back to "
                f"(CHAMPION: {current and current['version']})"
            )
        target = current["previous"]
        self.verify(target)
        # The one before the target, so that repeated rollbacks walk back in time.
        before = [h for h in self.history() if h.get("version") == target]
        previous = before[-1].get("previous") if before else None
        if previous is not None:
            check_version(previous, f"{self._at(HISTORY)} 'previous' of {target}")
        record = {
            "version": target,
            "promoted_at": _now(),
            "reason": f"{reason} (from {current['version']})",
            "previous": previous,
        }
        self._move(record, tag)
        self._append_history({"event": "rollback", **record})
        return record

    def _read_champion(self) -> tuple[dict[str, Any] | None, str | None]:
        """The CHAMPION record and the version tag a conditional write compares."""
        text, tag = read_object(self._at(CHAMPION))
        return (None if text is None else self._checked_champion(text)), tag

    def _move(self, record: dict[str, Any], expected: str | None) -> None:
        """Write CHAMPION if it is still the version read as `expected` (the move itself)."""
        try:
            champion = place("champion", model=self.model_name)
            write_json_if(self._at(CHAMPION), sign(record, place=champion), expected)
        except ConcurrentUpdate as err:
            now = self.champion()
            raise ChampionMoved(
                f"{self._at(CHAMPION)} moved to {now} while {record['version']} was being "
                "promoted (another promotion or rollback won); nothing was changed. Check "
                f"`recforge models list --model {self.model_name}` and promote again if "
                f"{record['version']} should still replace it"
            ) from err

    def _append_history(self, entry: dict[str, Any]) -> None:
        signed = sign(entry, place=place("history", model=self.model_name))
        line = json.dumps(signed, sort_keys=True) + "\n"
        if not self.remote:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / HISTORY, "a") as handle:
                handle.write(line)
            return
        # Object storage cannot append: rewrite the file conditionally, again on a race.
        for _ in range(HISTORY_ATTEMPTS):
            text, tag = read_object(self._at(HISTORY))
            try:
                write_text_if(self._at(HISTORY), (text or "") + line, tag)
                return
            except ConcurrentUpdate:
                continue
        raise ChampionMoved(
            f"{self._at(HISTORY)} kept changing during {HISTORY_ATTEMPTS} attempts to record "
            f"{entry}; CHAMPION has moved, but this event is missing from the history"
        )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
