"""The errors only training raises; the shared kinds are in `artifacts.errors`."""

from artifacts.errors import DeterministicError, TransientError


class ParityError(DeterministicError):
    """An exported model does not reproduce the trained model's scores."""


class TrainingCrashed(TransientError):
    """The DeepSpeed launcher or one of its ranks exited with a non-zero status."""


class Preempted(TrainingCrashed):
    """The ranks were asked to stop (SIGTERM), checkpointed and exited: a retry resumes."""
