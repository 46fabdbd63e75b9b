"""``hvd.DistributedOptimizer`` on dearopt's engine.

The returned object is an instance of the wrapped optimizer's own class (as in
Horovod, ``isinstance(opt, torch.optim.SGD)`` holds) that shares
``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer.

Two ways of reducing gradients sit behind it:

* **The engine** (``compression=Compression.none``, the default): a
  :class:`dearopt.DistOptim` with ``schedule="wfbp"``: fused all-reduces start
  during backward, ``synchronize()`` waits for them and leaves the averaged
  gradient in every ``p.grad``, ``step()`` applies the wrapped optimizer.  Horovod
  has no model argument, so the engine is given a small module that holds the
  optimizer's parameters under their Horovod names; its forward hooks never
  fire, which ``wfbp`` does not need.  ``schedule="dear"`` (updates in the next
  forward) needs the real model: pass ``model=``.
* **Per-parameter hooks** (any other ``compression``): Horovod's own scheme,
  one asynchronous all-reduce of the compressed gradient per parameter,
  started during backward in a fixed order (reverse registration order) so
  that every rank issues the same sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from .. import runtime
from ..errors import UsageError
from ..optimizer import DistOptim
from ..plan import DEFAULT_BUFFER_SIZE
from . import mpi_ops
from .compression import Compression, NoneCompressor
from .mpi_ops import Adasum, Average, Sum

__all__ = ["DistributedOptimizer"]

_STEP_AFTER_SYNCHRONIZE_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). This can "
    "cause training slowdown. You may want to consider using optimizer.skip_synchronize() context if you use "
    "optimizer.synchronize() in your code.")
_ZERO_GRAD_WARNING = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). Increase "
    "backward_passes_per_step to accumulate gradients locally.")


class _ParameterContainer(torch.nn.Module):
    """Holds the optimizer's parameters under their Horovod names so that the engine can plan them.

    Never called: it exists for ``parameters()``/``named_parameters()``.
    """

    def __init__(self, named):
        super().__init__()
        for name, p in named:
            self._parameters[name] = p  # names may contain dots: bypass register_parameter's check

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module only holds the parameters of an hvd.DistributedOptimizer; call your model")


def _find_duplicates(names):
    seen, dups = set(), []
    for n in names:
        if n in seen and n not in dups:
            dups.append(n)
        seen.add(n)
    return dups


def _scales(op, predivide):
    """Horovod's split of an average: divide by f before the sum, by size/f after."""
    if op == Average:
        return 1.0 / predivide, predivide
    return 1.0, 1.0


class _HookReducer:
    """Horovod's per-parameter scheme: compress, all-reduce asynchronously, decompress at synchronize()."""

    def __init__(self, params, compression, op, predivide, bpps):
        main = runtime.get_backend()
        try:
            self.backend = main.fork()
            self.owns_backend = True
        except NotImplementedError:
            self.backend, self.owns_backend = main, False
        self.params = params
        self.order = list(reversed(params))  # gradients of the last layers come first in backward
        self.compression, self.op, self.bpps = compression, op, bpps
        self.prescale, self.postscale = _scales(op, predivide)
        self.hooks: Dict[int, object] = {}
        self.delay = {id(p): bpps for p in params}
        self.ready = set()
        self.inflight: "OrderedDict[int, tuple]" = OrderedDict()
        self.next = 0
        self.register_hooks()

    def register_hooks(self):
        for p in self.params:
            if p.requires_grad and id(p) not in self.hooks:
                self.hooks[id(p)] = p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        key = id(p)
        if key in self.inflight or self.delay[key] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self.delay[key] -= 1
        if self.delay[key] == 0:
            self.ready.add(key)
            self._launch_ready()

    def _launch_ready(self):
        while self.next < len(self.order):
            p = self.order[self.next]
            if p.requires_grad and id(p) not in self.ready:
                break
            if p.requires_grad:
                self._launch(p)
            self.next += 1

    def _launch(self, p):
        if p.grad is None:
            # as Horovod: another rank may have a gradient for it, so send zeros
            p.grad = torch.zeros_like(p)
        compressed, ctx = self.compression.compress(p.grad)
        if compressed is p.grad:
            compressed = compressed.clone()
        works, finish = mpi_ops._allreduce_start(compressed, compressed, self.op, self.prescale, self.postscale,
                                                 "DistributedOptimizer", backend=self.backend)
        self.inflight[id(p)] = (p, works, finish, ctx)

    @property
    def pending(self) -> bool:
        return bool(self.inflight) or bool(self.ready)

    def synchronize(self):
        for p in self.order[self.next:]:
            if p.requires_grad and id(p) not in self.inflight:
                self._launch(p)
        self.next = len(self.order)
        for p, works, finish, ctx in self.inflight.values():
            for w in works:
                w.wait()
            reduced = self.compression.decompress(finish(), ctx)
            with torch.no_grad():
                p.grad.copy_(reduced)
        self.inflight.clear()
        self.ready.clear()
        self.next = 0
        self.delay = {id(p): self.bpps for p in self.params}
        self.register_hooks()  # parameters that became trainable since

    def close(self):
        for h in self.hooks.values():
            h.remove()
        self.hooks.clear()
        if self.owns_backend:
            self.backend.close()
            self.owns_backend = False


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a subclass of the wrapped optimizer's class; built by :func:`DistributedOptimizer`."""

    def _hvd_setup(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, model, schedule, buffer_size):
        self._inner = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, attr, OrderedDict())
        params: List[torch.nn.Parameter] = []
        seen = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if named_parameters is not None:
            named_parameters = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
                raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                                 "produced by model.named_parameters().")
            dups = _find_duplicates([name for name, _ in named_parameters])
            if dups:
                raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                                 f"{', '.join(map(str, dups))}")
            names = {}
            for name, p in named_parameters:
                names.setdefault(id(p), name)
            unnamed = [p for p in params if id(p) not in names]
            if unnamed:
                raise ValueError(
                    "named_parameters was specified, but one or more model parameters were not named (parameters "
                    f"of the optimizer missing from named_parameters, shapes "
                    f"{[tuple(p.shape) for p in unnamed]}); pass model.named_parameters() of the model whose "
                    "parameters the optimizer holds")
        else:
            names = {id(v): f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
                     for j, v in enumerate(group["params"])}
        self._parameter_names = {p: names[id(p)] for p in params}
        self._params = params
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense = sparse_as_dense
        self._groups = groups
        self._compression = compression
        self._synchronized = False
        self._should_synchronize = True
        self._reduced = False  # this step's gradients have been reduced (and scaled for op=Sum)
        self._engine: Optional[DistOptim] = None
        self._reducer: Optional[_HookReducer] = None
        uses_engine = compression is Compression.none or compression is NoneCompressor
        if not uses_engine and schedule != "wfbp":
            raise ValueError(f"compression={getattr(compression, '__name__', compression)} is carried out by "
                             f"per-parameter all-reduces and cannot be combined with schedule={schedule!r}; use "
                             "the default schedule='wfbp' or compression=hvd.Compression.none")
        if schedule == "dear" and model is None:
            raise ValueError("schedule='dear' applies each update during the next forward and needs the model: "
                             "pass hvd.DistributedOptimizer(..., model=model)")
        if uses_engine:
            container = model if model is not None else _ParameterContainer(
                [(self._parameter_names[p], p) for p in params])
            self._engine = DistOptim(optimizer, container, schedule=schedule, buffer_size=buffer_size,
                                     backward_passes_per_step=backward_passes_per_step, broadcast_parameters=False,
                                     broadcast_buffers=False, nonfinite="ignore")
        else:
            self._reducer = _HookReducer(params, compression, op, gradient_predivide_factor,
                                         backward_passes_per_step)

    # ------------------------------------------------------------- Horovod
    def synchronize(self) -> None:
        """Wait for the gradient reductions: afterwards every ``p.grad`` holds the reduced gradient."""
        if self._engine is not None:
            if not self._reduced:
                executor = self._engine._executor
                executor.reduce_gradients()
                if self.op == Sum and executor.world > 1:
                    for bucket in executor.buckets:
                        bucket.buffer[:bucket.spec.grad_numel].mul_(executor.world)
                self._reduce_unplanned(executor)
                self._reduced = True
        else:
            self._reducer.synchronize()
            self._reduced = True
        self._synchronized = True

    def _unplanned(self, executor) -> List[torch.nn.Parameter]:
        """Parameters that became trainable after the engine planned its buckets (it does not reduce them)."""
        if executor.plan is None:
            return []
        return [p for p in self._params if p.requires_grad and id(p) not in executor._where]

    def _reduce_unplanned(self, executor) -> None:
        """Reduce the gradients of parameters unfrozen after planning, in a fixed order, on the engine's channel."""
        self._extra = self._unplanned(executor)
        for p in self._extra:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # another rank may have a gradient for it (as Horovod)
            works, finish = mpi_ops._allreduce_start(p.grad, p.grad, self.op, 1.0, 1.0, "DistributedOptimizer",
                                                     backend=executor.backend)
            for w in works:
                w.wait()
            finish()

    def _step_unplanned(self) -> None:
        """Apply the wrapped optimizer to the parameters the engine does not own (see :meth:`_reduce_unplanned`)."""
        extra = {id(p) for p in getattr(self, "_extra", [])}
        if not extra:
            return
        saved = [g["params"] for g in self._inner.param_groups]
        try:
            for g in self._inner.param_groups:
                g["params"] = [p for p in g["params"] if id(p) in extra]
            self._inner.step()
        finally:
            for g, params in zip(self._inner.param_groups, saved):
                g["params"] = params
        self._extra = []

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside does not synchronize: use after an explicit ``synchronize()`` (e.g. to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`) and apply the wrapped optimizer's update."""
        if closure is not None:
            raise UsageError("hvd.DistributedOptimizer.step() does not take a closure here: run forward and "
                             "backward before step()")
        if self._engine is not None and self._engine.options.schedule == "dear":
            pass  # dear averages into shards and updates during the next forward: nothing to wait for here
        elif self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE_WARNING)
            self.synchronize()
        elif not self._reduced:
            # Horovod would step on the local, unreduced gradients here; reducing keeps the ranks equal.
            self.synchronize()
        self._synchronized = False
        self._reduced = False
        if self._engine is not None:
            self._engine.step()
            self._step_unplanned()
        else:
            self._inner.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine is not None:
            try:
                self._engine.zero_grad(set_to_none)
            except UsageError as exc:
                raise AssertionError(_ZERO_GRAD_WARNING) from exc
        else:
            if self._reducer.pending:
                raise AssertionError(_ZERO_GRAD_WARNING)
            self._inner.zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        if self._engine is not None:
            options = dataclasses.replace(self._engine.options, backward_passes_per_step=passes)
            self._engine.options = options
            self._engine._executor.options = options
        else:
            self._reducer.bpps = passes
            self._reducer.delay = {id(p): passes for p in self._params}

    # --------------------------------------------------------- optimizer
    def state_dict(self):
        return self._engine.state_dict() if self._engine is not None else self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        if self._engine is not None:
            self._engine.load_state_dict(state_dict)
        else:
            self._inner.load_state_dict(state_dict)
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
        self._synchronized = False

    def add_param_group(self, param_group) -> None:
        raise UsageError("add_param_group() after hvd.DistributedOptimizer() is not supported: add the group to "
                         "the plain optimizer before wrapping it")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def close(self) -> None:
        """Release the hooks and the communicator of this optimizer."""
        if self._engine is not None:
            self._engine.close()
        if self._reducer is not None:
            self._reducer.close()

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self._inner!r})"

    def __getstate__(self):
        raise TypeError("hvd.DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead")


_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=mpi_ops.global_process_set, *, model=None,
                         schedule: str = "wfbp", buffer_size=DEFAULT_BUFFER_SIZE):
    """Wrap a torch optimizer so that gradients are reduced across ranks (Horovod's signature).

    Args beyond Horovod's (keyword only): ``model`` (needed for
    ``schedule="dear"``, optional otherwise), ``schedule`` (``"wfbp"``
    default, ``"dear"``, ``"rsag"``), ``buffer_size`` (bytes per fused bucket).

    ``groups``/``num_groups`` are validated and otherwise superseded by the
    engine's size-based bucketing; ``sparse_as_dense`` is accepted (gradients
    are always reduced as dense tensors).
    """
    mpi_ops._check_process_set(process_set)
    mpi_ops._check_init()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            grouped = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in grouped:
                        raise ValueError("A parameter can only appear once in groups.")
                    grouped.add(id(p))
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dearopt.horovod (no Adasum reduction is built); use op=hvd.Average "
            "(the default) and scale the learning rate by hvd.size() as Horovod recommends for Average")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, got {op!r}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise UsageError("this optimizer is already an hvd.DistributedOptimizer; wrap the plain optimizer once")
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
        _CLASSES[base] = cls
    obj = cls.__new__(cls)
    obj._hvd_setup(optimizer, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, model, schedule, buffer_size)
    return obj
