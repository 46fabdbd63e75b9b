"""The bound plan: a :class:`~dearopt.planning.plan.Plan` laid onto one model's tensors, and the planner that makes it.

A :class:`BoundPlan` is immutable: the buckets, where each parameter lives,
the ops (as the issuer's :class:`~dearopt.engine.issuer.OpState`) indexed by the
moment they are due, the averaged regions, and :class:`PlanInputs`, what it
was derived from (the trainable set and the parameter groups, the knobs, the
profile).  A change of any input is noticed by comparing inputs, and a re-plan
swaps the bound plan whole (:meth:`Planner.bind`).  The :class:`Planner` owns
the knobs a tuner or a measured choice may change (:class:`PlanKnobs`) and the
pure questions about plans: which inputs hold now, whether a fresh profile
changes the plan, which plans are worth measuring against each other.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Union

import torch

from dearopt.backends.base import CollectiveBackend
from dearopt.backends.groups import local_tensor
from dearopt.engine.buckets import BucketState
from dearopt.engine.checks import Checks
from dearopt.errors import PlanMismatchError
from dearopt.planning.order import parameters_in_forward_order
from dearopt.engine.issuer import CreditWindow, Issuer, OpState
from dearopt.planning.plan import BACKWARD_END, STEP, ParamSpec, Plan, Point, allreduce_buckets, moment_key
from dearopt.planning.build import build_plan
from dearopt.planning.profile import ReadyProfile
from dearopt.schedules.prophet import profile_blocks
from dearopt.engine.tied import EmbeddingRows, TiedEmbeddings

__all__ = ["BoundPlan", "PlanInputs", "PlanKnobs", "Planner", "hook_name", "trainable_of"]


@dataclasses.dataclass(frozen=True)
class PlanKnobs:
    """The knobs a plan is made with that may change while training (the tuner, the measured choice)."""

    buffer_size: int
    partition_size: Optional[int] = None
    credit: Optional[int] = None
    allreduce: Union[float, str] = "auto"  # dear's rule for all-reduced buckets
    blocks: bool = False  # dear's measured choice: buckets as Prophet's blocks from the profile, not by size


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a plan is derived from: the trainable parameters by group (ids), the knobs, and the profile's
    identity (None: made without one).  Equal inputs make equal plans on every rank."""

    groups: Tuple[Tuple[int, ...], ...]
    knobs: PlanKnobs
    profile: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class BoundPlan:
    """A plan laid onto the model's tensors, with what the engine looks up per moment (see the module)."""

    plan: Plan
    inputs: PlanInputs
    buckets: Tuple[BucketState, ...]
    where: Dict[int, Tuple[BucketState, int]]  # id(param) -> its bucket and position
    module_bucket: Dict[int, int]  # id(module) -> the last bucket holding its parameters
    due: Dict[Point, List[OpState]]  # the ops due at each moment
    updates_at: Dict[Point, List[int]]  # the buckets updated at each moment
    early_ops: List[OpState]  # the ops that may start before step(): what averaging needs
    averaged: List[Tuple[torch.Tensor, bool]]  # (region, is a shard) once the early ops completed
    averaged_whole: List[Tuple[torch.Tensor, bool]]  # the same regions whole (after the gradients were gathered)
    checked_at_step: List[OpState]  # the ops leaving the averaged regions due by step()
    late_checked: FrozenSet[int]  # buckets whose gradients are checked at their update
    own_gradient_buckets: List[int]  # buckets whose buffers hold this rank's gradients at step()
    final_after_backward: FrozenSet[int]  # buckets whose p.grad holds the average once backward returns
    grad_views: List[Tuple[torch.Tensor, int]]  # what user code may not read before step() unfinished: (view, bucket)
    grad_params: List[Tuple[torch.Tensor, int]]  # (param, bucket), the same
    swappable: bool  # every parameter a plain Parameter (the guards swap their classes; no function mode needed)
    combines: Tuple[Tuple[BucketState, int, BucketState, int, Point], ...]  # tied weight, its twin, when


class Planner:
    """Makes bound plans for one model and optimizer (the engine's planning part).

    It owns what outlives one plan: the knobs (:class:`PlanKnobs`, replaced whole by :meth:`change`), the
    credit window, the issuer's launch log, the recorded forward order, the names of the parameters, the link
    monitor, the embedding rows' hook, and ``generation``, bumped when the trainable set or the groups changed
    (what was derived from the old ones is void)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options,
        profile: ReadyProfile,
        tied: TiedEmbeddings,
        checks: Checks,
        control: CollectiveBackend,
        knobs: PlanKnobs,
        *,
        sharded: bool = False,
        link_monitor=None,
    ):
        self.model, self.optimizer = model, optimizer
        self.options = options  # the engine's Options (set again where DistOptim replaces them)
        self.profile, self.tied, self.checks, self.control = profile, tied, checks, control
        self.rank, self.world = control.rank, control.size
        self.sharded = sharded  # the sharded update (shard_optimizer=True): part of every plan
        self.knobs = knobs
        self.window = CreditWindow(knobs.credit)
        self.launch_log = collections.deque(maxlen=100_000)  # the issuers' (step, kind, bucket, piece)
        self.module_order: List[torch.nn.Module] = []
        self.link_monitor = link_monitor
        self.rows = EmbeddingRows()  # the comm hook of row-sparse buckets (its counts over the run)
        self.generation = 0
        self.names: Dict[int, str] = {}
        for name, p in model.named_parameters():
            self.names.setdefault(id(p), name)

    def change(self, **knobs) -> None:
        """New knobs for the next plan (those given as None stay)."""
        changes = {k: v for k, v in knobs.items() if v is not None}
        if "credit" in changes:
            self.window = CreditWindow(changes["credit"])
        self.knobs = dataclasses.replace(self.knobs, **changes)

    def watch_link(self, step: int) -> None:
        """The link monitor's measurement, shared by rank 0 at the last ``step()``: where the link changed, the
        new profile is fresh (the next question :meth:`profile_changes_plan` answers)."""
        profile = self.profile
        if profile.remeasured:
            profile.remeasured = False
            if self.link_monitor is not None and self.link_monitor.observe(
                step, profile.result.bandwidth, profile.latest.bandwidth
            ):
                profile.result, profile.fresh = profile.latest, True

    def replan_due(self, step: int, bound: BoundPlan, reads_gradients: bool) -> bool:
        """As a backward begins at ``step``: whether ``bound``'s inputs no longer hold (the same answer on every
        rank).  A parameter unfrozen or frozen, or a group added: what was derived from the old set is forgotten
        (:meth:`forget_derived`; ``reads_gradients``: the all-reduce rule stays); rank 0's fresh profile that
        changes the plan (:meth:`profile_changes_plan`, after the link monitor's measurement)."""
        self.watch_link(step)
        if self.groups_key() != bound.inputs.groups:
            self.forget_derived(step, keep_rule=reads_gradients)
            return True
        return self.profile_changes_plan(bound.plan)

    def forget_derived(self, step: int, keep_rule: bool) -> None:
        """The trainable set or the groups changed: the profile, Prophet's blocks and the measured choice were
        derived from the old set; drop them (the profile is taken again from the next step).  ``keep_rule``: the
        all-reduce rule stays (the loop reads ``p.grad`` every step: DDP's plan was chosen for that)."""
        self.profile.forget(step + 1)
        self.change(blocks=False, allreduce=None if keep_rule else self.options.allreduce)
        self.generation += 1

    # ---------------------------------------------------------------- inputs
    def trainable(self) -> List[torch.nn.Parameter]:
        """The parameters the plan covers: those of the optimizer's groups that require grad, and frozen ones
        that still hold a gradient (torch's optimizer would still update them with it; they leave the plan once
        ``zero_grad(set_to_none=True)`` cleared it)."""
        return trainable_of(self.optimizer)

    def groups_key(self, trainable: Optional[List[torch.nn.Parameter]] = None) -> tuple:
        """The trainable set by parameter group (ids): the part of the inputs user code changes."""
        planned = {id(p) for p in (self.trainable() if trainable is None else trainable)}
        return tuple(tuple(id(p) for p in group["params"] if id(p) in planned) for group in self.optimizer.param_groups)

    def inputs(self, trainable: Optional[List[torch.nn.Parameter]] = None) -> PlanInputs:
        """The inputs a plan made now would be derived from."""
        measured = self.profile.result
        return PlanInputs(self.groups_key(trainable), self.knobs, None if measured is None else id(measured))

    def planned(self, trainable: Optional[List[torch.nn.Parameter]] = None) -> List[torch.Tensor]:
        """What the plan covers: the trainable parameters and the twins of their tied uses
        (:mod:`dearopt.engine.tied`)."""
        trainable = self.trainable() if trainable is None else trainable
        ids = {id(p) for p in trainable}
        return trainable + [twin for owner, uses in self.tied.twins.items() if owner in ids for _, _, twin in uses]

    def phases(self) -> Optional[Tuple[float, float]]:
        """The profiled forward and backward computation (seconds), where the profile timed the forward."""
        measured = self.profile.result
        if measured is None or measured.forward is None:
            return None
        return measured.forward, measured.backward

    # ------------------------------------------------------------------ plan
    def plan(
        self, trainable: List[torch.nn.Parameter], step: int, hook_name: str
    ) -> Tuple[Plan, List[torch.Tensor], List[ParamSpec]]:
        """The plan for ``trainable`` at ``step`` (agreed by every rank), the tensors in forward order and their
        specs; ``hook_name``: how gradients travel, as the plan's fingerprint names it (:func:`hook_name`)."""
        planned = self.planned(trainable)
        twins_by_module: Dict[int, List[torch.Tensor]] = {}
        for uses in self.tied.twins.values():
            for module, _, twin in uses:
                twins_by_module.setdefault(id(module), []).append(twin)
        ordered = self._agree_on_order(
            parameters_in_forward_order(self.model, self.module_order, planned, twins_by_module), planned, step
        )
        specs = self._specs(ordered)
        measured = self.profile.result
        if measured is not None and len(measured.ready) != len(specs):  # made for another trainable set
            measured = None
        ready, bandwidth, latency = (measured.ready, measured.bandwidth, measured.latency) if measured else (None,) * 3
        k = self.knobs
        groups = (
            profile_blocks(specs, buffer_size=k.buffer_size, ready_times=ready, bandwidth=bandwidth, latency=latency)
            if k.blocks
            else None
        )
        plan = build_plan(
            specs,
            k.buffer_size,
            self.world,
            self.options.policy,
            groups=groups,
            phases=self.phases(),
            gathers_at_step=k.blocks,
            partition_size=k.partition_size,
            priority=self.options.priority,
            ready_times=ready,
            bandwidth=bandwidth,
            latency=latency,
            credit=k.credit,
            comm_hook=hook_name,
            first_bucket_size=self.options.first_bucket_size,
            allreduce=k.allreduce,
            sharded_update=self.sharded,
        )
        self.checks.plan_agreement(plan, step)
        return plan, ordered, specs

    def bind(
        self,
        trainable: List[torch.nn.Parameter],
        reuse: Sequence[BucketState],
        make_issuer,
        step: int,
        hook_name: str,
        sparse_ids: Set[int] = frozenset(),
    ) -> Tuple[BoundPlan, Issuer, set]:
        """Plan for ``trainable`` at ``step`` and lay the plan onto the tensors.  A bucket of ``reuse`` (the old
        plan's) that the new plan lays out alike (same spec, parameters and groups) is kept as it is; returns the
        bound plan, its issuer (``make_issuer(plan, buckets)``) and the ids of the buckets kept.  ``sparse_ids``:
        the parameters seen with a sparse gradient."""
        inputs = self.inputs(trainable)
        plan, ordered, specs = self.plan(trainable, step, hook_name)
        group_of_param = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                group_of_param.setdefault(id(p), gi)
        n_groups = len(self.optimizer.param_groups)
        old = {(b.spec, tuple(map(id, b.params)), b.group_of, b.n_groups): b for b in reuse}
        buckets, where, kept = [], {}, set()
        for spec in plan.buckets:
            params = [ordered[i] for i in spec.params]
            groups = tuple(group_of_param.get(id(p), -1) for p in params)
            state = old.pop((spec, tuple(map(id, params)), groups, n_groups), None)
            if state is not None:
                kept.add(id(state))
                for j, p in enumerate(params):
                    where[id(p)] = (state, j)
            else:
                state = BucketState(
                    spec, params, [specs[i].name for i in spec.params], list(groups), n_groups, self.world, self.rank
                )
                for j, p in enumerate(params):
                    state.adopt(p, j)
                    state.sparse[j] = id(p) in sparse_ids
                    where[id(p)] = (state, j)
            buckets.append(state)
        module_bucket = {}
        for module in self.model.modules():
            # (module._parameters: what parameters(recurse=False) yields, without torch's five calls per module)
            idx = [where[id(p)][0].index for p in module._parameters.values() if p is not None and id(p) in where]
            if idx:
                module_bucket[id(module)] = max(idx)
        issuer = make_issuer(plan, buckets)
        combines = []
        for owner_id, uses in self.tied.twins.items():
            for _, _, twin in uses:
                if id(twin) in where and owner_id in where:
                    owner_bucket, j = where[owner_id]
                    twin_bucket, k = where[id(twin)]
                    rows = [op.spec.due for op in issuer.ops if op.spec.bucket == owner_bucket.index]
                    combines.append((owner_bucket, j, twin_bucket, k, rows[-1]))
        bound = _index(plan, inputs, tuple(buckets), where, module_bucket, issuer, tuple(combines))
        return bound, issuer, kept

    def _specs(self, ordered: List[torch.Tensor]) -> List[ParamSpec]:
        tied = self.tied
        position = {id(p): i for i, p in enumerate(ordered)}
        specs = []
        for i, p in enumerate(ordered):
            dtype, size = str(p.dtype).replace("torch.", ""), p.element_size()
            numel = local_tensor(p).numel()  # a DTensor: its local shard is what this rank reduces
            owner = tied.owner_of.get(id(p))
            if owner is not None:
                name = f"{self.names.get(id(owner), 'tied weight')} (tied use)"
                specs.append(ParamSpec(name, numel, dtype, size, twin_of=position[id(owner)]))
            else:
                specs.append(
                    ParamSpec(
                        self.names.get(id(p), f"param{i}"),
                        numel,
                        dtype,
                        size,
                        row_numel=tied.row_numel.get(id(p), 0),
                    )
                )
        return specs

    def _agree_on_order(
        self, ordered: List[torch.nn.Parameter], trainable: List[torch.nn.Parameter], step: int
    ) -> List[torch.nn.Parameter]:
        """Rank 0's forward order for everyone: a rank whose first forward skipped a module (a rank-dependent
        branch) saw another order, and the plan must be the same on every rank."""
        if self.world == 1:
            return ordered
        device = self.control.device
        count = torch.tensor([len(trainable)], dtype=torch.int64, device=device)
        counts = torch.empty(self.world, dtype=torch.int64, device=device)
        self.control.all_gather(counts, count, step=step).wait()
        if len(set(counts.tolist())) > 1:
            raise PlanMismatchError(
                f"ranks have different numbers of trainable parameters ({counts.tolist()} by rank): the models or "
                f"the optimizers' parameters differ between ranks",
                rank=self.rank,
                op="plan check",
                step=step,
            )
        index = {id(p): i for i, p in enumerate(trainable)}
        order = torch.tensor([index[id(p)] for p in ordered], dtype=torch.int64, device=device)
        self.control.broadcast(order, 0, step=step).wait()
        return [trainable[i] for i in order.tolist()]

    # ------------------------------------------------------ plans to measure
    def profile_changes_plan(self, plan: Optional[Plan]) -> bool:
        """Whether rank 0's freshly shared profile changes the plan (the same answer on every rank: pure, from
        the same numbers).  Without priority the profile only decides ``dear``'s all-reduced buckets; when
        those stay as they are, re-planning would only cost (pending updates applied early, new buffers)."""
        profile = self.profile
        if not profile.fresh:
            return False
        profile.fresh = False
        if self.options.priority or plan is None:
            return True
        result = profile.result
        policy = self.options.policy
        groups = policy.bucket_groups(
            plan.params,
            buffer_size=self.knobs.buffer_size,
            ready_times=result.ready,
            bandwidth=result.bandwidth,
            latency=result.latency,
        )
        if groups is not None:  # the schedule forms its buckets from the profile (Prophet's blocks)
            return [list(b.params) for b in plan.buckets] != groups
        chosen = (
            allreduce_buckets(
                plan.buckets, self.knobs.allreduce, result.ready, result.bandwidth, result.latency, self.phases()
            )
            if policy.mixes_allreduce
            else frozenset()
        )
        return tuple(sorted(chosen)) != tuple(plan.allreduce)

    def choices(self, plan: Optional[Plan], reads_gradients: bool) -> List[Tuple[Dict[str, object], Tuple]]:
        """The plans worth measuring against each other under ``allreduce="auto"``, as the knobs that make each
        (``{"allreduce": rule}``, and ``"blocks": True`` for Prophet's blocks) with what it plans (the
        all-reduced buckets; the blocks): the profile's rule (``"predicted"``), DeAR's (none: ``0.0``), DDP's
        (every bucket: ``1.0``), and DeAR's ops on Prophet's gradient blocks from the same profile, every
        all-gather started at ``step()`` (where the link is the bottleneck a bucket that starts as soon as its
        gradients exist keeps it busier than buckets of one size); plans alike counted once.  Empty without a
        profile or where nothing is to choose (one rank, another schedule, a fixed fraction)."""
        measured = self.profile.result
        if (
            self.options.allreduce != "auto"
            or self.world == 1
            or plan is None
            or measured is None
            or reads_gradients
            or not self.options.policy.mixes_allreduce
        ):
            return []
        ready, bandwidth, latency = measured.ready, measured.bandwidth, measured.latency
        choices, seen = [], set()
        for rule in ("predicted", 0.0, 1.0):
            chosen = allreduce_buckets(plan.buckets, rule, ready, bandwidth, latency, self.phases())
            if chosen not in seen:
                seen.add(chosen)
                choices.append(({"allreduce": rule}, tuple(sorted(chosen))))
        sized = [list(b.params) for b in plan.buckets] if not self.knobs.blocks else None
        blocks = profile_blocks(
            plan.params, buffer_size=self.knobs.buffer_size, ready_times=ready, bandwidth=bandwidth, latency=latency
        )
        if blocks is not None and blocks != sized:
            choices.append(({"allreduce": 0.0, "blocks": True}, tuple(tuple(g) for g in blocks)))
        return choices if len(choices) > 1 else []


def trainable_of(optimizer: torch.optim.Optimizer) -> List[torch.nn.Parameter]:
    """The parameters a plan covers (:meth:`Planner.trainable`)."""
    seen, out = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen and (p.requires_grad or p.grad is not None):
                seen.add(id(p))
                out.append(p)
    return out


def hook_name(sparse, comm_hook) -> str:
    """How gradients travel, as the plan's fingerprint names it: every rank must encode alike (``sparse``: a
    sparsifier's exchange, or None; ``comm_hook``: the cast hook, or None)."""
    if sparse is not None:
        s = sparse.sparsify
        return f"sparsify-{s.selection}-{s.density!r}-{s.warmup_steps}-{s.momentum!r}"
    return comm_hook.name if comm_hook is not None else "none"


def _index(
    plan: Plan, inputs: PlanInputs, buckets: Tuple[BucketState, ...], where, module_bucket, issuer: Issuer, combines
) -> BoundPlan:
    """What the engine looks up per moment: ops due there, updates applied there, averaged regions."""
    due: Dict[Point, List[OpState]] = {}
    updates_at: Dict[Point, List[int]] = {}
    for op in issuer.ops:
        due.setdefault(op.spec.due, []).append(op)
        if op.spec.update is not None:
            updates_at.setdefault(op.spec.update, []).append(op.spec.bucket)
    for listed in updates_at.values():
        listed.sort()
    early = [op for op in issuer.ops if moment_key(op.spec.start, plan.ops) < moment_key(STEP)]
    last_early = {}
    for op in early:
        last_early[(op.spec.bucket, op.spec.piece)] = op
    averaged, checked_at_step, checked_buckets = [], [], set()
    for (b, _), op in sorted(last_early.items()):
        if buckets[b].spec.twin_of is not None:  # added to its weight's gradient: counted there
            checked_buckets.add(b)
            continue
        averaged.append((op.piece.region(op.spec.result), op.spec.result == "shard"))
        if moment_key(op.spec.due) <= moment_key(STEP):
            checked_at_step.append(op)
            checked_buckets.add(b)
    final = {b.index for b in buckets}
    for op in issuer.ops:
        late = moment_key(op.spec.due) > moment_key(BACKWARD_END)
        shard = op.spec.result == "shard" and last_early.get((op.spec.bucket, op.spec.piece)) is op
        if late or shard:
            final.discard(op.spec.bucket)
    grad_views, grad_params = [], []
    for b in buckets:
        if b.spec.twin_of is None and b.index not in final:
            for p, view in zip(b.params, b.views):
                grad_params.append((p, b.index))
                grad_views.append((view, b.index))
    return BoundPlan(
        plan=plan,
        inputs=inputs,
        buckets=buckets,
        where=where,
        module_bucket=module_bucket,
        due=due,
        updates_at=updates_at,
        early_ops=early,
        averaged=averaged,
        averaged_whole=[
            (op.piece.full_grad, False) for (b, _), op in sorted(last_early.items()) if buckets[b].spec.twin_of is None
        ],
        checked_at_step=checked_at_step,
        late_checked=frozenset({b.index for b in buckets} - checked_buckets),
        own_gradient_buckets=sorted({op.spec.bucket for op in last_early.values() if op.spec.result == "shard"}),
        final_after_backward=frozenset(final),
        grad_views=grad_views,
        grad_params=grad_params,
        swappable=all(type(p) is torch.nn.Parameter for b in buckets for p in b.params),
        combines=combines,
    )
