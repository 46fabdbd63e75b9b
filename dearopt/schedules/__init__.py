"""The schedule registry: one policy per module, found by name.

A schedule is a :class:`~dearopt.schedules.base.Schedule`: an object that
owns its knobs (``dearopt.DeFT(links=2)``; the name is shorthand for the
defaults), settles what follows from the shared ones, and lists the plan's collectives (when each starts, when it
is due, what completing it does).  The executor carries out whatever plan it is
given and never asks which schedule made it.  Adding a schedule is one module
with one ``Schedule`` subclass and one line in :data:`_BUILTIN` (or a call to
:func:`register` from outside the package).
"""

from __future__ import annotations

from typing import Tuple

from dearopt.schedules.base import _REGISTRY, Figures, Schedule, mark_updates
from dearopt.schedules.bytescheduler import ByteScheduler
from dearopt.schedules.dear import DeAR
from dearopt.schedules.deft.schedule import DeFT, Preserver
from dearopt.schedules.prophet import Prophet, ProphetAllReduce
from dearopt.schedules.rsag import RSAG
from dearopt.schedules.wfbp import WFBP

__all__ = [
    "Schedule",
    "Figures",
    "mark_updates",
    "get_schedule",
    "register",
    "names",
    "DeAR",
    "WFBP",
    "RSAG",
    "ByteScheduler",
    "Prophet",
    "ProphetAllReduce",
    "DeFT",
    "Preserver",
]

_BUILTIN = (DeAR, WFBP, RSAG, ByteScheduler, Prophet, ProphetAllReduce, DeFT)
_REGISTRY.update({cls.name: cls() for cls in _BUILTIN})


def register(schedule: Schedule) -> Schedule:
    """Make ``schedule`` (an instance) available by its ``name`` to ``DistOptim(schedule=...)``."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"register() takes a dearopt.schedules.Schedule instance, got {type(schedule).__name__}")
    if not schedule.name or schedule.name in _REGISTRY and _REGISTRY[schedule.name] is not schedule:
        raise ValueError(f"a schedule named {schedule.name!r} is already registered (or the name is empty)")
    _REGISTRY[schedule.name] = schedule
    return schedule


def get_schedule(name) -> Schedule:
    """The registered schedule called ``name`` (with its default knobs), or ``name`` itself where it is a
    :class:`Schedule` instance; a ``ValueError`` listing the known ones otherwise."""
    if isinstance(name, Schedule):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule must be one of {names()}, got {name!r}") from None


def names() -> Tuple[str, ...]:
    """The names of the registered schedules."""
    return tuple(_REGISTRY)
