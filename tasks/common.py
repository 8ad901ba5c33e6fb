"""What every stage task shares: the retry policy and the cache/publish protocol.

A stage task computes its fingerprint, then either reuses a verified output
(a cache hit, visible in Prefect as a ``Cached`` state) or runs the library
function into a staging directory and publishes it. Deterministic errors fail
at once; transient ones (I/O, a crashed rank) are retried with exponential
backoff and jitter.
"""

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from data_prep.errors import DeterministicError, InputNotFoundError, TransientError
from tasks.store import (
    ArtifactStore,
    code_version,
    fingerprint,
    materialize,
    module_closure,
)

Stage = Literal["ingest", "preprocess", "shard", "train", "evaluate", "export"]
STAGES: tuple[Stage, ...] = ("ingest", "preprocess", "shard", "train", "evaluate", "export")
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
    root: str,
    produce: Callable[[Path], dict[str, Any]],
) -> StageOutput:
    """Reuse or produce one stage output.

    Args:
        stage: the stage name.
        fp: its fingerprint.
        mode: see ``Mode``.
        root: the artifact store root.
        produce: writes the output into the given staging directory and returns
            metadata for the manifest and the run record.

    Returns:
        The outcome; ``status`` tells a cache hit (``cached``) from a run (``ran``).

    Raises:
        InputNotFoundError: mode is ``reuse`` and there is no valid output.
        DeterministicError: from ``produce``; the partial output is kept under
            ``<root>/failed`` and named in the message.
    """
    logger = get_run_logger()
    store = ArtifactStore(root)
    final = store.output_url(stage, fp)
    if mode == "skip":
        return StageOutput(stage=stage, status="skipped", fingerprint=fp)
    if mode in ("auto", "reuse"):
        manifest, why = store.verify(stage, fp)
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

    staging = store.new_staging(stage, fp)
    started = time.perf_counter()
    try:
        meta = produce(staging)
    except DeterministicError as err:
        kept = store.keep_failed(stage, fp, staging)
        raise type(err)(f"{err} (partial output kept for inspection at {kept})") from err
    except BaseException:
        store.discard(staging)
        raise
    store.publish(stage, fp, staging, meta)
    return StageOutput(
        stage=stage,
        status="ran",
        fingerprint=fp,
        output=final,
        seconds=round(time.perf_counter() - started, 3),
        meta=meta,
    )


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
