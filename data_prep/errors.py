"""The error only the data libraries raise; the shared kinds are in `artifacts.errors`."""

from artifacts.errors import DeterministicError


class SchemaError(DeterministicError):
    """Data does not match the declared schema (too many bad rows, missing columns)."""
