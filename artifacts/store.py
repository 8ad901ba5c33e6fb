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
checkpoints) is its local mirror (`artifacts.locations.local_mirror`).
"""

import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from artifacts.durable import (
    file_sha256,
    fsync_dir,
    fsync_file,
    no_fault,
    replace_dir,
    write_json,
    write_json_durable,
)
from artifacts.errors import CorruptOutput, InputNotFoundError, StoreUnreachable
from artifacts.locations import (
    BUCKET_PROTOCOLS,
    UnsafeName,
    as_location,
    check_location,
    check_name,
    check_under,
    download_files,
    etag,
    filesystem,
    is_remote,
    join,
    local_mirror,
    read_text_or_none,
    remove_tree,
    safe_join,
    storage_errors,
    upload_files,
)
from artifacts.signing import Keyring, SignatureError, loads_verified, read_hint, require_key, sign

# The pipeline's stages, in order: the one place their names are spelled.
Stage = Literal["ingest", "preprocess", "shard", "train", "evaluate", "export"]
STAGES: tuple[Stage, ...] = ("ingest", "preprocess", "shard", "train", "evaluate", "export")
# The stages that prepare data (their work may run on a Dask cluster).
DATA_STAGES: tuple[Stage, ...] = STAGES[:3]
# The root when none is given: ./store beside where recforge runs.
DEFAULT_ROOT = "store"
MANIFEST = "_manifest.json"
_logger = logging.getLogger(__name__)


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


class ArtifactStore:
    """Stage outputs, run records and the model registry under one root (a path or a URL).

    Attributes:
        remote: Whether the root is an object-store URL (`is_remote`).
        url: The root as text: an absolute path, or the URL without a trailing slash.
        root: The local directory: the store itself for a local root; for a remote
            root its local mirror (staging, materialized outputs, resume checkpoints).
    """

    def __init__(self, root: str | Path) -> None:
        check_location(root, "the artifact root (--root)")
        self.remote = is_remote(root)
        self.url = str(root).rstrip("/") if self.remote else str(Path(as_location(root)).absolute())

    @property
    def root(self) -> Path:
        # Computed where it is used: a store passed to a task on another machine (a Dask
        # worker) mirrors a remote root under that machine's cache directory.
        return local_mirror(self.url) if self.remote else Path(self.url)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    def location(self, *parts: str) -> str:
        """Where `parts` live under the root: a local path or a URL, as text."""
        return join(self.url, *parts) if self.remote else str(self.root.joinpath(*parts))

    def output_dir(self, stage: str, fp: str) -> Path:
        """The local directory of an output (for a remote root, its materialized copy)."""
        return self.root / "stages" / stage / fp

    def output_url(self, stage: str, fp: str) -> str:
        """Where an output is published: its directory, or its URL for a remote root."""
        return self.location("stages", stage, fp)

    def require_key(self) -> Keyring | None:
        """The run key this store signs with; a remote root refuses to start without one.

        Raises:
            ConfigError: The root is an object-store URL and no signing key is set
                (`artifacts.signing`); the message says how to set one.
        """
        return require_key(self.url, self.remote)

    def check_reachable(self, timeout_s: float | None = None) -> None:
        """Fail once, before any stage, when a remote root cannot be reached.

        Args:
            timeout_s: Give up after this long (an endpoint that does not answer); the
                command line checks with a few seconds before Prefect starts. None: the
                client's own timeouts and retries.

        Raises:
            StoreUnreachable: The bucket does not exist, credentials are missing or
                refused, or the endpoint does not answer (in time); the message names the
                URL and what to set.
            ConfigError: The protocol's fsspec package is not installed.
        """
        if not self.remote:
            return
        if timeout_s is None:
            self._probe(filesystem(self.url))
            return
        options = {}
        if self.url.partition("://")[0] in ("s3", "s3a"):
            # One quick try: botocore's defaults wait 60 s per attempt, several times.
            timeouts = {"connect_timeout": timeout_s, "read_timeout": timeout_s}
            options["config_kwargs"] = {**timeouts, "retries": {"max_attempts": 1}}
        found = filesystem(self.url, skip_instance_cache=True, **options)
        failure: list[BaseException] = []

        def probe() -> None:
            try:
                self._probe(found)
            except BaseException as error:  # noqa: BLE001 - raised in the caller's thread
                failure.append(error)

        thread = threading.Thread(target=probe, name="store-probe", daemon=True)
        thread.start()
        thread.join(timeout_s + 1)
        if thread.is_alive():
            raise StoreUnreachable(
                f"the artifact store {self.url} did not answer within {timeout_s:.0f} s; check "
                "the endpoint (AWS_ENDPOINT_URL for an S3-compatible server) and the network"
            )
        if failure:
            raise failure[0]

    def _probe(self, found: tuple[Any, str]) -> None:
        fs, path = found
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
        return loads_verified(manifest_path.read_text(), str(manifest_path)), ""

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
            fsync_file(staging / rel)
        fault("before-manifest")
        manifest = sign(_manifest(stage, fp, files, meta))
        if fault is not no_fault:
            torn = json.dumps(manifest, indent=2, default=str)
            (staging / MANIFEST).write_text(torn[: len(torn) // 2])
            fault("mid-manifest")
        write_json_durable(staging / MANIFEST, manifest)
        fault("before-rename")
        final = self.output_dir(stage, fp)
        replace_dir(staging, final, fault)
        fault("after-rename")
        fsync_dir(final.parent)
        return manifest

    def _publish_remote(
        self, stage: str, fp: str, staging: Path, meta: dict, files: dict, fault: Any
    ) -> dict:
        """Upload the output, manifest last; the staging directory becomes its local copy."""
        manifest = _publish_tree(
            staging, self.output_url(stage, fp), _manifest(stage, fp, files, meta), fault
        )
        write_json_durable(staging / MANIFEST, manifest)
        replace_dir(staging, self.output_dir(stage, fp))
        return manifest

    def new_data_prefix(self, stage: str, fp: str) -> str:
        """A fresh data prefix of a remote output, for tasks that write there themselves."""
        return join(self.output_url(stage, fp), f"data-{uuid.uuid4().hex[:12]}")

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
                raise OSError(f"{join(data_url, rel)} is missing or changed before publishing")
            entries[rel] = {**entry, "etag": etag(info)}
        _chaos_fault(stage)("before-manifest")
        data = data_url.rstrip("/").rsplit("/", 1)[-1]
        manifest = sign({**_manifest(stage, fp, entries, meta), "data": data})
        write_json(join(url, MANIFEST), manifest)
        if previous and previous.get("data") and previous["data"] != data:
            remove_tree(join(url, previous["data"]))
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
        """The output a stage of this pipeline last published, if it still exists.

        Raises:
            SignatureError: The pointer is not signed with the run key.
            UnsafeName: It names a location outside this root's stage outputs.
        """
        location = self.location("latest", pipeline, f"{stage}.json")
        text = read_text_or_none(location)
        if text is None:
            return None
        pointer = loads_verified(text, str(location))
        output = check_under(
            str(pointer.get("output")), self.location("stages", stage), f"{location} 'output'"
        )
        if self.remote:
            return output if remote_manifest(output, strict=False) else None
        return output if Path(output).is_dir() else None

    def record_latest(self, pipeline: str, stage: str, output: str | Path) -> None:
        """Point ``latest/<pipeline>/<stage>.json`` at an output (replaced whole)."""
        write_json(
            self.location("latest", pipeline, f"{stage}.json"), sign({"output": str(output)})
        )

    def read_latest_json(self, pipeline: str, name: str) -> dict | None:
        """``latest/<pipeline>/<name>`` (signature removed), or None when there is none, or
        when it does not parse or verify (logged: it is a hint, never a source of truth)."""
        return read_hint(self.location("latest", pipeline, name), "latest pointer")

    def write_latest_json(self, pipeline: str, name: str, payload: dict) -> Path | str:
        """Replace ``latest/<pipeline>/<name>`` whole; returns its path (URL when remote)."""
        location = self.location("latest", pipeline, name)
        write_json(location, sign(payload))
        return location if self.remote else Path(location)

    def write_run_record(self, run_id: str, record: dict) -> Path | str:
        """Write ``runs/<run_id>/summary.json`` whole; returns its path (URL when remote)."""
        location = safe_join(self.url, f"runs/{run_id}/summary.json", "a run id")
        write_json(location, sign(record))
        return location if self.remote else Path(location)

    def model_location(self, model_name: str, version: str) -> Path | str:
        """Where ``registry/<model>/<version>`` is (a URL when remote)."""
        location = safe_join(self.url, f"registry/{model_name}/{version}", "a model version")
        return location if self.remote else Path(location)

    def is_model_published(self, model_name: str, version: str) -> bool:
        """Whether ``registry/<model>/<version>`` holds a package manifest."""
        location = safe_join(self.url, f"registry/{model_name}/{version}", "a model version")
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
        check_name(version, "a model version")
        if self.remote:
            local = materialize(package)
            url = self.location("registry", model_name, version)
            manifest = loads_verified((local / MANIFEST).read_text(), str(local / MANIFEST))
            _publish_tree(local, url, manifest)
            return url
        problem = check_output_dir(Path(package))
        if problem:
            raise CorruptOutput(f"the export package {package} does not verify: {problem}")
        final = self.root / "registry" / model_name / version
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".staging-{version}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(package, staging)
        replace_dir(staging, final)
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
    etags = upload_files(local, list(files), join(url, data))
    for rel, entry in files.items():
        entry["etag"] = etags[rel]
    (fault or no_fault)("before-manifest")
    published = sign({**manifest, "files": files, "data": data})
    write_json(join(url, MANIFEST), published)
    if previous and previous.get("data") and previous["data"] != data:
        remove_tree(join(url, previous["data"]))
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
        return as_location(location)
    url = str(location).rstrip("/")
    manifest = remote_manifest(url)
    if manifest is None:
        raise InputNotFoundError(
            f"nothing is published at {url} (no {MANIFEST}); run the stage that writes it"
        )
    local = local_mirror(url)
    if (local / MANIFEST).is_file() and json.loads((local / MANIFEST).read_text()) == manifest:
        try:
            if not check_output_dir(local):
                return local
        except (SignatureError, UnsafeName):
            pass  # the copy is downloaded again, whole, below
    # Every name the manifest lists is checked before anything is downloaded.
    for rel in manifest["files"]:
        check_name(rel, f"a file listed in {join(url, MANIFEST)}")
    staging = local.parent / f".staging-{local.name[:16]}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        data = join(url, manifest.get("data", ""))
        download_files(data, list(manifest["files"]), staging)
        for rel, entry in manifest["files"].items():
            path = staging / rel
            if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
                raise CorruptOutput(
                    f"{join(data, rel)} does not match its size and sha256 in "
                    f"{join(url, MANIFEST)}: the object changed after it was "
                    "published. Look for the cause, then run the stage again with "
                    f"--force {manifest.get('stage', '<stage>')} to replace it"
                )
        write_json_durable(staging / MANIFEST, manifest)
        replace_dir(staging, local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def remote_manifest(url: str, strict: bool = True) -> dict | None:
    """The manifest published at `url`, verified (signature, names), None when there is none.

    Its signature is checked first (`artifacts.signing`), then that its data prefix is
    one plain name: only then may a caller use a single name or sha256 from it.

    Raises:
        CorruptOutput: With `strict`, the manifest does not parse.
        SignatureError, UnsafeName: With `strict`, it is unsigned, forged or names a
            data prefix outside its directory. Without `strict` each of these reads as
            no manifest (logged).
    """
    location = join(url, MANIFEST)
    text = read_text_or_none(location)
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
            f"{location} is not a valid manifest ({err}); run the stage "
            "again with --force to replace it"
        ) from err
    try:
        loads_verified(text, str(location))
        if manifest.get("data"):
            check_name(str(manifest["data"]), f"the data prefix in {location}")
            if "/" in str(manifest["data"]):
                raise UnsafeName(f"the data prefix in {location} is not one name")
    except (SignatureError, UnsafeName) as err:
        if strict:
            raise
        _logger.warning("ignoring %s: %s", location, err)
        return None
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
    """Why the output directory `out` does not match its manifest, or "".

    Raises:
        SignatureError: The manifest is not signed with the run key (a forgery).
        UnsafeName: It lists a name outside `out`.
    """
    manifest_path = out / MANIFEST
    if not manifest_path.exists():
        # Publishing renames a directory that already holds its manifest.
        return f"{manifest_path} is missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{manifest_path} is not a valid manifest ({err})"
    loads_verified(manifest_path.read_text(), str(manifest_path))
    for rel, entry in files.items():
        path = Path(safe_join(out, rel, f"a file listed in {manifest_path}"))
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
    data = join(url, manifest.get("data", ""))
    for rel in manifest["files"]:
        check_name(rel, f"a file listed in {join(url, MANIFEST)}")
    fs, path = filesystem(data)
    fs.invalidate_cache(path)
    listing = {
        name.removeprefix(path.rstrip("/") + "/"): info
        for name, info in fs.find(path, detail=True).items()
    }
    for rel, entry in manifest["files"].items():
        info = listing.get(rel)
        if info is None:
            return f"{join(data, rel)} listed in the manifest is missing"
        if info["size"] != entry["bytes"]:
            return f"{join(data, rel)} has {info['size']} bytes, the manifest {entry['bytes']}"
        if entry.get("etag") and etag(info) and etag(info) != entry["etag"]:
            return f"{join(data, rel)} was written again after it was published (its ETag)"
    return ""


def _chaos_fault(stage: str):
    """The fault hook `CHAOS_PUBLISH_FAULT` asks for this stage, or `no_fault`."""
    target, _, point = os.environ.get(CHAOS_PUBLISH_FAULT, "").partition(":")
    if target != stage:
        return no_fault
    if point not in PUBLISH_POINTS:
        raise ValueError(f"{CHAOS_PUBLISH_FAULT}: {point!r} is not one of {PUBLISH_POINTS}")

    def die(name: str) -> None:
        if name == point:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    return die
