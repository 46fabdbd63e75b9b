"""Communication hooks: what a bucket sends, and what it makes of what comes back.

In the spirit of DDP's ``register_comm_hook``, a :class:`CommHook` sits
between a bucket's gradients and the collectives of the plan.  Before a
collective starts, :meth:`CommHook.encode` writes the gradient elements of the
piece into a wire buffer of :meth:`CommHook.wire_dtype`; when the collective
completes, :meth:`CommHook.decode` writes the received elements back.  The
engine averages after decoding, in the bucket's own dtype.

The bookkeeping that rides in every bucket (the "used" flags and the step
tags) never passes through the hook: the engine copies it into the wire buffer
itself.  Those are small integers, exact in float16 and bfloat16 (the engine
shortens the step tag to what the wire dtype holds exactly).

A hook may also change how many bytes travel and which collective carries
them: :meth:`CommHook.start` begins whatever carries an op's piece and
:meth:`CommHook.finish` leaves the result in its region.  The default is the
op's own collective through ``encode``/``decode``; a :class:`dearopt.Sparsify`
exchange (:mod:`dearopt.compression.sparsify`) and embedding rows
(:class:`dearopt.engine.tied.EmbeddingRows`) are hooks of this kind, so the issuer
starts and finishes every op alike (:func:`hooks_for` says which hook carries
which op).

Every rank must use the same hook (it is part of the plan's fingerprint).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional, Tuple

import torch

from dearopt.planning.plan import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ROWS

__all__ = [
    "CommHook",
    "CastHook",
    "ReduceInFloat32",
    "fp16_compress",
    "bf16_compress",
    "LOW_PRECISION",
    "Link",
    "GatherParameters",
    "hooks_for",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class CommHook:
    """Base class: override :attr:`name`, :meth:`wire_dtype`, :meth:`encode` and :meth:`decode`."""

    name = "none"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``dtype`` travels in."""
        return dtype

    def encode(self, grads: torch.Tensor, out: torch.Tensor) -> Any:
        """Write ``grads`` (flat, bucket dtype) into ``out`` (flat, wire dtype, same length); return a context."""
        out.copy_(grads)
        return None

    def decode(self, wire: torch.Tensor, out: torch.Tensor, ctx: Any) -> None:
        """Write the received ``wire`` elements into ``out`` (bucket dtype); ``ctx`` is what encode returned."""
        out.copy_(wire)

    def passes_through(self, dtype: torch.dtype) -> bool:
        """Whether a bucket of ``dtype`` travels untouched (no wire buffer): the default encode and decode into
        the same dtype."""
        cls = type(self)
        return cls.encode is CommHook.encode and cls.decode is CommHook.decode and self.wire_dtype(dtype) == dtype

    def wire_nbytes(self, op) -> int:
        """Bytes of wire buffer ``op`` takes from the pool while in flight (0: none, or a hook with a
        :meth:`start` of its own, whose buffers the pool does not see)."""
        return self._wire_of(op) if type(self).start is CommHook.start else 0

    def _wire_of(self, op) -> int:
        """The bytes of the wire buffer the default :meth:`start` takes for ``op``."""
        full = op.piece.full
        return 0 if self.passes_through(full.dtype) else full.numel() * self.wire_dtype(full.dtype).itemsize

    # ------------------------------------------------- what carries a piece
    def direct(self, op, backend) -> Optional[Callable[..., Any]]:
        """Where ``op``'s piece travels as it is (this hook neither encodes nor changes what carries it): the
        backend call that starts it, ``launch(**where) -> handle`` (the issuer then calls neither :meth:`start`
        nor :meth:`finish`); None otherwise."""
        cls = type(self)
        if cls.start is not CommHook.start or cls.finish is not CommHook.finish:
            return None
        piece = op.piece
        if not self.passes_through(piece.full.dtype):
            return None
        kind = op.spec.kind
        if kind == REDUCE_SCATTER:
            return functools.partial(backend.reduce_scatter, piece.shard, piece.full)
        if kind == ALL_GATHER:
            return functools.partial(backend.all_gather, piece.full, piece.shard)
        if kind == ALL_REDUCE:
            return functools.partial(backend.all_reduce, piece.full, "sum")
        return None

    def start(self, op, link: "Link") -> Tuple[Any, Any]:
        """Start what carries ``op``'s piece (an :class:`dearopt.engine.issuer.OpState`) on ``link``; returns
        ``(handle, ctx)``.  By default the op's own collective (reduce-scatter, all-gather or all-reduce) on the
        piece, through :meth:`encode` into a wire buffer where the bucket does not travel as it is."""
        kind, piece, where = op.spec.kind, op.piece, link.where
        backend = link.backend
        if self.passes_through(piece.full.dtype):
            if kind == REDUCE_SCATTER:
                return backend.reduce_scatter(piece.shard, piece.full, **where), None
            if kind == ALL_GATHER:
                return backend.all_gather(piece.full, piece.shard, **where), None
            return backend.all_reduce(piece.full, "sum", **where), None
        wire_full, wire_shard = piece.wire(self.wire_dtype(piece.full.dtype), link.pool)
        if kind == ALL_GATHER:  # (encoded before the gather starts)
            ctx = self._encode(piece.shard, piece.shard_grad, wire_shard)
            return backend.all_gather(wire_full, wire_shard, **where), (wire_full, wire_shard, ctx)
        ctx = self._encode(piece.full, piece.full_grad, wire_full)
        if kind == REDUCE_SCATTER:
            return backend.reduce_scatter(wire_shard, wire_full, **where), (wire_full, wire_shard, ctx)
        return backend.all_reduce(wire_full, "sum", **where), (wire_full, wire_shard, ctx)

    def finish(self, op, ctx: Any) -> None:
        """``op``'s collective completed: leave what arrived in the piece's result region (:meth:`decode`; the
        flags and tags behind the gradients copied exactly), and give the wire buffers back."""
        link = op.link
        piece = op.piece
        if ctx is None:  # (it travelled as it is)
            return
        wire_full, wire_shard, ctx = ctx
        shard = op.spec.result == "shard"
        wire, whole = (wire_shard, piece.shard) if shard else (wire_full, piece.full)
        result = piece.region(op.spec.result)
        n = result.numel()
        self.decode(wire[:n], result, ctx)
        whole[n:].copy_(wire[n:])
        link.pool.give(wire_full)  # the wire buffers exist while the op is in flight only

    def _encode(self, region: torch.Tensor, grads: torch.Tensor, wire: torch.Tensor) -> Any:
        """Gradients through the hook; the flags and tags behind them are copied exactly."""
        n = grads.numel()
        ctx = self.encode(grads, wire[:n])
        wire[n:].copy_(region[n:])
        return ctx

    def __repr__(self) -> str:
        return f"<comm hook {self.name}>"


class WirePool:
    """Buffers in a comm hook's wire dtype, taken when an op starts and given back when it completes: memory for
    the ops in flight, not for every bucket (a bfloat16 model reduced in float32 holds no float32 copy of its
    gradients).  A free buffer serves any op of its dtype and device that fits in it (a view of its front), the
    smallest that fits first; where none fits, the free ones smaller than the op are let go before a buffer of
    its size is made, so that what the pool holds stays what the most ops in flight at once need, not one
    buffer per bucket size.  With a :attr:`limit` (the issuer's wire budget), free buffers are let go, the
    smallest first, while the buffers taken and free together exceed it (BERT-Base in bfloat16 under ``dear``,
    2 ranks: peak per rank 1544 -> 1457 MiB with glibc's mmap threshold fixed, DDP 1351).  The issuer drops a
    finished op's hook context, which holds views of its buffers, so that a buffer let go is freed."""

    def __init__(self):
        self._free: dict = {}  # (dtype, device) -> free buffers, smallest first
        self.taken = 0  # bytes of the buffers taken and not given back (the ops in flight)
        self.limit: Optional[int] = None  # bytes of buffers held, taken and free together (the issuer's budget)
        self._held = 0  # bytes of the whole buffers taken

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.taken += numel * dtype.itemsize
        free = self._free.get((dtype, device))
        buffer = None
        if free:
            for i, candidate in enumerate(free):
                if candidate.numel() >= numel:
                    buffer = free.pop(i)
                    break
            else:
                free.clear()  # none fits: the smaller ones go (a buffer of this size serves them next time)
        if buffer is None:
            buffer = torch.empty(numel, dtype=dtype, device=device)
        self._held += buffer.numel() * dtype.itemsize
        self._trim()
        return buffer[:numel]

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer``: what :meth:`take` returned (its whole buffer is kept, within :attr:`limit`)."""
        self.taken -= buffer.numel() * buffer.dtype.itemsize
        whole = buffer._base if buffer._base is not None else buffer
        self._held -= whole.numel() * whole.dtype.itemsize
        free = self._free.setdefault((whole.dtype, whole.device), [])
        free.append(whole)
        free.sort(key=torch.Tensor.numel)
        self._trim()

    def _trim(self) -> None:
        """Free buffers let go, the smallest first, until the buffers taken and free together are within
        :attr:`limit`: a free one the ops in flight leave no room for is memory no op can use before they end
        (BERT-Base in bfloat16: at the end of backward, where the peak is, the tied embedding's 89 MiB op took
        its buffer while a bucket's 45 MiB one stayed free beside it)."""
        if self.limit is None:
            return
        total = self._held + sum(t.numel() * t.dtype.itemsize for kept in self._free.values() for t in kept)
        while total > self.limit:
            kept = min((k for k in self._free.values() if k), key=lambda k: k[0].numel(), default=None)
            if kept is None:
                return
            smallest = kept.pop(0)  # (each list is kept smallest first)
            total -= smallest.numel() * smallest.dtype.itemsize

    def buffers(self) -> List[torch.Tensor]:
        """The free buffers (what the pool holds between rounds)."""
        return [t for kept in self._free.values() for t in kept]


@dataclasses.dataclass(frozen=True)
class Link:
    """Where a hook starts a piece's collective: the data backend (collectives matched in plan order), the
    control channel (small agreements off the data queue), what names the collective (bucket, step), and the
    pool of wire buffers."""

    backend: Any
    control: Any
    where: dict
    pool: WirePool = dataclasses.field(default_factory=WirePool)


class GatherParameters(CommHook):
    """The sharded update's all-gathers: they carry the updated parameters into the model, never encoded (before
    the first sharded step has laid the parameters out, a piece travels through ``hook``)."""

    name = "parameters"

    def __init__(self, hook: CommHook):
        self.hook = hook

    def start(self, op, link: Link):
        """All-gather this rank's updated shard of the parameters into the model's flat parameter buffer."""
        piece = op.piece
        if piece.gather_full is None:
            return self.hook.start(op, link)
        return link.backend.all_gather(piece.gather_full, piece.gather_shard, **link.where), "parameters"

    def wire_nbytes(self, op) -> int:
        return self.hook.wire_nbytes(op) if op.piece.gather_full is None else 0

    def finish(self, op, ctx) -> None:
        """The parameters are in place."""
        if ctx != "parameters":
            self.hook.finish(op, ctx)


PLAIN = CommHook()
"""Every gradient as it is: the op's own collective on the piece."""


def hooks_for(
    plan, hook: Optional[CommHook], rows: Optional[CommHook] = None, sparse: Optional[CommHook] = None
) -> List[CommHook]:
    """Which hook carries each op of ``plan``: embedding rows' ops the ``rows`` hook, every all-reduce a
    sparsifier's exchange where there is one, the sharded update's all-gathers the parameters as they are, every
    other op the user's ``hook`` (or none: :data:`PLAIN`)."""
    hook = hook or PLAIN
    parameters = GatherParameters(hook)
    chosen = []
    for spec in plan.ops:
        if spec.kind == ROWS:
            chosen.append(rows)
        elif spec.kind == ALL_REDUCE and sparse is not None:
            chosen.append(sparse)
        elif spec.kind == ALL_GATHER and plan.sharded_update:
            chosen.append(parameters)
        else:
            chosen.append(hook)
    return chosen


class CastHook(CommHook):
    """Send floating-point gradients as ``dtype`` (rounded to nearest); other dtypes travel unchanged.

    Sums are taken in ``dtype`` on the wire: with float16, keep the summed
    gradients below 65504 (scale the loss down, or use bfloat16, whose range is
    float32's at 8 bits of precision).
    """

    def __init__(self, dtype: torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"CastHook casts to a floating-point dtype, got {dtype}")
        self.dtype = dtype
        self.name = f"cast-{str(dtype).replace('torch.', '')}"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if dtype.is_floating_point else dtype


class ReduceInFloat32(CommHook):
    """bfloat16 and float16 gradients are summed over ranks in float32 (as Megatron-core's
    ``grad_reduce_in_fp32``): each piece is widened into a float32 wire buffer, reduced, and rounded back once.
    Twice the bytes of such a bucket on the wire and a float32 copy of it in memory; other dtypes travel as they
    are, at no cost.  ``DistOptim``'s default (``comm_hook="auto"``); ``comm_hook=None`` reduces in the
    parameters' own dtype (less memory and traffic, a sum rounded at every step of the ring)."""

    name = "reduce-fp32"

    def __init__(self, auto: bool = False):
        self.auto = auto  # chosen by default, not by the user

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype in LOW_PRECISION else dtype

    def start(self, op, link: "Link"):
        """A reduction through a float32 wire buffer; an all-gather in the bucket's own dtype (its shard was
        rounded back already: gathering it wide and narrowing again would give the same values, at twice the
        bytes and a float32 buffer)."""
        if op.spec.kind == ALL_GATHER:
            piece = op.piece
            return link.backend.all_gather(piece.full, piece.shard, **link.where), None
        return super().start(op, link)

    def wire_nbytes(self, op) -> int:
        return 0 if op.spec.kind == ALL_GATHER else self._wire_of(op)  # (its start: the default's for the rest)

    def direct(self, op, backend):
        if op.spec.kind == ALL_GATHER:
            piece = op.piece
            return functools.partial(backend.all_gather, piece.full, piece.shard)
        return None


def fp16_compress() -> CastHook:
    """Gradients travel as float16 (half the bytes; ~3 decimal digits; range +-65504)."""
    return CastHook(torch.float16)


def bf16_compress() -> CastHook:
    """Gradients travel as bfloat16 (half the bytes; ~2 decimal digits; float32's range)."""
    return CastHook(torch.bfloat16)
