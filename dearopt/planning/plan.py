"""The planner: from a model profile and knobs to a communication plan.

Pure functions, free of ``torch.distributed``: the same profile and knobs give
the same plan on every rank, so collectives, which are matched by the order in
which ranks start them, line up.  Nothing here depends on timing.

A *profile* lists the trainable parameters in forward execution order
(:class:`ParamSpec`).  The plan fuses them into :class:`Bucket` s of at most
``buffer_size`` bytes.  Buckets are filled from the output side (the order in
which backward produces gradients), so the last bucket in forward order, the
first whose all-gather the next forward needs, holds the remainder and is the
smallest: the FeedPipe starts sooner.

Each bucket's flat buffer is laid out as::

    [ gradients | one "used" flag per parameter | one step tag per rank | padding ]

The flags and tags travel with the gradients (no extra message) and are summed,
not averaged: after the reduction every rank sees how many ranks produced a
gradient for each parameter, and each rank's step tag in its own slot, so ranks
that are at different steps are caught before their gradients are mixed.  The
buffer is padded to a multiple of the world size for reduce-scatter.

The plan is the whole contract between a schedule and the executor.  Its
:class:`CommOp` s are listed in the one order in which every rank starts them;
each says when it may start (:attr:`CommOp.start`), when its result must be
there (:attr:`CommOp.due`), and what completing it does (average its result
region, then, for the last op of a bucket, apply that bucket's optimizer
update).  Which schedule produced the ops is recorded for people, not for the
executor: it never asks.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from typing import FrozenSet, List, Optional, Sequence, Tuple, Union

from dearopt.backends.base import padded_numel

__all__ = [
    "ParamSpec",
    "Bucket",
    "When",
    "Point",
    "CommOp",
    "Plan",
    "priority_sequence",
    "parse_size",
    "padded_numel",
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_FIRST_BUCKET_SIZE",
    "REDUCE_SCATTER",
    "ALL_GATHER",
    "ALL_REDUCE",
    "ROWS",
]

DEFAULT_BUFFER_SIZE = 25 * 2**20
"""25 MiB: PyTorch DDP's default bucket size and the DeAR paper's first trial."""

DEFAULT_FIRST_BUCKET_SIZE = 2**20
"""1 MiB: DDP's first bucket; the first reduction starts as soon as the last layers' gradients exist."""

REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE = "reduce_scatter", "all_gather", "all_reduce"
ROWS = "all_gather_rows"
"""Every rank's touched rows (and the bucket's tail) all-gathered and summed: a full, dense result."""

_UNITS = {"": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}


def parse_size(size: Union[int, float, str]) -> int:
    """Bytes from an int or a string such as ``"25MB"`` or ``"1.5 GiB"`` (binary units)."""
    if isinstance(size, bool):
        raise TypeError(f"a size must be bytes or a string like '25MB', got {size!r}")
    if isinstance(size, (int, float)):
        value = int(size)
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read size {size!r}; write bytes or e.g. '25MB', '512KB', '1GB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(f"a size must be bytes or a string like '25MB', got {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"a size must be positive, got {size!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as the planner sees it.

    ``twin_of``: this is not a parameter of the optimizer but the second use of
    the parameter at that position (a tied weight, e.g. a decoder sharing the
    word embedding), whose gradient arrives separately and is added to the
    parameter's before its update.  ``row_numel``: the parameter's gradient has
    nonzero rows only where an embedding lookup touched it (rows of this many
    elements), so it may be reduced as those rows instead of densely.
    """

    name: str
    numel: int
    dtype: str  # e.g. "float32"
    element_size: int
    twin_of: Optional[int] = None
    row_numel: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Parameters communicated together (the unit of fusion)."""

    index: int
    params: Tuple[int, ...]  # positions in the profile, in forward order
    offsets: Tuple[int, ...]  # element offset of each parameter's gradient in the buffer
    dtype: str
    grad_numel: int  # elements holding gradients
    padded_numel: int  # buffer length: gradients + flags + tags + padding, a multiple of the world size
    world_size: int = 1
    pieces: Tuple[Tuple[int, int], ...] = ()  # partitions [start, end) of the buffer, each a multiple of the world size
    element_size: int = 4
    row_numel: int = 0  # > 0: the bucket holds one row-sparse parameter (ParamSpec.row_numel)
    twin_of: Optional[int] = None  # the bucket holds the twin of the parameter at this position

    @property
    def flags_offset(self) -> int:
        return self.grad_numel

    @property
    def tags_offset(self) -> int:
        return self.grad_numel + len(self.params)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def piece_nbytes(self, piece: int) -> int:
        start, end = self.pieces[piece]
        return (end - start) * self.element_size


class When(enum.Enum):
    """Moments of a training iteration that a plan refers to."""

    GRADS_READY = "grads ready"
    """Every gradient of the op's bucket has been computed (every bucket counts as ready once backward ends)."""
    BACKWARD_END = "backward end"
    """The communicating backward pass has ended."""
    STEP = "step"
    """``step()`` was called."""
    FORWARD = "forward"
    """The next forward is about to run the first module of bucket ``Point.index``."""
    AFTER = "after"
    """The op at plan position ``Point.index`` has completed."""


@dataclasses.dataclass(frozen=True)
class Point:
    """A moment of the iteration: :class:`When`, with the bucket (FORWARD) or op position (AFTER) it names."""

    when: When
    index: Optional[int] = None

    def __post_init__(self):
        if (self.index is None) != (self.when not in (When.FORWARD, When.AFTER)):
            raise ValueError(f"{self.when} {'needs' if self.index is None else 'takes no'} index")

    def __str__(self) -> str:
        if self.when is When.FORWARD:
            return f"forward of bucket {self.index}"
        if self.when is When.AFTER:
            return f"after op {self.index}"
        return self.when.value


GRADS_READY, BACKWARD_END, STEP = Point(When.GRADS_READY), Point(When.BACKWARD_END), Point(When.STEP)


def forward_of(bucket: int) -> Point:
    return Point(When.FORWARD, bucket)


def after(position: int) -> Point:
    return Point(When.AFTER, position)


@dataclasses.dataclass(frozen=True)
class CommOp:
    """One collective of the plan, on one piece (partition) of one bucket.

    The executor starts ops strictly in plan order; an op starts once its
    ``start`` moment has come and every op before it has started.  At its
    ``due`` moment the executor waits for it and completes it: the result
    region (the rank's shard for a reduce-scatter, the whole piece otherwise)
    is divided by the world size if ``average``.  The last op of each bucket
    names in ``update`` the moment (its due moment or later) at which the
    bucket's optimizer update is applied.
    """

    kind: str  # REDUCE_SCATTER, ALL_GATHER or ALL_REDUCE
    bucket: int
    piece: int
    nbytes: int
    start: Point = GRADS_READY
    due: Point = STEP
    average: bool = False
    update: Optional[Point] = None

    @property
    def result(self) -> str:
        """Where the op leaves its result: ``"shard"`` (reduce-scatter) or ``"full"``."""
        return "shard" if self.kind == REDUCE_SCATTER else "full"

    @property
    def reduces(self) -> bool:
        return self.kind != ALL_GATHER

    def __str__(self) -> str:
        extra = (" average" if self.average else "") + (f", update at {self.update}" if self.update else "")
        return (
            f"{self.kind} b{self.bucket}.{self.piece} ({self.nbytes} B) start at {self.start}, due at {self.due}{extra}"
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    world_size: int
    buffer_size: int
    params: Tuple[ParamSpec, ...]
    buckets: Tuple[Bucket, ...]
    ops: Tuple[CommOp, ...]
    partition_size: Optional[int] = None
    priority: bool = False
    credit: Optional[int] = None
    comm_hook: str = "none"
    first_bucket_size: Optional[int] = None
    allreduce: Tuple[int, ...] = ()  # buckets all-reduced in backward (dear)
    sharded_update: bool = False  # each rank updates its shard at step(); the all-gathers carry parameters

    @property
    def first_ops(self) -> Tuple[CommOp, ...]:
        """The reductions (reduce-scatter or all-reduce), in issue order."""
        return tuple(op for op in self.ops if op.reduces)

    @property
    def gather_ops(self) -> Tuple[CommOp, ...]:
        """The all-gathers, in issue order."""
        return tuple(op for op in self.ops if not op.reduces)

    @property
    def backward_order(self) -> Tuple[int, ...]:
        """Buckets in the order backward completes them."""
        return tuple(reversed(range(len(self.buckets))))

    def update_points(self) -> List[Point]:
        """For each bucket, the moment its optimizer update is applied."""
        points: List[Optional[Point]] = [None] * len(self.buckets)
        for op in self.ops:
            if op.update is not None:
                points[op.bucket] = op.update
        return points

    def fingerprint(self) -> int:
        """A 63-bit hash of everything that must agree across ranks."""
        text = repr(
            (
                self.schedule,
                self.world_size,
                self.buffer_size,
                self.partition_size,
                self.priority,
                self.credit,
                self.comm_hook,
                self.first_bucket_size,
                self.allreduce,
                self.sharded_update,
                [(p.name, p.numel, p.dtype, p.twin_of, p.row_numel) for p in self.params],
                [(b.params, b.padded_numel, b.pieces) for b in self.buckets],
                self.ops,
            )
        )
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def describe(self, ops: bool = False) -> str:
        """A human-readable summary: the schedule, world size and buffer size, one line per bucket (its size, dtype and
        first parameters), and with ``ops=True`` one line per op in issue order."""
        lines = [
            f"plan: schedule={self.schedule} world={self.world_size} buffer={self.buffer_size} B, "
            f"{len(self.buckets)} buckets, {len(self.ops)} ops"
            + (", sharded update (the all-gathers carry parameters)" if self.sharded_update else "")
        ]
        for b in self.buckets:
            names = [self.params[p].name for p in b.params]
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} params)" if len(names) > 3 else "")
            lines.append(f"  bucket {b.index}: {b.grad_numel} x {b.dtype} [{shown}]")
        if ops:
            lines += [f"  op {i}: {op}" for i, op in enumerate(self.ops)]
        return "\n".join(lines)


def priority_sequence(
    ops: Sequence[CommOp], ready: Sequence[float], bandwidth: float, latency: float = 0.0
) -> List[CommOp]:
    """ByteScheduler's order, decided once from a profile instead of negotiated every iteration.

    Simulates one link: whenever it is free, the highest-priority op whose
    gradient is ready (``ready[op.bucket]`` seconds after backward starts) goes
    next; priority is the forward order (bucket, then piece).  The result is a
    fixed sequence: every rank computes the same one from the same profile.
    """
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    remaining = list(ops)
    sequence: List[CommOp] = []
    clock = 0.0
    while remaining:
        available = [op for op in remaining if ready[op.bucket] <= clock]
        if not available:
            clock = min(ready[op.bucket] for op in remaining)
            continue
        op = min(available, key=lambda o: (o.bucket, o.piece))
        remaining.remove(op)
        sequence.append(op)
        clock += latency + op.nbytes / bandwidth
    return sequence


def _pieces(padded: int, world: int, element_size: int, partition_size: Optional[int]) -> Tuple[Tuple[int, int], ...]:
    if partition_size is None:
        return ((0, padded),)
    step = max(world, (partition_size // element_size) // world * world)
    return tuple((start, min(start + step, padded)) for start in range(0, padded, step))


def _special(spec: ParamSpec) -> bool:
    """A twin or a row-sparse parameter: always a bucket of its own."""
    return spec.twin_of is not None or spec.row_numel > 0


def must_split(params: Sequence[ParamSpec], pos: int) -> bool:
    """Whether a bucket boundary is required between positions ``pos`` and ``pos + 1`` (a twin or a row-sparse
    parameter on either side, or a change of dtype)."""
    a, b = params[pos], params[pos + 1]
    return _special(a) or _special(b) or a.dtype != b.dtype


def split_points(params: Sequence[ParamSpec]) -> List[int]:
    """Every ``pos`` with :func:`must_split` ``(params, pos)``, in order: the same answers in one pass (a re-plan
    asks for every position; one call each is Python's cost per parameter on the step that re-plans)."""
    special = [p.twin_of is not None or p.row_numel > 0 for p in params]
    return [
        pos
        for pos in range(len(params) - 1)
        if special[pos] or special[pos + 1] or params[pos].dtype != params[pos + 1].dtype
    ]


def layout_buckets(
    params: Sequence[ParamSpec],
    buffer_size: int,
    world_size: int,
    partition_size: Optional[int] = None,
    first_bucket_size: Optional[int] = None,
    groups: Optional[Sequence[Sequence[int]]] = None,
) -> Tuple[Bucket, ...]:
    """Fuse ``params`` (forward order) into buckets of at most ``buffer_size`` bytes, filled from the output side.

    The first bucket filled (the output side, whose gradients backward produces
    first) holds at most ``first_bucket_size`` bytes, so that the first
    reduction starts early in backward (DDP does the same with 1 MB).  A twin
    or a row-sparse parameter (see :class:`ParamSpec`) has a bucket of its own.
    ``groups`` (contiguous runs of positions covering every parameter in
    forward order, e.g. Prophet's blocks) replaces the fusion by size.
    """
    if groups is not None:
        flat = [pos for g in groups for pos in g]
        if flat != list(range(len(params))) or any(not g for g in groups):
            raise ValueError("bucket groups must be non-empty contiguous runs covering every parameter in order")
        cut = split_points(params)
        last = {g[-1] for g in groups}  # a required boundary must be one of the groups' ends
        for pos in cut:
            if pos not in last:
                g = next(g for g in groups if g[0] <= pos < g[-1])
                raise ValueError(
                    f"bucket group {list(g)} mixes dtypes or holds a twin or row-sparse parameter with others"
                )
        return _buckets_of(params, [list(g) for g in groups], world_size, partition_size)
    groups: List[List[int]] = []
    current: List[int] = []
    current_bytes = 0
    cut = set(split_points(params))
    for pos in reversed(range(len(params))):
        spec = params[pos]
        nbytes = spec.numel * spec.element_size
        cap = buffer_size if groups or first_bucket_size is None else min(buffer_size, first_bucket_size)
        if current and (current_bytes + nbytes > cap or pos in cut):  # pos + 1 is current's
            groups.append(current)
            current, current_bytes = [], 0
        current.append(pos)
        current_bytes += nbytes
    groups.append(current)
    groups.reverse()
    return _buckets_of(params, groups, world_size, partition_size)


def _buckets_of(
    params: Sequence[ParamSpec], groups: List[List[int]], world_size: int, partition_size: Optional[int]
) -> Tuple[Bucket, ...]:
    buckets = []
    for index, members in enumerate(groups):
        members = sorted(members)
        offsets, offset = [], 0
        for pos in members:
            offsets.append(offset)
            offset += params[pos].numel
        padded = padded_numel(offset + len(members) + world_size, world_size)
        element = params[members[0]].element_size
        first = params[members[0]]
        pieces = ((0, padded),) if _special(first) else _pieces(padded, world_size, element, partition_size)
        buckets.append(
            Bucket(
                index=index,
                params=tuple(members),
                offsets=tuple(offsets),
                dtype=first.dtype,
                grad_numel=offset,
                padded_numel=padded,
                world_size=world_size,
                pieces=pieces,
                element_size=element,
                row_numel=first.row_numel,
                twin_of=first.twin_of,
            )
        )
    return tuple(buckets)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a schedule builds its ops from: the buckets and the order of the reductions."""

    buckets: Tuple[Bucket, ...]
    reduction_order: Tuple[Tuple[int, int], ...]  # (bucket, piece) in the order the reductions start
    credit: Optional[int]
    allreduce: FrozenSet[int] = frozenset()  # buckets to all-reduce in backward (dear), see allreduce_buckets
    gathers_at_step: bool = False  # dear: every all-gather starts at step(), back to back (as Prophet's)


def allreduce_buckets(
    buckets: Sequence[Bucket],
    rule: Union[float, str, Sequence[int]],
    ready_times: Optional[Sequence[float]],
    bandwidth: Optional[float],
    latency: Optional[float] = None,
    phases: Optional[Tuple[float, float]] = None,
) -> FrozenSet[int]:
    """Which buckets ``dear`` all-reduces in backward instead of reduce-scattering them (twins and rows aside).

    An all-reduce moves the bytes of a reduce-scatter and an all-gather in one
    collective, which costs less CPU than the two, and needs no gather in the
    next forward; it pays where the link has room during backward.

    * a fraction: the buckets from the output side holding that fraction of the bytes;
    * bucket indices (a tuple or set, e.g. a plan's ``allreduce`` that ran): those buckets;
    * ``"auto"`` or ``"predicted"`` (the same here; the executor measures ``"auto"``'s choice against
      others, see :meth:`dearopt.engine.engine.Executor.plan_choices`): from a profile (each parameter's ``ready_times``
      after backward starts, the link's ``bandwidth`` in bytes/s for a reduce-scatter and its fixed ``latency`` in
      seconds per op):
      walking the buckets in the order backward completes
      them, a bucket is all-reduced (twice a reduce-scatter's time) while the
      link, which carries one op at a time, still finishes *every* reduction
      of backward (the all-reduces and the remaining buckets' reduce-scatters,
      which ``step()`` waits for) no later than it would with reduce-scatters
      only.  So all-reduces fill the link's idle
      time in backward and never lengthen the wait at ``step()``; where the
      reduce-scatters alone keep the link busy (communication-bound), every
      bucket is DeAR's.  Without a profile, none.

      With ``phases`` (the forward's computation and the backward's, in
      seconds, as profiled) the rule balances the link between the two phases
      instead: moving a bucket from DeAR's plan to an all-reduce moves its
      all-gather from the next forward into this backward.  Walking the same
      order, each prefix ``S`` of all-reduced buckets is judged by Eq. 7
      generalised, ``max(forward, gathers left) + max(backward, link end in
      backward)``; the shortest wins.  Among those within 1 % of it: where some
      leave both phases room (each phase's compute at least its link time),
      the one with the most all-reduces among those (one collective instead
      of two, nothing waits in forward); else the one with the most room on
      its tighter side (contention on shared cores lengthens both).  Where the
      forward computes less than the gathers take (ResNet-50 at 3 Gbit/s:
      0.17 s against 0.28 s, backward 0.35 s against 0.28 s of
      reduce-scatters) this all-reduces the buckets that fill backward's room,
      which the idle-time rule cannot see; where the link is idle (an unshaped
      link) it all-reduces every bucket; where the link is the bottleneck it
      balances the two phases' shortfall.
    """
    plain = [b for b in buckets if not b.row_numel and b.twin_of is None]
    if isinstance(rule, (tuple, list, set, frozenset)):  # the buckets themselves (a plan that ran, replayed)
        wrong = sorted(set(rule) - {b.index for b in plain})
        if wrong:
            raise ValueError(
                f"allreduce names buckets {wrong}, which are not plain buckets of this layout ({len(buckets)} buckets)"
            )
        return frozenset(rule)
    if rule in ("auto", "predicted"):
        if not ready_times or not bandwidth:
            return frozenset()
        # the link in backward also carries each twin's reduce-scatter and its all-gather right after it (a tied
        # decoder's gradient: large, and ready early); row-sparse buckets move few bytes and are left out
        order = [
            (
                max(ready_times[p] for p in b.params),
                b.index,
                (latency or 0.0) + b.padded_numel * b.element_size / bandwidth,
                b.twin_of is not None,
            )
            for b in reversed(buckets)
            if not b.row_numel
        ]

        def link_end(whole) -> float:
            link = 0.0
            for ready, index, rs_time, twin in order:
                link = max(link, ready) + (2 if twin or index in whole else 1) * rs_time
            return link

        if phases is not None:
            return _balanced(order, link_end, phases)
        # not the profiled backward's length: that step often runs slower than steady state (first touches), and
        # a longer limit would admit all-reduces that lengthen every later step's wait
        limit = link_end(())
        chosen: set = set()
        for _, index, _, twin in order:
            if twin:
                continue
            if link_end(chosen | {index}) > limit + 1e-12:
                break
            chosen.add(index)
        return frozenset(chosen)
    fraction = float(rule)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"allreduce must be a fraction in [0, 1] or 'auto', got {rule!r}")
    total = sum(b.grad_numel * b.element_size for b in plain)
    chosen, covered = set(), 0
    for b in reversed(plain):
        if fraction == 0.0 or covered >= fraction * total - 1e-9:
            break
        chosen.add(b.index)
        covered += b.grad_numel * b.element_size
    return frozenset(chosen)


def _balanced(order, link_end, phases: Tuple[float, float]) -> FrozenSet[int]:
    """``allreduce_buckets``'s rule with the phases' computation times: the prefix of ``order`` (output side
    first; twins are always all-reduced) that balances the link between the next forward's gathers and this
    backward's reductions (see its docstring)."""
    forward, backward = phases
    plain = [(index, rs_time) for _, index, rs_time, twin in order if not twin]
    options = []
    for k in range(len(plain) + 1):
        chosen = frozenset(index for index, _ in plain[:k])
        gathers = sum(rs_time for _, rs_time in plain[k:])  # an all-gather moves a reduce-scatter's bytes
        reductions = link_end(chosen)
        total = max(forward, gathers) + max(backward, reductions)
        options.append((total, min(forward - gathers, backward - reductions), chosen))
    best = min(total for total, _, _ in options)
    near = [o for o in options if o[0] <= 1.01 * best]
    roomy = [o for o in near if o[1] >= 0]
    if roomy:  # both phases have room: the most all-reduces (one collective instead of two, no forward waits)
        return roomy[-1][2]
    return max(near, key=lambda o: o[1])[2]  # the most room on the tighter side (the first of equals)


def _tied_and_rows(ops: Sequence[CommOp], buckets: Sequence[Bucket]) -> Tuple[CommOp, ...]:
    """The ops of twin and row-sparse buckets, the same under every schedule.

    * A row-sparse bucket (an embedding's weight) is reduced by one ``ROWS``
      op where the schedule's first reduction of it was: every rank's touched
      rows are all-gathered and summed, which leaves the whole averaged gradient
      on every rank (no all-gather needed).  It is due at backward end if the
      schedule's ops of that bucket were, else at ``step()``; the bucket's
      update stays where the schedule put it.
    * A twin bucket (the second use of that weight, e.g. a tied decoder) must be
      averaged in full before the weight's update, which adds the two: each of
      its reductions is one all-reduce where the schedule put it (a
      reduce-scatter with an all-gather right after it moves the same bytes in
      two ops, measured 2-5 % slower per BERT-Base iteration on two cores), and
      the schedule's all-gathers of it in the next forward are dropped.
    """
    if not any(b.row_numel or b.twin_of is not None for b in buckets):
        return tuple(ops)
    due_of = {}  # a bucket's ops due at backward end stay so (p.grad final when backward returns), others: step()
    for op in ops:
        due_of.setdefault(op.bucket, BACKWARD_END)
        if op.due != BACKWARD_END:
            due_of[op.bucket] = STEP
    update_of = {op.bucket: op.update for op in ops if op.update is not None}
    out: List[CommOp] = []
    moved = {}  # old position -> new position
    rows_placed = set()
    for position, op in enumerate(ops):
        bucket = buckets[op.bucket]
        if bucket.row_numel:
            if op.reduces and op.bucket not in rows_placed:
                rows_placed.add(op.bucket)
                moved[position] = len(out)
                out.append(
                    CommOp(
                        ROWS,
                        op.bucket,
                        0,
                        bucket.piece_nbytes(0),
                        start=GRADS_READY,
                        due=due_of[op.bucket],
                        average=True,
                    )
                )
            continue
        if bucket.twin_of is not None:
            if not op.reduces:
                continue
            moved[position] = len(out)
            out.append(
                dataclasses.replace(
                    op, kind=ALL_REDUCE, start=GRADS_READY, due=due_of[op.bucket], update=None, average=True
                )
            )
            continue
        moved[position] = len(out)
        start = after(moved[op.start.index]) if op.start.when is When.AFTER else op.start
        out.append(dataclasses.replace(op, start=start))
    last = {op.bucket: i for i, op in enumerate(out)}
    for b, i in last.items():
        if buckets[b].row_numel or buckets[b].twin_of is not None:
            update = update_of.get(b) if buckets[b].row_numel else STEP
            out[i] = dataclasses.replace(out[i], update=update)
    return tuple(out)


def moment_key(point: Point, ops: Sequence[CommOp] = ()) -> Tuple[int, int]:
    """Sort key of the moments of an iteration: backward (gradients ready, its end), ``step()``, then the
    buckets' forwards.  ``AFTER(i)`` sorts with the start of op ``i``."""
    if point.when is When.AFTER:
        return moment_key(ops[point.index].start, ops)
    order = {When.GRADS_READY: (0, 0), When.BACKWARD_END: (0, 1), When.STEP: (1, 0)}
    return order[point.when] if point.when in order else (2, point.index)


def _check_ops(ops: Sequence[CommOp], buckets: Sequence[Bucket], schedule: str) -> None:
    """A schedule's ops must be executable: what the executor relies on, checked once per plan.

    * starts never go back in time along the plan order, and no op is due before it may start (so forcing
      the ops up to one that is due never starts an op before its moment);
    * an all-gather of a piece comes after that piece's reduce-scatter and starts after it, or once it is due;
    * the last op of each bucket, and only it, names when the bucket's update is applied: not before any op of
      the bucket is due, and at ``step()`` or a forward.
    """

    def bad(why):
        raise ValueError(f"schedule {schedule!r} built an invalid plan: {why}")

    last, producer = {}, {}
    previous_start = (0, 0)
    for position, op in enumerate(ops):
        if not 0 <= op.bucket < len(buckets) or not 0 <= op.piece < len(buckets[op.bucket].pieces):
            bad(f"op {position} names bucket {op.bucket} piece {op.piece}, which the layout does not have")
        if op.start.when is When.AFTER and not 0 <= op.start.index < position:
            bad(f"op {position} starts after op {op.start.index}, which is not an earlier op")
        if op.due.when not in (When.BACKWARD_END, When.STEP, When.FORWARD):
            bad(f"op {position} is due at {op.due}; ops are due at backward end, step() or a bucket's forward")
        start = moment_key(op.start, ops)
        if start < previous_start:
            bad(f"op {position} may start at {op.start}, before an op ahead of it in the plan")
        if start > moment_key(op.due):
            bad(f"op {position} starts at {op.start} but is due before that, at {op.due}")
        previous_start = start
        piece = (op.bucket, op.piece)
        if op.kind == ALL_GATHER:
            source = producer.get(piece)
            if source is None:
                bad(f"op {position} all-gathers bucket {op.bucket} piece {op.piece} before any reduce-scatter of it")
            if op.start != after(source) and start < moment_key(ops[source].due):
                bad(f"op {position} may start before the reduce-scatter it gathers (op {source}) is due")
        elif op.kind == REDUCE_SCATTER:
            producer[piece] = position
        last[op.bucket] = position
    for b in range(len(buckets)):
        if b not in last:
            bad(f"bucket {b} has no op")
        for i, op in enumerate(ops):
            if op.bucket != b:
                continue
            if (op.update is not None) != (i == last[b]):
                bad(f"op {i}: the last op of bucket {b} in plan order, and only it, names the bucket's update")
            update = ops[last[b]].update
            if update is not None and moment_key(op.due) > moment_key(update):
                bad(f"op {i} is due after its bucket's update")
        update = ops[last[b]].update
        if update is not None and update.when not in (When.STEP, When.FORWARD):
            bad(f"bucket {b}'s update is at {update}; updates happen at step() or a forward")
