"""``horovod.torch.mpi_ops`` on dearopt: the job, tensor collectives and handles.

Every collective runs on dearopt's backend (:func:`dearopt.backends.get_backend`).  The
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

import datetime
import itertools
import math
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch

import dearopt.backends.runtime as runtime
from dearopt.errors import NotInitializedError
from dearopt.integrations.horovod.compression import Compression

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "handle_average_backwards_compatibility",
    "HorovodInternalError",
    "HorovodMismatchError",
    "HorovodJoinedError",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "synchronize",
    "join",
    "barrier",
]


class HorovodNotInitializedError(NotInitializedError, ValueError):
    """Raised before :func:`init`; a ``ValueError`` as in Horovod, and a :class:`dearopt.errors.NotInitializedError`."""


class HorovodMismatchError(ValueError, RuntimeError):
    """Ranks started the same op with tensors that cannot be combined (dtype, shape): raised on every rank, as
    Horovod's coordinator does (a ``RuntimeError`` there; a ``ValueError`` too, since the input is at fault)."""


class HorovodJoinedError(RuntimeError):
    """An op other ranks cannot answer after they called :func:`join` (Horovod raises a ``RuntimeError`` too)."""


class HorovodInternalError(RuntimeError):
    """Horovod's name for a failed collective; dearopt raises its own :class:`dearopt.errors.CollectiveError` types."""


# ------------------------------------------------------------------ the job
def init(comm=None, process_sets=None, *, backend: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Join the job (horovodrun, mpirun, torchrun, Slurm or a single process).

    Callable again: later calls do nothing; after :func:`shutdown` it joins
    anew.  ``backend``/``timeout`` are dearopt's (see :func:`dearopt.init`).
    ``comm`` (a sub-communicator) is not supported; ``process_sets`` (a list
    of :class:`ProcessSet` or rank lists) are added as by :func:`add_process_set`.
    """
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) is not supported: dearopt always runs on every launched process. Launch only "
            "the processes that should take part (e.g. mpirun -np N) and call hvd.init()"
        )
    runtime.init(backend=backend, timeout=timeout)
    _channel(runtime.get_backend(), "data")  # every rank makes its side channels here, at the same point
    for ps in process_sets or ():
        if not (isinstance(ps, ProcessSet) and ps.process_set_id is not None):
            add_process_set(ps)


def shutdown() -> None:
    """Leave the job; pending handles are dropped and :func:`init` may be called again."""
    _handle_map.clear()
    _staged.clear()
    _forget_process_sets()
    _channels.clear()
    runtime.shutdown()


def is_initialized() -> bool:
    """True once ``hvd.init()`` (or :func:`dearopt.init`) has run in this process."""
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
    """The number of machines: ``HOROVOD_CROSS_SIZE`` under horovodrun, else ``size() // local_size()``.

    Derived, where the launcher does not say: it assumes every machine runs
    ``local_size()`` processes (a homogeneous job, see :func:`is_homogeneous`).
    """
    _check_init()
    launch = runtime.launch_info()
    if launch.cross_size is not None:
        return launch.cross_size
    return max(1, runtime.size() // max(1, runtime.local_size()))


def cross_rank() -> int:
    """This machine's index: ``HOROVOD_CROSS_RANK`` under horovodrun, else ``rank() // local_size()``.

    Derived, where the launcher does not say: it assumes ranks are placed
    contiguously, machine by machine (what horovodrun, ``mpirun --map-by slot``
    and torchrun do).
    """
    _check_init()
    launch = runtime.launch_info()
    if launch.cross_rank is not None:
        return launch.cross_rank
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
    """False: dearopt has no IBM DDL backend."""
    return False


def ccl_built() -> bool:
    """False: dearopt has no oneCCL backend."""
    return False


def cuda_built() -> bool:
    """True when torch was built with CUDA (dearopt then runs on GPUs over NCCL)."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """True when torch was built for ROCm (``torch.version.hip`` is set)."""
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path, mark_cycles=False):
    """Not supported: raises ``NotImplementedError`` (use ``DistOptim(timeline=...)`` or ``DEAROPT_TIMELINE``)."""
    raise NotImplementedError(
        "hvd.start_timeline() is not supported: dearopt records a Chrome trace of its optimizer instead; pass "
        "timeline='trace.json' to dearopt.DistOptim or set DEAROPT_TIMELINE=trace.json before starting"
    )


def stop_timeline():
    """Not supported: raises ``NotImplementedError`` (dearopt's trace runs for the whole job)."""
    raise NotImplementedError(
        "hvd.stop_timeline() is not supported: dearopt's trace (DEAROPT_TIMELINE) runs for the whole job"
    )


# ---------------------------------------------------------------------- ops
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_BACKEND_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "product"}
_BACKEND_CODES = {"sum": 0, "min": 1, "max": 2, "product": 3}


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule: ``average=`` is deprecated, ``op`` supersedes it, the default is Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average


def _check_op(op, allowed=tuple(_BACKEND_OPS)):
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dearopt.integrations.horovod (no Adasum reduction is built); use "
            "op=hvd.Average (the default), possibly with a larger learning rate as Horovod recommends for Average"
        )
    if op not in allowed:
        names = ", ".join(f"hvd.{_OP_NAMES[o]}" for o in allowed)
        raise ValueError(f"unknown or unsupported reduction op {op!r}; expected one of {names}")


# --------------------------------------------------------- process sets
class ProcessSet:
    """A subset of the ranks that collectives may be restricted to (``process_set=``), as Horovod's.

    ``hvd.add_process_set(ranks)`` (on every rank, in the same order) makes it
    usable; each set is a ``torch.distributed`` group of its own.  Ranks are
    global ranks, also for ``root_rank=``.
    """

    def __init__(self, ranks=None):
        if ranks is None:
            self.ranks = None
        else:
            if not isinstance(ranks, (list, tuple, range)) or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in ranks
            ):
                raise ValueError(f"a process set is a list of ranks (ints), got {ranks!r}")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"a process set lists each rank once, got {list(ranks)}")
            self.ranks = sorted(ranks)
        self.process_set_id = 0 if ranks is None else None
        self._backend = None  # this rank's communicator in the set, once added (None where not included)

    def _members(self) -> List[int]:
        return list(range(size())) if self.ranks is None else self.ranks

    def included(self) -> Optional[bool]:
        """Whether this rank is in the set; None until the set is added (:func:`add_process_set`)."""
        if self.process_set_id is None:
            return None
        return rank() in self._members()

    def size(self) -> Optional[int]:
        """The number of ranks in the set; None until the set is added."""
        if self.process_set_id is None:
            return None
        return len(self._members())

    def rank(self) -> Optional[int]:
        """This rank's index within the set; None until the set is added or where this rank is not in it."""
        if self.process_set_id is None or not self.included():
            return None
        return self._members().index(rank())

    def __eq__(self, other):
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.process_set_id == other.process_set_id and self.ranks == other.ranks

    def __hash__(self):
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __repr__(self):
        if self.ranks is None:
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
_process_sets: Dict[int, ProcessSet] = {}
_set_ids = itertools.count(1)


def add_process_set(process_set) -> ProcessSet:
    """Make ``process_set`` (a :class:`ProcessSet` or a list of ranks) usable; call it on every rank, in the same
    order.  Returns the set (with its id)."""
    _check_init()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError("the global process set exists already")
    if ps.process_set_id is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    world = size()
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= world:
        raise ValueError(f"process set ranks {ps.ranks} must be ranks of a job of size {world}")
    if any(other.ranks == ps.ranks for other in _process_sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    from dearopt.backends.base import TorchDistBackend

    main = runtime.get_backend()
    if not hasattr(main, "pg_backend"):
        raise NotImplementedError(f"process sets need a torch.distributed backend, this job runs {main.name}")
    group = torch.distributed.new_group(
        ranks=ps.ranks, backend=main.pg_backend, timeout=datetime.timedelta(seconds=main.timeout)
    )
    ps.process_set_id = next(_set_ids)
    if rank() in ps.ranks:
        ps._backend = TorchDistBackend(ps.ranks.index(rank()), len(ps.ranks), main.timeout, group=group)
        _channel(ps._backend, "data")
    _process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set) -> bool:
    """Forget ``process_set`` (on every rank); returns whether it was known.  The global set stays."""
    if not isinstance(process_set, ProcessSet) or process_set.ranks is None:
        return False
    ps = _process_sets.pop(process_set.process_set_id, None) if process_set.process_set_id else None
    if ps is None:
        return False
    if ps._backend is not None:
        _channels.pop(id(ps._backend), None)
        ps._backend.close()  # and its side channels (forks)
    ps._backend = None
    ps.process_set_id = None
    if process_set is not ps:
        process_set.process_set_id = None
    return True


def _check_process_set(process_set) -> None:
    if (
        process_set is None
        or process_set is global_process_set
        or (isinstance(process_set, ProcessSet) and process_set.ranks is None)
    ):
        return
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id not in _process_sets:
        raise ValueError(f"{process_set} was not added (hvd.add_process_set) or was removed")
    if not process_set.included():
        raise ValueError(f"rank {rank()} is not part of {process_set}")


def _set_backend(process_set):
    """The communicator of ``process_set`` on this rank (the job's own for the global set)."""
    _check_process_set(process_set)
    if process_set is None or process_set.ranks is None:
        return _backend()
    return _process_sets[process_set.process_set_id]._backend


def _set_rank(process_set, global_rank: int, what: str) -> int:
    """``global_rank`` as a rank of ``process_set``'s communicator."""
    if process_set is None or process_set.ranks is None:
        return global_rank
    if global_rank not in process_set.ranks:
        raise ValueError(f"{what}: root_rank {global_rank} is not part of {process_set}")
    return process_set.ranks.index(global_rank)


def _forget_process_sets() -> None:
    for ps in list(_process_sets.values()):
        remove_process_set(ps)


# ------------------------------------------------------------------ handles
class _Pending:
    """An op in flight: the transport handles, what makes the result, and what must stay alive.

    ``advance``, when set, starts the op's second stage once its first one
    (``works``) has completed and returns the second stage's handles (an
    allgather exchanges shapes first, then the data).  Second stages start in
    the order the ops were issued, on every rank.
    """

    __slots__ = ("works", "finish", "keep", "name", "advance", "seen_done", "mark")

    def __init__(self, works, finish: Callable[[], object], keep=(), name=None, advance=None):
        self.works = list(works)
        self.finish = finish
        self.keep = keep
        self.name = name
        self.advance = advance
        self.seen_done = False  # poll() has returned True for it
        self.mark = _activity  # this rank's activity count when it was started


_handle_map: Dict[int, _Pending] = {}
_handle_ids = itertools.count(1)
_staged: List[int] = []  # handles whose second stage has not started, in issue order


_activity = 0
"""Counts what this rank did through this module: ops started, barriers, joins, polls, synchronizes."""


def _touch() -> None:
    global _activity
    _activity += 1


def _claim(name) -> None:
    """Horovod refuses a second op with the name of one still in flight (matched by name, it would be ambiguous).

    An op holds its name until this rank has seen it finish (``synchronize()``, or ``poll()`` returning True),
    or until the transport has finished it and this rank has done something else since (started another op,
    a barrier, a poll...).  The transport alone does not decide: a peer's side posted earlier can finish an op
    within microseconds of its start here, and whether a second op of the same name, started right after it,
    raised would depend on timing (Horovod's background thread keeps an op for at least one negotiation cycle).
    A handle dropped without ``synchronize()`` frees its name once finished, as in Horovod.
    """
    if name is None:
        return
    for pending in _handle_map.values():
        if pending.name != name or pending.seen_done:
            continue
        if pending.mark == _activity or not all(w.is_completed() for w in pending.works):
            raise ValueError(
                f"Duplicate name {name!r}: an operation with this name is still in flight; "
                f"synchronize it first or use another name"
            )


def _register(works, finish, keep=(), name=None, advance=None) -> int:
    _touch()
    handle = next(_handle_ids)
    _handle_map[handle] = _Pending(works, finish, keep, name, advance)
    if advance is not None:
        _staged.append(handle)
    return handle


def _advance_through(handle: int) -> None:
    """Start the second stage of every staged op issued up to ``handle`` (the same order on every rank)."""
    while handle in _staged:
        first = _staged.pop(0)
        pending = _handle_map.get(first)
        if pending is None or pending.advance is None:
            continue
        for w in pending.works:
            w.wait()
        pending.works = list(pending.advance())
        pending.advance = None


def poll(handle: int) -> bool:
    """True once ``synchronize(handle)`` would not wait for the transport; False while the op is in flight."""
    _touch()
    pending = _handle_map.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle!r} was not created or has already been synchronized")
    if not all(w.is_completed() for w in pending.works):
        return False
    if pending.advance is not None:
        _advance_through(handle)
        pending.seen_done = all(w.is_completed() for w in pending.works)
        return pending.seen_done
    pending.seen_done = True
    return True


def synchronize(handle: int):
    """Wait for the op and return its result (the output tensor, or a list for grouped ops).

    As in Horovod, a handle is consumed by its first ``synchronize``: a second
    call returns ``None`` (and :func:`poll` on it raises ``ValueError``).
    """
    _touch()
    pending = _handle_map.get(handle)
    if pending is None:
        return None
    try:
        if pending.advance is not None:
            _advance_through(handle)
    finally:
        del _handle_map[handle]
    for w in pending.works:
        w.wait()
    return pending.finish()


# ----------------------------------------------------------------- helpers
_channels: Dict[int, Dict[str, object]] = {}


def _channel(backend, kind: str):
    """A communicator of its own beside ``backend`` for ``kind``: ``"data"`` carries only the second stage of
    allgathers and broadcasts, in issue order (so when each starts never matters), ``"barrier"`` only barriers (so a
    barrier never pairs with an op a rank left in flight).  Made at the first collective that needs one, which every
    rank reaches in the same order."""
    forks = _channels.get(id(backend))
    if forks is None:  # both at once, in one order: the n-th new group is the same channel on every rank
        forks = {"of": backend}
        for name in ("data", "barrier"):
            try:
                forks[name] = backend.fork()
            except NotImplementedError:
                forks[name] = backend
        _channels[id(backend)] = forks
    return forks[kind]


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
    """Start reducing ``tensor`` into ``output`` (which may be ``tensor``); return ``(works, finish, advance)``:
    the header travels now, the data (on the data channel, in issue order) once every rank's header is known."""
    _check_tensor(tensor, what)
    _check_op(op)
    backend = backend or _backend()
    in_place = output is tensor
    work = _work_tensor(tensor.detach(), backend, in_place)
    _scale_(work, float(prescale_factor))
    n = backend.size
    header_work, everyone = _announce("allreduce", work, backend, op=_BACKEND_CODES[_BACKEND_OPS[op]])

    def advance():
        _rows(everyone, backend, what)
        return [_channel(backend, "data").all_reduce(work, _BACKEND_OPS[op])]

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

    return [header_work], finish, advance


def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """Start reducing ``tensor`` over all ranks into a new tensor; returns a handle. ``tensor`` is not modified.

    ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``.
    The result is ``postscale * reduce(prescale * x)``, divided by ``size()``
    for ``Average``.
    """
    _claim(name)
    backend = _set_backend(process_set)
    op = handle_average_backwards_compatibility(op, average)
    output = torch.empty_like(tensor)
    works, finish, advance = _allreduce_start(tensor, output, op, prescale_factor, postscale_factor, backend=backend)
    return _register(works, finish, (tensor, output), name, advance)


def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """As :func:`allreduce_async`, in place: ``synchronize`` returns ``tensor`` holding the result."""
    _claim(name)
    backend = _set_backend(process_set)
    op = handle_average_backwards_compatibility(op, average)
    works, finish, advance = _allreduce_start(tensor, tensor, op, prescale_factor, postscale_factor, backend=backend)
    return _register(works, finish, (tensor,), name, advance)


class _AllreduceFunction(torch.autograd.Function):
    """Allreduce whose backward is the allreduce of the gradient with the same op and factors (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(
            allreduce_async(
                tensor,
                op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
            )
        )

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, process_set = ctx.args
        return (
            synchronize(
                allreduce_async(
                    grad_output.contiguous(), op=op, prescale_factor=pre, postscale_factor=post, process_set=process_set
                )
            ),
            None,
            None,
            None,
            None,
        )


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Reduce ``tensor`` over all ranks and return the result as a new tensor (differentiable).

    ``compression`` (e.g. ``Compression.fp16``) is applied to what travels.
    """
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    _check_op(op)
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Reduce ``tensor`` over all ranks in place and return it (not differentiable)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Reduce a sparse COO tensor as Horovod does: every rank's indices and values are all-gathered.

    Returns a function; calling it waits and returns the (uncoalesced) sparse
    result, divided by the set's size for ``Average``.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async expects a sparse COO tensor")
    if op not in (Average, Sum):
        _check_op(op, (Average, Sum))
    t = tensor.coalesce()
    indices = allgather_async(
        t.indices().t().contiguous(), name=None if name is None else f"{name}.indices", process_set=process_set
    )
    values = allgather_async(t.values(), name=None if name is None else f"{name}.values", process_set=process_set)
    n = _set_backend(process_set).size

    def result():
        idx, val = synchronize(indices), synchronize(values)
        if op == Average:
            val = val / n
        return torch.sparse_coo_tensor(idx.t(), val, tensor.shape)

    return result


# --------------------------------------------------------- grouped allreduce
def _grouped_allreduce_start(tensors, outputs, op, prescale_factor, postscale_factor, backend):
    """One fused allreduce per dtype: the tensors are flattened into one buffer."""
    tensors = list(tensors)
    for t in tensors:
        _check_tensor(t, "grouped_allreduce")
    _check_op(op)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    works, parts, advances = [], [], []
    for dtype, members in by_dtype.items():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(backend.device) for i in members]) if members else None
        w, fin, adv = _allreduce_start(flat, flat, op, prescale_factor, postscale_factor, "allreduce", backend)
        works += w
        advances.append(adv)
        parts.append((members, flat, fin))

    def finish():
        for members, flat, fin in parts:
            fin()
            offset = 0
            with torch.no_grad():
                for i in members:
                    n = tensors[i].numel()
                    outputs[i].copy_(flat[offset : offset + n].view_as(outputs[i]))
                    offset += n
        return list(outputs)

    return works, finish, lambda: [w for adv in advances for w in adv()]


def grouped_allreduce_async(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """Start one fused reduction of a list of tensors; ``synchronize`` returns a list of new tensors."""
    _claim(name)
    backend = _set_backend(process_set)
    op = handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    outputs = [torch.empty_like(t) for t in tensors]
    works, finish, advance = _grouped_allreduce_start(tensors, outputs, op, prescale_factor, postscale_factor, backend)
    return _register(works, finish, (tensors, outputs), name, advance)


def grouped_allreduce_async_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """In-place :func:`grouped_allreduce_async`: ``synchronize`` returns the input list, reduced."""
    _claim(name)
    backend = _set_backend(process_set)
    op = handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    works, finish, advance = _grouped_allreduce_start(tensors, tensors, op, prescale_factor, postscale_factor, backend)
    return _register(works, finish, (tensors,), name, advance)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(
            synchronize(
                grouped_allreduce_async(
                    list(tensors),
                    op=op,
                    prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor,
                    process_set=process_set,
                )
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads],
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
            )
        )
        return (None, None, None, None) + tuple(reduced)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Reduce a list of tensors in one fused op; returns a list of new tensors (differentiable)."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    _check_op(op)
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduceFunction.apply(
        op, prescale_factor, postscale_factor, process_set, *[c for c, _ in compressed]
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Reduce a list of tensors in place in one fused op; returns the list."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


# ---------------------------------------------------------------- allgather
_MAX_DIMS = 16
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_JOIN, _KINDS = 1, {"allreduce": 2, "allgather": 3, "broadcast": 4, "alltoall": 5, "reducescatter": 6}
_KIND_NAMES = {code: name for name, code in _KINDS.items()}
_KIND_NAMES[_JOIN] = "join"


def _header(kind: str, tensor, backend, root: int = -1, op: int = -1) -> torch.Tensor:
    """What this rank is about to do, as a small tensor every rank all-gathers before the data moves (Horovod's
    negotiation): op kind, dtype, shape, broadcast root, reduction op.  A rank in :func:`join` answers headers."""
    meta = torch.full((_MAX_DIMS + 5,), -1, dtype=torch.int64)
    meta[0] = _JOIN if kind == "join" else _KINDS[kind]
    meta[-2], meta[-1] = root, op
    if tensor is not None:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"{kind} supports tensors of at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
        meta[1] = tensor.dim()
        meta[2] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
        meta[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return meta.to(backend.device)


def _announce(kind: str, tensor, backend, root: int = -1, op: int = -1):
    """Start all-gathering this rank's header on ``backend``; returns ``(work, everyone)``."""
    mine = _header(kind, tensor, backend, root, op)
    everyone = torch.empty(backend.size * mine.numel(), dtype=torch.int64, device=backend.device)
    return backend.all_gather(everyone, mine), everyone


def _rows(everyone, backend, what: str) -> List[List[int]]:
    """The headers of the ranks that take part in ``what`` (ranks in :func:`join` left out), checked: every rank
    started the same kind of op, with the same dtype, and, per kind, compatible shapes, root and op."""
    rows = everyone.view(backend.size, -1).cpu().tolist()
    joined = [r for r, row in enumerate(rows) if row[0] == _JOIN]
    if joined and what != "allreduce":
        raise HorovodJoinedError(
            f"{what} is not supported once a rank has called join(): ranks {joined} have; "
            f"only allreduce gets zeros from joined ranks"
        )
    active = [(r, row) for r, row in enumerate(rows) if row[0] != _JOIN]
    kinds = {_KIND_NAMES.get(row[0], "?") for _, row in active}
    if len(kinds) > 1:
        started = [_KIND_NAMES.get(row[0], "?") for _, row in active]
        raise HorovodMismatchError(
            f"Mismatched operations: ranks started {started} "
            f"at the same point; every rank must issue the same collectives in the same order"
        )
    if any(row[2] != active[0][1][2] for _, row in active):
        raise HorovodMismatchError(
            f"Mismatched data types: {what} got dtype codes {[row[2] for _, row in active]} on "
            f"ranks {[r for r, _ in active]}; every rank must pass the same dtype"
        )
    shapes = [row[3 : 3 + row[1]] for _, row in active]
    if what == "allgather":
        if any(len(sh) != len(shapes[0]) or sh[1:] != shapes[0][1:] for sh in shapes):
            raise HorovodMismatchError(
                f"Mismatched allgather tensor shapes {shapes}: all dimensions but the first must agree"
            )
    elif what in ("allreduce", "broadcast", "reducescatter") and any(sh != shapes[0] for sh in shapes):
        raise HorovodMismatchError(f"Mismatched {what} tensor shapes {shapes}: every rank must pass the same shape")
    if what == "broadcast" and any(row[-2] != active[0][1][-2] for _, row in active):
        raise HorovodMismatchError(
            f"Mismatched broadcast root ranks {[row[-2] for _, row in active]}: every rank must name the same root_rank"
        )
    if any(row[-1] != active[0][1][-1] for _, row in active):
        raise HorovodMismatchError(
            f"Mismatched {what} ops {[row[-1] for _, row in active]}: every rank must pass the same op"
        )
    return rows


def _allgather_start(tensor, backend):
    """Two stages: the shapes travel now (first dimensions may differ), the data once they are known.

    Returns ``(works, finish, advance, state)``: ``advance()`` starts the data
    on the gather channel (in issue order, see :func:`_advance_through`) and
    fills ``state["firsts"]``.
    """
    _check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; use tensor.reshape(1)")
    data = _channel(backend, "data")
    shapes_work, everyone = _announce("allgather", tensor, backend)
    source = tensor.detach().reshape(-1).to(backend.device)
    state = {}

    def advance():
        shapes = [row[3 : 3 + row[1]] for row in _rows(everyone, backend, "allgather")]
        firsts = [s[0] for s in shapes]
        row = math.prod(shapes[0][1:]) if len(shapes[0]) > 1 else 1
        chunk = max(1, max(firsts) * row)
        shard = torch.zeros(chunk, dtype=tensor.dtype, device=backend.device)
        shard[: source.numel()] = source
        full = torch.empty(chunk * backend.size, dtype=tensor.dtype, device=backend.device)
        state.update(firsts=firsts, row=row, chunk=chunk, full=full, trailing=shapes[0][1:])
        return [data.all_gather(full, shard)]

    def finish():
        firsts, row, chunk, full = state["firsts"], state["row"], state["chunk"], state["full"]
        parts = [full[r * chunk : r * chunk + firsts[r] * row] for r in range(backend.size)]
        return torch.cat(parts).view(sum(firsts), *state["trailing"]).to(tensor.device)

    return [shapes_work], finish, advance, state


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (first dims may differ); returns a handle.

    The first dimensions are exchanged first (a small blocking all-gather),
    then the data travels asynchronously.
    """
    _claim(name)
    works, finish, advance, _ = _allgather_start(tensor, _set_backend(process_set))
    return _register(works, finish, (tensor,), name, advance)


class _AllgatherFunction(torch.autograd.Function):
    """Allgather whose backward averages the gradient over ranks and returns this rank's slice (as Horovod 0.28)."""

    @staticmethod
    def forward(ctx, tensor, process_set):
        backend = _set_backend(process_set)
        works, finish, advance, state = _allgather_start(tensor, backend)
        out = synchronize(_register(works, finish, (tensor,), None, advance))
        ctx.firsts = state["firsts"]
        ctx.rank = backend.rank
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ctx.process_set))
        offset = sum(ctx.firsts[: ctx.rank])
        return averaged.narrow(0, offset, ctx.firsts[ctx.rank]), None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order (differentiable).

    All dimensions but the first must agree across ranks.
    """
    _check_process_set(process_set)
    return _AllgatherFunction.apply(tensor, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start :func:`allgather` of each tensor; ``synchronize`` returns the list of results."""
    _claim(name)
    backend = _set_backend(process_set)
    started = [_allgather_start(t, backend) for t in tensors]
    works = [w for ws, _, _, _ in started for w in ws]
    return _register(
        works,
        lambda: [fin() for _, fin, _, _ in started],
        (list(tensors),),
        name,
        lambda: [w for _, _, adv, _ in started for w in adv()],
    )


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """:func:`allgather` of each tensor of a list (differentiable)."""
    return [allgather(t, process_set=process_set) for t in tensors]


# ---------------------------------------------------------------- broadcast
def _broadcast_start(tensor, output, root_rank, process_set):
    """Two stages, as an allgather: every rank's shape, dtype and root travel first (so a mismatch is an error
    on every rank, not a hang or a silent copy), then the data on the data channel, in issue order."""
    _check_tensor(tensor, "broadcast")
    backend = _set_backend(process_set)
    world = size()
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or not 0 <= root_rank < world:
        raise ValueError(f"broadcast: root_rank {root_rank!r} is not a rank of a job of size {world}")
    meta_work, everyone = _announce("broadcast", tensor, backend, root=root_rank)
    work = _work_tensor(tensor.detach(), backend, output is tensor)

    def advance():
        _rows(everyone, backend, "broadcast")
        return [_channel(backend, "data").broadcast(work, _set_rank(process_set, root_rank, "broadcast"))]

    def finish():
        if work is not output:
            with torch.no_grad():
                output.copy_(work)
        return output

    return [meta_work], finish, advance


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying ``root_rank``'s ``tensor`` into a new tensor on every rank; returns a handle."""
    _claim(name)
    output = torch.empty_like(tensor)
    works, finish, advance = _broadcast_start(tensor, output, root_rank, process_set)
    return _register(works, finish, (tensor, output), name, advance)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; returns a handle."""
    _claim(name)
    works, finish, advance = _broadcast_start(tensor, tensor, root_rank, process_set)
    return _register(works, finish, (tensor,), name, advance)


class _BroadcastFunction(torch.autograd.Function):
    """Broadcast whose backward averages the gradients onto the root; other ranks get zero (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, process_set=process_set))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ctx.process_set))
        if rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank as a new tensor (differentiable)."""
    _check_process_set(process_set)
    return _BroadcastFunction.apply(tensor, root_rank, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------- alltoall
def _alltoall_splits(tensor, splits, n):
    first = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or first % n:
            raise ValueError(
                f"alltoall without splits needs a first dimension divisible by size()={n}, "
                f"got shape {tuple(tensor.shape)}"
            )
        return [first // n] * n
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != first:
        raise ValueError(
            f"alltoall: splits {splits} must hold size()={n} non-negative counts summing to the first dimension {first}"
        )
    return splits


def _alltoall_start(tensor, splits, backend):
    """Alltoall built on allgather: every rank receives all data and keeps its part (costs size() x the bytes)."""
    _check_tensor(tensor, "alltoall")
    n = backend.size
    mine = torch.tensor(_alltoall_splits(tensor, splits, n), dtype=torch.int64, device=backend.device)
    header_work, everyone = _announce("alltoall", tensor, backend)
    header_work.wait()
    _rows(everyone, backend, "alltoall")
    matrix = torch.empty(n * n, dtype=torch.int64, device=backend.device)
    backend.all_gather(matrix, mine).wait()
    matrix = matrix.view(n, n).cpu()  # matrix[src][dst]
    works, gather_finish, advance, state = _allgather_start(tensor, backend)
    me = backend.rank

    def finish():
        gathered = gather_finish()
        firsts = state["firsts"]
        pieces, start = [], 0
        for src in range(n):
            offset = start + int(matrix[src, :me].sum())
            pieces.append(gathered.narrow(0, offset, int(matrix[src, me])))
            start += firsts[src]
        received = matrix[:, me].to(torch.int32)
        return torch.cat(pieces) if pieces else gathered[:0], received

    return works, finish, advance


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    _claim(name)
    works, finish, advance = _alltoall_start(tensor, splits, _set_backend(process_set))
    return _register(works, finish, (tensor,), name, advance)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, process_set=process_set))
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_received):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, process_set=ctx.process_set))
        return grad, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter slices of ``tensor`` (split along dim 0 by ``splits``, equal parts by default) to every rank.

    Returns the received data concatenated in rank order, and, when
    ``splits`` is given, also the counts received from each rank (as
    Horovod).  Differentiable.  Built on allgather, so it moves ``size()``
    times the data of a native alltoall.
    """
    _check_process_set(process_set)
    output, received = _AlltoallFunction.apply(tensor, splits, process_set)
    return output if splits is None else (output, received)


# ------------------------------------------------------------ reducescatter
_shard_pool: Dict[tuple, List[torch.Tensor]] = {}


def _rows_of(first, n):
    """Horovod's split of dim 0: as even as possible, the first ``first % n`` ranks get one row more."""
    base, extra = divmod(first, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def _reducescatter_start(tensor, op, prescale_factor, postscale_factor, backend):
    _check_tensor(tensor, "reducescatter")
    if op not in (Average, Sum):
        _check_op(op, (Average, Sum))
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
        full[r * shard_n : r * shard_n + rows[r] * row] = flat[start * row : (start + rows[r]) * row]
        start += rows[r]
    _scale_(full, float(prescale_factor))
    key = (shard_n, tensor.dtype, backend.device)
    pool = _shard_pool.setdefault(key, [])
    shard = pool.pop() if pool else torch.empty(shard_n, dtype=tensor.dtype, device=backend.device)
    header_work, everyone = _announce("reducescatter", tensor, backend, op=op)

    def advance():
        _rows(everyone, backend, "reducescatter")
        return [_channel(backend, "data").reduce_scatter(shard, full)]

    def finish():
        out = shard[: rows[me] * row].clone().view(rows[me], *tensor.shape[1:])
        pool.append(shard)  # the backend caches a receive buffer per shard address: reuse shards
        if op == Average:
            if float(postscale_factor) == 1.0:
                _divide_(out, n)
            else:
                _scale_(out, float(postscale_factor) / n)
        else:
            _scale_(out, float(postscale_factor))
        return out.to(tensor.device)

    return [header_work], finish, advance


def reducescatter_async(
    tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
) -> int:
    """Start reducing ``tensor`` and scattering dim 0 over ranks; returns a handle."""
    _claim(name)
    works, finish, advance = _reducescatter_start(
        tensor, op, prescale_factor, postscale_factor, _set_backend(process_set)
    )
    return _register(works, finish, (tensor,), name, advance)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, process_set):
        backend = _set_backend(process_set)
        works, finish, advance = _reducescatter_start(tensor, op, prescale_factor, postscale_factor, backend)
        out = synchronize(_register(works, finish, (tensor,), None, advance))
        n = backend.size
        # Horovod 0.28's backward: the allgathered gradient, times size() for Sum (1 for Average), pre and post
        ctx.factor = float(prescale_factor) * float(postscale_factor) * (n if op == Sum else 1)
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad = allgather(grad_output.contiguous(), process_set=ctx.process_set)
        return grad * ctx.factor, None, None, None, None


def reducescatter(
    tensor,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce ``tensor`` over ranks (``Average`` or ``Sum``) and return this rank's rows (differentiable).

    Dimension 0 is split as evenly as possible, the first ``dim0 % size()``
    ranks receiving one row more.
    """
    _check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(
        _ReducescatterFunction.apply(compressed, op, prescale_factor, postscale_factor, process_set), ctx
    )


def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
) -> int:
    """Start :func:`reducescatter_async` on each of ``tensors``; one handle for :func:`synchronize` returns the list
    of outputs."""
    _claim(name)
    backend = _set_backend(process_set)
    started = [_reducescatter_start(t, op, prescale_factor, postscale_factor, backend) for t in tensors]
    works = [w for ws, _, _ in started for w in ws]
    return _register(
        works,
        lambda: [fin() for _, fin, _ in started],
        (list(tensors),),
        name,
        lambda: [w for _, _, adv in started for w in adv()],
    )


def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """:func:`reducescatter` of each of ``tensors``: this rank's part of each reduction, in a list."""
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor) for t in tensors]


# ------------------------------------------------------------ barrier, join
def barrier(process_set=global_process_set) -> None:
    """Return once every rank has called ``barrier()``."""
    _touch()
    backend = _channel(_set_backend(process_set), "barrier")
    token = torch.zeros(1, dtype=torch.int32, device=backend.device)
    backend.all_reduce(token, "sum").wait()


def join(device=-1) -> int:
    """Wait until every rank has called ``join()``; return the rank that joined last (the same on every rank).

    As in Horovod, a rank that has joined answers the other ranks' ``allreduce``
    and ``grouped_allreduce`` (of the global set) with zeros, so ranks with more
    batches can go on (``Average`` still divides by ``size()``); ``allgather``,
    ``broadcast``, ``alltoall`` and ``reducescatter`` raise
    :class:`HorovodJoinedError` on the ranks that call them.  Not answered: the
    ``DistributedOptimizer`` engine's gradient reductions and barriers (give
    every rank the same number of optimizer steps, e.g. ``DistributedSampler``
    with ``drop_last=True``), and ops on other process sets.
    """
    _touch()
    _check_init()
    backend = _backend()
    data = _channel(backend, "data")
    stamp = time.time_ns()
    while True:
        work, everyone = _announce("join", None, backend, root=stamp)
        work.wait()
        rows = everyone.view(backend.size, -1).cpu().tolist()
        active = [row for row in rows if row[0] != _JOIN]
        if not active:  # everyone has joined: the last to join has the latest stamp (ties: the highest rank)
            stamps = [row[-2] for row in rows]
            return max(range(len(stamps)), key=lambda r: (stamps[r], r))
        row = active[0]
        same = all(r[: 3 + r[1]] == row[: 3 + row[1]] and r[-1] == row[-1] for r in active)  # else they raise
        if row[0] == _KINDS["allreduce"] and same:
            dtype, shape = _DTYPES[row[2]], row[3 : 3 + row[1]]
            reduce_op = next(name for name, code in _BACKEND_CODES.items() if code == row[-1])
            zeros = torch.full(shape, _identity(reduce_op, dtype), dtype=dtype, device=backend.device)
            data.all_reduce(zeros, reduce_op).wait()
        # any other op: the ranks that started it raise HorovodJoinedError; nothing to answer


def _identity(reduce_op: str, dtype: torch.dtype):
    """What a joined rank contributes to a reduction: it changes nothing."""
    if reduce_op == "sum":
        return 0
    if reduce_op == "product":
        return 1
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.max if reduce_op == "min" else info.min
