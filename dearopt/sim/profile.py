"""A model's profile: what the simulator needs to know about one training iteration, measured.

:func:`record_profile` measures, on the job's own ranks and link:

* the parameters in forward order as the planner sees them (twins and
  row-sparse embeddings included, as :class:`dearopt.DistOptim` plans them);
* the forward as segments between the modules that own parameters (the
  executor acts just before those run), and the time each gradient becomes
  ready after backward starts;
* the optimizer's update cost (seconds per parameter element, and per call);
* for each collective kind, timings at several sizes and their alpha-beta fit,
  its beta set so that it reproduces the model's buckets sent back to back
  (:mod:`dearopt.sim.cost`), on this backend and link;
* how much compute slows down while the link is busy (on a machine where
  communication takes CPU from compute, as a 2-core one), forward and backward:
  as compute seconds lost per byte communicated meanwhile (``cpu_per_byte``, what
  the simulator uses; all-gathers and reduce-scatters, and all-reduces on their
  own), and as the older factor ``contention``;
* the engine's own passes over gradient memory, per byte (``copy_per_byte``): each
  gradient copied into its bucket when it is ready, each reduced region averaged
  when its collective completes (a plain backward, which the ready times come
  from, does neither);
* the backend's bound on reduce-scatters and all-gathers in flight
  (``workspace_bytes``: gloo runs them as all-to-alls through a bounded
  workspace, and a host that starts one past it waits for the oldest first).

A :class:`Profile` is saved and loaded as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from dearopt.planning.plan import ParamSpec
from dearopt.sim.cost import KINDS, CommCost, fit, op_steps

__all__ = [
    "Profile",
    "record_profile",
    "retime_compute",
    "contention_from_overlap",
    "stream_calibrated",
    "workspace_of",
]


@dataclasses.dataclass
class Profile:
    params: List[ParamSpec]  # forward order, as planned
    forward_segments: List[Tuple[List[int], float]]  # (the module's parameter positions, seconds before it runs)
    forward_tail: float  # seconds from the last parameter-owning module to the end of forward (and the loss)
    ready: List[float]  # per parameter position: seconds after backward starts
    t_bp: float  # backward, end to end
    update_per_element: float
    update_per_call: float
    comm: Dict[str, CommCost]
    comm_samples: Dict[str, List[Tuple[float, float]]]
    contention: Dict[str, float]  # "forward"/"backward": compute slowdown factor minus 1 while the link is busy
    world: int
    backend: str = "gloo"
    link: str = "unknown"
    rows_fraction: Dict[int, float] = dataclasses.field(default_factory=dict)  # row-sparse param -> rows touched
    copy_per_byte: float = 0.0  # seconds per byte of one elementwise pass (copy into a bucket, averaging)
    cpu_per_byte: Dict[str, float] = dataclasses.field(default_factory=dict)  # "forward"/"backward": compute
    # seconds lost per byte of all-gathers / reduce-scatters running meanwhile, "all_reduce": per byte of an
    # all-reduce's buffer (see _contention); the simulator prefers it to ``contention`` where measured
    lost_samples: Dict[str, List[List[float]]] = dataclasses.field(default_factory=dict)  # per key of
    # ``cpu_per_byte``, per sample: each rank's own compute seconds lost per byte (``cpu_per_byte`` is the median
    # of their means)
    comm_streams: Dict[str, List[float]] = dataclasses.field(default_factory=dict)  # per kind: [bytes, ops,
    # seconds] of the model's buckets sent back to back; ``comm``'s betas reproduce them (stream_calibrated)
    cores_per_rank: float = 0.0  # CPU cores this host gives each of its ranks (0: not recorded); with one or
    # more, each rank computes on a core of its own and the slowest rank's loss paces the job (see
    # :func:`dearopt.sim.cpu_per_byte`)
    workspace_bytes: float = 0.0  # the bytes of reduce-scatter and all-gather buffers the backend holds in flight
    # (gloo's all-to-all workspace: a receive buffer per reduce-scatter, a send buffer per all-gather, each the
    # op's full size; at least one op's): starting one more past it waits for the oldest first, on the host.
    # 0: no bound (NCCL; profiles recorded before the workspace, which predict as before)
    compute_samples: List[List[float]] = dataclasses.field(default_factory=list)  # per timed iteration: each
    # forward segment's seconds, the forward tail, t_bp, each parameter position's ready time (the slowest rank's
    # of each); ``forward_segments``, ``forward_tail``, ``t_bp`` and ``ready`` are their medians.  Empty in
    # profiles recorded before they were kept.  :func:`retime_compute` adds more.

    @property
    def t_ff(self) -> float:
        """The forward time of one iteration: every segment plus the tail after the last one, in seconds."""
        return sum(t for _, t in self.forward_segments) + self.forward_tail

    def without_twins(self) -> "Profile":
        """The profile as a job that reduces every gradient densely and each tied weight as one gradient sees it
        (``schedule="deft"``, which runs with ``embedding_rows=False``): each twin (a tied weight's second use)
        folded into its owner, whose gradient is complete when the later of the two parts is ready; a module
        that owned only a twin adds its time to the next module's."""
        keep = [i for i, p in enumerate(self.params) if p.twin_of is None]
        position = {old: new for new, old in enumerate(keep)}
        params = [dataclasses.replace(self.params[i], row_numel=0) for i in keep]
        ready = [self.ready[i] for i in keep]
        for i, p in enumerate(self.params):
            if p.twin_of is not None:
                owner = position[p.twin_of]
                ready[owner] = max(ready[owner], self.ready[i])
        segments, carried = [], 0.0
        for own, seconds in self.forward_segments:
            mapped = [position[i] for i in own if i in position]
            if mapped:
                segments.append((mapped, seconds + carried))
                carried = 0.0
            else:
                carried += seconds
        return dataclasses.replace(
            self,
            params=params,
            ready=ready,
            forward_segments=segments,
            forward_tail=self.forward_tail + carried,
            rows_fraction={},
            compute_samples=[],  # in the layout with twins
        )

    def with_compute_scaled(self, forward: float, backward: float) -> "Profile":
        """The profile with its forward (segments and tail) ``forward`` times as long and its backward (``t_bp``,
        every ready time) ``backward`` times: the same model's compute as another process runs it (the bench's
        DDP, in processes of its own, against the bench's).  The samples are dropped (they are the other's)."""
        if not (forward > 0 and backward > 0):
            raise ValueError(f"with_compute_scaled: factors must be positive, got {forward}, {backward}")
        return dataclasses.replace(
            self,
            forward_segments=[(own, seconds * forward) for own, seconds in self.forward_segments],
            forward_tail=self.forward_tail * forward,
            t_bp=self.t_bp * backward,
            ready=[t * backward for t in self.ready],
            compute_samples=[],
        )

    def to_json(self) -> dict:
        """The profile as a JSON-serializable dict (what :meth:`save` writes)."""
        doc = dataclasses.asdict(self)
        doc["params"] = [dataclasses.asdict(p) for p in self.params]
        doc["comm"] = {k: dataclasses.asdict(c) for k, c in self.comm.items()}
        doc["rows_fraction"] = {str(k): v for k, v in self.rows_fraction.items()}
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> "Profile":
        """The profile from a dict written by :meth:`to_json`."""
        doc = dict(doc)
        doc["params"] = [ParamSpec(**p) for p in doc["params"]]
        doc["comm"] = {k: CommCost(**c) for k, c in doc["comm"].items()}
        doc["forward_segments"] = [(list(s[0]), s[1]) for s in doc["forward_segments"]]
        doc["comm_samples"] = {k: [tuple(s) for s in v] for k, v in doc["comm_samples"].items()}
        doc["rows_fraction"] = {int(k): v for k, v in doc.get("rows_fraction", {}).items()}
        return cls(**doc)

    def save(self, path: str) -> None:
        """Write the profile to ``path`` as JSON."""
        with open(path, "w") as fh:
            json.dump(self.to_json(), fh, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        """Read a profile written by :meth:`save`."""
        with open(path) as fh:
            return cls.from_json(json.load(fh))


def contention_from_overlap(compute: float, comm: float, both: float) -> float:
    """The slowdown ``gamma`` of compute while the link is busy, from three timings: compute alone, the
    collectives alone, and both started together (time until both are done).

    Model: compute runs at ``1 / (1 + gamma)`` of its speed while the link is
    busy.  If compute outlasts the link, ``both = compute + comm * gamma / (1 + gamma)``.
    """
    if comm <= 0 or both <= compute:
        return 0.0
    x = min((both - compute) / comm, 0.95)
    return x / (1.0 - x)


def _cores_per_rank(backend, local_size: int) -> float:
    """The CPU cores the ranks of a host may run on (the union of their affinities: all of the host's they may
    use, whether each rank is bound to its own or all share them), per rank of the host.  The union is taken
    over every rank by core number, which is each host's where the hosts are alike."""
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:  # not Linux: every core
        mine = set(range(os.cpu_count() or 1))
    if backend.size <= 1:
        return len(mine) / local_size
    width = torch.tensor([float(max(max(mine) + 1, os.cpu_count() or 1))], dtype=torch.float64, device=backend.device)
    backend.all_reduce(width, "max").wait()  # hosts may number their cores differently: one width for all
    mask = torch.zeros(int(width.item()), dtype=torch.float64, device=backend.device)
    mask[sorted(mine)] = 1.0
    backend.all_reduce(mask, "max").wait()
    return float(mask.sum().item()) / local_size


def workspace_of(backend) -> float:
    """The bytes of reduce-scatter receive and all-gather send buffers ``backend`` keeps in flight before starting
    one more waits for the oldest (:attr:`dearopt.backends.base.TorchDistBackend.workspace_bytes`, on gloo,
    where both run as all-to-alls through that workspace); 0 where starting an op never waits."""
    if getattr(backend, "pg_backend", None) != "gloo":
        return 0.0
    return float(getattr(backend, "workspace_bytes", 0) or 0)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def record_profile(
    model: torch.nn.Module,
    run: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    sizes: Sequence[int] = (2**16, 2**20, 8 * 2**20, 24 * 2**20),
    repeats: int = 3,
    link: str = "unknown",
    embedding_rows: bool = True,
    bucket_bytes: int = 25 * 2**20,
) -> Profile:
    """Measure ``model`` on this job (call it on every rank, after ``dearopt.init()``; rank 0's profile is
    returned on every rank).

    ``run()`` runs one forward and returns the loss (no backward).  The model's
    parameters and ``optimizer`` are left as they were (gradients are zeroed).
    ``sizes``: the collectives' message sizes timed for the alpha-beta fits, from one small enough to show the
    fixed cost per op (which the fit's intercept otherwise cannot tell) up to the engine's bucket size
    (25 MiB by default): at 32 MiB gloo's all-gather took 1.7x its per-byte time at 8 MiB on this machine
    (a temporary buffer above the allocator's reuse threshold, paid per call), which the engine's buckets
    never pay and which had bent the all-gather fit by as much.
    """
    import dearopt.backends.runtime as runtime
    from dearopt.collectives import broadcast_object

    backend = runtime.get_backend()
    world = backend.size
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    specs, owners, timed, rows_fraction = _time_compute(model, run, trainable, repeats, embedding_rows)
    per_element, per_call = _update_cost(optimizer, trainable)
    comm, samples = _comm_fits(backend, sizes, repeats) if world > 1 else ({}, {})
    total_bytes = sum(s.nbytes for s in specs)
    streams = _stream_times(backend, total_bytes, bucket_bytes, repeats) if world > 1 else {}
    comm = {k: stream_calibrated(c, streams[k], world) if k in streams else c for k, c in comm.items()}
    contention, cpu_per_byte, lost_samples = (
        _contention(backend, model, run, total_bytes, bucket_bytes, repeats)
        if world > 1
        else ({"forward": 0.0, "backward": 0.0}, {"forward": 0.0, "backward": 0.0}, {})
    )
    copy_per_byte = _copy_cost(min(total_bytes, bucket_bytes), repeats)
    profile = Profile(
        params=specs,
        **_compute_fields(owners, timed),
        update_per_element=per_element,
        update_per_call=per_call,
        comm=comm,
        comm_samples=samples,
        contention=contention,
        world=world,
        backend=getattr(backend, "name", "gloo"),
        link=link,
        rows_fraction=rows_fraction,
        copy_per_byte=copy_per_byte,
        cpu_per_byte=cpu_per_byte,
        lost_samples=lost_samples,
        cores_per_rank=_cores_per_rank(backend, runtime.local_size()),
        comm_streams=streams,
        workspace_bytes=workspace_of(backend) if world > 1 else 0.0,
    )
    if world > 1:
        profile = Profile.from_json(broadcast_object(profile.to_json() if backend.rank == 0 else None, 0))
    return profile


def retime_compute(
    profile: Profile,
    model: torch.nn.Module,
    run: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    repeats: int = 3,
    embedding_rows: bool = True,
) -> Profile:
    """``profile`` with the model's compute timed ``repeats`` more times on this job and merged in (call it on
    every rank, as :func:`record_profile`, with the same model, ``run`` and ``embedding_rows``; the model and
    ``optimizer`` are left as they were).

    The forward segments, forward tail, ``t_bp`` and ready times become the medians over every sample so far
    (``compute_samples``; a profile saved before they were kept gets the new samples' medians); the link's fits,
    the contention and the costs measured once stay.  A job that times
    its compute again as it goes (the bench, once a round) predicts from the machine as it was over the whole
    run, not only at its start: on a shared 2-core machine a profile's backward timed at the start of a run sat
    27 % below and 15 % above the same run's (2026-11-29)."""
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    specs, owners, samples, _ = _time_compute(model, run, trainable, repeats, embedding_rows)
    if [(p.numel, p.twin_of) for p in specs] != [(p.numel, p.twin_of) for p in profile.params]:
        raise ValueError(
            "retime_compute: the model's parameters in forward order differ from the profile's; pass the model "
            "(and embedding_rows) the profile was recorded from"
        )
    if owners != [own for own, _ in profile.forward_segments]:
        raise ValueError(
            "retime_compute: the model's modules ran in another order than the profile's; pass the model the "
            "profile was recorded from, with the same run()"
        )
    return dataclasses.replace(profile, **_compute_fields(owners, profile.compute_samples + samples))


def _compute_fields(owners: List[List[int]], samples: List[List[float]]) -> dict:
    """The profile's compute fields from per-iteration samples (see ``Profile.compute_samples``): their medians."""
    medians = [_median([sample[k] for sample in samples]) for k in range(len(samples[0]))]
    n_seg = len(owners)
    return {
        "forward_segments": [(own, seconds) for own, seconds in zip(owners, medians[:n_seg])],
        "forward_tail": medians[n_seg],
        "t_bp": medians[n_seg + 1],
        "ready": medians[n_seg + 2 :],
        "compute_samples": [list(sample) for sample in samples],
    }


def _time_compute(
    model: torch.nn.Module,
    run: Callable[[], torch.Tensor],
    trainable: List[torch.Tensor],
    repeats: int,
    embedding_rows: bool,
) -> Tuple[List[ParamSpec], List[List[int]], List[List[float]], Dict[int, float]]:
    """Time ``repeats`` forwards and backwards (after one untimed) on every rank together: the parameters in
    forward order as the planner sees them, each forward segment's parameter positions, the samples (per
    iteration, the slowest rank's: each segment's seconds, the tail, t_bp, each position's ready time) and the
    fraction of rows each row-sparse embedding's gradient touched."""
    import dearopt.backends.runtime as runtime
    from dearopt.engine.tied import TiedEmbeddings
    from dearopt.planning.order import ForwardOrderRecorder, parameters_in_forward_order

    backend = runtime.get_backend()
    world = backend.size
    names = {id(p): n for n, p in model.named_parameters()}
    owned = {id(p) for p in trainable}
    tied = TiedEmbeddings(model, owned if embedding_rows else set(), lambda method: method)
    recorder = ForwardOrderRecorder()
    marks: Dict[int, float] = {}  # id(module) -> when it first ran in this iteration

    def mark(module, args):
        recorder.saw(module)
        marks.setdefault(id(module), time.perf_counter())

    hooks = []
    for module in model.modules():
        if any(id(p) in owned for p in module.parameters(recurse=False)):
            hooks.append(module.register_forward_pre_hook(mark))
    planned = trainable + tied.twin_params()
    ready_at: Dict[int, List[float]] = {id(p): [] for p in planned}
    t0 = [0.0]
    # On a GPU the host runs ahead of the kernels: the phases are timed to the device's end of them (the
    # per-module and per-gradient stamps are still the host's issue times)
    on_gpu = any(p.is_cuda for p in trainable)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for p in planned:
        hooks.append(
            p.register_post_accumulate_grad_hook(lambda q: ready_at[id(q)].append(time.perf_counter() - t0[0]))
        )
    timings: List[List[float]] = []  # per repeat: forward segments, tail, t_bp, ready time per planned parameter
    rows_touched: Dict[int, List[float]] = {}
    try:
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            for twin in tied.twin_params():
                twin.grad = None
            if world > 1:  # the ranks compute together, as in training
                backend.all_reduce(torch.zeros(1, device=backend.device)).wait()
            if i == 0:
                recorder.start()
            marks.clear()
            sync()
            start = time.perf_counter()
            loss = run()
            sync()
            end_fwd = time.perf_counter()
            if i == 0:
                order = recorder.stop()
            t0[0] = time.perf_counter()
            loss.backward()
            sync()
            t_bp = time.perf_counter() - t0[0]
            if i == 0:
                for p in planned:
                    ready_at[id(p)].clear()
                continue
            stamps = [marks.get(id(m), start) for m in order]
            sample = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
            sample += [end_fwd - (stamps[-1] if stamps else start), t_bp]
            sample += [ready_at[id(p)][-1] if ready_at[id(p)] else 0.0 for p in planned]
            if world > 1:  # a synchronous job runs at its slowest rank: per sample, each time from the slowest
                vector = torch.tensor(sample, dtype=torch.float64, device=backend.device)
                backend.all_reduce(vector, "max").wait()
                sample = vector.tolist()
            timings.append(sample)
            for owner_id, width in tied.row_numel.items():
                grad = next(p for p in trainable if id(p) == owner_id).grad
                if grad is not None:
                    rows_touched.setdefault(owner_id, []).append(float(grad.view(-1, width).any(1).float().mean()))
    finally:
        for h in hooks:
            h.remove()
        tied.restore()
        model.zero_grad(set_to_none=True)
    twins_by_module: Dict[int, List[torch.Tensor]] = {}
    for uses in tied.twins.values():
        for module, _, twin in uses:
            twins_by_module.setdefault(id(module), []).append(twin)
    ordered = parameters_in_forward_order(model, order, planned, twins_by_module)
    position = {id(p): i for i, p in enumerate(ordered)}
    specs = []
    for i, p in enumerate(ordered):
        dtype, size = str(p.dtype).replace("torch.", ""), p.element_size()
        owner = tied.owner_of.get(id(p))
        if owner is not None:
            specs.append(
                ParamSpec(
                    f"{names.get(id(owner), 'tied weight')} (tied use)",
                    p.numel(),
                    dtype,
                    size,
                    twin_of=position[id(owner)],
                )
            )
        else:
            specs.append(
                ParamSpec(names.get(id(p), f"param{i}"), p.numel(), dtype, size, row_numel=tied.row_numel.get(id(p), 0))
            )
    # forward segments, attributed to the parameters of each module, in the order modules ran
    n_seg = len(order)
    column = {id(p): n_seg + 2 + j for j, p in enumerate(planned)}  # a sample's ready time of each parameter
    samples = [sample[: n_seg + 2] + [sample[column[id(p)]] for p in ordered] for sample in timings]
    owners = []
    for module in order:
        own = [position[id(p)] for p in module.parameters(recurse=False) if id(p) in position]
        own += [position[id(t)] for t in twins_by_module.get(id(module), ())]
        owners.append(sorted(own))
    rows_fraction = {position[k]: _median(v) for k, v in rows_touched.items() if k in position}
    return specs, owners, samples, rows_fraction


def _copy_cost(nbytes: int, repeats: int) -> float:
    """Seconds per byte of copying one bucket-sized gradient into another buffer (as the engine copies each
    gradient into its bucket and averages each reduced region: one read and one write per element)."""
    n = max(nbytes // 4, 1)
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)  # first touch
    timings = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        dst.copy_(src)
        timings.append(time.perf_counter() - t)
    return _median(timings) / (n * 4)


def _update_cost(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> Tuple[float, float]:
    """Seconds per element and per call of the optimizer's step, timed on copies of the parameters."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c in copies:
        c.grad = torch.randn_like(c) * 1e-3
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in ("params",)}
    try:
        shadow = type(optimizer)(copies, **defaults)
        small = [torch.nn.Parameter(torch.zeros(1))]
        small[0].grad = torch.zeros(1)
        tiny = type(optimizer)(small, **defaults)
    except Exception:  # an optimizer that cannot be rebuilt from its defaults: no update cost in the model
        return 0.0, 0.0
    shadow.step()  # state is created on the first step
    tiny.step()
    timings, tiny_timings = [], []
    for _ in range(3):
        t = time.perf_counter()
        shadow.step()
        timings.append(time.perf_counter() - t)
        t = time.perf_counter()
        tiny.step()
        tiny_timings.append(time.perf_counter() - t)
    per_call = _median(tiny_timings)
    elements = sum(p.numel() for p in params)
    return max(_median(timings) - per_call, 0.0) / max(elements, 1), per_call


def _comm_fits(backend, sizes: Sequence[int], repeats: int):
    comm, samples = {}, {}
    world = backend.size
    for kind in KINDS:
        samples[kind] = []
        for nbytes in sizes:
            n = max(world, (nbytes // 4) // world * world)
            full = torch.ones(n, device=backend.device)
            shard = torch.ones(n // world, device=backend.device)
            ops = {
                "reduce_scatter": lambda: backend.reduce_scatter(shard, full),
                "all_gather": lambda: backend.all_gather(full, shard),
                "all_reduce": lambda: backend.all_reduce(full),
                "broadcast": lambda: backend.broadcast(full, 0),
            }
            times = []
            for i in range(repeats + 1):
                backend.all_reduce(torch.zeros(1, device=backend.device)).wait()  # start together
                t = time.perf_counter()
                ops[kind]().synchronize()
                if i:
                    times.append(time.perf_counter() - t)
            # per repeat the slowest rank's time, as the benchmark's parts are taken: the op is done when it is
            # done everywhere (one rank's own time read a reduce-scatter on a shaped link up to 10 % short)
            slowest = torch.tensor(times, dtype=torch.float64, device=backend.device)
            backend.all_reduce(slowest, "max").wait()
            samples[kind].append((n * 4.0, _median(slowest.tolist())))
        comm[kind] = fit(kind, samples[kind], world)
    return comm, samples


def _model_pieces(backend, total_bytes: int, bucket_bytes: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The model's ``total_bytes`` of float32 in buckets of ``bucket_bytes`` (sizes divisible by the world size),
    as the engine issues them: per bucket the full tensor and a shard-sized one."""
    world = backend.size
    per = max(world, (bucket_bytes // 4) // world * world)
    left = max(world, (total_bytes // 4) // world * world)
    pieces = []
    while left > 0:
        n = min(per, left)
        pieces.append((torch.ones(n, device=backend.device), torch.ones(n // world, device=backend.device)))
        left -= n
    return pieces


def within_workspace(pieces: Sequence[Tuple[torch.Tensor, torch.Tensor]], workspace: float) -> list:
    """The first of ``pieces`` (full, shard) whose reduce-scatters or all-gathers the backend starts without
    waiting: their full buffers together within ``workspace`` bytes (at least one piece; all where 0).

    Past the workspace (gloo's all-to-alls: 64 MiB) starting one more waits on the host for the oldest in flight;
    the model's 100 MB of ResNet-50 started at a phase's start held the host ~0.1 s unshaped and ~0.2 s at
    3 Gbit/s before the phase could compute, which the contention measurement read as compute lost to the
    collectives' CPU (2.3-2.9 ns/B, compute at its 5 % floor while any op was on the link: every plan predicted
    as compute plus communication)."""
    if not workspace:
        return list(pieces)
    chosen, held = [], 0
    for full, shard in pieces:
        size = full.numel() * full.element_size()
        if chosen and held + size > workspace:
            break
        chosen.append((full, shard))
        held += size
    return chosen


def _stream_times(backend, total_bytes: int, bucket_bytes: int, repeats: int) -> Dict[str, List[float]]:
    """Per kind (reduce-scatter, all-gather, all-reduce): the model's bytes in buckets of ``bucket_bytes``, the
    ops started back to back as the engine starts them, waited for together: ``[total bytes, ops, seconds]``
    (per repeat the slowest rank's time, then the median)."""
    pieces = _model_pieces(backend, total_bytes, bucket_bytes)
    start = {
        "reduce_scatter": lambda full, shard: backend.reduce_scatter(shard, full),
        "all_gather": lambda full, shard: backend.all_gather(full, shard),
        "all_reduce": lambda full, shard: backend.all_reduce(full),
    }
    out = {}
    for kind, op in start.items():
        times = []
        for _ in range(repeats):
            backend.all_reduce(torch.zeros(1, device=backend.device)).wait()  # start together
            t = time.perf_counter()
            for h in [op(full, shard) for full, shard in pieces]:
                h.synchronize()
            times.append(time.perf_counter() - t)
        slowest = torch.tensor(times, dtype=torch.float64, device=backend.device)
        backend.all_reduce(slowest, "max").wait()
        out[kind] = [float(sum(full.numel() * 4 for full, _ in pieces)), float(len(pieces)), _median(slowest.tolist())]
    return out


def stream_calibrated(cost: CommCost, stream: Sequence[float], world: int) -> CommCost:
    """``cost`` with its ``beta`` such that it reproduces ``stream`` (``[bytes, ops, seconds]`` of back-to-back
    ops of its kind, :func:`_stream_times`), its ``alpha`` kept: one op timed alone per size (the fit) cost
    ~4 % more per byte than ops started behind one another (BERT-Base at 3 Gbit/s: the fits gave 2.50 s for
    36 reduce-scatters and all-gathers the job ran in 2.40 s), and back to back is how the engine runs them
    wherever the link is the bottleneck.  A stream that leaves nothing beyond the fixed costs keeps the fit."""
    total, ops, seconds = stream
    steps, fraction = op_steps(cost.kind, world)
    moving = seconds - ops * steps * cost.alpha
    if total <= 0 or moving <= 0 or fraction <= 0:
        return cost
    return dataclasses.replace(cost, beta=moving / (fraction * total))


def _contention(
    backend, model, run, total_bytes: int, bucket_bytes: int, repeats: int, lost_repeats: int = 7
) -> Tuple[Dict[str, float], Dict[str, float], Dict[str, List[List[float]]]]:
    """How much compute slows while collectives run, forward (all-gathers) and backward (reduce-scatters, and
    all-reduces).

    Two measures.  ``contention`` (gamma per phase): compute alone, the model's
    worth of collectives alone, and both together (:func:`contention_from_overlap`).
    It is ill-conditioned where the collectives are short against the compute
    (an unshaped link: a few milliseconds of noise read as a 20x slowdown).
    ``cpu_per_byte``: the compute seconds lost per byte communicated meanwhile.
    Each phase runs alone and again with as many collectives started at its
    start as take about half its time alone (the model's buckets, repeated up to
    8 times where they are quick), no more than the backend starts without waiting
    (:func:`within_workspace`), so the compute outlasts them and every second
    it loses is the collectives' CPU (the time the host takes to start them is
    not counted: :func:`dearopt.sim.simulate` charges the host that work where
    the engine does it): the median of ``lost_repeats`` samples, each
    the ranks' mean of their own loss.  On a CPU machine that cost goes mostly
    with the bytes the ranks copy, sum and push through sockets, so it carries
    over to plans (and links) whose ops are busy for other lengths of time,
    where a factor per second of link time does not.
    The collectives are issued in buckets of ``bucket_bytes``, as the engine
    issues them.  All-reduces are measured on their own (key ``"all_reduce"``,
    per byte of the buffer, in backward): on gloo an all-reduce runs in place as
    gloo's ring while a reduce-scatter and an all-gather are all-to-alls through
    buffers, and the two do not cost the same CPU per byte (ResNet-50 at 3 Gbit/s
    on this 2-core machine: backward lost ~0.1 s to the model's 102 MB of
    all-reduces, the forward ~0.14 s to its all-gathers).
    """
    world = backend.size
    device = backend.device
    pieces = _model_pieces(backend, total_bytes, bucket_bytes)

    def start(kind, chosen):
        if kind == "all_gather":
            return [backend.all_gather(full, shard) for full, shard in chosen]
        if kind == "all_reduce":
            return [backend.all_reduce(full) for full, _ in chosen]
        return [backend.reduce_scatter(shard, full) for full, shard in chosen]

    def finish(handles):
        for h in handles:
            h.synchronize()

    def align():
        backend.all_reduce(torch.zeros(1, device=device)).wait()

    def phase_time(phase, chosen, kind=None) -> Tuple[float, float]:
        """Seconds of the phase (forward, or backward) with ``chosen`` collectives started at its start, less the
        time the host took to start them (an all-gather's send buffer filled, a start that waited for room in the
        backend's workspace: the host's own work, not compute slowed), and seconds until both the phase and the
        collectives are done."""
        kind = kind or ("all_gather" if phase == "forward" else "reduce_scatter")
        model.zero_grad(set_to_none=True)
        if phase == "forward":
            align()
            t = time.perf_counter()
            handles = start(kind, chosen)
            started = time.perf_counter()
            run()
        else:
            loss = run()
            align()
            t = time.perf_counter()
            handles = start(kind, chosen)
            started = time.perf_counter()
            loss.backward()
        elapsed = time.perf_counter() - started
        finish(handles)
        return elapsed, time.perf_counter() - t

    def over_ranks(values, op):  # "max": per sample the slowest rank's (as the compute times); "sum" / world
        vector = torch.tensor(values, dtype=torch.float64, device=device)
        backend.all_reduce(vector, op).wait()
        return (vector if op == "max" else vector / world).tolist()

    gamma, per_byte, samples = {}, {}, {}
    # forward with all-gathers, backward with reduce-scatters (their samples pooled: one cost per byte of either),
    # and backward with all-reduces, measured on their own (key "all_reduce": per byte of the buffer)
    for key, phase, kind in (
        ("forward", "forward", "all_gather"),
        ("backward", "backward", "reduce_scatter"),
        ("all_reduce", "backward", "all_reduce"),
    ):
        alone, comm, both = [], [], []
        for _ in range(repeats):
            compute = phase_time(phase, [])[0]
            align()
            t = time.perf_counter()
            finish(start(kind, pieces))
            collectives = time.perf_counter() - t
            together = phase_time(phase, pieces, kind)[1] if key in ("forward", "backward") else 0.0
            compute, collectives, together = over_ranks([compute, collectives, together], "max")
            alone.append(compute)
            comm.append(collectives)
            both.append(together)
        c, t_comm = _median(alone), _median(comm)
        if key in ("forward", "backward"):
            gamma[phase] = contention_from_overlap(c, t_comm, _median(both))
        # as many collectives as take about half the phase alone: the compute outlasts them
        per_piece = t_comm / len(pieces)
        count = max(1, min(8 * len(pieces), int(0.5 * c / per_piece))) if per_piece > 0 else len(pieces)
        chosen = [pieces[i % len(pieces)] for i in range(count)]
        if kind != "all_reduce":  # an all-reduce runs in place, in no workspace
            chosen = within_workspace(chosen, workspace_of(backend))
        nbytes = sum(full.numel() * full.element_size() for full, _ in chosen)
        lost, samples[key] = [], []
        for _ in range(max(repeats, lost_repeats)):
            with_comm, without = phase_time(phase, chosen, kind)[0], phase_time(phase, [])[0]
            # each rank's own loss, averaged over the ranks: what one rank loses per byte.  The slowest rank's
            # phase with less the slowest rank's without is a difference of two maxima; with 3 ranks on 2 cores
            # its 7-sample median of backward read 1.37, 1.56, 2.73 and 3.24 ns/B in four runs of one cell,
            # this estimator 1.31, 1.35, 1.63 and 1.76 (and the largest per-rank difference is noisier still)
            own = [0.0] * world
            own[backend.rank] = with_comm - without
            every = over_ranks(own, "sum")  # each rank's own loss (divided by world: scaled back below)
            samples[key].append([v * world / nbytes for v in every])
            lost.append(sum(every))
        per_byte[key] = max(_median(lost), 0.0) / nbytes
    model.zero_grad(set_to_none=True)
    return gamma, per_byte, samples
