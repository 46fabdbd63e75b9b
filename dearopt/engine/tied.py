"""A tied embedding is two gradients: the lookup's few rows, and the decoder's dense part.

A language model whose output projection shares the word embedding (BERT's
MLM head, GPT-2, T5) produces that weight's gradient in two parts.  The
decoder's part is dense and exists at the *start* of backward; the lookup's
part exists only at the *end*, and touches only the rows of the batch's tokens
(512 of 30522 in BERT-Base at batch 4 x 128).  Reduced as one dense gradient
after backward (94 MB for BERT-Base), it is the tail of every iteration.

:class:`TiedEmbeddings` separates the two: while a module other than the
embedding runs with the shared weight (the decoder), it runs with a *twin*, a
leaf tensor sharing the weight's storage, so autograd delivers that use's
gradient to the twin, early, as an ordinary planned parameter.  The weight
itself then only receives the lookup's gradient, which the plan reduces as
rows (:data:`dearopt.planning.plan.ROWS`): every rank's nonzero rows are all-gathered
and summed.  Before the weight's update the averaged twin gradient is added
to it, so the sum is exactly the single-process gradient.

This generalises in two ways, and not in a third:

* any ``nn.Embedding`` weight (tied or not) is reduced as rows: its gradient
  is nonzero only on looked-up rows, and the reduction checks that at run
  time (rows with any nonzero element), falling back to a dense all-reduce on
  every rank when too many rows are touched or another, unseen use made it
  dense (a functional ``x @ emb.weight.T`` that no module owns);
* any parameter used by two *modules* could be split the same way, but that
  only pays when one part is sparse: two dense parts would double the bytes,
  so other shared parameters (ALBERT's repeated layers) are left as they are.
"""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch
from torch import nn

from dearopt.backends.groups import is_dtensor
from dearopt.backends.base import JointHandle
from dearopt.compression.hooks import CommHook

__all__ = ["TiedEmbeddings", "EmbeddingRows"]


class TiedEmbeddings:
    """The embedding weights reduced as rows, and the twins of their other module uses."""

    def __init__(self, model: nn.Module, trainable: Set[int], make_hook):
        self.row_numel: Dict[int, int] = {}  # id(embedding weight) -> elements per row
        self.twins: Dict[int, List[Tuple[nn.Module, str, torch.Tensor]]] = {}  # id(weight) -> (module, name, twin)
        self.owner_of: Dict[int, torch.nn.Parameter] = {}  # id(twin) -> the weight
        self._hooks = []
        embeddings = [
            m
            for m in model.modules()
            if isinstance(m, nn.Embedding)
            and not m.sparse
            and m.max_norm is None
            and id(m.weight) in trainable
            and not is_dtensor(m.weight)  # a tensor-parallel embedding: reduced dense, as its shard
        ]
        for emb in embeddings:
            weight = emb.weight
            self.row_numel[id(weight)] = emb.embedding_dim
            for module in model.modules():
                if module is emb:
                    continue
                for name, p in list(module._parameters.items()):
                    if p is weight:
                        twin = torch.nn.Parameter(weight.detach(), requires_grad=weight.requires_grad)
                        self.twins.setdefault(id(weight), []).append((module, name, twin))
                        self.owner_of[id(twin)] = weight
                        self._hooks.append(module.register_forward_pre_hook(make_hook(self._swap_in)))
                        self._hooks.append(module.register_forward_hook(make_hook(self._swap_out)))

    def twin_params(self) -> List[torch.Tensor]:
        return [twin for uses in self.twins.values() for _, _, twin in uses]

    def twins_of_module(self, module: nn.Module) -> List[torch.Tensor]:
        return [twin for uses in self.twins.values() for m, _, twin in uses if m is module]

    def _swap_in(self, module, args) -> None:
        for uses in self.twins.values():
            for m, name, twin in uses:
                if m is module:
                    weight = self.owner_of[id(twin)]
                    if twin.data_ptr() != weight.data_ptr() or twin.shape != weight.shape:
                        twin.data = weight.data  # the weight's storage was replaced (p.data = ...)
                    twin.requires_grad_(weight.requires_grad)
                    module._parameters[name] = twin

    def _swap_out(self, module, args, output) -> None:
        for uses in self.twins.values():
            for m, name, twin in uses:
                if m is module:
                    module._parameters[name] = self.owner_of[id(twin)]

    def restore(self) -> None:
        """Put every weight back and remove the hooks (the optimizer is closed)."""
        for uses in self.twins.values():
            for m, name, twin in uses:
                m._parameters[name] = self.owner_of[id(twin)]
        for h in self._hooks:
            h.remove()
        self._hooks = []


class EmbeddingRows(CommHook):
    """The comm hook of row-sparse buckets (an ``nn.Embedding`` weight's gradient): it travels as the rows a batch
    touched.  The counts first (every rank learns the largest; on the control channel, so that it does not wait
    behind the data ops in flight), then every rank's row indices and rows (and the bucket's flags and tags)
    all-gathered and summed in rank order.  When the rows are not few (or a use the engine cannot see made the
    gradient dense) every rank all-reduces densely.  ``counts``: how the buckets were reduced over the run."""

    name = "rows"

    def __init__(self):
        self.counts = {"rows": 0, "dense": 0}

    def start(self, op, link):
        """The counts, then the rows all-gathered (or a dense all-reduce): ``(handle, ctx)``."""
        piece, backend, control, where = op.piece, link.backend, link.control, link.where
        world = backend.size
        spec = piece.bucket.spec
        width = spec.row_numel
        grads = piece.full[: spec.grad_numel].view(-1, width)
        rows = grads.any(dim=1).nonzero().flatten()
        mine = torch.tensor([rows.numel()], dtype=torch.int64, device=control.device)
        counts = torch.empty(world, dtype=torch.int64, device=control.device)
        control.all_gather(counts, mine, **where).wait()
        counts = counts.tolist()
        most = max(counts)
        if world * most * 2 > grads.shape[0]:
            self.counts["dense"] += 1
            return backend.all_reduce(piece.full, "sum", **where), None
        self.counts["rows"] += 1
        most = max(most, 1)
        tail = piece.full[spec.grad_numel :]
        length = most * width + tail.numel()
        index = torch.zeros(most, dtype=torch.int64, device=backend.device)
        index[: rows.numel()] = rows.to(backend.device)
        values = torch.zeros(length, dtype=piece.full.dtype, device=piece.full.device)
        values[: rows.numel() * width] = grads.index_select(0, rows).reshape(-1)
        values[most * width :] = tail
        all_index = torch.empty(world * most, dtype=torch.int64, device=backend.device)
        all_values = torch.empty(world * length, dtype=values.dtype, device=values.device)
        handle = JointHandle(
            backend.all_gather(all_index, index, **where), backend.all_gather(all_values, values, **where)
        )
        return handle, (counts, most, length, all_index, all_values)

    def finish(self, op, ctx) -> None:
        """Sum every rank's rows (and tails) into the bucket, in rank order (nothing after a dense all-reduce)."""
        if ctx is None:
            return
        counts, most, length, all_index, all_values = ctx
        piece = op.piece
        spec = piece.bucket.spec
        width = spec.row_numel
        grads = piece.full[: spec.grad_numel].view(-1, width)
        tail = piece.full[spec.grad_numel :]
        grads.zero_()
        tail.zero_()
        all_index = all_index.to(grads.device)
        for r, count in enumerate(counts):
            base = r * length
            if count:
                grads.index_add_(
                    0,
                    all_index[r * most : r * most + count],
                    all_values[base : base + count * width].view(count, width),
                )
            tail.add_(all_values[base + most * width : base + length])
