"""The content-addressed artifact store.

```
<root>/stages/<stage>/<fingerprint>/   one stage output; _manifest.json written last
<root>/runs/<run_id>/summary.json      the run record
<root>/registry/<model>/<version>/     exported model packages
<root>/failed/<stage>/<fingerprint>-<time>/   outputs of failed stages, kept for inspection
```

A stage writes into a staging directory next to its final place. Publishing
fsyncs every file, writes ``_manifest.json`` (file list, sizes, sha256, Parquet
row counts, stage metadata) last, then renames the staging directory into
place and fsyncs the parent directory, so a reader never sees half an output: a
process killed at any point leaves either no output (the staging directory is
left, named ``.staging-*``) or the whole one. A cache hit is an output whose
manifest verifies against the files; a published output that does not verify
has changed on disk since, and is refused (`CorruptOutput`), not silently
recomputed.

The store is local-filesystem only for now: renames are atomic there.
"""

import ast
import hashlib
import json
import os
import re
import shutil
import signal
import time
import uuid
from importlib import metadata
from pathlib import Path

import pyarrow.parquet as pq

from data_prep.errors import DataError

MANIFEST = "_manifest.json"
# Where `publish` calls its fault hook, in order (the chaos tests kill the process there).
PUBLISH_POINTS = (
    "before-manifest",  # every file fsynced, no manifest yet
    "mid-manifest",  # half of the manifest written (a torn write)
    "before-rename",  # the manifest complete, the staging directory not yet in place
    "after-aside",  # an older output of the same fingerprint moved aside, the new not in
    "after-rename",  # in place; the parent directory not yet fsynced
)
# Fault injection for the chaos tests, unset in real runs: "STAGE:POINT" SIGKILLs this
# process's group when `publish` of STAGE reaches POINT.
CHAOS_PUBLISH_FAULT = "RECFORGE_CHAOS_PUBLISH_FAULT"


class CorruptOutput(DataError):
    """A published stage output no longer matches its manifest's sizes and sha256."""


def fingerprint(stage: str, section: dict, inputs: list[str], code: str) -> str:
    """sha256 of the stage name, its config (canonical JSON), upstream fingerprints and code."""
    payload = json.dumps(
        {"stage": stage, "config": section, "inputs": inputs, "code": code},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


# The packages whose code a stage runs; a stage's code is the closure of their modules.
LIBRARIES = ("data_prep", "training")
# Installed libraries whose version changes what a stage computes.
VERSIONED_LIBRARIES = ("torch", "deepspeed", "pyarrow")
_MODULE_NAME = re.compile(r"^(?:data_prep|training)(?:\.[A-Za-z_]\w*)+$")


def module_closure(entry: str, root: Path) -> list[str]:
    """The library modules a stage's code can run, as paths relative to `root`.

    Starts from the library modules `entry` (a stage's task module, e.g. "tasks.train")
    imports and follows their imports transitively, function-level imports included.
    A string constant that names a library module counts as an import: that is how a
    launcher starts its rank modules (`python -m training.ctr.worker`). Only modules of
    `LIBRARIES` are followed; the task modules themselves are orchestration.

    Raises:
        FileNotFoundError: `entry` is not a module under `root`.
    """
    start = _module_file(entry, root)
    if start is None:
        raise FileNotFoundError(f"stage entry module {entry!r} is not under {root}")
    seen: set[Path] = set()
    pending = [
        f
        for f in _imported_files(start, root)
        if f.is_relative_to(root / "data_prep") or f.is_relative_to(root / "training")
    ]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        pending.extend(_imported_files(path, root))
    return sorted(str(p.relative_to(root)) for p in seen)


def _module_file(name: str, root: Path) -> Path | None:
    """The file of module `name` under `root` (a package's __init__.py), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_files(path: Path, root: Path) -> list[Path]:
    """Library module files that `path` imports or names by string, packages included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from training.sequence import bst_export` imports a module, not a name.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_NAME.match(node.value):
                names.add(node.value)
    files = []
    for name in names:
        parts = name.split(".")
        if parts[0] not in LIBRARIES:
            continue
        # The packages on the way are imported too (their __init__.py runs).
        for depth in range(1, len(parts) + 1):
            file = _module_file(".".join(parts[:depth]), root)
            if file is not None:
                files.append(file)
    return files


def library_versions() -> dict[str, str]:
    """Installed versions of `VERSIONED_LIBRARIES` ("" for one that is not installed)."""
    versions = {}
    for name in VERSIONED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def code_version(modules: list[str], root: Path) -> str:
    """sha256 over the modules' paths and source, and the versions of the libraries."""
    digest = hashlib.sha256()
    for module in sorted(modules):
        digest.update(module.encode())
        digest.update((root / module).read_bytes())
    digest.update(json.dumps(library_versions(), sort_keys=True).encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ArtifactStore:
    """Stage outputs, run records and the model registry under one root directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()

    def output_dir(self, stage: str, fp: str) -> Path:
        return self.root / "stages" / stage / fp

    def verify(self, stage: str, fp: str) -> tuple[dict | None, str]:
        """Check a published output against its manifest.

        Returns:
            (manifest, "") when every listed file exists with its size and sha256;
            (None, why) when there is no output (never published, or deleted whole).

        Raises:
            CorruptOutput: The output was published, but its manifest does not parse or
                a file it lists is missing or has other bytes.
        """
        out = self.output_dir(stage, fp)
        manifest_path = out / MANIFEST
        if not out.exists():
            return None, f"no output at {out}"
        problem = check_output_dir(out)
        if problem:
            raise CorruptOutput(
                f"the {stage} output {out} was published whole but has changed since: "
                f"{problem}. Look for the cause (disk, a hand edit), then run the stage "
                f"again with --force {stage} to replace it"
            )
        return json.loads(manifest_path.read_text()), ""

    def new_staging(self, stage: str, fp: str) -> Path:
        path = self.root / "stages" / stage / f".staging-{fp[:16]}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def publish(self, stage: str, fp: str, staging: Path, meta: dict) -> dict:
        """Seal a staging directory with its manifest and rename it into place."""
        files = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = path.relative_to(staging).as_posix()
            entry = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            if path.suffix == ".parquet":
                entry["rows"] = pq.ParquetFile(path).metadata.num_rows
            files[rel] = entry
            _fsync(path)
        fault = _chaos_fault(stage)
        fault("before-manifest")
        manifest = {
            "stage": stage,
            "fingerprint": fp,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": files,
            "meta": meta,
        }
        if fault is not _no_fault:
            torn = json.dumps(manifest, indent=2, default=str)
            (staging / MANIFEST).write_text(torn[: len(torn) // 2])
            fault("mid-manifest")
        _write_json_durable(staging / MANIFEST, manifest)
        fault("before-rename")
        final = self.output_dir(stage, fp)
        _replace_dir(staging, final, fault)
        fault("after-rename")
        _fsync(final.parent)
        return manifest

    def keep_failed(self, stage: str, fp: str, staging: Path) -> Path:
        """Move a failed stage's partial output out of the stage tree, for inspection."""
        target = self.root / "failed" / stage / f"{fp[:16]}-{time.strftime('%Y%m%dT%H%M%S')}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)
        return target

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def latest_output(self, pipeline: str, stage: str) -> Path | None:
        """The output a stage of this pipeline last published, if it still exists."""
        pointer = self.root / "latest" / pipeline / f"{stage}.json"
        if not pointer.exists():
            return None
        output = Path(json.loads(pointer.read_text())["output"])
        return output if output.is_dir() else None

    def record_latest(self, pipeline: str, stage: str, output: Path) -> None:
        """Point ``latest/<pipeline>/<stage>.json`` at an output, atomically."""
        _write_json_atomic(
            self.root / "latest" / pipeline / f"{stage}.json", {"output": str(output)}
        )

    def read_latest_json(self, pipeline: str, name: str) -> dict | None:
        """``latest/<pipeline>/<name>``, or None when there is none (or it does not parse)."""
        try:
            return json.loads((self.root / "latest" / pipeline / name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def write_latest_json(self, pipeline: str, name: str, payload: dict) -> Path:
        """Replace ``latest/<pipeline>/<name>`` atomically; returns its path."""
        path = self.root / "latest" / pipeline / name
        _write_json_atomic(path, payload)
        return path

    def write_run_record(self, run_id: str, record: dict) -> Path:
        path = self.root / "runs" / run_id / "summary.json"
        _write_json_atomic(path, record)
        return path

    def publish_model(self, model_name: str, version: str, package_dir: Path) -> Path:
        """Copy an export package into ``registry/<model>/<version>`` atomically."""
        final = self.root / "registry" / model_name / version
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".staging-{version}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(package_dir, staging)
        _replace_dir(staging, final)
        return final


def check_output_dir(out: Path) -> str:
    """Why the output directory `out` does not match its manifest, or ""."""
    manifest_path = out / MANIFEST
    if not manifest_path.exists():
        # Publishing renames a directory that already holds its manifest.
        return f"{manifest_path} is missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{manifest_path} is not a valid manifest ({err})"
    for rel, entry in files.items():
        path = out / rel
        if not path.exists():
            return f"{path} listed in the manifest is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, the manifest {entry['bytes']}"
        if file_sha256(path) != entry["sha256"]:
            return f"{path} does not match its sha256 in the manifest"
    return ""


def _no_fault(point: str) -> None:
    """No fault injected."""


def _chaos_fault(stage: str):
    """The fault hook `CHAOS_PUBLISH_FAULT` asks for this stage, or `_no_fault`."""
    target, _, point = os.environ.get(CHAOS_PUBLISH_FAULT, "").partition(":")
    if target != stage:
        return _no_fault
    if point not in PUBLISH_POINTS:
        raise ValueError(f"{CHAOS_PUBLISH_FAULT}: {point!r} is not one of {PUBLISH_POINTS}")

    def die(name: str) -> None:
        if name == point:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    return die


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durable(path: Path, payload: dict) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2, default=str)
        handle.flush()
        os.fsync(handle.fileno())


def _write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON next to ``path`` and rename it into place: readers see old or new, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
    _write_json_durable(tmp, payload)
    os.replace(tmp, path)


def _replace_dir(staging: Path, final: Path, fault=_no_fault) -> None:
    """Rename ``staging`` to ``final``, moving an existing ``final`` aside first.

    A death between the two renames leaves no ``final`` (the next run produces it
    again) and the older output under ``.trash-*``.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    trash = None
    if final.exists():
        trash = final.parent / f".trash-{final.name[:16]}-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
        fault("after-aside")
    os.replace(staging, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
