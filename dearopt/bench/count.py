"""The host's work per training step, counted: Python calls and operator dispatches above plain torch.

Times of host work on a shared 2-core machine are noise; counts are not.  Each configuration trains its own copy of a
BERT-shaped model (BERT-Base's layout and tensor count, hidden size 64, so that the arithmetic is small) with AdamW
(``foreach=True``) in fresh processes, warms up until the plan has settled (at least ``--warmup`` steps), and then
counts, per step (the mean over ``--steps``, 20 by default: one whole period of the link monitor, whose checks
measure 3 steps in every 20 under ``prophet``) and on rank 0:

* **Python calls**: every Python function entered (``sys.setprofile``'s ``call`` events, a generator counted at its
  first entry, not at every resumption), on every thread the
  process started after the counting was set up (a helper thread's Python is the host's work too);
* **operator dispatches**: the aten operators called from outside another operator (``torch.profiler``), on every
  thread.

Plain torch (no communication) is the floor; ``ddp`` is torch's DDP (``gradient_as_bucket_view=True``); the others
are dearopt schedules (``dear-sharded``: ``dear`` with ``shard_optimizer=True``).  On a GPU it also reports the
host's time to issue a step and the step's time.

    python -m dearopt.bench --count                                   # 2 ranks, 12 layers (~200 tensors)
    python -m dearopt.bench --count --layers 24 --configs plain,dear  # ~390 tensors
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

CONFIGS = ("plain", "ddp", "wfbp", "dear", "prophet", "dear-sharded")
VOCAB = 512


def _model(layers: int):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def _batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g).to(device)
    return ids, ids.clone()


def _first_entry_lasti() -> int:
    """Where a generator's frame stands when it is first entered (``sys.setprofile`` reports every resumption of
    a generator as a ``call``; a call is counted once, at its first entry)."""
    seen = []

    def probe():
        yield

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is probe.__code__:
            seen.append(frame.f_lasti)

    sys.setprofile(watch)
    try:
        next(probe())
    finally:
        sys.setprofile(None)
    return seen[0]


_GENERATOR = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


class _Calls:
    """Counts Python function calls (a generator's first entry, not its resumptions) on every thread while
    ``on``."""

    def __init__(self):
        self.on = False
        self.count = 0
        self._first = _first_entry_lasti()

    def __call__(self, frame, event, arg):
        if event == "call" and self.on:
            if frame.f_code.co_flags & _GENERATOR and frame.f_lasti > self._first:
                return  # a generator resumed
            self.count += 1  # (an increment lost between threads is one call in thousands)


def _build(name: str, layers: int, device):
    import dearopt

    model = _model(layers).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if name == "plain":
        return model, model, opt
    if name == "ddp":
        ddp = model
        if torch.distributed.get_world_size() > 1:
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return model, ddp, opt
    schedule, extra = (name[: -len("-sharded")], {"shard_optimizer": True}) if name.endswith("-sharded") else (name, {})
    return model, model, dearopt.DistOptim(opt, model, schedule=schedule, **extra)


def _step(forward, opt, step, rank, device):
    ids, labels = _batch(step, rank, device)
    opt.zero_grad()
    forward(input_ids=ids, labels=labels).loss.backward()
    opt.step()


def _dispatches(prof) -> int:
    count = 0
    for evt in prof.events():
        if not evt.name.startswith("aten::"):
            continue
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def _worker(rank, world, port, name, layers, warmup, steps, device_kind, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    calls = _Calls()
    threading.setprofile(calls)  # threads started from here on (the engine's helpers) are counted too
    import dearopt

    if name != "plain":  # plain torch: every rank trains alone
        dearopt.init(backend="nccl" if device_kind == "cuda" else None)
    elif device_kind == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    model, forward, opt = _build(name, layers, device)
    step = 0
    while step < warmup or (hasattr(opt, "settled") and not opt.settled and step < 10 * warmup):
        _step(forward, opt, step, rank, device)
        step += 1
    if step > warmup:  # and one more, as the bench times: the last re-plan's first updates (the flat runs built,
        _step(forward, opt, step, rank, device)  # the parameters moved into them) land in the step after it
        step += 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Python calls
    sync()
    sys.setprofile(calls)
    calls.on = True
    for _ in range(steps):
        _step(forward, opt, step, rank, device)
        step += 1
    calls.on = False
    sys.setprofile(None)
    # operator dispatches
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(forward, opt, step, rank, device)
            step += 1
    # times (a GPU: the host's time to issue a step, and the step's)
    host, whole = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        _step(forward, opt, step, rank, device)
        t1 = time.perf_counter()
        sync()
        host.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
        step += 1
    result = {
        "calls": calls.count / steps,
        "dispatches": _dispatches(prof) / steps,
        "host_ms": statistics.median(host) * 1e3,
        "step_ms": statistics.median(whole) * 1e3,
        "tensors": sum(1 for _ in model.parameters()),
    }
    if hasattr(opt, "close"):
        opt.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if dearopt.is_initialized():
        dearopt.shutdown()


def count(name: str, ranks: int, layers: int, warmup: int, steps: int, device: str) -> dict:
    """Counts of one configuration, measured in fresh processes."""
    import torch.multiprocessing as mp

    from dearopt.backends.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "count.json")
        port = free_port()
        mp.start_processes(
            _worker,
            args=(ranks, port, name, layers, warmup, steps, device, out),
            nprocs=ranks,
            start_method="spawn",
        )
        with open(out) as f:
            return json.load(f)


def table(results: dict, ranks: int) -> str:
    """The counts beside plain torch (and DDP), per step and per parameter tensor."""
    plain = results.get("plain")
    tensors = next(iter(results.values()))["tensors"]
    lines = [
        f"host work per step, {ranks} rank(s), BERT-shaped model with {tensors} parameter tensors, AdamW foreach "
        f"(rank 0; Python calls from sys.setprofile, operator dispatches from torch.profiler)",
        f"{'config':14s} {'calls':>8s} {'above plain':>12s} {'per tensor':>11s} {'dispatches':>11s} "
        f"{'above plain':>12s} {'host ms':>8s} {'step ms':>8s}",
    ]
    for name, r in results.items():
        extra_c = r["calls"] - plain["calls"] if plain else float("nan")
        extra_d = r["dispatches"] - plain["dispatches"] if plain else float("nan")
        lines.append(
            f"{name:14s} {r['calls']:8.0f} {extra_c:+12.0f} {extra_c / tensors:+11.2f} {r['dispatches']:11.0f} "
            f"{extra_d:+12.0f} {r['host_ms']:8.2f} {r['step_ms']:8.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dearopt.bench --count",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--count", action="store_true", help="(selects this mode)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=12, help="encoder layers (12: ~200 tensors, 24: ~390)")
    p.add_argument("--warmup", type=int, default=60, help="untimed steps first (more until the plan settled)")
    p.add_argument("--steps", type=int, default=20, help="steps counted (20: one period of the link monitor's checks)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    args = p.parse_args(argv)
    ranks = 1 if args.device == "cuda" and torch.cuda.device_count() < args.ranks else args.ranks
    results = {}
    for name in [c for c in args.configs.split(",") if c]:
        results[name] = count(name, ranks, args.layers, args.warmup, args.steps, args.device)
        print(
            f"[count] {name}: {results[name]['calls']:.0f} calls, {results[name]['dispatches']:.0f} dispatches",
            flush=True,
        )
    print(table(results, ranks))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": ranks, "layers": args.layers, "results": results}, f, indent=1)
    return 0
