"""Rounds: one step's gradients carried from backward to their updates, moment by moment.

The engine's life cycle speaks to its rounds part through one protocol (the
*moments*): ``begin_backward``, ``grad_ready``, ``end_backward``, ``step``,
``forward_started``, ``module_reached``, ``touched``, ``synchronize``,
``plan_bound``, ``record_loss``, ``may_replan``, ``close``.  :class:`ExactRounds` carries out the
plan's moments for every exact schedule: backward counts each bucket's ready
gradients and the issuer starts the ops whose moment has come; ``step()``
completes the ops due there, checks, and applies the buckets due there (all
of them under a sharded update, each rank its shard); as the next forward
reaches each bucket (or user code touches its parameters), the ops due there
complete and its update is applied; the round ends with the last one.
:class:`dearopt.schedules.deft.rounds.DelayedRounds` carries out ``deft``'s groups that cross
iterations through the same protocol, issuer and buckets.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import torch

from dearopt.backends.base import CollectiveBackend
from dearopt.engine.bound_plan import BoundPlan
from dearopt.engine.buckets import BucketState, read_tails
from dearopt.engine.checks import Checks
from dearopt.engine.gradients import AveragedGradients
from dearopt.engine.hooks import EngineHook, EngineHooks, LifeCycle
from dearopt.engine.issuer import CreditWindow, Issuer
from dearopt.engine.sharding import ShardedUpdate
from dearopt.engine.timeline import Timeline
from dearopt.engine.updates import BucketUpdater
from dearopt.errors import UsageError
from dearopt.planning.plan import BACKWARD_END, STEP, Point, forward_of
from dearopt.planning.profile import ReadyProfile

__all__ = ["ExactRounds"]


class ExactRounds:
    """Carries each step's gradients through the plan's moments (see the module)."""

    reuses_buckets = True
    """A re-plan keeps the buckets the new plan lays out alike, with their gradients."""
    every_module = False
    """The forward gates reach each bucket's moment; no Python hook runs before every module."""

    replans_in_backward = True
    """A backward that finds the trainable set or the profile changed re-plans (the engine does, as it begins)."""

    def __init__(
        self,
        life: LifeCycle,
        hooks: EngineHooks,
        profile: ReadyProfile,
        timeline: Timeline,
        checks: Checks,
        control: CollectiveBackend,
        updater: BucketUpdater,
        options,
        *,
        sharding: Optional[ShardedUpdate] = None,
    ):
        self.life = life  # the engine's life cycle: read, and moved through its transitions only
        self.hooks = hooks  # the gradient hooks, the guards and the forward gates it arms and disarms
        self.profile, self.timeline, self.checks, self.control = profile, timeline, checks, control
        self.updater, self.sharding = updater, sharding
        self.options = options  # the engine's Options (set again where DistOptim replaces them)
        self.window: Optional[CreditWindow] = None  # the plan's credit window (an op held back for credit may start
        # at any gradient hook)
        self.rank, self.world = control.rank, control.size
        self.gradients: Optional[AveragedGradients] = None  # the gradients part it makes (gradients_part)
        self.bound: Optional[BoundPlan] = None  # the plan in force and its issuer (plan_bound)
        self.issuer: Optional[Issuer] = None
        self.buckets: Tuple[BucketState, ...] = ()
        self.stale: set = set()  # buckets whose update was still pending as this backward began
        self.backward_start = 0.0  # the timeline's clock as this backward began

    step_count = property(lambda self: self.life.step_count, doc="Steps taken (named in its errors).")

    def gradients_part(self, *parts, **named) -> AveragedGradients:
        """Make the part that holds the averaged gradients between ``backward()`` and ``step()``, given what it
        reads (:class:`AveragedGradients`' arguments)."""
        self.gradients = AveragedGradients(*parts, **named)
        return self.gradients

    # -------------------------------------------------------------- backward
    def second_backward_refusal(self) -> Optional[UsageError]:
        """The error for a backward after this step's gradients were sent, or None for the engine's own (which
        names the ``DistOptim`` that communicated)."""
        return None

    def begin_backward(self) -> None:
        """A backward pass begins (the engine moved the life cycle to a new pass): buckets still waiting for
        their update were not reached by this forward: applied now (their parameters cannot have gradients unless
        they were read before their own module ran); what user code did to ``p.grad`` taken in; the backward's
        end queued."""
        self.stale = {b.index for b in self.buckets if b.pending}
        if self.stale:
            self.synchronize()
            self.timeline.flush()
        self.gradients.reconcile()
        self.backward_start = self.timeline.now()
        torch.autograd.Variable._execution_engine.queue_callback(EngineHook(self.end_backward))

    def backward_begun(self, sending: bool) -> None:
        """The backward pass is under way with the plan now in force; ``sending``: its gradients are sent (a
        round opens)."""
        life, profile = self.life, self.profile
        if sending:
            life.open_round()
            for b in self.buckets:
                b.start_round()
            self.issuer.start_round(life.step_count, life.forwards)
            profile.begin_backward(life.step_count, len(self.bound.plan.params))
        # C++ counts each bucket's gradients and Python runs once per bucket; the steps that time each gradient for
        # the profile have C++ note the arrival times too (or, without the extension, see every gradient in Python)
        recording = profile.recording
        gradients = self.hooks.gradients
        gradients.per_param(recording and not gradients.timed(recording))

    def show_predicted_sends(self) -> None:
        """Under a schedule whose buckets come from the profile (Prophet's blocks), each bucket's reduction as the
        link model predicted it, placed in the timeline from this backward's start (the measured ones are on
        the communication lane)."""
        policy = self.options.policy
        measured = self.profile.result
        times = policy.predicted_sends(self.bound.plan, measured) if measured is not None and self.bound.plan else None
        for bucket, (start, end) in zip(self.bound.plan.buckets if times else (), times or ()):
            self.timeline.span_at(
                f"predicted {policy.reduction}",
                "predicted",
                self.backward_start + start * 1e6,
                (end - start) * 1e6,
                bucket=bucket.index,
            )

    def grad_ready(self, p) -> None:
        located = self.bound.where.get(id(p))
        if located is None:
            return
        bucket, j = located
        if bucket.index in self.stale:
            self._refuse_stale(bucket, j)
        bucket.take_gradient(p, j)
        if self.life.round is None or bucket.stamp[j] == self.life.pass_id:
            return
        bucket.stamp[j] = self.life.pass_id
        bucket.ready += 1
        if self.profile.recording:
            self.profile.grad_ready(bucket.spec.params[j])
            self.issuer.observe()
        if bucket.complete or self.window.credit is not None:
            # with a credit window, an op held back for credit may start at any gradient hook once
            # earlier ops have finished, not only when the next bucket completes
            self.issuer.start_ready(self.life.round)

    def bucket_ready(self, b: int) -> None:
        """Every gradient of bucket ``b`` accumulated in this pass (counted in C++; each one moved into its view)."""
        bucket = self.buckets[b]
        if b in self.stale:
            self._refuse_stale(bucket, 0)
        bucket.take_counted()
        if self.life.round is None:
            return
        bucket.ready = len(bucket.params)
        if self.profile.recording:
            self.issuer.observe()
        self.issuer.start_ready(self.life.round)
        self.issuer.reap()  # finished ones give their buffers back for the next

    @staticmethod
    def _refuse_stale(bucket: BucketState, j: int) -> None:
        raise UsageError(
            f"parameter {bucket.names[j]!r} received a gradient although its pending update was not applied "
            f"before it was used: it was read in forward before its own module ran. Use schedule='wfbp', "
            f"or call optimizer.synchronize() before such a forward"
        )

    def end_backward(self) -> None:
        self.hooks.gradients.expect_backward()
        if self.hooks.gradients.counting:  # the buckets that did not complete: the gradients C++ counted in them
            for bucket in self.buckets:
                if bucket.ready < len(bucket.params):
                    counted = self.hooks.gradients.counted(bucket.index)
                    if bucket.index in self.stale and any(counted):
                        self._refuse_stale(bucket, counted.index(1))
                    bucket.take_counted(counted)
        self.timeline.span("backward", "compute", self.backward_start)
        if self.timeline.enabled:
            self.show_predicted_sends()
        if not self.life.backward_ended():
            return
        for b in self.buckets:  # unused since zero_grad(): a zero gradient (or the bucket would send a stale one)
            b.clear_stale()
        if self.profile.recording:
            if self.hooks.gradients.counting:  # the arrival times C++ noted
                self.profile.arrived(self.hooks.gradients.arrivals())
            self.profile.end_backward()
            self.issuer.observe()
        self.complete_due(BACKWARD_END)
        self.gradients.combine(BACKWARD_END)
        self.life.round.backward_done = True
        self.issuer.start_ready(self.life.round)
        if self.bound.grad_params:  # p.grad does not hold the average yet: reading it must finish the reductions
            self.hooks.grad_guard.arm(self.bound.grad_views, self.bound.grad_params)

    def step(self, skip: bool = False, scaler_checked: bool = False) -> None:
        """Complete the step's reductions, check, and apply (or schedule) the updates.

        ``skip``: a GradScaler found non-finite gradients (the same on every
        rank); ``scaler_checked``: a GradScaler checked the gradients, so the
        ``nonfinite`` policy does not apply to this step.
        """
        self.hooks.grad_guard.disarm()
        if self.options.debug and self.bound is not None:
            self.checks.parameters(self.buckets, self.life.step_count)
        self.life.require_gradients("step")
        r, g, bound = self.life.round, self.gradients, self.bound
        if r.gathered:  # p.grad held the average since user code read it: what it holds now is the gradient
            g.take_user_gradients()
        else:
            g.check_writes()
        g.gathered_steps = g.gathered_steps + 1 if r.gathered else 0
        r.scaler_checked = scaler_checked
        t0 = self.timeline.now()
        self.complete_due(STEP)
        g.combine(STEP)
        r.stepped = True
        regions = [op.piece.region(op.spec.result) for op in bound.checked_at_step]
        judge = not scaler_checked and self.options.nonfinite != "ignore"
        agreed = self.share_meta(r.step, judge and g.local_nonfinite()) if self.sharding is not None else None
        # the step tags and this rank's non-finite count in one read from the device
        count = g.nonfinite_count() if judge and agreed is None else None
        tagged = range(len(self.buckets)) if self.sharding is not None else bound.updates_at.get(STEP, ())
        count = read_tails([self.buckets[b] for b in tagged], r.step, check=self.options.check_agreement, extra=count)
        if judge:
            sharded = any(op.spec.result == "shard" for op in bound.checked_at_step)
            skip = g.verdict.judge(
                self.options.nonfinite,
                regions,
                sharded,
                self.buckets,
                r.step,
                own=bound.own_gradient_buckets,
                agreed=agreed,
                local=None if agreed is not None else bool(count),
            )
        if self.profile.recording:
            self.profile.share(self.control, self.issuer.reduction_services(), r.step)
        self.life.stepped(skip)
        if skip:  # the same decision on every rank: finish what was started, apply nothing
            self.issuer.complete_started()
            self.finish_round()
            return
        for b in self.buckets:
            b.pending = True
        r.updates_left = len(self.buckets)
        self.updater.begin_step(sum(1 for b in self.buckets if b.has_members))
        if self.sharding is not None:
            self.update_shards()
        self.update([self.buckets[b] for b in bound.updates_at.get(STEP, ())], tags_checked=True)
        if self.life.round is not None:
            self.issuer.start_ready(self.life.round)  # the ops that start at step()
            self.hooks.guard.arm((p, b.index) for b in self.buckets if b.pending for p in b.params)
            self.hooks.gates.arm(self.life.round.forward_reached)  # the next forward reaches each bucket's moment
        self.timeline.span("step", "update", t0)

    def plan_bound(self, bound: BoundPlan, issuer: Issuer) -> BoundPlan:
        """A new bound plan is in force, with the issuer of its ops (nothing of the exact rounds depends on the
        old one); returns it as these rounds carry it out (as it is)."""
        self.bound, self.issuer, self.buckets, self.window = bound, issuer, bound.buckets, issuer.window
        return bound

    def complete_due(self, point: Point) -> None:
        """Start, wait for and complete the ops due at ``point`` (before the moment is marked as reached)."""
        self.issuer.force_and_complete(self.bound.due.get(point, ()), self.life.round, host=self.profile.recording)

    # ------------------------------------------------ the moments protocol
    def forward_started(self) -> None:
        """A training forward began (nothing to do: the updates wait for their buckets' modules)."""

    def reach_bucket(self, bucket: int) -> None:
        """The forward gate: a module of ``bucket`` is about to run: the moments of the buckets up to it."""
        r = self.life.round
        if r is not None and r.stepped and bucket > r.forward_reached:
            self.reach_forward(bucket)

    def touched(self, bucket: int) -> None:
        """User code touched a parameter of ``bucket`` after ``step()``: its pending updates first."""
        r = self.life.round
        if r is not None and r.stepped:
            self.reach_forward(bucket)

    def synchronize(self) -> None:
        """Apply every pending update now."""
        r = self.life.round
        if r is not None and r.stepped:
            self.reach_forward(len(self.buckets) - 1)

    def record_loss(self, loss) -> None:
        """``step(loss)``: nothing measures the loss of an exact round."""

    def may_replan(self) -> None:
        """A re-plan is about to happen (every update of an exact round lands by the next forward: allowed)."""

    def close(self) -> None:
        """Nothing of its own to release."""

    # ------------------------------------------------------------ the round

    def reach_forward(self, target: int) -> None:
        """The forward reached bucket ``target``: carry out every bucket's forward moment up to it, in order."""
        while self.life.round is not None and self.life.round.forward_reached < target:
            k = self.life.round.forward_reached + 1
            point = forward_of(k)
            t0 = time.perf_counter()
            self.complete_due(point)
            self.profile.forward_waited(time.perf_counter() - t0)
            self.life.round.forward_reached = k
            self.hooks.gates.reached = k
            self.issuer.start_ready(self.life.round)  # e.g. prefetch the next bucket's all-gather
            due = self.bound.updates_at.get(point, ())
            if due:
                self.update([self.buckets[b] for b in due], tags_checked=False)

    def share_meta(self, step: int, nonfinite: bool) -> bool:
        """Sharded update: every bucket's used flags and step tags summed over ranks on the control channel, with
        this rank's non-finite answer (``nonfinite``); returns whether any rank found inf/NaN.  The
        reduce-scatter leaves the flags' and tags' sum only on the rank whose shard holds the bucket's tail, and
        the all-gather carries parameters, so without this message no other rank would learn them; the
        non-finite check rides along instead of taking a message of its own.  What each rank adds is what it
        wrote into its buffers' tails before the reduce-scatter (its used flags and its step tag, known on the
        host): the reduce-scatter wrote its sums into the same buffers since (the shard is the buffer's own
        region)."""
        if self.world == 1:
            return nonfinite
        values = [1.0 if nonfinite else 0.0]
        for b in self.buckets:
            values += [1.0 if u else 0.0 for u in b.used]
            values += [float(b.meta_tag) if r == self.rank else 0.0 for r in range(self.world)]
        meta = torch.tensor(values, dtype=torch.float64, device=self.control.device)
        self.control.all_reduce(meta, "sum", step=step).wait()
        meta = meta.to(self.buckets[0].buffer.device)
        found = float(meta[0]) > 0
        offset = 1
        for b in self.buckets:
            n = len(b.params)
            b.flags.copy_(meta[offset : offset + n])
            b.tags.copy_(meta[offset + n : offset + n + self.world])
            offset += n + self.world
            b.mark_seen()
        return found

    def included(self, bucket: BucketState) -> List[bool]:
        """Which parameters of the bucket the update includes: those some rank produced a gradient for, and
        those unused on every rank that keep the gradient they had (none after ``zero_grad(set_to_none=True)``,
        so the optimizer skips them, else their last one)."""
        used = bucket.used_anywhere()
        for owner, j, twin, k, _ in self.bound.combines:  # a tied weight is used where its twin was
            if owner is bucket:
                used[j] = used[j] or twin.used_anywhere()[k]
        include = [u or had for u, had in zip(used, bucket.has_grad)]
        bucket.has_grad = include
        return include

    def update_shards(self) -> None:
        """Sharded update, at ``step()``: each bucket's optimizer update on this rank's shard, in bucket order; the
        all-gathers that start from here on carry the updated parameters.  The whole averaged gradient exists on
        no rank, so every ``p.grad`` becomes None (as after ``zero_grad(set_to_none=True)``)."""
        self.sharding.prepare(self.buckets, self.bound.plan.fingerprint())
        for bucket in self.buckets:
            t0 = self.timeline.now()
            include = self.included(bucket)
            if bucket.has_members:
                self.sharding.apply(bucket, include, self.updater)
            bucket.zero(set_to_none=True)
            self.life.round.shards_updated = bucket.index + 1
            self.timeline.span("update shard", "update", t0, bucket=bucket.index)
            self.issuer.start_ready(self.life.round)  # its gather (due first in forward) overlaps the next updates

    def update(self, buckets: List[BucketState], tags_checked: bool) -> None:
        """The optimizer's update of ``buckets``, due at the same moment: each checked, then one call of the
        wrapped optimizer over all of them (:meth:`BucketUpdater.apply_buckets`), then each landed."""
        t0 = self.timeline.now()
        self.hooks.guard.release(p for b in buckets for p in b.params)  # current from here on
        if self.sharding is None:  # sharded: updated at step(); the all-gather just completed brought them
            step, chosen = self.life.round.step, []
            for bucket in buckets:
                if not tags_checked:
                    read_tails([bucket], step, check=self.options.check_agreement)
                if bucket.index in self.bound.late_checked and not self.life.round.scaler_checked:
                    self.gradients.verdict.bucket(self.options.nonfinite, bucket, self.buckets, step)
                include = self.included(bucket)
                if bucket.has_members:
                    bucket.restore_views()  # zero_grad(set_to_none=True) may have come first and set p.grad to None
                    chosen.append((bucket, include))
            if chosen:
                self.updater.apply_buckets(chosen)
        for bucket in buckets:
            self.updated(bucket, t0)

    def updated(self, bucket: BucketState, t0: float) -> None:
        """The bucket's update is in its parameters: no longer pending; the round ends with the last one."""
        bucket.pending = False
        if bucket.zero_after_update is not None:
            bucket.zero(bucket.zero_after_update)
            bucket.zero_after_update = None
        self.timeline.span("update", "update", t0, bucket=bucket.index)
        self.life.round.updates_left -= 1
        if self.life.round.updates_left == 0:
            self.finish_round()

    def finish_round(self) -> None:
        self.life.close_round()
        self.hooks.guard.disarm()
        self.hooks.gates.disarm()
        self.life.step_landed()
