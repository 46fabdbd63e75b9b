"""Run a function on N local ranks (gloo on CPU) with a hard time limit.

Workers are forked from a forkserver that has torch, torch._dynamo (which
torch.optim's constructors import: ~1.5 s a worker otherwise) and dearopt
imported already, so a 3-rank test costs well under a second to start.  Every run has a timeout:
a hang fails the test and its processes are killed.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from dearopt.backends.launch import free_port  # noqa: F401  (re-exported for the tests)

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "dearopt"])


_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "HOROVOD_")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_free_env() -> Dict[str, str]:
    """This process's environment without any launcher's variables: a child starts as a plain process."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_VARS}


@dataclasses.dataclass
class Outcome:
    rank: int
    value: Any = None
    error_type: Optional[str] = None
    error_types: tuple = ()
    message: str = ""
    traceback: str = ""
    exitcode: Optional[int] = None
    seconds: float = 0.0
    finished_at: float = 0.0  # wall clock (time.time()) when the rank returned or raised

    @property
    def ok(self) -> bool:
        return self.error_type is None


def _entry(target, rank, world_size, port, args, kwargs, queue, env, init_kwargs):
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    os.environ.update(env or {})
    import torch
    import dearopt

    torch.set_num_threads(1)
    start = time.monotonic()
    returned = False
    try:
        if init_kwargs is not None:
            dearopt.init(**init_kwargs)
        value = target(*args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: no shared-memory tensors that die with the process
        queue.put((rank, buffer.getvalue(), None, (), "", "", time.monotonic() - start, time.time()))
        returned = True
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        queue.put(
            (
                rank,
                None,
                type(exc).__name__,
                tuple(c.__name__ for c in type(exc).__mro__),
                str(exc),
                traceback.format_exc(),
                time.monotonic() - start,
                time.time(),
            )
        )
    finally:
        try:
            dearopt.shutdown(complete=returned)  # a rank that raised leaves as on an unhandled error
        except BaseException:
            pass


def run_workers(
    target: Callable,
    world_size: int,
    *args,
    timeout: float = 60.0,
    env: Optional[Dict[str, str]] = None,
    init_kwargs: Optional[dict] = None,
    expect_errors: bool = False,
    **kwargs,
) -> List[Outcome]:
    """Run ``target(*args, **kwargs)`` on ``world_size`` ranks; return each rank's :class:`Outcome`.

    Each worker calls ``dearopt.init(**init_kwargs)`` first (``init_kwargs={}``
    by default; pass ``None`` to skip it).  Unless ``expect_errors``, a rank
    that raised fails the calling test with its traceback.
    """
    if init_kwargs is None:
        init_kwargs = {}
    elif init_kwargs is False:
        init_kwargs = None
    port = free_port()
    queue = _CTX.Queue()
    procs = [
        _CTX.Process(
            target=_entry, args=(target, r, world_size, port, args, kwargs, queue, env, init_kwargs), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: Dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, value, etype, etypes, msg, tb, secs, wall = queue.get(timeout=0.1)
            if value is not None:
                value = torch.load(io.BytesIO(value), weights_only=False)
            outcomes[rank] = Outcome(rank, value, etype, etypes, msg, tb, seconds=secs, finished_at=wall)
        except Exception:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    for r, p in enumerate(procs):
        outcome = outcomes.setdefault(r, Outcome(r, error_type="NoResult", message="process ended without a result"))
        outcome.exitcode = p.exitcode
    if hung and not expect_errors:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s (killed)")
    if not expect_errors:
        failed = [o for o in outcomes.values() if not o.ok]
        if failed:
            raise AssertionError(
                "\n".join(f"rank {o.rank} raised {o.error_type}: {o.message}\n{o.traceback}" for o in failed)
            )
    return [outcomes[r] for r in range(world_size)]


class Attempts(dict):
    """What a rank's refusal cases raised: ``attempts.attempt(name, fn)`` records ``(error type, message)`` under
    ``name`` (None if ``fn`` raised nothing); :meth:`expect` checks them in the test process."""

    def attempt(self, name: str, fn: Callable[[], Any]) -> None:
        import dearopt

        try:
            fn()
            self[name] = None
        except (dearopt.DearoptError, ValueError, TypeError) as exc:
            self[name] = (type(exc).__name__, str(exc))

    @staticmethod
    def expect(got: Dict[str, Any], expected: Dict[str, tuple]) -> None:
        """``expected``: name -> (error type, text its message contains)."""
        for name, (kind, text) in expected.items():
            assert got.get(name) is not None, f"{name}: nothing was raised"
            assert got[name][0] == kind and text in got[name][1], (name, got[name])
