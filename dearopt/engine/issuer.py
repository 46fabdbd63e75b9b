"""The issuing engine: starts a plan's collectives in order and completes them.

Collectives are matched across ranks by the order in which they start, so
the issuer has one cursor over the plan's ops and never starts an op before
every op ahead of it.  An op at the cursor starts when

* its ``start`` moment has come in the round passed in (``start_ready(round)``),
  or the op is *forced* (its result is due now), and
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

from dearopt.engine.buckets import BucketState, step_tag
from dearopt.backends.base import CollectiveBackend, Handle
from dearopt.compression.hooks import CommHook, Link, WirePool, hooks_for
from dearopt.planning.plan import ALL_GATHER, CommOp, Plan, When
from dearopt.engine.timeline import Timeline

__all__ = ["CreditWindow", "OpState", "Issuer"]


class OpState:
    """A planned collective bound to its piece, with its handle for the current round.  What the issuer reads at
    every start and completion is laid out here once, when the plan is bound (the hot path reads attributes)."""

    __slots__ = (
        "position",
        "spec",
        "piece",
        "bucket",
        "handle",
        "done",
        "ctx",
        "started_at",
        "finished_at",
        "nonfinite",
        "hook",
        "link",
        "where",
        "launch",
        "when",
        "index",
        "reduces",
        "nbytes",
        "region",
        "average",
        "gated",
        "wire",
    )

    def __init__(self, position: int, spec: CommOp, piece):
        self.position = position
        self.spec = spec
        self.piece = piece
        self.bucket = piece.bucket  # (a strong reference: the issuer lives as long as the plan's buckets)
        self.handle: Optional[Handle] = None
        self.done = False
        self.ctx = None  # the comm hook's context from start
        self.hook: Optional[CommHook] = None  # what carries the piece (set by the issuer)
        self.link: Optional[Link] = None
        self.where = {"bucket": spec.bucket, "step": 0}  # names the collective in errors (the step: per round)
        self.launch = None  # the backend call that starts it, where its hook lets it travel as it is
        self.started_at = 0.0
        self.finished_at: Optional[float] = None  # when it was first seen finished (profiling)
        # averaged ops: a one-element tensor, > 0 where the average holds inf/NaN (set in the averaging pass);
        # None until then, and where the result was not averaged here
        self.nonfinite: Optional[torch.Tensor] = None
        self.when = spec.start.when
        self.index = spec.start.index
        self.reduces = spec.reduces
        self.nbytes = spec.nbytes
        self.region = piece.region(spec.result)
        self.average = spec.average
        self.gated = False  # a sharded update's all-gather: not before this rank's shard of it is updated
        self.wire = 0  # bytes of the comm hook's wire buffer it holds in flight (set by the issuer)


WIRE_BUDGET = 64 * 2**20
"""Bytes of comm-hook wire buffers in flight at once (or one op's, where larger): a bfloat16 model reduced in
float32 holds this, not a float32 copy of every bucket whose reduction is under way."""


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
    """Carries out the ops of one plan: the order cursor, the credit window, completion.  It is told where the
    round is (a :class:`dearopt.engine.hooks.Round`: backward done, stepped, the bucket the forward reached, the
    shards updated) and starts what that allows; it calls nobody back."""

    def __init__(
        self,
        plan: Plan,
        buckets: Sequence[BucketState],
        backend: CollectiveBackend,
        window: CreditWindow,
        carriers: Optional[Sequence[CommHook]],
        timeline: Timeline,
        control: Optional[CollectiveBackend] = None,
        wire_dtype: Optional[Callable[[torch.dtype], torch.dtype]] = None,
        sharded: bool = False,
    ):
        """``carriers``: the comm hook that carries each op of ``plan``, in order
        (:func:`dearopt.compression.hooks.hooks_for` chooses them: the user's hook, embedding rows, a sparsifier's
        exchange, the parameters of a sharded update); None: every op travels as it is.  Each bucket's used flags and
        step tag are written into its tail before its first reduction (:meth:`BucketState.write_tail`);
        ``wire_dtype``: the dtype a bucket's tag must be exact in (None: the bucket's own); ``sharded``: the
        all-gathers carry the sharded update's parameters."""
        self.plan = plan
        self.ops = [OpState(i, spec, buckets[spec.bucket].pieces[spec.piece]) for i, spec in enumerate(plan.ops)]
        self.backend = backend
        self.control = control if control is not None else backend  # small agreements, off the data queue
        self.world = backend.size
        self.window = window
        self._wire_dtype = wire_dtype
        self.pool = WirePool()  # a comm hook's wire buffers, for the ops in flight
        for op, carrier in zip(self.ops, carriers if carriers is not None else hooks_for(plan, None)):
            op.hook = carrier  # what carries the op's piece
            op.link = Link(backend, self.control, op.where, self.pool)
            op.launch = carrier.direct(op, backend)  # None: through the hook's start and finish
            op.gated = sharded and op.spec.kind == ALL_GATHER
            op.wire = carrier.wire_nbytes(op) if op.launch is None else 0
        # wire buffers in flight at once (a bfloat16 model's float32 sums): at most this many bytes, or one op's
        self.wire_budget = max([WIRE_BUDGET] + [op.wire for op in self.ops])
        self.pool.limit = self.wire_budget  # and what the pool holds, in flight and free together
        self.timeline = timeline
        self.cursor = 0
        self._reaped = 0  # ops before it are completed (or not started)
        self._observed = 0  # ops before it were seen finished (observe)
        self.step = 0  # the step whose gradients the current round carries (names ops in errors)
        self._tags: dict = {}  # wire dtype -> this round's step tag
        self._forwards = 0
        self.launch_log = collections.deque(maxlen=100_000)  # (step, kind, bucket, piece) in issue order
        self.first_reduction_at: Optional[float] = None  # perf_counter of the round's first reduction
        self.last_reduction_done_at: Optional[float] = None
        self._inverse: dict = {}  # device -> 1/world as the one-element float32 tensor the fused pass takes
        self.sends_in_flight: List[Handle] = []  # send()'s handles whose timeline span is open

    # ----------------------------------------------------------------- round
    def start_round(self, step: int, forwards: int = 0) -> None:
        """A new round: ``step`` and the training forwards before its backward make each bucket's step tag."""
        for op in self.ops:
            op.handle, op.done, op.ctx, op.finished_at, op.nonfinite = None, False, None, None, None
            op.where["step"] = step
        self.cursor = 0
        self._reaped = 0
        self._observed = 0
        self.step = step
        self._forwards = forwards
        self._tags = {}
        self.window.clear()
        self.first_reduction_at = self.last_reduction_done_at = None

    def reap(self) -> None:
        """Complete the started ops that have finished, in order, without waiting for any (their results
        decoded and averaged now; their buffers of the transport and the comm hook free for the next ops)."""
        ops, i = self.ops, self._reaped
        while i < self.cursor:
            op = ops[i]
            if not op.done:
                if not op.handle.is_completed():
                    break
                self.complete(op)
            i += 1
        self._reaped = i

    def _write_meta(self, bucket: BucketState) -> None:
        """The bucket's used flags and this rank's step tag, before its first reduction of the round (the tag
        exact in the bucket's own dtype and in the wire's)."""
        dtype = bucket.buffer.dtype if self._wire_dtype is None else self._wire_dtype(bucket.buffer.dtype)
        if bucket.buffer.dtype in (torch.bfloat16, torch.float16):
            dtype = bucket.buffer.dtype
        tag = self._tags.get(dtype)
        if tag is None:
            tag = self._tags[dtype] = step_tag(self.step, self._forwards, dtype)
        bucket.write_tail(tag)

    # ----------------------------------------------------------------- start
    def start_ready(self, r, force_through: int = -1) -> None:
        """Start ops at the cursor while round ``r`` lets them start; those at positions <= ``force_through``
        regardless.  An op starts when its ``start`` moment has come (``r``: backward done, stepped, the bucket the
        forward reached; its bucket complete), the credit window and the transport's workspace have room, and the
        op it follows (``AFTER``) has finished; a forced op waits for room and for that op."""
        ops, n = self.ops, len(self.ops)
        window = self.window if self.window.credit is not None else None
        while self.cursor < n:
            op = ops[self.cursor]
            forced = self.cursor <= force_through
            if not forced:
                when = op.when
                if when is When.GRADS_READY:
                    ok = r.backward_done or op.bucket.ready >= op.bucket.size
                elif when is When.BACKWARD_END:
                    ok = r.backward_done
                elif when is When.STEP:
                    ok = r.stepped
                elif when is When.FORWARD:
                    ok = r.forward_reached >= op.index
                else:
                    ok = True
                if not ok or (op.gated and op.spec.bucket >= r.shards_updated):
                    return
            if op.when is When.AFTER and not self._dependency_met(op, forced):
                return
            if window is not None and not window.has_room(op.nbytes):
                if not forced:
                    return
                window.make_room(op.nbytes)
            if not self.backend.has_room(op.nbytes, op.spec.kind):  # (gloo's workspace: never waited for in a hook)
                if not forced:
                    return
                self.backend.make_room(op.nbytes, op.spec.kind)
            if op.wire and not self._wire_room(op.wire, forced):
                return
            self._start(op)
            self.cursor += 1

    def _wire_room(self, nbytes: int, forced: bool) -> bool:
        """Whether an op whose wire buffer takes ``nbytes`` fits in :attr:`wire_budget` beside the ops in flight
        (the finished ones completed first, giving theirs back); a forced op waits for the oldest ones."""
        pool = self.pool
        while pool.taken and pool.taken + nbytes > self.wire_budget:
            self.reap()
            if not pool.taken or pool.taken + nbytes <= self.wire_budget or self._reaped >= self.cursor:
                break
            if not forced:
                return False
            self.complete(self.ops[self._reaped])
        return True

    def _dependency_met(self, op: OpState, forced: bool) -> bool:
        """An op after another goes once that one has finished (polled: a later start_ready starts it; the link is
        busy with that op meanwhile anyway), or at once, waiting for it, when forced."""
        dependency = self.ops[op.index]
        if forced or dependency.handle.is_completed():
            self.complete(dependency)
            return True
        return False

    def _start(self, op: OpState) -> None:
        bucket = op.bucket
        if op.reduces:
            if not bucket.meta_written:
                self._write_meta(bucket)
            if self.first_reduction_at is None:
                self.first_reduction_at = time.perf_counter()
        if op.launch is not None:
            op.handle = op.launch(**op.where)
        else:
            op.handle, op.ctx = op.hook.start(op, op.link)
        bucket.seen_version = bucket.buffer._version  # an in-place collective counts as the engine's write
        op.started_at = time.perf_counter()
        if self.window.credit is not None:
            self.window.add(op)
        self.launch_log.append((self.step, op.spec.kind, op.spec.bucket, op.spec.piece))
        if self.timeline.enabled:
            self.timeline.begin(("comm", op.position), op.spec.kind, "comm", bucket=op.spec.bucket, piece=op.spec.piece)

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
        handle = op.handle
        if handle is None:
            raise RuntimeError(
                f"op {op.position} ({op.spec}) is completed before it started: the plan's order "
                f"and its due moments disagree"
            )
        timeline = self.timeline if self.timeline.enabled else None
        t0 = timeline.now() if timeline is not None else 0.0
        if host:
            handle.synchronize()
        else:
            handle.wait()
        if timeline is not None:
            timeline.span(
                "wait reduce" if op.reduces else "wait all_gather",
                "wait",
                t0,
                bucket=op.spec.bucket,
                piece=op.spec.piece,
            )
            timeline.end(("comm", op.position))
        if op.launch is None:
            op.hook.finish(op, op.ctx)
            op.ctx = None  # (it holds views of the op's wire buffers: a buffer the pool lets go is freed)
        if op.average and self.world > 1:
            op.nonfinite = self._average(op.region)
        bucket = op.bucket
        bucket.seen_version = bucket.buffer._version
        op.done = True
        if op.finished_at is None:
            op.finished_at = time.perf_counter()
        if op.reduces:
            self.last_reduction_done_at = op.finished_at

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
        """Note when started ops are first seen finished (for the link's busy time).  Only the ops from the
        first one not yet seen finished on are asked (those before it were seen already)."""
        ops, cursor, i = self.ops, self.cursor, self._observed
        while i < cursor and ops[i].finished_at is not None:
            i += 1
        self._observed = i
        if i < cursor:
            now = time.perf_counter()
            for op in ops[i:cursor]:
                if op.finished_at is None and op.handle.is_completed():
                    op.finished_at = now

    def reduction_services(self) -> List[Tuple[int, float]]:
        """``(bytes, seconds)`` of each finished reduction: from its start, or the end of the one before it
        (the link carries one at a time), to its observed end."""
        spans = sorted(
            (op.started_at, op.finished_at, op.nbytes)
            for op in self.ops[: self.cursor]
            if op.reduces and op.finished_at is not None
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

    def force_and_complete(self, ops: Sequence[OpState], r, *, host: bool = False) -> None:
        """Start (forced) every op up to the last of ``ops`` (``ops`` in plan order), then complete them in
        order; ``r``: the round (what may start on the way)."""
        if not ops:
            return
        self.start_ready(r, force_through=ops[-1].position)
        for op in ops:
            self.complete(op, host=host)
