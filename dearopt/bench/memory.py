"""Peak memory per rank of each schedule beside DDP's, with a breakdown by kind of buffer.

    python -m dearopt.bench --memory                         (BERT-Base, 2 CPU ranks, AdamW, 6 steps)
    python -m dearopt.bench --memory --model tiny --steps 3  (a smoke run)

Each configuration runs in processes of its own (so that one's peak cannot
hide in another's): on the CPU the peak resident set (``ru_maxrss``) of each
rank (CUDA at world size 1: ``python -m dearopt.bench.single``, which
``scripts/gpu_check`` runs).  The breakdown (MiB, rank
0, after the last step): parameters, gradients outside the engine's buckets
(DDP's own buckets are views of them), the engine's buckets, shards (and the
sharded update's gather buffers), a comm hook's wire buffers, the backend's
workspace (gloo's reduce-scatter receive buffers), optimizer state.
Variants as in :mod:`dearopt.bench.single` (``ddp`` is DDP with
``gradient_as_bucket_view=True``; ``ddp-copy`` without).

**Two peaks per variant.**  The resident set counts what glibc's allocator
keeps, not only what is alive: by default glibc raises its mmap threshold as
large blocks are freed (up to 32 MiB), after which blocks below it come from
the heap, whose freed middle stays resident.  An update that allocates its
temporaries in the forward, between the activations (``dear``), leaves such
holes.  So each variant runs twice, once under glibc's defaults (``peak``) and
once with the threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``: large
blocks go back to the system when freed, so the resident set follows the live
tensors, as ``torch.cuda.max_memory_allocated`` does on a GPU): ``peak, fixed
mmap``.  ``--malloc default`` or ``fixed`` runs one of them.  ``--dtype
bfloat16`` measures a bfloat16 model (the default ``comm_hook="auto"`` sums its
gradients in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from typing import List

import torch

DEFAULT_VARIANTS = "ddp,wfbp,dear,dear-sharded"
FIXED_MMAP_THRESHOLD = str(2**20)  # bytes (glibc's MALLOC_MMAP_THRESHOLD_; see the module)


def _workspace_mib(dist_opt) -> float:
    executor = getattr(dist_opt, "_executor", None)
    seen, total = set(), 0
    for backend in (getattr(executor, "backend", None), getattr(executor, "control", None)):
        for t in (t for kept in getattr(backend, "_workspace", {}).values() for t in kept):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total / 2**20


def _rank(variant: str, model_name: str, steps: int, batch, size, device_kind: str, dtype: str = "float32") -> dict:
    import dearopt

    from dearopt.bench.models import build
    from dearopt.bench.single import breakdown, variant_options

    rank = dearopt.rank()
    device = torch.device("cuda", dearopt.local_rank()) if device_kind == "cuda" else torch.device("cpu")
    workload = build(model_name, batch, size, seed=0)
    model = workload.model.to(device, getattr(torch, dtype))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt, wrapped = inner, model
    if variant.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=variant == "ddp",
        )
    else:
        opt = dearopt.DistOptim(inner, model, **variant_options(variant))
    for step in range(steps):
        x, y = (t.to(device) for t in workload.make_batch(1000 * step + rank))
        if x.is_floating_point():
            x = x.to(getattr(torch, dtype))
        opt.zero_grad(set_to_none=True)
        workload.loss(wrapped(x), y).backward()
        opt.step()
    if opt is not inner:
        opt.synchronize()
    row = {"variant": variant, "rank": rank, "breakdown": breakdown(model, inner, opt if opt is not inner else None)}
    row["breakdown"]["workspace"] = _workspace_mib(opt) if opt is not inner else 0.0
    if device.type == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        row["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if opt is not inner:
        opt.close()
    return row


def measure(
    variants: List[str],
    model: str,
    ranks: int,
    steps: int,
    batch=None,
    size=None,
    device: str = "cpu",
    timeout: float = 1800,
    dtype: str = "float32",
    malloc: str = "both",
) -> List[dict]:
    """One row per variant: its peaks (the largest over ranks; ``peak_mib`` under glibc's defaults,
    ``peak_fixed_mib`` with the mmap threshold fixed, see the module) and rank 0's breakdown."""
    modes = {"both": ("default", "fixed"), "default": ("default",), "fixed": ("fixed",)}[malloc]
    rows = []
    for variant in variants:
        row: dict = {"variant": variant}
        try:
            for mode in modes:
                per_rank = _spawn_with_malloc(
                    mode, _rank, ranks, variant, model, steps, batch, size, device, dtype, timeout=timeout
                )
                row.update({k: v for k, v in per_rank[0].items() if k != "peak_mib"})
                row["peak_mib" if mode == "default" else "peak_fixed_mib"] = max(r["peak_mib"] for r in per_rank)
        except Exception as exc:  # one variant's failure is reported; the others still run
            row = {"variant": variant, "error": str(exc).strip().splitlines()[-1][:300]}
        rows.append(row)
        print(f"  {variant}: " + _peaks_text(row), file=sys.stderr, flush=True)
    return rows


def _spawn_with_malloc(mode: str, fn, ranks: int, *args, timeout: float):
    """The ranks spawned (fresh interpreters: glibc reads its settings at start) under glibc's defaults or with
    the mmap threshold fixed."""
    from dearopt.bench.spawn import spawn

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if mode == "fixed":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = FIXED_MMAP_THRESHOLD
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    try:
        return spawn(fn, ranks, *args, timeout=timeout)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _peaks_text(row: dict) -> str:
    if "error" in row:
        return row["error"]
    peaks = [
        f"{row[k]:.0f} MiB{label}" for k, label in (("peak_mib", ""), ("peak_fixed_mib", " (fixed mmap)")) if k in row
    ]
    return ", ".join(peaks)


def table(rows: List[dict], title: str) -> str:
    ddp = next((r for r in rows if r["variant"] == "ddp" and "error" not in r), None)
    kinds = ["parameters", "gradients", "buckets", "shards", "wire", "workspace", "optimizer state"]
    peaks = [("peak_mib", "peak MiB"), ("peak_fixed_mib", "fixed mmap")]
    peaks = [(k, label) for k, label in peaks if any(k in r for r in rows)]
    head = "".join(f"{label:>11}{'vs ddp':>8}" for _, label in peaks)
    lines = [title, f"{'variant':<14}{head}" + "".join(f"{k:>16}" for k in kinds)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<14}FAILED: {r['error']}")
            continue
        cells = ""
        for k, _ in peaks:
            ratio = f"{r[k] / ddp[k]:.3f}" if ddp and k in ddp and k in r else "-"
            cells += f"{r.get(k, float('nan')):11.0f}{ratio:>8}"
        lines.append(f"{r['variant']:<14}{cells}" + "".join(f"{r['breakdown'].get(k, 0.0):16.1f}" for k in kinds))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dearopt.bench --memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="bert", choices=("resnet50", "bert", "tiny"))
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--size", type=int, default=None)
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu",),
        help="CPU ranks on gloo (on a GPU: python -m dearopt.bench.single, world size 1)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")
    p.add_argument(
        "--malloc",
        default="both",
        choices=("both", "default", "fixed"),
        help="glibc's defaults, its mmap threshold fixed at 1 MiB, or both (see above)",
    )
    p.add_argument("--out", default=None, help="write memory.json here")
    args = p.parse_args(argv)
    rows = measure(
        args.variants.split(","),
        args.model,
        args.ranks,
        args.steps,
        args.batch_size,
        args.size,
        args.device,
        dtype=args.dtype,
        malloc=args.malloc,
    )
    title = (
        f"{args.model} ({args.dtype}), {args.ranks} ranks on {args.device}, AdamW, {args.steps} steps: peak "
        f"resident memory per rank (glibc's defaults; its mmap threshold fixed at 1 MiB) and rank 0's buffers (MiB)"
    )
    print(table(rows, title))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump({"title": title, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
