"""Attacks on the gate from the Prefect UI, and on config error messages (issue 38).

A Prefect UI user starts deployment runs with overrides of their choosing. The
locations were already pinned to the deployment's own overrides; what decides which
model may replace a champion was not: `bless.*` (thresholds, approval), the model a run
promotes (`export.model_name`), the model a warm start loads (`train.init`) and the
pipeline's `name` (its `latest/` pointers). Each must be refused unless it repeats the
deployment's own, and leaving out the deployment's own must be refused as well. A name
must be one plain name, so that it cannot reach another model's CHAMPION or a directory
outside the root. And an override or config file must not blow up the error message
that describes it.
"""

import time
from pathlib import Path

import pytest

from artifacts.errors import ConfigError
from flows.config import load_config
from flows.deploy import check_overrides
from flows.pipeline import pipeline
from tests.security.test_control_plane import deployment_run  # noqa: F401 - a fixture

pytestmark = pytest.mark.security

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
DAILY = REPO / "configs" / "daily.yaml"

# A deployment's own overrides, as `recforge serve --set ...` gives them.
OWN = ["ingest.path=/data/raw", "bless.require_approval=true", "export.model_name=tiny-ctr"]

# A YAML alias bomb: 9 ** 6 (half a million) ones from about 250 characters.
BOMB = (
    "[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], "
    "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], "
    "&e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]]"
)


# (i) The gate, from a deployment run's overrides.


@pytest.mark.parametrize(
    "override",
    [
        "bless.thresholds={auc: {lower_bound: 0.0}}",
        "bless.thresholds.auc={lower_bound: 0.0}",
        "bless.require_approval=false",
        "bless={}",
        "export.model_name=daily-ctr",  # another deployment's model: its CHAMPION
        "export={model_name: daily-ctr}",
        "train.init=champion",
        "train.init=0123456789ab",
        "name=daily",
    ],
)
def test_a_deployment_run_cannot_move_the_gate_with_an_override(override: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=f"overrides: {key} ") as refused:
        check_overrides([*OWN, override], OWN)
    assert "daily" not in str(refused.value) and "0.0" not in str(refused.value)


def test_a_deployment_run_cannot_drop_the_deployments_own_gate_override() -> None:
    """Prefect replaces the whole `overrides` list: leaving one out is an override too."""
    with pytest.raises(ConfigError, match="bless.require_approval=true"):
        check_overrides(["ingest.path=/data/raw", "export.model_name=tiny-ctr"], OWN)
    with pytest.raises(ConfigError, match="in the same order"):
        check_overrides([OWN[2], OWN[1], OWN[0]], OWN)
    check_overrides([*OWN, "train.lr=0.1"], OWN)  # the deployment's own, and any other field


def test_the_gate_override_is_refused_by_the_deployment_flow_before_anything_is_written(
    deployment_run: tuple[Path, str],  # noqa: F811 - the fixture imported above
) -> None:
    allowed, own = deployment_run
    for override in ("bless.require_approval=false", "export.model_name=daily-ctr"):
        key = override.partition("=")[0]
        with pytest.raises(ConfigError, match=f"overrides: {key} "):
            pipeline(config=str(TINY), root=str(allowed), overrides=[own, override])
    assert not allowed.exists()


# (ii) Names: one plain name each.


@pytest.mark.parametrize(
    "name", ["../other", "other/CHAMPION", "/etc/cron.d", ".hidden", "a\\b", "x" * 129, ""]
)
def test_export_model_name_is_one_plain_name(name: str) -> None:
    with pytest.raises(ConfigError, match=r"export.model_name: .*letters, digits"):
        load_config(TINY, [f"export.model_name='{name}'"])


@pytest.mark.parametrize("name", ["/etc/cron.d", "../../etc", "a/b", "..", "x" * 129])
def test_the_pipeline_name_cannot_leave_the_root(name: str) -> None:
    with pytest.raises(ConfigError, match=r"name: .*letters, digits"):
        load_config(TINY, [f"name='{name}'"])


def test_the_plain_names_shipped_and_in_use_still_load() -> None:
    config = load_config(TINY, ["name=tiny_2024.v1-a", "export.model_name=Full-3"])
    assert (config.name, config.export.model_name) == ("tiny_2024.v1-a", "Full-3")


# (iii) Error messages stay bounded.


def test_an_alias_bomb_in_an_override_is_refused_without_expanding_it() -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match="train.bottom_mlp.*alias") as refused:
        load_config(TINY, [f"train.bottom_mlp={BOMB}"])
    assert len(str(refused.value)) < 2000
    assert time.monotonic() - started < 5


def test_an_alias_bomb_in_a_config_file_is_refused_without_expanding_it(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    # An unknown key's value is echoed in the message.
    bomb.write_text(TINY.read_text().replace("\ntrain:\n", f"\ntrain:\n  mlp: {BOMB}\n", 1))
    started = time.monotonic()
    with pytest.raises(ConfigError, match="bomb.yaml") as refused:
        load_config(bomb)
    assert len(str(refused.value)) < 2000
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "override",
    [
        "train.bottom_mlp=[" + ", ".join(["-1"] * 3_000) + "]",  # a validator echoes it
        "train.zero_stage=" + "7" * 4_000,  # pydantic echoes the input
        "train.zero_stage=" + "7" * 5_000,  # past Python's int digits: a ValueError
        "train.lrr=" + "s" * 10_000,  # unknown key: its value is echoed
        "train.lr" + "r" * 10_000 + "=1",  # an unknown key that long
        "train.lr=" + "[" * 10_000,  # not YAML: the YAML error, and the override, are echoed
        "train.lr=" + "[" * 5_000 + "]" * 5_000,  # nested past Python's recursion limit
        "x" * 10_000,  # no '=': the override is echoed
        "train.lrr=" + "s" * 1_000_000,  # a megabyte
    ],
)
def test_a_huge_value_in_an_override_is_truncated_in_the_message(override: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, [override])
    assert len(str(refused.value)) < 2000, str(refused.value)[:300]
