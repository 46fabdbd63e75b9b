"""``hvd.DistributedOptimizer`` on dearopt's engine.

The returned object is an instance of the wrapped optimizer's own class (as in
Horovod, ``isinstance(opt, torch.optim.SGD)`` holds), built through
``torch.optim.Optimizer.__init__``, that shares ``param_groups``, ``state``
and ``defaults`` with the wrapped optimizer.

Behind it is a :class:`dearopt.DistOptim` (``schedule="wfbp"`` by default):
fused all-reduces start during backward, ``synchronize()`` waits for them and
leaves the averaged gradient in every ``p.grad``, ``step()`` applies the
wrapped optimizer.  Horovod has no model argument, so the engine is given a
small module that holds the optimizer's parameters under their Horovod names;
its forward hooks never fire, which ``wfbp`` does not need.  ``schedule="dear"``
(updates in the next forward) needs the real model: pass ``model=``.
A ``compression`` other than ``Compression.none`` becomes the engine's
communication hook (:class:`CompressorHook`), so it works with every schedule.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List

import torch

import dearopt.backends.runtime as runtime
from dearopt.compression.hooks import CommHook
from dearopt.errors import UsageError
from dearopt.optimizer import DistOptim
from dearopt.planning.plan import DEFAULT_BUFFER_SIZE
from dearopt.schedules import get_schedule
import dearopt.integrations.horovod.mpi_ops as mpi_ops
from dearopt.integrations.horovod.compression import Compression, NoneCompressor
from dearopt.integrations.horovod.mpi_ops import Adasum, Average, Sum

__all__ = ["DistributedOptimizer"]

_STEP_AFTER_SYNCHRONIZE_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). This can "
    "cause training slowdown. You may want to consider using optimizer.skip_synchronize() context if you use "
    "optimizer.synchronize() in your code."
)
_ZERO_GRAD_WARNING = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). Increase "
    "backward_passes_per_step to accumulate gradients locally."
)


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


class CompressorHook(CommHook):
    """A Horovod compressor (``compress``/``decompress``) as the engine's communication hook.

    ``gradient_predivide_factor`` f is applied as Horovod does: gradients are
    divided by f before they are compressed and summed, and multiplied by f
    after (the engine then divides by the world size), which keeps float16
    sums in range.
    """

    def __init__(self, compressor, predivide: float = 1.0):
        self.compressor = compressor
        self.predivide = float(predivide)
        self.name = f"horovod-{getattr(compressor, '__name__', type(compressor).__name__)}-{self.predivide:g}"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.compressor.compress(torch.zeros(1, dtype=dtype))[0].dtype

    def encode(self, grads, out):
        source = grads / self.predivide if self.predivide != 1.0 else grads
        compressed, ctx = self.compressor.compress(source)
        if compressed.numel() != grads.numel():
            raise ValueError(
                f"compression {self.name} changed the number of elements ({grads.numel()} -> "
                f"{compressed.numel()}); the engine reduces compressed gradients element by element"
            )
        out.copy_(compressed.reshape(-1))
        return ctx

    def decode(self, wire, out, ctx):
        out.copy_(self.compressor.decompress(wire, ctx))
        if self.predivide != 1.0:
            out.mul_(self.predivide)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a subclass of the wrapped optimizer's class; built by :func:`DistributedOptimizer`."""

    def _hvd_setup(
        self,
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        model,
        schedule,
        buffer_size,
        ranks=None,
    ):
        """``ranks``: how :func:`_ranks_of` places this rank (a process set's group, or none)."""
        self._inner = optimizer
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
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
                raise ValueError(
                    "named_parameters should be a sequence of tuples (name, parameter), usually "
                    "produced by model.named_parameters()."
                )
            dups = _find_duplicates([name for name, _ in named_parameters])
            if dups:
                raise ValueError(
                    f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(map(str, dups))}"
                )
            names = {}
            for name, p in named_parameters:
                names.setdefault(id(p), name)
            unnamed = [p for p in params if id(p) not in names]
            if unnamed:
                raise ValueError(
                    "named_parameters was specified, but one or more model parameters were not named (parameters "
                    f"of the optimizer missing from named_parameters, shapes "
                    f"{[tuple(p.shape) for p in unnamed]}); pass model.named_parameters() of the model whose "
                    "parameters the optimizer holds"
                )
        else:
            names = {
                id(v): f"allreduce.noname.{i}.{j}"
                for i, group in enumerate(optimizer.param_groups)
                for j, v in enumerate(group["params"])
            }
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
        plain = compression is Compression.none or compression is NoneCompressor
        hook = (
            None
            if plain and gradient_predivide_factor == 1.0
            else CompressorHook(NoneCompressor if plain else compression, gradient_predivide_factor)
        )
        # every named parameter (also those outside the optimizer yet: a group added later is one of them)
        known = dict(self._parameter_names)
        for name, p in named_parameters or ():
            known.setdefault(p, name)
        container = model if model is not None else _ParameterContainer([(name, p) for p, name in known.items()])
        self._dist = DistOptim(
            optimizer,
            container,
            schedule=schedule,
            buffer_size=buffer_size,
            backward_passes_per_step=backward_passes_per_step,
            broadcast_parameters=False,
            broadcast_buffers=False,
            nonfinite="ignore",
            comm_hook=hook,
            **(ranks or {}),
        )
        self._sum = op == Sum
        group = (ranks or {}).get("process_group")  # the ranks averaged over: a process set's, or the job's
        self._world = torch.distributed.get_world_size(group) if group is not None else 1 if ranks else runtime.size()

    # ------------------------------------------------------------- Horovod
    def synchronize(self) -> None:
        """Wait for the gradient reductions: afterwards every ``p.grad`` holds the reduced gradient."""
        if not self._reduced:
            self._dist.reduce_gradients()
            if self._sum and self._world > 1:
                with torch.no_grad():
                    for p in self._params:
                        if p.grad is not None:
                            p.grad.mul_(self._world)
            self._reduced = True
        self._synchronized = True

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
            raise UsageError(
                "hvd.DistributedOptimizer.step() does not take a closure here: run forward and backward before step()"
            )
        if not self._dist.gradients_in_place_before_step:
            pass  # the schedule keeps averaged shards and updates during the next forward: nothing to wait for
        elif self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE_WARNING)
            self.synchronize()
        elif not self._reduced:
            # Horovod would step on the local, unreduced gradients here; reducing keeps the ranks equal.
            self.synchronize()
        self._synchronized = False
        self._reduced = False
        self._dist.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        try:
            self._dist.zero_grad(set_to_none)
        except UsageError as exc:
            raise AssertionError(_ZERO_GRAD_WARNING) from exc

    def set_backward_passes_per_step(self, passes: int) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._dist.set_backward_passes_per_step(passes)

    # --------------------------------------------------------- optimizer
    def state_dict(self):
        return self._dist.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._dist.load_state_dict(state_dict)
        self.reshare()

    @property
    def distoptim(self) -> DistOptim:
        """The :class:`dearopt.DistOptim` this optimizer runs on (``dearopt.checkpoint`` saves and loads it)."""
        return self._dist

    def reshare(self) -> None:
        """Share the wrapped optimizer's ``param_groups`` and ``state`` again after a load replaced them (what
        ``load_state_dict`` does; ``dearopt.checkpoint`` calls it after loading into the wrapped optimizer); the
        next ``step()`` synchronizes afresh."""
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
        self._synchronized = False

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_dist", None) is None:  # Optimizer.__init__ registering the wrapped optimizer's groups
            return torch.optim.Optimizer.add_param_group(self, param_group)
        self._dist.add_param_group(param_group)  # re-planned at the next backward, on every rank

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def close(self) -> None:
        """Release the hooks and the communicator of this optimizer."""
        self._dist.close()

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self._inner!r})"

    def __getstate__(self):
        raise TypeError("hvd.DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead")


_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=mpi_ops.global_process_set,
    *,
    model=None,
    schedule: str = "wfbp",
    buffer_size=DEFAULT_BUFFER_SIZE,
):
    """Wrap a torch optimizer so that gradients are reduced across ranks (Horovod's signature).

    Args beyond Horovod's (keyword only): ``model`` (needed for
    ``schedule="dear"``, optional otherwise), ``schedule`` (``"wfbp"``
    default, ``"dear"``, ``"rsag"``), ``buffer_size`` (bytes per fused bucket).

    ``groups``/``num_groups`` are validated and otherwise superseded by the
    engine's size-based bucketing; ``sparse_as_dense`` is accepted (gradients
    are always reduced as dense tensors).
    """
    mpi_ops._check_init()
    ranks = _ranks_of(process_set)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.", DeprecationWarning
        )
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
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step <= 0
    ):
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dearopt.integrations.horovod (no Adasum reduction is built); use "
            "op=hvd.Average (the default) and scale the learning rate by hvd.size() as Horovod recommends for Average"
        )
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, got {op!r}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise UsageError("this optimizer is already an hvd.DistributedOptimizer; wrap the plain optimizer once")
    if model is None and get_schedule(schedule).updates_in_forward:
        raise ValueError(
            f"schedule={schedule!r} applies updates during the next forward and needs the model: "
            "pass hvd.DistributedOptimizer(..., model=model)"
        )
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
        _CLASSES[base] = cls
    obj = cls.__new__(cls)
    obj._hvd_setup(
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        model,
        schedule,
        buffer_size,
        ranks,
    )
    return obj


def _ranks_of(process_set) -> dict:
    """``DistOptim``'s argument for ``process_set``: on its members ``process_group=`` the set's torch group (the
    mechanism of ``DistOptim(process_group=...)``), elsewhere a one-rank communicator; nothing for the global set.

    As in Horovod, a rank outside the set reduces nothing: its optimizer
    applies its own gradients.
    """
    if process_set is None or process_set.ranks is None:
        return {}
    if not isinstance(process_set, mpi_ops.ProcessSet) or process_set.process_set_id not in mpi_ops._process_sets:
        raise ValueError(f"process_set {process_set!r} was not added with hvd.add_process_set")
    if process_set.included():
        return {"process_group": mpi_ops._set_backend(process_set).group}
    from dearopt.backends.base import TorchDistBackend

    main = runtime.get_backend()
    return {"backend": TorchDistBackend(0, 1, main.timeout, owns_group=False)}
