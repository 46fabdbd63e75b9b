"""``prophet``: buckets formed from when gradients appear (Prophet's gradient blocks, Algorithm 1).

Every other schedule closes a bucket when it holds ``buffer_size`` bytes, one
number for the whole model.  Prophet (Zhang et al., "Prophet: predictable
communication scheduling") forms *blocks* from the profile instead: with
``c(i)`` the time gradient ``i`` becomes ready after backward starts, ``s(i)``
its size and ``B`` the link's bandwidth, ``E(i) = s(i) / B``; when the link is
free, the gradients that already exist are assembled into one block as long as
the block is sent before the next gradient is generated (the block interval
``A``), so the link is never idle while a gradient waits and a block never
waits to fill.  :func:`prophet_blocks` is that rule on dearopt's engine, where
a bucket is a contiguous run of parameters in forward order and the ranks
start their collectives in one fixed order:

* walking from the output side (the order backward produces gradients), a
  block starts at ``max(c(first), link free)``;
* the next parameter joins while it is already ready at the block's start,
  the block stays within ``max_bytes`` (the ``buffer_size`` knob), no required
  boundary (dtype, a tied twin, a row-sparse embedding) lies between, and the
  block, with it, is sent (``latency + bytes / B``) before the next gradient
  not yet ready is generated (Prophet's constraint (11));
* the block occupies the link until ``start + latency + bytes / B``;
* a block smaller than ``latency * B`` (it would spend longer on its fixed
  cost than on its bytes: the paper's Eq. 10, small blocks lose throughput)
  waits for the next gradients instead of going alone.  ``latency`` is at
  least :data:`DEFAULT_LATENCY`: on the CPU machines measured here the
  per-collective cost is mostly CPU time the link model cannot see (ResNet-50
  unshaped: 102 blocks without this floor ran 0.84x DDP).

Equal ready times make one block (up to ``max_bytes``); a gap longer than
every transfer makes one block per burst of gradients; a gradient too large
for any window is a block of its own.

Two schedules use the blocks.  ``prophet`` reduce-scatters each block in
backward and all-gathers it for the next forward, where its update is applied
just before its layers run, as DeAR's FeedPipe does; the all-gathers all
start at ``step()``, back to back in the order the next forward needs them
(Prophet's "forward phase", lines 13-14: ``t_next`` chained), not one bucket
ahead as ``dear`` issues them; ``prophet-allreduce`` all-reduces
each block as soon as it is complete and waits for it just before its layers
in the next forward (ByteScheduler's op placement, Prophet's own, push/pull
being an all-reduce).  The plan is made from rank 0's profile of steps 1-3 (the
bandwidth measured on the job's own reductions), shared once, so every rank
builds the same blocks; before the profile exists (steps 0-3) the buckets
are fused by ``buffer_size``.  The fixed cost per collective in ``E`` is
fitted from the same steps' reductions (:func:`dearopt.planning.profile.fit_link`); ``link_check_every`` re-measures and
re-plans when the bandwidth changes (:class:`dearopt.planning.profile.LinkMonitor`).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from dearopt.planning.plan import (
    ALL_GATHER,
    ALL_REDUCE,
    GRADS_READY,
    REDUCE_SCATTER,
    STEP,
    CommOp,
    Layout,
    ParamSpec,
    forward_of,
    split_points,
)
from dearopt.schedules.base import Schedule, mark_updates
from dearopt.schedules.bytescheduler import ByteScheduler

__all__ = ["Prophet", "ProphetAllReduce", "prophet_blocks", "profile_blocks", "block_latency", "predicted_sends"]

DEFAULT_LATENCY = 1e-3
"""Seconds of fixed cost per collective at least (``E = latency + s / B``: the paper's throughput loss of small
blocks, its Eq. 10); the profile fits it from the job's own reductions
(:func:`dearopt.planning.profile.fit_latency`), which on a link that is rarely busy finds about nothing."""


def prophet_blocks(
    ready: Sequence[float],
    nbytes: Sequence[int],
    bandwidth: float,
    *,
    latency: float = 0.0,
    max_bytes: Optional[int] = None,
    min_bytes: int = 0,
    split_after: Sequence[int] = (),
) -> List[List[int]]:
    """Prophet's gradient blocks (see the module doc) as runs of parameter positions in forward order.

    ``ready[i]``: seconds after backward starts at which parameter ``i``'s
    gradient exists; ``nbytes[i]``: its bytes; ``bandwidth``: bytes/s of the
    reduction on the link; ``latency``: fixed seconds per collective;
    ``max_bytes``: no block larger (a single parameter may be); ``min_bytes``:
    a smaller block waits for the next gradients rather than go alone (the
    paper's Eq. 10: below some size a collective's fixed cost dominates);
    ``split_after``: positions ``i`` with a required boundary between ``i`` and ``i + 1``.
    """
    n = len(ready)
    if len(nbytes) != n:
        raise ValueError(f"ready has {n} entries but nbytes has {len(nbytes)}")
    if n == 0:
        raise ValueError("no parameters to form blocks from")
    if not bandwidth > 0 or not math.isfinite(bandwidth):
        raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency!r}")
    if any(not math.isfinite(t) for t in ready):
        raise ValueError("ready times must be finite")
    cut = set(split_after)
    later = _next_generation(ready)
    blocks: List[List[int]] = []
    link_free = 0.0
    i = n - 1
    while i >= 0:
        start = max(ready[i], link_free)  # the first gradient exists and the link is free
        size, j = nbytes[i], i - 1
        while j >= 0 and j not in cut:
            if max_bytes is not None and size + nbytes[j] > max_bytes:
                break
            if size < min_bytes:
                start = max(start, ready[j])  # too small to go alone: wait for the next gradient
            elif ready[j] > start:
                break  # not generated yet: a block never waits to fill
            elif start + latency + (size + nbytes[j]) / bandwidth > later(j, start):
                break  # sent only after the next gradient exists: that one would wait behind it
            size += nbytes[j]
            j -= 1
        blocks.append(list(range(j + 1, i + 1)))
        link_free = start + latency + size / bandwidth
        i = j
    blocks.reverse()
    return blocks


def predicted_sends(
    blocks: Sequence[Sequence[int]],
    ready: Sequence[float],
    nbytes: Sequence[int],
    bandwidth: float,
    latency: float = 0.0,
) -> List[Tuple[float, float]]:
    """When the link model behind :func:`prophet_blocks` expects each block's reduction to start and end
    (seconds after backward starts), in the order of ``blocks``: walking from the output side, a block
    goes when its last gradient exists and the link is free, and holds the link ``latency + bytes /
    bandwidth``.  For the blocks :func:`prophet_blocks` formed from the same numbers these are the times
    it planned them for; the timeline shows them beside the measured reductions."""
    times: List[Tuple[float, float]] = [(0.0, 0.0)] * len(blocks)
    link_free = 0.0
    for b in sorted(range(len(blocks)), key=lambda b: -max(blocks[b])):
        start = max(link_free, max(ready[p] for p in blocks[b]))
        link_free = start + latency + sum(nbytes[p] for p in blocks[b]) / bandwidth
        times[b] = (start, link_free)
    return times


def _next_generation(ready: Sequence[float]):
    """``later(j, t)``: the earliest ready time after ``t`` among positions ``< j`` (the gradients still to come
    on the input side), or infinity: the end of the block interval ``A``."""

    def later(j: int, t: float) -> float:
        upcoming = [r for r in ready[:j] if r > t]
        return min(upcoming) if upcoming else math.inf

    return later


def block_latency(measured: Optional[float]) -> float:
    """The fixed cost per collective the blocks are formed with: the measured one, at least the default."""
    return max(DEFAULT_LATENCY, measured or 0.0)


def profile_blocks(
    params: Sequence[ParamSpec],
    *,
    buffer_size: int,
    ready_times: Optional[Sequence[float]],
    bandwidth: Optional[float],
    latency: Optional[float] = None,
) -> Optional[List[List[int]]]:
    """Prophet's blocks for the planned parameters from a profile (ready times, the reduction's bandwidth and
    fixed cost per op), at most ``buffer_size`` bytes each and never across a required boundary; None without a
    profile.  ``prophet`` forms its buckets so; ``dear``'s measured choice tries them as one of its plans."""
    if ready_times is None or not bandwidth:
        return None
    if len(ready_times) != len(params):
        raise ValueError(f"ready_times has {len(ready_times)} entries for {len(params)} parameters")
    split = split_points(params)
    latency = block_latency(latency)
    return prophet_blocks(
        ready_times,
        [p.numel * p.element_size for p in params],
        bandwidth,
        latency=latency,
        max_bytes=buffer_size,
        min_bytes=int(latency * bandwidth),
        split_after=split,
    )


class Prophet(Schedule):
    """``prophet``: buckets are Prophet's gradient blocks, formed from a profile of steps 1-3, reduce-scattered in
    backward and gathered just before their layers in the next forward (see the module).

    ``link_check_every``: every this many steps rank 0 re-measures the gradients' ready times and the link's
    bandwidth on the job's own reductions; when the bandwidth moved by more than 25 % in two measurements in a
    row every rank re-plans at the same step (:class:`dearopt.planning.profile.LinkMonitor`; the re-plans:
    ``optimizer.schedule.link_changes``).  ``"auto"``: 20; ``None``: never.  The other knobs: :class:`Schedule`.
    """

    name = "prophet"
    reduction = REDUCE_SCATTER
    updates_in_forward = True
    needs_profile = True

    def __init__(self, *, link_check_every="auto", **common):
        every = link_check_every
        if (
            every is not None
            and every != "auto"
            and (isinstance(every, bool) or not isinstance(every, int) or every < 1)
        ):
            raise ValueError(f"link_check_every must be an integer >= 1, 'auto' or None, got {every!r}")
        self.link_check_every = link_check_every
        super().__init__(**common)

    @property
    def link_changes(self) -> List[Tuple[int, float, float]]:
        """On ``optimizer.schedule``: the re-plans after the link's bandwidth changed (``link_check_every``):
        ``(step, planned bytes/s, measured bytes/s)`` each, the same on every rank."""
        return self.figures.link_changes

    def resolve(self, options):
        """``link_check_every='auto'`` settled to 20 steps."""
        resolved = super().resolve(options)
        if resolved.link_check_every == "auto":
            resolved.link_check_every = 20
        return resolved

    def predicted_sends(self, plan, measured):
        """Each block's reduction as Prophet's link model predicts it (seconds after backward starts)."""
        sizes = [p.numel * p.element_size for p in plan.params]
        return predicted_sends(
            [b.params for b in plan.buckets],
            measured.ready,
            sizes,
            measured.bandwidth,
            self.block_latency(measured.latency),
        )

    def bucket_groups(
        self,
        params: Sequence[ParamSpec],
        *,
        buffer_size: int,
        ready_times: Optional[Sequence[float]],
        bandwidth: Optional[float],
        latency: Optional[float] = None,
    ):
        """Prophet's gradient blocks from the profile (None before it exists)."""
        return profile_blocks(
            params, buffer_size=buffer_size, ready_times=ready_times, bandwidth=bandwidth, latency=latency
        )

    @staticmethod
    def block_latency(measured: Optional[float]) -> float:
        """The fixed cost per collective the blocks are formed with: the measured one, at least the default."""
        return block_latency(measured)

    def ops(self, layout: Layout):
        """Reduce-scatters as blocks complete in backward; then every all-gather starts at ``step()``, back to
        back in the order the next forward needs them (Prophet's forward phase: ``t_next`` chained, not one
        bucket ahead as DeAR's FeedPipe), each due, and its block updated, just before its layers."""
        ops = [
            CommOp(REDUCE_SCATTER, b, k, layout.buckets[b].piece_nbytes(k), start=GRADS_READY, due=STEP, average=True)
            for b, k in layout.reduction_order
        ]
        ops += [
            CommOp(ALL_GATHER, bucket.index, k, bucket.piece_nbytes(k), start=STEP, due=forward_of(bucket.index))
            for bucket in layout.buckets
            for k in range(len(bucket.pieces))
        ]
        return mark_updates(ops)


class ProphetAllReduce(Prophet):
    """``prophet-allreduce``: Prophet's blocks, each all-reduced in backward and waited for just before its layers
    in the next forward; knobs: :class:`Prophet`."""

    name = "prophet-allreduce"
    reduction = ALL_REDUCE
    reduces_before_step = False

    def ops(self, layout: Layout):
        """ByteScheduler's ops on Prophet's blocks: all-reduced in backward, due at each block's forward."""
        return ByteScheduler().ops(layout)
