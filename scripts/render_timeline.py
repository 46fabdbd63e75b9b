#!/usr/bin/env python
"""Render one iteration of dearopt Chrome traces (one file per rank) as a PNG.

python scripts/render_timeline.py out/timeline.rank0.json out/timeline.rank1.json -o timeline.png [--iteration N]
"""

import argparse
import sys

from dearopt.bench.report import render_timeline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="timeline.rank<r>.json files, in rank order")
    p.add_argument("-o", "--out", default="timeline.png")
    p.add_argument("--iteration", type=int, default=None, help="iteration index (default: second-to-last recorded)")
    args = p.parse_args(argv)
    shown = render_timeline(args.traces, args.out, args.iteration)
    print(f"wrote {args.out} (iteration {shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
