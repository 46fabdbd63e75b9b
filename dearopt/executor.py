"""The executor: hooks that carry out a plan.

It records the forward order on the first iteration, builds the plan
(:mod:`dearopt.plan`), and then, every iteration:

* **BackPipe** (backward): a post-accumulate-grad hook per parameter counts
  the bucket's ready gradients; when a bucket is complete, its first
  collective starts, strictly in plan order (later buckets wait for earlier
  ones).  At the end of backward every bucket not yet started (unused
  parameters) starts, so all ranks always issue the same collectives.
* ``step()``: waits for the reductions and averages on the shard; then
  ``wfbp``/``rsag`` apply the optimizer, ``dear`` starts the all-gather of
  bucket 0 and returns.
* **FeedPipe** (``dear``, next forward): a forward pre-hook on each module that
  owns parameters waits for the all-gather of every bucket up to the module's,
  starts the next all-gather, and applies the wrapped optimizer to that
  bucket's parameters only.

The executor never waits without a timeout and never issues collectives in an
order that depends on timing: backward-phase ops start in the plan's backward
order, all-gathers in increasing bucket order, each once per iteration.  It
runs on its own communicator (``backend.fork()``), so a user's collectives can
never be paired with the engine's.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Dict, List, Optional

import torch

from .collectives import CollectiveBackend, Handle
from .errors import (
    NonFiniteGradientError,
    PlanMismatchError,
    StepMismatchError,
    UnusedParameterMismatchError,
    UsageError,
)
from .options import Options
from .plan import ParamSpec, Plan, build_plan
from .timeline import Timeline

__all__ = ["Executor"]


class _Piece:
    """One partition of a bucket's buffer: the unit each collective works on."""

    def __init__(self, bucket: "_BucketState", index: int, start: int, end: int, shard: torch.Tensor,
                 grad_numel: int, world: int, rank: int):
        self.bucket = bucket
        self.index = index
        self.full = bucket.buffer[start:end]
        self.shard = shard
        n = (end - start) // world
        first_element = start + rank * n  # the buffer element this rank's shard starts at
        self.shard_grad = shard[: max(0, min(n, grad_numel - first_element))]
        self.full_grad = self.full[: max(0, min(end, grad_numel) - start)]
        self.first: Optional[Handle] = None  # reduce-scatter or all-reduce
        self.second: Optional[Handle] = None  # all-gather
        self.reduced = False


class _Op:
    """A planned collective bound to its piece."""

    __slots__ = ("spec", "piece", "nbytes", "handle")

    def __init__(self, spec, piece: _Piece):
        self.spec = spec
        self.piece = piece
        self.nbytes = spec.nbytes
        self.handle: Optional[Handle] = None


class _CreditWindow:
    """At most ``credit`` bytes of collectives in flight (ByteScheduler's credit; None: unbounded)."""

    def __init__(self, credit: Optional[int]):
        self.credit = credit
        self.inflight: List[_Op] = []
        self.inflight_bytes = 0
        self.max_inflight_bytes = 0

    def _reap(self):
        for op in [op for op in self.inflight if op.handle.is_completed()]:
            self._release(op)

    def _release(self, op: _Op):
        self.inflight.remove(op)
        self.inflight_bytes -= op.nbytes

    def has_room(self, nbytes: int) -> bool:
        if self.credit is None:
            return True
        self._reap()
        return not self.inflight or self.inflight_bytes + nbytes <= self.credit

    def make_room(self, nbytes: int) -> None:
        """Block (with the backend's timeout) until ``nbytes`` more fit; waits on the oldest op first."""
        while not self.has_room(nbytes):
            oldest = self.inflight[0]
            oldest.handle.wait()
            self._release(oldest)

    def add(self, op: _Op) -> None:
        if self.credit is not None:
            self.inflight.append(op)
            self.inflight_bytes += op.nbytes
            self.max_inflight_bytes = max(self.max_inflight_bytes, self.inflight_bytes)


class _BucketState:
    """Run-time state of one planned bucket."""

    def __init__(self, spec, params, names, group_of, n_groups, buffer, world, rank):
        self.spec = spec
        self.index = spec.index
        self.params: List[torch.nn.Parameter] = params
        self.names: List[str] = names
        self.buffer = buffer
        self.views = [buffer[o:o + p.numel()].view_as(p) for o, p in zip(spec.offsets, params)]
        self.ptrs = [v.data_ptr() for v in self.views]
        self.flags = buffer[spec.flags_offset:spec.flags_offset + len(params)]
        self.tags = buffer[spec.tags_offset:spec.tags_offset + world]
        self.shard = torch.empty(spec.padded_numel // world, dtype=buffer.dtype, device=buffer.device)
        self.pieces: List[_Piece] = []
        offset = 0
        for k, (start, end) in enumerate(spec.pieces or ((0, spec.padded_numel),)):
            n = (end - start) // world
            self.pieces.append(_Piece(self, k, start, end, self.shard[offset:offset + n], spec.grad_numel, world, rank))
            offset += n
        self.group_members = [[p for p, g in zip(params, group_of) if g == gi] for gi in range(n_groups)]
        self.used = [False] * len(params)  # got a gradient since the last zero_grad (sent as flags)
        self.has_grad = [False] * len(params)  # what `p.grad is not None` would be without buckets
        self.stamp = [-1] * len(params)
        self.reset_iteration()

    def reset_iteration(self):
        for piece in self.pieces:
            piece.first = piece.second = None
            piece.reduced = False
        self.meta_written = False  # flags and step tag written into the buffer for this iteration
        self.pending = False  # reduced gradients await the optimizer
        self.ready = 0

    @property
    def reduced(self) -> bool:
        return all(piece.reduced for piece in self.pieces)


class Executor:
    """Carries out a :class:`~dearopt.plan.Plan` for one model and optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 backend: CollectiveBackend, options: Options, buffer_size: int,
                 partition_size: Optional[int] = None):
        self.optimizer = optimizer
        self.model = model
        self.backend = backend
        self.options = options
        self.buffer_size = buffer_size
        self.partition_size = partition_size
        self.rank, self.world = backend.rank, backend.size
        # Data collectives follow the plan's order on `backend`; the few control
        # messages (buffers, plan check, norms, profile) go on their own channel,
        # so that their place among the data ops never depends on timing.
        try:
            self.control = backend.fork()
        except NotImplementedError:
            self.control = backend
        self.timeline = Timeline(options.timeline, self.rank)
        self.plan: Optional[Plan] = None
        self.buckets: List[_BucketState] = []
        self.step_count = 0
        self._names: Dict[int, str] = {}
        for name, p in model.named_parameters():
            self._names.setdefault(id(p), name)
        self._hooks = []
        self._param_hooks = []
        self._recording: Optional[List[torch.nn.Module]] = None
        self._seen_modules = set()
        self._module_bucket: Dict[int, int] = {}
        # per-iteration state
        self._pass_id = 0
        self._in_backward = False
        self._accumulated = 0  # backward passes since the last communicating one
        self._comm_pass = False
        self._launched_all = False  # this window's gradients are being communicated
        self._all_ready = False  # backward ended: every bucket counts as ready
        self._first_ops: List[_Op] = []  # reductions in plan order
        self._gather_ops: List[_Op] = []  # all-gathers in plan order
        self._first_pos = 0  # next reduction to issue
        self._gather_pos = 0  # next all-gather to issue
        self._last_first_pos: Dict[int, int] = {}  # bucket -> position of its last reduction
        self._next_apply = 0  # FeedPipe: next bucket whose update is due
        self.window = _CreditWindow(None if options.credit == "auto" else options.credit)
        self.launch_log = collections.deque(maxlen=100_000)  # (step, kind, bucket, piece) in issue order
        self._profile = None  # (ready_times, bandwidth) from rank 0, for priority ordering
        self._ready_times: Optional[List[float]] = None
        self._first_issue_time = None
        self._reductions_done_time = None
        self._stale = set()
        self._zero_pending: Dict[int, bool] = {}
        self.no_sync = False
        self.skipped_steps = 0
        self._forwards = 0  # training forwards since the last step(), part of the step tag
        self._register_module_hooks()
        self._hooked = set()
        self._hook_new_params()

    def _hook_new_params(self):
        """Give every trainable parameter a gradient hook (also ones unfrozen after construction)."""
        for p in self._trainable():
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._param_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ------------------------------------------------------------------ hooks
    def _trainable(self):
        seen, out = set(), []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _register_module_hooks(self):
        self._hooks.append(self.model.register_forward_pre_hook(self._root_pre_hook))
        owned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        for module in self.model.modules():
            if any(id(p) in owned for p in module.parameters(recurse=False)):
                self._hooks.append(module.register_forward_pre_hook(self._module_pre_hook))
        self._hooks.append(self.model.register_state_dict_pre_hook(lambda *a, **k: self.synchronize()))
        if hasattr(self.model, "register_load_state_dict_pre_hook"):
            self._hooks.append(self.model.register_load_state_dict_pre_hook(lambda *a, **k: self.synchronize()))

    def remove_hooks(self):
        for h in self._hooks + self._param_hooks:
            h.remove()
        self._hooks, self._param_hooks = [], []

    def _root_pre_hook(self, module, args):
        if self.plan is None:
            self._recording, self._seen_modules = [], set()
        training = module.training and torch.is_grad_enabled()
        if not training:
            self.synchronize()
            return
        self._forwards += 1
        self._hook_new_params()
        if self.options.broadcast_buffers and self.world > 1:
            self._broadcast_buffers()

    def _module_pre_hook(self, module, args):
        if self._recording is not None and id(module) not in self._seen_modules:
            self._seen_modules.add(id(module))
            self._recording.append(module)
        if self._next_apply < len(self.buckets):
            target = self._module_bucket.get(id(module))
            if target is not None and target >= self._next_apply and self.buckets[target].pending:
                self._apply_through(target)
            elif self.window.credit is not None and self.buckets[self._next_apply].pending:
                self._refill()

    def _refill(self):
        """Start the ops that were held back for credit and now fit (at any module's forward)."""
        if self.options.schedule == "dear":
            self._pump_gather()
        elif self.options.schedule == "bytescheduler":
            self._pump_first()

    def _broadcast_buffers(self):
        buffers = [b for b in self.model.buffers() if b.numel() > 0]
        if not buffers:
            return
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for dtype, group in by_dtype.items():
            flat = torch.cat([b.reshape(-1) for b in group]).to(self.backend.device)
            self.control.broadcast(flat, 0, step=self.step_count).wait()
            offset = 0
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    # ------------------------------------------------------------- planning
    def _build_plan(self):
        trainable = self._trainable()
        index = {id(p): p for p in trainable}
        ordered, seen = [], set()
        for module in self._recording or []:
            for p in module.parameters(recurse=False):
                if id(p) in index and id(p) not in seen:
                    seen.add(id(p))
                    ordered.append(p)
        for p in self.model.parameters():
            if id(p) in index and id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
        self._module_order = list(self._recording or [])
        self._recording = None
        specs = [ParamSpec(self._names.get(id(p), f"param{i}"), p.numel(), str(p.dtype).replace("torch.", ""),
                           p.element_size()) for i, p in enumerate(ordered)]
        ready, bandwidth = self._profile if self._profile is not None else (None, None)
        plan = build_plan(specs, self.buffer_size, self.world, self.options.schedule,
                          partition_size=self.partition_size, priority=self.options.priority,
                          ready_times=ready, bandwidth=bandwidth)
        self._check_plan_agreement(plan)
        group_of_param = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                group_of_param.setdefault(id(p), gi)
        self.buckets = []
        self._where: Dict[int, tuple] = {}
        for spec in plan.buckets:
            params = [ordered[i] for i in spec.params]
            buffer = torch.zeros(spec.padded_numel, dtype=params[0].dtype, device=params[0].device)
            state = _BucketState(spec, params, [specs[i].name for i in spec.params],
                                 [group_of_param[id(p)] for p in params], len(self.optimizer.param_groups),
                                 buffer, self.world, self.rank)
            for j, (p, view) in enumerate(zip(params, state.views)):
                if p.grad is not None:
                    view.copy_(p.grad)
                    state.used[j] = state.has_grad[j] = True
                p.grad = view
                self._where[id(p)] = (state, j)
            self.buckets.append(state)
        self._module_bucket = {}
        for module in self.model.modules():
            idx = [self._where[id(p)][0].index for p in module.parameters(recurse=False) if id(p) in self._where]
            if idx:
                self._module_bucket[id(module)] = max(idx)
        ops = [_Op(spec, self.buckets[spec.bucket].pieces[spec.piece]) for spec in plan.ops]
        self._first_ops = [op for op in ops if op.spec.kind != "all_gather"]
        self._gather_ops = [op for op in ops if op.spec.kind == "all_gather"]
        self._last_first_pos = {op.spec.bucket: i for i, op in enumerate(self._first_ops)}
        self.plan = plan
        self._next_apply = len(self.buckets)

    def _check_plan_agreement(self, plan: Plan):
        if self.world == 1:
            return
        mine = torch.tensor([plan.fingerprint()], dtype=torch.int64, device=self.backend.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.backend.device)
        self.control.all_gather(everyone, mine).wait()
        values = everyone.tolist()
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise PlanMismatchError(
                f"ranks built different communication plans (ranks {differ} differ from rank 0): the models, "
                f"their trainable parameters, the optimizer's parameters or the options (schedule, buffer_size) "
                f"differ between ranks. This rank's plan:\n{plan.describe()}",
                rank=self.rank, op="plan check", step=self.step_count)

    def replan(self, buffer_size: Optional[int] = None, partition_size: Optional[int] = None,
               credit: Optional[int] = None, _inside_backward: bool = False):
        """Re-plan at an iteration boundary; gradients and pending updates are preserved exactly."""
        self.synchronize()
        if self._launched_all or (self._in_backward and not _inside_backward):
            raise UsageError("replan() must be called between step() and the next backward()")
        if buffer_size is not None:
            self.buffer_size = buffer_size
        if partition_size is not None:
            self.partition_size = partition_size
        if credit is not None:
            self.window = _CreditWindow(credit)
        if self.plan is None:  # nothing recorded yet: the first plan will use the new knobs
            return
        grads = {}
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                grads[id(p)] = view.clone()
        used = {id(p): u for b in self.buckets for p, u in zip(b.params, b.used)}
        had = {id(p): h for b in self.buckets for p, h in zip(b.params, b.has_grad)}
        stamps = {id(p): st for b in self.buckets for p, st in zip(b.params, b.stamp)}
        self._recording = list(self._module_order)
        old = self.buckets
        self.buckets = []
        for b in old:
            for p in b.params:
                p.grad = None
        self._build_plan()
        for b in self.buckets:
            for j, (p, view) in enumerate(zip(b.params, b.views)):
                if id(p) not in grads:  # newly trainable: _build_plan took its .grad, if any
                    continue
                view.copy_(grads[id(p)])
                b.used[j] = used.get(id(p), False)
                b.has_grad[j] = had.get(id(p), False)
                b.stamp[j] = stamps.get(id(p), -1)
                # gradients already counted in the backward pass now running (a re-plan inside backward);
                # at a step boundary the stamps belong to the finished pass and nothing is ready yet
                b.ready += self._in_backward and b.stamp[j] == self._pass_id

    # ------------------------------------------------------------- backward
    def _begin_backward(self):
        self._in_backward = True
        self._pass_id += 1
        if self._launched_all:
            raise UsageError(
                f"backward() was called again after the gradients of this step were sent "
                f"(backward_passes_per_step={self.options.backward_passes_per_step}); call step() first, "
                f"or accumulate inside `with optimizer.no_sync():`")
        # Buckets still waiting for their update were not reached by this
        # forward: apply them now (their parameters cannot have gradients
        # unless they were read before their own module ran).
        self._stale = {b.index for b in self.buckets if b.pending}
        if self._stale:
            self.synchronize()
        self._comm_pass = (not self.no_sync) and (self._accumulated + 1 >= self.options.backward_passes_per_step)
        if self._comm_pass:  # what this window's step tag says, fixed before any of its ops start
            self._comm_step, self._comm_forwards = self.step_count, self._forwards
        self._backward_start = self.timeline.now()
        self._backward_wall = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._hook_new_params()
        if any(id(p) not in self._where for p in self._trainable()):
            self._profile_pending = False
            self.replan(_inside_backward=True)  # a parameter was unfrozen: plan it (same on every rank)
        if self._profile_pending:
            self._profile_pending = False
            self.replan(_inside_backward=True)  # the priority order from rank 0's profile
        if (self.options.priority and self._comm_pass and self._profile is None
                and self.step_count == self.PROFILE_STEP):
            self._ready_times = [math.inf] * len(self.plan.params)
            self._first_issue_time = None

    def _on_grad_ready(self, p):
        if self.plan is None:
            self._build_plan()
        if not self._in_backward:
            self._begin_backward()
        located = self._where.get(id(p))
        if located is None:  # not trainable when the plan was made
            return
        bucket, j = located
        if bucket.index in self._stale:
            raise UsageError(
                f"parameter {bucket.names[j]!r} received a gradient although its pending update was not applied "
                f"before it was used: it was read in forward before its own module ran. Use schedule='wfbp', "
                f"or call optimizer.synchronize() before such a forward")
        grad = p.grad
        if grad is None or grad.data_ptr() != bucket.ptrs[j]:
            # the user replaced or cleared .grad: take its value into the bucket
            view = bucket.views[j]
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            p.grad = view
        bucket.used[j] = True
        if not self._comm_pass or bucket.stamp[j] == self._pass_id:
            return
        bucket.stamp[j] = self._pass_id
        bucket.ready += 1
        if self._ready_times is not None:
            self._ready_times[bucket.spec.params[j]] = time.perf_counter() - self._backward_wall
        if bucket.ready == len(bucket.params) or self.window.credit is not None:
            # with a credit window, an op held back for credit may start at any gradient hook once
            # earlier ops have finished, not only when the next bucket completes
            self._pump_first()

    def _bucket_ready(self, bucket: _BucketState) -> bool:
        return self._all_ready or bucket.ready >= len(bucket.params)

    def _pump_first(self, force_through: int = -1):
        """Issue reductions in plan order while their bucket is ready and the credit allows.

        Ops at positions <= ``force_through`` are issued regardless of
        readiness, blocking (with the timeout) for credit if needed.  The order
        never depends on timing: an op waits for every op before it.
        """
        ops = self._first_ops
        while self._first_pos < len(ops):
            op = ops[self._first_pos]
            forced = self._first_pos <= force_through
            if not forced and not self._bucket_ready(op.piece.bucket):
                return
            if not self.window.has_room(op.nbytes):
                if not forced:
                    return
                self.window.make_room(op.nbytes)
            if self.options.schedule == "rsag" and self._first_pos > 0:
                self._rsag_gather(ops[self._first_pos - 1])
            self._issue(op)
            self._first_pos += 1

    def _write_meta(self, bucket: _BucketState):
        if not bucket.meta_written:
            bucket.flags.copy_(torch.tensor(bucket.used, dtype=bucket.flags.dtype))
            bucket.tags.zero_()
            bucket.tags[self.rank] = self._tag(bucket.buffer.dtype)
            bucket.meta_written = True

    def _issue(self, op: _Op):
        piece, kind = op.piece, op.spec.kind
        bucket = piece.bucket
        where = dict(bucket=bucket.index, step=self._comm_step)
        if kind == "all_gather":
            op.handle = piece.second = self.backend.all_gather(piece.full, piece.shard, **where)
        else:
            self._write_meta(bucket)
            if self._first_issue_time is None:
                self._first_issue_time = time.perf_counter()
            if kind == "all_reduce":
                op.handle = piece.first = self.backend.all_reduce(piece.full, "sum", **where)
            else:
                op.handle = piece.first = self.backend.reduce_scatter(piece.shard, piece.full, **where)
        self.window.add(op)
        self.launch_log.append((where["step"], kind, bucket.index, piece.index))
        self.timeline.begin(("comm", kind, bucket.index, piece.index), kind, "comm", bucket=bucket.index,
                            piece=piece.index)

    def _rsag_gather(self, op: _Op):
        piece = op.piece
        if piece.second is None:
            self._finish_piece(piece)
            gather = _Op(dataclasses.replace(op.spec, kind="all_gather"), piece)
            self._issue(gather)

    def _end_backward(self):
        self._in_backward = False
        self.timeline.span("backward", "compute", self._backward_start)
        if not self._comm_pass:
            self._accumulated += 1
            return
        self._accumulated = 0
        self._all_ready = True
        if self.options.schedule == "bytescheduler":
            self._pump_first()  # the rest goes as credit frees, during the next forward
        else:
            self._pump_first(force_through=len(self._first_ops) - 1)
            if self.options.schedule == "rsag":
                self._rsag_gather(self._first_ops[-1])
        self._launched_all = True

    # ------------------------------------------------------------ agreement
    # A rank's step tag encodes its step count and the number of training
    # forwards since its last step; it must fit the bucket dtype's exact
    # integers (256 for bfloat16, 2048 for float16, 2**24 for float32).
    _TAG_STEPS = {torch.bfloat16: 32, torch.float16: 256}

    def _tag(self, dtype) -> int:
        steps = self._TAG_STEPS.get(dtype, 2**20)
        return (self._comm_step % steps) * 8 + min(self._comm_forwards, 7)

    def _check_tags(self, bucket: _BucketState, step: int):
        if not self.options.check_agreement:
            return
        tags = [int(t) for t in bucket.tags.float().round().tolist()]
        if len(set(tags)) == 1:
            return
        seen = ", ".join(f"rank {r}: step {t // 8} ({t % 8} forwards since its last step)" for r, t in enumerate(tags))
        raise StepMismatchError(
            f"ranks sent gradients of different steps in one collective ({seen}); a rank skipped or repeated "
            f"forward/backward/step. No update of this step was applied",
            rank=self.rank, op="step agreement", bucket=bucket.index, step=step)

    def _check_parameters(self):
        """Debug mode: every rank must hold the same parameters (checksums compared)."""
        sums = torch.tensor([float(sum(p.detach().double().sum() for p in b.params)) for b in self.buckets],
                            dtype=torch.float64, device=self.backend.device)
        everyone = torch.empty(len(self.buckets) * self.world, dtype=torch.float64, device=self.backend.device)
        self.control.all_gather(everyone, sums, step=self.step_count).wait()
        table = everyone.view(self.world, -1)
        differ = [r for r in range(self.world) if not torch.equal(table[r], table[0])]
        if differ:
            raise StepMismatchError(f"debug check: the parameters of ranks {differ} differ from rank 0's "
                                    f"(checksums per bucket {table.tolist()})", rank=self.rank,
                                    op="parameter checksum", step=self.step_count)

    # ----------------------------------------------------------------- step
    def _finish_piece(self, piece: _Piece):
        """Wait for the piece's reduction and average it (flags and tags stay sums)."""
        if piece.reduced:
            return
        t0 = self.timeline.now()
        piece.first.wait()
        self.timeline.span("wait reduce", "wait", t0, bucket=piece.bucket.index, piece=piece.index)
        self.timeline.end(("comm", "all_reduce" if self.options.schedule in ("wfbp", "bytescheduler")
                           else "reduce_scatter", piece.bucket.index, piece.index))
        if self.options.schedule in ("wfbp", "bytescheduler"):
            piece.full_grad.div_(self.world)
        else:
            piece.shard_grad.div_(self.world)
        piece.reduced = True
        self._reductions_done_time = time.perf_counter()

    def finish_reductions(self):
        """Issue every remaining reduction, wait for all (in plan order) and average."""
        self._require_gradients("finish the gradient reduction")
        self._pump_first(force_through=len(self._first_ops) - 1)
        for op in self._first_ops:
            self._finish_piece(op.piece)

    def _require_gradients(self, what: str):
        if self._launched_all:
            return
        bpps = self.options.backward_passes_per_step
        if self.plan is None or self._accumulated == 0:
            raise UsageError(f"cannot {what}: no backward() since the last step(); call loss.backward() first")
        raise UsageError(f"cannot {what}: only {self._accumulated} of backward_passes_per_step={bpps} backward "
                         f"passes were run (or they ran inside no_sync())")

    def _finish_averaging(self):
        """Complete this step's reductions (and, for rsag, its all-gathers): the averaged gradients are final."""
        self.finish_reductions()
        if self.options.schedule == "rsag":
            self._wait_gathers()

    def _reduced_grad_regions(self):
        """This rank's averaged gradients: full buffers for wfbp/rsag/bytescheduler, shards for dear."""
        if self.options.schedule == "dear":
            return [piece.shard_grad for b in self.buckets for piece in b.pieces], True
        return [b.buffer[: b.spec.grad_numel] for b in self.buckets], False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` would."""
        self._finish_averaging()
        regions, sharded = self._reduced_grad_regions()
        norm_type = float(norm_type)
        device = self.backend.device
        if norm_type == math.inf:
            local = torch.stack([r.abs().max() if r.numel() else torch.zeros((), dtype=r.dtype) for r in regions])
            total = local.max().to(torch.float64).reshape(1).to(device)
            if sharded:
                self.control.all_reduce(total, "max", step=self.step_count).wait()
        else:
            local = sum(r.double().abs().pow(norm_type).sum() for r in regions)
            total = torch.as_tensor(local, dtype=torch.float64).reshape(1).to(device)
            if sharded:
                self.control.all_reduce(total, "sum", step=self.step_count).wait()
            total = total.pow(1.0 / norm_type)
        total_norm = total.to(torch.float32).reshape(())
        coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
        for region in regions:
            region.mul_(coef.to(region.dtype))
        return total_norm.cpu()

    def unscale_(self, scale: float):
        """Divide the averaged gradients (shards under dear) by ``scale``."""
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"unscale_ needs a positive finite scale, got {scale}")
        if self._unscaled_at == self.step_count:
            raise UsageError("unscale_() was already called since the last step(); the gradients would be divided "
                             "twice")
        self._finish_averaging()
        self._unscaled_at = self.step_count
        regions, _ = self._reduced_grad_regions()
        for region in regions:
            region.div_(scale)

    def reduce_gradients(self):
        """Finish communication so that every ``p.grad`` holds the averaged gradient (wfbp, rsag).

        Under ``dear`` the averaged gradient exists only as shards until the
        next forward; this raises there.
        """
        if self.options.schedule == "dear":
            raise UsageError("under schedule='dear' the averaged gradients are sharded until the next forward; "
                             "use schedule='wfbp' to read averaged gradients before step()")
        self._finish_averaging()

    def _wait_gathers(self):
        for op in self._first_ops:
            if op.piece.second is not None:
                op.piece.second.wait()

    def step(self):
        if self.options.debug and self.plan is not None:
            self._check_parameters()
        schedule = self.options.schedule
        deferred = schedule == "bytescheduler"  # reductions finish in the next forward
        if deferred:
            self._require_gradients("step")
        else:
            self.finish_reductions()
        t0 = self.timeline.now()
        if schedule == "rsag":
            self._wait_gathers()
        if schedule in ("wfbp", "rsag"):
            for bucket in self.buckets:
                self._check_tags(bucket, self.step_count)
        if not deferred:
            self._check_nonfinite()
        if self._ready_times is not None:
            self._share_profile()
        self._forwards = 0
        for b in self.buckets:
            b.pending = True
        self._launched_all = self._all_ready = False
        self.step_count += 1
        if self._skip_this_step:
            for b in self.buckets:
                b.reset_iteration()
            self._first_pos = self._gather_pos = 0
            self.skipped_steps += 1
            self._next_apply = len(self.buckets)
            return
        self._next_apply = 0
        if schedule in ("dear", "bytescheduler"):
            # The updates run later (next forward), after an LR scheduler may have
            # stepped: keep the hyperparameters in force at step().
            self._hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            if schedule == "dear":
                self._gather_pos = 0
                self._pump_gather(force_through=0, prefetch=False)
        else:
            self._apply_through(len(self.buckets) - 1)
        self.timeline.span("step", "update", t0)

    def _share_profile(self):
        """Rank 0's gradient-ready times and bandwidth go to every rank; the next backward re-plans with them."""
        ready = [t if math.isfinite(t) else 0.0 for t in self._ready_times]
        span = (self._reductions_done_time or 0) - (self._first_issue_time or 0)
        total = sum(op.nbytes for op in self._first_ops)
        bandwidth = total / span if span > 0 else 1e9
        profile = torch.tensor(ready + [bandwidth], dtype=torch.float64, device=self.backend.device)
        self.control.broadcast(profile, 0, step=self.step_count).wait()
        values = profile.tolist()
        self._profile = (values[:-1], values[-1])
        self._ready_times = None
        self._profile_pending = True

    _skip_this_step = False
    _unscaled_at = -1  # the step whose gradients unscale_() divided
    _hyper = None  # hyperparameters in force at the last step() (dear)
    _profile_pending = False
    _comm_step = 0  # the step whose gradients are being communicated
    _comm_forwards = 0  # training forwards before that step's communicating backward
    PROFILE_STEP = 1
    """The step whose timings order a priority plan (step 0 builds the plan and is not typical)."""

    def _check_nonfinite(self):
        self._skip_this_step = False
        policy = self.options.nonfinite
        if policy == "ignore":
            return
        regions, sharded = self._reduced_grad_regions()
        local = torch.zeros(1, dtype=torch.float32, device=self.backend.device)
        for r in regions:
            # one pass, no temporary: the sum is finite iff every element is (or it overflowed)
            if r.numel() and not bool(torch.isfinite(r.sum())):
                local.fill_(1.0)
                break
        if sharded:
            self.control.all_reduce(local, "max", step=self.step_count).wait()
        if float(local) == 0.0:
            return
        if policy == "skip":
            self._skip_this_step = True
            return
        raise NonFiniteGradientError(self._describe_nonfinite(sharded) + "; pass nonfinite='skip' to skip such "
                                     "steps", rank=self.rank, op="step", step=self.step_count)

    def _describe_nonfinite(self, sharded: bool) -> str:
        """Name the first non-finite parameter and, under dear, the ranks whose own gradients were non-finite."""
        def first_bad(buffers):
            position = 0
            for bucket, buf in zip(self.buckets, buffers):
                for name, offset, p in zip(bucket.names, bucket.spec.offsets, bucket.params):
                    if not bool(torch.isfinite(buf[offset:offset + p.numel()]).all()):
                        return position, name
                    position += 1
            return -1, None

        if not sharded:  # wfbp/rsag: the buffers hold the averaged gradients; origins are unknown
            _, name = first_bad([b.buffer for b in self.buckets])
            return f"the averaged gradient of parameter {name!r} is not finite (the rank it came from is unknown)"
        # dear: the buffers still hold this rank's own gradients (the all-gather has not overwritten them)
        mine, _ = first_bad([b.buffer for b in self.buckets])
        mine_t = torch.tensor([mine], dtype=torch.int64, device=self.backend.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.backend.device)
        self.control.all_gather(everyone, mine_t, step=self.step_count).wait()
        names = [n for b in self.buckets for n in b.names]
        bad = {r: names[i] for r, i in enumerate(everyone.tolist()) if i >= 0}
        if not bad:
            return "the averaged gradient is not finite although every rank's own gradients are finite (overflow)"
        first = min(bad)
        return (f"non-finite gradients came from rank(s) {sorted(bad)}; first parameter: {bad[first]!r} on rank "
                f"{first}")

    # --------------------------------------------------------------- feed
    def _pump_gather(self, force_through: int = -1, prefetch: bool = True):
        """Issue all-gathers in bucket order: those of buckets <= ``force_through`` now (blocking for
        credit), further ones as far as the credit allows, or, without a credit, one bucket ahead of
        the bucket being updated (``prefetch``)."""
        ops = self._gather_ops
        if self.window.credit is not None:
            ahead = len(self.buckets)
        else:
            ahead = self._next_apply + 1 if prefetch else force_through
        while self._gather_pos < len(ops):
            op = ops[self._gather_pos]
            forced = op.spec.bucket <= force_through
            if not forced and (op.spec.bucket > ahead or not self.window.has_room(op.nbytes)):
                return
            self.window.make_room(op.nbytes)
            self._issue(op)
            self._gather_pos += 1

    def _wait_bucket(self, bucket: _BucketState):
        """Make the bucket's averaged gradient complete in its buffer (dear: all-gather; bytescheduler: all-reduce)."""
        if self.options.schedule == "dear":
            self._pump_gather(force_through=bucket.index)
            for piece in bucket.pieces:
                t0 = self.timeline.now()
                piece.second.wait()
                self.timeline.span("wait all_gather", "wait", t0, bucket=bucket.index, piece=piece.index)
                self.timeline.end(("comm", "all_gather", bucket.index, piece.index))
        else:
            self._pump_first(force_through=self._last_first_pos[bucket.index])
            for piece in bucket.pieces:
                self._finish_piece(piece)
        self._check_tags(bucket, self.step_count - 1)
        if self.options.schedule == "bytescheduler" and self.options.nonfinite == "raise":
            if not bool(torch.isfinite(bucket.buffer[: bucket.spec.grad_numel].sum())):
                raise NonFiniteGradientError(
                    self._describe_nonfinite(False) + " (bytescheduler checks bucket by bucket, so earlier buckets "
                    "of this step were already updated)", rank=self.rank, op="update", bucket=bucket.index,
                    step=self.step_count - 1)

    def _apply_through(self, target: int):
        """Apply the pending updates of buckets ``_next_apply .. target`` in order."""
        while self._next_apply <= target:
            bucket = self.buckets[self._next_apply]
            if self.options.schedule in ("dear", "bytescheduler"):
                self._wait_bucket(bucket)
            if self.options.schedule == "dear":
                self._pump_gather()  # prefetch the next bucket(s) while this one is updated
            elif self.options.schedule == "bytescheduler":
                self._pump_first()
            self._apply_update(bucket)
            self._next_apply += 1
        if self._next_apply == len(self.buckets):
            self._first_pos = self._gather_pos = 0

    def _apply_update(self, bucket: _BucketState):
        t0 = self.timeline.now()
        counts = bucket.flags.float().round().tolist()
        include = []
        for name, count in zip(bucket.names, counts):
            if 0 < count < self.world:
                raise UnusedParameterMismatchError(
                    f"parameter {name!r} received a gradient on {int(count)} of {self.world} ranks: the ranks ran "
                    f"different parts of the model. Make every rank use the same parameters each step",
                    rank=self.rank, op="update", bucket=bucket.index, step=self.step_count - 1)
            include.append(count > 0)
        # A parameter unused on every rank keeps the gradient it had: none after
        # zero_grad(set_to_none=True) (the optimizer skips it), else its last one.
        include = [inc or had for inc, had in zip(include, bucket.has_grad)]
        bucket.has_grad = include
        groups = self.optimizer.param_groups
        saved = [{k: g[k] for k in (self._hyper[gi] if self._hyper is not None else ())} | {"params": g["params"]}
                 for gi, g in enumerate(groups)]
        try:
            for gi, group in enumerate(groups):
                if self._hyper is not None:
                    group.update(self._hyper[gi])
                members = bucket.group_members[gi] if gi < len(bucket.group_members) else []
                if not all(include):
                    position = {id(q): k for k, q in enumerate(bucket.params)}
                    members = [p for p in members if include[position[id(p)]]]
                group["params"] = members
            self.optimizer.step()
        finally:
            for group, live in zip(groups, saved):
                group.update(live)
        bucket.pending = False
        bucket.reset_iteration()
        if bucket.index in self._zero_pending:
            self._zero_bucket(bucket, self._zero_pending.pop(bucket.index))
        self.timeline.span("update", "update", t0, bucket=bucket.index)

    def synchronize(self):
        """Apply every pending update now (parameters become current)."""
        if self._next_apply < len(self.buckets) and any(b.pending for b in self.buckets):
            self._apply_through(len(self.buckets) - 1)
        self.timeline.flush() if self.timeline.enabled else None

    # ----------------------------------------------------------- gradients
    def _zero_bucket(self, bucket: _BucketState, set_to_none: bool):
        bucket.buffer.zero_()
        bucket.used = [False] * len(bucket.params)
        if set_to_none:
            bucket.has_grad = [False] * len(bucket.params)

    def zero_grad(self, set_to_none: bool = True):
        if self.plan is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        if self._launched_all:
            raise UsageError("zero_grad() was called after backward() and before step(): the gradients being "
                             "communicated would be lost; call it before backward() or after step()")
        for bucket in self.buckets:
            if bucket.pending:
                self._zero_pending[bucket.index] = bool(set_to_none)  # zeroed right after its update
            else:
                self._zero_bucket(bucket, bool(set_to_none))
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    p.grad = view
        planned = {id(p) for b in self.buckets for p in b.params}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in planned and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def close(self):
        self.synchronize()
        self.remove_hooks()
        self.timeline.flush()
        if self.control is not self.backend:
            self.control.close()
