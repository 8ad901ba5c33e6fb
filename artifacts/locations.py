"""Where recforge reads and writes: a local path or an fsspec URL, the one adapter.

Every layer takes *locations*: a ``pathlib.Path`` (or a plain path) on this machine, or
an object-store URL (``s3://bucket/key``, ``memory://...``). With a URL every read and
write goes through fsspec, so a worker on another machine needs no shared disk: only
the URL and its credentials (boto's usual environment for ``s3://``).

A local location keeps pyarrow's own file I/O (the fast path of one machine). Parquet
and Arrow bytes do not depend on where they are written.

The local side of a remote artifact root (staging, materialized outputs, resume
checkpoints) lives under ``$RECFORGE_CACHE_DIR`` (default ``~/.cache/recforge``), at
``<cache>/<protocol>/<bucket>/<prefix>/...`` mirroring the URL (`local_mirror`).
"""

import difflib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from artifacts.errors import ConfigError, SignatureError, StoreUnreachable

# Where the local side of a remote store lives (see the module docstring).
CACHE_DIR_ENV = "RECFORGE_CACHE_DIR"
# Object stores whose first path component is a bucket that must exist beforehand.
BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
# "s3:/bucket" or "s3:bucket": a URL scheme without its "//", which would otherwise be
# taken for a local directory named "s3:".
_MALFORMED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:(?!//)")

Location = str | Path


def is_remote(location: Location) -> bool:
    """Whether ``location`` is an object-store URL (``s3://``, ``gs://``, ...).

    ``file://`` URLs and plain paths are local.
    """
    protocol, sep, _ = str(location).partition("://")
    return bool(sep) and protocol != "file"


def as_location(location: Location) -> Location:
    """A URL as text, anything else as a Path (``file://`` stripped)."""
    if is_remote(location):
        return str(location).rstrip("/")
    return Path(str(location).removeprefix("file://"))


def join(location: Location, *parts: str) -> Location:
    """``location`` with ``parts`` appended: a Path for a path, a URL for a URL."""
    location = as_location(location)
    if isinstance(location, Path):
        return location.joinpath(*parts)
    return "/".join([location, *(p.strip("/") for p in parts if p)])


class UnsafeName(ConfigError):
    """A name read back from storage would leave the directory it is joined onto."""


# A URL scheme at the start of a segment ("s3:", "file:", "C:").
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def check_name(name: str, what: str) -> list[str]:
    """The segments of a relative name read from storage, after refusing unsafe ones.

    Refused: a non-string or empty name, an absolute path, a backslash, a NUL or other
    control character, a URL scheme, and any empty, ``.`` or ``..`` segment.

    Raises:
        UnsafeName: Naming `what` (where the name came from) and why.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeName(f"{what}: {name!r} is not a relative name; refusing it")
    shown = repr(name[:80])
    reason = ""
    if name.startswith("/"):
        reason = "is an absolute path"
    elif "\\" in name:
        reason = "holds a backslash"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        reason = "holds a control character"
    elif _SCHEME.match(name) or "://" in name:
        reason = "is a URL or names a drive"
    else:
        segments = name.split("/")
        if any(s in ("", ".", "..") for s in segments):
            reason = "has an empty, '.' or '..' segment"
    if reason:
        raise UnsafeName(
            f"{what}: {shown} {reason}; a stored name must stay under its directory, so "
            "nothing was read or written for it. Someone other than recforge wrote it"
        )
    return name.split("/")


def safe_join(root: Location, name: str, what: str) -> Location:
    """`root` joined with a name read from storage, proven to stay under `root`.

    The one join every stored name goes through (manifest entries, exchange keys,
    registry versions, CHAMPION and its `previous`, run ids): `check_name`, then, for a
    local root, the resolved path (symlinks followed) must lie under the resolved root.

    Raises:
        UnsafeName: The name is unsafe, or resolves outside `root`.
    """
    segments = check_name(name, what)
    location = as_location(root)
    if not isinstance(location, Path):
        return "/".join([location, *segments])
    joined = location.joinpath(*segments)
    if not joined.resolve().is_relative_to(location.resolve()):
        raise UnsafeName(
            f"{what}: {name[:80]!r} resolves outside {location} (a symlink on the way); refusing it"
        )
    return joined


def check_under(url: str, root: str, what: str) -> str:
    """A location read back from storage, refused unless it lies under the run's `root`.

    Raises:
        UnsafeName: `url` is elsewhere (another bucket, http://, file://, a `..`).
    """
    text, base = str(url).rstrip("/"), str(root).rstrip("/")
    if not isinstance(url, str | Path) or not text.startswith(base + "/"):
        raise UnsafeName(
            f"{what}: {text[:120]!r} is not under the artifact root {base}; a location read "
            "back from storage must stay in its root, so it was not followed"
        )
    check_name(text[len(base) + 1 :], what)
    return text


def base_name(location: Location) -> str:
    """The last component: ``train-00000-of-00004.parquet``."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def list_files(location: Location, suffix: str, recursive: bool = False) -> list[Location]:
    """Files directly under ``location`` (every level with ``recursive``) ending in ``suffix``.

    Sorted by path (so by name within a directory); none when ``location`` does not exist.
    """
    location = as_location(location)
    if isinstance(location, Path):
        found = location.rglob(f"*{suffix}") if recursive else location.glob(f"*{suffix}")
        return sorted(p for p in found if p.is_file())
    fs, path = filesystem(location)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    names = fs.find(path) if recursive else fs.ls(path, detail=False)
    prefix = location[: len(location) - len(path)] if location.endswith(path) else ""
    files = sorted(n for n in names if n.endswith(suffix))
    return [f"{prefix}{n}" if prefix else fs.unstrip_protocol(n) for n in files]


def open_parquet(location: Location, **options: Any) -> pq.ParquetFile:
    """A ``pyarrow.parquet.ParquetFile`` of a local file or an object (read through fsspec)."""
    location = as_location(location)
    if isinstance(location, Path):
        return pq.ParquetFile(location, **options)
    fs, path = filesystem(location)
    return pq.ParquetFile(fs.open(path, "rb"), **options)


def read_schema(location: Location) -> pa.Schema:
    """The Arrow schema of a Parquet file."""
    return open_parquet(location).schema_arrow


def read_bytes(location: Location) -> bytes:
    location = as_location(location)
    if isinstance(location, Path):
        return location.read_bytes()
    fs, path = filesystem(location)
    return fs.cat_file(path)


def read_text(location: Location) -> str:
    return read_bytes(location).decode()


def write_bytes(location: Location, data: bytes) -> None:
    """Write a whole file (one PUT for an object)."""
    location = as_location(location)
    if isinstance(location, Path):
        location.parent.mkdir(parents=True, exist_ok=True)
        location.write_bytes(data)
        return
    fs, path = filesystem(location)
    fs.pipe_file(path, data)


def write_text(location: Location, text: str) -> None:
    write_bytes(location, text.encode())


def open_output(location: Location) -> str | IO[bytes]:
    """Where a streaming writer (``pq.ParquetWriter``) writes: a path, or an open object.

    An object becomes visible whole when ``close_output`` closes it (for ``s3://`` the
    multipart upload completes then). The caller closes it after its writer.
    """
    location = as_location(location)
    if isinstance(location, Path):
        location.parent.mkdir(parents=True, exist_ok=True)
        return str(location)
    fs, path = filesystem(location)
    return fs.open(path, "wb")


def close_output(sink: str | IO[bytes]) -> None:
    """Close what ``open_output`` opened (nothing to do for a path)."""
    if not isinstance(sink, str):
        sink.close()


def write_arrow(location: Location, table: pa.Table) -> None:
    """A table as one uncompressed Arrow IPC stream (a spill part), written whole."""
    location = as_location(location)
    if isinstance(location, Path):
        location.parent.mkdir(parents=True, exist_ok=True)
        with pa.ipc.new_stream(str(location), table.schema) as writer:
            writer.write_table(table)
        return
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    write_bytes(location, sink.getvalue().to_pybytes())


def read_arrow(location: Location) -> pa.Table:
    """A table written by ``write_arrow``."""
    location = as_location(location)
    if isinstance(location, Path):
        with pa.ipc.open_stream(str(location)) as reader:
            return reader.read_all()
    with pa.ipc.open_stream(pa.py_buffer(read_bytes(location))) as reader:
        return reader.read_all()


def remove(locations: list[Location]) -> None:
    """Delete files (missing ones are fine)."""
    urls = [str(x) for x in locations if is_remote(x)]
    for path in (as_location(x) for x in locations if not is_remote(x)):
        path.unlink(missing_ok=True)
    if urls:
        fs, _ = filesystem(urls[0])
        paths = [filesystem(u)[1] for u in urls]
        existing = [p for p in paths if fs.exists(p)]
        if existing:
            fs.rm(existing)


def check_location(location: Location, what: str) -> Location:
    """``location`` as ``as_location`` gives it, after checking it is well formed.

    Refused, each with a "did you mean" line: a scheme without ``//`` (``s3:/bucket``,
    ``s3:bucket``), a scheme fsspec does not know (``s4://``), a local path that starts
    like a URL missing its colon (``s3//bucket``), and a URL without a path.

    Args:
        location: A path or URL typed by a person (a flag, a config field).
        what: What it is, for the message (``"--root"``, ``"ingest.path"``).

    Raises:
        ConfigError: Naming `what`, the value and the likely intended one.
    """
    text = str(location)
    if _MALFORMED_URL.match(text):
        scheme, _, rest = text.partition(":")
        raise ConfigError(
            f"{what}={text!r} looks like a URL without '//' after '{scheme}:'; did you "
            f"mean {scheme}://{rest.lstrip('/')}? (A local path has no ':' there.)"
        )
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() not in known_schemes():
        guess = difflib.get_close_matches(
            scheme.lower(), [*_COMMON_SCHEMES, *BUCKET_PROTOCOLS, "memory"], n=1, cutoff=0.5
        )
        hint = f"did you mean {guess[0]}://{rest}? " if guess else ""
        raise ConfigError(
            f"{what}={text!r}: unknown storage scheme '{scheme}://'; {hint}Use a local path "
            f"or one of {', '.join(_COMMON_SCHEMES)}:// (any fsspec protocol)"
        )
    first, slashes, rest = text.partition("//")
    if slashes and first.lower() in {*BUCKET_PROTOCOLS, "hdfs", "http", "https", "memory"}:
        raise ConfigError(
            f"{what}={text!r} is a local path that starts like a URL; did you mean "
            f"{first}://{rest}? (For a local directory of that name, write ./{text}.)"
        )
    if is_remote(text) and not rest_of(text).strip("/"):
        raise ConfigError(f"{what}={text!r} names no bucket or path after '://'")
    return as_location(text)


# The schemes a "did you mean" suggests first, and the list a message shows.
_COMMON_SCHEMES = ("s3", "gs", "az", "abfs", "hdfs", "file")


def known_schemes() -> set[str]:
    """The URL schemes fsspec knows (installed or not), lower case."""
    from fsspec.registry import known_implementations, registry

    return {name.lower() for name in (*known_implementations, *registry)}


def rest_of(url: str) -> str:
    """What follows ``scheme://`` in a URL."""
    return url.partition("://")[2]


def cache_dir() -> Path:
    """Where the local side of remote stores lives: $RECFORGE_CACHE_DIR or ~/.cache/recforge."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "recforge"


def local_mirror(url: str) -> Path:
    """The local directory that mirrors `url`: ``<cache>/<protocol>/<bucket>/<key>``."""
    protocol, _, path = url.partition("://")
    return cache_dir() / protocol / path.strip("/")


def filesystem(url: str, **options: Any) -> tuple[Any, str]:
    """The fsspec filesystem of `url` and the path in it (`options` to its constructor).

    Raises:
        ConfigError: The protocol's package is not installed (s3fs for `s3://`).
    """
    try:
        return fsspec.core.url_to_fs(url, **options)
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


# The largest record (a manifest, a pointer, a run record) read back from storage, unless
# the reader names its own cap: a stage manifest of 100k files is about 20 MB.
MAX_RECORD_BYTES = 64 << 20


def read_text_or_none(location: str | Path, limit: int = MAX_RECORD_BYTES) -> str | None:
    """A small file's text (a manifest, a pointer, a record), or None when it is missing.

    At most `limit` bytes are read: an object planted in the bucket cannot make a reader
    hold gigabytes, and bytes that are not UTF-8 are an unreadable record, not a crash.

    Raises:
        SignatureError: The object is larger than `limit`, or is not UTF-8 text.
    """
    try:
        if not is_remote(location):
            with open(as_location(location), "rb") as handle:
                data = handle.read(limit + 1)
        else:
            fs, path = filesystem(str(location))
            # A ranged GET: the object's first limit + 1 bytes, never more.
            data = fs.cat_file(path, start=0, end=limit + 1)
    except FileNotFoundError:
        return None
    if len(data) > limit:
        raise SignatureError(
            f"{location} is larger than {limit} bytes, the cap for this kind of record: "
            "recforge never wrote it; refusing to read it"
        )
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise SignatureError(
            f"{location} is not UTF-8 text (byte {err.start}): recforge never wrote it; refusing it"
        ) from err


def upload_files(local_dir: Path, rels: list[str], url: str) -> dict[str, str | None]:
    """Upload `local_dir/<rel>` to `url/<rel>` for each rel; returns each object's ETag."""
    fs, path = filesystem(url)
    if rels:
        fs.put([str(local_dir / rel) for rel in rels], [f"{path}/{rel}" for rel in rels])
    fs.invalidate_cache(path)
    listing = fs.find(path, detail=True) if rels else {}
    return {rel: etag(listing.get(f"{path}/{rel}", {})) for rel in rels}


def download_files(url: str, rels: list[str], local_dir: Path) -> None:
    """Download `url/<rel>` to `local_dir/<rel>` for each rel.

    Every rel is checked (`safe_join`) before anything is written.

    Raises:
        UnsafeName: A rel would land outside `local_dir`.
    """
    fs, path = filesystem(url)
    targets = [Path(safe_join(local_dir, rel, f"a file listed for {url}")) for rel in rels]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    if rels:
        fs.get([f"{path}/{rel}" for rel in rels], [str(target) for target in targets])


def remove_tree(url: str) -> None:
    """Delete every object under `url` (nothing when there are none)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    found = fs.find(path)
    if found:
        fs.rm(found)


def etag(info: dict) -> str | None:
    """An object's ETag from an fsspec listing (s3fs: "ETag", gcsfs: "etag"), or None."""
    tag = info.get("ETag") or info.get("etag")
    return str(tag) if tag else None
