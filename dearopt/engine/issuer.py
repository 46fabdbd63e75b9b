"""The issuing engine: starts a plan's collectives in order and completes them.

Collectives are matched across ranks by the order in which they start, so
the issuer has one cursor over the plan's ops and never starts an op before
every op ahead of it.  An op at the cursor starts when

* the executor says its ``start`` moment has come (``may_start``), or the op
  is *forced* (its result is due now), and
* the credit window has room for its bytes (ByteScheduler's credit; forced
  ops wait, with the timeout, for room), and
* for an op that starts after another op (``When.AFTER``): that op has
  finished (polled, never waited for in a hook), or it is forced.

Completing an op waits for it, decodes it through the communication hook, and
averages its result region if the plan says so.  Applying the bucket's update
is the executor's business, not the issuer's.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from dearopt.engine.buckets import BucketState
from dearopt.backends.base import CollectiveBackend, Handle
from dearopt.compression.hooks import CommHook, Link, hooks_for
from dearopt.planning.plan import CommOp, Plan, When
from dearopt.engine.timeline import Timeline

__all__ = ["CreditWindow", "OpState", "Issuer"]


class OpState:
    """A planned collective bound to its piece, with its handle for the current round."""

    __slots__ = ("position", "spec", "piece", "handle", "done", "ctx", "started_at", "finished_at", "nonfinite", "hook")

    def __init__(self, position: int, spec: CommOp, piece):
        self.position = position
        self.spec = spec
        self.piece = piece
        self.handle: Optional[Handle] = None
        self.done = False
        self.ctx = None  # the comm hook's context from start
        self.hook: Optional[CommHook] = None  # what carries the piece (set by the issuer)
        self.started_at = 0.0
        self.finished_at: Optional[float] = None  # when it was first seen finished (profiling)
        # averaged ops: a one-element tensor, > 0 where the average holds inf/NaN (set in the averaging pass);
        # None until then, and where the result was not averaged here
        self.nonfinite: Optional[torch.Tensor] = None

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

    def __init__(
        self,
        plan: Plan,
        buckets: Sequence[BucketState],
        backend: CollectiveBackend,
        window: CreditWindow,
        carriers: Optional[Sequence[CommHook]],
        timeline: Timeline,
        prepare: Callable[[BucketState], None],
        control: Optional[CollectiveBackend] = None,
    ):
        """``carriers``: the comm hook that carries each op of ``plan``, in order
        (:func:`dearopt.compression.hooks.hooks_for` chooses them: the user's hook, embedding rows, a sparsifier's
        exchange, the parameters of a sharded update); None: every op travels as it is."""
        self.plan = plan
        self.ops = [OpState(i, spec, buckets[spec.bucket].pieces[spec.piece]) for i, spec in enumerate(plan.ops)]
        self.backend = backend
        self.control = control if control is not None else backend  # small agreements, off the data queue
        self.world = backend.size
        self.window = window
        for op, carrier in zip(self.ops, carriers if carriers is not None else hooks_for(plan, None)):
            op.hook = carrier  # what carries the op's piece
        self.timeline = timeline
        self._prepare = prepare
        self.cursor = 0
        self.step = 0  # the step whose gradients the current round carries (names ops in errors)
        self.launch_log = collections.deque(maxlen=100_000)  # (step, kind, bucket, piece) in issue order
        self.first_reduction_at: Optional[float] = None  # perf_counter of the round's first reduction
        self.last_reduction_done_at: Optional[float] = None
        self._inverse: dict = {}  # device -> 1/world as the one-element float32 tensor the fused pass takes
        self.sends_in_flight: List[Handle] = []  # send()'s handles whose timeline span is open

    # ----------------------------------------------------------------- round
    def start_round(self, step: int) -> None:
        for op in self.ops:
            op.handle, op.done, op.ctx, op.finished_at, op.nonfinite = None, False, None, None, None
        self.cursor = 0
        self.step = step
        self.window.clear()
        self.first_reduction_at = self.last_reduction_done_at = None

    # ----------------------------------------------------------------- start
    def start_ready(self, may_start: Callable[[OpState], bool], force_through: int = -1) -> None:
        """Start ops at the cursor while they may start; those at positions <= ``force_through`` regardless."""
        while self.cursor < len(self.ops):
            op = self.ops[self.cursor]
            forced = self.cursor <= force_through
            if not forced and not may_start(op):
                return
            if op.spec.start.when is When.AFTER and not self._dependency_met(op, forced):
                return
            if not self.window.has_room(op.nbytes):
                if not forced:
                    return
                self.window.make_room(op.nbytes)
            self._start(op)
            self.cursor += 1

    def _dependency_met(self, op: OpState, forced: bool) -> bool:
        """An op after another goes once that one has finished (polled: a later start_ready starts it; the link is
        busy with that op meanwhile anyway), or at once, waiting for it, when forced."""
        dependency = self.ops[op.spec.start.index]
        if forced or dependency.handle.is_completed():
            self.complete(dependency)
            return True
        return False

    def _start(self, op: OpState) -> None:
        spec, piece = op.spec, op.piece
        if spec.reduces:
            self._prepare(piece.bucket)
            if self.first_reduction_at is None:
                self.first_reduction_at = time.perf_counter()
        op.handle, op.ctx = op.hook.start(
            op, Link(self.backend, self.control, dict(bucket=spec.bucket, step=self.step))
        )
        piece.bucket.mark_seen()  # an in-place collective counts as the engine's write
        op.started_at = time.perf_counter()
        self.window.add(op)
        self.launch_log.append((self.step, spec.kind, spec.bucket, spec.piece))
        self.timeline.begin(("comm", op.position), spec.kind, "comm", bucket=spec.bucket, piece=spec.piece)

    def send(
        self,
        tensor: torch.Tensor,
        *,
        bucket: int,
        piece: int,
        step: int,
        link=None,
        shard: Optional[torch.Tensor] = None,
        label: str = "all_reduce",
        **span,
    ) -> Handle:
        """Start a sum over ranks that the plan does not list as an op of its own: a schedule whose sends cross
        iterations (``deft``'s groups) says what goes when, and the issuer starts it as it starts the plan's
        ops (logged in :attr:`launch_log`, a timeline span until :meth:`poll_sends` sees it complete).  ``link``:
        another communicator over the same ranks (a second link), or a
        :class:`dearopt.backends.base.ReduceScatterThenGather` with ``shard`` its reduce-scatter's output; by
        default the plan's own backend."""
        where = dict(bucket=bucket, step=step)
        if shard is not None:
            handle = link.start(tensor, shard, **where)
        else:
            handle = (link or self.backend).all_reduce(tensor, "sum", **where)
        self.launch_log.append((step, label, bucket, piece))
        if self.timeline.enabled:  # its span ends when a hook, a wait or step() first sees it complete
            self.timeline.begin(("send", id(handle)), label, "comm", bucket=bucket, step=step, **span)
            self.sends_in_flight.append(handle)
        return handle

    def poll_sends(self, waited: Sequence[Handle] = ()) -> None:
        """Close the timeline spans of the sends that are complete (and of ``waited``, just waited for)."""
        if not self.sends_in_flight:
            return
        done = {id(h) for h in waited}
        left = []
        for handle in self.sends_in_flight:
            if id(handle) in done or handle.is_completed():
                self.timeline.end(("send", id(handle)))
            else:
                left.append(handle)
        self.sends_in_flight = left

    # -------------------------------------------------------------- complete
    def complete(self, op: OpState, *, host: bool = False) -> None:
        """Wait for ``op`` (its data usable; ``host``: finished) and carry out its completion once."""
        if op.done:
            return
        if op.handle is None:
            raise RuntimeError(
                f"op {op.position} ({op.spec}) is completed before it started: the plan's order "
                f"and its due moments disagree"
            )
        t0 = self.timeline.now()
        if host:
            op.handle.synchronize()
        else:
            op.handle.wait()
        self.timeline.span(
            "wait reduce" if op.spec.reduces else "wait all_gather",
            "wait",
            t0,
            bucket=op.spec.bucket,
            piece=op.spec.piece,
        )
        self.timeline.end(("comm", op.position))
        piece, spec = op.piece, op.spec
        result = piece.region(spec.result)
        op.hook.finish(op, op.ctx)
        if spec.average and self.world > 1:
            op.nonfinite = self._average(result)
        piece.bucket.mark_seen()
        op.done = True
        if op.finished_at is None:
            op.finished_at = time.perf_counter()
        if spec.reduces:
            self.last_reduction_done_at = time.perf_counter()

    def _average(self, result: torch.Tensor) -> Optional[torch.Tensor]:
        """Divide the sum by the number of ranks and find any inf/NaN in the same pass over it (torch's fused
        GradScaler kernel: multiply by 1/world, flag non-finite elements); returns the flag, which the
        ``nonfinite`` check at ``step()`` reads instead of summing the averaged gradients once more.  Multiplying
        by 1/world equals dividing by world exactly where world is a power of two, and for float32 and narrower
        to within one unit in the last place elsewhere; the kernel's 1/world is a float32, so float64 gradients
        of other world sizes are divided instead (no flag: they are summed at ``step()``)."""
        if result.dtype == torch.float64 and self.world & (self.world - 1):
            result.div_(self.world)
            return None
        inverse = self._inverse.get(result.device)
        if inverse is None:
            inverse = self._inverse[result.device] = torch.full(
                (1,), 1.0 / self.world, dtype=torch.float32, device=result.device
            )
        found = torch.zeros(1, dtype=torch.float32, device=result.device)
        if result.numel():
            try:
                torch._amp_foreach_non_finite_check_and_unscale_([result], found, inverse)
            except (AttributeError, NotImplementedError, RuntimeError):  # a device or dtype without the kernel
                result.div_(self.world)
                return None
        return found

    def observe(self) -> None:
        """Note when started ops are first seen finished (for the link's busy time)."""
        now = time.perf_counter()
        for op in self.ops[: self.cursor]:
            if op.finished_at is None and op.handle.is_completed():
                op.finished_at = now

    def reduction_services(self) -> List[Tuple[int, float]]:
        """``(bytes, seconds)`` of each finished reduction: from its start, or the end of the one before it
        (the link carries one at a time), to its observed end."""
        spans = sorted(
            (op.started_at, op.finished_at, op.nbytes)
            for op in self.ops[: self.cursor]
            if op.spec.reduces and op.finished_at is not None
        )
        services, free = [], 0.0
        for start, end, nbytes in spans:
            services.append((nbytes, max(end - max(start, free), 0.0)))
            free = max(free, end)
        return services

    def complete_started(self) -> None:
        """Complete every op started this round, and start no other (a skipped step)."""
        for op in self.ops[: self.cursor]:
            self.complete(op)

    def force_and_complete(self, ops: Sequence[OpState], may_start, *, host: bool = False) -> None:
        """Start (forced) every op up to the last of ``ops``, then complete ``ops`` in plan order."""
        if not ops:
            return
        self.start_ready(may_start, force_through=max(op.position for op in ops))
        for op in sorted(ops, key=lambda o: o.position):
            self.complete(op, host=host)
