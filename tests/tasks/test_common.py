import pytest
from prefect.states import Failed

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from flows.pipeline import RunParams, plan_modes
from tasks.common import should_retry
from training.errors import TrainingCrashed


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (OSError("disk hiccup"), True),
        (TrainingCrashed("rank 1 killed"), True),
        (ConnectionError("reset"), True),
        (ConfigError("bad key"), False),
        (SchemaError("all rows bad"), False),
        (InputNotFoundError("no such path"), False),
        (ValueError("a bug"), False),
    ],
)
def test_only_transient_errors_are_retried(error, retry):
    assert should_retry(None, None, Failed(data=error)) is retry


def test_plan_from_stage():
    modes = plan_modes(RunParams(config="c", from_stage="evaluate"))
    assert list(modes.values()) == ["reuse"] * 4 + ["force"] * 2


def test_plan_only_and_force():
    modes = plan_modes(RunParams(config="c", only=["shard", "evaluate"], force=["ingest"]))
    assert modes == {
        "ingest": "force",
        "preprocess": "reuse",
        "shard": "force",
        "train": "reuse",
        "evaluate": "force",
        "export": "skip",
    }
    assert set(plan_modes(RunParams(config="c")).values()) == {"auto"}
