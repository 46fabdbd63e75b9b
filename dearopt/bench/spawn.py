"""Run a function on N local CPU ranks (one thread each) for benchmarks."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any, Callable, List

from dearopt.backends.launch import free_port


def _exit_with_parent(parent: int) -> None:
    """A rank whose launcher was killed exits too, instead of computing on as an orphan."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="dearopt-bench-parent-watch", daemon=True).start()


def bind_to_cores(local_rank: int, local_size: int) -> List[int]:
    """Let this process (and the threads it starts later: torch's, gloo's) run only on its share of the cores
    it may use now, as ``mpirun --bind-to core`` does; ranks beyond the cores share them round-robin.  Returns
    the cores kept."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(len(cores) // local_size, 1)
    first = (local_rank * per) % len(cores)
    mine = cores[first : first + per]
    os.sched_setaffinity(0, mine)
    return mine


def launch_env(rank: int, world: int, port: int) -> None:
    """This process as rank ``rank`` of ``world`` local ranks whose rendezvous is ``127.0.0.1:port``, as a launcher
    would set it (the environment ``dearopt.init()`` reads)."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )


def _entry(fn, rank, world, port, threads, args, queue, parent, bind=False):
    _exit_with_parent(parent)
    if bind:
        bind_to_cores(rank, world)
    launch_env(rank, world, port)
    import torch
    import dearopt

    torch.set_num_threads(threads)
    try:
        dearopt.init(backend="gloo")
        queue.put((rank, fn(*args), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dearopt.shutdown()


def spawn(
    fn: Callable, world_size: int, *args, threads: int = 1, timeout: float = 3600, bind: bool = False
) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks after ``dearopt.init()``; return rank results in order.
    ``bind``: each rank runs on its own cores (:func:`bind_to_cores`)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, threads, args, queue, os.getpid(), bind))
        for r in range(world_size)
    ]
    return run_processes(procs, queue, world_size, timeout)


def _other_errors(queue, left: int, what: str) -> str:
    """What the other processes report within a few seconds of the first failure (the first to report may have
    failed only because another one had: its cause is then among these)."""
    found = []
    for _ in range(left):
        try:
            rank, _, error = queue.get(timeout=5)
        except Exception:
            break
        if error:
            found.append(f"\n{what} {rank} failed too:\n{error}")
    return "".join(found)


def run_processes(procs, queue, world_size: int, timeout: float, what: str = "rank") -> List[Any]:
    """Start ``procs``, each of which puts ``(rank, value, error)`` on ``queue``; return the values in rank order
    (a ``RuntimeError`` with the traceback of the first that failed); every process is joined or killed."""
    for p in procs:
        p.start()
    results = {}
    try:
        for n in range(world_size):
            rank, value, error = queue.get(timeout=timeout)
            if error:
                raise RuntimeError(f"{what} {rank} failed:\n{error}" + _other_errors(queue, world_size - n - 1, what))
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
