"""Every train config field either reaches a model family's ranks or is refused for it.

For each family and each field of `TrainConfig` (but `model`, which picks the family
and has its own test) a non-default value is set on a valid base config, and either:

- parsing refuses it, naming the field (the fields the family has no use for);
- or the launch plan the ranks read changes outside its verbatim copy of the train
  config (the DeepSpeed config, the model config, the step plan, the paths);
- or the family's rank module reads it from the train config it is given
  (`config.<field>` in its source), the fields that steer the rank loop;
- or, `memory_per_rank_gb` only, the parent applies it: a budget too small is refused.

No rank is launched: the plans are what `train_model` / `train_sequence_model` would
write before launching.
"""

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

import tasks.incremental
import tasks.train
import tasks.train_nodes
import training.ctr.worker
import training.runtime.nodes
import training.sequence.pipeline_worker
import training.stages
from artifacts.errors import ConfigError, InputNotFoundError
from tests.training.conftest import write_shards
from training.config import WHERE_FIELDS, TrainConfig
from training.ctr.train import plan_ctr_run
from training.runtime.stage import LaunchPlan
from training.sequence.train import plan_sequence_run

FAMILIES = ("dlrm", "sasrec", "bst")

# A valid base per family: DLRM with the cross interaction (so embedding_dim and
# bottom_mlp may change alone), the sequence models on 2 ranks, 1 stage.
BASES: dict[str, dict[str, Any]] = {
    "dlrm": {"interaction": "cross", "embedding_dim": 8, "bottom_mlp": [16, 8], "batch_size": 32},
    "sasrec": {"model": "sasrec", "batch_size": 8},
    "bst": {"model": "bst", "batch_size": 8},
}

# field -> (what the base needs for the change to be valid, the changed values).
CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sequence": ({}, {"sequence": {"hidden_dim": 32, "num_heads": 2}}),
    "pipeline_stages": ({}, {"pipeline_stages": 2}),
    "interaction": ({}, {"interaction": "dot"}),
    "embedding_dim": ({}, {"embedding_dim": 4}),
    "bottom_mlp": ({}, {"bottom_mlp": [12, 8]}),
    "top_mlp": ({}, {"top_mlp": [8]}),
    "num_cross_layers": ({}, {"num_cross_layers": 3}),
    "dropout": ({}, {"dropout": 0.1}),
    "batch_size": ({}, {"batch_size": 16}),
    "grad_accum_steps": ({}, {"grad_accum_steps": 2}),
    "epochs": ({}, {"epochs": 0.5}),
    "max_steps": ({}, {"max_steps": 3}),
    "lr": ({}, {"lr": 0.01}),
    "weight_decay": ({}, {"weight_decay": 0.01}),
    "warmup_steps": ({}, {"warmup_steps": 2}),
    "grad_clip": ({}, {"grad_clip": 1.0}),
    "zero_stage": ({}, {"zero_stage": 1}),
    "precision": ({}, {"precision": "bf16"}),
    # fp16 only (a GPU run; the plan is built for "cuda").
    "loss_scale": ({"precision": "fp16"}, {"loss_scale": 128.0}),
    "offload_optimizer": ({"zero_stage": 1}, {"offload_optimizer": True}),
    "embeddings": ({}, {"embeddings": "dense"}),
    "table_precision": ({}, {"table_precision": "bf16"}),
    "comm_precision": ({}, {"comm_precision": "fp32"}),
    "overlap_exchange": ({}, {"overlap_exchange": False}),
    "sparse_optimizer": ({}, {"sparse_optimizer": "lazy_adam"}),
    "sparse_lr": ({}, {"sparse_lr": 0.1}),
    "sparse_weight_decay": ({}, {"sparse_weight_decay": 0.01}),
    "admission_min_count": ({}, {"admission_min_count": 3}),
    "pooling": ({}, {"pooling": "sum"}),
    "tasks": ({}, {"tasks": ["click", "purchase"]}),
    "data_streams": ({}, {"data_streams": 4}),
    "prefetch_batches": ({}, {"prefetch_batches": 2}),
    "memory_per_rank_gb": ({}, {"memory_per_rank_gb": 1e-6}),
    "tensorboard": ({}, {"tensorboard": False}),
    "checkpoint_every": ({}, {"checkpoint_every": 5}),
    "checkpoint_every_s": ({}, {"checkpoint_every_s": 30.0}),
    "threads_per_rank": ({}, {"threads_per_rank": 3}),
    "keep_checkpoints": ({}, {"keep_checkpoints": 3}),
    "checkpoint_max_deltas": ({}, {"checkpoint_max_deltas": 0}),
    "checkpoint_rebase_share": ({}, {"checkpoint_rebase_share": 0.25}),
    "checkpoint_async": ({}, {"checkpoint_async": False}),
    "world_size": ({}, {"world_size": 4}),
    "seed": ({}, {"seed": 1}),
    "log_every": ({}, {"log_every": 5}),
    "init": ({}, {"init": "champion"}),
    "eval_every_epochs": ({}, {"eval_every_epochs": 0.5}),
    # Validation settings mean something only with validation on.
    "patience": ({"eval_every_epochs": 1}, {"patience": 2}),
    "select_metric": ({"eval_every_epochs": 1}, {"select_metric": "hr@5_sampled"}),
    "valid_num_negatives": ({"eval_every_epochs": 1}, {"valid_num_negatives": 20}),
    "valid_negatives_seed": ({"eval_every_epochs": 1}, {"valid_negatives_seed": 1}),
    # Where the ranks run: read by the train stage, which builds the launcher command.
    "nodes": ({"launcher": "ssh", "hostfile": "hosts", "master_addr": "10.0.0.1"}, {"nodes": 2}),
    "ranks_per_node": ({}, {"ranks_per_node": 2}),
    "launcher": ({}, {"launcher": "per_node"}),
    "hostfile": ({"launcher": "per_node"}, {"hostfile": "hosts"}),
    "master_addr": ({}, {"master_addr": "10.0.0.1"}),
    "master_port": ({}, {"master_port": 29600}),
    "ssh_port": ({"launcher": "ssh", "hostfile": "hosts"}, {"ssh_port": 2222}),
    "node_dispatch": ({"launcher": "per_node"}, {"node_dispatch": "workers"}),
    "node_pickup_timeout_s": (
        {"launcher": "per_node", "node_dispatch": "workers"},
        {"node_pickup_timeout_s": 30.0},
    ),
    "node_heartbeat_timeout_s": ({"launcher": "per_node"}, {"node_heartbeat_timeout_s": 30.0}),
    "min_nodes": (
        {"launcher": "per_node", "node_dispatch": "workers", "nodes": 2},
        {"min_nodes": 1},
    ),
}

# Fields that say where the ranks run: the train task reads them (`tasks.train` and the
# modules it launches with) to build DeepSpeed's launcher command and send node runs;
# the ranks' plan must not change with them.
LAUNCH_FIELDS = set(WHERE_FIELDS)

# Where the sequence models' base (the defaults) needs another change than DLRM's.
SEQUENCE_CHANGES = {"interaction": {"interaction": "cross"}}

# What each family has no use for, stated here independently of training.config.
CTR_ONLY = {
    "interaction",
    "embedding_dim",
    "bottom_mlp",
    "top_mlp",
    "num_cross_layers",
    "dropout",
    "offload_optimizer",
    "embeddings",
    "table_precision",
    "comm_precision",
    "overlap_exchange",
    "sparse_optimizer",
    "sparse_lr",
    "sparse_weight_decay",
    "admission_min_count",
    "pooling",
    "tasks",
    "data_streams",
    "prefetch_batches",
    # Only a sharded table's checkpoints are differential.
    "checkpoint_max_deltas",
    "checkpoint_rebase_share",
    "checkpoint_async",
    # Needs fp16, which the pipeline engine does not train in.
    "loss_scale",
    # A warm start maps CTR tables' rows; sequence models cannot warm-start yet.
    "init",
}
SEQUENCE_ONLY = {
    "sequence",
    "pipeline_stages",
    "eval_every_epochs",
    "patience",
    "select_metric",
    "valid_num_negatives",
    "valid_negatives_seed",
}
REFUSED = {"dlrm": SEQUENCE_ONLY, "sasrec": CTR_ONLY, "bst": CTR_ONLY}

# Fields a rank reads through a derived value of the config.
READ_AS = {"data_streams": "num_data_streams()"}

# Fields that only CPU ranks are given (planned on the CPU accelerator).
CPU_ONLY = {"threads_per_rank"}

RANK_MODULES = {
    "dlrm": training.ctr.worker,
    "sasrec": training.sequence.pipeline_worker,
    "bst": training.sequence.pipeline_worker,
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    shards = write_shards(root / "shards", extra_labels=["purchase"])
    sequences = root / "sequences"
    sequences.mkdir()
    (sequences / "sequences.json").write_text(json.dumps({"num_items": 50, "max_length": 8}))
    histories = [[1 + (u + i) % 49 for i in range(2 + u % 7)] for u in range(64)]
    pq.write_table(pa.table({"user": range(64), "history": histories}), sequences / "train.parquet")
    # The valid split and the item counts that in-training validation reads.
    valid = {"user": range(4), "history": histories[:4], "target": [1, 2, 3, 0]}
    pq.write_table(pa.table({**valid, "seen": histories[:4]}), sequences / "valid.parquet")
    np.save(sequences / "train_item_counts.npy", np.ones(50, dtype=np.int64))
    return {"dlrm": shards, "sasrec": sequences, "bst": sequences}


def plan_of(
    family: str, data: dict[str, Path], tmp_path: Path, accelerator: str = "cuda"
) -> Callable[..., LaunchPlan]:
    """Builds the launch plan of a config of this family (as the train stage would)."""
    planner = plan_ctr_run if family == "dlrm" else plan_sequence_run

    def plan(config: TrainConfig) -> LaunchPlan:
        return planner(config, data[family], tmp_path / "out", accelerator, {})

    return plan


def what_ranks_see(plan: LaunchPlan) -> dict[str, Any]:
    """The launch plan less its copy of the train config and the fingerprint of it."""
    spec = {k: v for k, v in plan.spec.items() if k not in ("train_config", "config_fingerprint")}
    return {"spec": spec, "model_config": plan.model_config}


def test_the_walk_covers_every_field() -> None:
    assert set(CHANGES) == set(TrainConfig.model_fields) - {"model"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field", sorted(CHANGES))
def test_a_field_reaches_the_ranks_or_is_refused(
    family: str, field: str, data: dict[str, Path], tmp_path: Path
) -> None:
    needs, changed = CHANGES[field]
    if family != "dlrm":
        changed = SEQUENCE_CHANGES.get(field, changed)
    if field in REFUSED[family]:
        with pytest.raises(ValidationError, match=f"train.{field}="):
            TrainConfig(**{**BASES[family], **changed})
        return
    base_values = {**BASES[family], **needs}
    base = TrainConfig(**base_values)
    plan = plan_of(family, data, tmp_path, "cpu" if field in CPU_ONLY else "cuda")
    config = TrainConfig(**{**base_values, **changed})
    assert getattr(config, field) != getattr(base, field)
    if field in LAUNCH_FIELDS:
        assert what_ranks_see(plan(config)) == what_ranks_see(plan(base))
        assert plan(config).spec.get("config_fingerprint") == plan(base).spec.get(
            "config_fingerprint"
        ), f"train.{field} is where the ranks run: a resume must not depend on it"
        assert config.fingerprinted() == base.fingerprinted()
        read = {"ranks_per_node": "node_ranks()", "node_pickup_timeout_s": "pickup_timeout_s()"}
        sources = "".join(
            inspect.getsource(module)
            for module in (tasks.train, training.stages, tasks.train_nodes, training.runtime.nodes)
        )
        assert f"config.{read.get(field, field)}" in sources, f"train.{field} is read by nobody"
        return
    if field == "init":
        # Resolved by the pipeline (tasks.incremental) into a parent model, which keys the
        # train stage and reaches the ranks as the plan's warm start (test_warm_start.py).
        assert what_ranks_see(plan(config)) == what_ranks_see(plan(base))
        assert config.fingerprinted() == base.fingerprinted()
        assert "config.train.init" in inspect.getsource(tasks.incremental)
        return
    if field == "memory_per_rank_gb":
        with pytest.raises(ConfigError, match="train.memory_per_rank_gb"):
            plan(config)
        plan(base)  # the default budget (none given) is not checked
        return
    seen, seen_before = what_ranks_see(plan(config)), what_ranks_see(plan(base))
    assert plan(config).spec["train_config"][field] == config.model_dump(mode="json")[field]
    if seen != seen_before:
        return
    source = inspect.getsource(RANK_MODULES[family])
    read_as = f"config.{READ_AS.get(field, field)}"
    assert read_as in source, (
        f"train.{field} changes nothing the {family} ranks are given and they do not read it"
    )


# train.sequence's own fields: (what the base needs, the changed values); walked as the
# train fields are, for the two sequence families.
SEQUENCE_FIELD_CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "max_length": ({}, {"max_length": 4}),
    "hidden_dim": ({}, {"hidden_dim": 32}),
    "num_blocks": ({}, {"num_blocks": 3}),
    "num_heads": ({}, {"num_heads": 2}),
    "dropout": ({}, {"dropout": 0.3}),
    "loss": ({}, {"loss": "sampled_softmax"}),
    "num_negatives": ({}, {"num_negatives": 4}),
    "shared_negatives": ({"loss": "sampled_softmax"}, {"shared_negatives": True}),
    "mlp": ({}, {"mlp": [16]}),
    "partition_method": ({}, {"partition_method": "uniform"}),
}
# BST trains on click labels with BCE: no other loss, so no shared negatives.
SEQUENCE_REFUSED = {"sasrec": {"mlp"}, "bst": {"loss", "shared_negatives"}}


def test_the_sequence_walk_covers_every_field() -> None:
    fields = TrainConfig.model_fields["sequence"].annotation.model_fields
    assert set(SEQUENCE_FIELD_CHANGES) == set(fields)


@pytest.mark.parametrize("family", ["sasrec", "bst"])
@pytest.mark.parametrize("field", sorted(SEQUENCE_FIELD_CHANGES))
def test_a_sequence_field_reaches_the_ranks_or_is_refused(
    family: str, field: str, data: dict[str, Path], tmp_path: Path
) -> None:
    needs, changed = SEQUENCE_FIELD_CHANGES[field]
    if field in SEQUENCE_REFUSED[family]:
        with pytest.raises(ValidationError, match=f"train.sequence.{field}"):
            TrainConfig(**BASES[family], sequence=changed)
        return
    base = TrainConfig(**BASES[family], sequence=needs)
    config = TrainConfig(**BASES[family], sequence={**needs, **changed})
    assert getattr(config.sequence, field) != getattr(base.sequence, field)
    plan = plan_of(family, data, tmp_path)
    if what_ranks_see(plan(config)) != what_ranks_see(plan(base)):
        return
    source = inspect.getsource(RANK_MODULES[family])
    assert f"config.sequence.{field}" in source, (
        f"train.sequence.{field} changes nothing the {family} ranks are given and they do "
        "not read it"
    )


@pytest.mark.parametrize("field", ["patience", "select_metric", "valid_num_negatives"])
def test_a_validation_setting_without_validation_is_refused(field: str) -> None:
    _, changed = CHANGES[field]
    with pytest.raises(ValidationError, match=f"train.{field}=.* needs in-training validation"):
        TrainConfig(**BASES["sasrec"], **changed)


@pytest.mark.parametrize(
    ("family", "metric", "refusal"),
    [
        ("sasrec", "auc", "not a ranking metric"),
        ("sasrec", "ndcg@0_sampled", "not a ranking metric"),
        ("sasrec", "ndcg@10", "not a ranking metric"),
        ("bst", "ndcg@10_full", "BST ranks sampled negatives only"),
    ],
)
def test_a_select_metric_that_cannot_be_computed_is_refused(
    family: str, metric: str, refusal: str
) -> None:
    with pytest.raises(ValidationError, match=f"train.select_metric={metric!r}.*{refusal}"):
        TrainConfig(**BASES[family], eval_every_epochs=1, select_metric=metric)
    assert TrainConfig(**BASES["sasrec"], eval_every_epochs=1, select_metric="mrr_full")


def test_validation_is_planned_in_steps_of_the_train_epochs(
    data: dict[str, Path], tmp_path: Path
) -> None:
    # 64 train sequences, 8 per replica and 2 replicas: 4 steps an epoch.
    config = TrainConfig(
        **BASES["sasrec"], eval_every_epochs=0.5, select_metric="hr@5_sampled", max_steps=9
    )
    valid = plan_of("sasrec", data, tmp_path)(config).spec["valid"]
    assert valid["every_steps"] == 2 and valid["steps_per_epoch"] == 4.0
    assert valid["protocol"]["split"] == "valid" and valid["protocol"]["ks"] == [5]
    assert valid["protocol"]["num_negatives"] == 100 and not valid["protocol"]["full_ranking"]
    assert plan_of("sasrec", data, tmp_path)(TrainConfig(**BASES["sasrec"])).spec["valid"] is None
    (data["sasrec"] / "valid.parquet").rename(tmp_path / "moved.parquet")
    try:
        with pytest.raises(InputNotFoundError, match="valid.parquet does not exist.*"):
            plan_of("sasrec", data, tmp_path)(config)
    finally:
        (tmp_path / "moved.parquet").rename(data["sasrec"] / "valid.parquet")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_plans_its_own_models_only(
    family: str, data: dict[str, Path], tmp_path: Path
) -> None:
    other = "sasrec" if family == "dlrm" else "dlrm"
    planner = plan_ctr_run if family == "dlrm" else plan_sequence_run
    with pytest.raises(ConfigError, match=f"train.model={other!r}"):
        planner(TrainConfig(**BASES[other]), data[family], tmp_path / "out", "cpu", {})
