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
rows (:data:`dearopt.plan.ROWS`): every rank's nonzero rows are all-gathered
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

__all__ = ["TiedEmbeddings"]


class TiedEmbeddings:
    """The embedding weights reduced as rows, and the twins of their other module uses."""

    def __init__(self, model: nn.Module, trainable: Set[int], make_hook):
        self.row_numel: Dict[int, int] = {}  # id(embedding weight) -> elements per row
        self.twins: Dict[int, List[Tuple[nn.Module, str, torch.Tensor]]] = {}  # id(weight) -> (module, name, twin)
        self.owner_of: Dict[int, torch.nn.Parameter] = {}  # id(twin) -> the weight
        self._hooks = []
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding) and not m.sparse
                      and m.max_norm is None and id(m.weight) in trainable]
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
