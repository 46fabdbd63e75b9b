"""The knobs of :class:`dearopt.DistOptim`, validated in one place."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from .plan import DEFAULT_BUFFER_SIZE, DEFAULT_FIRST_BUCKET_SIZE, parse_size

__all__ = ["Options", "NONFINITE_POLICIES"]

NONFINITE_POLICIES = ("raise", "skip", "ignore")


@dataclasses.dataclass(frozen=True)
class Options:
    schedule: str = "dear"
    """A registered schedule (:mod:`dearopt.schedules`).  ``"dear"``: reduce-scatter during backward,
    all-gather + update during the next forward (the DeAR paper).  ``"wfbp"``: all-reduce during
    backward, update at ``step()`` (Horovod/DDP).  ``"rsag"``: reduce-scatter then all-gather, both
    during backward (the paper's baseline).  ``"bytescheduler"``: all-reduce per partition, each bucket
    finished and updated just before its layers run in the next forward.  ``"prophet"`` /
    ``"prophet-allreduce"``: buckets are Prophet's gradient blocks, formed from a profile of steps 1-3
    (:mod:`dearopt.schedules.prophet`), reduce-scattered (all-reduced) in backward and gathered (waited for)
    just before their layers in the next forward."""

    buffer_size: Union[int, str] = DEFAULT_BUFFER_SIZE
    """Bytes per fusion bucket (or ``"25MB"``).  25 MB is DDP's default and the
    paper's first tuning trial; ``"auto"`` tunes it online."""

    first_bucket_size: Union[int, str, None] = DEFAULT_FIRST_BUCKET_SIZE
    """Bytes of the first bucket backward fills (the last layers').  1 MB as DDP: the first reduction starts
    as soon as the last layers' gradients exist instead of waiting for 25 MB of them; ``None``: no cap."""

    allreduce: Union[float, str] = "auto"
    """``dear``: which buckets are all-reduced in backward (as ``wfbp``: one collective, less CPU than a
    reduce-scatter plus an all-gather, nothing to gather in the next forward) instead of DeAR's
    reduce-scatter in backward and all-gather in the next forward.  ``"predicted"``: from a profile of
    steps 1-3 taken on rank 0 and shared once, the buckets (output side first) whose all-reduce still fits in
    the link's idle time in backward (:func:`dearopt.plan.allreduce_buckets`).  ``"auto"`` (default): that
    prediction, then measured: the predicted choice, none (DeAR's) and all (DDP's) run a few steps each
    (those that pick the same buckets once) and the fastest on rank 0's clock is kept by every rank, because
    the link model cannot see what communication costs the computation on the same cores.  A fraction in
    [0, 1]: the buckets from the output side holding that fraction of the bytes (0: DeAR as in the paper)."""

    embedding_rows: Optional[bool] = None
    """Default (None): on for parameters on the CPU, unless ``shard_optimizer`` or ``schedule="deft"``; off for
    parameters on a GPU (the rows' count must be read on the host, which would wait for the device every step,
    and NCCL's dense all-reduce is fast; pass True to have rows there too).  Reduce each ``nn.Embedding``
    weight as the rows its lookups touched (all ranks' rows all-gathered,
    a dense all-reduce when they are not few), and a tied use of it (a decoder sharing the word
    embedding) as a gradient of its own, added before the update (:mod:`dearopt.tied`).  Exact either way."""

    shard_optimizer: bool = False
    """``dear`` only: each rank runs the wrapped optimizer on its shard of every bucket at ``step()`` (the shard its
    reduce-scatter averaged) and the next forward's all-gather carries the updated parameters instead of the
    gradients (:mod:`dearopt.sharding`): the optimizer's state and work per rank are 1/N.  Elementwise optimizers
    only; every bucket is reduce-scattered (``allreduce`` is 0) and embeddings are reduced densely (no
    ``embedding_rows``).  After ``step()`` every ``p.grad`` is None (the whole averaged gradient never exists on
    a rank), so gradients do not accumulate across steps."""

    partition_size: Union[int, str, None] = None
    """Split each bucket into collectives of at most this many bytes (ByteScheduler's
    partitioning); ``None``: one collective per bucket; ``"auto"``: tuned."""

    credit: Union[int, str, None] = None
    """At most this many bytes of collectives in flight (ByteScheduler's credit);
    ``None``: unbounded for reductions, all-gathers one bucket ahead; ``"auto"``: tuned."""

    priority: bool = False
    """Order reductions by priority (layers near the input first) where the data
    allows, from a profile of steps 1-3 taken on rank 0 and shared once; the order
    is part of the plan, identical on every rank."""

    link_check_every: Union[int, str, None] = "auto"
    """Schedules whose buckets are made from the profile (``prophet``): every this many steps rank 0
    re-measures the gradients' ready times and the link's bandwidth on the job's own reductions and shares
    them; when the bandwidth moved by more than 25 % in two measurements in a row, every rank re-plans at the
    same step (:class:`dearopt.profiling.LinkMonitor`).  ``"auto"``: every 20 steps for those schedules;
    ``None``: never."""

    backward_passes_per_step: int = 1
    """Backward passes accumulated locally before gradients are communicated."""

    broadcast_parameters: bool = True
    """Copy rank 0's parameters and buffers to every rank at construction (like DDP)."""

    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm statistics) before each training forward, as DDP does."""

    nonfinite: str = "raise"
    """What a non-finite averaged gradient does: ``"raise"`` a named error,
    ``"skip"`` the step on every rank, or ``"ignore"`` it (DDP's behaviour)."""

    check_agreement: bool = True
    """Check at every step, inside the gradient buckets' own messages, that all
    ranks are at the same step (no extra message; cost is a few scalar writes
    per bucket).  Turn off only to measure its cost."""

    timeline: Optional[str] = None
    """Write Chrome trace events to this path (one file per rank); default ``DEAROPT_TIMELINE``."""

    debug: bool = False
    sparsify: bool = False
    """The communication hook is a :class:`dearopt.Sparsify` (set by ``DistOptim`` from ``comm_hook``): ``wfbp``
    or ``dear`` only, every bucket all-reduced (under ``dear``: in backward, updated before its forward), whole
    buckets (no ``partition_size``), embeddings reduced as dense gradients."""
    """Extra agreement checks per step (parameter checksums); default ``DEAROPT_DEBUG``."""

    def __post_init__(self):
        from .schedules import get_schedule

        policy = get_schedule(self.schedule)
        for knob in ("buffer_size", "first_bucket_size", "partition_size", "credit"):
            value = getattr(self, knob)
            if value is not None and value != "auto":
                object.__setattr__(self, knob, parse_size(value))
        if self.buffer_size is None:
            raise ValueError("buffer_size must be a size or 'auto', not None")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        if self.allreduce not in ("auto", "predicted") and (isinstance(self.allreduce, bool)
                                                            or not isinstance(self.allreduce, (int, float))
                                         or not 0.0 <= float(self.allreduce) <= 1.0):
            raise ValueError(f"allreduce must be a fraction in [0, 1], 'auto' or 'predicted', got {self.allreduce!r}")
        policy.check_options(self)
        if self.sparsify:
            if self.shard_optimizer:
                raise ValueError("comm_hook=dearopt.Sparsify(...) and shard_optimizer=True do not combine (the "
                                 "sharded update needs each bucket reduce-scattered)")
            if self.schedule not in ("wfbp", "dear"):
                raise ValueError(f"comm_hook=dearopt.Sparsify(...) replaces each bucket's all-reduce: it works "
                                 f"with schedule='wfbp' or 'dear', not {self.schedule!r}")
            if self.schedule == "dear":
                if self.allreduce not in ("auto", 1, 1.0):
                    raise ValueError(f"comm_hook=dearopt.Sparsify(...) under 'dear' all-reduces every bucket in "
                                     f"backward (a sparse sum is whole on every rank); allreduce={self.allreduce!r} "
                                     f"must be left 'auto' or 1")
                object.__setattr__(self, "allreduce", 1.0)
            if self.partition_size is not None:
                raise ValueError("comm_hook=dearopt.Sparsify(...) selects over whole buckets: partition_size must "
                                 "be None")
            if self.nonfinite == "skip":
                raise ValueError("comm_hook=dearopt.Sparsify(...) takes each step's gradients into its residuals "
                                 "as it sends them; nonfinite='skip' would lose them: use 'raise' or 'ignore'")
            if self.embedding_rows:
                raise ValueError("comm_hook=dearopt.Sparsify(...) sparsifies embeddings itself (top-k of the "
                                 "whole gradient); leave embedding_rows unset")
            object.__setattr__(self, "embedding_rows", False)
        if self.shard_optimizer:
            if self.schedule != "dear":
                raise ValueError(f"shard_optimizer=True needs schedule='dear' (the reduce-scatter leaves each rank "
                                 f"the averaged gradient of its shard, the next forward's all-gather brings the "
                                 f"parameters); schedule={self.schedule!r} has no such pair")
            if self.allreduce not in ("auto", 0, 0.0):
                raise ValueError(f"shard_optimizer=True reduce-scatters every bucket (an all-reduced bucket would "
                                 f"be updated whole on every rank); allreduce={self.allreduce!r} must be left "
                                 f"'auto' or 0")
            object.__setattr__(self, "allreduce", 0.0)
            if self.embedding_rows:
                raise ValueError("shard_optimizer=True reduces embeddings densely: with embedding_rows=True every "
                                 "rank would hold the whole averaged embedding gradient; leave embedding_rows "
                                 "unset")
        if policy.delays_updates and self.embedding_rows:
            raise ValueError(f"schedule={self.schedule!r} reduces embeddings densely (a tied weight's two "
                             f"gradients are one); leave embedding_rows unset")
        object.__setattr__(self, "embedding_rows_given", self.embedding_rows is not None)  # not a field
        if self.embedding_rows is None:
            object.__setattr__(self, "embedding_rows", not (self.shard_optimizer or policy.delays_updates))
        every = self.link_check_every
        if every == "auto":
            object.__setattr__(self, "link_check_every", 20 if policy.needs_profile else None)
        elif every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"link_check_every must be an integer >= 1, 'auto' or None, got {every!r}")
            if not policy.needs_profile:
                raise ValueError(f"link_check_every re-plans schedules whose buckets are made from the profile "
                                 f"(prophet); schedule={self.schedule!r} has none")
        bpps = self.backward_passes_per_step
        if isinstance(bpps, bool) or not isinstance(bpps, int) or bpps < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {bpps!r}")
        if self.timeline is None and os.environ.get("DEAROPT_TIMELINE"):
            object.__setattr__(self, "timeline", os.environ["DEAROPT_TIMELINE"])
        if not self.debug and os.environ.get("DEAROPT_DEBUG", "0") not in ("", "0"):
            object.__setattr__(self, "debug", True)
