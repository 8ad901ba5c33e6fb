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
    remove_tree,
    safe_join,
    storage_errors,
    upload_files,
)
from artifacts.signing import (
    PLACE,
    Keyring,
    MisplacedRecord,
    SignatureError,
    place,
    read_hint,
    read_verified,
    require_key,
    sign,
)

# The pipeline's stages, in order: the one place their names are spelled.
Stage = Literal["ingest", "preprocess", "shard", "train", "evaluate", "export"]
STAGES: tuple[Stage, ...] = ("ingest", "preprocess", "shard", "train", "evaluate", "export")
# The stages that prepare data (their work may run on a Dask cluster).
DATA_STAGES: tuple[Stage, ...] = STAGES[:3]
# The root when none is given: ./store beside where recforge runs.
DEFAULT_ROOT = "store"
MANIFEST = "_manifest.json"
# Size caps of the small records read back from the root (a manifest has the default,
# `locations.MAX_RECORD_BYTES`): a `latest/` pointer is one URL; the plan's record
# holds each stage's config section and raw file list.
POINTER_BYTES = 64 << 10
LATEST_JSON_BYTES = 8 << 20
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
        """Where `parts` live under the root: a local path or a URL, as text.

        Every part goes through `safe_join`: a pipeline, model or version name such as
        ``/etc/cron.d`` or ``..`` cannot lead outside the root.

        Raises:
            UnsafeName: A part is empty, absolute, holds ``..``, a backslash or a scheme.
        """
        for part in parts:
            check_name(part, "a name under the artifact root (pipeline, stage, model, version)")
        name = "/".join(parts)
        return str(safe_join(self.url if self.remote else self.root, name, f"{name[:80]!r}"))

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
        """Check a published output against its manifest, and the manifest against its place.

        The manifest must be signed for ``place("stage-output", stage, fingerprint)``:
        a genuine manifest copied here from another output is refused. Locally every
        file's size and sha256 is checked; remotely every object's size and ETag, and
        that the data prefix holds nothing the manifest does not list (sha256 is checked
        when an output is materialized, see `materialize`).

        Returns:
            (manifest, "") when every listed file exists with its size and sha256;
            (None, why) when there is no output (never published, or deleted whole).

        Raises:
            MisplacedRecord: The manifest was signed for another output (a relocated
                copy, both places named) or names no place (written before records
                were bound; the message says what rebuilds it).
            SignatureError: It is unsigned, forged, too large or does not parse.
            CorruptOutput: The output was published, but a file it lists is missing or
                has other bytes (or, remotely, an object it does not list was added).
        """
        expected = stage_place(stage, fp)
        if self.remote:
            url = self.output_url(stage, fp)
            manifest = remote_manifest(url, place=expected)
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
        if not out.exists():
            return None, f"no output at {out}"
        manifest, problem = _checked_dir(out, expected)
        if problem:
            raise CorruptOutput(
                f"the {stage} output {out} was published whole but has changed since: "
                f"{problem}. Look for the cause (disk, a hand edit), then run the stage "
                f"again with --force {stage} to replace it"
            )
        return manifest, ""

    def is_published(self, stage: str, fp: str) -> bool:
        """Whether an output's manifest exists (not verified: the plan's cheap look)."""
        if self.remote:
            fs, path = filesystem(self.output_url(stage, fp))
            fs.invalidate_cache(path)
            return fs.exists(f"{path}/{MANIFEST}")
        return (self.output_dir(stage, fp) / MANIFEST).is_file()

    def new_staging(self, stage: str, fp: str) -> Path:
        """A fresh staging directory for one output, writable by this user only.

        Mode 0700: whoever else can write the root (another account on a shared disk)
        cannot add a file to it, so `publish` may sign what it finds there. (For a remote
        root it lies in the local mirror, which the bucket's writers cannot reach.)
        """
        parent = self.root / "stages" / stage
        parent.mkdir(parents=True, exist_ok=True)
        path = parent / f".staging-{fp[:16]}-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
        return path

    def publish(
        self, stage: str, fp: str, staging: Path, meta: dict, written: list[str] | None = None
    ) -> dict:
        """Seal a staging directory with its manifest and put it in place.

        Locally the staging directory is renamed into place. For a remote root its files
        are uploaded under a fresh data prefix, the manifest is written last (the commit),
        and the staging directory becomes the output's local materialized copy. The
        manifest is signed for ``place("stage-output", stage, fingerprint)``.

        Args:
            stage: The stage.
            fp: Its fingerprint.
            staging: A `new_staging` directory the stage wrote into.
            meta: The stage's figures, kept in the manifest.
            written: The files the stage reports writing (relative to `staging`); the
                directory must hold exactly these. None: every file in it (it was made
                by `new_staging`, 0700, and only this process and its children write it).

        Raises:
            CorruptOutput: `written` is given and the directory holds another file or
                lacks one (nothing is published).
        """
        files = describe_files(staging)
        if written is not None:
            _check_exactly(set(files), set(written), str(staging), stage)
        fault = _chaos_fault(stage)
        if self.remote:
            return self._publish_remote(stage, fp, staging, meta, files, fault)
        for rel in files:
            fsync_file(staging / rel)
        fault("before-manifest")
        manifest = sign(_manifest(stage, fp, files, meta), place=stage_place(stage, fp))
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
            staging,
            self.output_url(stage, fp),
            _manifest(stage, fp, files, meta),
            stage_place(stage, fp),
            fault,
        )
        write_json_durable(staging / MANIFEST, manifest)
        replace_dir(staging, self.output_dir(stage, fp))
        return manifest

    def new_data_prefix(self, stage: str, fp: str) -> str:
        """A fresh data prefix of a remote output, for tasks that write there themselves."""
        return join(self.output_url(stage, fp), f"data-{uuid.uuid4().hex[:12]}")

    def publish_prefix(self, stage: str, fp: str, data_url: str, files: dict, meta: dict) -> dict:
        """Seal objects already written under `data_url` (a `new_data_prefix`).

        `files` ({rel: {"bytes", "sha256"[, "rows"]}}) describes what the stage reports
        writing, and the prefix must hold exactly that: every object there with its size,
        and nothing else (an object someone else PUT there while the stage ran is never
        signed). The manifest naming the prefix, with each object's ETag, is written last
        (the commit point), signed for ``place("stage-output", stage, fingerprint)``; then
        the replaced output's objects go.

        Raises:
            CorruptOutput: The prefix holds an object the stage did not write (nothing is
                published; the message names it).
            OSError: An object is missing or has another size than described (transient:
                the stage runs again).
        """
        expected = stage_place(stage, fp)
        url = self.output_url(stage, fp)
        previous = remote_manifest(url, strict=False, place=expected)
        fs, path = filesystem(data_url)
        fs.invalidate_cache(path)
        listing = {
            name.removeprefix(path.rstrip("/") + "/"): info
            for name, info in fs.find(path, detail=True).items()
        }
        _refuse_unreported(set(listing) - set(files), data_url, stage)
        entries = {}
        for rel, entry in sorted(files.items()):
            info = listing.get(rel)
            if info is None or info["size"] != entry["bytes"]:
                raise OSError(f"{join(data_url, rel)} is missing or changed before publishing")
            entries[rel] = {**entry, "etag": etag(info)}
        _chaos_fault(stage)("before-manifest")
        data = data_url.rstrip("/").rsplit("/", 1)[-1]
        manifest = sign({**_manifest(stage, fp, entries, meta), "data": data}, place=expected)
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
            SignatureError: The pointer is not signed with the run key, is too large or
                does not parse.
            MisplacedRecord: It was signed for another pipeline's or stage's pointer.
            UnsafeName: It names a location outside this root's stage outputs.
        """
        name = f"{stage}.json"
        location = self.location("latest", pipeline, name)
        pointer = read_verified(location, place=latest_place(pipeline, name), limit=POINTER_BYTES)
        if pointer is None:
            return None
        output = check_under(
            str(pointer.get("output")), self.location("stages", stage), f"{location} 'output'"
        )
        if self.remote:
            return output if remote_manifest(output, strict=False) else None
        return output if Path(output).is_dir() else None

    def record_latest(self, pipeline: str, stage: str, output: str | Path) -> None:
        """Point ``latest/<pipeline>/<stage>.json`` at an output (replaced whole), signed
        for that place."""
        name = f"{stage}.json"
        write_json(
            self.location("latest", pipeline, name),
            sign({"output": str(output)}, place=latest_place(pipeline, name)),
        )

    def read_latest_json(self, pipeline: str, name: str) -> dict | None:
        """``latest/<pipeline>/<name>`` (signature removed), or None when there is none, or
        when it does not parse or verify, is too large or was signed for another place
        (logged: it is a hint, never a source of truth)."""
        record = read_hint(
            self.location("latest", pipeline, name),
            "latest pointer",
            place=latest_place(pipeline, name),
            limit=LATEST_JSON_BYTES,
        )
        return None if record is None else {k: v for k, v in record.items() if k != PLACE}

    def write_latest_json(self, pipeline: str, name: str, payload: dict) -> Path | str:
        """Replace ``latest/<pipeline>/<name>`` whole; returns its path (URL when remote)."""
        location = self.location("latest", pipeline, name)
        write_json(location, sign(payload, place=latest_place(pipeline, name)))
        return location if self.remote else Path(location)

    def write_run_record(self, run_id: str, record: dict) -> Path | str:
        """Write ``runs/<run_id>/summary.json`` whole, signed for
        ``place("run-record", run_id)``; returns its path (URL when remote)."""
        location = safe_join(self.url, f"runs/{run_id}/summary.json", "a run id")
        write_json(location, sign(record, place=place("run-record", run_id=run_id)))
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

        The export output's manifest (bound to its stage output) is verified, then
        signed again for ``place("package", model, version)``: the registry's copy
        belongs to that version only.

        Args:
            model_name: The registry's model name.
            version: The version's name.
            package: The export output (its path, or URL for a remote root).

        Returns:
            The package's registry directory (its URL when remote).
        """
        check_name(version, "a model version")
        bound = place("package", model=model_name, version=version)
        if self.remote:
            local = materialize(package)
            url = self.location("registry", model_name, version)
            manifest = read_verified(local / MANIFEST, place=output_place(package))
            _publish_tree(local, url, manifest, bound)
            return url
        manifest, problem = _checked_dir(Path(package), output_place(package))
        if problem:
            raise CorruptOutput(f"the export package {package} does not verify: {problem}")
        final = Path(self.location("registry", model_name, version))
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".staging-{version}-{uuid.uuid4().hex[:8]}"
        # Only the files the manifest lists are copied (nothing else that lies beside them).
        staging.mkdir(mode=0o700)
        for rel in manifest["files"]:
            target = Path(safe_join(staging, rel, f"a file listed in {package}/{MANIFEST}"))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(package) / rel, target)
        write_json_durable(staging / MANIFEST, sign(manifest, place=bound))
        replace_dir(staging, final)
        return final


def _publish_tree(
    local: Path, url: str, manifest: dict, bound: dict[str, str], fault: Any = None
) -> dict:
    """Publish the files `manifest` lists from `local` at `url`, whole or not at all.

    They go under a fresh data prefix, then the manifest naming it, signed for the place
    `bound`, is written in one PUT (the commit point); the objects of the manifest it
    replaces go last, once nothing names them.

    Returns:
        The published manifest (with its data prefix and each object's ETag).
    """
    previous = remote_manifest(url, strict=False, place=bound)
    data = f"data-{uuid.uuid4().hex[:12]}"
    files = {rel: dict(entry) for rel, entry in manifest["files"].items()}
    etags = upload_files(local, list(files), join(url, data))
    for rel, entry in files.items():
        entry["etag"] = etags[rel]
    (fault or no_fault)("before-manifest")
    published = sign({**manifest, "files": files, "data": data}, place=bound)
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
        MisplacedRecord: The manifest was signed for another place than `location`
            (`output_place`).
    """
    if not is_remote(location):
        return as_location(location)
    url = str(location).rstrip("/")
    manifest = remote_manifest(url, place=output_place(url))
    if manifest is None:
        raise InputNotFoundError(
            f"nothing is published at {url} (no {MANIFEST}); run the stage that writes it"
        )
    local = local_mirror(url)
    if (local / MANIFEST).is_file():
        try:
            mirrored, problem = _checked_dir(local, output_place(url))
            if not problem and mirrored == manifest:
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


def remote_manifest(
    url: str, strict: bool = True, place: dict[str, str] | None = None
) -> dict | None:
    """The manifest published at `url`, verified (signature, place, names), None when
    there is none.

    It is read up to its size cap, its signature is checked first (`artifacts.signing`),
    then that it was signed for the place it was found at, then that its data prefix is
    one plain name: only then may a caller use a single name or sha256 from it.

    Args:
        url: The output's URL (``.../stages/<stage>/<fp>`` or
            ``.../registry/<model>/<version>``).
        strict: Raise (True) or log and return None (False) when it does not verify.
        place: The place it must be signed for; default: the one its URL names
            (`output_place`).

    Raises:
        CorruptOutput: With `strict`, the manifest lists no files.
        MisplacedRecord: With `strict`, it was signed for another place (a relocated
            copy) or none.
        SignatureError, UnsafeName: With `strict`, it is unsigned, forged, too large,
            does not parse or names a data prefix outside its directory. Without
            `strict` each of these reads as no manifest (logged).
    """
    location = join(url, MANIFEST)
    try:
        manifest = read_verified(location, place=place or output_place(url))
        if manifest is None:
            return None
        if manifest.get("data"):
            check_name(str(manifest["data"]), f"the data prefix in {location}")
            if "/" in str(manifest["data"]):
                raise UnsafeName(f"the data prefix in {location} is not one name")
    except (SignatureError, UnsafeName) as err:
        if strict:
            raise
        _logger.warning("ignoring %s: %s", location, err)
        return None
    if not isinstance(manifest.get("files"), dict):
        if not strict:
            return None
        raise CorruptOutput(
            f"{location} is not a valid manifest (no file list); run the stage again with "
            "--force to replace it"
        )
    return manifest


def stage_place(stage: str, fp: str) -> dict[str, str]:
    """The place a stage output's manifest is signed for."""
    return place("stage-output", stage=stage, fingerprint=fp)


def latest_place(pipeline: str, name: str) -> dict[str, str]:
    """The place of ``latest/<pipeline>/<name>`` (a pointer, ``plan.json``)."""
    return place("latest", pipeline=pipeline, name=name)


def output_place(location: str | Path) -> dict[str, str]:
    """The place a manifest found at `location` must be signed for, read off its path.

    ``.../stages/<stage>/<fp>`` (an output, or its materialized copy in the local mirror)
    is ``place("stage-output", stage, fingerprint)``; ``.../registry/<model>/<version>``
    is ``place("package", model, version)``.

    Raises:
        MisplacedRecord: `location` is neither, so no place can be checked (refused:
            nothing is trusted that cannot be tied to where it was found).
    """
    parts = str(location).rstrip("/").replace("\\", "/").split("/")
    if len(parts) >= 3 and parts[-3] == "stages" and parts[-2] in STAGES:
        return stage_place(parts[-2], parts[-1])
    if len(parts) >= 3 and parts[-3] == "registry":
        return place("package", model=parts[-2], version=parts[-1])
    raise MisplacedRecord(
        f"{location} is neither a stage output (stages/<stage>/<fingerprint>) nor a "
        "registry package (registry/<model>/<version>), so the place its manifest must "
        "name is unknown; read it from where recforge published it"
    )


def output_manifest(location: str | Path) -> dict:
    """The verified manifest of a local output directory (or its materialized copy).

    Its signature and place (`output_place`) are checked, not the files' bytes (`verify`
    and `materialize` did that).

    Raises:
        InputNotFoundError: No manifest there.
        SignatureError: The manifest does not verify (`MisplacedRecord`: another place).
    """
    manifest = read_verified(Path(location) / MANIFEST, place=output_place(location))
    if manifest is None or not isinstance(manifest.get("files"), dict):
        raise InputNotFoundError(
            f"{location} holds no valid {MANIFEST}; run the stage that writes it"
        )
    return manifest


def listed_files(location: str | Path, under: str, suffix: str) -> list[Path]:
    """The files of a local output's manifest directly under `under`/ ending in `suffix`,
    sorted by name (``<location>/events/part-00000-0.parquet``).

    A stage output is exactly its manifest: readers take their inputs from this list,
    never from a directory listing, so a file planted beside the listed ones is never
    read.

    Raises:
        InputNotFoundError: No manifest there.
        SignatureError: The manifest does not verify (`MisplacedRecord`: another place).
    """
    manifest = output_manifest(location)
    return [Path(location) / rel for rel in names_under(manifest, under, suffix)]


def names_under(manifest: dict, under: str, suffix: str) -> list[str]:
    """The names `manifest` lists directly under `under`/ that end in `suffix`, sorted."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    return sorted(
        rel
        for rel in manifest["files"]
        if rel.startswith(prefix) and "/" not in rel[len(prefix) :] and rel.endswith(suffix)
    )


def _check_exactly(found: set[str], reported: set[str], where: str, stage: str) -> None:
    """Refuse to publish unless `where` holds exactly the files the stage reported.

    Raises:
        CorruptOutput: An unreported file is there (`_refuse_unreported`) or a reported
            one is missing.
    """
    _refuse_unreported(found - reported, where, stage)
    missing = sorted(reported - found)
    if missing:
        raise CorruptOutput(
            f"{where} lacks {', '.join(missing[:3])}, which the {stage} stage reports "
            "writing; nothing was published. Run the stage again"
        )


def _refuse_unreported(unreported: set[str], where: str, stage: str) -> None:
    """Refuse to publish files the stage did not report writing.

    Raises:
        CorruptOutput: Names up to three of them: someone else wrote there, and what
            they wrote is never signed.
    """
    extra = sorted(unreported)
    if extra:
        raise CorruptOutput(
            f"{where} holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, which "
            f"the {stage} stage did not write: someone else wrote there while it ran. Nothing "
            "was published (an output is exactly the files its stage wrote); find out who can "
            "write under the root, then run again"
        )


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


def check_output_dir(out: Path, place: dict[str, str] | None = None) -> str:
    """Why the output directory `out` does not match its manifest, or "".

    Args:
        out: A stage output or registry package directory (or its local copy).
        place: The place its manifest must be signed for; default: the one its path
            names (`output_place`).

    Raises:
        SignatureError: The manifest is not signed with the run key (a forgery), is
            too large or does not parse.
        MisplacedRecord: It was signed for another place (a relocated copy) or none.
        UnsafeName: It lists a name outside `out`.
    """
    return _checked_dir(out, place or output_place(out))[1]


def _checked_dir(out: Path, expected: dict[str, str]) -> tuple[dict | None, str]:
    """(the verified manifest, "") of the output directory `out`, or (None|manifest, why
    it does not match its files); raises as `check_output_dir`."""
    manifest_path = Path(out) / MANIFEST
    if not manifest_path.exists():
        # Publishing renames a directory that already holds its manifest.
        return None, f"{manifest_path} is missing"
    manifest = read_verified(manifest_path, place=expected)
    if manifest is None:
        return None, f"{manifest_path} is missing"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None, f"{manifest_path} is not a valid manifest (no file list)"
    return manifest, _check_files(Path(out), manifest_path, files)


def _check_files(out: Path, manifest_path: Path, files: dict) -> str:
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
    recorded one, its ETag (which changes whenever an object is written again); and the
    data prefix must hold nothing else (an output is exactly its manifest's files).
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
    if not manifest.get("data"):
        listing.pop(MANIFEST, None)
    extra = sorted(set(listing) - set(manifest["files"]))
    if extra:
        return (
            f"{join(data, extra[0])} is not listed in the manifest (someone else wrote it "
            f"there{f', and {len(extra) - 1} more' if len(extra) > 1 else ''})"
        )
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
