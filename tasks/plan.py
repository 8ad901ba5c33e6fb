"""The run plan: which stages will run and which are cache hits, and why, before any runs.

Every stage's fingerprint depends only on the config, the raw inputs' names and content
(sha256), the stage's source files and its upstream fingerprints, so the whole
chain can be computed up front. A stage whose output for its fingerprint is published is
a cache hit; one without is compared with the basis its last published output of this
pipeline was made from (`<root>/latest/<pipeline>/plan.json`) to say what changed: which
config keys (old -> new), which raw files, which source files, which upstream stage.

Reads: the artifact store's manifests and `latest/<pipeline>/plan.json`.
Writes: `latest/<pipeline>/plan.json` (`record_bases`), after a run.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from artifacts.errors import InputNotFoundError
from artifacts.fingerprint import code_version, fingerprint, library_versions
from artifacts.store import STAGES, ArtifactStore, Stage
from data_prep.ingest import check_partition, describe_inputs
from tasks import evaluate, ingest, preprocess
from tasks.common import Mode, StageOutput, load_run_key, stage_modules, task_options
from tasks.incremental import Parent, train_section
from tasks.train_nodes import check_dispatch

Action = Literal["run", "cached", "skip", "missing"]
PLAN_FILE = "plan.json"
_ROOT = Path(__file__).resolve().parent.parent
_SHOWN_CHANGES = 6


@dataclass(frozen=True)
class StageBasis:
    """What one stage's fingerprint is made of."""

    section: dict[str, Any]
    upstream: tuple[Stage, ...]
    modules: tuple[str, ...]
    prefix: str = ""  # how the plan names the section's keys: "train" -> train.lr


@dataclass(frozen=True)
class StagePlan:
    """One stage of the plan: what will happen and why."""

    stage: Stage
    mode: Mode
    action: Action
    fingerprint: str
    reason: str
    changes: list[str] = field(default_factory=list)


def stage_bases(config: Any, parent: Parent | None = None) -> dict[Stage, StageBasis]:
    """Each stage's fingerprint basis, exactly as its task computes it.

    Args:
        config: The pipeline config (flows.config.PipelineConfig).
        parent: The model an incremental run starts from (`tasks.incremental`).

    Raises:
        InputNotFoundError: `ingest.path` (or its `ingest.partition`) matches no files.
    """
    check_partition(config.ingest)
    inputs = describe_inputs(str(config.ingest.source()), config.ingest.format)
    return {
        "ingest": StageBasis(
            ingest.ingest_section(config.ingest, config.schema_, config.drift, inputs),
            (),
            tuple(stage_modules("ingest")),
        ),
        "preprocess": StageBasis(
            preprocess.preprocess_section(
                config.preprocess, config.schema_, config.ingest.partition, parent
            ),
            ("ingest",),
            tuple(stage_modules("preprocess")),
        ),
        "shard": StageBasis(
            config.shard.model_dump(), ("preprocess",), tuple(stage_modules("shard")), "shard"
        ),
        "train": StageBasis(
            train_section(config.train, parent),
            ("shard", "preprocess"),
            tuple(stage_modules("train")),
            "train",
        ),
        "evaluate": StageBasis(
            evaluate.evaluate_section(config.evaluate),
            ("train", "shard", "preprocess"),
            tuple(stage_modules("evaluate")),
            "evaluate",
        ),
        "export": StageBasis(
            {**config.export.model_dump(), "model": config.train.model,
             "item_field": config.schema_.item_key},
            ("train", "preprocess", "shard", "evaluate", "ingest"),
            tuple(stage_modules("export")),
            "export",
        ),
    }  # fmt: skip


def plan_run(
    config: Any, modes: dict[Stage, Mode], store: ArtifactStore, parent: Parent | None = None
) -> list[StagePlan]:
    """The plan of a run of `config` under `modes` (from `--from/--only/--force`).

    Args:
        config: The pipeline config.
        modes: Each stage's mode (flows.pipeline.plan_modes).
        store: The artifact store.
        parent: The model an incremental run starts from.

    Returns:
        One StagePlan per stage, in stage order. `missing` means the stage must be
        reused (it is upstream of `--from/--only`) but has no output for its fingerprint.
    """
    bases = stage_bases(config, parent)
    previous = store.read_latest_json(config.name, PLAN_FILE) or {}
    fps: dict[Stage, str] = {}
    plans = []
    for stage in STAGES:
        basis = bases[stage]
        upstream = [fps[name] for name in basis.upstream]
        fps[stage] = fingerprint(
            stage, basis.section, upstream, code_version(list(basis.modules), _ROOT)
        )
        published = store.is_published(stage, fps[stage])
        changes = _changes(_earlier(previous, stage), _basis_record(basis, fps, stage))
        mode = modes[stage]
        if mode == "skip":
            action, reason = "skip", "after the last --only stage"
        elif mode == "force":
            action, reason = "run", "selected by --from/--only/--force"
        elif published:
            action = "cached"
            reason = "upstream of the selected stages" if mode == "reuse" else "unchanged"
            reason += f"; output {store.output_url(stage, fps[stage])} exists"
        elif mode == "reuse":
            action, reason = "missing", "upstream of the selected stages, but never published"
        elif _earlier(previous, stage) is None:
            action, reason = "run", "no earlier output of this pipeline at this root"
        elif changes:
            action, reason = "run", "its fingerprint changed"
        else:
            action, reason = "run", "the output for this fingerprint is gone (deleted)"
        plans.append(StagePlan(stage, mode, action, fps[stage], reason, changes))
    return plans


def check_plan(plans: list[StagePlan]) -> None:
    """Fail before anything runs when a stage that must be reused has no output.

    Raises:
        InputNotFoundError: Names the stages and what to change.
    """
    missing = [p.stage for p in plans if p.action == "missing"]
    if missing:
        raise InputNotFoundError(
            f"{', '.join(missing)} has no valid output for this config, but --from/--only "
            f"would reuse it. Run it first: drop --from/--only, or include "
            f"'{missing[0]}' in them."
        )


def plan_markdown(pipeline: str, plans: list[StagePlan]) -> str:
    """The plan as a Markdown table, for the `plan` artifact and the log."""
    lines = [
        f"# Plan: {pipeline}",
        "",
        f"{sum(p.action == 'run' for p in plans)} to run, "
        f"{sum(p.action == 'cached' for p in plans)} cache hits, "
        f"{sum(p.action == 'skip' for p in plans)} skipped.",
        "",
        "| stage | plan | fingerprint | why |",
        "|---|---|---|---|",
    ]
    for p in plans:
        why = p.reason
        if p.changes:
            why += ": " + "; ".join(f"`{c}`" for c in p.changes)
        lines.append(f"| {p.stage} | **{p.action}** | `{p.fingerprint[:12]}` | {why} |")
    return "\n".join(lines) + "\n"


def record_bases(
    config: Any,
    store: ArtifactStore,
    plans: list[StagePlan],
    outputs: dict[str, StageOutput],
    parent: Parent | None = None,
) -> Path | str:
    """Remember what each stage's published output was made from, for the next plan.

    Only stages whose output now exists for the planned fingerprint (ran or cached) are
    recorded; the others keep their earlier entry.
    """
    bases = stage_bases(config, parent)
    fps = {p.stage: p.fingerprint for p in plans}
    record = store.read_latest_json(config.name, PLAN_FILE) or {}
    for p in plans:
        out = outputs.get(p.stage)
        if out is not None and out.status in ("ran", "cached") and out.fingerprint == fps[p.stage]:
            record[p.stage] = _basis_record(bases[p.stage], fps, p.stage)
    return store.write_latest_json(config.name, PLAN_FILE, record)


def _basis_record(basis: StageBasis, fps: dict[Stage, str], stage: Stage) -> dict:
    code = {m: hashlib.sha256((_ROOT / m).read_bytes()).hexdigest() for m in basis.modules}
    code.update({f"{name} version": v for name, v in library_versions().items()})
    return {
        "fingerprint": fps[stage],
        "section": json.loads(json.dumps(basis.section, default=str)),
        "upstream": {name: fps[name] for name in basis.upstream},
        "code": code,
        "prefix": basis.prefix,
    }


def _earlier(previous: dict, stage: Stage) -> dict | None:
    """The stage's entry of the last `plan.json`, or None when it has none of the right
    shape. The record is a hint (`ArtifactStore.read_latest_json`); on a root without a
    key it is not signed, so its shape is checked before the plan reads a field of it."""
    entry = previous.get(stage)
    fields = {"fingerprint": str, "section": dict, "upstream": dict, "code": dict}
    if not isinstance(entry, dict) or any(
        not isinstance(entry.get(name), kind) for name, kind in fields.items()
    ):
        return None
    return entry


def _changes(before: dict | None, now: dict) -> list[str]:
    """What differs between two basis records, most specific first."""
    if before is None or before["fingerprint"] == now["fingerprint"]:
        return []
    changes = _section_changes(before["section"], now["section"], now["prefix"])
    changes += [
        f"code {m} changed" for m in sorted(now["code"]) if before["code"].get(m) != now["code"][m]
    ]
    changes += [
        f"upstream {name} changed"
        for name, fp in now["upstream"].items()
        if before["upstream"].get(name) != fp
    ]
    if len(changes) > _SHOWN_CHANGES:
        changes = changes[:_SHOWN_CHANGES] + [f"and {len(changes) - _SHOWN_CHANGES} more"]
    return changes


def _section_changes(before: dict, now: dict, prefix: str) -> list[str]:
    changes = []
    if "inputs" in now or "inputs" in before:
        was = before.get("inputs")
        changes += _input_changes(was if isinstance(was, list) else [], now.get("inputs", []))
    old = _flatten(_without_inputs(before), prefix)
    new = _flatten(_without_inputs(now), prefix)
    for key in sorted(old.keys() | new.keys()):
        was, now_value = old.get(key, "<unset>"), new.get(key, "<unset>")
        if was != now_value:
            changes.append(f"{key}: {_short(was)} -> {_short(now_value)}")
    return changes


def _input_changes(before: list[dict], now: list[dict]) -> list[str]:
    old = {f.get("name", f.get("path")): f for f in before if isinstance(f, dict)}
    new = {f.get("name", f.get("path")): f for f in now if isinstance(f, dict)}
    changes = [f"raw file added: {p}" for p in sorted(new.keys() - old.keys())]
    changes += [f"raw file removed: {p}" for p in sorted(old.keys() - new.keys())]
    changes += [
        f"raw file rewritten: {p}" for p in sorted(new.keys() & old.keys()) if old[p] != new[p]
    ]
    return changes


def _without_inputs(section: dict) -> dict:
    return {k: v for k, v in section.items() if k != "inputs"}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, child in value.items():
            flat.update(_flatten(child, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


@task(name="plan", task_run_name="plan", **task_options(retries=0))
def plan_task(
    config: Any, modes: dict[Stage, Mode], store: ArtifactStore, parent: Parent | None = None
) -> list[StagePlan]:
    """Plan the run (`plan_run`) and show it as the `plan` Markdown artifact.

    A remote root is checked first, once: an unreachable bucket or missing credentials
    fail here, naming the URL, before any stage runs (and the plan is never retried).

    Raises:
        StoreUnreachable: The artifact store's URL cannot be reached.
        ConfigError: A remote root without a signing key (`tasks.common.load_run_key`);
            train.node_dispatch 'workers' without an object-store root or a
            Prefect server the workers can reach (`tasks.train_nodes.check_dispatch`).
    """
    load_run_key(store)
    store.check_reachable()
    check_dispatch(config.train, store.url)
    plans = plan_run(config, modes, store, parent)
    markdown = plan_markdown(config.name, plans)
    create_markdown_artifact(
        key="plan", markdown=markdown, description="Which stages run, which are cache hits, why"
    )
    get_run_logger().info("%s", markdown)
    return plans
