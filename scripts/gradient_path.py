"""One gradient's path under `dear`, traced: `torchrun --nproc-per-node 2 scripts/gradient_path.py`.

Rank 0 traces one steady-state iteration (forward, backward, step) with sys.setprofile and reports, per phase:
the dearopt files entered (with call counts), the moves between files, and every call back up: a call into a
method of an object that is already `self` in a caller frame further up the stack (not the immediate chain of
that same object's own methods).  docs/architecture.md ("One gradient's path") reads its output.
"""

import collections
import os
import sys

import torch

import dearopt

ROOT = os.path.dirname(dearopt.__file__) + os.sep
PHASE = ["setup"]
entered = collections.defaultdict(collections.Counter)  # phase -> file -> calls
moves = collections.defaultdict(collections.Counter)  # phase -> (from, to) -> count
upcalls = collections.defaultdict(collections.Counter)
stack = []  # (file, self id) per Python frame we saw entered (dearopt or not)


def rel(path):
    return path[len(ROOT) :] if path.startswith(ROOT) else None


def prof(frame, event, arg):
    if event == "call":
        f = rel(frame.f_code.co_filename)
        me = frame.f_locals.get("self") if frame.f_code.co_argcount else None
        sid = id(me) if me is not None else None
        if f is not None:
            entered[PHASE[0]][f] += 1
            prev = next((s for s in reversed(stack) if s[0] is not None), None)
            if prev is not None and prev[0] != f:
                moves[PHASE[0]][(prev[0], f)] += 1
            # a call back up: this object is `self` further up, beyond the frames of its own run of calls
            if sid is not None and stack:
                i = len(stack) - 1
                while i >= 0 and stack[i][1] == sid:
                    i -= 1
                if any(s[1] == sid for s in stack[: i + 1]):
                    chain = " > ".join(f"{s[0]}:{s[2]}" for s in stack[-6:])
                    upcalls[PHASE[0]][f"{f}:{type(me).__name__}.{frame.f_code.co_name} (from {chain})"] += 1
        stack.append((f, sid, frame.f_code.co_name))
    elif event == "return":
        if stack:
            stack.pop()


def main():
    dearopt.init()
    rank = dearopt.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )
    opt = dearopt.DistOptim(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model, schedule=dearopt.DeAR(allreduce=0), buffer_size=4096 * 4
    )
    g = torch.Generator().manual_seed(rank)

    def iteration(trace):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        if trace:
            sys.setprofile(prof)
        PHASE[0] = "forward"
        loss = torch.nn.functional.mse_loss(model(x), y)
        PHASE[0] = "backward"
        loss.backward()
        PHASE[0] = "step"
        opt.step()
        PHASE[0] = "zero_grad"
        opt.zero_grad()
        if trace:
            sys.setprofile(None)

    for _ in range(8):
        iteration(False)
    iteration(rank == 0)
    opt.synchronize()
    if rank == 0:
        print("buckets:", len(opt.plan.buckets))
        total = collections.Counter()
        for phase in ("forward", "backward", "step", "zero_grad"):
            print(f"== {phase}: {sum(entered[phase].values())} calls in dearopt")
            for f, n in entered[phase].most_common():
                print(f"   {n:5d}  {f}")
                total[f] += n
            print("   moves between files:", sum(moves[phase].values()))
            for (a, b), n in sorted(moves[phase].items()):
                print(f"      {a} -> {b}: {n}")
            for k, n in upcalls[phase].items():
                print(f"   CALL BACK UP: {k} x{n}")
        print("files entered:", len(total), sorted(total))
    dearopt.shutdown()


if __name__ == "__main__":
    main()
