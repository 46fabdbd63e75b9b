"""Tests of dearopt.planning.tuner: BayesianTuner on injected objectives, TuningController with a fake clock."""

import copy
import logging
import math

import numpy as np
import pytest

from dearopt.planning.tuner import MB, BayesianTuner, Knob, TuningController, buffer_size_knob

# ----------------------------------------------------------------- objectives


def peaked(peak, width=0.7):
    """Throughput over log buffer size: 100 at ``peak``, falling to 50 far away.

    ``width`` is in natural-log units: with 0.7, a factor 2 off the peak loses
    19 % and a factor 1.28 loses 3 %, so "within 3 % of the optimum's
    throughput" means "within a factor 1.28 of the optimal size".
    """

    def f(x):
        d = math.log(x / peak) / width
        return 100.0 * (0.5 + 0.5 * math.exp(-0.5 * d * d))

    return f


def run(tuner, f, noise=0.02, noise_seed=0):
    """Drive ``tuner`` on ``f(knobs)`` with multiplicative Gaussian noise until done."""
    rng = np.random.RandomState(noise_seed)
    while not tuner.done:
        knobs = tuner.suggest()
        tuner.observe(knobs, f(knobs) * (1.0 + noise * rng.randn()))
    return tuner.history


# ---------------------------------------------------------------- (a) 1 knob


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peak_mb", [3, 12, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_finds_optimum_neighbourhood(peak_mb, seed):
    f = peaked(peak_mb * MB)
    tuner = BayesianTuner([buffer_size_knob()], budget=10, seed=seed)
    history = run(tuner, lambda k: f(k["buffer_size"]), noise_seed=seed)
    assert 1 <= len(history) <= 10
    sizes = [k["buffer_size"] for k, _ in history]
    assert all(1 * MB <= s <= 100 * MB for s in sizes)
    # Some trial lands within a factor 1.5 of the optimal size...
    near = [i + 1 for i, s in enumerate(sizes) if abs(math.log(s / (peak_mb * MB))) < math.log(1.5)]
    assert near, f"no trial within 1.5x of {peak_mb} MB: {[s / MB for s in sizes]}"
    # ...and the reported best is within 3 % of the optimum's (noise-free) throughput.
    best_size = tuner.best[0]["buffer_size"]
    assert f(best_size) >= 0.97 * f(peak_mb * MB), (best_size / MB, [s / MB for s in sizes])
    print(
        f"peak {peak_mb} MB seed {seed}: first within 1.5x at trial {near[0]}, "
        f"{len(history)} trials, best {best_size / MB:.2f} MB"
    )


# --------------------------------------------------------- (b) determinism


@pytest.mark.timeout(120)
def test_deterministic_under_seed():
    f = peaked(12 * MB)
    h1 = run(BayesianTuner([buffer_size_knob()], seed=3), lambda k: f(k["buffer_size"]), noise_seed=5)
    h2 = run(BayesianTuner([buffer_size_knob()], seed=3), lambda k: f(k["buffer_size"]), noise_seed=5)
    assert h1 == h2
    assert len(h1) >= 3


# ----------------------------------------------------- (c) first suggestion


@pytest.mark.timeout(30)
def test_first_suggestion_is_25MB():
    from dearopt.planning.plan import DEFAULT_BUFFER_SIZE

    tuner = BayesianTuner([buffer_size_knob()])
    first = tuner.suggest()
    assert first == {"buffer_size": 25 * 2**20} == {"buffer_size": DEFAULT_BUFFER_SIZE}
    assert isinstance(first["buffer_size"], int)
    assert tuner.suggest() == first  # idempotent until observe()
    tuner.observe(first, 10.0)
    second = tuner.suggest()
    assert second != first and 1 * MB <= second["buffer_size"] <= 100 * MB
    assert tuner.best == (first, 10.0)


# ------------------------------------------------------------- duplicates


@pytest.mark.timeout(120)
def test_flat_objective_never_repeats_and_stops():
    tuner = BayesianTuner([buffer_size_knob()], budget=10, seed=0)
    history = run(tuner, lambda k: 50.0, noise=0.0)
    xs = [math.log(k["buffer_size"]) for k, _ in history]
    for i in range(1, len(xs)):
        assert min(abs(xs[i] - x) for x in xs[:i]) > 0.01, xs
    assert len(history) < 10  # the GP learns it is flat: nothing to gain, stop early


@pytest.mark.timeout(60)
def test_small_integer_grid_stops_when_exhausted():
    tuner = BayesianTuner([Knob("credit", 1, 3, integer=True)], budget=10, min_improvement=0)
    history = run(tuner, lambda k: 10.0 + k["credit"], noise=0.0)
    credits = [k["credit"] for k, _ in history]
    assert sorted(credits) == [1, 2, 3] and credits[0] == 2
    assert tuner.done and tuner.best == ({"credit": 3}, 13.0)


# ------------------------------------------------------------ (e) 2 knobs


def joint(p_opt, c_opt):
    def f(k):
        d = math.log(k["partition_size"] / p_opt) / 0.7
        e = (k["credit"] - c_opt) / 1.5
        return 100.0 * (0.5 + 0.5 * math.exp(-0.5 * d * d - 0.5 * e * e))

    return f


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p_mb,credit", [(8, 3), (40, 1)])
def test_joint_two_knobs(p_mb, credit):
    knobs = [
        Knob("partition_size", 1 * MB, 64 * MB, log=True, initial=4 * MB, integer=True),
        Knob("credit", 1, 8, initial=2, integer=True),
    ]
    f = joint(p_mb * MB, credit)
    tuner = BayesianTuner(knobs, budget=20, seed=0)
    history = run(tuner, f)
    assert history[0][0] == {"partition_size": 4 * MB, "credit": 2}
    assert all(isinstance(k["credit"], int) and 1 <= k["credit"] <= 8 for k, _ in history)
    assert len({(k["partition_size"], k["credit"]) for k, _ in history}) == len(history)  # no repeats
    best = tuner.best[0]
    assert f(best) >= 0.95 * 100.0, (best, history)
    near = [i + 1 for i, (k, _) in enumerate(history) if f(k) >= 95.0]
    print(f"joint ({p_mb} MB, {credit}): first within 5% at trial {near[0]}, {len(history)} trials, best {best}")


# ------------------------------------------------------------ (f) bad input


@pytest.mark.timeout(30)
def test_bad_input():
    with pytest.raises(ValueError, match="buffer_size.*low must be < high"):
        Knob("buffer_size", 10, 10)
    with pytest.raises(ValueError, match="'x'.*low must be < high"):
        Knob("x", 5, 1)
    with pytest.raises(ValueError, match="'x'.*log-scale.*low > 0"):
        Knob("x", 0, 1, log=True)
    with pytest.raises(ValueError, match="'x'.*initial"):
        Knob("x", 1, 2, initial=3)
    with pytest.raises(ValueError, match="budget"):
        BayesianTuner([buffer_size_knob()], budget=0)
    with pytest.raises(ValueError, match="budget"):
        BayesianTuner([buffer_size_knob()], budget=2.5)
    with pytest.raises(ValueError, match="xi"):
        BayesianTuner([buffer_size_knob()], xi=-1)
    with pytest.raises(ValueError, match="knobs"):
        BayesianTuner([])
    with pytest.raises(ValueError, match="'a'.*more than once"):
        BayesianTuner([Knob("a", 0, 1), Knob("a", 0, 2)])
    tuner = BayesianTuner([buffer_size_knob()])
    with pytest.raises(ValueError, match="unknown knob 'credit'"):
        tuner.observe({"buffer_size": 25 * MB, "credit": 1}, 1.0)
    with pytest.raises(ValueError, match="'buffer_size' is missing"):
        tuner.observe({}, 1.0)
    with pytest.raises(ValueError, match="'buffer_size'.*outside"):
        tuner.observe({"buffer_size": 200 * MB}, 1.0)
    with pytest.raises(ValueError, match="throughput"):
        tuner.observe({"buffer_size": 25 * MB}, float("nan"))
    with pytest.raises(ValueError, match="throughput"):
        tuner.observe({"buffer_size": 25 * MB}, 0.0)
    with pytest.raises(ValueError, match="measure_steps"):
        TuningController(tuner, measure_steps=0, is_root=True, broadcast=lambda d: d)
    with pytest.raises(ValueError, match="warmup_steps"):
        TuningController(tuner, warmup_steps=-1, is_root=True, broadcast=lambda d: d)
    t1 = BayesianTuner([buffer_size_knob()], budget=1)
    t1.observe(t1.suggest(), 3.0)
    assert t1.done
    with pytest.raises(RuntimeError, match="done"):
        t1.suggest()


# ------------------------------------------------------- (d) the controller


class FakeWorld:
    """Several "ranks" in one process, stepping in lock step on a shared fake clock."""

    def __init__(
        self, n_ranks, step_time, make_tuner, warmup_steps=1, measure_steps=4, replan_cost=10.0, samples_per_step=None
    ):
        self.now = 0.0
        self.step_time = step_time  # knobs, index within the trial -> seconds
        self.replan_cost = replan_cost  # extra time of the first step after a change
        self.bcast_calls = []  # (rank, object passed)
        self._value = None
        self.controllers = []
        for r in range(n_ranks):
            self.controllers.append(
                TuningController(
                    make_tuner(),
                    warmup_steps=warmup_steps,
                    measure_steps=measure_steps,
                    is_root=(r == 0),
                    broadcast=self._broadcast_for(r),
                    clock=lambda: self.now,
                    samples_per_step=samples_per_step,
                )
            )
        self.knobs = self.controllers[0].current
        self.in_trial = 0
        self.returns = []  # per step: the list of each rank's return value

    def _broadcast_for(self, rank):
        def broadcast(obj):
            self.bcast_calls.append((rank, obj))
            if rank == 0:
                self._value = copy.deepcopy(obj)
            else:
                assert obj is None
            return copy.deepcopy(self._value)

        return broadcast

    def step(self):
        dt = self.step_time(self.knobs, self.in_trial)
        if self.in_trial == 0 and self.returns:
            dt += self.replan_cost
        self.now += dt
        self.in_trial += 1
        # rank 0 first, like a broadcast from rank 0 completes there first
        outs = [c.on_step_end() for c in self.controllers]
        assert all(o == outs[0] for o in outs), outs
        if outs[0] is not None:
            self.knobs = outs[0]
            self.in_trial = 0
        elif self.in_trial == self.controllers[0].warmup_steps + self.controllers[0].measure_steps:
            self.in_trial = 0
        self.returns.append(outs[0])
        return outs[0]


@pytest.mark.timeout(120)
def test_controller_lockstep_fake_clock(caplog):
    f = peaked(12 * MB)
    k = 4

    def step_time(knobs, i):
        # the measured steps alternate between 0.5x and 1.5x of the mean step
        # time (average and median = 1 / f): the controller must use all k, not the last one
        return (0.5 if i % 2 else 1.5) / f(knobs["buffer_size"])

    world = FakeWorld(
        3,
        step_time,
        lambda: BayesianTuner([buffer_size_knob()], budget=6, seed=0),
        warmup_steps=1,
        measure_steps=k,
        replan_cost=10.0,
    )
    assert world.controllers[0].current == {"buffer_size": 25 * MB}
    assert world.controllers[1].current == {"buffer_size": 25 * MB}
    caplog.set_level(logging.INFO, logger="dearopt.planning.tuner")
    n_steps = 0
    while not world.controllers[0].finished:
        world.step()
        n_steps += 1
        assert n_steps < 200
    for _ in range(10):
        assert world.step() is None

    # The first trial runs the initial knobs: no change until it ends.
    assert world.returns[:k] == [None] * k
    # Changes only at trial boundaries (every warmup + k = 5 steps).
    change_steps = [i + 1 for i, r in enumerate(world.returns) if r is not None]
    assert change_steps and all(s % (1 + k) == 0 for s in change_steps)
    trials = n_steps // (1 + k)
    assert n_steps == trials * (1 + k) and 2 <= trials <= 6

    hist = world.controllers[0].history
    assert len(hist) == trials
    for c in world.controllers[1:]:  # every rank knows the history and the best
        assert c.history == hist and c.best == world.controllers[0].best and c.finished
    # Warm-up discarded (the 10 s re-plan step would dominate otherwise) and
    # the measurement over the k steps (their median, here also their mean): throughput == f exactly.
    for knobs, thr in hist:
        assert thr == pytest.approx(f(knobs["buffer_size"]), rel=1e-9)
    best_knobs, best_thr = world.controllers[0].best
    assert best_thr == max(t for _, t in hist)
    assert world.knobs == best_knobs  # ends with the best
    # one broadcast per trial per rank; only rank 0 passes a decision
    assert len(world.bcast_calls) == 3 * trials
    assert all((obj is None) == (rank != 0) for rank, obj in world.bcast_calls)
    # The last change is to the best knobs (returned once, if not already in use).
    if hist[-1][0] != best_knobs:
        assert world.returns[change_steps[-1] - 1] == best_knobs
    # Logged on rank 0 only (all ranks share the logger here: count = trials).
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trial ")]
    assert len(msgs) == trials
    assert msgs[0].startswith("trial 1: buffer_size=25.00MB -> throughput ")


@pytest.mark.timeout(60)
def test_controller_no_warmup_and_samples_per_step():
    steps = []

    def step_time(knobs, i):
        steps.append(i)
        return 2.0 if knobs["buffer_size"] == 25 * MB else 1.0

    world = FakeWorld(
        2,
        step_time,
        lambda: BayesianTuner([buffer_size_knob()], budget=2),
        warmup_steps=0,
        measure_steps=3,
        replan_cost=0.0,
        samples_per_step=64,
    )
    # warmup 0: the very first call only sets the reference time, so the first
    # trial takes 4 calls and measures 3 steps
    out = [world.step() for _ in range(4)]
    assert out[:3] == [None] * 3 and out[3] is not None
    assert world.controllers[0].history[0] == ({"buffer_size": 25 * MB}, pytest.approx(3 * 64 / 6.0))
    out = [world.step() for _ in range(3)]  # second trial: 3 calls
    assert world.controllers[1].finished
    assert world.controllers[1].history[1][1] == pytest.approx(64.0)
    # the second knobs are faster, so they stay: no change returned at the end
    assert out == [None, None, None]
    assert world.controllers[1].best[1] == pytest.approx(64.0)


@pytest.mark.timeout(60)
def test_controller_survives_tuner_error():
    world = FakeWorld(
        2, lambda knobs, i: 0.1, lambda: BayesianTuner([buffer_size_knob()], budget=5), warmup_steps=1, measure_steps=2
    )

    def boom(*a, **kw):
        raise RuntimeError("injected")

    world.controllers[0].tuner.observe = boom
    outs = [world.step() for _ in range(3)]
    assert outs == [None, None, None]  # stays on the initial knobs
    assert all(c.finished for c in world.controllers)
    assert world.controllers[1].best == ({"buffer_size": 25 * MB}, pytest.approx(10.0))
