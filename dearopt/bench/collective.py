"""Micro-benchmark: reduce-scatter, all-gather and all-reduce of one flat buffer.

Prints t_rs, t_ag, t_ar and (t_rs + t_ag) / t_ar for each size, so that one
sees whether the decoupled all-reduce costs what one all-reduce costs (the
assumption of the DeAR paper).  Also times gloo's own
``reduce_scatter_tensor`` for comparison with the all-to-all form dearopt uses.

    python scripts/collective_bench.py --sizes 25MB 100MB --ranks 2 --rate 3gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from dearopt.bench.netns import SHAPED_ENV, can_shape, run_shaped


def _measure(sizes_bytes, repeats):
    import torch
    import torch.distributed as dist

    import dearopt
    from dearopt.backends.base import padded_numel

    backend = dearopt.backends.get_backend()
    w = dearopt.size()
    rows = []
    for nbytes in sizes_bytes:
        n = padded_numel(nbytes // 4, w)
        full = torch.randn(n)
        shard = torch.empty(n // w)
        out = torch.empty(n)

        def timed(start):
            samples = []
            for i in range(repeats + 1):
                backend.all_reduce(torch.zeros(1)).wait()  # align the ranks
                t0 = time.perf_counter()
                start().wait()
                if i:  # the first run warms up buffers and connections
                    samples.append(time.perf_counter() - t0)
            return statistics.median(samples)

        t_rs = timed(lambda: backend.reduce_scatter(shard, full))
        t_ag = timed(lambda: backend.all_gather(out, shard))
        t_ar = timed(lambda: backend.all_reduce(full))
        t_rs_native = timed(lambda: dist.reduce_scatter_tensor(shard, full, async_op=True))
        rows.append(
            {
                "bytes": n * 4,
                "t_rs": t_rs,
                "t_ag": t_ag,
                "t_ar": t_ar,
                "t_rs_gloo_native": t_rs_native,
                "ratio": (t_rs + t_ag) / t_ar,
            }
        )
    return rows


def _parse_size(text: str) -> int:
    from dearopt.planning.plan import parse_size

    return parse_size(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["25MB", "100MB"], help="buffer sizes, e.g. 25MB 100MB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rate", default=None, help="emulated link rate, e.g. 3gbit (needs root); default unshaped")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    from dearopt.bench.spawn import spawn

    if args.rate and not __import__("os").environ.get(SHAPED_ENV):
        reason = can_shape()
        if reason is None:
            return run_shaped(args.rate, [sys.executable, "-m", "dearopt.bench.collective", *(argv or sys.argv[1:])])
        print(f"note: cannot emulate {args.rate} ({reason}); running unshaped", flush=True)
    link = __import__("os").environ.get(SHAPED_ENV, "unshaped loopback")
    sizes = [_parse_size(s) for s in args.sizes]
    rows = spawn(_measure, args.ranks, sizes, args.repeats)[0]
    print(f"collectives, {args.ranks} ranks, gloo, link: {link}")
    print(f"{'size':>10} {'t_rs[s]':>9} {'t_ag[s]':>9} {'t_ar[s]':>9} {'(rs+ag)/ar':>11} {'gloo rs[s]':>11}")
    for row in rows:
        print(
            f"{row['bytes'] / 2**20:>8.1f}MB {row['t_rs']:>9.4f} {row['t_ag']:>9.4f} {row['t_ar']:>9.4f} "
            f"{row['ratio']:>11.2f} {row['t_rs_gloo_native']:>11.4f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ranks": args.ranks, "link": link, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
