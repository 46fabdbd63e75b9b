"""The engine: the life cycle that carries out a bound plan, moment by moment.

The engine is parts by lifetime, as FSDP2 and Megatron-core split theirs:

* :class:`~dearopt.engine.hooks.EngineHooks`: the hooks on the model and its
  parameters, and the guards on user code (for the engine's whole life);
* :class:`~dearopt.engine.bound_plan.Planner` and :class:`~dearopt.engine.bound_plan.BoundPlan`:
  the plan laid onto the tensors, immutable, swapped whole by a re-plan (one
  plan's life), with the :class:`~dearopt.engine.issuer.Issuer` that starts its ops;
* :class:`~dearopt.engine.gradients.AveragedGradients`: finishing, clipping,
  unscaling and checking the averages between ``backward()`` and ``step()``;
* this :class:`Executor`: the life cycle, one :class:`TrainingState` plus,
  while a step's gradients are on their way, one :class:`Round`.

It records the forward order on the first iteration, has the schedule build
the plan, and then drives the plan through the moments of every iteration:

* **backward**: a post hook on each parameter's gradient accumulator, in C++
  (``csrc/ready.cpp``), moves a replaced ``.grad`` into its bucket view and
  counts the bucket's ready gradients; Python runs once per complete bucket
  (:meth:`~dearopt.engine.rounds.ExactRounds.bucket_ready`), and the issuer
  starts every op whose moment has come, strictly in plan order (without the
  extension, or for DTensor parameters, the same in a Python hook per parameter).
  When backward ends every bucket counts as ready, so all
  ranks always issue the same collectives.
* **step()**: completes the ops due at ``step()`` (waits, averages), runs the
  checks (:mod:`dearopt.engine.checks`), applies the updates due at ``step()``
  (:mod:`dearopt.engine.updates`), and starts the ops that start at ``step()``.
* **forward**: a pre-hook (a C callable) on each module where the recorded
  forward order enters a new bucket reaches that bucket: ops that start there are started, ops due there are
  completed, and updates due there are applied, bucket by bucket in order.

The executor knows moments, not schedules: which op goes when is the plan's.
Nothing waits without a timeout, and the engine's collectives run on their own
communicator (``backend.fork()``), so a user's collectives can never be paired
with them.
"""

from __future__ import annotations

import gc
import logging
from typing import List, Optional, Sequence, Union

import torch

from dearopt.backends.groups import local_tensor
from dearopt.engine.bound_plan import BoundPlan, PlanKnobs, Planner, hook_name, trainable_of
from dearopt.engine.buckets import BucketState
from dearopt.engine.checks import Checks
from dearopt.backends.base import CollectiveBackend
from dearopt.compression.hooks import CommHook, hooks_for
from dearopt.errors import UsageError
from dearopt.collectives import broadcast_buffers_as_bytes, second_backward_refusal
from dearopt.engine.hooks import EngineHook, EngineHooks, LifeCycle, Round, StepPostHooks, TrainingState
from dearopt.engine.issuer import Issuer
from dearopt.engine.options import Options
from dearopt.planning.profile import LinkMonitor, ReadyProfile
from dearopt.engine.sharding import ShardedUpdate
from dearopt.engine.tensor_parallel import TensorParallel, refuse_dtensors
from dearopt.engine.tied import TiedEmbeddings
from dearopt.engine.timeline import Timeline
from dearopt.engine.updates import BucketUpdater
from dearopt.engine.rounds import ExactRounds

__all__ = ["Executor", "TrainingState", "Round"]

_log = logging.getLogger("dearopt")

REPLAN_COLLECT_BYTES = 16 * 2**20
"""A re-plan that drops buckets holding at least this many bytes also runs the cycle collector (see
:meth:`Executor.replan`; the buckets themselves are freed by reference counting): a full collection costs ~0.1 s
in a process that imported torch, which a script switching a small model's trainable set paid at every switch."""

GATHERED_STEPS_TO_ADAPT = 2
"""Steps in a row whose ``p.grad`` was read before ``step()`` after which ``dear`` (``allreduce="auto"`` or
``"predicted"``) re-plans every bucket as an all-reduce in backward: the loop reads the averaged gradients every
step (torch's clip, ``GradScaler.unscale_``), so the gathers cannot overlap the next forward anyway."""


def _delayed_rounds():
    from dearopt.schedules.deft.rounds import DelayedRounds

    return DelayedRounds


class Executor:
    """Carries out a :class:`~dearopt.planning.plan.Plan` for one model and optimizer (see the module)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        backend: CollectiveBackend,
        options: Options,
        buffer_size: int,
        partition_size: Optional[int] = None,
        credit: Optional[int] = None,
        comm_hook: Optional[CommHook] = None,
        post_hooks: Optional[StepPostHooks] = None,
    ):
        self.optimizer = optimizer
        self.model = model
        self.backend = backend
        # the life cycle: its state and transitions; it runs the optimizer's step post hooks when a step landed
        self.life = LifeCycle(options.backward_passes_per_step, post_hooks)
        self._options = options
        from dearopt.compression.sparsify import SparseExchange, Sparsify

        # a sparsifier owns its buckets' exchange (dearopt.compression.sparsify); a cast hook only encodes what travels
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
        params = list(model.parameters())
        refuse_dtensors(params, options)
        # DTensor parameters: the global norm and the non-finite answer agreed over the tensor-parallel ranks too
        self.tensor_parallel = TensorParallel.of(params, backend.timeout)
        self.checks = Checks(self.control)
        self.updater = BucketUpdater(optimizer)
        self.sharding = (
            ShardedUpdate(optimizer, self.control, self.rank, self.world) if options.shard_optimizer else None
        )
        policy = options.policy
        self.profile = ReadyProfile(
            options.priority
            or policy.needs_profile
            or (policy.mixes_allreduce and options.allreduce in ("auto", "predicted")),
            every=options.link_check_every,
        )
        trainable = trainable_of(optimizer)
        rows = options.embedding_rows
        if rows and not options.embedding_rows_given and any(p.is_cuda for p in trainable):
            # on a GPU the rows' count is read on the host (which then waits for the device) and NCCL's dense
            # all-reduce is fast: rows only where asked for
            rows = False
        self.tied = TiedEmbeddings(model, {id(p) for p in trainable} if rows else set(), EngineHook)
        self.planner = Planner(
            model,
            optimizer,
            options,
            self.profile,
            self.tied,
            self.checks,
            self.control,
            PlanKnobs(buffer_size, partition_size, credit, options.allreduce),
            sharded=self.sharding is not None,
            link_monitor=LinkMonitor() if options.link_check_every else None,
        )
        self.bound: Optional[BoundPlan] = None  # the plan on the tensors (set by _build_plan)
        self.issuer: Optional[Issuer] = None
        Rounds = _delayed_rounds() if options.policy.delays_updates else ExactRounds  # (deft: may be applied later)
        self._buffers = None  # the model's buffers, listed again with each plan
        self.hooks = EngineHooks(self, model, every_module=Rounds.every_module)
        # the moments protocol: what a step's gradients do, from backward to update, given the parts it reads
        parts = (self.life, self.hooks, self.profile, self.timeline, self.checks, self.control, self.updater)
        if Rounds is ExactRounds:
            self.rounds = ExactRounds(*parts, options, sharding=self.sharding)
        else:
            self.rounds, self.comm_hook = Rounds.of(parts, backend, optimizer, self.planner, options, self.comm_hook)
        # a completed bucket and the forward reaching one call the rounds part itself (from C++ where it is built)
        self.hooks.route(self, self.rounds)
        # the averaged gradients between backward() and step(): the rounds part's kind, given what it reads
        self.gradients = self.rounds.gradients_part(
            self.life,
            backend,
            self.control,
            optimizer,
            (self.hooks.grad_guard, self.hooks.guard),
            tensor_parallel=self.tensor_parallel,
            sharding=self.sharding,
            sparse=self.sparse,
            schedule=options.schedule,
        )
        if self.rounds.every_module:  # (DeFT) every gradient is seen from Python
            self.hooks.gradients.per_param(True)
        self.hook_new_params()

    # ------------------------------------------------- the life cycle, read
    step_count = property(lambda self: self.life.step_count, doc="Steps taken.")

    @property
    def options(self) -> Options:
        """The engine's :class:`Options` (``DistOptim.set_backward_passes_per_step`` replaces them)."""
        return self._options

    @options.setter
    def options(self, options: Options) -> None:
        self._options = self.planner.options = self.rounds.options = options
        self.life.passes = options.backward_passes_per_step

    @property
    def buffers(self):
        """The model's non-empty buffers, as broadcast before each training forward (listed once per plan, as DDP
        lists them once)."""
        if self._buffers is None:
            self._buffers = [local_tensor(b) for b in self.model.buffers() if b.numel() > 0]
        return self._buffers

    def _low_precision(self) -> bool:
        from dearopt.compression.hooks import LOW_PRECISION

        return any(p.dtype in LOW_PRECISION for g in self.optimizer.param_groups for p in g["params"])

    # ------------------------------------------------- what the parts hold
    rank = property(lambda self: self.backend.rank, doc="This rank.")
    world = property(lambda self: self.backend.size, doc="How many ranks average the gradients.")
    plan = property(lambda self: self.bound.plan if self.bound is not None else None, doc="The plan in force.")
    buckets = property(lambda self: self.bound.buckets if self.bound is not None else (), doc="Its buckets.")
    window = property(lambda self: self.planner.window, doc="The credit window the issuer starts ops in.")
    launch_log = property(lambda self: self.planner.launch_log, doc="The issuer's (step, kind, bucket, piece) log.")
    guard = property(lambda self: self.hooks.guard, doc="The guard that applies pending updates on a touch.")

    @property
    def rows_reductions(self) -> dict:
        """How row-sparse buckets were reduced over the run: ``{"rows": n, "dense": m}`` (the rows hook outlives
        every plan)."""
        rows = self.planner.rows
        return rows.counts if rows is not None else {"rows": 0, "dense": 0}

    # ------------------------------------------------------------------ hooks
    def hook_new_params(self) -> None:
        """Give every trainable parameter a gradient hook (also ones unfrozen after construction).  What is hooked
        already is passed over by identity, without reading the parameter (a guarded one would call the guard)."""
        hooked = self.hooks.gradients.slot_of
        if any(id(p) not in hooked and p.requires_grad for g in self.optimizer.param_groups for p in g["params"]):
            self.hooks.gradients.add(self.planner.planned())

    def _note_sparse(self, pid: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            self.hooks.sparse_ids.add(pid)
            located = self.bound.where.get(pid) if self.bound is not None else None
            if located is not None:
                located[0].sparse[located[1]] = True

    def _synchronize_hook(self, *args, **kwargs) -> None:
        self.synchronize()

    def _root_pre_hook(self, module, args) -> None:
        # (the pending updates' guard stays on: the forward gates apply them as the forward reaches their buckets,
        # and a module that runs before its bucket's moment touches a guarded parameter, which applies it first)
        if self.bound is None and self.hooks.recording:
            self.hooks.recorder.start()
        if not (module.training and torch.is_grad_enabled()):
            self.synchronize()  # (an evaluation between backward and step() leaves the gradient guard armed)
            return
        self.hooks.grad_guard.disarm()
        self.life.forward_began()
        self.hook_new_params()
        if self._options.broadcast_buffers and self.world > 1 and self.buffers:
            broadcast_buffers_as_bytes(self.buffers, self.control, self.life.step_count)
        self.profile.begin_forward()
        self.rounds.forward_started()

    def _root_post_hook(self, module, args, output) -> None:
        """A training forward ended: where this step's backward will leave ``p.grad`` without the average, the
        gradient guard goes on the stack here, on the thread that runs the user's code (armed when backward ends)."""
        if (
            module.training
            and torch.is_grad_enabled()
            and (self.bound is None or (self.bound.grad_params and not self.bound.swappable))
            and self.life.communicates
        ):
            self.hooks.grad_guard.push()  # the fallback for tensors whose class cannot be swapped (DTensor)

    def _module_pre_hook(self, module, args) -> None:
        """A rounds part that wants every module (DeFT): ``module`` is about to run."""
        self.rounds.module_reached(module)

    # ------------------------------------------------------------- planning
    def _build_plan(
        self, trainable: Optional[List[torch.nn.Parameter]] = None, reuse: Sequence[BucketState] = ()
    ) -> set:
        """Plan for ``trainable`` (by default the trainable set now) and swap the bound plan whole.  A re-plan
        passes the old buckets as ``reuse``: one the new plan lays out alike is kept as it is; returns the ids of
        those kept."""
        planner = self.planner
        if self.hooks.recording:
            planner.module_order = self.hooks.stop_recording()
        trainable = planner.trainable() if trainable is None else trainable
        if self.issuer is not None:  # a re-plan (nothing in flight): buffers kept for the old buckets go
            self.backend.release_workspace()

        def make_issuer(plan, buckets):
            if self.sparse is not None:  # the residuals follow their parameters into the new buckets
                position = {id(p): i for i, p in enumerate(self.model.parameters())}
                self.sparse.bind(
                    buckets, [[position.get(id(p), -1 - i) for i, p in enumerate(b.params)] for b in buckets]
                )
            issuer = Issuer(
                plan,
                buckets,
                self.backend,
                planner.window,
                hooks_for(plan, self.comm_hook, planner.rows, self.sparse),
                self.timeline,
                control=self.control,
                wire_dtype=self.comm_hook.wire_dtype if self.comm_hook is not None else None,
                sharded=self.sharding is not None,
            )
            issuer.launch_log = planner.launch_log
            return issuer

        reuse = reuse if self.rounds.reuses_buckets else ()
        self.bound, self.issuer, kept = planner.bind(
            trainable,
            reuse,
            make_issuer,
            self.life.step_count,
            hook_name(self.sparse, self.comm_hook),
            self.hooks.sparse_ids,
        )
        self.life.planned = True
        self.hooks.bind(self.bound, planner.module_order)
        self._buffers = None
        self.bound = self.rounds.plan_bound(self.bound, self.issuer)  # (as the rounds part carries it out)
        self.gradients.bind(self.bound, self.issuer)
        return kept

    def plan_choices(self):
        """The plans worth measuring against each other (:meth:`dearopt.engine.bound_plan.Planner.choices`)."""
        return self.planner.choices(self.plan, self.gradients.reads)

    def replan(
        self,
        buffer_size: Optional[int] = None,
        partition_size: Optional[int] = None,
        credit: Optional[int] = None,
        allreduce: Union[float, str, None] = None,
        blocks: Optional[bool] = None,
        _inside_backward: bool = False,
    ) -> None:
        """Re-plan at an iteration boundary; gradients and pending updates are preserved exactly.  ``blocks``:
        form the buckets as Prophet's blocks from the profile (True) or by ``buffer_size`` (False)."""
        self.synchronize()
        state = self.life.state
        if state is TrainingState.REDUCING or (state is TrainingState.BACKWARD and not _inside_backward):
            raise UsageError("replan() must be called between step() and the next backward()")
        self.rounds.may_replan()
        self.planner.change(
            buffer_size=buffer_size,
            partition_size=partition_size,
            credit=credit,
            allreduce=allreduce,
            blocks=None if blocks is None else bool(blocks),
        )
        if self.bound is None:  # nothing recorded yet: the first plan will use the new knobs
            return
        if self.sharding is not None:  # the state back in the ordinary layout; the new buckets cut it anew
            self.sharding.release()
        saved = {id(p): (b.used[j], b.has_grad[j], b.stamp[j]) for b in self.buckets for j, p in enumerate(b.params)}
        trainable = self.planner.trainable()
        for b in self.buckets:  # each p.grad is its gradient: the old bucket's view, or what autograd gave it
            for j, p in enumerate(b.params):
                if not b.stale[j]:
                    p.grad = b.views[j]
        had = {id(p) for b in self.buckets for p in b.params if p.grad is not None}
        # Buckets the new plan lays out alike (a change of the ops only: dear's all-reduced buckets, credit) are
        # kept with their gradients; a new bucket takes each p.grad from the old view (no copy held aside).
        old = self.buckets
        kept = self._build_plan(trainable, reuse=old)
        dropped = sum(b.buffer.numel() * b.buffer.element_size() for b in old if id(b) not in kept)
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
                b.ready += self.life.state is TrainingState.BACKWARD and b.stamp[j] == self.life.pass_id
            b.mark_seen()
        # The old buckets are freed here by reference counting (a piece refers to its bucket weakly).  Left to
        # the cycle collector, which runs by object count, not bytes, a tuner's re-plans kept a model's worth of
        # buffers alive each (BERT-Base: ~0.5 GiB per re-plan, out of memory after about twenty): where much was
        # dropped, a cycle not broken yet (a comm hook's, a user's) is collected now too.
        del old
        if dropped >= REPLAN_COLLECT_BYTES:
            gc.collect()

    def adapt_to_gradient_reads(self) -> bool:
        """After :data:`GATHERED_STEPS_TO_ADAPT` steps in a row whose ``p.grad`` was read before ``step()``: where
        the schedule mixes in all-reduces and the rule is not fixed, re-plan every bucket as an all-reduce in
        backward (the gathers cannot overlap the next forward anyway, and one collective costs less than two).
        Called at a step boundary on every rank; True if it re-planned."""
        g = self.gradients
        if (
            g.reads
            or g.gathered_steps < GATHERED_STEPS_TO_ADAPT
            or self.sharding is not None
            or self.world == 1
            or self.options.allreduce not in ("auto", "predicted")
            or not self.options.policy.mixes_allreduce
        ):
            return False
        g.reads = True
        if self.rank == 0:
            _log.warning(
                "dearopt: p.grad was read between backward() and step() in %d steps in a row (torch's "
                "clip_grad_norm_, GradScaler.unscale_, ...): each time every bucket's reduction was finished "
                "first. Re-planned with every bucket all-reduced in backward (DDP's plan). "
                "optimizer.clip_grad_norm_(...) and optimizer.unscale_(scaler) act on the averaged shards and keep "
                "schedule=%r's overlap.",
                g.gathered_steps,
                self.options.schedule,
            )
        self.replan(allreduce=1.0, blocks=False)
        return True

    # ------------------------------------------------------------- backward
    def _backward_begins(self) -> None:
        """A gradient hook's first part: the plan made (first backward), the pass begun."""
        if self.bound is None:
            self._build_plan()
        if self.life.state is not TrainingState.BACKWARD:
            self._begin_backward()

    def _begin_backward(self) -> None:
        """A backward pass begins: the life cycle moves here, the rounds part does its work between the moves
        and, where the trainable set or rank 0's profile changed, the engine re-plans (the same on every rank)."""
        life, rounds = self.life, self.rounds
        if life.state is TrainingState.REDUCING:  # names the DistOptim that communicated (several on one model)
            refusal = rounds.second_backward_refusal()
            raise refusal if refusal is not None else second_backward_refusal(self)
        life.begin_pass()
        rounds.begin_backward()
        self.hook_new_params()
        sending = life.in_backward()
        if rounds.replans_in_backward and self.planner.replan_due(life.step_count, self.bound, self.gradients.reads):
            self.replan(_inside_backward=True)
        rounds.backward_begun(sending)

    def _param_ready(self, p) -> None:
        """A gradient accumulated (the per-parameter path: every gradient seen from Python)."""
        self._backward_begins()
        self.rounds.grad_ready(p)

    def step(self, skip: bool = False, scaler_checked: bool = False) -> None:
        """Complete the step's reductions, check, and apply (or schedule) the updates (:meth:`rounds.step`)."""
        replan = self.rounds.step(skip, scaler_checked)  # (deft's measuring steps may ask for smaller buckets)
        if replan is not None:
            self.replan(**replan)

    def record_loss(self, loss) -> None:
        """``step(loss)``: the loss of this step, for a rounds part that measures it (DeFT's Preserver)."""
        self.rounds.record_loss(loss)

    # ----------------------------------------------------------------- step
    def _gradients_requested(self, bucket: int) -> None:
        self.gradients.requested(bucket)

    def _make_current(self, bucket: int) -> None:
        """User code touched a parameter of ``bucket`` after step(): apply the pending updates up to it first."""
        self.rounds.touched(bucket)

    def synchronize(self) -> None:
        """Apply every pending update now (parameters become current)."""
        self.rounds.synchronize()
        self.timeline.flush()

    # ----------------------------------------------------------- gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` (:meth:`dearopt.engine.gradients.AveragedGradients.zero`)."""
        with self.hooks.guard.suspended():
            self.gradients.zero(set_to_none)

    def engine_state(self) -> dict:
        """What the engine keeps beyond the wrapped optimizer's state, for ``state_dict()``: a delayed
        schedule's group sums on this rank (``dearopt_deft``), a sparsifier's residuals (``dearopt_sparse``)."""
        out = {}
        if self.options.policy.delays_updates:
            out["dearopt_deft"] = self.rounds.deft_state()
        if self.sparse is not None:
            out["dearopt_sparse"] = self.sparse.state_dict()
        return out

    def load_engine_state(self, state_dict: dict) -> dict:
        """Take :meth:`engine_state`'s entries out of ``state_dict`` and load them (refused by name where this
        engine keeps no such state); returns the rest, the wrapped optimizer's."""
        state_dict = dict(state_dict)
        deft, sparse = state_dict.pop("dearopt_deft", None), state_dict.pop("dearopt_sparse", None)
        if deft is not None:
            if not self.options.policy.delays_updates:
                raise UsageError(
                    "this state_dict was saved under schedule='deft' (it holds delayed gradient sums); "
                    "load it into a DistOptim with schedule='deft'"
                )
            self.rounds.load_deft_state(deft)
        if sparse is not None:
            if self.sparse is None:
                raise UsageError(
                    "this state_dict holds a sparsifier's residuals (comm_hook=dearopt.Sparsify): load "
                    "it into a DistOptim with the same comm_hook"
                )
            self.sparse.load_state_dict(sparse)
        return state_dict

    def close(self) -> None:
        """Apply pending updates, remove the hooks, restore tied weights and release the control channel."""
        self.synchronize()
        self.hooks.remove()
        self.tied.restore()
        self.timeline.flush()
        self.rounds.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        if self.control is not self.backend:
            self.control.close()
