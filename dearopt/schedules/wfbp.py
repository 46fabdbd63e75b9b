"""``wfbp``: wait-free backpropagation, as Horovod and DDP do it.

Each bucket is all-reduced as soon as backward has produced all of its
gradients; ``step()`` waits for every all-reduce, averages, and applies the
optimizer to the whole model.  Averaged gradients are in ``p.grad`` before
``step()`` (after ``synchronize``-style waits), so anything that reads them works.
"""

from __future__ import annotations

from ..plan import ALL_REDUCE, GRADS_READY, STEP, CommOp
from .base import Schedule, mark_updates


class WFBP(Schedule):
    name = "wfbp"
    reduction = ALL_REDUCE

    def ops(self, layout):
        return mark_updates([CommOp(ALL_REDUCE, b, k, layout.buckets[b].piece_nbytes(k), start=GRADS_READY,
                                    due=STEP, average=True) for b, k in layout.reduction_order])
