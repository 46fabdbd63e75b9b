"""``DistOptim``: the user-facing distributed optimizer.

It *is* a ``torch.optim.Optimizer``, built through ``Optimizer.__init__``
(LR schedulers, step hooks and existing loops accept it), that shares
``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer, so
hyperparameter changes reach the wrapped optimizer at once.  The work is done
by :class:`dearopt.executor.Executor`; this face only validates, builds and
forwards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import warnings
import weakref
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.optim.optimizer as _torch_optimizer

from . import runtime
from .errors import NotInitializedError, UsageError
from . import functions
from .collectives import engine_boundary
from .comm_hooks import resolve_comm_hook
from .sparsify import Sparsify
from .delayed import APPLY_MODES, DelayedExecutor
from .executor import Executor
from .options import Options
from .plan import DEFAULT_BUFFER_SIZE, DEFAULT_FIRST_BUCKET_SIZE
from .schedules import get_schedule

__all__ = ["DistOptim", "PLAN_CHOICE_STEPS", "PLAN_CHOICE_REMATCH"]

PLAN_CHOICE_STEPS = 3
"""Steps measured per candidate plan of ``allreduce="auto"`` (after one discarded step that re-plans)."""

PLAN_CHOICE_REMATCH = 0.10
"""Candidate plans of ``allreduce="auto"`` within this fraction of the fastest are measured once more, in the
reverse order, and judged by the mean of their two trials (:class:`dearopt.tuner.ChoiceTuner`)."""

_WRAPPED = weakref.WeakSet()


def _preserver(preserver):
    """``preserver=``: True (the defaults), False/None (off) or a :class:`dearopt.Preserver`."""
    from .schedules.deft import Preserver

    if preserver is True:
        return Preserver()
    if preserver is False or preserver is None:
        return None
    if isinstance(preserver, Preserver):
        return preserver
    raise TypeError(f"preserver= takes True, False or a dearopt.Preserver, got {preserver!r}")


def _check_arguments(optimizer, model):
    if isinstance(optimizer, DistOptim):
        raise UsageError("this optimizer is already a DistOptim; wrap the plain torch optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistOptim expects a torch.optim.Optimizer as its first argument, got "
                        f"{type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"DistOptim expects the model (an nn.Module) as its second argument, got "
                        f"{type(model).__name__}; the model is needed to hook its forward")
    if optimizer in _WRAPPED:
        raise UsageError("this optimizer is already wrapped by another DistOptim; wrap each optimizer once")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError("LBFGS is not supported: its update couples all parameters and needs a closure that "
                        "re-evaluates the model, so it cannot be applied bucket by bucket")
    in_model = {id(p) for p in model.parameters()}
    trainable = 0
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in in_model:
                raise ValueError(f"param group {gi} of the optimizer holds a parameter of shape {tuple(p.shape)} "
                                 f"that is not a parameter of the model; pass the model those parameters belong to")
            trainable += p.requires_grad
    if trainable == 0:
        raise ValueError("the optimizer holds no parameter that requires grad: there is nothing to train")


# GradScaler.step(optimizer) passes itself as ``grad_scaler`` to optimizers whose step() takes it, and warns
# each process once that it will stop doing so; DistOptim relies on it to agree on inf/NaN across ranks.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def _global_step_hooks(kind: str):
    """torch's global optimizer step hooks (``register_optimizer_step_pre_hook`` / ``..._post_hook``)."""
    return getattr(_torch_optimizer, f"_global_optimizer_{kind}_hooks", {}).values()


class DistOptim(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that gradients are averaged across ranks with the chosen schedule.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose update is per parameter
            (SGD, Adam, AdamW, RMSprop, Adagrad, ...).  Under ``dear`` its
            ``step()`` is called once per bucket with each param group narrowed
            to the bucket's parameters, so an optimizer that couples parameters
            across a group (a global norm inside ``step``, LBFGS) would see only
            a bucket at a time: use ``schedule="wfbp"`` and a ``buffer_size``
            larger than the model for those (one bucket, one call).
        model: the module whose forward and backward are scheduled.
        schedule: ``"dear"`` (default), ``"wfbp"``, ``"rsag"``, ``"bytescheduler"``, ``"prophet"``,
            ``"prophet-allreduce"`` or any schedule registered
            with :func:`dearopt.schedules.register`; see :class:`dearopt.options.Options`.
        buffer_size: bytes per fusion bucket or a string like ``"25MB"``.
        first_bucket_size: bytes of the first bucket backward fills (default 1 MB, as DDP; None: no cap).
        allreduce: under ``dear``, which buckets are all-reduced in backward instead of reduce-scattered and
            gathered in the next forward.  ``"predicted"``: from a profile of steps 1-3, as many as fit in the
            link's idle time in backward (:func:`dearopt.plan.allreduce_buckets`).  ``"auto"`` (default): that
            prediction, then measured against none (DeAR's plan), all (DDP's) and DeAR's plan on Prophet's
            gradient blocks (buckets formed from the profiled gaps between gradients, every all-gather started
            at ``step()``) for
            :data:`PLAN_CHOICE_STEPS` steps each (those within :data:`PLAN_CHOICE_REMATCH` of the fastest once
            more), and the fastest is kept (``optimizer.plan_choice``): on
            machines where communication takes cycles from the computation the link model alone misjudges it.
            A fraction of the bytes from the output side (0: DeAR as in the paper) fixes the plan.
        embedding_rows: reduce embedding weights as the rows a batch touched, and a tied decoder's part of
            such a weight as a gradient of its own (default: on, unless ``shard_optimizer``; exact either way,
            see :mod:`dearopt.tied`).
        shard_optimizer: under ``dear``, each rank runs the optimizer on its shard of every bucket at ``step()``
            and the next forward's all-gather carries parameters (ZeRO stage 1 with DeAR's overlap; see
            :mod:`dearopt.sharding`): optimizer state and work per rank are 1/N.  Elementwise optimizers only
            (:class:`dearopt.NotElementwiseError` otherwise).  ``optimizer.state`` is then keyed by the shards;
            :meth:`state_dict` gathers the ordinary layout (every rank must call it),
            :meth:`sharded_state_dict` saves this rank's part.  After ``step()`` every ``p.grad`` is None.
        partition_size, credit, priority: ByteScheduler's partitioning, credit window and priority order.
        link_check_every: for schedules whose buckets come from the profile (``"prophet"``), re-measure the
            link every this many steps and re-plan when its bandwidth moved by more than 25 % twice in a row
            (``"auto"``: 20; ``None``: never); the re-plans: ``optimizer.link_changes``.
        backward_passes_per_step: local accumulation before communicating.
        broadcast_parameters: copy rank 0's parameters and buffers at construction.
        broadcast_buffers: copy rank 0's buffers before every training forward (DDP's default).
        nonfinite: ``"raise"``, ``"skip"`` or ``"ignore"`` for non-finite averaged gradients.
        check_agreement: check that all ranks are at the same step (folded into the buckets' messages).
        comm_hook: how gradients travel: ``"auto"`` (default: bfloat16 and float16 gradients summed in
            float32, :class:`dearopt.comm_hooks.ReduceInFloat32`; others as they are), ``None`` (every
            gradient as it is: a bfloat16 model reduces in bfloat16, less memory), ``"fp16"``, ``"bf16"``, a
            :class:`dearopt.CommHook`, or a :class:`dearopt.Sparsify` (DEFT's top-k with error feedback under
            ``wfbp``/``dear``; not exact; see :mod:`dearopt.sparsify`); the same on every rank.
        debug: compare parameter checksums across ranks at every step (costly; or ``DEAROPT_DEBUG=1``).
        timeline: path for Chrome trace events (or ``DEAROPT_TIMELINE``).
        tuner: a :class:`dearopt.tuner.BayesianTuner` over any of ``buffer_size``, ``partition_size``
            and ``credit``; built by default for the knobs set to ``"auto"`` (buffer: 1 MB .. min(100 MB,
            model size), first trial 25 MB, 10 trials).  Its trials and result: ``optimizer.tuning``.
        tuning_steps: iterations measured per trial (after one discarded iteration).
        profile: a :class:`dearopt.sim.Profile` of this model: with ``buffer_size="auto"`` the tuner's first
            trial is the buffer size the simulator predicts fastest, instead of 25 MB; under ``"deft"`` the
            per-bucket times its schedule is solved from.
        deft_schedule: under ``schedule="deft"``, a :class:`dearopt.schedules.deft.DeftSchedule` to follow
            instead of solving one from ``profile`` (delayed, merged updates: see :mod:`dearopt.delayed`).
        preserver: under ``schedule="deft"`` with a solved schedule, the convergence check it must pass
            (``True``: :class:`dearopt.Preserver` with its defaults, or one given; ``False``: the
            solver's schedule unchecked).  It needs the training loss of the first steps: call
            ``optimizer.step(loss=loss)``.  Its outcome: :attr:`deft_preserved`.
        deft_links: under ``schedule="deft"``, 2 sends part of the buckets over a second communicator
            concurrently (DeFT's heterogeneous links: gloo beside NCCL, a second gloo group beside gloo), with
            the ratio of the two links' times measured on the job; helps only where the links are distinct.
        deft_apply: under ``schedule="deft"``, when a reduced sum is applied: ``"bucket"`` (each bucket once
            all its pieces are sent: only the buckets sent in a later iteration are applied late) or
            ``"group"`` (the paper's: the whole group at once after its last bucket is sent; needed to clip).
        backend: the communicator to train over (default: the job's, from :func:`dearopt.init`); a
            :class:`dearopt.collectives.CollectiveBackend` over a subset of the ranks restricts the averaging to
            them (``dearopt.horovod``'s process sets use this).

    Step hooks registered on this optimizer (``register_step_pre_hook``,
    ``register_step_post_hook``) fire once per ``step()``: the pre hooks when
    it is called, the post hooks once that step's updates have been applied
    (under ``dear`` that is during the next forward, or at ``synchronize()``).
    Hooks on the wrapped optimizer also fire once per step, around its
    per-bucket updates.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                 schedule: str = "dear", buffer_size: Union[int, str] = DEFAULT_BUFFER_SIZE,
                 first_bucket_size: Union[int, str, None] = DEFAULT_FIRST_BUCKET_SIZE,
                 embedding_rows: Optional[bool] = None, allreduce: Union[float, str] = "auto",
                 shard_optimizer: bool = False,
                 partition_size: Union[int, str, None] = None, credit: Union[int, str, None] = None,
                 priority: bool = False, link_check_every: Union[int, str, None] = "auto",
                 backward_passes_per_step: int = 1, broadcast_parameters: bool = True,
                 broadcast_buffers: bool = True, nonfinite: str = "raise", check_agreement: bool = True,
                 comm_hook="auto", timeline: Optional[str] = None, debug: bool = False, tuner=None,
                 tuning_steps: int = 10, profile=None, deft_schedule=None, preserver=True, deft_links: int = 1,
                 deft_apply: str = "bucket", backend=None):
        _check_arguments(optimizer, model)
        preserver = _preserver(preserver)
        hook = resolve_comm_hook(comm_hook)
        if deft_links not in (1, 2):
            raise ValueError(f"deft_links must be 1 or 2, got {deft_links!r}")
        if deft_apply not in APPLY_MODES:
            raise ValueError(f"deft_apply must be one of {APPLY_MODES}, got {deft_apply!r}")
        options = Options(schedule=schedule, buffer_size=buffer_size, first_bucket_size=first_bucket_size,
                          embedding_rows=embedding_rows, allreduce=allreduce, shard_optimizer=shard_optimizer,
                          partition_size=partition_size,
                          credit=credit, priority=priority, link_check_every=link_check_every,
                          backward_passes_per_step=backward_passes_per_step,
                          broadcast_parameters=broadcast_parameters, broadcast_buffers=broadcast_buffers,
                          nonfinite=nonfinite, check_agreement=check_agreement, timeline=timeline, debug=debug,
                          sparsify=isinstance(hook, Sparsify))
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
        main = runtime.get_backend() if backend is None else backend
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
        if get_schedule(options.schedule).delays_updates:
            self._executor = DelayedExecutor(optimizer, model, engine, options, buffer, partition, credit_bytes,
                                             hook, on_step_landed=self._step_landed, schedule=deft_schedule,
                                             profile=profile, preserver=preserver, links=deft_links,
                                             apply=deft_apply)
        else:
            if deft_schedule is not None or deft_links != 1 or deft_apply != "bucket":
                raise ValueError("deft_schedule=, deft_links= and deft_apply= are for schedule='deft'")
            self._executor = Executor(optimizer, model, engine, options, buffer, partition, credit_bytes, hook,
                                      on_step_landed=self._step_landed)
        self._profile = profile
        self.tuning = self._make_tuning(tuner, tuning_steps)
        self.plan_choice = None
        """The measured choice of ``dear``'s all-reduced buckets (``allreduce="auto"``): a
        :class:`dearopt.tuner.TuningController` over a :class:`dearopt.tuner.ChoiceTuner` whose ``history``
        holds each rule's measured steps/s; None until rank 0's profile is shared, and where there is nothing
        to choose."""
        self._choice_considered = False
        self._plan_generation = 0  # the executor's plan_generation this face has seen
        _WRAPPED.add(optimizer)
        functions.register_distoptim(model, self)  # for dearopt.no_sync(model)

    def _make_tuning(self, tuner, tuning_steps):
        """The online tuner of the knobs set to "auto" (DeAR section IV.B); None when nothing is tuned."""
        from . import tuner as tuning  # bayes_opt is imported only when a tuner is built

        auto = [k for k in ("buffer_size", "partition_size", "credit") if getattr(self.options, k) == "auto"]
        if tuner is None and not auto:
            return None
        if tuner is None:
            model_bytes = sum(p.numel() * p.element_size() for g in self.param_groups for p in g["params"])
            mb = tuning.MB
            knobs = []
            if "buffer_size" in auto:
                high = min(100 * mb, max(model_bytes, 2 * mb))
                initial = min(25 * mb, high)
                if self._profile is not None:  # start where the simulator predicts the optimum
                    from . import sim

                    grid = [int(mb * 2 ** (i / 2)) for i in range(0, 15) if mb * 2 ** (i / 2) <= high]
                    initial = sim.best_buffer_size(self._profile, self.options.schedule, grid,
                                                   ranks=self._executor.world)
                knobs.append(tuning.buffer_size_knob(high=high, initial=initial))
            if "partition_size" in auto:
                knobs.append(tuning.Knob("partition_size", 256 * 1024, 16 * mb, log=True, initial=4 * mb, integer=True))
            if "credit" in auto:
                knobs.append(tuning.Knob("credit", 1 * mb, 64 * mb, log=True, initial=16 * mb, integer=True))
            tuner = tuning.BayesianTuner(knobs, budget=10 if len(knobs) == 1 else 20)
        if not isinstance(tuner, tuning.BayesianTuner):
            raise TypeError(f"tuner must be a dearopt.tuner.BayesianTuner, got {type(tuner).__name__}")
        control = self._executor.control
        controller = tuning.TuningController(
            tuner, warmup_steps=1, measure_steps=tuning_steps, is_root=control.rank == 0,
            broadcast=lambda decision: functions.broadcast_object(decision, 0, backend=control))
        self._apply_knobs(controller.current)
        return controller

    def _apply_knobs(self, knobs) -> None:
        self._executor.replan(**{k: int(v) for k, v in knobs.items()})

    def _step_landed(self) -> None:
        for hook in itertools.chain(list(self._optimizer_step_post_hooks.values()), list(_global_step_hooks("post"))):
            hook(self, (), {})

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
        """The :class:`dearopt.timeline.Timeline` this optimizer records to (disabled unless asked for)."""
        return self._executor.timeline

    @property
    def gradients_in_place_before_step(self) -> bool:
        """Whether the schedule can leave the averaged gradient in every ``p.grad`` before ``step()``
        (see :meth:`reduce_gradients`)."""
        return self._executor.gradients_in_place_before_step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of non-finite gradients (``nonfinite="skip"``)."""
        return self._executor.skipped_steps

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
        for hook in itertools.chain(list(_global_step_hooks("pre")), list(self._optimizer_step_pre_hooks.values())):
            hook(self, (), {})
        if loss is not None and hasattr(self._executor, "record_loss"):
            self._executor.record_loss(loss)
        if self._plan_generation != self._executor.plan_generation:
            self._plan_inputs_changed()
        self._inner._opt_called = True  # an LR scheduler built on the wrapped optimizer: its step() counts as called
        if grad_scaler is not None:
            found_inf = self._scaler_found_inf(grad_scaler, unscale=True)
            self._executor.step(skip=found_inf, scaler_checked=True)
        else:
            self._executor.step()
        if self.tuning is not None and not self.tuning.finished:
            knobs = self.tuning.on_step_end()
            if knobs:
                self._apply_knobs(knobs)  # every rank, at the same step boundary
        elif not self._choice_considered:
            self._consider_plan_choice()
        elif self.plan_choice is not None and not self.plan_choice.finished:
            knobs = self.plan_choice.on_step_end()
            if knobs:
                # every rank, at the same step boundary
                self._executor.replan(allreduce=knobs["allreduce"], blocks=knobs.get("blocks", False))
        if self._executor.adapt_to_gradient_reads():  # the loop reads p.grad before every step(): DDP's plan
            self.plan_choice, self._choice_considered = None, True
        return None

    def _plan_inputs_changed(self) -> None:
        """The trainable set or the groups changed (noticed at a backward, on every rank): the measured choice and a
        tuning trial under way were measured on the old set; measure again."""
        self._plan_generation = self._executor.plan_generation
        self.plan_choice, self._choice_considered = None, False
        if self.tuning is not None and not self.tuning.finished:
            self.tuning.restart_trial()

    def _consider_plan_choice(self) -> None:
        """Once rank 0's profile is shared (and tuning is over), start measuring the plans worth comparing."""
        executor = self._executor
        if executor.profile.enabled and executor.profile.result is None:
            return  # the profile is still to come: the same answer on every rank (it is broadcast)
        self._choice_considered = True
        choices = executor.plan_choices()
        if not choices:
            return
        from . import tuner as tuning

        control = executor.control
        self.plan_choice = tuning.TuningController(
            tuning.ChoiceTuner([knobs for knobs, _ in choices], rematch=PLAN_CHOICE_REMATCH),
            warmup_steps=1,
            measure_steps=PLAN_CHOICE_STEPS, is_root=control.rank == 0,
            broadcast=lambda decision: functions.broadcast_object(decision, 0, backend=control))

    @property
    def link_changes(self) -> List[Tuple[int, float, float]]:
        """Re-plans after the link's bandwidth changed (``link_check_every``): ``(step, planned bytes/s,
        measured bytes/s)`` each, the same on every rank."""
        monitor = self._executor.link_monitor
        return list(monitor.changes) if monitor is not None else []

    @property
    def deft_schedule(self):
        """Under ``schedule="deft"``: the :class:`dearopt.schedules.deft.DeftSchedule` in force (None until the
        plan is made; its ``update_frequency`` per bucket); None under every other schedule."""
        return getattr(self._executor, "deft", None)

    @property
    def sparse_traffic(self) -> Optional[Dict[str, int]]:
        """Under ``comm_hook=dearopt.Sparsify(...)``: this rank's elements in the last step that communicated:
        ``values`` it put into its reductions, ``indices`` it selected, ``received`` selections that reached it
        from every rank; None without a sparsifier."""
        sparse = self._executor.sparse
        return dict(sparse.last_step_sent) if sparse is not None else None

    @property
    def deft_preserved(self):
        """Under ``schedule="deft"`` with a solved, checked schedule: the Preserver's outcome (a
        :class:`dearopt.schedules.deft.Preserved`: ratio, capacity factor, re-solves, passed); else None."""
        return getattr(self._executor, "preserved", None)

    @property
    def deft_reduction(self) -> Optional[str]:
        """Under ``schedule="deft"``: how each piece is summed over ranks, ``"all_reduce"`` or
        ``"reduce_scatter+all_gather"`` (measured faster, or a profile's fits); None under every other schedule."""
        return getattr(self._executor, "reduction", None) if hasattr(self._executor, "deft_state") else None

    @property
    def deft_times(self) -> Optional[Dict[str, List[float]]]:
        """Under ``schedule="deft"`` once solved: what the solver was given, per piece (seconds, rank 0's
        measurement or the profile's, the same on every rank): ``forward`` and ``backward`` compute (the knapsack
        capacities) and ``comm`` (each piece's reduction, the items' weights); None before and under every other
        schedule."""
        measured = getattr(self._executor, "measured", None)
        if measured is None or not hasattr(self._executor, "deft_state"):
            return None
        forward, backward, comm = measured
        return {"forward": list(forward), "backward": list(backward), "comm": list(comm)}

    @property
    def deft_repartitions(self) -> Optional[List[int]]:
        """Under ``schedule="deft"``: the sizes in bytes the measuring steps re-partitioned buckets and pieces to,
        where one outlasted a stage (empty: none); None under every other schedule."""
        sizes = getattr(self._executor, "repartitions", None)
        return list(sizes) if sizes is not None else None

    @property
    def applied_steps(self) -> Optional[List[int]]:
        """Under ``schedule="deft"``: the steps at which a group of gradients was applied; None under every other
        schedule (each step's gradients are applied at that step, unless skipped: :attr:`skipped_steps`)."""
        steps = getattr(self._executor, "applied_steps", None)
        return list(steps) if steps is not None else None

    @property
    def settled(self) -> bool:
        """Whether the plan has stopped changing by itself: the profile is applied, tuning (``"auto"`` knobs)
        and the measured choice of ``allreduce="auto"`` are over.  The same on every rank."""
        executor = self._executor
        if getattr(executor, "offset", 0) and getattr(executor, "deft", None) is None:
            return False  # schedule="deft" is still measuring the job
        if executor.plan is None or (executor.profile.enabled and (executor.profile.result is None
                                                                  or executor.profile.fresh)):
            return False
        if self.tuning is not None and not self.tuning.finished:
            return False
        return self._choice_considered and (self.plan_choice is None or self.plan_choice.finished)

    step.hooked = True  # torch must not wrap it: the post hooks fire when the step's updates have landed

    def _scaler_found_inf(self, scaler, unscale: bool) -> bool:
        """Unscale through ``scaler`` if it has not been done this step (recording the agreed inf/NaN answer in
        the scaler's state, as its own ``unscale_`` would); return whether inf/NaN was found."""
        from torch.amp.grad_scaler import OptState

        if self._executor.sparse is not None:
            raise UsageError("GradScaler is not supported with comm_hook=dearopt.Sparsify(...): the residuals "
                             "(error feedback) would carry gradients scaled differently from step to step, and a "
                             "skipped step would lose what it selected")
        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY and unscale:
            inv_scale = scaler._scale.double().reciprocal().float()
            found = self._executor.unscale_and_check(inv_scale)
            state["found_inf_per_device"] = {scaler._scale.device: torch.full((), float(found),
                                                                               device=scaler._scale.device)}
            state["stage"] = OptState.UNSCALED
        elif state["stage"] is OptState.UNSCALED and not unscale:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        return sum(float(v) for v in state["found_inf_per_device"].values()) > 0

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
        return self._executor.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged gradients to ``[-clip_value, clip_value]``; between ``backward()`` and ``step()``.

        Equal to ``torch.nn.utils.clip_grad_value_`` on the averaged gradients
        of single-process training, under every schedule.
        """
        self._executor.clip_grad_value_(clip_value)

    def unscale_(self, scale) -> None:
        """Unscale the averaged gradients; call between ``backward()`` and ``step()``.

        ``scale`` is a ``torch.amp.GradScaler`` (what ``scaler.unscale_(optimizer)``
        does, on the averaged gradients: use it before clipping with
        :meth:`clip_grad_norm_`; then ``scaler.step(optimizer)`` skips the step on
        every rank if inf/NaN was found) or a number, for loss scaling by hand
        (``(loss * scale).backward()``; with ``nonfinite="skip"`` a step whose
        scaled gradients overflowed is skipped on every rank).
        """
        if isinstance(scale, torch.amp.GradScaler):
            from torch.amp.grad_scaler import OptState

            scale._check_scale_growth_tracker("unscale_")
            if scale._per_optimizer_states[id(self)]["stage"] is not OptState.READY:
                raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
            self._scaler_found_inf(scale, unscale=True)
            return
        self._executor.unscale_(scale)

    def reduce_gradients(self) -> None:
        """Finish communication now, so that every ``p.grad`` holds the averaged gradient.

        Under schedules that keep shards until the next forward (``dear``, ``prophet``, the sharded update) the
        averages are gathered into ``p.grad`` now, as a read of ``p.grad`` between backward and ``step()`` does:
        that step's gathers then no longer overlap the next forward.
        """
        self._executor.reduce_gradients()

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
        options = dataclasses.replace(self.options, backward_passes_per_step=passes)
        self.options = options
        self._executor.options = options
        self._executor.checks.options = options

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communication."""
        previous = self._executor.no_sync
        self._executor.no_sync = True
        try:
            yield
        finally:
            self._executor.no_sync = previous

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
        if hasattr(self._executor, "deft_state"):  # schedule="deft": this rank's delayed group sums
            saved["dearopt_deft"] = self._executor.deft_state()
        if self._executor.sparse is not None:  # comm_hook=Sparsify: this rank's residuals (error feedback)
            saved["dearopt_sparse"] = self._executor.sparse.state_dict()
        return saved

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
        if "dearopt_deft" in state_dict:
            if not hasattr(self._executor, "load_deft_state"):
                raise UsageError("this state_dict was saved under schedule='deft' (it holds delayed gradient sums); "
                                 "load it into a DistOptim with schedule='deft'")
            state_dict = dict(state_dict)
            self._executor.load_deft_state(state_dict.pop("dearopt_deft"))
        if "dearopt_sparse" in state_dict:
            if self._executor.sparse is None:
                raise UsageError("this state_dict holds a sparsifier's residuals (comm_hook=dearopt.Sparsify): load "
                                 "it into a DistOptim with the same comm_hook")
            state_dict = dict(state_dict)
            self._executor.sparse.load_state_dict(state_dict.pop("dearopt_sparse"))
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
        """Load this rank's :meth:`sharded_state_dict` (a :class:`dearopt.CheckpointMismatchError` if it was
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
            raise UsageError(f"{what}() is for shard_optimizer=True; this optimizer is not sharded: use "
                             f"state_dict() / load_state_dict()")
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
                raise ValueError(f"add_param_group(): a parameter of shape {tuple(p.shape)} is not a parameter of the "
                                 f"model this DistOptim was built on")
        self._inner.add_param_group(dict(param_group, params=params))

    def close(self) -> None:
        """Apply pending updates, remove the hooks and release the engine's communicator."""
        self._executor.close()
        if self._engine_backend is not None:
            self._engine_backend.close()
            self._engine_backend = None
        _WRAPPED.discard(self._inner)

    def __repr__(self) -> str:
        return f"DistOptim({self._inner!r}, schedule={self.options.schedule!r})"

    def __getstate__(self):
        raise TypeError("DistOptim cannot be pickled; save optimizer.state_dict() instead")
