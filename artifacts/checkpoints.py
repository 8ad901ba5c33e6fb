"""Crash-safe checkpoint directories: stage, fsync, manifest, rename, pointer, retention.

DeepSpeed's `engine.save_checkpoint` writes its files in place, and its loader
quietly starts from scratch when the `latest` file is missing. This module wraps
whatever the ranks write (DeepSpeed's files, sparse shards, client state) in a
protocol where a save either commits completely or leaves the previous checkpoint
as the resume point, whatever moment a rank dies at.

Layout under `root` (one training run, one save in flight at a time):

    root/
      step-00000100/            a committed checkpoint: the ranks' files + _manifest.json
      step-00000200/
      .staging/step-00000300/   a save being written (never returned by a scan)
      latest                    "step-00000200\\n": the newest commit, a hint only

`_manifest.json` holds {"step", "meta", "files": {relpath: {"size", "sha256"}},
"created", "place", "signature"} (the run key's HMAC, `artifacts.signing`: without a
valid one no file of the checkpoint is trusted, so DeepSpeed's unpickling loader never
sees it). Its place is ``place("checkpoint", fingerprint=<the run's resume key>,
step=<step>)``: a manifest copied from another run's checkpoints, or from another step,
is refused wherever it is read, naming both places. The resume key is the store's
`fingerprint` (by default the name of `root`, which the train task names by it:
``checkpoints/train/<key>``).
It is written (and fsynced) last inside the staging directory, and the
rename of the staging directory to `root/step-NNNNNNNN` is the commit point: a
directory under `root` named like a step either holds a complete manifest or was
damaged after the fact, which `verify` detects.

Protocol (rank 0 drives, the caller does the barriers)::

    if rank == 0:
        store.prepare(step)               # clears stale staging, creates the directory
    barrier()
    staging = store.staging_dir(step)     # the same path on every rank
    engine.save_checkpoint(str(staging), tag="state")   # or any files, any layout
    fsync_tree(staging)                   # each rank, on its own node
    barrier()
    if rank == 0:
        store.commit(step, meta={...})    # manifest, rename, pointer, retention
    barrier()

    resume = store.latest_valid(strict=True)   # verified newest, by step number
    if resume is not None:
        engine.load_checkpoint(str(resume.path), tag="state")

Each rank must fsync its own files because on a shared filesystem a file's dirty
pages live on the node that wrote it; rank 0's fsync in `commit` covers only what
its own node wrote (on a single node it covers everything).

Chains (differential checkpoints, issue 41): a checkpoint whose meta has a `chain` holds
only what changed since the checkpoint before it, and is whole only with the
checkpoints it builds on. `chain` lists them, base first, each as {"step",
"files_sha256", ...}: `files_digest` of that checkpoint's manifest (the sha256 of its
file list with every file's size and sha256), so the signed meta of the newest
checkpoint binds every byte of its chain, and a node's own copy of a member (nodes
that share no disk commit each their own manifest of the same files) matches too. A checkpoint
counts as valid (for `latest_valid`, `prepare` and retention) only when every member
of its chain is committed, verifies and holds those files; retention keeps the chains
of the checkpoints it keeps, and removes a chain once a newer base replaces it.

Reads and writes only under `root`; no Prefect, no torch, no environment.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from artifacts.durable import file_sha256, fsync_dir
from artifacts.errors import ConfigError, DataError, InputNotFoundError
from artifacts.locations import UnsafeName, read_text_or_none, safe_join
from artifacts.signing import SignatureError, loads_verified, place, sign

MANIFEST = "_manifest.json"
POINTER = "latest"
# Meta key of a differential checkpoint: the checkpoints it builds on, base first.
CHAIN = "chain"
STAGING = ".staging"

# Where `fault` is called during `commit`, in order. A death at any point before
# "before-pointer" leaves the previous checkpoint as the resume point; from
# "before-pointer" on, the rename has happened and the new checkpoint is committed.
FAULT_POINTS = (
    "after-files",  # commit entered: the ranks' files exist, rank 0 has not fsynced them
    "mid-manifest",  # half of _manifest.json is on disk (a torn manifest write)
    "before-rename",  # manifest complete and fsynced, staging not yet renamed
    "before-pointer",  # renamed into root, `latest` still names the previous checkpoint
    "mid-pointer",  # latest.tmp written and fsynced, not yet moved over `latest`
    "before-retention",  # pointer flipped, no old checkpoint removed yet
    "mid-retention",  # one old checkpoint moved into .staging, not yet deleted
)

_STEP_NAME = re.compile(r"step-(\d+)")
_logger = logging.getLogger(__name__)


class CheckpointCorrupt(DataError):
    """Committed checkpoints exist, but none of them verifies."""


class CheckpointExists(DataError):
    """A valid checkpoint of this step is already committed."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint that passed `CheckpointStore.verify`.

    Attributes:
        path: The checkpoint directory, `root/step-NNNNNNNN`.
        step: The training step it was saved at.
        meta: The `meta` dict given to `commit` (e.g. the resolved config).
        chain: The committed checkpoints it builds on (its meta's `chain`), base
            first, each verified too; empty for a whole checkpoint.
    """

    path: Path
    step: int
    meta: dict[str, Any]
    chain: tuple[Path, ...] = ()


def checkpoint_name(step: int) -> str:
    """The directory name of a step's checkpoint.

    Args:
        step: Training step, >= 0.

    Returns:
        `step-NNNNNNNN` (zero-padded to 8 digits, so names sort like steps up to 10^8).

    Raises:
        ValueError: If `step` is not a non-negative int.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None if it is not one.

    Args:
        name: A directory name.

    Returns:
        The step, or None unless `name` is exactly what `checkpoint_name` writes.
    """
    match = _STEP_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    # "step-100" or "step-000000100" are not ours: only the exact spelling counts.
    return step if checkpoint_name(step) == name else None


class CheckpointStore:
    """Committed, verified checkpoints of one training run under `root`.

    One save at a time per `root`: `prepare` deletes everything in `.staging/`.
    `prepare` and `commit` are rank 0's; `staging_dir`, `verify` and `latest_valid`
    may be called from any rank (verifying hashes every file, so on many ranks prefer
    rank 0 verifying and broadcasting the step).

    Args:
        root: The checkpoint directory; created by the first `prepare`.
        keep: How many valid checkpoints retention keeps, >= 1.
        log: Receives one line per notable event (a fallback, a stale pointer, a
            cleanup); default: this module's logger at WARNING.
        fault: Test hook, called with each name in `FAULT_POINTS` as `commit` passes it.
        pinned: Steps retention never removes, besides the `keep` newest (e.g. the
            best validation checkpoint); see `pin`.
        fingerprint: The resume key of the run these checkpoints belong to: every
            manifest is signed for it (and its step), and one signed for another run
            is refused. Default: the name of `root` (the train task's
            ``checkpoints/train/<key>``); give it explicitly where `root` is named
            otherwise, the same for the ranks that write and every reader.

    Raises:
        ConfigError: If `keep` < 1.
    """

    def __init__(
        self,
        root: Path,
        keep: int = 2,
        log: Callable[[str], None] | None = None,
        fault: Callable[[str], None] | None = None,
        pinned: Iterable[int] = (),
        fingerprint: str | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(
                f"checkpoint keep must be an int >= 1, got {keep!r}; "
                "keep at least one checkpoint to resume from"
            )
        self.root = Path(root)
        self.keep = keep
        self._log = log if log is not None else _logger.warning
        self._fault = fault
        self._pinned = frozenset(pinned)
        self.fingerprint = self.root.name if fingerprint is None else fingerprint

    def with_fault(self, fault: Callable[[str], None]) -> CheckpointStore:
        """The same store with the test hook `fault` (see `__init__`)."""
        return CheckpointStore(
            self.root, self.keep, self._log, fault, self._pinned, self.fingerprint
        )

    def place_of(self, step: int) -> dict[str, str]:
        """The place the manifest of `step`'s checkpoint is signed for."""
        return checkpoint_place(self.fingerprint, step)

    def manifest(self, path: Path) -> dict[str, Any]:
        """The manifest of the checkpoint directory `path`, its signature and place
        checked (not its files: see `verify`); for the ranks that read the meta of the
        checkpoint rank 0 verified whole.

        Raises:
            SignatureError: It is missing, over its size cap, does not parse, is unsigned
                or forged.
            MisplacedRecord: It was signed for another run's checkpoint or another step
                (a copy), or for none.
        """
        return _read_manifest(Path(path), self.fingerprint)

    def pin(self, steps: Iterable[int]) -> None:
        """Keep these steps' checkpoints through retention (replacing earlier pins).

        The pins live in this object only: a run that restarts pins again from what it
        recorded (the best validation step) before its first commit.

        Args:
            steps: Steps retention must not remove.
        """
        self._pinned = frozenset(steps)

    def checkpoint_dir(self, step: int) -> Path:
        """Where the checkpoint of `step` lives once committed.

        Args:
            step: Training step.

        Returns:
            `root/step-NNNNNNNN`.
        """
        return self.root / checkpoint_name(step)

    def staging_dir(self, step: int) -> Path:
        """Where the ranks write the checkpoint of `step` before it is committed.

        Args:
            step: Training step.

        Returns:
            `root/.staging/step-NNNNNNNN`, the same on every rank.
        """
        return self.root / STAGING / checkpoint_name(step)

    def prepare(self, step: int) -> Path:
        """Start a save (rank 0): clear what crashed saves left, create the staging dir.

        An invalid committed checkpoint of the same step (one a resume has fallen back
        past) is removed so the step can be saved again.

        Args:
            step: Training step about to be saved.

        Returns:
            The empty staging directory, `staging_dir(step)`.

        Raises:
            CheckpointExists: If a valid checkpoint of `step` is already committed.
            OSError: If the filesystem fails.
        """
        target = self.checkpoint_dir(step)
        staging_root = self.root / STAGING
        staging_root.mkdir(parents=True, exist_ok=True)
        for leftover in sorted(staging_root.iterdir()):
            self._log(f"checkpoint: removing {leftover}, left by an unfinished save or cleanup")
            _remove(leftover)
        if target.exists():
            reason = self.verify(target) or self._chain_problem(target, hashes=True, seen={})
            if reason is None:
                raise CheckpointExists(
                    f"step {step} is already committed at {target}; resume from it "
                    "(latest_valid) instead of saving it again, or delete it"
                )
            self._log(f"checkpoint: replacing invalid {target.name} ({reason})")
            self._discard(target, fault_point=None)
        staging = self.staging_dir(step)
        staging.mkdir()
        fsync_dir(staging_root)
        return staging

    def commit(self, step: int, meta: dict[str, Any]) -> Path:
        """Commit the staged save of `step` (rank 0, after every rank has fsynced).

        Fsyncs every staged file, writes `_manifest.json`, renames the staging dir
        to `root/step-NNNNNNNN` (the commit point), flips `latest`, then removes the
        oldest checkpoints beyond `keep` valid ones. Validity for retention is the
        cheap check (manifest, files present, sizes); hashes are checked on resume.
        Invalid checkpoints newer than the oldest kept one stay for inspection.

        Args:
            step: The step given to `prepare`.
            meta: JSON-serialisable data stored in the manifest (the resolved
                config, the reader position); returned as `Checkpoint.meta`.

        Returns:
            The committed checkpoint directory.

        Raises:
            InputNotFoundError: If `prepare(step)` was not called (no staging dir).
            CheckpointExists: If `step` is already committed.
            DataError: If a staged file is named `_manifest.json` or is a symlink.
            TypeError: If `meta` is not JSON-serialisable.
            OSError: If the filesystem fails.
        """
        staging = self.staging_dir(step)
        target = self.checkpoint_dir(step)
        if not staging.is_dir():
            raise InputNotFoundError(
                f"no staging directory {staging}; call prepare({step}) on rank 0 "
                "before the ranks write"
            )
        if target.exists():
            raise CheckpointExists(
                f"step {step} is already committed at {target}; save under a new step"
            )
        try:
            meta_json = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"checkpoint meta must be JSON-serialisable ({err}); "
                "convert paths, tensors and numpy values to str/int/float first"
            ) from err
        self._point("after-files")

        files = _hash_tree(staging)
        manifest = sign(
            {
                "step": step,
                "meta": meta_json,
                "files": files,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            },
            place=self.place_of(step),
        )
        data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        # Written in two fsynced halves so "mid-manifest" leaves a real torn file on
        # disk; the extra fsync costs nothing next to hashing the checkpoint.
        with open(staging / MANIFEST, "wb") as handle:
            half = len(data) // 2
            handle.write(data[:half])
            handle.flush()
            os.fsync(handle.fileno())
            self._point("mid-manifest")
            handle.write(data[half:])
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(staging)
        self._point("before-rename")

        os.rename(staging, target)
        fsync_dir(self.root)
        self._point("before-pointer")

        pointer_tmp = self.root / (POINTER + ".tmp")
        with open(pointer_tmp, "w") as handle:
            handle.write(target.name + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self._point("mid-pointer")
        os.replace(pointer_tmp, self.root / POINTER)
        fsync_dir(self.root)
        self._point("before-retention")

        newer = [s for s, _ in self._committed() if s > step]
        if newer:
            self._log(
                f"checkpoint: committed {target.name} below newer {checkpoint_name(max(newer))}; "
                "latest_valid returns the highest valid step"
            )
        self._retain(just_committed=target)
        return target

    def verify(self, path: Path) -> str | None:
        """Check a checkpoint directory against its manifest, hashing every file.

        Files present but not in the manifest are allowed and ignored: the manifest
        lists what the checkpoint consists of. A rank still writing after the commit
        (a missing barrier) shows up as a size or sha256 mismatch.

        Args:
            path: A checkpoint directory (`root/step-NNNNNNNN`).

        Returns:
            None if valid, else why not: not a directory, missing or unreadable
            manifest, a manifest signed for another run or step (naming both places),
            manifest step not matching the name, missing file, size mismatch, or
            sha256 mismatch, naming the file.
        """
        return _check(Path(path), self.fingerprint, hashes=True)[1]

    def latest_valid(self, *, strict: bool = False) -> Checkpoint | None:
        """The newest committed checkpoint that verifies, by step number.

        The `latest` pointer is not trusted: every `step-*` directory is a
        candidate, newest first; each invalid one is logged with its reason and the
        next older one tried. A pointer that is missing, unreadable, names a missing
        or invalid checkpoint, or lags behind the one returned is logged too. Saves
        left in `.staging/` are never returned.

        Args:
            strict: Raise instead of returning None when committed checkpoints exist
                but none is valid (use it on resume: training from scratch over a
                damaged run is rarely what anyone wants).

        Returns:
            The newest valid checkpoint, or None when there is none (with `strict`:
            only when no committed checkpoint exists at all, i.e. a fresh run).

        Raises:
            CheckpointCorrupt: With `strict`, if checkpoints exist and none verifies;
                the message lists each with its reason.
        """
        pointer = self._read_pointer()
        staged = sorted(p.name for p in (self.root / STAGING).glob("step-*"))
        if staged:
            self._log(f"checkpoint: ignoring unfinished saves in {STAGING}/: {', '.join(staged)}")
        rejected: list[tuple[str, str]] = []
        found: Checkpoint | None = None
        # Chain members already checked: step -> (manifest, reason).
        seen: dict[int, tuple[dict[str, Any] | None, str | None]] = {}
        for step, path in reversed(self._committed()):
            # A delta refused above may have hashed this one already, as its member.
            if step not in seen:
                seen[step] = _check(path, self.fingerprint, hashes=True)
            manifest, reason = seen[step]
            if reason is None and manifest is not None:
                reason = self._chain_problem(path, hashes=True, seen=seen, manifest=manifest)
            if reason is None and manifest is not None:
                chain = tuple(self.checkpoint_dir(s) for s in chain_steps(manifest["meta"]))
                found = Checkpoint(path=path, step=step, meta=manifest["meta"], chain=chain)
                break
            self._log(f"checkpoint: skipping invalid {path.name}: {reason}")
            rejected.append((path.name, str(reason)))
        self._report_pointer(pointer, found, dict(rejected))
        if found is None and rejected and strict:
            listing = "; ".join(f"{name}: {reason}" for name, reason in rejected)
            raise CheckpointCorrupt(
                f"no valid checkpoint under {self.root} ({listing}); restore one from a "
                "backup, or delete the directory to train from scratch on purpose"
            )
        return found

    def _chain_problem(
        self,
        path: Path,
        hashes: bool,
        seen: dict[int, tuple[dict[str, Any] | None, str | None]],
        manifest: dict[str, Any] | None = None,
    ) -> str | None:
        """Why the chain the checkpoint at `path` builds on is not whole, or None.

        Each member must be committed under root, verify (with `hashes`: every file's
        sha256) and hold the files the chain records (`files_digest`). `seen` caches
        members' own checks between calls of one scan.
        """
        if manifest is None:
            manifest, reason = _check(path, self.fingerprint, hashes=False)
            if manifest is None:
                return reason
        try:
            members = chain_members(manifest["meta"])
        except ValueError as err:
            return f"malformed {MANIFEST} meta: {err}"
        own = parse_step(path.name)
        for step, digest in members:
            member = self.checkpoint_dir(step)
            if own is not None and step >= own:
                return f"its {CHAIN} names {member.name}, which is not older than it"
            if step not in seen:
                seen[step] = _check(member, self.fingerprint, hashes)
            found, reason = seen[step]
            if reason is None and found is not None and files_digest(found) != digest:
                reason = "its files are not the ones the chain recorded (replaced)"
            if reason is not None:
                return f"it builds on {member.name}, which is not usable: {reason}"
        return None

    def _point(self, name: str) -> None:
        """Call the fault hook, if any, at a named point of `commit`."""
        if self._fault is not None:
            self._fault(name)

    def _committed(self) -> list[tuple[int, Path]]:
        """Every `step-*` directory under root (valid or not), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            step = parse_step(path.name)
            if step is not None:
                found.append((step, path))
        return sorted(found)

    def _retain(self, just_committed: Path) -> None:
        """Remove checkpoints older than the `keep`-th newest structurally valid one,
        but the pinned ones and the chains (`CHAIN`) of those kept."""
        valid = 0
        cutoff: int | None = None
        needed = set(self._pinned)
        committed = self._committed()
        seen: dict[int, tuple[dict[str, Any] | None, str | None]] = {}
        for step, path in reversed(committed):
            manifest, reason = _check(path, self.fingerprint, hashes=False)
            if manifest is not None and reason is None:
                reason = self._chain_problem(path, hashes=False, seen=seen, manifest=manifest)
            if reason is None and manifest is not None:
                valid += 1
                needed.update(chain_steps(manifest["meta"]))
                if valid == self.keep:
                    cutoff = step
                    break
        if cutoff is None:
            return
        for step in set(self._pinned):  # a pinned checkpoint keeps its chain too
            pinned = self.checkpoint_dir(step)
            manifest, _ = _check(pinned, self.fingerprint, hashes=False)
            if manifest is not None:
                needed.update(chain_steps(manifest["meta"]))
        for step, path in committed:
            if step < cutoff and path != just_committed and step not in needed:
                self._discard(path, fault_point="mid-retention")

    def _discard(self, path: Path, fault_point: str | None) -> None:
        """Delete a checkpoint dir: first move it out of the scan, so a crash mid-delete
        leaves only staging garbage, which the next `prepare` removes."""
        trash = self.root / STAGING / f"discard-{path.name}"
        if trash.exists():
            _remove(trash)
        os.rename(path, trash)
        fsync_dir(self.root)
        if fault_point is not None:
            self._point(fault_point)
        shutil.rmtree(trash)

    def _read_pointer(self) -> str | None:
        """The name in `latest`, or None if there is no readable one."""
        try:
            return (self.root / POINTER).read_text().strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as err:
            self._log(f"checkpoint: cannot read the {POINTER} pointer ({err}); ignoring it")
            return None

    def _report_pointer(
        self, pointer: str | None, found: Checkpoint | None, rejected: dict[str, str]
    ) -> None:
        """Log how the `latest` pointer disagrees with the scan, if it does."""
        if pointer is None:
            if found is not None or rejected:
                self._log(f"checkpoint: no {POINTER} pointer under {self.root}; scanned instead")
            return
        if found is not None and pointer == found.path.name:
            return
        if parse_step(pointer) is None:
            self._log(f"checkpoint: {POINTER} pointer holds {pointer[:80]!r}, not a checkpoint")
        elif pointer in rejected:
            self._log(f"checkpoint: {POINTER} names {pointer}, which is invalid")
        elif not (self.root / pointer).exists():
            self._log(f"checkpoint: {POINTER} names {pointer}, which does not exist")
        elif found is not None:
            self._log(
                f"checkpoint: {POINTER} names {pointer} but {found.path.name} is newer; "
                "a save died before flipping the pointer"
            )


def chain_members(meta: dict[str, Any]) -> list[tuple[int, str]]:
    """(step, manifest sha256) of each checkpoint a checkpoint's meta builds on, base
    first; empty for a whole checkpoint.

    Raises:
        ValueError: `chain` is not a list of {"step": int, "files_sha256": hex}
            in increasing steps.
    """
    chain = meta.get(CHAIN, [])
    if not isinstance(chain, list):
        raise ValueError(f"{CHAIN} must be a list, got {type(chain).__name__}")
    members: list[tuple[int, str]] = []
    for entry in chain:
        step = entry.get("step") if isinstance(entry, dict) else None
        digest = entry.get("files_sha256") if isinstance(entry, dict) else None
        if (
            isinstance(step, bool)
            or not isinstance(step, int)
            or step < 0
            or not isinstance(digest, str)
            or not re.fullmatch(r"[0-9a-f]{64}", digest)
            or (members and step <= members[-1][0])
        ):
            raise ValueError(
                f"{CHAIN} entry {str(entry)[:120]} is not a {{'step', 'files_sha256'}} "
                "of a step after the one before it"
            )
        members.append((step, digest))
    return members


def files_digest(manifest: dict[str, Any]) -> str:
    """sha256 of a checkpoint manifest's file list (each file's size and sha256): what a
    chain records of each member it builds on."""
    files = json.dumps(manifest.get("files"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(files.encode()).hexdigest()


def chain_steps(meta: dict[str, Any]) -> list[int]:
    """The steps a checkpoint's meta builds on (`chain_members`), none when malformed."""
    try:
        return [step for step, _ in chain_members(meta)]
    except ValueError:
        return []


def checkpoint_place(fingerprint: str, step: int) -> dict[str, str]:
    """The place of the checkpoint of `step` of the run with resume key `fingerprint`."""
    return place("checkpoint", fingerprint=fingerprint, step=step)


def _read_manifest(path: Path, fingerprint: str) -> dict[str, Any]:
    """The manifest of checkpoint directory `path`, read (up to its cap), parsed and
    verified: signed, and bound to `fingerprint` and the step `path` is named for.

    Raises:
        SignatureError: Missing, unreadable, not a checkpoint's name, or `verify` refuses
            it (`MisplacedRecord`: signed for another place, or none).
    """
    where = path / MANIFEST
    step = parse_step(path.name)
    if step is None:
        raise SignatureError(f"{path} is not named like a checkpoint (step-NNNNNNNN)")
    try:
        text = read_text_or_none(where)
    except OSError as err:
        raise SignatureError(f"unreadable {where}: {err.strerror}") from err
    if text is None:
        raise SignatureError(f"missing {where} (the save did not finish, or it was deleted)")
    # The signature and place first: a file's sha256 proves nothing when whoever could
    # replace the file could rewrite the manifest too. DeepSpeed's loader unpickles what
    # a verified manifest lists, and only that.
    return loads_verified(text, str(where), place=checkpoint_place(fingerprint, step))


def _check(path: Path, fingerprint: str, hashes: bool) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) if `path` matches its manifest, else (None, reason).

    Without `hashes` only presence and sizes are checked (cheap: no file is read).
    """
    if not path.is_dir():
        return None, f"{path} is not a directory"
    if not (path / MANIFEST).exists():
        return None, f"missing {MANIFEST} (the save did not finish, or it was deleted)"
    try:
        manifest = _read_manifest(path, fingerprint)
    except SignatureError as err:
        return None, str(err)
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(manifest.get("meta"), dict):
        return None, f"malformed {MANIFEST}: needs a 'files' and a 'meta' object"
    if manifest.get("step") != parse_step(path.name):
        return None, f"{MANIFEST} says step {manifest.get('step')!r}, the directory is {path.name}"
    for rel, entry in sorted(files.items()):
        try:
            file = Path(safe_join(path, rel, f"a file listed in {path / MANIFEST}"))
        except UnsafeName as err:
            return None, str(err)
        if not isinstance(entry, dict) or "size" not in entry or "sha256" not in entry:
            return None, f"malformed {MANIFEST} entry for {rel}"
        if not file.is_file():
            return None, f"missing file {rel}"
        size = file.stat().st_size
        if size != entry["size"]:
            return None, f"size of {rel} is {size} bytes, {MANIFEST} says {entry['size']}"
        if hashes and file_sha256(file) != entry["sha256"]:
            return None, f"sha256 of {rel} does not match {MANIFEST} (corrupted bytes)"
    return manifest, None


def _hash_tree(staging: Path) -> dict[str, dict[str, Any]]:
    """{relpath: {"size", "sha256"}} of every file under `staging`, fsyncing each."""
    files: dict[str, dict[str, Any]] = {}
    for directory, subdirs, names in os.walk(staging):
        for name in subdirs:
            if (Path(directory) / name).is_symlink():
                raise DataError(
                    f"{Path(directory) / name} is a symlink; write the files themselves "
                    "into the checkpoint"
                )
        for name in names:
            file = Path(directory) / name
            rel = file.relative_to(staging).as_posix()
            if rel == MANIFEST:
                raise DataError(
                    f"{file}: {MANIFEST} is reserved for the checkpoint manifest; rename it"
                )
            if file.is_symlink():
                raise DataError(f"{file} is a symlink; write the file itself into the checkpoint")
            with open(file, "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
                os.fsync(handle.fileno())
            files[rel] = {"size": file.stat().st_size, "sha256": digest}
        fsync_dir(Path(directory))
    return dict(sorted(files.items()))


def _remove(path: Path) -> None:
    """Delete a file or directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
