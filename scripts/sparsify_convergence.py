"""DEFT sparsification against dense training: digits and a small language model (issue 18's convergence check).

    python scripts/sparsify_convergence.py [--task digits|lm|both] [--epochs 8] [--lm-steps 600]
                                           [--optimizer adam|sgd|sgd-dgc] [--warmup STEPS]
                                           [--out bench-out/sparsify]

Two local ranks train the models of scripts/deft_convergence.py (the digits CNN; the character GRU on Python's
own sources) under ``dear``, densely and with ``comm_hook=dearopt.Sparsify(density)``: DEFT at 10 % and 1 %,
and the plain top-k baseline at 1 % (every rank's selection all-gathered).  Printed: test accuracy after every
epoch (digits) or held-out loss every 50 steps (lm), and the elements this rank put on the wire in the last
step (values, selected indices, selections received).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

RUNS = {"dense": None, "deft-10%": ("deft", 0.10), "deft-1%": ("deft", 0.01), "topk-1%": ("topk", 0.01)}


def _optimizer(name, model, args, lr):
    import torch

    import dearopt

    dgc = args.optimizer == "sgd-dgc" and RUNS[name] is not None  # the momentum moves into the compressor
    if args.optimizer == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=lr * 50, momentum=0.0 if dgc else 0.9)
    hook = (
        None
        if RUNS[name] is None
        else dearopt.Sparsify(
            RUNS[name][1], selection=RUNS[name][0], warmup_steps=args.warmup, momentum=0.9 if dgc else 0.0
        )
    )
    return dearopt.DistOptim(inner, model, schedule="dear", comm_hook=hook)


def _rank_digits(args) -> dict:
    import dearopt
    from convergence_tasks import train_digits

    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for name in RUNS:
        accuracy, _, opt = train_digits(lambda model: _optimizer(name, model, args, 2e-3), args.epochs, rank, world)
        out[name] = {"accuracy": accuracy, "traffic": getattr(opt.comm_hook, "traffic", None)}
        opt.close()
    return out


def _rank_lm(args) -> dict:
    import dearopt
    from convergence_tasks import train_lm

    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for name in ("dense", "deft-10%", "deft-1%"):
        curve, opt = train_lm(lambda model: _optimizer(name, model, args, 3e-3), args.lm_steps, rank, world)
        out[name] = {"held_out_loss": curve, "traffic": getattr(opt.comm_hook, "traffic", None)}
        opt.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("digits", "lm", "both"), default="both")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lm-steps", type=int, default=600)
    ap.add_argument(
        "--optimizer",
        choices=("adam", "sgd", "sgd-dgc"),
        default="adam",
        help="sgd-dgc: SGD whose momentum 0.9 is applied by Sparsify(momentum=0.9) before the selection "
        "(DGC's momentum correction) in the sparse runs, by SGD in the dense one",
    )
    ap.add_argument("--warmup", type=int, default=0, help="dense steps first (Sparsify(warmup_steps=...))")
    ap.add_argument("--out", default="bench-out/sparsify")
    args = ap.parse_args()
    from dearopt.bench.spawn import spawn

    os.makedirs(args.out, exist_ok=True)
    if args.task in ("digits", "both"):
        result = spawn(_rank_digits, 2, args)[0]
        print(f"digits: test accuracy [%] after each epoch, 2 ranks, CNN, {args.optimizer}")
        for name, r in result.items():
            print(
                f"{name:>9}: {' '.join(f'{a:5.1f}' for a in r['accuracy'])}   wire (rank 0, last step): {r['traffic']}"
            )
        with open(os.path.join(args.out, f"digits_{args.optimizer}_e{args.epochs}_w{args.warmup}.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.task in ("lm", "both"):
        result = spawn(_rank_lm, 2, args)[0]
        print(f"lm: held-out loss every 50 steps, 2 ranks, character GRU, {args.optimizer}")
        for name, r in result.items():
            print(f"{name:>9}: {' '.join(f'{v:6.3f}' for v in r['held_out_loss'])}   wire: {r['traffic']}")
        with open(os.path.join(args.out, f"lm_{args.optimizer}_w{args.warmup}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
