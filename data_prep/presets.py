"""Ready-made schemas for public recommendation datasets.

Each preset is the ``schema`` section for one well-known file layout plus the ``ingest``
options that read it (format, header, delimiter), so a pipeline config only adds the
path. The shipped configs (``configs/ml-latest-small.yaml``, ``configs/criteo-sample.yaml``)
spell the same schemas out in YAML; a test keeps them equal to the presets.

- ``movielens-ratings-csv``: MovieLens ``ratings.csv`` (ml-latest, ml-25m, ...), with the
  header ``userId,movieId,rating,timestamp``;
- ``movielens-u-data``: MovieLens 100K ``u.data``, tab-separated, no header:
  ``user item rating timestamp``;
- ``movielens-ratings-dat``: MovieLens 1M/10M ``ratings.dat``, ``::``-separated, no header;
- ``criteo``: the Criteo display-ads logs (``train.txt`` of the Kaggle challenge, the
  1TB click logs' days): tab-separated, no header: ``label, I1..I13, C1..C26``.

MovieLens presets share their field names, so the three renditions give the same
events: ``userId`` and ``movieId`` are sparse ids (and the user and item keys), the
label is ``rating >= 4.0`` and ``timestamp`` is unix seconds.

Criteo has no time column but its logs are in time order, so the timestamp ``ts`` is
generated from the record number. Its integer features ``I1..I13`` are declared
float64: the counts are integers in the original files but some copies (the shared
sample among them) write them as ``260.0``, and float64 reads both; they may be empty,
as may the hex-string categoricals ``C1..C26``.
"""

from dataclasses import dataclass
from typing import Any

from artifacts.errors import ConfigError
from data_prep.ingest import IngestConfig
from data_prep.schema import SchemaConfig


@dataclass(frozen=True)
class Preset:
    """A dataset layout: its schema section and the ingest options that read it.

    Attributes:
        name: the preset's name.
        description: the files it describes.
        schema: the ``schema`` section as plain data (``SchemaConfig.model_validate`` input).
        reading: ``ingest`` options (format, header, delimiter) for the original files.
    """

    name: str
    description: str
    schema: dict[str, Any]
    reading: dict[str, Any]

    def schema_config(self) -> SchemaConfig:
        """The schema, validated."""
        return SchemaConfig.model_validate(self.schema)

    def ingest_config(self, path: str, **overrides: Any) -> IngestConfig:
        """An ingest section reading ``path`` with the preset's options.

        Args:
            path: the files to read.
            overrides: other ingest fields, e.g. ``header=True, format="csv"`` for a
                copy written with a header, or ``max_bad_fraction``.
        """
        return IngestConfig(**{**self.reading, "path": path, **overrides})


def _movielens(name: str, description: str, reading: dict[str, Any]) -> Preset:
    schema = {
        "user_key": "userId",
        "item_key": "movieId",
        "fields": [
            {"name": "userId", "dtype": "int64", "role": "sparse"},
            {"name": "movieId", "dtype": "int64", "role": "sparse"},
            {"name": "rating", "dtype": "float64", "role": "label", "threshold": 4.0},
            {"name": "timestamp", "dtype": "int64", "role": "timestamp"},
        ],
    }
    return Preset(name, description, schema, reading)


def _criteo() -> Preset:
    fields: list[dict[str, Any]] = [{"name": "label", "dtype": "int64", "role": "label"}]
    fields += [
        {"name": f"I{i}", "dtype": "float64", "role": "dense", "required": False, "log": True}
        for i in range(1, 14)
    ]
    fields += [
        {"name": f"C{i}", "dtype": "string", "role": "sparse", "required": False}
        for i in range(1, 27)
    ]
    fields.append({"name": "ts", "dtype": "int64", "role": "timestamp", "generated": "row_number"})
    return Preset(
        "criteo",
        "Criteo display-ads logs: label, I1..I13 counts, C1..C26 hashed categoricals; "
        "tab-separated, no header, in time order.",
        {"fields": fields},
        {"format": "tsv", "header": False},
    )


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        _movielens(
            "movielens-ratings-csv",
            "MovieLens ratings.csv (ml-latest, ml-latest-small, ml-20m, ml-25m): "
            "userId,movieId,rating,timestamp with a header.",
            {"format": "csv", "header": True},
        ),
        _movielens(
            "movielens-u-data",
            "MovieLens 100K u.data: user, item, rating, timestamp; tab-separated, no header.",
            {"format": "tsv", "header": False},
        ),
        _movielens(
            "movielens-ratings-dat",
            "MovieLens 1M/10M ratings.dat: UserID::MovieID::Rating::Timestamp, no header.",
            {"format": "csv", "header": False, "delimiter": "::"},
        ),
        _criteo(),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ConfigError: no preset has that name.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown dataset preset '{name}'; choose one of {sorted(PRESETS)}.")
    return PRESETS[name]
