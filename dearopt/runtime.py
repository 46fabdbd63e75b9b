"""The process-wide runtime: ``init()``, who am I, and the collective backend.

``init()`` works under torchrun, horovodrun, OpenMPI's ``mpirun``,
MPICH/Hydra, Slurm's ``srun`` and with no launcher at all (a world of one).
When MPI launched the job and ``MASTER_ADDR`` is not set, rank 0's address and
a free port are broadcast with mpi4py.  If ``torch.distributed`` is already
initialized (for example by a script that also uses DDP), that process group is
adopted instead of creating a new one.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import re
import socket
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .collectives import CollectiveBackend, TorchDistBackend
from .errors import BackendUnavailableError, LaunchEnvironmentError, NotInitializedError
from .launch import LaunchInfo, detect_launch, free_port

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "get_backend",
    "get_timeout",
    "DEFAULT_TIMEOUT",
    "BACKENDS",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds any wait on a collective may take before it raises.

Five minutes: long enough for a slow rank's checkpoint write or a first
iteration's warm-up, short enough that a hung job is noticed.  Override with
``init(timeout=...)`` or ``DEAROPT_TIMEOUT``."""

BACKENDS = ("gloo", "nccl", "nccl-native")


@dataclasses.dataclass
class _Runtime:
    launch: LaunchInfo
    backend: CollectiveBackend
    timeout: float
    owns_process_group: bool


_runtime: Optional[_Runtime] = None
_exit_hook_registered = False


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
    if backend in ("nccl", "nccl-native") and not torch.cuda.is_available():
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


def _rendezvous_address(launch: LaunchInfo, env: Mapping[str, str]):
    """Return (addr, port) for the TCP rendezvous, asking MPI when needed."""
    addr, port = launch.master_addr, launch.master_port
    if addr and port:
        return addr, port
    if launch.launched_by_mpi or launch.launcher == "slurm":
        try:
            from mpi4py import MPI  # noqa: WPS433 (imported only when MPI launched us)
        except ImportError:
            MPI = None
        if MPI is not None and MPI.COMM_WORLD.Get_size() == launch.size:
            comm = MPI.COMM_WORLD
            hosts = comm.allgather(socket.gethostname())
            if comm.Get_rank() == 0:
                same_host = len(set(hosts)) == 1
                chosen_addr = addr or ("127.0.0.1" if same_host else socket.gethostbyname(socket.gethostname()))
                chosen = (chosen_addr, port or free_port(""))
            else:
                chosen = None
            return comm.bcast(chosen, root=0)
        if launch.launcher == "slurm":
            host = addr or _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", ""))
            job = int(env.get("SLURM_JOB_ID", "0") or 0)
            if host:
                return host, port or 20000 + job % 20000
        raise LaunchEnvironmentError(
            f"{launch.launcher} launched this job but MASTER_ADDR/MASTER_PORT are not set and mpi4py "
            "is not available to agree on them; `pip install dearopt[mpi]` or export MASTER_ADDR and MASTER_PORT"
        )
    missing = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not value]
    raise LaunchEnvironmentError(f"{launch.launcher} launched {launch.size} processes but {', '.join(missing)} is not set")


def init(backend: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Join the job.  Safe to call more than once (later calls do nothing).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``"nccl-native"`` (the csrc
            extension; control traffic stays on gloo).  Default: NCCL when CUDA
            is available, gloo otherwise.
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
        pg_backend = "gloo" if chosen == "nccl-native" else chosen
        if chosen == "nccl":
            torch.cuda.set_device(launch.local_rank % max(torch.cuda.device_count(), 1))
        kwargs = dict(backend=pg_backend, rank=launch.rank, world_size=launch.size,
                      timeout=datetime.timedelta(seconds=seconds))
        if launch.size == 1 and not (launch.master_addr and launch.master_port):
            dist.init_process_group(store=dist.HashStore(), **kwargs)
        else:
            addr, port = _rendezvous_address(launch, env)
            dist.init_process_group(init_method=f"tcp://{addr}:{port}", **kwargs)
        owns = True
    comm: CollectiveBackend
    if chosen == "nccl-native":
        try:
            from .nccl_native import NcclNativeBackend
        except ImportError as exc:
            if owns:
                dist.destroy_process_group()
            raise BackendUnavailableError(f"backend 'nccl-native' is not available: {exc}") from exc
        comm = NcclNativeBackend.create(launch.rank, launch.size, seconds)
    else:
        comm = TorchDistBackend(launch.rank, launch.size, seconds)
    _runtime = _Runtime(launch=launch, backend=comm, timeout=seconds, owns_process_group=owns)
    global _exit_hook_registered
    if not _exit_hook_registered:
        # gloo's worker threads drop their last reference to a finished op's
        # tensors after wait() has returned; if that happens while the
        # interpreter is finalizing, the thread cannot take the GIL and the
        # process aborts.  Tearing the process groups down (which joins those
        # threads) before finalization closes that window.
        atexit.register(_shutdown_at_exit)
        _exit_hook_registered = True


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
    try:
        shutdown()
    except Exception:  # a peer may be gone already; exiting anyway
        pass


def shutdown() -> None:
    """Leave the job; :func:`init` may be called again afterwards.

    Every communicator dearopt made is closed, including those of existing
    :class:`~dearopt.DistOptim` objects: using one after ``shutdown()`` raises
    :class:`~dearopt.CollectiveError`; make a new one after the next ``init()``.
    """
    global _runtime
    if _runtime is None:
        return
    runtime, _runtime = _runtime, None
    runtime.backend.close()
    if runtime.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
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


def get_backend() -> CollectiveBackend:
    """The collective backend every dearopt component uses."""
    return _require().backend


def get_timeout() -> float:
    """Seconds any wait on a collective may take."""
    return _require().timeout
