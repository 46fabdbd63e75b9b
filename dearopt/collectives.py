"""Collective helpers for training scripts: broadcasting state and reducing metrics; the check that every rank
built the same model and optimizer; ``no_sync(model)`` over every ``DistOptim`` of a model."""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
import weakref
import zlib
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

import dearopt.backends.runtime as runtime
from dearopt.backends.groups import layout_of, local_tensor
from dearopt.errors import PlanMismatchError, StepMismatchError, UsageError

__all__ = [
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allreduce",
    "broadcast_tensors",
    "check_same_model",
    "no_sync",
]


_OP_CODES = {"allreduce": 1, "broadcast": 2, "broadcast_object": 3, "check_model": 4}
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
        seen = "; ".join(
            f"rank {r}: #{row[0]} {names.get(row[1], row[1])} of {row[2]} elements, root {row[4]}"
            for r, row in enumerate(rows)
        )
        raise StepMismatchError(
            f"ranks issued different collectives ({seen}): a rank ran an extra or a different dearopt collective",
            rank=backend.rank,
            op=op,
            step=seq,
        )


def broadcast_tensors(tensors: Iterable[torch.Tensor], root_rank: int = 0, backend=None, **where) -> None:
    """Overwrite every tensor in place with ``root_rank``'s, coalesced by dtype and device.

    ``backend`` defaults to the runtime's (whose calls are checked to agree across ranks); another one (a subset
    of the ranks) is used as given, with ``root_rank`` its own rank.
    """
    own = backend is None
    backend = runtime.get_backend() if own else backend
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = defaultdict(list)
    for t in map(local_tensor, tensors):  # a DTensor: this rank's shard (the same on the ranks of a dp group)
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
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def broadcast_buffers_as_bytes(model, backend, step: int) -> None:
    """Rank 0's buffers (BatchNorm's running statistics...) on every rank, as DDP does before each training
    forward: all of them, of every dtype, as the bytes of one message (one collective, not one per dtype;
    each buffer's bytes start at a multiple of 8 so that they can be viewed as its dtype again).  ``model``: the
    module, or its non-empty buffers as a list (kept by the caller: walking the module tree costs a Python call
    per module)."""
    buffers = [b for b in model.buffers() if b.numel() > 0] if isinstance(model, torch.nn.Module) else model
    if not buffers:
        return
    spans, offset = [], 0
    for b in buffers:
        nbytes = b.numel() * b.element_size()
        spans.append((offset, nbytes))
        offset += -(-nbytes // 8) * 8
    flat = torch.zeros(offset, dtype=torch.uint8, device=backend.device)
    for b, (start, nbytes) in zip(buffers, spans):
        flat[start : start + nbytes].copy_(b.detach().reshape(-1).view(torch.uint8))
    backend.broadcast(flat, 0, step=step).wait()
    for b, (start, nbytes) in zip(buffers, spans):
        b.copy_(flat[start : start + nbytes].view(b.dtype).view_as(b))


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


def broadcast_parameters(
    model_or_state_dict: Union[torch.nn.Module, Dict[str, torch.Tensor], Iterable], root_rank: int = 0, backend=None
) -> None:
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
    broadcast_tensors([t.data if isinstance(t, torch.nn.Parameter) else t for t in unique.values()], root_rank, backend)


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


# ------------------------------------------------------------------ the same model and optimizer on every rank
def _describe_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What must be equal on every rank: the tensors ``broadcast_parameters`` sends (name, shape, dtype, for a
    parameter whether it is trained, for a ``DTensor`` which shard this rank holds), the optimizer's class and which
    parameters each of its groups holds."""
    tensors = []
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            trained = bool(t.requires_grad) if isinstance(t, torch.nn.Parameter) else None
            entry = (name, tuple(t.shape), str(t.dtype).replace("torch.", ""), trained)
            layout = layout_of(t)
            tensors.append(entry if layout is None else entry + (layout,))
    position: Dict[int, int] = {}
    for i, p in enumerate(model.parameters()):
        position.setdefault(id(p), i)
    groups = [tuple(position.get(id(p), -1) for p in group["params"]) for group in optimizer.param_groups]
    return {"tensors": tensors, "optimizer": type(optimizer).__name__, "groups": groups}


def _fingerprint(description: dict) -> int:
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _gather_objects(backend, obj) -> List[Any]:
    """Every rank's ``obj`` (pickled), in rank order: two all-gathers (the lengths, then the padded bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=backend.device)
    lengths = torch.empty(backend.size, dtype=torch.int64, device=backend.device)
    backend.all_gather(lengths, length, op="check_model").wait()
    lengths = lengths.tolist()
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: payload.numel()] = payload
    everyone = torch.empty(longest * backend.size, dtype=torch.uint8, device=backend.device)
    backend.all_gather(everyone, mine.to(backend.device), op="check_model").wait()
    rows = everyone.cpu().view(backend.size, longest)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def _names(names: List[str], most: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _tensor_text(entry) -> str:
    _, shape, dtype, trained = entry[:4]
    text = f"{tuple(shape)} {dtype}" + ("" if trained is None else (" trained" if trained else " frozen"))
    if len(entry) > 4:  # a DTensor: its placements and the shard this rank holds
        placements, sharded, local = entry[4]
        where = ", ".join(f"coordinate {c} of mesh dimension {i}" for i, c in sharded)
        text += f" DTensor {list(placements)} holding the local shard {tuple(local)}" + (
            f" at {where}" if where else ""
        )
    return text


def _differences(ref: dict, other: dict, r: int) -> List[str]:
    """How rank ``r``'s description differs from rank 0's, in words."""
    out = []
    if ref["optimizer"] != other["optimizer"]:
        out.append(f"the optimizer is {other['optimizer']} on rank {r} and {ref['optimizer']} on rank 0")
    a = {e[0]: e for e in ref["tensors"]}
    b = {e[0]: e for e in other["tensors"]}
    if len(a) != len(b):
        out.append(f"rank {r}'s model has {len(b)} parameters and buffers, rank 0's has {len(a)}")
    only_ref = [n for n in a if n not in b]
    only_other = [n for n in b if n not in a]
    if only_ref:
        out.append(f"{_names(only_ref)} only on rank 0")
    if only_other:
        out.append(f"{_names(only_other)} only on rank {r}")
    changed = [n for n in a if n in b and a[n] != b[n]]
    for n in changed[:3]:
        out.append(f"{n!r} is {_tensor_text(b[n])} on rank {r} and {_tensor_text(a[n])} on rank 0")
    if len(changed) > 3:
        out.append(f"{len(changed) - 3} more tensors differ in shape, dtype or requires_grad")
    if any(a[n][:4] == b[n][:4] for n in changed):
        out.append(
            "the ranks averaged together hold different shards of a DTensor: average over the mesh dimension "
            'its shards are replicated along (DistOptim(..., process_group=mesh["dp"])), not one it is sharded over'
        )
    if not (only_ref or only_other or changed) and [e[0] for e in ref["tensors"]] != [e[0] for e in other["tensors"]]:
        out.append(f"the model's parameters and buffers are registered in another order on rank {r}")
    if ref["groups"] != other["groups"]:
        sizes_ref, sizes_other = [len(g) for g in ref["groups"]], [len(g) for g in other["groups"]]
        if sizes_ref != sizes_other:
            out.append(
                f"the optimizer's param groups hold {sizes_other} parameters on rank {r} and {sizes_ref} on rank 0"
            )
        else:
            out.append(f"the optimizer's param groups hold other parameters on rank {r} than on rank 0")
    return out or [f"rank {r}'s model or optimizer differs from rank 0's"]


def check_same_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backend=None) -> None:
    """Raise :class:`~dearopt.errors.PlanMismatchError` on every rank if the ranks' models or optimizers differ (the
    number, names, shapes, dtypes or ``requires_grad`` of the parameters and buffers, the optimizer's class or its
    param groups), naming what differs and on which rank.

    One small all-gather (a fingerprint); only when they differ, a second exchange of the descriptions for the
    message.  ``DistOptim`` calls it before it broadcasts rank 0's parameters.  ``backend``: see
    :func:`broadcast_tensors`.
    """
    own = backend is None
    backend = runtime.get_backend() if own else backend
    if backend.size == 1:
        return
    description = _describe_model(model, optimizer)
    seq = -1
    if own:  # part of the helper collectives' sequence: an extra or a missing one is a StepMismatchError
        seq = _sequence.get(backend, 0)
        _sequence[backend] = seq + 1
    header = torch.tensor(
        [seq, _OP_CODES["check_model"], len(description["tensors"]), _fingerprint(description)],
        dtype=torch.int64,
        device=backend.device,
    )
    everyone = torch.empty(backend.size * header.numel(), dtype=torch.int64, device=backend.device)
    backend.all_gather(everyone, header, op="check_model", step=None if seq < 0 else seq).wait()
    rows = everyone.view(backend.size, -1).tolist()
    if any(row[:2] != rows[0][:2] for row in rows):
        names = {v: k for k, v in _OP_CODES.items()}
        seen = "; ".join(f"rank {r}: #{row[0]} {names.get(row[1], row[1])}" for r, row in enumerate(rows))
        raise StepMismatchError(
            f"ranks issued different collectives ({seen}): a rank ran an extra or a different dearopt collective",
            rank=backend.rank,
            op="check_model",
            step=seq,
        )
    differing = [r for r, row in enumerate(rows) if row[2:] != rows[0][2:]]
    if not differing:
        return
    descriptions = _gather_objects(backend, description)
    details = [d for r in differing for d in _differences(descriptions[0], descriptions[r], r)]
    raise PlanMismatchError(
        f"the ranks built different models or optimizers: ranks {differing} differ from rank 0: "
        f"{'; '.join(details[:8])}{'; ...' if len(details) > 8 else ''}. Every rank must build the same model and "
        f"wrapped optimizer (the same parameters, shapes, dtypes and param groups) before DistOptim",
        rank=backend.rank,
        op="check_model",
    )


# ------------------------------------------------------------------ every DistOptim of a model
_distoptims: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> [weakref to DistOptim], in order


def register_distoptim(model: torch.nn.Module, optimizer) -> None:
    """Note that ``optimizer`` (a ``DistOptim``) was built on ``model`` (``DistOptim.__init__`` calls it)."""
    refs = [ref for ref in _distoptims.get(model, []) if ref() is not None]
    refs.append(weakref.ref(optimizer))
    _distoptims[model] = refs


def distoptims_of(model: torch.nn.Module) -> list:
    """The live ``DistOptim`` objects built on ``model`` or on any module inside it, in the order they were built."""
    return [opt for _, opt in _registered(model)]


def _registered(model: torch.nn.Module) -> list:
    """``(module it was built on, DistOptim)`` for :func:`distoptims_of`'s optimizers, in the same order."""
    found, seen = [], set()
    for module in model.modules():
        for ref in _distoptims.get(module, ()):
            opt = ref()
            if opt is not None and id(opt) not in seen:
                seen.add(id(opt))
                found.append((module, opt))
    return found


@contextlib.contextmanager
def no_sync(model: torch.nn.Module):
    """Backward passes inside accumulate gradients locally in every ``DistOptim`` built on ``model`` (or on a
    module inside it), as DDP's ``model.no_sync()`` does; the first backward after the block communicates the
    accumulated sums.  ``optimizer.no_sync()`` holds back only its own optimizer's parameters."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"dearopt.no_sync expects the model (an nn.Module), got {type(model).__name__}")
    optimizers = distoptims_of(model)
    if not optimizers:
        raise UsageError(
            f"dearopt.no_sync(model): no DistOptim was built on this {type(model).__name__} or on a "
            f"module inside it; pass the model given to DistOptim (or one that contains it)"
        )
    with contextlib.ExitStack() as stack:
        for opt in optimizers:
            stack.enter_context(opt.no_sync())
        yield


def _distoptim_text(model, optimizer, number: Optional[int] = None, count: Optional[int] = None) -> str:
    """``optimizer`` (the wrapped one) and its parameters by their names in ``model``, the one it was built on."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    params = [
        names.get(id(p), f"<shape {tuple(p.shape)}>") for group in optimizer.param_groups for p in group["params"]
    ]
    which = f"DistOptim {number} of {count} on this model" if number is not None and count > 1 else "this DistOptim"
    return f"{which} ({type(optimizer).__name__} over {_names(params)})"


def second_backward_refusal(executor) -> UsageError:
    """The error for a backward after ``executor`` sent the gradients of its step: it names the ``DistOptim``
    that communicated and, where the model has several, those that accumulated inside their own ``no_sync()``."""
    mates = _registered(executor.model)
    mine = executor.optimizer  # each torch optimizer is wrapped by one DistOptim at most
    number = next((i + 1 for i, (_, opt) in enumerate(mates) if opt.optimizer is mine), None)
    me = _distoptim_text(executor.model, mine, number, len(mates))
    held = [
        (i + 1, module, opt)
        for i, (module, opt) in enumerate(mates)
        if opt.optimizer is not mine and not opt.require_backward_grad_sync
    ]
    message = (
        f"backward() was called again after {me} sent the gradients of this step "
        f"(backward_passes_per_step={executor.options.backward_passes_per_step}); call step() first, or "
        f"accumulate inside `with dearopt.no_sync(model):`, which holds back every DistOptim of the model"
    )
    if held:
        others = "; ".join(_distoptim_text(module, opt.optimizer, i, len(mates)) for i, module, opt in held)
        message += (
            f" (`optimizer.no_sync()` holds back only its own optimizer: {others} accumulated inside its "
            f"own no_sync(), this one did not)"
        )
    else:
        message += " (or `with optimizer.no_sync():` for this optimizer alone)"
    return UsageError(f"{message} [rank {executor.rank}, step {executor.step_count}]")
