"""The engine's own cost on one device: time per iteration and peak memory at world size 1, beside plain torch and DDP.

    python -m dearopt.bench.single --model resnet50 --device cuda
    python -m dearopt.bench.single --model bert --device cuda --batch-size 8 --size 128 --variants plain,ddp,dear
    python -m dearopt.bench.single --model tiny --device cpu --iterations 5     (a smoke run)

At world size 1 nothing is sent, so what a schedule costs above plain torch
is its own host work (hooks, bookkeeping, optimizer calls) and its buffers.
Each model runs in a fresh process; the variants run one after another in it
(each one's model and optimizer freed before the next; the peak is reset per
variant, and the memory still held when a variant starts is reported as
``base``, so a leak would show).  ``--profile`` also records a
``dearopt.sim`` profile of the model and prints the simulator's prediction of
``dear`` and of DDP (as ``wfbp`` with 25 MB buckets) on more GPUs.

Variants: ``plain`` (torch, no communication), ``ddp``
(``DistributedDataParallel``, ``gradient_as_bucket_view=True``), and any
dearopt schedule name (``dear``, ``wfbp``, ``rsag``, ...), ``<schedule>-sharded``
(``shard_optimizer=True``), ``<schedule>-native`` (``comm_hook=None``: a
bfloat16 model reduced in bfloat16 instead of float32), ``<schedule>-fixed``
(``allreduce=0.0``: no measured plan choice), ``<schedule>-dense``
(``embedding_rows=False``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

DEFAULT_VARIANTS = "plain,ddp,wfbp,dear"
GPU_SHAPES = {"resnet50": (32, 224), "bert": (8, 128), "tiny": (8, 16)}  # batch, image side or sequence length


_SUFFIXES = {
    "sharded": {"shard_optimizer": True},
    "native": {"comm_hook": None},
    "fixed": {"allreduce": 0.0},
    "dense": {"embedding_rows": False},
    "": {},
}


def variant_options(variant: str) -> dict:
    """``DistOptim``'s arguments for a dearopt variant: ``<schedule>[-sharded|-native|-fixed|-dense]``."""
    schedule, _, how = variant.partition("-")
    if how not in _SUFFIXES:
        raise ValueError(f"unknown variant {variant!r}: a schedule, optionally -{'/-'.join(k for k in _SUFFIXES if k)}")
    from dearopt.schedules import get_schedule

    options = dict(_SUFFIXES[how])
    policy = get_schedule(schedule)
    own = {k: options.pop(k) for k in list(options) if k in policy.knob_names()}  # the schedule object's knobs
    return dict(options, schedule=policy.with_knobs(**own))


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def _tensor_bytes(tensors, seen=None) -> int:
    """Bytes of the storages behind ``tensors``, each once (views of one buffer: DDP's gradient views, the sharded
    update's parameters in its gather buffer); ``seen``: storages already counted in another kind."""
    seen, total = (set() if seen is None else seen), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def breakdown(model: torch.nn.Module, optimizer, dist_opt=None) -> Dict[str, float]:
    """MiB by kind of buffer: parameters, gradients outside the engine's buckets, the engine's buckets (full
    buffers), shards (and the sharded update's gather buffers), a comm hook's wire buffers, optimizer state."""
    params = list({id(p): p for p in model.parameters()}.values())
    seen = set()  # a storage counts in the first kind it belongs to
    out = {"parameters": _mib(_tensor_bytes(params, seen))}
    bucket_ptrs, buckets, shards, wire = set(), [], [], []
    executor = getattr(dist_opt, "_executor", None)
    for b in getattr(executor, "buckets", None) or []:
        buckets.append(b.buffer)
        bucket_ptrs.add(b.buffer.untyped_storage().data_ptr())
        for piece in b.pieces:
            shards += [t for t in (piece.gather_full, piece.gather_shard) if t is not None]
    issuer = getattr(executor, "issuer", None)
    if issuer is not None:  # a comm hook's wire buffers (kept for the ops in flight)
        wire += issuer.pool.buffers()
    grads = [p.grad for p in params if p.grad is not None and p.grad.untyped_storage().data_ptr() not in bucket_ptrs]
    out["gradients"] = _mib(_tensor_bytes(grads, seen))
    out["buckets"] = _mib(_tensor_bytes(buckets, seen))
    out["shards"] = _mib(_tensor_bytes(shards, seen))
    out["wire"] = _mib(_tensor_bytes(wire, seen))  # a comm hook's buffers (bf16 reduced in float32)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out["optimizer state"] = _mib(_tensor_bytes(state, seen))
    return out


def _run_variant(variant: str, args, device: torch.device) -> dict:

    import dearopt

    from dearopt.bench.models import build

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = 0
    workload = build(args.model, args.batch_size, args.size, seed=args.seed)
    model = workload.model.to(device=device, dtype=args.dtype)
    batches = [
        tuple(
            t.to(device=device, dtype=args.dtype) if t.is_floating_point() else t.to(device)
            for t in workload.make_batch(s)
        )
        for s in range(2)
    ]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt, wrapped = inner, model
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True
        )
    elif variant != "plain":
        opt = dearopt.DistOptim(inner, model, **variant_options(variant))

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        workload.loss(wrapped(x), y).backward()
        opt.step()

    def sync():
        if opt is not inner:
            opt.synchronize()
        if cuda:
            torch.cuda.synchronize()

    for i in range(args.warmup):
        step(i)
    sync()
    host = 0.0
    start = time.perf_counter()
    for i in range(args.iterations):
        t0 = time.perf_counter()
        step(i)
        host += time.perf_counter() - t0  # the host's time to issue the step (on CUDA it may run ahead)
    sync()
    seconds = (time.perf_counter() - start) / args.iterations
    row = {
        "variant": variant,
        "iter_ms": seconds * 1e3,
        "host_ms": host / args.iterations * 1e3,
        "base_mib": _mib(base),
    }
    if cuda:
        row["peak_mib"] = _mib(torch.cuda.max_memory_allocated(device))
        row["end_mib"] = _mib(torch.cuda.memory_allocated(device))
    row["breakdown"] = breakdown(model, inner, opt if opt is not inner else None)
    if cuda:
        row["syncs_per_step"], row["sync_sites"] = _count_syncs(step, args.iterations, device)
    if opt is not inner:
        opt.close()
    opt = inner = model = wrapped = batches = workload = None  # freed (not del: step() and sync() name them)
    gc.collect()
    return row


def _count_syncs(step, first: int, device, steps: int = 3):
    """Host-device synchronizations per step (torch.cuda.set_sync_debug_mode) and the lines that cause them."""
    import collections
    import warnings

    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(steps):
                step(first + i)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    synced = [w for w in caught if "synchroniz" in str(w.message)]
    sites = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in synced)
    return len(synced) / steps, [f"{site} x{n / steps:g}" for site, n in sites.most_common(8)]


def _profile_and_predict(args, device: torch.device, ranks: List[int], link: str, latency: float) -> List[dict]:
    from dearopt.sim import predict, record_profile

    from dearopt.bench.models import build

    workload = build(args.model, args.batch_size, args.size, seed=args.seed)
    model = workload.model.to(device)
    x, y = (t.to(device) for t in workload.make_batch(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    profile = record_profile(
        model, lambda: workload.loss(model(x), y), opt, sizes=(2**16, 2**20), repeats=3, link="one device"
    )
    if args.out:
        profile.save(os.path.join(args.out, f"profile-{args.model}.json"))
    if not profile.comm:  # one rank measured no collective: the link's bandwidth and the given latency per step
        import dataclasses

        from dearopt.sim import CommCost, parse_link
        from dearopt.sim.cost import KINDS

        beta = 8.0 / parse_link(link)
        profile = dataclasses.replace(profile, comm={k: CommCost(k, latency, beta) for k in KINDS})
    rows = []
    for n in ranks:
        row = {"ranks": n, "link": link}
        for name, schedule in (("ddp (as wfbp)", "wfbp"), ("dear", "dear")):
            row[name] = predict(profile, schedule, ranks=n, link=link, latency=latency).iteration * 1e3
        rows.append(row)
    return rows


def child(args) -> int:
    import torch.distributed as dist

    import dearopt

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"error": "no CUDA device"}))
            return 2
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False  # its trial workspaces would count in the first variant's peak
    else:
        torch.set_num_threads(args.threads)
    os.environ.pop("WORLD_SIZE", None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    dearopt.init()  # joins the process group above
    out = {"model": args.model, "device": str(device), "dtype": str(args.dtype).replace("torch.", ""), "rows": []}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    for variant in args.variants.split(","):
        try:
            out["rows"].append(_run_variant(variant, args, device))
        except Exception as exc:  # one variant's failure is reported; the others still run
            out["rows"].append({"variant": variant, "error": f"{type(exc).__name__}: {exc}"})
    if args.profile:
        try:
            out["predictions"] = _profile_and_predict(args, device, [8, 64], args.link, args.latency)
        except Exception as exc:
            out["predictions_error"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(out), flush=True)
    dearopt.shutdown()
    return 0


def table(doc: dict) -> str:
    rows = doc["rows"]
    plain = next((r for r in rows if r["variant"] == "plain" and "error" not in r), None)
    ddp = next((r for r in rows if r["variant"] == "ddp" and "error" not in r), None)
    cuda = any("peak_mib" in r for r in rows)
    from dearopt.engine.hooks import NATIVE

    head = (
        f"{doc['model']} ({doc.get('dtype', 'float32')}) on {doc.get('gpu', doc['device'])}, world size 1 "
        f"(dearopt's gradient hooks in {'C++' if NATIVE else 'Python'})"
    )
    lines = [
        head,
        f"{'variant':<14}{'ms/iter':>9}{'host ms':>9}{'vs plain':>10}"
        + (f"{'peak MiB':>10}{'vs ddp':>8}" if cuda else "")
        + "  breakdown MiB",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<14}FAILED: {r['error']}")
            continue
        over = f"{r['iter_ms'] - plain['iter_ms']:+.2f}" if plain else "-"
        line = f"{r['variant']:<14}{r['iter_ms']:9.2f}{r['host_ms']:9.2f}{over:>10}"
        if cuda:
            ratio = f"{r['peak_mib'] / ddp['peak_mib']:.3f}" if ddp else "-"
            line += f"{r['peak_mib']:10.0f}{ratio:>8}"
        parts = ", ".join(f"{k} {v:.0f}" for k, v in r["breakdown"].items() if v >= 0.5)
        lines.append(line + "  " + parts)
        if r.get("sync_sites"):
            lines.append(f"{'':14}{r['syncs_per_step']:g} host-device syncs per step: " + "; ".join(r["sync_sites"]))
        elif "syncs_per_step" in r:
            lines.append(f"{'':14}no host-device sync in a step")
    for p in doc.get("predictions", []):
        lines.append(
            f"predicted on {p['ranks']} GPUs at {p['link']}: DDP (as wfbp) {p['ddp (as wfbp)']:.1f} ms, "
            f"dear {p['dear']:.1f} ms per iteration"
        )
    if doc.get("predictions_error"):
        lines.append(f"prediction failed: {doc['predictions_error']}")
    return "\n".join(lines)


def run(args, argv: List[str]) -> Optional[dict]:
    """Run ``args.model`` in a fresh process with this command's ``argv``; return its result document (None: it
    failed, see stderr)."""
    child_argv = [sys.executable, "-m", "dearopt.bench.single", "--child"] + list(argv)
    proc = subprocess.run(child_argv, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    sys.stderr.write(
        f"{args.model}: the measuring process failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}\n"
    )
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m dearopt.bench.single", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="resnet50", choices=("resnet50", "bert", "tiny"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--batch-size", type=int, default=None, help="default on CUDA: resnet50 32, bert 8")
    p.add_argument("--size", type=int, default=None, help="image side or sequence length (CUDA: 224, 128)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (dear profiles steps 1-3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the model's parameters (bfloat16: dear reduces in float32 by default; the variant "
        "dear-native reduces in bfloat16)",
    )
    p.add_argument("--profile", action="store_true", help="record a sim profile; predict 8 and 64 GPUs")
    p.add_argument("--link", default="100gbit")
    p.add_argument("--latency", type=float, default=1e-5, help="seconds per collective step in the prediction")
    p.add_argument("--out", default=None, help="directory for result-<model>.json and profile-<model>.json")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        shape = GPU_SHAPES[args.model]
        args.batch_size = args.batch_size or shape[0]
        args.size = args.size or shape[1]
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.child:
        return child(args)
    doc = run(args, sys.argv[1:] if argv is None else argv)
    if doc is None:
        return 1
    if args.out:
        suffix = "" if args.dtype == torch.float32 else "-" + str(args.dtype).replace("torch.", "")
        with open(os.path.join(args.out, f"result-{args.model}{suffix}.json"), "w") as f:
            json.dump(doc, f, indent=1)
    print(table(doc))
    return 0 if all("error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
