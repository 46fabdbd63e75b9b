"""One small asynchronous interface to collectives.

A :class:`CollectiveBackend` starts an op and returns a :class:`Handle`; the
handle is waited on (always with a timeout) or polled.  Everything above this
module (the executor, the helpers, the Horovod face) talks only to this
interface, so the transport can be swapped without touching them:

* :class:`TorchDistBackend` runs over ``torch.distributed`` (gloo on CPU,
  NCCL on GPU).
* ``dearopt.backends.nccl`` runs over the csrc NCCL extension.

Semantics shared by every backend:

* ``reduce_scatter(out_shard, in_full)``: ``in_full`` is a flat tensor of
  ``size * n`` elements; rank ``r`` receives the element-wise sum over ranks of
  ``in_full[r*n:(r+1)*n]`` in ``out_shard`` (``n`` elements).  Use
  :func:`padded_numel` to size flat buffers.
* ``all_gather(out_full, in_shard)``: the inverse layout.
* ``all_reduce(tensor, op)`` in place, ``broadcast(tensor, root)`` in place.
* A handle has two meanings of "done", the same on every backend:
  ``wait`` returns once the result may be *used*: by the host on CPU, by work
  queued afterwards on the caller's current stream on a GPU (the host may
  run ahead).  ``synchronize`` returns once the op has *finished* (the host
  waited for it), and ``is_completed`` says, without blocking, whether it
  has finished.  Data waits use ``wait``; anything that accounts for time or
  bytes in flight (the credit window, bandwidth profiles) uses
  ``synchronize``/``is_completed``.  Both raise
  :class:`~dearopt.errors.CollectiveTimeoutError` /
  :class:`~dearopt.errors.PeerLostError` naming the rank and the op.

Ops are matched across ranks by the order in which they are started, so
callers must start the same ops in the same order on every rank.

A rank whose engine fails with an unexpected exception (:func:`engine_failure`) posts it to the job's store
(:func:`post_failure`); a wait that has lasted :data:`FAULT_POLL_SECONDS` looks there every
:data:`FAULT_POLL_SECONDS` (one store round trip, ~0.1 ms on loopback; shorter waits never do) and raises
:class:`~dearopt.errors.PeerFailedError` naming the failed rank and its error, also when that rank's process
keeps running.  Every wait keeps its timeout.
"""

from __future__ import annotations

import abc
import datetime
import functools
import queue
import re
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from dearopt.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    DearoptError,
    PeerFailedError,
    PeerLostError,
    internal_error,
)

__all__ = [
    "Handle",
    "JointHandle",
    "ReduceScatterThenGather",
    "CollectiveBackend",
    "TorchDistBackend",
    "padded_numel",
    "REDUCE_OPS",
    "FAULT_POLL_SECONDS",
    "post_failure",
    "posted_failure",
    "engine_failure",
    "engine_boundary",
]

REDUCE_OPS = ("sum", "avg", "min", "max", "product")


_PEER_LOST_PATTERNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"Connection refused|ECONNRESET|EPIPE|peer.*(closed|lost|died)|remote process exited",
    re.IGNORECASE,
)
_TIMEOUT_PATTERNS = re.compile(r"timed out|timeout", re.IGNORECASE)


FAULT_KEY = "dearopt/failed"
"""The job store's key under which the first rank whose engine failed posts ``"<rank>\\n<error text>"``."""

FAULT_POLL_SECONDS = 0.25
"""A wait on a collective looks for a peer's posted failure after this long, and again every this long."""


_unreachable_stores: "weakref.WeakSet" = weakref.WeakSet()  # stores that failed once (their server is gone)


def _job_store():
    """The store of torch.distributed's default group (the job's rendezvous store), or None (also once it failed:
    its server died with its process, and each failed call has torch log a warning with a stack trace)."""
    try:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default group (torch.distributed torn down): nothing to post to
        return None
    return None if store in _unreachable_stores else store


def _store_failed(store) -> None:
    try:
        _unreachable_stores.add(store)
    except TypeError:  # not weakly referenceable: looked up again next time
        pass


def post_failure(error: BaseException) -> bool:
    """Tell the other ranks that this one failed with ``error`` (the first failure posted wins: later ones are
    what followed from it).  Returns whether it was posted; never raises."""
    store = _job_store()
    if store is None:
        return False
    text = " ".join(str(error).split()) or type(error).__name__
    try:
        store.compare_set(FAULT_KEY, "", f"{dist.get_rank()}\n{type(error).__name__}: {text}")
        return True
    except Exception:  # the store is gone (its server died): the transport will tell the peers
        _store_failed(store)
        return False


def posted_failure(members: Optional[Tuple[int, ...]] = None) -> Optional[Tuple[int, str]]:
    """``(rank, error text)`` of the failure another rank posted (one of ``members``, global ranks, if given),
    or None; never raises."""
    store = _job_store()
    if store is None:
        return None
    try:
        if not store.check([FAULT_KEY]):
            return None
        rank, text = store.get(FAULT_KEY).decode("utf-8", "replace").split("\n", 1)
        rank = int(rank)
        if rank == dist.get_rank() or (members is not None and rank not in members):
            return None
        return rank, text
    except Exception:  # the store is unreachable: no news
        _store_failed(store)
        return None


def peer_failed_error(posted: Tuple[int, str], *, rank: int, op: str, **where) -> PeerFailedError:
    failed, text = posted
    return PeerFailedError(
        f"rank {failed} failed, so {op} cannot complete: {text}",
        failed_rank=failed,
        failure=text,
        rank=rank,
        op=op,
        **where,
    )


def engine_failure(exc: BaseException, owner=None, where: str = "engine") -> BaseException:
    """What the engine raises for ``exc``: a :class:`~dearopt.errors.DearoptError` (or a ``BaseException`` that
    is not an ``Exception``: ``KeyboardInterrupt``...) as it is; any other exception as an
    :class:`~dearopt.errors.InternalError` naming the rank and step (from ``owner``, the executor), posted to the
    job's store so that the other ranks stop waiting for this one (:func:`post_failure`)."""
    if isinstance(exc, DearoptError) or not isinstance(exc, Exception):
        return exc
    rank = getattr(owner, "rank", None)
    if rank is None:
        try:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
        except Exception:
            rank = None
    error = internal_error(exc, rank=rank, step=getattr(owner, "step_count", None), where=where)
    post_failure(error)
    return error


def engine_boundary(method):
    """Decorate a ``DistOptim`` method: an unexpected exception inside becomes :func:`engine_failure`'s error."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            error = engine_failure(exc, getattr(self, "_executor", None), f"DistOptim.{method.__name__}()")
            if error is exc:
                raise
            raise error from exc

    return call


def translate_error(exc: BaseException, *, rank: int, op: str, **where) -> CollectiveError:
    """Map a transport exception to the dearopt hierarchy, keeping its text.  A failure another rank posted
    (:func:`post_failure`) is what the transport's error followed from: it is named instead."""
    if isinstance(exc, CollectiveError):
        return exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    posted = posted_failure()
    if posted is not None:
        return peer_failed_error(posted, rank=rank, op=op, **where)
    if _PEER_LOST_PATTERNS.search(str(exc)):
        return PeerLostError(f"a peer process was lost during {op}: {text}", rank=rank, op=op, **where)
    if _TIMEOUT_PATTERNS.search(str(exc)):
        return CollectiveTimeoutError(f"{op} did not complete in time: {text}", rank=rank, op=op, **where)
    return CollectiveError(f"{op} failed: {text}", rank=rank, op=op, **where)


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that holds ``numel`` elements (at least one per rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return max(1, -(-numel // world_size)) * world_size


class Handle(abc.ABC):
    """An op in flight.  ``wait``, ``synchronize`` and ``is_completed`` may be called any number of times."""

    op: str

    @abc.abstractmethod
    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the result may be used by the caller (see the module docstring); ``timeout`` in seconds."""

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the host until the op has finished.  Equal to :meth:`wait` where the host is the consumer."""
        self.wait(timeout)

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the op has finished (``synchronize`` would return without blocking on the transport)."""


class CompletedHandle(Handle):
    """A handle for an op that finished when it was started (world size 1)."""

    def __init__(self, op: str):
        self.op = op

    def wait(self, timeout: Optional[float] = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class JointHandle(Handle):
    """Several ops that complete together (a rows reduction's two all-gathers; a sparse exchange's parts)."""

    def __init__(self, *handles: Handle):
        self._handles = handles
        self.op = "+".join(h.op for h in handles)

    def wait(self, timeout=None) -> None:
        for h in self._handles:
            h.wait(timeout)

    def synchronize(self, timeout=None) -> None:
        for h in self._handles:
            h.synchronize(timeout)

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)


class CollectiveBackend(abc.ABC):
    """The interface every transport implements."""

    name: str = "abstract"

    device: torch.device = torch.device("cpu")
    """Where tensors handed to this backend must live."""

    def __init__(self, rank: int, size: int, timeout: float):
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        self._closed = False
        self._forks: "weakref.WeakSet[CollectiveBackend]" = weakref.WeakSet()

    def _check_open(self, op_name: str, where: dict) -> None:
        if self._closed:
            where = dict(where)
            op_name = where.pop("op", op_name)
            raise CollectiveError(
                f"{op_name}: this collective backend is closed (dearopt.shutdown() was called)",
                rank=self.rank,
                op=op_name,
                **where,
            )

    def members(self) -> Optional[Tuple[int, ...]]:
        """The global ranks of this backend's communicator (None: the whole job)."""
        return None

    def check_peers(self, op: str, where: dict) -> None:
        """Raise :class:`~dearopt.errors.PeerFailedError` if a rank of this communicator posted a failure."""
        if self.size == 1:
            return
        posted = posted_failure(self.members())
        if posted is not None:
            raise peer_failed_error(posted, rank=self.rank, op=op, **where)

    def _track_fork(self, child: "CollectiveBackend") -> "CollectiveBackend":
        """Remember a fork so that :meth:`_close_forks` (called by ``close``) closes it too."""
        self._forks.add(child)
        return child

    def _close_forks(self) -> None:
        for child in list(self._forks):
            child.close()
        self._forks.clear()

    @abc.abstractmethod
    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor, **where) -> Handle:
        """Sum ``in_full`` over ranks and keep this rank's shard in ``out_shard``."""

    @abc.abstractmethod
    def all_gather(self, out_full: torch.Tensor, in_shard: torch.Tensor, **where) -> Handle:
        """Concatenate every rank's ``in_shard`` (in rank order) into ``out_full``."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", **where) -> Handle:
        """Reduce ``tensor`` over ranks in place (``op`` in :data:`REDUCE_OPS`)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int = 0, **where) -> Handle:
        """Copy ``root``'s ``tensor`` into every rank's ``tensor``."""

    def check_shapes(self, op: str, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Raise ``ValueError``/``TypeError`` unless ``full`` and ``shard`` are flat, contiguous, of one dtype, and
        ``full`` has exactly ``size`` times ``shard``'s elements (what reduce-scatter and all-gather need)."""
        if full.dim() != 1 or shard.dim() != 1:
            raise ValueError(
                f"{op}: tensors must be flat (1-D); got shapes {tuple(full.shape)} and {tuple(shard.shape)}"
            )
        if full.numel() != shard.numel() * self.size:
            raise ValueError(
                f"{op}: the full tensor has {full.numel()} elements but the shard has {shard.numel()} "
                f"and the world size is {self.size}; pad the full tensor with dearopt.backends.padded_numel"
            )
        if full.dtype != shard.dtype:
            raise TypeError(f"{op}: dtypes differ ({full.dtype} vs {shard.dtype})")
        if not full.is_contiguous() or not shard.is_contiguous():
            raise ValueError(f"{op}: tensors must be contiguous")

    def fork(self) -> "CollectiveBackend":
        """A backend over a separate communicator: its ops are never matched with this one's.

        The optimizer engine runs on a fork so that a user's own collectives
        (metrics, barriers) can never be paired with the engine's.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot fork a separate communicator")

    def second_link(self) -> "CollectiveBackend":
        """A communicator over the same ranks for concurrent traffic (DeFT's heterogeneous links): over another
        transport where this backend has one (gloo beside NCCL), else a :meth:`fork`."""
        return self.fork()

    def release_workspace(self) -> None:
        """Drop buffers kept between ops for reuse (none here).  Called when a re-plan makes new buckets, with
        nothing in flight: buffers sized and keyed for the old buckets would otherwise stay alive."""

    def has_room(self, nbytes: int, kind: Optional[str] = None) -> bool:
        """Whether an op of ``nbytes`` (of ``kind``: ``"reduce_scatter"``, ``"all_gather"``, ...; None: any) can
        start now without waiting for one in flight (a transport whose ops need buffers of a bounded workspace
        says no when it is full; never blocks)."""
        return True

    def make_room(self, nbytes: int, kind: Optional[str] = None) -> None:
        """Wait (with the timeout) until an op of ``nbytes`` has room; for an op that is due now."""

    def close(self) -> None:
        """Release resources, this backend's forks' first; the backend is unusable afterwards."""
        self._closed = True
        self._close_forks()


class _ThenHandle(Handle):
    """``inner``, then ``then()`` once its result is usable (the narrowing copy of a widened op)."""

    def __init__(self, inner: Handle, then: Callable[[], None]):
        self.op = getattr(inner, "op", "collective")
        self._inner = inner
        self._then = then

    def _done(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def wait(self, timeout: Optional[float] = None) -> None:
        self._inner.wait(timeout)
        self._done()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        self._inner.synchronize(timeout)
        self._done()

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class _TorchHandle(Handle):
    __slots__ = ("_backend", "_work", "op", "_where", "_finish", "_waited", "_finished", "_lock")

    def __init__(
        self,
        backend: "TorchDistBackend",
        work,
        op: str,
        where: dict,
        finish: Optional[Callable[[], None]] = None,
    ):
        self._backend = backend
        self._work = work
        if "op" in where:  # a caller may name the op it is part of ("check_model")
            where = dict(where)
            op = where.pop("op")
        self.op = op
        self._where = where
        self._finish = finish
        self._waited = False  # wait() returned: the result may be used
        self._finished = False  # the host saw the op finish
        # wait() from two threads at once (ReduceScatterThenGather's helper and a workspace making room): the
        # second waits for the first, which lets go of the work object when done
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        if self._finished:
            return True
        try:
            self._finished = bool(self._work.is_completed())
        except Exception:  # the transport failed; wait() will raise it
            return True
        return self._finished

    def _seconds(self, timeout: Optional[float]) -> float:
        return self._backend.timeout if timeout is None else float(timeout)

    def _running(self) -> bool:
        try:
            return not self._work.is_completed()
        except Exception:
            return False

    def _succeeded(self) -> bool:
        """Whether the finished work ended without an error (a wait on it returns at once)."""
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=FAULT_POLL_SECONDS))
            return True
        except Exception:
            return False

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._waited:
            return
        with self._lock:
            if self._waited:
                return
            work = self._work
            if not self._backend.host_waits:  # NCCL: wait() orders the current stream after the op, the host goes on
                try:
                    work.wait()
                except Exception as exc:
                    raise translate_error(exc, rank=self._backend.rank, op=self.op, **self._where) from exc
                done = True
            else:
                try:  # the usual case at a due moment: the op has finished
                    done = work.is_completed() and work.wait() is not None
                except Exception:  # it failed: the slow path names the error
                    done = False
            if not done:
                self._wait(timeout)
            elif self._finish is not None:
                self._finish()
                self._finish = None
            self._waited = True
            if self._backend.host_waits:  # gloo: the host itself waited for the op
                self._finished = True
                # torch's work object holds the op's tensors (a workspace buffer, kept for reuse or let go) until
                # it is destroyed; this handle lives on in the engine until the next round: let them go now
                self._work = None

    def _wait(self, timeout: Optional[float]) -> None:
        deadline = time.monotonic() + self._seconds(timeout)
        while True:  # in slices of FAULT_POLL_SECONDS: between them, a failure a peer posted is looked for
            left = deadline - time.monotonic()
            try:
                self._work.wait(timeout=datetime.timedelta(seconds=max(min(left, FAULT_POLL_SECONDS), 0.001)))
                break
            except Exception as exc:
                if self._running():  # only this slice ran out
                    self._backend.check_peers(self.op, self._where)
                    if time.monotonic() < deadline:
                        continue
                elif self._succeeded():  # it finished as the slice ran out (its end seen late: a busy GIL)
                    break
                raise translate_error(exc, rank=self._backend.rank, op=self.op, **self._where) from exc
        if self._finish is not None:
            self._finish()
            self._finish = None

    def synchronize(self, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + self._seconds(timeout)
        self.wait(timeout)
        poll = time.monotonic() + FAULT_POLL_SECONDS
        while not self.is_completed():  # NCCL: wait() ordered the stream; now the host waits
            if time.monotonic() > poll:
                self._backend.check_peers(self.op, self._where)
                poll = time.monotonic() + FAULT_POLL_SECONDS
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"{self.op} did not finish in time", rank=self._backend.rank, op=self.op, **self._where
                )
            time.sleep(0.0002)
        self._finished = True


class ReduceScatterThenGather:
    """A sum over ranks in place as a reduce-scatter on one communicator, then an all-gather on another.

    On gloo this moves the same bytes as a ring all-reduce but measured 1.4-1.7x faster here (its all-reduce
    reduces on one thread).  ``start`` begins the reduce-scatter and returns at once; a helper thread waits
    for the reduce-scatters in the order they were started and starts each one's all-gather on the second
    communicator, so either communicator sees its ops in the same order on every rank whatever the timing,
    and the caller never blocks between the halves.  The handle's ``wait`` has the backends' timeout and
    names the rank, the op and the bucket, like every other wait.
    """

    def __init__(self, scatter: "CollectiveBackend", gather: "CollectiveBackend"):
        self.scatter, self.gather = scatter, gather
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="dearopt-rs-then-ag", daemon=True)
        self._thread.start()

    def start(self, full: torch.Tensor, shard: torch.Tensor, **where) -> Handle:
        """Sum ``full`` over ranks in place; ``shard`` (``full.numel() / size`` elements) is the scratch the
        reduce-scatter writes this rank's part into."""
        handle = _ChainedHandle(self.scatter.reduce_scatter(shard, full, **where), self.scatter, where)
        self._queue.put((handle, full, shard, where))
        return handle

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, full, shard, where = item
            try:
                handle.first.wait()
                handle.second = self.gather.all_gather(full, shard, **where)
            except BaseException as exc:  # raised to whoever waits on the handle
                handle.error = exc
            handle.started.set()

    def close(self) -> None:
        """Stop the helper thread once the ops already started have been handed on."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self.scatter.timeout)


class _ChainedHandle(Handle):
    op = "reduce_scatter+all_gather"

    def __init__(self, first: Handle, backend: "CollectiveBackend", where: dict):
        self.first, self.second = first, None
        self.error: Optional[BaseException] = None
        self.started = threading.Event()  # the all-gather was started (or the reduce-scatter failed)
        self._backend, self._where = backend, where

    def _second(self, timeout: Optional[float]) -> Handle:
        seconds = self._backend.timeout if timeout is None else float(timeout)
        if not self.started.wait(seconds):
            raise CollectiveTimeoutError(
                f"{self.op}: the reduce-scatter did not complete in time",
                rank=self._backend.rank,
                op=self.op,
                **self._where,
            )
        if self.error is not None:
            raise self.error
        return self.second

    def wait(self, timeout: Optional[float] = None) -> None:
        self._second(timeout).wait(timeout)

    def synchronize(self, timeout: Optional[float] = None) -> None:
        self._second(timeout).synchronize(timeout)

    def is_completed(self) -> bool:
        return self.started.is_set() and (self.error is not None or self.second.is_completed())


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_GLOO_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


def workspace_buffer_bytes(nbytes: float, largest: float, budget: float) -> float:
    """The bytes of gloo's workspace an op of ``nbytes`` holds while in flight, where the largest buffer made so
    far has ``largest``: one of that size where the op needs at least half of it (so that one size serves the
    buckets, whatever theirs, and a step allocates nothing); a smaller op, or one larger than the ``budget`` (a
    buffer of its own, never kept), its own size.  :mod:`dearopt.sim` replays the workspace with it."""
    if nbytes > budget or 2 * nbytes < largest:
        return nbytes
    return max(nbytes, largest)


def workspace_op_bytes(kind: Optional[str], nbytes: float, world: int) -> float:
    """The bytes of gloo's workspace an op of ``kind`` on a buffer of ``nbytes`` (the full one) needs on ``world``
    ranks: a reduce-scatter's receive buffer and an all-gather's send buffer are the full size; on two ranks a
    reduce-scatter receives only the peer's half (a shard's bytes) and an all-gather sends the shard itself (none).
    Other ops (an all-reduce runs in place) need none; ``kind`` None: any op, counted as the full size.
    :mod:`dearopt.sim` replays the workspace with it."""
    if kind is None:
        return nbytes
    if kind == "reduce_scatter":
        return nbytes / 2 if world == 2 else nbytes
    if kind in ("all_gather", "all_gather_rows"):
        return 0.0 if world == 2 else nbytes
    return 0.0


_SPARE_SUBGROUPS: Dict[tuple, list] = {}
"""Groups of closed forks over a subset of the ranks, by ``(default group, members, kind)``, for the next fork over
the same members.  torch names a group made by its members alone after its ranks and the number of groups this
process holds, so a group made again after one over the same ranks was destroyed would meet under the old one's
name, find its peers' stale addresses in the store and fail to connect.  Cleared when the default group goes
(:func:`dearopt.backends.runtime.shutdown`)."""


class TorchDistBackend(CollectiveBackend):
    """Collectives over an initialized ``torch.distributed`` process group.

    On gloo, ``reduce_scatter_tensor`` costs as much as a whole all-reduce, so
    reduce-scatter is done as ``all_to_all_single`` followed by a local sum of
    the received chunks, which moves the same bytes as the reduce-scatter half
    of a ring all-reduce (see ``scripts/collective_bench.py``).  On NCCL the
    native ``reduce_scatter_tensor`` is used.
    """

    name = "torch"
    workspace_bytes = 64 * 2**20
    """gloo: the reduce-scatters' receive buffers and the all-gathers' send buffers, in flight and kept for reuse,
    at most this many bytes together (or one op's, if that is more)."""

    def __init__(self, rank: int, size: int, timeout: float, group=None, owns_group: bool = True):
        super().__init__(rank, size, timeout)
        self.group = group
        self._owns_group = owns_group
        self.pg_backend = dist.get_backend(group)
        self.name = f"torch-{self.pg_backend}"
        self._workspace: Dict[tuple, List[torch.Tensor]] = {}  # spare receive buffers by (numel, dtype)
        self._largest_bytes = 0  # the largest workspace buffer made (within the budget)
        self._in_flight: Dict[int, tuple] = {}  # id(handle) -> (handle, receive buffer bytes), oldest first
        self._in_flight_bytes = 0
        self._use_all_to_all = self.pg_backend == "gloo"
        self._own: Optional[int] = None  # this rank in the group (two ranks: the all-to-alls' splits)
        # the process group's own methods: torch.distributed's Python functions around them cost ten Python calls
        # per collective (checks, logging); what they check is checked once here, and by the plan
        self._pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._a2a = _c10d.AllToAllOptions()
        self._sum = _c10d.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM
        self._rs = _c10d.ReduceScatterOptions()
        self._rs.reduceOp = dist.ReduceOp.SUM
        self._ag = _c10d.AllgatherOptions()
        self.host_waits = self.pg_backend == "gloo"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.pg_backend == "nccl" else torch.device("cpu")
        )

    def _start(self, op_name: str, where: dict, fn, *args, finish=None, **kwargs) -> Handle:
        where = dict(where)
        op_name = where.pop("op", op_name)
        try:
            work = fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as exc:
            raise translate_error(exc, rank=self.rank, op=op_name, **where) from exc
        return _TorchHandle(self, work, op_name, where, finish)

    @staticmethod
    def _then(handle: Handle, then: Callable[[], None]) -> Handle:
        return _ThenHandle(handle, then)

    def _widened(self, tensors):
        """Gloo has no 16-bit integers: such tensors travel widened (exact, also for sums, which wrap alike).

        Returns the tensors to hand to torch.distributed and a function that
        copies the wide results back, or ``None`` when nothing was widened.
        """
        if self.pg_backend != "gloo" or tensors[0].dtype not in _GLOO_WIDER:
            return tensors, None
        wide = [t.to(_GLOO_WIDER[t.dtype]) for t in tensors]

        def narrow():
            for t, w in zip(tensors, wide):
                t.copy_(w)

        return wide, narrow

    def fork(self, pg_backend: Optional[str] = None) -> "TorchDistBackend":
        """A new process group over the same ranks (of ``pg_backend``, default this one's)."""
        self._check_open("fork", {})
        if self.size == 1:  # nothing is ever exchanged: no new communicator (none to agree on with anyone)
            return self._track_fork(TorchDistBackend(self.rank, 1, self.timeout, group=self.group, owns_group=False))
        timeout = datetime.timedelta(seconds=self.timeout)
        kind = pg_backend or self.pg_backend
        members = None if self.group is None else dist.get_process_group_ranks(self.group)
        if members is None or len(members) == dist.get_world_size():
            group = dist.new_group(backend=kind, timeout=timeout)
        else:  # a subset of the ranks: only its members take part in making the new group
            key = (dist.group.WORLD, tuple(members), kind)
            spare = _SPARE_SUBGROUPS.get(key)
            if spare:  # one a closed fork left (see _SPARE_SUBGROUPS): every member takes it at the same fork
                group = spare.pop()
            else:
                group = dist.new_group(ranks=members, backend=kind, timeout=timeout, use_local_synchronization=True)
            child = TorchDistBackend(self.rank, self.size, self.timeout, group=group)
            child._spare_key = key
            return self._track_fork(child)
        return self._track_fork(TorchDistBackend(self.rank, self.size, self.timeout, group=group))

    def members(self) -> Optional[Tuple[int, ...]]:
        if self.group is None:
            return None
        if not hasattr(self, "_members"):
            try:
                self._members = tuple(dist.get_process_group_ranks(self.group))
            except Exception:  # torn down
                return None
        return self._members

    def second_link(self) -> "TorchDistBackend":
        """Beside NCCL: a gloo group (its all-reduce takes CUDA tensors through host memory); beside gloo:
        another gloo group (its own connections and thread)."""
        return self.fork("gloo")

    def close(self) -> None:
        """Close the forks made from this backend, then this one's own group.

        The group object is released here, not left to whoever still holds
        this backend: a process group's worker threads are joined only when
        its last reference goes, and if that happened while the interpreter
        is finalizing (an optimizer freed at exit), a worker thread dropping
        its last tensor could not take the GIL and the process would abort.
        """
        if self._closed:
            return
        super().close()
        group, self.group = self.group, None
        self._pg = None  # (the default group's object is not kept alive by a closed backend)
        key = getattr(self, "_spare_key", None)
        if group is not None and key is not None and key[0] is dist.group.WORLD and dist.is_initialized():
            _SPARE_SUBGROUPS.setdefault(key, []).append(group)  # kept for the next fork over these ranks
        elif group is not None and self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # already torn down with the default group
                pass
        self._workspace.clear()

    def release_workspace(self) -> None:
        """The spare receive buffers of the reduce-scatters (sized for the old buckets)."""
        self._workspace.clear()
        self._largest_bytes = 0

    def _run(self, op: str, where: dict, start, *args) -> Any:
        """``start(*args)``: a process group method that starts a collective; its transport error named."""
        if self._closed:
            self._check_open(op, where)
        try:
            return start(*args)
        except Exception as exc:
            where = dict(where)
            op = where.pop("op", op)
            raise translate_error(exc, rank=self.rank, op=op, **where) from exc

    def reduce_scatter(self, out_shard, in_full, **where) -> Handle:
        if self.size == 1 or self._closed or (self._use_all_to_all and in_full.dtype in _GLOO_WIDER):
            return self._reduce_scatter_rarely(out_shard, in_full, where)
        if not self._use_all_to_all:
            work = self._run("reduce_scatter", where, self._pg._reduce_scatter_base, out_shard, in_full, self._rs)
            return _TorchHandle(self, work, "reduce_scatter", where)
        # through .data: the sum is the collective's result, not an in-place change that autograd's version
        # counter (which the engine watches for the user's writes) should see; NCCL writes from C++ alike
        result = out_shard.data
        if self.size == 2:  # (every rank of the pair takes this path: the splits must agree)
            # two ranks: only the peer's half goes out, only the peer's half of ours comes in (a buffer of a
            # shard), and the sum adds it to our own half where it lies: no local copy of our half through
            # gloo, a receive buffer half the size, and an elementwise add instead of a sum over a dimension
            # (gloo, 25 MiB, both ranks' CPU: 25 ms against 39 ms before, an all-reduce 40 ms)
            halves = in_full.contiguous().view(2, -1)  # (a copy only where the buffer is not contiguous)
            recv = self._workspace_like(out_shard)
            mine, theirs, splits = halves[self._pair_rank], halves[1 - self._pair_rank], self._pair_splits(recv)

            def add():
                torch.add(mine.reshape(result.shape), recv, out=result)

            sent, received = theirs, recv.view(-1)  # (flat: the splits count elements of dim 0)
        else:
            recv = self._workspace_like(in_full)
            chunks = recv.view(self.size, out_shard.numel())
            splits = []

            def add():
                torch.sum(chunks, dim=0, out=result)

            sent, received = in_full, recv
        nbytes = self._bytes_of(recv)

        def finish():
            add()
            self._in_flight.pop(id(handle), None)
            self._in_flight_bytes -= nbytes
            self._spare(recv)

        work = self._run("reduce_scatter", where, self._pg.alltoall_base, received, sent, splits, splits, self._a2a)
        handle = _TorchHandle(self, work, "reduce_scatter", where, finish)
        self._in_flight[id(handle)] = (handle, nbytes)
        self._in_flight_bytes += nbytes
        return handle

    @property
    def _pair_rank(self) -> int:
        """This rank's place in its two-rank group (what an all-to-all's splits are indexed by)."""
        if self._own is None:
            self._own = self._pg.rank()
        return self._own

    def _pair_splits(self, shard: torch.Tensor) -> List[int]:
        """A two-rank all-to-all's splits that move ``shard``'s elements to and from the peer only."""
        return [0, shard.numel()] if self._pair_rank == 0 else [shard.numel(), 0]

    def _reduce_scatter_rarely(self, out_shard, in_full, where) -> Handle:
        """One rank, a closed backend, 16-bit integers on gloo: the cases off the hot path."""
        self._check_open("reduce_scatter", where)
        self.check_shapes("reduce_scatter", in_full, out_shard)
        if self.size == 1:
            out_shard.copy_(in_full)
            return CompletedHandle("reduce_scatter")
        (wide_out, wide_in), narrow = self._widened([out_shard, in_full])
        if narrow is not None:
            return self._then(self.reduce_scatter(wide_out, wide_in, **where), narrow)
        return self.reduce_scatter(out_shard, in_full, **where)

    def has_room(self, nbytes: int, kind: Optional[str] = None) -> bool:
        """gloo: whether the reduce-scatters' and all-gathers' workspace holds another op of ``nbytes`` now (in the
        buffer it would take, :meth:`_buffer_bytes` of :func:`workspace_op_bytes`); ops in flight that have
        finished are reaped first (their sums taken, their buffers spared).  Never waits: it is asked in gradient
        hooks, on the thread that runs backward, which must not wait for the link."""
        need = workspace_op_bytes(kind, nbytes, self.size)
        if not self._use_all_to_all or not need:
            return True
        taken = self._buffer_bytes(need)
        if self._in_flight_bytes + taken <= max(self.workspace_bytes, taken):
            return True
        for handle, _ in list(self._in_flight.values()):
            if not handle.is_completed():
                break
            handle.wait()  # (gloo finishes ops in issue order)
        return self._in_flight_bytes + taken <= max(self.workspace_bytes, taken)

    def make_room(self, nbytes: int, kind: Optional[str] = None) -> None:
        """Wait for the oldest ops in flight until another op of ``nbytes`` fits in the workspace (an op due now)."""
        taken = self._buffer_bytes(workspace_op_bytes(kind, nbytes, self.size))
        budget = max(self.workspace_bytes, taken)
        while self._in_flight and self._in_flight_bytes + taken > budget:
            oldest, _ = next(iter(self._in_flight.values()))
            oldest.wait()  # runs its finish: sums into its shard, spares its buffer

    def _buffer_bytes(self, nbytes: int) -> int:
        """The bytes of the workspace buffer an op of ``nbytes`` takes (:func:`workspace_buffer_bytes`)."""
        return workspace_buffer_bytes(nbytes, self._largest_bytes, self.workspace_bytes)

    def _workspace_like(self, full: torch.Tensor) -> torch.Tensor:
        """gloo: a buffer for a reduce-scatter's receive or an all-gather's send as large as ``full``, within
        :attr:`workspace_bytes` for the buffers in flight together: past it, the oldest such ops in flight are
        waited for first (gloo runs one op at a time in issue order, so the link stays busy with the ones behind
        them) and their buffers reused.  The engine's issuer asks :meth:`has_room` first and holds an op back
        instead, so that a gradient hook never waits here.

        The buffer is the front of a spare one of the size :meth:`_buffer_bytes` gives (a new one where none is
        spare): after the first step the buckets' ops take buffers of the largest bucket's size and reuse them,
        and a step allocates nothing here.  Spares kept per exact size (before) let one go and made another
        whenever buckets of different sizes alternated: a bucket-sized block freed and made again in every
        forward and backward, between the activations, which the host's allocator does not give back (BERT-Base
        under ``dear``, 2 ranks: 17 blocks of 18-25 MiB a step)."""
        numel, dtype = full.numel(), full.dtype
        need = numel * full.element_size()
        taken = self._buffer_bytes(need)
        if self._in_flight_bytes + taken > max(self.workspace_bytes, taken):
            self.make_room(need)
        if need > self.workspace_bytes:
            return torch.empty_like(full)
        size = -(-taken // full.element_size())
        self._largest_bytes = max(self._largest_bytes, taken)
        spares = self._workspace.get((size, dtype))
        if spares:
            buffer = spares.pop()
            if not spares:
                del self._workspace[(size, dtype)]
        else:
            buffer = torch.empty(size, dtype=dtype, device=full.device)
        return buffer[:numel].view(full.shape)

    @staticmethod
    def _buffer_of(used: torch.Tensor) -> torch.Tensor:
        """The workspace buffer ``used`` is the front of."""
        return used if used._base is None else used._base

    def _bytes_of(self, used: torch.Tensor) -> int:
        """The bytes of the workspace buffer ``used`` is the front of (what it holds while in flight)."""
        buffer = self._buffer_of(used)
        return buffer.numel() * buffer.element_size()

    def _spare(self, used: torch.Tensor) -> None:
        """Keep a finished op's buffer for the next op (a new one costs its page faults again), within the budget:
        the spares kept longest make room; one larger than the budget is let go."""
        buffer = self._buffer_of(used)
        size = self._bytes_of(buffer)
        if size > self.workspace_bytes:  # one op larger than the budget: not kept (its page faults each time)
            return
        kept = sum(t.numel() * t.element_size() for ts in self._workspace.values() for t in ts)
        while self._workspace and kept + size > self.workspace_bytes:
            key = next(iter(self._workspace))
            spares = self._workspace[key]
            if spares:
                old = spares.pop(0)
                kept -= old.numel() * old.element_size()
            if not spares:
                del self._workspace[key]
        self._workspace.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    def all_gather(self, out_full, in_shard, **where) -> Handle:
        if self.size == 1 or self._closed or (self._use_all_to_all and in_shard.dtype in _GLOO_WIDER):
            return self._all_gather_rarely(out_full, in_shard, where)
        if not self._use_all_to_all:
            work = self._run("all_gather", where, self._pg._allgather_base, out_full, in_shard, self._ag)
            return _TorchHandle(self, work, "all_gather", where)
        # gloo's all-gather copies through a temporary as large as the output, made when the op is issued and kept
        # while it waits its turn: with a model's all-gathers issued at once that is a whole model's worth.  An
        # all-to-all of the shard sent to every rank writes the output in place, from a send buffer of the
        # bounded workspace (the same bytes on the link).
        if self.size == 2 and out_full.is_contiguous():
            # two ranks: the shard itself goes out and the peer's comes into its half of the output; no send
            # buffer (gloo, 25 MiB, both ranks' CPU: 25 ms against 39 ms through one).  The shard is read
            # until the op completes, as NCCL's and gloo's own all-gathers read theirs
            halves = out_full.view(2, -1)
            mine = halves[self._pair_rank]
            if mine.data_ptr() != in_shard.data_ptr():  # (in place: the shard is already our half)
                mine.copy_(in_shard.view(mine.shape))
            splits = self._pair_splits(in_shard)
            work = self._run(
                "all_gather",
                where,
                self._pg.alltoall_base,
                halves[1 - self._pair_rank],
                in_shard.contiguous().view(-1),
                splits,
                splits,
                self._a2a,
            )
            return _TorchHandle(self, work, "all_gather", where)
        send = self._workspace_like(out_full)
        send.view(self.size, -1).copy_(in_shard.view(1, -1).expand(self.size, -1))
        nbytes = self._bytes_of(send)

        def finish():
            self._in_flight.pop(id(handle), None)
            self._in_flight_bytes -= nbytes
            self._spare(send)

        work = self._run("all_gather", where, self._pg.alltoall_base, out_full, send, [], [], self._a2a)
        handle = _TorchHandle(self, work, "all_gather", where, finish)
        self._in_flight[id(handle)] = (handle, nbytes)
        self._in_flight_bytes += nbytes
        return handle

    def _all_gather_rarely(self, out_full, in_shard, where) -> Handle:
        """One rank, a closed backend, 16-bit integers on gloo: the cases off the hot path."""
        self._check_open("all_gather", where)
        self.check_shapes("all_gather", out_full, in_shard)
        if self.size == 1:
            out_full.copy_(in_shard)
            return CompletedHandle("all_gather")
        (wide_out, wide_in), narrow = self._widened([out_full, in_shard])
        if narrow is not None:
            return self._then(self.all_gather(wide_out, wide_in, **where), narrow)
        return self.all_gather(out_full, in_shard, **where)

    def all_reduce(self, tensor, op: str = "sum", **where) -> Handle:
        if (
            op == "sum"
            and not self._closed
            and self.size > 1
            and not (self._use_all_to_all and tensor.dtype in _GLOO_WIDER)
        ):
            work = self._run("all_reduce", where, self._pg.allreduce, [tensor], self._sum)
            return _TorchHandle(self, work, "all_reduce", where)
        self._check_open("all_reduce", where)
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {REDUCE_OPS}")
        if self.size == 1:
            return CompletedHandle("all_reduce")
        (wide,), narrow = self._widened([tensor])
        if narrow is not None:
            return self._then(self.all_reduce(wide, op, **where), narrow)
        if op == "avg":
            size = self.size

            def finish():
                tensor.div_(size)

            return self._start("all_reduce", where, dist.all_reduce, tensor, op=dist.ReduceOp.SUM, finish=finish)
        return self._start("all_reduce", where, dist.all_reduce, tensor, op=_TORCH_OPS[op])

    def broadcast(self, tensor, root: int = 0, **where) -> Handle:
        self._check_open("broadcast", where)
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of a world of size {self.size}")
        if self.size == 1:
            return CompletedHandle("broadcast")
        (wide,), narrow = self._widened([tensor])
        if narrow is not None:
            return self._then(self.broadcast(wide, root, **where), narrow)
        # torch names the source by its rank in the whole job
        src = root if self.group is None else dist.get_global_rank(self.group, root)
        return self._start("broadcast", where, dist.broadcast, tensor, src=src)
