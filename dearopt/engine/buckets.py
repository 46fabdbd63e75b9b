"""Run-time state of a planned bucket: its flat buffer, the gradient views, its pieces and its tail.

A bucket owns one flat buffer laid out as the plan says
(:class:`dearopt.planning.plan.Bucket`): every parameter's ``.grad`` is a view into
it, so backward writes gradients straight into what is communicated.  Each
piece (partition) of the buffer is the unit a collective works on; its shard
is this rank's part of the reduce-scatter result.

The buffer's **tail** travels with the gradients, so the agreement it carries costs no message of its own:

* **used flags**, one per parameter, summed over ranks: how many ranks produced a gradient.  Zero means skip the
  parameter (as ``grad=None``); any other count means update it with the average, the missing ranks counting as
  zeros (:meth:`BucketState.used_anywhere`);
* **step tags** (``check_agreement``), one slot per rank: before its first reduction each bucket gets this rank's
  tag (step number and training forwards since the last step) in its own slot (:meth:`BucketState.write_tail`);
  after the reduction every rank sees every rank's tag, and :func:`read_tails` raises
  :class:`~dearopt.errors.StepMismatchError` if they differ.
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from dearopt.backends.groups import is_dtensor, local_tensor
from dearopt.errors import StepMismatchError
from dearopt.planning.plan import Bucket

__all__ = ["BucketState", "PieceState", "read_tails", "step_tag"]

# A rank's step tag encodes its step count and the number of training
# forwards since its last step; it must be exact in the dtype the bucket
# travels in (integers up to 256 for bfloat16, 2048 for float16, 2**24 for float32).
_TAG_STEPS = {torch.bfloat16: 32, torch.float16: 256}


def step_tag(step: int, forwards: int, wire_dtype: torch.dtype) -> int:
    """This rank's step tag (see the module), exact in ``wire_dtype``."""
    steps = _TAG_STEPS.get(wire_dtype, 2**20)
    return (step % steps) * 8 + min(forwards, 7)


def read_tails(buckets, step: int, *, check: bool, extra: Optional[torch.Tensor] = None) -> Optional[float]:
    """Check the step tags of ``buckets`` (reduced) with one read from the device (a GPU's host waits for it once
    per step, not once per bucket); ``check``: False reads nothing.  ``extra`` (a scalar on the same device) rides
    along and is returned."""
    if not check or not buckets or buckets[0].world == 1:
        return None if extra is None else float(extra)
    world = buckets[0].world
    parts = [b.tags.float() for b in buckets] + ([extra.reshape(1).float()] if extra is not None else [])
    values = torch.cat(parts).tolist()
    for i, bucket in enumerate(buckets):
        tags = [int(round(t)) for t in values[i * world : (i + 1) * world]]
        if len(set(tags)) > 1:
            seen = ", ".join(
                f"rank {r}: step {t // 8} ({t % 8} forwards since its last step)" for r, t in enumerate(tags)
            )
            raise StepMismatchError(
                f"ranks sent gradients of different steps in one collective ({seen}); a rank skipped or repeated "
                f"forward/backward/step. No update of this step was applied",
                rank=bucket.rank,
                op="step agreement",
                bucket=bucket.index,
                step=step,
            )
    return None if extra is None else values[-1]


def _grad_view(buffer: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as a view of ``buffer`` from ``offset``: shaped as ``p``, or for a ``DTensor`` parameter a
    ``DTensor`` laid out as ``p`` whose local shard is the view (what autograd accumulates into)."""
    if not is_dtensor(p):
        return buffer[offset : offset + p.numel()].view_as(p)
    local = p._local_tensor
    flat = buffer[offset : offset + local.numel()].view(local.shape)
    with torch.no_grad():
        return type(p).from_local(flat, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class PieceState:
    """One partition ``[start, end)`` of a bucket's buffer and this rank's shard of it."""

    def __init__(
        self, bucket: "BucketState", index: int, start: int, end: int, shard: torch.Tensor, world: int, rank: int
    ):
        # the bucket owns its pieces; a piece refers back weakly, so that a bucket a re-plan drops (and its
        # buffer) is freed at once, without waiting for the cycle collector
        self._bucket = weakref.ref(bucket)
        self._rank = rank
        self.index = index
        self.full = bucket.buffer[start:end]
        self.shard = shard
        grad_numel = bucket.spec.grad_numel
        n = (end - start) // world
        first_element = start + rank * n  # the buffer element this rank's shard starts at
        self.shard_grad = shard[: max(0, min(n, grad_numel - first_element))]
        self.full_grad = self.full[: max(0, min(end, grad_numel) - start)]
        self.own_in_full = self.full[rank * n : rank * n + self.shard_grad.numel()]  # where the shard came from
        # sharded update (dearopt.engine.sharding): the all-gather carries the piece's parameters, not its gradients
        self.gather_full: Optional[torch.Tensor] = None
        self.gather_shard: Optional[torch.Tensor] = None

    @property
    def bucket(self) -> "BucketState":
        """The bucket this is a piece of."""
        return self._bucket()

    def region(self, result: str) -> torch.Tensor:
        """The gradient elements of an op's result: this rank's shard, or the whole piece."""
        return self.shard_grad if result == "shard" else self.full_grad

    def wire(self, dtype: torch.dtype, pool):
        """Buffers of this piece in ``dtype`` for a comm hook that changes the dtype, from ``pool`` (a
        :class:`dearopt.compression.hooks.WirePool`: give the full one back when the op completed); the shard is
        the full one's own region, as in the bucket."""
        n = self.shard.numel()
        full = pool.take(self.full.numel(), dtype, self.full.device)
        return full, full[self._rank * n : (self._rank + 1) * n]


class BucketState:
    """The buffer, views and per-parameter bookkeeping of one planned bucket."""

    def __init__(
        self,
        spec: Bucket,
        params: List[torch.nn.Parameter],
        names: List[str],
        group_of: List[int],
        n_groups: int,
        world: int,
        rank: int,
    ):
        self.spec = spec
        self.index = spec.index
        self.rank, self.world = rank, world
        self.size = len(params)  # parameters (the count of gradients that completes the bucket)
        self.group_of, self.n_groups = tuple(group_of), n_groups  # the optimizer's groups it was made for
        self.params = params
        self.names = names
        self.buffer = torch.zeros(spec.padded_numel, dtype=params[0].dtype, device=params[0].device)
        self.has_dtensor = any(map(is_dtensor, params))  # updated per parameter (dearopt.engine.updates)
        self.views = [_grad_view(self.buffer, o, p) for o, p in zip(spec.offsets, params)]
        self.ptrs = [local_tensor(v).data_ptr() for v in self.views]
        self.flags = self.buffer[spec.flags_offset : spec.flags_offset + len(params)]
        self.tags = self.buffer[spec.tags_offset : spec.tags_offset + world]
        # this rank's shard of each piece is the piece's own region of the buffer: the reduce-scatter writes its
        # sum there (in place: the rest of the piece was sent and is read no more) and the all-gather sends it
        # from there, so a shard costs no memory of its own
        self.pieces: List[PieceState] = []
        for k, (start, end) in enumerate(spec.pieces or ((0, spec.padded_numel),)):
            n = (end - start) // world
            own = self.buffer[start + rank * n : start + (rank + 1) * n]
            self.pieces.append(PieceState(self, k, start, end, own, world, rank))
        self.group_members = [[p for p, g in zip(params, group_of) if g == gi] for gi in range(n_groups)]
        self.position = {id(p): j for j, p in enumerate(params)}
        self.used = [False] * len(params)  # got a gradient since the last zero_grad (sent as flags)
        self.has_grad = [False] * len(params)  # what `p.grad is not None` would be without buckets
        # The view still holds an old gradient that zero_grad(set_to_none=True) cleared lazily: p.grad is None,
        # and the view is zeroed only if no gradient was written into it before the bucket is sent.
        self.stale = [False] * len(params)
        self.stamp = [-1] * len(params)  # the backward pass that last counted this gradient as ready
        self.ready = 0  # gradients counted ready in the communicating backward pass
        self.meta_written = False  # flags and step tag written into the buffer for this round
        self.meta_tag = 0  # the step tag written (this rank's, as the host knows it)
        self.pending = False  # reduced gradients await the optimizer update
        self.zero_after_update: Optional[bool] = None  # zero_grad() came while the update was pending
        self.seen_version = self.buffer._version  # the buffer's version after the engine's last write to it
        self.sparse = [False] * len(params)  # autograd gives it sparse gradients (set by the executor's watch)
        self.flat = None  # its flat runs (dearopt.engine.updates.FlatRuns), made at its first flat update

    # ------------------------------------------------------------------ tail
    def write_tail(self, tag: int) -> None:
        """The used flags and this rank's step tag, written once per round before the bucket's first reduction."""
        if self.meta_written:
            return
        if all(self.used):  # the usual case: a fill, no copy from the host (which on a GPU would wait for it)
            self.flags.fill_(1)
        else:
            on_gpu = self.flags.is_cuda
            host = torch.tensor(self.used, dtype=self.flags.dtype, pin_memory=on_gpu)
            self.flags.copy_(host, non_blocking=on_gpu)
        self.tags.zero_()
        self.tags[self.rank : self.rank + 1].fill_(tag)  # a fill: `tags[rank] = tag` copies from the host
        self.meta_tag = tag
        self.meta_written = True
        self.mark_seen()

    def used_anywhere(self) -> List[bool]:
        """Which parameters got a gradient on at least one rank (the reduced flags).

        A parameter used on some ranks only gets the average over all ranks
        with zeros from the others, which is exactly its gradient over the
        global batch (the samples that did not use it contribute nothing).
        Where this rank used them all, the flags (a sum over ranks) need not
        be read: on a GPU that read would make the host wait for the device.
        """
        if all(self.used):
            return [True] * len(self.used)
        return [count > 0 for count in self.flags.float().round().tolist()]

    @property
    def has_members(self) -> bool:
        """Whether any of the bucket's parameters belongs to the optimizer (a twin's bucket has none)."""
        return any(self.group_members)

    @property
    def complete(self) -> bool:
        return self.ready >= len(self.params)

    def mark_seen(self) -> None:
        """The engine wrote the buffer: remember its version, so that writes by anyone else can be noticed."""
        self.seen_version = self.buffer._version

    def written_by_others(self) -> bool:
        """Whether the buffer was changed in place (e.g. ``p.grad.mul_``) since the engine last wrote it."""
        return self.buffer._version != self.seen_version

    def replaced_gradients(self) -> List[str]:
        """Names of parameters whose ``.grad`` is no longer the bucket's view (assigned a new tensor)."""
        return [name for p, view, name in zip(self.params, self.views, self.names) if p.grad is not view]

    def adopt(self, p: torch.nn.Parameter, j: int) -> None:
        """Make ``p.grad`` the bucket's view, keeping any gradient it had."""
        if p.grad is not None:
            self.views[j].copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            self.used[j] = self.has_grad[j] = True
        p.grad = self.views[j]
        self.mark_seen()

    def reconcile(self) -> None:
        """Before a backward: take in what user code did to ``p.grad`` since the engine last saw it, whichever way it
        zeroed or replaced it (``model.zero_grad()``, a submodule's, the wrapped optimizer's, ``p.grad = None`` by
        hand): a gradient set to None counts as cleared (its view is zeroed before the bucket is sent, unless
        backward writes it first), a tensor put there becomes the view's contents.  A view zeroed in place needs
        nothing: it is what the bucket sends."""
        changed = False
        for j, (p, view) in enumerate(zip(self.params, self.views)):
            grad = p.grad
            if grad is view:
                continue
            changed = True
            if grad is None:
                if not self.stale[j]:
                    self.stale[j], self.used[j], self.has_grad[j] = True, False, False
            else:
                view.copy_(grad.to_dense() if grad.is_sparse else grad)
                p.grad = view
                self.stale[j], self.used[j], self.has_grad[j] = False, True, True
        if changed:
            self.mark_seen()

    def take_counted(self, counted: Optional[bytes] = None) -> None:
        """The gradients the C++ hooks counted in this pass (each already moved into its view): all of them, or
        the positions whose byte in ``counted`` is set."""
        n = len(self.params)
        if counted is None or all(counted):
            self.used = [True] * n
            self.has_grad = [True] * n
            self.stale = [False] * n
        else:
            for j in range(n):
                if counted[j]:
                    self.used[j] = self.has_grad[j] = True
                    self.stale[j] = False
        self.mark_seen()

    def take_gradient(self, p: torch.nn.Parameter, j: int) -> None:
        """After autograd accumulated into ``p.grad``: if the user replaced or cleared it, copy it back in."""
        grad = p.grad
        if grad is None or grad.is_sparse or local_tensor(grad).data_ptr() != self.ptrs[j]:
            view = self.views[j]
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.to_dense() if grad.is_sparse else grad)
            p.grad = view
        self.used[j] = True
        self.stale[j] = False
        self.mark_seen()

    def sparse_gradients(self):
        """For the optimizer's update: ``p.grad`` as the sparse tensor autograd would have given it (Horovod's
        ``to_sparse()`` of the reduced gradient), for the parameters that get sparse gradients; restore after."""
        for j, p in enumerate(self.params):
            if self.sparse[j] and p.grad is self.views[j]:
                p.grad = self.views[j].to_sparse(1)

    def dense_gradients(self) -> None:
        """Undo :meth:`sparse_gradients`: the sparse parameters' ``p.grad`` is the bucket's view again."""
        for j, p in enumerate(self.params):
            if self.sparse[j] and p.grad is not None and p.grad.is_sparse:
                p.grad = self.views[j]

    def restore_views(self) -> None:
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    def start_round(self) -> None:
        self.ready = 0
        self.meta_written = False

    def zero(self, set_to_none: bool) -> None:
        """``zero_grad()``: with ``set_to_none`` every ``p.grad`` becomes None, as in torch, and the buffer is
        not written (autograd's next gradient is copied into the view instead of added to zeros, which saves a
        pass over the buffer: 0.44 GB for BERT-Base); without it, the views are zeroed and stay ``p.grad``."""
        n = len(self.params)
        if set_to_none:
            for p in self.params:
                p.grad = None
            self.stale = [True] * n
            self.has_grad = [False] * n
        else:
            self.buffer.zero_()
            self.stale = [False] * n
            self.restore_views()
        self.used = [False] * n
        self.mark_seen()

    def clear_stale(self) -> None:
        """Before the bucket is sent: the views that got no gradient since ``zero_grad()`` become zero ``p.grad``."""
        if any(self.stale):
            for j, (p, view) in enumerate(zip(self.params, self.views)):
                if self.stale[j]:
                    view.zero_()
                    if p.grad is None:
                        p.grad = view
            self.stale = [False] * len(self.params)
            self.mark_seen()
