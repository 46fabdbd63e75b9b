"""DDP timed as a user runs it: a plain DDP script in processes of its own (``--standalone-ddp``).

The bench's own DDP runs in the processes that also hold every dearopt schedule's model and optimizer.  This is the
same training (the model, batches, SGD, ``bucket_cap_mb``, torch threads, warm-up and timed iterations) in fresh
processes where no ``DistOptim`` is ever built and ``dearopt.init`` is never called: the process group is torch's
own, as in a plain DDP script.  The bench runs one round of it right before each of its own DDP rounds, on the
same link, while its own processes wait idle (:func:`dearopt.bench.runner.run_rank`), and reports each pair of
rounds' ratio beside the medians (:func:`compare`), so that a difference between the two shows in the run that
would be affected, apart from the machine's drift over the run.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import List

import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from dearopt.bench.models import build  # the bench's model and batches (no dearopt state)

        if hasattr(os, "sched_setaffinity"):  # started by the bench's rank 0, which --bind may have bound to a core
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        torch.set_num_threads(cfg["threads"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        workload = build(cfg["model"], cfg["batch_size"], cfg["size"], seed=cfg["seed"])
        model = DDP(workload.model, bucket_cap_mb=cfg["bucket_mb"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        batches = [workload.make_batch(1000 * rank + i) for i in range(cfg["distinct_batches"])]
        times: List[float] = []
        for i in range(cfg["warmup"] + cfg["iterations"]):
            x, y = batches[i % len(batches)]
            if i == cfg["warmup"]:
                dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            workload.loss(model(x), y).backward()
            opt.step()
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, times, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def run(cfg: dict, world: int, timeout: float = 3600) -> List[float]:
    """Rank 0's iteration times (seconds) of a plain DDP run of ``cfg``'s workload on ``world`` fresh processes."""
    from dearopt.bench.spawn import free_port, run_processes

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, cfg, queue)) for r in range(world)]
    times = run_processes(procs, queue, world, timeout, what="standalone DDP rank")
    # a step ends when the slowest rank's does: the per-iteration maximum over ranks, as the bench reports
    return [max(values) for values in zip(*times)]


def compare(rounds: List[List[float]], bench_rounds: List[float], bench_ddp: float) -> dict:
    """The standalone script's rounds beside the bench's DDP: ``rounds`` its iteration times per round, each round
    run right before the bench's DDP round of the same index; ``bench_rounds`` those rounds' times per iteration
    (the slowest rank's time for the round over its iterations), ``bench_ddp`` the bench's DDP median.  Each pair
    of rounds is one ratio (the bench's over the script's mean iteration); ``bench_over_standalone_rounds`` is
    their median, ``bench_over_standalone`` the ratio of the two medians."""
    means = [sum(r) / len(r) for r in rounds if r]
    ratios = [bench / alone for bench, alone in zip(bench_rounds, means)]
    alone = statistics.median(t for r in rounds for t in r)
    return {
        "rounds": means,
        "bench_rounds": list(bench_rounds[: len(means)]),
        "round_ratios": ratios,
        "median": alone,
        "bench_ddp": bench_ddp,
        "bench_over_standalone": bench_ddp / alone,
        "bench_over_standalone_rounds": statistics.median(ratios) if ratios else float("nan"),
    }
