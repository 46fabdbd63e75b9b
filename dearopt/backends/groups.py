"""The ranks a ``DistOptim`` averages over, given as torch names them, and what a rank holds of a ``DTensor``.

``DistOptim(..., process_group=...)`` takes a ``torch.distributed.ProcessGroup`` (``new_group(ranks)``), a 1-D
``DeviceMesh``, or one named dimension of a larger mesh (``mesh["dp"]``); :func:`group_backend` makes the
:class:`~dearopt.backends.base.TorchDistBackend` over it that the engine forks its communicator from.  The group's
rank 0 is the root of the parameter broadcast at construction.

Parameters that are ``DTensor`` s (tensor parallelism: ``parallelize_module`` over ``mesh["tp"]``) are averaged by
their local shards over the data-parallel group: the ranks of that group hold the same shard (a check at
construction, :func:`layout_of`), so the average of the local shards is the local shard of the average.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from dearopt.errors import UsageError

__all__ = ["group_backend", "refuse_group_as_backend", "is_dtensor", "local_tensor", "layout_of"]

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - a torch without device meshes
    DeviceMesh = None

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - a torch without DTensor
    DTensor = None

_EXPECTED = (
    "a torch.distributed.ProcessGroup (torch.distributed.new_group(ranks)), a 1-D DeviceMesh, or one named "
    'dimension of a larger mesh (mesh["dp"])'
)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a parameter of a tensor-parallel module)."""
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (the tensor itself, its storage shared), or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def layout_of(t: torch.Tensor) -> Optional[tuple]:
    """What must be equal on the ranks that average ``t``'s local shard (None for a plain tensor): its placements,
    and its coordinate along every mesh dimension it is sharded over (the same coordinate: the same shard)."""
    if not is_dtensor(t):
        return None
    coordinate = t.device_mesh.get_coordinate() or ()
    placements = tuple(t.placements)
    sharded = tuple(
        (i, coordinate[i] if i < len(coordinate) else None) for i, p in enumerate(placements) if not p.is_replicate()
    )
    return tuple(str(p) for p in placements), sharded, tuple(t._local_tensor.shape)


def refuse_group_as_backend(backend) -> None:
    """A :class:`~dearopt.errors.UsageError` for a torch process group or device mesh passed as ``backend=``."""
    if isinstance(backend, dist.ProcessGroup) or (DeviceMesh is not None and isinstance(backend, DeviceMesh)):
        raise UsageError(
            f"DistOptim(backend=...) takes a dearopt communicator, not a torch {type(backend).__name__}: pass "
            f"it as DistOptim(..., process_group=...) to average over its ranks"
        )


def _group_of(process_group) -> Tuple[dist.ProcessGroup, str]:
    """The torch group of ``process_group`` and how to name it in an error."""
    if DeviceMesh is not None and isinstance(process_group, DeviceMesh):
        names = process_group.mesh_dim_names
        if process_group.ndim != 1:
            dims = (
                " or ".join(f'mesh["{n}"]' for n in names) if names else "a 1-D mesh (name the dimensions to pick one)"
            )
            raise UsageError(
                f"DistOptim(process_group=...) got a {process_group.ndim}-D DeviceMesh "
                f"{tuple(process_group.shape)}; pass the data-parallel dimension alone: {dims}"
            )
        what = f'mesh["{names[0]}"]' if names else "the 1-D DeviceMesh"
        return process_group.get_group(), what
    if isinstance(process_group, dist.ProcessGroup):
        return process_group, "the ProcessGroup"
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise UsageError(
            "DistOptim(process_group=...): this rank is not a member of the process group it was given "
            "(torch.distributed.new_group returns NON_GROUP_MEMBER on ranks outside its list); build each "
            "rank's DistOptim on a group that contains it, e.g. one group per data-parallel replica"
        )
    raise UsageError(f"DistOptim(process_group=...) expects {_EXPECTED}; got a {type(process_group).__name__}")


def group_backend(process_group, timeout: float):
    """A :class:`~dearopt.backends.base.TorchDistBackend` over ``process_group`` (see the module), rank and size
    its own; the group stays the caller's (closing the backend does not destroy it)."""
    from dearopt.backends.base import TorchDistBackend

    group, what = _group_of(process_group)
    if not dist.is_initialized():
        raise UsageError(f"DistOptim(process_group=...): torch.distributed is not initialized, yet {what} was given")
    rank = dist.get_rank(group)
    if rank < 0:
        raise UsageError(
            f"DistOptim(process_group=...): rank {dist.get_rank()} is not a member of {what} "
            f"(ranks {dist.get_process_group_ranks(group)}); build each rank's DistOptim on a group that contains it"
        )
    return TorchDistBackend(rank, dist.get_world_size(group), timeout, group=group, owns_group=False)
