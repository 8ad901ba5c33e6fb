"""The recforge pipeline flow: six stages from raw logs to an exported model."""

import time
import uuid

from prefect import flow, runtime
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import BaseModel, Field

from flows.config import PipelineConfig, load_config
from tasks.common import STAGES, Mode, Stage, StageOutput
from tasks.evaluate import evaluate_task
from tasks.export import export_task
from tasks.ingest import ingest_task
from tasks.preprocess import preprocess_task
from tasks.promote import bless_task, promote_task
from tasks.shard import shard_task
from tasks.store import ArtifactStore
from tasks.train import train_task


class RunParams(BaseModel):
    """Parameters of a pipeline run (also the Prefect UI's form for deployments)."""

    config: str = Field(description="Pipeline YAML, e.g. configs/demo.yaml.")
    root: str = Field(default="artifacts", description="Artifact store root directory.")
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


@flow(name="recforge-pipeline", flow_run_name="{params.config}", log_prints=True)
def pipeline(params: RunParams) -> str:
    """Run ingest -> preprocess -> shard -> train -> evaluate -> export.

    Returns:
        The path of the run record, ``<root>/runs/<run_id>/summary.json``.
    """
    config = load_config(params.config, params.overrides)
    modes = plan_modes(params)
    root = params.root
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{str(runtime.flow_run.id or uuid.uuid4())[:8]}"
    outputs: dict[str, StageOutput] = {}
    promotion: dict = {}
    error: BaseException | None = None
    try:
        outputs["ingest"] = _result(
            ingest_task(
                config.ingest,
                config.schema_,
                config.drift,
                config.name,
                root,
                modes["ingest"],
                return_state=True,
            )
        )
        outputs["preprocess"] = _result(
            preprocess_task(
                config.preprocess,
                config.schema_,
                outputs["ingest"],
                root,
                modes["preprocess"],
                return_state=True,
            )
        )
        outputs["shard"] = _result(
            shard_task(config.shard, outputs["preprocess"], root, modes["shard"], return_state=True)
        )
        outputs["train"] = _result(
            train_task(
                config.train,
                outputs["shard"],
                outputs["preprocess"],
                root,
                modes["train"],
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
                root,
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
                root,
                modes["export"],
                ingest=outputs["ingest"],
                return_state=True,
            )
        )
        promotion = bless_task(
            config.bless,
            config.evaluate,
            config.train.model,
            config.export.model_name,
            outputs["evaluate"],
            outputs["export"],
            outputs["shard"],
            outputs["preprocess"],
            root,
        )
        if promotion["status"] == "blessed":
            promotion = _promote(config, promotion, root)
    except BaseException as err:  # recorded in the run record, then re-raised
        error = err
    record = build_run_record(run_id, params, outputs, error)
    record["promotion"] = promotion
    path = ArtifactStore(root).write_run_record(run_id, record)
    print(f"run record: {path}")
    if error is not None:
        raise error
    return str(path)


def _promote(config: PipelineConfig, blessed: dict, root: str) -> dict:
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
    promote_task(config.export.model_name, blessed["version"], root, reason)
    return {**blessed, "status": "promoted", "champion": blessed["version"]}


def build_run_record(
    run_id: str, params: RunParams, outputs: dict[str, StageOutput], error: BaseException | None
) -> dict:
    """The run record (DESIGN.md): stage statuses, metrics and the model path."""
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
            if out.meta.get("resumed_from_step") is not None:
                # A train attempt that continued from a checkpoint says from where.
                stages[stage]["resumed_from_step"] = out.meta["resumed_from_step"]
        elif error is not None and not any(s["status"] == "failed" for s in stages.values()):
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
        **({"error": f"{type(error).__name__}: {error}"} if error is not None else {}),
    }


def pipeline_deployment(config: str, cron: str, root: str, name: str):
    """The pipeline as a scheduled deployment; every RunParams field is settable per run."""
    return pipeline.to_deployment(
        name=name,
        cron=cron,
        parameters={"params": RunParams(config=config, root=root).model_dump()},
        description="recforge: ingest -> preprocess -> shard -> train -> evaluate -> export",
        tags=["recforge"],
        enforce_parameter_schema=True,  # bad parameters are rejected before a run starts
    )
