"""The declarative schema of raw behaviour logs.

The schema names every raw column, its type, its role and the transform that
turns it into a model input. Types come from here and are never inferred from the
data; roles tell later stages what a column is for:

- ``label``: a target (several labels make a multi-task dataset; the first is primary);
- ``sparse``: a categorical id, single-valued or multi-hot (a list of ids), embedded by
  the model; it maps to an index through a vocabulary (``min_count``/``top_k``, index 0
  is out-of-vocabulary) or by hashing into ``hash_buckets``;
- ``dense``: a number; ``fill`` -> ``clip`` -> ``log`` -> ``standardize``, or
  ``bucketize`` into a categorical index;
- ``timestamp``: event time in unix seconds;
- ``oracle``: a column only evaluation may read (e.g. synthetic data's true click
  probability), never a feature;
- ``key``: kept through the pipeline, never a feature.

``user_key`` and ``item_key`` name the fields (usually sparse features too) that
identify users and items, for per-user splits and behaviour sequences.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["int64", "float64", "string"]
Role = Literal["label", "sparse", "dense", "timestamp", "oracle", "key"]


class FieldSpec(BaseModel):
    """One raw column and its transform."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        description="Column name in the raw files (CSV header, JSON key, Parquet column)."
    )
    dtype: Dtype = Field(
        description="Type the raw value must parse as (of each element, for multi_hot); "
        "rows that do not are quarantined."
    )
    role: Role = Field(description="What the column is for; see the module docstring.")
    required: bool = Field(default=True, description="A missing value quarantines the row.")
    generated: Literal["row_number"] | None = Field(
        default=None,
        description="Timestamp only: not read from the files but numbered by input order (file "
        "order, then row order), for logs such as Criteo's that are time-ordered but carry no "
        "time column.",
    )
    threshold: float | None = Field(
        default=None,
        description="Label only: the raw column is numeric (e.g. a star rating) and the label is "
        "1 when it is >= threshold, else 0.",
    )
    # sparse
    multi_hot: bool = Field(
        default=False,
        description="Sparse only: the value is a list of ids (a JSON array, a Parquet list, or "
        "text split on `separator`).",
    )
    separator: str = Field(
        default="|", min_length=1, description="Sparse multi_hot only: separator in text formats."
    )
    min_count: int | None = Field(
        default=None,
        ge=1,
        description="Sparse only: ids seen fewer times in train map to the OOV index 0 "
        "(default preprocess.min_count).",
    )
    top_k: int | None = Field(
        default=None, ge=1, description="Sparse only: keep at most the K most frequent ids."
    )
    hash_buckets: int | None = Field(
        default=None,
        ge=2,
        description="Sparse only: hash ids into this many buckets instead of a vocabulary "
        "(for unbounded id spaces); no OOV row.",
    )
    # dense
    fill: float | None = Field(
        default=None,
        description="Dense only: value for a missing entry (default: the train mean, i.e. 0 "
        "after standardising).",
    )
    clip: tuple[float, float] | None = Field(
        default=None, description="Dense only: clip raw values to [low, high] before log/scale."
    )
    log: bool = Field(default=False, description="Dense only: apply log1p(max(x, 0)).")
    standardize: bool = Field(
        default=True, description="Dense only: subtract the train mean, divide by the train std."
    )
    bucketize: list[float] | None = Field(
        default=None,
        min_length=1,
        description="Dense only: ascending boundaries; the value becomes a categorical bucket "
        "index (a sparse feature of len(bucketize) + 1 values) instead of a number.",
    )

    @model_validator(mode="after")
    def _options_fit_role(self) -> "FieldSpec":
        if self.role == "timestamp" and self.dtype != "int64":
            raise ValueError(f"field '{self.name}': role timestamp needs dtype int64")
        if self.role == "label" and self.dtype != (
            "int64" if self.threshold is None else "float64"
        ):
            raise ValueError(
                f"field '{self.name}': a label needs dtype int64, or float64 with a threshold"
            )
        if self.generated is not None and self.role != "timestamp":
            raise ValueError(f"field '{self.name}': generated applies to the timestamp only")
        if self.threshold is not None and self.role != "label":
            raise ValueError(f"field '{self.name}': threshold applies to labels only")
        if self.role in ("dense", "oracle") and self.dtype == "string":
            raise ValueError(f"field '{self.name}': role {self.role} needs a numeric dtype")
        sparse_options = {
            "multi_hot": self.multi_hot,
            "min_count": self.min_count,
            "top_k": self.top_k,
            "hash_buckets": self.hash_buckets,
        }
        dense_options = {
            "fill": self.fill,
            "clip": self.clip,
            "log": self.log,
            "bucketize": self.bucketize,
        }
        for role, options in (("sparse", sparse_options), ("dense", dense_options)):
            used = [k for k, v in options.items() if v not in (None, False)]
            if used and self.role != role:
                raise ValueError(f"field '{self.name}': {used} apply to {role} fields only")
        if self.hash_buckets is not None and (self.min_count or self.top_k):
            raise ValueError(
                f"field '{self.name}': hash_buckets replaces the vocabulary; drop min_count/top_k"
            )
        if self.clip is not None and self.clip[0] > self.clip[1]:
            raise ValueError(f"field '{self.name}': clip low {self.clip[0]} > high {self.clip[1]}")
        if self.bucketize is not None and sorted(self.bucketize) != self.bucketize:
            raise ValueError(f"field '{self.name}': bucketize boundaries must be ascending")
        return self


class SchemaConfig(BaseModel):
    """The raw columns, in file order for header-less formats."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fields: list[FieldSpec] = Field(min_length=1, description="Every raw column.")
    label_values: list[int] = Field(
        default=[0, 1], description="Allowed label values; other values are quarantined."
    )
    min_timestamp: int = Field(default=0, description="Smallest valid event time (unix seconds).")
    max_timestamp: int = Field(
        default=4_102_444_800, description="Largest valid event time (unix seconds, 2100-01-01)."
    )
    user_key: str | None = Field(
        default=None, description="Field that identifies the user (per-user splits, sequences)."
    )
    item_key: str | None = Field(
        default=None, description="Field that identifies the item (behaviour sequences)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "SchemaConfig":
        names = [f.name for f in self.fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate field names: {duplicates}")
        if not any(f.role == "label" for f in self.fields):
            raise ValueError("at least one field must have role label")
        if sum(f.role == "timestamp" for f in self.fields) != 1:
            raise ValueError("exactly one field must have role timestamp")
        if not any(f.role in ("sparse", "dense") for f in self.fields):
            raise ValueError("at least one field must have role sparse or dense")
        if sum(f.role == "oracle" for f in self.fields) > 1:
            raise ValueError("at most one field may have role oracle")
        for key in ("user_key", "item_key"):
            value = getattr(self, key)
            if value is not None and value not in names:
                raise ValueError(f"{key} '{value}' is not one of the fields {names}")
        return self

    def by_role(self, role: Role) -> list[FieldSpec]:
        """Fields with the given role, in schema order."""
        return [f for f in self.fields if f.role == role]

    @property
    def labels(self) -> list[FieldSpec]:
        return self.by_role("label")

    @property
    def label(self) -> FieldSpec:
        """The primary (first) label."""
        return self.labels[0]

    @property
    def timestamp(self) -> FieldSpec:
        return self.by_role("timestamp")[0]

    @property
    def oracle(self) -> FieldSpec | None:
        found = self.by_role("oracle")
        return found[0] if found else None
