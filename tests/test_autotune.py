"""Online tuning inside DistOptim: re-planning at trial boundaries never changes the mathematics."""

import weakref

import pytest
import torch

import dearopt
from dearopt.planning.tuner import BayesianTuner, Knob
from harness import run_workers
from models import make_model, make_optimizer, train_step
from test_distoptim import assert_params_match, reference

STEPS = 12


def _train_tuned(opt_name, schedule, knob_names):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    knobs = {
        "buffer_size": Knob("buffer_size", 64, 2048, log=True, initial=256, integer=True),
        "partition_size": Knob("partition_size", 32, 512, log=True, initial=128, integer=True),
        "credit": Knob("credit", 128, 4096, log=True, initial=512, integer=True),
    }
    tuner = BayesianTuner([knobs[k] for k in knob_names], budget=5, seed=0, steps_per_trial=1)
    opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, schedule=schedule, tuner=tuner)
    plans = []
    old, current, plan = [], [], None  # weak references to the buffers of the plans replaced, of the one in force
    for step in range(STEPS):
        train_step(opt, model, step, rank, world)
        plans.append((opt.plan.buffer_size, opt.plan.partition_size, len(opt.plan.buckets)))
        if opt.plan is not plan:
            old += current
            plan = opt.plan
        executor = opt._executor
        current = [weakref.ref(b.buffer) for b in executor.buckets] + [
            weakref.ref(t) for kept in getattr(executor.backend, "_workspace", {}).values() for t in kept
        ]
    opt.synchronize()
    live = {id(b.buffer) for b in opt._executor.buckets}  # a bucket laid out alike is kept, with its buffer
    kept = sum(ref() is not None and id(ref()) not in live for ref in old)  # the others' buffers are freed
    return [p.detach().clone() for p in model.parameters()], plans, opt.tuning.history, opt.tuning.finished, kept


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "world, schedule, knob_names",
    [
        (2, "dear", ("buffer_size",)),
        (3, "dear", ("buffer_size",)),
        (2, "wfbp", ("buffer_size",)),
        (3, "dear", ("partition_size", "credit")),
    ],
)
def test_tuning_replans_exactly(world, schedule, knob_names):
    outcomes = run_workers(_train_tuned, world, "adamw", schedule, knob_names, timeout=150)
    want, _ = reference("mlp", "adamw", world, steps=STEPS)
    for o in outcomes:
        params, plans, history, finished, kept = o.value
        assert_params_match(params, want)
        assert kept == 0, f"{kept} buffers of replaced plans still alive"
        assert plans == outcomes[0].value[1], "every rank re-planned at the same step with the same knobs"
        assert len(history) >= 3 and finished
        assert len({p[:2] for p in plans}) >= 2, "the knobs really changed during the run"


def test_auto_builds_the_papers_tuner():
    dearopt.init()
    try:
        model = make_model("mlp")
        opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size="auto")
        knob = opt.tuning.tuner.knobs[0]
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        assert knob.name == "buffer_size" and knob.low == 2**20 and knob.high == max(model_bytes, 2 * 2**20)
        assert opt.tuning.current["buffer_size"] == min(25 * 2**20, knob.high)
        opt.close()
    finally:
        dearopt.shutdown()


def _train_with_plan_choice(opt_name, steps):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, buffer_size=512)  # dear, allreduce="auto"
    plans, settled = [], []
    for step in range(steps):
        train_step(opt, model, step, rank, world)
        plans.append((tuple(opt.plan.allreduce), tuple(tuple(b.params) for b in opt.plan.buckets)))
        settled.append(opt.settled)
    opt.synchronize()
    measured = opt._executor.profile.result  # the forward's computation was timed, its waits left out
    assert measured.forward is not None and 0 < measured.forward < measured.backward + 1.0
    choice = opt.schedule.plan_choice
    opt._executor.replan(blocks=False)  # the candidates as they were listed, from the size-fused plan
    choices = opt._executor.plan_choices()
    return (
        [p.detach().clone() for p in model.parameters()],
        plans,
        settled,
        choice.history,
        choice.finished,
        choice.current,
        choices,
        len(opt.plan.buckets),
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_auto_measures_the_plans_and_keeps_the_fastest_exactly(world):
    """dear's allreduce="auto" runs each distinct plan (predicted, none, all all-reduced; Prophet's blocks) for a
    few steps after the profile, the close ones twice, keeps the fastest on rank 0's clock on every rank, and
    trains as one process would throughout."""
    from dearopt.optimizer import PLAN_CHOICE_REMATCH, PLAN_CHOICE_STEPS
    from dearopt.planning.profile import ReadyProfile

    profiled = ReadyProfile.STEP + ReadyProfile.STEPS  # the steps up to the end of the profile's window
    steps = profiled + 1 + 8 * (1 + PLAN_CHOICE_STEPS) + 2  # four candidates, each at most twice
    outcomes = run_workers(_train_with_plan_choice, world, "adamw", steps, timeout=150)
    want, _ = reference("mlp", "adamw", world, steps=steps)
    first = outcomes[0].value
    for o in outcomes:
        params, plans, settled, history, finished, current, choices, n_buckets = o.value
        assert_params_match(params, want)
        assert (plans, settled, history, current) == first[1:4] + (first[5],), "every rank made the same choice"
        assert finished and len(choices) >= 2
        labels = [tuple(sorted(knobs.items())) for knobs, _ in choices]
        tried = [tuple(sorted(k.items())) for k, _ in history]
        assert tried[: len(labels)] == labels, "each candidate once, in order"
        once = dict(zip(labels, (t for _, t in history)))
        close = [c for c in labels if once[c] >= (1 - PLAN_CHOICE_REMATCH) * max(once.values())]
        assert tried[len(labels) :] == (close[::-1] if len(close) > 1 else []), "the close ones again, reversed"
        rules = [knobs for knobs, _ in choices]
        assert rules[0] == {"allreduce": "predicted"}
        whole = tuple(range(n_buckets))
        sized = [planned for knobs, planned in choices if not knobs.get("blocks")]
        assert {(), whole} <= set(sized) and len(set(sized)) == len(sized), "DeAR's and DDP's plans, each once"
        assert all(knobs == {"allreduce": 0.0, "blocks": True} for knobs in rules[len(sized) :]), (
            "then DeAR's ops on Prophet's blocks, where they differ from the buckets by size"
        )
        mean = {c: sum(t for k, t in history if tuple(sorted(k.items())) == c) / tried.count(c) for c in labels}
        kept = tuple(sorted(current.items()))
        assert kept == max(labels, key=lambda c: mean[c]), "the fastest (mean of its trials) is kept"
        for knobs, planned in choices:  # each candidate really ran
            ran = [groups if knobs.get("blocks") else allreduce for allreduce, groups in plans]
            assert planned in ran, knobs
        settle = settled.index(True)
        assert all(settled[settle:]) and len(set(plans[settle:])) == 1, "settled: the plan no longer changes"
        assert settle == profiled - 1 + len(history) * (1 + PLAN_CHOICE_STEPS)  # the profile's steps, the trials


def _train_on_blocks(steps, switch):
    from dearopt.planning.profile import Measurement
    from dearopt.schedules.prophet import profile_blocks

    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("adamw", model), model, schedule=dearopt.DeAR(allreduce=0.0), buffer_size=4096
    )
    for step in range(steps):
        if step == switch:
            sized = [list(b.params) for b in opt.plan.buckets]
            n = len(opt.plan.params)  # a profile (the same on every rank) whose gradients come far apart
            opt._executor.profile.result = Measurement(
                ready=[0.1 * (n - i) for i in range(n)],
                bandwidth=1e5,
                backward=0.1 * n + 0.1,
                latency=1e-3,
                forward=0.2,
            )
            opt._executor.replan(blocks=True)
        train_step(opt, model, step, rank, world)
    opt.synchronize()
    measured = opt._executor.profile.result
    want = profile_blocks(
        opt.plan.params,
        buffer_size=4096,
        ready_times=measured.ready,
        bandwidth=measured.bandwidth,
        latency=measured.latency,
    )
    return [p.detach().clone() for p in model.parameters()], [list(b.params) for b in opt.plan.buckets], want, sized


@pytest.mark.parametrize("world", [2, 3])
def test_dear_on_prophets_blocks_trains_exactly(world):
    """The measured choice's blocks candidate: DeAR's ops on Prophet's blocks of the shared profile, switched to at
    a step boundary, train as one process would."""
    steps, switch = 9, 5
    outcomes = run_workers(_train_on_blocks, world, steps, switch, timeout=120)
    want, _ = reference("mlp", "adamw", world, steps=steps)
    for o in outcomes:
        params, buckets, blocks, sized = o.value
        assert_params_match(params, want)
        assert buckets == blocks and len(blocks) > len(sized)
        assert buckets == outcomes[0].value[1]


def test_choice_tuner_under_the_controller_tries_each_candidate_once_and_keeps_the_best():
    from dearopt.planning.tuner import ChoiceTuner, TuningController

    clock = iter([0.0, 1.0, 3.0, 3.5, 4.0, 4.5, 4.6, 5.6, 8.6])  # step ends; after each switch one step is discarded
    tuner = ChoiceTuner([{"r": "a"}, {"r": "b"}, {"r": "c"}])
    ctl = TuningController(
        tuner, warmup_steps=1, measure_steps=2, is_root=True, broadcast=lambda d: d, clock=lambda: next(clock)
    )
    switches = [ctl.on_step_end() for _ in range(9)]
    assert switches == [None, None, {"r": "b"}, None, None, {"r": "c"}, None, None, {"r": "b"}]
    assert [k["r"] for k, _ in ctl.history] == ["a", "b", "c"] and ctl.finished
    assert [round(t, 6) for _, t in ctl.history] == [round(2 / 3.0, 6), 2.0, 0.5]  # 2 steps over 3, 1 and 4 s
    # one slow step (a collection, first touches of new buffers) does not decide: the median step counts
    clock = iter([0.0, 1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 14.5])  # "a": 1 s steps; "b": 0.5, 0.5 and one of 10 s
    ctl = TuningController(
        ChoiceTuner([{"r": "a"}, {"r": "b"}]),
        warmup_steps=1,
        measure_steps=3,
        is_root=True,
        broadcast=lambda d: d,
        clock=lambda: next(clock),
    )
    assert [ctl.on_step_end() for _ in range(8)][-1] is None and ctl.finished  # already on "b", the best
    assert [t for _, t in ctl.history] == [1.0, 2.0] and ctl.best == ({"r": "b"}, 2.0)
    tie = ChoiceTuner([{"r": 1}, {"r": 2}])
    tie.observe({"r": 1}, 5.0)
    tie.observe({"r": 2}, 5.0)
    assert tie.best == ({"r": 1}, 5.0) and tie.done, "a tie keeps the earlier candidate (the prediction)"
    with pytest.raises(ValueError, match="more than once"):
        ChoiceTuner([{"r": 1}, {"r": 1}])
    # rematch: the candidates within 10 % of the best are tried again in reverse order; the mean decides
    tuner = ChoiceTuner([{"r": "a"}, {"r": "b"}, {"r": "c"}], rematch=0.1)
    for r, t in (("a", 10.0), ("b", 9.5), ("c", 5.0)):
        tuner.observe({"r": r}, t)
    assert not tuner.done and tuner.suggest() == {"r": "b"}  # c is out; b then a
    tuner.observe({"r": "b"}, 10.3)
    tuner.observe({"r": "a"}, 9.0)
    assert tuner.done and tuner.best == ({"r": "b"}, pytest.approx(9.9))  # b: (9.5 + 10.3) / 2 > a: 9.5
    alone = ChoiceTuner([{"r": "a"}, {"r": "b"}], rematch=0.1)
    alone.observe({"r": "a"}, 10.0)
    alone.observe({"r": "b"}, 5.0)
    assert alone.done and alone.best == ({"r": "a"}, 10.0)  # nothing close: no second round
    with pytest.raises(ValueError, match="rematch"):
        ChoiceTuner([{"r": 1}], rematch=-0.1)
    with pytest.raises(ValueError, match="candidate on trial"):
        ChoiceTuner([{"r": 1}, {"r": 2}]).observe({"r": 2}, 1.0)


def _replan_ops_only():
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(make_optimizer("adamw", model), model, schedule=dearopt.DeAR(allreduce=0.0), buffer_size=64)
    buffers = None
    for step in range(STEPS):
        if step == 2:
            buffers = [id(b.buffer) for b in opt._executor.buckets]
            opt._executor.replan(allreduce=1.0)  # every bucket all-reduced: the same buckets, other ops
            same = [id(b.buffer) for b in opt._executor.buckets] == buffers
        train_step(opt, model, step, rank, world)
    opt.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return params, same


@pytest.mark.timeout(120)
def test_a_replan_that_changes_only_the_ops_keeps_the_buckets():
    """dear's all-reduced buckets changed between steps: the buckets (and their gradients) are kept, no new
    buffers are made, and training stays exact."""
    world = 2
    want, _ = reference("mlp", "adamw", world, STEPS)
    for o in run_workers(_replan_ops_only, world, timeout=100):
        params, same = o.value
        assert same
        assert_params_match(params, want)
