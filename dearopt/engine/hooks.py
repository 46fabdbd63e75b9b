"""The engine's hooks on the user's model and tensors, and the records of its life cycle.

:class:`EngineHooks` registers and removes every hook the engine puts on the
model and holds the two guards that watch user code (:mod:`dearopt.engine.guards`):

* the root module's forward pre and post hooks, and state-dict hooks (Python, once per forward);
* :class:`GradientHooks`: one post hook per parameter on its ``AccumulateGrad`` node.  With the C++ extension
  (``dearopt.engine._ready``, csrc/ready.cpp) it moves a replaced ``.grad`` into its bucket view and counts the
  bucket's gradients without the GIL, as DDP's reducer does; Python runs once per backward (``on_first``) and
  once per bucket (``on_bucket``), or at every gradient where the engine asks for it (``per_param``: the steps
  that time each gradient for the profile, DeFT).  Without the extension each parameter has a Python hook;
* :class:`ForwardGates`: a forward pre-hook on every module that owns planned parameters, a C callable where the
  extension is built: while updates are pending it calls the engine for a module whose bucket the forward has
  not reached yet, else it costs one C call;
* while the first forward runs, the recorder's hooks (the forward order the plan is made from).

The callbacks are the engine's own methods, reached through :class:`EngineHook` (a weak reference).
:class:`TrainingState`, :class:`Round` and :class:`LifeCycle` (their transitions, written once) are the life cycle
the engine keeps; the life cycle also runs the optimizer's step post hooks (:class:`StepPostHooks`, the user's) once
a step's updates have landed.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim import optimizer as _torch_optimizer

from dearopt.errors import UsageError
from dearopt.planning.order import ForwardOrderRecorder
from dearopt.engine.guards import GradientGuard, PendingUpdateGuard

__all__ = ["EngineHook", "EngineHooks", "LifeCycle", "StepPostHooks", "TrainingState", "Round", "global_step_hooks"]


class EngineHook:
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
            _raise_named(exc, method.__self__, method.__name__)
            raise

    def __deepcopy__(self, memo) -> "EngineHook":
        return EngineHook()

    def __reduce__(self):
        return (EngineHook, ())


def _raise_named(exc: BaseException, owner, name: str) -> None:
    """Raise what the engine reports for ``exc``, raised by ``owner``'s method ``name`` in a hook: a
    :class:`~dearopt.errors.DearoptError` as it is, a bug as an error naming the rank and step
    (:func:`dearopt.backends.base.engine_failure`).  Returns only for a ``BaseException`` that is not an
    ``Exception`` (the caller re-raises it)."""
    from dearopt.backends.base import engine_failure

    if not isinstance(exc, Exception):
        return
    error = engine_failure(exc, owner, f"{type(owner).__name__}.{name}")
    if error is exc:
        raise exc
    raise error from exc


def _weak_call(method: Optional[Callable]):
    """``method`` (a bound method; None: nothing) as C++ calls it: through a weak reference to its object, with no
    Python frame between (``dearopt.engine._ready.WeakCall``)."""
    if method is None:
        return _native.WeakCall(None, "")
    return _native.WeakCall(method.__self__, method.__name__, _raise_named)


class _SparseWatch(EngineHook):
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


def global_step_hooks(kind: str):
    """torch's global optimizer step hooks (``register_optimizer_step_pre_hook`` / ``..._post_hook``)."""
    return getattr(_torch_optimizer, f"_global_optimizer_{kind}_hooks", {}).values()


class StepPostHooks:
    """An optimizer's step post hooks: its own (torch's ``register_step_post_hook`` writes them into ``hooks``)
    and torch's global ones, called as torch calls them, ``hook(optimizer, (), {})``, once a step's updates have
    landed.  The optimizer is held weakly (its engine holds this)."""

    __slots__ = ("_optimizer", "_hooks")

    def __init__(self, optimizer, hooks: dict):
        self._optimizer = weakref.ref(optimizer)
        self._hooks = hooks

    def run(self) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        for hook in itertools.chain(list(self._hooks.values()), list(global_step_hooks("post"))):
            hook(optimizer, (), {})


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


class LifeCycle:
    """The engine's life cycle, written once: where the loop is (:class:`TrainingState`), the step and pass
    counters and, while a step's gradients are on their way, their :class:`Round`.

    The :class:`~dearopt.engine.engine.Executor` owns one; its parts read it and move it only through these
    transitions (no part sets its fields), so every rounds part goes through the same life cycle.  It calls
    nobody of the engine: a leaf that holds numbers, and the user's step post hooks it runs when a step landed.
    """

    __slots__ = (
        "state",
        "round",
        "step_count",
        "forwards",
        "skipped_steps",
        "pass_id",
        "accumulated",
        "no_sync",
        "passes",
        "planned",
        "sending",
        "post_hooks",
    )

    def __init__(self, backward_passes_per_step: int = 1, post_hooks: Optional[StepPostHooks] = None):
        self.state = TrainingState.IDLE
        self.round: Optional[Round] = None
        self.step_count = 0
        self.forwards = 0  # training forwards since the last step(), part of the step tag
        self.skipped_steps = 0
        self.pass_id = 0
        self.accumulated = 0  # backward passes since the last communicating one
        self.no_sync = False
        self.passes = backward_passes_per_step  # the options' backward_passes_per_step (set again when it changes)
        self.planned = False  # a plan was made (the first backward ran)
        self.sending = False  # the backward pass under way sends its gradients
        self.post_hooks = post_hooks  # the optimizer's step post hooks (step_landed)

    # ------------------------------------------------------------ transitions
    def forward_began(self) -> None:
        """A training forward began."""
        self.forwards += 1

    def begin_pass(self) -> None:
        """A backward pass begins (its gradients carry this pass's id)."""
        self.pass_id += 1

    def in_backward(self) -> bool:
        """The backward pass is under way (a re-plan from here on is one inside backward); returns whether it
        sends its gradients (:attr:`communicates`)."""
        self.state = TrainingState.BACKWARD
        self.sending = not self.no_sync and self.accumulated + 1 >= self.passes
        return self.sending

    @property
    def communicates(self) -> bool:
        """Whether a backward pass beginning now would send its gradients (not inside ``no_sync()``, the last of
        ``backward_passes_per_step``)."""
        return not self.no_sync and self.accumulated + 1 >= self.passes

    def open_round(self) -> Round:
        """A communicating backward began: its gradients' round."""
        self.round = Round(self.step_count, self.forwards)
        return self.round

    def backward_ended(self) -> bool:
        """The backward pass ended: its gradients are in flight or accumulated locally; returns whether they are
        in flight (``step()`` comes next)."""
        if not self.sending:
            self.state = TrainingState.ACCUMULATED
            self.accumulated += 1
            return False
        self.accumulated = 0
        self.state = TrainingState.REDUCING
        return True

    def stepped(self, skipped: bool) -> None:
        """``step()`` took the round's gradients (``skipped``: a non-finite step applies nothing)."""
        self.forwards = 0
        self.step_count += 1
        self.state = TrainingState.IDLE
        self.skipped_steps += bool(skipped)

    def close_round(self) -> None:
        """The round's last update landed (or a skipped step finished what it had started)."""
        self.round = None

    def step_landed(self) -> None:
        """Every update of the last ``step()`` is in the parameters (or a skipped step applied nothing): the
        optimizer's step post hooks run now, as torch runs them at the end of ``step()``."""
        if self.post_hooks is not None:
            self.post_hooks.run()

    def restore(self, step_count: int) -> None:
        """A checkpoint's step count (a resumed delayed schedule continues its period where it stopped)."""
        self.step_count = step_count

    # ---------------------------------------------------------------- checks
    def require_gradients(self, what: str) -> None:
        """A ``UsageError`` unless a communicating backward ran since the last ``step()``."""
        if self.state is TrainingState.REDUCING:
            return
        if not self.planned or self.accumulated == 0:
            raise UsageError(f"cannot {what}: no backward() since the last step(); call loss.backward() first")
        raise UsageError(
            f"cannot {what}: only {self.accumulated} of backward_passes_per_step={self.passes} backward "
            f"passes were run (or they ran inside no_sync())"
        )


try:  # the C++ hooks (csrc/ready.cpp), built by setup.py where torch's C++ extension tools work
    from dearopt.engine import _ready as _native
except ImportError:  # pragma: no cover - a build without the extension: the Python hooks
    _native = None

NATIVE = _native is not None
"""Whether the C++ hooks are built (``python -m dearopt.bench --count`` says which hooks a run used)."""


def _plain(p: torch.Tensor) -> bool:
    """A tensor whose storage the C++ hooks can look at (not a wrapper subclass such as DTensor)."""
    return type(p) in (torch.Tensor, torch.nn.Parameter) or type(p.data) is torch.Tensor


class GradientHooks:
    """The gradient hooks of every planned parameter (see the module): ``on_first()`` once per backward (after
    :meth:`expect_backward`), ``on_bucket(b)`` once bucket ``b`` has all its gradients, ``on_param(p)`` at every
    gradient in per-parameter mode.  Each parameter is hooked once, for the engine's life; :meth:`bind` says
    which bucket and position each has under the plan in force."""

    def __init__(self, on_first: Callable, on_bucket: Optional[Callable], on_param: Callable, on_sparse: Callable):
        """Bound methods, held weakly: ``on_bucket`` (None where Python sees every gradient) is called from C++
        directly; ``on_sparse(id(param), grad)`` at each parameter's first gradient."""
        self._on_first, self._on_param, self._on_sparse = EngineHook(on_first), EngineHook(on_param), on_sparse
        self.native = None
        if _native is not None:
            self.native = _native.ReadyHooks(
                _weak_call(on_first), _weak_call(on_bucket), _weak_call(self._param_by_slot)
            )
            self.native.expect_backward()
        self.params: List[torch.Tensor] = []  # by slot
        self.slot_of: Dict[int, int] = {}  # id(param) -> slot
        self._handles = []
        self._expect = True
        self._per_param = self.native is None
        self._timing = False
        self._position_of: List[Tuple[int, int]] = []  # (slot, position in the plan) of every planned parameter

    @property
    def counting(self) -> bool:
        """Whether C++ counts the buckets' gradients (else Python sees every gradient)."""
        return not self._per_param

    def _param_by_slot(self, slot: int):
        return self._on_param(self.params[slot])

    def add(self, params: Iterable[torch.Tensor]) -> None:
        """Hook the parameters that require grad and are not hooked yet (one unfrozen later, too)."""
        new = [p for p in params if id(p) not in self.slot_of and p.requires_grad]
        if not new:
            return
        if self.native is not None and not all(_plain(p) for p in new):
            self._fall_back()
        if self.native is not None:
            slots = self.native.add(new)
        else:
            slots = range(len(self.params), len(self.params) + len(new))
            for p in new:
                self._handles.append(p.register_post_accumulate_grad_hook(EngineHook(self._python_ready)))
        for p, slot in zip(new, slots):
            self.slot_of[id(p)] = slot
            self.params.append(p)
            watch = _SparseWatch(self._on_sparse, id(p))  # one-shot: the first gradient says whether it is sparse
            watch.handle = p.register_hook(watch)

    def _fall_back(self) -> None:
        """A parameter the C++ hooks cannot see into (a DTensor): every parameter gets a Python hook instead."""
        old, self.params, self.slot_of = self.params, [], {}
        self.native.remove()
        self.native = None
        self._per_param = True
        self.add(old)

    def _python_ready(self, p) -> None:
        if self._expect:
            self._expect = False
            self._on_first()
        self._on_param(p)

    def bind(self, buckets: Sequence) -> None:
        """The plan in force: each planned parameter's bucket, position and view (for the C++ counting)."""
        if self.native is None:
            return
        slots, which, positions, views = [], [], [], []
        self._position_of = []
        for b in buckets:
            for j, (p, view) in enumerate(zip(b.params, b.views)):
                slot = self.slot_of.get(id(p))
                if slot is not None:
                    slots.append(slot)
                    which.append(b.index)
                    positions.append(j)
                    views.append(view)
                    self._position_of.append((slot, b.spec.params[j]))
        self.native.bind(slots, which, positions, views, [len(b.params) for b in buckets])

    def per_param(self, on: bool) -> None:
        """Python sees every gradient (``on``) or C++ counts them (off; only where the extension is built)."""
        on = on or self.native is None
        self._per_param = on
        if self.native is not None:
            self.native.per_param(on)

    def timed(self, on: bool) -> bool:
        """Note each gradient's arrival time in C++ while counting (the profile's steps); False where only
        Python can (:meth:`per_param` then)."""
        if self.native is None or self._per_param:
            return False
        if on != self._timing:
            self.native.timing(on)
            self._timing = on
        return on

    def arrivals(self) -> List[Tuple[int, float]]:
        """``(position in the plan, perf_counter seconds)`` of each gradient that arrived in this pass (after
        :meth:`timed`)."""
        stamps = self.native.stamps()
        n = len(stamps)
        return [(pos, stamps[slot]) for slot, pos in self._position_of if slot < n and not math.isnan(stamps[slot])]

    def expect_backward(self) -> None:
        """The next gradient begins a backward pass: ``on_first()`` is called there."""
        self._expect = True
        if self.native is not None:
            self.native.expect_backward()

    def counted(self, bucket: int) -> bytes:
        """Which positions of ``bucket`` got a gradient in this pass (one byte each), as C++ counted them."""
        return self.native.counted(bucket)

    def sparse_slots(self) -> List[int]:
        return self.native.sparse_slots() if self.native is not None else []

    def remove(self) -> None:
        if self.native is not None:
            self.native.remove()
        for h in self._handles:
            h.remove()
        self._handles = []


class _PyGate:
    """:class:`ForwardGates`' Python stand-in for the C++ gate."""

    def __init__(self, reach: Callable):
        self._reach = reach
        self.armed = False
        self.reached = -1

    def arm(self, reached: int) -> None:
        self.reached, self.armed = reached, True

    def disarm(self) -> None:
        self.armed = False

    def hook(self, bucket: int) -> Callable:
        gate = weakref.ref(self)

        def module_reached(module, args):
            g = gate()
            if g is not None and g.armed and bucket > g.reached:
                g._reach(bucket)

        return module_reached


class ForwardGates:
    """A forward pre-hook on each module that owns planned parameters, with the last bucket holding them: while
    the gate is armed (updates pending after ``step()``), a module whose bucket the forward has not reached calls
    ``reach(bucket)``; the others cost one C call (a Python call without the extension)."""

    def __init__(self, reach: Callable):
        """``reach``: a bound method (held weakly), called from C++ directly where the extension is built."""
        self.gate = _native.ForwardGate(_weak_call(reach)) if _native is not None else _PyGate(EngineHook(reach))
        self._handles = []

    def bind(self, module_bucket: Dict[int, int], order: Sequence[torch.nn.Module]) -> None:
        """Hooks for the plan in force (those of the old plan are removed): on the modules, in the recorded forward
        order, that reach a bucket no module before them reached (each bucket's moment).  A module that runs out of
        that order touches parameters whose update is pending, which the guard on them applies first
        (:class:`dearopt.engine.guards.PendingUpdateGuard`); a hook on every module would cost each module's
        call torch's slower path with hooks."""
        self.remove()
        reached = -1
        for module in order:
            bucket = module_bucket.get(id(module))
            if bucket is not None and bucket > reached:
                reached = bucket
                self._handles.append(module.register_forward_pre_hook(self.gate.hook(bucket)))

    def arm(self, reached: int = -1) -> None:
        self.gate.arm(reached)

    def disarm(self) -> None:
        self.gate.disarm()

    @property
    def reached(self) -> int:
        return self.gate.reached

    @reached.setter
    def reached(self, bucket: int) -> None:
        self.gate.reached = bucket

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class EngineHooks:
    """Every hook the engine registers, the forward-order recorder and the guards on user code."""

    def __init__(self, engine, model: torch.nn.Module, every_module: bool):
        """``every_module``: the rounds part wants ``module_reached(module)`` before every module with parameters
        (DeFT's measuring marks); otherwise the forward gates call ``reach_bucket(b)``."""
        self.recorder = ForwardOrderRecorder()
        self.guard = PendingUpdateGuard(EngineHook(engine._make_current))
        self.grad_guard = GradientGuard(EngineHook(engine._gradients_requested))
        self.sparse_ids: set = set()  # parameters autograd gave a sparse gradient
        self.model = model
        self.gradients: Optional[GradientHooks] = None  # (route: once the rounds part exists)
        self.gates: Optional[ForwardGates] = None
        self._handles = [
            model.register_forward_pre_hook(EngineHook(engine._root_pre_hook)),
            model.register_forward_hook(EngineHook(engine._root_post_hook)),
            model.register_state_dict_pre_hook(EngineHook(engine._synchronize_hook)),
            model.register_load_state_dict_pre_hook(EngineHook(engine._synchronize_hook)),
        ]
        # every module with parameters of its own, also those outside the optimizer now: a group added later
        # (add_param_group) must find its modules in the recorded forward order
        modules = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        self._recording = [m.register_forward_pre_hook(EngineHook(self._saw)) for m in modules]
        self._every_module = (
            [m.register_forward_pre_hook(EngineHook(engine._module_pre_hook)) for m in modules] if every_module else []
        )

    def route(self, engine, rounds) -> None:
        """The gradient hooks and the forward gates, routed to the parts that do the work: the engine at a
        backward's first gradient (it begins the pass) and at each gradient where Python sees every one; the rounds
        part itself where a bucket completes (``bucket_ready``) and where the forward reaches a bucket
        (``reach_bucket``).  A rounds part that sees every gradient and module (``every_module``) has neither."""
        self.gradients = GradientHooks(
            engine._backward_begins,
            getattr(rounds, "bucket_ready", None),
            engine._param_ready,
            engine._note_sparse,
        )
        self.gates = ForwardGates(getattr(rounds, "reach_bucket", None))

    def _saw(self, module, args) -> None:
        self.recorder.saw(module)

    @property
    def recording(self) -> bool:
        """Whether the forward order may still be recorded (no plan was made yet)."""
        return bool(self._recording)

    def stop_recording(self) -> List[torch.nn.Module]:
        """The forward order recorded; its hooks are removed."""
        for h in self._recording:
            h.remove()
        self._recording = []
        return self.recorder.stop()

    def bind(self, bound, order: Sequence[torch.nn.Module]) -> None:
        """The plan in force: the gradient hooks' buckets and the forward gates (``order``: the modules in the
        recorded forward order)."""
        self.gradients.bind(bound.buckets)
        if not self._every_module:
            self.gates.bind(bound.module_bucket, order)

    def remove(self) -> None:
        """Remove every hook and disarm the guards."""
        self.guard.disarm()
        self.grad_guard.disarm()
        self.gradients.remove()
        self.gates.remove()
        for h in self._handles + self._recording + self._every_module:
            h.remove()
        self._handles, self._recording, self._every_module = [], [], []
