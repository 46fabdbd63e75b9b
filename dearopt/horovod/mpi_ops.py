"""``horovod.torch.mpi_ops`` on dearopt: the job, tensor collectives and handles.

Every collective runs on dearopt's backend (:func:`dearopt.get_backend`).  The
asynchronous forms return an integer handle; :func:`poll` asks the transport
whether the op is done (it returns ``False`` while data is still in flight) and
:func:`synchronize` waits for it and returns the result.

One difference matters for correct use: Horovod matches collectives across
ranks by *name* (and negotiates their order); dearopt matches them by the
*order in which they are started*.  ``name=`` is accepted everywhere and
ignored; every rank must start the same collectives in the same order, which
is what ordinary training scripts do.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch

from .. import runtime
from ..errors import NotInitializedError
from .compression import Compression

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
    "stop_timeline", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "handle_average_backwards_compatibility", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize",
    "join", "barrier",
]


class HorovodNotInitializedError(NotInitializedError, ValueError):
    """Raised before :func:`init`; a ``ValueError`` as in Horovod, and a :class:`dearopt.NotInitializedError`."""


# ------------------------------------------------------------------ the job
def init(comm=None, process_sets=None, *, backend: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Join the job (horovodrun, mpirun, torchrun, Slurm or a single process).

    Callable again: later calls do nothing; after :func:`shutdown` it joins
    anew.  ``backend``/``timeout`` are dearopt's (see :func:`dearopt.init`).
    ``comm`` (a sub-communicator) and ``process_sets`` are not supported.
    """
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) is not supported: dearopt always runs on every launched process. Launch only "
            "the processes that should take part (e.g. mpirun -np N) and call hvd.init()")
    if process_sets is not None:
        raise NotImplementedError(
            "process sets are not supported by dearopt.horovod: every collective spans all ranks. Use "
            "torch.distributed.new_group() after hvd.init() for collectives on a subset of ranks")
    runtime.init(backend=backend, timeout=timeout)


def shutdown() -> None:
    """Leave the job; pending handles are dropped and :func:`init` may be called again."""
    _handle_map.clear()
    runtime.shutdown()


def is_initialized() -> bool:
    return runtime.is_initialized()


def _check_init():
    if not runtime.is_initialized():
        raise HorovodNotInitializedError("Horovod has not been initialized; use hvd.init().")


def rank() -> int:
    """This process's rank in ``0..size()-1``."""
    _check_init()
    return runtime.rank()


def size() -> int:
    """The number of processes in the job."""
    _check_init()
    return runtime.size()


def local_rank() -> int:
    """This process's rank among the processes on its machine."""
    _check_init()
    return runtime.local_rank()


def local_size() -> int:
    """The number of processes on this machine."""
    _check_init()
    return runtime.local_size()


def cross_size() -> int:
    """The number of machines: ``size() // local_size()``.

    Derived, not measured: it assumes every machine runs ``local_size()``
    processes (a homogeneous job, see :func:`is_homogeneous`).
    """
    _check_init()
    return max(1, runtime.size() // max(1, runtime.local_size()))


def cross_rank() -> int:
    """This machine's index: ``rank() // local_size()``.

    Derived, not measured: it assumes ranks are placed contiguously, machine
    by machine (what horovodrun, ``mpirun --map-by slot`` and torchrun do).
    """
    _check_init()
    return runtime.rank() // max(1, runtime.local_size())


def is_homogeneous() -> bool:
    """True when ``size()`` is a multiple of ``local_size()`` (derived from this rank's view only)."""
    _check_init()
    return runtime.size() % max(1, runtime.local_size()) == 0


def mpi_threads_supported() -> bool:
    """False: dearopt's collectives do not run over MPI (Horovod raises ValueError when MPI is not enabled)."""
    _check_init()
    return False


def mpi_enabled() -> bool:
    """False: collectives run over torch.distributed (gloo/NCCL); mpi4py is used only to agree on an address."""
    return False


def mpi_built() -> bool:
    """False: dearopt has no MPI collective backend."""
    return False


def gloo_enabled() -> bool:
    """True when the collectives of this job run on gloo."""
    if not runtime.is_initialized():
        return gloo_built()
    return "gloo" in getattr(runtime.get_backend(), "name", "")


def gloo_built() -> bool:
    """True when torch.distributed has gloo."""
    import torch.distributed as dist
    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> int:
    """The NCCL version code (e.g. 21805 for 2.18.5) torch was built with, 0 without NCCL (as Horovod)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available()):
        return 0
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return 0
    if isinstance(version, tuple):
        major, minor, patch = (list(version) + [0, 0, 0])[:3]
        return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch
    return int(version)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when torch was built with CUDA (dearopt then runs on GPUs over NCCL)."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path, mark_cycles=False):
    raise NotImplementedError(
        "hvd.start_timeline() is not supported: dearopt records a Chrome trace of its optimizer instead; pass "
        "timeline='trace.json' to dearopt.DistOptim or set DEAROPT_TIMELINE=trace.json before starting")


def stop_timeline():
    raise NotImplementedError(
        "hvd.stop_timeline() is not supported: dearopt's trace (DEAROPT_TIMELINE) runs for the whole job")


# ---------------------------------------------------------------------- ops
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_BACKEND_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "product"}


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule: ``average=`` is deprecated, ``op`` supersedes it, the default is Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _check_op(op, allowed=tuple(_BACKEND_OPS)):
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dearopt.horovod (no Adasum reduction is built); use op=hvd.Average "
            "(the default), possibly with a larger learning rate as Horovod recommends for Average")
    if op not in allowed:
        names = ", ".join(f"hvd.{_OP_NAMES[o]}" for o in allowed)
        raise ValueError(f"unknown or unsupported reduction op {op!r}; expected one of {names}")


# --------------------------------------------------------- process sets
class ProcessSet:
    """Only the global process set exists in dearopt.horovod."""

    def __init__(self, ranks=None):
        if ranks is not None:
            raise NotImplementedError(
                "process sets are not supported by dearopt.horovod: every collective spans all ranks. Use "
                "torch.distributed.new_group(ranks) after hvd.init() for collectives on a subset of ranks")
        self.ranks = None
        self.process_set_id = 0

    def included(self) -> bool:
        return True

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def __repr__(self):
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def add_process_set(process_set):
    raise NotImplementedError(
        "process sets are not supported by dearopt.horovod: every collective spans all ranks. Use "
        "torch.distributed.new_group(ranks) after hvd.init() for collectives on a subset of ranks")


def remove_process_set(process_set):
    raise NotImplementedError("process sets are not supported by dearopt.horovod; only the global set exists")


def _check_process_set(process_set):
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            "process_set= other than hvd.global_process_set is not supported by dearopt.horovod; use "
            "torch.distributed.new_group(ranks) for collectives on a subset of ranks")


# ------------------------------------------------------------------ handles
class _Pending:
    """An op in flight: the transport handles, what makes the result, and what must stay alive."""

    __slots__ = ("works", "finish", "keep")

    def __init__(self, works, finish: Callable[[], object], keep=()):
        self.works = list(works)
        self.finish = finish
        self.keep = keep


_handle_map: Dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def _register(works, finish, keep=()) -> int:
    handle = next(_handle_ids)
    _handle_map[handle] = _Pending(works, finish, keep)
    return handle


def poll(handle: int) -> bool:
    """True once ``synchronize(handle)`` would not wait for the transport; False while the op is in flight."""
    pending = _handle_map.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle!r} was not created or has already been synchronized")
    return all(w.is_completed() for w in pending.works)


def synchronize(handle: int):
    """Wait for the op and return its result (the output tensor, or a list for grouped ops).

    As in Horovod, a handle is consumed by its first ``synchronize``: a second
    call returns ``None`` (and :func:`poll` on it raises ``ValueError``).
    """
    pending = _handle_map.pop(handle, None)
    if pending is None:
        return None
    for w in pending.works:
        w.wait()
    return pending.finish()


# ----------------------------------------------------------------- helpers
def _backend():
    _check_init()
    return runtime.get_backend()


def _scale_(t: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.double() * factor).to(t.dtype))


def _divide_(t: torch.Tensor, n: int) -> None:
    if n == 1:
        return
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def _work_tensor(tensor: torch.Tensor, backend, in_place: bool) -> torch.Tensor:
    """A contiguous tensor on the backend's device holding ``tensor``'s values (``tensor`` itself if possible)."""
    if in_place and tensor.is_contiguous() and tensor.device == backend.device:
        return tensor
    return tensor.detach().to(backend.device, copy=True).contiguous()


def _check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise NotImplementedError(f"{what} of a sparse tensor is not supported; use tensor.to_dense()")


# ---------------------------------------------------------------- allreduce
def _allreduce_start(tensor, output, op, prescale_factor, postscale_factor, what="allreduce", backend=None):
    """Start reducing ``tensor`` into ``output`` (which may be ``tensor``); return (works, finish)."""
    _check_tensor(tensor, what)
    _check_op(op)
    backend = backend or _backend()
    in_place = output is tensor
    work = _work_tensor(tensor.detach(), backend, in_place)
    _scale_(work, float(prescale_factor))
    n = backend.size
    handle = backend.all_reduce(work, _BACKEND_OPS[op])

    def finish():
        if op == Average:
            if float(postscale_factor) == 1.0:
                _divide_(work, n)
            else:
                _scale_(work, float(postscale_factor) / n)
        else:
            _scale_(work, float(postscale_factor))
        if work is not output:
            with torch.no_grad():
                output.copy_(work)
        return output

    return [handle], finish


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing ``tensor`` over all ranks into a new tensor; returns a handle. ``tensor`` is not modified.

    ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``.
    The result is ``postscale * reduce(prescale * x)``, divided by ``size()``
    for ``Average``.
    """
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    output = torch.empty_like(tensor)
    works, finish = _allreduce_start(tensor, output, op, prescale_factor, postscale_factor)
    return _register(works, finish, (tensor, output))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """As :func:`allreduce_async`, in place: ``synchronize`` returns ``tensor`` holding the result."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    works, finish = _allreduce_start(tensor, tensor, op, prescale_factor, postscale_factor)
    return _register(works, finish, (tensor,))


class _AllreduceFunction(torch.autograd.Function):
    """Allreduce whose backward is the allreduce of the gradient with the same op and factors (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor):
        ctx.args = (op, prescale_factor, postscale_factor)
        return synchronize(allreduce_async(tensor, op=op, prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post = ctx.args
        return synchronize(allreduce_async(grad_output.contiguous(), op=op, prescale_factor=pre,
                                           postscale_factor=post)), None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks and return the result as a new tensor (differentiable).

    ``compression`` (e.g. ``Compression.fp16``) is applied to what travels.
    """
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    _check_op(op)
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` over all ranks in place and return it (not differentiable)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    raise NotImplementedError(
        "sparse allreduce is not supported by dearopt.horovod; reduce tensor.to_dense() with hvd.allreduce, "
        "or pass sparse_as_dense=True to hvd.DistributedOptimizer")


# --------------------------------------------------------- grouped allreduce
def _grouped_allreduce_start(tensors, outputs, op, prescale_factor, postscale_factor):
    """One fused allreduce per dtype: the tensors are flattened into one buffer."""
    tensors = list(tensors)
    for t in tensors:
        _check_tensor(t, "grouped_allreduce")
    _check_op(op)
    backend = _backend()
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    works, parts = [], []
    for dtype, members in by_dtype.items():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(backend.device) for i in members]) if members else None
        w, fin = _allreduce_start(flat, flat, op, prescale_factor, postscale_factor, "grouped_allreduce")
        works += w
        parts.append((members, flat, fin))

    def finish():
        for members, flat, fin in parts:
            fin()
            offset = 0
            with torch.no_grad():
                for i in members:
                    n = tensors[i].numel()
                    outputs[i].copy_(flat[offset:offset + n].view_as(outputs[i]))
                    offset += n
        return list(outputs)

    return works, finish


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Start one fused reduction of a list of tensors; ``synchronize`` returns a list of new tensors."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    outputs = [torch.empty_like(t) for t in tensors]
    works, finish = _grouped_allreduce_start(tensors, outputs, op, prescale_factor, postscale_factor)
    return _register(works, finish, (tensors, outputs))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`: ``synchronize`` returns the input list, reduced."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    works, finish = _grouped_allreduce_start(tensors, tensors, op, prescale_factor, postscale_factor)
    return _register(works, finish, (tensors,))


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), op=op, prescale_factor=prescale_factor,
                                                         postscale_factor=postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post = ctx.args
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=op,
                                                      prescale_factor=pre, postscale_factor=post))
        return (None, None, None) + tuple(reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors in one fused op; returns a list of new tensors (differentiable)."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    _check_op(op)
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduceFunction.apply(op, prescale_factor, postscale_factor, *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce a list of tensors in place in one fused op; returns the list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---------------------------------------------------------------- allgather
_MAX_DIMS = 16


def _gather_shapes(tensor, backend) -> List[List[int]]:
    """Every rank's shape (blocking, one small all-gather); checks dtypes and trailing dims agree."""
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; use tensor.reshape(1)")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"allgather supports tensors of at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
    code = dtypes.index(tensor.dtype) if tensor.dtype in dtypes else 99
    meta = torch.full((_MAX_DIMS + 2,), -1, dtype=torch.int64)
    meta[0], meta[1] = tensor.dim(), code
    meta[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    meta = meta.to(backend.device)
    everyone = torch.empty(backend.size * meta.numel(), dtype=torch.int64, device=backend.device)
    backend.all_gather(everyone, meta).wait()
    rows = everyone.view(backend.size, -1).cpu().tolist()
    shapes = [row[2:2 + row[0]] for row in rows]
    if any(row[1] != rows[0][1] for row in rows):
        raise ValueError(f"Mismatched data types: allgather got dtype codes {[row[1] for row in rows]} on ranks "
                         f"0..{backend.size - 1}; every rank must gather the same dtype")
    if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(f"Mismatched allgather tensor shapes {shapes}: all dimensions but the first must agree")
    return shapes


def _allgather_start(tensor):
    _check_tensor(tensor, "allgather")
    backend = _backend()
    shapes = _gather_shapes(tensor, backend)
    firsts = [s[0] for s in shapes]
    row = math.prod(shapes[0][1:]) if len(shapes[0]) > 1 else 1
    chunk = max(1, max(firsts) * row)
    shard = torch.zeros(chunk, dtype=tensor.dtype, device=backend.device)
    shard[:tensor.numel()] = tensor.detach().reshape(-1).to(backend.device)
    full = torch.empty(chunk * backend.size, dtype=tensor.dtype, device=backend.device)
    handle = backend.all_gather(full, shard)

    def finish():
        parts = [full[r * chunk:r * chunk + firsts[r] * row] for r in range(backend.size)]
        out = torch.cat(parts).view(sum(firsts), *shapes[0][1:]).to(tensor.device)
        return out

    return [handle], finish, firsts


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (first dims may differ); returns a handle.

    The first dimensions are exchanged first (a small blocking all-gather),
    then the data travels asynchronously.
    """
    _check_process_set(process_set)
    works, finish, _ = _allgather_start(tensor)
    return _register(works, finish, (tensor,))


class _AllgatherFunction(torch.autograd.Function):
    """Allgather whose backward sums the gradient over ranks and returns this rank's slice (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor):
        works, finish, firsts = _allgather_start(tensor)
        for w in works:
            w.wait()
        ctx.firsts = firsts
        ctx.rank = _backend().rank
        return finish()

    @staticmethod
    def backward(ctx, grad_output):
        summed = synchronize(allreduce_async(grad_output.contiguous(), op=Sum))
        offset = sum(ctx.firsts[:ctx.rank])
        return summed.narrow(0, offset, ctx.firsts[ctx.rank])


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order (differentiable).

    All dimensions but the first must agree across ranks.
    """
    _check_process_set(process_set)
    return _AllgatherFunction.apply(tensor)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start :func:`allgather` of each tensor; ``synchronize`` returns the list of results."""
    _check_process_set(process_set)
    started = [_allgather_start(t) for t in tensors]
    works = [w for ws, _, _ in started for w in ws]
    return _register(works, lambda: [fin() for _, fin, _ in started], (list(tensors),))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """:func:`allgather` of each tensor of a list (differentiable)."""
    return [allgather(t, process_set=process_set) for t in tensors]


# ---------------------------------------------------------------- broadcast
def _broadcast_start(tensor, output, root_rank):
    _check_tensor(tensor, "broadcast")
    backend = _backend()
    if not isinstance(root_rank, int) or not 0 <= root_rank < backend.size:
        raise ValueError(f"broadcast: root_rank {root_rank!r} is not a rank of a job of size {backend.size}")
    work = _work_tensor(tensor.detach(), backend, output is tensor)
    handle = backend.broadcast(work, root_rank)

    def finish():
        if work is not output:
            with torch.no_grad():
                output.copy_(work)
        return output

    return [handle], finish


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying ``root_rank``'s ``tensor`` into a new tensor on every rank; returns a handle."""
    _check_process_set(process_set)
    output = torch.empty_like(tensor)
    works, finish = _broadcast_start(tensor, output, root_rank)
    return _register(works, finish, (tensor, output))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; returns a handle."""
    _check_process_set(process_set)
    works, finish = _broadcast_start(tensor, tensor, root_rank)
    return _register(works, finish, (tensor,))


class _BroadcastFunction(torch.autograd.Function):
    """Broadcast whose backward averages the gradients onto the root; other ranks get zero (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, root_rank):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(allreduce_async(grad_output.contiguous(), op=Average))
        if _backend().rank != ctx.root_rank:
            averaged.zero_()
        return averaged, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank as a new tensor (differentiable)."""
    _check_process_set(process_set)
    return _BroadcastFunction.apply(tensor, root_rank)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------- alltoall
def _alltoall_splits(tensor, splits, n):
    first = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or first % n:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by size()={n}, "
                             f"got shape {tuple(tensor.shape)}")
        return [first // n] * n
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != first:
        raise ValueError(f"alltoall: splits {splits} must hold size()={n} non-negative counts summing to the "
                         f"first dimension {first}")
    return splits


def _alltoall_start(tensor, splits):
    """Alltoall built on allgather: every rank receives all data and keeps its part (costs size() x the bytes)."""
    _check_tensor(tensor, "alltoall")
    backend = _backend()
    n = backend.size
    mine = torch.tensor(_alltoall_splits(tensor, splits, n), dtype=torch.int64, device=backend.device)
    matrix = torch.empty(n * n, dtype=torch.int64, device=backend.device)
    backend.all_gather(matrix, mine).wait()
    matrix = matrix.view(n, n).cpu()  # matrix[src][dst]
    works, gather_finish, firsts = _allgather_start(tensor)
    me = backend.rank

    def finish():
        gathered = gather_finish()
        pieces, start = [], 0
        for src in range(n):
            offset = start + int(matrix[src, :me].sum())
            pieces.append(gathered.narrow(0, offset, int(matrix[src, me])))
            start += firsts[src]
        received = matrix[:, me].to(torch.int32)
        return torch.cat(pieces) if pieces else gathered[:0], received

    return works, finish


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    _check_process_set(process_set)
    works, finish = _alltoall_start(tensor, splits)
    return _register(works, finish, (tensor,))


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits):
        output, received = synchronize(alltoall_async(tensor, splits))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_received):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received))
        return grad, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter slices of ``tensor`` (split along dim 0 by ``splits``, equal parts by default) to every rank.

    Returns the received data concatenated in rank order, and, when
    ``splits`` is given, also the counts received from each rank (as
    Horovod).  Differentiable.  Built on allgather, so it moves ``size()``
    times the data of a native alltoall.
    """
    _check_process_set(process_set)
    output, received = _AlltoallFunction.apply(tensor, splits)
    return output if splits is None else (output, received)


# ------------------------------------------------------------ reducescatter
_shard_pool: Dict[tuple, List[torch.Tensor]] = {}


def _rows_of(first, n):
    """Horovod's split of dim 0: as even as possible, the first ``first % n`` ranks get one row more."""
    base, extra = divmod(first, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def _reducescatter_start(tensor, op, prescale_factor, postscale_factor):
    _check_tensor(tensor, "reducescatter")
    if op not in (Average, Sum):
        _check_op(op, (Average, Sum))
    backend = _backend()
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    n, me = backend.size, backend.rank
    rows = _rows_of(tensor.shape[0], n)
    row = tensor[0].numel() if tensor.shape[0] else math.prod(tensor.shape[1:])
    shard_n = max(1, max(rows) * row)
    flat = tensor.detach().reshape(-1).to(backend.device)
    full = torch.zeros(shard_n * n, dtype=tensor.dtype, device=backend.device)
    start = 0
    for r in range(n):
        full[r * shard_n:r * shard_n + rows[r] * row] = flat[start * row:(start + rows[r]) * row]
        start += rows[r]
    _scale_(full, float(prescale_factor))
    key = (shard_n, tensor.dtype, backend.device)
    pool = _shard_pool.setdefault(key, [])
    shard = pool.pop() if pool else torch.empty(shard_n, dtype=tensor.dtype, device=backend.device)
    handle = backend.reduce_scatter(shard, full)

    def finish():
        out = shard[:rows[me] * row].clone().view(rows[me], *tensor.shape[1:])
        pool.append(shard)  # the backend caches a receive buffer per shard address: reuse shards
        if op == Average:
            if float(postscale_factor) == 1.0:
                _divide_(out, n)
            else:
                _scale_(out, float(postscale_factor) / n)
        else:
            _scale_(out, float(postscale_factor))
        return out.to(tensor.device)

    return [handle], finish, rows


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` and scattering dim 0 over ranks; returns a handle."""
    _check_process_set(process_set)
    works, finish, _ = _reducescatter_start(tensor, op, prescale_factor, postscale_factor)
    return _register(works, finish, (tensor,))


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor):
        works, finish, _ = _reducescatter_start(tensor, op, prescale_factor, postscale_factor)
        for w in works:
            w.wait()
        n = _backend().size
        ctx.factor = float(prescale_factor) * float(postscale_factor) / (n if op == Average else 1)
        return finish()

    @staticmethod
    def backward(ctx, grad_output):
        grad = allgather(grad_output.contiguous())
        return grad * ctx.factor, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over ranks (``Average`` or ``Sum``) and return this rank's rows (differentiable).

    Dimension 0 is split as evenly as possible, the first ``dim0 % size()``
    ranks receiving one row more.
    """
    _check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_ReducescatterFunction.apply(compressed, op, prescale_factor, postscale_factor),
                                  ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    _check_process_set(process_set)
    started = [_reducescatter_start(t, op, prescale_factor, postscale_factor) for t in tensors]
    works = [w for ws, _, _ in started for w in ws]
    return _register(works, lambda: [fin() for _, fin, _ in started], (list(tensors),))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
            for t in tensors]


# ------------------------------------------------------------ barrier, join
def barrier(process_set=global_process_set) -> None:
    """Return once every rank has called ``barrier()``."""
    _check_process_set(process_set)
    backend = _backend()
    token = torch.zeros(1, dtype=torch.int32, device=backend.device)
    backend.all_reduce(token, "sum").wait()


def join(device=-1) -> int:
    """Wait for every rank to call ``join()`` and return the rank that joined last.

    Simplified: Horovod lets ranks that have joined answer other ranks'
    collectives with zeros (for uneven data).  Here ``join()`` is a barrier:
    every rank must have issued the same collectives before joining, so
    equalize the number of batches per rank (e.g. ``DistributedSampler`` with
    ``drop_last=True``) instead of relying on join.
    """
    backend = _backend()
    stamp = torch.tensor([time.time()], dtype=torch.float64, device=backend.device)
    stamps = torch.empty(backend.size, dtype=torch.float64, device=backend.device)
    backend.all_gather(stamps, stamp).wait()
    return int(torch.argmax(stamps.cpu()))
