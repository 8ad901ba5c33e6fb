"""Where the data stages read and write: a local path or an fsspec URL.

The data libraries take *locations*: a ``pathlib.Path`` (or a plain path) on this
machine, or an object-store URL (``s3://bucket/key``, ``memory://...``). With a URL
every read and write goes through fsspec, so a worker on another machine needs no
shared disk: only the URL and its credentials (boto's usual environment for ``s3://``).

A local location keeps pyarrow's own file I/O (the fast path of one machine). Parquet
and Arrow bytes do not depend on where they are written.
"""

from pathlib import Path
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

Location = str | Path


def is_url(location: Location) -> bool:
    """Whether ``location`` is a URL with a protocol other than ``file://``."""
    protocol, sep, _ = str(location).partition("://")
    return bool(sep) and protocol != "file"


def as_location(location: Location) -> Location:
    """A URL as text, anything else as a Path (``file://`` stripped)."""
    if is_url(location):
        return str(location).rstrip("/")
    return Path(str(location).removeprefix("file://"))


def join(location: Location, *parts: str) -> Location:
    """``location`` with ``parts`` appended: a Path for a path, a URL for a URL."""
    location = as_location(location)
    if isinstance(location, Path):
        return location.joinpath(*parts)
    return "/".join([location, *(p.strip("/") for p in parts if p)])


def base_name(location: Location) -> str:
    """The last component: ``train-00000-of-00004.parquet``."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def _fs(url: str) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(url)


def list_files(location: Location, suffix: str, recursive: bool = False) -> list[Location]:
    """Files directly under ``location`` (every level with ``recursive``) ending in ``suffix``.

    Sorted by path (so by name within a directory); none when ``location`` does not exist.
    """
    location = as_location(location)
    if isinstance(location, Path):
        found = location.rglob(f"*{suffix}") if recursive else location.glob(f"*{suffix}")
        return sorted(p for p in found if p.is_file())
    fs, path = _fs(location)
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
    fs, path = _fs(location)
    return pq.ParquetFile(fs.open(path, "rb"), **options)


def read_schema(location: Location) -> pa.Schema:
    """The Arrow schema of a Parquet file."""
    return open_parquet(location).schema_arrow


def read_bytes(location: Location) -> bytes:
    location = as_location(location)
    if isinstance(location, Path):
        return location.read_bytes()
    fs, path = _fs(location)
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
    fs, path = _fs(location)
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
    fs, path = _fs(location)
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
    urls = [str(x) for x in locations if is_url(x)]
    for path in (as_location(x) for x in locations if not is_url(x)):
        path.unlink(missing_ok=True)
    if urls:
        fs, _ = _fs(urls[0])
        paths = [_fs(u)[1] for u in urls]
        existing = [p for p in paths if fs.exists(p)]
        if existing:
            fs.rm(existing)
