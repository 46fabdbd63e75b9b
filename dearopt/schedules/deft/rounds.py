"""The executor of delayed, merged updates (``schedule="deft"``): a group of gradients travels across iterations.

Every other schedule finishes a step's communication by the next forward and
is exact.  DeFT (Meng and Sun) lets a step's gradients (a *group*) be sent in
later iterations' forward and backward stages, and applies the group as one
update once its last bucket is reduced; meanwhile training goes on with the
parameters from before it, and gradients computed while a group is still in
flight are held on each rank and summed, so the next group covers several
iterations.  What is sent when is a :class:`~dearopt.schedules.deft.schedule.DeftSchedule`
(:func:`~dearopt.schedules.deft.schedule.deft_schedule` solves it from per-bucket
times; or it is given), the same on every rank, so collectives stay matched by
order.  The times come from a given :class:`dearopt.sim.Profile`, or the job
measures them in its first :data:`MEASURED_STEPS` steps, which are exact.

**What it computes** (tested against a single-process emulation): at step
``t`` the gradient of the global batch ``g_t`` (at the parameters current at
``t``) either starts a new group (summed with the held ones) or is held.  Each
bucket of a group is applied with ``p.grad`` set to the group's average,
``sum(g_i) / k`` over its ``k`` iterations: with ``DeFT(apply="bucket")`` (the
default) at the ``step()`` that ends the iteration that sent its last piece
(carried out lazily, before its module's next forward or when user code
touches its parameters, as ``dear`` does), so the buckets the schedule sends in
their own backward are applied at once and only those it sends later are
late; with ``DeFT(apply="group")`` (the paper's Algorithm 2) all of them at once,
at the ``step()`` the schedule applies the group.  Between ``backward()`` and
``step()`` ``p.grad`` holds this rank's own gradient of this step; after
``step()`` it holds it again.

**The Preserver** (:class:`~dearopt.schedules.deft.schedule.Preserver`, on by default
for a solved schedule): the measuring steps also record the loss the user
passes to ``step(loss=...)`` and the drift and noise of an exact update; the
schedule is re-solved with raised capacities until the expected loss after
one period is within ``1 +- epsilon`` of exact training's (the paper's test;
``Preserver(statistic="progress")``: its expected loss decrease at least
``1 - epsilon`` of exact training's) (``DistOptim.deft_preserved``).

**Waits**: ``step()`` waits only for the group it applies (``"group"``) or for
nothing (``"bucket"``: each due bucket waits for its own sends just before its
module's next forward); the sends of the group formed in this backward run on
into the next forward (the link stays busy), and the next backward waits for
them with the forward stage's sends.
Between ``step()`` and the next ``backward()``, ``synchronize()`` (and so
``state_dict()`` and ``close()``) waits for every send in flight.

**Two links** (``DeFT(links=2)``): a second communicator over the same ranks
(:meth:`~dearopt.backends.base.CollectiveBackend.second_link`: gloo beside
NCCL, another gloo group beside gloo) runs concurrently with the first; the
last measuring step also times each bucket alone on it, and ``mu`` (its time
over the first's) turns every knapsack into the paper's Problem 2.  Whether it
helps depends on the links being distinct: two gloo groups on one network
share its bandwidth, which the solver does not model.

**Units**: the solver's items are the plan's pieces of buckets
(:func:`plan_units`): one per bucket, or several where ``partition_size``
splits it, so a parameter larger than the smallest knapsack (BERT's tied
94 MB embedding) can still be scheduled; the measuring steps re-partition
buckets and pieces where one outlasts a stage.  Each unit is summed by one
all-reduce or, where that measured faster (gloo), a reduce-scatter and an
all-gather on a second communicator (:data:`RSAG`).

**Clipping** (``DeFT(apply="group")``; refused by name under ``"bucket"``, where
no step applies one whole average): ``optimizer.clip_grad_norm_`` /
``clip_grad_value_`` between ``backward()`` and ``step()`` clip what that
step's ``step()`` applies: the group's average over every step it covers (as
torch's clipping would clip that average in the single-process emulation); at
a step that applies no group they clip nothing (the norm returned is NaN).

**Accumulation** (``no_sync()``, ``backward_passes_per_step``): the backward
passes before the one that communicates only accumulate into ``p.grad``; the
step of the schedule is that last backward's (its gradient the sum of the
micro-batches', as under DDP), and its forward stage's sends run from the
step's first forward on.  The measuring steps time the forward stage from the
first forward to the communicating backward.

**Status** (issue 16): no comm hook and no loss scaling (``unscale_``,
GradScaler) of a delayed group (refused by name).

**Checkpoints**: ``DistOptim.state_dict()`` carries, besides the wrapped
optimizer's state, the schedule, the step within it and the group sums (the
group in flight: reduced where sent, this rank's own sum where not; the held
sum): this rank's own, so under ``deft`` every rank saves its own checkpoint.
A run resumed from it is bit-identical to one that was not interrupted.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dearopt.errors import NonFiniteGradientError, UsageError
from dearopt.engine.hooks import EngineHook, EngineHooks, LifeCycle, TrainingState
from dearopt.engine.gradients import AveragedGradients
from dearopt.planning.profile import fit_link
from dearopt.schedules.deft.schedule import (
    DeftIteration,
    DeftSchedule,
    Preserved,
    Preserver,
    check_partition,
    deft_schedule,
)

if TYPE_CHECKING:  # (annotations only: DeftParts is given these parts, never imports their modules to run)
    from dearopt.backends.base import CollectiveBackend
    from dearopt.engine.bound_plan import Planner
    from dearopt.engine.timeline import Timeline
    from dearopt.engine.updates import BucketUpdater

__all__ = ["DelayedRounds", "deft_times", "plan_units", "profile_reduction", "MEASURED_STEPS", "ALL_REDUCE", "RSAG"]

ALL_REDUCE = "all_reduce"
RSAG = "reduce_scatter+all_gather"
"""How a unit is summed over ranks: one all-reduce, or a reduce-scatter then an all-gather on a second
communicator (:class:`dearopt.backends.base.ReduceScatterThenGather`; same bytes, faster on gloo here).  The job
measures both for each unit alone while measuring (one link, gloo) and keeps the faster; with a profile, its
fitted costs decide; a given schedule uses the all-reduce."""

MEASURED_STEPS = 3
"""Without a profile or a schedule, the first steps are exact (every bucket all-reduced in backward and applied
at its own step) and measure the job: step 1 the forward and backward times per bucket, step 2 each bucket's
all-reduce alone, one after another (a slower step); rank 0's numbers are shared and every rank solves the same
schedule, which starts at this step."""

REPARTITIONS = 3
"""Where a measured bucket takes longer on the link than a whole stage computes (DeFT's partition constraint),
the job re-plans with smaller buckets, and a parameter larger than them in pieces (``partition_size``), and
measures again, at most this many times, then raises."""

RSAG_MARGIN = 0.10
"""Measured alone, each unit once, the units summed as reduce-scatter + all-gather must take this fraction less
time than as all-reduces for the schedule to use them: the pair needs a helper thread and a shard buffer per unit
while training, and one measurement of each is noisier than that (on a shaped 1 Gbit/s link, BERT-Base's pair
measured faster in 4 of 8 runs although it took 3 to 10 % longer on the whole)."""

GROWTH = 4
"""A re-partition makes at most about this many times as many pieces as the plan had."""


def plan_units(plan) -> List[Tuple[int, int]]:
    """DeFT's items: ``(bucket, piece)`` of ``plan`` in forward order.  A bucket is one item unless
    ``partition_size`` splits it (the paper's partition: a parameter too large for the smallest knapsack is
    sent in pieces, each scheduled on its own)."""
    return [(b.index, k) for b in plan.buckets for k in range(len(b.pieces))]


def unit_times(
    forward_b: Sequence[float], ready_b: Sequence[float], end: float, units: Sequence[Tuple[int, int]]
) -> Tuple[List[float], List[float]]:
    """Per unit: forward seconds (a bucket's to its first piece) and backward seconds (the time from the
    output-side unit before it becoming ready to it becoming ready; the compute after the last, ``end`` minus
    the latest ready time, to unit 0), from per-bucket forward seconds and ready times after backward starts.
    The pieces of one bucket are ready together: the first of them in backward's order carries the wait."""
    n = len(units)
    forward = [0.0] * n
    for u, (b, k) in enumerate(units):
        if k == 0:
            forward[u] = forward_b[b]
    backward, done = [0.0] * n, 0.0
    for u in range(n - 1, -1, -1):  # backward makes the output side first
        ready = ready_b[units[u][0]]
        backward[u] = max(ready - done, 0.0)
        done = max(done, ready)
    backward[0] += max(end - done, 0.0)
    return forward, backward


def deft_times(profile, plan, reduction: str = ALL_REDUCE):
    """Per unit of ``plan`` (:func:`plan_units`): (forward, backward, communication) seconds from a
    :class:`dearopt.sim.Profile`; communication by ``reduction`` (:data:`ALL_REDUCE` or :data:`RSAG`)."""
    if [p.numel for p in profile.params] != [p.numel for p in plan.params]:
        raise UsageError(
            "the profile's parameters are not the plan's: record it with the same model and "
            "optimizer, and embedding_rows=False (deft reduces a tied weight as one gradient)"
        )
    bucket_of = {p: b.index for b in plan.buckets for p in b.params}
    n = len(plan.buckets)
    forward = [0.0] * n
    for positions, seconds in profile.forward_segments:
        owned = [bucket_of[p] for p in positions if p in bucket_of]
        if owned:
            forward[min(owned)] += seconds
    forward[n - 1] += profile.forward_tail
    ready = [max(profile.ready[p] for p in b.params) for b in plan.buckets]
    units = plan_units(plan)
    forward, backward = unit_times(forward, ready, profile.t_bp, units)
    kinds = ("all_reduce",) if reduction == ALL_REDUCE else ("reduce_scatter", "all_gather")
    comm = [
        sum(profile.comm[kind].time(plan.buckets[b].piece_nbytes(k), plan.world_size) for kind in kinds)
        for b, k in units
    ]
    return forward, backward, comm


def profile_reduction(profile, plan) -> str:
    """The faster way to sum a plan's units over ranks by a profile's fitted costs (all-reduce without fits of
    both halves)."""
    if not {"reduce_scatter", "all_gather"} <= set(profile.comm):
        return ALL_REDUCE
    return RSAG if sum(deft_times(profile, plan, RSAG)[2]) < sum(deft_times(profile, plan)[2]) else ALL_REDUCE


class _Group:
    """One group's gradients on this rank: a sum per bucket, reduced in place when sent (``sent``: the units,
    pieces of buckets, sent so far)."""

    def __init__(self, storage: Dict[int, torch.Tensor], covers: int):
        self.storage = storage
        self.covers = covers
        self.sent: set = set()
        self.handles: List = []
        self.unit_handles: Dict[int, object] = {}  # unit -> its send's handle (per-bucket application waits on it)
        self.due: set = set()  # the buckets whose sums were handed to per-bucket application (all units sent)
        self.serial = 0  # which of two reduce-scatter outputs per unit its sends use (consecutive groups differ)


class DelayedGradients(AveragedGradients):
    """``deft``'s gradients between ``backward()`` and ``step()``: a step's gradients were taken into a group as
    backward made them, so ``p.grad`` may not change; clipping acts on the group the step applies; unscaling and
    reducing now are refused by name."""

    def __init__(self, *parts, applied: Callable[[], tuple], **named):
        super().__init__(*parts, **named)
        self.applied = applied  # the group this step applies and the factor that makes its sums the average

    def check_writes(self) -> None:
        """The step's gradients were copied into the group (or the held sum) as backward made them: a change of
        ``p.grad`` after that would be lost, on any number of ranks."""
        for b in self.bound.buckets:
            replaced = b.replaced_gradients()
            if replaced or b.written_by_others():
                what = replaced[:3] or b.names[:3]
                raise UsageError(
                    f"the gradients of {what} were changed between backward() and step(); under "
                    f"schedule='deft' they were already taken into a delayed group, so the change "
                    f"would be lost (to clip, call optimizer.clip_grad_norm_(...) or "
                    f"clip_grad_value_(...): they clip the group the step applies) "
                    f"[rank {self.rank}, step {self.life.step_count}]"
                )

    def _applied_now(self) -> tuple:
        """The group this step's ``step()`` applies (waited for: its sums are complete) and the factor that makes
        its sums the average, or ``(None, 0.0)`` at a step that applies none (:meth:`DelayedRounds.applied_now`)."""
        self.life.require_gradients("clip the gradients")
        return self.applied()

    def _sum_regions(self, group: _Group) -> List[torch.Tensor]:
        return [group.storage[b.index][: b.spec.grad_numel] for b in self.bound.buckets]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the average this step applies (the group's, over every step it covers) by its global norm, as
        ``torch.nn.utils.clip_grad_norm_`` would clip that average; returns its norm before clipping, or NaN at
        a step that applies no group (nothing to clip: its gradients are held or in flight)."""
        group, scale = self._applied_now()
        if group is None:
            return torch.tensor(float("nan"))
        norm_type = float(norm_type)
        regions = self._sum_regions(group)
        norms = torch.stack([torch.linalg.vector_norm(r.double(), norm_type) for r in regions])
        total = torch.linalg.vector_norm(norms, norm_type) * scale
        coef = min(float(max_norm) / (float(total) + 1e-6), 1.0)
        if coef < 1.0:
            for region in regions:
                region.mul_(coef)
        return total.float().cpu()

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the average this step applies to ``[-clip_value, clip_value]`` (nothing at a step that applies no
        group)."""
        group, scale = self._applied_now()
        if group is not None:
            bound = float(clip_value) / scale  # on the sums: the average is sum * scale
            for region in self._sum_regions(group):
                region.clamp_(-bound, bound)

    # ------------------------------------------------------ refused tools
    def finish_averaging(self):
        raise UsageError(
            "under schedule='deft' a step's gradients are averaged as part of a group applied at a "
            "later step, over the steps it covers: unscaling them (optimizer.unscale_, GradScaler) "
            "and reduce_gradients() are not supported; optimizer.clip_grad_norm_/clip_grad_value_ "
            "clip the group a step applies"
        )

    def reduce(self) -> None:
        self.finish_averaging()


class DeftMeasurement:
    """``deft``'s measuring steps and solver: without a given schedule the first :data:`MEASURED_STEPS` steps
    are exact and measure the job (compute per bucket, each piece's reduction alone, the loss and the update's
    drift and noise for the Preserver); rank 0's numbers are shared, every rank solves the same schedule, and a
    piece that outlasts a stage re-partitions the buckets (at most :data:`REPARTITIONS` times)."""

    def __init__(self, rounds, preserver: Optional[Preserver], profile):
        self.rounds = rounds  # the DelayedRounds it measures for (its units, links and schedule)
        self.preserver = preserver
        self.preserved: Optional[Preserved] = None  # the Preserver's outcome, once solved
        self.profile = profile  # a dearopt.sim.Profile the times come from (no measuring of them)
        self.losses: Dict[int, float] = {}  # measuring step -> the loss the user reported at its step()
        self.dots: Dict[int, float] = {}  # measuring step -> this rank's own gradient . the update made
        self.measure_from = 0  # the first measuring step (later after a re-partition)
        self.repartitions: List[int] = []  # the buffer sizes re-planned to
        self.measured: Optional[tuple] = None  # (forward, backward, comm) per bucket, rank 0's, shared
        self.marks: Dict[object, float] = {}  # step 1: forward/backward start and end, per bucket reached/ready
        self.comm: Dict[int, float] = {}  # each piece's all-reduce alone (seconds)
        self.comm_second: Dict[int, float] = {}  # on the second link
        self.comm_rsag: Dict[int, float] = {}  # as reduce-scatter + all-gather

    @property
    def times_alone(self) -> bool:
        """Whether the last measuring step times each bucket's all-reduce alone: for the times (no profile), or
        for the second link's ratio ``mu``."""
        r = self.rounds
        return self.profile is None or r.second is not None

    def measuring(self, step: int) -> bool:
        """Whether this is measuring step ``step`` (1: compute times, 2: each all-reduce alone)."""
        r = self.rounds
        e = r.parts
        return r.offset > 0 and e.life.step_count == self.measure_from + step and r.plan is not None

    def measured_times(self) -> tuple:
        """Per unit: forward and backward seconds from step 1's marks (per bucket), all-reduce seconds from
        step 2."""
        r = self.rounds
        n, marks = len(r.buckets), self.marks
        forward = [0.0] * n
        reached = sorted((marks[("forward", b)], b) for b in range(n) if ("forward", b) in marks)
        for k, (at, b) in enumerate(reached):
            until = reached[k + 1][0] if k + 1 < len(reached) else marks["backward"]
            forward[b] = max(until - at, 0.0)
        if reached:
            forward[reached[0][1]] += max(reached[0][0] - marks["start"], 0.0)
        ready = [marks.get(("ready", b), marks["end"]) - marks["backward"] for b in range(n)]
        forward, backward = unit_times(forward, ready, marks["end"] - marks["backward"], r.units)
        measured = self.comm_rsag if self.measured_reduction() == RSAG else self.comm
        # one sample per unit, on a machine that computes and communicates at once: the solver takes the line
        # fitted through them (Theil-Sen, robust to the one slow sample that would otherwise break the
        # partition constraint), not each sample
        nbytes = [r.unit_nbytes(u) for u in range(len(r.units))]
        bandwidth, latency = fit_link([(nbytes[u], measured[u]) for u in range(len(r.units))])
        return forward, backward, [latency + n / bandwidth for n in nbytes]

    def measured_reduction(self) -> str:
        """The faster way to sum the units, from the measuring step's times of each alone (rank 0's decides):
        reduce-scatter + all-gather only where faster by :data:`RSAG_MARGIN`."""
        r = self.rounds
        if (
            r.rsag is not None
            and len(self.comm_rsag) == len(self.comm)
            and sum(self.comm_rsag.values()) < (1.0 - RSAG_MARGIN) * sum(self.comm.values())
        ):
            return RSAG
        return ALL_REDUCE

    def profiled_reduction(self, reduction: str) -> str:
        """The way to sum the units the profile's times favour, where there is a choice (else ``reduction``)."""
        r = self.rounds
        return profile_reduction(self.profile, r.plan) if r.rsag is not None else reduction

    def solve_measured(self) -> Solved:
        """After the measuring steps: rank 0's times for everyone, and the same schedule solved on every rank; or,
        where a piece outlasts a stage, the smaller sizes to re-plan with (the knobs of ``Executor.replan``).
        Returns what was decided; the rounds part adopts it."""
        r = self.rounds
        e = r.parts
        from dearopt.collectives import broadcast_object

        mu, reduction = r.mu, r.reduction
        if self.times_alone:  # rank 0's numbers for everyone
            measured, mu, reduction = broadcast_object(
                (self.measured_times(), self.measured_mu(), self.measured_reduction()) if e.rank == 0 else None,
                0,
                backend=e.control,
            )
        if self.profile is not None:
            reduction = self.profiled_reduction(reduction)
            measured = deft_times(self.profile, r.plan, reduction)
        self.measured = measured
        forward, backward, comm = self.measured
        too_long = check_partition(forward, backward, comm)
        if too_long and len(self.repartitions) < REPARTITIONS:
            # split: buckets, and pieces of any larger parameter, that take at most 80 % of the shortest stage
            # by the link's line through the units' (bytes, seconds) (``comm`` lies on it: fitted above, shared);
            # at most GROWTH times as many pieces per re-partition, since the line cannot always see the fixed
            # cost per collective (a tiny model was cut into ~700 pieces of mostly fixed cost); and only where it
            # shrinks a unit that is too long
            shortest = min(sum(forward), sum(backward))
            nbytes = [r.unit_nbytes(u) for u in range(len(r.units))]
            bandwidth, latency = fit_link(list(zip(nbytes, comm)))
            size = max(int((0.8 * shortest - latency) * bandwidth), -(-sum(nbytes) // (GROWTH * len(nbytes))))
            if size < max(nbytes[u] for u in too_long) and self.profile is None:
                self.repartitions.append(size)
                # nothing in flight: every measuring step was applied; the executor re-plans after this step
                knobs = e.planner.knobs
                self.measure_from = e.life.step_count
                self.marks, self.comm, self.comm_second, self.losses, self.dots = {}, {}, {}, {}, {}
                self.comm_rsag = {}
                replan = dict(
                    buffer_size=min(knobs.buffer_size, size), partition_size=min(knobs.partition_size or size, size)
                )
                return Solved(mu=mu, reduction=reduction, replan=replan, offset=e.life.step_count + MEASURED_STEPS)
        return Solved(deft=self.solve(self.measured, mu), mu=mu, reduction=reduction)

    def time_alone(self, group) -> None:
        """The last measuring step: each unit of ``group`` (this backward's) reduced alone, in turn (as an
        all-reduce; on the second link and as reduce-scatter + all-gather too, a scratch copy, where there are)."""
        r = self.rounds
        e = r.parts
        for u in range(len(r.units) - 1, -1, -1):
            b = r.units[u][0]
            if b not in group.storage:
                group.storage[b] = r.take(b)
            if r.second is not None:  # the same bytes on the second link (a scratch copy), alone
                scratch = r.unit_tensor(group, u).clone()
                t0 = time.perf_counter()
                r.second.all_reduce(scratch, "sum", bucket=b, step=e.life.step_count).wait()
                self.comm_second[u] = time.perf_counter() - t0
            if r.rsag is not None:  # the same bytes as reduce-scatter + all-gather (a scratch copy), alone
                scratch = r.unit_tensor(group, u).clone()
                t0 = time.perf_counter()
                r.rsag.start(scratch, r.shard(u), bucket=b, step=e.life.step_count).wait()
                self.comm_rsag[u] = time.perf_counter() - t0
            t0 = time.perf_counter()
            r.send_unit(group, u)
            group.handles[-1].wait()
            self.comm[u] = time.perf_counter() - t0

    def measured_mu(self) -> Optional[float]:
        """The second link's all-reduce time over the first's, over all buckets measured alone (None: one link)."""
        r = self.rounds
        if r.second is None:
            return None
        first = sum(self.comm.values())
        return sum(self.comm_second.values()) / first if first > 0 else 1.0

    def convergence_stats(self) -> tuple:
        """The Preserver's inputs from the measuring steps, the same on every rank: the mean loss, and per step
        the drift (minus the averaged gradient . the update) and the noise (the spread of the ranks' own
        gradients . the update, over sqrt(ranks)), averaged over the measuring steps."""
        r = self.rounds
        e = r.parts
        steps = sorted(self.dots)
        rows = [[self.dots[s], self.dots[s] ** 2, self.losses.get(s, math.nan)] for s in steps]
        total = torch.tensor(rows, dtype=torch.float64, device=e.control.device)
        e.control.all_reduce(total, "sum", step=e.life.step_count).wait()
        total = total.cpu()
        n = e.world
        dot = total[:, 0] / n  # the averaged gradient . the update, per step
        var = (total[:, 1] - n * dot**2).clamp(min=0) / (n - 1) if n > 1 else torch.zeros_like(dot)
        loss = float(total[:, 2].mean()) / n
        if not math.isfinite(loss):
            raise UsageError(
                f"schedule='deft' checks its solved schedule's convergence (the Preserver) from the "
                f"training loss of its first {len(steps)} steps, and not every rank reported one: "
                f"pass it as optimizer.step(loss=loss) on every rank, or preserver=None to use the "
                f"solver's schedule unchecked [rank {e.rank}, step {e.life.step_count}]"
            )
        return loss, -float(dot.mean()), math.sqrt(float(var.mean()) / n)

    def solve(self, times, mu: Optional[float]):
        """The schedule solved from ``times`` (and checked by the Preserver, where there is one)."""
        r = self.rounds
        e = r.parts
        try:
            if self.preserver is None:
                return deft_schedule(*times, mu=mu)
            loss, drift, noise = self.convergence_stats()
            self.preserved = self.preserver.solve(*times, loss=loss, drift=drift, noise=noise, mu=mu)
            schedule = self.preserved.schedule
            if not self.preserved.passed:
                warnings.warn(
                    f"dearopt: the DeFT schedule failed the Preserver's check after "
                    f"{self.preserved.resolves} re-solves ({self.preserver.statistic} ratio "
                    f"{self.preserved.ratio:.4f}, epsilon {self.preserver.epsilon}); it is used as the "
                    f"last re-solve left it ({schedule.updates_per_iteration:.2f} updates per step)",
                    RuntimeWarning,
                )
            return schedule
        except ValueError as exc:  # the partition constraint: a bucket longer on the link than a whole stage
            raise UsageError(
                f"schedule='deft' cannot schedule these {len(r.buckets)} buckets (sent in "
                f"{len(r.units)} pieces, numbered from the input side): {exc}. A smaller "
                f"buffer_size or partition_size helps where bandwidth dominates a piece's time; where "
                f"the fixed cost per collective does, this model computes too little per step for "
                f"DeFT [rank {e.rank}, step {e.life.step_count}]"
            ) from None

    def record_loss(self, loss) -> None:
        """The training loss of this step (``DistOptim.step(loss=...)``): the Preserver's, in the measuring steps."""
        r = self.rounds
        e = r.parts
        if self.preserver is not None and r.deft is None and e.life.step_count < r.offset:
            self.losses[e.life.step_count] = float(loss.detach() if torch.is_tensor(loss) else loss)


@dataclasses.dataclass
class Solved:
    """What the measuring steps decided (:meth:`DeftMeasurement.solve_measured`): the schedule (None where a
    re-partition comes first), the second link's time ratio ``mu``, the way to sum the units, and for a
    re-partition the knobs of the re-plan and the step the measuring ends at again."""

    mu: Optional[float]
    reduction: str
    deft: Optional[object] = None
    replan: Optional[dict] = None
    offset: Optional[int] = None


@dataclasses.dataclass
class DeftParts:
    """What ``deft``'s parts read of the engine's parts, given once at construction (none of them the engine)."""

    life: LifeCycle  # the life cycle: read, and moved through its transitions only
    hooks: EngineHooks  # the gradient hooks and the pending updates' guard
    timeline: Timeline
    control: CollectiveBackend  # the control channel (the Preserver's statistics, rank 0's times)
    updater: BucketUpdater
    optimizer: torch.optim.Optimizer
    planner: Planner  # the trainable set and the knobs a re-partition shrinks

    rank = property(lambda self: self.control.rank)
    world = property(lambda self: self.control.size)
    guard = property(lambda self: self.hooks.guard)


def accepted_hook(comm_hook):
    """The comm hook ``deft`` reduces with: none (the default ``"auto"`` cast is dropped: deft reduces in the
    parameters' own dtype); any other is refused by name."""
    if getattr(comm_hook, "auto", False):
        return None
    if comm_hook is not None:
        raise UsageError("schedule='deft' does not take a comm_hook yet")
    return None


_SECOND_BACKWARD = (
    "backward() was called again before step(): under schedule='deft' every backward is one step of the schedule"
)


class DelayedRounds:
    """``deft``'s rounds (the moments protocol of :mod:`dearopt.engine.rounds`): a group of gradients travels across
    iterations as the :class:`DeftSchedule` says, through the engine's issuer (:meth:`Issuer.send`) and buckets;
    each bucket of a group is applied when it is due (``apply="bucket"``: lazily, before its module's next
    forward or when user code touches its parameters) or the whole group at the ``step()`` the schedule names."""

    Gradients = DelayedGradients
    applied_steps = property(lambda self: self.updates.applied_steps, doc="The steps at which a group was applied.")
    reuses_buckets = False  # the schedule's state is per bucket: a re-plan makes new ones
    every_module = True  # module_reached(module) before every module (its measuring marks, the due buckets)

    @classmethod
    def of(cls, parts: tuple, backend, optimizer, planner, options, comm_hook) -> tuple:
        """Made from the parts :class:`~dearopt.engine.rounds.ExactRounds` is given first (life, hooks, profile,
        timeline, checks, control, updater) and the rest deft reads; returns it and the comm hook the executor
        keeps (:func:`accepted_hook`)."""
        life, hooks, _, timeline, _, control, updater = parts
        hook = accepted_hook(comm_hook)
        return cls(DeftParts(life, hooks, timeline, control, updater, optimizer, planner), backend, options), hook

    def __init__(self, parts: DeftParts, backend, options):
        """``parts``: the engine's parts it reads (:class:`DeftParts`); ``backend``: the data communicator its
        second link and reduce-scatter + all-gather are forked from; ``options``: the engine's Options."""
        e = self.parts = parts
        self.options = options  # (set again where DistOptim replaces them)
        self.bound = self.issuer = None  # the plan in force, as carried out, and its issuer (plan_bound)
        self.stale: set = set()  # due buckets this forward did not reach, as this backward began
        self.backward_start = 0.0  # the timeline's clock as this backward began
        policy = options.policy  # the DeFT object and its knobs
        schedule, profile, preserver, links, apply = (
            policy.given,
            policy.profile,
            policy.preserver,
            policy.links,
            policy.apply,
        )
        self.updates = GroupUpdates(self)  # applying the groups' buckets when they are due
        self.replanning: Optional[dict] = None  # the measuring steps' re-partition (nothing in flight): the knobs
        # of the re-plan asked of the executor after step(), the one re-plan allowed
        self.apply_mode = apply  # one of schedules.deft.APPLY_MODES (the DeFT object checked it)
        if (
            schedule is not None
            and links == 1
            and any(it.second_old or it.second_new for it in schedule.warmup + schedule.period)
        ):
            raise UsageError("the given DeFT schedule sends on a second link: pass schedule=dearopt.DeFT(links=2)")
        # DeFT's heterogeneous links: a second communicator over the same ranks, used concurrently with the first
        self.second = backend.second_link() if links == 2 else None
        self.mu: Optional[float] = None if schedule is None else schedule.mu  # its time per bucket over the first's
        # the second half of a reduce-scatter + all-gather runs on a communicator of its own (one link, on a
        # backend whose host waits for an op, i.e. gloo: where all-reduce is slow)
        self.rsag = None
        if links == 1 and schedule is None and e.world > 1 and getattr(backend, "host_waits", False):
            from dearopt.backends.base import ReduceScatterThenGather

            self.rsag = ReduceScatterThenGather(backend, backend.fork())
        self.reduction = ALL_REDUCE  # how a unit is summed (RSAG once measured or profiled faster)
        # per (unit, group parity): the reduce-scatter's output (RSAG); two, since the next group may send a unit
        # while the one before still gathers it (its bucket applied only when the next forward reaches it)
        self._shards: Dict[Tuple[int, int], torch.Tensor] = {}
        self.groups_formed = 0
        self._accumulating = False  # this backward only accumulates (no_sync(), backward_passes_per_step)
        self.deft: Optional[DeftSchedule] = schedule
        # A given schedule is followed as it is.  Otherwise the first MEASURED_STEPS steps are exact and measure
        # the job: its times (unless a profile gives them) and what the Preserver needs (unless it is off)
        self.measurement = DeftMeasurement(self, None if schedule is not None else preserver, profile)
        self.offset = MEASURED_STEPS if schedule is None and (profile is None or preserver is not None) else 0
        self.group: Optional[_Group] = None  # in flight: its buckets are sent over this and later iterations
        self.new_group: Optional[_Group] = None  # the group this backward starts
        self.held: Optional[_Group] = None  # gradients held (summed) while the group in flight is unfinished
        self._new_cursor = 0
        self._forward_sent_at = -1
        self.loaded: Optional[dict] = None  # a checkpoint's group sums, until the plan exists to check them
        self.gradients: Optional[DelayedGradients] = None  # the gradients part it makes (gradients_part)

    def gradients_part(self, *parts, **named) -> DelayedGradients:
        """Make the part that holds a step's gradients between ``backward()`` and ``step()`` (clipping acts on the
        group the step applies: :meth:`applied_now`)."""
        self.gradients = DelayedGradients(*parts, applied=self.applied_now, **named)
        return self.gradients

    def applied_now(self) -> tuple:
        """The group this step's ``step()`` applies (waited for: its sums are complete) and the factor that makes
        its sums the average, or ``(None, 0.0)`` at a step that applies none."""
        e = self.parts
        if self.apply_mode == "bucket" and e.life.step_count >= self.offset:
            raise UsageError(
                "under DeFT(apply='bucket') a group's buckets are applied at different steps, so no "
                "step applies one whole average to clip: pass schedule=dearopt.DeFT(apply='group') (now "
                "dearopt.DeFT(apply='group')) to clip with "
                "optimizer.clip_grad_norm_/clip_grad_value_ (each step then clips the group it applies)"
            )
        it = self.iteration
        group = self.new_group if it.applies == 0 else self.group if it.applies is not None else None
        if group is None:
            return None, 0.0
        self.wait_group(group)
        return group, 1.0 / (e.world * group.covers)

    # --------------------------------------------------------------- plan
    def plan_bound(self, bound, issuer):
        """The plan's buckets are new (never reused: the schedule's state is per bucket): its units, and a solved
        or restored schedule checked against them; returns the bound plan as these rounds carry it out (``p.grad``
        holds this rank's own gradient after backward: changes to it are refused)."""
        self.bound = bound = dataclasses.replace(bound, final_after_backward=frozenset())
        self.issuer, self.replanning = issuer, None  # (a re-partition asked for is carried out: this plan)
        # the schedule's items: (bucket, piece) in forward order; a bucket is one unless partition_size splits it
        self.units = plan_units(self.plan)
        self.units_of = [[u for u, (b, _) in enumerate(self.units) if b == bucket.index] for bucket in self.buckets]
        self._shards = {}
        if self.deft is None and self.measurement.profile is not None and not self.offset:
            self.reduction = self.measurement.profiled_reduction(self.reduction)
            self.deft = self.measurement.solve(deft_times(self.measurement.profile, self.plan, self.reduction), self.mu)
        if self.deft is not None and self.deft.buckets != len(self.units):
            pieces = "" if len(self.units) == len(self.buckets) else f" in {len(self.units)} pieces"
            raise UsageError(
                f"the DeFT schedule is for {self.deft.buckets} buckets, the plan has "
                f"{len(self.buckets)}{pieces} (buffer_size and partition_size decide them)"
            )
        if self.loaded is not None:
            _restore(self, self.loaded)
        return bound

    plan = property(lambda self: self.bound.plan if self.bound is not None else None, doc="The plan in force.")
    buckets = property(lambda self: self.bound.buckets if self.bound is not None else (), doc="Its buckets.")
    measured = property(lambda self: self.measurement.measured, doc="The times the schedule was solved from.")
    preserved = property(lambda self: self.measurement.preserved, doc="The Preserver's outcome, once solved.")
    repartitions = property(lambda self: self.measurement.repartitions, doc="The sizes re-partitioned to.")

    @property
    def iteration(self) -> DeftIteration:
        e = self.parts
        if e.life.step_count < self.offset:  # measuring: exact, every unit sent in backward, applied now
            n = len(self.units)
            alone = e.life.step_count == self.offset - 1 and self.measurement.times_alone  # timed in end_backward
            send = () if alone else tuple(range(n - 1, -1, -1))
            return DeftIteration(4, (), (), send, False, 0, 1)
        return self.deft.iteration(e.life.step_count - self.offset)

    def unit_nbytes(self, u: int) -> int:
        b, k = self.units[u]
        return self.buckets[b].spec.piece_nbytes(k)

    def unit_tensor(self, group: _Group, u: int) -> torch.Tensor:
        """Unit ``u``'s part of ``group``'s sum for its bucket (a view: reduced in place)."""
        b, k = self.units[u]
        start, end = self.buckets[b].spec.pieces[k]
        return group.storage[b][start:end]

    def send_unit(self, group: _Group, u: int, new: bool = False) -> None:
        """Start unit ``u``'s sum of ``group`` (the group formed in this backward: ``new``) through the issuer, on
        the link the schedule gives it (measuring steps: the first)."""
        e = self.parts
        group.sent.add(u)
        scheduled = e.life.step_count >= self.offset
        on_second = self.second is not None and scheduled and self.iteration.link(u, new)
        b, k = self.units[u]
        rsag = self.reduction == RSAG and scheduled and not on_second
        kind = "second link" if on_second else self.reduction if scheduled else ALL_REDUCE
        handle = self.issuer.send(
            self.unit_tensor(group, u),
            bucket=b,
            piece=k,
            step=e.life.step_count,
            link=self.second if on_second else self.rsag if rsag else None,
            shard=self.shard(u, group.serial % 2) if rsag else None,
            label=f"{kind} unit {u}",
            unit=u,
            group="new" if new else "old",
        )
        group.handles.append(handle)
        group.unit_handles[u] = handle

    def shard(self, u: int, parity: int = 0) -> torch.Tensor:
        """Unit ``u``'s reduce-scatter output for groups of this ``parity`` (allocated once per plan)."""
        e = self.parts
        if (u, parity) not in self._shards:
            b, k = self.units[u]
            start, end = self.buckets[b].spec.pieces[k]
            self._shards[(u, parity)] = self.buckets[b].buffer.new_empty((end - start) // e.world)
        return self._shards[(u, parity)]

    # ----------------------------------------------------------- forward
    def _send_forward_stage(self) -> None:
        """Case 1: the old group's buckets the schedule sends while the forward computes, once per step (at the
        forward's start; or at backward's start where the plan was made only then, after a resume)."""
        e = self.parts
        if self._forward_sent_at != e.life.step_count and self.iteration.forward:
            self._forward_sent_at = e.life.step_count
            for u in self.iteration.forward:
                self.send_unit(self.group, u)

    # ----------------------------------------------------------- backward
    replans_in_backward = False  # its groups span iterations: a changed input is refused, not re-planned

    second_backward_refusal = staticmethod(
        lambda: UsageError(_SECOND_BACKWARD)
    )  # the error for a backward before step()

    def begin_backward(self) -> None:
        """A backward pass begins (the engine moved the life cycle to a new pass)."""
        e = self.parts
        # due buckets this forward did not reach: applied now (a parameter of theirs that gets a gradient was read
        # before its own module ran, at its old value: refused in its gradient hook)
        self.stale = set(self.updates.due_buckets)
        self.updates.apply_due()
        for b in self.buckets:  # what user code did to p.grad since (model.zero_grad(), p.grad = None, ...)
            b.reconcile()
        if any(id(p) not in self.bound.where for p in e.planner.trainable()):
            raise UsageError("a parameter was unfrozen after the plan was made: schedule='deft' cannot re-plan")
        torch.autograd.Variable._execution_engine.queue_callback(EngineHook(self.end_backward))

    def backward_begun(self, sending: bool) -> None:
        """The backward pass is under way; ``sending``: this step of the schedule communicates."""
        e = self.parts
        self.backward_start = e.timeline.now()
        # inside no_sync(), or before the last of backward_passes_per_step: the gradients accumulate in p.grad
        # and this step of the schedule begins with the backward that communicates (its forward stage's sends
        # started with the step's first forward and run on meanwhile)
        self._accumulating = not sending
        if self._accumulating:
            return
        if self.measurement.measuring(1):
            self.measurement.marks["backward"] = time.perf_counter()
        for b in self.buckets:
            b.start_round()
        it = self.iteration
        self._send_forward_stage()
        if self.group is not None:  # the forward stage's sends are done before backward (Algorithm 2, line 15)
            self.wait_group(self.group)
            if not it.held and it.applies is None:  # a given schedule may say so; nothing is in flight yet
                raise UsageError(
                    f"the DeFT schedule forms a new group at step {e.life.step_count} while the group "
                    f"in flight is not applied at that step: its gradients would be lost (a given "
                    f"DeFT(given=...) must apply each group before the next forms) [rank {e.rank}]"
                )
            for u in it.backward_old:  # Cases 2 and 3: old gradients, ready now
                self.send_unit(self.group, u)
        self.new_group = None if it.held else _Group({}, 1 + (self.held.covers if self.held is not None else 0))
        if self.new_group is not None:
            self.groups_formed += 1
            self.new_group.serial = self.groups_formed
        self._new_cursor = 0

    def grad_ready(self, p) -> None:
        e = self.parts
        located = self.bound.where.get(id(p))  # (the engine made the plan and began the pass)
        self.issuer.poll_sends()
        if located is None:
            return
        bucket, j = located
        if bucket.index in self.stale:
            raise UsageError(
                f"parameter {bucket.names[j]!r} received a gradient although its delayed update was not applied "
                f"before it was used: it was read in forward before its own module ran. Use "
                f"DeFT(apply='group'), or call optimizer.synchronize() before such a forward"
            )
        bucket.take_gradient(p, j)
        if self._accumulating:
            return
        if bucket.stamp[j] != e.life.pass_id:
            bucket.stamp[j] = e.life.pass_id
            bucket.ready += 1
        if bucket.complete:
            if self.measurement.measuring(1):
                self.measurement.marks.setdefault(("ready", bucket.index), time.perf_counter())
            self._start_new(force=False)

    def take(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s gradient of this step (with its used flags), plus what was held of it."""
        bucket = self.buckets[b]
        bucket.clear_stale()
        self._write_flags(bucket)
        total = bucket.buffer.clone()
        if self.held is not None:
            total.add_(self.held.storage[b])
        return total

    @staticmethod
    def _write_flags(bucket) -> None:
        """The used flags into the bucket's tail, so that a group's sum counts, per parameter, the steps and
        ranks that produced a gradient (step tags are not checked under deft: a group sums several steps)."""
        bucket.flags.copy_(torch.tensor(bucket.used, dtype=bucket.flags.dtype))
        bucket.tags.zero_()
        bucket.mark_seen()

    def _start_new(self, force: bool) -> None:
        """Send the new group's units the schedule sends in this backward, in its order, as they are ready."""
        if self.new_group is None:
            return
        order = self.iteration.backward_new
        while self._new_cursor < len(order):
            u = order[self._new_cursor]
            b = self.units[u][0]
            if not (force or self.buckets[b].complete):
                return
            if b not in self.new_group.storage:
                self.new_group.storage[b] = self.take(b)
            self.send_unit(self.new_group, u, new=True)
            self._new_cursor += 1

    def end_backward(self) -> None:
        e = self.parts
        e.hooks.gradients.expect_backward()
        e.timeline.span("backward", "compute", self.backward_start)
        if not e.life.backward_ended():
            return
        for b in self.buckets:  # unused since zero_grad(): a zero gradient
            b.clear_stale()
        if self.new_group is None:  # Case 2: this step's gradients are held, summed with what was held before
            if self.held is None:
                self.held = _Group({b.index: torch.zeros_like(b.buffer) for b in self.buckets}, 0)
            for b in self.buckets:
                self._write_flags(b)
                self.held.storage[b.index].add_(b.buffer)
            self.held.covers += 1
            return
        if self.measurement.measuring(1):
            self.measurement.marks["end"] = time.perf_counter()
        if self.measurement.measuring(MEASURED_STEPS - 1) and self.measurement.times_alone:
            self.measurement.time_alone(self.new_group)
        self._start_new(force=True)
        for b in range(len(self.buckets)):  # the new group's other buckets wait on this rank for a later stage
            if b not in self.new_group.storage:
                self.new_group.storage[b] = self.take(b)
        self.held = None

    # --------------------------------------------------------------- step
    def wait_group(self, group: Optional[_Group]) -> None:
        e = self.parts
        if group is None:
            return
        t0 = e.timeline.now()
        for handle in group.handles:
            handle.wait()
        if e.timeline.enabled:
            self.issuer.poll_sends(group.handles)
            e.timeline.span("wait for sends", "wait", t0, sends=len(group.handles))
        group.handles = []

    def step(self, skip: bool = False, scaler_checked: bool = False) -> Optional[dict]:
        """Apply what this step of the schedule applies; returns the knobs of a re-plan the executor is to make
        now (the measuring steps' re-partition), or None."""
        e = self.parts
        if scaler_checked:
            raise UsageError(
                "GradScaler is not supported under schedule='deft' yet: a group applied later covers "
                "steps scaled differently"
            )
        e.life.require_gradients("step")
        self.gradients.check_writes()
        t0 = e.timeline.now()
        it = self.iteration
        # only the group applied now is waited for: the sends of the group this backward formed run on into the
        # next forward (the link stays busy; the next backward waits for them with the forward stage's sends)
        if it.applies == 0:  # a measuring step: exact, applied at once
            self.wait_group(self.new_group)
            dot = self.updates.apply(self.new_group, measure=self.measurement.preserver is not None)
            if dot is not None:  # the Preserver's input
                self.measurement.dots[e.life.step_count] = dot
            self.new_group = None
        elif self.apply_mode == "bucket":
            self.updates.hand_over(it)
            self.group = None if it.applies is not None else self.group  # (applied: every bucket of it handed over)
        elif it.applies is not None:
            self.wait_group(self.group)
            self.updates.apply(self.group)
            self.group = None
        if self.new_group is not None:  # (a group in flight and not applied was refused when this backward began)
            self.group, self.new_group = self.new_group, None
        e.life.stepped(False)
        if self.deft is None and e.life.step_count == self.offset:
            self.adopt(self.measurement.solve_measured())
        e.timeline.span("step", "update", t0)
        if self.updates.due_buckets:  # the step lands once its due buckets are applied (the post hooks wait for them)
            self.updates.due_landing = True
            e.guard.arm((p, b) for b in self.updates.due_buckets for p in self.buckets[b].params)
        else:
            e.life.step_landed()
        return self.replanning

    # -------------------------------------------------------- checkpoints
    def deft_state(self) -> dict:
        """The schedule, the step within it and this rank's group sums, for ``DistOptim.state_dict()``."""
        return save_groups(self)

    def load_deft_state(self, saved: dict) -> None:
        """Resume from :meth:`deft_state` (checked against the plan's buckets once the plan exists)."""
        load_groups(self, saved)

    # ------------------------------------------------ the moments protocol
    def forward_started(self) -> None:
        """A training forward began: the measuring step's first mark, and Case 1's sends."""
        e = self.parts
        if self.plan is None:
            return
        if (
            self.measurement.measuring(1) and e.life.forwards == 1
        ):  # the step's first forward (more where it accumulates)
            self.measurement.marks = {"start": time.perf_counter()}
        self._send_forward_stage()

    def module_reached(self, module) -> None:
        """Before ``module`` runs: its due buckets applied; the measuring step's forward marks."""
        if self.updates.due_buckets:
            bucket = self.bound.module_bucket.get(id(module))
            if bucket is not None:
                self.updates.apply_due(bucket)
        if self.issuer is not None:
            self.issuer.poll_sends()
        if self.measurement.measuring(1) and module.training and "start" in self.measurement.marks:
            now = time.perf_counter()
            for p in module.parameters(recurse=False):
                if id(p) in self.bound.where:
                    self.measurement.marks.setdefault(("forward", self.bound.where[id(p)][0].index), now)

    def touched(self, bucket: int) -> None:
        """User code touched a parameter of ``bucket`` after step(): apply the due buckets up to it first."""
        self.updates.apply_due(bucket)

    def synchronize(self) -> None:
        """Finish every send in flight (the group in flight is then reduced where it was sent); under ``deft``
        nothing else is pending: a group is applied only at the ``step()`` the schedule names."""
        e = self.parts
        if e.life.state is TrainingState.IDLE:
            self.updates.apply_due()
            self.wait_group(self.group)

    def adopt(self, solved: Solved) -> None:
        """What the measuring steps decided: the schedule, or the re-partition to re-plan with after this step."""
        self.mu, self.reduction, self.replanning = solved.mu, solved.reduction, solved.replan
        self.deft = solved.deft if solved.deft is not None else self.deft
        self.offset = solved.offset if solved.offset is not None else self.offset

    record_loss = property(lambda self: self.measurement.record_loss, doc="``step(loss)``: the Preserver's losses.")

    def may_replan(self) -> None:
        """Refused once planned (its groups span iterations), except for the measuring steps' re-partition."""
        if self.plan is not None and not self.replanning:
            raise UsageError(
                "schedule='deft' cannot re-plan (its groups span iterations): buffer_size='auto' "
                "and the other tuned knobs are not supported"
            )

    def close(self) -> None:
        """Release the second link and the reduce-scatter + all-gather communicator."""
        if self.rsag is not None:
            self.rsag.close()
        if self.second is not None:
            self.second.close()


class GroupUpdates:
    """``deft``'s updates: each group's buckets applied when they are due (``apply="bucket"``: lazily, before their
    module's next forward or when user code touches their parameters), or the whole group at the ``step()`` the
    schedule names (``"group"``), one optimizer call per moment."""

    def __init__(self, rounds):
        self.rounds = rounds
        self.parts = rounds.parts  # the engine's parts it reads
        # bucket -> the groups whose reduced sums it still has to apply, oldest first (two where one step sends the
        # last of the old group's and all of the new group's)
        self.due_buckets: Dict[int, List[_Group]] = {}
        self.due_landing = False  # the step whose due buckets are not all applied yet (its post hooks wait)
        self.applied_steps: List[int] = []  # the steps at which a group was applied (the update frequency)

    def hand_over(self, it: DeftIteration) -> None:
        """``DeFT(apply="bucket")``: every bucket of the groups in flight all of whose pieces are sent by the end
        of this iteration becomes due, to be applied (with this step's hyperparameters) before its parameters are
        next used; a group the schedule applies now must have none left (its rounds then let it go)."""
        r = self.rounds
        e = self.parts
        fresh = 0
        for group in (r.group, r.new_group):
            if group is None:
                continue
            for b in range(len(r.buckets)):
                if b not in group.due and all(u in group.sent for u in r.units_of[b]):
                    group.due.add(b)
                    self.due_buckets.setdefault(b, []).append(group)
                    fresh += 1
        if it.applies is not None:
            if r.group is None or len(r.group.due) != len(r.buckets):
                raise RuntimeError(
                    "the DeFT schedule applies a group not every bucket of which was sent: the "
                    "solver and the executor disagree"
                )
            self.applied_steps.append(e.life.step_count)
        if fresh:
            e.updater.begin_step(fresh)

    def apply_due(self, upto: Optional[int] = None) -> None:
        """Apply the due buckets numbered up to ``upto`` (all: ``None``), in one optimizer call, each after its
        sends are complete."""
        r = self.rounds
        e = self.parts
        chosen = sorted(b for b in self.due_buckets if upto is None or b <= upto)
        if not chosen:
            return
        t0 = e.timeline.now()
        with e.guard.suspended():
            passes = max(len(self.due_buckets[b]) for b in chosen)
            pending = {b: self.due_buckets.pop(b) for b in chosen}
            for k in range(passes):  # the older group's sum first: one optimizer call per pass
                members = [[] for _ in e.optimizer.param_groups]
                saved: Dict[int, tuple] = {}
                waited = []
                now = [b for b in chosen if k < len(pending[b])]
                for b in now:
                    group = pending[b][k]
                    for u in r.units_of[b]:
                        handle = group.unit_handles.get(u)  # none for a unit reduced before a checkpoint
                        if handle is not None:
                            handle.wait()
                            waited.append(handle)
                    self.take_average(r.buckets[b], group, members, saved)
                if e.timeline.enabled:
                    r.issuer.poll_sends(waited)
                try:
                    e.updater.apply_members(members, updates=len(now))
                finally:
                    for p, grad in saved.values():
                        p.grad = grad
        e.timeline.span("update", "update", t0, buckets=chosen)
        if e.guard.armed:
            if self.due_buckets:
                e.guard.arm((p, b) for b in self.due_buckets for p in r.buckets[b].params)
            else:
                e.guard.disarm()
        if not self.due_buckets and self.due_landing:
            self.due_landing = False
            e.life.step_landed()

    def apply(self, group: _Group, measure: bool = False) -> Optional[float]:
        """One update of every parameter with the group's average (``p.grad`` points into it meanwhile); with
        ``measure``, returns this rank's own gradient dotted with the update it made (the Preserver's input)."""
        r = self.rounds
        e = self.parts
        if group is None or len(group.sent) != len(r.units):
            raise RuntimeError(
                "the DeFT schedule applies a group not every bucket of which was sent: the solver "
                "and the executor disagree"
            )
        members = [[] for _ in e.optimizer.param_groups]
        saved = {}
        for bucket in r.buckets:
            if bucket.index not in group.due:  # (applied already: a checkpoint of DeFT(apply="bucket"))
                self.take_average(bucket, group, members, saved)
        before = [(p, p.detach().clone()) for params in members for p in params] if measure else []
        e.updater.begin_step(1)
        try:
            e.updater.apply_members(members)
        finally:
            for p, grad in saved.values():
                p.grad = grad
        self.applied_steps.append(e.life.step_count)
        if measure:  # p.grad is this rank's own gradient again
            return sum(
                float(torch.sum(p.grad.double() * (p.detach() - old).double()))
                for p, old in before
                if p.grad is not None
            )
        return None

    def take_average(self, bucket, group: _Group, members: List[list], saved: Dict[int, tuple]) -> None:
        """Make the group's sum of ``bucket`` its average and point ``p.grad`` of its used parameters into it
        (the old ``p.grad`` kept in ``saved``), each added to its param group's ``members``."""
        e = self.parts
        storage = group.storage[bucket.index]
        storage[: bucket.spec.grad_numel].mul_(1.0 / (e.world * group.covers))
        used = [
            count > 0
            for count in storage[bucket.spec.flags_offset : bucket.spec.flags_offset + len(bucket.params)]
            .round()
            .tolist()
        ]
        if self.rounds.options.nonfinite == "raise" and not bool(
            torch.isfinite(storage[: bucket.spec.grad_numel].sum())
        ):
            raise NonFiniteGradientError(
                f"the averaged gradient of a delayed group (bucket {bucket.index}: "
                f"{', '.join(bucket.names[:3])}) is not finite",
                rank=e.rank,
                op="update",
                bucket=bucket.index,
                step=e.life.step_count,
            )
        for gi, params in enumerate(bucket.group_members):
            for p in params:
                j = bucket.position[id(p)]
                if used[j]:
                    saved[id(p)] = (p, p.grad)
                    offset = bucket.spec.offsets[j]
                    p.grad = storage[offset : offset + p.numel()].view_as(p)
                    members[gi].append(p)


def save_groups(rounds) -> dict:
    """``deft``'s checkpoint: the schedule, the step within it and this rank's group sums."""
    e = rounds.parts
    if e.life.state is not TrainingState.IDLE:
        raise UsageError("save the optimizer's state between step() and the next backward()")
    if rounds.deft is None and rounds.offset and rounds.plan is not None:
        raise UsageError(
            f"schedule='deft' is measuring the job in its first {rounds.offset} steps; save its state after them"
        )

    def dump(group):
        return (
            None
            if group is None
            else {
                "storage": {b: t.clone() for b, t in group.storage.items()},
                "covers": group.covers,
                "sent": sorted(group.sent),
                "due": sorted(group.due),
            }
        )

    if rounds.loaded is not None:  # loaded, not yet applied (no plan yet): pass it on unchanged
        return dict(rounds.loaded)
    rounds.updates.apply_due()  # the parameters saved are current
    rounds.wait_group(rounds.group)  # its sends may still be in flight (step() waits only for a group it applies)
    return {
        "step": e.life.step_count,
        "apply": rounds.apply_mode,
        "schedule": rounds.deft,
        "offset": rounds.offset,
        "measured": rounds.measurement.measured,
        "preserved": rounds.measurement.preserved,
        "mu": rounds.mu,
        "reduction": rounds.reduction,
        "group": dump(rounds.group),
        "held": dump(rounds.held),
        "applied_steps": list(rounds.updates.applied_steps),
    }


def load_groups(rounds, saved: dict) -> None:
    """Resume from :meth:`deft_state` (checked against the plan's buckets once the plan exists)."""
    e = rounds.parts
    if e.life.state is not TrainingState.IDLE:
        raise UsageError("load the optimizer's state between step() and the next backward()")
    if saved.get("apply", "group") == "bucket" and rounds.apply_mode == "group":
        raise UsageError(
            "this checkpoint was saved with DeFT(apply='bucket') (part of its group in flight is "
            "applied already): resume with schedule=dearopt.DeFT(apply='bucket')"
        )
    rounds.wait_group(rounds.group)  # nothing of the replaced group may still be on the link
    for groups in rounds.updates.due_buckets.values():
        for group in groups:
            rounds.wait_group(group)
    rounds.updates.due_buckets.clear()  # the replaced run's pending updates: the checkpoint supersedes them
    rounds.updates.due_landing = False
    e.guard.disarm()
    e.life.restore(int(saved["step"]))
    rounds.deft = saved["schedule"]
    rounds.offset, rounds.measurement.measured = saved.get("offset", 0), saved.get("measured")
    rounds.measurement.preserved = saved.get("preserved")
    rounds.mu = saved.get("mu")
    rounds.reduction = saved.get("reduction", ALL_REDUCE)
    if rounds.reduction == RSAG and rounds.rsag is None:
        raise UsageError(
            "this checkpoint's DeFT schedule sums by reduce-scatter + all-gather, which needs one "
            "link on gloo and no given DeFT(given=...)"
        )
    if rounds.second is None and rounds.deft is not None and rounds.deft.mu is not None:
        raise UsageError(
            "this checkpoint's DeFT schedule uses a second link: resume with schedule=dearopt.DeFT(links=2)"
        )
    rounds.updates.applied_steps = list(saved.get("applied_steps", []))
    rounds.loaded = saved
    if rounds.plan is not None:
        _restore(rounds, saved)


def _restore(rounds, saved: dict) -> None:

    def load(entry):
        if entry is None:
            return None
        for b, t in entry["storage"].items():
            if b >= len(rounds.buckets) or t.shape != rounds.buckets[b].buffer.shape:
                raise UsageError(
                    f"the checkpoint's DeFT group does not fit this plan's bucket {b}: save and "
                    f"resume with the same model and buffer_size"
                )
        if any(not 0 <= u < len(rounds.units) for u in entry["sent"]):
            raise UsageError(
                f"the checkpoint's DeFT group was sent in more pieces than this plan has "
                f"({len(rounds.units)}): resume with the same buffer_size and partition_size"
            )
        group = _Group(
            {b: t.clone().to(rounds.buckets[b].buffer.device) for b, t in entry["storage"].items()}, entry["covers"]
        )
        group.sent = set(entry["sent"])
        group.due = set(entry.get("due", ()))  # (applied already, under DeFT(apply="bucket"))
        group.serial = rounds.groups_formed  # the next group formed uses the other reduce-scatter outputs
        return group

    rounds.group, rounds.held = load(saved["group"]), load(saved["held"])
    rounds.loaded = None
