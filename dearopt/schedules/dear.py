"""``dear``: DeAR's BackPipe and FeedPipe.

BackPipe: each bucket is reduce-scattered as soon as backward has produced
all of its gradients; ``step()`` waits for the reduce-scatters and averages
each rank's shard.  FeedPipe: bucket ``b``'s all-gather is due, and its
update applied, just before the first module of bucket ``b`` runs in the next
forward.  The first bucket's all-gather starts at ``step()``; each next one
when the forward reaches the one before (one bucket ahead), or, with a
``credit`` window, at ``step()`` as far as the credit allows; with ``gathers_at_step`` (the measured
choice's plan on Prophet's blocks), all at ``step()``, back to back.

Buckets in ``layout.allreduce`` (the output side, whose gradients are ready
first; see :func:`dearopt.planning.plan.allreduce_buckets`) are instead all-reduced in
backward as ``wfbp`` does, complete when backward returns and updated at
``step()``: where the link has room in backward, one all-reduce costs less CPU
than a reduce-scatter plus an all-gather, and the next forward waits for fewer
gathers.
"""

from __future__ import annotations

from dearopt.planning.plan import (
    ALL_GATHER,
    ALL_REDUCE,
    BACKWARD_END,
    GRADS_READY,
    REDUCE_SCATTER,
    STEP,
    CommOp,
    forward_of,
)
from dearopt.schedules.base import Schedule, mark_updates


class DeAR(Schedule):
    """``dear``: DeAR's BackPipe and FeedPipe (see the module).

    ``allreduce``: which buckets are all-reduced in backward instead of reduce-scattered and gathered in the
    next forward.  ``"predicted"``: from a profile of steps 1-3, as many as fit in the link's idle time in
    backward (:func:`dearopt.planning.plan.allreduce_buckets`).  ``"auto"`` (default): that prediction, then measured
    against none (DeAR's plan), all (DDP's) and DeAR's plan on Prophet's gradient blocks for a few steps each,
    and the fastest is kept (``optimizer.schedule.plan_choice``).  A fraction in [0, 1] of the bytes from the output
    side (0: DeAR as in the paper) fixes the plan.  The other knobs: :class:`Schedule`.
    """

    name = "dear"
    reduction = REDUCE_SCATTER
    updates_in_forward = True
    mixes_allreduce = True
    shards_update = True
    takes_sparsify = True

    def __init__(self, *, allreduce="auto", **common):
        if allreduce not in ("auto", "predicted") and (
            isinstance(allreduce, bool) or not isinstance(allreduce, (int, float)) or not 0.0 <= float(allreduce) <= 1.0
        ):
            raise ValueError(f"allreduce must be a fraction in [0, 1], 'auto' or 'predicted', got {allreduce!r}")
        self.allreduce = allreduce
        super().__init__(**common)

    @property
    def plan_choice(self):
        """On ``optimizer.schedule``: the measured choice of the all-reduced buckets (``allreduce="auto"``): a
        :class:`dearopt.planning.tuner.TuningController` over a :class:`dearopt.planning.tuner.ChoiceTuner` whose
        ``history`` holds each rule's measured steps/s; None until rank 0's profile is shared, and where there is
        nothing to choose."""
        return self.figures.plan_choice

    def resolve(self, options):
        """``allreduce`` settled: 1 under a Sparsify (whole sums), 0 under ``shard_optimizer=True``."""
        resolved = super().resolve(options)
        if options.sparsify:
            if self.allreduce not in ("auto", 1, 1.0):
                raise ValueError(
                    f"comm_hook=dearopt.Sparsify(...) under 'dear' all-reduces every bucket in "
                    f"backward (a sparse sum is whole on every rank); allreduce={self.allreduce!r} "
                    f"must be left 'auto' or 1"
                )
            resolved.allreduce = 1.0
        if options.shard_optimizer:
            if self.allreduce not in ("auto", 0, 0.0):
                raise ValueError(
                    f"shard_optimizer=True reduce-scatters every bucket (an all-reduced bucket would "
                    f"be updated whole on every rank); allreduce={self.allreduce!r} must be left "
                    f"'auto' or 0"
                )
            resolved.allreduce = 0.0
        return resolved

    def ops(self, layout):
        """BackPipe's reduce-scatters (all-reduces for ``layout.allreduce``), FeedPipe's all-gathers."""
        buckets, whole = layout.buckets, layout.allreduce
        ops = []
        for b, k in layout.reduction_order:
            nbytes = buckets[b].piece_nbytes(k)
            if b in whole:  # all-reduced in backward, complete when backward returns, as under wfbp
                ops.append(CommOp(ALL_REDUCE, b, k, nbytes, start=GRADS_READY, due=BACKWARD_END, average=True))
            else:
                ops.append(CommOp(REDUCE_SCATTER, b, k, nbytes, start=GRADS_READY, due=STEP, average=True))
        previous = None
        for bucket in buckets:
            b = bucket.index
            if b in whole:
                continue
            start = (
                STEP
                if previous is None or layout.credit is not None or layout.gathers_at_step
                else forward_of(previous)
            )
            ops += [
                CommOp(ALL_GATHER, b, k, bucket.piece_nbytes(k), start=start, due=forward_of(b))
                for k in range(len(bucket.pieces))
            ]
            previous = b
        return mark_updates(ops, at=lambda op: STEP if op.bucket in whole else op.due)
