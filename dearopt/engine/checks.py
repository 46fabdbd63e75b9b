"""The agreement checks off the gradient's path: every rank with the same plan and, in debug mode, parameters.

* **Plan agreement**, once per plan: the plans' fingerprints all-gathered; ranks that differ raise
  :class:`~dearopt.errors.PlanMismatchError` with this rank's plan.
* **Parameter checksums** per step in debug mode (``debug="full"``).

Both use the engine's control channel.  The checks that travel with the gradients are the bucket's: the used flags
and step tags in its buffer's tail (:mod:`dearopt.engine.buckets`); whether the averaged gradients are finite is
judged by :class:`dearopt.engine.gradients.AveragedGradients`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dearopt.engine.buckets import BucketState
from dearopt.backends.base import CollectiveBackend
from dearopt.errors import PlanMismatchError, StepMismatchError
from dearopt.planning.plan import Plan

__all__ = ["Checks"]


class Checks:
    """The plan agreement and the debug checksums of one engine, on its control channel."""

    def __init__(self, control: CollectiveBackend):
        self.control = control
        self.rank, self.world = control.rank, control.size
        self.device = control.device

    # --------------------------------------------------------- plan, params
    def plan_agreement(self, plan: Plan, step: int) -> None:
        if self.world == 1:
            return
        mine = torch.tensor([plan.fingerprint()], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self.control.all_gather(everyone, mine).wait()
        values = everyone.tolist()
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise PlanMismatchError(
                f"ranks built different communication plans (ranks {differ} differ from rank 0): the models, "
                f"their trainable parameters, the optimizer's parameters or the options (schedule, buffer_size, "
                f"comm hook) differ between ranks. This rank's plan:\n{plan.describe()}",
                rank=self.rank,
                op="plan check",
                step=step,
            )

    def parameters(self, buckets: Sequence[BucketState], step: int) -> None:
        """Debug mode: every rank must hold the same parameters (checksums compared)."""
        sums = torch.tensor(
            [float(sum(p.detach().double().sum() for p in b.params)) for b in buckets],
            dtype=torch.float64,
            device=self.device,
        )
        everyone = torch.empty(len(buckets) * self.world, dtype=torch.float64, device=self.device)
        self.control.all_gather(everyone, sums, step=step).wait()
        table = everyone.view(self.world, -1)
        differ = [r for r in range(self.world) if not torch.equal(table[r], table[0])]
        if differ:
            raise StepMismatchError(
                f"debug check: the parameters of ranks {differ} differ from rank 0's "
                f"(checksums per bucket {table.tolist()})",
                rank=self.rank,
                op="parameter checksum",
                step=step,
            )
