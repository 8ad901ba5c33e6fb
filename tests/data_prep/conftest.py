import pytest

from data_prep.schema import SchemaConfig


@pytest.fixture
def schema() -> SchemaConfig:
    return SchemaConfig(
        fields=[
            {"name": "ts", "dtype": "int64", "role": "timestamp"},
            {"name": "user_id", "dtype": "int64", "role": "sparse"},
            {"name": "city", "dtype": "string", "role": "sparse"},
            {"name": "price", "dtype": "float64", "role": "dense", "log": True},
            {"name": "click", "dtype": "int64", "role": "label"},
            {"name": "p_true", "dtype": "float64", "role": "oracle", "required": False},
        ]
    )
