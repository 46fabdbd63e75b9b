"""Replay what ``schedule="deft"`` does with its solved schedule, in simulated time.

DeFT's work crosses iterations: a group of gradients is sent in later
iterations' forward and backward stages, as its
:class:`~dearopt.schedules.deft.schedule.DeftSchedule` says, and applied at the
``step()`` that completes it.  The iterations of one period differ, so the
prediction is their mean in the steady state.  The walk follows
:class:`dearopt.schedules.deft.rounds.DelayedRounds`:

* forward: at its start the old group's units of the forward stage are sent
  (the link carries one collective at a time, in the order started);
* backward: at its start those are waited for, then the old group's units of
  the backward stage are sent; each unit of the new group this backward sends
  is sent, in the schedule's order, once its bucket's gradients exist; when
  backward ends the rest of them are sent and every bucket's gradient is copied
  into the new group (plus what was held), or, at an iteration whose gradients
  are held, added to the held sums;
* ``step()``: a group the schedule applies now is waited for and costs one
  update of every bucket; the sends of the group formed in this backward (and
  of a group not applied yet) run on into the next forward, where the forward
  stage's sends queue behind them, and the next backward waits for all of them.
  With ``apply="bucket"`` (``deft_apply``, the default) ``step()`` waits for
  nothing: each bucket all of whose units are sent by then is due, and the
  next forward waits for its sends and updates it just before computing it.

Each unit is one all-reduce, or a reduce-scatter and an all-gather (the
reduction the job measured faster); compute loses the CPU an op's bytes take
while it is on the link (the profile's cost per byte of its kind, :func:`dearopt.sim.simulator.cpu_costs`), as in
:mod:`dearopt.sim.simulator`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from dearopt.planning.plan import Plan
from dearopt.schedules.deft.schedule import DeftIteration, DeftSchedule
from dearopt.sim.cost import CommCost
from dearopt.sim.profile import Profile
from dearopt.sim.simulator import Prediction, compute_rate, cpu_costs

__all__ = ["simulate_deft", "schedule_to_json", "schedule_from_json"]

ALL_REDUCE = "all_reduce"
RSAG = "reduce_scatter+all_gather"


class _Clock:
    """One rank's compute stream and the link, in simulated seconds."""

    def __init__(self):
        self.now = 0.0
        self.queue: List[Tuple[int, float, float]] = []  # (op, seconds, compute seconds it takes) started, in order
        self.running: Optional[Tuple[int, float, float, float]] = None  # (op, end, seconds, compute seconds)
        self.done: set = set()
        self._next = 0
        self.busy = 0.0

    def send(self, seconds: float, cpu: float) -> int:
        op = self._next
        self._next += 1
        self.queue.append((op, seconds, cpu))
        self._start()
        return op

    def _start(self) -> None:
        if self.running is None and self.queue:
            op, seconds, cpu = self.queue.pop(0)
            self.running = (op, self.now + seconds, seconds, cpu)

    def _advance(self, until: float) -> None:
        """Move the clock to ``until`` (not past the running op's end), finishing the op if it ends there."""
        if self.running is not None:
            until = min(until, self.running[1])
            self.busy += max(until - self.now, 0.0)
        self.now = max(self.now, until)
        if self.running is not None and self.running[1] <= self.now + 1e-12:
            self.done.add(self.running[0])
            self.running = None
            self._start()

    def work(self, seconds: float, phase: str) -> None:
        """Compute ``seconds`` of work, slower while an op is on the link."""
        left = seconds
        while left > 1e-12:
            rate = 1.0 if self.running is None else compute_rate(1.0, self.running[3], self.running[2])
            end = self.now + left / rate
            start = self.now
            self._advance(end)
            left -= (self.now - start) * rate

    def wait(self, ops: Sequence[int]) -> None:
        while any(op not in self.done for op in ops):
            if self.running is None:
                raise RuntimeError(f"deft simulation stuck waiting for ops {list(ops)}")
            self._advance(self.running[1])


def simulate_deft(
    profile: Profile,
    plan: Plan,
    schedule: DeftSchedule,
    *,
    reduction: str = ALL_REDUCE,
    world: Optional[int] = None,
    comm: Optional[Dict[str, CommCost]] = None,
    periods: int = 3,
    apply: str = "group",
) -> Prediction:
    """Predict ``plan`` (its buckets and pieces: the units) carried out by ``schedule`` on ``world`` ranks; the
    iteration time is the mean over one period in the steady state (after the warm-up and ``periods - 1``
    periods), its parts likewise.  ``apply``: ``deft_apply`` (``"group"`` or ``"bucket"``)."""
    from dearopt.schedules.deft.rounds import deft_times, plan_units

    world = world or plan.world_size
    comm = comm or profile.comm
    units = plan_units(plan)
    if schedule.buckets != len(units):
        raise ValueError(f"the schedule has {schedule.buckets} units, the plan {len(units)}")
    if reduction not in (ALL_REDUCE, RSAG):
        raise ValueError(f"reduction must be {ALL_REDUCE!r} or {RSAG!r}, got {reduction!r}")
    kinds = ("all_reduce",) if reduction == ALL_REDUCE else ("reduce_scatter", "all_gather")
    seconds = [sum(comm[k].time(plan.buckets[b].piece_nbytes(p), world) for k in kinds) for b, p in units]
    costs = cpu_costs(profile)
    taken = [sum(costs[k] * plan.buckets[b].piece_nbytes(p) for k in kinds) for b, p in units]  # compute seconds
    forward_u, _, _ = deft_times(profile, plan, reduction)
    ready_b = [max(profile.ready[p] for p in b.params) for b in plan.buckets]
    bucket_bytes = [b.padded_numel * b.element_size for b in plan.buckets]
    elements = sum(b.grad_numel for b in plan.buckets)
    update = profile.update_per_call * len(plan.buckets) + profile.update_per_element * elements
    clock = _Clock()
    if apply not in ("group", "bucket"):
        raise ValueError(f"apply must be 'group' or 'bucket', got {apply!r}")
    held = False
    in_flight: List[int] = []  # the sends of the group in flight not waited for yet
    # apply="bucket": per group (old: in flight, new: formed in this backward) the op of each unit sent so far and
    # the buckets handed over; per bucket due, the ops its update waits for
    old_ops: Dict[int, int] = {}
    old_due: set = set()
    due: Dict[int, List[List[int]]] = {}  # bucket -> per due sum (two where a step completes two groups'), its ops
    first_unit = {b: min(u for u, (ub, _) in enumerate(units) if ub == b) for b in range(len(plan.buckets))}
    # a module's forward time goes to the first of its parameters' buckets (deft_times); the executor applies the
    # due buckets up to the last of them in that module's pre-hook, before it computes
    bucket_of = {p: b.index for b in plan.buckets for p in b.params}
    reach = list(range(len(plan.buckets)))
    for positions, _ in profile.forward_segments:
        owned = [bucket_of[p] for p in positions if p in bucket_of]
        if owned:
            reach[min(owned)] = max(reach[min(owned)], max(owned))
    unit_bucket = [b for b, _ in units]
    spans: List[Tuple[float, float, float, float, float]] = []  # per iteration: start, backward, step, end, busy
    n_iter = len(schedule.warmup) + periods * len(schedule.period)
    for t in range(n_iter):
        it = schedule.iteration(t)
        start, busy0 = clock.now, clock.busy
        for u in it.forward:
            op = clock.send(seconds[u], taken[u])
            in_flight.append(op)
            old_ops[u] = op
        for u in range(len(units)):
            b = unit_bucket[u]
            if first_unit[b] == u:  # the due updates up to its modules' buckets, each once its sends are done
                for c in sorted(c for c in due if c <= reach[b]):
                    for ops in due.pop(c):
                        clock.wait(ops)
                        clock.work(
                            profile.update_per_call + profile.update_per_element * plan.buckets[c].grad_numel, "forward"
                        )
            clock.work(forward_u[u], "forward")
        backward_at = clock.now
        clock.wait(in_flight)  # the group's sends so far are done before backward's
        in_flight = []
        for u in it.backward_old:
            op = clock.send(seconds[u], taken[u])
            in_flight.append(op)
            old_ops[u] = op
        new_ops: List[int] = []
        new_unit_ops: Dict[int, int] = {}
        order, cursor, done_compute = list(it.backward_new), 0, 0.0
        for b in sorted(range(len(plan.buckets)), key=lambda b: ready_b[b]):
            clock.work(max(ready_b[b] - done_compute, 0.0), "backward")
            done_compute = max(done_compute, ready_b[b])
            ready = {c for c in range(len(plan.buckets)) if ready_b[c] <= done_compute}
            while cursor < len(order) and units[order[cursor]][0] in ready:
                new_ops.append(clock.send(seconds[order[cursor]], taken[order[cursor]]))
                new_unit_ops[order[cursor]] = new_ops[-1]
                cursor += 1
        clock.work(max(profile.t_bp - done_compute, 0.0), "backward")
        for u in order[cursor:]:
            new_ops.append(clock.send(seconds[u], taken[u]))
            new_unit_ops[u] = new_ops[-1]
        # every bucket's gradient copied into the new group (and the held sums added), or added to the held sums
        passes = 2 if held and not it.held else 1
        clock.work(sum(bucket_bytes) * passes * profile.copy_per_byte, "backward")
        held = it.held
        step_at = clock.now
        if apply == "bucket":  # every bucket all of whose units are sent is due; step() waits for nothing
            new_due: set = set()
            for ops, handed in ((old_ops, old_due), (new_unit_ops, new_due)):
                for b in range(len(plan.buckets)):
                    mine = [u for u in range(len(units)) if unit_bucket[u] == b]
                    if b not in handed and all(u in ops for u in mine):
                        handed.add(b)
                        due.setdefault(b, []).append([ops[u] for u in mine])
            if it.applies is not None:
                old_ops, old_due = {}, set()
            if not it.held:  # a group forms only where none is in flight after this step (the executor refuses
                old_ops, old_due = new_unit_ops, new_due  # a schedule that would form one otherwise)
        elif it.applies is not None:  # step() waits for the group it applies, and only for that
            clock.wait(in_flight)
            in_flight = []
            clock.work(update, "backward")
        if not it.held:  # the group formed now is in flight from here on
            in_flight += new_ops
        spans.append((start, backward_at, step_at, clock.now, clock.busy - busy0))
    last = spans[-len(schedule.period) :]
    mean = lambda f: sum(f(s) for s in last) / len(last)  # noqa: E731
    return Prediction(
        iteration=mean(lambda s: s[3] - s[0]),
        forward=mean(lambda s: s[1] - s[0]),
        backward=mean(lambda s: s[2] - s[1]),
        step=mean(lambda s: s[3] - s[2]),
        link_busy=mean(lambda s: s[4]),
        events=[],
    )


def schedule_to_json(schedule: DeftSchedule) -> dict:
    """A :class:`DeftSchedule` as JSON (the benchmark records the one each run solved)."""
    return dataclasses.asdict(schedule)


def schedule_from_json(doc: dict) -> DeftSchedule:
    """The inverse of :func:`schedule_to_json`."""

    def iteration(d):
        return DeftIteration(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    return DeftSchedule(
        buckets=doc["buckets"],
        warmup=tuple(iteration(d) for d in doc["warmup"]),
        period=tuple(iteration(d) for d in doc["period"]),
        mu=doc.get("mu"),
    )
