"""Prefect task for the train stage: launches DeepSpeed ranks as separate processes.

The ranks keep their crash-safe resume checkpoints in a local directory per
fingerprint (`artifacts.checkpoints`). With a remote artifact root
(`s3://...`) that directory is mirrored to ``<root>/checkpoints/train/<key>/``
(`CheckpointMirror`): before the ranks start, the newest remote checkpoint that
verifies is downloaded (so a retry on another machine resumes); while they run,
each newly committed checkpoint is uploaded, files first and its manifest last. A
remote checkpoint is committed when its manifest object exists; no rename is needed.
"""

import json
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

from artifacts.checkpoint_mirror import CheckpointMirror, newest_checkpoint_meta
from artifacts.locations import remove_tree
from artifacts.store import ArtifactStore
from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
    upstream_dirs,
)
from tasks.incremental import Parent, train_section
from tasks.progress import train_progress
from tasks.train_nodes import PerNodeRun, failed_attempts_before, log_launcher_line
from training.config import TrainConfig, resume_layout
from training.runtime.files import SUMMARY_FILE
from training.runtime.launcher import free_port
from training.runtime.nodes import surviving_layout
from training.stages import ssh_launch, train_launch

# The progress artifact is updated at most once per this many seconds.
ARTIFACT_INTERVAL_S = 1.0


# A crashed or killed rank is transient: retry after 10 s, 20 s.
@task(name="train", task_run_name="train", **task_options(backoff_seconds=10.0, retries=2))
def train_task(
    config: TrainConfig,
    shard: StageOutput,
    preprocess: StageOutput,
    store: ArtifactStore,
    mode: Mode,
    parent: Parent | None = None,
) -> StageOutput:
    """Train the model with DeepSpeed on `config.world_size` ranks.

    Which upstream output the model reads is `training.stages.train_launch`'s business.
    With a `parent` (train.init) the ranks warm-start from its train output, verified
    against its signed manifest before any rank reads it.
    """
    fp = stage_fingerprint("train", train_section(config, parent), [shard, preprocess])
    # The resume checkpoints are named by what is trained, not by the layout: a retry
    # or rerun on another world size finds them (`TrainConfig.resume_keyed`).
    resume_keyed = config.resume_keyed()
    if parent is not None:
        resume_keyed["parent"] = parent.identity()
    key = stage_fingerprint("train", resume_keyed, [shard, preprocess])
    logger = get_run_logger()
    # For a remote root this is the local mirror of <root>/checkpoints/train/<key>.
    resume_root = store.root / "checkpoints" / "train" / key
    mirror = (
        CheckpointMirror(
            resume_root,
            store.location("checkpoints", "train", key),
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
        # per_node: the attempts that failed before this one, and the nodes they lost.
        failed_attempts: list[dict] = []
        # The ranks' protocol lines drive the bar and become human lines in the log; the
        # raw records stay in the launcher log (launcher.log in the stage output).
        with train_progress(logger) as shown:
            # The artifact is a request to the Prefect API: at most one a second, not one
            # per record (every log_every steps). At ~10 records/s they kept the API server
            # on ~10% of a core that the ranks train on. The end always gets its 100%.
            last_update = [0.0]

            def on_progress(record: dict) -> None:
                history.append(record)
                shown.on_progress(record)
                if time.monotonic() - last_update[0] >= ARTIFACT_INTERVAL_S:
                    last_update[0] = time.monotonic()
                    update_progress_artifact(
                        progress_id, progress=100.0 * record["step"] / record["total_steps"]
                    )

            # The layout asked for (less lost nodes, with train.min_nodes), its batch
            # split fitted to the newest checkpoint's global batch when another world
            # size wrote it.
            layout, workers = config, None
            if config.launcher == "per_node":
                failed_attempts.extend(failed_attempts_before(store, key))
                layout, workers, line = surviving_layout(config, failed_attempts)
                if line:
                    logger.warning(line)
            launched = fit_to_checkpoint(layout, store, key, resume_root, logger.info)
            warm = None
            if parent is not None:
                parent_train = parent.train_output(store)
                warm = (local_dir(parent_train), int(parent_train.meta["world_size"]))
            if launched.launcher == "per_node":
                nodes = PerNodeRun(
                    launched, shard, preprocess, store, key, dict(os.environ), logger, workers
                )
                result = nodes.run(out_dir, on_progress)
            else:
                run = partial(
                    train_launch(launched, upstream_dirs(shard, preprocess), warm),
                    out_dir,
                    master_port=launched.master_port or free_port(),
                    env=dict(os.environ),
                    on_log=partial(log_launcher_line, logger),
                    on_progress=on_progress,
                    # Outlives this attempt's staging directory, so that a retry resumes.
                    checkpoint_root=resume_root,
                    node=ssh_launch(launched) if launched.launcher == "ssh" else None,
                    artifact_root=store.url,
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
            remove_tree(store.location("checkpoints", "train", key))
        return {
            "world_size": result.world_size,
            "resumed_from_step": result.resumed_from_step,
            "resumed_from_world_size": result.resumed_from_world_size,
            "final_loss": result.final_loss,
            "steps": result.steps,
            "samples_per_s": result.samples_per_s,
            "seconds": result.seconds,
            "step_ms": result.step_ms,
            **({"startup_s": result.startup_s} if result.startup_s else {}),
            # How the sharded rows were stored (models with a sharded table).
            **(
                {"table_precision": result.table_precision}
                if result.table_precision is not None
                else {}
            ),
            **(
                {"comm_precision": result.comm_precision}
                if result.comm_precision is not None
                else {}
            ),
            # Bytes all ranks sent each other per sample, by kind (families that count them).
            **(
                {"wire_bytes_per_sample": result.wire_bytes_per_sample}
                if result.wire_bytes_per_sample is not None
                else {}
            ),
            **({"failed_attempts": failed_attempts} if failed_attempts else {}),
            # In-training validation (train.eval_every_epochs): best step, curve, stop reason.
            **({"validation": validation} if validation is not None else {}),
        }

    return as_state(run_stage("train", fp, mode, store, produce))


def fit_to_checkpoint(
    config: TrainConfig,
    store: ArtifactStore,
    key: str,
    resume_root: Path,
    log: Callable[[str], None],
) -> TrainConfig:
    """The config to launch: `config`, or, when the newest resume checkpoint was written
    on another world size, `config` with its batch split refitted to that checkpoint's
    global batch (`training.config.resume_layout`).

    The checkpoint is the newest whose manifest is signed, locally (`resume_root`) or in
    the root; the ranks verify its files before they load it. With the same world size
    nothing is refitted: a changed batch is the user's, and the ranks refuse a
    checkpoint of another global batch by name.

    Raises:
        ConfigError: The new layout cannot keep the checkpoint's global batch; the
            message names the fields and what to set.
    """
    places = {str(resume_root), str(store.location("checkpoints", "train", key))}
    found = [point for place in places if (point := newest_checkpoint_meta(place))]
    if not found:
        return config
    step, meta = max(found, key=lambda point: point[0])
    written_on = meta.get("world_size")
    if written_on is None or int(written_on) == config.world_size:
        return config
    fitted = resume_layout(config, meta)
    batch = fitted.global_batch_size(fitted.data_parallel_size())
    changed = {
        name: (getattr(config, name), getattr(fitted, name))
        for name in ("batch_size", "grad_accum_steps", "data_streams")
        if getattr(config, name) != getattr(fitted, name)
    }
    log(
        f"resuming step {step}, written on {written_on} ranks, on {config.world_size}: "
        + (
            ", ".join(f"train.{name} {old} -> {new}" for name, (old, new) in changed.items())
            + f" keep its global batch of {batch}"
            if changed
            else f"its global batch of {batch} needs no change"
        )
    )
    return fitted


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
