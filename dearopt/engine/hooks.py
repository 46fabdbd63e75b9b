"""The engine's hooks on the user's model and tensors, and the records of its life cycle.

:class:`EngineHooks` registers and removes every hook the engine puts on the
model (forward pre/post hooks, a post-accumulate-grad hook and a one-shot
sparse watch per parameter, state-dict hooks) and holds the two guards that
watch user code (:mod:`dearopt.engine.guards`).  The callbacks are the engine's own
methods, reached through :class:`EngineHook` (a weak reference).
:class:`TrainingState` and :class:`Round` are the life cycle the engine keeps.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Callable, Iterable

import torch

from dearopt.planning.order import ForwardOrderRecorder
from dearopt.engine.guards import GradientGuard, PendingUpdateGuard

__all__ = ["EngineHook", "EngineHooks", "TrainingState", "Round"]


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
            from dearopt.backends.base import engine_failure

            error = engine_failure(exc, method.__self__, f"{type(method.__self__).__name__}.{method.__name__}")
            if error is exc:
                raise
            raise error from exc

    def __deepcopy__(self, memo) -> "EngineHook":
        return EngineHook()

    def __reduce__(self):
        return (EngineHook, ())


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


class EngineHooks:
    """Every hook the engine registers, the forward-order recorder and the guards on user code."""

    def __init__(self, engine, model: torch.nn.Module):
        self.recorder = ForwardOrderRecorder()
        self.guard = PendingUpdateGuard(EngineHook(engine._make_current))
        self.grad_guard = GradientGuard(EngineHook(engine._gradients_requested))
        self.sparse_ids: set = set()  # parameters autograd gave a sparse gradient
        self._engine = weakref.ref(engine)
        self._handles = [
            model.register_forward_pre_hook(EngineHook(engine._root_pre_hook)),
            model.register_forward_hook(EngineHook(engine._root_post_hook)),
        ]
        # every module with parameters of its own, also those outside the optimizer now: a group added later
        # (add_param_group) must find its modules in the recorded forward order and their updates applied in time
        for module in model.modules():
            if next(module.parameters(recurse=False), None) is not None:
                self._handles.append(module.register_forward_pre_hook(EngineHook(engine._module_pre_hook)))
        self._handles.append(model.register_state_dict_pre_hook(EngineHook(engine._synchronize_hook)))
        self._handles.append(model.register_load_state_dict_pre_hook(EngineHook(engine._synchronize_hook)))
        self._hooked: set = set()

    def hook_params(self, params: Iterable[torch.nn.Parameter], on_ready: Callable, on_sparse: Callable) -> None:
        """Give every parameter that requires grad a gradient hook, once (also ones unfrozen later)."""
        for p in params:
            if id(p) not in self._hooked and p.requires_grad:  # a frozen one that still holds a gradient: later
                self._hooked.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(EngineHook(on_ready)))
                watch = _SparseWatch(on_sparse, id(p))
                watch.handle = p.register_hook(watch)

    def remove(self) -> None:
        """Remove every hook and disarm the guards."""
        self.guard.disarm()
        self.grad_guard.disarm()
        for h in self._handles:
            h.remove()
        self._handles = []
