"""``DistOptim``: the user-facing distributed optimizer.

It *is* a ``torch.optim.Optimizer``, built through ``Optimizer.__init__``
(LR schedulers, step hooks and existing loops accept it), that shares
``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer, so
hyperparameter changes reach the wrapped optimizer at once.  The work is done
by :class:`dearopt.engine.engine.Executor`; this face only validates, builds and
forwards.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import sys
import warnings
import weakref
from typing import Dict, Optional, Tuple, Union

import torch

import dearopt.backends.runtime as runtime
from dearopt.errors import NotInitializedError, UsageError
import dearopt.collectives as functions
from dearopt.backends.base import engine_boundary
from dearopt.backends.groups import group_backend, refuse_group_as_backend
from dearopt.compression import resolve_comm_hook
from dearopt.compression.sparsify import Sparsify
from dearopt.engine.engine import Executor
from dearopt.engine.hooks import StepPostHooks, global_step_hooks
from dearopt.engine.options import Options
from dearopt.engine.search import PLAN_CHOICE_REMATCH, PLAN_CHOICE_STEPS, PlanSearch
from dearopt.engine.sharding import ShardedUpdate
from dearopt.planning.plan import DEFAULT_BUFFER_SIZE
from dearopt.schedules import Figures, Schedule

__all__ = ["DistOptim", "PLAN_CHOICE_STEPS", "PLAN_CHOICE_REMATCH"]

_WRAPPED = weakref.WeakSet()


def _refuse_data_parallel_wrapper(model) -> None:
    """A ``UsageError`` for a model that is, or holds, torch's DDP or FSDP (FSDP1's wrapper, FSDP2's
    ``fully_shard``): they reduce the gradients themselves, so under a ``DistOptim`` every gradient would be
    averaged twice."""
    ddp = torch.nn.parallel.DistributedDataParallel
    kinds = [(ddp, "DistributedDataParallel (DDP)", "DDP")]
    fsdp = sys.modules.get("torch.distributed.fsdp")  # a model can only be wrapped by FSDP if torch imported it
    if fsdp is not None:
        for name, what in (("FullyShardedDataParallel", "FullyShardedDataParallel (FSDP)"), ("FSDPModule", "")):
            kind = getattr(fsdp, name, None)
            if isinstance(kind, type):
                kinds.append((kind, what or "FSDP2 (a module given to fully_shard)", "FSDP"))
    for path, module in model.named_modules():
        for kind, what, short in kinds:
            if isinstance(module, kind):
                where = "the model is" if not path else f"the model's submodule {path!r} is"
                fix = (
                    "Pass the unwrapped module (the DDP's .module)"
                    if kind is ddp
                    else "Pass the plain module (neither wrapped in FSDP nor sharded by fully_shard)"
                )
                raise UsageError(
                    f"DistOptim refuses this model: {where} torch's {what}, which reduces the gradients itself; "
                    f"DistOptim already averages them across ranks, so they would be reduced twice. {fix} and do "
                    f"not combine {short} with dearopt"
                )


def _check_arguments(optimizer, model):
    if isinstance(optimizer, DistOptim):
        raise UsageError("this optimizer is already a DistOptim; wrap the plain torch optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistOptim expects a torch.optim.Optimizer as its first argument, got {type(optimizer).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"DistOptim expects the model (an nn.Module) as its second argument, got "
            f"{type(model).__name__}; the model is needed to hook its forward"
        )
    _refuse_data_parallel_wrapper(model)
    if optimizer in _WRAPPED:
        raise UsageError("this optimizer is already wrapped by another DistOptim; wrap each optimizer once")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS is not supported: its update couples all parameters and needs a closure that "
            "re-evaluates the model, so it cannot be applied bucket by bucket"
        )
    in_model = {id(p) for p in model.parameters()}
    trainable = 0
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in in_model:
                raise ValueError(
                    f"param group {gi} of the optimizer holds a parameter of shape {tuple(p.shape)} "
                    f"that is not a parameter of the model; pass the model those parameters belong to"
                )
            trainable += p.requires_grad
    if trainable == 0:
        raise ValueError("the optimizer holds no parameter that requires grad: there is nothing to train")


def _resolve_group(process_group, backend):
    """``(backend, main)``: the communicator given (``backend``, one over ``process_group``:
    :func:`dearopt.backends.groups.group_backend`, or None for the job's) and the one ``DistOptim`` trains over."""
    refuse_group_as_backend(backend)
    if process_group is not None and backend is not None:
        raise UsageError("DistOptim takes process_group= or backend=, not both; pass the process group alone")
    main = runtime.get_backend()
    if process_group is not None:
        backend = main._track_fork(group_backend(process_group, main.timeout))  # closed with the job's at shutdown()
    return backend, main if backend is None else backend


# GradScaler.step(optimizer) passes itself as ``grad_scaler`` to optimizers whose step() takes it, and warns
# each process once that it will stop doing so; DistOptim relies on it to agree on inf/NaN across ranks.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def _complete_dropped(executor) -> None:
    """A ``DistOptim`` went away (its last reference dropped) without ``close()``: its pending updates, as when
    leaving the job (:meth:`DistOptim._complete_at_leave`); a failure is logged, not raised (a finalizer)."""
    try:
        executor.synchronize()
    except Exception as exc:
        logging.getLogger("dearopt").warning("dearopt: a DistOptim went away without completing its updates: %s", exc)


class DistOptim(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that gradients are averaged across ranks with the chosen schedule.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose update is per parameter (SGD, Adam, AdamW, RMSprop,
            Adagrad, ...).  Under ``dear`` its ``step()`` runs once per bucket with each param group narrowed to the
            bucket's parameters: for an optimizer that couples parameters across a group use ``schedule="wfbp"``
            and a ``buffer_size`` larger than the model (one bucket, one call).
        model: the module whose forward and backward are scheduled.
        schedule: a schedule object that owns its knobs (:class:`dearopt.DeAR`, :class:`dearopt.WFBP`,
            :class:`dearopt.RSAG`, :class:`dearopt.ByteScheduler`, :class:`dearopt.Prophet`,
            :class:`dearopt.schedules.ProphetAllReduce`, :class:`dearopt.DeFT`, or one registered with
            :func:`dearopt.schedules.register`), or its name (``"dear"``, the default, ...) for its defaults.
        buffer_size: bytes per fusion bucket or a string like ``"25MB"``; ``"auto"``: tuned online.
        shard_optimizer: under ``dear``, each rank updates its shard of every bucket at ``step()`` and the next
            forward's all-gather carries parameters (ZeRO stage 1 with DeAR's overlap, :mod:`dearopt.engine.sharding`):
            optimizer state and work per rank are 1/N.  Elementwise optimizers only.  :meth:`state_dict` gathers
            the ordinary layout (on every rank), :meth:`sharded_state_dict` saves this rank's part; after
            ``step()`` every ``p.grad`` is None.
        comm_hook: how gradients travel: ``"auto"`` (default: bfloat16/float16 gradients summed in float32;
            others as they are), ``None`` (every gradient as it is), ``"fp16"``, ``"bf16"``, a
            :class:`dearopt.CommHook`, or a :class:`dearopt.Sparsify` (not exact, :mod:`dearopt.compression.sparsify`).
        backward_passes_per_step: local accumulation before communicating.
        broadcast_parameters: copy rank 0's parameters and buffers at construction.
        broadcast_buffers: copy rank 0's buffers before every training forward (DDP's default).
        nonfinite: ``"raise"``, ``"skip"`` or ``"ignore"`` for non-finite averaged gradients.
        checks: ``"step"`` (default), ``"full"`` or ``"off"`` (:data:`dearopt.engine.options.CHECKS`).
        timeline: path for Chrome trace events (or ``DEAROPT_TIMELINE``).
        tuner: a :class:`dearopt.planning.tuner.BayesianTuner` over ``buffer_size``, ``partition_size`` and ``credit``;
            built by default for the knobs set to ``"auto"``.  Its trials and result: ``optimizer.tuning``.
        process_group: the ranks to average over: a torch ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``mesh["dp"]``
            (docs/process_groups.md); or ``backend``: a dearopt communicator.  Default: the job's (``dearopt.init``).

    Step hooks registered on this optimizer (``register_step_pre_hook``,
    ``register_step_post_hook``) fire once per ``step()``: the pre hooks when
    it is called, the post hooks once that step's updates have been applied
    (under ``dear`` that is during the next forward, or at ``synchronize()``).
    Hooks on the wrapped optimizer also fire once per step, around its
    per-bucket updates.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        *,
        schedule: Union[str, Schedule] = "dear",
        buffer_size: Union[int, str] = DEFAULT_BUFFER_SIZE,
        shard_optimizer: bool = False,
        comm_hook="auto",
        backward_passes_per_step: int = 1,
        broadcast_parameters: bool = True,
        broadcast_buffers: bool = True,
        nonfinite: str = "raise",
        checks: str = "step",
        timeline: Optional[str] = None,
        tuner=None,
        process_group=None,
        backend=None,
    ):
        _check_arguments(optimizer, model)
        hook = resolve_comm_hook(comm_hook)
        from dearopt.schedules import get_schedule

        policy = get_schedule(schedule)
        options = Options(
            policy,
            buffer_size,
            shard_optimizer=shard_optimizer,
            backward_passes_per_step=backward_passes_per_step,
            broadcast_parameters=broadcast_parameters,
            broadcast_buffers=broadcast_buffers,
            nonfinite=nonfinite,
            checks=checks,
            timeline=timeline,
            sparsify=isinstance(hook, Sparsify),
        )
        if not runtime.is_initialized():
            raise NotInitializedError("call dearopt.init() before creating a DistOptim")
        self._inner = optimizer
        self._constructing = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._constructing = False
        # Share the wrapped optimizer's containers: schedulers edit the same dicts.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.options = options
        backend, main = _resolve_group(process_group, backend)
        functions.check_same_model(model, optimizer, backend=backend)  # PlanMismatchError if the ranks' models differ
        if options.broadcast_parameters:
            functions.broadcast_parameters(model, root_rank=0, backend=backend)
        try:
            engine = main.fork()
        except NotImplementedError:
            engine = main
        self._engine_backend = engine if engine is not main else None
        buffer = DEFAULT_BUFFER_SIZE if options.buffer_size == "auto" else options.buffer_size
        partition = None if options.partition_size == "auto" else options.partition_size
        credit_bytes = None if options.credit == "auto" else options.credit
        post_hooks = StepPostHooks(self, self._optimizer_step_post_hooks)  # run by the engine when a step landed
        self._executor = Executor(optimizer, model, engine, options, buffer, partition, credit_bytes, hook, post_hooks)
        self._search = PlanSearch(options, optimizer, self._executor.control, self._executor.world, tuner)
        first = self._search.first_trial()
        if first is not None:
            self._executor.replan(**first)  # the tuner's first trial
        search, executor = self._search, self._executor
        self._figures = Figures(  # read on self.schedule, the copy that runs
            plan_choice=lambda: search.plan_choice,
            link_monitor=executor.planner.link_monitor,
            delayed=executor.rounds if options.policy.delays_updates else None,
        )
        options.policy.figures = self._figures
        self._closed = False
        runtime.on_leave(self._complete_at_leave)  # the last step's updates, when this process leaves the job
        # and when it goes away first (a function returns): the ranks that go on (one saving the model) join those
        self._at_drop = weakref.finalize(self, _complete_dropped, self._executor)
        self._at_drop.atexit = False
        _WRAPPED.add(optimizer)
        functions.register_distoptim(model, self)  # for dearopt.no_sync(model)

    # ---------------------------------------------------------------- API
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def plan(self):
        """The communication plan (``None`` until the first backward)."""
        return self._executor.plan

    @property
    def timeline(self):
        """The :class:`dearopt.engine.timeline.Timeline` this optimizer records to (disabled unless asked for)."""
        return self._executor.timeline

    @property
    def gradients_in_place_before_step(self) -> bool:
        """Whether the schedule can leave the averaged gradient in every ``p.grad`` before ``step()``
        (see :meth:`reduce_gradients`)."""
        return self._executor.gradients.in_place_before_step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of non-finite gradients (``nonfinite="skip"``)."""
        return self._executor.life.skipped_steps

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward communicates: False inside this optimizer's own :meth:`no_sync` (as DDP's
        attribute of the same name; ``dearopt.no_sync(model)`` holds back every ``DistOptim`` of the model)."""
        return not self._executor.life.no_sync

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step(optimizer)`` hands itself to :meth:`step`, which unscales the averaged
    gradients and agrees on inf/NaN across ranks (see :meth:`step`)."""

    @engine_boundary
    def step(self, closure=None, grad_scaler=None, *, loss=None):
        """Average the gradients across ranks and apply the wrapped optimizer's update.

        ``loss``: this step's training loss (a number or a tensor), for ``deft``'s
        Preserver (read in its first steps only); ignored by the other schedules.

        Under ``dear`` the update of each bucket is applied during the next
        forward, just before the bucket's first module runs (or as soon as
        your code touches one of its parameters); call :meth:`synchronize`
        to apply every pending update now.

        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step(optimizer)``:
        the averaged gradients are unscaled (unless ``optimizer.unscale_(scaler)``
        or, where ``p.grad`` holds the average, ``scaler.unscale_(optimizer)``
        came first), checked for inf/NaN over all ranks, and the step is skipped
        on every rank if any is found; ``scaler.update()`` then sees the same
        answer on every rank.
        """
        if closure is not None:
            raise UsageError("DistOptim.step() does not take a closure: run forward and backward before step()")
        for hook in itertools.chain(list(global_step_hooks("pre")), list(self._optimizer_step_pre_hooks.values())):
            hook(self, (), {})
        if loss is not None and self.options.policy.delays_updates:
            self._executor.record_loss(loss)
        self._search.notice_new_inputs(self._executor.planner.generation)
        self._inner._opt_called = True  # an LR scheduler built on the wrapped optimizer: its step() counts as called
        if grad_scaler is not None:
            found_inf = self._executor.gradients.scaler_found_inf(grad_scaler, id(self), unscale=True)
            self._executor.step(skip=found_inf, scaler_checked=True)
        else:
            self._executor.step()
        self._search_step()
        return None

    def _search_step(self) -> None:
        """At ``step()``'s end, on every rank: the re-plan the plan search asks for, then DDP's plan where the loop
        reads ``p.grad`` before every ``step()``."""
        executor = self._executor
        profile = executor.profile
        knobs = self._search.step_ended(profile.enabled and profile.result is None, executor.plan_choices)
        if knobs is not None:
            executor.replan(**knobs)  # every rank, at the same step boundary
        if executor.adapt_to_gradient_reads():
            self._search.adopted_ddp_plan()

    @property
    def tuning(self):
        """The online tuner of the knobs set to ``"auto"`` (DeAR section IV.B): a
        :class:`dearopt.planning.tuner.TuningController` with its trials and result; None when nothing is tuned."""
        return self._search.tuning

    @property
    def schedule(self) -> Schedule:
        """The schedule this optimizer runs: a copy of the one passed (or named) with its knobs settled
        (:meth:`dearopt.schedules.Schedule.resolve`), on which what this run measured and decided is read:
        ``plan_choice`` (:class:`dearopt.DeAR`), ``link_changes`` (:class:`dearopt.Prophet`), ``in_force``,
        ``preserved``, ``piece_reduction``, ``times``, ``repartitions`` and ``applied_steps``
        (:class:`dearopt.DeFT`).  The object passed as ``schedule=`` is left as it was (it may be shared)."""
        return self.options.policy

    @property
    def comm_hook(self):
        """How gradients travel in this run (see the ``comm_hook`` argument): a :class:`dearopt.CommHook`, or under
        ``comm_hook=dearopt.Sparsify(...)`` this run's :class:`dearopt.compression.sparsify.SparseExchange` (its
        ``traffic``); None where every gradient travels as it is."""
        return self._executor.sparse if self._executor.sparse is not None else self._executor.comm_hook

    @property
    def settled(self) -> bool:
        """Whether the plan has stopped changing by itself: the profile is applied, tuning (``"auto"`` knobs)
        and the measured choice of ``allreduce="auto"`` are over.  The same on every rank."""
        executor = self._executor
        if self.options.policy.delays_updates and executor.rounds.offset and executor.rounds.deft is None:
            return False  # schedule="deft" is still measuring the job
        if executor.plan is None or (
            executor.profile.enabled and (executor.profile.result is None or executor.profile.fresh)
        ):
            return False
        return self._search.settled

    step.hooked = True  # torch must not wrap it: the post hooks fire when the step's updates have landed

    @engine_boundary
    def synchronize(self) -> None:
        """Apply every pending update now, so that the parameters are current."""
        self._executor.synchronize()

    @engine_boundary
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients (their storage stays in the communication buckets)."""
        self._executor.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm; call between ``backward()`` and ``step()``.

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the averaged gradients
        of single-process training; costs one scalar all-reduce where the
        schedule keeps the averaged gradients as shards.
        """
        return self._executor.gradients.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged gradients to ``[-clip_value, clip_value]``; between ``backward()`` and ``step()``.

        Equal to ``torch.nn.utils.clip_grad_value_`` on the averaged gradients
        of single-process training, under every schedule.
        """
        self._executor.gradients.clip_grad_value_(clip_value)

    def unscale_(self, scale) -> None:
        """Unscale the averaged gradients; call between ``backward()`` and ``step()``.

        ``scale`` is a ``torch.amp.GradScaler`` (what ``scaler.unscale_(optimizer)``
        does, on the averaged gradients: use it before clipping with
        :meth:`clip_grad_norm_`; then ``scaler.step(optimizer)`` skips the step on
        every rank if inf/NaN was found) or a number, for loss scaling by hand
        (``(loss * scale).backward()``; with ``nonfinite="skip"`` a step whose
        scaled gradients overflowed is skipped on every rank).
        """
        self._executor.gradients.unscale_(scale, key=id(self))

    def reduce_gradients(self) -> None:
        """Finish communication now, so that every ``p.grad`` holds the averaged gradient.

        Under schedules that keep shards until the next forward (``dear``, ``prophet``, the sharded update) the
        averages are gathered into ``p.grad`` now, as a read of ``p.grad`` between backward and ``step()`` does:
        that step's gathers then no longer overlap the next forward.
        """
        self._executor.gradients.reduce()

    def register_comm_hook(self, hook) -> None:
        """Set how gradients travel (see the ``comm_hook`` argument); before the first backward, on every rank."""
        if self._executor.plan is not None:
            raise UsageError("register_comm_hook() must be called before the first backward(): the plan is made")
        hook = resolve_comm_hook(hook)
        if isinstance(hook, Sparsify) or self._executor.sparse is not None:
            raise UsageError("a dearopt.Sparsify changes the plan's options: pass it as DistOptim(comm_hook=...)")
        self._executor.comm_hook = hook

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change local accumulation between steps (the same on every rank)."""
        options = self.options.replace(backward_passes_per_step=passes)
        options.policy.figures = self._figures  # the same run: the new copy of the schedule reads the same figures
        self.options = options
        self._executor.options = options
        self._executor.checks.options = options

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communication."""
        previous = self._executor.life.no_sync
        self._executor.life.no_sync = True
        try:
            yield
        finally:
            self._executor.life.no_sync = previous

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()``, in torch's ordinary per-parameter layout.

        With ``shard_optimizer=True`` it is gathered from every rank's shards (a collective: call it on every
        rank; every rank gets the whole state), loadable by an unsharded run and by torch's optimizer."""
        self.synchronize()
        sharding = self._executor.sharding
        if sharding is None or not sharding.active:
            saved = self._inner.state_dict()
        else:
            saved = self._inner_state_dict(sharding.gather_state())
        saved.update(self._executor.engine_state())  # deft's group sums, a sparsifier's residuals
        return saved

    @property
    def engine_state_keys(self) -> Tuple[str, ...]:
        """The keys :meth:`engine_state_dict` returns, known without computing them: ``"dearopt_deft"`` under
        ``schedule="deft"``, ``"dearopt_sparse"`` under ``comm_hook=dearopt.Sparsify(...)``; empty otherwise."""
        keys = ("dearopt_deft",) if self.options.policy.delays_updates else ()
        return keys + (("dearopt_sparse",) if self._executor.sparse is not None else ())

    def engine_state_dict(self) -> Dict[str, dict]:
        """This rank's state kept by the engine beyond the wrapped optimizer's, the entries :meth:`state_dict`
        adds (and :meth:`load_state_dict` takes back): ``dearopt_deft`` (``schedule="deft"``: its schedule, the
        step within it and this rank's group sums; computed first, since it applies the groups that are due) and
        ``dearopt_sparse`` (a sparsifier's residuals).  Per rank: a checkpoint saves one per rank
        (:mod:`dearopt.checkpoint`)."""
        return self._executor.engine_state()

    @property
    def sharded_update(self) -> Optional[ShardedUpdate]:
        """Under ``shard_optimizer=True``: the :class:`dearopt.engine.sharding.ShardedUpdate` that keeps this
        rank's segments of the optimizer state (``active`` once the first ``step()`` cut them; ``on_sharded``
        is called then); None otherwise.  For checkpoints that read and write the segments in place
        (:mod:`dearopt.checkpoint`)."""
        return self._executor.sharding

    def _inner_state_dict(self, state) -> dict:
        """The wrapped optimizer's ``state_dict()`` over ``state`` (parameters to entries) instead of its own."""
        live = self._inner.state
        self._inner.state = collections.defaultdict(dict, state)
        try:
            return self._inner.state_dict()
        finally:
            self._inner.state = live

    def load_state_dict(self, state_dict) -> None:
        """Load an ordinary ``state_dict()`` (from this class, sharded or not, or from a torch optimizer)."""
        self.synchronize()
        state_dict = self._executor.load_engine_state(state_dict)
        self._inner.load_state_dict(state_dict)
        self._share_inner()
        sharding = self._executor.sharding
        if sharding is not None:
            sharding.take_state()  # cut into this rank's shards (at the first step() if none exist yet)

    def _share_inner(self) -> None:
        # load_state_dict replaces the group dicts and the state: share them again
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state

    def sharded_state_dict(self) -> dict:
        """``shard_optimizer=True``: this rank's part of the optimizer state (and the hyperparameters), for a
        per-rank checkpoint of a large model.  It loads (:meth:`load_sharded_state_dict`) only into the same
        rank of a run with the same world size and plan; :meth:`state_dict` is the portable form."""
        sharding = self._require_sharding("sharded_state_dict")
        self.synchronize()
        saved = sharding.sharded_state()
        saved["param_groups"] = self._inner_state_dict({})["param_groups"]
        return saved

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Load this rank's :meth:`sharded_state_dict` (a :class:`dearopt.errors.CheckpointMismatchError` if it was
        saved by another rank, world size or plan)."""
        sharding = self._require_sharding("load_sharded_state_dict")
        self.synchronize()
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            sharding.load_sharded_state(state_dict)  # names what is wrong with it
        self._inner.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._share_inner()
        sharding.load_sharded_state(state_dict)

    def _require_sharding(self, what: str):
        if self._executor.sharding is None:
            raise UsageError(
                f"{what}() is for shard_optimizer=True; this optimizer is not sharded: use "
                f"state_dict() / load_state_dict()"
            )
        return self._executor.sharding

    def add_param_group(self, param_group) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer.add_param_group`` does (how fine-tuning scripts unfreeze a
        backbone); adding it to the wrapped optimizer is the same.  The plan follows at the next backward, on every
        rank (each rank must add the same group); what was derived from the old groups (the profile, the
        measured choice, a tuning trial under way) is measured again."""
        if getattr(self, "_constructing", False):  # Optimizer.__init__ registering the wrapped optimizer's groups
            return super().add_param_group(param_group)
        params = param_group["params"] if isinstance(param_group, dict) else None
        if params is None:
            raise TypeError(f"add_param_group() takes a dict with 'params', got {type(param_group).__name__}")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        in_model = {id(p) for p in self._executor.model.parameters()}
        for p in params:
            if id(p) not in in_model:
                raise ValueError(
                    f"add_param_group(): a parameter of shape {tuple(p.shape)} is not a parameter of the "
                    f"model this DistOptim was built on"
                )
        self._inner.add_param_group(dict(param_group, params=params))

    def _complete_at_leave(self) -> None:
        """Leaving the job (:func:`dearopt.backends.runtime.on_leave`): the pending updates, on every rank alike."""
        if not self._closed:
            self._executor.synchronize()

    def close(self) -> None:
        """Apply pending updates, remove the hooks and release the engine's communicator."""
        self._closed = True
        self._at_drop.detach()
        self._executor.close()
        if self._engine_backend is not None:
            self._engine_backend.close()
            self._engine_backend = None
        _WRAPPED.discard(self._inner)

    def __repr__(self) -> str:
        return f"DistOptim({self._inner!r}, schedule={self.options.schedule!r})"

    def __getstate__(self):
        raise TypeError("DistOptim cannot be pickled; save optimizer.state_dict() instead")
