"""``dear``: DeAR's BackPipe and FeedPipe.

BackPipe: each bucket is reduce-scattered as soon as backward has produced
all of its gradients; ``step()`` waits for the reduce-scatters and averages
each rank's shard.  FeedPipe: bucket ``b``'s all-gather is due, and its
update applied, just before the first module of bucket ``b`` runs in the next
forward.  Bucket 0's all-gather starts at ``step()``; bucket ``b``'s starts
when the forward reaches bucket ``b - 1`` (one bucket ahead), or, with a
``credit`` window, at ``step()`` as far as the credit allows.
"""

from __future__ import annotations

from ..plan import ALL_GATHER, GRADS_READY, REDUCE_SCATTER, STEP, CommOp, forward_of
from .base import Schedule, mark_updates


class DeAR(Schedule):
    name = "dear"
    reduction = REDUCE_SCATTER
    updates_in_forward = True

    def ops(self, layout):
        buckets = layout.buckets
        ops = [CommOp(REDUCE_SCATTER, b, k, buckets[b].piece_nbytes(k), start=GRADS_READY, due=STEP, average=True)
               for b, k in layout.reduction_order]
        for bucket in buckets:
            b = bucket.index
            start = STEP if b == 0 or layout.credit is not None else forward_of(b - 1)
            ops += [CommOp(ALL_GATHER, b, k, bucket.piece_nbytes(k), start=start, due=forward_of(b))
                    for k in range(len(bucket.pieces))]
        return mark_updates(ops)
