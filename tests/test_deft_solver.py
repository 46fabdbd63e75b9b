"""DeFT's solver (issue 16, planner only): the knapsack and the two-link packing against brute force,
Algorithm 1 and Algorithm 2 (over one and two links) against hand-worked profiles, the Preserver by hand."""

import itertools
import math
import random

import pytest

from dearopt.schedules.deft.schedule import (
    RESOLUTION,
    check_partition,
    deft_schedule,
    knapsack,
    link_knapsack,
    ready_knapsack,
    recursive_knapsack,
)


def _brute_force(weights, capacity):
    best = 0.0
    for r in range(len(weights) + 1):
        for subset in itertools.combinations(range(len(weights)), r):
            total = sum(weights[i] for i in subset)
            if total <= capacity + 1e-12:
                best = max(best, total)
    return best


def test_the_knapsack_equals_brute_force_on_small_instances():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 9)
        weights = [round(rng.uniform(0.0, 0.05), 5) for _ in range(n)]
        capacity = round(rng.uniform(0.0, 0.15), 5)
        chosen = knapsack(weights, capacity)
        assert len(set(chosen)) == len(chosen)
        total = sum(weights[i] for i in chosen)
        assert total <= capacity + RESOLUTION
        assert total == pytest.approx(_brute_force(weights, capacity), abs=n * RESOLUTION)


def test_the_knapsack_by_hand():
    assert knapsack([0.3, 0.5, 0.4], 0.7) == (0, 2)  # 0.7 exactly; 0.5 alone or 0.3+0.4: the sum 0.7 wins
    assert knapsack([0.3, 0.5, 0.4], 0.2) == ()
    assert knapsack([], 1.0) == ()
    assert knapsack([0.1], 0.0) == ()
    with pytest.raises(ValueError, match="finite"):
        knapsack([float("nan")], 1.0)


def _brute_force_two_links(weights, capacities, mu):
    best = 0.0
    for where in itertools.product(range(3), repeat=len(weights)):  # 0: not sent, 1: first link, 2: second
        first = sum(w for w, k in zip(weights, where) if k == 1)
        second = sum(w for w, k in zip(weights, where) if k == 2)
        if first <= capacities[0] + 1e-12 and second * mu <= capacities[1] + 1e-12:
            best = max(best, first + second)
    return best


def test_the_two_link_packing_against_brute_force():
    rng = random.Random(1)
    equal, cases = 0, 300
    for _ in range(cases):
        n = rng.randint(0, 7)
        weights = [round(rng.uniform(0.0, 0.05), 5) for _ in range(n)]
        capacities = [round(rng.uniform(0.0, 0.12), 5) for _ in range(2)]
        mu = round(rng.uniform(1.0, 2.5), 3)
        placed = link_knapsack(weights, capacities, (1.0, mu))
        assert [i for i, _ in placed] == sorted({i for i, _ in placed})  # each item once, by index
        loads = [sum(weights[i] * (1.0, mu)[k] for i, k in placed if k == link) for link in range(2)]
        assert loads[0] <= capacities[0] + n * RESOLUTION and loads[1] <= capacities[1] + n * RESOLUTION
        total, best = sum(weights[i] for i, _ in placed), _brute_force_two_links(weights, capacities, mu)
        # a heuristic (Problem 2 is NP-hard; the paper's is greedy): never below either link alone, near the best
        assert total >= _brute_force(weights, capacities[0]) - n * RESOLUTION
        assert total >= best * 0.95 - n * RESOLUTION
        equal += abs(total - best) <= n * RESOLUTION
    assert equal >= 0.95 * cases  # measured: 299 of 300


def test_a_second_link_carries_what_the_first_cannot():
    # 3 buckets, 1 s forward and backward each, 2 s on the first link each (6 s of communication per 6 s of
    # compute).  One link: the forward stage (3 s) takes one old bucket, backward has 3 - 1 = 2 s after the
    # last bucket's backward for one new one: 2 updates in 3 iterations.
    one = deft_schedule([1, 1, 1], [1, 1, 1], [2.0, 2.0, 2.0])
    assert one.updates_per_iteration == pytest.approx(2 / 3) and one.mu is None
    assert all(it.second_old == () and it.second_new == () for it in one.warmup + one.period)
    # A second link 1.3 times slower takes a bucket in 2.6 s: in the forward stage, bucket 1 goes on it beside
    # bucket 0 on the first; bucket 2 (new) in backward as before: every iteration's gradients, one step late.
    two = deft_schedule([1, 1, 1], [1, 1, 1], [2.0, 2.0, 2.0], mu=1.3)
    assert two.updates_per_iteration == 1.0 and len(two.period) == 1 and two.mu == 1.3
    steady = two.period[0]
    assert steady.forward == (0, 1) and steady.second_old == (1,) and steady.backward_new == (2,)
    assert steady.link(1, new=False) == 1 and steady.link(0, new=False) == 0 and steady.link(2, new=True) == 0
    assert steady.applies == 1 and steady.covers == 1
    # 2.5 s a bucket: 3.25 s on the second link, more than any stage: it carries nothing, as one link
    assert (
        deft_schedule([1, 1, 1], [1, 1, 1], [2.5] * 3, mu=1.3).period
        == deft_schedule([1, 1, 1], [1, 1, 1], [2.5] * 3).period
    )
    with pytest.raises(ValueError, match="mu"):
        deft_schedule([1], [1], [0.5], mu=0.0)


def test_algorithm_1_drops_early_items_when_the_rest_fit_better():
    # ready order 3, 2, 1; each bucket's backward takes 1 s
    backward = [1.0, 1.0, 1.0, 1.0]
    comm = [0.0, 1.5, 1.5, 2.5]
    # capacity 3: the knapsack over {3, 2, 1} takes 2.5 (bucket 3) or 1.5 + 1.5 = 3.0 (buckets 2 and 1)
    assert recursive_knapsack([3, 2, 1], comm, backward, 3.0) == (2, 1)
    # capacity 2.6: all three lists: {3,2,1} -> 2.5; {2,1} with 1.6 -> 1.5; bucket 3 wins
    assert recursive_knapsack([3, 2, 1], comm, backward, 2.6) == (3,)
    assert recursive_knapsack([], comm, backward, 5.0) == ()
    assert recursive_knapsack([3, 2], comm, backward, 0.0) == ()


def _serial_link_brute_force(items, comm, backward, start, deadline):
    """The most communication time any subset of ``items`` sends, in their order, each once ready and the link
    free (from ``start``), all ending by ``deadline``."""
    ready, t = {}, 0.0
    for b in items:
        t += backward[b]
        ready[b] = t
    best = 0.0
    for r in range(len(items) + 1):
        for subset in itertools.combinations(items, r):
            free = start
            for b in subset:
                free = max(free, ready[b]) + comm[b]
            if free <= deadline + 1e-12:
                best = max(best, sum(comm[b] for b in subset))
    return best


def test_the_ready_knapsack_equals_brute_force_on_small_instances():
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(1, 7)
        comm = [rng.randint(0, 30) / 1000 for _ in range(n)]  # on the 10 us grid: exact
        backward = [rng.randint(0, 20) / 1000 for _ in range(n)]
        items = rng.sample(range(n), n)
        start, deadline = rng.randint(0, 30) / 1000, rng.randint(0, 150) / 1000
        got = ready_knapsack(items, comm, backward, start, deadline)
        assert list(got) == [b for b in items if b in got]  # in ready order
        free, ready = start, 0.0
        ready_at = {}
        for b in items:
            ready += backward[b]
            ready_at[b] = ready
        for b in got:
            free = max(free, ready_at[b]) + comm[b]
        assert free <= deadline + 1e-9 or not got
        assert sum(comm[b] for b in got) == pytest.approx(
            _serial_link_brute_force(items, comm, backward, start, deadline), abs=1e-9
        )


def test_the_ready_knapsack_refuses_what_algorithm_1_overfills():
    # bucket 2 ready 0.1 s into a 1 s backward, bucket 1 at 0.8 s; 0.5 and 0.4 s on the link.  Algorithm 1's
    # capacity after bucket 2's backward is 0.9 s and takes both; sent as they become ready, bucket 1 would end
    # at 1.2 s, after backward: only bucket 2 (0.1-0.6 s) fits
    backward, comm = [0.0, 0.7, 0.1], [0.0, 0.4, 0.5]
    assert recursive_knapsack([2, 1], comm, backward, 0.9) == (2, 1)
    assert ready_knapsack([2, 1], comm, backward, 0.0, 1.0) == (2,)
    # the old group's 0.3 s go first: bucket 2 then ends at 0.8 s, bucket 1 would at 1.2 s; one of them still fits
    assert ready_knapsack([2, 1], comm, backward, 0.3, 1.0) == (2,)
    # with 0.55 s taken: bucket 2 would end at 1.05 s, bucket 1 at 1.2 s: none; in a 1.25 s backward bucket 2,
    # and both only where bucket 1 may end at 1.45 s
    assert ready_knapsack([2, 1], comm, backward, 0.55, 1.0) == ()
    assert ready_knapsack([2, 1], comm, backward, 0.55, 1.25) == (2,)
    assert ready_knapsack([2, 1], comm, backward, 0.55, 1.45) == (2, 1)


def test_compute_rich_every_iteration_updates_one_step_late():
    # 3 buckets, 1 s forward and 2 s backward each, 0.5 s on the link each
    s = deft_schedule([1, 1, 1], [2, 2, 2], [0.5, 0.5, 0.5])
    first = s.iteration(0)
    assert first.case == 4 and first.forward == () and first.backward_new == (2, 1) and first.applies is None
    assert len(s.warmup) == 1 and len(s.period) == 1
    steady = s.period[0]
    # bucket 0 (needed first in forward, ready last in backward) goes in the next forward; then the group is whole
    # ... with the gradients of the iteration before (one step late)
    assert steady.forward == (0,) and steady.applies == 1 and steady.covers == 1
    assert steady.case == 4 and steady.backward_new == (2, 1)
    assert s.update_frequency == {0: 1.0, 1: 1.0, 2: 1.0}


def test_communication_bound_merges_two_iterations_per_update():
    # forward and backward 3 s each, 2.5 s per bucket on the link: 7.5 s of communication per 6 s of compute
    s = deft_schedule([1, 1, 1], [1, 1, 1], [2.5, 2.5, 2.5])
    it = [s.iteration(t) for t in range(6)]
    assert [i.case for i in it] == [4, 2, 4, 2, 4, 2]
    assert it[0].backward_new == ()  # 2 s of compute after the last bucket's backward: nothing fits
    assert it[1].forward == (0,) and it[1].backward_old == (1,) and it[1].held  # iteration 1's gradients held
    assert it[2].forward == (2,) and it[2].applies == 2 and it[2].covers == 1  # iteration 0's gradients
    # iteration 2's gradients are summed with the held ones of iteration 1: the next update covers both
    assert it[4].applies == 3 and it[4].covers == 2 and it[6 - 2].applies == s.iteration(6).applies
    assert len(s.period) == 2 and s.updates_per_iteration == 0.5
    assert s.update_frequency[1] == 0.5


def test_the_partition_constraint_is_checked():
    assert check_partition([1.5, 1.5], [2, 2], [2.5, 1.0]) == []
    assert check_partition([0.5, 0.5], [2, 2], [1.5, 0.2]) == [0]  # the forward stage (1 s) is the smallest
    with pytest.raises(ValueError, match="split them"):
        deft_schedule([0.5, 0.5], [2, 2], [1.5, 0.2])
    with pytest.raises(ValueError, match="one entry per bucket"):
        deft_schedule([1.0], [1.0, 1.0], [0.1, 0.1])


def test_equation_1_by_hand():
    from dearopt.schedules.deft.schedule import expected_loss

    # far from the objective the rebound does not matter: the loss falls by lr * mean
    assert expected_loss(10.0, 0.1, 2.0, 0.5, 32) == pytest.approx(10.0 - 0.2, abs=1e-12)
    # no noise: the walk stops at the objective (|s - lr*mean - S*| + S*)
    assert expected_loss(0.1, 0.1, 2.0, 0.0, 32) == pytest.approx(0.1)
    # at the objective with noise: E|X| of X ~ N(-lr*mean, (lr*std/sqrt(B))^2), computed by hand for a = -2
    spread = 0.1 * 4.0 / 4.0  # lr * std / sqrt(16)
    want = -0.2 * (2 * 0.5 * (1 + math.erf(-2 / math.sqrt(2))) - 1) + spread * math.sqrt(2 / math.pi) * math.exp(-2)
    assert expected_loss(0.0, 0.1, 2.0, 4.0, 16) == pytest.approx(want)


def test_the_preserver_raises_the_capacity_until_updates_keep_up():
    from dearopt.schedules.deft.schedule import (
        Preserver,
        _period_losses,
        expected_loss,
        preserved_schedule,
        preserver_check,
        preserver_ratio,
    )

    stats = dict(loss=2.0, lr=0.1, mean=0.5, std=1.0, batch=32)
    merged = deft_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3)  # half the updates, each of two steps' gradients
    assert [it.covers for it in merged.period if it.applies is not None] == [2]
    # one update of batch 2B instead of two of batch B; far from the objective the loss falls by lr * mean per
    # update: the paper's loss ratio (2 - 2 * 0.05) / (2 - 0.05), outside 1 +- 1 %; the progress ratio
    # 0.05 / (2 * 0.05)
    assert preserver_ratio(merged, **stats, statistic="loss") == pytest.approx((2 - 2 * 0.05) / (2 - 0.05))
    assert preserver_ratio(merged, **stats, statistic="progress") == pytest.approx(0.5)
    every_step = deft_schedule([1.0] * 3, [2.0] * 3, [0.5] * 3)
    for statistic in ("loss", "progress"):
        assert preserver_ratio(every_step, **stats, statistic=statistic) == pytest.approx(1.0)
        kept = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **stats, statistic=statistic)
        assert kept.passed and kept.resolves >= 1 and kept.capacity_factor == 1.5**kept.resolves
        assert kept.schedule.updates_per_iteration == 1.0
        # every solve in turn: the first merges (refused with the ratio above), the last is the one kept
        assert kept.tried[0] == (1.0, 0.5, preserver_ratio(merged, **stats, statistic=statistic), False)
        assert kept.tried[-1] == (kept.capacity_factor, 1.0, kept.ratio, True)
        assert len(kept.tried) == kept.resolves + 1 and not any(t[3] for t in kept.tried[:-1])
    noise = 0.1 / math.sqrt(32)  # stats' walk per step: drift lr * mean, noise lr * std / sqrt(batch)
    solved = Preserver(statistic="loss").solve([1.0] * 3, [1.0] * 3, [2.5] * 3, loss=2.0, drift=0.05, noise=noise)
    assert solved.inputs == {"loss": 2.0, "drift": 0.05, "noise": noise}
    want = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **stats, statistic="loss").tried
    assert [t[:2] + t[3:] for t in solved.tried] == [t[:2] + t[3:] for t in want]
    assert [t[2] for t in solved.tried] == pytest.approx([t[2] for t in want], rel=1e-12)
    # a near-zero learning rate makes every schedule's loss the same: the paper's ratio passes the first one,
    # though it makes half the progress, which the progress ratio sees whatever the loss
    lazy = {**stats, "lr": 1e-6}
    loose = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **lazy, statistic="loss")
    assert loose.passed and loose.resolves == 0 and loose.schedule.updates_per_iteration == 0.5
    strict = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **lazy, statistic="progress")
    assert strict.passed and strict.resolves >= 1 and strict.schedule.updates_per_iteration == 1.0
    assert preserver_ratio(merged, **lazy, statistic="progress") == pytest.approx(0.5)
    assert Preserver().statistic == "progress"  # the default (docs/deft.md: what it bought on digits)
    # the function's own default is the paper's test
    assert preserver_ratio(merged, **stats) == preserver_ratio(merged, **stats, statistic="loss")
    # no re-solve allowed: kept, marked as failed
    stuck = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **stats, max_resolves=0)
    assert not stuck.passed and stuck.schedule.updates_per_iteration == 0.5
    # where the noise dominates, exact training expects no decrease over the period (the walk rebounds off the
    # objective): a ratio of progress means nothing and the paper's two-sided loss test decides; merging two
    # steps halves the one update's noise, which the model finds far better than exact training: outside too
    near = dict(loss=0.01, lr=0.1, mean=0.01, std=5.0, batch=1)
    baseline = near["loss"]
    for _ in range(2):
        baseline = expected_loss(baseline, 0.1, 0.01, 5.0, 1)
    assert baseline > near["loss"]
    ratio, passed = preserver_check(merged, **near, statistic="progress")
    assert ratio == pytest.approx(baseline / expected_loss(0.01, 0.1, 0.01, 5.0, 2)) and ratio > 1.01
    assert not passed and (ratio, passed) == preserver_check(merged, **near, statistic="loss")
    assert (
        preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **near, statistic="progress").schedule.updates_per_iteration
        == 1.0
    )
    # outside the model: exact training's first-order decrease over the period (2 steps of lr * mean = 3.0) passes
    # the objective from the loss 1.5 (ResNet-50's first steps on the bench: drift 209.5 per step, loss 7.11).
    # The walk's verdict there is arbitrary: with little noise exact training rebounds to |1.5 - 3| = 1.5 and back
    # to 1.5, the merged update to 1.5, a ratio of 1 that the paper's test would pass (and the progress test too:
    # no expected progress, so the paper's decides).  Merging is refused by either test; the schedule that does not
    # merge passes with the ratio of identical walks
    steep = dict(loss=1.5, lr=0.1, mean=30.0, std=0.01, batch=32)
    assert len(merged.period) == 2
    baseline, delayed = _period_losses(merged, **steep, target=0.0)
    assert baseline == pytest.approx(1.5) and delayed == pytest.approx(1.5)  # what the guard keeps from passing
    for statistic in ("loss", "progress"):
        ratio, passed = preserver_check(merged, **steep, statistic=statistic)
        assert math.isnan(ratio) and not passed
        assert preserver_check(every_step, **steep, statistic=statistic) == (1.0, True)
        kept = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **steep, statistic=statistic)
        assert kept.passed and kept.resolves >= 1 and kept.schedule.updates_per_iteration == 1.0
        assert kept.ratio == 1.0 and math.isnan(kept.tried[0][2]) and kept.tried[0][1] == 0.5
        # the boundary (2 * lr * mean == loss - target) is outside; just inside, the walk judges (and refuses: the
        # merged update ends at 6.01 - 3 = 3.01, exact training at 0.01)
        assert math.isnan(preserver_check(merged, **{**steep, "loss": 6.0}, statistic=statistic)[0])
        ratio, passed = preserver_check(merged, **{**steep, "loss": 6.01}, statistic=statistic)
        assert not math.isnan(ratio) and not passed
    # with a target, the distance to it counts, not the loss
    assert math.isnan(preserver_check(merged, **{**steep, "loss": 7.5}, target=1.5, statistic="loss")[0])
    assert not math.isnan(preserver_check(merged, **{**steep, "loss": 7.5}, statistic="loss")[0])
    with pytest.raises(ValueError, match="statistic"):
        preserver_ratio(merged, **stats, statistic="accuracy")


def test_the_solver_takes_hundreds_of_pieces_without_recursing():
    """Algorithm 1 tries every suffix of the ready order; as printed it recurses once per item, and a BERT-Base
    job re-partitioned into ~1000 pieces overflowed Python's stack.  Under a recursion limit far below the
    item count the loop solves it, and the schedule is the one the same times give with six pieces (each
    piece 2.5x as long on the link as it computes in either stage: two updates every three steps)."""
    import sys

    n, limit = 300, sys.getrecursionlimit()
    sys.setrecursionlimit(150)
    try:
        schedule = deft_schedule([0.001] * n, [0.001] * n, [0.0025] * n)
    finally:
        sys.setrecursionlimit(limit)
    six = deft_schedule([1.0] * 6, [1.0] * 6, [2.5] * 6)
    assert schedule.buckets == n
    assert schedule.updates_per_iteration == six.updates_per_iteration == pytest.approx(2 / 3)
    assert [it.held for it in schedule.period] == [it.held for it in six.period]
