"""The model registry: versioned packages and an atomic CHAMPION pointer.

```
<root>/registry/<model>/<version>/        an export package (its _manifest.json verifies it)
<root>/registry/<model>/CHAMPION          {"version", "promoted_at", "reason", "previous"}
<root>/registry/<model>/history.jsonl     every pointer move, oldest first
<root>/registry/<model>/decisions/        the blessing decision of every candidate
```

The pointer is one JSON file replaced by rename: readers see the old or the new
champion, never a torn one. It moves only through `promote` (which verifies the
package first) and `rollback`; a failure before the rename leaves it where it was.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.errors import ConfigError, InputNotFoundError
from tasks.store import MANIFEST, CorruptOutput, _write_json_atomic, check_output_dir

CHAMPION = "CHAMPION"
HISTORY = "history.jsonl"
DECISIONS = "decisions"
INFRA_REPORT = "infra_validation.json"


@dataclass(frozen=True)
class Version:
    """One registered package."""

    name: str
    path: Path
    created: str
    champion: bool
    blessed: bool | None  # None: no decision recorded (e.g. registered before the gate)


class Registry:
    """The versions and champion of one model name under an artifact root."""

    def __init__(self, root: str | Path, model_name: str) -> None:
        self.root = Path(root).absolute() / "registry" / model_name
        self.model_name = model_name

    def versions(self) -> list[Version]:
        """Registered versions, oldest first."""
        if not self.root.is_dir():
            return []
        champion = self.champion()
        found = []
        for path in self.root.iterdir():
            if path.name.startswith(".") or not (path / MANIFEST).is_file():
                continue
            manifest = json.loads((path / MANIFEST).read_text())
            decision = self.decision(path.name)
            found.append(
                Version(
                    name=path.name,
                    path=path,
                    created=str(manifest.get("created", "")),
                    champion=path.name == champion,
                    blessed=None if decision is None else bool(decision["blessed"]),
                )
            )
        return sorted(found, key=lambda v: (v.created, v.name))

    def path(self, version: str) -> Path:
        """The package directory of `version`.

        Raises:
            InputNotFoundError: No such version.
        """
        path = self.root / version
        if not (path / MANIFEST).is_file():
            known = ", ".join(v.name for v in self.versions()) or "none"
            raise InputNotFoundError(
                f"model {self.model_name!r} has no version {version!r} under {self.root} "
                f"(registered: {known}); `recforge models list` shows them"
            )
        return path

    def champion(self) -> str | None:
        """The champion's version, or None before the first promotion."""
        pointer = self.root / CHAMPION
        if not pointer.is_file():
            return None
        return str(json.loads(pointer.read_text())["version"])

    def champion_record(self) -> dict[str, Any] | None:
        pointer = self.root / CHAMPION
        return json.loads(pointer.read_text()) if pointer.is_file() else None

    def history(self) -> list[dict[str, Any]]:
        """Every pointer move, oldest first."""
        path = self.root / HISTORY
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def record_decision(self, version: str, decision: dict[str, Any]) -> Path:
        """Keep the blessing decision of `version` (the latest one wins)."""
        path = self.root / DECISIONS / f"{version}.json"
        _write_json_atomic(path, {"version": version, "decided_at": _now(), **decision})
        return path

    def decision(self, version: str) -> dict[str, Any] | None:
        path = self.root / DECISIONS / f"{version}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def verify(self, version: str) -> Path:
        """The package of `version`, checked against its manifest and infra report.

        Raises:
            InputNotFoundError: No such version.
            CorruptOutput: A file differs from the manifest.
            ConfigError: The package's infra validation is missing or failed.
        """
        path = self.path(version)
        problem = check_output_dir(path)
        if problem:
            raise CorruptOutput(
                f"registry package {path} does not match its manifest: {problem}; "
                "export it again (`recforge run CONFIG --force export`)"
            )
        report_path = path / INFRA_REPORT
        if (path / "model.onnx").is_file() and (path / "score.py").is_file():
            # CTR packages score raw records: they must have passed infra validation.
            if not report_path.is_file():
                raise ConfigError(
                    f"{path} has no {INFRA_REPORT}: the package was never loaded and "
                    "scored in a fresh process; export it again"
                )
            report = json.loads(report_path.read_text())
            if not report.get("ok", True) or not report.get("rows"):
                raise ConfigError(f"{path}: infra validation failed: {report}")
        return path

    def promote(self, version: str, reason: str) -> dict[str, Any]:
        """Make `version` the champion (after verifying it), atomically.

        Returns:
            The new CHAMPION record.
        """
        self.verify(version)
        previous = self.champion()
        record = {
            "version": version,
            "promoted_at": _now(),
            "reason": reason,
            "previous": previous,
        }
        _write_json_atomic(self.root / CHAMPION, record)  # the move itself
        self._append_history({"event": "promote", **record})
        return record

    def rollback(self, reason: str = "rollback") -> dict[str, Any]:
        """Point CHAMPION back at the version before the current one.

        Raises:
            InputNotFoundError: There is no earlier champion to go back to.
        """
        current = self.champion_record()
        if current is None or not current.get("previous"):
            raise InputNotFoundError(
                f"model {self.model_name!r} has no earlier champion to roll back to "
                f"(CHAMPION: {current and current['version']})"
            )
        target = current["previous"]
        self.verify(target)
        # The one before the target, so that repeated rollbacks walk back in time.
        before = [h for h in self.history() if h.get("version") == target]
        record = {
            "version": target,
            "promoted_at": _now(),
            "reason": f"{reason} (from {current['version']})",
            "previous": before[-1].get("previous") if before else None,
        }
        _write_json_atomic(self.root / CHAMPION, record)
        self._append_history({"event": "rollback", **record})
        return record

    def _append_history(self, entry: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / HISTORY, "a") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
