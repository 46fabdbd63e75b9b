"""On profiles recorded by the bench (``tests/data/sim-resnet50-3gbit-s57.json``, ``-s58.json``: ResNet-50 at 3 Gbit/s,
2 ranks on a loaded 2-core machine; ``sim-bert-3gbit-s63.json``: BERT-Base with its tied decoder at 3 Gbit/s), the
prediction of each schedule follows its own plan and lands within 10 % of the iteration measured in the same run
(read from the fixture).

What this guards against: from these runs' own profiles the overlap schedules were predicted 14-25 % slow (s58:
wfbp +17.8 %, dear +18.0 %, prophet +23.4 %), because (1) the CPU the collectives take from compute was read as the
median of the slowest rank's loss per sample, which on samples dominated by timing noise (single ranks -12 to +23
ns/B) reads the noise as loss, and (2) the replay held the host at a full gloo workspace wherever it started an op,
where the executor's issuer leaves such an op for a later poll unless it is due now.
"""

import json
import os

import pytest

from dearopt.bench.report import predictions
from dearopt.sim import Profile
from dearopt.sim.simulator import cpu_costs, resolved

DATA = os.path.join(os.path.dirname(__file__), "data")
RUNS = ("sim-resnet50-3gbit-s57.json", "sim-resnet50-3gbit-s58.json")
BERT = "sim-bert-3gbit-s63.json"  # ddp, wfbp, dear; dear's measured choice kept another plan in each round


def load(name):
    with open(os.path.join(DATA, name)) as fh:
        return json.load(fh)


@pytest.fixture(scope="module", params=RUNS)
def run(request):
    doc = load(request.param)
    return doc, predictions(doc)


def test_every_schedule_of_the_run_is_predicted(run):
    doc, predicted = run
    assert set(predicted) == set(doc["schedules"]) == {"ddp", "wfbp", "dear", "prophet", "deft"}


def test_schedules_with_different_plans_get_different_predictions(run):
    # a prediction that ignores the schedule gives every schedule the same forward, backward and step; here each
    # pair of plans differs by at least 2 % of the iteration in some phase.  DDP runs wfbp's kind of plan on its own
    # buckets: the same forward, and a backward that ends later, since the last bucket backward fills (the input
    # side's, reduced after backward) is what is left of DDP's greedy fill from the output side (7.5 MB here)
    # where wfbp's own layout leaves the remainder small at that end (2.6 MB)
    doc, predicted = run
    parts = ("forward", "backward", "step")
    assert predicted["ddp"]["forward"] == pytest.approx(predicted["wfbp"]["forward"])
    assert predicted["ddp"]["backward"] > predicted["wfbp"]["backward"] + 0.01
    names = ["wfbp", "dear", "prophet", "deft"]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            gap = max(abs(predicted[a][k] - predicted[b][k]) for k in parts)
            assert gap > 0.02 * predicted[a]["iter"], (a, b, predicted[a], predicted[b])
    # dear and prophet gather in the forward, wfbp does not; deft's step applies nothing it waits for
    assert predicted["dear"]["forward"] > predicted["wfbp"]["forward"] + 0.05
    assert predicted["prophet"]["forward"] > predicted["wfbp"]["forward"] + 0.05
    assert predicted["deft"]["step"] < predicted["dear"]["step"]


# s58's wfbp: its plan is DDP's but for the buckets' edges, which the same run measured at 2.011 s, 12 % slower
# than wfbp's 1.792 s; the prediction, 1.998 s (DDP's 2.018 s), is +11.5 % of wfbp
KNOWN_MISSES = {("sim-resnet50-3gbit-s58.json", "wfbp")}


@pytest.mark.parametrize(
    "name,schedule",
    [
        pytest.param(
            n,
            s,
            marks=pytest.mark.xfail(reason="the same plan measured 12 % apart as ddp and wfbp", strict=False)
            if (n, s) in KNOWN_MISSES
            else (),
        )
        for n in RUNS
        for s in ("ddp", "wfbp", "dear", "prophet", "deft")
    ]
    + [(BERT, s) for s in ("ddp", "wfbp", "dear")],
)
def test_each_prediction_is_within_10_percent_of_the_iteration_measured_in_the_same_run(name, schedule):
    doc = load(name)
    predicted = predictions(doc)[schedule]["iter"]
    measured = doc["schedules"][schedule]["iter_time"]
    assert abs(predicted / measured - 1) < 0.10, (schedule, predicted, measured)


def test_ddp_is_predicted_reducing_a_tied_weight_once_when_backward_has_finished_with_it():
    # BERT's decoder shares the word embedding (23.4 M of its 109.5 M parameters): DDP all-reduces that weight's
    # one gradient, densely, once its last use in backward (the embedding lookup, at the end) has accumulated it;
    # dearopt's schedules reduce the decoder's part as soon as it is ready and the lookup's rows apart.  Before,
    # DDP was predicted as wfbp (13.8 % below the 6.057 s this run measured; now 5.9 %).
    from dearopt.sim import ddp_groups, predict, predict_ddp

    doc = load(BERT)
    profile = Profile.from_json(doc["profile"])
    got = predictions(doc)
    seen = profile.without_twins()
    want = predict(seen, "wfbp", buffer_size=25 * 2**20, groups=ddp_groups(seen))
    assert got["ddp"]["iter"] == pytest.approx(want.iteration) == pytest.approx(predict_ddp(profile).iteration)
    tied = next(p for p in profile.params if p.twin_of is None and any(q.twin_of is not None for q in profile.params))
    tail = profile.comm["all_reduce"].time(tied.numel * tied.element_size, profile.world)  # its all-reduce alone
    assert got["ddp"]["backward"] - got["wfbp"]["backward"] > 0.5 * tail
    assert got["ddp"]["forward"] == pytest.approx(got["wfbp"]["forward"])


def test_dear_is_predicted_round_by_round_with_the_plan_each_round_kept():
    # dear's measured choice kept all-reduces for 16 of 20 buckets in round 1, Prophet's blocks in round 2 (35
    # buckets, every all-gather at step()) and the predicted plan in round 3; each round is predicted with its own
    # plan and the schedule with their mean (the rounds time as many iterations each).  Before, one plan stood for
    # all three (the most frequent all-reduced set with round 1's flags): +12.0 % against this run, now +7.8 %.
    from dearopt.bench.report import _round_knobs
    from dearopt.sim import predict

    doc = load(BERT)
    profile = Profile.from_json(doc["profile"])
    rounds = doc["plans"]["dear"]
    assert [r["kept"] for r in rounds] == [1.0, "blocks", "predicted"]
    got = predictions(doc)["dear"]
    want = [predict(profile, "dear", **_round_knobs(doc, "dear", {}, r)) for r in rounds]
    assert got["rounds"] == pytest.approx([p.iteration for p in want])
    assert got["iter"] == pytest.approx(sum(p.iteration for p in want) / 3)
    assert _round_knobs(doc, "dear", {}, rounds[1])["gathers_at_step"] is True
    assert len(rounds[0]["allreduce"]) == 16 and _round_knobs(doc, "dear", {}, rounds[0])["allreduce"] == tuple(
        rounds[0]["allreduce"]
    )
    # all-reducing most buckets in backward leaves the forward nothing to gather: the shortest forward
    assert want[0].forward < min(want[1].forward, want[2].forward) - 0.2


def test_noisy_loss_samples_count_as_the_ranks_mean_not_the_largest_rank(run):
    # single ranks read below zero in these runs: their largest per sample is noise as much as loss; the
    # reduce-scatters' and all-gathers' cost is the median of the ranks' means (before: of the largest, which
    # read 2.3-2.7 ns/B where the means read 0.3-0.9)
    doc, _ = run
    profile = Profile.from_json(doc["profile"])
    samples = [s for k in ("forward", "backward") for s in profile.lost_samples[k]]
    assert profile.cores_per_rank >= 1 and not resolved(samples)
    means = sorted(sum(s) / len(s) for s in samples)
    largest = sorted(max(s) for s in samples)
    median = lambda v: (v[len(v) // 2] + v[(len(v) - 1) // 2]) / 2  # noqa: E731
    assert cpu_costs(profile)["reduce_scatter"] == pytest.approx(max(median(means), 0.0))
    assert median(largest) > 2 * median(means)


@pytest.mark.parametrize("name", RUNS + (BERT,))
def test_ddp_groups_are_the_buckets_torch_ddp_forms(name):
    # torch's own assignment (what DDP's reducer calls when it rebuilds its buckets after the first iteration) on
    # tensors of the profiled sizes in the order backward made them ready, 1 MiB first and 25 MiB after
    import torch
    import torch.distributed as dist

    from dearopt.sim import ddp_groups

    seen = Profile.from_json(load(name)["profile"]).without_twins()
    order = sorted(range(len(seen.params)), key=lambda i: (seen.ready[i], -i))
    tensors = [torch.empty(seen.params[i].numel) for i in order]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, [2**20, 25 * 2**20], [False] * len(tensors), list(range(len(tensors)))
    )
    want = sorted(sorted(order[j] for j in b) for b in buckets)
    assert ddp_groups(seen) == want
    assert all(g == list(range(g[0], g[-1] + 1)) for g in want)  # contiguous: the plan takes them as they are
