"""Parameters are current whenever the user's code looks at them.

Schedules that apply updates in the next forward (``dear``, ``bytescheduler``)
leave a step's updates pending after ``step()`` returns.  From then until the
model's next training forward starts, :class:`PendingUpdateGuard` is on
torch's function-mode stack: any torch call that touches a parameter whose
update is pending (reading ``p.data``, ``p.clamp_()``, ``p.detach()``,
``p.grad``, ``torch.nn.utils.parameters_to_vector(...)``...) first applies the
pending updates up to that parameter's bucket, in bucket order, and then runs.
So an EMA read, a WGAN clamp (``p.data.clamp_(-c, c)``) or a copy into the
weights after ``step()`` sees and changes the parameters exactly as in
single-process training.  The price is paid only when such code runs: the
FeedPipe overlap of those buckets is lost for that iteration.

The guard costs one Python call per torch op while it is on the stack; the
engine leaves it off during its own work and takes it off when the model's
next forward starts (whose module hooks apply the updates anyway).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PendingUpdateGuard"]


def _current_mode():
    """The torch function mode on top of the stack (None if the stack is empty)."""
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


class PendingUpdateGuard(TorchFunctionMode):
    def __init__(self, make_current: Callable[[int], None]):
        super().__init__()
        self._make_current = make_current
        self._bucket_of: Dict[int, int] = {}  # id(parameter) -> its bucket, while its update is pending
        self._on_stack = False
        self._suspended = 0

    @property
    def armed(self) -> bool:
        return bool(self._bucket_of)

    def arm(self, bucket_of: Dict[int, int]) -> None:
        """Guard these parameters (``id(p) -> bucket``) until :meth:`disarm`."""
        self._bucket_of = dict(bucket_of)
        if self._bucket_of and not self._on_stack:
            self.__enter__()
            self._on_stack = True

    def disarm(self) -> None:
        """Stop guarding; leave torch's mode stack as soon as this is called from outside the guard itself."""
        self._bucket_of = {}
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

    def _target(self, args, kwargs) -> Optional[int]:
        target = None
        for value in list(args) + list(kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor):
                    bucket = self._bucket_of.get(id(item))
                    if bucket is not None and (target is None or bucket > target):
                        target = bucket
        return target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._bucket_of and not self._suspended:
            target = self._target(args, kwargs)
            if target is not None:
                self._make_current(target)
        return func(*args, **kwargs)
