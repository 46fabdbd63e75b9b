"""Collective helpers for training scripts: broadcasting state and reducing metrics."""

from __future__ import annotations

import io
import pickle
import weakref
import zlib
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Tuple, Union

import torch

from . import runtime
from .errors import StepMismatchError

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allreduce", "broadcast_tensors"]


_OP_CODES = {"allreduce": 1, "broadcast": 2, "broadcast_object": 3}
_sequence = weakref.WeakKeyDictionary()  # backend -> number of helper collectives issued


def _agree(op: str, numel: int = 0, dtype: torch.dtype = None, root: int = 0) -> None:
    """Check that every rank is issuing the same helper collective (op, sequence number, size, dtype).

    Costs one small all-gather; turns "one rank ran an extra collective" into a
    named error on every rank instead of a transport abort or a silent mix.
    """
    backend = runtime.get_backend()
    if backend.size == 1:
        return
    seq = _sequence.get(backend, 0)
    _sequence[backend] = seq + 1
    code = zlib.crc32(str(dtype).encode()) if dtype is not None else -1
    header = torch.tensor([seq, _OP_CODES[op], numel, code, root], dtype=torch.int64, device=backend.device)
    everyone = torch.empty(backend.size * header.numel(), dtype=torch.int64, device=backend.device)
    backend.all_gather(everyone, header, step=seq).wait()
    rows = everyone.view(backend.size, -1).tolist()
    if any(row != rows[0] for row in rows):
        names = {v: k for k, v in _OP_CODES.items()}
        seen = "; ".join(f"rank {r}: #{row[0]} {names.get(row[1], row[1])} of {row[2]} elements, root {row[4]}"
                         for r, row in enumerate(rows))
        raise StepMismatchError(f"ranks issued different collectives ({seen}): a rank ran an extra or a different "
                                f"dearopt collective", rank=backend.rank, op=op, step=seq)


def broadcast_tensors(tensors: Iterable[torch.Tensor], root_rank: int = 0, backend=None, **where) -> None:
    """Overwrite every tensor in place with ``root_rank``'s, coalesced by dtype and device.

    ``backend`` defaults to the runtime's (whose calls are checked to agree across ranks); another one (a subset
    of the ranks) is used as given, with ``root_rank`` its own rank.
    """
    own = backend is None
    backend = runtime.get_backend() if own else backend
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    for (dtype, device), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in group]).to(backend.device)
        if own:
            _agree("broadcast", flat.numel(), dtype, root_rank)
        backend.broadcast(flat, root_rank, **where).wait()
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n


def _named_tensors(target) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(target, torch.nn.Module):
        return list(target.state_dict(keep_vars=True).items())
    if isinstance(target, dict):
        return list(target.items())
    if isinstance(target, (list, tuple)):
        items = list(target)
        if all(isinstance(i, tuple) and len(i) == 2 for i in items):
            return items
        return [(str(i), t) for i, t in enumerate(items)]
    raise TypeError(
        "broadcast_parameters expects an nn.Module, a state dict, or a list of (name, tensor) pairs; "
        f"got {type(target).__name__}"
    )


def broadcast_parameters(model_or_state_dict: Union[torch.nn.Module, Dict[str, torch.Tensor], Iterable],
                         root_rank: int = 0, backend=None) -> None:
    """Copy ``root_rank``'s parameters and buffers into every rank's, in place (``backend``: see
    :func:`broadcast_tensors`)."""
    named = _named_tensors(model_or_state_dict)
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: entry {name!r} is a {type(t).__name__}, not a tensor")
    # Tied parameters appear under several names; send each storage once.
    unique: Dict[int, torch.Tensor] = {}
    for _, t in named:
        unique.setdefault(id(t), t)
    broadcast_tensors(
        [t.data if isinstance(t, torch.nn.Parameter) else t for t in unique.values()], root_rank, backend
    )


def broadcast_object(obj: Any = None, root_rank: int = 0, backend=None) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; for small objects and state).

    ``backend`` defaults to the runtime's; the engine passes its own control channel.
    """
    own = backend is None
    backend = runtime.get_backend() if own else backend
    if backend.size == 1:
        return obj
    if own:
        _agree("broadcast_object", 0, None, root_rank)
    if backend.rank == root_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=backend.device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=backend.device)
    backend.broadcast(length, root_rank).wait()
    if backend.rank != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    data = payload.to(backend.device)
    backend.broadcast(data, root_rank).wait()
    if backend.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s.

    Works when some ranks have not stepped yet (empty state): the root's whole
    ``state_dict()`` is sent and loaded, so no dummy step is taken.
    """
    if not hasattr(optimizer, "state_dict") or not hasattr(optimizer, "load_state_dict"):
        raise TypeError(f"broadcast_optimizer_state expects a torch optimizer, got {type(optimizer).__name__}")
    state = optimizer.state_dict() if runtime.rank() == root_rank else None
    state = broadcast_object(state, root_rank)
    if runtime.rank() != root_rank:
        optimizer.load_state_dict(state)


def allreduce(value, op: str = "avg"):
    """Reduce a metric over ranks; returns a new tensor (or a float for a float input)."""
    backend = runtime.get_backend()
    as_float = isinstance(value, (int, float)) and not isinstance(value, bool)
    tensor = torch.as_tensor(value, dtype=torch.float64 if as_float else None).detach().clone()
    original_device = tensor.device
    if op == "avg" and not tensor.is_floating_point():
        tensor = tensor.double()
    work = tensor.to(backend.device).reshape(-1).contiguous()
    _agree("allreduce", work.numel(), work.dtype)
    backend.all_reduce(work, op).wait()
    result = work.view(tensor.shape).to(original_device)
    return result.item() if as_float else result
