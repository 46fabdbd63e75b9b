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
