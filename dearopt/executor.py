"""The executor: hooks that carry out a plan.

It records the forward order on the first iteration, has the schedule build
the plan (:mod:`dearopt.plan`, :mod:`dearopt.schedules`), and then drives
the plan through the moments of every iteration:

* **backward**: a post-accumulate-grad hook per parameter counts its bucket's
  ready gradients; the issuer (:mod:`dearopt.issuer`) starts every op whose
  moment has come, strictly in plan order.  When backward ends every bucket
  counts as ready, so all ranks always issue the same collectives.
* **step()**: completes the ops due at ``step()`` (waits, averages), runs the
  checks (:mod:`dearopt.checks`), applies the updates due at ``step()``
  (:mod:`dearopt.updater`), and starts the ops that start at ``step()``.
* **forward**: a pre-hook on each module that owns parameters reaches the
  module's bucket: ops that start there are started, ops due there are
  completed, and updates due there are applied, bucket by bucket in order.

The executor knows moments, not schedules: which op goes when is the plan's.
Its life cycle is one :class:`TrainingState` plus, while a step's gradients
are on their way, one :class:`Round`.  Nothing waits without a timeout, and
the engine's collectives run on their own communicator (``backend.fork()``),
so a user's collectives can never be paired with them.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import logging
import math
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .buckets import BucketState
from .checks import Checks
from .collectives import CollectiveBackend
from .comm_hooks import CommHook
from .errors import CollectiveTimeoutError, PlanMismatchError, UsageError
from .forward_order import ForwardOrderRecorder, parameters_in_forward_order
from .issuer import CreditWindow, Issuer, OpState
from .options import Options
from .pending import GradientGuard, PendingUpdateGuard
from .plan import (ALL_GATHER, BACKWARD_END, STEP, ParamSpec, Plan, Point, When, allreduce_buckets, build_plan,
                   forward_of, moment_key)
from .profiling import LinkMonitor, ReadyProfile
from .schedules import get_schedule
from .schedules.prophet import profile_blocks
from .sharding import ShardedUpdate
from .tied import TiedEmbeddings
from .timeline import Timeline
from .updater import BucketUpdater

__all__ = ["Executor", "TrainingState", "Round"]

_log = logging.getLogger("dearopt")

GATHERED_STEPS_TO_ADAPT = 2
"""Steps in a row whose ``p.grad`` was read before ``step()`` after which ``dear`` (``allreduce="auto"`` or
``"predicted"``) re-plans every bucket as an all-reduce in backward: the loop reads the averaged gradients every
step (torch's clip, ``GradScaler.unscale_``), so the gathers cannot overlap the next forward anyway."""


class _EngineHook:
    """A hook that reaches the engine through a weak reference.

    A deep copy of the model (an EMA model, ``torch.optim.swa_utils.AveragedModel``)
    gets an inert copy of it, pickling the model pickles nothing of the engine,
    and a model whose optimizer is gone is left with hooks that do nothing.
    """

    __slots__ = ("_method",)

    def __init__(self, method=None):
        self._method = weakref.WeakMethod(method) if method is not None else None

    def __call__(self, *args, **kwargs):
        method = self._method() if self._method is not None else None
        if method is None:
            return None
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # every engine hook passes here: a bug's exception becomes a named error
            from .collectives import engine_failure

            error = engine_failure(exc, method.__self__, f"{type(method.__self__).__name__}.{method.__name__}")
            if error is exc:
                raise
            raise error from exc

    def __deepcopy__(self, memo) -> "_EngineHook":
        return _EngineHook()

    def __reduce__(self):
        return (_EngineHook, ())


class _SparseWatch(_EngineHook):
    """A one-shot tensor hook: notes whether autograd hands the parameter a sparse gradient (an embedding with
    ``sparse=True``), which the post-accumulate hook cannot see once it was added into the bucket's dense view."""

    __slots__ = ("_pid", "handle")

    def __init__(self, method=None, pid: int = 0):
        super().__init__(method)
        self._pid = pid
        self.handle = None

    def __call__(self, grad):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        return super().__call__(self._pid, grad)


class TrainingState(enum.Enum):
    """Where the training loop is, as the engine sees it."""

    IDLE = "idle"
    """Between ``step()`` and the next backward (the last step's updates may still be pending)."""
    BACKWARD = "backward"
    """A backward pass is running."""
    ACCUMULATED = "accumulated"
    """Backward passes ran without communicating (``no_sync()``, ``backward_passes_per_step``)."""
    REDUCING = "reducing"
    """A communicating backward ended; its gradients are in flight and ``step()`` comes next."""


@dataclasses.dataclass
class Round:
    """One step's gradients on their way through the plan: from the communicating backward to the last update."""

    step: int  # the step the gradients belong to
    forwards: int  # training forwards before the communicating backward (part of the step tag)
    backward_done: bool = False
    stepped: bool = False
    forward_reached: int = -1  # the next forward has reached buckets <= this one
    updates_left: int = 0
    scaler_checked: bool = False  # a GradScaler judged the gradients: no non-finite policy for this step
    written: bool = False  # clipping or unscale_ wrote to the averaged gradients after their averaging pass
    gathered: bool = False  # user code read p.grad before step(): every reduction finished, the average in p.grad
    shards_updated: int = 0  # sharded update: buckets < this one hold their updated shard (may be gathered)
    combined: set = dataclasses.field(default_factory=set)  # tied weights whose twin gradient was added


class Executor:
    """Carries out a :class:`~dearopt.plan.Plan` for one model and optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, backend: CollectiveBackend,
                 options: Options, buffer_size: int, partition_size: Optional[int] = None,
                 credit: Optional[int] = None, comm_hook: Optional[CommHook] = None,
                 on_step_landed: Optional[Callable[[], None]] = None):
        self.optimizer = optimizer
        self.model = model
        self.backend = backend
        self.options = options
        self.buffer_size = buffer_size
        self.partition_size = partition_size
        self.allreduce = options.allreduce  # dear's rule for all-reduced buckets; a measured choice may change it
        self.rank, self.world = backend.rank, backend.size
        from .sparsify import SparseExchange, Sparsify

        # a sparsifier owns its buckets' exchange (dearopt.sparsify); a cast hook only encodes what travels
        self.sparse = SparseExchange(comm_hook, self.rank, self.world) if isinstance(comm_hook, Sparsify) else None
        self.comm_hook = None if self.sparse is not None else comm_hook
        if getattr(self.comm_hook, "auto", False) and not self._low_precision():
            self.comm_hook = None  # the default, with nothing in bfloat16 or float16: every gradient as it is
        # Data collectives follow the plan's order on `backend`; the few control
        # messages (buffers, plan check, norms, profile) go on their own channel,
        # so that their place among the data ops never depends on timing.
        try:
            self.control = backend.fork()
        except NotImplementedError:
            self.control = backend
        self.timeline = Timeline(options.timeline, self.rank)
        self.checks = Checks(options, self.control, self.rank, self.world)
        self.updater = BucketUpdater(optimizer)
        self.sharding = ShardedUpdate(optimizer, self.control, self.rank, self.world) \
            if options.shard_optimizer else None
        self.recorder = ForwardOrderRecorder()
        policy = get_schedule(options.schedule)
        self.profile = ReadyProfile(options.priority or policy.needs_profile
                                    or (policy.mixes_allreduce and options.allreduce in ("auto", "predicted")),
                                    every=options.link_check_every)
        self.link_monitor = LinkMonitor() if options.link_check_every else None
        self.window = CreditWindow(credit)
        self.on_step_landed = on_step_landed
        self.launch_log = None  # the issuer's (step, kind, bucket, piece) log, kept across re-plans
        self.blocks = False  # dear's measured choice: buckets as Prophet's blocks from the profile, not by size
        # the plan and what is derived from it (set by _build_plan)
        self.plan: Optional[Plan] = None
        self.buckets: List[BucketState] = []
        self.issuer: Optional[Issuer] = None
        self._module_order: List[torch.nn.Module] = []
        self._where: Dict[int, Tuple[BucketState, int]] = {}
        self._module_bucket: Dict[int, int] = {}
        self._due: Dict[Point, List[OpState]] = {}
        self._updates_at: Dict[Point, List[int]] = {}
        self._early_ops: List[OpState] = []  # ops that may start before step(): what averaging needs
        self._averaged: List[Tuple[torch.Tensor, bool]] = []  # (region, is a shard) once the early ops completed
        self._checked_at_step: List[OpState] = []  # the ops leaving the averaged regions due by step()
        self._late_checked: set = set()  # buckets whose gradients are checked at their update
        self._own_gradient_buckets: List[int] = []  # buckets whose buffers hold this rank's gradients at step()
        self._final_after_backward: set = set()  # buckets whose p.grad holds the average once backward returns
        self._combines: List[Tuple[BucketState, int, BucketState, int, Point]] = []  # owner, twin, when
        # the life cycle
        self.state = TrainingState.IDLE
        self.round: Optional[Round] = None
        self.step_count = 0
        self.forwards = 0  # training forwards since the last step(), part of the step tag
        self.skipped_steps = 0
        self.pass_id = 0
        self.accumulated = 0  # backward passes since the last communicating one
        self.no_sync = False
        self._stale: set = set()
        self._unscaled_at = -1  # the step whose gradients unscale_() divided
        self._backward_start = 0.0
        self._names: Dict[int, str] = {}
        for name, p in model.named_parameters():
            self._names.setdefault(id(p), name)
        self.guard = PendingUpdateGuard(_EngineHook(self._make_current))
        self.grad_guard = GradientGuard(_EngineHook(self._gradients_requested))
        self._grad_views: Dict[int, int] = {}  # what the gradient guard watches (id -> bucket), from the plan
        self._grad_params: Dict[int, int] = {}
        self.gathered_steps = 0  # steps in a row whose p.grad user code read before step()
        self.reads_gradients = False  # re-planned for a loop that reads p.grad before every step()
        self.plan_generation = 0  # bumped when the trainable set or the groups change: what was derived is void
        self._derived_from: Optional[tuple] = None  # the trainable set and groups the plan was made for
        self._hooks = []
        self._param_hooks = []
        self._hooked = set()
        self._sparse_ids = set()  # parameters autograd gave a sparse gradient
        trainable = self._trainable()
        rows = options.embedding_rows
        if rows and not options.embedding_rows_given and any(p.is_cuda for p in trainable):
            # on a GPU the rows' count is read on the host (which then waits for the device) and NCCL's dense
            # all-reduce is fast: rows only where asked for
            rows = False
        self.tied = TiedEmbeddings(model, {id(p) for p in trainable} if rows else set(), _EngineHook)
        self._register_module_hooks()
        self._hook_new_params()

    def _low_precision(self) -> bool:
        from .comm_hooks import LOW_PRECISION

        return any(p.dtype in LOW_PRECISION for g in self.optimizer.param_groups for p in g["params"])

    # ------------------------------------------------------------------ hooks
    def _trainable(self) -> List[torch.nn.Parameter]:
        """The parameters the plan covers: those of the optimizer's groups that require grad, and frozen ones
        that still hold a gradient (torch's optimizer would still update them with it; they leave the plan once
        ``zero_grad(set_to_none=True)`` cleared it)."""
        seen, out = set(), []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen and (p.requires_grad or p.grad is not None):
                    seen.add(id(p))
                    out.append(p)
        return out

    def _plan_inputs(self, trainable: Optional[List[torch.nn.Parameter]] = None) -> tuple:
        """What the plan is derived from besides the knobs and the profile: the trainable set and the groups."""
        planned = {id(p) for p in (self._trainable() if trainable is None else trainable)}
        return tuple(tuple(id(p) for p in group["params"] if id(p) in planned)
                     for group in self.optimizer.param_groups)

    def _planned(self, trainable: Optional[List[torch.nn.Parameter]] = None) -> List[torch.Tensor]:
        """What the plan covers: the trainable parameters and the twins of their tied uses (:mod:`dearopt.tied`)."""
        trainable = self._trainable() if trainable is None else trainable
        ids = {id(p) for p in trainable}
        return trainable + [twin for owner, uses in self.tied.twins.items() if owner in ids for _, _, twin in uses]

    def _hook_new_params(self) -> None:
        """Give every trainable parameter a gradient hook (also ones unfrozen after construction)."""
        for p in self._planned():
            if id(p) not in self._hooked and p.requires_grad:  # a frozen one that still holds a gradient: later
                self._hooked.add(id(p))
                self._param_hooks.append(p.register_post_accumulate_grad_hook(_EngineHook(self._on_grad_ready)))
                watch = _SparseWatch(self._note_sparse, id(p))
                watch.handle = p.register_hook(watch)

    def _note_sparse(self, pid: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            self._sparse_ids.add(pid)
            located = self._where.get(pid)
            if located is not None:
                located[0].sparse[located[1]] = True

    def _register_module_hooks(self) -> None:
        self._hooks.append(self.model.register_forward_pre_hook(_EngineHook(self._root_pre_hook)))
        self._hooks.append(self.model.register_forward_hook(_EngineHook(self._root_post_hook)))
        # every module with parameters of its own, also those outside the optimizer now: a group added later
        # (add_param_group) must find its modules in the recorded forward order and their updates applied in time
        for module in self.model.modules():
            if next(module.parameters(recurse=False), None) is not None:
                self._hooks.append(module.register_forward_pre_hook(_EngineHook(self._module_pre_hook)))
        self._hooks.append(self.model.register_state_dict_pre_hook(_EngineHook(self._synchronize_hook)))
        self._hooks.append(self.model.register_load_state_dict_pre_hook(_EngineHook(self._synchronize_hook)))

    def _synchronize_hook(self, *args, **kwargs) -> None:
        self.synchronize()

    def remove_hooks(self) -> None:
        for h in self._hooks + self._param_hooks:
            h.remove()
        self._hooks, self._param_hooks = [], []

    def _root_pre_hook(self, module, args) -> None:
        self.guard.disarm()  # from here the module hooks apply pending updates as the forward reaches them
        if self.plan is None:
            self.recorder.start()
        if not (module.training and torch.is_grad_enabled()):
            self.synchronize()  # (an evaluation between backward and step() leaves the gradient guard armed)
            return
        self.grad_guard.disarm()
        self.forwards += 1
        self._hook_new_params()
        if self.options.broadcast_buffers and self.world > 1:
            self._broadcast_buffers()
        self.profile.begin_forward()

    def _root_post_hook(self, module, args, output) -> None:
        """A training forward ended: where this step's backward will leave ``p.grad`` without the average, the
        gradient guard goes on the stack here, on the thread that runs the user's code (armed when backward ends)."""
        if (module.training and torch.is_grad_enabled() and (self.plan is None or self._grad_params)
                and not self.no_sync and self.accumulated + 1 >= self.options.backward_passes_per_step):
            self.grad_guard.push()

    def _module_pre_hook(self, module, args) -> None:
        self.recorder.saw(module)
        r = self.round
        if r is None or not r.stepped:
            return
        bucket = self._module_bucket.get(id(module))
        if bucket is not None and bucket > r.forward_reached:
            self._reach_forward(bucket)
        elif self.window.credit is not None:
            self.issuer.pump(self._may_start)  # ops held back for credit start as soon as room frees

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm's running statistics...) on every rank, as DDP does before each training
        forward: all of them, of every dtype, as the bytes of one message (one collective, not one per dtype;
        each buffer's bytes start at a multiple of 8 so that they can be viewed as its dtype again)."""
        buffers = [b for b in self.model.buffers() if b.numel() > 0]
        if not buffers:
            return
        spans, offset = [], 0
        for b in buffers:
            nbytes = b.numel() * b.element_size()
            spans.append((offset, nbytes))
            offset += -(-nbytes // 8) * 8
        flat = torch.zeros(offset, dtype=torch.uint8, device=self.backend.device)
        for b, (start, nbytes) in zip(buffers, spans):
            flat[start:start + nbytes].copy_(b.detach().reshape(-1).view(torch.uint8))
        self.control.broadcast(flat, 0, step=self.step_count).wait()
        for b, (start, nbytes) in zip(buffers, spans):
            b.copy_(flat[start:start + nbytes].view(b.dtype).view_as(b))

    # ------------------------------------------------------------- planning
    def _build_plan(self, trainable: Optional[List[torch.nn.Parameter]] = None,
                    reuse: Sequence[BucketState] = ()) -> set:
        """Plan for ``trainable`` (by default :meth:`_trainable`).  A re-plan passes the old buckets as ``reuse``:
        one the new plan lays out alike (same spec, parameters and groups) is kept as it is; returns the ids of
        those kept."""
        if self.recorder.recording:
            self._module_order = self.recorder.stop()
        trainable = self._trainable() if trainable is None else trainable
        planned = self._planned(trainable)
        twins_by_module: Dict[int, List[torch.Tensor]] = {}
        for uses in self.tied.twins.values():
            for module, _, twin in uses:
                twins_by_module.setdefault(id(module), []).append(twin)
        ordered = self._agree_on_order(
            parameters_in_forward_order(self.model, self._module_order, planned, twins_by_module), planned)
        specs = self._specs(ordered)
        measured = self.profile.result
        if measured is not None and len(measured.ready) != len(specs):  # made for another trainable set
            measured = None
        ready, bandwidth, latency = (measured.ready, measured.bandwidth, measured.latency) if measured else (None,) * 3
        hook_name = self.comm_hook.name if self.comm_hook is not None else "none"
        if self.sparse is not None:  # part of the plan's fingerprint: every rank must sparsify alike
            s = self.sparse.sparsify
            hook_name = f"sparsify-{s.selection}-{s.density!r}-{s.warmup_steps}-{s.momentum!r}"
        groups = profile_blocks(specs, buffer_size=self.buffer_size, ready_times=ready, bandwidth=bandwidth,
                                latency=latency) if self.blocks else None
        plan = build_plan(specs, self.buffer_size, self.world, self.options.schedule, groups=groups,
                          phases=self._phases(), gathers_at_step=self.blocks,
                          partition_size=self.partition_size, priority=self.options.priority,
                          ready_times=ready, bandwidth=bandwidth, latency=latency, credit=self.window.credit,
                          comm_hook=hook_name,
                          first_bucket_size=self.options.first_bucket_size, allreduce=self.allreduce,
                          sharded_update=self.sharding is not None)
        self.checks.plan_agreement(plan, self.step_count)
        self._derived_from = self._plan_inputs(trainable)
        group_of_param = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                group_of_param.setdefault(id(p), gi)
        n_groups = len(self.optimizer.param_groups)
        old = {(b.spec, tuple(map(id, b.params)), b.group_of, b.n_groups): b for b in reuse}
        self.buckets, self._where, kept = [], {}, set()
        for spec in plan.buckets:
            params = [ordered[i] for i in spec.params]
            groups = tuple(group_of_param.get(id(p), -1) for p in params)
            state = old.pop((spec, tuple(map(id, params)), groups, n_groups), None)
            if state is not None:
                kept.add(id(state))
                for j, p in enumerate(params):
                    self._where[id(p)] = (state, j)
            else:
                state = BucketState(spec, params, [specs[i].name for i in spec.params], list(groups), n_groups,
                                    self.world, self.rank)
                for j, p in enumerate(params):
                    state.adopt(p, j)
                    state.sparse[j] = id(p) in self._sparse_ids
                    self._where[id(p)] = (state, j)
            self.buckets.append(state)
        self._module_bucket = {}
        for module in self.model.modules():
            idx = [self._where[id(p)][0].index for p in module.parameters(recurse=False) if id(p) in self._where]
            if idx:
                self._module_bucket[id(module)] = max(idx)
        if self.sparse is not None:  # the residuals follow their parameters into the new buckets
            position = {id(p): i for i, p in enumerate(self.model.parameters())}
            self.sparse.bind(self.buckets, [[position.get(id(p), -1 - i) for i, p in enumerate(b.params)]
                                            for b in self.buckets])
        if self.issuer is not None:  # a re-plan (nothing in flight): buffers kept for the old buckets go
            self.backend.release_workspace()
        self.issuer = Issuer(plan, self.buckets, self.backend, self.window, self.comm_hook, self.timeline,
                             prepare=self._write_meta, control=self.control,
                             rows_reductions=self.issuer.rows_reductions if self.issuer is not None else None,
                             sparse=self.sparse)
        if self.launch_log is not None:
            self.issuer.launch_log = self.launch_log
        self.launch_log = self.issuer.launch_log
        self.plan = plan
        self._index_plan()
        self._combines = []
        for owner_id, uses in self.tied.twins.items():
            for _, _, twin in uses:
                if id(twin) in self._where and owner_id in self._where:
                    owner_bucket, j = self._where[owner_id]
                    twin_bucket, k = self._where[id(twin)]
                    rows = [op.spec.due for op in self.issuer.ops if op.spec.bucket == owner_bucket.index]
                    self._combines.append((owner_bucket, j, twin_bucket, k, rows[-1]))
        return kept

    def _specs(self, ordered: List[torch.Tensor]) -> List[ParamSpec]:
        position = {id(p): i for i, p in enumerate(ordered)}
        specs = []
        for i, p in enumerate(ordered):
            dtype, size = str(p.dtype).replace("torch.", ""), p.element_size()
            owner = self.tied.owner_of.get(id(p))
            if owner is not None:
                name = f"{self._names.get(id(owner), 'tied weight')} (tied use)"
                specs.append(ParamSpec(name, p.numel(), dtype, size, twin_of=position[id(owner)]))
            else:
                specs.append(ParamSpec(self._names.get(id(p), f"param{i}"), p.numel(), dtype, size,
                                       row_numel=self.tied.row_numel.get(id(p), 0)))
        return specs

    def _combine(self, point: Optional[Point] = None) -> None:
        """Add the averaged gradient of each tied use (the twin) to its weight's, once per round, at ``point``
        (the moment the weight's rows are due) or, with None, now."""
        for owner, j, twin, k, due in self._combines:
            if (point is None or due == point) and id(owner.params[j]) not in self.round.combined:
                self.round.combined.add(id(owner.params[j]))
                owner.views[j].add_(twin.views[k])
                owner.mark_seen()

    def _agree_on_order(self, ordered: List[torch.nn.Parameter],
                        trainable: List[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
        """Rank 0's forward order for everyone: a rank whose first forward skipped a module (a rank-dependent
        branch) saw another order, and the plan must be the same on every rank."""
        if self.world == 1:
            return ordered
        device = self.control.device
        count = torch.tensor([len(trainable)], dtype=torch.int64, device=device)
        counts = torch.empty(self.world, dtype=torch.int64, device=device)
        self.control.all_gather(counts, count, step=self.step_count).wait()
        if len(set(counts.tolist())) > 1:
            raise PlanMismatchError(
                f"ranks have different numbers of trainable parameters ({counts.tolist()} by rank): the models or "
                f"the optimizers' parameters differ between ranks", rank=self.rank, op="plan check",
                step=self.step_count)
        index = {id(p): i for i, p in enumerate(trainable)}
        order = torch.tensor([index[id(p)] for p in ordered], dtype=torch.int64, device=device)
        self.control.broadcast(order, 0, step=self.step_count).wait()
        return [trainable[i] for i in order.tolist()]

    def _index_plan(self) -> None:
        """What the executor looks up per moment: ops due there, updates applied there, averaged regions."""
        self._due, self._updates_at = {}, {}
        for op in self.issuer.ops:
            self._due.setdefault(op.spec.due, []).append(op)
            if op.spec.update is not None:
                self._updates_at.setdefault(op.spec.update, []).append(op.spec.bucket)
        for buckets in self._updates_at.values():
            buckets.sort()
        ops = self.plan.ops
        early = [op for op in self.issuer.ops if moment_key(op.spec.start, ops) < moment_key(STEP)]
        self._early_ops = early
        last_early = {}
        for op in early:
            last_early[(op.spec.bucket, op.spec.piece)] = op
        self._averaged, self._checked_at_step = [], []
        checked_buckets = set()
        for (b, _), op in sorted(last_early.items()):
            if self.buckets[b].spec.twin_of is not None:  # added to its weight's gradient: counted there
                checked_buckets.add(b)
                continue
            entry = (op.piece.region(op.spec.result), op.spec.result == "shard")
            self._averaged.append(entry)
            if moment_key(op.spec.due) <= moment_key(STEP):
                self._checked_at_step.append(op)
                checked_buckets.add(b)
        self._late_checked = {b.index for b in self.buckets} - checked_buckets
        self._own_gradient_buckets = sorted({op.spec.bucket for op in last_early.values() if op.spec.result == "shard"})
        by_backward_end = moment_key(BACKWARD_END)
        self._final_after_backward = {b.index for b in self.buckets}
        for op in self.issuer.ops:
            late = moment_key(op.spec.due) > by_backward_end
            shard = op.spec.result == "shard" and last_early.get((op.spec.bucket, op.spec.piece)) is op
            if late or shard:
                self._final_after_backward.discard(op.spec.bucket)
        self._averaged_whole = [(op.piece.full_grad, False) for (b, _), op in sorted(last_early.items())
                                if self.buckets[b].spec.twin_of is None]
        # what user code may not read before step() without finishing the reductions first
        self._grad_views, self._grad_params = {}, {}
        for b in self.buckets:
            if b.spec.twin_of is None and b.index not in self._final_after_backward:
                for p, view in zip(b.params, b.views):
                    self._grad_params[id(p)] = self._grad_views[id(view)] = b.index

    def _profile_changes_plan(self) -> bool:
        """Whether rank 0's freshly shared profile changes the plan (the same answer on every rank: pure, from
        the same numbers).  Without priority the profile only decides ``dear``'s all-reduced buckets; when
        those stay as they are, re-planning would only cost (pending updates applied early, new buffers)."""
        if not self.profile.fresh:
            return False
        self.profile.fresh = False
        if self.options.priority or self.plan is None:
            return True
        ready, bandwidth = self.profile.result.ready, self.profile.result.bandwidth
        policy = get_schedule(self.options.schedule)
        groups = policy.bucket_groups(self.plan.params, buffer_size=self.buffer_size, ready_times=ready,
                                      bandwidth=bandwidth, latency=self.profile.result.latency)
        if groups is not None:  # the schedule forms its buckets from the profile (Prophet's blocks)
            return [list(b.params) for b in self.plan.buckets] != groups
        latency = self.profile.result.latency
        chosen = allreduce_buckets(self.plan.buckets, self.allreduce, ready, bandwidth, latency, self._phases()) \
            if policy.mixes_allreduce else frozenset()
        return tuple(sorted(chosen)) != tuple(self.plan.allreduce)

    def _phases(self) -> Optional[Tuple[float, float]]:
        """The profiled forward and backward computation (seconds), where the profile timed the forward."""
        measured = self.profile.result
        if measured is None or measured.forward is None:
            return None
        return measured.forward, measured.backward

    def plan_choices(self) -> List[Tuple[Dict[str, object], Tuple]]:
        """The plans worth measuring against each other under ``allreduce="auto"``, as the knobs that make each
        (``{"allreduce": rule}``, and ``"blocks": True`` for Prophet's blocks) with what it plans (the
        all-reduced buckets; the blocks): the profile's rule (``"predicted"``), DeAR's (none: ``0.0``), DDP's
        (every bucket: ``1.0``), and DeAR's ops on Prophet's gradient blocks from the same profile, every
        all-gather started at ``step()`` (where the link is the bottleneck a bucket that starts as soon as its
        gradients exist keeps it busier than buckets of one size); plans alike counted once.  Empty without a
        profile or where nothing is to choose (one rank, another schedule, a fixed fraction)."""
        if (self.options.allreduce != "auto" or self.world == 1 or self.plan is None or self.profile.result is None
                or self.reads_gradients or not get_schedule(self.options.schedule).mixes_allreduce):
            return []
        measured = self.profile.result
        ready, bandwidth, latency = measured.ready, measured.bandwidth, measured.latency
        choices, seen = [], set()
        for rule in ("predicted", 0.0, 1.0):
            chosen = allreduce_buckets(self.plan.buckets, rule, ready, bandwidth, latency, self._phases())
            if chosen not in seen:
                seen.add(chosen)
                choices.append(({"allreduce": rule}, tuple(sorted(chosen))))
        sized = [list(b.params) for b in self.plan.buckets] if not self.blocks else None
        blocks = profile_blocks(self.plan.params, buffer_size=self.buffer_size, ready_times=ready,
                                bandwidth=bandwidth, latency=latency)
        if blocks is not None and blocks != sized:
            choices.append(({"allreduce": 0.0, "blocks": True}, tuple(tuple(g) for g in blocks)))
        return choices if len(choices) > 1 else []

    @staticmethod
    def _gradient_of(bucket: BucketState, j: int) -> Optional[torch.Tensor]:
        """A copy of parameter ``j``'s gradient as the bucket holds it; None if it has none since zero_grad()."""
        if not bucket.stale[j]:
            return bucket.views[j].clone()
        grad = bucket.params[j].grad  # stale view: autograd may already have handed p a fresh gradient
        if grad is None:
            return None
        return (grad.to_dense() if grad.is_sparse else grad).detach().clone()

    def replan(self, buffer_size: Optional[int] = None, partition_size: Optional[int] = None,
               credit: Optional[int] = None, allreduce: Union[float, str, None] = None,
               blocks: Optional[bool] = None, _inside_backward: bool = False) -> None:
        """Re-plan at an iteration boundary; gradients and pending updates are preserved exactly.  ``blocks``:
        form the buckets as Prophet's blocks from the profile (True) or by ``buffer_size`` (False)."""
        self.synchronize()
        if self.state is TrainingState.REDUCING or (self.state is TrainingState.BACKWARD and not _inside_backward):
            raise UsageError("replan() must be called between step() and the next backward()")
        if buffer_size is not None:
            self.buffer_size = buffer_size
        if partition_size is not None:
            self.partition_size = partition_size
        if credit is not None:
            self.window = CreditWindow(credit)
        if allreduce is not None:
            self.allreduce = allreduce
        if blocks is not None:
            self.blocks = bool(blocks)
        if self.plan is None:  # nothing recorded yet: the first plan will use the new knobs
            return
        if self.sharding is not None:  # the state back in the ordinary layout; the new buckets cut it anew
            self.sharding.release()
        saved = {id(p): (b.used[j], b.has_grad[j], b.stamp[j]) for b in self.buckets for j, p in enumerate(b.params)}
        trainable = self._trainable()
        for b in self.buckets:  # each p.grad is its gradient: the old bucket's view, or what autograd gave it
            for j, p in enumerate(b.params):
                if not b.stale[j]:
                    p.grad = b.views[j]
        had = {id(p) for b in self.buckets for p in b.params if p.grad is not None}
        # Buckets the new plan lays out alike (a change of the ops only: dear's all-reduced buckets, credit) are
        # kept with their gradients; a new bucket takes each p.grad from the old view (no copy held aside).
        kept = self._build_plan(trainable, reuse=self.buckets)
        for b in self.buckets:
            if id(b) in kept:
                continue
            for j, (p, view) in enumerate(zip(b.params, b.views)):
                if id(p) not in saved:  # newly trainable: _build_plan took its .grad, if any
                    continue
                b.used[j], b.has_grad[j], b.stamp[j] = saved[id(p)]
                if id(p) not in had:  # it had none: cleared by zero_grad(set_to_none=True), no gradient since
                    p.grad = None
                    b.stale[j] = True
                    continue
                # gradients already counted in the backward pass now running (a re-plan inside backward);
                # at a step boundary the stamps belong to the finished pass and nothing is ready yet
                b.ready += self.state is TrainingState.BACKWARD and b.stamp[j] == self.pass_id
            b.mark_seen()
        # The old buckets, their ops and handles refer to each other: only the cycle collector frees them, and
        # it runs by object count, not bytes, so a tuner's re-plans kept a model's worth of buffers alive each
        # (BERT-Base: ~0.5 GiB per re-plan, out of memory after about twenty).  Re-plans are rare: collect now.
        gc.collect()

    # ------------------------------------------------------------- backward
    def _begin_backward(self) -> None:
        if self.state is TrainingState.REDUCING:  # names the DistOptim that communicated (several on one model)
            from .functions import second_backward_refusal

            raise second_backward_refusal(self)
        self.pass_id += 1
        # Buckets still waiting for their update were not reached by this
        # forward: apply them now (their parameters cannot have gradients
        # unless they were read before their own module ran).
        self._stale = {b.index for b in self.buckets if b.pending}
        if self._stale:
            self.synchronize()
        self._backward_start = self.timeline.now()
        torch.autograd.Variable._execution_engine.queue_callback(_EngineHook(self._end_backward))
        self._hook_new_params()
        self.state = TrainingState.BACKWARD
        if self.profile.remeasured:  # the link monitor's measurement, shared by rank 0 at the last step()
            self.profile.remeasured = False
            if self.link_monitor is not None and self.link_monitor.observe(
                    self.step_count, self.profile.result.bandwidth, self.profile.latest.bandwidth):
                self.profile.result, self.profile.fresh = self.profile.latest, True
        if self._plan_inputs() != self._derived_from:
            # a parameter was unfrozen or frozen, or a group added: re-plan, and forget what was derived from the
            # old set (the profile, Prophet's blocks, the measured choice); the same on every rank
            self._forget_derived()
            self.replan(_inside_backward=True)
        elif self._profile_changes_plan():  # rank 0's profile changes the plan: re-plan (the same on every rank)
            self.replan(_inside_backward=True)
        communicates = (not self.no_sync) and (self.accumulated + 1 >= self.options.backward_passes_per_step)
        if communicates:
            self.round = Round(self.step_count, self.forwards)
            for b in self.buckets:
                b.start_round()
            self.issuer.start_round(self.step_count)
            self.profile.begin_backward(self.step_count, len(self.plan.params))

    def _show_predicted_sends(self) -> None:
        """Under a schedule whose buckets come from the profile (Prophet's blocks), each bucket's reduction as the
        link model predicted it, placed in the timeline from this backward's start (the measured ones are on
        the communication lane)."""
        policy = get_schedule(self.options.schedule)
        measured = self.profile.result
        if not hasattr(policy, "block_latency") or measured is None or self.plan is None:
            return  # not Prophet's blocks (a registered schedule may form buckets its own way)
        from .schedules.prophet import predicted_sends

        sizes = [p.nbytes for p in self.plan.params]
        blocks = [b.params for b in self.plan.buckets]
        times = predicted_sends(blocks, measured.ready, sizes, measured.bandwidth,
                                policy.block_latency(measured.latency))
        for bucket, (start, end) in zip(self.plan.buckets, times):
            self.timeline.span_at(f"predicted {policy.reduction}", "predicted", self._backward_start + start * 1e6,
                                  (end - start) * 1e6, bucket=bucket.index)

    def _located_in_backward(self, p) -> Optional[Tuple[BucketState, int]]:
        """A gradient hook's first part: the plan made (first backward), the pass begun; ``p``'s bucket and
        position, or None if ``p`` was not trainable when the plan was made."""
        if self.plan is None:
            self._build_plan()
        if self.state is not TrainingState.BACKWARD:
            self._begin_backward()
        return self._where.get(id(p))

    def _on_grad_ready(self, p) -> None:
        located = self._located_in_backward(p)
        if located is None:
            return
        bucket, j = located
        if bucket.index in self._stale:
            raise UsageError(
                f"parameter {bucket.names[j]!r} received a gradient although its pending update was not applied "
                f"before it was used: it was read in forward before its own module ran. Use schedule='wfbp', "
                f"or call optimizer.synchronize() before such a forward")
        bucket.take_gradient(p, j)
        if self.round is None or bucket.stamp[j] == self.pass_id:
            return
        bucket.stamp[j] = self.pass_id
        bucket.ready += 1
        if self.profile.recording:
            self.profile.grad_ready(bucket.spec.params[j])
            self.issuer.observe()
        if bucket.complete or self.window.credit is not None:
            # with a credit window, an op held back for credit may start at any gradient hook once
            # earlier ops have finished, not only when the next bucket completes
            self.issuer.pump(self._may_start)

    def _end_backward(self) -> None:
        self.timeline.span("backward", "compute", self._backward_start)
        if self.timeline.enabled:
            self._show_predicted_sends()
        if self.round is None:
            self.state = TrainingState.ACCUMULATED
            self.accumulated += 1
            return
        self.accumulated = 0
        self.state = TrainingState.REDUCING
        for b in self.buckets:  # unused since zero_grad(): a zero gradient (or the bucket would send a stale one)
            b.clear_stale()
        if self.profile.recording:
            self.profile.end_backward()
            self.issuer.observe()
        self._complete_due(BACKWARD_END)
        self._combine(BACKWARD_END)
        self.round.backward_done = True
        self.issuer.pump(self._may_start)
        if self._grad_params:  # p.grad does not hold the average yet: reading it must finish the reductions
            self.grad_guard.arm(self._grad_views, self._grad_params)

    def _write_meta(self, bucket: BucketState) -> None:
        r = self.round
        dtype = self.comm_hook.wire_dtype(bucket.buffer.dtype) if self.comm_hook is not None else bucket.buffer.dtype
        self.checks.write_meta(bucket, self.checks.tag(r.step, r.forwards, dtype))

    def _may_start(self, op: OpState) -> bool:
        """Has the moment come at which ``op`` may start?  (``AFTER`` is the issuer's to judge.)"""
        r, start = self.round, op.spec.start
        if self.sharding is not None and op.spec.kind == ALL_GATHER and op.spec.bucket >= r.shards_updated:
            return False  # it carries parameters: not before this rank's shard of them is updated
        if start.when is When.GRADS_READY:
            return r.backward_done or op.bucket.complete
        if start.when is When.BACKWARD_END:
            return r.backward_done
        if start.when is When.STEP:
            return r.stepped
        if start.when is When.FORWARD:
            return r.forward_reached >= start.index
        return True

    def _complete_due(self, point: Point) -> None:
        """Start, wait for and complete the ops due at ``point`` (before the moment is marked as reached)."""
        self.issuer.force_and_complete(self._due.get(point, ()), self._may_start, host=self.profile.recording)

    # ----------------------------------------------------------------- step
    def step(self, skip: bool = False, scaler_checked: bool = False) -> None:
        """Complete the step's reductions, check, and apply (or schedule) the updates.

        ``skip``: a GradScaler found non-finite gradients (the same on every
        rank); ``scaler_checked``: a GradScaler checked the gradients, so the
        ``nonfinite`` policy does not apply to this step.
        """
        self.grad_guard.disarm()
        if self.options.debug and self.plan is not None:
            self.checks.parameters(self.buckets, self.step_count)
        self._require_gradients("step")
        r = self.round
        if r.gathered:  # p.grad held the average since user code read it: what it holds now is the gradient
            self._take_user_gradients()
        else:
            self._check_gradient_writes()
        self.gathered_steps = self.gathered_steps + 1 if r.gathered else 0
        r.scaler_checked = scaler_checked
        t0 = self.timeline.now()
        self._complete_due(STEP)
        self._combine(STEP)
        r.stepped = True
        regions = [op.piece.region(op.spec.result) for op in self._checked_at_step]
        judge = not scaler_checked and self.options.nonfinite != "ignore"
        agreed = self._share_meta(r.step, judge and self._local_nonfinite()) if self.sharding is not None else None
        # the step tags and this rank's non-finite count in one read from the device
        count = self._nonfinite_count() if judge and agreed is None else None
        tagged = range(len(self.buckets)) if self.sharding is not None else self._updates_at.get(STEP, ())
        count = self.checks.check_tags_of([self.buckets[b] for b in tagged], r.step, extra=count)
        if judge:
            sharded = any(op.spec.result == "shard" for op in self._checked_at_step)
            skip = self.checks.nonfinite(regions, sharded, self.buckets, r.step, own=self._own_gradient_buckets,
                                         agreed=agreed, local=None if agreed is not None else bool(count))
        if self.profile.recording:
            self.profile.share(self.control, self.issuer.reduction_services(), r.step)
        self.forwards = 0
        self.step_count += 1
        self.state = TrainingState.IDLE
        if skip:  # the same decision on every rank: finish what was started, apply nothing
            self.issuer.complete_started()
            self.skipped_steps += 1
            self._finish_round()
            return
        for b in self.buckets:
            b.pending = True
        r.updates_left = len(self.buckets)
        self.updater.begin_step(sum(1 for b in self.buckets if b.has_members))
        if self.sharding is not None:
            self._update_shards()
        self._update([self.buckets[b] for b in self._updates_at.get(STEP, ())], tags_checked=True)
        if self.round is not None:
            self.issuer.pump(self._may_start)  # the ops that start at step()
            self.guard.arm({id(p): b.index for b in self.buckets if b.pending for p in b.params})
        self.timeline.span("step", "update", t0)

    def _local_nonfinite(self) -> bool:
        count = self._nonfinite_count()
        return count is not None and bool(count > 0)

    def _nonfinite_count(self):
        """How many of this rank's regions due by ``step()`` hold inf or NaN, as a device scalar nobody has read
        yet (None: nothing to check), so that the caller reads it with the step tags, once.  Where the averaging pass
        flagged a region (:meth:`Issuer._average`) and nothing can have written to it since, its flag answers;
        any other region is summed.  Written since: by clipping or ``unscale_`` (``round.written``), by adding a
        tied weight's second gradient, or by the user's code where ``p.grad`` holds the average when backward
        returns (``wfbp``, all-reduced buckets): such code may write through ``.data`` or a raw kernel, which no
        version counter sees, so those buckets are always summed.  The choice depends only on the plan and on
        calls every rank makes, so every rank judges alike."""
        r = self.round
        combined_into = {owner.index for owner, *_ in self._combines}
        flags, summed = [], []
        for op in self._checked_at_step:
            b = op.spec.bucket
            if (op.nonfinite is not None and not r.written and b not in combined_into
                    and b not in self._final_after_backward):
                flags.append(op.nonfinite)
            else:
                summed.append(op.piece.region(op.spec.result))
        count = self.checks.nonfinite_count(summed)
        if flags:
            device = flags[0].device
            flagged = (torch.cat([f.to(device).reshape(-1) for f in flags]) > 0).sum()
            count = flagged if count is None else count + flagged.to(count.device)
        return count

    def _check_gradient_writes(self) -> None:
        """Gradients changed between backward() and step() must not be changed behind the engine's back."""
        for b in self.buckets:
            if b.index in self._final_after_backward or b.spec.twin_of is not None:
                continue  # p.grad held the averaged gradient when backward returned: any change is the user's own
            replaced = b.replaced_gradients()
            if not replaced and not b.written_by_others():
                continue
            if self.world == 1:  # with one rank the "reduction" was a copy: take the changed gradients again
                self._retake_local(b)
                continue
            what = (f"the .grad of {replaced[:3]} was replaced by another tensor" if replaced else
                    f"a gradient of bucket {b.index} ({', '.join(b.names[:3])}{', ...' if len(b.names) > 3 else ''}) "
                    f"was changed in place")
            raise UsageError(
                f"{what} between backward() and step(), but under schedule={self.options.schedule!r} p.grad holds "
                f"this rank's own gradient while the average travels or is kept as shards, so the change would "
                f"be lost or mixed in. Change p.grad only after backward() has returned (the first read of a p.grad "
                f"then gathers the average into every p.grad, as torch's clip_grad_norm_ and GradScaler.unscale_ "
                f"find it), or call optimizer.clip_grad_norm_(...), optimizer.clip_grad_value_(...) or "
                f"optimizer.unscale_(scaler), which act on the averaged gradients [rank {self.rank}, step "
                f"{self.step_count}]")

    def _gradients_requested(self, bucket: int) -> None:
        """User code read a ``p.grad`` between backward() and step() whose average was still travelling or kept as
        this rank's shard (torch's ``clip_grad_norm_``, ``GradScaler.unscale_``): finish every reduction now and
        gather each bucket's average into ``p.grad``, so that the code sees and changes the averaged gradient, as
        under DDP.  Every rank runs the same code, so every rank issues the same collectives in the same order
        (a rank that alone reads ``p.grad`` here waits for the others' next forward)."""
        self.grad_guard.disarm()
        r = self.round
        if r is None or r.stepped or r.gathered or not r.backward_done:
            return
        try:
            with self.guard.suspended():
                # the reductions first: a gather reads what completing its reduce-scatter wrote (the local sum)
                self.issuer.force_and_complete(self._early_ops, self._may_start)
                if self.sharding is None:
                    self.issuer.force_and_complete(self.issuer.ops, self._may_start)
                else:  # the plan's all-gathers carry parameters after step(): the gradients' average needs its own
                    self._gather_gradient_shards()
                self._combine()
        except CollectiveTimeoutError as exc:
            raise CollectiveTimeoutError(
                f"{exc}. This rank read p.grad between backward() and step(), which gathers the averaged gradients "
                f"(every rank must take part); if only this rank reads it (a log line under `if rank == 0`), the "
                f"others wait in step() meanwhile: read p.grad on every rank, or after step()",
                rank=self.rank, op="gather p.grad", step=r.step) from exc
        r.gathered = r.written = True
        for b in self.buckets:
            b.mark_seen()

    def _gather_gradient_shards(self) -> None:
        """Sharded update: each piece's averaged shards all-gathered into the gradient views (flags and tags left
        as they are: the sharded step sums them itself)."""
        scratch = None
        for b in self.buckets:
            for piece in b.pieces:
                if scratch is None or scratch.numel() < piece.full.numel() or scratch.dtype != piece.full.dtype:
                    scratch = torch.empty(piece.full.numel(), dtype=piece.full.dtype, device=piece.full.device)
                out = scratch[:piece.full.numel()]
                self.backend.all_gather(out, piece.shard, bucket=b.index, step=self.round.step).wait()
                piece.full_grad.copy_(out[:piece.full_grad.numel()])

    def _take_user_gradients(self) -> None:
        """At step() after the averages were gathered into ``p.grad``: what the user's code left there (changed
        in place, or a new tensor) is the gradient; this rank's shards are taken from it again, so the checks and
        a sharded update see it."""
        for b in self.buckets:
            for j, (p, view) in enumerate(zip(b.params, b.views)):
                grad = p.grad
                if grad is not None and grad is not view:
                    view.copy_(grad.to_dense() if grad.is_sparse else grad)
                    p.grad = view
        for i in self._own_gradient_buckets:
            for piece in self.buckets[i].pieces:
                piece.shard_grad.copy_(piece.own_in_full)
        for b in self.buckets:
            b.mark_seen()

    def adapt_to_gradient_reads(self) -> bool:
        """After :data:`GATHERED_STEPS_TO_ADAPT` steps in a row whose ``p.grad`` was read before ``step()``: where
        the schedule mixes in all-reduces and the rule is not fixed, re-plan every bucket as an all-reduce in
        backward (the gathers cannot overlap the next forward anyway, and one collective costs less than two).
        Called at a step boundary on every rank; True if it re-planned."""
        if (self.reads_gradients or self.gathered_steps < GATHERED_STEPS_TO_ADAPT or self.sharding is not None
                or self.world == 1
                or self.options.allreduce not in ("auto", "predicted")
                or not get_schedule(self.options.schedule).mixes_allreduce):
            return False
        self.reads_gradients = True
        if self.rank == 0:
            _log.warning(
                "dearopt: p.grad was read between backward() and step() in %d steps in a row (torch's "
                "clip_grad_norm_, GradScaler.unscale_, ...): each time every bucket's reduction was finished "
                "first. Re-planned with every bucket all-reduced in backward (DDP's plan). "
                "optimizer.clip_grad_norm_(...) and optimizer.unscale_(scaler) act on the averaged shards and keep "
                "schedule=%r's overlap.", self.gathered_steps, self.options.schedule)
        self.replan(allreduce=1.0, blocks=False)
        return True

    def _forget_derived(self) -> None:
        """The trainable set or the groups changed: the profile, Prophet's blocks and the measured choice were
        derived from the old set; drop them (the profile is taken again from the next step)."""
        self.profile.forget(self.step_count + 1)
        self.blocks = False
        if not self.reads_gradients:
            self.allreduce = self.options.allreduce
        self.plan_generation += 1

    def _retake_local(self, bucket: BucketState) -> None:
        """One rank: p.grad (changed in place or replaced after backward) is the gradient to use."""
        for j, p in enumerate(bucket.params):
            if p.grad is not bucket.views[j]:
                bucket.take_gradient(p, j)
        for piece in bucket.pieces:
            piece.shard.copy_(piece.full)
        bucket.mark_seen()

    def _reach_forward(self, target: int) -> None:
        """The forward reached bucket ``target``: carry out every bucket's forward moment up to it, in order."""
        while self.round is not None and self.round.forward_reached < target:
            k = self.round.forward_reached + 1
            point = forward_of(k)
            t0 = time.perf_counter()
            self._complete_due(point)
            self.profile.forward_waited(time.perf_counter() - t0)
            self.round.forward_reached = k
            self.issuer.pump(self._may_start)  # e.g. prefetch the next bucket's all-gather
            due = self._updates_at.get(point, ())
            if due:
                self._update([self.buckets[b] for b in due], tags_checked=False)

    def _share_meta(self, step: int, nonfinite: bool) -> bool:
        """Sharded update: every bucket's used flags and step tags summed over ranks on the control channel, with
        this rank's non-finite answer (``nonfinite``); returns whether any rank found inf/NaN.  The
        reduce-scatter leaves the flags' and tags' sum only on the rank whose shard holds the bucket's tail, and
        the all-gather carries parameters, so without this message no other rank would learn them; the
        non-finite check rides along instead of taking a message of its own."""
        if self.world == 1:
            return nonfinite
        meta = torch.cat([torch.tensor([1.0 if nonfinite else 0.0], dtype=torch.float64)]
                         + [torch.cat([b.flags, b.tags]).double().cpu() for b in self.buckets]).to(self.control.device)
        self.control.all_reduce(meta, "sum", step=step).wait()
        meta = meta.to(self.buckets[0].buffer.device)
        found = float(meta[0]) > 0
        offset = 1
        for b in self.buckets:
            n = len(b.params)
            b.flags.copy_(meta[offset:offset + n])
            b.tags.copy_(meta[offset + n:offset + n + self.world])
            offset += n + self.world
            b.mark_seen()
        return found

    def _included(self, bucket: BucketState) -> List[bool]:
        """Which parameters of the bucket the update includes: those some rank produced a gradient for, and
        those unused on every rank that keep the gradient they had (none after ``zero_grad(set_to_none=True)``,
        so the optimizer skips them, else their last one)."""
        used = self.checks.used(bucket)
        for owner, j, twin, k, _ in self._combines:  # a tied weight is used where its twin was
            if owner is bucket:
                used[j] = used[j] or self.checks.used(twin)[k]
        include = [u or had for u, had in zip(used, bucket.has_grad)]
        bucket.has_grad = include
        return include

    def _update_shards(self) -> None:
        """Sharded update, at ``step()``: each bucket's optimizer update on this rank's shard, in bucket order; the
        all-gathers that start from here on carry the updated parameters.  The whole averaged gradient exists on
        no rank, so every ``p.grad`` becomes None (as after ``zero_grad(set_to_none=True)``)."""
        self.sharding.prepare(self.buckets, self.plan.fingerprint())
        for bucket in self.buckets:
            t0 = self.timeline.now()
            include = self._included(bucket)
            if bucket.has_members:
                self.sharding.apply(bucket, include, self.updater)
            bucket.zero(set_to_none=True)
            self.round.shards_updated = bucket.index + 1
            self.timeline.span("update shard", "update", t0, bucket=bucket.index)
            self.issuer.pump(self._may_start)  # its gather (due first in forward) overlaps the next updates

    def _update(self, buckets: List[BucketState], tags_checked: bool) -> None:
        """The optimizer's update of ``buckets``, due at the same moment: each checked, then one call of the
        wrapped optimizer over all of them (:meth:`BucketUpdater.apply_buckets`), then each landed."""
        t0 = self.timeline.now()
        if self.sharding is None:  # sharded: updated at step(); the all-gather just completed brought them
            step, chosen = self.round.step, []
            for bucket in buckets:
                if not tags_checked:
                    self.checks.check_tags(bucket, step)
                if bucket.index in self._late_checked and not self.round.scaler_checked:
                    self.checks.nonfinite_bucket(bucket, self.buckets, step)
                include = self._included(bucket)
                if bucket.has_members:
                    bucket.restore_views()  # zero_grad(set_to_none=True) may have come first and set p.grad to None
                    chosen.append((bucket, include))
            if chosen:
                self.updater.apply_buckets(chosen)
        for bucket in buckets:
            self._land(bucket, t0)

    def _land(self, bucket: BucketState, t0: float) -> None:
        """The bucket's update is in its parameters: no longer pending; the round ends with the last one."""
        bucket.pending = False
        if bucket.zero_after_update is not None:
            bucket.zero(bucket.zero_after_update)
            bucket.zero_after_update = None
        self.timeline.span("update", "update", t0, bucket=bucket.index)
        self.round.updates_left -= 1
        if self.round.updates_left == 0:
            self._finish_round()

    def _finish_round(self) -> None:
        self.round = None
        self.guard.disarm()
        if self.on_step_landed is not None:
            self.on_step_landed()

    def _make_current(self, bucket: int) -> None:
        """User code touched a parameter of ``bucket`` after step(): apply the pending updates up to it first."""
        if self.round is not None and self.round.stepped:
            self._reach_forward(bucket)

    def synchronize(self) -> None:
        """Apply every pending update now (parameters become current)."""
        if self.round is not None and self.round.stepped:
            self._reach_forward(len(self.buckets) - 1)
        self.timeline.flush()

    # ----------------------------------------------------------- gradients
    def _require_gradients(self, what: str) -> None:
        if self.state is TrainingState.REDUCING:
            return
        bpps = self.options.backward_passes_per_step
        if self.plan is None or self.accumulated == 0:
            raise UsageError(f"cannot {what}: no backward() since the last step(); call loss.backward() first")
        raise UsageError(f"cannot {what}: only {self.accumulated} of backward_passes_per_step={bpps} backward "
                         f"passes were run (or they ran inside no_sync())")

    def finish_averaging(self) -> List[Tuple[torch.Tensor, bool]]:
        """Complete every op that may run before ``step()``; return the averaged gradient regions.

        Each region is ``(tensor, is_shard)``: this rank's shard of a bucket
        piece (summed over ranks it covers the piece), or the whole piece.
        """
        self._require_gradients("finish the gradient reduction")
        self.issuer.force_and_complete(self._early_ops, self._may_start)
        self._combine()
        if self.round is not None and self.round.gathered:  # p.grad holds the average: that is where it lives now
            return self._averaged_whole
        return self._averaged

    @property
    def gradients_in_place_before_step(self) -> bool:
        """Whether every ``p.grad`` holds the averaged gradient once :meth:`finish_averaging` returns."""
        return not any(is_shard for _, is_shard in self._averaged)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` would."""
        regions = self.finish_averaging()
        total_norm = self._global_norm(regions, float(norm_type))
        coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
        for region, _ in regions:
            region.mul_(coef.to(region.dtype))
        self._mark_written()
        return total_norm.cpu()

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged gradients to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``."""
        clip_value = float(clip_value)
        for region, _ in self.finish_averaging():
            region.clamp_(-clip_value, clip_value)
        self._mark_written()

    def _mark_written(self) -> None:
        for b in self.buckets:
            b.mark_seen()
        if self.round is not None:  # the averaging pass's inf/NaN flags no longer describe the gradients
            self.round.written = True

    def _global_norm(self, regions, norm_type: float) -> torch.Tensor:
        """The norm over whole pieces and shards; shards are combined over ranks on the control channel."""
        device = self.control.device
        shards = [r for r, is_shard in regions if is_shard]
        whole = [r for r, is_shard in regions if not is_shard]
        if norm_type == math.inf:
            def local_max(rs):
                return max((float(r.abs().max()) for r in rs if r.numel()), default=0.0)
            total = torch.tensor([local_max(shards)], dtype=torch.float64, device=device)
            if shards and self.world > 1:
                self.control.all_reduce(total, "max", step=self.step_count).wait()
            return torch.tensor(max(float(total), local_max(whole)), dtype=torch.float32)
        def local_sum(rs):
            return float(sum(r.double().abs().pow(norm_type).sum() for r in rs)) if rs else 0.0
        total = torch.tensor([local_sum(shards)], dtype=torch.float64, device=device)
        if shards and self.world > 1:
            self.control.all_reduce(total, "sum", step=self.step_count).wait()
        return torch.tensor((float(total) + local_sum(whole)) ** (1.0 / norm_type), dtype=torch.float32)

    def unscale_(self, scale: float) -> None:
        """Divide the averaged gradients (shards where the schedule keeps shards) by ``scale``."""
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"unscale_ needs a positive finite scale, got {scale}")
        self._check_not_unscaled()
        regions = self.finish_averaging()
        self._unscaled_at = self.step_count
        for region, _ in regions:
            region.div_(scale)
        self._mark_written()

    def unscale_and_check(self, inv_scale: torch.Tensor) -> bool:
        """GradScaler's unscale on the averaged gradients: multiply by ``inv_scale``; True if any is not finite.

        The answer is the same on every rank (shards are combined over ranks),
        so every rank skips the same steps and adjusts its scale alike.
        """
        self._check_not_unscaled()
        regions = self.finish_averaging()
        self._unscaled_at = self.step_count
        found = False
        for region, _ in regions:
            region.mul_(inv_scale.to(device=region.device, dtype=region.dtype))
            found = found or (region.numel() > 0 and not bool(torch.isfinite(region.sum())))
        self._mark_written()
        if any(is_shard for _, is_shard in regions) and self.world > 1:
            flag = torch.tensor([1.0 if found else 0.0], device=self.control.device)
            self.control.all_reduce(flag, "max", step=self.step_count).wait()
            found = float(flag) > 0
        return found

    def _check_not_unscaled(self) -> None:
        if self._unscaled_at == self.step_count:
            raise UsageError("unscale_() was already called since the last step(); the gradients would be divided "
                             "twice")

    def reduce_gradients(self) -> None:
        """Finish communication so that every ``p.grad`` holds the averaged gradient (under schedules that keep
        shards, they are gathered now: that step's gathers no longer overlap the next forward)."""
        self._require_gradients("finish the gradient reduction")
        if self._grad_params:
            self._gradients_requested(-1)
        self.finish_averaging()

    def zero_grad(self, set_to_none: bool = True) -> None:
        with self.guard.suspended():
            self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        if self.plan is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        if self.state is TrainingState.REDUCING:
            raise UsageError("zero_grad() was called after backward() and before step(): the gradients being "
                             "communicated would be lost; call it before backward() or after step()")
        for bucket in self.buckets:
            if bucket.pending:
                bucket.zero_after_update = bool(set_to_none)  # zeroed right after its update
                if set_to_none:  # p.grad is None, as in torch; the update still reads the reduced gradient
                    for p in bucket.params:
                        p.grad = None
            else:
                bucket.zero(bool(set_to_none))
        planned = {id(p) for b in self.buckets for p in b.params}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in planned and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def close(self) -> None:
        self.synchronize()
        self.guard.disarm()
        self.grad_guard.disarm()
        self.remove_hooks()
        self.tied.restore()
        self.timeline.flush()
        if self.control is not self.backend:
            self.control.close()
