"""Host work per step where compute is tiny: a BERT-shaped model with BERT-Base's tensor count and hidden size 64.

Every configuration trains its own copy of the same model (AdamW, batch 2 x 16 tokens per rank) in the same
processes, in interleaved rounds (each round times every configuration once, in turn), and the median over rounds
of each round's median iteration time is reported, beside plain torch without communication: what is left above
plain is the cost of the data-parallel machinery (hooks, bucket copies, collectives, checks), per step and per
parameter tensor.

    .venv/bin/python scripts/host_overhead.py --ranks 2 --rounds 3 --iters 30
    .venv/bin/python scripts/host_overhead.py --ranks 1

Needs ``transformers`` (the model is built from a config; nothing is downloaded).  Unshaped loopback, gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = ("plain", "ddp", "wfbp", "dear")
VOCAB = 512  # small: the embedding must not make the arithmetic large


def _model():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=12,
        num_attention_heads=2,
        intermediate_size=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    return ids, ids.clone()


def _build(name):
    import dearopt

    model = _model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model) if dist.get_world_size() > 1 else model
        return model, opt
    if name == "plain":
        return model, opt
    return model, dearopt.DistOptim(opt, model, schedule=name)


def _iterate(model, opt, step, rank):
    ids, labels = _batch(step, rank)
    opt.zero_grad()
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()


def _worker(rank, world, port, configs, rounds, iters, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import dearopt

    dearopt.init()
    if not dist.is_initialized():  # DDP needs torch.distributed's default group
        dist.init_process_group("gloo", rank=rank, world_size=world)
    built = {name: _build(name) for name in configs}
    step = 0
    for name, (model, opt) in built.items():  # warm up; dear until its plan has settled (profile, choice)
        for _ in range(5):
            _iterate(model, opt, step, rank)
            step += 1
        while hasattr(opt, "settled") and not opt.settled and step < 400:
            _iterate(model, opt, step, rank)
            step += 1
    times = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (model, opt) in built.items():
            per = []
            for _ in range(iters):
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                _iterate(model, opt, step, rank)
                per.append(time.perf_counter() - t0)
                step += 1
            times[name].append(statistics.median(per))
    n_tensors = sum(1 for _ in built[configs[0]][0].parameters())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "tensors": n_tensors, "world": world}, f)
    for name, (model, opt) in built.items():
        if hasattr(opt, "close"):
            opt.close()
    dearopt.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="host_overhead.json")
    parser.add_argument(
        "--src",
        help="import dearopt from this source tree (another commit's worktree, to "
        "measure it side by side with this one)",
    )
    args = parser.parse_args(argv)
    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))  # spawned ranks inherit sys.path
    from dearopt.backends.launch import free_port

    configs = tuple(args.configs.split(","))
    mp.start_processes(
        _worker,
        args=(args.ranks, free_port(), configs, args.rounds, args.iters, args.out),
        nprocs=args.ranks,
        start_method="spawn",
    )
    with open(args.out) as f:
        result = json.load(f)
    med = {k: statistics.median(v) * 1e3 for k, v in result["times"].items()}
    plain = med.get("plain")
    import dearopt

    print(f"dearopt from {os.path.dirname(os.path.dirname(dearopt.__file__))}")
    print(
        f"{result['world']} rank(s), {result['tensors']} parameter tensors, median of {args.rounds} rounds "
        f"x {args.iters} iterations [ms/iteration]"
    )
    for name in configs:
        extra = (
            ""
            if plain is None or name == "plain"
            else (
                f"  +{med[name] - plain:.2f} ms above plain ({(med[name] - plain) * 1e3 / result['tensors']:.1f} us "
                f"per tensor)"
            )
        )
        ratio = ""
        if plain is not None and "ddp" in med and name not in ("plain", "ddp") and med["ddp"] > plain:
            ratio = f"  {(med[name] - plain) / (med['ddp'] - plain):.2f}x DDP's excess"
        print(f"  {name:6s} {med[name]:7.2f}{extra}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
