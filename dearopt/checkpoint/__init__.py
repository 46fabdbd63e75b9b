"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that load at another world size, plan or schedule.

::

    import dearopt.checkpoint as ckpt

    ckpt.save("ckpt/step_00000100", model, optimizer, extra={"step": 100, "sampler": sampler})
    extra = ckpt.load("ckpt/step_00000100", model, optimizer, extra={"sampler": sampler})

``optimizer`` is a :class:`dearopt.DistOptim` under any schedule, sharded or
not, or a plain ``torch.optim.Optimizer`` (a single process needs no
``dearopt.init()``).  Every rank calls :func:`save` and :func:`load`.

**What is written.**  One DCP checkpoint (a directory) whose keys do not
depend on the world size, the bucket plan or the schedule:

* ``model.<name>``: ``model.state_dict()``; the ranks hold the same tensors,
  and each is handed to DCP by one rank (dealt by bytes), which writes it.
* ``optim.flat.<param>.<key>``: every optimizer state entry shaped as its
  parameter (``exp_avg``, ``momentum_buffer``...), as one flat tensor of the
  parameter's ``numel()`` elements.  Under ``shard_optimizer=True`` each rank
  hands DCP only its segments of it, each with its offset (DCP's
  ``ChunkStorageMetadata``): nothing is gathered and no rank holds more than
  its shard.  Unsharded, every rank holds the whole state: each tensor is
  handed to DCP by one rank, as the model's.  A loader asks DCP for the
  ranges it owns in its own plan and DCP reads the overlapping pieces.
* ``optim.state.<param>.<key>``: the other entries (``step``; an entry of
  another shape, under an unsharded run).
* ``optim.param_groups``: the hyperparameters, parameters named by their
  fully qualified names.
* ``dearopt.meta``: names and shapes of the parameters, world size,
  schedule; ``dearopt.rank<r>.deft`` / ``.sparse``: a rank's own
  ``schedule="deft"`` in-flight gradient sums and ``Sparsify`` residuals.
* ``extra.<name>``: what the caller passed as ``extra``.

**What cannot move.**  ``deft``'s in-flight gradient groups and
``Sparsify``'s residuals are sums of this rank's gradients: they load only
into the same world size, under the same schedule / comm hook.  Anything else
is refused by name (:class:`dearopt.errors.CheckpointMismatchError`), never loaded
wrong.

**Plain torch.**  :func:`torch_state_dicts` turns the output of
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (or of
:func:`read`) into ``(model_state_dict, optimizer_state_dict)`` for
``model.load_state_dict`` and a torch optimizer's ``load_state_dict``.

**Elastic jobs.**  :func:`step_path` / :func:`latest` name and find the
checkpoints of a job in one directory (a checkpoint counts once DCP has
written its ``.metadata``, which it does last); :class:`ElasticSampler`
continues an epoch where the checkpoint was, at any world size.  See
``docs/checkpoint.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import math
import os
import re
import threading
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from dearopt.backends.groups import is_dtensor, local_tensor
from dearopt.errors import BackendUnavailableError, CheckpointMismatchError, CollectiveTimeoutError, UsageError

__all__ = [
    "save",
    "load",
    "describe",
    "read",
    "torch_state_dicts",
    "step_path",
    "latest",
    "wait",
    "AsyncSave",
    "ElasticSampler",
    "FORMAT",
]

FORMAT = "dearopt-dcp-1"
"""The layout written by :func:`save` (in ``dearopt.meta``)."""

_META = "dearopt.meta"
_GROUPS = "optim.param_groups"
_FLAT = "optim.flat."
_STATE = "optim.state."
_MODEL = "model."
_EXTRA = "extra."

# --------------------------------------------------------------------------------------------- DCP planners


class _Chunks(dict):
    """This rank's pieces of one flat tensor of ``numel`` elements: ``{offset: 1-D tensor}``.  A dict, so that
    DCP's walks over a state dict (which drop objects they do not know) keep it and its tensors."""

    def __init__(self, numel: int, pieces=()):
        super().__init__(pieces)
        self.numel = numel

    @property
    def pieces(self) -> List[Tuple[int, torch.Tensor]]:
        return sorted(self.items(), key=lambda piece: piece[0])

    def at(self, offset: int) -> torch.Tensor:
        return self[offset]


def _dcp():
    """torch.distributed.checkpoint's pieces (imported when a checkpoint is made or read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    return dict(
        dcp=dcp,
        DefaultLoadPlanner=DefaultLoadPlanner,
        DefaultSavePlanner=DefaultSavePlanner,
        ChunkStorageMetadata=ChunkStorageMetadata,
        MetadataIndex=MetadataIndex,
        TensorProperties=TensorProperties,
        TensorStorageMetadata=TensorStorageMetadata,
        TensorWriteData=TensorWriteData,
        WriteItem=WriteItem,
        WriteItemType=WriteItemType,
        create_read_items_for_chunk_list=create_read_items_for_chunk_list,
    )


def _planners():
    """DCP's default planners, taught :class:`_Chunks`: a value made of this rank's ranges of a flat tensor."""
    m = _dcp()

    def split(state_dict):
        return {k: v for k, v in state_dict.items() if isinstance(v, _Chunks)}

    def without_chunks(planner, make_plan):
        """DCP's own plan for everything but the chunked entries (``_Chunks``, planned by the caller), and those."""
        chunks = split(planner.state_dict)
        for key in chunks:
            del planner.state_dict[key]
        try:
            return make_plan(), chunks
        finally:
            planner.state_dict.update(chunks)

    class SavePlanner(m["DefaultSavePlanner"]):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # flat keys; values are leaves

        def create_local_plan(self):
            plan, chunks = without_chunks(self, super().create_local_plan)
            items = []
            for fqn, value in chunks.items():
                for offset, tensor in value.pieces:
                    chunk = m["ChunkStorageMetadata"](offsets=torch.Size([offset]), sizes=torch.Size([tensor.numel()]))
                    items.append(
                        m["WriteItem"](
                            index=m["MetadataIndex"](fqn, torch.Size([offset])),
                            type=m["WriteItemType"].SHARD,
                            tensor_data=m["TensorWriteData"](
                                chunk=chunk,
                                properties=m["TensorProperties"].create_from_tensor(tensor),
                                size=torch.Size([value.numel]),
                            ),
                        )
                    )
            self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
            return self.plan

        def resolve_data(self, write_item):
            value = self.state_dict.get(write_item.index.fqn)
            if isinstance(value, _Chunks):
                return value.at(write_item.index.offset[0])
            return super().resolve_data(write_item)

    class LoadPlanner(m["DefaultLoadPlanner"]):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # bytes land in our dict

        def create_local_plan(self):
            plan, chunks = without_chunks(self, super().create_local_plan)
            items = []
            for fqn, value in chunks.items():
                stored = self.metadata.state_dict_metadata.get(fqn)
                if not isinstance(stored, m["TensorStorageMetadata"]) or tuple(stored.size) != (value.numel,):
                    raise CheckpointMismatchError(
                        f"{fqn}: the checkpoint holds {stored!r}, not a flat tensor of {value.numel} elements"
                    )
                local = [
                    m["ChunkStorageMetadata"](offsets=torch.Size([o]), sizes=torch.Size([t.numel()]))
                    for o, t in value.pieces
                ]
                items += m["create_read_items_for_chunk_list"](fqn, stored, local)
            return dataclasses.replace(plan, items=list(plan.items) + items)

        def resolve_tensor(self, read_item):
            value = self.state_dict.get(read_item.dest_index.fqn)
            if isinstance(value, _Chunks):
                tensor = value.at(read_item.dest_index.offset[0])
                return tensor.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])
            return super().resolve_tensor(read_item)

    return SavePlanner, LoadPlanner


# ------------------------------------------------------------------------------------------ process group

_group_lock = threading.Lock()
_group: Optional[Tuple[Any, Any]] = None  # (the default group it was made under, a gloo group for DCP)


def _process_group():
    """The group DCP coordinates over: None (no process group: one process, ``no_dist``) or a gloo group of its
    own over the default group's ranks (made once per default group; every rank makes it at the same call).
    A group of its own: an async save's planning runs in a thread, and must never be paired with the
    training's or the user's collectives."""
    global _group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    with _group_lock:
        if _group is None or _group[0] is not world:
            if not dist.is_gloo_available():
                raise BackendUnavailableError(
                    "dearopt.checkpoint needs torch.distributed's gloo backend (DCP coordinates the ranks over a "
                    "CPU process group) and this torch build has none; save optimizer.state_dict() on rank 0 "
                    "instead"
                )
            _group = (world, dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_timeout())))
        return _group[1]


@contextlib.contextmanager
def _single(group):
    """Without a process group DCP warns that it assumes one process: that is what the caller asked for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _timeout() -> float:
    import dearopt.backends.runtime as runtime

    return runtime.get_timeout() if runtime.is_initialized() else 300.0


# ------------------------------------------------------------------------------------- the optimizer's state


def _distoptim(optimizer):
    """The :class:`dearopt.DistOptim` behind ``optimizer`` (itself, or ``hvd.DistributedOptimizer.distoptim``)."""
    from dearopt.optimizer import DistOptim

    if isinstance(optimizer, DistOptim):
        return optimizer
    inner = getattr(optimizer, "distoptim", None)
    return inner if isinstance(inner, DistOptim) else None


def _reshare(optimizer) -> None:
    """After a load replaced the wrapped optimizer's groups and state: a face over it shares them again."""
    wrapped = _distoptim(optimizer)
    if wrapped is not None and wrapped is not optimizer:
        optimizer.reshare()


def _inner(optimizer) -> torch.optim.Optimizer:
    wrapped = _distoptim(optimizer)
    return wrapped.optimizer if wrapped is not None else optimizer


def _names(model: torch.nn.Module, optimizer) -> Dict[int, str]:
    """id(parameter) -> its fully qualified name, for every parameter the optimizer holds."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for gi, group in enumerate(_inner(optimizer).param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise UsageError(
                    f"param group {gi} holds a parameter of shape {tuple(p.shape)} that is not a "
                    f"parameter of the model passed: pass the model those parameters belong to"
                )
    return names


def _sharding(optimizer):
    """The optimizer's :class:`dearopt.engine.sharding.ShardedUpdate` once its state lives in segments, else None."""
    wrapped = _distoptim(optimizer)
    if wrapped is None:
        return None
    sharding = wrapped.sharded_update
    return sharding if sharding is not None and sharding.active else None


def _is_elementwise(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _groups(inner: torch.optim.Optimizer, names: Dict[int, str]) -> List[dict]:
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in inner.param_groups
    ]


def _optimizer_entries(optimizer, names: Dict[int, str]) -> Dict[str, Any]:
    """The optimizer's state as DCP values, the live tensors: flat elementwise entries (this rank's chunks under
    the sharded update) and the others."""

    def keep(t):
        return t.detach()

    out: Dict[str, Any] = {}
    inner = _inner(optimizer)
    sharding = _sharding(optimizer)
    if sharding is None:
        for p, entry in inner.state.items():
            name = names.get(id(p))
            if name is None:
                continue
            for key, value in entry.items():
                if _is_elementwise(value, p) and is_dtensor(value):  # as it is: DCP saves a DTensor's shards
                    out[f"{_FLAT}{name}.{key}"] = keep(value)
                elif _is_elementwise(value, p):
                    out[f"{_FLAT}{name}.{key}"] = keep(value.reshape(-1))
                else:
                    out[f"{_STATE}{name}.{key}"] = keep(value) if isinstance(value, torch.Tensor) else value
        return out
    for s in sharding.segments():
        entry = inner.state.get(s.tensor)
        if not entry:
            continue
        name = names[id(s.param)]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == s.numel:
                flat = out.setdefault(f"{_FLAT}{name}.{key}", _Chunks(s.param.numel()))
                flat[s.begin] = keep(value)
            else:
                out[f"{_STATE}{name}.{key}"] = keep(value) if isinstance(value, torch.Tensor) else value
    return out


def _model_entries(model: torch.nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``model.state_dict()`` with each tensor once: entries that are the same tensor as an earlier one (tied
    weights: a decoder sharing the word embedding) become aliases of its name, as ``torch.save`` writes one
    storage once."""
    entries, aliases, seen = {}, {}, {}
    for name, tensor in model.state_dict().items():
        own = local_tensor(tensor)  # a DTensor: this rank's shard (the wrapper has no storage of its own)
        key = (own.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        entries[name] = tensor
    return entries, aliases


def _meta(model, optimizer, names, world) -> dict:
    wrapped = _distoptim(optimizer)
    params = {names[id(p)]: tuple(p.shape) for g in _inner(optimizer).param_groups for p in g["params"]}
    return {
        "format": FORMAT,
        "world": world,
        "params": params,
        "schedule": wrapped.options.schedule if wrapped is not None else None,
        "shard_optimizer": bool(wrapped is not None and wrapped.options.shard_optimizer),
        "optimizer": type(_inner(optimizer)).__name__,
        "deft": bool(wrapped is not None and wrapped.options.policy.delays_updates),
        "sparse": bool(wrapped is not None and "dearopt_sparse" in wrapped.engine_state_keys),
    }


def _state_dict(model, optimizer, extra, copy: bool) -> Dict[str, Any]:
    """What :func:`save` hands DCP (flat keys)."""
    wrapped = _distoptim(optimizer)
    if wrapped is not None:
        wrapped.synchronize()  # the parameters are current, no update pending
    rank, world = _rank_world()
    names = _names(model, optimizer)
    out: Dict[str, Any] = {}
    if wrapped is not None:  # deft's first: it applies what is due
        for key, value in wrapped.engine_state_dict().items():  # dearopt_deft, dearopt_sparse
            out[f"dearopt.rank{rank}.{key[len('dearopt_') :]}"] = value
    entries, aliases = _model_entries(model)
    replicated = {_MODEL + name: tensor.detach() for name, tensor in entries.items()}
    optim = _optimizer_entries(optimizer, names)
    if _sharding(optimizer) is None:  # the whole state on every rank, the same
        replicated.update({k: v for k, v in optim.items() if isinstance(v, torch.Tensor)})
    # a DTensor (tensor parallelism) is handed to DCP by every rank, its shard: DCP writes each shard once
    sharded = {k: v for k, v in replicated.items() if is_dtensor(v)}
    replicated = {k: v for k, v in replicated.items() if k not in sharded}
    owners = _owners({k: v.numel() * v.element_size() for k, v in replicated.items()}, world)
    out.update({k: v for k, v in replicated.items() if owners[k] == rank})
    out.update(sharded)
    out.update({k: v for k, v in optim.items() if k not in replicated})
    out[_GROUPS] = _groups(_inner(optimizer), names)
    out[_META] = dict(_meta(model, optimizer, names, world), aliases=aliases)
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"extra= takes a dict with str keys, got {key!r}")
        if hasattr(value, "state_dict") and callable(value.state_dict):
            value = value.state_dict()
        out[_EXTRA + key] = value
    if copy:  # an async save: what this rank writes, copied to host memory
        import copy as copying

        for key, value in out.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.to("cpu", copy=True)
            elif isinstance(value, _Chunks):
                out[key] = _Chunks(value.numel, {o: t.to("cpu", copy=True) for o, t in value.items()})
            else:
                out[key] = copying.deepcopy(value)
    return out


def _owners(sizes: Dict[str, int], world: int) -> Dict[str, int]:
    """Which rank writes each tensor every rank holds: the largest first, each to the rank with the fewest bytes so
    far (the same answer on every rank: the tensors and their sizes are the same).  Each rank then hands DCP
    (and, for an async save, copies) only its share."""
    load = [0] * world
    owners = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[key] = rank
        load[rank] += sizes[key]
    return owners


# ----------------------------------------------------------------------------------------------- save


class AsyncSave:
    """An :func:`save` with ``async_=True`` under way: the training loop's copy is taken, the writing goes on in a
    thread.  :meth:`result` waits for it (with a timeout) and raises what the write raised."""

    def __init__(self, future: concurrent.futures.Future, path: str):
        self._future = future
        self.path = path

    def done(self) -> bool:
        """Whether the checkpoint is written (or failed)."""
        return self._future.done()

    def result(self, timeout: Optional[float] = None):
        """Wait until the checkpoint is written (at most ``timeout`` seconds, default dearopt's collective
        timeout); a :class:`dearopt.CollectiveTimeoutError` if it is not by then."""
        timeout = _timeout() if timeout is None else timeout
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeoutError(
                f"the async checkpoint to {self.path} was not written within {timeout:g} s; "
                f"a rank may have died or the disk stalled",
                op="checkpoint",
            ) from None


_pending: Optional[AsyncSave] = None


def wait(timeout: Optional[float] = None) -> None:
    """Wait for this process's async save under way, if any (see :meth:`AsyncSave.result`)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.result(timeout)


class _Staged:
    """An ``AsyncStager`` for a state dict that :func:`save` has copied already."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self):
        pass

    def close(self):
        pass


def save(
    path: str, model: torch.nn.Module, optimizer, *, extra: Optional[Mapping[str, Any]] = None, async_: bool = False
):
    """Save ``model`` and ``optimizer`` (a :class:`dearopt.DistOptim` or a torch optimizer) to the DCP checkpoint
    directory ``path``; every rank calls it, between ``step()`` and the next backward.

    Each rank writes only what it owns: under ``shard_optimizer=True`` its segments of the optimizer state (no
    gather); tensors every rank holds (the model, an unsharded optimizer state) are dealt between the ranks, each
    written by one of them, so they must be the same on every rank (data parallel training keeps them so).

    Args:
        extra: more to keep, by name: picklable values, or objects with ``state_dict()`` (a sampler, an LR
            scheduler), saved as their state dict.  :func:`load` returns them.
        async_: copy the state to host memory (the training loop waits for that only) and write it in a thread
            (``torch.distributed.checkpoint.async_save``); returns an :class:`AsyncSave`.  The next ``save``
            first waits for this one.

    Returns None, or an :class:`AsyncSave`.
    """
    global _pending
    wait()
    m = _dcp()
    path = os.fspath(path)
    state = _state_dict(model, optimizer, extra, copy=async_)
    SavePlanner, _ = _planners()
    group = _process_group()
    common = dict(checkpoint_id=path, planner=SavePlanner(), process_group=group, no_dist=group is None)
    if not async_:
        with _single(group):
            m["dcp"].save(state, **common)
        return None
    with _single(group):
        future = m["dcp"].async_save(state, async_stager=_Staged(), **common)
    _pending = AsyncSave(future, path)
    return _pending


# ----------------------------------------------------------------------------------------------- load


def _metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointMismatchError(
            f"{path} is not a finished DCP checkpoint (no .metadata in it); a save "
            f"interrupted before its end leaves none: load an earlier one (latest())"
        )
    return FileSystemReader(path).read_metadata()


def _read_objects(path: str, keys: Sequence[str], group) -> Dict[str, Any]:
    """The non-tensor values ``keys`` of the checkpoint."""
    m = _dcp()
    out = {key: None for key in keys}
    if out:
        _, LoadPlanner = _planners()
        with _single(group):
            m["dcp"].load(out, checkpoint_id=path, planner=LoadPlanner(), process_group=group, no_dist=group is None)
    return out


def _check(meta: dict, names: Dict[int, str], optimizer) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointMismatchError(
            f"not a dearopt.checkpoint checkpoint (format {meta and meta.get('format')!r}, expected {FORMAT!r})"
        )
    inner = _inner(optimizer)
    mine = {names[id(p)]: tuple(p.shape) for g in inner.param_groups for p in g["params"]}
    if set(mine) != set(meta["params"]):
        missing, unknown = sorted(set(meta["params"]) - set(mine)), sorted(set(mine) - set(meta["params"]))
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer holds other parameters than this one: only in the "
            f"checkpoint {missing[:5]}, only here {unknown[:5]}; build the same model "
            f"and param groups"
        )
    for name, shape in mine.items():
        if tuple(meta["params"][name]) != shape:
            raise CheckpointMismatchError(
                f"parameter {name!r} has shape {shape} here and {tuple(meta['params'][name])} in the checkpoint"
            )


def _optimizer_targets(stored, by_name, scalars, flats, sharding) -> Dict[str, Any]:
    """Where DCP reads the optimizer's tensors into: whole parameters' flat state (``sharding`` None), or this
    rank's segments of it; the tensor scalars (``step``) whole."""
    m = _dcp()
    targets: Dict[str, Any] = {}
    for key, (name, _) in scalars.items():
        md = stored[key]
        if isinstance(md, m["TensorStorageMetadata"]):
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype, device=by_name[name].device)
    for key, (name, _) in flats.items():
        md, p = stored[key], by_name[name]
        if sharding is None and is_dtensor(p):  # saved as a DTensor laid out as its parameter (read in its layout)
            targets[key] = torch.empty_like(p.detach(), dtype=md.properties.dtype)
        elif sharding is None:
            targets[key] = torch.empty(p.numel(), dtype=md.properties.dtype, device=p.device)
        else:
            pieces = [
                (s.begin, torch.empty(s.numel, dtype=md.properties.dtype, device=p.device))
                for s in sharding.segments()
                if s.param is p
            ]
            targets[key] = _Chunks(p.numel(), pieces)
    return targets


def _fill_segments(inner, sharding, by_name, scalars, flats, values) -> None:
    """Give each of this rank's segments its state: its ranges of the flat entries, a copy of the scalars."""
    for s in sharding.segments():
        inner.state.pop(s.tensor, None)
    name_of = {id(p): n for n, p in by_name.items()}
    for s in sharding.segments():
        name = name_of[id(s.param)]
        entry = {
            k: (values[key].clone() if isinstance(values[key], torch.Tensor) else values[key])
            for key, (n, k) in scalars.items()
            if n == name
        }
        entry.update({k: values[key].at(s.begin) for key, (n, k) in flats.items() if n == name})
        if entry:
            inner.state[s.tensor] = entry


def describe(path: str) -> dict:
    """What a checkpoint of :func:`save` was saved from, read by this process alone (no collective):
    ``world`` (ranks), ``schedule``, ``shard_optimizer``, ``optimizer`` (class name), ``params`` (names and
    shapes), ``format``."""
    path = os.fspath(path)
    _metadata(path)
    meta = _read_objects(path, [_META], None)[_META]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{path} is not a dearopt.checkpoint checkpoint")
    return dict(meta)


def _deft_in_flight(saved: Optional[dict]) -> bool:
    return bool(saved) and (saved.get("group") is not None or saved.get("held") is not None)


def _sparse_nonzero(saved: Optional[dict]) -> bool:
    def walk(value):
        if isinstance(value, torch.Tensor):
            return bool(value.ne(0).any())
        if isinstance(value, dict):
            return any(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(walk(v) for v in value)
        return False

    return walk(saved)


def load(
    path: str, model: torch.nn.Module, optimizer, *, extra: Optional[Mapping[str, Any]] = None, strict: bool = True
) -> Dict[str, Any]:
    """Load a checkpoint of :func:`save` into ``model`` and ``optimizer``, at any world size, plan or schedule,
    sharded or not; every rank calls it (before the first step, or between ``step()`` and the next backward).

    Under ``shard_optimizer=True`` each rank reads only the ranges of the optimizer state it owns; before the first
    ``step()`` (the segments follow from the plan) the model and hyperparameters are loaded now and the optimizer
    state at that ``step()``, on every rank.

    Args:
        extra: objects to restore from the saved ``extra`` of the same names (through their
            ``load_state_dict``).
        strict: as ``model.load_state_dict``'s: the model's entries and the checkpoint's must be the same names
            (False: entries missing from the checkpoint are left as they are, others in it are ignored).

    Returns every saved ``extra`` value by name (the state dicts of the objects restored).

    Raises :class:`dearopt.errors.CheckpointMismatchError` for what cannot be loaded: another model, ``schedule="deft"``
    gradient sums in flight or ``Sparsify`` residuals at another world size or into another schedule.
    """
    m = _dcp()
    path = os.fspath(path)
    wait()
    wrapped = _distoptim(optimizer)
    if wrapped is not None:
        wrapped.synchronize()
    rank, world = _rank_world()
    group = _process_group()
    metadata = _metadata(path)
    stored = metadata.state_dict_metadata
    keys = list(stored)
    names = _names(model, optimizer)
    meta = _read_objects(path, [_META], group)[_META]
    _check(meta, names, optimizer)
    by_name = {names[id(p)]: p for g in _inner(optimizer).param_groups for p in g["params"]}

    # per-rank state that does not move
    deft_key, sparse_key = f"dearopt.rank{rank}.deft", f"dearopt.rank{rank}.sparse"
    objects = [k for k in keys if k == _GROUPS or k.startswith(_EXTRA)]
    same_world = meta["world"] == world
    if meta.get("deft"):
        objects += [deft_key] if same_world and deft_key in stored else []
    if meta.get("sparse"):
        objects += [sparse_key] if same_world and sparse_key in stored else []

    # the tensors to read: the model's (in place) and the optimizer's (in this rank's layout)
    targets: Dict[str, Any] = {}
    saved_aliases = meta.get("aliases", {})
    entries, aliases = _model_entries(model)
    for name, tensor in entries.items():
        if _MODEL + name in stored:
            targets[_MODEL + name] = tensor.detach()
        elif name in saved_aliases:
            raise CheckpointMismatchError(
                f"model entry {name!r} was saved as the same tensor as "
                f"{saved_aliases[name]!r} (tied weights); this model holds them apart: "
                f"tie them as the saved model did"
            )
        elif strict:
            raise CheckpointMismatchError(
                f"model entry {name!r} is not in the checkpoint (strict=True); strict=False leaves it as it is"
            )
    unexpected = sorted(
        k[len(_MODEL) :]
        for k in stored
        if k.startswith(_MODEL) and k[len(_MODEL) :] not in entries and k[len(_MODEL) :] not in aliases
    )
    if strict and unexpected:
        raise CheckpointMismatchError(
            f"the checkpoint's model holds entries this model does not have: "
            f"{unexpected[:5]} (strict=True); strict=False ignores them"
        )
    scalars: Dict[str, Tuple[str, str]] = {}
    flats: Dict[str, Tuple[str, str]] = {}
    for key, md in stored.items():
        for prefix, table in ((_FLAT, flats), (_STATE, scalars)):
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                for name in by_name:
                    if rest.startswith(name + "."):
                        table[key] = (name, rest[len(name) + 1 :])
                        break
    sharding = _sharding(optimizer)
    # shard_optimizer=True before the first step(): the segments do not exist yet; their state is read when they do
    deferred = sharding is None and wrapped is not None and wrapped.sharded_update is not None
    objects += [key for key in scalars if not isinstance(stored[key], m["TensorStorageMetadata"])]
    if not deferred:
        targets.update(_optimizer_targets(stored, by_name, scalars, flats, sharding))
    # the values that are not tensors first: everything that could refuse the load is checked before a tensor
    # of the model or the optimizer is written
    values = _read_objects(path, objects, group)
    deft = values.get(deft_key)
    sparse = values.get(sparse_key)
    if meta.get("deft") and not same_world:
        # whether any saved rank had a group in flight
        probe = [f"dearopt.rank{r}.deft" for r in range(meta["world"]) if f"dearopt.rank{r}.deft" in stored]
        saved = _read_objects(path, probe, group)
        if any(_deft_in_flight(v) for v in saved.values()):
            raise CheckpointMismatchError(
                f"this checkpoint was saved under schedule='deft' at {meta['world']} ranks with gradient sums in "
                f"flight (delayed groups not yet applied); they are sums over those ranks' batches and cannot move "
                f"to {world} ranks. Save where no group is in flight, or resume at {meta['world']} ranks"
            )
    if (
        meta.get("deft")
        and same_world
        and _deft_in_flight(deft)
        and not (wrapped is not None and wrapped.options.policy.delays_updates)
    ):
        raise CheckpointMismatchError(
            "this checkpoint holds schedule='deft' gradient sums in flight (delayed "
            "groups not yet applied): load it into a DistOptim with schedule='deft'"
        )
    if meta.get("sparse"):
        if not same_world:
            probe = [f"dearopt.rank{r}.sparse" for r in range(meta["world"]) if f"dearopt.rank{r}.sparse" in stored]
            saved = _read_objects(path, probe, group)
            if any(_sparse_nonzero(v) for v in saved.values()):
                raise CheckpointMismatchError(
                    f"this checkpoint holds comm_hook=dearopt.Sparsify residuals (per-rank error feedback) of "
                    f"{meta['world']} ranks; they cannot move to {world} ranks: resume at {meta['world']} ranks"
                )
        elif _sparse_nonzero(sparse) and (wrapped is None or "dearopt_sparse" not in wrapped.engine_state_keys):
            raise CheckpointMismatchError(
                "this checkpoint holds comm_hook=dearopt.Sparsify residuals (error "
                "feedback): load it into a DistOptim with the same comm_hook"
            )

    groups = values[_GROUPS]
    inner = _inner(optimizer)
    if len(groups) != len(inner.param_groups) or any(
        g["params"] != [names[id(p)] for p in mine["params"]] for g, mine in zip(groups, inner.param_groups)
    ):
        raise CheckpointMismatchError(
            "the checkpoint's param groups hold other parameters (or another order) than "
            "this optimizer's; build the optimizer with the same groups"
        )
    _, LoadPlanner = _planners()
    with _single(group):
        m["dcp"].load(targets, checkpoint_id=path, planner=LoadPlanner(), process_group=group, no_dist=group is None)
    targets.update(values)

    # the model was loaded in place; the optimizer: torch's layout, or straight into the segments
    index = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    torch_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    if sharding is None and not deferred:
        per_param: Dict[str, Dict[str, Any]] = {}
        for key, (name, entry) in scalars.items():
            per_param.setdefault(name, {})[entry] = targets[key]
        for key, (name, entry) in flats.items():
            per_param.setdefault(name, {})[entry] = targets[key].view(by_name[name].shape)
        torch_state = {"state": {index[n]: e for n, e in per_param.items()}, "param_groups": torch_groups}
        if wrapped is not None:
            if deft is not None and wrapped.options.policy.delays_updates:
                torch_state["dearopt_deft"] = deft
            if sparse is not None and "dearopt_sparse" in wrapped.engine_state_keys:
                torch_state["dearopt_sparse"] = sparse
        (wrapped if wrapped is not None else optimizer).load_state_dict(torch_state)
    else:
        hyper = {"state": {}, "param_groups": torch_groups}  # the hyperparameters; no state
        if sparse is not None and "dearopt_sparse" in wrapped.engine_state_keys:
            hyper["dearopt_sparse"] = sparse
        wrapped.load_state_dict(hyper)
        scalar_values = {key: targets[key] for key in scalars if key in targets}
        if not deferred:
            _fill_segments(inner, sharding, by_name, scalars, flats, {**targets, **scalar_values})
        else:

            def read_segments():  # at the first step(), on every rank, once the segments exist
                segments = wrapped.sharded_update
                tensors = _optimizer_targets(stored, by_name, scalars, flats, segments)
                with _single(group):
                    m["dcp"].load(
                        tensors,
                        checkpoint_id=path,
                        planner=_planners()[1](),
                        process_group=group,
                        no_dist=group is None,
                    )
                _fill_segments(inner, segments, by_name, scalars, flats, {**tensors, **scalar_values})

            wrapped.sharded_update.on_sharded = read_segments
    _reshare(optimizer)
    out = {key[len(_EXTRA) :]: targets[key] for key in targets if key.startswith(_EXTRA)}
    for name, target in (extra or {}).items():
        if name not in out:
            raise CheckpointMismatchError(f"extra {name!r} is not in the checkpoint (it holds {sorted(out)})")
        target.load_state_dict(out[name])
    return out


# ------------------------------------------------------------------------------------- plain torch, one process


def read(path: str) -> Dict[str, Any]:
    """The whole checkpoint as a flat dict of full tensors and values, in this process alone (no process group:
    what ``dcp_to_torch_save`` writes to a file).  For :func:`torch_state_dicts`."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint import FileSystemReader

    _metadata(os.fspath(path))
    out: Dict[str, Any] = {}
    _load_state_dict(
        out, storage_reader=FileSystemReader(os.fspath(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return out


def torch_state_dicts(flat: Mapping[str, Any]) -> Tuple[Dict[str, torch.Tensor], dict]:
    """``(model_state_dict, optimizer_state_dict)`` in torch's ordinary layout from a whole checkpoint: the dict
    ``torch.load`` returns for a file of ``dcp_to_torch_save``, or :func:`read`'s.  The optimizer's loads into
    the torch optimizer (same class, same param groups) of one plain process."""
    meta = flat.get(_META)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointMismatchError(f"not a dearopt.checkpoint checkpoint (no {_META!r} of format {FORMAT!r})")
    model_state = {k[len(_MODEL) :]: v for k, v in flat.items() if k.startswith(_MODEL)}
    for name, first in meta.get("aliases", {}).items():
        model_state[name] = model_state[first]
    groups = flat[_GROUPS]
    order = [n for g in groups for n in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in flat.items():
        for prefix in (_FLAT, _STATE):
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                name = max((n for n in order if rest.startswith(n + ".")), key=len, default=None)
                if name is None:
                    raise CheckpointMismatchError(f"{key}: names no parameter of the checkpoint's param groups")
                entry = rest[len(name) + 1 :]
                if prefix == _FLAT:
                    value = value.view(meta["params"][name])
                state.setdefault(index[name], {})[entry] = value
    return model_state, {
        "state": state,
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


# -------------------------------------------------------------------------------------- a job's checkpoints

_STEP = re.compile(r"^step_(\d+)$")


def step_path(root: str, step: int) -> str:
    """The directory of the checkpoint at ``step`` under ``root`` (``root/step_00000042``)."""
    return os.path.join(os.fspath(root), f"step_{int(step):08d}")


def latest(root: str) -> Optional[Tuple[int, str]]:
    """``(step, path)`` of the newest finished checkpoint under ``root`` (named by :func:`step_path`), or None.
    A checkpoint whose save did not finish (no ``.metadata``: a rank died while writing) is passed over."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    found = []
    for entry in os.listdir(root):
        match = _STEP.match(entry)
        if match and os.path.exists(os.path.join(root, entry, ".metadata")):
            found.append((int(match.group(1)), os.path.join(root, entry)))
    return max(found) if found else None


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that continues an epoch where a checkpoint was, at any world size (Horovod's ``ElasticSampler``).

    Each epoch is a permutation of the dataset (``seed + epoch``) of the samples not yet processed.  Rank ``r``
    of ``W`` takes every ``W``-th of them from ``r`` (padded by wrapping, as ``DistributedSampler``), so batch
    ``i`` of a ``DataLoader(batch_size=b)`` over it holds, on all ranks together, the permutation's samples
    ``[i*b*W, (i+1)*b*W)``.  :meth:`record_batch` marks those as processed on every rank (no communication);
    :meth:`state_dict` / :meth:`load_state_dict` carry the epoch and the processed samples: pass the sampler in
    ``extra=`` of :func:`save` / :func:`load`.  After loading, the remaining samples are shuffled again
    and dealt over the new world size.

    Args:
        dataset: anything with ``len()``.
        shuffle: permute each epoch (else the remaining samples in order).
        seed: the permutation's seed, the same on every rank.
        rank, world: this rank and the number of ranks (default: dearopt's, or 0 and 1 before ``init()``).
    """

    def __init__(
        self, dataset, shuffle: bool = True, seed: int = 0, rank: Optional[int] = None, world: Optional[int] = None
    ):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._rank, self._world = rank, world
        self.epoch = 0
        self.processed_indices: set = set()
        self.reset()

    def _where(self) -> Tuple[int, int]:
        import dearopt.backends.runtime as runtime

        if self._rank is not None and self._world is not None:
            return self._rank, self._world
        if runtime.is_initialized():
            return runtime.rank(), runtime.size()
        return 0, 1

    def reset(self) -> None:
        """Deal the samples not yet processed this epoch over the current ranks."""
        self.rank, self.num_replicas = self._where()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            remaining = [remaining[i] for i in torch.randperm(len(remaining), generator=g).tolist()]
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        self.total_size = self.num_samples * self.num_replicas
        padded = list(remaining)
        while remaining and len(padded) < self.total_size:
            padded += remaining[: self.total_size - len(padded)]
        self._padded = padded
        self.indices = padded[self.rank : self.total_size : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed, a new permutation."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's samples of batch ``batch_idx`` (of ``batch_size`` per rank) since the last reset."""
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (``batch_size`` per rank, counted since the last reset) as processed: every
        rank's samples of it."""
        start = batch_idx * batch_size * self.num_replicas
        end = min((batch_idx + 1) * batch_size * self.num_replicas, self.total_size)
        self.processed_indices.update(self._padded[start:end])

    def record_indices(self, indices) -> None:
        """Mark these samples as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        """The epoch and the samples processed in it."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; the remaining samples are dealt over the current ranks."""
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
