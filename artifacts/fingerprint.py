"""Fingerprints: what names a stage output, so the same inputs land in the same place.

fingerprint = sha256 of the stage's config section (canonical JSON), the fingerprints of
its inputs and the stage's code version. The code version covers every first-party
module the stage can run: the import closure of its task module, computed from the
source (never listed by hand), plus the versions of the libraries that change what it
computes.
"""

import ast
import hashlib
import json
import os
import re
from importlib import metadata
from pathlib import Path

from artifacts.durable import file_sha256, write_json_atomic
from artifacts.locations import Location, as_location, cache_dir, etag, filesystem, is_remote


def fingerprint(stage: str, section: dict, inputs: list[str], code: str) -> str:
    """sha256 of the stage name, its config (canonical JSON), upstream fingerprints and code."""
    payload = json.dumps(
        {"stage": stage, "config": section, "inputs": inputs, "code": code},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


# The first-party packages: a stage's code is the closure of their modules it imports.
# A stage output's fingerprint, as stored names carry it (sha256 hex).
FINGERPRINT = re.compile(r"[0-9a-f]{64}")

FIRST_PARTY = ("artifacts", "data_prep", "training", "tasks")


# Installed libraries whose version changes what a stage computes.
VERSIONED_LIBRARIES = ("torch", "deepspeed", "pyarrow")


_MODULE_NAME = re.compile(r"^(?:artifacts|data_prep|training|tasks)(?:\.[A-Za-z_]\w*)+$")


def module_closure(entry: str, root: Path) -> list[str]:
    """Every first-party module a stage can run, as paths relative to `root`.

    Starts from `entry` (a stage's task module, e.g. "tasks.train"), itself included, and
    follows imports transitively through every package of `FIRST_PARTY` (the task
    modules, the libraries and the artifact store alike: an edit to how a task calls its
    library changes what the stage computes as surely as an edit to the library). A
    string constant that names a first-party module counts as an import: that is how a
    launcher starts its rank modules (`python -m training.ctr.worker`).

    A module's top-level imports are always followed (they run when it is imported). Its
    function-level imports are followed for the functions and classes the stage can
    reach: those imported by name (`from training.stages import evaluate`), those its
    module-level code names, and those they name in turn. So one module can hold the
    entries of several stages (`training.stages`) and import each family's code inside
    the entry that runs it, and editing the export code does not rerun training. A module
    imported whole (`import m`, `from pkg import m`, a module named by string) counts
    with every function.

    Raises:
        FileNotFoundError: `entry` is not a module under `root`.
    """
    start = _module_file(entry, root)
    if start is None:
        raise FileNotFoundError(f"stage entry module {entry!r} is not under {root}")
    wanted: dict[Path, frozenset[str] | None] = {start: None}
    followed: dict[Path, frozenset[str] | None] = {}
    pending = [start]
    while pending:
        path = pending.pop()
        want = wanted[path]
        done = followed.get(path, frozenset())
        if path in followed and (done is None or (want is not None and want <= done)):
            continue
        followed[path] = want
        for file, names in _imported_files(path, root, want):
            before = wanted.get(file, frozenset())
            merged = None if before is None or names is None else before | names
            if file not in wanted or merged != before:
                wanted[file] = merged
                pending.append(file)
    return sorted(str(p.relative_to(root)) for p in followed)


def _module_file(name: str, root: Path) -> Path | None:
    """The file of module `name` under `root` (a package's __init__.py), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _reachable_nodes(tree: ast.Module, want: frozenset[str] | None) -> list[ast.AST]:
    """The parts of a module that run when the names `want` are used (None: all of it).

    Module-level statements always run; a top-level function or class runs when it is
    wanted, or named by module-level code or by another one that runs.
    """
    if want is None:
        return [tree]
    defs = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    nodes: list[ast.AST] = [node for node in tree.body if node not in defs.values()]
    reached: set[str] = set()
    todo = [name for name in want if name in defs]
    for node in nodes:
        todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in defs]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    return nodes + [defs[name] for name in sorted(reached)]


def _imported_files(
    path: Path, root: Path, want: frozenset[str] | None
) -> list[tuple[Path, frozenset[str] | None]]:
    """(module file, names it is used for; None: all) of what the reachable parts of
    `path` (`_reachable_nodes`) import or name by string, the packages on the way included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, frozenset[str] | None]] = []
    for part in _reachable_nodes(tree, want):
        for node in ast.walk(part):
            if isinstance(node, ast.Import):
                found += [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = frozenset(alias.name for alias in node.names)
                found.append((node.module, names))
                # `from training.sequence import bst_export` imports a module, not a name.
                found += [(f"{node.module}.{name}", None) for name in names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if _MODULE_NAME.match(node.value):
                    found.append((node.value, None))
    files = []
    for name, names in found:
        parts = name.split(".")
        if parts[0] not in FIRST_PARTY:
            continue
        # The packages on the way are imported too (their __init__.py runs).
        for depth in range(1, len(parts)):
            file = _module_file(".".join(parts[:depth]), root)
            if file is not None:
                files.append((file, frozenset()))
        file = _module_file(name, root)
        if file is not None:
            files.append((file, names))
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


# Where computed content digests are remembered, under the local cache directory.
DIGESTS_DIR = "digests"


def content_sha256(location: Location, memo_dir: Path | None = None) -> str:
    """sha256 of a file's bytes (a path or an object URL), computed once per version.

    Raw input is keyed by content, so the same bytes at another path or under a new
    mtime hit the cache, and changed bytes never do. Hashing costs one read of the file
    (866 MB/s here, `bench/input_digest.py`); the digest is remembered per version of
    the file, so a rerun reads nothing. A local file's version is its (device, inode,
    size, mtime_ns, ctime_ns): ctime cannot be set by a user and moves with every write and every
    `touch`, so bytes changed under a restored mtime are hashed again. An object's
    version is its (URL, size, ETag): the ETag changes whenever an object is written.
    The memo lives on this machine (`memo_dir`, default under `cache_dir()`), never in
    the bucket, and a version that changes while it is hashed is not remembered.

    Args:
        location: The file.
        memo_dir: Where digests are remembered (default `<cache_dir>/digests`).

    Returns:
        The hex sha256 of the file's stored bytes (compressed files are not
        decompressed).
    """
    memo_dir = memo_dir or cache_dir() / DIGESTS_DIR
    stamp = _version(location)
    memo = memo_dir / f"{hashlib.sha256(json.dumps(stamp).encode()).hexdigest()}.json"
    remembered = _read_memo(memo)
    if remembered.get("version") == stamp and len(str(remembered.get("sha256", ""))) == 64:
        return remembered["sha256"]
    digest = file_sha256(location)
    if _version(location) == stamp:
        write_json_atomic(memo, {"version": stamp, "sha256": digest})
    return digest


def _read_memo(memo: Path) -> dict:
    """A remembered digest, or {} when there is none (or it does not parse: hash again)."""
    try:
        remembered = json.loads(memo.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return remembered if isinstance(remembered, dict) else {}


def _version(location: Location) -> list:
    """What identifies one version of a file's bytes without reading them."""
    if is_remote(location):
        fs, path = filesystem(str(location))
        fs.invalidate_cache(path)
        info = fs.info(path)
        tag = etag(info) or str(info.get("LastModified") or info.get("mtime") or "")
        return [str(location), info.get("size"), tag]
    stat = os.stat(as_location(location))
    return [
        str(Path(as_location(location)).resolve()),
        stat.st_dev,
        stat.st_ino,
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ctime_ns,
    ]
