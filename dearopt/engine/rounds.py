"""Rounds: one step's gradients carried from backward to their updates, moment by moment.

The engine's life cycle speaks to its rounds part through one protocol (the
*moments*): ``begin_backward``, ``grad_ready``, ``end_backward``, ``step``,
``forward_started``, ``module_reached``, ``touched``, ``synchronize``,
``plan_bound``, ``may_replan``, ``close``.  :class:`ExactRounds` carries out the
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
from typing import List

import torch

from dearopt.engine.buckets import BucketState
from dearopt.errors import UsageError
from dearopt.engine.gradients import AveragedGradients
from dearopt.engine.hooks import EngineHook, TrainingState
from dearopt.planning.plan import BACKWARD_END, STEP, forward_of

__all__ = ["ExactRounds"]


class ExactRounds:
    """Carries each step's gradients through the plan's moments (see the module)."""

    reuses_buckets = True
    """A re-plan keeps the buckets the new plan lays out alike, with their gradients."""
    every_module = False
    """The forward gates reach each bucket's moment; no Python hook runs before every module."""

    def __init__(self, engine):
        self.engine = engine
        self.gradients: AveragedGradients = None  # the gradients part it makes (gradients_part)
        self.stale: set = set()  # buckets whose update was still pending as this backward began
        self.backward_start = 0.0  # the timeline's clock as this backward began

    def gradients_part(self, *parts, **named) -> AveragedGradients:
        """Make the part that holds the averaged gradients between ``backward()`` and ``step()``, given what it
        reads (:class:`AveragedGradients`' arguments)."""
        self.gradients = AveragedGradients(*parts, **named)
        return self.gradients

    # -------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        e = self.engine
        if e.life.state is TrainingState.REDUCING:  # names the DistOptim that communicated (several on one model)
            from dearopt.collectives import second_backward_refusal

            raise second_backward_refusal(e)
        e.life.begin_pass()
        # Buckets still waiting for their update were not reached by this
        # forward: apply them now (their parameters cannot have gradients
        # unless they were read before their own module ran).
        self.stale = {b.index for b in e.buckets if b.pending}
        if self.stale:
            e.synchronize()
        self.gradients.reconcile()
        self.backward_start = e.timeline.now()
        torch.autograd.Variable._execution_engine.queue_callback(EngineHook(self.end_backward))
        e.hook_new_params()
        sending = e.life.in_backward()
        e.planner.watch_link(e.life.step_count)
        if e.planner.groups_key() != e.bound.inputs.groups:
            # a parameter was unfrozen or frozen, or a group added: re-plan, and forget what was derived from the
            # old set (the profile, Prophet's blocks, the measured choice); the same on every rank
            e.planner.forget_derived(e.life.step_count, keep_rule=self.gradients.reads)
            e.replan(_inside_backward=True)
        elif e.planner.profile_changes_plan(e.plan):  # rank 0's profile changes it (the same on every rank)
            e.replan(_inside_backward=True)
        if sending:
            e.life.open_round()
            for b in e.buckets:
                b.start_round()
            e.issuer.start_round(e.life.step_count, e.life.forwards)
            e.profile.begin_backward(e.life.step_count, len(e.plan.params))
        # C++ counts each bucket's gradients and Python runs once per bucket; the steps that time each gradient for
        # the profile have C++ note the arrival times too (or, without the extension, see every gradient in Python)
        recording = e.profile.recording
        e.hooks.gradients.per_param(recording and not e.hooks.gradients.timed(recording))

    def show_predicted_sends(self) -> None:
        """Under a schedule whose buckets come from the profile (Prophet's blocks), each bucket's reduction as the
        link model predicted it, placed in the timeline from this backward's start (the measured ones are on
        the communication lane)."""
        e = self.engine
        policy = e.options.policy
        measured = e.profile.result
        times = policy.predicted_sends(e.plan, measured) if measured is not None and e.plan else None
        for bucket, (start, end) in zip(e.plan.buckets if times else (), times or ()):
            e.timeline.span_at(
                f"predicted {policy.reduction}",
                "predicted",
                self.backward_start + start * 1e6,
                (end - start) * 1e6,
                bucket=bucket.index,
            )

    def grad_ready(self, p) -> None:
        e = self.engine
        located = e.locate(p)
        if located is None:
            return
        bucket, j = located
        if bucket.index in self.stale:
            self._refuse_stale(bucket, j)
        bucket.take_gradient(p, j)
        if e.life.round is None or bucket.stamp[j] == e.life.pass_id:
            return
        bucket.stamp[j] = e.life.pass_id
        bucket.ready += 1
        if e.profile.recording:
            e.profile.grad_ready(bucket.spec.params[j])
            e.issuer.observe()
        if bucket.complete or e.window.credit is not None:
            # with a credit window, an op held back for credit may start at any gradient hook once
            # earlier ops have finished, not only when the next bucket completes
            e.issuer.start_ready(e.life.round)

    def bucket_ready(self, b: int) -> None:
        """Every gradient of bucket ``b`` accumulated in this pass (counted in C++; each one moved into its view)."""
        e = self.engine
        bucket = e.buckets[b]
        if b in self.stale:
            self._refuse_stale(bucket, 0)
        bucket.take_counted()
        if e.life.round is None:
            return
        bucket.ready = len(bucket.params)
        if e.profile.recording:
            e.issuer.observe()
        e.issuer.start_ready(e.life.round)
        e.issuer.reap()  # finished ones give their buffers back for the next

    @staticmethod
    def _refuse_stale(bucket: BucketState, j: int) -> None:
        raise UsageError(
            f"parameter {bucket.names[j]!r} received a gradient although its pending update was not applied "
            f"before it was used: it was read in forward before its own module ran. Use schedule='wfbp', "
            f"or call optimizer.synchronize() before such a forward"
        )

    def end_backward(self) -> None:
        e = self.engine
        e.hooks.gradients.expect_backward()
        if e.hooks.gradients.counting:  # the buckets that did not complete: the gradients C++ counted in them
            for bucket in e.buckets:
                if bucket.ready < len(bucket.params):
                    counted = e.hooks.gradients.counted(bucket.index)
                    if bucket.index in self.stale and any(counted):
                        self._refuse_stale(bucket, counted.index(1))
                    bucket.take_counted(counted)
        e.timeline.span("backward", "compute", self.backward_start)
        if e.timeline.enabled:
            self.show_predicted_sends()
        if not e.life.backward_ended():
            return
        for b in e.buckets:  # unused since zero_grad(): a zero gradient (or the bucket would send a stale one)
            b.clear_stale()
        if e.profile.recording:
            if e.hooks.gradients.counting:  # the arrival times C++ noted
                e.profile.arrived(e.hooks.gradients.arrivals())
            e.profile.end_backward()
            e.issuer.observe()
        e.complete_due(BACKWARD_END)
        self.gradients.combine(BACKWARD_END)
        e.life.round.backward_done = True
        e.issuer.start_ready(e.life.round)
        if e.bound.grad_params:  # p.grad does not hold the average yet: reading it must finish the reductions
            e.hooks.grad_guard.arm(e.bound.grad_views, e.bound.grad_params)

    def step(self, skip: bool = False, scaler_checked: bool = False) -> None:
        """Complete the step's reductions, check, and apply (or schedule) the updates.

        ``skip``: a GradScaler found non-finite gradients (the same on every
        rank); ``scaler_checked``: a GradScaler checked the gradients, so the
        ``nonfinite`` policy does not apply to this step.
        """
        e = self.engine
        e.hooks.grad_guard.disarm()
        if e.options.debug and e.bound is not None:
            e.checks.parameters(e.buckets, e.life.step_count)
        e.require_gradients("step")
        r, g, bound = e.life.round, self.gradients, e.bound
        if r.gathered:  # p.grad held the average since user code read it: what it holds now is the gradient
            g.take_user_gradients()
        else:
            g.check_writes()
        g.gathered_steps = g.gathered_steps + 1 if r.gathered else 0
        r.scaler_checked = scaler_checked
        t0 = e.timeline.now()
        e.complete_due(STEP)
        g.combine(STEP)
        r.stepped = True
        regions = [op.piece.region(op.spec.result) for op in bound.checked_at_step]
        judge = not scaler_checked and e.options.nonfinite != "ignore"
        agreed = self.share_meta(r.step, judge and g.local_nonfinite()) if e.sharding is not None else None
        # the step tags and this rank's non-finite count in one read from the device
        count = g.nonfinite_count() if judge and agreed is None else None
        tagged = range(len(e.buckets)) if e.sharding is not None else bound.updates_at.get(STEP, ())
        count = e.checks.check_tags_of([e.buckets[b] for b in tagged], r.step, extra=count)
        if judge:
            sharded = any(op.spec.result == "shard" for op in bound.checked_at_step)
            skip = e.checks.nonfinite(
                regions,
                sharded,
                e.buckets,
                r.step,
                own=bound.own_gradient_buckets,
                agreed=agreed,
                local=None if agreed is not None else bool(count),
            )
        if e.profile.recording:
            e.profile.share(e.control, e.issuer.reduction_services(), r.step)
        e.life.stepped(skip)
        if skip:  # the same decision on every rank: finish what was started, apply nothing
            e.issuer.complete_started()
            self.finish_round()
            return
        for b in e.buckets:
            b.pending = True
        r.updates_left = len(e.buckets)
        e.updater.begin_step(sum(1 for b in e.buckets if b.has_members))
        if e.sharding is not None:
            self.update_shards()
        self.update([e.buckets[b] for b in bound.updates_at.get(STEP, ())], tags_checked=True)
        if e.life.round is not None:
            e.issuer.start_ready(e.life.round)  # the ops that start at step()
            e.hooks.guard.arm((p, b.index) for b in e.buckets if b.pending for p in b.params)
            e.hooks.gates.arm(e.life.round.forward_reached)  # the next forward reaches each bucket's moment
        e.timeline.span("step", "update", t0)

    def plan_bound(self) -> None:
        """A new bound plan is in force (nothing of the exact rounds depends on the old one)."""

    # ------------------------------------------------ the moments protocol
    def forward_started(self) -> None:
        """A training forward began (nothing to do: the updates wait for their buckets' modules)."""

    def reach_bucket(self, bucket: int) -> None:
        """The forward gate: a module of ``bucket`` is about to run: the moments of the buckets up to it."""
        r = self.engine.life.round
        if r is not None and r.stepped and bucket > r.forward_reached:
            self.reach_forward(bucket)

    def touched(self, bucket: int) -> None:
        """User code touched a parameter of ``bucket`` after ``step()``: its pending updates first."""
        r = self.engine.life.round
        if r is not None and r.stepped:
            self.reach_forward(bucket)

    def synchronize(self) -> None:
        """Apply every pending update now."""
        r = self.engine.life.round
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
        while e.life.round is not None and e.life.round.forward_reached < target:
            k = e.life.round.forward_reached + 1
            point = forward_of(k)
            t0 = time.perf_counter()
            e.complete_due(point)
            e.profile.forward_waited(time.perf_counter() - t0)
            e.life.round.forward_reached = k
            e.hooks.gates.reached = k
            e.issuer.start_ready(e.life.round)  # e.g. prefetch the next bucket's all-gather
            due = e.bound.updates_at.get(point, ())
            if due:
                self.update([e.buckets[b] for b in due], tags_checked=False)

    def share_meta(self, step: int, nonfinite: bool) -> bool:
        """Sharded update: every bucket's used flags and step tags summed over ranks on the control channel, with
        this rank's non-finite answer (``nonfinite``); returns whether any rank found inf/NaN.  The
        reduce-scatter leaves the flags' and tags' sum only on the rank whose shard holds the bucket's tail, and
        the all-gather carries parameters, so without this message no other rank would learn them; the
        non-finite check rides along instead of taking a message of its own.  What each rank adds is what it
        wrote into its buffers' tails before the reduce-scatter (its used flags and its step tag, known on the
        host): the reduce-scatter wrote its sums into the same buffers since (the shard is the buffer's own
        region)."""
        e = self.engine
        if e.world == 1:
            return nonfinite
        values = [1.0 if nonfinite else 0.0]
        for b in e.buckets:
            values += [1.0 if u else 0.0 for u in b.used]
            values += [float(b.meta_tag) if r == e.rank else 0.0 for r in range(e.world)]
        meta = torch.tensor(values, dtype=torch.float64, device=e.control.device)
        e.control.all_reduce(meta, "sum", step=step).wait()
        meta = meta.to(e.buckets[0].buffer.device)
        found = float(meta[0]) > 0
        offset = 1
        for b in e.buckets:
            n = len(b.params)
            b.flags.copy_(meta[offset : offset + n])
            b.tags.copy_(meta[offset + n : offset + n + e.world])
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
            e.life.round.shards_updated = bucket.index + 1
            e.timeline.span("update shard", "update", t0, bucket=bucket.index)
            e.issuer.start_ready(e.life.round)  # its gather (due first in forward) overlaps the next updates

    def update(self, buckets: List[BucketState], tags_checked: bool) -> None:
        """The optimizer's update of ``buckets``, due at the same moment: each checked, then one call of the
        wrapped optimizer over all of them (:meth:`BucketUpdater.apply_buckets`), then each landed."""
        e = self.engine
        t0 = e.timeline.now()
        e.hooks.guard.release(p for b in buckets for p in b.params)  # current from here on
        if e.sharding is None:  # sharded: updated at step(); the all-gather just completed brought them
            step, chosen = e.life.round.step, []
            for bucket in buckets:
                if not tags_checked:
                    e.checks.check_tags(bucket, step)
                if bucket.index in e.bound.late_checked and not e.life.round.scaler_checked:
                    e.checks.nonfinite_bucket(bucket, e.buckets, step)
                include = self.included(bucket)
                if bucket.has_members:
                    bucket.restore_views()  # zero_grad(set_to_none=True) may have come first and set p.grad to None
                    chosen.append((bucket, include))
            if chosen:
                e.updater.apply_buckets(chosen)
        for bucket in buckets:
            self.updated(bucket, t0)

    def updated(self, bucket: BucketState, t0: float) -> None:
        """The bucket's update is in its parameters: no longer pending; the round ends with the last one."""
        e = self.engine
        bucket.pending = False
        if bucket.zero_after_update is not None:
            bucket.zero(bucket.zero_after_update)
            bucket.zero_after_update = None
        e.timeline.span("update", "update", t0, bucket=bucket.index)
        e.life.round.updates_left -= 1
        if e.life.round.updates_left == 0:
            self.finish_round()

    def finish_round(self) -> None:
        e = self.engine
        e.life.close_round()
        e.hooks.guard.disarm()
        e.hooks.gates.disarm()
        if e.on_step_landed is not None:
            e.on_step_landed()
