"""The recforge pipeline flow: six stages from raw logs to an exported model.

Where each stage's code is: the flow calls one task per stage, and each task calls its
library entry. `training.stages` is the only module that knows the model families: it
sends CTR models to `training.ctr` and sequence models to `training.sequence`, picked by
`train.model`:

| stage | task | library entry |
|---|---|---|
| ingest | `tasks.ingest.ingest_task` | `data_prep.ingest.ingest_logs` (`data_prep.ingest.ingest_file` per file) |
| preprocess | `tasks.preprocess.preprocess_task` | `data_prep.preprocess.preprocess_events` |
| shard | `tasks.shard.shard_task` | `data_prep.shard.write_shards` (`data_prep.shard.write_shards_distributed` for an object-store root) |
| train | `tasks.train.train_task` | `training.stages.train_launch` (`training.ctr.train.train_model`, `training.sequence.train.train_sequence_model`) |
| evaluate | `tasks.evaluate.evaluate_task` | `training.stages.evaluate` (`training.ctr.evaluate.evaluate_model`, `training.sequence.evaluate.evaluate_sequence_model`) |
| export | `tasks.export.export_task` | `training.stages.export` (`training.ctr.export.export_model`, `training.sequence.export.export_sequence_model`, `training.sequence.bst_export.export_bst_model`) |
| bless, promote | `tasks.promote.bless_task`, `tasks.promote.promote_task` | `training.stages.evaluate` (the champion), `training.blessing.decide` |
"""  # noqa: E501

import datetime
import math
import time
import uuid
from pathlib import Path

from prefect import flow, runtime
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import BaseModel, Field

from artifacts.errors import ConfigError, RecforgeError, StoreUnreachable
from artifacts.lease import RunLease
from artifacts.locations import backend_errors, is_remote
from artifacts.store import DEFAULT_ROOT, STAGES, ArtifactStore, Stage
from flows.config import (
    PipelineConfig,
    backfill_days,
    backfill_overrides,
    expand_schedule,
    load_config,
)
from flows.deploy import check_deployment_defaults, check_deployment_run
from tasks.common import Mode, StageOutput
from tasks.evaluate import evaluate_task
from tasks.export import export_task
from tasks.incremental import Parent, lineage_record, parent_task
from tasks.ingest import ingest_task
from tasks.plan import StagePlan, check_plan, plan_task, record_bases
from tasks.preprocess import preprocess_task
from tasks.promote import bless_task, promote_task
from tasks.report import publish_run_artifacts
from tasks.shard import shard_task
from tasks.train import train_task


class RunParams(BaseModel):
    """Parameters of a pipeline run (also the Prefect UI's form for deployments)."""

    config: str = Field(description="Pipeline YAML, e.g. configs/demo.yaml.")
    root: str = Field(
        default=DEFAULT_ROOT,
        description="Artifact store root: a directory, or an fsspec URL such as s3://bucket/prefix.",
    )
    from_stage: Stage | None = Field(
        default=None, description="Rerun this stage and every later one; reuse earlier outputs."
    )
    only: list[Stage] = Field(default=[], description="Rerun just these stages.")
    force: list[Stage] = Field(default=[], description="Rerun these even when cached.")
    overrides: list[str] = Field(default=[], description="section.key=value config overrides.")


def plan_modes(params: RunParams) -> dict[Stage, Mode]:
    """How each stage runs under --from/--only/--force.

    Stages before the first selected stage must reuse their outputs; selected
    stages run; stages after the last `--only` stage are skipped.
    """
    if params.from_stage and params.only:
        raise ValueError("use either from_stage or only, not both")
    modes: dict[Stage, Mode] = dict.fromkeys(STAGES, "auto")
    if params.from_stage:
        start = STAGES.index(params.from_stage)
        for i, stage in enumerate(STAGES):
            modes[stage] = "reuse" if i < start else "force"
    elif params.only:
        picked = [STAGES.index(s) for s in params.only]
        for i, stage in enumerate(STAGES):
            if stage in params.only:
                modes[stage] = "force"
            else:
                modes[stage] = "skip" if i > max(picked) else "reuse"
    for stage in params.force:
        if modes[stage] != "skip":
            modes[stage] = "force"
    return modes


class Approval(RunInput):
    """What the Prefect UI asks before a blessed model is promoted."""

    approve: bool = Field(description="Promote this model to champion.")
    note: str = Field(default="", description="Why (kept with the decision).")


def _result(state) -> StageOutput:
    # Tasks return a Cached state on a cache hit; .result() unwraps both kinds.
    return state.result()


def _run_name() -> str:
    """Flow run names the UI lists: `tiny`, `tiny from evaluate`, `tiny: rerun export`."""
    parameters = runtime.flow_run.parameters
    name = Path(parameters["config"]).stem
    if parameters.get("stage"):
        return f"{name}: rerun {parameters['stage']}"
    if parameters.get("from_stage"):
        return f"{name} from {parameters['from_stage']}"
    if parameters.get("only"):
        return f"{name} only {','.join(parameters['only'])}"
    return name


@flow(name="recforge-pipeline", flow_run_name=_run_name, log_prints=True)
def pipeline(
    config: str,
    root: str = DEFAULT_ROOT,
    from_stage: Stage | None = None,
    only: list[Stage] | None = None,
    force: list[Stage] | None = None,
    overrides: list[str] | None = None,
) -> str:
    """Run ingest -> preprocess -> shard -> train -> evaluate -> export.

    The parameters are flat (not one RunParams object) so that a deployment run can
    change one of them: Prefect merges run parameters with the deployment's defaults by
    top-level name. Their types are checked by the server before a run starts; from a
    deployment, their values are held to what the operator allowed before anything is
    read or written (`flows.deploy.check_deployment_run`).

    Args:
        config: Pipeline YAML, e.g. configs/demo.yaml.
        root: Artifact store root: a directory, or an fsspec URL (s3://bucket/prefix).
        from_stage: Rerun this stage and every later one; reuse earlier outputs.
        only: Rerun just these stages.
        force: Rerun these even when cached.
        overrides: section.key=value config overrides.

    Returns:
        The path (URL for a remote root) of the run record,
        ``<root>/runs/<run_id>/summary.json``.

    Raises:
        ConfigError: A deployment run's root, config or an override is not allowed.
    """
    check_deployment_run(config, root, overrides or [])
    params = RunParams(
        config=config,
        root=root,
        from_stage=from_stage,
        only=only or [],
        force=force or [],
        overrides=expand_schedule(overrides or [], _scheduled_time()),
    )
    return run_pipeline(params)


def _scheduled_time() -> datetime.datetime:
    """When this flow run was scheduled for (now, for a run started by hand)."""
    scheduled = runtime.flow_run.scheduled_start_time
    if scheduled is None:
        return datetime.datetime.now(datetime.UTC)
    return datetime.datetime.fromtimestamp(scheduled.timestamp(), datetime.UTC)


@flow(name="recforge-rerun", flow_run_name=_run_name, log_prints=True)
def rerun(
    config: str,
    stage: Stage,
    root: str = DEFAULT_ROOT,
    downstream: bool = True,
    overrides: list[str] | None = None,
) -> str:
    """Rerun one stage, reusing the published outputs of the stages before it.

    Prefect can only retry a whole flow run; this is restart-from-task for recforge.
    Upstream outputs come from the content-addressed store and must exist.

    Args:
        config: Pipeline YAML, e.g. configs/demo.yaml.
        stage: The stage to rerun.
        root: Artifact store root directory.
        downstream: Also rerun every later stage (off: this stage only).
        overrides: section.key=value config overrides.

    Returns:
        The path of the run record.

    Raises:
        ConfigError: A deployment run's root, config or an override is not allowed.
    """
    check_deployment_run(config, root, overrides or [])
    params = RunParams(
        config=config,
        root=root,
        from_stage=stage if downstream else None,
        only=[] if downstream else [stage],
        overrides=expand_schedule(overrides or [], _scheduled_time()),
    )
    return run_pipeline(params)


class BackfillStopped(RecforgeError):
    """A backfill day failed; the days after it did not run."""


@flow(name="recforge-backfill", log_prints=True)
def backfill(
    config: str,
    first: str,
    last: str,
    root: str = DEFAULT_ROOT,
    overrides: list[str] | None = None,
) -> list[str]:
    """Run the pipeline once per day from `first` to `last`, in order, each as a subflow.

    Each day's overrides have `{scheduled_date}` set to that day, and name its partition
    (`ingest.partition=dt=<day>` unless the overrides name one). With train.init, each
    day warm-starts from the champion the days before it left: a day the gate rejects
    does not advance the chain, and the next day starts from the champion still serving.
    Days already done are all cache hits. The first day that fails stops the backfill.

    Args:
        config: Pipeline YAML.
        first: The first day, YYYY-MM-DD (UTC).
        last: The last day, included.
        root: Artifact store root.
        overrides: section.key=value config overrides of every day.

    Returns:
        The run record of each day, in order.

    Raises:
        ConfigError: The dates (`flows.config.backfill_days`), or the config.
        BackfillStopped: A day failed: names it, its error and the command that goes on.
    """
    days = backfill_days(first, last)
    load_config(config, backfill_overrides(overrides or [], days[0]))  # fail before day one
    records: list[str] = []
    for number, day in enumerate(days, start=1):
        date = day.date().isoformat()
        try:
            records.append(
                pipeline.with_options(flow_run_name=f"{Path(config).stem} {date}")(
                    config=config, root=root, overrides=backfill_overrides(overrides or [], day)
                )
            )
        except Exception as error:
            raise BackfillStopped(
                f"backfill stopped at {date} (day {number} of {len(days)}): "
                f"{type(error).__name__}: {error}. Days before it are done; fix the cause and "
                f"run `recforge backfill {config} --from {date} --to {last}` to go on"
            ) from error
        print(f"backfill {date}: {records[-1]}")
    return records


def run_pipeline(params: RunParams) -> str:
    """The body of both flows: plan, the six stages, the gate, the run record.

    From its plan to its run record the run holds a lease on the root, which `recforge
    gc` respects: it deletes nothing the run uses (`artifacts.lease`). A store the lease
    cannot be written to fails at the plan, which names the URL and what to set.
    """
    store = ArtifactStore(params.root)  # the one store object of this run
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{str(runtime.flow_run.id or uuid.uuid4())[:8]}"
    lease = RunLease(store.url, run_id)
    try:
        return _run_leased(params, store, run_id, lease)
    finally:
        lease.release()


def _run_leased(params: RunParams, store: ArtifactStore, run_id: str, lease: RunLease) -> str:
    outputs: dict[str, StageOutput] = {}
    promotion: dict = {}
    plans: list[StagePlan] = []
    error: BaseException | None = None
    config: PipelineConfig | None = None
    parent: Parent | None = None
    try:
        config = load_config(params.config, params.overrides)
        try:
            lease.start()  # before the plan reads the store: until `name`, gc keeps all
            leased = True
        except (*backend_errors(), OSError):
            leased = False  # a missing bucket or refused credentials: the plan names them
        # train.init: the model this run warm-starts from, verified (it keys the plan).
        parent = parent_task(config, store) if config.train.init is not None else None
        plans = plan_task(config, plan_modes(params), store, parent)
        if not leased:
            lease.start()  # the store answered the plan: now the run must hold its lease
        lease.name(plan.fingerprint for plan in plans)
        check_plan(plans)
        run_stages(config, plans, store, outputs, parent)
        promotion = bless_task(
            config.bless,
            config.evaluate,
            config.train.model,
            config.export.model_name,
            outputs["evaluate"],
            outputs["export"],
            outputs["shard"],
            outputs["preprocess"],
            store,
        )
        if promotion["status"] == "blessed":
            promotion = _promote(config, promotion, store)
    except BaseException as err:  # recorded in the run record, then re-raised
        error = err
    failed_at = None
    if error is not None:
        failed_at = "config" if config is None else "plan" if not plans else None
        failed_at = failed_at or next((s for s in STAGES if s not in outputs), "gate")
    if isinstance(error, StoreUnreachable):
        # There is no store to write a run record into; the error names the URL.
        raise error
    record = build_run_record(run_id, params, outputs, error, failed_at)
    record["promotion"] = promotion
    if config is not None and config.ingest.partition is not None:
        record["lineage"] = lineage_record(
            parent,
            outputs["preprocess"].meta.get("partitions") if "preprocess" in outputs else None,
            [],
        )
    path = store.write_run_record(run_id, record)
    if config is not None and plans:
        record_bases(config, store, plans, outputs, parent)
    publish_run_artifacts(record, path, params)
    print(f"run record: {path}")
    if error is not None:
        raise error
    return str(path)


def run_stages(
    config: PipelineConfig,
    plans: list[StagePlan],
    store: ArtifactStore,
    outputs: dict[str, StageOutput],
    parent: Parent | None = None,
) -> None:
    """The six stage tasks in order, each in its planned mode; fills `outputs` as they end.

    `parent` (train.init) is the model an incremental run extends and warm-starts from.
    """
    modes = {p.stage: p.mode for p in plans}
    outputs["ingest"] = _result(
        ingest_task(
            config.ingest,
            config.schema_,
            config.drift,
            config.name,
            store,
            modes["ingest"],
            return_state=True,
        )
    )
    outputs["preprocess"] = _result(
        preprocess_task(
            config.preprocess,
            config.schema_,
            outputs["ingest"],
            store,
            modes["preprocess"],
            partition=config.ingest.partition,
            parent=parent,
            return_state=True,
        )
    )
    outputs["shard"] = _result(
        shard_task(config.shard, outputs["preprocess"], store, modes["shard"], return_state=True)
    )
    outputs["train"] = _result(
        train_task(
            config.train,
            outputs["shard"],
            outputs["preprocess"],
            store,
            modes["train"],
            parent=parent,
            return_state=True,
        )
    )
    outputs["evaluate"] = _result(
        evaluate_task(
            config.evaluate,
            config.train.model,
            outputs["train"],
            outputs["shard"],
            outputs["preprocess"],
            store,
            modes["evaluate"],
            return_state=True,
        )
    )
    outputs["export"] = _result(
        export_task(
            config.export,
            config.train.model,
            config.schema_.item_key,
            outputs["train"],
            outputs["preprocess"],
            outputs["shard"],
            outputs["evaluate"],
            store,
            modes["export"],
            ingest=outputs["ingest"],
            parent=parent,
            return_state=True,
        )
    )


def _promote(config: PipelineConfig, blessed: dict, store: ArtifactStore) -> dict:
    """Ask for approval when configured, then move the champion pointer."""
    if config.bless.require_approval:
        try:
            answer = pause_flow_run(
                wait_for_input=Approval.with_initial_data(
                    description=f"Promote {config.export.model_name} {blessed['version']} "
                    f"(champion now: {blessed['champion'] or 'none'})?",
                    approve=False,
                ),
                timeout=config.bless.approval_timeout_s,
            )
        except Exception as error:  # the pause timed out or was aborted: no means no
            return {**blessed, "status": "not_approved", "approval": f"{error}"}
        if not answer.approve:
            return {**blessed, "status": "not_approved", "approval": answer.note}
        blessed = {**blessed, "approval": answer.note or "approved"}
    reason = blessed.get("approval") or "blessed by the gate"
    promote_task(config.export.model_name, blessed["version"], store, reason)
    return {**blessed, "status": "promoted", "champion": blessed["version"]}


# The train stage's figures the run record carries (from its output's meta): how it ran,
# where it continued from, and how fast. A cached stage shows the run that trained it.
TRAIN_FIGURES = (
    "world_size",
    "resumed_from_step",
    "resumed_from_world_size",
    "steps",
    "samples_per_s",
    "step_ms",
    # Rank 0's start-up by phase (CTR models): where the time to the first step went.
    "startup_s",
    # How the sharded embedding rows were stored (fp32, fp16, bf16).
    "table_precision",
    # How their rows and gradients travelled, and the bytes all ranks sent per sample.
    "comm_precision",
    "wire_bytes_per_sample",
    "final_loss",
    # launcher 'per_node': earlier attempts that failed, with the nodes they lost and why.
    "failed_attempts",
)


def train_figures(meta: dict) -> dict:
    """`TRAIN_FIGURES` found in a train output's meta; a NaN loss (no step) as None."""
    figures = {key: meta[key] for key in TRAIN_FIGURES if key in meta}
    loss = figures.get("final_loss")
    if isinstance(loss, float) and math.isnan(loss):
        figures["final_loss"] = None
    return figures


def build_run_record(
    run_id: str,
    params: RunParams,
    outputs: dict[str, StageOutput],
    error: BaseException | None,
    failed_at: str | None = None,
) -> dict:
    """The run record (docs/architecture.md): stage statuses, metrics and the model path.

    `failed_at` names where a failed run stopped: a stage, or `config`, `plan` (before
    any stage ran) or `gate` (after export).
    """
    stages = {}
    for stage in STAGES:
        if stage in outputs:
            out = outputs[stage]
            stages[stage] = {
                "status": out.status,
                "fingerprint": out.fingerprint,
                "output": out.output,
                "seconds": out.seconds,
            }
            if stage == "train":
                stages[stage].update(train_figures(out.meta))
            if "validation" in out.meta:
                # A sequence model validated while training: which step's weights, and why
                # training stopped (the curve is in the train output's train_summary.json).
                validation = out.meta["validation"]
                stages[stage]["validation"] = {
                    key: validation[key]
                    for key in ("metric", "best_step", "best_epoch", "best_value", "stop_reason")
                }
        elif error is not None and stage == failed_at:
            stages[stage] = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        else:
            stages[stage] = {"status": "skipped"}
    metrics = dict(outputs["evaluate"].meta.get("metrics", {})) if "evaluate" in outputs else {}
    model = outputs["export"].meta.get("model") if "export" in outputs else None
    return {
        "run_id": run_id,
        "config": params.config,
        "status": "failed" if error is not None else "completed",
        "params": params.model_dump(),
        "stages": stages,
        "metrics": metrics,
        "model": model,
        **(
            {"error": f"{type(error).__name__}: {error}", "failed_at": failed_at}
            if error is not None
            else {}
        ),
    }


def deployments(
    config: str,
    root: str,
    name: str,
    cron: str | None,
    rerun_cron: str | None = None,
    rerun_stage: Stage | None = None,
    overrides: list[str] | None = None,
) -> list:
    """The pipeline and the per-stage rerun flow as deployments named `name`.

    Every parameter is settable per run and typed: the server rejects an unknown stage
    or a wrong type before a run starts (`enforce_parameter_schema`).

    Args:
        config: Pipeline YAML (made absolute: runs start in the serving process's cwd).
        root: Artifact store root (a local one made absolute; a URL as it is).
        name: Deployment name, e.g. the config's name.
        cron: The pipeline's cron schedule (None: no schedule).
        rerun_cron: The rerun flow's cron schedule (None: it runs only when triggered,
            with the stage named in the run form).
        rerun_stage: The stage a scheduled rerun starts from (needed with `rerun_cron`).
        overrides: Default section.key=value overrides of both.

    Raises:
        ConfigError: No stage for `rerun_cron`; or the config or root is one the
            deployment's own runs would refuse (`flows.deploy.check_deployment_defaults`).
    """
    if rerun_cron and rerun_stage is None:
        raise ConfigError("a rerun schedule needs the stage it reruns: pass --rerun-stage")
    check_deployment_defaults(config, root)
    defaults = {
        "config": str(Path(config).absolute()),
        "root": root if is_remote(root) else str(Path(root).absolute()),
        "overrides": list(overrides or []),
    }
    common = {"tags": ["recforge"], "enforce_parameter_schema": True}
    return [
        pipeline.to_deployment(
            name=name,
            cron=cron,
            parameters=defaults,
            description="recforge: ingest -> preprocess -> shard -> train -> evaluate -> export",
            **common,
        ),
        rerun.to_deployment(
            name=name,
            cron=rerun_cron,
            parameters={**defaults, **({"stage": rerun_stage} if rerun_stage else {})},
            description="recforge: rerun one stage (and later ones), reusing earlier outputs",
            **common,
        ),
    ]
