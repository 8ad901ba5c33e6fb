import subprocess
import sys

import pytest
from pydantic import BaseModel, ValidationError

from training.config import EvaluateConfig, ExportConfig, TrainConfig

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
    [{"zero_stage": 4}, {"precision": "fp8"}, {"epochs": 0}, {"top_mlp": [0]}, {"sparse_lr": 0}],
)
def test_out_of_range_values_are_rejected(override: dict) -> None:
    with pytest.raises(ValidationError):
        TrainConfig(**override)


def test_global_batch_size_is_derived() -> None:
    config = TrainConfig(batch_size=32, grad_accum_steps=3, world_size=2)
    assert config.global_batch_size() == 192
    assert config.global_batch_size(world_size=4) == 384
    assert "global_batch_size" not in config.model_dump()


def test_config_module_imports_without_torch() -> None:
    code = "import sys, training.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"data_streams": 3}, ["train.data_streams=3", "train.world_size=2"]),
        ({"data_streams": 4, "batch_size": 3}, ["train.data_streams=4", "batch_size"]),
        ({"offload_optimizer": True}, ["train.offload_optimizer", "zero_stage"]),
        ({"loss_scale": 128.0}, ["train.loss_scale", "precision: fp16"]),
    ],
)
def test_inconsistent_settings_name_the_fields_to_change(override: dict, names: list) -> None:
    with pytest.raises(ValidationError) as error:
        TrainConfig(**override)
    assert all(name in str(error.value) for name in names)


def test_data_streams_default_to_the_world_size() -> None:
    assert TrainConfig(world_size=4, batch_size=8).num_data_streams() == 4
    assert TrainConfig(world_size=1, data_streams=2, batch_size=8).num_data_streams() == 2


def test_dropout_is_for_the_ctr_mlps() -> None:
    assert TrainConfig(dropout=0.1).dropout == 0.1
    with pytest.raises(ValidationError, match="train.sequence.dropout"):
        TrainConfig(model="sasrec", world_size=1, dropout=0.1)
    with pytest.raises(ValidationError, match="less than 1"):
        TrainConfig(dropout=1.0)
