"""Prophet following the link: a run whose emulated link changes its rate halfway (issue 17).

    python scripts/prophet_link_change.py [--model resnet50] [--rate 3gbit] [--then 1gbit] [--steps 40]
                                          [--every 5] [--out bench-out/prophet-link]

Needs root (a network namespace whose loopback is shaped, as the bench's ``--rate``).  Two ranks train
with ``prophet`` and its link monitor (``link_check_every=--every``); after half the steps rank 0
re-shapes the loopback to ``--then`` (``tc qdisc change``).  Printed and written to
``OUT/link_change.json``: every step's iteration time (the slower rank's), the number of blocks in force,
the re-plans with the bandwidth before and after, and the median iteration time before the change, after
it until the re-plan (the old blocks on the new link) and after the re-plan (the new blocks).

Two models trained in turn in the same processes would not be a fair side-by-side here: ``prophet``'s
all-gathers run into the next forward, so one model's gathers would share the link with the other
model's iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dearopt.bench.netns import parse_rate, rerun_shaped  # noqa: E402


def _burst_kb(rate: str) -> int:
    return max(128, int(128 * parse_rate(rate) / 1e9))


def _rank(args) -> dict:
    import torch

    import dearopt
    from dearopt.bench.models import build

    rank = dearopt.rank()
    backend = dearopt.backends.runtime.get_backend()
    runs = {}
    for name, every in (("monitored", args.every),):
        work = build(args.model, seed=0)
        inner = torch.optim.SGD(work.model.parameters(), lr=0.01, momentum=0.9)
        opt = dearopt.DistOptim(inner, work.model, schedule=dearopt.Prophet(link_check_every=every))
        runs[name] = (work, opt)
    batch = build(args.model, seed=0).make_batch(rank)
    times = {name: [] for name in runs}
    blocks = {name: [] for name in runs}
    change_at = args.steps // 2
    for step in range(args.steps):
        if step == change_at:  # re-shape an idle link: twice in four runs the change with gathers in flight
            for _, opt in runs.values():  # stalled the next collective past the timeout
                opt.synchronize()
            backend.all_reduce(torch.zeros(1)).wait()
            if rank == 0:
                subprocess.run(
                    [
                        "tc",
                        "qdisc",
                        "change",
                        "dev",
                        "lo",
                        "root",
                        "tbf",
                        "rate",
                        args.then,
                        "burst",
                        f"{_burst_kb(args.then)}kb",
                        "latency",
                        "100ms",
                    ],
                    check=True,
                )
            backend.all_reduce(torch.zeros(1)).wait()
        for name, (work, opt) in runs.items():
            t0 = time.perf_counter()
            opt.zero_grad()
            work.loss(work.model(batch[0]), batch[1]).backward()
            opt.step()
            times[name].append(time.perf_counter() - t0)  # combined over ranks at the end: a collective
            blocks[name].append(len(opt.plan.buckets))  # here would queue behind the gathers in flight
    for name in runs:
        slowest = torch.tensor(times[name])
        backend.all_reduce(slowest, "max").wait()  # per step, the slower rank's time sets the pace
        times[name] = slowest.tolist()
    out = {
        name: {"times": times[name], "blocks": blocks[name], "link_changes": opt.schedule.link_changes}
        for name, (_, opt) in runs.items()
    }
    for _, opt in runs.values():
        opt.close()
    return out


def _summary(result: dict, change_at: int, steps: int) -> dict:
    replans = [s for s, _, _ in result["monitored"]["link_changes"] if s > change_at]
    replan_at = replans[0] if replans else steps
    from dearopt.planning.profile import ReadyProfile

    blocks_from = ReadyProfile.STEP + ReadyProfile.STEPS + 1  # the step after the first re-plan to the blocks
    windows = {
        "before the change": (blocks_from, change_at),
        "after it, before the re-plan": (change_at + 1, replan_at),
        "after the re-plan": (replan_at + 1, steps),
    }
    table = {}
    for label, (a, b) in windows.items():
        table[label] = {name: (statistics.median(r["times"][a:b]) if b > a else None) for name, r in result.items()}
    return {"replan_step": replan_at if replans else None, "medians": table}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", choices=("resnet50", "bert", "tiny"))
    ap.add_argument("--rate", default="3gbit")
    ap.add_argument("--then", default="1gbit")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", default="bench-out/prophet-link")
    args = ap.parse_args()
    code = rerun_shaped(args.rate)
    if code is not None:
        return code
    from dearopt.bench.spawn import spawn

    result = spawn(_rank, 2, args)[0]
    change_at = args.steps // 2
    print(
        f"{args.model}, 2 ranks, link {args.rate} -> {args.then} before step {change_at}; prophet with the "
        f"link monitor (every {args.every} steps)"
    )
    print("step  iteration [s] blocks")
    for s in range(args.steps):
        m = result["monitored"]
        mark = "  <- link changed" if s == change_at else ""
        print(f"{s:4d}  {m['times'][s]:13.3f} {m['blocks'][s]:6d}{mark}")
    for step, before, after in result["monitored"]["link_changes"]:
        print(f"re-plan at step {step}: bandwidth {before / 1e6:.1f} -> {after / 1e6:.1f} MB/s")
    summary = _summary(result, change_at, args.steps)
    for label, medians in summary["medians"].items():
        shown = ", ".join(f"{k} {v:.3f} s" if v is not None else f"{k} -" for k, v in medians.items())
        print(f"median iteration {label}: {shown}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "link_change.json"), "w") as f:
        json.dump({"args": vars(args), "result": result, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
