"""torch DDP timed as a user runs it: in processes of its own, where nothing of dearopt is alive.

A plain DDP script's processes hold one model, one optimizer and torch's own process group; no ``DistOptim`` is
built there and ``dearopt.init`` is never called.  The bench's DDP runs the same way: each bench rank starts one
:class:`DDPProcess` per DDP schedule (``ddp``, ``ddp-view``), and the processes of one schedule form a process
group of their own.  It lives for the whole run (with ``--rebuild``, a round) and trains only when its bench rank
asks for a round, while the bench's own processes wait idle; so its allocator, caches and threads have seen
DDP's iterations and nothing else, as in the user's script.

Before, the bench's DDP ran in the processes that also held every dearopt schedule, and what those had left in
glibc's heap changed DDP's time: ResNet-50's DDP took 13,000-25,000 minor page faults per iteration in fresh
processes and none after ``wfbp`` and ``dear`` had run in the same ones (2026-11-29, docs/benchmarks.md).

:func:`train` is the loop itself, shared with the plain script of :mod:`dearopt.bench.standalone`.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Dict, List, Optional

import torch.multiprocessing as mp


def setup(rank: int, world: int, port: int, cfg: dict, ddp_kwargs: dict, timeout: float):
    """The user's script up to its loop: torch's process group, the bench's model (same seed, so the same initial
    weights as every schedule's), DDP with ``bucket_cap_mb`` and ``ddp_kwargs``, SGD, and this rank's batches."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dearopt.bench.models import build  # the bench's model and batches (no dearopt state)

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    workload = build(cfg["model"], cfg["batch_size"], cfg["size"], seed=cfg["seed"])
    model = DDP(workload.model, bucket_cap_mb=cfg["bucket_mb"], **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    batches = [workload.make_batch(1000 * rank + i) for i in range(cfg["distinct_batches"])]
    return workload, model, opt, batches


def train(state, first: int, warm: int, count: int) -> Dict[str, List[float]]:
    """``warm`` untimed iterations, then ``count`` timed ones, on the batches from position ``first`` on; returns
    each timed iteration's phase times in seconds (``iter``, ``forward``, ``backward``, ``step``) as the bench
    records a schedule's.  A barrier before the timed iterations and after them, so that the ranks start
    together and nothing runs on into whatever comes next."""
    import torch.distributed as dist

    workload, model, opt, batches = state
    out: Dict[str, List[float]] = {"iter": [], "forward": [], "backward": [], "step": []}
    for i in range(warm + count):
        if i == warm:
            dist.barrier()
        x, y = batches[(first + i) % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = workload.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= warm:
            for key, value in (("iter", t3 - t0), ("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
                out[key].append(value)
    dist.barrier()
    return out


def compute(state, count: int) -> Dict[str, List[float]]:
    """The model's compute alone, as this process runs it: ``count`` forwards and backwards of the bare model
    (after one untimed), timed as the bench's parts ``t_ff`` and ``t_bp`` are in its own processes.  DDP's hooks
    stay idle (its reducer expects them only after its own forward), so nothing is reduced; the gradients are
    dropped after each pass, as the training's ``zero_grad()`` drops them.  :func:`dearopt.bench.report.predictions`
    sets it beside the bench's parts: the compute a profile timed in the bench's processes, as DDP's processes
    (their heap, their page faults) run it."""
    import torch.distributed as dist

    workload, model, opt, batches = state
    bare = model.module
    out: Dict[str, List[float]] = {"t_ff": [], "t_bp": []}
    for i in range(count + 1):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        loss = workload.loss(bare(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:  # the first warms up allocator and kernels
            out["t_ff"].append(t1 - t0)
            out["t_bp"].append(t2 - t1)
    opt.zero_grad(set_to_none=True)
    return out


def _serve(rank: int, world: int, port: int, cfg: dict, ddp_kwargs: dict, timeout: float, conn, parent: int):
    from dearopt.bench.spawn import _exit_with_parent

    _exit_with_parent(parent)
    try:
        state = setup(rank, world, port, cfg, ddp_kwargs, timeout)
        conn.send(("ready", None))
        done = 0
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            if message[0] == "compute":
                conn.send(("compute", compute(state, message[1])))
                continue
            _, warm, count = message
            conn.send(("samples", train(state, done, warm, count)))
            done += warm + count
        import torch.distributed as dist

        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class DDPProcess:
    """This rank's part of a plain DDP training in a process of its own (started now, trained by :meth:`round`).

    ``port`` is the same on every rank (its process group's rendezvous), ``ddp_kwargs`` DDP's own keywords beyond
    ``bucket_cap_mb``.  Each call waits at most ``timeout`` seconds for the process; an error there is raised here
    with its traceback."""

    def __init__(self, rank: int, world: int, port: int, cfg: dict, ddp_kwargs: dict, timeout: float):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout = timeout
        self.rank = rank
        self._proc = ctx.Process(
            target=_serve,
            args=(rank, world, port, cfg, ddp_kwargs, timeout, child, os.getpid()),
            name=f"dearopt-bench-ddp-{rank}",
            daemon=True,
        )
        self._proc.start()
        self.pid = self._proc.pid
        child.close()
        self._receive("ready")

    def _receive(self, expected: str):
        if not self._conn.poll(self.timeout):
            self.close()
            raise TimeoutError(f"the DDP process of rank {self.rank} sent nothing in {self.timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"the DDP process of rank {self.rank} ended (exit code {self._proc.exitcode})") from None
        if kind == "error":
            self.close()
            raise RuntimeError(f"the DDP process of rank {self.rank} failed:\n{value}")
        assert kind == expected, (kind, expected)
        return value

    def round(self, warm: int, count: int) -> Dict[str, List[float]]:
        """``warm`` untimed iterations and ``count`` timed ones (see :func:`train`); every rank calls it."""
        self._conn.send(("round", warm, count))
        return self._receive("samples")

    def compute(self, count: int) -> Dict[str, List[float]]:
        """``count`` timed forwards and backwards of the bare model in this process (see :func:`compute`); every
        rank calls it."""
        self._conn.send(("compute", count))
        return self._receive("compute")

    def close(self) -> Optional[int]:
        """End the process (its process group first); returns its exit code."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=10)
        self._conn.close()
        return self._proc.exitcode
