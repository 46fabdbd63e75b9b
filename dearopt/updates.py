"""The updates of a round: each bucket's update applied at the moment the plan names.

:class:`RoundUpdates` is the engine's part from ``step()`` to the last update of
that step's round: at ``step()`` the buckets due there (all of them under a
sharded update, each rank its shard), and, as the next forward reaches each
bucket (or user code touches its parameters), the ops due there completed and
its update applied; the round ends with the last one.  The optimizer itself is
called by :class:`~dearopt.updater.BucketUpdater`.
"""

from __future__ import annotations

import time
from typing import List

import torch

from .buckets import BucketState
from .plan import forward_of

__all__ = ["RoundUpdates"]


class RoundUpdates:
    """Applies a round's updates at their moments (see the module)."""

    def __init__(self, engine):
        self.engine = engine

    # ------------------------------------------------ the moments protocol
    def forward_started(self) -> None:
        """A training forward began (nothing to do: the updates wait for their buckets' modules)."""

    def module_reached(self, module) -> None:
        """The forward is about to run ``module``: the moments of the buckets up to its own."""
        e = self.engine
        r = e.round
        if r is None or not r.stepped:
            return
        bucket = e.bound.module_bucket.get(id(module))
        if bucket is not None and bucket > r.forward_reached:
            self.reach_forward(bucket)
        elif e.window.credit is not None:
            e.issuer.pump(e.may_start)  # ops held back for credit start as soon as room frees

    def touched(self, bucket: int) -> None:
        """User code touched a parameter of ``bucket`` after ``step()``: its pending updates first."""
        r = self.engine.round
        if r is not None and r.stepped:
            self.reach_forward(bucket)

    def synchronize(self) -> None:
        """Apply every pending update now."""
        r = self.engine.round
        if r is not None and r.stepped:
            self.reach_forward(len(self.engine.buckets) - 1)

    def may_replan(self) -> None:
        """A re-plan is about to happen (every update of an exact round lands by the next forward: allowed)."""

    def close(self) -> None:
        """Nothing of its own to release."""

    # ------------------------------------------------------------ the round

    def reach_forward(self, target: int) -> None:
        """The forward reached bucket ``target``: carry out every bucket's forward moment up to it, in order."""
        e = self.engine
        while e.round is not None and e.round.forward_reached < target:
            k = e.round.forward_reached + 1
            point = forward_of(k)
            t0 = time.perf_counter()
            e._complete_due(point)
            e.profile.forward_waited(time.perf_counter() - t0)
            e.round.forward_reached = k
            e.issuer.pump(e.may_start)  # e.g. prefetch the next bucket's all-gather
            due = e.bound.updates_at.get(point, ())
            if due:
                self.update([e.buckets[b] for b in due], tags_checked=False)

    def share_meta(self, step: int, nonfinite: bool) -> bool:
        """Sharded update: every bucket's used flags and step tags summed over ranks on the control channel, with
        this rank's non-finite answer (``nonfinite``); returns whether any rank found inf/NaN.  The
        reduce-scatter leaves the flags' and tags' sum only on the rank whose shard holds the bucket's tail, and
        the all-gather carries parameters, so without this message no other rank would learn them; the
        non-finite check rides along instead of taking a message of its own."""
        e = self.engine
        if e.world == 1:
            return nonfinite
        meta = torch.cat([torch.tensor([1.0 if nonfinite else 0.0], dtype=torch.float64)]
                         + [torch.cat([b.flags, b.tags]).double().cpu() for b in e.buckets]).to(e.control.device)
        e.control.all_reduce(meta, "sum", step=step).wait()
        meta = meta.to(e.buckets[0].buffer.device)
        found = float(meta[0]) > 0
        offset = 1
        for b in e.buckets:
            n = len(b.params)
            b.flags.copy_(meta[offset:offset + n])
            b.tags.copy_(meta[offset + n:offset + n + e.world])
            offset += n + e.world
            b.mark_seen()
        return found

    def included(self, bucket: BucketState) -> List[bool]:
        """Which parameters of the bucket the update includes: those some rank produced a gradient for, and
        those unused on every rank that keep the gradient they had (none after ``zero_grad(set_to_none=True)``,
        so the optimizer skips them, else their last one)."""
        e = self.engine
        used = e.checks.used(bucket)
        for owner, j, twin, k, _ in e.bound.combines:  # a tied weight is used where its twin was
            if owner is bucket:
                used[j] = used[j] or e.checks.used(twin)[k]
        include = [u or had for u, had in zip(used, bucket.has_grad)]
        bucket.has_grad = include
        return include

    def update_shards(self) -> None:
        """Sharded update, at ``step()``: each bucket's optimizer update on this rank's shard, in bucket order; the
        all-gathers that start from here on carry the updated parameters.  The whole averaged gradient exists on
        no rank, so every ``p.grad`` becomes None (as after ``zero_grad(set_to_none=True)``)."""
        e = self.engine
        e.sharding.prepare(e.buckets, e.plan.fingerprint())
        for bucket in e.buckets:
            t0 = e.timeline.now()
            include = self.included(bucket)
            if bucket.has_members:
                e.sharding.apply(bucket, include, e.updater)
            bucket.zero(set_to_none=True)
            e.round.shards_updated = bucket.index + 1
            e.timeline.span("update shard", "update", t0, bucket=bucket.index)
            e.issuer.pump(e.may_start)  # its gather (due first in forward) overlaps the next updates

    def update(self, buckets: List[BucketState], tags_checked: bool) -> None:
        """The optimizer's update of ``buckets``, due at the same moment: each checked, then one call of the
        wrapped optimizer over all of them (:meth:`BucketUpdater.apply_buckets`), then each landed."""
        e = self.engine
        t0 = e.timeline.now()
        if e.sharding is None:  # sharded: updated at step(); the all-gather just completed brought them
            step, chosen = e.round.step, []
            for bucket in buckets:
                if not tags_checked:
                    e.checks.check_tags(bucket, step)
                if bucket.index in e.bound.late_checked and not e.round.scaler_checked:
                    e.checks.nonfinite_bucket(bucket, e.buckets, step)
                include = self.included(bucket)
                if bucket.has_members:
                    bucket.restore_views()  # zero_grad(set_to_none=True) may have come first and set p.grad to None
                    chosen.append((bucket, include))
            if chosen:
                e.updater.apply_buckets(chosen)
        for bucket in buckets:
            self.land(bucket, t0)

    def land(self, bucket: BucketState, t0: float) -> None:
        """The bucket's update is in its parameters: no longer pending; the round ends with the last one."""
        e = self.engine
        bucket.pending = False
        if bucket.zero_after_update is not None:
            bucket.zero(bucket.zero_after_update)
            bucket.zero_after_update = None
        e.timeline.span("update", "update", t0, bucket=bucket.index)
        e.round.updates_left -= 1
        if e.round.updates_left == 0:
            self.finish_round()

    def finish_round(self) -> None:
        e = self.engine
        e.round = None
        e.hooks.guard.disarm()
        if e.on_step_landed is not None:
            e.on_step_landed()
