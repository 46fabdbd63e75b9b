"""Parameters and gradients are current whenever the user's code looks at them.

Two guards, each on only while it has something to guard, and costing nothing for code that does not touch what
they guard:

* :class:`GradientGuard`, from the end of a communicating backward to ``step()``, under schedules whose ``p.grad``
  does not yet hold the averaged gradient when ``backward()`` returns (``dear``, ``bytescheduler``, ``prophet``:
  the average is still travelling, or kept as this rank's shard).  The first torch call that reads a watched
  ``p.grad`` (``torch.nn.utils.clip_grad_norm_``, ``GradScaler.unscale_``, a logging line) first finishes every
  bucket's reduction and gathers it into ``p.grad``, so that call, and every later one until ``step()``, sees
  and changes the averaged gradient exactly as with DDP.  The price is that step's overlap of the gathers with
  the next forward.
* :class:`PendingUpdateGuard`, from ``step()`` until each bucket's update lands (its module is reached in the next
  forward), under schedules that apply updates in the next forward (``dear``, ``bytescheduler``): any torch call
  that touches a parameter whose update is pending (reading ``p.data``, ``p.clamp_()``, ``p.detach()``,
  ``p.grad``, ``torch.nn.utils.parameters_to_vector(...)``, a module that runs before its bucket's moment...)
  first applies the pending updates up to that parameter's bucket, in bucket order, and then runs.  So an EMA
  read, a WGAN clamp (``p.data.clamp_(-c, c)``) or a copy into the weights after ``step()`` sees and changes the
  parameters exactly as in single-process training, and so does a forward whose modules run in another order than
  the recorded one.  The price is paid only when such code runs: the FeedPipe overlap of those buckets is lost
  for that iteration.

**How.**  A guarded tensor's class is swapped for a subclass of its own (``nn.Parameter`` or ``Tensor``) whose
``__torch_function__`` calls the engine back and restores the class; torch calls it only for calls that involve
a guarded tensor, so everything else runs at full speed.  The class is restored as soon as the tensor is current
(its bucket's update landed, or ``step()``).  Tensors whose class cannot be swapped (a wrapper subclass such as
``DTensor``) are watched by a torch function mode on the stack instead, which costs one Python call per torch
call while it is pushed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PendingUpdateGuard", "GradientGuard"]

_GRAD_DESCRIPTOR = torch._C.TensorBase.__dict__["grad"]


def _current_mode():
    """The torch function mode on top of the stack (None if the stack is empty)."""
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


def _reads_grad(func) -> bool:
    """Whether ``func`` is the getter of ``Tensor.grad`` (what ``p.grad`` calls under torch's function dispatch)."""
    return getattr(func, "__self__", None) is _GRAD_DESCRIPTOR


_SWAPPABLE = (torch.Tensor, torch.nn.Parameter)
"""The classes the guard may swap (a wrapper subclass such as ``DTensor`` is watched by the mode instead)."""


def _metadata_calls() -> frozenset:
    """What a torch call may read without the values: the metadata an update never changes (``p.dtype``,
    ``p.shape``, ``p.size()``, ``hash(p)``...).  A model that asks for its parameters' dtype before its first module
    runs (Hugging Face's ``self.dtype``) does not make the pending updates land there."""
    base = torch._C.TensorBase.__dict__
    getters = [
        base[name].__get__
        for name in (
            "dtype",
            "shape",
            "device",
            "requires_grad",
            "is_leaf",
            "layout",
            "ndim",
            "is_cuda",
            "is_sparse",
            "is_quantized",
            "is_meta",
            "is_mkldnn",
            "is_nested",
            "names",
            "grad_fn",
            "_version",
            "itemsize",
            "nbytes",
        )
        if name in base and hasattr(base[name], "__get__")
    ]
    methods = [
        getattr(torch.Tensor, name)
        for name in (
            "size",
            "dim",
            "numel",
            "stride",
            "element_size",
            "is_floating_point",
            "is_complex",
            "data_ptr",
            "__hash__",
            "__len__",
            "storage_offset",
            "is_contiguous",
            "get_device",
            "nelement",
            "untyped_storage",
        )
        if hasattr(torch.Tensor, name)
    ]
    return frozenset(getters + methods)


_METADATA = _metadata_calls()


def _guarded_classes(guard) -> Dict[type, type]:
    """The guard's own subclasses of ``Tensor`` and ``nn.Parameter`` (their ``__torch_function__`` reaches it
    through a weak reference)."""
    ref = weakref.ref(guard)

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = ref()
        if g is not None:
            g._seen(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __reduce_ex__(self, proto):  # pickled (torch.save) as what it is
        g = ref()
        if g is not None:
            g._seen(None, (self,), {})
        with _own_class(self):
            return self.__reduce_ex__(proto)

    def __deepcopy__(self, memo):  # copied (an EMA model) as what it is
        g = ref()
        if g is not None:
            g._seen(None, (self,), {})
        with _own_class(self):
            return self.__deepcopy__(memo)

    out = {}
    for base in (torch.Tensor, torch.nn.Parameter):
        out[base] = type(
            f"Guarded{base.__name__}",
            (base,),
            {
                "__torch_function__": classmethod(__torch_function__),
                "__reduce_ex__": __reduce_ex__,
                "__deepcopy__": __deepcopy__,
                "__module__": __name__,
                "_own": base,
            },
        )
    return out


@contextlib.contextmanager
def _own_class(t: torch.Tensor):
    """``t`` with its own class for a moment (if it is still guarded)."""
    guarded = type(t)
    own = getattr(guarded, "_own", None)
    if own is None:
        yield
        return
    t.__class__ = own
    try:
        yield
    finally:
        t.__class__ = guarded


class _Mode(TorchFunctionMode):
    """The fallback for tensors whose class cannot be swapped: a function mode that sees every torch call."""

    def __init__(self, guard):
        super().__init__()
        self._guard = weakref.ref(guard)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self._guard()
        if g is not None:
            g._seen(func, args, kwargs)
        return func(*args, **kwargs)


class _TouchGuard:
    """Calls back ``callback(bucket)`` when a torch call touches one of the tensors it watches."""

    def __init__(self, callback: Callable[[int], None]):
        self._callback = callback
        self._watch: Dict[int, int] = {}  # id(tensor) -> its bucket, while guarded
        self._swapped: Dict[int, Tuple[torch.Tensor, type]] = {}  # id -> (tensor, its own class)
        self._classes = _guarded_classes(self)
        self._mode = _Mode(self)
        self._mode_ids: Dict[int, int] = {}  # watched through the mode
        self._on_stack = False
        self._suspended = 0

    @property
    def armed(self) -> bool:
        return bool(self._watch)

    # ----------------------------------------------------------------- watch
    def arm(self, watch: Iterable[Tuple[torch.Tensor, int]]) -> None:
        """Guard these tensors (``(tensor, bucket)`` pairs) until :meth:`release` or :meth:`disarm`."""
        self.disarm()
        for t, bucket in watch:
            self._watch[id(t)] = bucket
            if type(t) in _SWAPPABLE:
                self._swapped[id(t)] = (t, type(t))
                t.__class__ = self._classes[type(t)]
            else:
                self._mode_ids[id(t)] = bucket
        if self._mode_ids:
            self.push()

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        """Stop guarding these (they are current now)."""
        for t in tensors:
            if self._watch.pop(id(t), None) is not None:
                swapped = self._swapped.pop(id(t), None)
                if swapped is not None:
                    t.__class__ = swapped[1]
                self._mode_ids.pop(id(t), None)
        if not self._mode_ids:
            self._pop()

    def disarm(self) -> None:
        """Stop guarding everything."""
        for t, cls in self._swapped.values():
            t.__class__ = cls
        self._swapped, self._watch, self._mode_ids = {}, {}, {}
        self._pop()

    # -------------------------------------------------- the fallback's mode
    def push(self) -> None:
        """Have the mode on the stack (only where a watched tensor's class could not be swapped).  From the thread
        that runs the user's code: torch restores the stack after a callback at the end of backward."""
        if not self._on_stack:
            self._mode.__enter__()
            self._on_stack = True

    def _pop(self) -> None:
        # Inside the mode's own __torch_function__ torch has taken it off the stack for the call and puts it back
        # afterwards; then (or if the user pushed a mode above ours) it stays, passing everything through, until
        # the next disarm() from outside.
        if self._on_stack and _current_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._on_stack = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The engine's own work runs unguarded."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # ------------------------------------------------------------- callback
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

    def _seen(self, func, args, kwargs) -> None:
        if self._watch and not self._suspended and func not in _METADATA:
            target = self._target(func, args, kwargs)
            if target is not None:
                self._callback(target)


class PendingUpdateGuard(_TouchGuard):
    """After ``step()``: a touch of a parameter whose update is pending applies the updates up to its bucket."""


class GradientGuard(_TouchGuard):
    """Between backward and ``step()``: reading a watched parameter's ``.grad``, or touching a gradient view kept
    from before, finishes the reductions first.  A parameter counts only through its ``.grad`` getter: reading
    its values (a weight norm for a log) needs no communication."""

    def __init__(self, callback: Callable[[int], None]):
        super().__init__(callback)
        self._params: Dict[int, int] = {}  # id(parameter) -> its bucket

    def arm(self, views: Iterable[Tuple[torch.Tensor, int]], params: Iterable[Tuple[torch.Tensor, int]] = ()) -> None:
        """Guard the gradient ``views`` and the ``.grad`` of ``params`` (``(tensor, bucket)`` pairs each)."""
        params = list(params)
        super().arm(list(views) + params)
        self._params = {id(p): bucket for p, bucket in params}

    def disarm(self) -> None:
        self._params = {}
        super().disarm()

    def _target(self, func, args, kwargs) -> Optional[int]:
        if _reads_grad(func):
            return self._params.get(id(args[0])) if args else None
        found = super()._target(func, args, kwargs)
        if found is not None and all(id(a) in self._params for a in _tensors(args, kwargs) if id(a) in self._watch):
            return None  # a parameter's values, not its gradient
        return found


def _tensors(args, kwargs) -> List[torch.Tensor]:
    out = []
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        out.extend(item for item in items if isinstance(item, torch.Tensor))
    return out
