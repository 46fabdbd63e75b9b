"""``horovod.torch.functions`` on dearopt: broadcasting model and optimizer state, and Python objects."""

from __future__ import annotations

import io
import pickle
from typing import Any, List

import torch

import dearopt.collectives as _functions
import dearopt.integrations.horovod.mpi_ops as mpi_ops

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank, prefix=None, process_set=mpi_ops.global_process_set) -> None:
    """Overwrite every rank's tensors in place with ``root_rank``'s.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` (a list or
    the generator itself), or a list of tensors, as Horovod accepts.
    """
    mpi_ops._check_init()
    mpi_ops._check_process_set(process_set)
    if isinstance(params, dict):
        items = sorted(params.items())  # the same order on every rank, as Horovod
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        items = [p if isinstance(p, tuple) else (str(i), p) for i, p in enumerate(params)]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"broadcast_parameters: entry {name!r} is a {type(value).__name__}, not a tensor")
    if process_set.ranks is None:
        _functions.broadcast_parameters(items, root_rank=root_rank)
        return
    for _, value in items:  # a subset of the ranks: tensor by tensor on the set's communicator
        mpi_ops.broadcast_(
            value.data if isinstance(value, torch.nn.Parameter) else value, root_rank, process_set=process_set
        )


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=mpi_ops.global_process_set) -> None:
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s.

    Works when the state is still empty (before the first ``step()``) on every
    or only some ranks: ``root_rank``'s whole ``state_dict()`` is sent and
    loaded, so no dummy step is taken.
    """
    mpi_ops._check_init()
    mpi_ops._check_process_set(process_set)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    # As Horovod (whose dummy step sets them), parameters that train and have no gradient get a zero one.
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    if process_set.ranks is None:
        _functions.broadcast_optimizer_state(optimizer, root_rank=root_rank)
        return
    state = broadcast_object(optimizer.state_dict(), root_rank, process_set=process_set)
    optimizer.load_state_dict(state)


def broadcast_object(obj: Any = None, root_rank: int = 0, name=None, process_set=mpi_ops.global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` (any picklable object) on every rank."""
    mpi_ops._check_init()
    mpi_ops._check_process_set(process_set)
    if process_set.ranks is None:
        return _functions.broadcast_object(obj, root_rank=root_rank)
    return _functions.broadcast_object(
        obj,
        root_rank=mpi_ops._set_rank(process_set, root_rank, "broadcast_object"),
        backend=mpi_ops._set_backend(process_set),
    )


def allgather_object(obj: Any, name=None, process_set=mpi_ops.global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj`` (any picklable object), in rank order."""
    mpi_ops._check_process_set(process_set)
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = mpi_ops.allgather(torch.tensor([payload.numel()], dtype=torch.int64), process_set=process_set).tolist()
    gathered = mpi_ops.allgather(payload, process_set=process_set)
    out, offset = [], 0
    for n in sizes:
        out.append(torch.load(io.BytesIO(gathered[offset : offset + n].numpy().tobytes()), weights_only=False))
        offset += n
    return out
