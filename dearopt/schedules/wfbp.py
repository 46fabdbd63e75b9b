"""``wfbp``: wait-free backpropagation, as Horovod and DDP do it.

Each bucket is all-reduced as soon as backward has produced all of its
gradients.  As with DDP, backward ends only once every all-reduce has
finished and been averaged: when ``loss.backward()`` returns, every ``p.grad``
holds the averaged gradient, so torch's own tools (``clip_grad_norm_``,
``GradScaler.unscale_``) and anything else that reads or rescales gradients
before ``step()`` see exactly what one process would.  ``step()`` applies the
optimizer to the whole model.
"""

from __future__ import annotations

from dearopt.planning.plan import ALL_REDUCE, BACKWARD_END, GRADS_READY, STEP, CommOp
from dearopt.schedules.base import Schedule, mark_updates


class WFBP(Schedule):
    """``wfbp``: Horovod's and DDP's all-reduce in backward (see the module); knobs: :class:`Schedule`."""

    name = "wfbp"
    reduction = ALL_REDUCE
    takes_sparsify = True

    def ops(self, layout):
        """One all-reduce per piece as its gradients are ready, all due when backward ends; updates at ``step()``."""
        return mark_updates(
            [
                CommOp(
                    ALL_REDUCE,
                    b,
                    k,
                    layout.buckets[b].piece_nbytes(k),
                    start=GRADS_READY,
                    due=BACKWARD_END,
                    average=True,
                )
                for b, k in layout.reduction_order
            ],
            at=lambda op: STEP,
        )
