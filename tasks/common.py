"""What every stage task shares: the retry policy and the cache/publish protocol.

A stage task computes its fingerprint, then either reuses a verified output
(a cache hit, visible in Prefect as a ``Cached`` state) or runs the library
function into a staging directory and publishes it. Deterministic errors fail
at once; transient ones (I/O, a crashed rank) are retried with exponential
backoff and jitter.
"""

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import cache, partial
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.states import Completed, State
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from artifacts.errors import (
    ConfigError,
    CorruptOutput,
    DeterministicError,
    InputNotFoundError,
    TransientError,
)
from artifacts.fingerprint import code_version, fingerprint, module_closure
from artifacts.locations import Location, check_name, is_remote, join, remove_tree
from artifacts.signing import MisplacedRecord
from artifacts.store import (
    ArtifactStore,
    Stage,
    check_remote_output,
    describe_object,
    materialize,
    names_under,
    output_manifest,
    remote_manifest,
)

Mode = Literal["auto", "force", "reuse", "skip"]
"""auto: reuse a verified output, else run; force: run; reuse: the output must
exist (an upstream stage of --from/--only); skip: do nothing (downstream of --only)."""

_ROOT = Path(__file__).resolve().parent.parent
_RETRYABLE = (OSError, TransientError, ConnectionError, TimeoutError)


class StageOutput(BaseModel):
    """A stage's outcome as the flow and the run record see it."""

    stage: Stage
    status: Literal["ran", "cached", "skipped", "failed"]
    fingerprint: str = ""
    output: str = ""
    seconds: float = 0.0
    meta: dict[str, Any] = {}


def should_retry(task: Any, task_run: Any, state: State) -> bool:
    """Prefect retry condition: only transient errors are worth another try."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is None:
        error = state.result(raise_on_failure=False)
    if isinstance(error, DeterministicError):
        return False
    return isinstance(error, _RETRYABLE)


def task_options(backoff_seconds: float = 2.0, retries: int = 3) -> dict[str, Any]:
    """Decorator arguments shared by the stage tasks."""
    return {
        "retries": retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=backoff_seconds),
        "retry_jitter_factor": 0.5,
        "retry_condition_fn": should_retry,
        "cache_policy": NO_CACHE,  # caching is the artifact store's job
        "persist_result": False,
    }


def stage_modules(stage: Stage) -> list[str]:
    """The library modules stage `stage` runs: the import closure of `tasks.<stage>`."""
    return module_closure(f"tasks.{stage}", _ROOT)


def stage_code_version(stage: Stage) -> str:
    """The code part of a stage's fingerprint (its modules' source, library versions)."""
    return code_version(stage_modules(stage), _ROOT)


def stage_fingerprint(stage: Stage, section: dict, upstream: list[StageOutput]) -> str:
    """Fingerprint from the config section, upstream fingerprints and the stage's code."""
    code = stage_code_version(stage)
    return fingerprint(stage, section, [u.fingerprint for u in upstream], code)


def run_stage(
    stage: Stage,
    fp: str,
    mode: Mode,
    store: ArtifactStore,
    produce: Callable[[Path], dict[str, Any]],
) -> StageOutput:
    """Reuse or produce one stage output.

    Args:
        stage: the stage name.
        fp: its fingerprint.
        mode: see ``Mode``.
        store: the artifact store.
        produce: writes the output into the given staging directory and returns
            metadata for the manifest and the run record.

    Returns:
        The outcome; ``status`` tells a cache hit (``cached``) from a run (``ran``).

    Raises:
        InputNotFoundError: mode is ``reuse`` and there is no valid output.
        DeterministicError: from ``produce``; the partial output is kept under
            ``<root>/failed`` and named in the message.
    """
    reused = _reuse(stage, fp, mode, store)
    if reused is not None:
        return reused
    return _run_in_staging(stage, fp, store, lambda staging: (produce(staging), None))


def _run_in_staging(
    stage: Stage,
    fp: str,
    store: ArtifactStore,
    produce: Callable[[Path], tuple[dict[str, Any], list[str] | None]],
) -> StageOutput:
    """Run ``produce`` into a fresh staging directory and publish it (`run_stage`).

    ``produce`` returns the metadata and the files it wrote (None: the whole staging
    directory, which only this user can write: `ArtifactStore.new_staging`).
    """
    staging = store.new_staging(stage, fp)
    started = time.perf_counter()
    try:
        meta, written = produce(staging)
    except DeterministicError as err:
        kept = store.keep_failed(stage, fp, staging)
        raise type(err)(f"{err} (partial output kept for inspection at {kept})") from err
    except BaseException:
        store.discard(staging)
        raise
    try:
        store.publish(stage, fp, staging, meta, written)
    except CorruptOutput:
        store.discard(staging)
        raise
    return StageOutput(
        stage=stage,
        status="ran",
        fingerprint=fp,
        output=store.output_url(stage, fp),
        seconds=round(time.perf_counter() - started, 3),
        meta=meta,
    )


def _run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger; this module's logger when called outside a run (tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _reuse(stage: Stage, fp: str, mode: Mode, store: ArtifactStore) -> StageOutput | None:
    """The skipped or cached outcome when the stage does not run, else None (it runs).

    A manifest signed for another place (a genuine output copied here from another
    fingerprint) or for none (written before records were bound) is no cache hit: the
    refusal is logged as a warning naming both places, and the stage runs again; its
    publish replaces the copy.
    """
    logger = _run_logger()
    final = store.output_url(stage, fp)
    if mode == "skip":
        return StageOutput(stage=stage, status="skipped", fingerprint=fp)
    if mode in ("auto", "reuse"):
        try:
            manifest, why = store.verify(stage, fp)
        except MisplacedRecord as refused:
            manifest, why = None, f"its manifest was refused: {refused}"
            logger.warning("%s: not a cache hit, %s", stage, why)
        if manifest is not None:
            logger.info("%s: cache hit %s", stage, final)
            return StageOutput(
                stage=stage,
                status="cached",
                fingerprint=fp,
                output=final,
                meta=manifest["meta"],
            )
        if mode == "reuse":
            raise InputNotFoundError(
                f"{stage} has no valid output for this config ({why}). Run it first: drop "
                f"--from/--only, or include '{stage}' in them."
            )
        logger.info("%s: running (%s)", stage, why)
    return None


def run_stage_at(
    stage: Stage,
    fp: str,
    mode: Mode,
    store: ArtifactStore,
    produce: Callable[[Path | str], dict[str, Any]],
) -> StageOutput:
    """`run_stage` for a data stage whose work runs on the task runner, maybe elsewhere.

    ``produce`` returns the metadata and the files it wrote, relative to its output: an
    output is exactly those files. With a local root ``produce`` gets a local staging
    directory, which must then hold exactly them. With a remote root nothing goes
    through this machine's disk: ``produce`` gets a fresh data prefix of the output (a
    URL) and its tasks write their files there themselves; the reported objects are then
    described (size, sha256, rows) by tasks on the runner and the manifest is written
    last, so a crash leaves no output that looks whole. An object under the prefix that
    the stage did not report (someone else PUT it there while it ran) fails the publish:
    it is never signed.

    Raises:
        InputNotFoundError: mode is ``reuse`` and there is no valid output.
        DeterministicError: from ``produce``; the partial objects are kept unpublished at
            the data prefix, named in the message.
        CorruptOutput: The output holds a file the stage did not report writing.
    """
    if not store.remote:
        reused = _reuse(stage, fp, mode, store)
        if reused is not None:
            return reused
        return _run_in_staging(stage, fp, store, produce)
    reused = _reuse(stage, fp, mode, store)
    if reused is not None:
        return reused
    data = store.new_data_prefix(stage, fp)
    started = time.perf_counter()
    try:
        meta, written = produce(data)
        rels = sorted(set(written))
        urls = [join(data, *check_name(rel, f"a file the {stage} stage wrote")) for rel in rels]
        described = list(prefect_file_mapper(stage)(partial(_describe_nth, urls), range(len(urls))))
    except DeterministicError as err:
        raise type(err)(f"{err} (partial output kept, unpublished, at {data})") from err
    except BaseException:
        remove_tree(data)
        raise
    files = dict(zip(rels, described, strict=True))
    try:
        store.publish_prefix(stage, fp, data, files, meta)
    except CorruptOutput:
        remove_tree(data)
        raise
    return StageOutput(
        stage=stage,
        status="ran",
        fingerprint=fp,
        output=store.output_url(stage, fp),
        seconds=round(time.perf_counter() - started, 3),
        meta=meta,
    )


def _describe_nth(urls: list[str], index: int) -> dict:
    return describe_object(urls[index])


def data_location(output: StageOutput) -> Path | str:
    """Where a stage output's files are, for code that reads them wherever it runs.

    A local root: the output directory. A remote root: the URL of its data prefix, after
    one listing checked every object's size and ETag against the manifest (the tasks that
    read it then need no local copy).

    Raises:
        InputNotFoundError: The output is not published.
        CorruptOutput: An object changed since it was published (named in the message).
    """
    return _verified_data(output)[0]


def input_files(output: StageOutput, under: str, suffix: str) -> list[Location]:
    """The files of a stage output that its signed manifest lists directly under `under`
    (``"events"``; ``""`` for the top level) ending in `suffix`, sorted by name, as
    locations to read (paths, or URLs under its data prefix).

    A stage output is exactly its manifest: readers take their inputs from this list,
    never from a directory listing, so a file planted beside the listed ones is never
    read.

    Raises:
        InputNotFoundError: The output is not published.
        CorruptOutput: An object changed since it was published (remote roots).
        SignatureError: The manifest does not verify, or was signed for another place.
    """
    location, manifest = _verified_data(output)
    return [join(location, rel) for rel in names_under(manifest, under, suffix)]


def listed_names(output: StageOutput) -> list[str]:
    """Every file name a stage output's signed manifest lists (relative to its data)."""
    return sorted(_verified_data(output)[1]["files"])


def _verified_data(output: StageOutput) -> tuple[Location, dict]:
    """Where a stage output's files are, and its verified manifest (see `data_location`)."""
    if not is_remote(output.output):
        return Path(output.output), output_manifest(output.output)
    manifest = remote_manifest(output.output)
    if manifest is None:
        raise InputNotFoundError(
            f"nothing is published at {output.output}; run the {output.stage} stage again"
        )
    problem = check_remote_output(output.output, manifest)
    if problem:
        raise CorruptOutput(
            f"the {output.stage} output {output.output} has changed since it was published: "
            f"{problem}. Run it again with --force {output.stage}"
        )
    return join(output.output, manifest.get("data", "")), manifest


def local_dir(output: StageOutput) -> Path:
    """A stage output as a local directory, for the libraries that read it.

    With a local root that is the output itself. With a remote root (`s3://...`) it is
    the output's materialized copy under the local cache, downloaded once per machine
    and checked file by file against the output's manifest (sha256).

    Raises:
        CorruptOutput: An object differs from the manifest; the message names it.
        InputNotFoundError: The output is not published (deleted since it was made).
    """
    return materialize(output.output)


def upstream_dirs(*outputs: StageOutput | None) -> Callable[[str], Path]:
    """`training.stages.Upstream` over these outputs: a stage name -> its local directory.

    Each output is fetched on first use only (`local_dir`: for a remote root, one verified
    download per machine), so a model family pays for no output it does not read.

    Raises:
        KeyError: A stage whose output was not given (names it).
    """
    by_stage = {output.stage: output for output in outputs if output is not None}

    @cache
    def local(stage: str) -> Path:
        if stage not in by_stage:
            raise KeyError(f"the {stage} output was not passed to this task; pass it")
        return local_dir(by_stage[stage])

    return local


def as_state(output: StageOutput) -> StageOutput | State:
    """What a task returns: a cache hit shows in Prefect as ``Cached``, a skip as ``Skipped``."""
    if output.status == "cached":
        return Completed(name="Cached", message=f"cache hit: {output.output}", data=output)
    if output.status == "skipped":
        return Completed(name="Skipped", message="after the last --only stage", data=output)
    return output


@task(name="map-file", **task_options())
def file_step_task(step: Callable[[int], Any], index: int) -> Any:
    """One per-file step of a data stage (a counting or transform pass over one file)."""
    return step(index)


def prefect_file_mapper(stage: Stage) -> Callable[[Callable[[int], Any], range], Iterator[Any]]:
    """A ``map_files`` for the libraries that runs each file's step on the flow's task runner.

    Threads locally, Dask workers under a DaskTaskRunner. Results come back in file
    order and at most one step per core (plus one) is in flight, so memory stays bounded.
    """
    step_task = file_step_task.with_options(name=f"map-{stage}")
    window = os.cpu_count() or 2

    def map_files(step: Callable[[int], Any], items: range) -> Iterator[Any]:
        pending = deque()
        for index in items:
            pending.append(step_task.submit(step, index))
            if len(pending) > window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    return map_files


def load_run_key(store: ArtifactStore) -> None:
    """Make the run key available to this process and the ranks it starts, or refuse.

    `$RECFORGE_SIGNING_KEY_BLOCK` names a Prefect Secret block holding the key: it is
    read here (artifacts/ imports no Prefect) into `$RECFORGE_SIGNING_KEY`, which the
    ranks inherit. Then `ArtifactStore.require_key`: a remote root without a key fails.

    Raises:
        ConfigError: A remote root and no key, or the block cannot be loaded.
    """
    from artifacts.signing import KEY_BLOCK_ENV, KEY_ENV

    block = os.environ.get(KEY_BLOCK_ENV)
    if block and not os.environ.get(KEY_ENV):
        from prefect.blocks.system import Secret

        try:
            os.environ[KEY_ENV] = str(Secret.load(block).get())
        except (ValueError, RuntimeError) as err:
            raise ConfigError(
                f"{KEY_BLOCK_ENV}={block}: cannot load that Prefect Secret block ({err}); "
                f"create it (`Secret(value=...).save({block!r})`) or set {KEY_ENV}"
            ) from err
    store.require_key()
