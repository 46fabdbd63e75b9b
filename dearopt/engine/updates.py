"""Applying the wrapped optimizer to the buckets as their updates fall due.

The wrapped optimizer's own ``step()`` runs once per moment of the plan at which
buckets are updated (once per bucket where they land one by one, once for all
of them where they land together at ``step()``), with each param group narrowed
to those buckets' parameters (and to the ones that got a gradient
on some rank), using the hyperparameters that were in force when the user
called ``step()``: an LR scheduler that steps in between does not leak into
updates applied later, in the next forward.

The wrapped optimizer's step hooks (``register_step_pre_hook`` /
``register_step_post_hook`` on it) fire once per training step, not once per
bucket: the pre hooks before the first bucket's update, the post hooks after
the last one.  Its ``step()`` is called without torch's hook wrapper.

**Flat updates.**  Where the optimizer updates element by element
(:data:`dearopt.engine.sharding.ELEMENTWISE`), a bucket's parameters are moved
once into a flat buffer laid out as its gradient buffer (``p.data`` becomes a
view of it, as under the sharded update), and the optimizer runs on a few flat
tensors per bucket (:class:`FlatRuns`: each a run of parameters of one param
group, all updated at this step, that share their scalar state), with the
matching views of the averaged gradients: torch's per-parameter Python
(``_init_group``: some ten calls per parameter) runs once per run, not once per
parameter.  The optimizer state stays in torch's per-parameter layout
(``optimizer.state[p]``, what ``state_dict()`` saves and loads): each
parameter's entries are views of its run's flat state, and scalar entries
(``step``) are one tensor shared by the run, so that the run's update advances
every parameter's.  A parameter no rank produced a gradient for is left out of
its step, as torch skips ``grad=None``: its run splits there and it keeps a
scalar state of its own.  A bucket holding a ``DTensor`` parameter (tensor parallelism) is updated per parameter:
the optimizer's state of a ``DTensor`` is a ``DTensor`` too, as ``torch.distributed.checkpoint`` expects it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dearopt.engine.buckets import BucketState

__all__ = ["BucketUpdater", "FlatRuns"]


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """The optimizer's ``step`` without torch's pre/post hook wrapper (``Optimizer.profile_hook_step``)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        raw = step.__wrapped__
        return lambda: raw(optimizer)
    return optimizer.step


class BucketUpdater:
    def __init__(self, optimizer: torch.optim.Optimizer, flat: bool = True):
        """``flat``: update buckets as flat runs where the optimizer is elementwise (see the module)."""
        from dearopt.engine.sharding import ELEMENTWISE

        self.optimizer = optimizer
        self.flat = flat and type(optimizer) in ELEMENTWISE
        self._step = _unhooked_step(optimizer)
        self._hyper: Optional[List[Dict]] = None  # hyperparameters in force at step()
        self._remaining = 0  # bucket updates of this step still to apply
        self._started = False

    def begin_step(self, n_updates: int) -> None:
        """A step's updates begin: remember the hyperparameters now in force."""
        self._hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self._remaining = n_updates
        self._started = False

    @property
    def in_step(self) -> bool:
        return self._remaining > 0

    def apply_buckets(self, chosen: List[Tuple[BucketState, List[bool]]]) -> None:
        """Run the optimizer once over the parameters of several buckets (each narrowed by its ``include``), as
        one update per bucket: where buckets are updated at the same moment (at ``step()``) one call costs one
        call's overhead, as DDP's single ``step()`` does, instead of one per bucket.  A per-parameter optimizer
        updates every parameter the same either way."""
        members: List[List[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        flat, per_param = [], []
        state = self.optimizer.state
        for bucket, include in chosen:
            runs = self._flat(bucket)
            if runs is None:
                per_param.append(bucket)
                for gi, into in enumerate(members):
                    group = bucket.group_members[gi] if gi < len(bucket.group_members) else []
                    into.extend(group if all(include) else [p for p in group if include[bucket.position[id(p)]]])
                continue
            cut = runs.runs(include, self.optimizer)
            for run in cut:
                if run.group < len(members):
                    members[run.group].append(run.tensor)
                    if run.state is not None:
                        state[run.tensor] = run.state
            flat.append((runs, cut))
        for bucket in per_param:
            bucket.sparse_gradients()
        try:
            self.apply_members(members, updates=len(chosen))
        finally:
            for bucket in per_param:
                bucket.dense_gradients()
            for runs, cut in flat:
                runs.update(cut, self.optimizer)

    def _flat(self, bucket: BucketState) -> Optional["FlatRuns"]:
        """The bucket's flat runs where it is updated flat (made at its first update), else None."""
        if not self.flat or any(bucket.sparse) or bucket.buffer.is_complex() or bucket.has_dtensor:
            return None
        runs = bucket.flat
        if runs is None or runs.moved():
            runs = bucket.flat = FlatRuns(bucket)
        return runs

    def apply_members(self, members: List[List[torch.Tensor]], updates: int = 1) -> None:
        """Run the optimizer once with param group ``gi`` narrowed to ``members[gi]`` (parameters, or the
        segments of a sharded update) and the hyperparameters in force at ``step()``; it counts as ``updates``
        bucket updates of this step (the post hooks fire after the last)."""
        if not self._started:
            self._started = True
            for hook in list(self.optimizer._optimizer_step_pre_hooks.values()):
                hook(self.optimizer, (), {})
        groups = self.optimizer.param_groups
        # a group added since step() (add_param_group before the pending updates landed) has nothing of this step
        hyper = [
            self._hyper[gi] if self._hyper is not None and gi < len(self._hyper) else {} for gi in range(len(groups))
        ]
        saved = [{k: g[k] for k in hyper[gi]} | {"params": g["params"]} for gi, g in enumerate(groups)]
        try:
            for gi, group in enumerate(groups):
                group.update(hyper[gi])
                group["params"] = members[gi] if gi < len(members) else []
            self._step()
        finally:
            for group, live in zip(groups, saved):
                group.update(live)
        self._remaining -= updates
        if self._remaining == 0:
            for hook in list(self.optimizer._optimizer_step_post_hooks.values()):
                hook(self.optimizer, (), {})


class _Run:
    """Parameters ``[lo, hi)`` of a bucket (one param group), updated as one flat tensor."""

    __slots__ = ("lo", "hi", "group", "tensor", "begin", "end", "state")

    def __init__(self, lo: int, hi: int, group: int, tensor: torch.Tensor, begin: int, end: int):
        self.lo, self.hi, self.group = lo, hi, group
        self.tensor = tensor  # a view of the flat parameter buffer; its .grad the bucket's averaged gradients
        self.begin, self.end = begin, end  # elements of the bucket's buffer it spans
        self.state: Optional[dict] = None  # the optimizer's entry for it while bound (flat tensors, shared scalars)


class FlatRuns:
    """A bucket's parameters in one flat buffer and its runs for the optimizer (see the module).  Made at the
    bucket's first flat update; the parameters keep their values (``p.data`` becomes a view)."""

    def __init__(self, bucket: BucketState):
        spec = bucket.spec
        # what it needs of the bucket, not the bucket (which holds this object: no cycle for the collector)
        self.params, self.offsets, self.group_of, self.grads = (
            bucket.params,
            spec.offsets,
            bucket.group_of,
            bucket.buffer,
        )
        self.flat = torch.empty(spec.padded_numel, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
        self.ptrs: List[int] = []
        with torch.no_grad():
            for p, offset in zip(bucket.params, spec.offsets):
                view = self.flat[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                self.ptrs.append(p.data_ptr())
        self._runs: Optional[List[_Run]] = None  # for the common step: every member included
        self._state_owner = None  # the optimizer's state dict the runs' entries were bound in

    def moved(self) -> bool:
        """Whether a parameter's storage was replaced since (``p.data = ...``): the flat layout no longer holds."""
        return any(p.data_ptr() != ptr for p, ptr in zip(self.params, self.ptrs))

    def runs(self, include: Sequence[bool], optimizer: torch.optim.Optimizer) -> List[_Run]:
        """The runs of this step (all members included: the cached ones), their state entries bound."""
        everyone = all(include)
        if everyone and self._runs is not None and self._state_owner is optimizer.state:
            return self._runs
        if not everyone:  # a member left out keeps its scalars (step) to itself: the others advance theirs
            for j, p in enumerate(self.params):
                entry = optimizer.state.get(p) if not include[j] else None
                if entry:
                    for k, v in list(entry.items()):
                        if isinstance(v, torch.Tensor) and not _elementwise(v, p):
                            entry[k] = v.clone()
        runs = self._cut(include, optimizer.state)
        self._bind(runs, optimizer.state)
        if everyone:
            self._runs, self._state_owner = runs, optimizer.state
        else:
            self._runs = None  # (their scalars were split: cut again at the next full step)
        return runs

    def invalidate(self) -> None:
        """The optimizer's state was replaced (``load_state_dict``): bind the runs again at the next update."""
        self._runs = None

    def _cut(self, include: Sequence[bool], state) -> List[_Run]:
        """Maximal runs of included members of one group whose scalar state is one object (or absent)."""
        offsets, params, groups = self.offsets, self.params, self.group_of
        runs: List[_Run] = []
        lo = None
        key = None
        for j, p in enumerate(params):
            member = groups[j] >= 0 and include[j]
            entry = state.get(p) if member else None
            # the ids of its entries that are not elementwise (_elementwise, inlined: this runs per parameter)
            numel = p.numel()
            scalar_key = (
                tuple(
                    id(v)
                    for k, v in sorted(entry.items())
                    if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel)
                )
                if entry
                else ()
            )
            this = (groups[j], scalar_key) if member else None
            if lo is not None and (this is None or this != key or offsets[j] != offsets[j - 1] + params[j - 1].numel()):
                runs.append(self._run(lo, j))
                lo = None
            if this is not None and lo is None:
                lo, key = j, this
        if lo is not None:
            runs.append(self._run(lo, len(params)))
        return runs

    def _run(self, lo: int, hi: int) -> _Run:
        begin = self.offsets[lo]
        end = self.offsets[hi - 1] + self.params[hi - 1].numel()
        tensor = self.flat[begin:end]
        tensor.grad = self.grads[begin:end]
        return _Run(lo, hi, self.group_of[lo], tensor, begin, end)

    def _bind(self, runs: List[_Run], state) -> None:
        """Each run's state entry: its members' entries where they are views of one flat tensor already, else
        their values joined into a new flat tensor (and the members' entries made views of it)."""
        for run in runs:
            members = self.params[run.lo : run.hi]
            entries = [state.get(p) for p in members]
            if not any(entries):
                run.state = None  # the optimizer makes it at the run's first update
                continue
            first = next(e for e in entries if e)
            flat: Dict[str, Any] = {}
            for k, v in first.items():
                if _elementwise(v, members[entries.index(first)]):
                    values = [e.get(k) if e else None for e in entries]
                    view = _one_view(values, members)
                    flat[k] = view if view is not None else _joined(values, members)
                else:  # a scalar (step): one object of the run's own, shared by its members' entries (another
                    # run, of this bucket or an old plan's, may hold the object this one was cut from)
                    flat[k] = v.clone() if isinstance(v, torch.Tensor) else v
            run.state = flat
            self._spread(run, members, state)

    def _spread(self, run: _Run, members, state) -> None:
        """Every member's entries as views of the run's flat state (scalars shared)."""
        entries = [(k, v, _elementwise(v, run.tensor)) for k, v in run.state.items()]  # (the same for every member)
        offset = 0
        for p in members:
            n = p.numel()
            state[p] = {k: (v[offset : offset + n].view_as(p) if elementwise else v) for k, v, elementwise in entries}
            offset += n

    def update(self, runs: List[_Run], optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer ran on ``runs``: entries it made (first update) spread to the members; the runs'
        entries taken out of ``optimizer.state`` again (torch's ``state_dict`` keys the per-parameter ones)."""
        state = optimizer.state
        for run in runs:
            made = state.pop(run.tensor, None)
            if run.state is None and made:
                run.state = made
                self._spread(run, self.params[run.lo : run.hi], state)


def _elementwise(value, like: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == like.numel()


def _one_view(values, members) -> Optional[torch.Tensor]:
    """The members' entries as one flat tensor without a copy, where they are consecutive views of one storage
    (the usual case: bound at an earlier update); None otherwise."""
    if any(v is None for v in values):
        return None
    first = values[0]
    base = first._base if first._base is not None else first
    offset = first.storage_offset()
    expected = offset
    for v, p in zip(values, members):
        if (
            (v._base if v._base is not None else v) is not base
            or v.storage_offset() != expected
            or not v.is_contiguous()
        ):
            return None
        expected += p.numel()
    return base.reshape(-1)[offset - base.storage_offset() : expected - base.storage_offset()]


def _joined(values, members) -> torch.Tensor:
    """One flat state tensor for a run from its members' entries (a member without one: zeros, as the optimizer
    would have made)."""
    parts = []
    for v, p in zip(values, members):
        parts.append(
            v.detach().reshape(-1) if v is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        )
    return torch.cat(parts)
