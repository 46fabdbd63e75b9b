"""``dear``: DeAR's BackPipe and FeedPipe.

BackPipe: each bucket is reduce-scattered as soon as backward has produced
all of its gradients; ``step()`` waits for the reduce-scatters and averages
each rank's shard.  FeedPipe: bucket ``b``'s all-gather is due, and its
update applied, just before the first module of bucket ``b`` runs in the next
forward.  The first bucket's all-gather starts at ``step()``; each next one
when the forward reaches the one before (one bucket ahead), or, with a
``credit`` window, at ``step()`` as far as the credit allows.

Buckets in ``layout.backward_gathers`` (the output side, whose gradients are
ready first) are instead gathered right after their reduce-scatter, while
backward still computes, complete when backward returns (their ``p.grad``
holds the average, as under ``rsag``) and updated at ``step()``: where the link has room
in backward, the next forward then waits for fewer gathers.
"""

from __future__ import annotations

from ..plan import ALL_GATHER, BACKWARD_END, GRADS_READY, REDUCE_SCATTER, STEP, CommOp, after, forward_of
from .base import Schedule, mark_updates


class DeAR(Schedule):
    name = "dear"
    reduction = REDUCE_SCATTER
    updates_in_forward = True

    def ops(self, layout):
        buckets, back = layout.buckets, layout.backward_gathers
        ops = []
        for b, k in layout.reduction_order:
            # a bucket gathered in backward is complete (p.grad averaged) when backward returns, as under rsag
            due = BACKWARD_END if b in back else STEP
            ops.append(CommOp(REDUCE_SCATTER, b, k, buckets[b].piece_nbytes(k), start=GRADS_READY, due=due,
                              average=True))
            if b in back:
                ops.append(CommOp(ALL_GATHER, b, k, buckets[b].piece_nbytes(k), start=after(len(ops) - 1),
                                  due=BACKWARD_END))
        previous = None
        for bucket in buckets:
            b = bucket.index
            if b in back:
                continue
            start = STEP if previous is None or layout.credit is not None else forward_of(previous)
            ops += [CommOp(ALL_GATHER, b, k, bucket.piece_nbytes(k), start=start, due=forward_of(b))
                    for k in range(len(bucket.pieces))]
            previous = b
        return mark_updates(ops, at=lambda op: STEP if op.bucket in back else op.due)
