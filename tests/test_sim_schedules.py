"""On a profile recorded by the bench, every schedule gets its own prediction: the overlap a schedule's plan allows
shows in its predicted iteration, and the bench's predictions pass each schedule its own plan.

The issue this guards against: from one bench run's own profile DDP, ``wfbp`` and ``dear`` were all predicted
1.273 s (measured 1.193, 0.971 and 0.928 s), because the recorded CPU cost of the collectives held the replayed
compute at its floor whenever an op was on the link, so every plan predicted as its compute plus its
communication.
"""

import dataclasses
import json
import os

import pytest

from dearopt.bench.report import predictions
from dearopt.sim import Profile, link_costs, plan_for, predict, predict_ddp
from dearopt.sim.simulator import compute_rate, cpu_costs

DATA = os.path.join(os.path.dirname(__file__), "data", "sim-resnet50-3gbit.json")
MiB = 2**20


@pytest.fixture(scope="module")
def run():
    with open(DATA) as fh:
        return json.load(fh)


def link_bound(profile: Profile, link: str) -> Profile:
    """The recorded profile with its collectives on a slower link, where the link is the bottleneck."""
    return dataclasses.replace(profile, comm=link_costs(profile, link))


def test_the_recorded_profile_leaves_compute_running_while_a_bucket_is_on_the_link(run):
    # a 25 MiB reduce-scatter, all-gather or all-reduce takes only part of the compute's speed while on the link;
    # the profiles of the issue held it at the 5 % floor (2.3-2.9 ns/B against ~2.8 ns/B of link time)
    profile = Profile.from_json(run["profile"])
    for kind, cost in profile.comm.items():
        if kind == "broadcast":
            continue
        seconds = cost.time(25 * MiB, profile.world)
        assert compute_rate(1.0, cpu_costs(profile)[kind] * 25 * MiB, seconds) > 0.3, kind


def test_each_schedule_is_predicted_from_its_own_overlap_where_the_link_is_the_bottleneck(run):
    profile = link_bound(Profile.from_json(run["profile"]), "500mbit")
    size = int(run["bucket_mb"] * MiB)
    blocks = run["plans"]["prophet"][0]["groups"]
    wfbp = predict(profile, "wfbp", buffer_size=size)
    dear = predict(profile, "dear", buffer_size=size, allreduce=())  # DeAR's plan: every bucket scattered
    prophet = predict(profile, "prophet", buffer_size=size, groups=blocks)
    rsag = predict(profile, "rsag", buffer_size=size)
    # dear gathers during the next forward and scatters during backward: it hides more than wfbp, whose
    # all-reduces only overlap backward; rsag sends the same bytes as dear, all of them in backward; prophet's
    # blocks are dear's ops with every gather started at step()
    assert dear.iteration < 0.95 * wfbp.iteration
    assert dear.iteration < 0.9 * rsag.iteration
    assert prophet.iteration < wfbp.iteration < rsag.iteration
    times = sorted(p.iteration for p in (wfbp, dear, prophet, rsag))
    assert all(b > 1.01 * a for a, b in zip(times, times[1:]))  # four plans, four predictions
    # the phases carry the difference: dear's forward waits for gathers, wfbp's backward for all-reduces
    assert dear.forward > wfbp.forward and dear.backward < wfbp.backward


def test_the_bench_predicts_ddp_on_its_buckets_and_every_schedule_with_the_plan_that_ran(run):
    profile = link_bound(Profile.from_json(run["profile"]), "500mbit")
    doc = {
        "bucket_mb": run["bucket_mb"],
        "profile": profile.to_json(),
        "schedules": {s: {} for s in ("ddp", "wfbp", "dear", "prophet")},
        "plans": {
            "dear": [dict(run["plans"]["prophet"][0], allreduce=[], groups=None, kept="predicted")],
            "prophet": run["plans"]["prophet"],
        },
    }
    predicted = {name: p["iter"] for name, p in predictions(doc).items()}
    size = int(run["bucket_mb"] * MiB)
    # DDP: wfbp's kind of plan on DDP's own buckets (1 MiB first, then 25 MiB closed by the tensor that reaches it)
    assert predicted["ddp"] == pytest.approx(predict_ddp(profile, bucket_cap_mb=run["bucket_mb"]).iteration)
    assert predicted["ddp"] != pytest.approx(predicted["wfbp"], rel=1e-3)  # other buckets than wfbp's own layout
    assert predicted["wfbp"] == pytest.approx(predict(profile, "wfbp", buffer_size=size).iteration)
    assert predicted["dear"] == pytest.approx(predict(profile, "dear", buffer_size=size, allreduce=()).iteration)
    assert predicted["dear"] < 0.95 * predicted["wfbp"]
    assert predicted["prophet"] != pytest.approx(predicted["wfbp"], rel=0.02)
    # dear's plan as it ran: every bucket all-reduced in backward is wfbp's plan, predicted as wfbp
    doc["plans"]["dear"][0]["allreduce"] = list(range(len(plan_for(profile, "wfbp", buffer_size=size).buckets)))
    assert predictions(doc)["dear"]["iter"] == pytest.approx(predicted["wfbp"], rel=1e-6)


def test_deft_is_predicted_by_its_own_schedule_not_as_the_all_reduce_plan_it_sends_on():
    # predict(profile, "deft") once replayed deft's plan as wfbp's (an all-reduce per bucket in backward, waited
    # for at its end): the same time as wfbp to the microsecond, whatever deft's schedule sends when
    from dearopt.schedules.deft.rounds import deft_times, profile_reduction
    from dearopt.schedules.deft.schedule import deft_schedule
    from dearopt.sim.deft import schedule_from_json, simulate_deft

    with open(os.path.join(os.path.dirname(DATA), "sim-resnet50-3gbit-s58.json")) as fh:
        run = json.load(fh)  # a bench run of ResNet-50 at 3 Gbit/s whose deft rounds recorded their schedules
    profile = Profile.from_json(run["profile"])
    size = int(run["bucket_mb"] * MiB)
    wfbp = predict(profile, "wfbp", buffer_size=size)
    deft = predict(profile, "deft", buffer_size=size)
    parts = ("forward", "backward", "step")
    assert max(abs(getattr(deft, k) - getattr(wfbp, k)) for k in parts) > 0.02 * wfbp.iteration
    assert deft.step < 0.5 * wfbp.step  # under apply="bucket" step() waits for nothing and applies nothing
    assert deft.forward > wfbp.forward  # the forward stage's sends, and the late buckets' updates
    # by hand: the solver's schedule on deft's units, replayed by simulate_deft
    dense = profile.without_twins()
    plan = plan_for(dense, "deft", buffer_size=size)
    reduction = profile_reduction(dense, plan)
    solved = deft_schedule(*deft_times(dense, plan, reduction))
    want = simulate_deft(dense, plan, solved, reduction=reduction, apply="bucket")
    assert deft.iteration == pytest.approx(want.iteration)
    # a schedule passed in is the one replayed: the bench's recorded one gives the bench's prediction
    recorded = run["plans"]["deft"][0]
    given = predict(
        profile,
        "deft",
        buffer_size=recorded["buffer_size"],
        partition_size=recorded["deft"]["partition_size"],
        groups=recorded.get("groups"),
        deft=schedule_from_json(recorded["deft"]["schedule"]),
        apply=recorded["deft"].get("apply", "group"),
    )
    doc = dict(run, schedules={"deft": {}}, plans={"deft": [recorded]})
    assert given.iteration == pytest.approx(predictions(doc)["deft"]["iter"])
    with pytest.raises(ValueError, match="contention"):
        predict(profile, "deft", buffer_size=size, contention={"forward": 0.0, "backward": 0.0})
    # a bucket longer on a slow link than a whole stage: the error names the knobs that split it
    with pytest.raises(ValueError, match="partition_size"):
        predict(profile, "deft", buffer_size=size, link="100mbit")
