"""Every schedule as a user runs it: each in fresh processes of its own, side by side with DDP.

``python -m dearopt.bench.fresh --model resnet50 --rate 3gbit --schedules ddp,wfbp,dear --iterations 20 --rounds 2``

The bench (``python -m dearopt.bench``) runs every schedule in processes of its own that live for the whole run
(:mod:`dearopt.bench.process`).  Here each round starts, for every schedule in turn, two fresh processes (DDP:
torch's process group only; a dearopt schedule: ``dearopt.init`` and ``DistOptim``, warmed up until its plan
settles, as the bench does: the same :class:`dearopt.bench.process.DDPSession` and
:class:`~dearopt.bench.process.RunnerSession`), times ``iterations / rounds`` iterations and ends them; and
reports each schedule's median iteration (the slowest rank's), its ratio to DDP in the same round, and its minor
page faults per timed iteration (``getrusage``: memory new to the process).

2026-11-29, ResNet-50 at 3 Gbit/s, 2 ranks, unshaped CPU workers (/work/diag/ddp_parts.py, the same loop):
DDP 22,000-26,000 faults per iteration, ``wfbp`` 20,000-26,000, ``dear`` 0-925 (its gradients live in its buckets).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from typing import Dict, List, Optional

import torch.multiprocessing as mp

__all__ = ["run_schedule", "main"]


def _ddp_rank(rank: int, world: int, port: int, cfg: dict, timeout: float, queue) -> None:
    try:
        from dearopt.bench.process import DDPSession

        session = DDPSession("ddp", rank, world, port, cfg, timeout)
        got = session.round(cfg["warmup"], cfg["iterations"], 0)
        session.close()
        queue.put((rank, got, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _dearopt_rank(schedule: str, cfg: dict) -> dict:
    """This rank's part of ``schedule`` in a fresh process (after ``dearopt.init``, :func:`dearopt.bench.spawn`),
    warmed up as the bench warms it up."""
    from dearopt.bench.process import RunnerSession

    session = RunnerSession(schedule, cfg, None, rebuild=True)
    got = session.round(cfg["warmup"], cfg["iterations"], 0)
    session.close()
    return got


def run_schedule(schedule: str, cfg: dict, world: int, timeout: float = 3600) -> dict:
    """``schedule`` (``ddp`` or a dearopt schedule of the bench, :func:`dearopt.bench.runner.variant`) trained on
    ``world`` fresh processes: each timed iteration's phases (the slowest rank's), the mean minor page faults per
    iteration over the ranks, and the untimed iterations before them."""
    from dearopt.bench.runner import base_schedule
    from dearopt.bench.spawn import free_port, run_processes, spawn

    if base_schedule(schedule) == "ddp":
        if schedule != "ddp":
            raise ValueError(f"{schedule!r}: only plain 'ddp' runs here (its own keywords are the bench's)")
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, cfg, timeout, queue)) for r in range(world)]
        results = run_processes(procs, queue, world, timeout, what="DDP rank")
    else:
        results = spawn(_dearopt_rank, world, schedule, cfg, threads=cfg["threads"], timeout=timeout)
    phases = {k: [max(v) for v in zip(*(r["samples"][k] for r in results))] for k in results[0]["samples"]}
    return {
        "phases": phases,
        "faults": sum(r["faults"] for r in results) / len(results),
        "untimed": max(r["untimed"] for r in results),
    }


def _parser() -> argparse.ArgumentParser:
    from dearopt.bench.models import MODELS

    p = argparse.ArgumentParser(prog="python -m dearopt.bench.fresh", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", choices=MODELS)
    p.add_argument("--schedules", default="ddp,wfbp,dear", help="comma-separated; ddp first (default ddp,wfbp,dear)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rate", default=None, help="emulated link rate, e.g. 3gbit (root + iproute2); default unshaped")
    p.add_argument("--iterations", "-k", type=int, default=20, help="timed iterations per schedule (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per schedule, interleaved (default 2)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (dear: until it settles)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from dearopt.bench.netns import SHAPED_ENV, rerun_shaped
    from dearopt.bench.runner import iterations_per_round, known_schedule, workload_cfg

    args = _parser().parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in schedules if not known_schedule(s)]
    if unknown or "ddp" not in schedules:
        print(f"--schedules needs ddp and known schedules; unknown: {unknown}", file=sys.stderr)
        return 2
    shaped = rerun_shaped(args.rate)
    if shaped is not None:
        return shaped
    link = os.environ.get(SHAPED_ENV) or "unshaped loopback"
    per_round = iterations_per_round(args.iterations, args.rounds)
    cfg = workload_cfg(args)
    print(f"[fresh] {args.model}: {args.ranks} ranks, link {link}, fresh processes per schedule and round", flush=True)
    times: Dict[str, List[float]] = {s: [] for s in schedules}
    faults: Dict[str, List[float]] = {s: [] for s in schedules}
    ratios: Dict[str, List[float]] = {s: [] for s in schedules}
    for r, count in enumerate(per_round):
        medians = {}
        for s in schedules:
            got = run_schedule(s, dict(cfg, iterations=count), args.ranks)
            medians[s] = statistics.median(got["phases"]["iter"])
            times[s] += got["phases"]["iter"]
            faults[s].append(got["faults"])
            phases = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in got["phases"].items() if k != "iter")
            print(
                f"[fresh] round {r + 1}: {s:>8} median {medians[s]:.3f}s ({phases}; {got['untimed']} untimed), "
                f"{got['faults']:.0f} page faults per iteration",
                flush=True,
            )
        for s in schedules:
            ratios[s].append(medians["ddp"] / medians[s])
    width = max(len("per round vs ddp"), 8 * len(per_round) - 2) + 3
    print("schedule   iter [s]   vs ddp   " + "per round vs ddp".ljust(width) + "page faults per iteration")
    ddp = statistics.median(times["ddp"])
    for s in schedules:
        t = statistics.median(times[s])
        print(
            f"{s:<10}{t:>9.3f}{ddp / t:>8.3f}x   "
            + ", ".join(f"{x:.3f}x" for x in ratios[s]).ljust(width)
            + ", ".join(f"{f:.0f}" for f in faults[s])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
