"""Durable writes: fsync, write-then-rename, whole-object PUTs and conditional writes.

The one set of helpers every writer of recforge uses (stage outputs, the registry's
pointer, checkpoints): a file is fsynced before it is renamed into place and the
directory after, so a reader sees the old or the new version, whole, after a crash or a
power loss; on object storage a small object is replaced by one PUT (visible whole or
not at all), and a pointer moves only by a conditional write.
"""

import errno
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from artifacts.errors import ConcurrentUpdate, ConfigError, InputNotFoundError
from artifacts.locations import as_location, etag, filesystem, is_remote, read_text_or_none

FaultHook = Callable[[str], None]


def no_fault(point: str) -> None:
    """No fault injected (the default fault hook)."""


def file_sha256(location: Path | str) -> str:
    """Hex sha256 of a file's bytes: a local path, or an object URL read through fsspec."""
    digest = hashlib.sha256()
    if is_remote(location):
        fs, path = filesystem(str(location))
        handle = fs.open(path, "rb")
    else:
        handle = open(as_location(location), "rb")  # noqa: SIM115 - closed below
    with handle:
        while block := handle.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    """fsync one file (read-only open is enough on Linux to flush its dirty pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory so the entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some filesystems (FUSE mounts, a few network ones) cannot fsync a
        # directory at all; their renames are as durable as they get.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(paths: Path | Iterable[Path]) -> None:
    """Flush files and directories to stable storage.

    A file is fsynced together with its parent directory (so its directory entry
    survives a power loss); a directory is fsynced with everything below it.

    Args:
        paths: A file or directory, or several.

    Raises:
        InputNotFoundError: If a path does not exist.
        OSError: If the filesystem fails an fsync.
    """
    for path in [paths] if isinstance(paths, str | os.PathLike) else list(paths):
        path = Path(path)
        if path.is_dir():
            for directory, _, files in os.walk(path):
                for name in files:
                    fsync_file(Path(directory) / name)
                fsync_dir(Path(directory))
        elif path.exists():
            fsync_file(path)
            fsync_dir(path.parent)
        else:
            raise InputNotFoundError(
                f"cannot fsync {path}: it does not exist; pass the files this rank wrote"
            )


def write_json_durable(path: Path, payload: dict) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2, default=str)
        handle.flush()
        os.fsync(handle.fileno())


def replace_file(partial: Path, path: Path) -> None:
    """Put a fully written file in place: fsync it, rename it over `path`, fsync the
    directory, so that after a crash `path` is the old file or the new one, whole."""
    fsync_file(partial)
    os.replace(partial, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON next to ``path`` and rename it into place: readers see old or new, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
    write_json_durable(tmp, payload)
    replace_file(tmp, path)


def replace_dir(staging: Path, final: Path, fault: FaultHook = no_fault) -> None:
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


def write_json(location: str | Path, payload: dict) -> None:
    """Replace a JSON file whole: locally by rename, remotely by one PUT."""
    if not is_remote(location):
        write_json_atomic(as_location(location), payload)
        return
    fs, path = filesystem(str(location))
    fs.pipe_file(path, json.dumps(payload, indent=2, default=str).encode())


def read_object(location: str | Path) -> tuple[str | None, str | None]:
    """(text, version tag) of an object, (None, None) when missing.

    The tag is what `write_json_if` compares: the ETag remotely, a hash locally.
    """
    text = read_text_or_none(location)
    if text is None or not is_remote(location):
        tag = None if text is None else hashlib.sha256(text.encode()).hexdigest()
        return text, tag
    fs, path = filesystem(str(location))
    info = fs.info(path)
    # A write between the read and the HEAD makes the tag newer than the text: the
    # conditional write then fails where it could have succeeded, never the other way.
    return text, etag(info)


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
        path = as_location(location)
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
