"""The simulator against timelines computed by hand, and the alpha-beta fit against synthetic timings."""

import json
import os
import statistics

import pytest

from dearopt.planning.plan import ParamSpec

from dearopt.planning.build import build_plan
from dearopt.sim.cost import CommCost, fit, parse_link
from dearopt.sim.profile import Profile, contention_from_overlap, stream_calibrated
from dearopt.sim.simulator import cpu_costs, cpu_per_byte, simulate, workspace_passes
from dearopt.backends.base import workspace_op_bytes

# two parameters of 997 elements: each bucket holds 997 + 1 flag + 2 tags = 1000 float32 = 4000 bytes (2 ranks)
PARAMS = [ParamSpec("p0", 997, "float32", 4), ParamSpec("p1", 997, "float32", 4)]


def profile(beta, gamma=0.0):
    comm = {k: CommCost(k, alpha=0.0, beta=beta) for k in ("reduce_scatter", "all_gather", "all_reduce", "broadcast")}
    return Profile(
        params=PARAMS,
        forward_segments=[([0], 0.1), ([1], 0.1)],
        forward_tail=0.2,
        ready=[0.3, 0.1],
        t_bp=0.4,
        update_per_element=0.0,
        update_per_call=0.0,
        comm=comm,
        comm_samples={},
        contention={"forward": gamma, "backward": gamma},
        world=2,
    )


def plan(schedule):
    return build_plan(PARAMS, 4000, 2, schedule)


def test_wfbp_hides_what_fits_in_backward_and_waits_for_the_rest_at_its_end():
    # all-reduce of 4000 bytes on 2 ranks: 4000 * beta; gradients ready at 0.1 (p1) and 0.3 (p0), backward 0.4
    fast = simulate(profile(beta=2.5e-5), plan("wfbp"))  # 0.1 s each: 0.1-0.2, 0.3-0.4
    assert fast.iteration == pytest.approx(0.8) and fast.backward == pytest.approx(0.4)
    slow = simulate(profile(beta=1e-4), plan("wfbp"))  # 0.4 s each: 0.1-0.5, 0.5-0.9
    assert (slow.forward, slow.backward, slow.step) == pytest.approx((0.4, 0.9, 0.0))
    assert slow.iteration == pytest.approx(1.3)


def test_dear_overlaps_gathers_with_the_next_forward():
    # reduce-scatter and all-gather 0.2 s each.  Backward [0, 0.4]: RS1 0.1-0.3, RS0 0.3-0.5; step waits until 0.5,
    # AG0 0.5-0.7.  Forward: 0.1 of work, wait AG0 until 0.7, AG1 0.7-0.9, 0.1 of work, wait AG1 until 0.9,
    # 0.2 of tail: 1.1.  Per iteration: forward 0.6, backward 0.4, step 0.1.
    p = simulate(profile(beta=1e-4), plan("dear"))
    assert (p.forward, p.backward, p.step) == pytest.approx((0.6, 0.4, 0.1))
    assert p.iteration == pytest.approx(1.1)
    names = [e["name"] for e in p.events if e["cat"] == "comm"]
    assert names == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]


def test_only_the_host_starts_ops_an_op_needing_anothers_result_waits_for_the_next_hook():
    # rsag: rs1, ag1 (after rs1), rs0, ag0 (after rs0), 0.1 s each.  rs1 0.1-0.2 ends while backward computes:
    # ag1 starts at the next gradient hook (p0 ready, 0.3), rs0 behind it (0.4-0.5); at backward's end (0.4) the
    # host waits, completes rs0 at 0.5 and starts ag0: 0.5-0.6
    p = simulate(profile(beta=5e-5), plan("rsag"))
    assert (p.forward, p.backward, p.step) == pytest.approx((0.4, 0.6, 0.0))
    starts = [round(e["ts"] / 1e6 - p.forward, 6) for e in p.events if e["cat"] == "comm"]
    assert starts == pytest.approx([0.1, 0.3, 0.4, 0.5])


def test_compute_slows_while_the_link_is_busy():
    # gamma 1: half speed while an all-reduce runs.  Backward: 0-0.1 alone; AR1 0.1-0.2 (compute +0.05);
    # 0.2-0.35 alone (p0 ready); AR0 0.35-0.45 (+0.05); 0.45-0.5 alone: backward 0.5
    p = simulate(profile(beta=2.5e-5, gamma=1.0), plan("wfbp"))
    assert p.backward == pytest.approx(0.5) and p.iteration == pytest.approx(0.9)


def test_compute_loses_the_cpu_each_ops_bytes_take():
    # cpu_per_byte k (per byte of a reduce-scatter or an all-gather): while an op of n bytes is on the link for
    # d seconds, compute runs at 1 - k n / d, an all-reduce (both of them) at 1 - 2 k n / d.
    # k = 0.025 / 4000: each 4000-byte all-reduce (0.1 s) takes 0.05 s of CPU, half speed: the gamma = 1 case
    base = profile(beta=2.5e-5)
    base.cpu_per_byte = {"forward": 0.0, "backward": 0.025 / 4000}
    p = simulate(base, plan("wfbp"))
    assert p.backward == pytest.approx(0.5) and p.iteration == pytest.approx(0.9)
    # the same bytes on a link twice as slow take the same CPU over twice the time (0.75 speed): backward
    # 0-0.1 alone, AR1 0.1-0.3 (0.15 of work), p0 ready at 0.35, AR0 0.35-0.55 (compute done at 0.4833), wait
    slow = profile(beta=5e-5)
    slow.cpu_per_byte = base.cpu_per_byte
    assert simulate(slow, plan("wfbp")).backward == pytest.approx(0.55)
    # an explicit contention= overrides the profile's (the older factor per phase)
    r = simulate(base, plan("wfbp"), contention={"forward": 0.0, "backward": 0.0})
    assert r.backward == pytest.approx(0.4)


def test_ranks_with_a_core_each_run_at_the_pace_of_the_one_that_loses_most():
    # per sample each rank's own loss; with a core per rank a sample's loss is the largest of the ranks':
    # forward max(1, 3), max(2, 2), max(5, 0) = 3, 2, 5; backward 1, 4, 2; one number for both phases, the
    # median of all six samples: median(1, 2, 2, 3, 4, 5) = 2.5 (units of 0.01 / 4000 s per byte)
    unit = 0.01 / 4000
    losses = {
        "forward": [[1 * unit, 3 * unit], [2 * unit, 2 * unit], [5 * unit, 0.0]],
        "backward": [[1 * unit, 0.0], [4 * unit, 0.0], [2 * unit, 2 * unit]],
    }
    own = profile(beta=2.5e-5)
    own.lost_samples, own.cores_per_rank = losses, 1.0
    own.cpu_per_byte = {"forward": 2 * unit, "backward": 1.5 * unit}  # the means' medians, as recorded
    assert cpu_per_byte(own) == pytest.approx(2.5 * unit)
    # a rank that lost less than nothing (timing noise at least as large as the loss): the largest per sample
    # is as much that noise as loss, and the ranks' mean is the measure: forward 2, 2, 2.5, backward 0.5, 1.5,
    # 2: median 2
    noisy = profile(beta=2.5e-5)
    noisy.cores_per_rank = 1.0
    noisy.lost_samples = dict(losses, backward=[[1 * unit, 0.0], [4 * unit, -1 * unit], [2 * unit, 2 * unit]])
    assert cpu_per_byte(noisy) == pytest.approx(2.0 * unit)
    # ranks sharing cores (3 on 2), or a profile that did not record the cores: each sample's mean over the
    # ranks, forward 2, 2, 2.5 and backward 0.5, 1.5, 2: median(0.5, 1.5, 2, 2, 2, 2.5) = 2
    shared = profile(beta=2.5e-5)
    shared.lost_samples, shared.cores_per_rank, shared.cpu_per_byte = losses, 2 / 3, own.cpu_per_byte
    assert cpu_per_byte(shared) == pytest.approx(2.0 * unit)
    shared.cores_per_rank = 0.0
    assert cpu_per_byte(shared) == pytest.approx(2.0 * unit)
    # one phase's high samples do not carry the number: the pooled median, not the phases' medians' mean
    skewed = profile(beta=2.5e-5)
    skewed.cores_per_rank = 2 / 3
    skewed.lost_samples = {"forward": [[1 * unit]] * 3, "backward": [[1 * unit], [9 * unit], [9 * unit]]}
    assert cpu_per_byte(skewed) == pytest.approx(1.0 * unit)  # median(1, 1, 1, 1, 9, 9); the means' mean: 5
    # no per-rank samples: the recorded phases' mean, leaving out a phase that measured nothing
    recorded = profile(beta=2.5e-5)
    recorded.cpu_per_byte = {"forward": 3 * unit, "backward": 0.0}
    assert cpu_per_byte(recorded) == pytest.approx(3.0 * unit)
    # the replay uses it: a profile whose recorded loss is that number predicts the same timeline
    fixed = profile(beta=2.5e-5)
    fixed.cpu_per_byte = dict.fromkeys(("forward", "backward"), 2.5 * unit)
    assert simulate(own, plan("wfbp")).parts() == pytest.approx(simulate(fixed, plan("wfbp")).parts())
    assert simulate(own, plan("wfbp")).backward > simulate(shared, plan("wfbp")).backward


def test_an_all_reduce_takes_the_cpu_the_profile_measured_of_all_reduces():
    # without a measure of their own an all-reduce's bytes count twice at the reduce-scatters' and all-gathers'
    # cost; with one (gloo's ring in place against all-to-alls through buffers) its own, per byte of its buffer.
    # k = 0.025 / 4000: a 4000-byte all-reduce (0.1 s on the link) takes 0.05 s of compute (the gamma = 1 case,
    # backward 0.5); measured at k / 4 per byte of its buffer it takes 0.00625 s: backward 0.4 + 2 * 0.00625
    unit = 0.025 / 4000
    twice = profile(beta=2.5e-5)
    twice.cpu_per_byte = {"forward": unit, "backward": unit}
    assert cpu_costs(twice)["all_reduce"] == pytest.approx(2 * unit)
    assert simulate(twice, plan("wfbp")).backward == pytest.approx(0.5)
    own = profile(beta=2.5e-5)
    own.cpu_per_byte = {"forward": unit, "backward": unit, "all_reduce": unit / 4}
    own.lost_samples = {"forward": [[unit]], "backward": [[unit]], "all_reduce": [[unit / 4], [unit / 4]]}
    assert cpu_costs(own) == pytest.approx(
        {"reduce_scatter": unit, "all_gather": unit, "broadcast": unit, "all_reduce": unit / 4}
    )
    assert cpu_per_byte(own) == pytest.approx(unit)  # the all-reduces' samples are not pooled with the others'
    assert simulate(own, plan("wfbp")).backward == pytest.approx(0.4 + 2 * 0.00625)
    assert simulate(own, plan("dear")).parts() == pytest.approx(simulate(twice, plan("dear")).parts())


def test_the_engines_copies_and_averaging_take_compute_time():
    # copy_per_byte c: each 3988-byte gradient is copied into its bucket when ready (0.1 and 0.3), each 4000-byte
    # all-reduced bucket averaged (c per byte) and summed by the non-finite check (c / 2) when backward ends.
    # Fast link (0.1 s per all-reduce, hidden): backward = 0.4 of compute + 2 copies + 2 averages and checks;
    # forward and step unchanged
    c = 0.05 / 4000
    base = profile(beta=2.5e-5)
    base.copy_per_byte = c
    p = simulate(base, plan("wfbp"))
    assert p.backward == pytest.approx(0.4 + 2 * 3988 * c + 2 * 1.5 * 4000 * c)  # average + the check's sum
    assert (p.forward, p.step) == pytest.approx((0.4, 0.0))
    # under dear only this rank's shard of a reduce-scatter is averaged (2000 bytes each, at step())
    q = simulate(base, plan("dear"))
    without = simulate(profile(beta=2.5e-5), plan("dear"))
    assert q.step - without.step == pytest.approx(2 * 1.5 * 2000 * c)
    assert q.backward - without.backward == pytest.approx(2 * 3988 * c)


def test_a_full_workspace_holds_back_an_op_until_a_later_poll_and_holds_the_host_only_for_an_op_due_now():
    # gloo's all-to-alls: a workspace of one 2000-byte buffer (on two ranks a reduce-scatter of a 4000-byte bucket
    # receives the peer's half into one, an all-gather needs none: workspace_op_bytes), as the executor's issuer
    # uses it: an op past it is not started where the host polls (it never waits for room in a hook or at
    # step()), a later poll starts it; an op due now waits for room on the host.  dear with every all-gather
    # started at step(), ops of 0.2 s: backward [0, 0.4] (RS1 0.1-0.3, RS0 0.3-0.5), step() waits for RS0 until
    # 0.5 and starts AG0 (0.5-0.7) and AG1 (on the link after it, 0.7-0.9): step 0.4-0.5.  The next forward
    # (0.1 of work) waits for AG0 until 0.7; 0.1 of work, AG1 waited for until 0.9, tail 0.2: forward 0.6.  The
    # host is never held for room
    assert [workspace_op_bytes(k, 4000, 2) for k in ("reduce_scatter", "all_gather", "all_reduce")] == [2000, 0, 0]
    assert [workspace_op_bytes(k, 4000, 3) for k in ("reduce_scatter", "all_gather", "all_reduce")] == [4000, 4000, 0]
    at_step = build_plan(PARAMS, 4000, 2, "dear", gathers_at_step=True)
    unbounded = simulate(profile(beta=1e-4), at_step)
    assert (unbounded.forward, unbounded.backward, unbounded.step) == pytest.approx((0.6, 0.4, 0.1))
    bounded = profile(beta=1e-4)
    bounded.workspace_bytes = 2000
    p = simulate(bounded, at_step)
    assert (p.forward, p.backward, p.step) == pytest.approx((0.6, 0.4, 0.1))
    assert not [e for e in p.events if e["name"] == "wait workspace"]
    gathers = [e["ts"] / 1e6 for e in p.events if e["name"] == "all_gather"]
    assert gathers == pytest.approx([0.0, 0.2])  # AG1 started when the forward waited for AG0, not at step()
    # ops of 0.4 s: RS1 0.1-0.5 holds the workspace when p0 is ready (0.3), so RS0 is held back through the
    # backward; step() (at 1.4 in the iteration's frame: forward 1.0, backward 0.4) must complete it, and waits
    # on the host for RS1 to leave (until 1.5), then for RS0 (1.5-1.9): step 0.5
    slow = profile(beta=2e-4)
    slow.workspace_bytes = 2000
    q = simulate(slow, at_step)
    assert (q.forward, q.backward, q.step) == pytest.approx((1.0, 0.4, 0.5))
    waits = [(e["ts"] / 1e6, e["dur"] / 1e6) for e in q.events if e["name"] == "wait workspace"]
    assert len(waits) == 1 and waits[0] == pytest.approx((1.4, 0.1))
    # one gather ahead (dear's default) never holds more than the workspace: as without it
    assert simulate(bounded, plan("dear")).parts() == pytest.approx(simulate(profile(beta=1e-4), plan("dear")).parts())


def test_the_host_fills_each_gathers_buffer_and_sums_each_scatters_chunks_on_gloo():
    # a workspace (gloo's all-to-alls): the host sums a reduce-scatter's chunks when it waits for it, (1 + 1/2) / 2
    # of a copy of the 4000-byte buffer: 0.04 s here; on two ranks an all-gather sends the shard itself (nothing
    # to fill; on more ranks its send buffer is filled, (1 + 1/P) / 2 of a copy).  Fast link (0.05 s per op,
    # hidden): dear's step() gains the two sums; forward and backward are unchanged
    c = 0.04 / 3000
    base = profile(beta=2.5e-5)
    base.copy_per_byte = c
    gloo = profile(beta=2.5e-5)
    gloo.copy_per_byte, gloo.workspace_bytes = c, 1e9
    p, q = simulate(base, plan("dear")), simulate(gloo, plan("dear"))
    assert q.forward == pytest.approx(p.forward)
    assert q.step - p.step == pytest.approx(2 * 0.04)
    assert q.backward == pytest.approx(p.backward)
    assert workspace_passes(gloo, "all_gather", 4000, 2) == 0.0
    assert workspace_passes(gloo, "all_gather", 4000, 3) == pytest.approx(4000 * c * (1 + 1 / 3) / 2)
    assert workspace_passes(gloo, "all_reduce", 4000, 2) == 0.0  # an all-reduce runs in place
    assert workspace_passes(base, "reduce_scatter", 4000, 2) == 0.0  # no workspace (NCCL, older profiles)


def test_more_ranks_cost_what_the_ring_formulas_say():
    cost = CommCost("all_reduce", alpha=1e-4, beta=1e-9)
    assert cost.time(1e6, 2) == pytest.approx(2 * 1e-4 + 1e6 * 1e-9)
    assert cost.time(1e6, 64) == pytest.approx(2 * 63 * 1e-4 + 2 * 63 / 64 * 1e6 * 1e-9)
    rs = CommCost("reduce_scatter", alpha=1e-4, beta=1e-9)
    assert rs.time(1e6, 8) == pytest.approx(7 * (1e-4 + 1e6 / 8 * 1e-9))
    assert cost.on_link(parse_link("10gbit")).beta == pytest.approx(8 / 1e10)


@pytest.mark.parametrize("kind, world", [("reduce_scatter", 2), ("all_gather", 3), ("all_reduce", 2), ("broadcast", 4)])
def test_the_fit_recovers_alpha_and_beta_from_synthetic_timings(kind, world):
    truth = CommCost(kind, alpha=3e-5, beta=2.7e-10)
    samples = [
        (n, truth.time(n, world) * (1 + noise))
        for n, noise in [(2**20, 0.01), (2**23, -0.01), (2**25, 0.005), (2**27, 0.0)]
    ]
    got = fit(kind, samples, world)
    assert got.beta == pytest.approx(truth.beta, rel=0.02)
    assert got.time(2**26, 64) == pytest.approx(truth.time(2**26, 64), rel=0.05)


def test_the_fixed_cost_comes_from_the_smallest_message_where_the_line_cannot_tell_it():
    # 2 ranks, reduce-scatter: t = alpha + n / 2 * beta.  Large messages a little superlinear (a shaped link sends
    # small ones within its burst): the least-squares line's intercept is negative, the 64 KiB one shows alpha
    beta, alpha = 5e-9, 2e-4
    samples = [
        (2**16, alpha + 2**15 * beta),
        (2**20, 2**19 * beta),
        (2**23, 2**22 * beta * 1.1),
        (24 * 2**20, 12 * 2**20 * beta * 1.25),
    ]
    got = fit("reduce_scatter", samples, 2)
    slope = got.beta / 2  # seconds per byte of the message
    assert got.alpha == pytest.approx(samples[0][1] - slope * 2**16)
    assert got.alpha > 1e-4


def test_the_fits_beta_reproduces_the_buckets_sent_back_to_back():
    # 4 all-gathers of 1e8 bytes in all on 2 ranks took 0.6 s: 4 ops x 1 step x alpha 1 ms fixed, the rest
    # moves half the bytes: beta = (0.6 - 0.004) / (0.5 * 1e8); alpha kept
    cost = CommCost("all_gather", alpha=0.001, beta=1e-8)
    tuned = stream_calibrated(cost, [1e8, 4, 0.6], 2)
    assert tuned.alpha == 0.001 and tuned.beta == pytest.approx(0.596 / 5e7)
    assert 4 * tuned.time(1e8 / 4, 2) == pytest.approx(0.6)
    # an all-reduce on 3 ranks: 4 steps and 4/3 of the bytes per op
    ar = stream_calibrated(CommCost("all_reduce", alpha=0.001, beta=1e-8), [3e8, 2, 0.9], 3)
    assert ar.beta == pytest.approx((0.9 - 2 * 4 * 0.001) / (4 / 3 * 3e8))
    # a stream no longer than its fixed costs says nothing about the bytes: the fit is kept
    assert stream_calibrated(cost, [1e8, 4, 0.003], 2) == cost


def test_contention_from_an_overlap_measurement():
    # compute 1.0 alone, link 0.5 alone, both 1.25: compute lost 0.25 in the 0.5 of link: gamma = 1
    assert contention_from_overlap(1.0, 0.5, 1.25) == pytest.approx(1.0)
    assert contention_from_overlap(1.0, 0.5, 1.0) == 0.0


def test_a_profile_round_trips_through_json(tmp_path):
    p = profile(beta=1e-4, gamma=0.3)
    p.save(str(tmp_path / "p.json"))
    q = Profile.load(str(tmp_path / "p.json"))
    assert q == p


def _record(kind):
    import torch

    import dearopt
    from dearopt.sim import record_profile
    from dearopt.sim.profile import retime_compute
    from models import global_batch, loss_fn, make_model, shard

    model = make_model(kind)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = (shard(t, dearopt.rank(), dearopt.size()) for t in global_batch(0, kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = record_profile(
        model, lambda: loss_fn(kind, model(x), y), opt, sizes=(2**12, 2**16), repeats=2, bucket_bytes=2**12
    )
    again = retime_compute(prof, model, lambda: loss_fn(kind, model(x), y), opt, repeats=3)
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    no_grads = all(p.grad is None for p in model.parameters())
    try:  # another model than the profile's
        other = make_model("batchnorm")
        retime_compute(prof, other, lambda: loss_fn(kind, other(x), y), torch.optim.SGD(other.parameters(), lr=0.1))
        refused = None
    except ValueError as e:
        refused = str(e)
    return prof.to_json(), [p.numel() for p in model.parameters()], untouched, no_grads, again.to_json(), refused


@pytest.mark.parametrize("kind", ["mlp"])
def test_record_profile_on_two_ranks(kind):
    from harness import run_workers

    outs = run_workers(_record, 2, kind, timeout=90)
    docs = [o.value[0] for o in outs]
    assert docs[0] == docs[1]  # rank 0's profile, on every rank
    assert outs[0].value[4] == outs[1].value[4]  # compute timed again: the same on every rank
    doc, numels, untouched, no_grads, again_doc, refused = outs[0].value
    prof = Profile.from_json(doc)
    # the compute fields are the medians of the samples kept (2 repeats); timed again, of those and 3 more
    again = Profile.from_json(again_doc)
    n_seg = len(prof.forward_segments)
    assert len(prof.compute_samples) == 2 and again.compute_samples[:2] == prof.compute_samples
    assert len(again.compute_samples) == 5
    for p, count in ((prof, 2), (again, 5)):
        column = lambda k: statistics.median(s[k] for s in p.compute_samples)  # noqa: E731
        assert [t for _, t in p.forward_segments] == [column(k) for k in range(n_seg)]
        assert (p.forward_tail, p.t_bp) == (column(n_seg), column(n_seg + 1))
        assert p.ready == [column(n_seg + 2 + k) for k in range(len(p.params))]
    assert [own for own, _ in again.forward_segments] == [own for own, _ in prof.forward_segments]
    assert (again.params, again.comm, again.cpu_per_byte) == (prof.params, prof.comm, prof.cpu_per_byte)
    assert refused is not None and "differ from the profile's" in refused
    assert untouched and no_grads  # the model is left as it was
    # every parameter, in forward order (the MLP's modules run in definition order)
    assert [s.numel for s in prof.params] == numels
    # gradients become ready in reverse forward order, within backward
    assert all(a >= b for a, b in zip(prof.ready, prof.ready[1:]))
    assert 0 < prof.ready[0] <= prof.t_bp
    assert prof.t_ff > 0 and prof.world == 2
    for kind_ in ("reduce_scatter", "all_gather", "all_reduce", "broadcast"):
        cost = prof.comm[kind_]
        assert cost.alpha >= 0 and cost.beta >= 0
        # the fit reproduces its own samples' scale: the larger message costs at least the smaller one
        small, large = prof.comm_samples[kind_][0][0], prof.comm_samples[kind_][-1][0]
        assert cost.time(large, 2) >= cost.time(small, 2)
    assert set(prof.contention) == {"forward", "backward"} and min(prof.contention.values()) >= 0
    assert set(prof.cpu_per_byte) == {"forward", "backward", "all_reduce"} and min(prof.cpu_per_byte.values()) >= 0
    # each rank's own loss per byte, per sample: cpu_per_byte is the median of the samples' means over ranks
    assert set(prof.lost_samples) == {"forward", "backward", "all_reduce"}
    for phase, samples in prof.lost_samples.items():
        assert len(samples) == 7 and all(len(s) == 2 for s in samples)
        assert prof.cpu_per_byte[phase] == pytest.approx(max(statistics.median(sum(s) / 2 for s in samples), 0.0))
    assert prof.cores_per_rank == pytest.approx(len(os.sched_getaffinity(0)) / 2)  # two ranks on this host
    # the model's buckets sent back to back per kind, and the fits' betas reproduce them
    assert set(prof.comm_streams) == {"reduce_scatter", "all_gather", "all_reduce"}
    for kind_, (total, ops, seconds) in prof.comm_streams.items():
        # the model's bytes, each bucket rounded down to a multiple of the ranks' count of floats
        assert total == pytest.approx(sum(s.nbytes for s in prof.params), abs=8 * ops) and ops >= 1 and seconds > 0
        cost = prof.comm[kind_]
        if seconds > ops * cost.time(0, 2):  # the bytes took time beyond the fixed costs
            assert ops * cost.time(total / ops, 2) == pytest.approx(seconds)
    assert 0 < prof.copy_per_byte < 1e-6  # a copy runs faster than 1 MB/s


def _deft_profile(comm_seconds, n=3):
    """n one-parameter buckets: 1 s of forward and 1 s of backward each, an all-reduce of ``comm_seconds``."""
    params = [ParamSpec(f"p{i}", 997, "float32", 4) for i in range(n)]
    comm = {"all_reduce": CommCost("all_reduce", alpha=comm_seconds / 2, beta=0.0)}  # 2 (P - 1) steps on 2 ranks
    return Profile(
        params=params,
        forward_segments=[([i], 1.0) for i in range(n)],
        forward_tail=0.0,
        ready=[float(n - i) for i in range(n)],
        t_bp=float(n),
        update_per_element=0.0,
        update_per_call=0.0,
        comm=comm,
        comm_samples={},
        contention={},
        world=2,
    )


def test_deft_replays_its_schedule_by_hand():
    from dearopt.schedules.deft.schedule import deft_schedule
    from dearopt.sim.deft import schedule_from_json, schedule_to_json, simulate_deft

    # communication-bound (2.5 s per bucket against 1 + 1 s of compute): the solver's period is two steps.  Step A
    # (held): unit 0 of the old group during the forward (0-2.5 of 0-3), unit 1 at backward's start (3-5.5 of
    # 3-6), nothing waits: 6 s.  Step B: unit 2 during the forward, the group applied at step(): 6 s.  The link
    # carries 5 s in A and 2.5 s in B.
    prof = _deft_profile(2.5)
    plan = build_plan(prof.params, 1, 2, "deft")
    schedule = deft_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3)
    assert [it.held for it in schedule.period] == [True, False]
    assert schedule_from_json(json.loads(json.dumps(schedule_to_json(schedule)))) == schedule  # as the bench keeps it
    p = simulate_deft(prof, plan, schedule)
    assert p.iteration == pytest.approx(6.0) and p.link_busy == pytest.approx(3.75)
    assert (p.forward, p.backward, p.step) == pytest.approx((3.0, 3.0, 0.0))
    # the forward's send takes CPU: half speed while it runs (k n / d = 0.5), so forward A and B take
    # 2.5 s at half speed (1.25 of work) + 1.75 s = 4.25 s, and backward A 3 s while unit 1 runs 2.5 s of it: 4.25
    slowed = _deft_profile(2.5)
    # a bucket: 4000 bytes, all-reduced (twice the CPU of a reduce-scatter's bytes)
    slowed.cpu_per_byte = {"forward": 0.25 * 2.5 / 4000, "backward": 0.25 * 2.5 / 4000}
    q = simulate_deft(slowed, build_plan(slowed.params, 1, 2, "deft"), schedule)
    assert q.iteration == pytest.approx(((4.25 + 4.25) + (4.25 + 3.0)) / 2)
    # one bucket whose all-reduce fits in the forward: every step's group in the next forward, one step late
    one = _deft_profile(0.5, n=1)
    one_plan = build_plan(one.params, 1, 2, "deft")
    r = simulate_deft(one, one_plan, deft_schedule([1.0], [1.0], [0.5]))
    assert r.iteration == pytest.approx(2.0) and r.link_busy == pytest.approx(0.5)


def test_deft_replay_lets_the_new_groups_sends_run_into_the_next_forward():
    from dearopt.schedules.deft.schedule import DeftIteration, DeftSchedule
    from dearopt.sim.deft import simulate_deft

    # two buckets (1 s forward and backward each, 1.5 s on the link); every step sends the new group's bucket 1
    # when it is ready (1 s into backward: on the link until 0.5 s after backward ends) and the old group's
    # bucket 0 in the next forward, and applies the old group.  step() waits only for the group it applies, so
    # the new group's send runs 0.5 s into the next forward, bucket 0 queues behind it (0.5-2.0 of a 2 s
    # forward) and nothing waits: 4 s per step, the link busy 3 s of it (waiting at step() would make it 4.5 s)
    prof = _deft_profile(1.5, n=2)
    plan = build_plan(prof.params, 1, 2, "deft")
    schedule = DeftSchedule(
        2, (DeftIteration(4, (), (), (1,), False, None, 0),), (DeftIteration(4, (0,), (), (1,), False, 1, 1),)
    )
    p = simulate_deft(prof, plan, schedule)
    assert p.iteration == pytest.approx(4.0) and p.link_busy == pytest.approx(3.0)
    assert (p.forward, p.backward, p.step) == pytest.approx((2.0, 2.0, 0.0))
    # 2.5 s on the link: the new group's bucket 1 goes 1 s into backward (3.0-5.5 of a step that ends at 4.0), the
    # next forward's bucket 0 queues behind it (5.5-8.0).  Applied as a group (the paper's), the next backward
    # waits for both at its start (6.0-8.0): forward 2 s, backward 2 + 2 s.  Applied per bucket (the default),
    # bucket 1 (all sent in its own backward) is due at step() and the next forward waits for its send before
    # computing it (5.0-5.5): forward 2.5 s, backward 1.5 + 2 s.  6 s per step either way (the link is busy 5 s)
    slow = _deft_profile(2.5, n=2)
    group = simulate_deft(slow, plan, schedule)
    bucket = simulate_deft(slow, plan, schedule, apply="bucket")
    for q in (group, bucket):
        assert q.iteration == pytest.approx(6.0) and q.link_busy == pytest.approx(5.0) and q.step == pytest.approx(0)
    assert (group.forward, group.backward) == pytest.approx((2.0, 4.0))
    assert (bucket.forward, bucket.backward) == pytest.approx((2.5, 3.5))


def test_a_profile_without_twins_is_the_model_as_deft_sees_it():
    # an embedding (rows of 4) whose tied decoder is its twin: the decoder's module owns only the twin, and its
    # part of the gradient is ready first (0.1), the lookup's last (0.9).  Without twins: the embedding's gradient
    # is complete at 0.9 and dense; the decoder's 0.05 s before it runs move to the forward's tail
    params = [
        ParamSpec("emb", 16, "float32", 4, row_numel=4),
        ParamSpec("lin", 8, "float32", 4),
        ParamSpec("emb (tied use)", 16, "float32", 4, twin_of=0),
    ]
    comm = {k: CommCost(k, alpha=0.0, beta=1e-6) for k in ("reduce_scatter", "all_gather", "all_reduce", "broadcast")}
    tied = Profile(
        params=params,
        forward_segments=[([0], 0.1), ([1], 0.2), ([2], 0.05)],
        forward_tail=0.3,
        ready=[0.9, 0.5, 0.1],
        t_bp=1.0,
        update_per_element=0.0,
        update_per_call=0.0,
        comm=comm,
        comm_samples={},
        contention={},
        world=2,
        rows_fraction={0: 0.25},
    )
    dense = tied.without_twins()
    assert [(p.name, p.row_numel, p.twin_of) for p in dense.params] == [("emb", 0, None), ("lin", 0, None)]
    assert dense.ready == [0.9, 0.5] and dense.rows_fraction == {}
    assert dense.forward_segments == [([0], 0.1), ([1], 0.2)] and dense.forward_tail == pytest.approx(0.35)
    assert dense.t_ff == pytest.approx(tied.t_ff)
    # a twin ready after its owner makes the owner's gradient that late
    late = Profile(**{**tied.__dict__, "ready": [0.2, 0.5, 0.7]}).without_twins()
    assert late.ready == [0.7, 0.5]
    assert build_plan(dense.params, 1, 2, "deft").buckets  # plans like any profile
