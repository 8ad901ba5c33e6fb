"""Prefect task for the train stage: launches DeepSpeed ranks as separate processes.

The ranks keep their crash-safe resume checkpoints in a local directory per
fingerprint (`training.runtime.checkpoint`). With a remote artifact root
(`s3://...`) that directory is mirrored to ``<root>/checkpoints/train/<fp>/``
(`CheckpointMirror`): before the ranks start, the newest remote checkpoint that
verifies is downloaded (so a retry on another machine resumes); while they run,
each newly committed checkpoint is uploaded, files first and its manifest last. A
remote checkpoint is committed when its manifest object exists; no rename is needed.
"""

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

from tasks.common import (
    Mode,
    StageOutput,
    as_state,
    local_dir,
    run_stage,
    stage_fingerprint,
    task_options,
)
from tasks.progress import format_resume_line, train_progress
from tasks.store import (
    ArtifactStore,
    backend_errors,
    download_files,
    filesystem,
    join_url,
    read_text,
    remove_tree,
    upload_files,
)
from training.config import SEQUENCE_MODELS, TrainConfig
from training.ctr.train import train_model
from training.runtime.checkpoint import MANIFEST, CheckpointStore, checkpoint_name, parse_step
from training.runtime.files import SUMMARY_FILE
from training.runtime.launcher import (
    ERROR_PREFIX,
    RESUME_PREFIX,
    free_port,
    is_protocol_line,
    parse_record,
)
from training.runtime.memory import machine_memory_bytes
from training.sequence.train import train_sequence_model

# How often the mirror looks for newly committed checkpoints to upload.
MIRROR_EVERY_S = 1.0


class CheckpointMirror:
    """Resume checkpoints of one training run, mirrored between a local root and a URL.

    Args:
        local_root: The ranks' checkpoint directory (`CheckpointStore` layout).
        url: Where the checkpoints go, ``<root>/checkpoints/train/<fp>``.
        keep: How many committed checkpoints the remote side keeps.
        log: Receives one line per download, upload or skipped checkpoint.
    """

    def __init__(self, local_root: Path, url: str, keep: int, log: Callable[[str], None]) -> None:
        self.local_root = local_root
        self.url = url
        self.keep = keep
        self._log = log
        self._uploaded: set[int] = set()

    def pull(self) -> int | None:
        """Download the newest remote checkpoint that verifies, unless one as new is local.

        Each candidate is downloaded next to the local ones and verified (sizes and
        sha256 against its manifest) before it is renamed into place; one that does not
        verify is logged and the next older tried.

        Returns:
            The step downloaded, or None (nothing remote, or nothing newer).
        """
        local = max(self._local_steps(), default=-1)
        for step in sorted(self._remote_steps(committed=True), reverse=True):
            if step <= local:
                return None
            name = checkpoint_name(step)
            scratch = self.local_root / ".staging" / "pull" / name
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            text = read_text(join_url(self._remote(step), MANIFEST)) or ""
            try:
                files = list(json.loads(text)["files"])
            except (json.JSONDecodeError, KeyError, TypeError):
                files = []  # verify names what is wrong with the manifest
            download_files(self._remote(step), files, scratch)
            (scratch / MANIFEST).write_text(text)
            problem = CheckpointStore(self.local_root).verify(scratch)
            if problem is not None:
                self._log(f"checkpoint {self._remote(step)} does not verify ({problem}); skipped")
                shutil.rmtree(scratch)
                continue
            # A local directory of this step without a manifest is an unfinished save.
            shutil.rmtree(self.local_root / name, ignore_errors=True)
            os.replace(scratch, self.local_root / name)
            self._uploaded.add(step)
            self._log(f"resume checkpoint of step {step} downloaded from {self._remote(step)}")
            return step
        return None

    def push(self) -> None:
        """Upload every committed local checkpoint not uploaded yet, then prune the remote.

        Files go first, the manifest last: a remote checkpoint without its manifest is
        an unfinished upload, never a resume point.
        """
        for step in sorted(self._local_steps()):
            if step in self._uploaded:
                continue
            path = self.local_root / checkpoint_name(step)
            remote = self._remote(step)
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
        return join_url(self.url, checkpoint_name(step))

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
        """Remove remote checkpoints older than the `keep` newest committed ones."""
        committed = sorted(self._remote_steps(committed=True), reverse=True)
        if len(committed) < self.keep:
            return
        cutoff = committed[self.keep - 1]
        fs, _ = filesystem(self.url)
        for step in self._remote_steps(committed=False):
            if step < cutoff:
                _, remote_path = filesystem(self._remote(step))
                if fs.exists(f"{remote_path}/{MANIFEST}"):
                    fs.rm(f"{remote_path}/{MANIFEST}")  # first: it stops being a resume point
                remove_tree(self._remote(step))


# Share of the machine's memory the ranks may plan for; the rest is the OS, Prefect
# and the page cache the reader lives on.
MEMORY_SHARE = 0.85


def memory_budget(config: TrainConfig, accelerator: str) -> tuple[int, str]:
    """Per-rank memory budget for the planner, and where the figure comes from."""
    if accelerator == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of GPU 0's memory"
    total = machine_memory_bytes()
    return (
        int(total * MEMORY_SHARE / config.world_size),
        f"{MEMORY_SHARE:.0%} of this machine's {total / 2**30:.1f} GiB / {config.world_size} ranks",
    )


def log_launcher_line(logger: logging.Logger | logging.LoggerAdapter, line: str) -> None:
    """Log one output line of the launcher or a rank as people read it.

    Ordinary output goes on as it is. The ranks' machine records do not: progress records
    reach people through `TrainProgress` (the launcher parses them for `on_progress`), a
    resume record becomes a sentence, an error record a warning (the stage's error names
    it again). The launcher log keeps every line as it came.
    """
    if not is_protocol_line(line):
        logger.info(line)
        return
    resume = parse_record(line, RESUME_PREFIX)
    if resume is not None:
        logger.info(format_resume_line(resume))
    error = parse_record(line, ERROR_PREFIX)
    if error is not None:
        logger.warning("train rank %s failed: %s", error.get("rank"), error.get("error"))


# A crashed or killed rank is transient: retry after 10 s, 20 s.
@task(name="train", task_run_name="train", **task_options(backoff_seconds=10.0, retries=2))
def train_task(
    config: TrainConfig, shard: StageOutput, preprocess: StageOutput, root: str, mode: Mode
) -> StageOutput:
    """Train the model with DeepSpeed on `config.world_size` ranks.

    CTR models read the shards; sequence models (SASRec) preprocess's sequences/.
    """
    fp = stage_fingerprint("train", config.model_dump(), [shard, preprocess])
    logger = get_run_logger()
    store = ArtifactStore(root)
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

            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
            if config.model in SEQUENCE_MODELS:
                train_fn, data_dir = train_sequence_model, local_dir(preprocess) / "sequences"
            else:
                train_fn, data_dir = train_model, local_dir(shard)

            run = partial(
                train_fn,
                config,
                data_dir,
                out_dir,
                accelerator=accelerator,
                master_port=free_port(),
                env=dict(os.environ),
                on_log=partial(log_launcher_line, logger),
                on_progress=on_progress,
                memory_budget=memory_budget(config, accelerator),
                # Outlives this attempt's staging directory, so that a retry resumes.
                checkpoint_root=resume_root,
            )
            if mirror is None:
                result = run()
            else:
                mirror.pull()
                with mirror.pushing():
                    result = run()
        update_progress_artifact(progress_id, progress=100.0)
        # CTR runs split a step into data/lookup/dense/optimizer; pipelines report "step".
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
            description="Planned memory per rank (training.ctr.memory)",
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
        if mirror is not None:
            mirror.remove()
        return {
            "resumed_from_step": result.resumed_from_step,
            "final_loss": result.final_loss,
            "steps": result.steps,
            "samples_per_s": result.samples_per_s,
            "seconds": result.seconds,
            "step_ms": result.step_ms,
            # Sequence models with train.eval_every_epochs: best step, curve, stop reason.
            **({"validation": validation} if validation is not None else {}),
        }

    return as_state(run_stage("train", fp, mode, root, produce))


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
