"""DeFT's delayed updates against exact training: digits and a small language model (issue 16's convergence check).

    python scripts/deft_convergence.py [--task digits|lm|both] [--epochs 8] [--lm-steps 400] [--seeds 1]
                                       [--schedules dear,deft-late,deft-merged,deft-preserved,deft-progress]
                                       [--out bench-out/deft]

Two local ranks train, under each of:

* ``dear``: exact (equal to one process on the global batch);
* ``deft-late`` (digits only): the schedule the solver makes where computation hides all communication (2 s
  of backward, 1 s of forward and 0.5 s on the link per bucket): every step's gradients applied one step late;
* ``deft-merged``: the schedule it makes where communication exceeds computation (2.5 s on the link per
  1 + 1 s of compute per bucket): steps held and merged, fewer updates; given, so the Preserver is off;
* ``deft-preserved``: the same per-bucket times, given as a profile, with the paper's Preserver test
  (``Preserver(statistic="loss")``): the first three steps are exact and measure the loss
  (``optimizer.step(loss=loss)``), the drift and the noise; the Preserver raises the knapsack capacities until
  its check passes (the expected losses after one period within 1 %);
* ``deft-progress``: the same with the default Preserver (``statistic="progress"``): the expected loss decrease
  over one period at least 99 % of exact training's.

Each ``deft-*`` applies a bucket's sum as soon as all of it is sent (``DeFT(apply="bucket")``, the default); the
same name with ``-group`` appended (``deft-late-group``...) applies each group at once, the paper's way.

The tasks: digits, examples/digits_dearopt.py's CNN (Adam 2e-3, 32 samples per rank and step, test accuracy
after each epoch); ``lm``, a character-level GRU language model on a fixed text (Python 3.11's own
``argparse.py``, ``textwrap.py`` and ``string.py``, so nothing is downloaded; Adam 3e-3, 16 sequences of 64
characters per rank and step, held-out loss every 50 steps).  These models compute far too little per step for
this machine's links (every measured all-reduce outlasts a whole forward), so the per-bucket times are fixed
(one bucket per parameter); what is measured is what the delays, and the Preserver, do to training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def fixed_profile(model, world: int, forward: float, backward: float, comm: float):
    """A :class:`dearopt.sim.Profile` that gives every bucket (one per parameter, ``buffer_size=1``) these
    forward, backward and all-reduce seconds: what ``deft_times`` reads."""
    from dearopt.planning.plan import ParamSpec
    from dearopt.sim.cost import CommCost
    from dearopt.sim.profile import Profile

    params = [p for p in model.parameters() if p.requires_grad]
    n = len(params)
    steps = CommCost("all_reduce", 1.0, 0.0).time(0, world)  # latency steps of one all-reduce on `world` ranks
    return Profile(
        params=[
            ParamSpec(f"p{i}", p.numel(), str(p.dtype).replace("torch.", ""), p.element_size())
            for i, p in enumerate(params)
        ],
        forward_segments=[([i], forward) for i in range(n)],
        forward_tail=0.0,
        ready=[(n - i) * backward for i in range(n)],
        t_bp=n * backward,
        update_per_element=0.0,
        update_per_call=0.0,
        comm={"all_reduce": CommCost("all_reduce", comm / steps, 0.0)},
        comm_samples={},
        contention={},
        world=world,
    )


def _optimizer(name, model, world, lr):
    """The DistOptim (Adam at ``lr``) for one of the runs (one bucket per parameter)."""
    import torch

    import dearopt
    from dearopt.schedules.deft.schedule import Preserver, deft_schedule

    n_params = len(list(model.parameters()))
    inner = torch.optim.Adam(model.parameters(), lr=lr)
    knobs = {}  # the DeFT schedule object's
    if name.endswith("-group"):
        name, knobs["apply"] = name[: -len("-group")], "group"
    if name == "deft-late":
        knobs["given"] = deft_schedule([1.0] * n_params, [2.0] * n_params, [0.5] * n_params)
    elif name == "deft-merged":
        knobs["given"] = deft_schedule([1.0] * n_params, [1.0] * n_params, [2.5] * n_params)
    elif name in ("deft-preserved", "deft-progress"):
        knobs["profile"] = fixed_profile(model, world, 1.0, 1.0, 2.5)
        knobs["preserver"] = Preserver(statistic="progress" if name == "deft-progress" else "loss")
    schedule = dearopt.DeFT(**knobs) if name.startswith("deft") else "dear"
    return dearopt.DistOptim(inner, model, schedule=schedule, buffer_size=1)


def _summary(opt, steps) -> dict:
    delayed = opt.schedule  # DeFT's figures; None on the exact schedules
    schedule, kept = getattr(delayed, "in_force", None), getattr(delayed, "preserved", None)
    applied = getattr(delayed, "applied_steps", None)
    out = {
        "steps": steps,
        "updates": len(applied) if applied is not None else steps,
        "updates_per_step": schedule.updates_per_iteration if schedule is not None else 1.0,
        "period": len(schedule.period) if schedule is not None else 1,
    }
    if kept is not None:
        out["preserver"] = {
            "ratio": kept.ratio,
            "capacity_factor": kept.capacity_factor,
            "resolves": kept.resolves,
            "passed": kept.passed,
        }
    return out


def _rank_digits(args) -> dict:
    import dearopt
    from convergence_tasks import train_digits

    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for name in args.schedules:
        runs = []
        for seed in range(args.seeds):
            test_loss = []
            accuracy, steps, opt = train_digits(
                lambda model: _optimizer(name, model, world, 2e-3),
                args.epochs,
                rank,
                world,
                seed=seed,
                test_loss=test_loss,
            )
            runs.append({"seed": seed, "accuracy": accuracy, "test_loss": test_loss, **_summary(opt, steps)})
            opt.close()
        out[name] = runs
    return out


def _rank_lm(args) -> dict:
    import dearopt
    from convergence_tasks import train_lm

    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for name in [s for s in args.schedules if not s.startswith("deft-late")]:
        curve, opt = train_lm(lambda model: _optimizer(name, model, world, 3e-3), args.lm_steps, rank, world)
        out[name] = {"held_out_loss": curve, **_summary(opt, args.lm_steps)}
        opt.close()
    return out


def _describe(name, r) -> str:
    text = f"({r['updates']} updates in {r['steps']} steps; {r['updates_per_step']:.2f} per step, period {r['period']}"
    if "preserver" in r:
        k = r["preserver"]
        text += (
            f"; Preserver: ratio {k['ratio']:.4f}, capacities x{k['capacity_factor']:.3g} after "
            f"{k['resolves']} re-solves, {'passed' if k['passed'] else 'FAILED'}"
        )
    return text + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("digits", "lm", "both"), default="both")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lm-steps", type=int, default=400)
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="digits: runs per schedule, seeds 0..N-1 (initial weights and sample order)",
    )
    ap.add_argument(
        "--schedules",
        default="dear,deft-late,deft-merged,deft-preserved",
        help="which of dear, deft-late (digits only), deft-merged, deft-preserved, deft-progress "
        "(each deft-* also with -group: the whole group applied at once)",
    )
    ap.add_argument("--out", default="bench-out/deft")
    args = ap.parse_args()
    args.schedules = [name.strip() for name in args.schedules.split(",") if name.strip()]
    known = {"deft-late", "deft-merged", "deft-preserved", "deft-progress"}
    unknown = sorted({s for s in args.schedules if s != "dear" and s.removesuffix("-group") not in known})
    if unknown:
        ap.error(f"unknown schedules {unknown}")
    from dearopt.bench.spawn import spawn

    os.makedirs(args.out, exist_ok=True)
    if args.task in ("digits", "both"):
        result = spawn(_rank_digits, 2, args)[0]
        print(f"digits: test accuracy [%] after each epoch (mean of {args.seeds} seeds), 2 ranks, CNN, Adam")
        for name, runs in result.items():
            mean = [sum(r["accuracy"][e] for r in runs) / len(runs) for e in range(args.epochs)]
            finals = [r["accuracy"][-1] for r in runs]
            losses = [r["test_loss"][-1] for r in runs]
            print(
                f"{name:>15}: {' '.join(f'{a:5.1f}' for a in mean)}   final {min(finals):.1f}-{max(finals):.1f}, "
                f"test loss {sum(losses) / len(losses):.4f} ({min(losses):.4f}-{max(losses):.4f})   "
                f"{'; '.join(sorted(set(_describe(name, r) for r in runs)))}"
            )
        with open(os.path.join(args.out, "convergence.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.task in ("lm", "both"):
        result = spawn(_rank_lm, 2, args)[0]
        print("lm: held-out loss every 50 steps, 2 ranks, character GRU, Adam")
        for name, r in result.items():
            print(f"{name:>15}: {' '.join(f'{v:6.3f}' for v in r['held_out_loss'])}   {_describe(name, r)}")
        with open(os.path.join(args.out, "convergence_lm.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
