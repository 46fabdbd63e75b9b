"""``hvd.elastic`` on dearopt: Horovod's elastic API, recovered by a restart under torchrun's elastic agent.

A Horovod elastic script runs with only its import changed::

    import dearopt.integrations.horovod as hvd

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

**How it differs from Horovod.**  Horovod keeps the processes that survive a
failure and re-forms the ring in place (``run`` catches the error, calls
``state.restore()`` and ``state.sync()`` and calls ``train`` again).  Under
dearopt the set of ranks of a process is fixed: a failure ends the processes
and torchrun's agent (``torchrun --nnodes=MIN:MAX --max-restarts=N``) starts
them again with the ranks that are left (or that joined).  So that the new
processes continue where the old ones were, :meth:`State.commit` writes the
state to disk through :mod:`dearopt.checkpoint` (DCP: every rank its part) in
the directory named by ``DEAROPT_ELASTIC_DIR`` (or ``checkpoint_dir=``), and
:func:`run` begins by loading the latest commit there.  Without a directory,
commits stay in memory (``restore()`` works, a restart starts afresh).

``ElasticSampler`` is :class:`dearopt.checkpoint.ElasticSampler`: the samples
processed in the epoch are committed with the state, and the remaining ones are
dealt over the new world size.  Callbacks registered with
:meth:`State.register_reset_callbacks` run when a commit is loaded at another
world size (where Horovod calls them after a reset).
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
from typing import Any, Callable, Dict, List, Optional

import dearopt.checkpoint as _checkpoint
import dearopt.backends.runtime as runtime
from dearopt.errors import UsageError

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "CHECKPOINT_DIR_ENV"]

CHECKPOINT_DIR_ENV = "DEAROPT_ELASTIC_DIR"
"""The environment variable naming the directory commits are written to."""

KEEP = 2
"""Commits kept on disk (the newest ones; older ones are removed after a newer one is written)."""


class ElasticSampler(_checkpoint.ElasticSampler):
    """``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``: see :class:`dearopt.checkpoint.ElasticSampler`
    (``record_batch`` marks every rank's samples of the batch, so no exchange is needed at commit)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        super().__init__(dataset, shuffle=shuffle, seed=seed)


class State:
    """Horovod's base class of elastic state: :meth:`commit`, :meth:`restore`, :meth:`sync`, reset callbacks.

    Args:
        checkpoint_dir: where commits are written (default: ``$DEAROPT_ELASTIC_DIR``; None: in memory only).
    """

    def __init__(self, bcast_object=None, get_rank=None, checkpoint_dir: Optional[str] = None):
        self._reset_callbacks: List[Callable[[], None]] = []
        self._dir = checkpoint_dir if checkpoint_dir is not None else os.environ.get(CHECKPOINT_DIR_ENV) or None
        self._commits = 0

    @property
    def checkpoint_dir(self) -> Optional[str]:
        """The directory commits are written to (None: kept in memory)."""
        return self._dir

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call when the state is resumed at another world size than it was committed at."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks."""
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's host-discovery hook; under dearopt membership changes arrive as a restart: nothing to do."""

    def commit(self) -> None:
        """Keep the current state: written to the checkpoint directory (every rank calls it, at the same step)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises ``HostsUpdatedInterrupt`` here when hosts changed; under dearopt torchrun's agent
        restarts the job instead: nothing to do."""

    def save(self) -> None:
        """Keep the current state (see :meth:`commit`)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last commit."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state the same: the latest commit on disk if there is one, else rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called by :func:`run` before the state is synced; nothing to do under dearopt."""


class ObjectState(State):
    """Elastic state made of picklable attributes (``state.epoch``, ``state.batch``...), committed with the
    checkpoint and broadcast from rank 0 by :meth:`sync` when there is none."""

    def __init__(self, bcast_object=None, get_rank=None, checkpoint_dir: Optional[str] = None, **kwargs):
        super().__init__(checkpoint_dir=checkpoint_dir)
        self._saved_state = dict(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def _values(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._saved_state}

    def save(self) -> None:
        """Keep a copy of the attributes."""
        self._saved_state = copy.deepcopy(self._values())

    def restore(self) -> None:
        """Set the attributes back to the last commit."""
        self._set_attrs()

    def sync(self) -> None:
        """Take rank 0's committed attributes on every rank."""
        if self._saved_state and runtime.is_initialized() and runtime.size() > 1:
            from dearopt.collectives import broadcast_object

            self._saved_state = broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()


class TorchState(ObjectState):
    """``hvd.elastic.TorchState(model=None, optimizer=None, **kwargs)``: the model, the optimizer (a
    ``hvd.DistributedOptimizer`` or a :class:`dearopt.DistOptim`), samplers (objects with ``state_dict``) and
    other attributes, committed together as one :mod:`dearopt.checkpoint` checkpoint."""

    def __init__(self, model=None, optimizer=None, checkpoint_dir: Optional[str] = None, **kwargs):
        stateful = {k: v for k, v in kwargs.items() if _stateful(v)}
        plain = {k: v for k, v in kwargs.items() if k not in stateful}
        self.model = model
        self.optimizer = optimizer
        self._stateful = stateful
        for name, value in stateful.items():
            setattr(self, name, value)
        self._memory: Optional[dict] = None
        super().__init__(checkpoint_dir=checkpoint_dir, **plain)

    def _extra(self) -> Dict[str, Any]:
        return {"attributes": self._values(), "commits": self._commits, **self._stateful}

    def save(self) -> None:
        """Write the model, the optimizer, the samplers and the attributes as commit number ``n`` (the next) to
        ``checkpoint_dir/step_<n>`` through :func:`dearopt.checkpoint.save` (every rank its part; the
        :data:`KEEP` newest commits are kept), or, without a directory, copy them in memory."""
        if self.model is None or self.optimizer is None:
            raise UsageError("hvd.elastic.TorchState needs model= and optimizer= to commit")
        self._commits += 1
        super().save()
        if self._dir is None:  # in memory only: a copy of this rank's model and optimizer
            self._memory = {
                "model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "stateful": {k: copy.deepcopy(v.state_dict()) for k, v in self._stateful.items()},
            }
            return
        path = _checkpoint.step_path(self._dir, self._commits)
        _checkpoint.save(path, self.model, self.optimizer, extra=self._extra())
        _prune(self._dir, self._commits)

    def restore(self) -> None:
        """Go back to the last commit: the latest on disk, or the copy in memory."""
        if self._dir is not None:
            found = _checkpoint.latest(self._dir)
            if found is not None:
                self._load(found[1])
                return
        if self._memory is not None:
            self.model.load_state_dict(self._memory["model"])
            self.optimizer.load_state_dict(self._memory["optimizer"])
            for name, value in self._stateful.items():
                value.load_state_dict(self._memory["stateful"][name])
        super().restore()

    def _load(self, path: str) -> None:
        extra = _checkpoint.load(path, self.model, self.optimizer, extra=self._stateful)
        self._saved_state = dict(extra["attributes"])
        self._commits = int(extra["commits"])
        self._set_attrs()

    def sync(self) -> None:
        """Load the latest commit on disk (a restarted job continues from it; reset callbacks run if the world size
        changed), or, if there is none, take rank 0's attributes."""
        found = _checkpoint.latest(self._dir) if self._dir is not None else None
        if found is None:
            super().sync()
            return
        self._load(found[1])
        saved_world = _checkpoint.describe(found[1])["world"]
        if runtime.is_initialized() and saved_world != runtime.size():
            self.on_reset()


def _stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _prune(root: str, newest: int) -> None:
    """Remove commits older than the :data:`KEEP` newest (rank 0, once the newest is written)."""
    if runtime.is_initialized() and runtime.rank() != 0:
        return
    for entry in os.listdir(root):
        if entry.startswith("step_") and entry[5:].isdigit() and int(entry[5:]) <= newest - KEEP:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def run(func):
    """``@hvd.elastic.run``: call ``func(state, ...)`` after syncing ``state`` (the latest commit, when torchrun's
    agent restarted the job after a failure).  An error in ``func`` (a lost peer: :class:`dearopt.PeerLostError`)
    ends the process, for the agent to restart it with the ranks that are left; Horovod's in-process retry does
    not exist here."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(
                f"hvd.elastic.run: the first argument must be a hvd.elastic.State, got {type(state).__name__}"
            )
        if not runtime.is_initialized():
            raise UsageError("call hvd.init() before the function decorated with hvd.elastic.run")
        state.reset()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper
