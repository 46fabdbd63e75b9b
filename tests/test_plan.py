"""The planner and the schedules, without processes: layouts, fingerprints, each schedule's ops and moments."""

import dataclasses

import pytest

import dearopt
from dearopt.planning.plan import (
    ALL_GATHER,
    ALL_REDUCE,
    BACKWARD_END,
    GRADS_READY,
    REDUCE_SCATTER,
    STEP,
    CommOp,
    ParamSpec,
    When,
    after,
    forward_of,
    layout_buckets,
    padded_numel,
)
from dearopt.planning.build import build_plan
from dearopt.schedules import Schedule, get_schedule, mark_updates, register


def specs(*numels, dtype="float32", size=4):
    return [ParamSpec(f"p{i}", n, dtype, size) for i, n in enumerate(numels)]


def test_buckets_fill_from_the_output_side_and_pad_to_the_world():
    params = specs(10, 20, 30, 40)  # 40, 80, 120, 160 bytes
    buckets = layout_buckets(params, 200, world_size=3)
    # backward produces p3, p2, p1, p0: p3+p2 = 280 > 200 closes {p3}; {p2, p1} = 200; {p0}
    assert [b.params for b in buckets] == [(0,), (1, 2), (3,)]
    b = buckets[1]
    assert b.offsets == (0, 20) and b.grad_numel == 50
    assert b.flags_offset == 50 and b.tags_offset == 52  # one flag per parameter, then one tag per rank
    assert b.padded_numel == padded_numel(50 + 2 + 3, 3) == 57 and b.padded_numel % 3 == 0
    assert b.pieces == ((0, 57),) and b.shard_numel == 19


def test_a_dtype_change_closes_a_bucket():
    params = specs(4, 4) + [ParamSpec("h", 4, "float16", 2)] + specs(4)
    buckets = layout_buckets(params, 10**6, 1)
    assert [b.dtype for b in buckets] == ["float32", "float16", "float32"]
    assert [b.element_size for b in buckets] == [4, 2, 4]


def test_partitions_are_multiples_of_the_world_and_cover_the_buffer():
    (bucket,) = layout_buckets(specs(1000, 37), 10**6, 3, partition_size=256)
    assert bucket.pieces[0][0] == 0 and bucket.pieces[-1][1] == bucket.padded_numel
    for (s, e), (s2, _) in zip(bucket.pieces, bucket.pieces[1:]):
        assert e == s2
    assert all((e - s) % 3 == 0 and (e - s) * 4 <= 256 for s, e in bucket.pieces)
    assert sum(bucket.piece_nbytes(k) for k in range(len(bucket.pieces))) == bucket.padded_numel * 4


BASE = dict(params=specs(10, 20, 30, 40), buffer_size=200, world_size=2, schedule="dear")


@pytest.mark.parametrize(
    "change",
    [
        {"buffer_size": 120},
        {"world_size": 3},
        {"schedule": "wfbp"},
        {"partition_size": 64},
        {"credit": 1000},
        {"comm_hook": "cast-float16"},
        {"params": specs(10, 20, 30, 41)},
        {"params": specs(10, 20, 30, 40, dtype="float64", size=8)},
        {"priority": True, "ready_times": [0.3, 0.2, 0.1, 0.0], "bandwidth": 1.0},
    ],
)
def test_the_fingerprint_changes_with_every_input_that_matters(change):
    base = build_plan(**BASE)
    assert build_plan(**BASE).fingerprint() == base.fingerprint()  # deterministic
    changed = build_plan(**{**BASE, **change})
    assert changed.fingerprint() != base.fingerprint(), change


def test_parameter_names_are_part_of_the_fingerprint():
    # two models with the same shapes in the same order but other parameters are different models
    renamed = [dataclasses.replace(p, name=p.name + "_x") for p in BASE["params"]]
    assert build_plan(**{**BASE, "params": renamed}).fingerprint() != build_plan(**BASE).fingerprint()


def moments(plan):
    return [
        (op.kind, op.bucket, str(op.start), str(op.due), op.average, op.update and str(op.update)) for op in plan.ops
    ]


def test_wfbp_all_reduces_in_backward_order_and_updates_at_step():
    plan = build_plan(specs(10, 10, 10), 40, 2, "wfbp")
    assert moments(plan) == [(ALL_REDUCE, b, "grads ready", "backward end", True, "step") for b in (2, 1, 0)]


def test_dear_reduce_scatters_in_backward_and_gathers_one_bucket_ahead_in_forward():
    plan = build_plan(specs(10, 10, 10), 40, 2, "dear")
    assert moments(plan) == [
        (REDUCE_SCATTER, 2, "grads ready", "step", True, None),
        (REDUCE_SCATTER, 1, "grads ready", "step", True, None),
        (REDUCE_SCATTER, 0, "grads ready", "step", True, None),
        (ALL_GATHER, 0, "step", "forward of bucket 0", False, "forward of bucket 0"),
        (ALL_GATHER, 1, "forward of bucket 0", "forward of bucket 1", False, "forward of bucket 1"),
        (ALL_GATHER, 2, "forward of bucket 1", "forward of bucket 2", False, "forward of bucket 2"),
    ]
    # with a credit window every gather may start at step(); the window decides how many run
    credited = build_plan(specs(10, 10, 10), 40, 2, "dear", credit=100)
    assert [op.start for op in credited.gather_ops] == [STEP] * 3
    assert plan.update_points() == [forward_of(0), forward_of(1), forward_of(2)]
    # gathers_at_step (the measured choice's plan on Prophet's blocks): all at step(), each still due before its
    # bucket's layers; the reductions as before
    eager = build_plan(specs(10, 10, 10), 40, 2, "dear", gathers_at_step=True)
    assert [op.start for op in eager.gather_ops] == [STEP] * 3
    assert [op.due for op in eager.gather_ops] == [forward_of(0), forward_of(1), forward_of(2)]
    assert eager.first_ops == plan.first_ops and eager.fingerprint() != plan.fingerprint()


def test_rsag_gathers_each_piece_after_its_reduce_scatter():
    plan = build_plan(specs(10, 10), 40, 2, "rsag")
    assert [(op.kind, op.bucket, op.start) for op in plan.ops] == [
        (REDUCE_SCATTER, 1, GRADS_READY),
        (ALL_GATHER, 1, after(0)),
        (REDUCE_SCATTER, 0, GRADS_READY),
        (ALL_GATHER, 0, after(2)),
    ]
    assert all(op.due == BACKWARD_END for op in plan.ops)  # p.grad is averaged when backward() returns
    assert [op.update for op in plan.ops] == [None, STEP, None, STEP]
    with pytest.raises(ValueError, match="rsag"):
        dearopt.RSAG(credit=100)


def test_bytescheduler_finishes_each_bucket_just_before_its_forward():
    plan = build_plan(specs(10, 10, 10), 40, 2, "bytescheduler", partition_size=16)
    for op in plan.ops:
        assert op.kind == ALL_REDUCE and op.due == forward_of(op.bucket) and op.average
    last = {op.bucket: i for i, op in enumerate(plan.ops)}
    assert [i for i, op in enumerate(plan.ops) if op.update] == sorted(last.values())
    assert all(op.update in (None, op.due) for op in plan.ops)
    with pytest.raises(ValueError, match="skip"):
        dearopt.Options(schedule="bytescheduler", nonfinite="skip")


def test_priority_orders_the_reductions_from_the_profile():
    # bucket 2 ready at 0, 1 at 0.1, 0 at 0.2; each op takes 1 s: when the link frees, 0 (nearer the input) goes
    plan = build_plan(specs(100, 100, 100), 400, 1, "wfbp", priority=True, ready_times=[0.2, 0.1, 0.0], bandwidth=400.0)
    assert [op.bucket for op in plan.ops] == [2, 0, 1]
    assert [op.update for op in plan.ops] == [STEP, STEP, STEP]


class _GatherFirst(Schedule):
    """A broken schedule: gathers a piece before reducing it."""

    name = "test-broken"
    reduction = REDUCE_SCATTER

    def ops(self, layout):
        ops = []
        for b, k in layout.reduction_order:
            nbytes = layout.buckets[b].piece_nbytes(k)
            ops += [
                CommOp(ALL_GATHER, b, k, nbytes, start=GRADS_READY, due=STEP),
                CommOp(REDUCE_SCATTER, b, k, nbytes, start=GRADS_READY, due=STEP, average=True),
            ]
        return mark_updates(ops)


class _NoUpdate(Schedule):
    name = "test-no-update"

    def ops(self, layout):
        return [CommOp(ALL_REDUCE, b, k, layout.buckets[b].piece_nbytes(k)) for b, k in layout.reduction_order]


class _DueBeforeStart(Schedule):
    name = "test-due-before-start"

    def ops(self, layout):
        return mark_updates(
            [
                CommOp(ALL_REDUCE, b, k, layout.buckets[b].piece_nbytes(k), start=forward_of(0), due=STEP)
                for b, k in layout.reduction_order
            ]
        )


@pytest.mark.parametrize(
    "schedule, message",
    [
        (_GatherFirst(), "before any reduce-scatter"),
        (_NoUpdate(), "names the bucket's update"),
        (_DueBeforeStart(), "due before that"),
    ],
)
def test_plans_a_schedule_cannot_carry_out_are_refused(schedule, message):
    register(schedule)
    with pytest.raises(ValueError, match=message):
        build_plan(specs(10, 10), 40, 2, schedule.name)


def test_the_registry_names_the_known_schedules():
    with pytest.raises(ValueError, match="schedule must be one of .*dear.*wfbp"):
        get_schedule("fast")
    assert get_schedule("dear").reduction == REDUCE_SCATTER
    assert {"dear", "wfbp", "rsag", "bytescheduler"} <= set(dearopt.schedules.names())
    with pytest.raises(ValueError, match="already registered"):
        register(type(get_schedule("dear"))())
    assert When.FORWARD.value == "forward"


def test_the_first_bucket_backward_fills_is_small():
    params = specs(*[25] * 8)  # 100 bytes each
    big = layout_buckets(params, 400, 1)
    small = layout_buckets(params, 400, 1, first_bucket_size=150)
    assert [len(b.params) for b in big] == [4, 4]
    assert [len(b.params) for b in small] == [3, 4, 1]  # the output side's bucket holds one parameter


def test_an_embedding_is_reduced_as_rows_and_its_tied_use_is_complete_before_its_update():
    params = (
        [ParamSpec("embed.weight", 800, "float32", 4, row_numel=8)]
        + specs(10, 10)
        + [
            ParamSpec("decoder.weight (tied use)", 800, "float32", 4, twin_of=0),
            ParamSpec("decoder.bias", 100, "float32", 4),
        ]
    )
    for schedule in ("dear", "wfbp", "rsag", "bytescheduler"):
        plan = build_plan(params, 120, 2, schedule)
        by_bucket = {}
        for i, op in enumerate(plan.ops):
            by_bucket.setdefault(plan.buckets[op.bucket].params, []).append((i, op))
        ((_, rows),) = by_bucket[(0,)]
        assert rows.kind == "all_gather_rows" and rows.average and rows.start == GRADS_READY
        twin = [op for _, op in by_bucket[(3,)]]
        assert all(op.due in (BACKWARD_END, STEP) for op in twin), schedule  # averaged in full before the update
        assert all(op.kind == ALL_REDUCE and op.average for op in twin), schedule  # one op, not RS + AG
        assert dataclasses.replace(params[0]) in plan.params
        # the rows' update stays where the schedule put the embedding's
        assert rows.update == (forward_of(0) if schedule in ("dear", "bytescheduler") else STEP), schedule


def test_dear_all_reduces_the_output_side_in_backward_when_asked():
    plan = build_plan(specs(10, 10, 10, 10), 40, 2, "dear", allreduce=0.5)
    whole = {op.bucket for op in plan.ops if op.kind == ALL_REDUCE}
    assert whole == {2, 3} and plan.allreduce == (2, 3)  # the output side, half the bytes
    for op in plan.ops:
        if op.bucket in whole:
            assert op.due == BACKWARD_END and op.update == STEP and op.average
        elif op.kind == ALL_GATHER:
            assert op.due == forward_of(op.bucket) and op.update == forward_of(op.bucket)
    forward_gathers = [op for op in plan.ops if op.kind == ALL_GATHER]
    assert [(op.bucket, op.start) for op in forward_gathers] == [(0, STEP), (1, forward_of(0))]
    assert (
        build_plan(specs(10, 10), 40, 2, "dear", allreduce=0.0).fingerprint()
        != build_plan(specs(10, 10), 40, 2, "dear", allreduce=1.0).fingerprint()
    )
    assert build_plan(specs(10, 10), 40, 2, "wfbp", allreduce=1.0).allreduce == ()  # dear's choice only
    # the buckets themselves (a plan that ran, replayed by the simulator): exactly those
    assert build_plan(specs(10, 10, 10, 10), 20, 2, "dear", allreduce=(0, 3)).allreduce == (0, 3)
    with pytest.raises(ValueError, match=r"names buckets \[7\]"):
        build_plan(specs(10, 10), 20, 2, "dear", allreduce=(7,))


def test_auto_all_reduces_only_into_the_links_idle_time_in_backward():
    # four buckets of 48 bytes (10 + a flag + 2 tags padded to 12 elements); a reduce-scatter takes 48 / 480 = 0.1 s,
    # an all-reduce 0.2 s; gradients of buckets 3, 2, 1, 0 ready at 0.1, 0.2, 0.3, 0.8
    params = specs(10, 10, 10, 10)
    ready = [0.8, 0.3, 0.2, 0.1]
    plan = build_plan(params, 40, 2, "dear", allreduce="auto", ready_times=ready, bandwidth=480.0)
    # reduce-scatters only: the link ends at 0.9 (bucket 0: 0.8-0.9). All-reduces of 3, 2, 1: 0.1-0.3, 0.3-0.5,
    # 0.5-0.7, bucket 0 still 0.8-0.9; bucket 0's all-reduce would end at 1.0 > 0.9: DeAR's
    assert plan.allreduce == (1, 2, 3)
    assert build_plan(params, 40, 2, "dear", allreduce="auto").allreduce == ()  # no profile: DeAR
    # communication-bound: gradients ready at 0, 0.05, 0.1, 0.15; the reduce-scatters alone
    # keep the link busy until 0.4, so an all-reduce anywhere would make step() wait longer: none
    assert (
        build_plan(
            params, 40, 2, "dear", allreduce="auto", ready_times=[0.15, 0.1, 0.05, 0.0], bandwidth=480.0
        ).allreduce
        == ()
    )
    # idle link time early in backward: bucket 3's all-reduce (0-0.2) fits before bucket 2 is ready (0.3), the
    # others (ready 0.3, 0.4, 0.5; reduce-scatters end at 0.6) would push the end past 0.6
    assert build_plan(
        params, 40, 2, "dear", allreduce="auto", ready_times=[0.5, 0.4, 0.3, 0.0], bandwidth=480.0
    ).allreduce == (3,)
    # a twin (a tied decoder's use of p0, ready first) takes the link for its reduce-scatter and all-gather:
    # the idle time bucket 3's all-reduce used above is gone
    tied = params + [ParamSpec("decoder (tied use)", 10, "float32", 4, twin_of=0)]
    plan = build_plan(tied, 40, 2, "dear", allreduce="auto", ready_times=[0.5, 0.4, 0.3, 0.0, 0.0], bandwidth=480.0)
    assert plan.allreduce == (), [b.params for b in plan.buckets]


def test_auto_with_the_phases_balances_the_link_between_forward_and_backward():
    # four 56-byte buckets: a reduce-scatter (or an all-gather) 0.1 s, an all-reduce 0.2 s.  Gradients of buckets
    # 3, 2, 1, 0 ready at 0.0, 0.1, 0.2, 0.5; the forward computes 0.15 s, the backward 0.75 s.  Judged by
    # max(forward, gathers left) + max(backward, link end in backward):
    #   none: 0.4 + 0.75 = 1.15;  {3}: 0.3 + 0.75;  {3, 2}: 0.2 + 0.75;  {3, 2, 1}: max(0.15, 0.1) + 0.75 (link:
    #   all-reduces 0-0.2, 0.2-0.4, 0.4-0.6, bucket 0's reduce-scatter 0.6-0.7) = 0.9;  all: 0.15 + 0.8 = 0.95
    params = specs(10, 10, 10, 10)
    ready = [0.5, 0.2, 0.1, 0.0]
    knobs = dict(allreduce="auto", ready_times=ready, bandwidth=560.0)
    assert build_plan(params, 40, 2, "dear", phases=(0.15, 0.75), **knobs).allreduce == (1, 2, 3)
    # the idle-time rule (no phases) stops where the link would end later than with reduce-scatters only (0.6)
    assert build_plan(params, 40, 2, "dear", **knobs).allreduce == (2, 3)
    # the link the bottleneck in both phases (gradients at 0.1, 0.2, 0.3, 0.4; forward 0.25, backward 0.5):
    # none and {3} tie at 0.9 ({3, 2}: 0.25 + 0.7); {3} leaves more room on its tighter side (-0.1 vs -0.15)
    bound = dict(knobs, ready_times=[0.4, 0.3, 0.2, 0.1])
    assert build_plan(params, 40, 2, "dear", phases=(0.25, 0.5), **bound).allreduce == (3,)
    # an idle link (reduce-scatters of 1 ms): every plan takes 0.2 + 0.5, all leave room: every bucket all-reduced
    idle = dict(bound, bandwidth=56000.0)
    assert build_plan(params, 40, 2, "dear", phases=(0.2, 0.5), **idle).allreduce == (0, 1, 2, 3)


def test_explicit_groups_replace_the_schedules_buckets():
    params = specs(10, 20, 30, 40)
    plan = build_plan(params, 10**6, 2, "prophet", groups=[[0, 1], [2], [3]])  # no profile: prophet would fuse
    assert [b.params for b in plan.buckets] == [(0, 1), (2,), (3,)]
    assert [op.bucket for op in plan.ops if op.kind == REDUCE_SCATTER] == [2, 1, 0]
    assert (
        build_plan(params, 10**6, 2, "dear", groups=[[0, 1], [2, 3]]).fingerprint()
        != build_plan(params, 10**6, 2, "dear").fingerprint()
    )
    with pytest.raises(ValueError, match="contiguous runs"):
        build_plan(params, 10**6, 2, "dear", groups=[[0, 2], [1, 3]])


def test_bench_variants_name_a_fixed_allreduce_share():
    from dearopt.bench.runner import known_schedule, variant

    assert variant("dear@0.5") == ("dear", {"allreduce": 0.5})
    assert variant("dear-paper") == ("dear", {"allreduce": 0.0}) and variant("wfbp") == ("wfbp", {})
    for bad in ("dear@2", "dear@x", "nosuch@0.5"):
        assert not known_schedule(bad)
        with pytest.raises(ValueError, match="<schedule>@<fraction"):
            variant(bad)
    assert known_schedule("ddp") and known_schedule("dear@1") and not known_schedule("nosuch")


def test_split_points_answers_must_split_at_every_position():
    from dearopt.planning.plan import must_split, split_points

    params = [
        ParamSpec("a", 4, "float32", 4),
        ParamSpec("b", 4, "float32", 4),
        ParamSpec("c", 4, "bfloat16", 2),
        ParamSpec("d", 8, "float32", 4, row_numel=2),
        ParamSpec("e", 4, "float32", 4),
        ParamSpec("f", 4, "float32", 4, twin_of=0),
        ParamSpec("g", 4, "float32", 4),
        ParamSpec("h", 4, "float32", 4),
    ]
    assert split_points(params) == [i for i in range(len(params) - 1) if must_split(params, i)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"bucket group \[4, 5\] mixes"):
        layout_buckets(params, 1 << 20, 1, groups=[[0, 1], [2], [3], [4, 5], [6, 7]])


def test_summarised_ready_times_are_the_medians():
    import statistics

    from dearopt.planning.profile import _summarise

    for steps in (1, 2, 3, 4):
        window = [([0.1 * s + i * (-1) ** s for i in range(5)], 1.0, [], 2.0) for s in range(steps)]
        ready = _summarise(window)[0]
        assert ready == [statistics.median(t) for t in zip(*(w[0] for w in window))]
