"""How many tuner trials does starting at the simulator's best buffer size save?

    python scripts/tune_bench.py --model resnet50 --rate 3gbit --json tune.json      # a measured grid
    python -m dearopt.bench --model resnet50 --rate 3gbit --profile --out B          # a profile (B/profile.json)
    python scripts/tuner_start.py --grid tune.json --profile B/profile.json

The buffer-size tuner (:class:`dearopt.planning.tuner.BayesianTuner`, as ``DistOptim``
builds it: budget 10, early stop) is replayed offline against the *measured*
throughput of the grid (log-linear interpolation between grid sizes, and 2 %
Gaussian noise per trial, the noise of a few-step average here), from two
starts: 25 MB (no profile) and the simulator's best size for the profile
(``DistOptim(..., buffer_size="auto", profile=...)``).  Over ``--seeds`` runs
it reports the trials until the tuner first tries a size within ``--within``
of the grid's best throughput, the trials until it stops, and how good its
final choice is.  The replay is offline so that both starts see the same
objective; the objective itself is a measurement, not a prediction.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import numpy as np

from dearopt import sim
from dearopt.planning.tuner import MB, BayesianTuner, buffer_size_knob


def objective(grid):
    sizes = sorted(grid)
    xs = [math.log(s) for s in sizes]
    ys = [grid[s] for s in sizes]

    def f(size_bytes: float) -> float:
        return float(np.interp(math.log(size_bytes / MB), xs, ys))

    return f


def replay(f, initial: int, high: int, seed: int, best: float, within: float):
    tuner = BayesianTuner([buffer_size_knob(high=high, initial=initial)], budget=10, seed=seed)
    rng = np.random.RandomState(seed)
    first_good = None
    while not tuner.done:
        knobs = tuner.suggest()
        true = f(knobs["buffer_size"])
        if first_good is None and true >= (1 - within) * best:
            first_good = len(tuner.history) + 1
        tuner.observe(knobs, true * (1 + 0.02 * rng.randn()))
    chosen = tuner.best[0]["buffer_size"]
    return {
        "first_good": first_good,
        "trials": len(tuner.history),
        "chosen_mb": chosen / MB,
        "chosen_fraction": f(chosen) / best,
    }


def _predicted(profile, args, mb):
    return sim.predict(profile, args.schedule, buffer_size=int(mb * MB), allreduce=args.allreduce)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", required=True, help="scripts/tune_bench.py --json output (a measured grid)")
    p.add_argument("--profile", required=True, help="a profile of the same model and link")
    p.add_argument("--schedule", default="dear")
    p.add_argument("--allreduce", type=float, default=0.0, help="dear's all-reduced share, as tune_bench ran it")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--within", type=float, default=0.02, help="'good' = within this fraction of the grid's best")
    args = p.parse_args(argv)
    with open(args.grid) as fh:
        doc = json.load(fh)
    grid = {float(mb): row["samples_per_s"] for mb, row in doc["grid"].items()}
    f = objective(grid)
    best_mb = max(grid, key=grid.get)
    best = grid[best_mb]
    profile = sim.Profile.load(args.profile)
    model_bytes = sum(s.nbytes for s in profile.params)
    high = min(100 * MB, max(model_bytes, 2 * MB))
    candidates = [int(MB * 2 ** (i / 2)) for i in range(0, 15) if MB * 2 ** (i / 2) <= high]
    start_sim = sim.best_buffer_size(profile, args.schedule, candidates, allreduce=args.allreduce)
    print(
        f"measured grid ({doc.get('link', '?')}): "
        + ", ".join(f"{mb:g} MB {v:.2f}/s" for mb, v in sorted(grid.items()))
        + f"; best {best_mb:g} MB"
    )
    print(
        "simulated: "
        + ", ".join(f"{mb:g} MB {1 / _predicted(profile, args, mb).iteration:.3f} it/s" for mb in sorted(grid))
        + f"; simulator's best size {start_sim / MB:.1f} MB "
        f"(measured throughput there {f(start_sim) / best:.3f} of the grid's best)"
    )
    rows = {}
    for label, initial in (("25 MB start", min(25 * MB, high)), ("simulator start", start_sim)):
        runs = [replay(f, initial, high, seed, best, args.within) for seed in range(args.seeds)]
        good = [r["first_good"] for r in runs if r["first_good"] is not None]
        rows[label] = runs
        print(
            f"{label:>16} ({initial / MB:5.1f} MB): first trial within {args.within:.0%} of best: "
            f"median {statistics.median(good) if good else float('nan'):.1f}, mean "
            f"{statistics.mean(good) if good else float('nan'):.2f} (never in {args.seeds - len(good)} of "
            f"{args.seeds}); trials until the tuner stops: mean {statistics.mean(r['trials'] for r in runs):.2f}; "
            f"final choice {statistics.mean(r['chosen_fraction'] for r in runs):.3f} of best"
        )
    a, b = ([r["first_good"] or 11 for r in rows[k]] for k in rows)
    print(
        f"trials saved to reach a good size: {statistics.mean(a) - statistics.mean(b):+.2f} (mean over "
        f"{args.seeds} seeds; 'never' counted as 11)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
