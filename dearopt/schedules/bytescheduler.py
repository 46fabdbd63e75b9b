"""``bytescheduler``: ByteScheduler's per-partition all-reduce, finished just in time for the next forward.

Reductions start as backward produces gradients (in priority order when
``priority=True``, bounded by the ``credit`` window) and may still be running
during the next forward: bucket ``b``'s all-reduce is due, and its update
applied, just before the first module of bucket ``b`` runs.  Buckets are
therefore updated one by one, so a non-finite gradient cannot skip the whole
step (``nonfinite="skip"`` is refused).
"""

from __future__ import annotations

from dearopt.planning.plan import ALL_REDUCE, GRADS_READY, CommOp, forward_of
from dearopt.schedules.base import Schedule, mark_updates


class ByteScheduler(Schedule):
    """``bytescheduler``: ByteScheduler's per-partition all-reduce, finished just in time for the next forward
    (see the module): ``ByteScheduler(partition_size="4MB", credit="16MB", priority=True)``; knobs:
    :class:`Schedule`."""

    name = "bytescheduler"
    reduction = ALL_REDUCE
    reduces_before_step = False
    updates_in_forward = True

    def ops(self, layout):
        """One all-reduce per piece as its gradients are ready, each bucket due (and updated) at its forward."""
        return mark_updates(
            [
                CommOp(
                    ALL_REDUCE,
                    b,
                    k,
                    layout.buckets[b].piece_nbytes(k),
                    start=GRADS_READY,
                    due=forward_of(b),
                    average=True,
                )
                for b, k in layout.reduction_order
            ]
        )
