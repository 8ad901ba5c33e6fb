"""Run artifacts: what a run produced, and for a failed run, how to rerun from where it failed.

The `run-record` Markdown artifact links the flow run to each stage's output directory,
the model package and the run record. A failed run also gets a `failure` artifact that
names the stage, the error, and the command and UI action that rerun from that stage
(the other stages' outputs are reused from the artifact store).
"""

import shlex
from pathlib import Path
from typing import Any

from prefect import runtime
from prefect.artifacts import create_markdown_artifact

RERUN_FLOW = "recforge-rerun"


def publish_run_artifacts(record: dict, record_path: Path, params: Any) -> None:
    """Create the `run-record` artifact, and the `failure` artifact if the run failed.

    Args:
        record: The run record (flows.pipeline.build_run_record).
        record_path: Where it was written.
        params: The run's flows.pipeline.RunParams.
    """
    lines = [
        f"# Run {record['run_id']}: {record['status']}",
        "",
        f"Config `{record['config']}`, run record `{record_path}`.",
        "",
        "| stage | status | fingerprint | output |",
        "|---|---|---|---|",
    ]
    for stage, info in record["stages"].items():
        fp = info.get("fingerprint", "")[:12]
        output = f"`{info['output']}`" if info.get("output") else ""
        lines.append(f"| {stage} | {info['status']} | `{fp}` | {output} |")
    if record.get("model"):
        lines += ["", f"Model package: `{record['model']}`"]
    promotion = record.get("promotion") or {}
    if promotion.get("status"):
        lines.append(f"Gate: {promotion['status']} (champion: {promotion.get('champion')})")
    create_markdown_artifact(
        key="run-record", markdown="\n".join(lines) + "\n", description="Stage outputs and model"
    )
    if record["status"] == "failed":
        create_markdown_artifact(
            key="failure",
            markdown=failure_markdown(record, params, runtime.deployment.name),
            description="Which stage failed and how to rerun from it",
        )


def failure_markdown(record: dict, params: Any, deployment: str | None) -> str:
    """Which stage failed, the error, and how to rerun from that stage.

    Args:
        record: A failed run record.
        params: The run's RunParams.
        deployment: The deployment this run came from (None: `recforge run`).
    """
    failed = record.get("failed_at")
    error = record.get("error", "unknown error")
    command = ["recforge", "run", params.config, "--root", params.root]
    for override in params.overrides:
        command += ["--set", override]
    lines = [f"# Run {record['run_id']} failed", ""]
    if failed not in record["stages"]:
        # No stage had started (config, plan), or every stage had ended (gate).
        lines += [
            f"**Failed at `{failed}`**, "
            + ("after export" if failed == "gate" else "before any stage ran")
            + ":",
            "",
            f"```\n{error}\n```",
            "",
            "Fix what the message names, then run again (finished stages are cache hits):",
            "",
            f"```\n{shlex.join(command)}\n```",
        ]
        return "\n".join(lines) + "\n"
    lines += [f"**Stage `{failed}` failed:**", "", f"```\n{error}\n```", ""]
    lines += [
        f"Rerun from `{failed}` (earlier stages' outputs are reused):",
        "",
        f"```\n{shlex.join([*command, '--from', failed])}\n```",
    ]
    if deployment:
        lines += [
            "",
            f"In the Prefect UI: **Deployments → {RERUN_FLOW} / {deployment} → Run → "
            f"Custom run**, set `stage` to `{failed}`, then **Submit**. Or:",
            "",
            f"```\nprefect deployment run '{RERUN_FLOW}/{deployment}' -p stage={failed}\n```",
        ]
    return "\n".join(lines) + "\n"
