"""The sharded update (``shard_optimizer=True``): each rank updates its shard, the all-gather carries parameters.

Under ``dear`` the reduce-scatter of a bucket leaves each rank holding the
averaged gradient of one shard of the bucket.  With the sharded update each
rank runs the wrapped optimizer on exactly that shard at ``step()``, and the
all-gather of the next forward carries the updated *parameters* instead of the
averaged gradients: the same bytes on the wire, the optimizer's state and
work divided by the number of ranks (ZeRO stage 1, with DeAR's FeedPipe
overlap of the gather and the next forward).

**Layout.**  When a bucket is first updated sharded, its parameters move into
one flat buffer laid out as the bucket's gradient buffer (``p.data`` becomes a
view of it), so the all-gather writes straight into the parameters.  This
rank's part of each piece of that buffer is a contiguous range; where it
meets a parameter it is a :class:`Segment`: a view of the parameter's
elements this rank updates, whose ``.grad`` is the matching part of the
averaged gradient shard.  The wrapped optimizer sees the segments in place of
the parameters (grouped as their parameters are, so groups with different
hyperparameters split a shard at their boundaries), and its state is keyed
by the segments: 1/N of the unsharded state per rank.

**Which optimizers.**  Only optimizers whose update acts element by element,
with per-parameter scalars (``step``) that are the same for every element:
then the update of a segment is exactly the update of those elements of the
whole parameter.  The torch optimizers for which that holds are in
:data:`ELEMENTWISE`; :func:`register_elementwise` declares another class.
Others (LBFGS, Adafactor's factored moments, Muon's orthogonalisation,
SparseAdam's sparse-only update) raise :class:`~dearopt.errors.NotElementwiseError`.

**Checkpoints.**  :meth:`ShardedUpdate.gather_state` builds the ordinary
per-parameter state (an all-gather per bucket and state entry: every rank
calls it, every rank gets the whole state); :meth:`ShardedUpdate.take_state`
cuts ordinary per-parameter state into this rank's segments.  The per-rank
form (:meth:`ShardedUpdate.sharded_state`) holds only this rank's segments and
loads only into the same world size and plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Type

import torch

from dearopt.engine.buckets import BucketState
from dearopt.backends.base import CollectiveBackend
from dearopt.errors import CheckpointMismatchError, NotElementwiseError, UsageError
from dearopt.collectives import broadcast_object

__all__ = ["ELEMENTWISE", "register_elementwise", "check_elementwise", "Segment", "ShardedUpdate", "SHARDED_FORMAT"]

ELEMENTWISE: List[Type[torch.optim.Optimizer]] = [
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
]
"""Optimizer classes whose update is elementwise (their scalar state, such as ``step``, is per parameter and the
same for all of its elements)."""

SHARDED_FORMAT = "dearopt-sharded-optimizer-1"

_WHY_NOT = {
    "LBFGS": "its update couples every parameter through a line search and needs a closure",
    "Adafactor": "it keeps factored (row and column) second moments of each matrix, which a shard cannot hold",
    "Muon": "it orthogonalises each whole matrix update",
    "SparseAdam": "it needs sparse gradients; a shard holds dense averaged gradients",
}


def register_elementwise(cls: Type[torch.optim.Optimizer]) -> Type[torch.optim.Optimizer]:
    """Declare that ``cls`` updates element by element, so ``shard_optimizer=True`` may shard it (usable as a class
    decorator).  A wrong declaration makes the sharded update differ from the unsharded one."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_elementwise expects a torch.optim.Optimizer subclass, got {cls!r}")
    if cls not in ELEMENTWISE:
        ELEMENTWISE.append(cls)
    return cls


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that is not known to update element by element (the class itself, not a subclass:
    a subclass may change ``step``)."""
    cls = type(optimizer)
    if cls in ELEMENTWISE:
        return
    why = _WHY_NOT.get(
        cls.__name__,
        "dearopt does not know that its update acts element by element with the "
        "same scalars for every element of a parameter",
    )
    raise NotElementwiseError(
        f"shard_optimizer=True runs the optimizer on each rank's shard of every parameter, which is exact only for "
        f"elementwise optimizers; {cls.__name__} cannot be sharded: {why}. Use shard_optimizer=False, or, if its "
        f"update is elementwise, declare it with dearopt.register_elementwise({cls.__name__})"
    )


@dataclasses.dataclass
class Segment:
    """The elements ``[begin, begin + numel)`` of parameter ``j`` of a bucket that this rank updates."""

    param: torch.nn.Parameter
    j: int  # position of the parameter in its bucket
    group: int  # the optimizer's param group the parameter belongs to
    begin: int  # first element of the (flattened) parameter
    tensor: torch.Tensor  # view of the bucket's flat parameter buffer (its .grad: the averaged shard's part)

    @property
    def numel(self) -> int:
        return self.tensor.numel()


class _ShardedBucket:
    """A bucket whose parameters live in a flat buffer, and this rank's segments of it."""

    def __init__(self, bucket: BucketState, rank: int, world: int):
        spec = bucket.spec
        self.bucket = bucket
        self.flat = torch.zeros(spec.padded_numel, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
        with torch.no_grad():
            for p, offset in zip(bucket.params, spec.offsets):
                view = self.flat[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        group_of = {id(p): gi for gi, members in enumerate(bucket.group_members) for p in members}
        self.segments: List[Segment] = []
        for piece, (start, end) in zip(bucket.pieces, spec.pieces or ((0, spec.padded_numel),)):
            n = (end - start) // world
            own = start + rank * n
            piece.gather_full = self.flat[start:end]  # the all-gather of this piece carries parameters
            piece.gather_shard = self.flat[own : own + n]
            for j, (p, offset) in enumerate(zip(bucket.params, spec.offsets)):
                lo, hi = max(offset, own), min(offset + p.numel(), own + n)
                if lo < hi:
                    tensor = self.flat[lo:hi]
                    tensor.grad = piece.shard[lo - own : hi - own]
                    self.segments.append(Segment(p, j, group_of[id(p)], lo - offset, tensor))

    def members(self, n_groups: int, include: Sequence[bool]) -> List[List[torch.Tensor]]:
        """The segments to update, by param group (a parameter no rank produced a gradient for is left out, as
        torch skips a parameter whose ``.grad`` is None)."""
        by_group: List[List[torch.Tensor]] = [[] for _ in range(n_groups)]
        for s in self.segments:
            if include[s.j]:
                by_group[s.group].append(s.tensor)
        return by_group

    def release(self) -> None:
        for piece in self.bucket.pieces:
            piece.gather_full = piece.gather_shard = None


def _slice_state(value: Any, param: torch.Tensor, begin: int, numel: int, what: str) -> Any:
    """The part of one per-parameter state entry that belongs to a segment."""
    if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
        return value.detach().reshape(-1)[begin : begin + numel].clone()
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise NotElementwiseError(
            f"the optimizer state {what} has shape {tuple(value.shape)}, neither the "
            f"parameter's {tuple(param.shape)} nor a scalar: it cannot be sharded"
        )
    return value.clone() if isinstance(value, torch.Tensor) else value


def _is_elementwise(value: Any, segment: Segment) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == segment.numel


class ShardedUpdate:
    """The sharded buckets of one executor, the optimizer state keyed by their segments, and its checkpoints."""

    def __init__(self, optimizer: torch.optim.Optimizer, control: CollectiveBackend, rank: int, world: int):
        check_elementwise(optimizer)
        self.optimizer = optimizer
        self.control = control
        self.rank, self.world = rank, world
        self._buckets: Dict[int, _ShardedBucket] = {}
        self._pending_sharded: Optional[dict] = None  # a per-rank checkpoint loaded before the buckets existed
        self.on_sharded = None  # called once the segments exist (dearopt.checkpoint: a load before the first step)
        self._fingerprint: Optional[int] = None

    @property
    def active(self) -> bool:
        return bool(self._buckets)

    def segments(self) -> List[Segment]:
        return [s for b in sorted(self._buckets) for s in self._buckets[b].segments]

    # ---------------------------------------------------------------- update
    def prepare(self, buckets: Sequence[BucketState], fingerprint: int) -> None:
        """At ``step()``: give buckets not yet sharded their flat parameter buffer and segments, and move any
        ordinary per-parameter state (from before wrapping, a loaded checkpoint, a re-plan) into them."""
        if len(self._buckets) == len(buckets):
            return
        for b in buckets:
            if b.index not in self._buckets:
                self._buckets[b.index] = _ShardedBucket(b, self.rank, self.world)
        self._fingerprint = fingerprint
        self.take_state()
        if self._pending_sharded is not None:
            pending, self._pending_sharded = self._pending_sharded, None
            self.load_sharded_state(pending)
        if self.on_sharded is not None:
            hook, self.on_sharded = self.on_sharded, None
            hook()

    def apply(self, bucket: BucketState, include: Sequence[bool], updater) -> None:
        """Run the wrapped optimizer over this rank's segments of ``bucket`` (at ``step()``)."""
        if any(bucket.sparse):
            sparse = [n for n, is_sparse in zip(bucket.names, bucket.sparse) if is_sparse]
            raise UsageError(
                f"{sparse} get sparse gradients (nn.Embedding(sparse=True)); shard_optimizer=True "
                f"updates dense shards, which the optimizer may treat differently from a sparse "
                f"gradient: use sparse=False, or shard_optimizer=False"
            )
        sharded = self._buckets[bucket.index]
        updater.apply_members(sharded.members(len(self.optimizer.param_groups), include))

    def release(self) -> None:
        """Before a re-plan: the ordinary state back (collective), the flat buffers let go (the parameters keep
        their values; the next plan's buckets get new buffers at their first sharded step)."""
        if not self._buckets:
            return
        full = self.gather_state()
        self._drop_segment_state()
        for sharded in self._buckets.values():
            sharded.release()
        self._buckets = {}
        for p, entry in full.items():
            self.optimizer.state[p] = entry

    # ------------------------------------------------------------------ state
    def _drop_segment_state(self) -> None:
        for s in self.segments():
            self.optimizer.state.pop(s.tensor, None)

    def take_state(self) -> None:
        """Cut ordinary per-parameter state entries (``optimizer.state[p]``) into this rank's segments."""
        state = self.optimizer.state
        for sharded in self._buckets.values():
            for s in sharded.segments:
                entry = state.get(s.param)
                if entry:
                    name = sharded.bucket.names[s.j]
                    state[s.tensor] = {
                        k: _slice_state(v, s.param, s.begin, s.numel, f"{k!r} of {name!r}") for k, v in entry.items()
                    }
        for sharded in self._buckets.values():
            for p in sharded.bucket.params:
                state.pop(p, None)

    def gather_state(self) -> Dict[torch.nn.Parameter, Dict[str, Any]]:
        """The ordinary per-parameter state, on every rank (collective: every rank must call it)."""
        state = self.optimizer.state
        # what each rank holds per parameter: elementwise entries by dtype, scalars by value
        mine: Dict[tuple, Dict[str, tuple]] = {}
        for b, sharded in sorted(self._buckets.items()):
            for s in sharded.segments:
                entry = state.get(s.tensor)
                if not entry:
                    continue
                mine[(b, s.j)] = {
                    k: (("tensor", v.dtype) if _is_elementwise(v, s) else ("scalar", v)) for k, v in entry.items()
                }
        described: Dict[tuple, Dict[str, tuple]] = {}
        for r in range(self.world):
            theirs = broadcast_object(mine if r == self.rank else None, r, backend=self.control)
            for key, kinds in theirs.items():
                known = described.setdefault(key, {})
                for k, v in kinds.items():
                    known.setdefault(k, v)
        full: Dict[torch.nn.Parameter, Dict[str, Any]] = {}
        for b, sharded in sorted(self._buckets.items()):
            bucket = sharded.bucket
            entries = {j: described[(b, j)] for j in range(len(bucket.params)) if (b, j) in described}
            if not entries:
                continue
            for j, kinds in entries.items():
                full[bucket.params[j]] = {
                    k: (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, (kind, v) in kinds.items()
                    if kind == "scalar"
                }
            tensor_keys = sorted(
                {
                    (k, str(v[1]).replace("torch.", ""))
                    for kinds in entries.values()
                    for k, v in kinds.items()
                    if v[0] == "tensor"
                }
            )
            for key, dtype_name in tensor_keys:
                dtype = getattr(torch, dtype_name)
                gathered = self._gather_entry(sharded, key, dtype)
                for j, kinds in entries.items():
                    if key in kinds and kinds[key][0] == "tensor":
                        p, offset = bucket.params[j], bucket.spec.offsets[j]
                        full[p][key] = gathered[offset : offset + p.numel()].view_as(p).clone()
        return full

    def _gather_entry(self, sharded: _ShardedBucket, key: str, dtype: torch.dtype) -> torch.Tensor:
        """One state entry of a whole bucket, laid out as its buffer: every rank's segments all-gathered."""
        bucket, state = sharded.bucket, self.optimizer.state
        spec = bucket.spec
        device = self.control.device
        full = torch.zeros(spec.padded_numel, dtype=dtype, device=device)
        for start, end in spec.pieces or ((0, spec.padded_numel),):
            n = (end - start) // self.world
            own = start + self.rank * n
            mine = torch.zeros(n, dtype=dtype, device=device)
            for s in sharded.segments:
                offset = spec.offsets[s.j] + s.begin
                if own <= offset < own + n:
                    entry = state.get(s.tensor, {})
                    if key in entry:
                        mine[offset - own : offset - own + s.numel].copy_(entry[key])
            self.control.all_gather(full[start:end], mine).wait()
        return full.to(bucket.buffer.device)

    # ------------------------------------------------------- per-rank checkpoints
    def sharded_state(self) -> dict:
        """This rank's segments' state, for a per-rank checkpoint (loads only into the same world size and plan)."""
        if not self._buckets:
            raise UsageError(
                "the optimizer state is not sharded yet (that happens at the first step()); before "
                "it, optimizer.state_dict() is the whole state"
            )
        state = self.optimizer.state
        segments = []
        for b, sharded in sorted(self._buckets.items()):
            for s in sharded.segments:
                entry = state.get(s.tensor)
                segments.append(
                    {
                        "bucket": b,
                        "param": sharded.bucket.names[s.j],
                        "begin": s.begin,
                        "numel": s.numel,
                        "state": {
                            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in (entry or {}).items()
                        },
                    }
                )
        return {
            "format": SHARDED_FORMAT,
            "world": self.world,
            "rank": self.rank,
            "plan": self._fingerprint,
            "segments": segments,
        }

    def load_sharded_state(self, saved: dict) -> None:
        """Load :meth:`sharded_state` of this rank (before the first step it waits until the buckets exist)."""
        if not isinstance(saved, dict) or saved.get("format") != SHARDED_FORMAT:
            raise CheckpointMismatchError(
                "not a per-rank sharded optimizer checkpoint of dearopt "
                "(optimizer.sharded_state_dict()); for optimizer.state_dict() use "
                "optimizer.load_state_dict()"
            )
        if saved["world"] != self.world or saved["rank"] != self.rank:
            raise CheckpointMismatchError(
                f"this sharded checkpoint was saved by rank {saved['rank']} of {saved['world']}, and is loaded by "
                f"rank {self.rank} of {self.world}: a per-rank checkpoint loads only into the same rank of the same "
                f"world size; use optimizer.state_dict() (the whole state) to change the number of ranks"
            )
        if not self._buckets:
            self._pending_sharded = saved
            return
        if saved["plan"] != self._fingerprint:
            raise CheckpointMismatchError(
                f"this sharded checkpoint was saved with another communication plan (buckets, buffer size, "
                f"schedule or model) than this run's [rank {self.rank}]; save and load optimizer.state_dict() "
                f"(the whole state) instead"
            )
        self._drop_segment_state()
        by_place = {(s["bucket"], s["begin"], s["numel"], s["param"]): s["state"] for s in saved["segments"]}
        state = self.optimizer.state
        for b, sharded in sorted(self._buckets.items()):
            for s in sharded.segments:
                entry = by_place.get((b, s.begin, s.numel, sharded.bucket.names[s.j]))
                if entry is None:
                    raise CheckpointMismatchError(
                        f"segment {sharded.bucket.names[s.j]}[{s.begin}:"
                        f"{s.begin + s.numel}] is missing from the sharded checkpoint"
                    )
                if entry:
                    state[s.tensor] = {
                        k: (v.to(s.tensor.device).clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in entry.items()
                    }
