"""DeFT's solver (issue 16, planner only): the knapsack against brute force, Algorithm 1 and Algorithm 2
against hand-worked profiles.  No training runs under DeFT yet (the executor part is not built)."""

import itertools
import random

import pytest

from dearopt.schedules.deft import RESOLUTION, check_partition, deft_schedule, knapsack, recursive_knapsack


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
    from dearopt.schedules.deft import expected_loss

    # far from the objective the rebound does not matter: the loss falls by lr * mean
    assert expected_loss(10.0, 0.1, 2.0, 0.5, 32) == pytest.approx(10.0 - 0.2, abs=1e-12)
    # no noise: the walk stops at the objective (|s - lr*mean - S*| + S*)
    assert expected_loss(0.1, 0.1, 2.0, 0.0, 32) == pytest.approx(0.1)
    # at the objective with noise: E|X| of X ~ N(-lr*mean, (lr*std/sqrt(B))^2), computed by hand for a = -2
    spread = 0.1 * 4.0 / 4.0  # lr * std / sqrt(16)
    import math
    want = -0.2 * (2 * 0.5 * (1 + math.erf(-2 / math.sqrt(2))) - 1) + spread * math.sqrt(2 / math.pi) * math.exp(-2)
    assert expected_loss(0.0, 0.1, 2.0, 4.0, 16) == pytest.approx(want)


def test_the_preserver_raises_the_capacity_until_updates_keep_up():
    from dearopt.schedules.deft import preserved_schedule, preserver_ratio

    stats = dict(loss=2.0, lr=0.1, mean=0.5, std=1.0, batch=32)
    merged = deft_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3)  # half the updates, each of two steps' gradients
    assert [it.covers for it in merged.period if it.applies is not None] == [2]
    # one update of batch 2B instead of two of batch B; far from the objective the loss falls by lr * mean per
    # update: (2 - 2 * 0.05) / (2 - 0.05), outside 1 +- 1 %
    assert preserver_ratio(merged, **stats) == pytest.approx((2 - 2 * 0.05) / (2 - 0.05))
    every_step = deft_schedule([1.0] * 3, [2.0] * 3, [0.5] * 3)
    assert preserver_ratio(every_step, **stats) == pytest.approx(1.0)
    kept = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **stats)
    assert kept.passed and kept.resolves >= 1 and kept.capacity_factor == 1.5 ** kept.resolves
    assert kept.schedule.updates_per_iteration == 1.0
    # a near-zero learning rate makes every schedule equivalent: the first one passes
    lazy = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **{**stats, "lr": 1e-6})
    assert lazy.passed and lazy.resolves == 0 and lazy.schedule.updates_per_iteration == 0.5
    # no re-solve allowed: kept, marked as failed
    stuck = preserved_schedule([1.0] * 3, [1.0] * 3, [2.5] * 3, **stats, max_resolves=0)
    assert not stuck.passed and stuck.schedule.updates_per_iteration == 0.5
