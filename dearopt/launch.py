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
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Mapping, Optional

from .errors import LaunchEnvironmentError

__all__ = ["LaunchInfo", "detect_launch"]


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

    @property
    def launched_by_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich")


# name, rank var, size var, local rank var, local size var
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
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
        return LaunchInfo(
            launcher=name,
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=port,
        )
    if env.get("LOCAL_RANK") not in (None, ""):
        raise LaunchEnvironmentError(
            "LOCAL_RANK is set but neither RANK nor WORLD_SIZE is: the torchrun environment is incomplete"
        )
    port = _int(env, "MASTER_PORT")
    return LaunchInfo("none", 0, 1, 0, 1, env.get("MASTER_ADDR") or None, port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
