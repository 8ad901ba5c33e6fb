"""The declarative schema of raw behaviour logs.

The schema names every raw column, its type and its role. Types come from here
and are never inferred from the data; roles tell later stages what a column is
for (label, sparse id, dense value, event time, oracle, key).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["int64", "float64", "string"]
Role = Literal["label", "sparse", "dense", "timestamp", "oracle", "key"]


class FieldSpec(BaseModel):
    """One raw column."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        description="Column name in the raw files (CSV header, JSON key, Parquet column)."
    )
    dtype: Dtype = Field(
        description="Type the raw text must parse as; rows that do not are quarantined."
    )
    role: Role = Field(
        description=(
            "label: the click target; sparse: a categorical id embedded by the model; dense: a "
            "numeric feature; timestamp: event time in unix seconds; oracle: a column only "
            "evaluation may read (e.g. the true click probability of synthetic data); key: kept "
            "but never a feature."
        )
    )
    required: bool = Field(default=True, description="A missing value quarantines the row.")
    log: bool = Field(
        default=False, description="Dense only: apply log1p before standardising (prices, counts)."
    )
    min_count: int | None = Field(
        default=None,
        ge=1,
        description="Sparse only: overrides preprocess.min_count for this feature's vocabulary.",
    )

    @model_validator(mode="after")
    def _role_fits_dtype(self) -> "FieldSpec":
        if self.role in ("label", "timestamp") and self.dtype != "int64":
            raise ValueError(f"field '{self.name}': role {self.role} needs dtype int64")
        if self.role in ("dense", "oracle") and self.dtype == "string":
            raise ValueError(f"field '{self.name}': role {self.role} needs a numeric dtype")
        if self.log and self.role != "dense":
            raise ValueError(f"field '{self.name}': log applies to dense fields only")
        if self.min_count is not None and self.role != "sparse":
            raise ValueError(f"field '{self.name}': min_count applies to sparse fields only")
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

    @model_validator(mode="after")
    def _one_label_one_time(self) -> "SchemaConfig":
        names = [f.name for f in self.fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate field names: {duplicates}")
        for role in ("label", "timestamp"):
            count = sum(f.role == role for f in self.fields)
            if count != 1:
                raise ValueError(f"exactly one field must have role {role}, found {count}")
        if not any(f.role in ("sparse", "dense") for f in self.fields):
            raise ValueError("at least one field must have role sparse or dense")
        if sum(f.role == "oracle" for f in self.fields) > 1:
            raise ValueError("at most one field may have role oracle")
        return self

    def by_role(self, role: Role) -> list[FieldSpec]:
        """Fields with the given role, in schema order."""
        return [f for f in self.fields if f.role == role]

    @property
    def label(self) -> FieldSpec:
        return self.by_role("label")[0]

    @property
    def timestamp(self) -> FieldSpec:
        return self.by_role("timestamp")[0]

    @property
    def oracle(self) -> FieldSpec | None:
        found = self.by_role("oracle")
        return found[0] if found else None
