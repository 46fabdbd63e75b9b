"""The agreement checks: every rank at the same step, with the same plan, parameters and finite gradients.

* **Step tags** (``check_agreement``): before its first reduction each bucket
  gets this rank's tag (step number and training forwards since the last
  step) in its own slot of the bucket's tail; after the reduction every rank
  sees every rank's tag and raises :class:`StepMismatchError` if they differ.
* **Used flags**: one per parameter, summed: how many ranks produced a
  gradient.  Zero means skip the parameter (as ``grad=None``); any other count
  means update it with the average, the missing ranks counting as zeros.
* **Non-finite gradients** (``nonfinite``): raise, skip the step on every
  rank, or ignore.
* **Plan agreement** once per plan, and parameter checksums per step in debug mode.

The tags and flags ride in the gradient buffers, so they cost no message of
their own; the others use the executor's control channel.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from dearopt.engine.buckets import BucketState
from dearopt.backends.base import CollectiveBackend
from dearopt.errors import NonFiniteGradientError, PlanMismatchError, StepMismatchError
from dearopt.planning.plan import Plan

__all__ = ["Checks"]

# A rank's step tag encodes its step count and the number of training
# forwards since its last step; it must be exact in the dtype the bucket
# travels in (integers up to 256 for bfloat16, 2048 for float16, 2**24 for float32).
_TAG_STEPS = {torch.bfloat16: 32, torch.float16: 256}


class Checks:
    def __init__(self, options, control: CollectiveBackend, rank: int, world: int, tensor_parallel=None):
        """``tensor_parallel``: a :class:`dearopt.engine.tensor_parallel.TensorParallel` where the model has
        ``DTensor`` parameters (the non-finite answer is agreed over its ranks too), else None."""
        self.options = options
        self.tensor_parallel = tensor_parallel
        self.control = control
        self.rank = rank
        self.world = world
        self.device = control.device

    # ------------------------------------------------------------- tags, flags
    @staticmethod
    def tag(step: int, forwards: int, wire_dtype: torch.dtype) -> int:
        steps = _TAG_STEPS.get(wire_dtype, 2**20)
        return (step % steps) * 8 + min(forwards, 7)

    def write_meta(self, bucket: BucketState, tag: int) -> None:
        """The used flags and this rank's step tag, written once per round before the bucket's first reduction."""
        if not bucket.meta_written:
            if all(bucket.used):  # the usual case: a fill, no copy from the host (which on a GPU would wait for it)
                bucket.flags.fill_(1)
            else:
                on_gpu = bucket.flags.is_cuda
                host = torch.tensor(bucket.used, dtype=bucket.flags.dtype, pin_memory=on_gpu)
                bucket.flags.copy_(host, non_blocking=on_gpu)
            bucket.tags.zero_()
            bucket.tags[self.rank : self.rank + 1].fill_(tag)  # a fill: `tags[rank] = tag` copies from the host
            bucket.meta_tag = tag
            bucket.meta_written = True
            bucket.mark_seen()

    def check_tags(self, bucket: BucketState, step: int) -> None:
        self.check_tags_of([bucket], step)

    def check_tags_of(
        self, buckets: Sequence[BucketState], step: int, extra: Optional[torch.Tensor] = None
    ) -> Optional[float]:
        """Check the step tags of ``buckets`` with one read from the device (a GPU's host waits for it once per
        step, not once per bucket); ``extra`` (a scalar on the same device) rides along and is returned."""
        check = self.options.check_agreement and self.world > 1 and len(buckets) > 0
        if not check:
            return None if extra is None else float(extra)
        parts = [b.tags.float() for b in buckets] + ([extra.reshape(1).float()] if extra is not None else [])
        values = torch.cat(parts).tolist()
        for i, bucket in enumerate(buckets):
            self._agree(bucket, [int(round(t)) for t in values[i * self.world : (i + 1) * self.world]], step)
        return None if extra is None else values[-1]

    def _agree(self, bucket: BucketState, tags: List[int], step: int) -> None:
        if len(set(tags)) == 1:
            return
        seen = ", ".join(f"rank {r}: step {t // 8} ({t % 8} forwards since its last step)" for r, t in enumerate(tags))
        raise StepMismatchError(
            f"ranks sent gradients of different steps in one collective ({seen}); a rank skipped or repeated "
            f"forward/backward/step. No update of this step was applied",
            rank=self.rank,
            op="step agreement",
            bucket=bucket.index,
            step=step,
        )

    @staticmethod
    def used(bucket: BucketState) -> List[bool]:
        """Which parameters of the bucket got a gradient on at least one rank.

        A parameter used on some ranks only gets the average over all ranks
        with zeros from the others, which is exactly its gradient over the
        global batch (the samples that did not use it contribute nothing).
        Where this rank used them all, the flags (a sum over ranks) need not
        be read: on a GPU that read would make the host wait for the device.
        """
        if all(bucket.used):
            return [True] * len(bucket.used)
        return [count > 0 for count in bucket.flags.float().round().tolist()]

    # ------------------------------------------------------------- non-finite
    def nonfinite(
        self,
        regions: Sequence[torch.Tensor],
        sharded: bool,
        buckets: Sequence[BucketState],
        step: int,
        own: Sequence[int] = (),
        agreed: Optional[bool] = None,
        local: Optional[bool] = None,
    ) -> bool:
        """Check the averaged gradients (this rank's shards if ``sharded``): True means skip the step.

        ``own``: the buckets whose buffers still hold this rank's own gradients
        (their average is kept as shards), from which the ranks a non-finite
        gradient came from can be named.  ``agreed``: the answer over every
        rank, where the caller already combined :meth:`local_nonfinite` with
        another message (the sharded update's).  ``local``: this rank's answer where the caller has it
        (the averaging pass flagged the regions), else the regions are summed.
        """
        policy = self.options.nonfinite
        if policy == "ignore" or (not regions and agreed is None):
            return False
        if agreed is None:
            found = self.local_nonfinite(regions) if local is None else local
            if sharded and self.world > 1:  # each rank checked its own shards: every rank must learn the answer
                flag = torch.full((1,), 1.0 if found else 0.0, device=self.device)
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

    @staticmethod
    def nonfinite_count(regions: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """A device scalar: how many of ``regions`` hold inf or NaN (None: no region), read by nobody yet."""
        # one pass, no temporary: the sum is finite iff every element is (or it overflowed)
        sums = [r.sum().float().reshape(1) for r in regions if r.numel()]
        if not sums:
            return None
        return (~torch.isfinite(torch.cat(sums))).sum()

    @classmethod
    def local_nonfinite(cls, regions: Sequence[torch.Tensor]) -> bool:
        """Whether any of this rank's ``regions`` holds inf or NaN (one read from the device)."""
        count = cls.nonfinite_count(regions)
        return count is not None and bool(count > 0)

    def nonfinite_bucket(self, bucket: BucketState, buckets: Sequence[BucketState], step: int) -> None:
        """For schedules that update bucket by bucket: this bucket's averaged gradient (``raise`` only)."""
        if self.options.nonfinite != "raise":
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
        mine_t = torch.tensor([mine], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.device)
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

    # --------------------------------------------------------- plan, params
    def plan_agreement(self, plan: Plan, step: int) -> None:
        if self.world == 1:
            return
        mine = torch.tensor([plan.fingerprint()], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self.control.all_gather(everyone, mine).wait()
        values = everyone.tolist()
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise PlanMismatchError(
                f"ranks built different communication plans (ranks {differ} differ from rank 0): the models, "
                f"their trainable parameters, the optimizer's parameters or the options (schedule, buffer_size, "
                f"comm hook) differ between ranks. This rank's plan:\n{plan.describe()}",
                rank=self.rank,
                op="plan check",
                step=step,
            )

    def parameters(self, buckets: Sequence[BucketState], step: int) -> None:
        """Debug mode: every rank must hold the same parameters (checksums compared)."""
        sums = torch.tensor(
            [float(sum(p.detach().double().sum() for p in b.params)) for b in buckets],
            dtype=torch.float64,
            device=self.device,
        )
        everyone = torch.empty(len(buckets) * self.world, dtype=torch.float64, device=self.device)
        self.control.all_gather(everyone, sums, step=step).wait()
        table = everyone.view(self.world, -1)
        differ = [r for r in range(self.world) if not torch.equal(table[r], table[0])]
        if differ:
            raise StepMismatchError(
                f"debug check: the parameters of ranks {differ} differ from rank 0's "
                f"(checksums per bucket {table.tolist()})",
                rank=self.rank,
                op="parameter checksum",
                step=step,
            )
