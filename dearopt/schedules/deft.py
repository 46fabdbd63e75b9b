"""DeFT's solver (Meng and Sun): which buckets to send in which stage, as 0/1 knapsacks over compute time.

Pure functions from a profile (per bucket: forward time ``F``, backward time
``B``, communication time ``C``) to a periodic schedule of delayed, merged
updates, and the ``"deft"`` policy; :class:`dearopt.delayed.DelayedExecutor`
carries the schedule out.  Not built (issue 16): the heterogeneous links (two
communicators) and the Preserver (the convergence check).

The paper's idea: an iteration's parameter update may wait until every bucket
of its gradient is reduced, and the next iteration's forward runs on the
parameters from before it.  The communication of one *group* of gradients can
then hide under any later compute: the forward stage's (capacity ``sum(F)``)
and the backward stage's (``sum(B)``).  Buckets are numbered from the input
side (0 here, the paper's 1); backward produces them from the last to the
first.  Which buckets go in a stage is a 0/1 knapsack whose items weigh and
are worth their communication time (:func:`knapsack`); in backward the new
gradients become ready one after another, which Algorithm 1
(:func:`recursive_knapsack`) approximates by trying every suffix of the ready
order with the compute left after its head is ready.

Algorithm 2 (:func:`deft_schedule`) walks iterations with two queues:
*current* (buckets of the oldest group not yet sent: the next update waits for
exactly these) and *future* (newer gradients held on this rank, merged by
summation while the current group is in flight).  Per iteration:

* forward stage: if the current queue is not empty, the knapsack over it with
  capacity ``sum(F)`` is sent (Case 1);
* backward stage, current queue empty (Case 4): the new gradients (merged with
  the future queue, if it holds any) form a new group; Algorithm 1 picks what
  goes now (never bucket 0, whose gradient is ready last and is needed first);
  the rest become the current queue;
* current queue not empty and it does not fit in ``sum(B)`` (Case 2): the
  knapsack over it is sent, the new gradients go to (or are summed into) the
  future queue;
* it fits (Case 3): all of it is sent, then Algorithm 1 over the new group (as
  in Case 4) with the compute left.

A group whose last bucket was sent is applied at the end of that iteration
(``step()``), as one update of every bucket; it covers the iterations whose
gradients were merged into it, and the update uses their average (over all
samples those iterations saw: the issue's choice where the paper is
ambiguous).  Where the paper's pseudo-code and prose disagree, this follows
the prose (docs/deft.md lists each choice).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..plan import ALL_REDUCE, BACKWARD_END, GRADS_READY, STEP, CommOp
from .base import Schedule, mark_updates

__all__ = ["knapsack", "recursive_knapsack", "DeftIteration", "DeftSchedule", "deft_schedule",
           "check_partition", "RESOLUTION", "DeFT"]

RESOLUTION = 1e-5
"""Seconds per unit of the exact knapsack (times are rounded to it; 10 us)."""


def _units(seconds: float) -> int:
    return int(math.floor(seconds / RESOLUTION + 1e-9))


def knapsack(weights: Sequence[float], capacity: float) -> Tuple[int, ...]:
    """The 0/1 knapsack with profit = weight (subset sum): the indices of the subset of ``weights`` with the
    largest total not above ``capacity``, exact at :data:`RESOLUTION`.  Among subsets of equal total the one
    that comes first in lexicographic order of indices wins, so the answer is the same on every rank."""
    for w in weights:
        if not (w >= 0 and math.isfinite(w)):
            raise ValueError(f"knapsack weights must be finite and >= 0, got {w!r}")
    cap = _units(capacity) if capacity > 0 else -1
    if cap < 0:
        return ()
    units = [int(round(w / RESOLUTION)) for w in weights]
    mask = (1 << (cap + 1)) - 1
    # reach[i]: bit s set iff some subset of items i.. sums to s (python ints as bitsets)
    reach = [0] * (len(units) + 1)
    reach[len(units)] = 1
    for i in range(len(units) - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << units[i])) & mask
    best = reach[0].bit_length() - 1
    chosen, left = [], best
    for i, u in enumerate(units):  # take item i whenever the rest can still make up what is left
        if left >= u and (reach[i + 1] >> (left - u)) & 1:
            chosen.append(i)
            left -= u
    return tuple(chosen)


def recursive_knapsack(items: Sequence[int], comm: Sequence[float], backward: Sequence[float],
                       capacity: float) -> Tuple[int, ...]:
    """Algorithm 1: the buckets of ``items`` (in the order backward makes them ready) to send in this
    backward, given ``capacity`` seconds of compute to hide them under.

    Either the knapsack over all of them with the whole capacity, or (recursively) over the items after the
    first, whose capacity loses the backward time of the bucket that becomes the first ready (the paper's
    ``T_{N-1}``, read as that bucket's backward time); the larger total wins, ties go to the shorter list."""
    items = list(items)
    if not items or capacity <= 0:
        return ()
    first = knapsack([comm[b] for b in items], capacity)
    rest = recursive_knapsack(items[1:], comm, backward, capacity - backward[items[1]]) if len(items) > 1 else ()
    if sum(comm[items[i]] for i in first) > sum(comm[b] for b in rest) + RESOLUTION / 2:
        return tuple(sorted((items[i] for i in first), key=items.index))
    return rest


@dataclasses.dataclass(frozen=True)
class DeftIteration:
    """What one iteration does under the schedule."""

    case: int  # the backward stage's case of Algorithm 2 (2, 3 or 4)
    forward: Tuple[int, ...]  # buckets of the current group sent in the forward stage
    backward_old: Tuple[int, ...]  # buckets of the current group sent in backward (Cases 2 and 3)
    backward_new: Tuple[int, ...]  # buckets of the group formed now, sent in this backward (Cases 3 and 4)
    held: bool  # this iteration's gradients are added to the future queue (Case 2) instead of forming a group
    applies: Optional[int]  # a group whose last bucket was sent now is applied at step(): how many iterations
    # before this one its first gradients were computed (None: no update at this step)
    covers: int  # ... and how many iterations' gradients it sums (0 when nothing is applied)


@dataclasses.dataclass(frozen=True)
class DeftSchedule:
    """Algorithm 2 unrolled: iterations before the schedule repeats, then one period that repeats forever."""

    buckets: int
    warmup: Tuple[DeftIteration, ...]
    period: Tuple[DeftIteration, ...]

    def iteration(self, t: int) -> DeftIteration:
        """What iteration ``t`` (from 0) does."""
        if t < len(self.warmup):
            return self.warmup[t]
        return self.period[(t - len(self.warmup)) % len(self.period)]

    @property
    def updates_per_iteration(self) -> float:
        """Updates per iteration in the steady state (1.0: every iteration's gradients applied, one step late)."""
        return sum(1 for it in self.period if it.applies is not None) / len(self.period)

    @property
    def update_frequency(self) -> Dict[int, float]:
        """Per bucket, updates per iteration in the steady state.  Algorithm 2 applies a group as one update of
        every bucket, so it is the same for all of them."""
        return {b: self.updates_per_iteration for b in range(self.buckets)}


def _check_profile(forward, backward, comm) -> int:
    n = len(comm)
    if n == 0 or len(forward) != n or len(backward) != n:
        raise ValueError(f"forward, backward and comm times need one entry per bucket (got {len(forward)}, "
                         f"{len(backward)}, {len(comm)})")
    for name, values in (("forward", forward), ("backward", backward), ("comm", comm)):
        if any(not (v >= 0 and math.isfinite(v)) for v in values):
            raise ValueError(f"{name} times must be finite and >= 0, got {list(values)}")
    return n


def check_partition(forward: Sequence[float], backward: Sequence[float], comm: Sequence[float]) -> List[int]:
    """Section III's partition constraint: the buckets whose communication is longer than the smallest
    knapsack (the shorter of the forward and the backward stage); they must be split before solving."""
    _check_profile(forward, backward, comm)
    smallest = min(sum(forward), sum(backward))
    return [b for b, c in enumerate(comm) if c > smallest]


def deft_schedule(forward: Sequence[float], backward: Sequence[float], comm: Sequence[float],
                  max_iterations: int = 1000) -> DeftSchedule:
    """Algorithm 2 from a profile: per bucket (0 = input side) its forward and backward compute time and its
    communication time, in seconds.  The same numbers give the same schedule on every rank."""
    n = _check_profile(forward, backward, comm)
    too_long = check_partition(forward, backward, comm)
    if too_long:
        raise ValueError(f"buckets {too_long} take longer on the link than the shortest stage's compute "
                         f"({min(sum(forward), sum(backward)):.4g} s): split them (DeFT's partition constraint)")
    fp_time, bp_time = sum(forward), sum(backward)
    ready_order = list(range(n - 1, 0, -1))  # backward makes bucket n-1 first; bucket 0 always waits
    first_capacity = bp_time - backward[n - 1]  # nothing is ready while the last bucket's backward runs

    current: Tuple[int, ...] = ()  # buckets of the group in flight not yet sent
    current_group: Optional[Tuple[int, int]] = None  # (first iteration, iterations covered)
    future: Optional[Tuple[int, int]] = None  # held gradients: (first iteration, iterations summed)
    seen: Dict[tuple, int] = {}
    history: List[DeftIteration] = []
    for t in range(max_iterations):
        # the state, relative to t, decides everything from here on
        key = (current, None if current_group is None else (t - current_group[0], current_group[1]),
               None if future is None else (t - future[0], future[1]))
        if key in seen:
            start = seen[key]
            return DeftSchedule(n, tuple(history[:start]), tuple(history[start:]))
        seen[key] = t
        sent_forward: Tuple[int, ...] = ()
        if current:  # Case 1: old gradients depend on nothing; any of them may go in forward
            chosen = knapsack([comm[b] for b in current], fp_time)
            sent_forward = tuple(current[i] for i in chosen)
            current = tuple(b for b in current if b not in sent_forward)
        applies, covers = None, 0
        if not current and current_group is not None and sent_forward:
            applies, covers = current_group  # the group's last buckets went in this forward
            current_group = None
        old, new, held = (), (), False
        if current:
            fits = sum(comm[b] for b in current) <= bp_time + RESOLUTION / 2
            if not fits:  # Case 2: as much of the old group as fits; the new gradients are held
                chosen = knapsack([comm[b] for b in current], bp_time)
                old = tuple(current[i] for i in chosen)
                current = tuple(b for b in current if b not in old)
                future = (t, 1) if future is None else (future[0], future[1] + 1)
                held, case = True, 2
            else:  # Case 3: all of the old group, then the new group with what is left
                old, current = current, ()
                applies, covers = current_group
                current_group = None
                case = 3
        else:
            case = 4
        if not held:
            group = (t, 1) if future is None else (future[0], future[1] + 1)
            future = None
            # the old group's buckets are ready at once and go first; the new ones only after the last
            # bucket's backward
            left = min(bp_time - sum(comm[b] for b in old), first_capacity)
            new = recursive_knapsack(ready_order, comm, backward, left)
            current = tuple(b for b in range(n) if b not in new)
            current_group = group
        age = None if applies is None else t - applies
        history.append(DeftIteration(case, sent_forward, old, new, held, age, covers))
    raise RuntimeError(f"DeFT's schedule did not repeat within {max_iterations} iterations")


class DeFT(Schedule):
    """``deft``: the plan gives the buckets (fused by ``buffer_size``, one all-reduce each, listed as ``wfbp``'s
    for the plan's fingerprint); when each is sent is the :class:`DeftSchedule`'s, carried out by
    :class:`dearopt.delayed.DelayedExecutor`."""

    name = "deft"
    reduction = ALL_REDUCE
    takes_ordering_knobs = False
    reduces_before_step = False
    delays_updates = True

    def check_options(self, options) -> None:
        if options.nonfinite == "skip":
            raise ValueError("schedule='deft' applies groups of several steps' gradients at later steps; "
                             "nonfinite='skip' is not supported: use 'raise' or 'ignore'")
        super().check_options(options)
        for knob in ("buffer_size", "partition_size", "credit"):
            if getattr(options, knob) == "auto":
                raise ValueError(f"schedule='deft' cannot re-plan (its groups span iterations): {knob}='auto' is "
                                 f"not supported")

    def ops(self, layout):
        return mark_updates([CommOp(ALL_REDUCE, b, k, layout.buckets[b].piece_nbytes(k), start=GRADS_READY,
                                    due=BACKWARD_END, average=True) for b, k in layout.reduction_order],
                            at=lambda op: STEP)
