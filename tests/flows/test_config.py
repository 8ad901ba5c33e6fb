import datetime
from pathlib import Path

import pytest

from artifacts.errors import ConfigError
from flows.config import (
    MAX_CONFIG_BYTES,
    MAX_PROBLEMS,
    SHOWN_CHARS,
    backfill_days,
    backfill_overrides,
    check_yaml_size,
    clipped,
    expand_schedule,
    load_config,
    shown,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.schema_.label.role == "label"
    assert config.train.bottom_mlp


def test_override_sets_a_field_with_yaml_types():
    config = load_config(REPO / "configs/tiny.yaml", ["train.lr=0.05", "train.top_mlp=[8, 4]"])
    assert config.train.lr == 0.05 and config.train.top_mlp == [8, 4]


def test_unknown_key_names_file_field_and_value(tmp_path):
    text = (REPO / "configs/tiny.yaml").read_text().replace("  lr: 0.003", "  lrr: 0.003")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    message = str(err.value)
    assert "bad.yaml" in message and "train.lrr" in message and "0.003" in message


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"train.zero_stage.*got 7"):
        load_config(REPO / "configs/tiny.yaml", ["train.zero_stage=7"])


def test_unknown_override_is_an_error():
    with pytest.raises(ConfigError, match="train.nope"):
        load_config(REPO / "configs/tiny.yaml", ["train.nope=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(REPO / "configs/tiny.yaml", ["train.lr"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_in_training_validation_must_use_the_test_protocol():
    """Weights picked under another negatives protocol than the test's are refused."""
    sasrec = str(REPO / "configs" / "tiny-sasrec.yaml")
    on = ["train.eval_every_epochs=1", "train.valid_num_negatives=20"]  # evaluate's 20
    assert load_config(sasrec, on).train.valid_num_negatives == 20
    with pytest.raises(ConfigError, match="train.valid_num_negatives=20 differs from evaluate"):
        load_config(sasrec, [*on, "evaluate.num_negatives=30"])
    with pytest.raises(ConfigError, match="valid_negatives_seed=3 differs"):
        load_config(sasrec, [*on, "train.valid_negatives_seed=3"])
    # Without in-training validation the valid protocol is not used, so not checked.
    load_config(sasrec, ["evaluate.num_negatives=30"])


BST = ["train.model=bst", "preprocess.sequence_item_features=[]", "train.sequence.mlp=[16]"]


@pytest.mark.parametrize(
    ("config", "overrides", "refusal"),
    [
        ("tiny.yaml", ["evaluate.ks=[5]"], r"evaluate.ks=\[5\] does not apply to train.model=dlrm"),
        ("tiny.yaml", ["export.top_k=5"], "export.top_k=5 does not apply to train.model=dlrm"),
        (
            "tiny-sasrec.yaml",
            ["evaluate.auc_mode=exact"],
            "evaluate.auc_mode='exact' does not apply to train.model=sasrec",
        ),
        (
            "tiny-sasrec.yaml",
            ["export.infra_validation_rows=10"],
            "export.infra_validation_rows=10 does not apply to train.model=sasrec",
        ),
        ("tiny-sasrec.yaml", [*BST, "export.top_k=5"], "export.top_k=5 does not apply.*bst"),
        (
            "tiny-sasrec.yaml",
            [*BST, "evaluate.full_ranking=false"],
            "evaluate.full_ranking=False does not apply to train.model=bst",
        ),
    ],
)
def test_an_evaluate_or_export_field_of_another_model_is_refused(config, overrides, refusal):
    """A setting the chosen model never reads is refused, naming it, not silently ignored."""
    path = REPO / "configs" / config
    with pytest.raises(ConfigError, match=refusal) as err:
        load_config(path, overrides)
    assert config in str(err.value) and "remove it" in str(err.value)
    # The refusal names the field; it does not dump the whole config.
    assert "'schema'" not in str(err.value)
    load_config(path, overrides[:-1])  # the same config without it loads


def test_schedule_tokens_name_the_scheduled_day_in_utc():
    late_evening_in_tokyo = datetime.datetime(
        2026, 12, 7, 1, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=9))
    )  # 2026-12-06 16:30 UTC
    overrides = [
        "ingest.partition=dt={scheduled_date-1d}",
        "name=daily-{scheduled_date}",
        "name=braces {kept} {scheduled_date-x}",
    ]
    assert expand_schedule(overrides, late_evening_in_tokyo) == [
        "ingest.partition=dt=2026-12-05",
        "name=daily-2026-12-06",
        "name=braces {kept} {scheduled_date-x}",
    ]
    # The expanded partition is then validated like any override.
    config = load_config(
        REPO / "configs" / "demo.yaml",
        expand_schedule(["ingest.partition=dt={scheduled_date-1d}"], late_evening_in_tokyo),
    )
    assert config.ingest.partition == "dt=2026-12-05"


def test_backfill_days_are_checked_and_each_names_its_partition() -> None:
    days = backfill_days("2026-12-30", "2027-01-02")
    assert [d.date().isoformat() for d in days] == [
        "2026-12-30", "2026-12-31", "2027-01-01", "2027-01-02",
    ]  # fmt: skip
    assert backfill_overrides(["train.lr=0.01"], days[2]) == [
        "train.lr=0.01", "ingest.partition=dt=2027-01-01",
    ]  # fmt: skip
    named = ["ingest.partition=day_{scheduled_date-1d}"]
    assert backfill_overrides(named, days[0]) == ["ingest.partition=day_2026-12-29"]
    for first, last, match in [
        ("2026-12-05", "2026-12-01", "before"),
        ("2026-13-01", "2026-12-01", "YYYY-MM-DD"),
        ("2020-01-01", "2026-01-01", "split the range"),
    ]:
        with pytest.raises(ConfigError, match=match):
            backfill_days(first, last)


def test_a_config_file_may_use_yaml_anchors_within_bounds(tmp_path):
    text = (REPO / "configs/tiny.yaml").read_text()
    text = text.replace("  bottom_mlp: [32, 16]", "  bottom_mlp: &sizes [32, 16]")
    text = text.replace("  top_mlp: [64, 32]", "  top_mlp: *sizes")
    path = tmp_path / "anchored.yaml"
    path.write_text(text)
    assert load_config(path).train.top_mlp == [32, 16]
    # An override may not: it comes from whoever starts the run.
    with pytest.raises(ConfigError, match=r"--set train.top_mlp: .*anchor or alias"):
        load_config(path, ["train.top_mlp=&a [8]"])


@pytest.mark.parametrize(
    ("yaml_text", "refusal"),
    [
        ("a: &a [1, *a]", "a cycle"),
        ("a: " + "[" * 21 + "]" * 21, "nested more than 20 deep"),
        ("a: &a [" + ", ".join(["1"] * 1000) + "]\nb: [" + ", ".join(["*a"] * 101) + "]", "expand"),
    ],
)
def test_check_yaml_size_refuses_cycles_depth_and_expansion(yaml_text, refusal):
    with pytest.raises(ConfigError, match=f"^where: .*{refusal}"):
        check_yaml_size(yaml_text, "where", aliases=True)
    check_yaml_size("a: &a [1, 2]\nb: [*a, *a]\nc: " + "[" * 19 + "]" * 19, "where", aliases=True)


def test_a_config_file_too_large_or_not_utf8_is_refused(tmp_path):
    large = tmp_path / "large.yaml"
    large.write_text("# " + "x" * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError, match=f"large.yaml: larger than {MAX_CONFIG_BYTES} bytes"):
        load_config(large)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.yaml: not UTF-8 text"):
        load_config(latin)


def test_values_in_messages_are_shown_bounded():
    assert shown("x" * 10) == "'xxxxxxxxxx'"
    assert len(shown("x" * 10_000)) <= SHOWN_CHARS
    nested = [[list(range(1000))] * 1000] * 1000  # a billion values, shared
    assert len(shown(nested)) <= SHOWN_CHARS
    assert clipped("a" * 300 + " say what to change", 100).endswith("say what to change")
    assert len(clipped("a" * 300, 100)) == 100


def test_many_problems_are_listed_up_to_a_bound():
    overrides = [f"train.unknown{i}=1" for i in range(MAX_PROBLEMS + 5)]
    with pytest.raises(ConfigError, match=r"(?s)\(25 problem\(s\)\).*and 5 more") as err:
        load_config(REPO / "configs/tiny.yaml", overrides)
    assert "unknown24" not in str(err.value)


def test_a_value_yaml_cannot_convert_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--set ingest.partition: .*month must be in 1..12"):
        load_config(REPO / "configs/tiny.yaml", ["ingest.partition=2024-13-01"])
