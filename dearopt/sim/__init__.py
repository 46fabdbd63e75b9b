"""``dearopt.sim``: predict a plan's iteration time from a measured profile, here or at P ranks on another link.

    from dearopt.sim import Profile, record_profile, simulate, predict
    profile = record_profile(model, lambda: loss_fn(model(x), y), optimizer)   # on every rank
    profile.save("profile.json")
    prediction = predict(profile, "dear", ranks=64, link="10gbit")
    prediction.iteration, prediction.parts()

or ``python -m dearopt.sim --profile profile.json --schedule dear --ranks 64 --link 10gbit``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from dearopt.planning.plan import DEFAULT_BUFFER_SIZE, DEFAULT_FIRST_BUCKET_SIZE, Plan

from dearopt.planning.build import build_plan
from dearopt.sim.cost import CommCost, fit, parse_link
from dearopt.sim.profile import Profile, contention_from_overlap, record_profile
from dearopt.sim.simulator import Prediction, simulate

__all__ = [
    "Profile",
    "record_profile",
    "simulate",
    "predict",
    "plan_for",
    "best_buffer_size",
    "ddp_groups",
    "predict_ddp",
    "predict_deft",
    "Prediction",
    "CommCost",
    "fit",
    "parse_link",
    "contention_from_overlap",
]


def plan_for(
    profile: Profile,
    schedule: str,
    ranks: Optional[int] = None,
    *,
    buffer_size=DEFAULT_BUFFER_SIZE,
    first_bucket_size=DEFAULT_FIRST_BUCKET_SIZE,
    **knobs,
) -> Plan:
    """The plan ``DistOptim`` would make for the profiled model (``knobs``: partition_size, credit, priority,
    allreduce; ``allreduce="auto"`` decides from the profile, as the executor does from its profile of steps 1-3)."""
    world = ranks or profile.world
    if knobs.get("allreduce", "auto") == "auto" and profile.comm:
        from dearopt.planning.plan import layout_buckets
        from dearopt.schedules import get_schedule

        buckets = layout_buckets(profile.params, buffer_size, world, None, first_bucket_size)
        # the bandwidth the executor's profile measures: of the schedule's own reduction
        rs = profile.comm.get(get_schedule(schedule).reduction, profile.comm["reduce_scatter"])
        nbytes = sum(b.padded_numel * b.element_size for b in buckets)
        seconds = sum(rs.time(b.padded_numel * b.element_size, world) for b in buckets)
        knobs = dict(
            knobs,
            allreduce="auto",
            ready_times=profile.ready,
            bandwidth=nbytes / seconds if seconds > 0 else None,
            latency=rs.time(0, world),
            phases=(profile.t_ff, profile.t_bp),
        )
    return build_plan(profile.params, buffer_size, world, schedule, first_bucket_size=first_bucket_size, **knobs)


def link_costs(profile: Profile, link: Optional[str] = None, latency: Optional[float] = None) -> Dict[str, CommCost]:
    """The profile's collective costs, or the same collectives on another link."""
    if link is None and latency is None:
        return dict(profile.comm)
    bits = parse_link(link) if link else None
    return {
        k: (c.on_link(bits, latency) if bits else CommCost(c.kind, latency, c.beta)) for k, c in profile.comm.items()
    }


def predict(
    profile: Profile,
    schedule: str,
    *,
    ranks: Optional[int] = None,
    link: Optional[str] = None,
    latency: Optional[float] = None,
    contention: Optional[Dict[str, float]] = None,
    **knobs,
) -> Prediction:
    """Predict ``schedule`` on ``ranks`` ranks (default: the profiled number) on ``link`` (default: the profiled
    link), with the plan's knobs (buffer_size, first_bucket_size, partition_size, credit, ...).

    A schedule that delays updates (``deft``) is predicted by :func:`predict_deft`: its own knobs are ``deft``
    (a solved :class:`~dearopt.schedules.deft.schedule.DeftSchedule`; default: the one the profile solves) and
    ``apply``."""
    from dearopt.schedules import get_schedule

    if get_schedule(schedule).delays_updates:
        if contention is not None:
            raise ValueError(
                f"{schedule!r} is predicted with the CPU the profile measured its collectives to take; "
                f"contention= is not modelled for it: leave it out"
            )
        return predict_deft(profile, ranks=ranks, link=link, latency=latency, **knobs)
    plan = plan_for(profile, schedule, ranks, **knobs)
    return simulate(
        profile, plan, world=ranks or profile.world, comm=link_costs(profile, link, latency), contention=contention
    )


def predict_deft(
    profile: Profile,
    *,
    ranks: Optional[int] = None,
    link: Optional[str] = None,
    latency: Optional[float] = None,
    deft=None,
    reduction: Optional[str] = None,
    apply: str = "bucket",
    **knobs,
) -> Prediction:
    """Predict ``schedule="deft"``: its plan on the model as deft sees it (a tied weight one gradient, every
    gradient dense: :meth:`Profile.without_twins`), each unit summed the way the profile's costs favour, and
    ``deft``, a :class:`~dearopt.schedules.deft.schedule.DeftSchedule` (default: the one ``DistOptim`` solves
    when given this profile, :func:`~dearopt.schedules.deft.schedule.deft_schedule` on
    :func:`~dearopt.schedules.deft.rounds.deft_times`, on ``link``'s costs), replayed by
    :func:`dearopt.sim.deft.simulate_deft` with ``apply`` (``"bucket"``, the default, or ``"group"``).
    ``reduction``: how each unit is summed (``"all_reduce"`` or ``"reduce_scatter+all_gather"``, as a job
    records it); default: the faster by the profile's costs.

    The default schedule is the solver's, unchecked: the Preserver decides from the training loss, which a
    profile does not hold, and may raise the capacities until one update is applied per step.  To predict the
    schedule a job runs, pass it (``optimizer.schedule.deft``, or the bench's recorded one)."""
    from dearopt.schedules.deft.rounds import deft_times, profile_reduction
    from dearopt.schedules.deft.schedule import deft_schedule
    from dearopt.sim.deft import simulate_deft

    dense = profile.without_twins()
    dense = dataclasses.replace(dense, comm=link_costs(dense, link, latency))
    plan = plan_for(dense, "deft", ranks, **knobs)
    reduction = reduction or profile_reduction(dense, plan)
    if deft is None:
        try:
            deft = deft_schedule(*deft_times(dense, plan, reduction))
        except ValueError as exc:  # DeFT's partition constraint: a unit longer on the link than a stage
            raise ValueError(
                f"{exc}; predict with a smaller buffer_size or partition_size (python -m dearopt.sim: "
                f"--buffer-size, --partition-size), as DistOptim re-partitions where it measures its own times"
            ) from None
    return simulate_deft(dense, plan, deft, reduction=reduction, world=ranks or dense.world, apply=apply)


def best_buffer_size(profile: Profile, schedule: str, candidates: Sequence[int], **kwargs) -> int:
    """The buffer size of ``candidates`` with the shortest predicted iteration."""
    return min(candidates, key=lambda size: predict(profile, schedule, buffer_size=size, **kwargs).iteration)


DDP_FIRST_BUCKET_BYTES = 2**20  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


def ddp_groups(
    profile: Profile, bucket_bytes: int = 25 * 2**20, first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES
) -> List[List[int]]:
    """The buckets torch DDP runs for the profiled model (positions in forward order), as its reducer rebuilds
    them after the first iteration: the gradients in the order backward made them ready, each dtype filled on its
    own until a bucket reaches its limit (``first_bucket_bytes`` for the first, ``bucket_bytes`` after; the
    tensor that reaches it stays in, so a bucket may pass the limit), as ``torch.distributed``'s
    ``_compute_bucket_assignment_by_size`` does.  On the profile as DDP sees the model
    (:meth:`Profile.without_twins`: a tied weight is one gradient)."""
    order = sorted(range(len(profile.params)), key=lambda i: (profile.ready[i], -i))
    limits = (first_bucket_bytes, bucket_bytes)
    filling: Dict[str, Tuple[List[int], int, int]] = {}  # dtype -> (positions, bytes, which limit)
    out: List[List[int]] = []
    for i in order:
        spec = profile.params[i]
        members, size, limit = filling.get(spec.dtype, ([], 0, 0))
        members, size = members + [i], size + spec.numel * spec.element_size
        if size >= limits[limit]:
            out.append(members)
            members, size, limit = [], 0, min(limit + 1, len(limits) - 1)
        filling[spec.dtype] = (members, size, limit)
    out += [members for members, _, _ in filling.values() if members]
    return sorted(sorted(g) for g in out)


def predict_ddp(
    profile: Profile,
    *,
    bucket_cap_mb: float = 25.0,
    compute_scale: Optional[Tuple[float, float]] = None,
    contention: Optional[Dict[str, float]] = None,
) -> Prediction:
    """Predict torch DDP (``bucket_cap_mb``) on the profiled job: ``wfbp``'s plan (an all-reduce per bucket as its
    gradients are ready, waited for at backward's end) on DDP's own buckets (:func:`ddp_groups`) and on the model
    as DDP sees it (:meth:`Profile.without_twins`: DDP all-reduces a tied weight once, densely, after its last use
    in backward).  ``compute_scale``: (forward, backward) factors for compute timed in other processes than DDP's
    (:meth:`Profile.with_compute_scaled`).  Where DDP's buckets are not contiguous runs in forward order (dtypes
    interleaved), the layout of ``wfbp``'s own buckets stands in.  DDP's C++ reducer is otherwise replayed as the
    engine's passes (a copy into the bucket, one pass when waited for)."""
    seen = profile.without_twins()
    if compute_scale is not None:
        seen = seen.with_compute_scaled(*compute_scale)
    cap = int(bucket_cap_mb * 2**20)
    try:
        plan = plan_for(seen, "wfbp", buffer_size=cap, groups=ddp_groups(seen, cap))
    except ValueError:  # not contiguous in forward order
        plan = plan_for(seen, "wfbp", buffer_size=cap)
    return simulate(seen, plan, world=seen.world, comm=dict(seen.comm), contention=contention)
