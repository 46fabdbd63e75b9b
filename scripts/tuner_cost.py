"""Cost of one tuner decision (rank 0's work at a trial boundary) after 10 observations.

Times ``observe(10th) + suggest()``: registering the 10th observation fits the
GP, maximizes expected improvement (bayes_opt) for the 11th suggestion and runs
the early-stop check; ``suggest()`` then returns the cached point.

    python scripts/tuner_cost.py [--repeats 5]
"""

import argparse
import math
import statistics
import time

import numpy as np

from dearopt.planning.tuner import MB, BayesianTuner, Knob, buffer_size_knob


def one(knobs, f, seed):
    tuner = BayesianTuner(knobs, budget=20, seed=seed, min_improvement=0)
    rng = np.random.RandomState(seed)
    for _ in range(9):
        k = tuner.suggest()
        tuner.observe(k, f(k) * (1 + 0.02 * rng.randn()))
    k = tuner.suggest()
    y = f(k) * (1 + 0.02 * rng.randn())
    t0 = time.perf_counter()
    tuner.observe(k, y)
    tuner.suggest()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    def f1(k):
        d = math.log(k["buffer_size"] / (12 * MB)) / 0.7
        return 100 * (0.5 + 0.5 * math.exp(-0.5 * d * d))

    def f2(k):
        d = math.log(k["partition_size"] / (8 * MB)) / 0.7
        e = (k["credit"] - 3) / 1.5
        return 100 * (0.5 + 0.5 * math.exp(-0.5 * d * d - 0.5 * e * e))

    cases = {
        "buffer_size": ([buffer_size_knob()], f1),
        "partition_size+credit": (
            [
                Knob("partition_size", 1 * MB, 64 * MB, log=True, initial=4 * MB, integer=True),
                Knob("credit", 1, 8, initial=2, integer=True),
            ],
            f2,
        ),
    }
    for name, (knobs, f) in cases.items():
        ms = [one(knobs, f, seed) for seed in range(args.repeats)]
        print(
            f"{name}: one suggestion after 10 observations: median {statistics.median(ms):.1f} ms "
            f"(min {min(ms):.1f}, max {max(ms):.1f}, {args.repeats} seeds)"
        )


if __name__ == "__main__":
    main()
