"""torch DDP as a user runs it: a plain DDP script's setup and loop, where nothing of dearopt is alive.

A plain DDP script's processes hold one model, one optimizer and torch's own process group; no ``DistOptim`` is
built there and ``dearopt.init`` is never called.  :func:`setup` and :func:`train` are that script, shared by the
bench's DDP processes (:class:`dearopt.bench.process.DDPSession`), ``python -m dearopt.bench.fresh`` and the plain
script of :mod:`dearopt.bench.standalone`.
"""

from __future__ import annotations

import datetime
import time
from typing import Dict, List


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
