"""What a deployment run may override (`flows.deploy.check_overrides`)."""

import pytest

from artifacts.errors import ConfigError
from flows.deploy import PINNED_FIELDS, check_overrides, pinned_field


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("bless", "bless"),
        ("bless.thresholds.auc.lower_bound", "bless"),
        ("export", "export.model_name"),
        ("export.model_name", "export.model_name"),
        ("train", "train.hostfile"),  # a section above several: the first one named
        ("train.init", "train.init"),
        ("name", "name"),
        ("ingest.path", "ingest.path"),
        ("export.parity_rows", None),
        ("train.lr", None),
        ("names", None),
        ("blessing", None),
    ],
)
def test_a_key_sets_a_pinned_field_when_it_is_the_field_above_or_inside_it(key, field):
    assert pinned_field(key) == field


def test_every_pinned_field_says_why():
    assert all(PINNED_FIELDS.values())


def test_a_run_repeats_the_deployments_pinned_overrides_and_adds_others():
    own = ["ingest.partition=dt={scheduled_date-1d}", "bless.require_approval=true"]
    check_overrides(own, own)
    check_overrides(["train.lr=0.1", *own, "evaluate.split=valid"], own)
    check_overrides([own[1]], own)  # the partition is no pinned field
    check_overrides(["train.lr=0.1"], [])
    with pytest.raises(ConfigError, match="must repeat"):
        check_overrides(["train.lr=0.1"], own)
    with pytest.raises(ConfigError, match="must repeat"):
        check_overrides([own[1], own[1]], own)
