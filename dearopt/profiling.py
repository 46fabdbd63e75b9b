"""The one-time profile a priority plan is ordered by.

With ``priority=True`` (or ``dear``'s ``allreduce="auto"``), rank 0 records
during step :data:`ReadyProfile.STEP` when each gradient becomes ready
(seconds after backward starts), how long backward took and the bandwidth its
reductions achieved while the link was busy.  At that step's ``step()`` it broadcasts
the numbers once over the control channel; every rank then re-plans from the
same numbers at the next backward, so the order stays identical everywhere.
"""

from __future__ import annotations

import math
import time
from typing import List, Optional, Tuple

import torch

from .collectives import CollectiveBackend

__all__ = ["ReadyProfile"]


class ReadyProfile:
    STEP = 1
    """The step that is profiled (step 0 builds the plan and is not typical)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        # (ready times per parameter, bytes/s of a reduction on the link, backward seconds)
        self.result: Optional[Tuple[List[float], float, float]] = None
        self.fresh = False  # a result arrived that the plan does not use yet
        self._times: Optional[List[float]] = None
        self._t0 = 0.0
        self._backward = 0.0

    @property
    def recording(self) -> bool:
        return self._times is not None

    def begin_backward(self, step: int, n_params: int) -> None:
        if self.enabled and self.result is None and step == self.STEP:
            self._times = [math.inf] * n_params
            self._t0 = time.perf_counter()

    def grad_ready(self, position: int) -> None:
        if self._times is not None:
            self._times[position] = time.perf_counter() - self._t0

    def end_backward(self) -> None:
        if self._times is not None:
            self._backward = time.perf_counter() - self._t0

    def share(self, control: CollectiveBackend, nbytes: int, busy: float, step: int) -> None:
        """Broadcast rank 0's profile (called on every rank at the profiled step's ``step()``).

        ``busy``: seconds the link was busy with the ``nbytes`` of reductions
        (from each op's start, or the end of the one before it, to its observed end).
        """
        if self._times is None:
            return
        ready = [t if math.isfinite(t) else 0.0 for t in self._times]
        bandwidth = nbytes / busy if busy > 0 else 1e9
        profile = torch.tensor(ready + [bandwidth, self._backward], dtype=torch.float64, device=control.device)
        control.broadcast(profile, 0, step=step).wait()
        values = profile.tolist()
        self.result = (values[:-2], values[-2], values[-1])
        self._times = None
        self.fresh = True
