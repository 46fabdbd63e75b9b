"""Applying the wrapped optimizer to the buckets as their updates fall due.

The wrapped optimizer's own ``step()`` runs once per moment of the plan at which
buckets are updated (once per bucket where they land one by one, once for all
of them where they land together at ``step()``), with each param group narrowed
to those buckets' parameters (and to the ones that got a gradient
on some rank), using the hyperparameters that were in force when the user
called ``step()``: an LR scheduler that steps in between does not leak into
updates applied later, in the next forward.

The wrapped optimizer's step hooks (``register_step_pre_hook`` /
``register_step_post_hook`` on it) fire once per training step, not once per
bucket: the pre hooks before the first bucket's update, the post hooks after
the last one.  Its ``step()`` is called without torch's hook wrapper.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from dearopt.engine.buckets import BucketState

__all__ = ["BucketUpdater"]


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """The optimizer's ``step`` without torch's pre/post hook wrapper (``Optimizer.profile_hook_step``)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        raw = step.__wrapped__
        return lambda: raw(optimizer)
    return optimizer.step


class BucketUpdater:
    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._step = _unhooked_step(optimizer)
        self._hyper: Optional[List[Dict]] = None  # hyperparameters in force at step()
        self._remaining = 0  # bucket updates of this step still to apply
        self._started = False

    def begin_step(self, n_updates: int) -> None:
        """A step's updates begin: remember the hyperparameters now in force."""
        self._hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self._remaining = n_updates
        self._started = False

    @property
    def in_step(self) -> bool:
        return self._remaining > 0

    def apply_buckets(self, chosen: List[Tuple[BucketState, List[bool]]]) -> None:
        """Run the optimizer once over the parameters of several buckets (each narrowed by its ``include``), as
        one update per bucket: where buckets are updated at the same moment (at ``step()``) one call costs one
        call's overhead, as DDP's single ``step()`` does, instead of one per bucket.  A per-parameter optimizer
        updates every parameter the same either way."""
        members: List[List[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for bucket, include in chosen:
            for gi, into in enumerate(members):
                group = bucket.group_members[gi] if gi < len(bucket.group_members) else []
                into.extend(group if all(include) else [p for p in group if include[bucket.position[id(p)]]])
        for bucket, _ in chosen:
            bucket.sparse_gradients()
        try:
            self.apply_members(members, updates=len(chosen))
        finally:
            for bucket, _ in chosen:
                bucket.dense_gradients()

    def apply_members(self, members: List[List[torch.Tensor]], updates: int = 1) -> None:
        """Run the optimizer once with param group ``gi`` narrowed to ``members[gi]`` (parameters, or the
        segments of a sharded update) and the hyperparameters in force at ``step()``; it counts as ``updates``
        bucket updates of this step (the post hooks fire after the last)."""
        if not self._started:
            self._started = True
            for hook in list(self.optimizer._optimizer_step_pre_hooks.values()):
                hook(self.optimizer, (), {})
        groups = self.optimizer.param_groups
        # a group added since step() (add_param_group before the pending updates landed) has nothing of this step
        hyper = [
            self._hyper[gi] if self._hyper is not None and gi < len(self._hyper) else {} for gi in range(len(groups))
        ]
        saved = [{k: g[k] for k in hyper[gi]} | {"params": g["params"]} for gi, g in enumerate(groups)]
        try:
            for gi, group in enumerate(groups):
                group.update(hyper[gi])
                group["params"] = members[gi] if gi < len(members) else []
            self._step()
        finally:
            for group, live in zip(groups, saved):
                group.update(live)
        self._remaining -= updates
        if self._remaining == 0:
            for hook in list(self.optimizer._optimizer_step_post_hooks.values()):
                hook(self.optimizer, (), {})
