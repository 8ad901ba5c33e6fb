import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from artifacts.errors import ConfigError
from training.config import (
    EvaluateConfig,
    ExportConfig,
    TrainConfig,
    evaluate_export_problems,
    resume_layout,
)
from training.runtime.stage import NOT_FINGERPRINTED

CONFIGS = [TrainConfig, EvaluateConfig, ExportConfig]


@pytest.mark.parametrize("config_class", CONFIGS)
def test_defaults_are_valid_and_frozen(config_class: type[BaseModel]) -> None:
    config = config_class()
    field = next(iter(config_class.model_fields))
    with pytest.raises(ValidationError):
        setattr(config, field, getattr(config, field))


@pytest.mark.parametrize("config_class", CONFIGS)
def test_unknown_keys_are_rejected(config_class: type[BaseModel]) -> None:
    with pytest.raises(ValidationError, match="learning_rate"):
        config_class.model_validate({"learning_rate": 0.1})


@pytest.mark.parametrize("config_class", CONFIGS)
def test_every_field_has_a_description(config_class: type[BaseModel]) -> None:
    undocumented = [name for name, f in config_class.model_fields.items() if not f.description]
    assert undocumented == []


def test_dot_interaction_needs_bottom_mlp_to_end_at_embedding_dim() -> None:
    with pytest.raises(ValidationError) as error:
        TrainConfig(embedding_dim=8, bottom_mlp=[64, 16])
    message = str(error.value)
    assert "bottom_mlp" in message and "embedding_dim" in message and "[64, 8]" in message


def test_cross_interaction_allows_any_bottom_mlp() -> None:
    config = TrainConfig(interaction="cross", embedding_dim=8, bottom_mlp=[64, 16])
    assert config.bottom_mlp == [64, 16]


@pytest.mark.parametrize(
    "override",
    [
        {"zero_stage": 4},
        {"precision": "fp8"},
        {"epochs": 0},
        {"top_mlp": [0]},
        {"sparse_lr": 0},
        {"checkpoint_every_s": -1},
    ],
)
def test_out_of_range_values_are_rejected(override: dict) -> None:
    with pytest.raises(ValidationError):
        TrainConfig(**override)


def test_global_batch_size_is_derived() -> None:
    config = TrainConfig(batch_size=32, grad_accum_steps=3, world_size=2)
    assert config.global_batch_size() == 192
    assert config.global_batch_size(world_size=4) == 384
    assert "global_batch_size" not in config.model_dump()


def test_resume_layout_keeps_the_checkpoints_global_batch_on_another_world_size() -> None:
    # CTR: 2 ranks x 32 rows over 2 streams, resumed on 1 rank, then on 4.
    meta = {**TrainConfig(batch_size=32, data_streams=4).checkpoint_layout(), "step": 8}
    assert meta["global_batch_size"] == 64 and meta["data_streams"] == 4
    one = resume_layout(TrainConfig(world_size=1, batch_size=32), meta)
    assert (one.batch_size, one.grad_accum_steps, one.data_streams) == (32, 2, 4)
    four = resume_layout(TrainConfig(world_size=4, batch_size=32), meta)
    assert (four.batch_size, four.grad_accum_steps, four.global_batch_size()) == (16, 1, 64)
    same = TrainConfig(batch_size=32, data_streams=4)
    assert resume_layout(same, meta) is same
    with pytest.raises(ConfigError, match="train.world_size=3 gives 3 data-parallel replicas"):
        resume_layout(TrainConfig(world_size=3, batch_size=32), meta)
    two_streams = {**meta, "data_streams": 2}
    with pytest.raises(ConfigError, match="data_streams"):
        resume_layout(TrainConfig(world_size=4, batch_size=16), two_streams)
    # Written before the layout was recorded: nothing to fit.
    old = TrainConfig(world_size=1)
    assert resume_layout(old, {"step": 8, "world_size": 2}) is old

    # Sequence models: the checkpoint's micro batch, more of them per replica.
    sasrec = {"model": "sasrec", "batch_size": 8, "world_size": 2}
    meta = TrainConfig(**sasrec).checkpoint_layout()
    assert (meta["global_batch_size"], meta["data_streams"]) == (16, None)
    one = resume_layout(TrainConfig(**{**sasrec, "world_size": 1, "batch_size": 16}), meta)
    assert (one.batch_size, one.grad_accum_steps) == (8, 2)
    with pytest.raises(ConfigError, match="do not divide the checkpoint's 2 micro batches"):
        resume_layout(TrainConfig(**{**sasrec, "world_size": 4}), meta)
    stages = TrainConfig(**{**sasrec, "pipeline_stages": 2, "zero_stage": 0})
    with pytest.raises(ConfigError, match="pipeline_stages=1 and this run has 2"):
        resume_layout(stages, meta)


def test_config_module_imports_without_torch() -> None:
    code = "import sys, training.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"data_streams": 3}, ["train.data_streams=3", "train.world_size=2"]),
        ({"data_streams": 4, "batch_size": 3}, ["train.data_streams=4", "batch_size"]),
        (
            {"offload_optimizer": True, "zero_stage": 0},
            ["train.offload_optimizer", "zero_stage: 1, 2, 3 or auto"],
        ),
        ({"loss_scale": 128.0}, ["train.loss_scale", "precision: fp16"]),
        (
            {"table_precision": "bf16", "embeddings": "dense"},
            ["train.table_precision=bf16", "embeddings: sharded"],
        ),
        (
            {"comm_precision": "bf16", "embeddings": "dense"},
            ["train.comm_precision=bf16", "embeddings: sharded"],
        ),
    ],
)
def test_inconsistent_settings_name_the_fields_to_change(override: dict, names: list) -> None:
    with pytest.raises(ValidationError) as error:
        TrainConfig(**override)
    assert all(name in str(error.value) for name in names)


def test_zero_stage_is_auto_by_default_and_lists_the_stages_it_may_pick() -> None:
    assert TrainConfig().zero_stage == "auto"
    assert TrainConfig.model_validate({"zero_stage": "auto"}).zero_stage == "auto"
    assert TrainConfig().zero_stages() == (0, 1, 2, 3)  # the fastest first
    assert TrainConfig(zero_stage=2).zero_stages() == (2,)
    # offload_optimizer needs a partitioned optimizer: auto starts at 1.
    assert TrainConfig(offload_optimizer=True).zero_stages() == (1, 2, 3)
    # The pipeline engine runs ZeRO 0 or 1: auto passes its check and picks from those.
    sasrec = TrainConfig(model="sasrec", pipeline_stages=2, world_size=2)
    assert sasrec.zero_stage == "auto" and sasrec.zero_stages() == (0, 1)
    with pytest.raises(ValidationError, match="ZeRO stage 0 or 1 only; set zero_stage to 0, 1"):
        TrainConfig(model="sasrec", pipeline_stages=2, world_size=2, zero_stage=2)
    with pytest.raises(ValidationError, match="zero_stage"):
        TrainConfig(zero_stage="fastest")


def test_data_streams_default_to_the_world_size() -> None:
    assert TrainConfig(world_size=4, batch_size=8).num_data_streams() == 4
    assert TrainConfig(world_size=1, data_streams=2, batch_size=8).num_data_streams() == 2


def test_resume_checkpoints_are_on_by_default_and_off_only_with_both_triggers_off() -> None:
    assert TrainConfig().checkpoint_every_s == 120 and TrainConfig().checkpoint_every == 0
    assert TrainConfig().saves_resume_checkpoints()
    assert TrainConfig(checkpoint_every=5, checkpoint_every_s=0).saves_resume_checkpoints()
    assert not TrainConfig(checkpoint_every_s=0).saves_resume_checkpoints()


def test_checkpoint_every_s_is_in_neither_the_cache_key_nor_the_resume_fingerprint() -> None:
    key = TrainConfig().fingerprinted()
    # The keys of train outputs written before the field existed stay what they were.
    assert "checkpoint_every_s" not in key
    assert TrainConfig(checkpoint_every_s=5).fingerprinted() == key
    assert TrainConfig(checkpoint_every=5).fingerprinted() != key  # in the key, as it was
    # A resume may change either trigger.
    assert {"checkpoint_every", "checkpoint_every_s"} <= set(NOT_FINGERPRINTED)


def test_table_precision_keys_the_cache_and_the_resume_checkpoints() -> None:
    # A checkpoint's rows are at the precision they trained in: a resume cannot change it.
    for key in ("fingerprinted", "resume_keyed"):
        fp32 = getattr(TrainConfig(), key)()
        assert getattr(TrainConfig(table_precision="bf16"), key)() != fp32
    assert "table_precision" not in NOT_FINGERPRINTED
    with pytest.raises(ValidationError, match="train.table_precision='fp16' does not apply"):
        TrainConfig(model="sasrec", world_size=1, table_precision="fp16")


def test_dropout_is_for_the_ctr_mlps() -> None:
    assert TrainConfig(dropout=0.1).dropout == 0.1
    with pytest.raises(ValidationError, match="train.sequence.dropout"):
        TrainConfig(model="sasrec", world_size=1, dropout=0.1)
    with pytest.raises(ValidationError, match="less than 1"):
        TrainConfig(dropout=1.0)


# Every evaluate and export field with a non-default value, walked per model as the train
# fields are (tests/training/runtime/test_train_config_fields.py).
STAGE_CHANGES: dict[str, dict[str, Any]] = {
    "evaluate": {
        "batch_size": 1024,
        "split": "valid",
        "ks": [5],
        "num_negatives": 20,
        "negatives_seed": 1,
        "full_ranking": False,
        "ranking_block_users": 64,
        "auc_mode": "exact",
        "auc_buckets": 1024,
        "exact_auc_max_rows": 10,
        "slice_by": ["city"],
        "calibration_bins": 5,
        "user_key": "user_id",
        "score_sample_rows": 512,
        "workers": 2,
    },
    "export": {
        "model_name": "m",
        "parity_rows": 10,
        "parity_atol": 1e-4,
        "opset": 18,
        "top_k": 5,
        "infra_validation_rows": 10,
        "infra_validation_unseen": 0,
        "infra_validation_repetitions": 10,
    },
}
STAGE_CLASSES = {"evaluate": EvaluateConfig, "export": ExportConfig}

# What each model's evaluate and export never read, stated here independently of
# training.config (from training/ctr/evaluate.py, training/sequence/evaluate.py and the
# three exports).
CTR_EVALUATE_ONLY = {
    "batch_size",  # the sequence models score ranking_block_users users at once
    "auc_mode",
    "auc_buckets",
    "exact_auc_max_rows",
    "slice_by",
    "calibration_bins",
    "user_key",
    "score_sample_rows",
}
SEQUENCE_EVALUATE_ONLY = {
    "ks",
    "num_negatives",
    "negatives_seed",
    "full_ranking",
    "ranking_block_users",
}
CTR_EXPORT_ONLY = {
    "infra_validation_rows",
    "infra_validation_unseen",
    "infra_validation_repetitions",
}
STAGE_REFUSED = {
    "dlrm": {"evaluate": SEQUENCE_EVALUATE_ONLY, "export": {"top_k"}},
    "sasrec": {"evaluate": CTR_EVALUATE_ONLY, "export": CTR_EXPORT_ONLY},
    # BST scores given candidates: no full ranking, no top-K recommender.
    "bst": {
        "evaluate": CTR_EVALUATE_ONLY | {"full_ranking"},
        "export": CTR_EXPORT_ONLY | {"top_k"},
    },
}
# Where each model's evaluate and export read their config (training.stages, the
# dispatcher, passes export.top_k to SASRec's export as k).
STAGE_MODULES = {
    "dlrm": ["training.stages", "training.ctr.evaluate", "training.ctr.export"],
    "sasrec": ["training.stages", "training.sequence.evaluate", "training.sequence.export"],
    "bst": [
        "training.stages",
        "training.sequence.evaluate",
        "training.sequence.export",
        "training.sequence.bst_export",
    ],
}


def _source(module: str) -> str:
    """A module's source, read without importing it (no torch, no Prefect)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).read_text()


@pytest.mark.parametrize("section", sorted(STAGE_CHANGES))
def test_the_stage_walk_covers_every_field(section: str) -> None:
    assert set(STAGE_CHANGES[section]) == set(STAGE_CLASSES[section].model_fields)


@pytest.mark.parametrize("model", ["dlrm", "sasrec", "bst"])
@pytest.mark.parametrize(
    ("section", "field"),
    [(section, field) for section, changes in STAGE_CHANGES.items() for field in changes],
)
def test_an_evaluate_or_export_field_is_read_or_refused(
    section: str, field: str, model: str
) -> None:
    value = STAGE_CHANGES[section][field]
    changed = STAGE_CLASSES[section](**{field: value})
    stages = {"evaluate": EvaluateConfig(), "export": ExportConfig(), section: changed}
    problems = evaluate_export_problems(model, stages["evaluate"], stages["export"])
    if field in STAGE_REFUSED[model][section]:
        assert len(problems) == 1, problems
        assert problems[0].startswith(
            f"{section}.{field}={value!r} does not apply to train.model={model}; "
        )
        assert "remove it (default " in problems[0]
        return
    assert problems == []
    sources = "".join(_source(module) for module in STAGE_MODULES[model])
    assert f"config.{field}" in sources, f"{section}.{field} is read by no {model} stage"


def test_default_stage_sections_apply_to_every_model() -> None:
    for model in ("dlrm", "sasrec", "bst"):
        assert evaluate_export_problems(model, EvaluateConfig(), ExportConfig()) == []


def test_every_inapplicable_field_is_reported() -> None:
    evaluate = EvaluateConfig(ks=[5], auc_mode="exact")
    problems = evaluate_export_problems("bst", evaluate, ExportConfig(top_k=3))
    assert [problem.split("=")[0] for problem in problems] == ["evaluate.auc_mode", "export.top_k"]
    assert "BST" in problems[1] and "(default 10)" in problems[1]


def test_cpu_ranks_share_the_cores_of_the_machine_they_run_on() -> None:
    # One machine: every rank shares its cores.
    assert TrainConfig(world_size=2).intra_op_threads(2) == 1
    assert TrainConfig(world_size=4).intra_op_threads(16) == 4
    assert TrainConfig(world_size=3).intra_op_threads(2) == 1  # never 0
    nodes = {"world_size": 8, "nodes": 2, "launcher": "per_node"}
    assert TrainConfig(**nodes).intra_op_threads(16) == 2  # node threads: one machine
    # Nodes on machines of their own: the node's ranks share its cores.
    assert TrainConfig(**nodes, node_dispatch="workers").intra_op_threads(16) == 4
    assert (
        TrainConfig(**nodes, node_dispatch="workers", threads_per_rank=1).intra_op_threads(16) == 1
    )
    # How a rank runs, not what it trains: no new cache key or resume fingerprint.
    assert TrainConfig(threads_per_rank=1).fingerprinted() == TrainConfig().fingerprinted()
