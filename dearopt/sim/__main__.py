"""Predict a schedule's iteration from a profile: ``python -m dearopt.sim --profile P.json --schedule dear``.

    python -m dearopt.sim --profile bench-out/bert-3gbit/profile.json --schedule dear --ranks 64 --link 10gbit
    python -m dearopt.sim --profile P.json --schedule dear --timeline predicted.png --measured DIR/timeline.rank0.json

Prints the predicted iteration time and its parts (forward, backward, step as the benchmark measures them) and,
with ``--timeline``, writes the predicted timeline as a Chrome trace (``.json``) and a PNG drawn by the
benchmark's renderer (beside a measured trace, with ``--measured``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dearopt.sim import Profile
from dearopt.sim import predict
from dearopt.sim.simulator import cpu_costs
from dearopt.planning.plan import parse_size


def trace(prediction, path: str) -> None:
    """The prediction as trace events the benchmark's renderer reads (one iteration, on rank 0's lanes)."""
    events = list(prediction.events)
    start = 0.0
    for name, seconds in (
        ("forward", prediction.forward),
        ("loss.backward()", prediction.backward),
        ("opt.step()", prediction.step),
    ):
        events.append(
            {"name": name, "cat": "compute", "ph": "X", "tid": 0, "ts": start * 1e6, "dur": seconds * 1e6, "args": {}}
        )
        start += seconds
    events.append(
        {
            "name": "iteration",
            "cat": "iteration",
            "ph": "X",
            "tid": 0,
            "ts": 0.0,
            "dur": prediction.iteration * 1e6,
            "args": {"iteration": 0},
        }
    )
    for e in events:
        e.setdefault("pid", 0)
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dearopt.sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", required=True, help="a profile JSON (dearopt.sim.record_profile, or the bench's)")
    p.add_argument("--schedule", default="dear")
    p.add_argument("--ranks", type=int, default=None, help="world size to predict (default: the profiled one)")
    p.add_argument("--link", default=None, help="link bandwidth, e.g. 10gbit (default: the profiled link)")
    p.add_argument("--latency", type=float, default=None, help="seconds per collective step (default: profiled)")
    p.add_argument("--buffer-size", default="25MB")
    p.add_argument("--partition-size", default=None, help="split buckets into pieces of at most this size, e.g. 1MB")
    p.add_argument("--no-contention", action="store_true", help="compute does not slow while the link is busy")
    p.add_argument("--timeline", default=None, help="write the predicted timeline here (.png; a .json beside it)")
    p.add_argument("--measured", default=None, help="a measured timeline.rank0.json to draw beside the prediction")
    args = p.parse_args(argv)
    profile = Profile.load(args.profile)
    try:
        prediction = predict(
            profile,
            args.schedule,
            ranks=args.ranks,
            link=args.link,
            latency=args.latency,
            buffer_size=parse_size(args.buffer_size),
            **({"partition_size": parse_size(args.partition_size)} if args.partition_size else {}),
            contention={"forward": 0.0, "backward": 0.0} if args.no_contention else None,
        )
    except ValueError as exc:  # an unknown schedule, link or size: say so as a usage error
        p.error(str(exc))
    ranks = args.ranks or profile.world
    print(
        f"{args.schedule} on {ranks} ranks, link {args.link or profile.link}: predicted iteration "
        f"{prediction.iteration:.4f} s (forward {prediction.forward:.4f}, backward {prediction.backward:.4f}, "
        f"step {prediction.step:.4f}; link busy {prediction.link_busy:.4f} s)"
    )
    if profile.cpu_per_byte:
        costs = cpu_costs(profile)
        contention = (
            f"compute lost per byte on the link: reduce-scatter/all-gather {costs['reduce_scatter'] * 1e9:.2f} ns, "
            f"all-reduce {costs['all_reduce'] * 1e9:.2f} ns"
        )
    else:
        contention = (
            f"contention forward {profile.contention.get('forward', 0):.2f}, "
            f"backward {profile.contention.get('backward', 0):.2f}"
        )
    workspace = f"; workspace {profile.workspace_bytes / 2**20:.0f} MiB" if profile.workspace_bytes else ""
    print(
        f"profile: t_ff {profile.t_ff:.4f} s, t_bp {profile.t_bp:.4f} s, measured on {profile.world} ranks "
        f"({profile.backend}, {profile.link}); {contention}{workspace}"
    )
    if args.timeline:
        root, _ = os.path.splitext(args.timeline)
        trace(prediction, root + ".json")
        from dearopt.bench.report import have_matplotlib, render_timeline

        if have_matplotlib():
            paths = ([args.measured] if args.measured else []) + [root + ".json"]
            render_timeline(paths, root + ".png")
            print(f"wrote {root}.json and {root}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
