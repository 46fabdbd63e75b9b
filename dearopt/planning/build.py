"""The plan builder: a schedule's ops over the buckets laid out for a model's parameters, as a :class:`Plan`.

Above both the plan's vocabulary (:mod:`dearopt.planning.plan`) and the schedules (:mod:`dearopt.schedules`), which
write their ops in that vocabulary.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

from dearopt.planning.plan import (
    CommOp,
    DEFAULT_BUFFER_SIZE,
    Layout,
    ParamSpec,
    Plan,
    _check_ops,
    _tied_and_rows,
    ALL_GATHER,
    REDUCE_SCATTER,
    allreduce_buckets,
    layout_buckets,
    parse_size,
    priority_sequence,
)
from dearopt.schedules import get_schedule

__all__ = ["build_plan"]


def build_plan(
    params: Sequence[ParamSpec],
    buffer_size: Union[int, str] = DEFAULT_BUFFER_SIZE,
    world_size: int = 1,
    schedule="dear",
    *,
    partition_size: Union[int, str, None] = None,
    priority: bool = False,
    ready_times: Optional[Sequence[float]] = None,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    credit: Union[int, str, None] = None,
    comm_hook: str = "none",
    first_bucket_size: Union[int, str, None] = None,
    allreduce: Union[float, str] = 0.0,
    sharded_update: bool = False,
    groups: Optional[Sequence[Sequence[int]]] = None,
    phases: Optional[Tuple[float, float]] = None,
    gathers_at_step: bool = False,
) -> Plan:
    """Fuse ``params`` (forward order) into buckets and let ``schedule`` list the plan's collectives.

    ``partition_size`` splits each bucket's buffer into pieces of at most that
    many bytes, each its own collective.  With ``priority`` and a profile
    (``ready_times``: seconds after backward starts at which each parameter's
    gradient is ready, and the link's ``bandwidth`` in bytes/s) the reductions
    are ordered by :func:`priority_sequence`; without a profile they go in the
    order backward produces them.  ``latency`` (the measured fixed seconds per
    collective) serves schedules that form their own buckets from the profile
    (:meth:`dearopt.schedules.Schedule.bucket_groups`).  ``credit`` (bytes in flight) is part of the
    plan because schedules may start ops earlier when a credit window bounds them.
    ``first_bucket_size`` caps the first bucket backward fills (see :func:`layout_buckets`).
    ``allreduce``: for ``dear``, which buckets are all-reduced in backward (as
    ``wfbp`` does) instead of reduce-scattered in backward and all-gathered in
    the next forward: a fraction of the gradient bytes from the output side, or
    ``"auto"`` with a profile (``ready_times``, ``bandwidth``):
    see :func:`allreduce_buckets`.  ``sharded_update``: the ops stay ``dear``'s, but each rank updates its shard
    at ``step()`` and the all-gathers carry parameters (:mod:`dearopt.engine.sharding`); part of the fingerprint, so
    ranks that disagree about it are refused.

    ``phases``: the profiled forward and backward computation (seconds), for ``allreduce="auto"``'s balance
    (:func:`allreduce_buckets`).  ``gathers_at_step``: under ``dear``, start every all-gather at ``step()``, back
    to back in forward order (as Prophet's forward phase), not one bucket ahead of the forward: with many small
    buckets on a saturated link one bucket ahead leaves the link idle between them.  ``groups``: the buckets
    themselves (contiguous runs of positions in forward order, e.g. the blocks a run
    formed, replayed by :mod:`dearopt.sim`) instead of the schedule's own (:func:`layout_buckets`).

    Twins and row-sparse parameters (:class:`ParamSpec`) are planned the same
    way for every schedule, after it wrote its ops (:func:`_tied_and_rows`).
    """
    policy = get_schedule(schedule)  # a name, or the schedule object itself
    schedule = policy.name
    buffer_size = parse_size(buffer_size)
    partition_size = None if partition_size is None else parse_size(partition_size)
    credit = None if credit is None else parse_size(credit)
    first_bucket_size = None if first_bucket_size is None else parse_size(first_bucket_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    params = tuple(params)
    if not params:
        raise ValueError("the model has no trainable parameters to plan for")
    if groups is None:
        groups = policy.bucket_groups(
            params, buffer_size=buffer_size, ready_times=ready_times, bandwidth=bandwidth, latency=latency
        )
    buckets = layout_buckets(params, buffer_size, world_size, partition_size, first_bucket_size, groups=groups)
    backward = [(b.index, k) for b in reversed(buckets) for k in range(len(b.pieces))]
    if priority and ready_times is not None and bandwidth:
        if len(ready_times) != len(params):
            raise ValueError(f"ready_times has {len(ready_times)} entries for {len(params)} parameters")
        bucket_ready = [max(ready_times[p] for p in b.params) for b in buckets]
        probes = [CommOp(policy.reduction, b, k, buckets[b].piece_nbytes(k)) for b, k in backward]
        backward = [(op.bucket, op.piece) for op in priority_sequence(probes, bucket_ready, bandwidth, latency or 0.0)]
    chosen = (
        allreduce_buckets(buckets, allreduce, ready_times, bandwidth, latency, phases)
        if policy.mixes_allreduce
        else frozenset()
    )
    layout = Layout(buckets, tuple(backward), credit, chosen, gathers_at_step)
    ops = _tied_and_rows(tuple(policy.ops(layout)), buckets)
    _check_ops(ops, buckets, schedule)
    if sharded_update and any(op.kind not in (REDUCE_SCATTER, ALL_GATHER) for op in ops):
        kinds = sorted({op.kind for op in ops} - {REDUCE_SCATTER, ALL_GATHER})
        raise ValueError(
            f"sharded_update needs every bucket reduce-scattered, then all-gathered; this plan "
            f"({schedule!r}) also has {kinds} (all-reduced buckets, tied uses or embedding rows)"
        )
    return Plan(
        schedule=schedule,
        world_size=world_size,
        buffer_size=buffer_size,
        params=params,
        buckets=buckets,
        ops=ops,
        partition_size=partition_size,
        priority=priority,
        credit=credit,
        comm_hook=comm_hook,
        first_bucket_size=first_bucket_size,
        allreduce=tuple(sorted(chosen)),
        sharded_update=sharded_update,
    )
