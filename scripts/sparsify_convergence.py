"""DEFT sparsification against dense training: digits and a small language model (issue 18's convergence check).

    python scripts/sparsify_convergence.py [--task digits|lm|both] [--epochs 8] [--lm-steps 600]
                                           [--optimizer adam|sgd] [--warmup STEPS] [--out bench-out/sparsify]

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

    if args.optimizer == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=lr * 50, momentum=0.9)
    hook = None if RUNS[name] is None else dearopt.Sparsify(RUNS[name][1], selection=RUNS[name][0],
                                                            warmup_steps=args.warmup)
    return dearopt.DistOptim(inner, model, schedule="dear", comm_hook=hook)


def _rank_digits(args) -> dict:
    import torch
    from torch import nn

    import dearopt
    from deft_convergence import _digits, _digits_model

    rank, world = dearopt.rank(), dearopt.size()
    x_train, y_train, x_test, y_test = _digits()
    x_train, y_train = x_train[rank::world], y_train[rank::world]
    batch, out = 32, {}
    for name in RUNS:
        model = _digits_model()
        opt = _optimizer(name, model, args, 2e-3)
        accuracy = []
        for epoch in range(args.epochs):
            model.train()
            perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
            for start in range(0, len(perm) - batch + 1, batch):
                idx = perm[start:start + batch]
                opt.zero_grad()
                nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                accuracy.append(100 * (model(x_test).argmax(1) == y_test).float().mean().item())
        out[name] = {"accuracy": accuracy, "traffic": opt.sparse_traffic}
        opt.close()
    return out


def _rank_lm(args) -> dict:
    import torch
    from torch import nn

    import dearopt
    from deft_convergence import EVAL_EVERY, LM_BATCH, SEQ, _CharLM, _text

    rank, world = dearopt.rank(), dearopt.size()
    train, held_out, vocab = _text()
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(held_out) - SEQ - 1, (64,), generator=g)
    eval_x = torch.stack([held_out[s:s + SEQ] for s in starts])
    eval_y = torch.stack([held_out[s + 1:s + SEQ + 1] for s in starts])
    out = {}
    for name in ("dense", "deft-10%", "deft-1%"):
        model = _CharLM(vocab)
        opt = _optimizer(name, model, args, 3e-3)
        curve = []
        for step in range(args.lm_steps):
            picks = torch.randint(0, len(train) - SEQ - 1, (LM_BATCH * world,),
                                  generator=torch.Generator().manual_seed(100 + step))[rank::world]
            x = torch.stack([train[s:s + SEQ] for s in picks])
            y = torch.stack([train[s + 1:s + SEQ + 1] for s in picks])
            model.train()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()
            opt.step()
            if (step + 1) % EVAL_EVERY == 0:
                opt.synchronize()
                model.eval()
                with torch.no_grad():
                    held = nn.functional.cross_entropy(model(eval_x).reshape(-1, vocab), eval_y.reshape(-1))
                curve.append(round(float(held), 4))
        out[name] = {"held_out_loss": curve, "traffic": opt.sparse_traffic}
        opt.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("digits", "lm", "both"), default="both")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lm-steps", type=int, default=600)
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--warmup", type=int, default=0, help="dense steps first (Sparsify(warmup_steps=...))")
    ap.add_argument("--out", default="bench-out/sparsify")
    args = ap.parse_args()
    from dearopt.bench.spawn import spawn

    os.makedirs(args.out, exist_ok=True)
    if args.task in ("digits", "both"):
        result = spawn(_rank_digits, 2, args)[0]
        print(f"digits: test accuracy [%] after each epoch, 2 ranks, CNN, {args.optimizer}")
        for name, r in result.items():
            print(f"{name:>9}: {' '.join(f'{a:5.1f}' for a in r['accuracy'])}   wire (rank 0, last step): "
                  f"{r['traffic']}")
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
