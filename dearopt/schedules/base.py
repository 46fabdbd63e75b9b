"""What every schedule is: an object that owns its knobs and lists a plan's collectives."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

from dearopt.planning.plan import DEFAULT_FIRST_BUCKET_SIZE, CommOp, Layout, ParamSpec, Point, parse_size

__all__ = ["Schedule", "Figures", "mark_updates", "KNOB_DEFAULTS"]

KNOB_DEFAULTS: Dict[str, Any] = {
    "first_bucket_size": DEFAULT_FIRST_BUCKET_SIZE,
    "embedding_rows": None,
    "profile": None,
    "partition_size": None,
    "credit": None,
    "priority": False,
    "allreduce": "auto",
    "link_check_every": "auto",
    "given": None,
    "preserver": True,
    "links": 1,
    "apply": "bucket",
}
"""Every schedule knob with the value that means "not asked for": a knob a schedule does not have may be
passed to :meth:`Schedule.with_knobs` at this value."""


def _size(value, knob: str, auto: bool = False):
    if value is None or (auto and value == "auto"):
        return value
    try:
        return parse_size(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{knob}: {exc}") from None


class Figures:
    """What the engine running a schedule measured and decided, read-only.

    A ``DistOptim`` hands one to the copy of the schedule it runs (``optimizer.schedule.figures``), made from the
    engine parts that keep the figures; the schedules' own properties read it (``DeAR.plan_choice``,
    ``Prophet.link_changes``, ``DeFT.applied_steps``, ...), so that a schedule never holds the engine.  Each figure
    is read when asked and handed out as a copy.  ``Figures()`` (no parts) is the answer of a schedule no optimizer
    runs: nothing measured (None, or empty).

    Args:
        plan_choice: answers the measured choice of ``allreduce="auto"`` as it stands (the plan search's).
        link_monitor: the :class:`dearopt.planning.profile.LinkMonitor` of ``link_check_every``.
        delayed: a delayed schedule's rounds part (:class:`dearopt.schedules.deft.rounds.DelayedRounds`).
    """

    def __init__(self, *, plan_choice: Optional[Callable[[], Any]] = None, link_monitor=None, delayed=None):
        self._plan_choice = plan_choice
        self._link_monitor = link_monitor
        self._delayed = delayed

    @property
    def plan_choice(self):
        """The measured choice of ``allreduce="auto"`` (a :class:`dearopt.planning.tuner.TuningController`), or None."""
        return self._plan_choice() if self._plan_choice is not None else None

    @property
    def link_changes(self) -> List[Tuple[int, float, float]]:
        """Re-plans after the link's bandwidth changed: ``(step, planned bytes/s, measured bytes/s)`` each."""
        return list(self._link_monitor.changes) if self._link_monitor is not None else []

    def delayed(self, name: str):
        """A delayed schedule's figure ``name`` as its rounds part keeps it (``deft``, ``preserved``,
        ``reduction``, ``measured``, ``repartitions``, ``applied_steps``), or None under any other schedule."""
        return getattr(self._delayed, name) if self._delayed is not None else None


class Schedule(abc.ABC):
    """A communication schedule: its knobs, its traits, and the plan's collectives.

    An instance owns its knobs, validated once when it is made
    (``dearopt.ByteScheduler(partition_size="4MB", credit="16MB", priority=True)``); the name
    (``schedule="bytescheduler"``) is shorthand for the instance with the defaults.  Subclasses set
    :attr:`name`, :attr:`reduction` (the collective that sums the gradients), the traits below, and implement
    :meth:`ops`.  Everything the engine does follows from the ops and the traits, never from the name.

    Knobs every schedule has: ``first_bucket_size`` (bytes of the first bucket backward fills; 1 MB as DDP;
    None: no cap), ``embedding_rows`` (reduce ``nn.Embedding`` weights as the rows a batch touched: default on
    for CPU parameters where the schedule allows it; see :mod:`dearopt.engine.tied`) and ``profile`` (a
    :class:`dearopt.sim.Profile` of the model: the buffer tuner's first trial, and ``deft``'s times).  Where
    :attr:`takes_ordering_knobs`: ``partition_size`` (ByteScheduler's partitions: at most this many bytes per
    collective; ``"auto"``: tuned), ``credit`` (bytes in flight at most; ``"auto"``: tuned) and ``priority``
    (reductions ordered by priority from a profile of steps 1-3).
    """

    name: ClassVar[str] = ""
    reduction: ClassVar[str] = "all_reduce"
    takes_ordering_knobs: ClassVar[bool] = True
    """Whether ``partition_size``, ``credit`` and ``priority`` apply."""
    reduces_before_step: ClassVar[bool] = True
    """Whether every gradient is averaged by the end of ``step()`` (``nonfinite="skip"`` needs that)."""
    mixes_allreduce: ClassVar[bool] = False
    """Whether the schedule all-reduces the buckets in ``Layout.allreduce`` (the ``allreduce`` knob)."""
    updates_in_forward: ClassVar[bool] = False
    """Whether updates are applied during the next forward (the model's forward hooks must run)."""
    delays_updates: ClassVar[bool] = False
    """Whether a step's gradients may be applied at a later step (DeFT): carried out by
    :class:`dearopt.schedules.deft.rounds.DelayedRounds` instead of the exact rounds."""
    needs_profile: ClassVar[bool] = False
    """Whether the plan is made from rank 0's profile of steps 1-3 (gradient ready times, the link's bandwidth)."""
    shards_update: ClassVar[bool] = False
    """Whether each bucket's reduce-scatter can leave a rank its shard to update and an all-gather in the next
    forward bring the parameters (``shard_optimizer=True``)."""
    takes_sparsify: ClassVar[bool] = False
    """Whether each bucket's sum may be replaced by a :class:`dearopt.Sparsify` exchange (whole buckets,
    all-reduced)."""
    rows_by_default: ClassVar[bool] = True
    """Whether embeddings are reduced as rows unless asked otherwise (a schedule that sums a tied weight's two
    gradients as one says False)."""
    figures: Figures = Figures()
    """What this run measured and decided (a read-only view of the engine): set by ``DistOptim`` on the copy of
    the schedule it runs (``optimizer.schedule``); the schedule's own properties read it.  Nothing measured on any
    other schedule object (the one passed as ``schedule=`` is never changed)."""

    def __init__(
        self,
        *,
        first_bucket_size=DEFAULT_FIRST_BUCKET_SIZE,
        embedding_rows: Optional[bool] = None,
        profile=None,
        partition_size=None,
        credit=None,
        priority: bool = False,
    ):
        self.first_bucket_size = _size(first_bucket_size, "first_bucket_size")
        if embedding_rows not in (None, True, False):
            raise ValueError(f"embedding_rows must be True, False or None (the default), got {embedding_rows!r}")
        if embedding_rows and not self.rows_by_default:
            raise ValueError(
                f"schedule={self.name!r} reduces embeddings densely (a tied weight's two gradients "
                f"are one); leave embedding_rows unset"
            )
        self.embedding_rows = embedding_rows
        self.profile = profile
        self.partition_size = _size(partition_size, "partition_size", auto=True)
        self.credit = _size(credit, "credit", auto=True)
        if not isinstance(priority, bool):
            raise ValueError(f"priority must be True or False, got {priority!r}")
        self.priority = priority
        if not self.takes_ordering_knobs and (
            credit is not None or priority or (partition_size is not None and not self._takes_partitions())
        ):
            raise ValueError(self._ordering_refusal())

    def _takes_partitions(self) -> bool:
        return False

    def _ordering_refusal(self) -> str:
        return f"schedule={self.name!r} takes no partition_size, credit or priority"

    # --------------------------------------------------------------- knobs
    def knobs(self) -> Dict[str, Any]:
        """The knobs this schedule was made with (what :meth:`with_knobs` starts from)."""
        return {name: getattr(self, name) for name in self.knob_names()}

    @classmethod
    def knob_names(cls) -> Tuple[str, ...]:
        """The knobs this kind of schedule takes (its own and its bases' keyword arguments)."""
        return tuple(_knob_defaults(cls))

    def with_knobs(self, **changes) -> "Schedule":
        """A copy of this schedule with ``changes`` to its knobs (validated as at construction).  A knob this
        schedule does not have is refused by name, unless it is at the value that means "not asked for"."""
        names = self.knob_names()
        for knob, value in changes.items():
            if knob not in names and knob not in KNOB_DEFAULTS:
                raise TypeError(f"{knob!r} is not a schedule knob")
            if knob not in names and not _same(value, KNOB_DEFAULTS[knob]):
                takers = _takers(knob)
                raise ValueError(
                    f"{knob}={value!r} is a knob of schedule {' / '.join(map(repr, takers))}; "
                    f"schedule={self.name!r} has none"
                )
        return type(self)(**{**self.knobs(), **{k: v for k, v in changes.items() if k in names}})

    def resolve(self, options) -> "Schedule":
        """This schedule with what follows from the knobs every schedule shares (``options``: the
        :class:`dearopt.Options` being made) settled, and what cannot combine refused by name: the copy the
        engine runs.  Subclasses settle their own knobs (``super().resolve`` first)."""
        if options.nonfinite == "skip" and not self.reduces_before_step:
            raise ValueError(
                f"nonfinite='skip' needs every gradient before the first update; schedule={self.name!r} "
                f"updates bucket by bucket as the next forward reaches them: use 'raise' or 'ignore', "
                f"or schedule='dear'"
            )
        if options.shard_optimizer and not self.shards_update:
            raise ValueError(
                f"shard_optimizer=True needs schedule='dear' (the reduce-scatter leaves each rank "
                f"the averaged gradient of its shard, the next forward's all-gather brings the "
                f"parameters); schedule={self.name!r} has no such pair"
            )
        rows = self.embedding_rows
        if options.sparsify:
            if not self.takes_sparsify:
                raise ValueError(
                    f"comm_hook=dearopt.Sparsify(...) replaces each bucket's all-reduce: it works "
                    f"with schedule='wfbp' or 'dear', not {self.name!r}"
                )
            if self.partition_size is not None:
                raise ValueError(
                    "comm_hook=dearopt.Sparsify(...) selects over whole buckets: partition_size must be None"
                )
            if options.shard_optimizer:
                raise ValueError(
                    "comm_hook=dearopt.Sparsify(...) and shard_optimizer=True do not combine (the "
                    "sharded update needs each bucket reduce-scattered)"
                )
            if options.nonfinite == "skip":
                raise ValueError(
                    "comm_hook=dearopt.Sparsify(...) takes each step's gradients into its residuals "
                    "as it sends them; nonfinite='skip' would lose them: use 'raise' or 'ignore'"
                )
            if rows:
                raise ValueError(
                    "comm_hook=dearopt.Sparsify(...) sparsifies embeddings itself (top-k of the "
                    "whole gradient); leave embedding_rows unset"
                )
            rows = False
        if options.shard_optimizer and rows:
            raise ValueError(
                "shard_optimizer=True reduces embeddings densely: with embedding_rows=True every "
                "rank would hold the whole averaged embedding gradient; leave embedding_rows unset"
            )
        resolved = self.with_knobs()
        resolved.embedding_rows_given = self.embedding_rows is not None
        resolved.embedding_rows = rows if rows is not None else self.rows_by_default and not options.shard_optimizer
        return resolved

    # ------------------------------------------------------------- the plan
    def bucket_groups(
        self,
        params: Sequence[ParamSpec],
        *,
        buffer_size: int,
        ready_times: Optional[Sequence[float]],
        bandwidth: Optional[float],
        latency: Optional[float] = None,
    ) -> Optional[List[List[int]]]:
        """Which parameters share a bucket (contiguous runs of positions in forward order), or None to fuse them
        by ``buffer_size`` (every schedule but Prophet's).  ``latency``: measured fixed seconds per collective."""
        return None

    def check_options(self, options) -> None:
        """Refuse option combinations this schedule cannot carry out (``ValueError`` naming them); kept for
        schedules registered from outside: :meth:`resolve` does this for the built-in ones."""

    @abc.abstractmethod
    def ops(self, layout: Layout) -> Sequence[CommOp]:
        """The plan's collectives in the order every rank starts them."""

    def predicted_sends(self, plan, measured) -> Optional[List[Tuple[float, float]]]:
        """Each bucket's reduction as the schedule's link model predicts it (start, end seconds after backward
        starts), for the timeline; None where the schedule has no such model (all but Prophet's)."""
        return None

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and _same(self.knobs(), other.knobs())

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.knobs().items() if not _same(v, _default_of(type(self), k))}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _knob_defaults(cls) -> Dict[str, Any]:
    import inspect

    found: Dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for name, parameter in inspect.signature(init).parameters.items():
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
                found.setdefault(name, parameter.default)
    return found


def _default_of(cls, knob: str):
    return _knob_defaults(cls)[knob]


# the registry by name: the package fills it with the built-in schedules; dearopt.schedules.register adds others
_REGISTRY: Dict[str, "Schedule"] = {}


def _takers(knob: str) -> List[str]:
    return [s.name for s in _REGISTRY.values() if knob in s.knob_names()]


def mark_updates(ops: Sequence[CommOp], at: Optional[Callable[[CommOp], Point]] = None) -> List[CommOp]:
    """Name on the last op of each bucket (in plan order) when the bucket's update is applied:
    ``at(op)``, by default the op's own due moment."""
    last = {op.bucket: i for i, op in enumerate(ops)}
    return [
        dataclasses.replace(op, update=((at or (lambda o: o.due))(op) if last[op.bucket] == i else None))
        for i, op in enumerate(ops)
    ]
