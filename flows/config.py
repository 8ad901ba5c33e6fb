"""The pipeline config: one YAML file per pipeline, one frozen section per stage.

``load_config`` reads the YAML, applies ``--set section.key=value`` overrides and
validates everything at once. Unknown keys are errors; every error names the
file, the field and the offending value.

Overrides come from whoever starts a run, a Prefect UI user included (docs/security.md),
so reading them is bounded: an override holds at most `MAX_OVERRIDE_CHARS` characters
and no YAML anchor or alias, a config file at most `MAX_CONFIG_BYTES` bytes whose
aliases expand to at most `MAX_YAML_NODES` values, both nested at most
`MAX_YAML_DEPTH` deep; a value echoed in an error is cut to `SHOWN_CHARS` characters,
each problem's line to `MAX_PROBLEM_CHARS`, and at most `MAX_PROBLEMS` are listed.
"""

import datetime
import re
import reprlib
from pathlib import Path

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from artifacts.errors import ConfigError
from data_prep.drift import DriftConfig
from data_prep.ingest import IngestConfig
from data_prep.preprocess import PreprocessConfig
from data_prep.schema import SchemaConfig
from data_prep.shard import ShardConfig
from data_prep.synthetic import GenerateConfig
from training.blessing import BlessConfig
from training.config import (
    EvaluateConfig,
    ExportConfig,
    TrainConfig,
    check_plain_name,
    evaluate_export_problems,
)

# Bounds on what a config file and an override may hold (the module docstring).
MAX_CONFIG_BYTES = 1 << 20
MAX_OVERRIDE_CHARS = 16 << 10
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 20
# Bounds on an error message: a value echoed, one problem's line, problems listed.
SHOWN_CHARS = 200
MAX_PROBLEM_CHARS = 500
MAX_PROBLEMS = 20

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN_CHARS


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for an error message, bounded whatever the value holds.

    Args:
        value: A value from a config file or an override (a string, number, list, ...).
        limit: The most characters returned.

    Returns:
        Its repr, at most `limit` characters: nested containers shortened, the cut
        marked with an ellipsis.
    """
    return clipped(_REPR.repr(value), limit)


def clipped(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters: its start and end, an ellipsis between.

    The end is kept because a message ends with what to change.
    """
    if len(text) <= limit:
        return text
    tail = limit // 4
    return text[: limit - tail - 1] + "…" + text[-tail:]


class PipelineConfig(BaseModel):
    """A whole pipeline: data source, schema and every stage's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        description="Pipeline name, used in run names, the model card and the root's "
        "latest/<name>/ pointers: one plain name (letters, digits, '_', '.', '-').",
    )
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

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        # It names a directory under the root (latest/<name>/): never a path.
        return check_plain_name(value, "name", "the pipeline's name")

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
        ConfigError: the file is missing, too large or not YAML, an override is
            malformed, too long or names no field, or validation fails. One line per
            problem, values cut short (the module docstring).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass a YAML file under configs/.")
    raw = parse_yaml(read_config_text(path), str(path), aliases=True) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections.")
    for override in overrides:
        apply_override(raw, override, path)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, path)) from err


def read_config_text(path: Path) -> str:
    """The text of a config file, read up to `MAX_CONFIG_BYTES`.

    Raises:
        ConfigError: The file is larger, or not UTF-8.
    """
    with path.open("rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_CONFIG_BYTES} bytes, which is no pipeline config; "
            "check that the path names the right file"
        )
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {err.start}); save the file as UTF-8"
        ) from None


def parse_yaml(text: str, what: str, *, aliases: bool) -> object:
    """YAML text as Python values (`yaml.safe_load`), after `check_yaml_size`.

    Args:
        text: The YAML.
        what: Where it came from, for messages (the file, or `--set key`).
        aliases: Whether anchors and aliases are allowed (a file: yes; an override: no).

    Raises:
        ConfigError: Naming `what`: it is not YAML, nested or expanded past the bounds,
            holds an alias where none is allowed, or a value that does not convert (an
            integer longer than Python converts, an impossible date).
    """
    try:
        check_yaml_size(text, what, aliases=aliases)
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}: not valid YAML ({clipped(str(err), SHOWN_CHARS)})") from None
    except ValueError as err:  # an int past Python's digit limit, a date like 2024-13-01
        reason = clipped(str(err).partition(";")[0], SHOWN_CHARS)  # not its advice on limits
        raise ConfigError(
            f"{what}: a value YAML cannot convert ({reason}); correct it, or quote it to "
            "make it a string"
        ) from None


def check_yaml_size(text: str, what: str, *, aliases: bool) -> None:
    """Refuse YAML nested deeper than `MAX_YAML_DEPTH` or expanding past `MAX_YAML_NODES`.

    One pass over the parser's events (no recursion, nothing built): each anchored
    node's expanded size is counted once, and an alias adds its anchor's size, so an
    alias bomb (nine aliases of nine aliases of ...) is refused from its text alone.

    Args:
        text: The YAML.
        what: Where it came from, for messages.
        aliases: False: any anchor or alias is refused.

    Raises:
        ConfigError: Naming `what` and the bound.
        yaml.YAMLError: The text is not YAML.
    """
    sizes: dict[str, int] = {}  # anchor -> expanded values under it
    open_nodes: list[list] = []  # [anchor, values so far] of each open collection
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        anchor = getattr(event, "anchor", None)
        if anchor is not None and not aliases:
            raise ConfigError(
                f"{what}: the value holds a YAML anchor or alias (&{clipped(anchor, 40)}, "
                f"*{clipped(anchor, 40)}), which an override may not; write the value out in full"
            )
        if isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append([anchor, 1])
            if len(open_nodes) > MAX_YAML_DEPTH:
                raise ConfigError(
                    f"{what}: nested more than {MAX_YAML_DEPTH} deep, which no config "
                    "field is; flatten the value"
                )
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = size
        elif isinstance(event, yaml.AliasEvent):
            if any(node[0] == anchor for node in open_nodes):
                raise ConfigError(
                    f"{what}: the alias *{clipped(anchor, 40)} refers to a value that holds "
                    "it (a cycle); write the value out in full"
                )
            size = sizes.get(anchor, 1)  # an undefined one: yaml.safe_load refuses it
        elif isinstance(event, yaml.ScalarEvent):
            size = 1
            if anchor is not None:
                sizes[anchor] = size
        else:
            continue  # stream and document boundaries
        if open_nodes:
            open_nodes[-1][1] += size
            size = open_nodes[-1][1]
        if size > MAX_YAML_NODES:
            raise ConfigError(
                f"{what}: its YAML aliases expand to more than {MAX_YAML_NODES} values "
                "(an alias bomb?); write the values out, or use fewer aliases"
            )


def override_key(override: str) -> str:
    """The ``section.key`` of a ``section.key=value`` override, as `apply_override` reads it."""
    return override.partition("=")[0].strip()


def apply_override(raw: dict, override: str, path: Path) -> None:
    """Set ``section.key=value`` in the raw config mapping, in place.

    Raises:
        ConfigError: The override is malformed, longer than `MAX_OVERRIDE_CHARS`, names
            a key under a value that is no section, or its value is refused by
            `parse_yaml` (no anchors or aliases).
    """
    key, sep, value = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {shown(override)}: expected section.key=value.")
    what = f"--set {clipped(key, SHOWN_CHARS)}"
    if len(override) > MAX_OVERRIDE_CHARS:
        raise ConfigError(
            f"{what}: the override is {len(override)} characters, more than "
            f"{MAX_OVERRIDE_CHARS}; put a value that long in the config file"
        )
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what}: {shown(part)} in {path} is not a section.")
        node = child
    node[parts[-1]] = parse_yaml(value, what, aliases=False)


def describe_validation_error(err: ValidationError, path: Path) -> str:
    """One line per problem (at most `MAX_PROBLEMS`), each naming the field and the value.

    Values are shown cut short (`shown`), and each line is cut to `MAX_PROBLEM_CHARS`:
    a validator's message may echo a value of any size.
    """
    problems = err.errors()
    lines = [f"{path}: invalid config ({len(problems)} problem(s)):"]
    for problem in problems[:MAX_PROBLEMS]:
        field = clipped(".".join(str(p) for p in problem["loc"]), SHOWN_CHARS) or "(top level)"
        if problem["type"] == "extra_forbidden":
            line = (
                f"  {field}: unknown key (value {shown(problem['input'])}); remove it or fix "
                "its spelling."
            )
        elif not problem["loc"]:
            # A check across sections names its fields and values; its input is the
            # whole config, not worth repeating.
            line = f"  {field}: {problem['msg']}"
        else:
            line = f"  {field}: {problem['msg']} (got {shown(problem['input'])})"
        lines.append(clipped(line, MAX_PROBLEM_CHARS))
    if len(problems) > MAX_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_PROBLEMS} more; fix these first")
    return "\n".join(lines)
