"""What every schedule is: a policy that lists a plan's collectives."""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, List, Optional, Sequence

from ..plan import CommOp, Layout, ParamSpec, Point

__all__ = ["Schedule", "mark_updates"]


class Schedule(abc.ABC):
    """A communication schedule, chosen once by name and asked only to build ops.

    Subclasses set :attr:`name`, :attr:`reduction` (the collective that sums
    the gradients) and implement :meth:`ops`.  Everything the executor does
    follows from the ops: when each starts and is due, which region it
    averages, when the bucket's update runs.
    """

    name: ClassVar[str] = ""
    reduction: ClassVar[str] = "all_reduce"
    takes_ordering_knobs: ClassVar[bool] = True
    """Whether ``partition_size``, ``credit`` and ``priority`` apply."""
    reduces_before_step: ClassVar[bool] = True
    """Whether every gradient is averaged by the end of ``step()`` (``nonfinite="skip"`` needs that)."""
    mixes_allreduce: ClassVar[bool] = False
    """Whether the schedule all-reduces the buckets in ``Layout.allreduce`` (the ``allreduce`` option)."""
    updates_in_forward: ClassVar[bool] = False
    """Whether updates are applied during the next forward (the model's forward hooks must run)."""
    delays_updates: ClassVar[bool] = False
    """Whether a step's gradients may be applied at a later step (DeFT): carried out by
    :class:`dearopt.delayed.DelayedExecutor` instead of the exact executor."""
    needs_profile: ClassVar[bool] = False
    """Whether the plan is made from rank 0's profile of steps 1-3 (gradient ready times, the link's bandwidth)."""

    def bucket_groups(self, params: Sequence[ParamSpec], *, buffer_size: int,
                      ready_times: Optional[Sequence[float]], bandwidth: Optional[float],
                      latency: Optional[float] = None) -> Optional[List[List[int]]]:
        """Which parameters share a bucket (contiguous runs of positions in forward order), or None to fuse them
        by ``buffer_size`` (every schedule but Prophet's).  ``latency``: measured fixed seconds per collective."""
        return None

    def check_options(self, options) -> None:
        """Refuse option combinations this schedule cannot carry out (``ValueError`` naming them)."""
        if not self.takes_ordering_knobs and (options.partition_size is not None or options.credit is not None
                                              or options.priority):
            raise ValueError(f"schedule={self.name!r} takes no partition_size, credit or priority")
        if options.nonfinite == "skip" and not self.reduces_before_step:
            raise ValueError(f"nonfinite='skip' needs every gradient before the first update; schedule={self.name!r} "
                             f"updates bucket by bucket as the next forward reaches them: use 'raise' or 'ignore', "
                             f"or schedule='dear'")

    @abc.abstractmethod
    def ops(self, layout: Layout) -> Sequence[CommOp]:
        """The plan's collectives in the order every rank starts them."""

    def __repr__(self) -> str:
        return f"<schedule {self.name!r}>"


def mark_updates(ops: Sequence[CommOp], at: Optional[Callable[[CommOp], Point]] = None) -> List[CommOp]:
    """Name on the last op of each bucket (in plan order) when the bucket's update is applied:
    ``at(op)``, by default the op's own due moment."""
    last = {op.bucket: i for i, op in enumerate(ops)}
    return [dataclasses.replace(op, update=((at or (lambda o: o.due))(op) if last[op.bucket] == i else None))
            for i, op in enumerate(ops)]
