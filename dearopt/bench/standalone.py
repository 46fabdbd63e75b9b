"""DDP timed as a user runs it: a plain DDP script in processes of its own (``--standalone-ddp``).

The bench's own DDP runs in processes of its own that live for the whole run (:mod:`dearopt.bench.ddp`), each
started by a bench rank.  This is the same training (the model, batches, SGD, ``bucket_cap_mb``, torch threads,
warm-up and timed iterations, the loop :func:`dearopt.bench.ddp.train`) in fresh processes started for the round
by rank 0 alone, not bound to any core, where no ``DistOptim`` is ever built and ``dearopt.init`` is never
called.  The bench runs one round of it right before each of its own DDP rounds, on the same link, while its own
processes wait idle (:func:`dearopt.bench.runner.run_rank`), and reports each pair of rounds' ratio beside the
medians (:func:`compare`), so that a difference between the two shows in the run that would be affected, apart
from the machine's drift over the run.
"""

from __future__ import annotations

import os
import statistics
import traceback
from typing import List

import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, cfg: dict, timeout: float, queue) -> None:
    try:
        from dearopt.bench.ddp import setup, train

        if hasattr(os, "sched_setaffinity"):  # started by the bench's rank 0, which --bind may have bound to a core
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        state = setup(rank, world, port, cfg, {}, timeout)
        times = train(state, 0, cfg["warmup"], cfg["iterations"])["iter"]
        import torch.distributed as dist

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
    procs = [ctx.Process(target=_rank, args=(r, world, port, cfg, timeout, queue)) for r in range(world)]
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
