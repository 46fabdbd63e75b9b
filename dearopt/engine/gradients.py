"""The averaged gradients: finishing the reductions, reading and changing the averages before ``step()``.

:class:`AveragedGradients` is the engine's part between ``backward()`` and
``step()``: it finishes the reductions that may run before ``step()``, clips
and unscales the averaged regions (whole pieces, or this rank's shards, whose
norm is combined over ranks), gathers the averages into ``p.grad`` when user
code reads it (torch's ``clip_grad_norm_``, ``GradScaler.unscale_``), takes
back what user code left there, and judges whether they are finite (the ``nonfinite`` option: raise, skip the
step on every rank, or ignore).
Everything it does follows the bound plan (:mod:`dearopt.engine.bound_plan`); it never
asks which schedule made it.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from dearopt.backends.base import CollectiveBackend
from dearopt.engine.bound_plan import BoundPlan
from dearopt.engine.buckets import BucketState
from dearopt.engine.guards import GradientGuard, PendingUpdateGuard
from dearopt.engine.hooks import LifeCycle, TrainingState
from dearopt.engine.issuer import Issuer
from dearopt.engine.sharding import ShardedUpdate
from dearopt.engine.tensor_parallel import TensorParallel
from dearopt.errors import CollectiveTimeoutError, NonFiniteGradientError, UsageError
from dearopt.planning.plan import Point

__all__ = ["AveragedGradients", "NonFiniteVerdict"]


def _count_nonfinite(regions: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A device scalar: how many of ``regions`` hold inf or NaN (None: no region), read by nobody yet."""
    # one pass, no temporary: the sum is finite iff every element is (or it overflowed)
    sums = [r.sum().float().reshape(1) for r in regions if r.numel()]
    if not sums:
        return None
    return (~torch.isfinite(torch.cat(sums))).sum()


def _any_nonfinite(regions: Sequence[torch.Tensor]) -> bool:
    """Whether any of this rank's ``regions`` holds inf or NaN (one read from the device)."""
    count = _count_nonfinite(regions)
    return count is not None and bool(count > 0)


class AveragedGradients:
    """The averaged gradients of one engine (see the module)."""

    def __init__(
        self,
        life: LifeCycle,
        backend: CollectiveBackend,
        control: CollectiveBackend,
        optimizer: torch.optim.Optimizer,
        guards: Tuple[GradientGuard, PendingUpdateGuard],
        *,
        tensor_parallel: Optional[TensorParallel] = None,
        sharding: Optional[ShardedUpdate] = None,
        sparse=None,
        schedule: str = "",
    ):
        self.life = life  # the engine's life cycle, read here (the round, the step): never moved from here
        self.backend, self.control, self.optimizer = backend, control, optimizer
        self.rank, self.world = backend.rank, backend.size
        self.grad_guard, self.guard = guards  # the gradient guard (before step()), the pending-update guard
        self.tensor_parallel, self.sharding, self.sparse = tensor_parallel, sharding, sparse
        self.verdict = NonFiniteVerdict(control, tensor_parallel)  # whether the averages are finite, agreed
        self.schedule = schedule  # its name, for errors
        self.bound: Optional[BoundPlan] = None  # the plan in force and its issuer (bind)
        self.issuer: Optional[Issuer] = None
        self.unscaled_at = -1  # the step whose gradients unscale_() divided
        self.gathered_steps = 0  # steps in a row whose p.grad user code read before step()
        self.reads = False  # re-planned for a loop that reads p.grad before every step()

    def bind(self, bound: BoundPlan, issuer: Issuer) -> None:
        """A plan was bound: its buckets and the issuer of its ops (until the next re-plan)."""
        self.bound, self.issuer = bound, issuer

    # ------------------------------------------------------------ averaging
    def finish_averaging(self) -> List[Tuple[torch.Tensor, bool]]:
        """Complete every op that may run before ``step()``; return the averaged gradient regions.

        Each region is ``(tensor, is_shard)``: this rank's shard of a bucket
        piece (summed over ranks it covers the piece), or the whole piece.
        """
        self.life.require_gradients("finish the gradient reduction")
        bound = self.bound
        self.issuer.force_and_complete(bound.early_ops, self.life.round)
        self.combine()
        if (
            self.life.round is not None and self.life.round.gathered
        ):  # p.grad holds the average: that is where it lives now
            return bound.averaged_whole
        return bound.averaged

    @property
    def in_place_before_step(self) -> bool:
        """Whether every ``p.grad`` holds the averaged gradient once :meth:`finish_averaging` returns."""
        bound = self.bound
        return bound is not None and not any(is_shard for _, is_shard in bound.averaged)

    def combine(self, point: Optional[Point] = None) -> None:
        """Add the averaged gradient of each tied use (the twin) to its weight's, once per round, at ``point``
        (the moment the weight's rows are due) or, with None, now."""
        for owner, j, twin, k, due in self.bound.combines:
            if (point is None or due == point) and id(owner.params[j]) not in self.life.round.combined:
                self.life.round.combined.add(id(owner.params[j]))
                with self.grad_guard.suspended():  # the engine's own write, not user code reading p.grad
                    owner.views[j].add_(twin.views[k])
                    # the twin's part now lives in its weight's gradient, which user code zeroes
                    # (model.zero_grad() never sees the twin): the twin starts the next round from zero
                    twin.views[k].zero_()
                owner.mark_seen()
                twin.mark_seen()

    def reconcile(self) -> None:
        """Before a backward: each bucket takes in what user code did to ``p.grad`` (:meth:`BucketState.reconcile`);
        a tied weight cleared by the user clears its twins' bookkeeping too (their gradients were moved into the
        weight's when they were combined)."""
        for b in self.bound.buckets:
            b.reconcile()
        for owner, j, twin, k, _ in self.bound.combines:
            if owner.stale[j] and not twin.stale[k]:
                twin.used[k] = twin.has_grad[k] = False

    def reduce(self) -> None:
        """Finish communication so that every ``p.grad`` holds the averaged gradient (under schedules that keep
        shards, they are gathered now: that step's gathers no longer overlap the next forward)."""
        self.life.require_gradients("finish the gradient reduction")
        if self.bound.grad_params:
            self.requested(-1)
        self.finish_averaging()

    # ------------------------------------------------------- clip, unscale
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` would."""
        regions = self.finish_averaging()
        total_norm = self._global_norm(regions, float(norm_type))
        coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
        for region, _ in regions:
            region.mul_(coef.to(region.dtype))
        self.mark_written()
        return total_norm.cpu()

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged gradients to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``."""
        clip_value = float(clip_value)
        for region, _ in self.finish_averaging():
            region.clamp_(-clip_value, clip_value)
        self.mark_written()

    def unscale_(self, scale, key: int = 0) -> None:
        """Divide the averaged gradients (shards where the schedule keeps shards) by ``scale``: a number, or a
        ``torch.amp.GradScaler`` (what its ``unscale_`` does, its state kept under ``key``, the optimizer's id)."""
        if isinstance(scale, torch.amp.GradScaler):
            from torch.amp.grad_scaler import OptState

            scale._check_scale_growth_tracker("unscale_")
            if scale._per_optimizer_states[key]["stage"] is not OptState.READY:
                raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
            self.scaler_found_inf(scale, key, unscale=True)
            return
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"unscale_ needs a positive finite scale, got {scale}")
        self._check_not_unscaled()
        regions = self.finish_averaging()
        self.unscaled_at = self.life.step_count
        for region, _ in regions:
            region.div_(scale)
        self.mark_written()

    def unscale_and_check(self, inv_scale: torch.Tensor) -> bool:
        """GradScaler's unscale on the averaged gradients: multiply by ``inv_scale``; True if any is not finite.

        The answer is the same on every rank (shards are combined over ranks),
        so every rank skips the same steps and adjusts its scale alike.
        """
        self._check_not_unscaled()
        regions = self.finish_averaging()
        self.unscaled_at = self.life.step_count
        found = False
        for region, _ in regions:
            region.mul_(inv_scale.to(device=region.device, dtype=region.dtype))
            found = found or (region.numel() > 0 and not bool(torch.isfinite(region.sum())))
        self.mark_written()
        if any(is_shard for _, is_shard in regions) and self.world > 1:
            flag = torch.tensor([1.0 if found else 0.0], device=self.control.device)
            self.control.all_reduce(flag, "max", step=self.life.step_count).wait()
            found = float(flag) > 0
        if self.tensor_parallel is not None:  # every tensor-parallel rank skips the same step
            found = self.tensor_parallel.any(found, self.life.step_count)
        return found

    def scaler_found_inf(self, scaler, key: int, unscale: bool) -> bool:
        """Unscale through ``scaler`` if it has not been done this step (recording the agreed inf/NaN answer in
        the scaler's state under ``key``, as its own ``unscale_`` would); return whether inf/NaN was found."""
        from torch.amp.grad_scaler import OptState

        if self.sparse is not None:
            raise UsageError(
                "GradScaler is not supported with comm_hook=dearopt.Sparsify(...): the residuals "
                "(error feedback) would carry gradients scaled differently from step to step, and a "
                "skipped step would lose what it selected"
            )
        state = scaler._per_optimizer_states[key]
        if state["stage"] is OptState.READY and unscale:
            inv_scale = scaler._scale.double().reciprocal().float()
            found = self.unscale_and_check(inv_scale)
            state["found_inf_per_device"] = {
                scaler._scale.device: torch.full((), float(found), device=scaler._scale.device)
            }
            state["stage"] = OptState.UNSCALED
        elif state["stage"] is OptState.UNSCALED and not unscale:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        return sum(float(v) for v in state["found_inf_per_device"].values()) > 0

    def _check_not_unscaled(self) -> None:
        if self.unscaled_at == self.life.step_count:
            raise UsageError(
                "unscale_() was already called since the last step(); the gradients would be divided twice"
            )

    def mark_written(self) -> None:
        """Clipping or unscaling wrote to the averaged gradients after their averaging pass."""
        for b in self.bound.buckets:
            b.mark_seen()
        if self.life.round is not None:  # the averaging pass's inf/NaN flags no longer describe the gradients
            self.life.round.written = True

    def _global_norm(self, regions, norm_type: float) -> torch.Tensor:
        """The norm over whole pieces and shards; shards are combined over ranks on the control channel."""
        if self.tensor_parallel is not None:
            return self._tensor_parallel_norm(regions, norm_type)
        device = self.control.device
        shards = [r for r, is_shard in regions if is_shard]
        whole = [r for r, is_shard in regions if not is_shard]
        if norm_type == math.inf:

            def local_max(rs):
                return max((float(r.abs().max()) for r in rs if r.numel()), default=0.0)

            total = torch.tensor([local_max(shards)], dtype=torch.float64, device=device)
            if shards and self.world > 1:
                self.control.all_reduce(total, "max", step=self.life.step_count).wait()
            return torch.tensor(max(float(total), local_max(whole)), dtype=torch.float32)

        def local_sum(rs):
            return float(sum(r.double().abs().pow(norm_type).sum() for r in rs)) if rs else 0.0

        total = torch.tensor([local_sum(shards)], dtype=torch.float64, device=device)
        if shards and self.world > 1:
            self.control.all_reduce(total, "sum", step=self.life.step_count).wait()
        return torch.tensor((float(total) + local_sum(whole)) ** (1.0 / norm_type), dtype=torch.float32)

    def _tensor_parallel_norm(self, regions, norm_type: float) -> torch.Tensor:
        """:meth:`_global_norm` with ``DTensor`` parameters: the elements of parameters sharded over the
        tensor-parallel ranks are combined over those ranks too; the others (every tp rank holds them alike) are
        counted once."""
        cut = self.tensor_parallel.split(regions, self.bound.buckets)
        inf = norm_type == math.inf

        def local(parts) -> float:
            if inf:
                return max((float(r.abs().max()) for r in parts if r.numel()), default=0.0)
            return float(sum(r.double().abs().pow(norm_type).sum() for r in parts)) if parts else 0.0

        shard_tp = [r for inside, _, is_shard in cut if is_shard for r in inside]
        shard_rest = [r for _, outside, is_shard in cut if is_shard for r in outside]
        values = torch.tensor([local(shard_tp), local(shard_rest)], dtype=torch.float64, device=self.control.device)
        if any(is_shard for _, _, is_shard in cut) and self.world > 1:
            self.control.all_reduce(values, "max" if inf else "sum", step=self.life.step_count).wait()
        whole_tp = local([r for inside, _, is_shard in cut if not is_shard for r in inside])
        whole_rest = local([r for _, outside, is_shard in cut if not is_shard for r in outside])
        shard_tp, shard_rest = values.tolist()
        join = max if inf else (lambda a, b: a + b)
        sharded = self.tensor_parallel.combine(join(shard_tp, whole_tp), norm_type, self.life.step_count)
        total = join(sharded, join(shard_rest, whole_rest))
        return torch.tensor(total if inf else total ** (1.0 / norm_type), dtype=torch.float32)

    # ------------------------------------------------ p.grad read or changed
    def requested(self, bucket: int) -> None:
        """User code read a ``p.grad`` between backward() and step() whose average was still travelling or kept as
        this rank's shard (torch's ``clip_grad_norm_``, ``GradScaler.unscale_``): finish every reduction now and
        gather each bucket's average into ``p.grad``, so that the code sees and changes the averaged gradient, as
        under DDP.  Every rank runs the same code, so every rank issues the same collectives in the same order
        (a rank that alone reads ``p.grad`` here waits for the others' next forward)."""
        self.grad_guard.disarm()
        r = self.life.round
        if r is None or r.stepped or r.gathered or not r.backward_done:
            return
        try:
            with self.guard.suspended():
                # the reductions first: a gather reads what completing its reduce-scatter wrote (the local sum)
                self.issuer.force_and_complete(self.bound.early_ops, self.life.round)
                if self.sharding is None:
                    self.issuer.force_and_complete(self.issuer.ops, self.life.round)
                else:  # the plan's all-gathers carry parameters after step(): the gradients' average needs its own
                    self._gather_shards()
                self.combine()
        except CollectiveTimeoutError as exc:
            raise CollectiveTimeoutError(
                f"{exc}. This rank read p.grad between backward() and step(), which gathers the averaged gradients "
                f"(every rank must take part); if only this rank reads it (a log line under `if rank == 0`), the "
                f"others wait in step() meanwhile: read p.grad on every rank, or after step()",
                rank=self.rank,
                op="gather p.grad",
                step=r.step,
            ) from exc
        r.gathered = r.written = True
        for b in self.bound.buckets:
            b.mark_seen()

    def _gather_shards(self) -> None:
        """Sharded update: each piece's averaged shards all-gathered into the gradient views (flags and tags left
        as they are: the sharded step sums them itself)."""
        scratch = None
        for b in self.bound.buckets:
            for piece in b.pieces:
                if scratch is None or scratch.numel() < piece.full.numel() or scratch.dtype != piece.full.dtype:
                    scratch = torch.empty(piece.full.numel(), dtype=piece.full.dtype, device=piece.full.device)
                out = scratch[: piece.full.numel()]
                self.backend.all_gather(out, piece.shard, bucket=b.index, step=self.life.round.step).wait()
                piece.full_grad.copy_(out[: piece.full_grad.numel()])

    def take_user_gradients(self) -> None:
        """At step() after the averages were gathered into ``p.grad``: what the user's code left there (changed
        in place, or a new tensor) is the gradient; this rank's shards are taken from it again, so the checks and
        a sharded update see it."""
        for b in self.bound.buckets:
            for j, (p, view) in enumerate(zip(b.params, b.views)):
                grad = p.grad
                if grad is not None and grad is not view:
                    view.copy_(grad.to_dense() if grad.is_sparse else grad)
                    p.grad = view
        for i in self.bound.own_gradient_buckets:
            for piece in self.bound.buckets[i].pieces:
                piece.shard_grad.copy_(piece.own_in_full)
        for b in self.bound.buckets:
            b.mark_seen()

    def check_writes(self) -> None:
        """Gradients changed between backward() and step() must not be changed behind the engine's back."""
        for b in self.bound.buckets:
            if b.index in self.bound.final_after_backward or b.spec.twin_of is not None:
                continue  # p.grad held the averaged gradient when backward returned: any change is the user's own
            replaced = b.replaced_gradients()
            if not replaced and not b.written_by_others():
                continue
            if self.world == 1:  # with one rank the "reduction" was a copy: take the changed gradients again
                self._retake_local(b)
                continue
            what = (
                f"the .grad of {replaced[:3]} was replaced by another tensor"
                if replaced
                else f"a gradient of bucket {b.index} ({', '.join(b.names[:3])}{', ...' if len(b.names) > 3 else ''}) "
                f"was changed in place"
            )
            raise UsageError(
                f"{what} between backward() and step(), but under schedule={self.schedule!r} p.grad holds "
                f"this rank's own gradient while the average travels or is kept as shards, so the change would "
                f"be lost or mixed in. Change p.grad only after backward() has returned (the first read of a p.grad "
                f"then gathers the average into every p.grad, as torch's clip_grad_norm_ and GradScaler.unscale_ "
                f"find it), or call optimizer.clip_grad_norm_(...), optimizer.clip_grad_value_(...) or "
                f"optimizer.unscale_(scaler), which act on the averaged gradients [rank {self.rank}, step "
                f"{self.life.step_count}]"
            )

    @staticmethod
    def _retake_local(bucket: BucketState) -> None:
        """One rank: p.grad (changed in place or replaced after backward) is the gradient to use."""
        for j, p in enumerate(bucket.params):
            if p.grad is not bucket.views[j]:
                bucket.take_gradient(p, j)
        for piece in bucket.pieces:
            piece.shard.copy_(piece.full)
        bucket.mark_seen()

    # ------------------------------------------------------------ non-finite
    def nonfinite_count(self):
        """How many of this rank's regions due by ``step()`` hold inf or NaN, as a device scalar nobody has read
        yet (None: nothing to check), so that the caller reads it with the step tags, once.  Where the averaging pass
        flagged a region (:meth:`Issuer._average`) and nothing can have written to it since, its flag answers;
        any other region is summed.  Written since: by clipping or ``unscale_`` (``round.written``), by adding a
        tied weight's second gradient, or by the user's code where ``p.grad`` holds the average when backward
        returns (``wfbp``, all-reduced buckets): such code may write through ``.data`` or a raw kernel, which no
        version counter sees, so those buckets are always summed.  The choice depends only on the plan and on
        calls every rank makes, so every rank judges alike."""
        r, bound = self.life.round, self.bound
        combined_into = {owner.index for owner, *_ in bound.combines}
        flags, summed = [], []
        for op in bound.checked_at_step:
            b = op.spec.bucket
            if (
                op.nonfinite is not None
                and not r.written
                and b not in combined_into
                and b not in bound.final_after_backward
            ):
                flags.append(op.nonfinite)
            else:
                summed.append(op.piece.region(op.spec.result))
        count = _count_nonfinite(summed)
        if flags:
            device = flags[0].device
            flagged = (torch.cat([f.to(device).reshape(-1) for f in flags]) > 0).sum()
            count = flagged if count is None else count + flagged.to(count.device)
        return count

    def local_nonfinite(self) -> bool:
        """Whether this rank's regions due by ``step()`` hold inf or NaN (read now)."""
        count = self.nonfinite_count()
        return count is not None and bool(count > 0)

    # -------------------------------------------------------------- zeroing
    def zero(self, set_to_none: bool) -> None:
        """``zero_grad()``: a bucket whose update is pending is zeroed right after it (its update still reads the
        reduced gradient); a parameter outside the plan as torch would."""
        if self.bound is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        if self.life.state is TrainingState.REDUCING:
            raise UsageError(
                "zero_grad() was called after backward() and before step(): the gradients being "
                "communicated would be lost; call it before backward() or after step()"
            )
        for bucket in self.bound.buckets:
            if bucket.pending:
                # zeroed right after its update, which still reads the reduced gradient; its parameters are
                # guarded until then, so code that reads a p.grad first lands the update and finds it None
                bucket.zero_after_update = bool(set_to_none)
            else:
                bucket.zero(bool(set_to_none))
        planned = self.bound.where
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in planned and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()


class NonFiniteVerdict:
    """Whether a step's averaged gradients are finite, the same answer on every rank (and on every tensor-parallel
    rank): under the ``nonfinite`` policy, raise :class:`~dearopt.errors.NonFiniteGradientError` naming the first
    parameter and, where it can be known, the ranks it came from; skip the step on every rank; or ignore."""

    def __init__(self, control: CollectiveBackend, tensor_parallel: Optional[TensorParallel] = None):
        self.control, self.tensor_parallel = control, tensor_parallel
        self.rank, self.world = control.rank, control.size

    def judge(
        self,
        policy: str,
        regions: Sequence[torch.Tensor],
        sharded: bool,
        buckets: Sequence[BucketState],
        step: int,
        own: Sequence[int] = (),
        agreed: Optional[bool] = None,
        local: Optional[bool] = None,
    ) -> bool:
        """Check the averaged gradients (this rank's shards if ``sharded``) under ``policy`` (the ``nonfinite``
        option: ``raise``, ``skip``, ``ignore``): True means skip the step.

        ``own``: the buckets whose buffers still hold this rank's own gradients
        (their average is kept as shards), from which the ranks a non-finite
        gradient came from can be named.  ``agreed``: the answer over every
        rank, where the caller already combined :meth:`local_nonfinite` with
        another message (the sharded update's).  ``local``: this rank's answer where the caller has it
        (the averaging pass flagged the regions), else the regions are summed.
        """
        if policy == "ignore" or (not regions and agreed is None):
            return False
        if agreed is None:
            found = _any_nonfinite(regions) if local is None else local
            if sharded and self.world > 1:  # each rank checked its own shards: every rank must learn the answer
                flag = torch.full((1,), 1.0 if found else 0.0, device=self.control.device)
                self.control.all_reduce(flag, "max", step=step).wait()
                found = float(flag) > 0
            agreed = found
        if self.tensor_parallel is not None:  # every tensor-parallel rank skips or raises at the same step
            agreed = self.tensor_parallel.any(agreed, step)
        if not agreed:
            return False
        if policy == "skip":
            return True
        raise NonFiniteGradientError(
            self._describe_nonfinite(buckets, step, own) + "; pass nonfinite='skip' to skip such steps",
            rank=self.rank,
            op="step",
            step=step,
        )

    def bucket(self, policy: str, bucket: BucketState, buckets: Sequence[BucketState], step: int) -> None:
        """For schedules that update bucket by bucket: this bucket's averaged gradient (``policy`` ``raise``
        only)."""
        if policy != "raise":
            return
        found = not bool(torch.isfinite(bucket.buffer[: bucket.spec.grad_numel].sum()))
        if self.tensor_parallel is not None:  # the tensor-parallel ranks hold other shards: all raise, or none
            found = self.tensor_parallel.any(found, step)
        if found:
            raise NonFiniteGradientError(
                self._describe_nonfinite(buckets, step) + " (this schedule checks bucket by bucket, so "
                "buckets updated at an earlier moment of this step were already updated)",
                rank=self.rank,
                op="update",
                bucket=bucket.index,
                step=step,
            )

    def _describe_nonfinite(self, buckets: Sequence[BucketState], step: int, own: Sequence[int] = ()) -> str:
        """Name the first non-finite parameter: in a bucket that holds the average (the same on every rank;
        where it came from is unknown), else in the ``own`` buckets, with the ranks it came from."""

        def first_bad(chosen, local=False):
            """The first parameter with an element that is not finite; ``local``: in this rank's own gradients
            only (outside its shards, where the reduce-scatter wrote the sums)."""
            position = 0
            for bucket in chosen:
                finite = torch.isfinite(bucket.buffer)
                if local:
                    for piece in bucket.pieces:
                        start = piece.shard.storage_offset() - bucket.buffer.storage_offset()
                        finite[start : start + piece.shard.numel()] = True
                for name, offset, p in zip(bucket.names, bucket.spec.offsets, bucket.params):
                    if not bool(finite[offset : offset + p.numel()].all()):
                        return position, name
                    position += 1
            return -1, None

        own = set(own)
        _, name = first_bad([b for b in buckets if b.index not in own])
        if name is not None or not own:  # the same answer on every rank: no rank goes on to the all-gather alone
            return f"the averaged gradient of parameter {name!r} is not finite (the rank it came from is unknown)"
        mine_buckets = [b for b in buckets if b.index in own]
        mine, _ = first_bad(mine_buckets, local=True)
        mine_t = torch.tensor([mine], dtype=torch.int64, device=self.control.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.control.device)
        self.control.all_gather(everyone, mine_t, step=step).wait()
        names = [n for b in mine_buckets for n in b.names]
        bad = {r: names[i] for r, i in enumerate(everyone.tolist()) if i >= 0}
        if not bad:
            return (
                "the averaged gradient is not finite, and no rank's own gradients outside its shard are: an overflow "
                "of the sum, or inf/NaN in a rank's own shard (which the reduce-scatter overwrites; the rank it "
                "came from is unknown)"
            )
        first = min(bad)
        return f"non-finite gradients came from rank(s) {sorted(bad)}; first parameter: {bad[first]!r} on rank {first}"
