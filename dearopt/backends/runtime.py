"""The process-wide runtime: ``init()``, who am I, and the collective backend.

``init()`` works under torchrun, horovodrun, OpenMPI's ``mpirun``,
MPICH/Hydra, Slurm's ``srun`` and with no launcher at all (a world of one).
Rank 0 (or torchrun's agent) serves a TCP store at ``MASTER_ADDR:MASTER_PORT``
when they are set; otherwise on a port of its choosing, whose address it
publishes on horovodrun's rendezvous server (``HOROVOD_GLOO_RENDEZVOUS_ADDR``)
or sends over mpi4py (MPI launchers).  The store is kept for the life of the
process and each ``init()`` meets under a key prefix of its own, so
``shutdown(); init()`` joins anew under every launcher, every wait with a
timeout.  If ``torch.distributed`` is already initialized (for example by a
script that also uses DDP), that process group is adopted instead of creating
a new one.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import re
import socket
import sys
import time
import weakref
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from dearopt.backends.base import _SPARE_SUBGROUPS, CollectiveBackend, TorchDistBackend
from dearopt.errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
    LaunchEnvironmentError,
    NotInitializedError,
)
from dearopt.backends.launch import LaunchInfo, detect_launch, kv_put, kv_wait, route_address

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "launch_info",
    "get_backend",
    "get_timeout",
    "on_leave",
    "complete_pending",
    "DEFAULT_TIMEOUT",
    "BACKENDS",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds any wait on a collective may take before it raises.

Five minutes: long enough for a slow rank's checkpoint write or a first
iteration's warm-up, short enough that a hung job is noticed.  Override with
``init(timeout=...)`` or ``DEAROPT_TIMEOUT``."""

BACKENDS = ("gloo", "nccl", "nccl-native", "cuda-relay")


@dataclasses.dataclass
class _Runtime:
    launch: LaunchInfo
    backend: CollectiveBackend
    timeout: float
    owns_process_group: bool


_runtime: Optional[_Runtime] = None
_exit_hook_registered = False
_leave_hooks: list = []  # weak methods called when this process leaves the job (pending work completed)
_unhandled_error = False  # an exception reached the top of the main thread: leave without completing anything


def _resolve_timeout(timeout: Optional[float], env: Mapping[str, str]) -> float:
    if timeout is None:
        raw = env.get("DEAROPT_TIMEOUT")
        if raw:
            try:
                timeout = float(raw)
            except ValueError:
                raise LaunchEnvironmentError(f"DEAROPT_TIMEOUT={raw!r} is not a number of seconds") from None
        else:
            timeout = DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _resolve_backend(backend: Optional[str]) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    backend = backend.lower()
    if backend in ("nccl", "nccl-native", "cuda-relay") and not torch.cuda.is_available():
        raise BackendUnavailableError(f"backend {backend!r} needs a CUDA GPU, and torch sees none; use 'gloo'")
    return backend


def _first_slurm_host(nodelist: str) -> Optional[str]:
    """First host of a Slurm node list such as ``node[03-05,9],gpu1``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return None
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


_STORE_SCOPE = "dearopt"
"""The scope dearopt uses on horovodrun's rendezvous server (Horovod's own are ``global``, ``local_*``, ``cross_*``)."""

_generation = 0
"""How many times this process has started to join a job.  Each :func:`init`
meets its peers under the key prefix of its generation, so a re-init after
:func:`shutdown` never reads keys (peer addresses, counters) that an earlier
generation left in the store, whichever rank arrives first."""

_kept_store = None
"""``(identity, store)``: the TCP store of this process's job, made at its first
:func:`init` and kept for the life of the process.  Rank 0 serves it; were it
closed at :func:`shutdown`, a rank that re-inits sooner than rank 0 could
connect to the old server as it closes (or, on a fixed ``MASTER_PORT``, to
the port while nobody listens)."""


def _rendezvous_deadline_error(what: str, seconds: float, rank: int) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"rendezvous: {what} within {seconds:g} s (the timeout); did every rank call init() (again, after shutdown())?",
        rank=rank,
        op="rendezvous",
    )


def _mpi_agree(comm, launch: LaunchInfo, choose, seconds: float):
    """Rank 0 learns every rank's host name and sends ``choose(hosts)`` to all; each wait has a deadline.

    Point-to-point messages polled with ``iprobe``/``test`` (MPI's blocking
    collectives cannot be given a timeout).
    """
    tag = 0x0DEA
    deadline = time.monotonic() + seconds
    me, n = comm.Get_rank(), comm.Get_size()

    def until(ready, what):
        pause = 0.0005
        while not ready():
            if time.monotonic() >= deadline:
                raise _rendezvous_deadline_error(what, seconds, launch.rank)
            time.sleep(pause)
            pause = min(0.02, pause * 2)

    host = socket.gethostname()
    if me == 0:
        hosts = [host]
        for peer in range(1, n):
            until(lambda: comm.iprobe(source=peer, tag=tag), f"rank {peer} did not send its host name over MPI")
            hosts.append(comm.recv(source=peer, tag=tag))
        chosen = choose(hosts)
        requests = [comm.isend(chosen, dest=peer, tag=tag) for peer in range(1, n)]
        for peer, request in enumerate(requests, start=1):
            until(lambda: request.test()[0], f"rank {peer} did not take the store's address over MPI")
        return chosen
    request = comm.isend(host, dest=0, tag=tag)
    until(lambda: comm.iprobe(source=0, tag=tag), "rank 0 did not send the store's address over MPI")
    chosen = comm.recv(source=0, tag=tag)
    until(lambda: request.test()[0], "rank 0 did not take this rank's host name over MPI")
    return chosen


def _tcp_store(addr: str, port: int, launch: LaunchInfo, seconds: float, serve: bool):
    """Rank 0's server (``serve``), or a client of ``addr:port`` that retries connecting until the timeout."""
    timeout = datetime.timedelta(seconds=seconds)
    if serve:
        return dist.TCPStore(addr, port, launch.size, True, timeout, wait_for_workers=False, multi_tenant=True)
    return dist.TCPStore(addr, port, launch.size, False, timeout)


def _make_store(launch: LaunchInfo, env: Mapping[str, str], seconds: float):
    addr, port = launch.master_addr, launch.master_port
    if addr and port:
        # torchrun's agent serves the store itself (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does.
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return _tcp_store(addr, port, launch, seconds, serve=launch.rank == 0 and not agent)
    if launch.rendezvous_server is not None:
        # horovodrun's gloo mode: rank 0 serves a store on a port of its choosing and publishes its address
        # on horovodrun's HTTP rendezvous server; the others read it from there.
        server = launch.rendezvous_server
        if launch.rank == 0:
            own = route_address(*server)
            store = _tcp_store(own, port or 0, launch, seconds, serve=True)
            kv_put(server, _STORE_SCOPE, "store", f"{own}:{store.port}".encode(), timeout=seconds)
            return store
        value = kv_wait(server, _STORE_SCOPE, "store", seconds, waiting_for="rank 0 publishes its store there")
        host, _, served = value.decode().rpartition(":")
        return _tcp_store(host, int(served), launch, seconds, serve=False)
    if launch.launched_by_mpi or launch.launcher == "slurm":
        try:
            from mpi4py import MPI  # noqa: WPS433 (imported only when MPI launched us)
        except ImportError:
            MPI = None
        if MPI is not None and MPI.COMM_WORLD.Get_size() == launch.size:
            if launch.rank == 0:
                box = {}

                def serve(hosts):
                    own = addr or ("127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname()))
                    box["store"] = _tcp_store(own, port or 0, launch, seconds, serve=True)
                    return own, box["store"].port

                _mpi_agree(MPI.COMM_WORLD, launch, serve, seconds)
                return box["store"]
            host, served = _mpi_agree(MPI.COMM_WORLD, launch, None, seconds)
            return _tcp_store(host, served, launch, seconds, serve=False)
        if launch.launcher == "slurm":
            host = addr or _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", ""))
            job = int(env.get("SLURM_JOB_ID", "0") or 0)
            if host:
                port = port or 20000 + job % 20000
                return _tcp_store(host, port, launch, seconds, serve=launch.rank == 0)
        raise LaunchEnvironmentError(
            f"{launch.launcher} launched this job but MASTER_ADDR/MASTER_PORT are not set and mpi4py "
            "is not available to agree on them; `pip install dearopt[mpi]` or export MASTER_ADDR and MASTER_PORT"
        )
    missing = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not value]
    hint = (
        " (or HOROVOD_GLOO_RENDEZVOUS_ADDR/HOROVOD_GLOO_RENDEZVOUS_PORT, which horovodrun sets)"
        if launch.launcher == "horovod"
        else ""
    )
    raise LaunchEnvironmentError(
        f"{launch.launcher} launched {launch.size} processes but {', '.join(missing)} is not set{hint}"
    )


def _rendezvous_store(launch: LaunchInfo, env: Mapping[str, str], seconds: float):
    """The job's TCP store: made at the first :func:`init` of this process and kept (see ``_kept_store``)."""
    global _kept_store
    identity = (
        launch.launcher,
        launch.rank,
        launch.size,
        launch.master_addr,
        launch.master_port,
        launch.rendezvous_server,
        env.get("TORCHELASTIC_RUN_ID"),
        env.get("TORCHELASTIC_RESTART_COUNT"),
    )
    if _kept_store is not None and _kept_store[0] == identity:
        store = _kept_store[1]
        store.set_timeout(datetime.timedelta(seconds=seconds))
        return store
    _kept_store = None  # another job's (the environment changed): released
    store = _make_store(launch, env, seconds)
    _kept_store = (identity, store)
    return store


def _join_process_group(launch: LaunchInfo, env: Mapping[str, str], seconds: float, **kwargs) -> None:
    """``init_process_group`` on the job's store, under this generation's key prefix; every wait has a timeout."""
    global _generation
    _generation += 1
    try:
        store = _rendezvous_store(launch, env, seconds)
        prefix = f"dearopt/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}.{_generation}/"
        dist.init_process_group(
            store=dist.PrefixStore(prefix, store), rank=launch.rank, world_size=launch.size, **kwargs
        )
    except dist.DistStoreError as exc:
        raise _rendezvous_deadline_error(
            f"not every rank arrived ({exc})".replace("\n", " ")[:600], seconds, launch.rank
        ) from exc
    except dist.DistNetworkError as exc:
        raise CollectiveError(
            f"rendezvous: the job's store failed: {exc}".replace("\n", " ")[:600], rank=launch.rank, op="rendezvous"
        ) from exc


def init(backend: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Join the job.  Safe to call more than once (later calls do nothing).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``"nccl-native"`` (the csrc
            extension; control traffic stays on gloo).  Default: NCCL when CUDA
            is available, gloo otherwise.  ``"cuda-relay"`` is a test backend
            (:mod:`dearopt.backends.relay`): NCCL's stream contract with the bytes moved
            through host memory and gloo, so that several ranks share one GPU.
        timeout: seconds any collective may take; default ``DEAROPT_TIMEOUT``
            or :data:`DEFAULT_TIMEOUT`.
    """
    global _runtime
    if _runtime is not None:
        return
    env = os.environ
    seconds = _resolve_timeout(timeout, env)
    chosen = _resolve_backend(backend)
    if dist.is_available() and dist.is_initialized():
        launch = detect_launch(env)
        launch = dataclasses.replace(launch, rank=dist.get_rank(), size=dist.get_world_size())
        owns = False
    else:
        launch = detect_launch(env)
        _bind_torch_defaults_before_init()
        pg_backend = "gloo" if chosen in ("nccl-native", "cuda-relay") else chosen
        if chosen == "nccl":
            torch.cuda.set_device(launch.local_rank % max(torch.cuda.device_count(), 1))
        kwargs = dict(backend=pg_backend, timeout=datetime.timedelta(seconds=seconds))
        if launch.size == 1 and not (launch.master_addr and launch.master_port):
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        else:
            _join_process_group(launch, env, seconds, **kwargs)
        owns = True
    comm: CollectiveBackend
    if chosen == "nccl-native":
        try:
            from dearopt.backends.nccl import NcclNativeBackend
        except ImportError as exc:
            if owns:
                dist.destroy_process_group()
            raise BackendUnavailableError(f"backend 'nccl-native' is not available: {exc}") from exc
        comm = NcclNativeBackend.create(launch.rank, launch.size, seconds)
    elif chosen == "cuda-relay":  # a test backend: CUDA tensors and streams, bytes through host memory and gloo
        from dearopt.backends.relay import HostRelayBackend

        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        comm = HostRelayBackend(TorchDistBackend(launch.rank, launch.size, seconds), device)
    else:
        comm = TorchDistBackend(launch.rank, launch.size, seconds)
    _runtime = _Runtime(launch=launch, backend=comm, timeout=seconds, owns_process_group=owns)
    _install_exit_hooks()


def _bind_torch_defaults_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated
    when the module is first imported; torch._dynamo imports it lazily (when
    the first optimizer is built, for one).  Imported after
    ``init_process_group``, ten functions would hold the default group
    forever, so ``destroy_process_group`` could not free it: gloo's worker
    threads would outlive :func:`shutdown` and, if one dropped a finished
    op's tensor while the interpreter was finalizing, abort the process
    ("terminate called without an active exception").  Imported now, the
    defaults are ``None``.
    """
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except Exception:  # an optional torch module; never a reason to fail init
        pass


def _shutdown_at_exit() -> None:
    global _kept_store
    try:
        shutdown(complete=not _unhandled_error)
    except Exception:  # a peer may be gone already; exiting anyway
        pass
    _kept_store = None  # the job's store (rank 0's server thread) closed while the interpreter is alive


def on_leave(method) -> None:
    """Call the bound ``method`` (held weakly) when this process leaves the job: :func:`shutdown`, interpreter
    exit, or ``torch.distributed.destroy_process_group()`` (a :class:`~dearopt.DistOptim` completes its pending
    updates there, so that a rank that alone saves or evaluates the model after the last step finds the others'
    part of the collectives that takes)."""
    _leave_hooks.append(weakref.WeakMethod(method))


def complete_pending() -> None:
    """Call the leave hooks (:func:`on_leave`) in the order they were registered; one that fails is logged and
    the others still run (a peer may have gone already)."""
    hooks, _leave_hooks[:] = list(_leave_hooks), []
    for ref in hooks:
        method = ref()
        if method is None:
            continue
        try:
            method()
        except Exception as exc:  # leaving anyway: say what was not completed
            logging.getLogger("dearopt").warning("dearopt: leaving the job without completing %s: %s", method, exc)


def shutdown(complete: bool = True) -> None:
    """Leave the job; :func:`init` may be called again afterwards.

    Every :class:`~dearopt.DistOptim` first applies its pending updates (``complete=False``: not; what a process
    leaving on an error does), so the parameters every rank leaves with include the last ``step()``, and a rank
    that saves or evaluates after the others left was joined in the collectives that needs.  Then every
    communicator dearopt made is closed, including those of existing
    :class:`~dearopt.DistOptim` objects: using one after ``shutdown()`` raises
    :class:`~dearopt.errors.CollectiveError`; make a new one after the next ``init()``.
    """
    global _runtime
    if _runtime is None:
        return
    if complete:
        complete_pending()
    runtime, _runtime = _runtime, None
    _leave_hooks.clear()
    runtime.backend.close()
    _SPARE_SUBGROUPS.clear()  # (they go with the default group)
    if runtime.owns_process_group and dist.is_initialized():
        _torch_destroy_process_group()


def _torch_destroy_process_group(*args, **kwargs):
    return _ORIGINAL_DESTROY(*args, **kwargs)


def _destroy_process_group(group=None):
    """``torch.distributed.destroy_process_group`` while dearopt is initialized: pending updates are completed
    first when the default group (and with it every group) goes (see :func:`on_leave`)."""
    if group is None or group is dist.GroupMember.WORLD:
        shutdown()  # pending updates completed; dearopt's communicators go with torch's groups
        if not dist.is_initialized():  # dearopt made the default group: it went with them
            return None
    return _ORIGINAL_DESTROY(group)


def _note_unhandled(kind, value, tb):
    """``sys.excepthook``: an exception ended the main thread; tell the peers (they stop waiting for this rank
    within a fraction of a second) and leave without completing pending work."""
    global _unhandled_error
    _unhandled_error = True
    if _runtime is not None and not isinstance(value, KeyboardInterrupt):
        from dearopt.backends.base import post_failure

        post_failure(value)
    _ORIGINAL_EXCEPTHOOK(kind, value, tb)


def _install_exit_hooks() -> None:
    """Once per process: leaving at interpreter exit, on ``destroy_process_group()``, and on an unhandled
    exception (see :func:`shutdown`)."""
    global _exit_hook_registered, _ORIGINAL_DESTROY, _ORIGINAL_EXCEPTHOOK
    if _exit_hook_registered:
        return
    # gloo's worker threads drop their last reference to a finished op's tensors after wait() has returned; if
    # that happens while the interpreter is finalizing, the thread cannot take the GIL and the process aborts.
    # Tearing the process groups down (which joins those threads) before finalization closes that window.
    atexit.register(_shutdown_at_exit)
    _ORIGINAL_DESTROY = dist.destroy_process_group
    dist.destroy_process_group = _destroy_process_group
    try:
        import torch.distributed.distributed_c10d as c10d

        c10d.destroy_process_group = _destroy_process_group
    except ImportError:  # pragma: no cover
        pass
    _ORIGINAL_EXCEPTHOOK = sys.excepthook
    sys.excepthook = _note_unhandled
    _exit_hook_registered = True


_ORIGINAL_DESTROY = dist.destroy_process_group if dist.is_available() else None
_ORIGINAL_EXCEPTHOOK = sys.excepthook


def is_initialized() -> bool:
    """True once :func:`dearopt.init` has run in this process (and :func:`dearopt.shutdown` has not)."""
    return _runtime is not None


def _require() -> _Runtime:
    if _runtime is None:
        raise NotInitializedError("dearopt is not initialized: call dearopt.init() first")
    return _runtime


def rank() -> int:
    """This process's rank in ``0..size()-1``."""
    return _require().launch.rank


def size() -> int:
    """The number of processes in the job."""
    return _require().launch.size


def local_rank() -> int:
    """This process's rank among the processes on its machine."""
    return _require().launch.local_rank


def local_size() -> int:
    """The number of processes on this machine."""
    return _require().launch.local_size


def launch_info() -> LaunchInfo:
    """How the launcher placed this process (its variables as read at :func:`init`)."""
    return _require().launch


def get_backend() -> CollectiveBackend:
    """The collective backend every dearopt component uses."""
    return _require().backend


def get_timeout() -> float:
    """Seconds any wait on a collective may take."""
    return _require().timeout
