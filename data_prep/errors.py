"""Error types shared by every layer.

Deterministic errors (bad config, schema violations, impossible plans) fail a
stage at once; transient errors (I/O, a crashed rank) are retried by the task
layer. The split lives here so the libraries can raise the right kind without
knowing about Prefect.
"""


class RecforgeError(Exception):
    """Base class of every error recforge raises on purpose."""


class DeterministicError(RecforgeError):
    """Retrying cannot help: the input or the config must change."""


class ConfigError(DeterministicError):
    """A config file, field or override is invalid."""


class InputNotFoundError(DeterministicError):
    """A path named in the config does not exist or matches no files."""


class SchemaError(DeterministicError):
    """Data does not match the declared schema (too many bad rows, missing columns)."""


class ParityError(DeterministicError):
    """An exported model does not reproduce the trained model's scores."""


class TransientError(RecforgeError):
    """May succeed on retry: a crashed or killed rank, a lost connection."""


class TrainingCrashed(TransientError):
    """The DeepSpeed launcher or one of its ranks exited with a non-zero status."""


class Preempted(TrainingCrashed):
    """The ranks were asked to stop (SIGTERM), checkpointed and exited: a retry resumes."""


class DataError(DeterministicError):
    """The data cannot support the requested operation (e.g. an empty split)."""
