"""Mirror a train run's resume checkpoints between the ranks' local root and object storage.

The ranks always write crash-safe checkpoints locally (`artifacts.checkpoints`);
with an object-store artifact root the train task pulls the newest remote checkpoint
that verifies before they start, and uploads each committed one while they run, so a
retry on another machine resumes from the store. Object storage has no rename: a remote
checkpoint is committed when its manifest object exists (uploaded last).

Every checkpoint manifest is bound to its place, the run's resume key and its step
(`artifacts.checkpoints`): one copied from another run's prefix, or from another step,
is neither pulled nor read for its meta (the world size a retry refits to).
"""

import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from artifacts.checkpoints import (
    MANIFEST,
    CheckpointStore,
    chain_steps,
    checkpoint_name,
    checkpoint_place,
    parse_step,
)
from artifacts.errors import DeterministicError
from artifacts.locations import (
    backend_errors,
    check_name,
    download_files,
    filesystem,
    join,
    read_text_or_none,
    remove_tree,
    upload_files,
)
from artifacts.signing import SignatureError, loads_verified

# How often the mirror looks for newly committed checkpoints to upload.
MIRROR_EVERY_S = 1.0


class CheckpointMirror:
    """Resume checkpoints of one training run, mirrored between a local root and a URL.

    Args:
        local_root: The ranks' checkpoint directory (`CheckpointStore` layout).
        url: Where the checkpoints go, ``<root>/checkpoints/train/<fp>``.
        keep: How many committed checkpoints the remote side keeps.
        log: Receives one line per download, upload or skipped checkpoint.
        fingerprint: The run's resume key, which every checkpoint manifest must be
            signed for (`CheckpointStore`'s `fingerprint`); default: the last name of
            `url` (``<key>``), which the ranks writing into `local_root` must use too.
    """

    def __init__(
        self,
        local_root: Path,
        url: str,
        keep: int,
        log: Callable[[str], None],
        fingerprint: str | None = None,
    ) -> None:
        self.local_root = local_root
        self.url = url
        self.keep = keep
        self._log = log
        self.fingerprint = url_key(url) if fingerprint is None else fingerprint
        self._uploaded: set[int] = set()
        self._refused: set[int] = set()

    def _local_store(self) -> CheckpointStore:
        return CheckpointStore(self.local_root, fingerprint=self.fingerprint)

    def pull(self, exact: bool = False) -> int | None:
        """Download the newest remote checkpoint that verifies, unless one as new is local.

        Each candidate is downloaded next to the local ones and verified (sizes and
        sha256 against its manifest) before it is renamed into place; one that does not
        verify is logged and the next older tried.

        Args:
            exact: First delete the local checkpoints newer than the newest remote one
                (launcher 'per_node': every node's copy must resume from the same step,
                and only what reached the store is known to every node).

        The checkpoints the resume point's meta pins (a sequence model's best validation
        step, and the chain a differential checkpoint builds on) are downloaded too when
        they are not local.

        Returns:
            The step downloaded, or None (nothing remote, or nothing newer).
        """
        remote = sorted(self._remote_steps(committed=True), reverse=True)
        if exact:
            # Other nodes pull these now: never upload them again (a re-upload briefly
            # uncommits a checkpoint).
            self._uploaded.update(remote)
            newest = remote[0] if remote else -1
            for step in self._local_steps():
                if step > newest:
                    shutil.rmtree(self.local_root / checkpoint_name(step))
                    self._log(f"local checkpoint of step {step} never reached {self.url}; removed")
        local = max(self._local_steps(), default=-1)
        for step in remote:
            if step <= local:
                self._pull_pinned(local)
                return None
            if not self._download(step):
                continue
            self._log(f"resume checkpoint of step {step} downloaded from {self._remote(step)}")
            self._pull_pinned(step)
            return step
        return None

    def _download(self, step: int) -> bool:
        """Download remote checkpoint `step` next to the local ones, verify it, rename it
        into place; False (logged) when it does not verify."""
        name = checkpoint_name(step)
        scratch = self.local_root / ".staging" / "pull" / name
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        where = join(self._remote(step), MANIFEST)
        try:
            # Signed by the run key for this run and step, every name plain, before a
            # single byte is fetched.
            text = read_text_or_none(where) or ""
            manifest = loads_verified(
                text, str(where), place=checkpoint_place(self.fingerprint, step)
            )
            files = list(manifest["files"])
            for rel in files:
                check_name(rel, f"a file listed in {where}")
        except (DeterministicError, KeyError, TypeError) as err:
            self._log(f"checkpoint {self._remote(step)} is refused ({err}); skipped")
            shutil.rmtree(scratch)
            return False
        download_files(self._remote(step), files, scratch)
        (scratch / MANIFEST).write_text(text)
        problem = self._local_store().verify(scratch)
        if problem is not None:
            self._log(f"checkpoint {self._remote(step)} does not verify ({problem}); skipped")
            shutil.rmtree(scratch)
            return False
        # A local directory of this step without a manifest is an unfinished save.
        shutil.rmtree(self.local_root / name, ignore_errors=True)
        os.replace(scratch, self.local_root / name)
        self._uploaded.add(step)
        return True

    def _pull_pinned(self, step: int) -> None:
        """Download the checkpoints local checkpoint `step` pins (its best validation
        step), which the resumed run needs besides it; missing ones are logged."""
        path = self.local_root / checkpoint_name(step)
        if not (path / MANIFEST).is_file():
            return
        try:
            pinned = _pinned_steps(self._local_store().manifest(path))
        except SignatureError as err:
            self._log(f"checkpoint {path} is refused ({err}); its pinned steps are not pulled")
            return
        for pin in sorted(set(pinned) - set(self._local_steps())):
            if self._download(pin):
                self._log(f"pinned checkpoint of step {pin} downloaded from {self._remote(pin)}")
            else:
                self._log(f"pinned checkpoint of step {pin} is not in {self.url}")

    def push(self) -> None:
        """Upload every committed local checkpoint not uploaded yet, then prune the remote.

        Files go first, the manifest last: a remote checkpoint without its manifest is
        an unfinished upload, never a resume point.
        """
        for step in sorted(self._local_steps()):
            if step in self._uploaded or step in self._refused:
                continue
            path = self.local_root / checkpoint_name(step)
            remote = self._remote(step)
            try:
                # Only what this run's readers accept: a checkpoint signed for another
                # run (a misnamed local root) would be refused by every reader anyway.
                self._local_store().manifest(path)
            except SignatureError as err:
                if not (path / MANIFEST).exists():
                    continue  # local retention removed it: a newer one exists
                self._refused.add(step)
                self._log(f"checkpoint {path} is not uploaded to {remote}: {err}")
                continue
            try:
                manifest = (path / MANIFEST).read_text()
                fs, remote_path = filesystem(remote)
                # A step saved again (after a fallback) must not look committed half-way.
                if fs.exists(f"{remote_path}/{MANIFEST}"):
                    fs.rm(f"{remote_path}/{MANIFEST}")
                upload_files(path, list(json.loads(manifest)["files"]), remote)
                fs.pipe_file(f"{remote_path}/{MANIFEST}", manifest.encode())
            except FileNotFoundError:
                # Local retention removed it while it was read: a newer one exists.
                continue
            self._uploaded.add(step)
            self._log(f"resume checkpoint of step {step} uploaded to {remote}")
        self._prune()

    @contextmanager
    def pushing(self) -> Iterator[None]:
        """Upload new checkpoints in a background thread while the block runs, and once
        more at its end (also when it fails, so that a retry elsewhere can resume)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(MIRROR_EVERY_S):
                try:
                    self.push()
                except backend_errors() as err:  # the final push reports what still fails
                    self._log(f"checkpoint upload to {self.url} failed, retrying: {err}")

        thread = threading.Thread(target=loop, name="checkpoint-mirror", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.push()

    def remove(self) -> None:
        """Delete the remote checkpoints (the run finished; they are spent)."""
        remove_tree(self.url)

    def _remote(self, step: int) -> str:
        return join(self.url, checkpoint_name(step))

    def _local_steps(self) -> list[int]:
        """Steps committed locally (a step directory holding its manifest)."""
        if not self.local_root.is_dir():
            return []
        return [
            step
            for path in self.local_root.iterdir()
            if (step := parse_step(path.name)) is not None and (path / MANIFEST).is_file()
        ]

    def _remote_steps(self, committed: bool) -> list[int]:
        """Steps with a remote directory (`committed`: only those with their manifest)."""
        fs, path = filesystem(self.url)
        fs.invalidate_cache(path)
        if not fs.exists(path):
            return []
        steps = []
        for entry in fs.ls(path, detail=False):
            step = parse_step(entry.rstrip("/").rsplit("/", 1)[-1])
            if step is not None and (not committed or fs.exists(f"{entry}/{MANIFEST}")):
                steps.append(step)
        return steps

    def _prune(self) -> None:
        """Remove remote checkpoints older than the `keep` newest committed ones.

        The steps the kept ones' meta pins (a sequence model's best validation step,
        whose weights become the model; the chain a differential checkpoint builds on)
        are kept too.
        """
        committed = sorted(self._remote_steps(committed=True), reverse=True)
        if len(committed) < self.keep:
            return
        cutoff = committed[self.keep - 1]
        pinned = set().union(*(self._pinned(step) for step in committed[: self.keep]))
        fs, _ = filesystem(self.url)
        for step in self._remote_steps(committed=False):
            if step < cutoff and step not in pinned:
                _, remote_path = filesystem(self._remote(step))
                if fs.exists(f"{remote_path}/{MANIFEST}"):
                    fs.rm(f"{remote_path}/{MANIFEST}")  # first: it stops being a resume point
                remove_tree(self._remote(step))

    def _pinned(self, step: int) -> set[int]:
        """The steps checkpoint `step`'s meta pins against retention."""
        where = join(self._remote(step), MANIFEST)
        try:
            text = read_text_or_none(where) or "{}"
            return _pinned_steps(
                loads_verified(text, str(where), place=checkpoint_place(self.fingerprint, step))
            )
        except DeterministicError:
            return set()


def _pinned_steps(manifest: dict) -> set[int]:
    """The steps a verified checkpoint manifest's meta pins (its "pinned" steps and
    the chain it builds on); none when malformed."""
    meta = manifest.get("meta")
    if not isinstance(meta, dict):
        return set()
    pinned = meta.get("pinned", [])
    chain = set(chain_steps(meta))
    if not isinstance(pinned, list):
        return chain
    return chain | {step for step in pinned if isinstance(step, int) and not isinstance(step, bool)}


def url_key(location: str | Path) -> str:
    """The last name of a checkpoint root (``checkpoints/train/<key>``): its resume key."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def newest_checkpoint_meta(
    location: str, fingerprint: str | None = None
) -> tuple[int, dict] | None:
    """(step, meta) of the newest committed checkpoint under `location` whose manifest
    is signed by the run key for this run and that step; None when there is none.

    `location` is a local checkpoint root or a `checkpoints/train/<key>` URL. Only the
    manifest is read (the ranks verify every file before they load one); an unsigned,
    forged, unparsable or relocated manifest (another run's, or another step's under
    this step's name) is passed over, as the ranks and `CheckpointMirror.pull` would:
    the world size a retry refits its layout to comes only from this run's own.

    Args:
        location: The checkpoint root.
        fingerprint: The run's resume key; default: the last name of `location`.
    """
    fingerprint = url_key(location) if fingerprint is None else fingerprint
    fs, path = filesystem(location)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return None
    steps = sorted(
        (
            step
            for entry in fs.ls(path, detail=False)
            if (step := parse_step(entry.rstrip("/").rsplit("/", 1)[-1])) is not None
        ),
        reverse=True,
    )
    for step in steps:
        where = join(location, checkpoint_name(step), MANIFEST)
        try:
            text = read_text_or_none(where)
            if text is None:
                continue  # not committed
            meta = loads_verified(text, str(where), place=checkpoint_place(fingerprint, step)).get(
                "meta"
            )
        except DeterministicError:
            continue
        if isinstance(meta, dict):
            return step, meta
    return None
