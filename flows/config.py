"""The pipeline config: one YAML file per pipeline, one frozen section per stage.

``load_config`` reads the YAML, applies ``--set section.key=value`` overrides and
validates everything at once. Unknown keys are errors; every error names the
file, the field and the offending value.
"""

import datetime
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from artifacts.errors import ConfigError
from data_prep.drift import DriftConfig
from data_prep.ingest import IngestConfig
from data_prep.preprocess import PreprocessConfig
from data_prep.schema import SchemaConfig
from data_prep.shard import ShardConfig
from data_prep.synthetic import GenerateConfig
from training.blessing import BlessConfig
from training.config import EvaluateConfig, ExportConfig, TrainConfig, evaluate_export_problems


class PipelineConfig(BaseModel):
    """A whole pipeline: data source, schema and every stage's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Pipeline name, used in run names and the model card.")
    generate: GenerateConfig | None = Field(
        default=None, description="Synthetic data for `recforge generate` (the embedded default)."
    )
    schema_: SchemaConfig = Field(alias="schema", description="The raw columns and their roles.")
    ingest: IngestConfig
    drift: DriftConfig = Field(
        default=DriftConfig(), description="Dataset checks of ingest against the previous run."
    )
    preprocess: PreprocessConfig = PreprocessConfig()
    shard: ShardConfig = ShardConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()
    bless: BlessConfig = Field(
        default=BlessConfig(),
        description="When an exported model may replace the registry's champion.",
    )

    @model_validator(mode="after")
    def _stages_apply_to_the_model(self) -> "PipelineConfig":
        """Refuse evaluate/export settings the chosen train.model would silently ignore."""
        problems = evaluate_export_problems(self.train.model, self.evaluate, self.export)
        if problems:
            # One line each, as load_config's message lists its problems.
            raise ValueError("\n  ".join(problems))
        return self

    @model_validator(mode="after")
    def _validation_matches_evaluation(self) -> "PipelineConfig":
        """In-training validation must pick weights under the protocol they are tested with."""
        if not self.train.eval_every_epochs:
            return self
        pairs = (
            ("valid_num_negatives", "num_negatives"),
            ("valid_negatives_seed", "negatives_seed"),
        )
        for train_field, evaluate_field in pairs:
            train_value = getattr(self.train, train_field)
            evaluate_value = getattr(self.evaluate, evaluate_field)
            if train_value != evaluate_value:
                raise ValueError(
                    f"train.{train_field}={train_value} differs from evaluate."
                    f"{evaluate_field}={evaluate_value}: the best weights would be chosen "
                    "under another protocol than the test's; set both to the same value"
                )
        return self


# `{scheduled_date}` or `{scheduled_date-Nd}` in an override's value: the flow run's
# scheduled UTC date (N days before it), so a daily deployment names its partition.
_SCHEDULE_TOKEN = re.compile(r"\{scheduled_date(?:-(\d{1,3})d)?\}")


def expand_schedule(overrides: list[str], scheduled: datetime.datetime) -> list[str]:
    """Overrides with every `{scheduled_date}` / `{scheduled_date-Nd}` replaced by the
    date (YYYY-MM-DD, UTC) of `scheduled`, or N days before it.

    A daily deployment with `--set ingest.partition=dt={scheduled_date-1d}` ingests
    yesterday's partition on every run, and a backfill or a late run still names the day
    it was scheduled for. Other text, braces included, is left as it is.
    """
    day = scheduled.astimezone(datetime.UTC).date()

    def date_of(match: re.Match[str]) -> str:
        return (day - datetime.timedelta(days=int(match.group(1) or 0))).isoformat()

    return [_SCHEDULE_TOKEN.sub(date_of, override) for override in overrides]


# The most days one backfill runs (a year): a typo in a date should not queue a decade.
MAX_BACKFILL_DAYS = 366
# The partition a backfill names when its overrides name none.
DEFAULT_PARTITION = "ingest.partition=dt={scheduled_date}"


def backfill_days(first: str, last: str) -> list[datetime.datetime]:
    """Every UTC day from `first` to `last` (YYYY-MM-DD, both included), as midnights.

    Raises:
        ConfigError: A date is not YYYY-MM-DD, `last` is before `first`, or the range is
            longer than `MAX_BACKFILL_DAYS`.
    """
    try:
        start = datetime.date.fromisoformat(first)
        end = datetime.date.fromisoformat(last)
    except ValueError:
        raise ConfigError(
            f"backfill --from {first[:40]!r} --to {last[:40]!r}: dates are YYYY-MM-DD"
        ) from None
    if end < start:
        raise ConfigError(f"backfill --to {last} is before --from {first}; swap them")
    count = (end - start).days + 1
    if count > MAX_BACKFILL_DAYS:
        raise ConfigError(
            f"backfill --from {first} --to {last} is {count} days; at most "
            f"{MAX_BACKFILL_DAYS} per backfill: split the range"
        )
    return [
        datetime.datetime.combine(start + datetime.timedelta(days=i), datetime.time(), datetime.UTC)
        for i in range(count)
    ]


def backfill_overrides(overrides: list[str], day: datetime.datetime) -> list[str]:
    """One backfill day's overrides: the schedule tokens as that day, and its partition.

    Overrides that name no `ingest.partition` get `ingest.partition=dt={scheduled_date}`.
    """
    if not any(o.split("=", 1)[0].strip() == "ingest.partition" for o in overrides):
        overrides = [*overrides, DEFAULT_PARTITION]
    return expand_schedule(overrides, day)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read, override and validate a pipeline config.

    Args:
        path: the YAML file.
        overrides: ``section.key=value`` strings; values parse as YAML (``1e-3``,
            ``true``, ``[64, 32]``).

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed or
            names no field, or validation fails. One line per problem.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass a YAML file under configs/.")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections.")
    for override in overrides:
        apply_override(raw, override, path)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, path)) from err


def apply_override(raw: dict, override: str, path: Path) -> None:
    """Set ``section.key=value`` in the raw config mapping, in place."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set '{override}': expected section.key=value.")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set '{override}': '{part}' in {path} is not a section.")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set '{override}': value is not valid YAML ({err}).") from err


def describe_validation_error(err: ValidationError, path: Path) -> str:
    lines = [f"{path}: invalid config ({err.error_count()} problem(s)):"]
    for problem in err.errors():
        field = ".".join(str(p) for p in problem["loc"]) or "(top level)"
        if problem["type"] == "extra_forbidden":
            lines.append(
                f"  {field}: unknown key (value {problem['input']!r}); remove it or fix its "
                "spelling."
            )
        elif not problem["loc"]:
            # A check across sections names its fields and values; its input is the
            # whole config, not worth repeating.
            lines.append(f"  {field}: {problem['msg']}")
        else:
            lines.append(f"  {field}: {problem['msg']} (got {problem['input']!r})")
    return "\n".join(lines)
