"""Replay what the executor would do with a plan, in simulated time.

Two resources: the **compute** stream (one rank's forward, backward, the
executor's waits and its optimizer updates) and the **link** (collectives,
one at a time, in the order they were started).  The simulator walks the
compute stream of several iterations exactly as :class:`dearopt.engine.engine.Executor`
acts on the plan:

* forward: before each parameter-owning module, the buckets up to its own
  reach their forward moment: ops due there are waited for, ops that start
  there are started, updates due there cost compute time;
* backward: gradients become ready at the profiled times; a bucket whose
  gradients are all ready lets its reductions start (in plan order, within the
  credit window); at backward end the ops due there are waited for;
* ``step()``: ops due there are waited for, updates due there are applied,
  ops that start there start.

An op starts on the link when every op before it has started, its start
moment has come, the credit window has room (unless it is due now) and the
link is free; it lasts what the profile's alpha-beta fit predicts for the
world size.  While an op is on the link, compute loses the CPU the op takes: the
profile's cost per byte of its kind (:func:`cpu_costs`: one number for reduce-scatters and all-gathers in
both phases, :func:`cpu_per_byte`, and the all-reduces' own where measured; else an all-reduce's bytes count
twice: a ring all-reduce is a reduce-scatter and an all-gather of its buffer) times the op's bytes, spread
over its time on the link (profiles without it: compute runs ``1 + gamma`` times slower, the older factor).
The engine's own passes over gradient memory run on the compute stream too (the profile's ``copy_per_byte``):
each gradient copied into its bucket as it becomes ready, each reduced region averaged (and summed by the
non-finite check) when its op is waited for.  Where the backend runs reduce-scatters and all-gathers as
all-to-alls through a bounded workspace (gloo; ``profile.workspace_bytes``), the host does what it does there
(:func:`workspace_passes`): it fills each all-gather's send buffer when it starts it, sums each reduce-scatter's
received chunks when it waits for it, and an op past the workspace waits, as the executor's issuer has it: one that
is due now (forced) waits on the host for the oldest such op on the link (compute stops meanwhile); any other is
not started where the host polls (a gradient hook, a module's forward, ``step()``): it stays at the head of the
plan's order, with every op behind it, until a later poll finds room (``prophet`` starting its all-gathers at
``step()``: those past the workspace start in the next forward; a reduce-scatter ready while two are still on the
link: at the next bucket's completion).  Several iterations are simulated; the last one is the prediction
(steady state, for schedules whose work crosses iterations).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Dict, Iterator, List, Optional, Tuple

from dearopt.backends.base import workspace_buffer_bytes, workspace_op_bytes
from dearopt.planning.plan import ALL_GATHER, REDUCE_SCATTER, ROWS, Plan, When
from dearopt.sim.cost import CommCost
from dearopt.sim.profile import Profile

__all__ = [
    "Prediction",
    "simulate",
    "op_time",
    "op_bytes",
    "cpu_bytes",
    "compute_rate",
    "cpu_per_byte",
    "cpu_costs",
    "workspace_passes",
    "resolved",
]


@dataclasses.dataclass
class Prediction:
    iteration: float  # seconds per iteration in the steady state
    forward: float  # the phases as the benchmark measures them: zero_grad + forward (waits, updates included),
    backward: float  # loss.backward() (waits at its end included),
    step: float  # optimizer.step()
    link_busy: float  # seconds the link was busy during that iteration
    events: List[dict]  # Chrome trace events of the last iteration (the timeline renderer's format)

    def parts(self) -> Dict[str, float]:
        """The predicted iteration, forward, backward and step times by name, in seconds."""
        return {"iter": self.iteration, "forward": self.forward, "backward": self.backward, "step": self.step}


def op_bytes(profile: Profile, plan: Plan, op, world: int) -> Tuple[str, float]:
    """The collective ``op`` runs and the bytes of its buffer: an embedding's rows are all-gathered (the touched
    rows with their indices), or all-reduced dense where they are not few, as the executor does."""
    if op.kind != ROWS:
        return op.kind, op.nbytes
    bucket = plan.buckets[op.bucket]
    width = max(bucket.row_numel, 1)
    rows_total = bucket.grad_numel // width
    rows = math.ceil(profile.rows_fraction.get(bucket.params[0], 1.0) * rows_total)
    if world * rows * 2 > rows_total:  # the executor falls back to a dense all-reduce
        return "all_reduce", bucket.padded_numel * bucket.element_size
    return "all_gather", world * rows * (width * bucket.element_size + 8)


def cpu_bytes(kind: str, nbytes: float) -> float:
    """The bytes an op of ``kind`` on a buffer of ``nbytes`` costs in CPU, in the units of the profile's
    ``cpu_per_byte`` (measured per buffer byte of reduce-scatters and all-gathers): an all-reduce is both."""
    return 2.0 * nbytes if kind == "all_reduce" else nbytes


def compute_rate(per_byte: float, nbytes: float, seconds: float) -> float:
    """The share of its speed compute keeps while an op of ``nbytes`` CPU bytes (:func:`cpu_bytes`) is on the
    link for ``seconds``: it loses ``per_byte`` seconds per byte, spread over that time; it keeps at least 5 %."""
    taken = per_byte * nbytes / seconds if seconds > 0 else 0.0
    return max(1.0 - taken, 0.05)


def cpu_per_byte(profile: Profile) -> float:
    """The compute seconds a byte of collectives takes, one number for both phases: the CPU a byte costs is the
    machine's and the backend's, not the phase's, so every sample of either phase measures it.  The median of
    all of them (seven per phase): a single sample reads anything from nothing to four times the median (three
    ranks on two cores: 0.09 to 5.47 ns/B in one run's backward), and the two phases' own medians, averaged as
    before, followed whichever phase drew more high samples (that run: 1.22 forward, 2.30 backward, 1.76 used;
    the pooled median 1.27).  Over the 258 stored predictions of 44 bench runs with samples, 233 were within
    10 % of the measured median with the pooled median and 230 with the phases' mean.

    Each sample's value is the loss of the rank that loses most where each rank has a core of its own
    (``profile.cores_per_rank >= 1``): the collectives' CPU lands unevenly (two ranks on two cores lost 0.17
    and 1.14 ns/B in one sample, 0.96 and 0.33 in the next), and ranks that meet at every collective run at
    the pace of the one that lost most, where the samples resolve each rank's own loss (:func:`resolved`: none
    below zero; else timing noise, not the ranks' imbalance, makes the largest, and the ranks' mean is the
    measure).  Where ranks share cores (three on two), or the cores were not
    recorded, the operating system moves the loss between them and the ranks' mean is the measure.  Profiles
    without per-rank samples: the mean of the phases' recorded values, leaving out one that measured nothing
    (a short or noisy phase can hide it: ResNet-50 on an unshaped link measured 0 in backward)."""
    return _pooled(profile, ("forward", "backward"))


def _pooled(profile: Profile, keys) -> float:
    samples = [sample for key in keys for sample in profile.lost_samples.get(key, ()) if sample]
    if not samples:
        values = [v for k, v in profile.cpu_per_byte.items() if k in keys and v > 0]
        return sum(values) / len(values) if values else 0.0
    own = profile.cores_per_rank >= 1 and resolved(samples)
    return max(statistics.median(max(s) if own else sum(s) / len(s) for s in samples), 0.0)


def resolved(samples) -> bool:
    """Whether per-rank loss samples tell each rank's own loss from the timing noise: none is below zero.  A
    rank's phase cannot compute faster because collectives run beside it, so a negative loss is noise at least
    as large as the loss; where the samples show one, the largest rank's value in a sample is as much that
    noise as the rank's loss, and the median of the largest reads the noise as loss (two ranks whose true
    losses are equal, each read with noise of spread ``s``: the larger is ``0.56 s`` high on average).  The
    ranks' mean is unbiased under that noise.  On a loaded 2-core machine (ResNet-50 at 3 Gbit/s, 2026-11-28/29)
    single ranks read -12 to +23 ns/B; the largest per sample read 2.7 and 3.5 ns/B (reduce-scatters and
    all-gathers, all-reduces) where the ranks' mean read 0.3 and 2.4, and the bench's own backward with the
    model's all-reduces beside it, timed on the slowest rank in the same run, lost 2.4 ns/B."""
    return all(v >= 0 for sample in samples for v in sample)


def cpu_costs(profile: Profile) -> Dict[str, float]:
    """Per collective kind, the compute seconds a byte of its buffer takes while the op is on the link.

    Reduce-scatters, all-gathers and broadcasts: :func:`cpu_per_byte`.  All-reduces: what the profile measured of
    them on their own (``cpu_per_byte["all_reduce"]``, from its samples as :func:`cpu_per_byte` takes them) where
    it did: on gloo an all-reduce is gloo's ring, in place, while a reduce-scatter and an all-gather are
    all-to-alls through buffers, and on a 2-core machine the all-reduce took less CPU per byte than the two of
    them together.  Profiles without it: twice :func:`cpu_per_byte` (a ring all-reduce is a reduce-scatter and an
    all-gather of its buffer, :func:`cpu_bytes`)."""
    per_byte = cpu_per_byte(profile)
    costs = {
        kind: per_byte * cpu_bytes(kind, 1.0) for kind in ("reduce_scatter", "all_gather", "all_reduce", "broadcast")
    }
    if profile.lost_samples.get("all_reduce") or "all_reduce" in profile.cpu_per_byte:
        costs["all_reduce"] = _pooled(profile, ("all_reduce",))
    return costs


def workspace_passes(profile: Profile, kind: str, nbytes: float, world: int) -> float:
    """Seconds of the host's own pass over an op's buffer where the backend runs it as an all-to-all through its
    workspace (``profile.workspace_bytes`` > 0, gloo): an all-gather's send buffer filled with ``world`` copies
    of the shard when it starts, a reduce-scatter's ``world`` received chunks summed into the shard when it is
    waited for.  Either moves the buffer once one way and a ``1 / world`` share of it the other: ``(1 + 1 /
    world) / 2`` of a copy of ``nbytes``.  0 for other ops, and where there is no such workspace."""
    if not profile.workspace_bytes or kind not in (REDUCE_SCATTER, ALL_GATHER) or world <= 1:
        return 0.0
    if kind == ALL_GATHER and world == 2:  # two ranks: the shard itself is sent, no buffer to fill (since 2026-11-29)
        return 0.0
    return nbytes * profile.copy_per_byte * (1.0 + 1.0 / world) / 2.0


def op_time(profile: Profile, plan: Plan, op, world: int, comm: Dict[str, CommCost]) -> float:
    """Seconds ``op`` keeps the link busy."""
    if world <= 1:
        return 0.0
    kind, nbytes = op_bytes(profile, plan, op, world)
    if op.kind == ROWS:  # the rows' indices and counts go first, one more fixed cost
        return comm["all_gather"].alpha + comm[kind].time(nbytes, world)
    return comm[kind].time(nbytes, world)


class _Link:
    def __init__(self, durations: List[float], credit: Optional[int], nbytes: List[int]):
        self.durations = durations
        self.nbytes = nbytes
        self.credit = credit
        self.issued: List[float] = []  # issue time per op (in order)
        self.done: Dict[int, float] = {}  # op -> completion time
        self.queue: List[int] = []  # issued, not yet finished, in order
        self.busy_until = 0.0
        self.running: Optional[int] = None
        self.start_times: Dict[int, float] = {}

    @property
    def cursor(self) -> int:
        return len(self.issued)

    def inflight_bytes(self) -> int:
        return sum(self.nbytes[i] for i in self.queue)

    def issue(self, i: int, now: float) -> None:
        self.issued.append(now)
        self.queue.append(i)
        self._advance(now)

    def _advance(self, now: float) -> None:
        if self.running is None and self.queue and self.queue[0] not in self.start_times:
            i = self.queue[0]
            self.running = i
            self.start_times[i] = now
            self.busy_until = now + self.durations[i]

    def next_event(self) -> float:
        return self.busy_until if self.running is not None else math.inf

    def finish(self, now: float) -> int:
        i = self.running
        self.done[i] = now
        self.queue.pop(0)
        self.running = None
        self._advance(now)
        return i

    @property
    def busy(self) -> bool:
        return self.running is not None


def simulate(
    profile: Profile,
    plan: Plan,
    *,
    world: Optional[int] = None,
    comm: Optional[Dict[str, CommCost]] = None,
    iterations: int = 3,
    contention: Optional[Dict[str, float]] = None,
) -> Prediction:
    """Predict ``plan``'s iteration on ``world`` ranks (default: the plan's) from ``profile``."""
    world = world or plan.world_size
    comm = comm or profile.comm
    gamma = profile.contention if contention is None else contention
    costs = cpu_costs(profile) if contention is None and profile.cpu_per_byte else None
    ops = plan.ops
    durations = [op_time(profile, plan, op, world, comm) for op in ops]
    buffers = [op_bytes(profile, plan, op, world) for op in ops]
    taken = [costs[kind] * n for kind, n in buffers] if costs else []  # compute seconds each op takes
    # the backend's workspace (gloo): the ops that hold a buffer of it while in flight, and the host's pass over
    # each one's buffer (an all-gather's at its start, a reduce-scatter's at its wait)
    workspace = profile.workspace_bytes if world > 1 else 0.0
    held = [workspace_op_bytes(kind, n, world) if workspace else 0.0 for kind, n in buffers]
    largest = max((n for n in held if n <= workspace), default=0.0)  # the buffer size that serves the buckets
    held = [workspace_buffer_bytes(n, largest, workspace) if n else 0.0 for n in held]
    passes = [workspace_passes(profile, op.kind, op.nbytes, world) for op in ops]
    owner = {}
    for b in plan.buckets:
        for p in b.params:
            owner[p] = b.index
    members = [sum(plan.params[p].numel for p in b.params if plan.params[p].twin_of is None) for b in plan.buckets]
    update_cost = [profile.update_per_call + profile.update_per_element * n if n else 0.0 for n in members]
    due: Dict[Tuple, List[int]] = {}
    updates: Dict[Tuple, List[int]] = {}
    for i, op in enumerate(ops):
        due.setdefault((op.due.when, op.due.index), []).append(i)
        if op.update is not None:
            updates.setdefault((op.update.when, op.update.index), []).append(op.bucket)

    clock = [0.0]
    events: List[dict] = []
    marks: Dict[str, float] = {}
    link_busy_total = [0.0]

    state = {"ready": set(), "backward_done": False, "stepped": False, "reached": -1, "link": None}

    def may_start(i: int, forced: bool) -> bool:
        op, link = ops[i], state["link"]
        start = op.start
        if not forced:
            if start.when is When.GRADS_READY and not (state["backward_done"] or op.bucket in state["ready"]):
                return False
            if start.when is When.BACKWARD_END and not state["backward_done"]:
                return False
            if start.when is When.STEP and not state["stepped"]:
                return False
            if start.when is When.FORWARD and state["reached"] < start.index:
                return False
            if link.credit is not None and link.queue and link.inflight_bytes() + ops[i].nbytes > link.credit:
                return False
            if held[i] and sum(held[j] for j in link.queue) + held[i] > max(workspace, held[i]):
                return False  # the executor never waits for the workspace in a hook: the op waits for a later poll
        if start.when is When.AFTER and start.index not in link.done:
            return False
        return True

    def pump(force_through: int = -1, phase: str = "backward") -> None:
        link = state["link"]
        while link.cursor < len(ops) and may_start(link.cursor, link.cursor <= force_through):
            i = link.cursor
            make_room(i, phase)
            link.issue(i, clock[0])
            if ops[i].kind == ALL_GATHER:  # the host fills its send buffer as it starts it
                work(passes[i], "fill all_gather", phase)

    summed: set = set()

    def host_sum(i: int, phase: str) -> None:
        """The host sums a reduce-scatter's received chunks the first time it waits for it."""
        if ops[i].kind == REDUCE_SCATTER and i not in summed:
            summed.add(i)
            work(passes[i], "sum reduce_scatter", phase)

    def wait_span(name: str, start: float) -> None:
        """A timeline span for the host's wait from ``start`` to now (none where it did not wait)."""
        if clock[0] > start:
            events.append(
                {
                    "name": name,
                    "cat": "wait",
                    "ph": "X",
                    "tid": 0,
                    "ts": start * 1e6,
                    "dur": (clock[0] - start) * 1e6,
                    "args": {},
                }
            )

    def make_room(i: int, phase: str) -> None:
        """Before the host starts op ``i``: past the backend's workspace it waits for the oldest op holding a
        buffer of it until there is room (compute stops meanwhile).  Only an op due now gets here past the
        workspace (:func:`may_start` holds back any other, as the executor never waits for room in a hook)."""
        if not held[i]:
            return
        link = state["link"]
        room = max(workspace, held[i])
        start = clock[0]
        while sum(held[j] for j in link.queue) + held[i] > room:
            oldest = next(j for j in link.queue if held[j])
            while oldest not in link.done:
                advance(link.next_event(), phase)
            host_sum(oldest, phase)
        wait_span("wait workspace", start)

    def slowdown(phase: str) -> float:
        """How many times slower compute runs now: while an op is on the link, it loses the CPU the op's bytes
        take (:func:`cpu_costs` times its bytes, spread over its time on the link; compute keeps at least 5 %),
        or, for profiles without ``cpu_per_byte``, runs ``1 + gamma`` times slower."""
        link = state["link"]
        if not link.busy:
            return 1.0
        if costs:
            i = link.running
            return 1.0 / compute_rate(1.0, taken[i], durations[i])
        return 1.0 + gamma.get(phase, 0.0)

    def advance(until: float, phase: str, waiting: bool = False) -> float:
        """Run the clock to ``until`` or to the link's next event, whichever is first; return the compute
        progress made meanwhile (slower while the link is busy).  Only the host starts ops: while it computes,
        an op that finishes lets none start (an op needing its result, or credit it frees, waits for the next
        gradient hook, module or wait, as the executor polls); while it waits (``waiting``), it does."""
        link = state["link"]
        step_end = min(until, link.next_event())
        rate = 1.0 / slowdown(phase)
        span = max(step_end - clock[0], 0.0)
        if link.busy:
            link_busy_total[0] += span
        clock[0] = max(clock[0], step_end)
        if link.busy and link.next_event() <= clock[0] + 1e-12:
            i = link.finish(clock[0])
            events.append(
                {
                    "name": ops[i].kind,
                    "cat": "comm",
                    "ph": "X",
                    "tid": 1,
                    "ts": link.start_times[i] * 1e6,
                    "dur": (clock[0] - link.start_times[i]) * 1e6,
                    "args": {"bucket": ops[i].bucket, "piece": ops[i].piece},
                }
            )
            if waiting:
                pump()  # the host, waiting, completes this op: an op after it (its dependency, or credit) may go
        return span * rate

    def work(seconds: float, name: str, phase: str) -> None:
        start = clock[0]
        remaining = seconds
        while remaining > 1e-12:
            rate = 1.0 / slowdown(phase)
            remaining -= advance(clock[0] + remaining / rate, phase)
        if seconds > 0:
            events.append(
                {
                    "name": name,
                    "cat": "compute",
                    "ph": "X",
                    "tid": 0,
                    "ts": start * 1e6,
                    "dur": (clock[0] - start) * 1e6,
                    "args": {},
                }
            )

    averaged: set = set()

    def average(indices: List[int]) -> None:
        """The executor averages each reduced region once its op is waited for (one pass over those bytes, as a
        copy) and its non-finite check sums it (a read: half a copy's work)."""
        for i in indices:
            if i in averaged or not ops[i].average or ops[i].kind == ROWS:
                continue
            averaged.add(i)
            share = ops[i].nbytes / world if ops[i].kind == REDUCE_SCATTER else ops[i].nbytes
            work(1.5 * share * profile.copy_per_byte, "average", "backward")

    def wait_for(indices: List[int], name: str) -> None:
        if not indices:
            return
        pump(force_through=max(indices))
        start = clock[0]
        link = state["link"]
        while any(i not in link.done for i in indices):
            if not link.busy:  # nothing on the link can finish what we wait for: a dependency must start
                pump(force_through=max(indices))
                if not link.busy:
                    raise RuntimeError(f"simulation stuck waiting for ops {indices} at {clock[0]:.4f}s")
            advance(link.next_event(), "backward", waiting=True)
        wait_span(name, start)
        for i in indices:
            host_sum(i, "backward")
        average(indices)

    def apply_updates(key: Tuple, phase: str) -> None:
        for b in sorted(updates.get(key, ())):
            work(update_cost[b], "update", phase)

    def reach(target: int) -> None:
        while state["stepped"] and state["reached"] < target:
            k = state["reached"] + 1
            wait_for(due.get((When.FORWARD, k), []), "wait all_gather")
            state["reached"] = k
            pump(phase="forward")
            apply_updates((When.FORWARD, k), "forward")

    def iteration(n: int) -> Iterator[None]:
        marks[f"start{n}"] = clock[0]
        # forward
        for positions, seconds in profile.forward_segments:
            work(seconds, "forward", "forward")
            if positions:
                reach(max(owner[p] for p in positions))
        work(profile.forward_tail, "forward", "forward")
        reach(len(plan.buckets) - 1)  # buckets the forward did not reach: applied before the next backward
        marks[f"backward{n}"] = clock[0]
        # backward: a new round of the plan's ops (the last round's were all due by the end of this forward)
        state["link"] = _Link(durations, plan.credit, [op.nbytes for op in ops])
        state.update(ready=set(), backward_done=False, stepped=False, reached=-1)
        averaged.clear()
        summed.clear()
        remaining = {b.index: set(b.params) for b in plan.buckets}
        previous = 0.0
        for p in sorted(range(len(plan.params)), key=lambda q: profile.ready[q]):
            work(max(profile.ready[p] - previous, 0.0), "backward", "backward")
            previous = max(previous, profile.ready[p])
            work(plan.params[p].nbytes * profile.copy_per_byte, "backward", "backward")  # into its bucket
            b = owner[p]
            remaining[b].discard(p)
            if not remaining[b]:
                state["ready"].add(b)
                pump()
        work(max(profile.t_bp - previous, 0.0), "backward", "backward")
        wait_for(due.get((When.BACKWARD_END, None), []), "wait reduce")
        state["backward_done"] = True
        pump()
        marks[f"step{n}"] = clock[0]
        wait_for(due.get((When.STEP, None), []), "wait reduce")
        state["stepped"] = True
        apply_updates((When.STEP, None), "backward")
        pump()
        marks[f"end{n}"] = clock[0]
        yield

    state["link"] = _Link(durations, plan.credit, [op.nbytes for op in ops])
    first_events, busy_before = 0, 0.0
    for n in range(max(iterations, 2)):
        first_events, busy_before = len(events), link_busy_total[0]
        for _ in iteration(n):
            pass
    last = max(iterations, 2) - 1
    t0, tb, ts, te = marks[f"start{last}"], marks[f"backward{last}"], marks[f"step{last}"], marks[f"end{last}"]
    shown = [dict(e, ts=e["ts"] - t0 * 1e6) for e in events[first_events:]]
    return Prediction(
        iteration=te - t0,
        forward=tb - t0,
        backward=ts - tb,
        step=te - ts,
        link_busy=link_busy_total[0] - busy_before,
        events=shown,
    )
