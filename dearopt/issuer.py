"""The issuing engine: starts a plan's collectives in order and completes them.

Collectives are matched across ranks by the order in which they start, so
the issuer has one cursor over the plan's ops and never starts an op before
every op ahead of it.  An op at the cursor starts when

* the executor says its ``start`` moment has come (``may_start``), or the op
  is *forced* (its result is due now), and
* the credit window has room for its bytes (ByteScheduler's credit; forced
  ops wait, with the timeout, for room), and
* for an op that starts after another op (``When.AFTER``): that op has
  finished, or a later op is ready to go and waits for it, or it is forced.

Completing an op waits for it, decodes it through the communication hook, and
averages its result region if the plan says so.  Applying the bucket's update
is the executor's business, not the issuer's.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, List, Optional, Sequence

import torch

from .buckets import BucketState
from .collectives import CollectiveBackend, Handle
from .comm_hooks import CommHook
from .plan import ALL_GATHER, REDUCE_SCATTER, CommOp, Plan, When
from .timeline import Timeline

__all__ = ["CreditWindow", "OpState", "Issuer"]


class OpState:
    """A planned collective bound to its piece, with its handle for the current round."""

    __slots__ = ("position", "spec", "piece", "handle", "done", "ctx", "started_at")

    def __init__(self, position: int, spec: CommOp, piece):
        self.position = position
        self.spec = spec
        self.piece = piece
        self.handle: Optional[Handle] = None
        self.done = False
        self.ctx = None  # the comm hook's context from encode
        self.started_at = 0.0

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def bucket(self) -> BucketState:
        return self.piece.bucket


class CreditWindow:
    """At most ``credit`` bytes of collectives in flight (ByteScheduler's credit; None: unbounded).

    "In flight" means not yet finished on the transport (``Handle.is_completed``,
    ``Handle.synchronize``), not merely ordered on a stream.
    """

    def __init__(self, credit: Optional[int]):
        self.credit = credit
        self.inflight: List[OpState] = []
        self.inflight_bytes = 0
        self.max_inflight_bytes = 0

    def _release(self, op: OpState) -> None:
        self.inflight.remove(op)
        self.inflight_bytes -= op.nbytes

    def has_room(self, nbytes: int) -> bool:
        if self.credit is None:
            return True
        for op in [op for op in self.inflight if op.handle.is_completed()]:
            self._release(op)
        return not self.inflight or self.inflight_bytes + nbytes <= self.credit

    def make_room(self, nbytes: int) -> None:
        """Block (with the backend's timeout) until ``nbytes`` more fit; waits for the oldest op first."""
        while not self.has_room(nbytes):
            oldest = self.inflight[0]
            oldest.handle.synchronize()
            self._release(oldest)

    def add(self, op: OpState) -> None:
        if self.credit is not None:
            self.inflight.append(op)
            self.inflight_bytes += op.nbytes
            self.max_inflight_bytes = max(self.max_inflight_bytes, self.inflight_bytes)

    def clear(self) -> None:
        self.inflight, self.inflight_bytes = [], 0


class Issuer:
    """Carries out the ops of one plan: the order cursor, the credit window, completion."""

    def __init__(self, plan: Plan, buckets: Sequence[BucketState], backend: CollectiveBackend,
                 window: CreditWindow, hook: Optional[CommHook], timeline: Timeline,
                 prepare: Callable[[BucketState], None]):
        self.plan = plan
        self.ops = [OpState(i, spec, buckets[spec.bucket].pieces[spec.piece]) for i, spec in enumerate(plan.ops)]
        self.backend = backend
        self.world = backend.size
        self.window = window
        self.hook = hook
        self.timeline = timeline
        self._prepare = prepare
        self.cursor = 0
        self.step = 0  # the step whose gradients the current round carries (names ops in errors)
        self.launch_log = collections.deque(maxlen=100_000)  # (step, kind, bucket, piece) in issue order
        self.first_reduction_at: Optional[float] = None  # perf_counter of the round's first reduction
        self.last_reduction_done_at: Optional[float] = None

    # ----------------------------------------------------------------- round
    def start_round(self, step: int) -> None:
        for op in self.ops:
            op.handle, op.done, op.ctx = None, False, None
        self.cursor = 0
        self.step = step
        self.window.clear()
        self.first_reduction_at = self.last_reduction_done_at = None

    # ----------------------------------------------------------------- start
    def pump(self, may_start: Callable[[OpState], bool], force_through: int = -1) -> None:
        """Start ops at the cursor while they may start; those at positions <= ``force_through`` regardless."""
        while self.cursor < len(self.ops):
            op = self.ops[self.cursor]
            forced = self.cursor <= force_through
            if not forced and not may_start(op):
                return
            if op.spec.start.when is When.AFTER and not self._dependency_met(op, may_start, forced):
                return
            if not self.window.has_room(op.nbytes):
                if not forced:
                    return
                self.window.make_room(op.nbytes)
            self._start(op)
            self.cursor += 1

    def _dependency_met(self, op: OpState, may_start, forced: bool) -> bool:
        """An op after another goes once that one finished, or when forced or a later op is waiting for it."""
        dependency = self.ops[op.spec.start.index]
        if dependency.handle.is_completed():
            self.complete(dependency)
            return True
        following = self.ops[self.cursor + 1] if self.cursor + 1 < len(self.ops) else None
        if forced or (following is not None and following.spec.start.when is not When.AFTER and may_start(following)):
            self.complete(dependency)
            return True
        return False

    def _start(self, op: OpState) -> None:
        spec, piece, hook = op.spec, op.piece, self.hook
        where = dict(bucket=spec.bucket, step=self.step)
        backend = self.backend
        if spec.reduces:
            self._prepare(piece.bucket)
            if self.first_reduction_at is None:
                self.first_reduction_at = time.perf_counter()
        if hook is None:
            if spec.kind == REDUCE_SCATTER:
                op.handle = backend.reduce_scatter(piece.shard, piece.full, **where)
            elif spec.kind == ALL_GATHER:
                op.handle = backend.all_gather(piece.full, piece.shard, **where)
            else:
                op.handle = backend.all_reduce(piece.full, "sum", **where)
        else:
            wire_full, wire_shard = piece.wire(hook.wire_dtype(piece.full.dtype))
            if spec.kind == ALL_GATHER:
                op.ctx = self._encode(piece.shard, piece.shard_grad, wire_shard)
                op.handle = backend.all_gather(wire_full, wire_shard, **where)
            else:
                op.ctx = self._encode(piece.full, piece.full_grad, wire_full)
                if spec.kind == REDUCE_SCATTER:
                    op.handle = backend.reduce_scatter(wire_shard, wire_full, **where)
                else:
                    op.handle = backend.all_reduce(wire_full, "sum", **where)
        piece.bucket.mark_seen()  # an in-place collective counts as the engine's write
        op.started_at = time.perf_counter()
        self.window.add(op)
        self.launch_log.append((self.step, spec.kind, spec.bucket, spec.piece))
        self.timeline.begin(("comm", op.position), spec.kind, "comm", bucket=spec.bucket, piece=spec.piece)

    def _encode(self, region: torch.Tensor, grads: torch.Tensor, wire: torch.Tensor):
        """Gradients through the hook; the flags and tags behind them are copied exactly."""
        n = grads.numel()
        ctx = self.hook.encode(grads, wire[:n])
        wire[n:].copy_(region[n:])
        return ctx

    # -------------------------------------------------------------- complete
    def complete(self, op: OpState, *, host: bool = False) -> None:
        """Wait for ``op`` (its data usable; ``host``: finished) and carry out its completion once."""
        if op.done:
            return
        if op.handle is None:
            raise RuntimeError(f"op {op.position} ({op.spec}) is completed before it started: the plan's order "
                               f"and its due moments disagree")
        t0 = self.timeline.now()
        if host:
            op.handle.synchronize()
        else:
            op.handle.wait()
        self.timeline.span("wait reduce" if op.spec.reduces else "wait all_gather", "wait", t0, bucket=op.spec.bucket,
                           piece=op.spec.piece)
        self.timeline.end(("comm", op.position))
        piece, spec = op.piece, op.spec
        result = piece.region(spec.result)
        if self.hook is not None:
            wire_full, wire_shard = piece.wire(self.hook.wire_dtype(piece.full.dtype))
            wire, whole = (wire_shard, piece.shard) if spec.result == "shard" else (wire_full, piece.full)
            n = result.numel()
            self.hook.decode(wire[:n], result, op.ctx)
            whole[n:].copy_(wire[n:])
        if spec.average and self.world > 1:
            result.div_(self.world)
        piece.bucket.mark_seen()
        op.done = True
        if spec.reduces:
            self.last_reduction_done_at = time.perf_counter()

    def complete_started(self) -> None:
        """Complete every op started this round, and start no other (a skipped step)."""
        for op in self.ops[:self.cursor]:
            self.complete(op)

    def force_and_complete(self, ops: Sequence[OpState], may_start, *, host: bool = False) -> None:
        """Start (forced) every op up to the last of ``ops``, then complete ``ops`` in plan order."""
        if not ops:
            return
        self.pump(may_start, force_through=max(op.position for op in ops))
        for op in sorted(ops, key=lambda o: o.position):
            self.complete(op, host=host)
