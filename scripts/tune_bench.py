#!/usr/bin/env python
"""How good is the online buffer-size tuner?  A grid of fixed sizes and the tuner, side by side in one run.

For each size of the grid (default 1, 2, 5, 10, 25, 50, 100 MB) the `dear`
schedule trains the model for --iterations timed iterations (after --warmup),
in --rounds interleaved rounds (every size once per round, a fresh DistOptim
each time; a size's figure is the median over all its rounds' iterations, so
that a slow minute of the machine does not land on one size);
then a fresh DistOptim with buffer_size="auto" tunes online until the tuner
stops, and the size it chose is timed the same way.  Prints the grid's
throughputs, the chosen size, the number of trials, the chosen size's
throughput as a fraction of the grid's best, and the cost of one suggestion
(rank 0's time at trial boundaries).

    python scripts/tune_bench.py --model resnet50 --rate 3gbit
"""

import argparse
import json
import os
import statistics
import sys
import time

MB = 2**20


def _timed(opt, model, workload, iterations, warmup, seed0, times=None):
    times = [] if times is None else times
    for i in range(warmup + iterations):
        x, y = workload.make_batch(seed0 + i)
        t0 = time.perf_counter()
        opt.zero_grad()
        workload.loss(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    opt.synchronize()
    return statistics.median(times)


def _run(cfg):
    import logging

    import torch

    import dearopt
    from dearopt.bench.models import build

    rank = dearopt.rank()
    results = {"grid": {}, "tuner": {}}

    def make():
        workload = build(cfg["model"], seed=0)
        inner = torch.optim.SGD(workload.model.parameters(), lr=0.01, momentum=0.9)
        return workload, inner

    samples = {size_mb: [] for size_mb in cfg["grid"]}
    for r in range(cfg["rounds"]):
        for size_mb in cfg["grid"]:
            workload, inner = make()
            opt = dearopt.DistOptim(
                inner, workload.model, schedule=dearopt.DeAR(allreduce=cfg["allreduce"]), buffer_size=int(size_mb * MB)
            )
            t = _timed(opt, workload.model, workload, cfg["iterations"], cfg["warmup"], 100 * r, samples[size_mb])
            opt.close()
            if rank == 0:
                print(f"  round {r + 1}/{cfg['rounds']}, grid {size_mb:>6} MB: {t:.3f} s/iteration so far", flush=True)
    for size_mb, times in samples.items():
        t = statistics.median(times)
        results["grid"][size_mb] = {
            "iteration_s": t,
            "samples_per_s": workload.batch_size * dearopt.size() / t,
            "samples_s": times,
        }
    workload, inner = make()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    from dearopt.planning.tuner import MB as TUNER_MB, BayesianTuner, buffer_size_knob

    model_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    high = min(100 * TUNER_MB, max(model_bytes, 2 * TUNER_MB))
    tuner = BayesianTuner(
        [buffer_size_knob(high=high, initial=min(25 * TUNER_MB, high))],
        budget=10,
        steps_per_trial=cfg["tuning_steps"],
    )
    opt = dearopt.DistOptim(
        inner, workload.model, schedule=dearopt.DeAR(allreduce=cfg["allreduce"]), buffer_size="auto", tuner=tuner
    )
    boundary_costs, steps = [], 0
    while not opt.tuning.finished and steps < 400:
        x, y = workload.make_batch(1000 + steps)
        opt.zero_grad()
        workload.loss(workload.model(x), y).backward()
        trials_before = len(opt.tuning.history)
        t0 = time.perf_counter()
        opt.step()
        if len(opt.tuning.history) > trials_before:
            boundary_costs.append(time.perf_counter() - t0)
        steps += 1
    chosen = opt.tuning.best[0]["buffer_size"]
    history = [(k["buffer_size"] / MB, thr) for k, thr in opt.tuning.history]
    t = _timed(opt, workload.model, workload, cfg["iterations"], cfg["warmup"], 5000)
    opt.close()
    results["tuner"] = {
        "chosen_mb": chosen / MB,
        "trials": len(history),
        "tuning_steps_total": steps,
        "history": history,
        "iteration_s": t,
        "samples_per_s": workload.batch_size * dearopt.size() / t,
        "boundary_step_s_median": statistics.median(boundary_costs) if boundary_costs else None,
    }
    return results


def main(argv=None):
    from dearopt.bench.netns import SHAPED_ENV, can_shape, run_shaped
    from dearopt.bench.spawn import spawn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "bert", "tiny"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rate", default=None, help="emulated link, e.g. 3gbit (root)")
    parser.add_argument("--grid", default="1,2,5,10,25,50,100", help="buffer sizes in MB")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the grid")
    parser.add_argument("--tuning-steps", type=int, default=3, help="measured iterations per trial")
    parser.add_argument(
        "--allreduce",
        type=float,
        default=0.0,
        help="dear's all-reduced share, fixed for every size (default 0: DeAR's plan, as the paper "
        "tunes it; allreduce='auto' would measure plans inside the timed iterations)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.rate and not os.environ.get(SHAPED_ENV):
        reason = can_shape()
        if reason is None:
            return run_shaped(args.rate, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])])
        print(f"note: cannot emulate {args.rate} ({reason}); running unshaped", flush=True)
    cfg = {
        "model": args.model,
        "grid": [float(g) for g in args.grid.split(",")],
        "iterations": args.iterations,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "tuning_steps": args.tuning_steps,
        "allreduce": args.allreduce,
    }
    link = os.environ.get(SHAPED_ENV, "unshaped loopback")
    print(f"tuner benchmark: {args.model}, {args.ranks} ranks, link {link}", flush=True)
    res = spawn(_run, args.ranks, cfg)[0]
    best_mb = max(res["grid"], key=lambda k: res["grid"][k]["samples_per_s"])
    best = res["grid"][best_mb]["samples_per_s"]
    print("\n| buffer | s/iteration | samples/s |\n| --- | --- | --- |")
    for mb, row in res["grid"].items():
        print(f"| {mb:g} MB | {row['iteration_s']:.3f} | {row['samples_per_s']:.2f} |")
    tuner = res["tuner"]
    print(f"| tuner: {tuner['chosen_mb']:.1f} MB | {tuner['iteration_s']:.3f} | {tuner['samples_per_s']:.2f} |")
    print(
        f"\ntuner chose {tuner['chosen_mb']:.1f} MB after {tuner['trials']} trials ({tuner['tuning_steps_total']} "
        f"iterations); its throughput is {tuner['samples_per_s'] / best:.3f} of the grid's best ({best_mb:g} MB)"
    )
    if tuner["boundary_step_s_median"] is not None:
        print(
            f"median step() time at a trial boundary (suggestion + broadcast + re-plan): "
            f"{1000 * tuner['boundary_step_s_median']:.0f} ms"
        )
    print("trials:", ", ".join(f"{mb:.1f} MB -> {thr:.3f} steps/s" for mb, thr in tuner["history"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"link": link, **res}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
