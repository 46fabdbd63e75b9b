"""What each rank runs: the measured parts in the bench's processes, every schedule in processes of its own.

:func:`run_rank` is started on every rank (after ``dearopt.init()``) by
:func:`dearopt.bench.spawn.spawn`.  It builds one plain model for the parts and
starts, per schedule, a process of its own (:class:`dearopt.bench.process.ScheduleProcess`:
as a user runs it, DDP with torch's process group only, a dearopt schedule after
``dearopt.init()`` with its ``DistOptim``, the same model and seed, so the same
initial weights; ``--in-process`` runs every schedule here instead), and then,
for each of ``rounds`` rounds:

1. the parts: ``t_ff`` (forward + loss), ``t_bp`` (backward, no hooks, no
   communication), and ``t_ar`` / ``t_rs`` / ``t_ag``: all-reduce,
   reduce-scatter and all-gather of every gradient bucket of dearopt's plan
   (25 MiB buckets), started back to back in backward order and waited;
2. every schedule in turn, in its processes while these wait idle at a barrier:
   warm-up iterations (untimed; a dearopt schedule until its plan settles,
   :func:`warm_up`), then timed iterations (zero_grad + forward + backward +
   step), then a ``synchronize()`` (untimed) so that no work leaks into the
   next block.

Interleaving the rounds spreads slow phases of a noisy machine over every
schedule and the parts alike.  Every sample is returned per rank; the report
takes, for each sample, the slowest rank, and then the median.
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dearopt.bench.process import InProcess, ScheduleProcess
from dearopt.schedules import names as _dearopt_schedules
from dearopt.schedules.deft.schedule import Preserver
from dearopt.compression.sparsify import Sparsify

VARIANTS = {
    # name: (dearopt schedule, extra knobs: the schedule object's and DistOptim's), or ("ddp", DDP's own keywords);
    # the bucket size is --bucket-mb
    "ddp-view": ("ddp", {"gradient_as_bucket_view": True}),
    "dear+pc": ("dear", {"priority": True, "partition_size": 4 * 2**20, "credit": 16 * 2**20}),
    "dear-nocheck": ("dear", {"checks": "off", "nonfinite": "ignore"}),
    "dear-paper": ("dear", {"allreduce": 0.0}),
    "dear-tuned": ("dear", {"buffer_size": "auto", "steps_per_trial": 3}),
    "deft-2links": ("deft", {"links": 2}),
    "deft-group": ("deft", {"apply": "group"}),
    "deft-paper": ("deft", {"preserver": Preserver(statistic="loss")}),
    "dear+deft1": ("dear", {"comm_hook": Sparsify(0.01)}),
    "dear+deft10": ("dear", {"comm_hook": Sparsify(0.10)}),
    "dear+topk1": ("dear", {"comm_hook": Sparsify(0.01, selection="topk")}),
    "dear+topk10": ("dear", {"comm_hook": Sparsify(0.10, selection="topk")}),
}
"""Configured variants: ``ddp-view`` is torch DDP with ``gradient_as_bucket_view=True`` (``ddp`` keeps DDP's
defaults, as a plain DDP script runs it: each gradient copied into its bucket and back into a new tensor every
iteration); ``dear+pc`` is dear with priority order, 4 MiB partitions and a 16 MiB credit window
(issue 6); ``dear-nocheck`` is dear without the step-agreement and non-finite checks (to price them, issue 9);
``dear-paper`` is DeAR as in the paper (every bucket reduce-scattered and gathered in the next forward), where
``dear`` all-reduces in backward as many buckets as fit in the link's idle time there (``allreduce="auto"``);
``dear-tuned`` tunes its buffer size online (Bayesian optimization, 10 trials of 3 measured steps; untimed
until tuning and the measured choice are over) instead of --bucket-mb; ``deft-2links`` is deft over two
concurrent communicators (DeFT's heterogeneous links, issue 16) and ``deft-group`` deft applying each group at
once as the paper does (``deft_apply="group"``; ``deft`` applies each bucket once all of it is sent),
``deft-paper`` deft whose Preserver is the paper's test, the expected losses' ratio
(``Preserver(statistic="loss")``; ``deft``'s default tests the expected loss decrease);
``dear+deft1``/``dear+deft10`` sparsify with
DEFT at 1 %/10 % density and ``dear+topk1``/``dear+topk10`` with the plain top-k baseline (issue 18)."""

SCHEDULES = ("ddp",) + _dearopt_schedules() + tuple(VARIANTS)
"""Known schedules: ``ddp`` is torch DDP (gloo, bucket_cap_mb=25); then dearopt's (``dearopt.schedules.names()``)
and the configured :data:`VARIANTS`."""


def variant(name: str) -> Tuple[str, dict]:
    """``(dearopt schedule or "ddp", extra keywords: DistOptim's, or DDP's for "ddp")`` of a benchmark schedule
    name: a configured :data:`VARIANTS` entry, ``<schedule>@<fraction>`` (e.g. ``dear@0.5``: that fixed
    ``allreduce`` fraction of the bytes all-reduced in backward from the output side), or a schedule's own name."""
    if name in VARIANTS:
        return VARIANTS[name]
    base, at, fraction = name.partition("@")
    if at:
        try:
            value = float(fraction)
        except ValueError:
            value = -1.0
        if base not in _dearopt_schedules() or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name!r}: expected <schedule>@<fraction in [0, 1]>, e.g. dear@0.5")
        return base, {"allreduce": value}
    return name, {}


def known_schedule(name: str) -> bool:
    """Whether the benchmark can run ``name`` (see :func:`variant`)."""
    try:
        base = variant(name)[0]
    except ValueError:
        return False
    return base == "ddp" or base in _dearopt_schedules()


def base_schedule(name: str) -> str:
    """The dearopt schedule (or ``ddp``) a benchmark schedule name runs."""
    return variant(name)[0]


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", flush=True)


class _Runner:
    """One schedule's model, optimizer and iteration."""

    def __init__(self, schedule: str, cfg: dict, timeline_path=None):
        import dearopt
        from dearopt.bench.models import build

        self.schedule = schedule
        self.workload = build(cfg["model"], cfg["batch_size"], cfg["size"], seed=cfg["seed"])
        model = self.workload.model
        self.model = model
        inner = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        self.timeline = None
        base, extra = variant(schedule)
        if base == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.forward_module = DDP(model, bucket_cap_mb=cfg["bucket_mb"], **extra)
            self.opt = inner
            self.is_dearopt = False
        else:
            self.forward_module = model
            self.is_dearopt = True
            policy = dearopt.schedules.get_schedule(base)
            own = {k: v for k, v in extra.items() if k in policy.knob_names()}  # the schedule object's knobs
            knobs = {
                "buffer_size": int(cfg["bucket_mb"] * 2**20),
                "timeline": timeline_path,
                **{k: v for k, v in extra.items() if k not in own and k != "steps_per_trial"},
            }
            if "steps_per_trial" in extra:  # dear-tuned: the default tuner's buffer size, fewer steps per trial
                from dearopt.planning.tuner import MB, BayesianTuner, buffer_size_knob

                high = min(100 * MB, max(sum(p.numel() * p.element_size() for p in model.parameters()), 2 * MB))
                knobs["tuner"] = BayesianTuner(
                    [buffer_size_knob(high=high, initial=min(25 * MB, high))],
                    budget=10,
                    steps_per_trial=extra["steps_per_trial"],
                )
            self.opt = dearopt.DistOptim(inner, model, schedule=policy.with_knobs(**own), **knobs)
            if timeline_path:
                self.timeline = self.opt.timeline  # forward/iteration spans from the benchmark side
        self.iteration = 0

    def step(self, x, y) -> Dict[str, float]:
        """One training iteration; returns its phase times in seconds."""
        tl = self.timeline
        t_iter = tl.now() if tl else 0.0
        t0 = time.perf_counter()
        self.opt.zero_grad()
        t_fw = tl.now() if tl else 0.0
        loss = self.workload.loss(self.forward_module(x), y)
        if tl:
            tl.span("forward", "compute", t_fw, iteration=self.iteration)
        t1 = time.perf_counter()
        t_bw = tl.now() if tl else 0.0
        loss.backward()
        t2 = time.perf_counter()
        if tl:
            tl.span("loss.backward()", "compute", t_bw, iteration=self.iteration)
        t_st = tl.now() if tl else 0.0
        if self.is_dearopt:  # deft's Preserver reads the loss of its first steps
            self.opt.step(loss=loss.detach())
        else:
            self.opt.step()
        t3 = time.perf_counter()
        if tl:
            tl.span("opt.step()", "compute", t_st, iteration=self.iteration)
            tl.span("iteration", "iteration", t_iter, iteration=self.iteration)
        self.iteration += 1
        return {"iter": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}

    @property
    def settled(self) -> bool:
        """Whether the optimizer's plan stopped changing by itself (profile, tuning, measured choice)."""
        return not self.is_dearopt or self.opt.settled

    def settle(self) -> None:
        """Finish every pending update (untimed, between blocks)."""
        if self.is_dearopt:
            self.opt.synchronize()

    def close(self) -> None:
        if self.is_dearopt:
            self.opt.close()


DELAYED_WARMUP_PERIODS = 4
"""Untimed periods a delaying schedule (``deft``) runs before each timed block, beyond the warm-up every schedule
gets: its backlog of sends still running from earlier iterations reaches its steady size first."""
PROFILE_REPEATS = 3  # iterations a --profile times its compute in, at the start and again in every later round


def warm_up(runner, batches: Sequence, warm: int) -> Tuple[int, int, int]:
    """The untimed iterations before a dearopt schedule's timed ones: at least ``warm``, then until its plan stops
    changing by itself (a plan that still changes is not the steady state), and one more if it changed past
    ``warm`` (the last re-plan applied every pending update, so the next iteration would start with no all-gather
    to wait for).  A schedule whose iterations repeat with a period (deft: merged groups, sends crossing
    iterations) is timed in whole periods, one sample per period (its mean iteration: a few single iterations of a
    period of 5 measure one phase of it, not its pace), after :data:`DELAYED_WARMUP_PERIODS` more periods: its
    sends run on across iterations, and after ``settle()`` (or a re-solve) the link starts idle and the backlog
    builds up over several iterations; timed from there, the first iterations ran ahead of the steady pace
    (BERT-Base at 3 Gbit/s: 1.4-2.2 s against 2.6-3.1 s, below the 2.34 s the link needs per iteration when every
    byte is sent).  Returns (iterations run, the period, iterations the plan took to settle beyond ``warm``)."""
    i = 0
    while i < warm or not runner.settled:
        runner.step(*batches[i % len(batches)])
        i += 1
    beyond = i - warm
    if beyond:
        runner.step(*batches[i % len(batches)])
        i += 1
    deft = getattr(getattr(runner.opt, "schedule", None), "in_force", None)  # DeFT's
    period = len(deft.period) if deft is not None else 1
    for _ in range(DELAYED_WARMUP_PERIODS * period if deft is not None else 0):
        runner.step(*batches[i % len(batches)])
        i += 1
    return i, period, beyond


def workload_cfg(args) -> dict:
    """The part of a bench configuration that builds and trains one schedule (:class:`_Runner`,
    :func:`dearopt.bench.ddp.setup`), from the parsed command line of ``python -m dearopt.bench`` or
    ``python -m dearopt.bench.fresh``."""
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "size": args.size,
        "seed": args.seed,
        "lr": args.lr,
        "bucket_mb": args.bucket_mb,
        "threads": args.threads,
        "warmup": args.warmup,
        "distinct_batches": 4,
    }


def timed_samples(step: Callable, batches: Sequence, first: int, count: int, period: int = 1) -> Dict[str, List[float]]:
    """``count`` samples of ``step(x, y)`` (a dict of seconds per part), on the batches from position ``first``
    on; with ``period`` above 1, each sample is the mean of ``period`` consecutive steps (any window of a whole
    period holds each of its iterations once)."""
    out: Dict[str, List[float]] = {}
    for j in range(count):
        sums: Dict[str, float] = {}
        for q in range(period):
            x, y = batches[(first + j * period + q) % len(batches)]
            for k, v in step(x, y).items():
                sums[k] = sums.get(k, 0.0) + v
        for k, v in sums.items():
            out.setdefault(k, []).append(v / period)
    return out


def iterations_per_round(iterations: int, rounds: int) -> List[int]:
    """How the timed iterations are split over the rounds (the first rounds take the remainder)."""
    return [iterations // rounds + (1 if r < iterations % rounds else 0) for r in range(rounds)]


def _rule(knobs: dict):
    """A measured plan as results.json records it: the ``allreduce`` rule, or ``"blocks"`` (Prophet's blocks)."""
    return "blocks" if knobs.get("blocks") else knobs["allreduce"]


def plan_label(knobs: dict) -> str:
    """A measured plan as the log names it."""
    return "blocks" if knobs.get("blocks") else f"allreduce={knobs['allreduce']!r}"


def _barrier(backend) -> None:
    backend.all_reduce(torch.zeros(1)).wait()


def _forward_order_specs(model, workload):
    """Parameters in forward execution order, as dearopt's planner sees them."""
    from dearopt.planning.order import param_specs, parameters_in_forward_order, record_forward_order

    def run():
        with torch.no_grad():
            model(workload.make_batch(0)[0])

    modules = record_forward_order(model, run)
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    return param_specs(parameters_in_forward_order(model, modules, trainable), names)


class _Parts:
    """The plain model and the bucket buffers for t_ff, t_bp, t_ar, t_rs, t_ag."""

    def __init__(self, cfg: dict, world: int, backend):
        from dearopt.planning.build import build_plan
        from dearopt.bench.models import build

        self.cfg = cfg
        self.backend = backend
        self.workload = build(cfg["model"], cfg["batch_size"], cfg["size"], seed=cfg["seed"])
        specs = _forward_order_specs(self.workload.model, self.workload)
        self.plan = build_plan(specs, int(cfg["bucket_mb"] * 2**20), world, "dear")
        self.full = [torch.randn(b.padded_numel) for b in self.plan.buckets]
        self.shards = [torch.empty(b.padded_numel // world) for b in self.plan.buckets]
        self.samples: Dict[str, List[float]] = {k: [] for k in ("t_ff", "t_bp", "t_ar", "t_rs", "t_ag")}
        # diagnostics: compute while the collectives run (both started at once, time to finish both)
        self.overlap: Dict[str, List[float]] = {k: [] for k in ("t_ff||ag", "t_bp||rs", "t_bp||ar")}

    def compute(self, batches, n: int) -> None:
        model, wl = self.workload.model, self.workload
        for i in range(n + 1):
            x, y = batches[i % len(batches)]
            model.zero_grad(set_to_none=True)
            _barrier(self.backend)
            t0 = time.perf_counter()
            loss = wl.loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if i:  # the first sample warms up allocator and kernels
                self.samples["t_ff"].append(t1 - t0)
                self.samples["t_bp"].append(t2 - t1)

    def overlapped(self, batches, n: int) -> None:
        """Forward while every all-gather runs; backward while every reduce-scatter (all-reduce) runs.

        On a CPU-only machine the collectives' copies, sums and socket work take
        cores from the compute: these show how much, against the idealized
        ``max(t_ff, t_ag)`` and ``max(t_bp, t_rs)`` of the bounds.
        """
        model, wl, be = self.workload.model, self.workload, self.backend
        order = self.plan.backward_order
        for i in range(n):
            x, y = batches[i % len(batches)]
            model.zero_grad(set_to_none=True)
            _barrier(be)
            t0 = time.perf_counter()
            handles = [be.all_gather(self.full[b], self.shards[b]) for b in reversed(order)]
            loss = wl.loss(model(x), y)
            for h in handles:
                h.wait()
            self.overlap["t_ff||ag"].append(time.perf_counter() - t0)
            for key in ("t_bp||rs", "t_bp||ar"):
                if key == "t_bp||ar":
                    model.zero_grad(set_to_none=True)
                    loss = wl.loss(model(x), y)
                _barrier(be)
                t0 = time.perf_counter()
                if key == "t_bp||rs":
                    handles = [be.reduce_scatter(self.shards[b], self.full[b]) for b in order]
                else:
                    handles = [be.all_reduce(self.full[b]) for b in order]
                loss.backward()
                for h in handles:
                    h.wait()
                self.overlap[key].append(time.perf_counter() - t0)
            for f in self.full:
                f.fill_(1.0)

    def comm(self, n: int, warm: bool) -> None:
        order = self.plan.backward_order
        be = self.backend
        kinds = {
            "t_ar": lambda b: be.all_reduce(self.full[b]),
            "t_rs": lambda b: be.reduce_scatter(self.shards[b], self.full[b]),
            "t_ag": lambda b: be.all_gather(self.full[b], self.shards[b]),
        }
        for key, start in kinds.items():
            for i in range(n + (1 if warm else 0)):
                _barrier(be)
                t0 = time.perf_counter()
                handles = [start(b) for b in order]
                for h in handles:
                    h.wait()
                if i or not warm:
                    self.samples[key].append(time.perf_counter() - t0)
        for f in self.full:  # keep values bounded across repeated all-reduces
            f.fill_(1.0)


def run_rank(cfg: dict) -> dict:
    """Measure the parts and every schedule on this rank; returns raw samples."""
    import dearopt

    rank, world = dearopt.rank(), dearopt.size()
    torch.set_num_threads(cfg["threads"])
    backend = dearopt.backends.get_backend()
    schedules = cfg["schedules"]
    t_start = time.perf_counter()
    from dearopt.bench.report import source

    code = source() if rank == 0 else None  # the commit these processes imported, not the one at the end
    parts = _Parts(cfg, world, backend)
    batches = [parts.workload.make_batch(1000 * rank + i) for i in range(cfg["distinct_batches"])]
    rebuild = cfg.get("rebuild", False)
    profile = None
    if cfg.get("profile"):
        from dearopt.sim import record_profile

        _log(
            rank,
            "recording a profile for dearopt.sim (per-module times, gradient ready times, collective fits, contention)",
        )
        model, wl = parts.workload.model, parts.workload
        x, y = batches[0]
        profiled = (
            model,
            lambda: wl.loss(model(x), y),
            torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9),
        )
        profile = record_profile(
            *profiled,
            link=os.environ.get("DEAROPT_SHAPED_RATE", "unshaped loopback"),
            bucket_bytes=int(cfg["bucket_mb"] * 2**20),
            repeats=PROFILE_REPEATS,
        )
    _log(
        rank,
        f"{parts.workload.describe}; {parts.workload.n_params() / 1e6:.2f} M params, "
        f"{len(parts.plan.buckets)} buckets of <= {cfg['bucket_mb']} MiB; "
        + ("building a model per schedule and round" if rebuild else f"building {len(schedules)} models"),
    )
    runners = {}
    in_process = cfg.get("in_process", False)
    pids: Dict[str, List[int]] = {}  # schedule -> the processes of its own it ran in (one per round: rebuild)

    def runner_for(s, r):
        # Kept for the whole run, or (rebuild: a model per schedule at once does not fit in memory, as
        # BERT-Base x 5 schedules x 2 ranks on 24 GiB) built for each round and dropped after it.
        if s not in runners:
            recorded = s == cfg.get("timeline_schedule") and (not rebuild or r == cfg["rounds"] - 1)
            timeline = cfg.get("timeline") if recorded else None
            if in_process:
                runners[s] = InProcess(s, cfg, timeline, rebuild)
            else:  # as a user runs it: in processes of its own
                from dearopt.backends.launch import free_port
                from dearopt.collectives import broadcast_object

                port = broadcast_object(free_port() if rank == 0 else None, backend=backend)  # its rendezvous
                runners[s] = ScheduleProcess(s, rank, world, port, cfg, backend.timeout, timeline, rebuild)
                pids.setdefault(s, []).append(runners[s].pid)
        return runners[s]

    if not rebuild:
        for s in schedules:
            runner_for(s, 0)
    samples = {s: {"iter": [], "forward": [], "backward": [], "step": []} for s in schedules}
    steal: Dict[str, List[float]] = {s: [] for s in schedules}  # per round: the host CPU the hypervisor took
    faults: Dict[str, List[float]] = {s: [] for s in schedules}  # per round: minor page faults per timed iteration
    cpu: Dict[str, List[float]] = {s: [] for s in schedules}  # per round: this rank's process CPU s per iteration
    main_cpu: Dict[str, List[float]] = {s: [] for s in schedules}  # per round: that of its main thread (compute)
    busy: Dict[str, List[float]] = {s: [] for s in schedules}  # per round: the host's busy share of its CPU
    ddp_compute: Dict[str, Dict[str, List[float]]] = {}  # DDP schedule -> t_ff, t_bp timed in its own processes
    plans = {}  # dearopt schedule -> per round: the buckets all-reduced in backward, the measured choice
    rounds = cfg["rounds"]
    per_round = iterations_per_round(cfg["iterations"], rounds)
    alone: List[List[float]] = []  # per round: the standalone DDP script's iteration times (rank 0)
    for r in range(rounds):
        _log(rank, f"round {r + 1}/{rounds}: parts (t_ff, t_bp, t_ar, t_rs, t_ag)")
        parts.compute(batches, cfg["part_repeats"])
        parts.comm(cfg["comm_repeats"], warm=(r == 0))
        if cfg.get("overlap_repeats"):
            parts.overlapped(batches, cfg["overlap_repeats"])
        ps = parts.samples
        _log(rank, "  so far: " + ", ".join(f"{k} {_median(v):.3f}s" for k, v in ps.items()))
        if profile is not None and r > 0:  # the machine drifts over a run: the profile's compute, timed again
            from dearopt.sim.profile import retime_compute

            profile = retime_compute(profile, *profiled, repeats=PROFILE_REPEATS)
            _log(rank, "  the profile's compute, timed again: " + _profile_compute(profile))
        for s in schedules:
            if s == "ddp" and cfg.get("standalone_ddp"):
                alone.append(_standalone_round(cfg, rank, world, backend, per_round[r]))
            runner = runner_for(s, r)
            _barrier(backend)  # the schedule's processes train while these wait
            # --warmup untimed iterations every round, as the plain DDP script's processes warm up: with one, a
            # process idle since its last round timed DDP 3-8 % slower than the script (2026-11-29, 18:43; 1.1 %
            # with three)
            got = runner.round(cfg["warmup"], per_round[r], r)
            for k, v in got["samples"].items():
                samples[s][k].extend(v)
            steal[s].append(got["steal"])
            faults[s].append(got["faults"])
            cpu[s].append(got["cpu"])
            main_cpu[s].append(got["main_cpu"])
            busy[s].append(got["busy"])
            if got["beyond"]:
                _log(
                    rank,
                    f"  {s:>5}: {got['untimed']} untimed iterations (the plan settled after {got['beyond']} beyond "
                    "--warmup)",
                )
            for line in got["lines"]:
                _log(rank, line)
            if got["plan"] is not None:
                plans.setdefault(s, []).append(got["plan"])
            if profile is not None and base_schedule(s) == "ddp" and not in_process:
                for k, v in runner.compute(PROFILE_REPEATS).items():  # the compute as DDP's processes run it
                    ddp_compute.setdefault(s, {}).setdefault(k, []).extend(v)
            if rebuild:
                runners.pop(s).close()
                del runner
                gc.collect()
            _barrier(backend)
            _log_round(rank, s, samples[s]["iter"], per_round[r], got["period"], got["faults"])
    for runner in runners.values():
        runner.close()
    return {
        "rank": rank,
        "source": code,
        "parts": parts.samples,
        "overlap": parts.overlap,
        "schedules": samples,
        "steal": steal,
        "faults": faults,
        "cpu": cpu,
        "main_cpu": main_cpu,
        "busy": busy,
        "ddp_compute": ddp_compute,
        "buckets": [b.grad_numel * 4 for b in parts.plan.buckets],
        "params": parts.workload.n_params(),
        "describe": parts.workload.describe,
        "batch_size": parts.workload.batch_size,
        "wall_s": time.perf_counter() - t_start,
        "pid": os.getpid(),
        "pids": pids,
        "profile": None if profile is None else profile.to_json(),
        "plans": plans,
        "standalone_ddp_rounds": alone if rank == 0 else [],
    }


def round_report(runner, s: str, r: int, rebuild: bool) -> Tuple[List[str], Optional[dict]]:
    """What a dearopt schedule's round ran, after it (its pending updates settled): the lines the bench logs
    (measured plans, traffic, DeFT's schedule and Preserver, the buckets all-reduced in backward, the tuned
    buffer, Prophet's blocks) and the plan record of results.json (None for DDP), from this rank's optimizer."""
    lines: List[str] = []
    opt = runner.opt
    schedule = getattr(opt, "schedule", None)
    deft = getattr(schedule, "in_force", None)  # DeFT's
    choice = getattr(schedule, "plan_choice", None)
    if choice is not None and choice.history:
        lines.append(
            f"  {s:>5}: measured plans (steps/s): "
            + ", ".join(f"{plan_label(k)} {t:.3f}" for k, t in choice.history)
            + f"; kept {plan_label(choice.current)}"
        )
    traffic = getattr(getattr(opt, "comm_hook", None), "traffic", None)
    if traffic is not None and r == 0:
        lines.append(
            f"  {s:>5}: on the wire (rank 0, last step, elements): {traffic['values']} values into "
            f"all-reduces, {traffic['indices']} indices selected, {traffic['received']} selections "
            f"received; ~{4 * (traffic['values'] + traffic['indices']) / 2**20:.2f} MiB sent"
        )
    if deft is not None and (rebuild or r == 0):  # a new optimizer (and schedule) per round with rebuild
        split = [round(x / 2**20, 2) for x in schedule.repartitions]
        lines.append(
            f"  {s:>5}: DeFT schedule: {deft.updates_per_iteration:.2f} updates per step (every "
            f"bucket), period {len(deft.period)}, {len(opt.plan.buckets)} buckets sent in "
            f"{deft.buckets} pieces"
            + (f" (re-partitioned to {split} MiB)" if split else "")
            + f", summed by {schedule.piece_reduction}"
        )
        if deft.mu is not None:
            lines.append(f"  {s:>5}: second link: mu {deft.mu:.3f} (its time per bucket over the first's)")
        times = schedule.times
        if times is not None:
            lines.append(
                f"  {s:>5}: solved from forward {sum(times['forward']):.3f}s, backward "
                f"{sum(times['backward']):.3f}s of compute and {sum(times['comm']):.3f}s of reductions"
            )
        kept = schedule.preserved
        if kept is not None:
            lines.append(
                f"  {s:>5}: Preserver: ratio {kept.ratio:.4f}, capacities x{kept.capacity_factor:.3g} "
                f"after {kept.resolves} re-solves, {'passed' if kept.passed else 'FAILED'}"
            )
            given = kept.inputs or {}
            lines.append(
                f"  {s:>5}: Preserver's inputs: loss {given.get('loss', math.nan):.4g}, drift "
                f"{given.get('drift', math.nan):.4g} and noise "
                f"{given.get('noise', math.nan):.4g} per step; solves (capacities: updates "
                f"per step, ratio): " + "; ".join(f"x{f:.3g}: {u:.2f}, {q:.4f}" for f, u, q, _ in kept.tried)
            )
    plan = getattr(opt, "plan", None)
    if plan is None:
        return lines, None
    record = {
        "allreduce": list(plan.allreduce),
        "buckets": len(plan.buckets),
        "buffer_size": plan.buffer_size,
        "groups": [list(b.params) for b in plan.buckets],
        "measured": [[_rule(k), t] for k, t in choice.history] if choice is not None else [],
        "kept": _rule(choice.current) if choice is not None else None,
    }
    if deft is not None:  # per round: what the DeFT schedule did (the same on every rank)
        from dearopt.sim.deft import schedule_to_json

        kept = schedule.preserved
        record["deft"] = {
            "schedule": schedule_to_json(deft),
            "partition_size": plan.partition_size,
            "pieces": deft.buckets,
            "updates_per_step": deft.updates_per_iteration,
            "period": len(deft.period),
            "repartitions": schedule.repartitions,
            "reduction": schedule.piece_reduction,
            "times": schedule.times,
            "apply": schedule.apply,
            "preserver": None
            if kept is None
            else {
                "ratio": kept.ratio,
                "factor": kept.capacity_factor,
                "resolves": kept.resolves,
                "passed": kept.passed,
                "tried": [list(t) for t in kept.tried],
                "inputs": dict(kept.inputs or {}),
            },
        }
    if plan.allreduce:
        lines.append(f"  {s:>5}: all-reduces buckets {list(plan.allreduce)} of {len(plan.buckets)} in backward")
    if getattr(opt, "tuning", None) is not None:
        lines.append(f"  {s:>5}: tuned buffer_size {plan.buffer_size / 2**20:.1f} MiB ({len(plan.buckets)} buckets)")
    if base_schedule(s).startswith("prophet"):
        sizes = [b.grad_numel * b.element_size / 2**20 for b in plan.buckets]
        lines.append(f"  {s:>5}: {len(sizes)} blocks from the profile, {min(sizes):.2f}-{max(sizes):.2f} MiB")
    return lines, record


def host_cpu_times() -> Optional[Tuple[int, int, int]]:
    """This host's CPU time since boot over all its CPUs, in clock ticks: (stolen by the hypervisor for other
    guests, all of it, idle); None where the kernel does not say (no ``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)


def steal_share(before: Optional[Tuple[int, ...]], after: Optional[Tuple[int, ...]]) -> float:
    """The share of the host's CPU time between two :func:`host_cpu_times` readings that the hypervisor gave to
    other guests (steal): time the ranks were runnable and could not run, whatever the schedule did.  NaN where
    not known."""
    if before is None or after is None or after[1] <= before[1]:
        return math.nan
    return (after[0] - before[0]) / (after[1] - before[1])


def busy_share(before: Optional[Tuple[int, int, int]], after: Optional[Tuple[int, int, int]]) -> float:
    """The share of the CPU this host had (all of it less the steal) that was busy between two
    :func:`host_cpu_times` readings: near 1 where the ranks, their collectives' threads and the kernel's network
    work kept every core busy, so that no schedule can hide more than the CPU frees.  NaN where not known."""
    if before is None or after is None:
        return math.nan
    total = (after[1] - before[1]) - (after[0] - before[0])
    idle = after[2] - before[2]
    return (total - idle) / total if total > 0 else math.nan


def _profile_compute(profile) -> str:
    """The profile's forward and backward in each timing since it was recorded (their medians over its
    iterations), and over all of them (what the simulator predicts from)."""
    n_seg = len(profile.forward_segments)
    samples, out = profile.compute_samples, []
    for k in range(0, len(samples), PROFILE_REPEATS):
        chunk = samples[k : k + PROFILE_REPEATS]
        ff = _median([sum(s[: n_seg + 1]) for s in chunk])
        out.append(f"{ff:.3f}/{_median([s[n_seg + 1] for s in chunk]):.3f}")
    return f"t_ff/t_bp per timing {', '.join(out)} s; over all: {profile.t_ff:.3f}/{profile.t_bp:.3f} s"


def _log_round(rank: int, s: str, got: List[float], count: int, period: int, faults: float) -> None:
    unit = f"periods of {period} iterations (their mean iterations)" if period > 1 else "iterations"
    _log(
        rank,
        f"  {s:>5}: {len(got)} timed {unit}, median {_median(got):.3f}s "
        f"(this round: {', '.join(f'{v:.3f}' for v in got[-count:]) if count else '-'}); "
        f"{faults:.0f} minor page faults per iteration",
    )


def _standalone_round(cfg: dict, rank: int, world: int, backend, iterations: int) -> List[float]:
    """One round of the plain DDP script (:mod:`dearopt.bench.standalone`) in fresh processes, run by rank 0 right
    before the bench's own DDP round while every rank of the bench waits idle at a barrier; rank 0 returns its
    iteration times (the other ranks an empty list).  Side by side in time, the two rounds see the same machine:
    run before and after the whole bench instead, the script's two medians differed by up to 29 % on this
    2-core machine (3.220 s and 2.504 s, 2026-11-29), more than the 3 % the comparison is asked to resolve."""
    times: List[float] = []
    _barrier(backend)
    if rank == 0:
        from dearopt.bench import standalone

        # within the barrier's own wait, which the other ranks are in meanwhile
        times = standalone.run(dict(cfg, iterations=iterations), world, timeout=max(backend.timeout - 30.0, 30.0))
        _log(rank, f"  standalone DDP script: {len(times)} timed iterations, mean {sum(times) / len(times):.3f}s")
    _barrier(backend)
    return times


def _median(values):
    import statistics

    return statistics.median(values) if values else math.nan
