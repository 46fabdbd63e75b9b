"""Parameters and gradients are current whenever the user's code looks at them.

Two guards on torch's function-mode stack, each on only while it has something to guard:

* :class:`GradientGuard`, from the end of a communicating backward to ``step()``, under schedules whose ``p.grad``
  does not yet hold the averaged gradient when ``backward()`` returns (``dear``, ``bytescheduler``, ``prophet``:
  the average is still travelling, or kept as this rank's shard).  The first torch call that reads a watched
  ``p.grad`` (``torch.nn.utils.clip_grad_norm_``, ``GradScaler.unscale_``, a logging line) first finishes every
  bucket's reduction and gathers it into ``p.grad``, so that call, and every later one until ``step()``, sees
  and changes the averaged gradient exactly as with DDP.  The price is that step's overlap of the gathers with
  the next forward.
* :class:`PendingUpdateGuard`, from ``step()`` until the model's next training forward starts, under schedules
  that apply updates in the next forward (``dear``, ``bytescheduler``): any torch call that touches a parameter
  whose update is pending (reading ``p.data``, ``p.clamp_()``, ``p.detach()``, ``p.grad``,
  ``torch.nn.utils.parameters_to_vector(...)``...) first applies the pending updates up to that parameter's
  bucket, in bucket order, and then runs.  So an EMA read, a WGAN clamp (``p.data.clamp_(-c, c)``) or a copy into
  the weights after ``step()`` sees and changes the parameters exactly as in single-process training.  The price
  is paid only when such code runs: the FeedPipe overlap of those buckets is lost for that iteration.

A guard costs one Python call per torch op while it is on the stack; the engine leaves it off during its own work
and takes it off as soon as it has done its job.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PendingUpdateGuard", "GradientGuard"]

_GRAD_DESCRIPTOR = torch._C.TensorBase.__dict__["grad"]


def _current_mode():
    """The torch function mode on top of the stack (None if the stack is empty)."""
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


def _reads_grad(func) -> bool:
    """Whether ``func`` is the getter of ``Tensor.grad`` (what ``p.grad`` calls under a function mode)."""
    return getattr(func, "__self__", None) is _GRAD_DESCRIPTOR


class _TouchGuard(TorchFunctionMode):
    """A function mode that calls back when a torch call touches one of the tensors it watches (by ``id``)."""

    def __init__(self, callback: Callable[[int], None]):
        super().__init__()
        self._callback = callback
        self._watch: Dict[int, int] = {}  # id(tensor) -> its bucket, while guarded
        self._active = False
        self._on_stack = False
        self._suspended = 0

    @property
    def armed(self) -> bool:
        return self._active

    def push(self) -> None:
        """Be on the stack, passing everything through until armed.  From the thread that runs the user's code:
        torch restores the stack after a callback at the end of backward, so a push there would not last."""
        if not self._on_stack:
            self.__enter__()
            self._on_stack = True

    def arm(self, watch: Dict[int, int]) -> None:
        """Guard these tensors (``id(t) -> bucket``) until :meth:`disarm`."""
        self._watch = watch
        self._active = bool(watch)
        if self._active:
            self.push()

    def disarm(self) -> None:
        """Stop guarding; leave torch's mode stack as soon as this is called from outside the guard itself."""
        self._watch = {}
        self._active = False
        # Inside our own __torch_function__ torch has taken the mode off the stack for the call and puts it
        # back afterwards; then (or if the user pushed a mode above ours) it stays, passing everything through,
        # until the next disarm() from outside (the model's next forward).
        if self._on_stack and _current_mode() is self:
            self.__exit__(None, None, None)
            self._on_stack = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The engine's own work runs unguarded."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _target(self, func, args, kwargs) -> Optional[int]:
        target = None
        for value in list(args) + list(kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor):
                    bucket = self._watch.get(id(item))
                    if bucket is not None and (target is None or bucket > target):
                        target = bucket
        return target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._active and not self._suspended:
            target = self._target(func, args, kwargs)
            if target is not None:
                self._callback(target)
        return func(*args, **kwargs)


class PendingUpdateGuard(_TouchGuard):
    """After ``step()``: a touch of a parameter whose update is pending applies the updates up to its bucket."""


class GradientGuard(_TouchGuard):
    """Between backward and ``step()``: reading a watched parameter's ``.grad``, or touching a gradient view kept
    from before, finishes the reductions first.  A parameter counts only through its ``.grad`` getter: reading
    its values (a weight norm for a log) needs no communication."""

    def __init__(self, callback: Callable[[int], None]):
        super().__init__(callback)
        self._params: Dict[int, int] = {}  # id(parameter) -> its bucket

    def arm(self, views: Dict[int, int], params: Optional[Dict[int, int]] = None) -> None:
        """Guard the gradient ``views`` and the ``.grad`` of ``params`` (``id -> bucket`` each)."""
        self._params = params or {}
        super().arm(views)
        if self._params and not self._active:
            self._active = True
            self.push()

    def disarm(self) -> None:
        self._params = {}
        super().disarm()

    def _target(self, func, args, kwargs) -> Optional[int]:
        if _reads_grad(func):
            return self._params.get(id(args[0])) if args else None
        return super()._target(func, args, kwargs)
