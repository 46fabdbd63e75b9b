"""DeFT's delayed updates against exact training, on scikit-learn's digits (issue 16's convergence check).

    python scripts/deft_convergence.py [--epochs 8] [--out bench-out/deft]

Two local ranks train examples/digits_dearopt.py's CNN (Adam, 2e-3, 32 samples per rank and step) under:

* ``dear``: exact (equal to one process on the global batch);
* ``deft-late``: the schedule the solver makes where computation hides all communication (2 s of backward,
  1 s of forward and 0.5 s on the link per bucket): every step's gradients applied one step late;
* ``deft-merged``: the schedule it makes where communication exceeds computation (2.5 s on the link per
  1 + 1 s of compute per bucket): every second step's gradients are held and merged, half the updates.

The digits CNN computes far too little per step for this machine's links (DeFT's partition constraint
refuses a schedule measured on the job: every all-reduce outlasts a whole forward), so the schedules are
given, solved from those per-bucket times; what is measured is what the delays do to training.

Printed: test accuracy after every epoch for each, the updates applied and the update frequency.  No
Preserver is built yet, so nothing here raises the capacity when accuracy falls behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _data():
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[order[:1400]], y[order[:1400]], x[order[1400:]], y[order[1400:]]


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def _rank(args) -> dict:
    import torch
    from torch import nn

    import dearopt
    from dearopt.schedules.deft import deft_schedule

    rank, world = dearopt.rank(), dearopt.size()
    x_train, y_train, x_test, y_test = _data()
    x_train, y_train = x_train[rank::world], y_train[rank::world]
    batch = 32
    out = {}
    for name in ("dear", "deft-late", "deft-merged"):
        model = _model()
        inner = torch.optim.Adam(model.parameters(), lr=2e-3)
        kwargs = {}
        n = len(list(model.parameters()))  # buffer_size=1: one bucket per parameter
        if name == "deft-late":
            kwargs["deft_schedule"] = deft_schedule([1.0] * n, [2.0] * n, [0.5] * n)
        elif name == "deft-merged":
            kwargs["deft_schedule"] = deft_schedule([1.0] * n, [1.0] * n, [2.5] * n)
        opt = dearopt.DistOptim(inner, model, schedule="deft" if name.startswith("deft") else "dear",
                                buffer_size=1, **kwargs)
        accuracy = []
        steps = 0
        for epoch in range(args.epochs):
            model.train()
            perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
            for start in range(0, len(perm) - batch + 1, batch):
                idx = perm[start:start + batch]
                opt.zero_grad()
                nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                opt.step()
                steps += 1
            model.eval()
            with torch.no_grad():
                accuracy.append(100 * (model(x_test).argmax(1) == y_test).float().mean().item())
        schedule = opt.deft_schedule
        out[name] = {"accuracy": accuracy, "steps": steps, "updates": len(opt.applied_steps),
                     "updates_per_step": schedule.updates_per_iteration if schedule is not None else 1.0,
                     "period": len(schedule.period) if schedule is not None else 1}
        opt.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--out", default="bench-out/deft")
    args = ap.parse_args()
    from dearopt.bench.spawn import spawn

    result = spawn(_rank, 2, args)[0]
    print("test accuracy [%] after each epoch, 2 ranks, digits CNN, Adam")
    for name, r in result.items():
        curve = " ".join(f"{a:5.1f}" for a in r["accuracy"])
        print(f"{name:>12}: {curve}   ({r['updates']} updates in {r['steps']} steps; "
              f"{r['updates_per_step']:.2f} per step, period {r['period']})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
