"""How long the training loop stalls per checkpoint (issue 45): DCP save, DCP async save, torch.save on rank 0.

    nice python scripts/checkpoint_stall.py [--configs sharded,unsharded] [--rounds 3] [--layers 12]
                                            [--seq 32] [--batch 2] [--dir /tmp/dearopt-stall]

Two gloo ranks on CPU train BERT-Base (``transformers.BertForMaskedLM(BertConfig())``: 12 layers, hidden 768,
110 M parameters, built locally from the default config, nothing downloaded) with AdamW through
``dearopt.DistOptim`` (``shard_optimizer=True`` for ``sharded``, the defaults for ``unsharded``), one model
alive at a time.  After untimed steps until the plan has settled, each round takes every method in turn, in the
same processes (after one untimed DCP save, which makes DCP's process group):

* ``dcp``: ``dearopt.checkpoint.save(path, model, optimizer)``: every rank writes its part (its shard of the
  optimizer state under ``sharded``; the model's tensors are dealt between the ranks by DCP);
* ``dcp-async``: the same with ``async_=True``: the loop waits for the copy into host memory only; the write goes
  on in a thread while training continues;
* ``torch.save``: ``optimizer.state_dict()`` (under ``sharded`` a gather of the whole state onto every rank)
  and ``model.state_dict()``, written by rank 0 with ``torch.save``; the other ranks wait for it (their next
  step's collectives would).

The stall is the wall time from the end of the step before the checkpoint until the loop may start the next
step, the slower rank's.  For ``dcp-async`` the table also gives when the write had finished (from the call) and
how much longer the steps taken meanwhile were than the median step.  The checkpoint directory is removed after
each save (the page cache still holds it: the write is to memory as much as to the disk).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

METHODS = ("dcp", "dcp-async", "torch.save")


def _slowest(seconds: float) -> float:
    import torch
    import dearopt

    t = torch.tensor([seconds], dtype=torch.float64)
    dearopt.backends.get_backend().all_reduce(t, "max").wait()
    return float(t)


def _build(args, sharded: bool):
    import torch
    import dearopt
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=args.layers)
    model = BertForMaskedLM(config)
    model.train()
    opt = dearopt.DistOptim(
        torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01), model, shard_optimizer=sharded
    )
    g = torch.Generator().manual_seed(dearopt.rank())
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    return model, opt, ids


def _rank(args) -> dict:
    import faulthandler
    import signal

    import torch
    import dearopt
    import dearopt.checkpoint as ckpt

    rank = dearopt.rank()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <rank>: every thread's stack on stderr
    out = {}
    for config in args.configs.split(","):
        model, opt, ids = _build(args, config == "sharded")

        def step():
            t0 = time.perf_counter()
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            return time.perf_counter() - t0

        n = 0
        while n < 2 or not opt.settled:
            step()
            n += 1
        step()
        steps = [_slowest(step()) for _ in range(2)]
        warm = os.path.join(args.dir, f"{config}-warm-up")
        ckpt.save(warm, model, opt)  # untimed: DCP's first save makes its process group and imports its pieces
        dearopt.backends.get_backend().all_reduce(torch.zeros(1), "sum").wait()
        if rank == 0:
            shutil.rmtree(warm, ignore_errors=True)
        rows = {m: [] for m in METHODS}
        for r in range(args.rounds):
            for method in METHODS:
                path = os.path.join(args.dir, f"{config}-{method}-{r}")
                opt.synchronize()
                t0 = time.perf_counter()
                pending = None
                if method == "dcp":
                    ckpt.save(path, model, opt)
                elif method == "dcp-async":
                    pending = ckpt.save(path, model, opt, async_=True)
                else:
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                    if rank == 0:
                        os.makedirs(path, exist_ok=True)
                        torch.save(state, os.path.join(path, "checkpoint.pt"))
                    del state
                    dearopt.backends.get_backend().all_reduce(torch.zeros(1), "sum").wait()  # others wait for rank 0
                stall = _slowest(time.perf_counter() - t0)
                row = {"stall": stall}
                if pending is not None:
                    during = []
                    # the ranks agree on each step (a rank whose write is done still steps with the others)
                    while _slowest(0.0 if pending.done() else 1.0) > 0 and len(during) < 20:
                        during.append(step())
                    pending.result(timeout=600)
                    row["written_after"] = _slowest(time.perf_counter() - t0)
                    row["steps_during"] = len(during)
                    row["slowdown"] = _slowest(sum(during) - len(during) * statistics.median(steps))
                else:
                    steps.append(_slowest(step()))
                rows[method].append(row)
                dearopt.backends.get_backend().all_reduce(torch.zeros(1), "sum").wait()
                if rank == 0:
                    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)
                    row["bytes"] = size
                    print(
                        f"[{time.strftime('%H:%M:%S')}] {config} round {r} {method:>10}: stall {stall:.2f} s"
                        + (
                            f", written after {row['written_after']:.2f} s ({row['steps_during']} steps, "
                            f"{row['slowdown']:+.2f} s)"
                            if pending is not None
                            else ""
                        )
                        + f", {size / 2**20:.0f} MiB",
                        flush=True,
                    )
                    shutil.rmtree(path, ignore_errors=True)
                dearopt.backends.get_backend().all_reduce(torch.zeros(1), "sum").wait()
        state_bytes = sum(
            v.numel() * v.element_size() for e in opt.state.values() for v in e.values() if isinstance(v, torch.Tensor)
        )
        out[config] = {"rows": rows, "step": statistics.median(steps), "state_bytes_rank": state_bytes}
        opt.close()
        model = opt = None  # freed (a closure above names them)
        gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="sharded,unsharded")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dearopt-stall")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    from dearopt.bench.spawn import spawn

    result = spawn(_rank, 2, args, timeout=3600)[0]
    print(
        f"\nBERT-Base ({args.layers} layers), AdamW, 2 gloo ranks on CPU, batch {args.batch} x {args.seq} tokens "
        f"per rank; {args.rounds} rounds; the slower rank's seconds (median over rounds)"
    )
    print(
        "| optimizer | step [s] | method | stall [s] | written after [s] | steps during write, extra time [s] |"
        " checkpoint [MiB] |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for config, got in result.items():
        for method in METHODS:
            rows = got["rows"][method]
            stall = statistics.median(r["stall"] for r in rows)
            written = (
                f"{statistics.median(r['written_after'] for r in rows):.2f}" if "written_after" in rows[0] else "-"
            )
            during = (
                f"{statistics.median(r['steps_during'] for r in rows):g}, "
                f"{statistics.median(r['slowdown'] for r in rows):+.2f}"
                if "slowdown" in rows[0]
                else "-"
            )
            size = statistics.median(r.get("bytes", 0) for r in rows) / 2**20
            print(f"| {config} | {got['step']:.2f} | {method} | {stall:.2f} | {written} | {during} | {size:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
