"""``DTensor`` parameters (tensor parallelism beside dearopt's data parallelism): what the engine must agree on over
the tensor-parallel ranks too.

The engine reduces each rank's local shards over its data-parallel group (the buckets hold local shards,
:mod:`dearopt.engine.buckets`); that is exact without any word between the tensor-parallel ranks.  Two things are
not local: a **global norm** (``DistOptim.clip_grad_norm_``: the shards of a parameter sharded over ``tp`` are summed
over the ``tp`` ranks, the elements every ``tp`` rank holds alike counted once) and **whether a step holds inf/NaN**
(every ``tp`` rank must skip, or raise at, the same step as its peers).  :class:`TensorParallel` does both, with one
scalar all-reduce over the ``tp`` group each, made only where the model has ``DTensor`` parameters.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dearopt.backends.groups import is_dtensor
from dearopt.errors import UsageError

__all__ = ["TensorParallel", "refuse_dtensors"]


def refuse_dtensors(params: Sequence[torch.Tensor], options) -> None:
    """A :class:`~dearopt.errors.UsageError` at construction for what cannot take ``DTensor`` parameters."""
    dtensors = [p for p in params if is_dtensor(p)]
    if not dtensors:
        return
    if options.shard_optimizer:
        raise UsageError(
            "shard_optimizer=True does not take DTensor parameters (the model is tensor parallel): the sharded update "
            "lays each bucket's parameters out flat, which a DTensor cannot be. Use shard_optimizer=False (every "
            "schedule is exact with DTensor parameters), or FSDP2's fully_shard over the data-parallel dimension"
        )
    for p in dtensors:
        partial = [str(pl) for pl in p.placements if pl.is_partial()]
        if partial:
            raise UsageError(
                f"a DTensor parameter of shape {tuple(p.shape)} has a Partial placement ({partial[0]}): its local "
                f"shards are not parts of its value, so their average is not the average's shard. Redistribute it "
                f"to Shard or Replicate placements before DistOptim"
            )


class TensorParallel:
    """The tensor-parallel side of an engine whose model has ``DTensor`` parameters (see the module)."""

    def __init__(self, params: Sequence[torch.Tensor], timeout: float):
        self.timeout = timeout
        self.sharded = {}  # id(param) -> param, for the DTensors whose shards differ between the tp ranks
        kinds = set()
        for p in params:
            if is_dtensor(p):
                dims = tuple(i for i, pl in enumerate(p.placements) if not pl.is_replicate())
                if dims:
                    self.sharded[id(p)] = p
                    kinds.add((p.device_mesh, dims))
        self.why_not: Optional[str] = None  # why a global norm cannot be computed (None: it can)
        self._group = None
        if len(kinds) == 1:
            mesh, dims = next(iter(kinds))
            if len(dims) == 1:
                self._group = mesh.get_group(dims[0])
            else:
                self.why_not = f"DTensor parameters are sharded over {len(dims)} mesh dimensions {dims}"
        elif kinds:
            self.why_not = "DTensor parameters are sharded over different meshes or mesh dimensions"
        self._backend = None
        self._splits: List[Tuple[object, tuple]] = []  # (regions, their split): at most two per plan

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], timeout: float) -> Optional["TensorParallel"]:
        """One for ``params`` if any is a ``DTensor``, else None (the engine then never asks)."""
        return cls(params, timeout) if any(map(is_dtensor, params)) else None

    @property
    def backend(self):
        """A communicator over the tensor-parallel group (the DTensors' own), every wait with the timeout."""
        if self._backend is None and self._group is not None:
            import torch.distributed as dist

            from dearopt.backends.base import TorchDistBackend

            group = self._group
            self._backend = TorchDistBackend(
                dist.get_rank(group), dist.get_world_size(group), self.timeout, group=group, owns_group=False
            )
        return self._backend

    def any(self, found: bool, step: int) -> bool:
        """Whether any tensor-parallel rank found ``found`` (inf/NaN in its gradients): the same answer on all."""
        backend = self.backend
        if backend is None or backend.size == 1:
            return found
        flag = torch.full((1,), 1.0 if found else 0.0, device=backend.device)
        backend.all_reduce(flag, "max", step=step).wait()
        return float(flag) > 0

    def combine(self, sharded: float, norm_type: float, step: int) -> float:
        """The sum (``max`` for the inf-norm) over the tensor-parallel ranks of ``sharded``."""
        backend = self.backend
        if backend is None or backend.size == 1:
            return sharded
        value = torch.tensor([sharded], dtype=torch.float64, device=backend.device)
        kind = "max" if norm_type == float("inf") else "sum"
        backend.all_reduce(value, kind, step=step).wait()
        return float(value)

    def split(self, regions, buckets) -> List[Tuple[List[torch.Tensor], List[torch.Tensor], bool]]:
        """Each averaged region cut into the parts that hold shards of tp-sharded parameters and the rest:
        ``(sharded parts, other parts, is_shard)``, made once per plan and kind of regions."""
        for known, cut in self._splits:
            if known is regions:
                return cut
        if self.why_not is not None:
            raise UsageError(
                f"optimizer.clip_grad_norm_() cannot compute the global norm: {self.why_not}. Clip by value "
                f"(optimizer.clip_grad_value_), or shard every DTensor parameter over one mesh dimension"
            )
        spans: Dict[int, List[Tuple[int, int]]] = {}  # buffer's data_ptr -> element ranges of sharded params
        for b in buckets:
            ranges = [
                (o, o + p._local_tensor.numel()) for o, p in zip(b.spec.offsets, b.params) if id(p) in self.sharded
            ]
            spans[b.buffer.untyped_storage().data_ptr()] = (b.buffer.storage_offset(), ranges)
        cut = []
        for region, is_shard in regions:
            base, ranges = spans.get(region.untyped_storage().data_ptr(), (0, []))
            lo = region.storage_offset() - base
            hi = lo + region.numel()
            inside, outside, at = [], [], lo
            for start, end in ranges:
                start, end = max(start, lo), min(end, hi)
                if start >= end:
                    continue
                if start > at:
                    outside.append(region[at - lo : start - lo])
                inside.append(region[start - lo : end - lo])
                at = end
            if at < hi:
                outside.append(region[at - lo :])
            cut.append((inside, outside, is_shard))
        self._splits = [(k, c) for k, c in self._splits[-1:]] + [(regions, tuple(cut))]
        return cut

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()  # (the group is the mesh's: not destroyed)
            self._backend = None
