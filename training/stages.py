"""The train, evaluate and export stages' library entries: the one place that knows the families.

CTR models (DLRM, DCN-v2: `training/ctr/`) read the shard stage's Parquet shards;
sequence models (SASRec, BST: `training/sequence/`) read preprocess's `sequences/`.
Every entry here takes the typed config, `train.model` and where the upstream outputs
are, and dispatches to the family's own function; the Prefect tasks call one entry
each and never branch on a family.

Upstream outputs are reached through an `Upstream`: a function from a stage name to
that output's local directory. The task layer fetches an output only when it is asked
for (with an object-store root that is a verified download), so a family never pays
for a stage output it does not read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from artifacts.errors import ConfigError
from artifacts.store import listed_files
from training.blessing import BlessConfig, MetricThreshold, thresholds_for
from training.config import SEQUENCE_MODELS, EvaluateConfig, ExportConfig, TrainConfig
from training.runtime.hosts import check_ssh_hosts, read_hostfile
from training.runtime.launcher import NodeLaunch, TrainResult
from training.runtime.memory import machine_memory_bytes

# Each entry imports its families' code itself: a stage's fingerprint covers the code its
# entry can run (`artifacts.fingerprint.module_closure`), so an edit to the export code
# reruns export, not training.

Upstream = Callable[[str], Path]
"""Stage name ("ingest", "preprocess", "shard", "train", "evaluate") -> its local output."""

# Share of the machine's memory the ranks may plan for; the rest is the OS, Prefect
# and the page cache the reader lives on.
MEMORY_SHARE = 0.85
# The infra validation figures kept in the export stage's manifest (the package holds
# the rest).
INFRA_KEYS = (
    "rows",
    "p50_ms",
    "p99_ms",
    "batch_p50_ms",
    "batch_p99_ms",
    "max_abs_diff",
    "max_abs_diff_vs_evaluate",
)
TRANSFORM = "transform.json"
SEQUENCES = "sequences"


def is_sequence_model(model: str) -> bool:
    """Whether `model` (train.model) is a sequence model (else a CTR model)."""
    return model in SEQUENCE_MODELS


def data_stage(model: str) -> Literal["shard", "preprocess"]:
    """The upstream stage whose output holds `model`'s train and test data."""
    return "preprocess" if is_sequence_model(model) else "shard"


def _data_dir(model: str, upstream: Upstream) -> Path:
    """`model`'s train/test data: the shards, or preprocess's sequences/."""
    stage = data_stage(model)
    return upstream(stage) / SEQUENCES if stage == "preprocess" else upstream(stage)


def memory_budget(config: TrainConfig, accelerator: str) -> tuple[int, str]:
    """Per-rank memory budget for the planner, and where the figure comes from.

    Planned per node, on the machine that calls it (each node of a per-node run plans
    on its own): a node's memory is shared by its `ranks_per_node` ranks (on GPUs each
    rank has its own device).
    """
    if accelerator == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of GPU 0's memory"
    total = machine_memory_bytes()
    ranks = config.node_ranks()
    where = "this machine's" if config.nodes == 1 else "each node's (as this machine's)"
    return (
        int(total * MEMORY_SHARE / ranks),
        f"{MEMORY_SHARE:.0%} of {where} {total / 2**30:.1f} GiB / {ranks} ranks per node",
    )


def train_launch(
    config: TrainConfig, upstream: Upstream, parent: tuple[Path, int] | None = None
) -> Callable[..., TrainResult | None]:
    """The family's train function with config, local data and memory budget bound.

    The caller adds the launch details (out_dir, master_port, env, on_log, on_progress,
    checkpoint_root, node, stop) of `training.ctr.train.train_model` /
    `training.sequence.train.train_sequence_model`, which take the same ones.

    Args:
        config: The train section.
        upstream: The local upstream outputs.
        parent: train.init's parent: (its verified train output, its world size); the
            ranks warm-start from it through this run's extended transform.

    Raises:
        ConfigError: A parent for a sequence model (train.init refuses those too).
    """
    from training.ctr.train import train_model, warm_start_spec
    from training.sequence.train import train_sequence_model

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    train_fn = train_sequence_model if is_sequence_model(config.model) else train_model
    extra: dict[str, Any] = {}
    if parent is not None:
        if is_sequence_model(config.model):
            raise ConfigError(f"train.model={config.model} cannot warm-start (train.init)")
        extra["warm_start"] = partial(
            warm_start_spec, parent[0], parent[1], upstream("preprocess") / TRANSFORM
        )
    return partial(
        train_fn,
        config,
        _data_dir(config.model, upstream),
        accelerator=accelerator,
        memory_budget=memory_budget(config, accelerator),
        **extra,
    )


def ssh_launch(config: TrainConfig) -> NodeLaunch:
    """launcher 'ssh': the checked hostfile, every host answering ssh, as a `NodeLaunch`.

    Raises:
        InputNotFoundError: train.hostfile does not exist.
        ConfigError: The hostfile does not fit the layout, or a host does not answer
            (named), or pdsh is missing.
    """
    hostfile = Path(config.hostfile or "").expanduser().resolve()
    hosts = read_hostfile(hostfile, config.nodes, config.node_ranks())
    check_ssh_hosts([host for host, _ in hosts], config.ssh_port, hostfile)
    return NodeLaunch(
        hostfile, config.nodes, config.node_ranks(), config.master_addr, None, config.ssh_port
    )


def evaluate(
    config: EvaluateConfig,
    model: str,
    train_dir: Path,
    upstream: Upstream,
    out_dir: Path,
    *,
    env: Mapping[str, str],
    master_port: int | None = None,
) -> dict[str, float]:
    """Score the split with the model in `train_dir` (a train output or a package).

    CTR models: AUC and logloss over the shards, slices named through preprocess's
    transform.json, and scores_head.npy (export's infra validation reference).
    Sequence models: leave-one-out ranking of preprocess's sequences, with the
    popularity baseline.

    Args:
        config: The evaluate section.
        model: train.model.
        train_dir: The trained weights: a train output, or a registry package.
        upstream: Where the upstream outputs are.
        out_dir: Receives metrics.json and the family's other evaluation files.
        env: The environment for the ranks when evaluate.workers > 1 starts them.
        master_port: Their rendezvous port.

    Returns:
        The metrics (as written to out_dir/metrics.json).
    """
    from training.ctr.evaluate import evaluate_model
    from training.sequence.evaluate import evaluate_sequence_model

    if is_sequence_model(model):
        result = evaluate_sequence_model(
            config,
            train_dir,
            _data_dir(model, upstream),
            out_dir,
            env=env,
            master_port=master_port,
        )
    else:
        result = evaluate_model(
            config,
            train_dir,
            _data_dir(model, upstream),
            out_dir,
            # Names slice values by their raw value (slice/city=Paris, not #3).
            transform_path=upstream("preprocess") / TRANSFORM,
            env=env,
            master_port=master_port,
        )
    return json.loads(result.metrics_path.read_text())


def champion_view(model: str, package: Path, upstream: Upstream, out_dir: Path) -> Path | None:
    """The champion laid onto this run's extended transform, to score it on this run's data.

    When this run's transform extends the champion's (an incremental day,
    `data_prep.idmap`), `training.ctr.model.lay_onto_transform` gives the champion's
    weights on this run's rows, scoring exactly as its own package would. None when the
    family has no such view (sequence models) or the transform extends another model's.
    """
    from data_prep.idmap import transform_digest
    from training.ctr.data import load_dataset_meta
    from training.ctr.model import lay_onto_transform

    if is_sequence_model(model):
        return None
    ours = json.loads((upstream("preprocess") / TRANSFORM).read_text())
    theirs = json.loads((package / TRANSFORM).read_text())
    if ours.get("parent_digest") != transform_digest(theirs):
        return None
    meta = load_dataset_meta(upstream("shard"))
    return lay_onto_transform(package, ours, meta, out_dir)


def export(
    config: ExportConfig,
    model: str,
    item_field: str | None,
    upstream: Upstream,
    out_dir: Path,
    *,
    infra_validate: bool,
) -> dict[str, Any]:
    """Package the trained model (weights, ONNX, TorchScript, transform, card).

    Sequence models that rank every item export a top-K recommender: history -> the
    `config.top_k` best item indices and scores; BST exports a candidate scorer
    (`item_field` names the item ids). CTR models with `infra_validate` are
    infra-validated: the package's own score.py scores ingest's raw test events in a
    fresh interpreter (`infra_validation.json`), and its scores must be evaluate's
    (`scores_head.npy`) of the same rows.

    Returns:
        The figures the stage's manifest keeps: parity diffs, top-K agreement (full
        ranking sequence models), infra validation (CTR).
    """
    from training.ctr.export import export_model
    from training.sequence.bst_export import export_bst_model
    from training.sequence.export import export_sequence_model
    from training.sequence.registry import sequence_model

    transform = upstream("preprocess") / TRANSFORM
    metrics = upstream("evaluate") / "metrics.json"
    if is_sequence_model(model):
        if item_field is None:
            raise ConfigError(
                f"exporting train.model={model} needs the schema's item_key (the item ids "
                "the recommender returns); set schema.item_key"
            )
        sequence_args = (
            upstream("train"),
            transform,
            _data_dir(model, upstream),
            item_field,
            metrics,
            out_dir,
        )
        if not sequence_model(model).full_ranking:
            # A model that scores given candidates (BST) ships as a candidate scorer.
            result = export_bst_model(config, *sequence_args)
            return {"parity_rows": result.parity_rows, **_diffs(result)}
        result = export_sequence_model(config, *sequence_args, k=config.top_k)
        return {
            "parity_rows": result.parity_rows,
            "top_k_match_onnx": result.top_k_match_onnx,
            "top_k_match_torchscript": result.top_k_match_torchscript,
            **_diffs(result),
        }
    # Only the event files ingest's signed manifest lists, never a directory listing.
    events = listed_files(upstream("ingest"), "events", ".parquet") if infra_validate else None
    result = export_model(
        config,
        upstream("train"),
        transform,
        _data_dir(model, upstream),
        metrics,
        out_dir,
        events_dir=events,
        evaluate_dir=upstream("evaluate"),
    )
    infra = result.infra_validation
    return {
        **_diffs(result),
        "infra_validation": None if infra is None else {key: infra[key] for key in INFRA_KEYS},
    }


def bless_thresholds(config: BlessConfig, model: str) -> dict[str, MetricThreshold]:
    """The blessing thresholds for `model`: the configured ones, or its family's defaults."""
    return thresholds_for(config, is_sequence_model(model))


def _diffs(result: Any) -> dict:
    """The parity figures of an `ExportResult` that the stage's manifest keeps."""
    return {
        "parity_max_abs_diff_onnx": result.parity_max_abs_diff_onnx,
        "parity_max_abs_diff_torchscript": result.parity_max_abs_diff_torchscript,
    }
