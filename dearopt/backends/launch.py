"""Reading who we are from the launcher's environment.

Pure functions of an environment mapping, so they can be tested without
launching anything.  Supported launchers, checked in this order:

=============  =====================  ======================  ===================
launcher       rank                   world size              local rank
=============  =====================  ======================  ===================
torchrun       ``RANK``               ``WORLD_SIZE``          ``LOCAL_RANK``
horovodrun     ``HOROVOD_RANK``       ``HOROVOD_SIZE``        ``HOROVOD_LOCAL_RANK``
OpenMPI        ``OMPI_COMM_WORLD_RANK`` ``OMPI_COMM_WORLD_SIZE`` ``OMPI_COMM_WORLD_LOCAL_RANK``
MPICH/Hydra    ``PMI_RANK``           ``PMI_SIZE``            ``MPI_LOCALRANKID``
Slurm srun     ``SLURM_PROCID``       ``SLURM_NTASKS``        ``SLURM_LOCALID``
(none)         0                      1                       0
=============  =====================  ======================  ===================

Where the ranks meet (the rendezvous) is ``MASTER_ADDR``/``MASTER_PORT`` when
they are set.  Otherwise horovodrun's gloo mode gives the address of its HTTP
key-value server (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``): rank 0
publishes its store's address there (:func:`kv_put`) and the others read it
(:func:`kv_wait`); MPI launchers agree over mpi4py (see ``dearopt.backends.runtime``).
"""

from __future__ import annotations

import dataclasses
import http.client
import random
import socket
import time
from typing import Mapping, Optional, Tuple

from dearopt.errors import CollectiveTimeoutError, LaunchEnvironmentError

__all__ = ["LaunchInfo", "detect_launch", "free_port", "route_address", "kv_put", "kv_get", "kv_wait", "kv_delete"]


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher described it."""

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: Optional[str]
    master_port: Optional[int]
    rendezvous_server: Optional[Tuple[str, int]] = None
    """horovodrun's HTTP key-value server (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``), if it gave one."""
    cross_rank: Optional[int] = None
    """This machine's index, where the launcher says (``HOROVOD_CROSS_RANK``)."""
    cross_size: Optional[int] = None
    """The number of machines, where the launcher says (``HOROVOD_CROSS_SIZE``)."""

    @property
    def launched_by_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich")


# name, rank var, size var, local rank var, local size var
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        # Slurm writes SLURM_NTASKS_PER_NODE as e.g. "4(x2)"; take the count.
        head = value.split("(")[0].split(",")[0]
        try:
            return int(head)
        except ValueError:
            raise LaunchEnvironmentError(f"environment variable {name}={value!r} is not an integer") from None


def detect_launch(env: Mapping[str, str]) -> LaunchInfo:
    """Return the :class:`LaunchInfo` described by ``env`` (usually ``os.environ``).

    Raises :class:`LaunchEnvironmentError` when a launcher's variables are
    present but incomplete or contradictory, naming what is missing.
    """
    for name, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None and size is None:
            continue
        if name == "slurm" and rank is not None and size is None:
            size = _int(env, "SLURM_NPROCS")
        if rank is None:
            raise LaunchEnvironmentError(
                f"{size_var}={env.get(size_var)} is set but {rank_var} is not: the {name} environment "
                f"is incomplete; set {rank_var} to this process's rank (0..{size - 1})"
            )
        if size is None:
            raise LaunchEnvironmentError(
                f"{rank_var}={rank} is set but {size_var} is not: the {name} environment is incomplete; "
                f"set {size_var} to the number of processes"
            )
        if size < 1:
            raise LaunchEnvironmentError(f"{size_var}={size}: the world size must be at least 1")
        if not 0 <= rank < size:
            raise LaunchEnvironmentError(f"{rank_var}={rank} is outside 0..{size - 1} ({size_var}={size})")
        local_rank = _int(env, local_var)
        local_size = _int(env, local_size_var)
        if local_rank is None:
            local_rank = rank if size == 1 or local_size is None else rank % local_size
        if local_size is None:
            local_size = size if local_rank is not None else 1
        if not 0 <= local_rank < max(local_size, 1):
            local_size = max(local_size, local_rank + 1)
        port = _int(env, "MASTER_PORT")
        server = cross_rank = cross_size = None
        if name == "horovod":
            server = _horovod_rendezvous_server(env)
            cross_rank, cross_size = _int(env, "HOROVOD_CROSS_RANK"), _int(env, "HOROVOD_CROSS_SIZE")
            if cross_rank is None or cross_size is None or not 0 <= cross_rank < cross_size:
                cross_rank = cross_size = None
        return LaunchInfo(
            launcher=name,
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=port,
            rendezvous_server=server,
            cross_rank=cross_rank,
            cross_size=cross_size,
        )
    if env.get("LOCAL_RANK") not in (None, ""):
        raise LaunchEnvironmentError(
            "LOCAL_RANK is set but neither RANK nor WORLD_SIZE is: the torchrun environment is incomplete"
        )
    port = _int(env, "MASTER_PORT")
    return LaunchInfo("none", 0, 1, 0, 1, env.get("MASTER_ADDR") or None, port)


def _horovod_rendezvous_server(env: Mapping[str, str]) -> Optional[Tuple[str, int]]:
    addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or None
    port = _int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT")
    if addr is None and port is None:
        return None
    if addr is None or port is None:
        have, lack = (
            ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")
            if addr
            else ("HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_ADDR")
        )
        raise LaunchEnvironmentError(
            f"{have} is set but {lack} is not: horovodrun sets both (the address of its rendezvous server)"
        )
    if not 0 < port < 65536:
        raise LaunchEnvironmentError(f"HOROVOD_GLOO_RENDEZVOUS_PORT={port} is not a TCP port")
    return addr, port


# --------------------------------------------------- horovodrun's rendezvous server
# horovodrun (gloo mode) runs an HTTP key-value server for the job's lifetime:
# PUT /<scope>/<key> stores the body, GET returns it (404 while absent), DELETE
# removes it (horovod/runner/http/http_server.py).  Each request below has its
# own socket timeout; kv_wait polls until its deadline.

_KV_REQUEST_TIMEOUT = 5.0


def _kv_request(
    server: Tuple[str, int],
    method: str,
    scope: str,
    key: str,
    body: Optional[bytes] = None,
    timeout: float = _KV_REQUEST_TIMEOUT,
):
    if "/" in scope or "/" in key:
        raise ValueError(f"scope and key may not contain '/': {scope!r}, {key!r}")
    conn = http.client.HTTPConnection(server[0], server[1], timeout=timeout)
    try:
        headers = {"Content-Length": str(len(body))} if body is not None else {}
        conn.request(method, f"/{scope}/{key}", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _kv_error(server, what: str, exc: BaseException) -> LaunchEnvironmentError:
    return LaunchEnvironmentError(
        f"horovodrun's rendezvous server at {server[0]}:{server[1]} (HOROVOD_GLOO_RENDEZVOUS_ADDR/_PORT) {what}: {exc}"
    )


def kv_put(server: Tuple[str, int], scope: str, key: str, value: bytes, timeout: float = 30.0) -> None:
    """Store ``value`` under ``/scope/key`` on horovodrun's rendezvous server (retried until ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, _ = _kv_request(
                server,
                "PUT",
                scope,
                key,
                bytes(value),
                timeout=max(0.1, min(_KV_REQUEST_TIMEOUT, deadline - time.monotonic())),
            )
            if status == 200:
                return
            problem: BaseException = RuntimeError(f"PUT /{scope}/{key} answered HTTP {status}")
        except (OSError, http.client.HTTPException) as exc:
            problem = exc
        if time.monotonic() >= deadline:
            raise _kv_error(server, f"did not take /{scope}/{key} within {timeout:g} s", problem)
        time.sleep(0.05)


def kv_get(server: Tuple[str, int], scope: str, key: str, timeout: float = _KV_REQUEST_TIMEOUT) -> Optional[bytes]:
    """The value under ``/scope/key``, or ``None`` while there is none (one request)."""
    try:
        status, body = _kv_request(server, "GET", scope, key, timeout=timeout)
    except (OSError, http.client.HTTPException) as exc:
        raise _kv_error(server, "did not answer", exc) from exc
    if status == 404:
        return None
    if status != 200:
        raise _kv_error(server, f"answered GET /{scope}/{key}", RuntimeError(f"HTTP {status}"))
    return body


def kv_wait(server: Tuple[str, int], scope: str, key: str, timeout: float, waiting_for: str = "") -> bytes:
    """Poll ``/scope/key`` until it holds a value; :class:`CollectiveTimeoutError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        left = deadline - time.monotonic()
        try:
            value = kv_get(server, scope, key, timeout=max(0.1, min(_KV_REQUEST_TIMEOUT, left)))
        except LaunchEnvironmentError:
            if left <= 0:
                raise
            value = None  # the server may be starting or busy: retried until the deadline
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(
                f"waited {timeout:g} s for /{scope}/{key} on horovodrun's rendezvous server at "
                f"{server[0]}:{server[1]}" + (f" ({waiting_for})" if waiting_for else ""),
                op="rendezvous",
            )
        time.sleep(pause)
        pause = min(0.1, pause * 2)


def kv_delete(server: Tuple[str, int], scope: str, key: str) -> None:
    """Remove ``/scope/key`` (best effort: a server that refuses DELETE keeps it)."""
    try:
        _kv_request(server, "DELETE", scope, key)
    except (OSError, http.client.HTTPException):
        pass


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (the one ``host``'s peers can reach us by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))  # UDP: nothing is sent; only the route is looked up
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


_PORTS = (20000, 32768)  # below Linux's ephemeral range (32768-60999): no connection's local port is taken from here


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous address).

    Drawn at random (from the system's entropy: a seeded ``random`` in the caller cannot make two processes draw
    alike) below the range the kernel hands out for ``bind(0)`` and outgoing connections, so that a port returned
    here is not given to someone else before the rendezvous binds it, even with several jobs starting at once (as
    the tests do under ``pytest -n 2``)."""
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # (a crowded range: any the kernel gives)
        sock.bind((host, 0))
        return sock.getsockname()[1]
