"""The sharded update against its peers, side by side in one run (issue 19).

    python scripts/sharded_bench.py [--model bert] [--rate 3gbit] [--rounds 2] [--steps 5]
                                    [--schedules ddp,dear,dear-sharded,fsdp2,zero] [--out bench-out/sharded]

Two ranks train the same model with AdamW under each schedule in turn, in the same processes:

* ``ddp``: torch DDP (25 MB buckets), AdamW on every rank;
* ``dear``: ``DistOptim`` with its defaults; ``dear-paper``: DeAR as in the paper (``allreduce=0``);
* ``dear-sharded``: ``DistOptim(..., shard_optimizer=True)``;
* ``fsdp2``: ``fully_shard`` on every transformer layer (or ResNet stage) and the root,
  ``reshard_after_forward=False`` (ZeRO-2-like: parameters stay gathered after forward);
* ``zero``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1).

One model is alive at a time (six BERT-Base models with AdamW state do not fit in 24 GiB next to each other):
each round builds it from the same seed, runs untimed iterations until its plan has settled, then ``--steps``
timed iterations (the slower rank's time per iteration), and measures the optimizer state this rank holds
(bytes of the tensors in the optimizer's state, local shards for DTensors).  Rounds interleave the
schedules.  With ``--rate`` (root) the run happens inside a network namespace whose loopback is shaped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dearopt.bench.netns import rerun_shaped  # noqa: E402

SCHEDULES = ("ddp", "dear", "dear-paper", "dear-sharded", "fsdp2", "zero")


def _state_bytes(optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` held by this rank (a DTensor counts its local shard)."""
    import torch

    total = 0
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _build(schedule: str, args):
    """(forward module, optimizer whose state to measure, step function's optimizer, DistOptim or None)."""
    import torch
    import dearopt
    from dearopt.bench.models import build

    work = build(args.model, args.batch_size, args.size, seed=0)
    model = work.model
    lr = dict(lr=1e-4, weight_decay=0.01)
    if schedule in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model, bucket_cap_mb=25)
        if schedule == "ddp":
            opt = torch.optim.AdamW(model.parameters(), **lr)
            return work, module, opt, opt, None
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **lr)
        return work, module, opt, opt.optim, None
    if schedule == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        units = (
            list(model.layers)
            if hasattr(model, "layers")
            else [m for m in (getattr(model, f"layer{i}", None) for i in range(1, 5)) if m is not None]
        )
        for unit in units:
            fully_shard(unit, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), **lr)
        return work, model, opt, opt, None
    knobs = {"dear": {}, "dear-paper": {"allreduce": 0.0}, "dear-sharded": {"shard_optimizer": True}}[schedule]
    opt = dearopt.DistOptim(torch.optim.AdamW(model.parameters(), **lr), model, **knobs)
    return work, model, opt, opt, opt


def _rank(args) -> dict:
    import torch
    import dearopt

    rank = dearopt.rank()
    backend = dearopt.backends.runtime.get_backend()
    schedules = args.schedules.split(",")
    times = {s: [] for s in schedules}
    state = {s: 0 for s in schedules}
    untimed = {s: [] for s in schedules}
    for r in range(args.rounds):
        for schedule in schedules:
            work, module, opt, holder, ours = _build(schedule, args)
            x, y = work.make_batch(1000 * rank + r)

            def iteration():
                t0 = time.perf_counter()
                opt.zero_grad()
                work.loss(module(x), y).backward()
                opt.step()
                return time.perf_counter() - t0

            i = 0
            while i < args.warmup or (ours is not None and not ours.settled):
                iteration()
                i += 1
            if ours is not None and i > args.warmup:
                iteration()  # the last re-plan applied every pending update: one more to reach the steady state
                i += 1
            untimed[schedule].append(i)
            mine = [iteration() for _ in range(args.steps)]
            if ours is not None:
                ours.synchronize()  # the last gathers finish before the next schedule's block
            slowest = torch.tensor(mine, dtype=torch.float64)
            backend.all_reduce(slowest, "max").wait()
            times[schedule] += slowest.tolist()
            state[schedule] = max(state[schedule], _state_bytes(holder))
            if rank == 0:
                print(
                    f"[{time.strftime('%H:%M:%S')}] round {r} {schedule:>12}: {i} untimed, median "
                    f"{statistics.median(slowest.tolist()):.3f} s, optimizer state {state[schedule] / 2**20:.1f} "
                    f"MiB on rank 0",
                    flush=True,
                )
            if ours is not None:
                ours.close()
            # one model alive at a time (None, not del: the closure iteration() above names these)
            work = module = opt = holder = ours = None
            gc.collect()
    everyone = torch.tensor([state[s] for s in schedules], dtype=torch.float64)
    backend.all_reduce(everyone, "max").wait()
    return {"times": times, "state_bytes_max_rank": dict(zip(schedules, everyone.tolist())), "untimed": untimed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert", choices=("bert", "resnet50", "tiny"))
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--rate", default=None, help="shape the link (e.g. 3gbit; needs root)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--out", default="bench-out/sharded")
    args = ap.parse_args()
    unknown = set(args.schedules.split(",")) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; expected some of {SCHEDULES}")
    code = rerun_shaped(args.rate)
    if code is not None:
        return code
    from dearopt.bench.spawn import spawn

    result = spawn(_rank, 2, args)[0]
    schedules = args.schedules.split(",")
    medians = {s: statistics.median(result["times"][s]) for s in schedules}
    base = medians.get("ddp")
    dear = medians.get("dear")
    print(
        f"\n{args.model}, AdamW, 2 ranks, link {args.rate or 'unshaped'}; {args.rounds} rounds x {args.steps} "
        f"timed iterations (slower rank per iteration, median)"
    )
    print("| schedule | iter [s] | vs DDP | vs dear | optimizer state / rank [MiB] |")
    print("|---|---:|---:|---:|---:|")
    for s in schedules:
        vs_ddp = f"{base / medians[s]:.3f}x" if base else "-"
        vs_dear = f"{dear / medians[s]:.3f}x" if dear else "-"
        print(f"| {s} | {medians[s]:.3f} | {vs_ddp} | {vs_dear} | {result['state_bytes_max_rank'][s] / 2**20:.1f} |")
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.model}-{args.rate or 'unshaped'}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"args": vars(args), "result": result, "medians": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
