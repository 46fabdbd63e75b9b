"""Is dearopt faster than what users would use instead, and how close to its bound is it?

Runs torch DDP (gloo, bucket_cap_mb=25) and dearopt's schedules, each in processes of its own as a user runs
it, side by side in one run on the same inputs, measures the parts t_ff, t_bp, t_ar,
t_rs, t_ag, and reports per schedule the median iteration time, global
samples/s, speedup over DDP and the fraction of its bound (Eq. 7 for dear,
Eq. 8 for all-reduce schedules) reached.

    python -m dearopt.bench --model resnet50 --rate 3gbit --out bench-out/resnet50-3gbit --timeline
    python -m dearopt.bench --model tiny --iterations 2 --out /tmp/b          # smoke test

Writes DIR/results.json, DIR/table.txt, DIR/chart.png and, with --timeline,
DIR/timeline.rank<r>.json (Chrome trace) and DIR/timeline.png.
``python -m dearopt.bench --rerender DIR`` recomputes the numbers from the samples in DIR/results.json;
``python -m dearopt.bench --markdown DIR...`` prints them as the tables of docs/benchmarks.md;
``python -m dearopt.bench --summary DIR...`` prints one row per run (the README's table).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from dearopt.bench.netns import SHAPED_ENV, can_shape, run_shaped


def parse_args(argv):
    from dearopt.bench.models import MODELS
    from dearopt.bench.runner import SCHEDULES, base_schedule, known_schedule

    p = argparse.ArgumentParser(
        prog="python -m dearopt.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="resnet50", choices=MODELS)
    p.add_argument(
        "--schedules",
        default="ddp,wfbp,dear",
        help=f"comma-separated, compared in this order (known: {','.join(SCHEDULES)}, and "
        f"<schedule>@<fraction>, e.g. dear@0.5: that fixed share of the bytes all-reduced in "
        f"backward); default ddp,wfbp,dear",
    )
    p.add_argument("--rsag", action="store_true", help="also run dearopt's rsag schedule")
    p.add_argument("--ranks", type=int, default=2, help="local ranks, one torch thread each (default 2)")
    p.add_argument("--rate", default=None, help="emulated link rate, e.g. 3gbit (root + iproute2); default unshaped")
    p.add_argument("--iterations", "-k", type=int, default=8, help="timed iterations per schedule (default 8)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed iterations before every round's timed block of every schedule, as a plain script warms up "
        "(default 3); a dearopt schedule whose plan still changes by itself then (dear's allreduce='auto' profiles "
        "steps 1-3 and measures its candidate plans for a few steps) runs untimed until it settles",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleave: split the timed iterations into this many rounds of parts + every schedule",
    )
    p.add_argument(
        "--part-repeats", type=int, default=None, help="t_ff/t_bp samples per round (default: iterations/rounds)"
    )
    p.add_argument("--comm-repeats", type=int, default=2, help="t_ar/t_rs/t_ag samples per round (default 2)")
    p.add_argument(
        "--overlap-repeats",
        type=int,
        default=1,
        help="per round: forward during all-gathers, backward during reduce-scatters/all-reduces "
        "(diagnostic, not used in the bounds); 0 to skip (default 1)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: resnet50 16, bert 2, tiny 8)")
    p.add_argument("--size", type=int, default=None, help="image side or sequence length (default: 64, 64, 16)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb and dearopt buffer_size in MiB")
    p.add_argument("--lr", type=float, default=1e-3, help="SGD (momentum 0.9) learning rate")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--bind",
        action="store_true",
        help="run each rank on its own cores, as mpirun --bind-to core does (default: the ranks share "
        "every core, as torchrun leaves them)",
    )
    p.add_argument("--out", default=None, help="directory for results.json, chart.png (and timeline files)")
    p.add_argument(
        "--timeline",
        nargs="?",
        const=True,
        default=None,
        metavar="SCHEDULE",
        help="record the timeline of the named dearopt run (default: dear, or the first dearopt schedule "
        "listed without dear); render DIR/timeline.png",
    )
    p.add_argument(
        "--rebuild",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build each schedule's model at the start of each round and drop it after (all of them at "
        "once do not fit in memory for BERT-Base on 24 GiB); default: on for bert, off otherwise. "
        "Each round then builds its schedules anew",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="record a dearopt.sim profile in the same run (DIR/profile.json) and print the simulator's "
        "prediction for every schedule beside the measurement",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every schedule in the bench's own processes, one after another, as before 2026-11-29 17:45 (default: "
        "each in processes of its own, as a user runs it; dearopt.bench.process)",
    )
    p.add_argument(
        "--standalone-ddp",
        action="store_true",
        help="also time a plain DDP script (fresh processes, no dearopt state, torch's own process group) on the "
        "same workload and link, a round of it right before each of the bench's DDP rounds, and print each pair of "
        "rounds' ratio and their median beside the bench's DDP (dearopt.bench.standalone)",
    )
    done = p.add_argument_group("finished runs (instead of measuring)")
    done.add_argument(
        "--rerender",
        metavar="DIR",
        help="recompute every number of DIR/results.json from its samples; rewrite it, table.txt and chart.png",
    )
    done.add_argument("--markdown", metavar="DIR", nargs="+", help="print the runs' tables as in docs/benchmarks.md")
    done.add_argument("--summary", metavar="DIR", nargs="+", help="print one row per run (the README's table)")
    args = p.parse_args(argv)
    if sum(x is not None for x in (args.rerender, args.markdown, args.summary)) > 1:
        p.error("--rerender, --markdown and --summary are alternatives; give one")
    if args.rerender or args.markdown or args.summary:
        return args
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if args.rsag and "rsag" not in schedules:
        schedules.append("rsag")
    unknown = [s for s in schedules if not known_schedule(s)]
    if unknown:
        p.error(f"unknown schedules {unknown}; known: {SCHEDULES}")
    if len(set(schedules)) != len(schedules):
        p.error("a schedule is listed twice")
    if args.standalone_ddp and "ddp" not in schedules:
        p.error("--standalone-ddp compares a plain DDP script with the bench's DDP: list ddp in --schedules")
    dearopt_runs = [s for s in schedules if base_schedule(s) != "ddp"]
    if args.timeline and not dearopt_runs:
        p.error("--timeline records a dearopt run: list one in --schedules")
    if isinstance(args.timeline, str) and args.timeline not in dearopt_runs:
        p.error(f"--timeline {args.timeline}: not a dearopt schedule of this run ({','.join(dearopt_runs)})")
    args.timeline_schedule = (
        (args.timeline if isinstance(args.timeline, str) else "dear" if "dear" in schedules else dearopt_runs[0])
        if args.timeline
        else None
    )
    if args.timeline and not args.out:
        p.error("--timeline needs --out DIR")
    if args.rounds < 1 or args.iterations < args.rounds:
        p.error("need --rounds >= 1 and --iterations >= --rounds")
    args.schedule_list = schedules
    return args


def load_results(directory: str) -> dict:
    """DIR/results.json of a finished run, every number recomputed from its samples."""
    import json

    import dearopt.bench.report as report

    with open(os.path.join(directory, "results.json")) as fh:
        return report.derive(json.load(fh))


def rerender(directory: str) -> int:
    """Recompute every number from the samples in DIR/results.json; rewrite it, table.txt and chart.png."""
    import dearopt.bench.report as report

    doc = load_results(directory)
    print(report.table(doc), flush=True)
    report.write(doc, directory)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--count" in argv:  # the host's work per step: Python calls and operator dispatches (dearopt.bench.count)
        from dearopt.bench.count import main as count_main

        return count_main(argv)
    if "--memory" in argv:  # peak memory per rank and its breakdown (dearopt.bench.memory)
        from dearopt.bench.memory import main as memory_main

        return memory_main(argv)
    args = parse_args(argv)
    if args.markdown:  # tables for docs/benchmarks.md from finished runs
        import dearopt.bench.report as report

        for directory in args.markdown:
            print(report.markdown(load_results(directory)) + "\n")
        return 0
    if args.summary:  # one row per finished run: iteration times, dear vs DDP and vs its bound
        import dearopt.bench.report as report

        print(report.summary([load_results(directory) for directory in args.summary]))
        return 0
    if args.rerender:
        return rerender(args.rerender)
    if args.rate and not os.environ.get(SHAPED_ENV):
        reason = can_shape()
        if reason is None:
            try:
                return run_shaped(args.rate, [sys.executable, "-m", "dearopt.bench", *argv])
            except Exception as exc:  # namespace or qdisc could not be set up
                reason = str(exc)
        print(f"note: cannot emulate {args.rate} ({reason}); running unshaped", flush=True)
    link = os.environ.get(SHAPED_ENV) or "unshaped loopback"
    import dearopt.bench.report as report
    from dearopt.bench.runner import run_rank, workload_cfg
    from dearopt.bench.spawn import spawn

    out = os.path.abspath(args.out) if args.out else None
    timeline = os.path.join(out, "timeline.json") if args.timeline else None
    if out:
        os.makedirs(out, exist_ok=True)
        for old in glob.glob(os.path.join(out, "timeline.rank*.json")):
            os.remove(old)
    cfg = {
        **workload_cfg(args),
        "schedules": args.schedule_list,
        "iterations": args.iterations,
        "rounds": args.rounds,
        "part_repeats": args.part_repeats or max(1, args.iterations // args.rounds),
        "comm_repeats": args.comm_repeats,
        "overlap_repeats": args.overlap_repeats,
        "timeline": timeline,
        "timeline_schedule": args.timeline_schedule,
        "rebuild": args.rebuild if args.rebuild is not None else args.model == "bert",
        "profile": args.profile,
        "standalone_ddp": args.standalone_ddp,
        "in_process": args.in_process,
        "bind": args.bind,
    }
    print(
        f"[bench] {args.model}: {args.ranks} ranks, link {link}, schedules {','.join(args.schedule_list)}, "
        f"{args.warmup} warm-up + {args.iterations} timed iterations in {args.rounds} rounds",
        flush=True,
    )
    results = spawn(run_rank, args.ranks, cfg, threads=args.threads, bind=args.bind)
    doc = report.summarize(results, cfg, link)
    s = doc.get("standalone_ddp")
    if s:
        print(
            "[bench] standalone DDP script, a round right before each of the bench's DDP rounds: "
            + ", ".join(f"{b:.3f} s / {a:.3f} s = {b / a:.3f}x" for a, b in zip(s["rounds"], s["bench_rounds"]))
            + " (the bench's over the script's); median of the rounds' ratios "
            + f"{s['bench_over_standalone_rounds']:.3f}x; medians {s['bench_ddp']:.3f} s / {s['median']:.3f} s = "
            + f"{s['bench_over_standalone']:.3f}x",
            flush=True,
        )
    print(report.table(doc), flush=True)
    if out:
        if timeline:
            paths = sorted(glob.glob(os.path.join(out, "timeline.rank*.json")))
            if paths and report.have_matplotlib():
                idx = report.render_timeline(
                    paths, os.path.join(out, "timeline.png"), schedule=args.timeline_schedule or "dear"
                )
                doc["timeline"] = {
                    "files": [os.path.basename(p) for p in paths],
                    "png": "timeline.png",
                    "iteration_shown": idx,
                }
        if doc.get("profile"):
            from dearopt.sim import Profile

            Profile.from_json(doc["profile"]).save(os.path.join(out, "profile.json"))
        report.write(doc, out)
        print(f"[bench] wrote {os.path.join(out, 'results.json')} and chart.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
