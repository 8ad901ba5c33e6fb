"""Prefect task for the train stage: launches DeepSpeed ranks as separate processes.

The ranks keep their crash-safe resume checkpoints in a local directory per
fingerprint (`artifacts.checkpoints`). With a remote artifact root
(`s3://...`) that directory is mirrored to ``<root>/checkpoints/train/<fp>/``
(`CheckpointMirror`): before the ranks start, the newest remote checkpoint that
verifies is downloaded (so a retry on another machine resumes); while they run,
each newly committed checkpoint is uploaded, files first and its manifest last. A
remote checkpoint is committed when its manifest object exists; no rename is needed.
"""

import json
import os
import shutil
from functools import partial
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.locations import remove_tree
from artifacts.store import ArtifactStore
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    run_stage,
    stage_fingerprint,
    task_options,
    upstream_dirs,
)
from tasks.progress import train_progress
from tasks.train_nodes import PerNodeRun, log_launcher_line
from training.config import TrainConfig
from training.runtime.files import SUMMARY_FILE
from training.runtime.launcher import free_port
from training.stages import ssh_launch, train_launch


# A crashed or killed rank is transient: retry after 10 s, 20 s.
@task(name="train", task_run_name="train", **task_options(backoff_seconds=10.0, retries=2))
def train_task(
    config: TrainConfig,
    shard: StageOutput,
    preprocess: StageOutput,
    store: ArtifactStore,
    mode: Mode,
) -> StageOutput:
    """Train the model with DeepSpeed on `config.world_size` ranks.

    Which upstream output the model reads is `training.stages.train_launch`'s business.
    """
    fp = stage_fingerprint("train", config.fingerprinted(), [shard, preprocess])
    logger = get_run_logger()
    # For a remote root this is the local mirror of <root>/checkpoints/train/<fp>.
    resume_root = store.root / "checkpoints" / "train" / fp
    mirror = (
        CheckpointMirror(
            resume_root,
            store.location("checkpoints", "train", fp),
            config.keep_checkpoints,
            logger.info,
        )
        if store.remote
        else None
    )

    def produce(out_dir: Path) -> dict:
        progress_id = create_progress_artifact(
            progress=0.0, key="train-progress", description="Training steps completed (%)"
        )
        history: list[dict] = []
        # The ranks' protocol lines drive the bar and become human lines in the log; the
        # raw records stay in the launcher log (launcher.log in the stage output).
        with train_progress(logger) as shown:

            def on_progress(record: dict) -> None:
                history.append(record)
                shown.on_progress(record)
                update_progress_artifact(
                    progress_id, progress=100.0 * record["step"] / record["total_steps"]
                )

            if config.launcher == "per_node":
                nodes = PerNodeRun(config, shard, preprocess, store, fp, dict(os.environ), logger)
                result = nodes.run(out_dir, on_progress)
            else:
                run = partial(
                    train_launch(config, upstream_dirs(shard, preprocess)),
                    out_dir,
                    master_port=config.master_port or free_port(),
                    env=dict(os.environ),
                    on_log=partial(log_launcher_line, logger),
                    on_progress=on_progress,
                    # Outlives this attempt's staging directory, so that a retry resumes.
                    checkpoint_root=resume_root,
                    node=ssh_launch(config) if config.launcher == "ssh" else None,
                )
                if mirror is None:
                    result = run()
                else:
                    mirror.pull()
                    with mirror.pushing():
                        result = run()
        update_progress_artifact(progress_id, progress=100.0)
        # The step-time phases are the family's own (data/lookup/dense/optimizer or "step").
        phases = list(history[0]["step_ms"]) if history else []
        rows = "\n".join(
            f"| {r['step']} | {r['loss']:.5f} | {r['samples_per_s']:.0f} | "
            + " | ".join(f"{r['step_ms'][phase]:.1f}" for phase in phases)
            + f" | {' / '.join(f'{m:.0f}' for m in r['rss_mb'])} |"
            for r in history
        )
        create_markdown_artifact(
            key="train-loss",
            markdown="| step | loss | samples/s | "
            + " | ".join(f"{phase} ms" for phase in phases)
            + " | RSS MB per rank |\n|"
            + "---|" * (4 + len(phases))
            + "\n"
            + rows,
            description="Training loss, throughput, step time split and memory by step",
        )
        create_markdown_artifact(
            key="train-memory-plan",
            markdown=result.memory_plan.table(),
            description="Planned memory per rank (the family's memory plan)",
        )
        if result.resumed_from_step is not None:
            create_markdown_artifact(
                key="train-resume",
                markdown=f"Resumed from the checkpoint of step {result.resumed_from_step} "
                f"under `{resume_root}`.",
                description="Where this training run continued from",
            )
        validation = _validation_record(out_dir)
        if validation is not None:
            create_markdown_artifact(
                key="train-validation",
                markdown=_validation_table(validation),
                description="Valid-split metric by step, the best step (its weights are "
                "the model) and why training stopped",
            )
        # The stage output holds the final checkpoint; the resume checkpoints are spent.
        shutil.rmtree(resume_root, ignore_errors=True)
        if mirror is not None or config.launcher == "per_node":
            remove_tree(store.location("checkpoints", "train", fp))
        return {
            "world_size": result.world_size,
            "resumed_from_step": result.resumed_from_step,
            "resumed_from_world_size": result.resumed_from_world_size,
            "final_loss": result.final_loss,
            "steps": result.steps,
            "samples_per_s": result.samples_per_s,
            "seconds": result.seconds,
            "step_ms": result.step_ms,
            # In-training validation (train.eval_every_epochs): best step, curve, stop reason.
            **({"validation": validation} if validation is not None else {}),
        }

    return as_state(run_stage("train", fp, mode, store, produce))


def _validation_record(out_dir: Path) -> dict | None:
    """The in-training validation the ranks summarised, or None when there was none."""
    summary_path = out_dir / SUMMARY_FILE
    if not summary_path.is_file():
        return None
    return json.loads(summary_path.read_text()).get("validation")


def _validation_table(validation: dict) -> str:
    """A markdown table of the valid curve, the best step marked."""
    metric = validation["metric"]
    rows = "\n".join(
        f"| {point['step']} | {point['epoch']:.1f} | {point['value']:.5f} | "
        f"{'best' if point['step'] == validation['best_step'] else ''} |"
        for point in validation["curve"]
    )
    return (
        f"| step | epoch | valid {metric} | |\n|---|---|---|---|\n{rows}\n\n"
        f"Best: step {validation['best_step']} (epoch {validation['best_epoch']:.1f}), "
        f"{metric} {validation['best_value']:.5f}. {validation['stop_reason']}"
    )
