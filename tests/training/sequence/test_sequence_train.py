import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from artifacts.errors import ConfigError, InputNotFoundError
from training.config import SEQUENCE_MODELS, TrainConfig
from training.sequence.bst import BST
from training.sequence.registry import SEQUENCE_MODEL_REGISTRY, sequence_model
from training.sequence.sasrec import SASRec
from training.sequence.train import (
    check_sequence_memory,
    plan_sequence_memory,
    plan_sequence_steps,
    read_sequences_meta,
    sequence_model_config,
    train_sequence_model,
)

SASREC = {"model": "sasrec", "pipeline_stages": 2, "world_size": 2, "zero_stage": 1}


def test_pipeline_layouts_deepspeed_cannot_run_are_refused_at_parse_time() -> None:
    TrainConfig(**SASREC)
    for bad, match in [
        ({"zero_stage": 2}, "ZeRO stage 0 or 1"),
        ({"zero_stage": 3}, "ZeRO stage 0 or 1"),
        ({"world_size": 3}, "does not divide"),
        ({"sequence": {"hidden_dim": 10, "num_heads": 4}}, "not divisible"),
        ({"precision": "fp16"}, "fp32 or bf16"),
    ]:
        with pytest.raises(ValidationError, match=match):
            TrainConfig(**{**SASREC, **bad})
    with pytest.raises(ValidationError, match="sequence models"):
        TrainConfig(pipeline_stages=2)  # DLRM has no pipeline form
    with pytest.raises(ValidationError, match="extra"):
        TrainConfig(**SASREC, sequence={"blocks": 2})


def test_steps_cover_the_epochs_over_all_replicas() -> None:
    config = TrainConfig(**{**SASREC, "world_size": 4}, batch_size=8, grad_accum_steps=2, epochs=3)
    assert config.data_parallel_size() == 2
    # 3 epochs of 100 sequences at 8 x 2 x 2 = 32 per step.
    assert plan_sequence_steps(config, 100) == 10
    assert plan_sequence_steps(config.model_copy(update={"max_steps": 7}), 100) == 7
    with pytest.raises(ConfigError, match="fewer than the 2 data-parallel replicas"):
        plan_sequence_steps(config, 1)


def test_model_config_takes_the_sequence_length_and_refuses_a_longer_one() -> None:
    meta = {"max_length": 50, "num_items": 1000}
    config = TrainConfig(**SASREC)
    assert sequence_model_config(config, meta) == {
        "model": "sasrec",
        "num_items": 1000,
        "max_length": 50,
        "hidden_dim": 64,
        "num_blocks": 2,
        "num_heads": 1,
        "dropout": 0.2,
        "item_features": {},
    }
    shorter = TrainConfig(**SASREC, sequence={"max_length": 20})
    assert sequence_model_config(shorter, meta)["max_length"] == 20
    with pytest.raises(ConfigError, match="preprocess.sequence_length=50"):
        sequence_model_config(TrainConfig(**SASREC, sequence={"max_length": 80}), meta)
    with_features = {**meta, "item_features": {"category": 12}}
    assert sequence_model_config(config, with_features)["item_features"] == {"category": 12}
    bst = TrainConfig(**{**SASREC, "model": "bst"})
    assert "item_features" not in sequence_model_config(bst, meta)
    with pytest.raises(ConfigError, match="takes no item side features"):
        sequence_model_config(bst, with_features)


def test_memory_plan_grows_with_the_batch_and_refuses_what_does_not_fit() -> None:
    model = {"model": "sasrec", "num_items": 1_000_000, "max_length": 200, "hidden_dim": 64}
    model |= {"num_blocks": 2, "num_heads": 1}
    small = plan_sequence_memory(TrainConfig(**SASREC, batch_size=32), model, 10_000)
    big = plan_sequence_memory(TrainConfig(**SASREC, batch_size=512), model, 10_000)
    assert big.per_rank["activations"] == pytest.approx(16 * small.per_rank["activations"])
    assert small.per_rank["embeddings"] == 1_000_000 * 64 * 4
    check_sequence_memory(small, small.total, "test")
    with pytest.raises(ConfigError, match="Lower train.batch_size") as error:
        check_sequence_memory(big, small.total, "train.memory_per_rank_gb")
    assert "activations" in str(error.value) and "train.memory_per_rank_gb" in str(error.value)
    # Shared negatives: the (M, 1 + N) logits grow with N, not an (M, N, D) gather.
    shared = {"loss": "sampled_softmax", "shared_negatives": True}
    plans = [
        plan_sequence_memory(
            TrainConfig(**SASREC, batch_size=32, sequence={**shared, "num_negatives": n}),
            model,
            10_000,
        ).per_rank["activations"]
        for n in (1024, 2048)
    ]
    logits = 2 * 32 * 200 * 1024 * 4  # 1024 more logits and their grads per position
    assert plans[1] - plans[0] == pytest.approx(logits + 2 * 1024 * 64 * 4, rel=1e-9)


def test_missing_sequences_say_to_set_sequence_length(tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match="preprocess.sequence_length"):
        read_sequences_meta(tmp_path)
    with pytest.raises(InputNotFoundError, match="sequence_length"):
        train_sequence_model(
            TrainConfig(**SASREC), tmp_path, tmp_path / "out", "cpu", 12345, env={}
        )
    (tmp_path / "sequences.json").write_text(json.dumps({"max_length": 5}))
    (tmp_path / "train.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match="num_items"):
        read_sequences_meta(tmp_path)


def test_sequence_options_a_model_does_not_take_are_refused() -> None:
    TrainConfig(**SASREC, sequence={"loss": "sampled_softmax"})
    with pytest.raises(ValidationError, match="train.sequence.loss='sampled_softmax'"):
        TrainConfig(**{**SASREC, "model": "bst"}, sequence={"loss": "sampled_softmax"})
    TrainConfig(**{**SASREC, "model": "bst"}, sequence={"mlp": [16]})
    TrainConfig(**SASREC, sequence={"loss": "sampled_softmax", "shared_negatives": True})
    for loss in ("bce", "softmax"):
        with pytest.raises(ValidationError, match="only 'sampled_softmax' shares"):
            TrainConfig(**SASREC, sequence={"loss": loss, "shared_negatives": True})
    with pytest.raises(ValidationError, match="train.sequence.loss='sampled_softmax'"):
        TrainConfig(
            **{**SASREC, "model": "bst"},
            sequence={"loss": "sampled_softmax", "shared_negatives": True},
        )
    with pytest.raises(ValidationError, match=r"train.sequence.mlp=\[16\] is BST's head"):
        TrainConfig(**SASREC, sequence={"mlp": [16]})
    with pytest.raises(ValidationError, match="train.embedding_dim=8 does not apply"):
        TrainConfig(**SASREC, embedding_dim=8)


def test_the_registry_serves_every_sequence_model() -> None:
    assert set(SEQUENCE_MODEL_REGISTRY) == set(SEQUENCE_MODELS)
    meta = {"max_length": 6, "num_items": 30}
    # name: (module class, pipeline layers with 2 blocks, rows of a micro batch of 2
    # sequences with 2 negatives, shortest usable history)
    expected = {"sasrec": (SASRec, 6, 2, 1), "bst": (BST, 7, 2 * 3, 2)}
    for name, entry in SEQUENCE_MODEL_REGISTRY.items():
        model_class, layers, rows, min_items = expected[name]
        config = TrainConfig(**{**SASREC, "model": name}, sequence={"hidden_dim": 8})
        model_config = sequence_model_config(config, meta)
        assert entry.name == name and entry.min_items == min_items
        assert isinstance(entry.build_model(model_config), model_class)
        assert len(entry.build_pipeline_layers(model_config)) == layers
        generator = torch.Generator().manual_seed(0)
        inputs, labels = entry.micro_batch([[1, 2, 3], [4, 5, 6, 7]], 6, 30, 2, generator)
        assert inputs[0].shape == (rows, 6) and labels.shape[0] == rows
        assert config.sequence.loss in entry.losses
    with pytest.raises(ConfigError, match="not a sequence model"):
        sequence_model("dlrm")
