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
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import List, Optional, Sequence, Tuple, Union

__all__ = ["ParamSpec", "Bucket", "CommOp", "Plan", "build_plan", "priority_sequence", "parse_size", "SCHEDULES",
           "DEFAULT_BUFFER_SIZE"]

SCHEDULES = ("dear", "wfbp", "rsag", "bytescheduler")

DEFAULT_BUFFER_SIZE = 25 * 2**20
"""25 MiB: PyTorch DDP's default bucket size and the DeAR paper's first trial."""

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
    """One trainable parameter as the planner sees it."""

    name: str
    numel: int
    dtype: str  # e.g. "float32"
    element_size: int

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
    padded_numel: int  # buffer length: gradients + flags + padding, a multiple of the world size
    world_size: int = 1
    pieces: Tuple[Tuple[int, int], ...] = ()  # partitions [start, end) of the buffer, each a multiple of the world size

    @property
    def flags_offset(self) -> int:
        return self.grad_numel

    @property
    def tags_offset(self) -> int:
        return self.grad_numel + len(self.params)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size


@dataclasses.dataclass(frozen=True)
class CommOp:
    """One collective in the plan, on one piece (partition) of one bucket."""

    kind: str  # "reduce_scatter", "all_gather" or "all_reduce"
    bucket: int
    piece: int
    phase: str  # "backward" or "forward": where the schedule normally issues it
    nbytes: int


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

    @property
    def first_ops(self) -> Tuple[CommOp, ...]:
        """The reductions (reduce-scatter or all-reduce), in issue order."""
        return tuple(op for op in self.ops if op.kind != "all_gather")

    @property
    def gather_ops(self) -> Tuple[CommOp, ...]:
        """The all-gathers, in issue order."""
        return tuple(op for op in self.ops if op.kind == "all_gather")

    @property
    def backward_order(self) -> Tuple[int, ...]:
        """Buckets in the order backward completes them (and their first collectives start)."""
        return tuple(reversed(range(len(self.buckets))))

    def bucket_of(self) -> List[int]:
        """For each parameter position, the index of its bucket."""
        owner = [0] * len(self.params)
        for bucket in self.buckets:
            for p in bucket.params:
                owner[p] = bucket.index
        return owner

    def fingerprint(self) -> int:
        """A 63-bit hash of everything that must agree across ranks."""
        text = repr((self.schedule, self.world_size, self.buffer_size, self.partition_size, self.priority,
                     [(p.numel, p.dtype) for p in self.params],
                     [(b.params, b.padded_numel, b.pieces) for b in self.buckets], self.ops))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def describe(self) -> str:
        lines = [f"plan: schedule={self.schedule} world={self.world_size} buffer={self.buffer_size} B, "
                 f"{len(self.buckets)} buckets"]
        for b in self.buckets:
            names = [self.params[p].name for p in b.params]
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} params)" if len(names) > 3 else "")
            lines.append(f"  bucket {b.index}: {b.grad_numel} x {b.dtype} [{shown}]")
        return "\n".join(lines)


def priority_sequence(ops: Sequence[CommOp], ready: Sequence[float], bandwidth: float,
                      latency: float = 0.0) -> List[CommOp]:
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


def _ops_for(schedule: str, buckets: Sequence["Bucket"], element_size: Sequence[int],
             ready: Optional[Sequence[float]], bandwidth: Optional[float]) -> Tuple[CommOp, ...]:
    def ops(kind, bucket, phase):
        return [CommOp(kind, bucket.index, k, phase, (end - start) * element_size[bucket.index])
                for k, (start, end) in enumerate(bucket.pieces)]

    backward = list(reversed(buckets))
    first_kind = "all_reduce" if schedule in ("wfbp", "bytescheduler") else "reduce_scatter"
    first = [op for b in backward for op in ops(first_kind, b, "backward")]
    if ready is not None and bandwidth:
        first = priority_sequence(first, ready, bandwidth)
    if schedule == "rsag":
        return tuple(op for b in backward for op in ops("reduce_scatter", b, "backward") + ops("all_gather", b, "backward"))
    if schedule == "dear":
        return tuple(first + [op for b in buckets for op in ops("all_gather", b, "forward")])
    return tuple(first)


def _pieces(padded: int, world: int, element_size: int, partition_size: Optional[int]) -> Tuple[Tuple[int, int], ...]:
    if partition_size is None:
        return ((0, padded),)
    step = max(world, (partition_size // element_size) // world * world)
    return tuple((start, min(start + step, padded)) for start in range(0, padded, step))


def _padded(numel: int, world: int) -> int:
    return max(1, -(-numel // world)) * world


def build_plan(params: Sequence[ParamSpec], buffer_size: Union[int, str] = DEFAULT_BUFFER_SIZE,
               world_size: int = 1, schedule: str = "dear", *, partition_size: Union[int, str, None] = None,
               priority: bool = False, ready_times: Optional[Sequence[float]] = None,
               bandwidth: Optional[float] = None) -> Plan:
    """Fuse ``params`` (forward order) into buckets and list the plan's collectives.

    ``partition_size`` splits each bucket's buffer into pieces of at most that
    many bytes, each its own collective.  With ``priority`` and a profile
    (``ready_times``: seconds after backward starts at which each parameter's
    gradient is ready, and the link's ``bandwidth`` in bytes/s) the reductions
    are ordered by :func:`priority_sequence`; without a profile they go in the
    order backward produces them.
    """
    buffer_size = parse_size(buffer_size)
    partition_size = None if partition_size is None else parse_size(partition_size)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    params = tuple(params)
    if not params:
        raise ValueError("the model has no trainable parameters to plan for")
    # Fill from the output side: walk backward, close a bucket when the next
    # parameter would overflow it or has another dtype.
    groups: List[List[int]] = []
    current: List[int] = []
    current_bytes = 0
    for pos in reversed(range(len(params))):
        spec = params[pos]
        if current and (current_bytes + spec.nbytes > buffer_size or params[current[0]].dtype != spec.dtype):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(pos)
        current_bytes += spec.nbytes
    groups.append(current)
    groups.reverse()
    buckets = []
    for index, members in enumerate(groups):
        members = sorted(members)
        offsets, offset = [], 0
        for pos in members:
            offsets.append(offset)
            offset += params[pos].numel
        padded = _padded(offset + len(members) + world_size, world_size)
        element = params[members[0]].element_size
        buckets.append(Bucket(index=index, params=tuple(members), offsets=tuple(offsets),
                              dtype=params[members[0]].dtype, grad_numel=offset,
                              padded_numel=padded, world_size=world_size,
                              pieces=_pieces(padded, world_size, element, partition_size)))
    bucket_ready = None
    if priority and ready_times is not None:
        if len(ready_times) != len(params):
            raise ValueError(f"ready_times has {len(ready_times)} entries for {len(params)} parameters")
        bucket_ready = [max(ready_times[p] for p in b.params) for b in buckets]
    ops = _ops_for(schedule, buckets, [params[b.params[0]].element_size for b in buckets], bucket_ready,
                   bandwidth if priority else None)
    return Plan(schedule=schedule, world_size=world_size, buffer_size=buffer_size, params=params,
                buckets=tuple(buckets), ops=ops, partition_size=partition_size, priority=priority)

