"""``rsag``: reduce-scatter, then all-gather, both during backward (the DeAR paper's baseline).

Each piece's all-gather starts once its reduce-scatter has finished (or as soon
as a later op in the plan is waiting for it).  Backward ends once every
all-gather has finished, so, as with ``wfbp``, every ``p.grad`` holds the
averaged gradient when ``loss.backward()`` returns; ``step()`` applies the optimizer.
"""

from __future__ import annotations

from dearopt.planning.plan import ALL_GATHER, BACKWARD_END, GRADS_READY, REDUCE_SCATTER, STEP, CommOp, after
from dearopt.schedules.base import Schedule, mark_updates


class RSAG(Schedule):
    """``rsag``: reduce-scatter then all-gather, both in backward (see the module); knobs: :class:`Schedule`
    without the ordering ones."""

    name = "rsag"
    reduction = REDUCE_SCATTER
    takes_ordering_knobs = False

    def _ordering_refusal(self) -> str:
        return "schedule='rsag' is the paper's baseline and takes no partition_size, credit or priority"

    def ops(self, layout):
        """Per piece a reduce-scatter, then its all-gather once it finished; all due when backward ends."""
        ops = []
        for b, k in layout.reduction_order:
            nbytes = layout.buckets[b].piece_nbytes(k)
            ops.append(CommOp(REDUCE_SCATTER, b, k, nbytes, start=GRADS_READY, due=BACKWARD_END, average=True))
            ops.append(CommOp(ALL_GATHER, b, k, nbytes, start=after(len(ops) - 1), due=BACKWARD_END))
        return mark_updates(ops, at=lambda op: STEP)
