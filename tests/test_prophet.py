"""Prophet's gradient blocks (issue 17): Algorithm 1 against hand-worked profiles, and training with
``prophet`` / ``prophet-allreduce`` against single-process training on the global batch."""

import math

import pytest
import torch

import dearopt
from dearopt.planning.plan import STEP, ParamSpec
from dearopt.planning.build import build_plan
from dearopt.schedules import get_schedule
from dearopt.schedules.prophet import prophet_blocks
from harness import run_workers
from models import make_model, make_optimizer, train_step
from test_distoptim import assert_params_match, reference


def test_equal_ready_times_make_one_block_up_to_the_size_cap():
    # everything exists at once: nothing is generated later, so no window closes a block
    assert prophet_blocks([0.0] * 5, [100] * 5, 1000.0) == [[0, 1, 2, 3, 4]]
    # the cap is filled from the output side, as backward produces them
    assert prophet_blocks([0.0] * 5, [100] * 5, 1000.0, max_bytes=200) == [[0], [1, 2], [3, 4]]


def test_a_gap_longer_than_every_transfer_makes_one_block_per_burst():
    # bursts of two gradients 0.3 s apart; each burst takes 0.02 s on the link
    ready = [0.9, 0.9, 0.6, 0.6, 0.3, 0.3, 0.0, 0.0]
    assert prophet_blocks(ready, [10] * 8, 1000.0) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_busy_link_splits_at_the_window_and_merges_what_waited():
    # E = 0.1 s per gradient, one generated every 0.05 s (hand-worked):
    # p3 at 0.00: alone (p2 is not generated yet); link busy until 0.10.
    # p2 at 0.10 (link free): p1 is ready (0.10), but p2+p1 would be sent at 0.30, after p0 appears (0.15): close.
    # p1 at 0.20: p0 (0.15) is ready and nothing comes after it: one block.
    assert prophet_blocks([0.15, 0.10, 0.05, 0.0], [100] * 4, 1000.0) == [[0, 1], [2], [3]]


def test_one_huge_tensor_is_a_block_of_its_own():
    # p2 (10 kB, 10 s on the link) is ready at 0.1 s; its neighbours are small and come 0.1 s apart
    ready, nbytes = [0.3, 0.2, 0.1, 0.0], [10, 10, 10000, 10]
    # p3 alone (p2 not yet there); p2 alone until 10.11; then p1 and p0 have both waited: one block
    assert prophet_blocks(ready, nbytes, 1000.0) == [[0, 1], [2], [3]]


def test_latency_and_required_boundaries():
    ready, nbytes = [0.2, 0.1, 0.0], [100, 100, 100]
    # without latency p2 is sent by 0.1, when p1 appears: separate blocks
    assert prophet_blocks(ready, nbytes, 1000.0) == [[0], [1], [2]]
    # a 0.15 s fixed cost per collective: p2 occupies the link until 0.25 and p1, p0 wait for it together
    assert prophet_blocks(ready, nbytes, 1000.0, latency=0.15) == [[0, 1], [2]]
    assert prophet_blocks(ready, nbytes, 1000.0, latency=0.15, split_after=[0]) == [[0], [1], [2]]


def test_a_block_below_the_minimum_waits_for_the_next_gradients():
    # the bursts of the gap test, 0.3 s apart; a block must hold 30 bytes: p7, p6 (20 bytes) wait for the next
    # burst and start at 0.3 s with p5 and p4 (which is ready and sent before p3 appears at 0.6 s); the same again
    ready = [0.9, 0.9, 0.6, 0.6, 0.3, 0.3, 0.0, 0.0]
    assert prophet_blocks(ready, [10] * 8, 1000.0, min_bytes=30) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the schedule takes the minimum as latency x bandwidth: the size whose transfer lasts as long as its fixed cost
    params = [ParamSpec(f"p{i}", 10, "float32", 4) for i in range(4)]  # 40 bytes each
    groups = get_schedule("prophet").bucket_groups(
        params, buffer_size=10**6, ready_times=[0.3, 0.2, 0.1, 0.0], bandwidth=40_000.0, latency=0.002
    )  # minimum 80 bytes
    assert groups == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "bad", [dict(bandwidth=0.0), dict(bandwidth=math.nan), dict(latency=-1.0), dict(ready=[0.0, math.inf])]
)
def test_bad_profiles_are_refused_by_name(bad):
    args = dict(ready=[0.0, 0.0], nbytes=[4, 4], bandwidth=1.0)
    args.update(bad)
    with pytest.raises(ValueError):
        prophet_blocks(args.pop("ready"), args.pop("nbytes"), args.pop("bandwidth"), **args)


def test_the_plan_takes_the_blocks_with_a_profile_and_fuses_by_size_without():
    params = (
        [ParamSpec("embed.weight", 40, "float32", 4, row_numel=4)]
        + [ParamSpec(f"p{i}", 25, "float32", 4) for i in range(4)]
        + [ParamSpec("head (tied use)", 40, "float32", 4, twin_of=0)]
    )
    ready = [0.5, 0.3, 0.3, 0.1, 0.1, 0.0]
    for name in ("prophet", "prophet-allreduce"):
        assert [b.params for b in build_plan(params, 10**6, 2, name).buckets] == [(0,), (1, 2, 3, 4), (5,)]
        plan = build_plan(params, 10**6, 2, name, ready_times=ready, bandwidth=1e4)
        assert [b.params for b in plan.buckets] == [(0,), (1, 2), (3, 4), (5,)]  # bursts; twin and rows alone
        expected = {
            "prophet": {"reduce_scatter", "all_gather", "all_reduce", "all_gather_rows"},
            "prophet-allreduce": {"all_reduce", "all_gather_rows"},
        }[name]
        assert {op.kind for op in plan.ops} == expected
        gathers = [op for op in plan.ops if op.kind == "all_gather"]
        # Prophet's forward phase: every gather starts at step(), back to back in the order forward needs them
        assert (
            all(op.start == STEP for op in gathers)
            and [op.bucket for op in gathers] == sorted(op.bucket for op in gathers)
            and all(op.update == op.due for op in gathers)
        )
    with pytest.raises(ValueError, match="ready_times"):
        build_plan(params, 10**6, 2, "prophet", ready_times=ready[:-1], bandwidth=1e4)


STEPS = 6


KNOBS = {
    "prophet": {},
    "prophet-allreduce": {},
    # ByteScheduler's knobs still apply to the blocks: priority order, partitions, a credit window
    "prophet+pc": {"priority": True, "partition_size": 128, "credit": 512},
}


def _prophet_training(opt_names, schedules):
    """Each optimizer under each Prophet schedule; a forced re-plan (a smaller block cap) after step 3."""
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for schedule in schedules:
        for opt_name in opt_names:
            model = make_model("mlp")
            opt = dearopt.DistOptim(
                make_optimizer(opt_name, model),
                model,
                schedule=get_schedule(schedule.split("+")[0]).with_knobs(**KNOBS[schedule]),
                buffer_size=4096,
            )
            plans = []
            for step in range(STEPS):
                train_step(opt, model, step, rank, world)
                plans.append([b.params for b in opt.plan.buckets])
                if step == 3:
                    opt._executor.replan(buffer_size=400)  # the re-plan path the tuner takes
            measured = opt._executor.profile.result  # rank 0's step-1 profile, shared
            blocks = get_schedule(schedule.split("+")[0]).bucket_groups(
                opt.plan.params,
                buffer_size=400,
                ready_times=measured.ready,
                bandwidth=measured.bandwidth,
                latency=measured.latency,
            )
            opt.synchronize()
            out[(schedule, opt_name)] = (
                [p.detach().clone() for p in model.parameters()],
                plans,
                blocks,
                opt.plan.fingerprint(),
            )
            opt.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_prophet_training_equals_single_process_with_a_replan_in_the_middle(world):
    opt_names = ["adamw", "sgd"]
    schedules = list(KNOBS)
    outcomes = run_workers(_prophet_training, world, opt_names, schedules, timeout=150)
    for opt_name in opt_names:
        want, _ = reference("mlp", opt_name, world, steps=STEPS)
        for schedule in schedules:
            fingerprints = set()
            for o in outcomes:
                params, plans, blocks, fingerprint = o.value[(schedule, opt_name)]
                assert_params_match(params, want)
                # steps 0-3 fuse by size (one bucket: 620 bytes < 4096); then the plan is made of the blocks of
                # rank 0's profile of steps 1-3; after the re-plan, of blocks of at most 400 bytes: several
                assert len(plans[0]) == 1 and [list(b) for b in plans[-1]] == blocks and len(blocks) > 1
                fingerprints.add(fingerprint)
            assert len(fingerprints) == 1


def test_the_link_monitor_needs_a_change_beyond_the_threshold_twice_in_a_row_and_alike():
    from dearopt.planning.profile import LinkMonitor

    m = LinkMonitor(threshold=0.25, patience=2)
    # within 25 %: never; one slow measurement, then a fast one: the streak restarts; two fast ones: re-plan
    assert [m.observe(s, 100.0, bw) for s, bw in enumerate([120, 79, 126, 130])] == [False, False, False, True]
    assert m.changes == [(3, 100.0, 130)]
    assert [m.observe(s, 130.0, bw) for s, bw in enumerate([110, 60, 50], start=4)] == [False, False, True]
    # above the threshold twice, but scattered (noise, not a new link): no re-plan until two readings agree
    m = LinkMonitor(threshold=0.25, patience=2)
    assert [m.observe(s, 100.0, bw) for s, bw in enumerate([400, 40_000, 900, 1_000])] == [False, False, False, True]
    assert m.changes == [(3, 100.0, 1_000)]
    from dearopt.engine.options import Options

    assert Options(schedule="prophet").link_check_every == 20 and Options(schedule="dear").link_check_every is None
    with pytest.raises(ValueError, match="link_check_every must be"):
        dearopt.Prophet(link_check_every=0)
    with pytest.raises(ValueError, match="has none"):  # only the schedules whose buckets come from the profile
        get_schedule("dear").with_knobs(link_check_every=5)


class _SlowLink(dearopt.backends.base.CollectiveBackend):
    """The job's backend, with every data collective taking ``delay[0]`` seconds longer once it is set: an
    emulated link whose bandwidth drops in the middle of a run."""

    def __init__(self, inner, delay):
        super().__init__(inner.rank, inner.size, inner.timeout)
        self.inner, self.delay, self.name, self.device = inner, delay, inner.name, inner.device

    def _slow(self, handle):
        return _Late(handle, self.delay[0])

    def reduce_scatter(self, out_shard, in_full, **where):
        return self._slow(self.inner.reduce_scatter(out_shard, in_full, **where))

    def all_gather(self, out_full, in_shard, **where):
        return self._slow(self.inner.all_gather(out_full, in_shard, **where))

    def all_reduce(self, tensor, op="sum", **where):
        return self._slow(self.inner.all_reduce(tensor, op, **where))

    def broadcast(self, tensor, root=0, **where):
        return self.inner.broadcast(tensor, root, **where)

    def fork(self):
        return self._track_fork(_SlowLink(self.inner.fork(), self.delay))

    def close(self):
        super().close()
        self.inner.close()


class _Late(dearopt.backends.base.Handle):
    def __init__(self, handle, delay):
        import time

        self.handle, self.op, self.until = handle, handle.op, time.perf_counter() + delay

    def wait(self, timeout=None):
        import time

        time.sleep(max(0.0, self.until - time.perf_counter()))
        self.handle.wait(timeout)

    def is_completed(self):
        import time

        return time.perf_counter() >= self.until and self.handle.is_completed()


def _link_drops_midway(steps=18, slow_from=6):
    rank, world = dearopt.rank(), dearopt.size()
    delay = [0.0]
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("adamw", model),
        model,
        schedule=dearopt.Prophet(link_check_every=2),
        buffer_size=4096,
        backend=_SlowLink(dearopt.backends.runtime.get_backend(), delay),
    )
    for step in range(steps):
        delay[0] = 0.05 if step >= slow_from else 0.0  # 50 ms more per collective: the link got much slower
        train_step(opt, model, step, rank, world)
    measured = opt._executor.profile.result  # the measurement the monitor adopted last
    blocks = get_schedule("prophet").bucket_groups(
        opt.plan.params,
        buffer_size=4096,
        ready_times=measured.ready,
        bandwidth=measured.bandwidth,
        latency=measured.latency,
    )
    opt.synchronize()
    out = (
        [p.detach().clone() for p in model.parameters()],
        opt.schedule.link_changes,
        [list(b.params) for b in opt.plan.buckets],
        blocks,
    )
    opt.close()
    return out


@pytest.mark.timeout(120)
def test_prophet_replans_when_the_link_slows_down_and_stays_exact():
    outcomes = run_workers(_link_drops_midway, 2, timeout=100)
    want, _ = reference("mlp", "adamw", 2, steps=18)
    changes = outcomes[0].value[1]
    for o in outcomes:
        params, seen, buckets, blocks = o.value
        assert_params_match(params, want)
        assert seen == changes  # the same decisions on every rank
        assert buckets == blocks  # the plan in force is made from the measurement the monitor adopted
    # re-measured every 4 steps (5-7, 9-11, 13-15): the window 5-7 straddles the change (one fast step) and reads ~1.5x
    # the later ones, so the streak of alike readings starts at 9-11 and the plan changes at step 16's backward at
    # the latest (at step 12's when the straddling reading happens to agree with the next)
    slow = [(step, planned, now) for step, planned, now in changes if step >= 8 and now < planned / 2]
    assert slow, changes


def test_the_fixed_cost_per_collective_is_fitted_from_the_reductions():
    from dearopt.planning.profile import fit_latency

    # seconds = 0.002 + bytes / 1e6 for three ops, one observed late (its end seen at a later hook)
    services = [(1000, 0.003), (10_000, 0.012), (5000, 0.017)]
    assert fit_latency(services, 1e6) == pytest.approx(0.002)
    assert fit_latency([(1000, 0.0005)], 1e6) == 0.0  # never negative
    assert fit_latency([], 1e6) == 0.0


def test_the_link_fit_does_not_depend_on_how_the_bytes_are_cut():
    from dearopt.planning.profile import fit_link

    def ops(sizes, late=()):  # seconds = 0.004 + bytes / 2e8; the ops in ``late`` were seen 0.5 s late
        return [(n, 0.004 + n / 2e8 + (0.5 if k in late else 0.0)) for k, n in enumerate(sizes)]

    few, many = ops([2**24, 2**25, 3 * 2**23]), ops([2**20, 2**21, 3 * 2**20, 2**22, 2**23, 5 * 2**20])
    for services in (few, many, ops([2**20, 2**21, 3 * 2**20, 2**22, 2**23], late={3})):  # one outlier
        bandwidth, latency = fit_link(services)
        assert bandwidth == pytest.approx(2e8, rel=1e-6) and latency == pytest.approx(0.004, rel=1e-6)
    # bytes / busy seconds counts the fixed cost as link time: the smaller ops make the link look slower
    assert sum(n for n, _ in many) / sum(t for _, t in many) < 0.9 * sum(n for n, _ in few) / sum(t for _, t in few)
    # sizes that cannot tell a slope: bytes / busy seconds, the fixed cost fitted to it (here none)
    assert fit_link([(1000, 0.01), (1000, 0.03)]) == (pytest.approx(2000 / 0.04), 0.0)
    assert fit_link([]) == (1e9, 0.0)


class _Control:
    """A control channel of one rank: the broadcast leaves the tensor as it is; an all-reduce takes no time."""

    device = torch.device("cpu")

    def all_reduce(self, tensor, op="sum", **where):
        return self.broadcast(tensor)

    def broadcast(self, tensor, root=0, **where):
        class Done:
            def wait(self, timeout=None):
                return None

        return Done()


def test_the_profile_is_the_median_of_a_window_of_steps_and_is_shared_once_at_its_end(monkeypatch):
    from dearopt.planning import profile as profiling

    clock = [0.0]
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])
    profile = profiling.ReadyProfile(True, every=10, steps=3)
    # per step: (ready times of parameters 0, 1, backward's end, its reductions' (bytes, seconds))
    steps = {
        1: ([0.9, 0.2], 1.0, [(100, 0.1)]),
        2: ([0.5, 0.1], 0.6, [(100, 0.3)]),
        3: ([0.7, 0.9], 2.0, [(200, 0.1)]),
        **{step: ([0.4, 0.4], 0.5, [(300, 0.1)]) for step in (11, 12, 13)},
    }
    shared_at = []
    for step in range(16):
        clock[0] = 100.0 * step
        profile.begin_backward(step, 2)
        assert profile.recording == (step in steps), step
        if step in steps:
            times, end, services = steps[step]
            for position in (1, 0):
                clock[0] = 100.0 * step + times[position]
                profile.grad_ready(position)
            clock[0] = 100.0 * step + end
            profile.end_backward()
            fresh_before = profile.latest
            profile.share(_Control(), services, step)
            if profile.latest is not fresh_before:
                shared_at.append(step)
    assert shared_at == [3, 13]  # once per window, at its last step
    first = profile.result
    assert first.ready == pytest.approx([0.7, 0.2]) and first.backward == pytest.approx(1.0)  # medians
    assert first.bandwidth == pytest.approx(400 / 0.5)  # every reduction of the window: bytes / busy seconds
    assert first.latency == pytest.approx(profiling.fit_latency([(100, 0.1), (100, 0.3), (200, 0.1)], 800.0))
    assert profile.remeasured and profile.latest.bandwidth == pytest.approx(3000.0)  # the monitor's window
    assert profile.result is first  # adopted only when the monitor says so
    with pytest.raises(ValueError, match="at least one step"):
        profiling.ReadyProfile(True, steps=0)

    # a parameter unfrozen in the middle of a window: the window starts again with the new count
    profile = profiling.ReadyProfile(True, steps=2)
    for step, n in ((1, 2), (2, 3), (3, 3)):
        profile.begin_backward(step, n)
        profile.end_backward()
        profile.share(_Control(), [(100, 0.1)], step)
        assert (profile.result is None) == (step < 3)
    assert len(profile.result.ready) == 3

    class SlowControl(_Control):  # each tiny all-reduce takes 50 ms: the fixed cost per op is at least that
        def all_reduce(self, tensor, op="sum", **where):
            clock[0] += 0.05
            return self.broadcast(tensor)

    profile = profiling.ReadyProfile(True, steps=1)
    profile.begin_backward(profiling.ReadyProfile.STEP, 2)
    profile.share(SlowControl(), [(100, 0.1), (200, 0.2)], profiling.ReadyProfile.STEP)  # the fit alone: 0
    assert profile.result.latency == pytest.approx(0.05) and profile.result.bandwidth == pytest.approx(1000.0)


def test_predicted_sends_walk_the_link_from_the_output_side():
    from dearopt.schedules.prophet import predicted_sends

    # blocks in forward order; the output-side block goes first, each when its last gradient exists and the
    # link is free, for latency + bytes / bandwidth
    times = predicted_sends([[0], [1, 2], [3]], [0.5, 0.1, 0.1, 0.0], [100] * 4, 1000.0, latency=0.01)
    assert times == [pytest.approx(t) for t in [(0.5, 0.61), (0.11, 0.32), (0.0, 0.11)]]


def _prophet_timeline(path, steps):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(make_optimizer("sgd", model), model, schedule="prophet", buffer_size=4096, timeline=path)
    for step in range(steps):
        train_step(opt, model, step, rank, world)
    opt.synchronize()
    measured = opt._executor.profile.result
    out = ([b.params for b in opt.plan.buckets], [p.nbytes for p in opt.plan.params], measured)
    opt.close()
    return out


@pytest.mark.timeout(90)
def test_the_timeline_shows_each_block_as_predicted_beside_the_measured_reductions(tmp_path):
    import json

    from dearopt.planning.profile import ReadyProfile
    from dearopt.schedules.prophet import Prophet, predicted_sends
    from dearopt.engine.timeline import timeline_path_for_rank

    path, steps = str(tmp_path / "trace.json"), 7
    outcomes = run_workers(_prophet_timeline, 2, path, steps, timeout=80)
    blocks, sizes, measured = outcomes[0].value
    want = predicted_sends(blocks, measured.ready, sizes, measured.bandwidth, Prophet.block_latency(measured.latency))
    planned = steps - (ReadyProfile.STEP + ReadyProfile.STEPS)  # the backwards after the profile was shared
    for rank in range(2):
        with open(timeline_path_for_rank(path, rank)) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
        # in the order written: each backward's predictions are written together when it ends (a prediction
        # may start later than the next backward's own ones on a loaded machine, so not sorted by start)
        predicted = [e for e in events if e["name"] == "predicted reduce_scatter"]
        assert len(predicted) == planned * len(blocks) and all(e["tid"] == 2 for e in predicted)
        last_backward = max((e for e in events if e["name"] == "backward"), key=lambda e: e["ts"])
        last = {e["args"]["bucket"]: e for e in predicted[-len(blocks) :]}
        assert set(last) == set(range(len(blocks)))
        for b, (start, end) in enumerate(want):  # placed from that backward's start, as the link model says
            assert last[b]["ts"] - last_backward["ts"] == pytest.approx(start * 1e6, abs=1.0)
            assert last[b]["dur"] == pytest.approx((end - start) * 1e6, abs=1.0)
        measured_spans = {e["args"]["bucket"] for e in events if e["name"] == "reduce_scatter"}
        assert measured_spans == set(range(len(blocks)))  # and the measured reductions of the same blocks
