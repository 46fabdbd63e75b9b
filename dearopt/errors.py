"""The one exception hierarchy of dearopt.

Every error that dearopt raises on purpose derives from :class:`DearoptError`,
so ``except dearopt.DearoptError`` catches all of them.  Errors caused by the
caller's arguments additionally derive from ``TypeError`` or ``ValueError``, so
code that already catches those keeps working.

Errors about collectives carry the rank, the op, the bucket and the step where
they are known, both as attributes and in the message.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "DearoptError",
    "NotInitializedError",
    "LaunchEnvironmentError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "PlanMismatchError",
    "StepMismatchError",
    "NonFiniteGradientError",
    "UsageError",
    "BackendUnavailableError",
    "NotElementwiseError",
    "CheckpointMismatchError",
    "InternalError",
    "PeerFailedError",
]


class DearoptError(RuntimeError):
    """Base class of every error dearopt raises on purpose."""


class NotInitializedError(DearoptError):
    """A call that needs :func:`dearopt.init` came before it."""


class LaunchEnvironmentError(DearoptError, ValueError):
    """The launcher's environment variables are missing or contradict each other."""


class BackendUnavailableError(DearoptError):
    """The requested collective backend cannot be used on this machine."""


class UsageError(DearoptError):
    """The API was used in an order or a way it does not support."""


class NotElementwiseError(DearoptError, TypeError):
    """``shard_optimizer=True`` with an optimizer whose update is not known to act element by element, so that
    running it on a shard of each parameter could differ from running it on the whole parameter."""


class CheckpointMismatchError(DearoptError, ValueError):
    """A sharded checkpoint was made with another world size, rank or plan than the one loading it."""


def _describe(rank, op, bucket, step) -> str:
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if op is not None:
        parts.append(f"op {op}")
    if bucket is not None:
        parts.append(f"bucket {bucket}")
    if step is not None:
        parts.append(f"step {step}")
    return ", ".join(parts)


class CollectiveError(DearoptError):
    """A collective failed.  Carries ``rank``, ``op``, ``bucket`` and ``step``."""

    def __init__(
        self,
        message: str,
        *,
        rank: Optional[int] = None,
        op: Optional[str] = None,
        bucket: Optional[int] = None,
        step: Optional[int] = None,
    ):
        where = _describe(rank, op, bucket, step)
        super().__init__(f"{message} [{where}]" if where else message)
        self.rank = rank
        self.op = op
        self.bucket = bucket
        self.step = step


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A wait on a collective passed its timeout."""


class PeerLostError(CollectiveError):
    """The transport reports that a peer process is gone."""

    def __init__(self, message: str, *, lost_rank: Optional[int] = None, **where):
        super().__init__(message, **where)
        self.lost_rank = lost_rank


class PlanMismatchError(CollectiveError):
    """Ranks built different communication plans (different models or options)."""


class StepMismatchError(CollectiveError):
    """Ranks disagree about the step or the sequence of collectives."""


class NonFiniteGradientError(CollectiveError, FloatingPointError):
    """A gradient holds inf or NaN and ``nonfinite="raise"`` is in force."""


class InternalError(DearoptError):
    """An exception that is not a :class:`DearoptError` (an ``IndexError``, a ``RuntimeError``...) was raised
    inside dearopt's engine: in one of its hooks (forward, backward) or in ``step()``, ``zero_grad()`` or
    ``synchronize()``.  The original exception is the ``__cause__``; its type and message are in the text.
    Carries ``rank``, ``step``, ``where`` (the engine method) and, where known, ``op`` and ``bucket``.  The other
    ranks are told (they raise :class:`PeerFailedError` instead of waiting for the timeout)."""

    def __init__(
        self,
        message: str,
        *,
        rank: Optional[int] = None,
        step: Optional[int] = None,
        where: Optional[str] = None,
        op: Optional[str] = None,
        bucket: Optional[int] = None,
    ):
        place = _describe(rank, op, bucket, step)
        super().__init__(f"{message} [{place}]" if place else message)
        self.rank = rank
        self.step = step
        self.where = where
        self.op = op
        self.bucket = bucket


def internal_error(
    exc: BaseException, *, rank: Optional[int] = None, step: Optional[int] = None, where: str = "engine"
) -> InternalError:
    """``exc`` (not a :class:`DearoptError`) as an :class:`InternalError` naming the rank, the step and where it
    was raised, ``exc`` its ``__cause__``."""
    text = str(exc).strip() or "(no message)"
    error = InternalError(
        f"an unexpected {type(exc).__name__} was raised inside dearopt ({where}): {text}",
        rank=rank,
        step=step,
        where=where,
    )
    error.__cause__ = exc
    return error


class PeerFailedError(CollectiveError):
    """Another rank failed with an error its peers could not see through the transport (its process may still be
    running: the user's code caught the error), and posted it to the job's store.  ``failed_rank`` is that
    rank, ``failure`` its error's text; ``rank``, ``op``, ``bucket``, ``step`` say where this rank was waiting."""

    def __init__(self, message: str, *, failed_rank: Optional[int] = None, failure: str = "", **where):
        super().__init__(message, **where)
        self.failed_rank = failed_rank
        self.failure = failure
