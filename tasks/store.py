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

The root is a local directory or an fsspec URL (`s3://bucket/prefix`, `gs://...`;
`file://` and plain paths are local). Object storage has no rename, so a remote
store keeps the same guarantees on its own terms:

- a stage still produces into a local staging directory; `publish` uploads its
  files under a fresh data prefix, ``stages/<stage>/<fp>/<data>/``, and then writes
  ``stages/<stage>/<fp>/_manifest.json`` in one PUT, last. The manifest is the commit
  point (an object is visible whole or not at all) and names its data prefix, so a
  republish never changes the files an earlier manifest describes;
- a reader trusts an output only through its manifest: a cache hit is a manifest
  whose every object exists with the listed size and ETag (no download), and
  `materialize` copies an output into the local mirror (`local_mirror`) checking
  every file's sha256 (`CorruptOutput` names the object that differs);
- the data stages' tasks may instead write straight under a fresh data prefix
  (`new_data_prefix`; no local staging, so a worker elsewhere needs only the URL);
  `publish_prefix` then checks the described objects against one listing and writes
  the manifest last, the same commit point;
- run records, `latest/` pointers and registry files are single PUTs.

The local side of a remote store (staging, materialized outputs, train resume
checkpoints) lives under ``$RECFORGE_CACHE_DIR`` (default ``~/.cache/recforge``), at
``<cache>/<protocol>/<bucket>/<prefix>/...`` mirroring the URL.
"""

import ast
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq

from data_prep.errors import ConfigError, DataError, DeterministicError, InputNotFoundError

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


# Where the local side of a remote store lives (see the module docstring).
CACHE_DIR_ENV = "RECFORGE_CACHE_DIR"
# Object stores whose first path component is a bucket that must exist beforehand.
BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


class CorruptOutput(DataError):
    """A published stage output no longer matches its manifest's sizes and sha256."""


class StoreUnreachable(DeterministicError):
    """The artifact store's URL cannot be listed: endpoint, credentials or bucket."""


class ConcurrentUpdate(DeterministicError):
    """A conditional write lost: someone else changed the object since it was read."""


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
    and the task modules it imports (e.g. "tasks.train_launch") import, and follows their
    imports transitively, function-level imports included. A string constant that names
    a library module counts as an import: that is how a launcher starts its rank modules
    (`python -m training.ctr.worker`). Only modules of `LIBRARIES` are returned; the
    task modules themselves are orchestration.

    Raises:
        FileNotFoundError: `entry` is not a module under `root`.
    """
    start = _module_file(entry, root)
    if start is None:
        raise FileNotFoundError(f"stage entry module {entry!r} is not under {root}")
    orchestration: set[Path] = set()
    entries = [start]
    while entries:
        path = entries.pop()
        if path not in orchestration:
            orchestration.add(path)
            entries.extend(_imported_files(path, root, packages=("tasks",)))
    seen: set[Path] = set()
    pending = [
        f
        for path in orchestration
        for f in _imported_files(path, root)
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


def _imported_files(path: Path, root: Path, packages: tuple[str, ...] = LIBRARIES) -> list[Path]:
    """Module files of `packages` that `path` imports or names by string, packages included."""
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
        if parts[0] not in packages:
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
    """Stage outputs, run records and the model registry under one root (a path or a URL).

    Attributes:
        remote: Whether the root is an object-store URL (`is_remote`).
        url: The root as text: an absolute path, or the URL without a trailing slash.
        root: The local directory: the store itself for a local root; for a remote
            root its local mirror (staging, materialized outputs, resume checkpoints).
    """

    def __init__(self, root: str | Path) -> None:
        self.remote = is_remote(root)
        if self.remote:
            self.url = str(root).rstrip("/")
            self.root = local_mirror(self.url)
        else:
            self.root = local_path(root).absolute()
            self.url = str(self.root)

    def location(self, *parts: str) -> str:
        """Where `parts` live under the root: a local path or a URL, as text."""
        return join_url(self.url, *parts) if self.remote else str(self.root.joinpath(*parts))

    def output_dir(self, stage: str, fp: str) -> Path:
        """The local directory of an output (for a remote root, its materialized copy)."""
        return self.root / "stages" / stage / fp

    def output_url(self, stage: str, fp: str) -> str:
        """Where an output is published: its directory, or its URL for a remote root."""
        return self.location("stages", stage, fp)

    def check_reachable(self) -> None:
        """Fail once, before any stage, when a remote root cannot be reached.

        Raises:
            StoreUnreachable: The bucket does not exist, credentials are missing or
                refused, or the endpoint does not answer; the message names the URL and
                what to set.
            ConfigError: The protocol's fsspec package is not installed.
        """
        if not self.remote:
            return
        fs, path = filesystem(self.url)
        with storage_errors(self.url):
            if self.url.partition("://")[0] in BUCKET_PROTOCOLS:
                # The bucket (first path component) answers for every object under it.
                fs.info(path.split("/")[0])
            else:
                fs.makedirs(path, exist_ok=True)

    def verify(self, stage: str, fp: str) -> tuple[dict | None, str]:
        """Check a published output against its manifest.

        Locally every file's size and sha256 is checked; remotely every object's size and
        ETag (sha256 is checked when an output is materialized, see `materialize`).

        Returns:
            (manifest, "") when every listed file exists with its size and sha256;
            (None, why) when there is no output (never published, or deleted whole).

        Raises:
            CorruptOutput: The output was published, but its manifest does not parse or
                a file it lists is missing or has other bytes.
        """
        if self.remote:
            url = self.output_url(stage, fp)
            manifest = remote_manifest(url)
            if manifest is None:
                return None, f"no output at {url}"
            problem = check_remote_output(url, manifest)
            if problem:
                raise CorruptOutput(
                    f"the {stage} output {url} was published whole but has changed since: "
                    f"{problem}. Look for the cause (a hand edit, a lifecycle rule), then run "
                    f"the stage again with --force {stage} to replace it"
                )
            return manifest, ""
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

    def is_published(self, stage: str, fp: str) -> bool:
        """Whether an output's manifest exists (not verified: the plan's cheap look)."""
        if self.remote:
            fs, path = filesystem(self.output_url(stage, fp))
            fs.invalidate_cache(path)
            return fs.exists(f"{path}/{MANIFEST}")
        return (self.output_dir(stage, fp) / MANIFEST).is_file()

    def new_staging(self, stage: str, fp: str) -> Path:
        path = self.root / "stages" / stage / f".staging-{fp[:16]}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def publish(self, stage: str, fp: str, staging: Path, meta: dict) -> dict:
        """Seal a staging directory with its manifest and put it in place.

        Locally the staging directory is renamed into place. For a remote root its files
        are uploaded under a fresh data prefix, the manifest is written last (the commit),
        and the staging directory becomes the output's local materialized copy.
        """
        files = describe_files(staging)
        fault = _chaos_fault(stage)
        if self.remote:
            return self._publish_remote(stage, fp, staging, meta, files, fault)
        for rel in files:
            _fsync(staging / rel)
        fault("before-manifest")
        manifest = _manifest(stage, fp, files, meta)
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

    def _publish_remote(
        self, stage: str, fp: str, staging: Path, meta: dict, files: dict, fault: Any
    ) -> dict:
        """Upload the output, manifest last; the staging directory becomes its local copy."""
        manifest = _publish_tree(
            staging, self.output_url(stage, fp), _manifest(stage, fp, files, meta), fault
        )
        _write_json_durable(staging / MANIFEST, manifest)
        _replace_dir(staging, self.output_dir(stage, fp))
        return manifest

    def new_data_prefix(self, stage: str, fp: str) -> str:
        """A fresh data prefix of a remote output, for tasks that write there themselves."""
        return join_url(self.output_url(stage, fp), f"data-{uuid.uuid4().hex[:12]}")

    def publish_prefix(self, stage: str, fp: str, data_url: str, files: dict, meta: dict) -> dict:
        """Seal objects already written under `data_url` (a `new_data_prefix`).

        Every object `files` describes ({rel: {"bytes", "sha256"[, "rows"]}}) must be
        there with its size; the manifest naming the prefix, with each object's ETag, is
        written last (the commit point), then the replaced output's objects go.

        Raises:
            OSError: An object is missing or has another size than described (transient:
                the stage runs again).
        """
        url = self.output_url(stage, fp)
        previous = remote_manifest(url, strict=False)
        fs, path = filesystem(data_url)
        fs.invalidate_cache(path)
        listing = {
            name.removeprefix(path.rstrip("/") + "/"): info
            for name, info in fs.find(path, detail=True).items()
        }
        entries = {}
        for rel, entry in sorted(files.items()):
            info = listing.get(rel)
            if info is None or info["size"] != entry["bytes"]:
                raise OSError(f"{join_url(data_url, rel)} is missing or changed before publishing")
            entries[rel] = {**entry, "etag": _etag(info)}
        _chaos_fault(stage)("before-manifest")
        data = data_url.rstrip("/").rsplit("/", 1)[-1]
        manifest = {**_manifest(stage, fp, entries, meta), "data": data}
        write_json(join_url(url, MANIFEST), manifest)
        if previous and previous.get("data") and previous["data"] != data:
            remove_tree(join_url(url, previous["data"]))
        return manifest

    def keep_failed(self, stage: str, fp: str, staging: Path) -> Path:
        """Move a failed stage's partial output out of the stage tree, for inspection."""
        target = self.root / "failed" / stage / f"{fp[:16]}-{time.strftime('%Y%m%dT%H%M%S')}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)
        return target

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def latest_output(self, pipeline: str, stage: str) -> str | None:
        """The output a stage of this pipeline last published, if it still exists."""
        pointer = self.read_latest_json(pipeline, f"{stage}.json")
        if pointer is None:
            return None
        output = str(pointer["output"])
        if self.remote:
            return output if remote_manifest(output, strict=False) else None
        return output if Path(output).is_dir() else None

    def record_latest(self, pipeline: str, stage: str, output: str | Path) -> None:
        """Point ``latest/<pipeline>/<stage>.json`` at an output (replaced whole)."""
        write_json(self.location("latest", pipeline, f"{stage}.json"), {"output": str(output)})

    def read_latest_json(self, pipeline: str, name: str) -> dict | None:
        """``latest/<pipeline>/<name>``, or None when there is none (or it does not parse)."""
        text = read_text(self.location("latest", pipeline, name))
        try:
            return None if text is None else json.loads(text)
        except json.JSONDecodeError:
            return None

    def write_latest_json(self, pipeline: str, name: str, payload: dict) -> Path | str:
        """Replace ``latest/<pipeline>/<name>`` whole; returns its path (URL when remote)."""
        location = self.location("latest", pipeline, name)
        write_json(location, payload)
        return location if self.remote else Path(location)

    def write_run_record(self, run_id: str, record: dict) -> Path | str:
        """Write ``runs/<run_id>/summary.json`` whole; returns its path (URL when remote)."""
        location = self.location("runs", run_id, "summary.json")
        write_json(location, record)
        return location if self.remote else Path(location)

    def model_location(self, model_name: str, version: str) -> Path | str:
        """Where ``registry/<model>/<version>`` is (a URL when remote)."""
        location = self.location("registry", model_name, version)
        return location if self.remote else Path(location)

    def is_model_published(self, model_name: str, version: str) -> bool:
        """Whether ``registry/<model>/<version>`` holds a package manifest."""
        location = self.location("registry", model_name, version)
        if self.remote:
            return remote_manifest(location, strict=False) is not None
        return (Path(location) / MANIFEST).is_file()

    def publish_model(self, model_name: str, version: str, package: str | Path) -> Path | str:
        """Copy an export package into ``registry/<model>/<version>``, whole or not at all.

        Args:
            model_name: The registry's model name.
            version: The version's name.
            package: The export output (its path, or URL for a remote root).

        Returns:
            The package's registry directory (its URL when remote).
        """
        if self.remote:
            local = materialize(package)
            url = self.location("registry", model_name, version)
            _publish_tree(local, url, json.loads((local / MANIFEST).read_text()))
            return url
        final = self.root / "registry" / model_name / version
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".staging-{version}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(package, staging)
        _replace_dir(staging, final)
        return final


def _publish_tree(local: Path, url: str, manifest: dict, fault: Any = None) -> dict:
    """Publish the files `manifest` lists from `local` at `url`, whole or not at all.

    They go under a fresh data prefix, then the manifest naming it is written in one PUT
    (the commit point); the objects of the manifest it replaces go last, once nothing
    names them.

    Returns:
        The published manifest (with its data prefix and each object's ETag).
    """
    previous = remote_manifest(url, strict=False)
    data = f"data-{uuid.uuid4().hex[:12]}"
    files = {rel: dict(entry) for rel, entry in manifest["files"].items()}
    etags = upload_files(local, list(files), join_url(url, data))
    for rel, entry in files.items():
        entry["etag"] = etags[rel]
    (fault or _no_fault)("before-manifest")
    published = {**manifest, "files": files, "data": data}
    write_json(join_url(url, MANIFEST), published)
    if previous and previous.get("data") and previous["data"] != data:
        remove_tree(join_url(url, previous["data"]))
    return published


def materialize(location: str | Path) -> Path:
    """A local, sha256-verified copy of a published output (a local root: itself).

    Args:
        location: An output's path or URL (`StageOutput.output`, a registry package).

    Returns:
        Its local directory: for a URL, the mirror under the cache directory, reused
        while it matches the published manifest.

    Raises:
        InputNotFoundError: Nothing is published at `location`.
        CorruptOutput: An object differs from the manifest (named in the message).
    """
    if not is_remote(location):
        return local_path(location)
    url = str(location).rstrip("/")
    manifest = remote_manifest(url)
    if manifest is None:
        raise InputNotFoundError(
            f"nothing is published at {url} (no {MANIFEST}); run the stage that writes it"
        )
    local = local_mirror(url)
    if (local / MANIFEST).is_file() and not check_output_dir(local):
        if json.loads((local / MANIFEST).read_text()) == manifest:
            return local
    staging = local.parent / f".staging-{local.name[:16]}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        data = join_url(url, manifest.get("data", ""))
        download_files(data, list(manifest["files"]), staging)
        for rel, entry in manifest["files"].items():
            path = staging / rel
            if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
                raise CorruptOutput(
                    f"{join_url(data, rel)} does not match its size and sha256 in "
                    f"{join_url(url, MANIFEST)}: the object changed after it was "
                    "published. Look for the cause, then run the stage again with "
                    f"--force {manifest.get('stage', '<stage>')} to replace it"
                )
        _write_json_durable(staging / MANIFEST, manifest)
        _replace_dir(staging, local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def remote_manifest(url: str, strict: bool = True) -> dict | None:
    """The manifest published at `url`, None when there is none.

    Raises:
        CorruptOutput: With `strict`, the manifest does not parse.
    """
    text = read_text(join_url(url, MANIFEST))
    if text is None:
        return None
    try:
        manifest = json.loads(text)
        if not isinstance(manifest.get("files"), dict):
            raise KeyError("files")
    except (json.JSONDecodeError, KeyError, AttributeError) as err:
        if not strict:
            return None
        raise CorruptOutput(
            f"{join_url(url, MANIFEST)} is not a valid manifest ({err}); run the stage "
            "again with --force to replace it"
        ) from err
    return manifest


def describe_files(staging: Path) -> dict[str, dict]:
    """{relpath: {"bytes", "sha256"[, "rows"]}} of every file under `staging`."""
    files = {}
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        entry = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        if path.suffix == ".parquet":
            entry["rows"] = pq.ParquetFile(path).metadata.num_rows
        files[path.relative_to(staging).as_posix()] = entry
    return files


def describe_object(url: str) -> dict:
    """{"bytes", "sha256"[, "rows"]} of one object, read through fsspec (`describe_files`)."""
    fs, path = filesystem(url)
    digest = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    entry = {"bytes": size, "sha256": digest.hexdigest()}
    if url.endswith(".parquet"):
        with fs.open(path, "rb") as handle:
            entry["rows"] = pq.ParquetFile(handle).metadata.num_rows
    return entry


def _manifest(stage: str, fp: str, files: dict, meta: dict) -> dict:
    return {
        "stage": stage,
        "fingerprint": fp,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
        "meta": meta,
    }


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


def check_remote_output(url: str, manifest: dict) -> str:
    """Why the objects of the output published at `url` do not match `manifest`, or "".

    One listing: every listed object must exist with its size and, when the manifest
    recorded one, its ETag (which changes whenever an object is written again).
    """
    data = join_url(url, manifest.get("data", ""))
    fs, path = filesystem(data)
    fs.invalidate_cache(path)
    listing = {
        name.removeprefix(path.rstrip("/") + "/"): info
        for name, info in fs.find(path, detail=True).items()
    }
    for rel, entry in manifest["files"].items():
        info = listing.get(rel)
        if info is None:
            return f"{join_url(data, rel)} listed in the manifest is missing"
        if info["size"] != entry["bytes"]:
            return f"{join_url(data, rel)} has {info['size']} bytes, the manifest {entry['bytes']}"
        if entry.get("etag") and _etag(info) and _etag(info) != entry["etag"]:
            return f"{join_url(data, rel)} was written again after it was published (its ETag)"
    return ""


# -- Locations: local paths and fsspec URLs -----------------------------------------


def is_remote(location: str | Path) -> bool:
    """Whether `location` is an object-store URL (`s3://`, `gs://`, ...), not a local path.

    `file://` URLs and plain paths are local.
    """
    protocol, sep, _ = str(location).partition("://")
    return bool(sep) and protocol != "file"


def local_path(location: str | Path) -> Path:
    """A local location as a Path (`file://` stripped)."""
    return Path(str(location).removeprefix("file://"))


def join_url(url: str, *parts: str) -> str:
    """`url` with `parts` appended, one slash between each (empty parts dropped)."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def cache_dir() -> Path:
    """Where the local side of remote stores lives: $RECFORGE_CACHE_DIR or ~/.cache/recforge."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "recforge"


def local_mirror(url: str) -> Path:
    """The local directory that mirrors `url`: ``<cache>/<protocol>/<bucket>/<key>``."""
    protocol, _, path = url.partition("://")
    return cache_dir() / protocol / path.strip("/")


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of `url` and the path in it.

    Raises:
        ConfigError: The protocol's package is not installed (s3fs for `s3://`).
    """
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        extra = " (pip install -e '.[s3]')" if url.startswith("s3") else ""
        raise ConfigError(
            f"artifact store {url}: the filesystem for this protocol is not installed "
            f"({err}); install it{extra}"
        ) from err


def backend_errors() -> tuple[type[BaseException], ...]:
    """The exceptions object-store clients raise for a bad endpoint, credentials or bucket."""
    errors: list[type[BaseException]] = [OSError, ValueError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # no s3fs installed: other backends raise OSError subclasses
        return tuple(errors)
    return (*errors, BotoCoreError, ClientError)


@contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn an object-store failure into `StoreUnreachable` naming `url` and what to set."""
    try:
        yield
    except backend_errors() as err:
        raise StoreUnreachable(
            f"cannot reach the artifact store {url} ({type(err).__name__}: {err}). Check "
            "that the bucket exists, that credentials are set (for s3://: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and, for an "
            "S3-compatible server, that AWS_ENDPOINT_URL points at it; or pass a local --root"
        ) from err


def read_text(location: str | Path) -> str | None:
    """A small file's text (a manifest, a pointer, a record), or None when it is missing."""
    if not is_remote(location):
        try:
            return local_path(location).read_text()
        except FileNotFoundError:
            return None
    fs, path = filesystem(str(location))
    try:
        return fs.cat_file(path).decode()
    except FileNotFoundError:
        return None


def read_object(location: str | Path) -> tuple[str | None, str | None]:
    """(text, version tag) of an object, (None, None) when missing.

    The tag is what `write_json_if` compares: the ETag remotely, a hash locally.
    """
    text = read_text(location)
    if text is None or not is_remote(location):
        tag = None if text is None else hashlib.sha256(text.encode()).hexdigest()
        return text, tag
    fs, path = filesystem(str(location))
    info = fs.info(path)
    # A write between the read and the HEAD makes the tag newer than the text: the
    # conditional write then fails where it could have succeeded, never the other way.
    return text, _etag(info)


def write_json(location: str | Path, payload: dict) -> None:
    """Replace a JSON file whole: locally by rename, remotely by one PUT."""
    if not is_remote(location):
        _write_json_atomic(local_path(location), payload)
        return
    fs, path = filesystem(str(location))
    fs.pipe_file(path, json.dumps(payload, indent=2, default=str).encode())


def write_json_if(location: str | Path, payload: dict, expected: str | None) -> None:
    """`write_text_if` of `payload` as JSON."""
    write_text_if(location, json.dumps(payload, indent=2, default=str), expected)


def write_text_if(location: str | Path, body: str, expected: str | None) -> None:
    """Replace a small object only if it is still the version `expected` (None: absent).

    S3 does the check itself (`If-Match` / `If-None-Match: *` on the PUT), so of two
    writers that read the same version exactly one succeeds. Locally an exclusive
    lock (flock) around read-compare-rename gives the same answer.

    Raises:
        ConcurrentUpdate: The object changed (or appeared) since it was read.
        ConfigError: A remote protocol without conditional writes (not s3://).
    """
    if not is_remote(location):
        path = local_path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _, tag = read_object(path)
            if tag != expected:
                raise ConcurrentUpdate(f"{path} changed since it was read")
            tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
            with open(tmp, "w") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        return
    fs, path = filesystem(str(location))
    if not str(location).startswith("s3"):
        raise ConfigError(
            f"{location}: moving a pointer safely needs a conditional write, which recforge "
            "implements for s3:// (If-Match / If-None-Match) and local roots; use one of those"
        )
    bucket, _, key = path.partition("/")
    condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body.encode(), **condition)
    except (FileExistsError, OSError) as err:
        # s3fs turns 412 Precondition Failed into FileExistsError or OSError(EINVAL).
        if "pre-condition" not in str(err) and not isinstance(err, FileExistsError):
            raise
        raise ConcurrentUpdate(f"{location} changed since it was read") from err
    finally:
        fs.invalidate_cache(path)


def upload_files(local_dir: Path, rels: list[str], url: str) -> dict[str, str | None]:
    """Upload `local_dir/<rel>` to `url/<rel>` for each rel; returns each object's ETag."""
    fs, path = filesystem(url)
    if rels:
        fs.put([str(local_dir / rel) for rel in rels], [f"{path}/{rel}" for rel in rels])
    fs.invalidate_cache(path)
    listing = fs.find(path, detail=True) if rels else {}
    return {rel: _etag(listing.get(f"{path}/{rel}", {})) for rel in rels}


def download_files(url: str, rels: list[str], local_dir: Path) -> None:
    """Download `url/<rel>` to `local_dir/<rel>` for each rel."""
    fs, path = filesystem(url)
    for rel in rels:
        (local_dir / rel).parent.mkdir(parents=True, exist_ok=True)
    if rels:
        fs.get([f"{path}/{rel}" for rel in rels], [str(local_dir / rel) for rel in rels])


def remove_tree(url: str) -> None:
    """Delete every object under `url` (nothing when there are none)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    found = fs.find(path)
    if found:
        fs.rm(found)


def _etag(info: dict) -> str | None:
    """An object's ETag from an fsspec listing (s3fs: "ETag", gcsfs: "etag"), or None."""
    tag = info.get("ETag") or info.get("etag")
    return str(tag) if tag else None


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
