"""Prefect task for the ingest stage, with dataset checks against the previous run."""

import hashlib
import json
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.context import FlowRunContext

from artifacts import locations
from artifacts.errors import ConfigError, DataError, StoreUnreachable
from artifacts.locations import (
    Location,
    UnsafeName,
    as_location,
    is_remote,
    join,
    read_text_or_none,
)
from artifacts.signing import SignatureError
from artifacts.store import DATA_STAGES, ArtifactStore, remote_manifest
from data_prep.drift import DriftConfig, compare_stats, compute_stats
from data_prep.ingest import (
    FileReport,
    Format,
    IngestConfig,
    IngestResult,
    check_partition,
    combine_reports,
    describe_inputs,
    find_replays,
    ingest_file,
    ingest_logs,
    numbers_records_globally,
    quarantine_replayed_file,
    resolve_inputs,
)
from data_prep.schema import SchemaConfig
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    run_stage_at,
    stage_code_version,
    stage_fingerprint,
    task_options,
)
from tasks.progress import terminal_progress

STATS_FILE = "stats.json"
# combine_reports writes it beside the events and the quarantine.
VALIDATION_FILE = "validation.json"


def ingest_section(
    config: IngestConfig, schema: SchemaConfig, drift: DriftConfig, inputs: list[dict]
) -> dict:
    """What ingest's fingerprint covers: its settings and the raw files' content.

    Not where the files are (`ingest.path`): `inputs` (describe_inputs) names each file
    relative to it with its sha256, so the same bytes elsewhere hit the cache.
    """
    return {
        # Nor which partition: a day's files are keyed by their content alone.
        "ingest": config.model_dump(exclude={"path", "partition"}),
        "schema": schema.model_dump(),
        "drift": drift.model_dump(),
        "inputs": inputs,
    }


@task(name="ingest", task_run_name="ingest", **task_options())
def ingest_task(
    config: IngestConfig,
    schema: SchemaConfig,
    drift: DriftConfig,
    pipeline: str,
    store: ArtifactStore,
    mode: Mode,
) -> StageOutput:
    """Validate raw logs into clean events and a quarantine; compare with the last run."""
    cluster = _dask_cluster()
    if store.remote and cluster is not None:
        check_inputs_reachable(str(config.source()), cluster.address)
        check_workers(cluster.client, store.url)
    check_partition(config)
    inputs = describe_inputs(str(config.source()), config.format)
    section = ingest_section(config, schema, drift, inputs)
    fp = stage_fingerprint("ingest", section, [])
    logger = get_run_logger()

    def produce(out_dir: Location) -> tuple[dict, list[str]]:
        result = ingest_in_parallel(config, schema, out_dir)
        events = [rel for rel in result.files if rel.startswith("events/")]
        previous = _previous_ingest(store, pipeline)
        findings = _check_drift(previous, out_dir, schema, drift, events)
        if findings and drift.policy == "fail":
            raise DataError(
                f"dataset drift against the previous run (drift.policy=fail): "
                f"{'; '.join(f['column'] + ' ' + f['check'] + ' ' + f['detail'] for f in findings)}"
                ". Check the data, or set drift.policy=warn to accept it."
            )
        for finding in findings:
            logger.warning(
                "drift: %s %s %s", finding["column"], finding["check"], finding["detail"]
            )
        meta = {
            "rows": result.rows,
            "good_rows": result.good_rows,
            "bad_rows": result.bad_rows,
            "bad_fraction": result.bad_fraction,
            "reasons": result.reasons,
            "drift": findings,
        }
        # What this stage wrote, and all that its manifest may list (`run_stage_at`).
        written = [*result.files, VALIDATION_FILE]
        return meta, written + ([STATS_FILE] if drift.policy != "off" else [])

    output = run_stage_at("ingest", fp, mode, store, produce)
    store.record_latest(pipeline, "ingest", output.output)
    meta = output.meta
    rows = [{"reason": "(clean)", "rows": meta["good_rows"]}] + [
        {"reason": reason, "rows": count} for reason, count in meta["reasons"].items()
    ]
    create_table_artifact(
        key="ingest-validation",
        table=rows,
        description=f"Validation: {meta['bad_rows']} of {meta['rows']} rows quarantined.",
    )
    if meta.get("drift"):
        create_table_artifact(
            key="ingest-drift",
            table=meta["drift"],
            description="Dataset drift against the previous run",
        )
    return as_state(output)


@task(name="read-file", **task_options())
def read_file_task(
    config: IngestConfig, schema: SchemaConfig, url: str, fmt: Format, out_dir: str, part: int
) -> FileReport:
    """Ingest one raw file into the stage's staging directory (or data prefix URL)."""
    return ingest_file(config, schema, url, fmt, as_location(out_dir), part)


def check_inputs_reachable(path: str, dask_address: str | None) -> None:
    """Fail fast when the workers of a Dask cluster could not read the raw logs.

    With a remote artifact root and a Dask cluster at an address, the workers share no
    disk with this process: they read the raw logs through fsspec, so ``ingest.path``
    must be a URL they can reach.

    Raises:
        ConfigError: ``ingest.path`` is a local path; the message says where to put it.
    """
    if dask_address is None or is_remote(path):
        return
    raise ConfigError(
        f"ingest.path '{path}' is a path on this machine, which the Dask workers at "
        f"{dask_address} cannot read (with an object-store --root they share no disk with "
        "this process). Copy the raw logs to object storage (e.g. `aws s3 sync "
        f"{path} s3://BUCKET/raw/`) and pass --set ingest.path=s3://BUCKET/raw/"
    )


def check_workers(client: Any, root: str) -> None:
    """Fail fast when a Dask worker could not do the data stages' work against `root`.

    Every worker must reach the object store with its own environment (credentials,
    ``AWS_ENDPOINT_URL``) and run the code this flow fingerprints its outputs with.

    Args:
        client: A ``distributed.Client`` of the cluster.
        root: The artifact store root (a URL).

    Raises:
        StoreUnreachable: A worker cannot list the root; the message names the worker.
        ConfigError: A worker runs other recforge code (another checkout or version).
    """
    expected = {stage: stage_code_version(stage) for stage in DATA_STAGES}
    for address, (codes, error) in sorted(client.run(_worker_view, root).items()):
        if error:
            raise StoreUnreachable(
                f"the Dask worker {address} cannot use the artifact store: {error} (set "
                "these in the workers' environment; they share nothing with this process)"
            )
        stale = [stage for stage in DATA_STAGES if codes.get(stage) != expected[stage]]
        if stale:
            raise ConfigError(
                f"the Dask worker {address} runs other recforge code than this process for "
                f"{', '.join(stale)}: install this checkout on the workers, then run again."
            )


def _worker_view(root: str) -> tuple[dict[str, str], str]:
    """On a worker: its data stages' code versions, and why it cannot reach `root` ("")."""
    codes = {stage: stage_code_version(stage) for stage in DATA_STAGES}
    try:
        ArtifactStore(root).check_reachable()
    except (StoreUnreachable, ConfigError) as err:
        return codes, str(err)
    return codes, ""


def _dask_cluster() -> Any:
    """This flow's task runner when it is a Dask cluster at an address (`--dask tcp://...`);
    None for threads or a cluster the runner started itself (`--dask local:N`)."""
    context = FlowRunContext.get()
    runner = getattr(context, "task_runner", None)
    if type(runner).__name__ != "DaskTaskRunner" or not getattr(runner, "address", None):
        return None
    return runner


def ingest_in_parallel(
    config: IngestConfig, schema: SchemaConfig, out_dir: Location
) -> IngestResult:
    """Map ingest over the input files with the flow's task runner (threads or Dask).

    Each file numbers its records from 0, so the output does not depend on the runner
    or on the order files finish in. A generated timestamp numbers records across files
    in file order, so that case reads the files one after another.
    """
    if numbers_records_globally(schema):
        with terminal_progress("ingest rows", None) as advance:
            return ingest_logs(config, schema, out_dir, on_progress=advance)
    inputs = resolve_inputs(str(config.source()), config.format)
    originals = find_replays([url for url, _ in inputs])
    out_dir = as_location(out_dir)
    if not is_remote(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    futures = {
        part: read_file_task.submit(config, schema, url, fmt, str(out_dir), part)
        for part, (url, fmt) in enumerate(inputs)
        if originals[part] is None
    }
    reports = {part: future.result() for part, future in futures.items()}
    for part, (url, _) in enumerate(inputs):
        if originals[part] is not None:
            original = reports[originals[part]]
            reports[part] = quarantine_replayed_file(config, url, original, out_dir, part)
    return combine_reports(config, out_dir, [reports[p] for p in sorted(reports)])


def _previous_ingest(store: ArtifactStore, pipeline: str) -> str | None:
    """The ingest output the drift check compares with, or None (then it is skipped).

    A pointer that does not verify (forged, or written before the signing key was set)
    or names a place outside the root is not followed; ingest goes on without the
    comparison, and this run's output replaces the pointer.
    """
    try:
        return store.latest_output(pipeline, "ingest")
    except (SignatureError, UnsafeName) as error:
        get_run_logger().warning("drift check skipped: %s", error)
        return None


def _check_drift(
    previous: str | None,
    out_dir: Location,
    schema: SchemaConfig,
    drift: DriftConfig,
    events: list[str],
) -> list[dict]:
    """Write this run's stats.json; return findings against the previous output's.

    Args:
        previous: The previous ingest output (a path, or a URL for a remote root).
        out_dir: This run's staging directory (a data prefix URL for a remote root).
        schema: The raw columns.
        drift: The drift checks.
        events: The event files this run wrote (relative to `out_dir`): only those are
            summarised, never an object someone else put under the data prefix.
    """
    if drift.policy == "off":
        return []
    files = [join(out_dir, rel) for rel in events]
    stats = compute_stats(join(out_dir, "events"), schema, drift.top_values, files)
    locations.write_text(join(out_dir, STATS_FILE), json.dumps(stats, indent=1))
    if previous is None:
        return []
    # Only the small stats file is read, not the previous output's events, and only
    # when the previous output's signed manifest vouches for its bytes.
    manifest = remote_manifest(previous, strict=False)
    listed = (manifest or {}).get("files", {}).get(STATS_FILE) or {}
    data = manifest.get("data", "") if manifest else ""
    text = read_text_or_none(join(previous, data, STATS_FILE))
    if text is None or hashlib.sha256(text.encode()).hexdigest() != listed.get("sha256"):
        if text is not None:
            get_run_logger().warning(
                "drift check skipped: %s/%s does not match its manifest", previous, STATS_FILE
            )
        return []
    return compare_stats(json.loads(text), stats, drift).findings
