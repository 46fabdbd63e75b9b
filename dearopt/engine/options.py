"""The knobs of :class:`dearopt.DistOptim`, validated and settled in one place.

A :class:`Options` is the schedule object (:mod:`dearopt.schedules`: it owns
its own knobs) plus the knobs every schedule shares.  It is made once per
``DistOptim`` and never changed; :meth:`Options.replace` makes another.  The
environment (``DEAROPT_TIMELINE``, ``DEAROPT_DEBUG``) is read here and nowhere
else.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from dearopt.planning.plan import DEFAULT_BUFFER_SIZE, parse_size

__all__ = ["Options", "NONFINITE_POLICIES", "CHECKS", "SHARED"]

NONFINITE_POLICIES = ("raise", "skip", "ignore")

CHECKS = ("off", "step", "full")
"""How much the ranks' agreement is checked.  ``"step"`` (default): at every step, inside the gradient buckets'
own messages, that all ranks are at the same step (no extra message; a few scalar writes per bucket).
``"full"``: also the parameters' checksums across ranks at every step (costly; or ``DEAROPT_DEBUG=1``).
``"off"``: nothing (only to measure what the check costs)."""

SHARED = (
    "buffer_size",
    "shard_optimizer",
    "backward_passes_per_step",
    "broadcast_parameters",
    "broadcast_buffers",
    "nonfinite",
    "checks",
    "timeline",
)
"""The knobs every schedule shares (besides ``comm_hook``, ``tuner`` and ``backend``, which ``DistOptim`` keeps)."""


class Options:
    """The schedule (with its knobs) and the shared knobs of one ``DistOptim``, settled once.

    ``schedule``: a registered name (its default knobs) or a :class:`dearopt.schedules.Schedule` instance (its
    knobs are its own: ``dearopt.DeAR(allreduce=0.5)``).  The knobs of the schedule in force are readable here too
    (``options.allreduce``), as the schedule settled them.
    """

    __slots__ = ("policy",) + SHARED + ("sparsify",)

    def __init__(
        self,
        schedule: Any = "dear",
        buffer_size: Union[int, str] = DEFAULT_BUFFER_SIZE,
        *,
        shard_optimizer: bool = False,
        backward_passes_per_step: int = 1,
        broadcast_parameters: bool = True,
        broadcast_buffers: bool = True,
        nonfinite: str = "raise",
        checks: str = "step",
        timeline: Optional[str] = None,
        sparsify: bool = False,
    ):
        from dearopt.schedules import get_schedule

        if buffer_size is None:
            raise ValueError("buffer_size must be a size or 'auto', not None")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        bpps = backward_passes_per_step
        if isinstance(bpps, bool) or not isinstance(bpps, int) or bpps < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {bpps!r}")
        if checks not in CHECKS:
            raise ValueError(f"checks must be one of {CHECKS}, got {checks!r}")
        if checks != "full" and os.environ.get("DEAROPT_DEBUG", "0") not in ("", "0"):
            checks = "full"
        if timeline is None and os.environ.get("DEAROPT_TIMELINE"):
            timeline = os.environ["DEAROPT_TIMELINE"]
        settled = {
            "buffer_size": buffer_size if buffer_size == "auto" else parse_size(buffer_size),
            "shard_optimizer": bool(shard_optimizer),
            "backward_passes_per_step": bpps,
            "broadcast_parameters": bool(broadcast_parameters),
            "broadcast_buffers": bool(broadcast_buffers),
            "nonfinite": nonfinite,
            "checks": checks,
            "timeline": timeline,
            "sparsify": bool(sparsify),
        }
        for name, value in settled.items():
            object.__setattr__(self, name, value)
        policy = get_schedule(schedule)
        object.__setattr__(self, "policy", policy.resolve(self))
        self.policy.check_options(self)  # schedules registered from outside may still refuse combinations here

    def __setattr__(self, name, value):
        raise AttributeError(f"Options are settled once; make another with options.replace({name}=...)")

    def replace(self, **changes) -> "Options":
        """Another ``Options`` with ``changes`` (shared knobs, or the schedule's knobs by name: the schedule object
        is replaced by its :meth:`~dearopt.schedules.Schedule.with_knobs`)."""
        shared = {name: getattr(self, name) for name in SHARED}
        schedule_knobs = {k: changes.pop(k) for k in list(changes) if k not in SHARED and k != "sparsify"}
        policy = self.policy.with_knobs(**schedule_knobs) if schedule_knobs else self.policy
        return Options(policy, **{**shared, "sparsify": self.sparsify, **changes})

    # --------------------------------------------------- the schedule's knobs
    @property
    def schedule(self) -> str:
        """The schedule's name (for messages; what it does is answered by its traits)."""
        return self.policy.name

    def _knob(self, name: str):
        from dearopt.schedules.base import KNOB_DEFAULTS

        return getattr(self.policy, name) if name in self.policy.knob_names() else KNOB_DEFAULTS[name]

    @property
    def allreduce(self):
        """``dear``'s all-reduced buckets rule (:class:`dearopt.DeAR`), as settled."""
        return self._knob("allreduce")

    @property
    def partition_size(self):
        """Bytes per collective at most (ByteScheduler's partitioning), ``"auto"`` or None."""
        return self.policy.partition_size

    @property
    def credit(self):
        """Bytes of collectives in flight at most (ByteScheduler's credit), ``"auto"`` or None."""
        return self.policy.credit

    @property
    def priority(self) -> bool:
        """Whether reductions are ordered by priority from a profile."""
        return self.policy.priority

    @property
    def first_bucket_size(self):
        """Bytes of the first bucket backward fills (None: no cap)."""
        return self.policy.first_bucket_size

    @property
    def embedding_rows(self) -> bool:
        """Whether embeddings are reduced as the rows a batch touched, as settled."""
        return self.policy.embedding_rows

    @property
    def embedding_rows_given(self) -> bool:
        """Whether the user chose ``embedding_rows`` (else the default decided, off for GPU parameters)."""
        return self.policy.embedding_rows_given

    @property
    def link_check_every(self) -> Optional[int]:
        """Prophet's link re-measurement period in steps (None: never, or another schedule)."""
        return self._knob("link_check_every") if self.policy.needs_profile else None

    @property
    def profile(self):
        """The :class:`dearopt.sim.Profile` given with the schedule, or None."""
        return self.policy.profile

    @property
    def check_agreement(self) -> bool:
        """Whether the step agreement is checked (``checks`` is not ``"off"``)."""
        return self.checks != "off"

    @property
    def debug(self) -> bool:
        """Whether parameter checksums are compared at every step (``checks="full"``)."""
        return self.checks == "full"

    def as_dict(self) -> Dict[str, Any]:
        """The shared knobs and the schedule, as given to :class:`Options` again."""
        return {"schedule": self.policy, **{name: getattr(self, name) for name in SHARED}, "sparsify": self.sparsify}

    def __reduce__(self):
        return (_rebuild, (self.as_dict(),))

    def __repr__(self) -> str:
        shared = ", ".join(f"{name}={getattr(self, name)!r}" for name in SHARED)
        return f"Options(schedule={self.policy!r}, {shared})"


def _rebuild(settled: Dict[str, Any]) -> Options:
    return Options(**settled)
