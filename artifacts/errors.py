"""The error types every layer raises, and the artifact store's own.

Deterministic errors (bad config, an impossible plan, a changed output) fail a stage at
once; transient errors (I/O, a crashed rank) are retried by the task layer. The split
lives in the lowest layer so that every library can raise the right kind without
knowing about Prefect. Errors only one layer raises live next to it:
`data_prep.errors` (schema), `training.errors` (ranks, parity).
"""


class RecforgeError(Exception):
    """Base class of every error recforge raises on purpose."""


class DeterministicError(RecforgeError):
    """Retrying cannot help: the input or the config must change."""


class ConfigError(DeterministicError):
    """A config file, field or override is invalid."""


class InputNotFoundError(DeterministicError):
    """A path named in the config does not exist or matches no files."""


class DataError(DeterministicError):
    """The data cannot support the requested operation (e.g. an empty split)."""


class TransientError(RecforgeError):
    """May succeed on retry: a crashed or killed rank, a lost connection."""


class CorruptOutput(DataError):
    """A published stage output no longer matches its manifest's sizes and sha256."""


class StoreUnreachable(DeterministicError):
    """The artifact store's URL cannot be listed: endpoint, credentials or bucket."""


class ConcurrentUpdate(DeterministicError):
    """A conditional write lost: someone else changed the object since it was read."""


class SignatureError(DataError):
    """A record read back from storage cannot be trusted: unsigned, signed with an unknown
    key, forged, bound to another place, too large, or not parseable (`artifacts.signing`).
    """
