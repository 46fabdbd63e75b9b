"""``schedule="deft"`` (issue 16): delayed, merged updates carried out across iterations, against a
single-process emulation of exactly those updates (1e-5), with a given schedule and with the solver's own."""

import pytest
import torch

import dearopt
from dearopt.schedules.deft.rounds import RSAG
from dearopt.schedules.deft.schedule import DeftIteration, DeftSchedule, Preserver, deft_schedule
from harness import Attempts, run_workers
from models import global_batch, loss_fn, make_model, make_optimizer, resumable_run, shard, train_step
from test_distoptim import assert_params_match, reference

STEPS = 7
N_BUCKETS = 6  # the MLP's six parameters, one bucket each at buffer_size=64

SCHEDULES = {
    # every group is sent whole in the next forward and applied at the end of that step: one step late
    "given: one step late": DeftSchedule(
        N_BUCKETS,
        (DeftIteration(4, (), (), (), False, None, 0),),
        (DeftIteration(4, tuple(range(N_BUCKETS)), (), (), False, 1, 1),),
    ),
    # the solver, compute-rich: the output side in its own backward, bucket 0 in the next forward
    "solver: compute-rich": deft_schedule([1.0] * N_BUCKETS, [2.0] * N_BUCKETS, [0.5] * N_BUCKETS),
    # the solver, communication-bound: every second step's gradients are held and merged into the next group
    "solver: communication-bound": deft_schedule([1.0] * N_BUCKETS, [1.0] * N_BUCKETS, [2.5] * N_BUCKETS),
    # the solver over two links (the second 1.3 times slower): some buckets go on the second communicator
    "solver: two links": deft_schedule([1.0] * N_BUCKETS, [1.0] * N_BUCKETS, [2.5] * N_BUCKETS, mu=1.3),
}

PIECES = "solver: pieces (partition_size=64)"  # every parameter of more than 16 floats sent in several pieces


def pieces_units(world):
    """The MLP's units (bucket, piece) with its buckets split at 64 bytes (the pieces depend on the world size:
    each a multiple of it)."""
    from dearopt.schedules.deft.rounds import plan_units
    from dearopt.planning.build import build_plan

    return plan_units(build_plan(_synthetic_profile().params, 64, world, "deft", partition_size=64))


def pieces_schedule(world):
    """The communication-bound solver schedule over the MLP's buckets split at 64 bytes."""
    n = len(pieces_units(world))
    assert n > N_BUCKETS
    return deft_schedule([1.0] * n, [1.0] * n, [2.5] * n)


CLIP = 0.05  # the clipped runs' max_norm: below most averages' norms here, so it binds
CLIP_VALUE = 0.004  # and clip_grad_value_'s bound: below the largest entries of most averages


def emulate(
    schedule,
    opt_name,
    steps=STEPS,
    clip=None,
    norms=None,
    clip_value=None,
    apply="group",
    units=None,
    buckets=None,
    micro=1,
    world=1,
):
    """One process, global batch: the gradients of each step grouped, held and applied as ``schedule`` says;
    with ``clip``, each applied average clipped to that norm by torch (its norms appended to ``norms``); with
    ``clip_value``, clamped to that bound by torch.  ``apply="group"``: a group as one update at the step the
    schedule applies it; ``"bucket"``: each bucket (``buckets[b]``: its parameters' positions, default one each; sent
    as the ``units`` whose bucket is ``b``, default one each) at the step that ends the iteration that sent its
    last unit.  With ``micro`` > 1 each step's gradient is the sum over its micro-batches (the k-th of every one of
    ``world`` ranks' shards together), as accumulating ranks make it."""
    model = make_model("mlp")
    opt = make_optimizer(opt_name, model)
    params = list(model.parameters())
    buckets = buckets or [[i] for i in range(len(params))]
    units = units or [(b, 0) for b in range(len(buckets))]
    group, held, held_count, applied = None, None, 0, []
    for t in range(steps):
        it = schedule.iteration(t)
        opt.zero_grad()
        x, y = global_batch(t, "mlp")
        for k in range(micro):
            part = [torch.cat([shard(v, r, world).chunk(micro)[k] for r in range(world)]) for v in (x, y)]
            loss_fn("mlp", model(part[0]), part[1]).backward()
        g = [p.grad.detach().clone() for p in model.parameters()]
        new = None
        if it.applies == 0:  # a measuring step: exact
            for p, gi in zip(model.parameters(), g):
                p.grad = gi
            opt.step()
            applied.append(t)
            continue
        if it.held:
            held = g if held is None else [a + b for a, b in zip(held, g)]
            held_count += 1
        else:
            new = (g if held is None else [a + b for a, b in zip(held, g)], held_count + 1)
            held, held_count = None, 0
        if apply == "bucket":  # sums: the group's, sent: its units sent so far, done: its buckets applied
            if group is not None:
                group[2].update(it.forward + it.backward_old)
            if new is not None:
                new = (new[0], new[1], set(it.backward_new), set())
            for grp in (group, new):  # the old group's due buckets first, then the new group's
                due = []
                for b in [] if grp is None else range(len(buckets)):
                    if b not in grp[3] and all(u in grp[2] for u, (ub, _) in enumerate(units) if ub == b):
                        grp[3].add(b)
                        due += [(i, grp[0][i] / grp[1]) for i in buckets[b]]
                for p in params:
                    p.grad = None
                for i, avg in due:
                    params[i].grad = avg
                if due:
                    opt.step()
            if it.applies is not None:
                assert len(group[3]) == len(buckets)
                applied.append(t)
                group = None
            if new is not None:
                group = new
            continue
        if it.applies is not None:
            sums, k = group
            assert k == it.covers
            for p, s in zip(model.parameters(), sums):
                p.grad = s / k
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            applied.append(t)
            group = None
        if new is not None:
            group = new
    return [p.detach().clone() for p in model.parameters()], applied


def _deft_runs(names, opt_names, clipped=(), value_clipped=()):
    """Each schedule with each optimizer, each way of applying (``deft_apply``: key ``(name, opt_name, apply)``);
    the ``clipped`` ones once more with ``optimizer.clip_grad_norm_(CLIP)`` at every step (its returned norms
    kept), the ``value_clipped`` ones with ``clip_grad_value_(CLIP_VALUE)`` (both per group)."""
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    runs = [(name, opt_name, apply) for name in names for opt_name in opt_names for apply in ("bucket", "group")]
    runs += [(name, opt_name, "clip") for name in clipped for opt_name in opt_names]
    runs += [(name, opt_name, "clip value") for name in value_clipped for opt_name in opt_names]
    for name, opt_name, clip in runs:
        model = make_model("mlp")
        schedule = pieces_schedule(world) if name == PIECES else SCHEDULES[name]
        opt = dearopt.DistOptim(
            make_optimizer(opt_name, model),
            model,
            schedule=dearopt.DeFT(
                partition_size=64 if name == PIECES else None,
                given=schedule,
                links=2 if schedule.mu else 1,
                apply="bucket" if clip == "bucket" else "group",
            ),
            buffer_size=64,
        )
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            if clip == "clip":
                norms.append(float(opt.clip_grad_norm_(CLIP)))
            elif clip == "clip value":
                opt.clip_grad_value_(CLIP_VALUE)
            opt.step()
        out[(name, opt_name, clip)] = (
            [p.detach().clone() for p in model.parameters()],
            opt.schedule.applied_steps,
            len(opt.plan.buckets),
            norms,
        )
        opt.close()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_deft_equals_the_single_process_emulation_of_its_schedule(world):
    names, opt_names = list(SCHEDULES) + [PIECES], ["adamw", "sgd"]
    clipped, value_clipped = ["solver: communication-bound", PIECES], ["solver: communication-bound"]
    outcomes = run_workers(_deft_runs, world, names, opt_names, clipped, value_clipped, timeout=130)
    assert any(it.held for it in pieces_schedule(world).period)
    held = [t for t in range(STEPS) if SCHEDULES["solver: communication-bound"].iteration(t).held]
    assert held, "the communication-bound schedule must hold some steps' gradients"
    two = [SCHEDULES["solver: two links"].iteration(t) for t in range(STEPS)]
    assert any(it.second_old for it in two) and any(it.second_new for it in two)  # both groups use the 2nd link
    for name in names:
        for opt_name in opt_names:
            for apply in ("bucket", "group"):
                want, want_applied = emulate(
                    pieces_schedule(world) if name == PIECES else SCHEDULES[name],
                    opt_name,
                    apply=apply,
                    units=pieces_units(world) if name == PIECES else None,
                )
                for o in outcomes:
                    params, applied, n_buckets, _ = o.value[(name, opt_name, apply)]
                    assert n_buckets == N_BUCKETS
                    assert applied == want_applied, name
                    assert_params_match(params, want)
    # applying per bucket is a different training from the paper's group at once (the buckets sent in their
    # own backward are applied a step earlier)
    late = [o.value[("solver: compute-rich", "sgd", a)][0] for o in outcomes[:1] for a in ("bucket", "group")]
    assert not torch.allclose(late[0][-1], late[1][-1])
    # clipping clips what a step applies: the group's average over the steps it covers, as torch clips it in
    # the emulation; the norm returned is that average's (NaN at a step that applies none)
    for name in clipped:
        for opt_name in opt_names:
            want_norms = []
            want, want_applied = emulate(
                pieces_schedule(world) if name == PIECES else SCHEDULES[name], opt_name, clip=CLIP, norms=want_norms
            )
            assert max(want_norms) > CLIP  # it binds
            for o in outcomes:
                params, applied, _, norms = o.value[(name, opt_name, "clip")]
                assert applied == want_applied
                assert_params_match(params, want)
                got = [norms[t] for t in applied]
                assert got == pytest.approx(want_norms, rel=1e-5)
                assert all(n != n for t, n in enumerate(norms) if t not in applied)  # NaN: nothing applied
                assert not all(torch.allclose(a, b) for a, b in zip(params, o.value[(name, opt_name, "group")][0]))
    for name in value_clipped:
        for opt_name in opt_names:
            want, _ = emulate(SCHEDULES[name], opt_name, clip_value=CLIP_VALUE)
            unclipped = o.value[(name, opt_name, "group")][0]
            assert not all(torch.allclose(a, b) for a, b in zip(want, unclipped))  # it binds
            for o in outcomes:
                assert_params_match(o.value[(name, opt_name, "clip value")][0], want)
    # and it is not the exact result: the delays change the training (that is the trade)
    got = outcomes[0].value[("given: one step late", "sgd", "bucket")][0]
    assert not torch.allclose(got[0], reference("mlp", "sgd", world, STEPS)[0][0])


def _accumulating_runs():
    """Two micro-batches per step: by ``no_sync()`` (the communication-bound schedule: held and merged steps) and
    by ``backward_passes_per_step=2`` (the compute-rich one), per bucket and as groups."""
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for name, how in (("solver: communication-bound", "no_sync"), ("solver: compute-rich", "bpps")):
        for apply in ("bucket", "group"):
            model = make_model("mlp")
            opt = dearopt.DistOptim(
                make_optimizer("adamw", model),
                model,
                schedule=dearopt.DeFT(given=SCHEDULES[name], apply=apply),
                buffer_size=64,
                backward_passes_per_step=2 if how == "bpps" else 1,
            )
            for step in range(STEPS):
                opt.zero_grad()
                x, y = global_batch(step, "mlp")
                parts = [shard(v, rank, world).chunk(2) for v in (x, y)]
                for k in range(2):
                    if how == "no_sync" and k == 0:
                        with opt.no_sync():
                            loss_fn("mlp", model(parts[0][k]), parts[1][k]).backward()
                    else:
                        loss_fn("mlp", model(parts[0][k]), parts[1][k]).backward()
                opt.step()
            out[(name, apply)] = ([p.detach().clone() for p in model.parameters()], opt.schedule.applied_steps)
            opt.close()
    return out


@pytest.mark.timeout(90)
def test_deft_accumulates_micro_batches_by_no_sync_and_backward_passes_per_step():
    world = 2
    for o in run_workers(_accumulating_runs, world, timeout=70):
        for (name, apply), (params, applied) in o.value.items():
            want, want_applied = emulate(SCHEDULES[name], "adamw", apply=apply, micro=2, world=world)
            assert applied == want_applied, (name, apply)
            assert_params_match(params, want)


def _synthetic_profile(halves=False):
    """A hand-made profile of the MLP (one bucket per parameter at buffer_size=64); with ``halves``, also
    reduce-scatter and all-gather fits that make the pair slightly cheaper than the all-reduce."""
    from dearopt.planning.plan import ParamSpec
    from dearopt.sim.cost import CommCost
    from dearopt.sim.profile import Profile

    sizes = [
        ("fc1.weight", 48),
        ("fc1.bias", 8),
        ("fc2.weight", 64),
        ("fc2.bias", 8),
        ("fc3.weight", 24),
        ("fc3.bias", 3),
    ]
    return Profile(
        params=[ParamSpec(n, k, "float32", 4) for n, k in sizes],
        forward_segments=[([0, 1], 0.01), ([2, 3], 0.01), ([4, 5], 0.01)],
        forward_tail=0.001,
        ready=[0.05, 0.05, 0.03, 0.03, 0.01, 0.01],
        t_bp=0.06,
        update_per_element=0.0,
        update_per_call=0.0,
        comm={
            "all_reduce": CommCost("all_reduce", 0.004, 1e-5),
            **(
                {
                    "reduce_scatter": CommCost("reduce_scatter", 0.0039, 1e-5),
                    "all_gather": CommCost("all_gather", 0.0039, 1e-5),
                }
                if halves
                else {}
            ),
        },
        comm_samples={},
        contention={},
        world=2,
    )


def test_the_measured_reduction_is_the_pair_only_where_faster_by_the_margin():
    from types import SimpleNamespace

    from dearopt.schedules.deft.rounds import ALL_REDUCE, RSAG_MARGIN, DeftMeasurement

    m = DeftMeasurement(SimpleNamespace(rsag=object()), None, None)
    m.comm = {0: 1.0, 1: 3.0}  # all-reduce of each unit alone: 4 s in all
    for saved, want in ((0.0, ALL_REDUCE), (RSAG_MARGIN / 2, ALL_REDUCE), (2 * RSAG_MARGIN, RSAG)):
        m.comm_rsag = {0: 1.0 * (1 - saved), 1: 3.0 * (1 - saved)}
        assert m.measured_reduction() == want, saved
    m.comm_rsag = {0: 0.1}  # not every unit measured as a pair: all-reduce
    assert m.measured_reduction() == ALL_REDUCE
    m.rounds.rsag = None  # no pair to choose (one link, no helper)
    m.comm_rsag = {0: 0.1, 1: 0.1}
    assert m.measured_reduction() == ALL_REDUCE


def test_bucket_times_from_a_profile_by_hand():
    from dearopt.schedules.deft.rounds import deft_times
    from dearopt.planning.build import build_plan

    profile = _synthetic_profile()
    plan = build_plan(profile.params, 64, 2, "deft")
    forward, backward, comm = deft_times(profile, plan)
    # each segment's time goes to the first bucket of its module; the tail after the last module to the last
    assert forward == pytest.approx([0.01, 0, 0.01, 0, 0.01, 0.001])
    # backward makes bucket 5 at 0.01 s, 4 with it, 3 at 0.03, 2 with it, 1 at 0.05, 0 with it; 0.01 s after
    assert backward == pytest.approx([0.01, 0.02, 0, 0.02, 0, 0.01])
    # ring all-reduce on 2 ranks: 2 steps of alpha + the bucket's bytes once (padded, with flags and tags)
    assert comm == pytest.approx([2 * 0.004 + b.padded_numel * 4 * 1e-5 for b in plan.buckets])

    # split at 64 bytes (16 floats): bucket 0 (48 floats, 1 flag, 2 tags: 52) in 4 pieces, 1 in one, 2 (64 + 1
    # + 2: 68) in 5, 3 in one, 4 (24 + 3: 28) in 2, 5 in one; each piece is a unit of the schedule
    plan = build_plan(profile.params, 64, 2, "deft", partition_size=64)
    forward, backward, comm = deft_times(profile, plan)
    # a bucket's forward time goes to its first piece
    assert forward == pytest.approx([{0: 0.01, 5: 0.01, 11: 0.01, 13: 0.001}.get(u, 0.0) for u in range(14)])
    # the pieces of a bucket are ready together: the first of them in backward's order (its last piece) waits;
    # the compute after the last gradient (0.01 s) goes to unit 0
    assert backward == pytest.approx([{0: 0.01, 4: 0.02, 10: 0.02, 13: 0.01}.get(u, 0.0) for u in range(14)])
    sizes = [16, 16, 16, 4, 12, 16, 16, 16, 16, 4, 12, 16, 12, 6]
    assert comm == pytest.approx([2 * 0.004 + n * 4 * 1e-5 for n in sizes])


def _from_profile_and_resume():
    rank, world = dearopt.rank(), dearopt.size()
    profile = _synthetic_profile(halves=True)  # its fits choose reduce-scatter + all-gather

    def run(steps, start=0, load=None):
        params, saved, opt = resumable_run(
            lambda model: dearopt.DistOptim(
                make_optimizer("adam", model),
                model,
                schedule=dearopt.DeFT(profile=profile, preserver=False),
                buffer_size=64,
            ),
            steps,
            rank,
            world,
            start,
            load,
        )
        schedule, reduction = opt.schedule.in_force, opt.schedule.piece_reduction
        opt.close()
        return params, saved, (schedule, reduction)

    whole, at3, (schedule, reduction) = run(STEPS)
    resumed, _, (_, resumed_reduction) = run(STEPS - 3, 3, at3)
    return (
        whole,
        resumed,
        schedule,
        at3[1]["dearopt_deft"]["held"] is not None or at3[1]["dearopt_deft"]["group"],
        (reduction, resumed_reduction, at3[1]["dearopt_deft"]["reduction"]),
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_the_solver_schedule_from_a_profile_and_a_bit_identical_resume(world):
    for o in run_workers(_from_profile_and_resume, world, timeout=100):
        whole, resumed, schedule, had_group, reductions = o.value
        assert had_group  # the checkpoint was taken with gradients in flight
        assert reductions == (RSAG,) * 3  # chosen by the profile's fits, saved, and resumed with
        assert schedule.updates_per_iteration < 1.0 or any(it.forward for it in schedule.period)
        want, _ = emulate(schedule, "adam", apply="bucket")
        assert_params_match(whole, want)
        for a, b in zip(whole, resumed):
            assert torch.equal(a, b)


def _pieces_resume():
    """Pieces (a bucket's units sent in different iterations), per bucket: checkpoints between them resume
    bit-identically; one of "bucket" resumed with deft_apply="group" is refused."""
    rank, world = dearopt.rank(), dearopt.size()

    def make(apply):
        return lambda model: dearopt.DistOptim(
            make_optimizer("adam", model),
            model,
            schedule=dearopt.DeFT(partition_size=64, given=pieces_schedule(world), apply=apply),
            buffer_size=64,
        )

    out = {}
    for save_at in (0, 3):
        whole, saved, opt = resumable_run(make("bucket"), STEPS, rank, world, save_at=save_at)
        opt.close()
        resumed, _, opt = resumable_run(make("bucket"), STEPS - save_at - 1, rank, world, save_at + 1, saved)
        opt.close()
        out[save_at] = (whole, resumed)
    try:
        resumable_run(make("group"), 1, rank, world, 1, saved)
    except dearopt.UsageError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.timeout(90)
def test_pieces_sent_across_a_checkpoint_resume_bit_identically():
    for o in run_workers(_pieces_resume, 2, timeout=70):
        for save_at in (0, 3):
            whole, resumed = o.value[save_at]
            want, _ = emulate(pieces_schedule(2), "adam", apply="bucket", units=pieces_units(2))
            assert_params_match(whole, want)
            assert all(torch.equal(a, b) for a, b in zip(whole, resumed)), save_at
        assert "resume with schedule=dearopt.DeFT(apply='bucket')" in o.value["mismatch"]


def _refusals():
    model = make_model("mlp")
    out = Attempts()
    attempt = out.attempt

    attempt(
        "auto buffer",
        lambda: dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1), model, schedule="deft", buffer_size="auto"
        ),
    )
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        schedule=dearopt.DeFT(given=SCHEDULES["given: one step late"]),
        buffer_size=64,
    )
    x, y = global_batch(0, "mlp")
    loss_fn("mlp", model(x), y).backward()
    attempt("unscale", lambda: opt.unscale_(128.0))
    attempt("reduce now", opt.reduce_gradients)
    attempt("clip per bucket", lambda: opt.clip_grad_norm_(1.0))  # deft_apply="bucket", the default
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    attempt("torch clip", opt.step)
    opt.close()
    attempt(
        "apply how",
        lambda: dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=dearopt.DeFT(apply="now")
        ),
    )
    attempt(
        "apply not deft",
        lambda: dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=dearopt.DeAR(apply="group")
        ),
    )
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        schedule=dearopt.DeFT(given=SCHEDULES["given: one step late"]),
        buffer_size=4096,
    )
    attempt("wrong bucket count", lambda: loss_fn("mlp", model(x), y).backward())
    opt.close()
    attempt(
        "second link not asked for",
        lambda: dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model,
            schedule=dearopt.DeFT(given=SCHEDULES["solver: two links"]),
        ),
    )
    attempt(
        "three links",
        lambda: dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=dearopt.DeFT(links=3)),
    )
    attempt(
        "preserver type",
        lambda: dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=dearopt.DeFT(preserver="yes")
        ),
    )
    model = make_model("mlp")  # the Preserver on (the default), a profile for the times, no loss reported
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        schedule=dearopt.DeFT(profile=_synthetic_profile()),
        buffer_size=64,
    )

    def three_steps():
        for step in range(3):
            opt.zero_grad()
            loss_fn("mlp", model(x), y).backward()
            out["steps before"] = step
            opt.step()

    attempt("no loss", three_steps)
    opt.close()
    model = make_model("mlp")  # a given schedule that forms a group every step and applies none
    never = DeftSchedule(N_BUCKETS, (), (DeftIteration(4, (), (), (N_BUCKETS - 1,), False, None, 0),))
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=dearopt.DeFT(given=never), buffer_size=64
    )
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    attempt("group never applied", lambda: loss_fn("mlp", model(x), y).backward())
    return out


@pytest.mark.timeout(60)
def test_what_deft_cannot_do_is_refused_by_name():
    got = run_workers(_refusals, 2, timeout=50)[0].value
    Attempts.expect(
        got,
        {
            "auto buffer": ("ValueError", "cannot re-plan"),
            "unscale": ("UsageError", "unscaling them"),
            "reduce now": ("UsageError", "reduce_gradients() are not supported"),
            "torch clip": ("UsageError", "already taken into a delayed group"),
            "clip per bucket": ("UsageError", "pass schedule=dearopt.DeFT(apply='group')"),
            "apply how": ("ValueError", "apply must be one of"),
            "apply not deft": ("TypeError", "apply"),
            "wrong bucket count": ("UsageError", "6 buckets"),
            "preserver type": ("TypeError", "preserver="),
            "second link not asked for": ("UsageError", "DeFT(links=2)"),
            "three links": ("ValueError", "links must be 1 or 2"),
            # named at the step that solves the schedule: the third, after the exact measuring steps
            "no loss": ("UsageError", "optimizer.step(loss=loss)"),
            # refused at the backward that would start a second group, before anything of it is sent
            "group never applied": ("UsageError", "forms a new group at step 1"),
        },
    )
    assert got["steps before"] == 2


class _AfterMeasuring:
    """The schedule a job that measured itself follows: exact steps, then the solved schedule."""

    def __init__(self, offset, schedule):
        self.offset, self.schedule = offset, schedule

    def iteration(self, t):
        if t < self.offset:
            return DeftIteration(4, (), (), (), False, 0, 1)
        return self.schedule.iteration(t - self.offset)


def preserver_inputs(opt_name, world, steps=3):
    """By hand, from exact single-process training on the global batch: the Preserver's loss, drift and noise
    over the first ``steps`` steps (each rank's loss and own gradient on its shard, dotted with the update)."""
    model = make_model("mlp")
    opt = make_optimizer(opt_name, model)
    losses, dots, variances = [], [], []
    for t in range(steps):
        x, y = global_batch(t, "mlp")
        own = []
        for r in range(world):
            model.zero_grad()
            loss = loss_fn("mlp", model(shard(x, r, world)), shard(y, r, world))
            loss.backward()
            losses.append(float(loss.detach()))
            own.append([p.grad.detach().clone() for p in model.parameters()])
        before = [p.detach().clone() for p in model.parameters()]
        for p, *gs in zip(model.parameters(), *own):
            p.grad = sum(gs) / world
        opt.step()
        d = [
            sum(
                float((g.double() * (p.detach() - b).double()).sum()) for g, p, b in zip(gr, model.parameters(), before)
            )
            for gr in own
        ]
        mean = sum(d) / world
        dots.append(mean)
        variances.append(sum((v - mean) ** 2 for v in d) / (world - 1))
    return sum(losses) / len(losses), -sum(dots) / steps, (sum(variances) / steps / world) ** 0.5


def _measured(buffer_size, steps, preserver=False, links=1, reduction=None, micro=1):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("adamw", model),
        model,
        schedule=dearopt.DeFT(preserver=preserver, links=links),
        buffer_size=buffer_size,
        backward_passes_per_step=micro,
    )
    executor = opt._executor.rounds  # deft's part of the engine
    measured = executor.measurement.measured_times
    real = {}

    def times():  # rank 0's real measurement is kept; the schedule is solved from fixed times, so that the
        real["times"] = measured()  # test does not depend on this machine's speed
        n = len(executor.units)
        if n == 1:  # one bucket: 1 s on the link, 0.1 s of compute per stage: must be split
            return [0.1], [0.1], [1.0]
        return [1.0] * n, [1.0] * n, [2.5] * n

    executor.measurement.measured_times = times
    if reduction is not None:  # as if rank 0 had measured this one faster
        executor.measurement.measured_reduction = lambda: reduction
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        for k in range(micro):
            parts = [shard(v, rank, world).chunk(micro)[k] for v in (x, y)]
            loss = loss_fn("mlp", model(parts[0]), parts[1])
            loss.backward()
        opt.step(loss=loss)
    out = (
        [p.detach().clone() for p in model.parameters()],
        executor.offset,
        opt.schedule.in_force,
        real.get("times"),
        executor.measured,
        opt.schedule.applied_steps,
        opt.schedule.repartitions,
        len(executor.units),
        opt.schedule.preserved,
        executor.mu,
        len(opt._executor.buckets),
        [executor.unit_nbytes(u) for u in range(len(executor.units))],
        opt.schedule.piece_reduction,
        opt.schedule.times,
        [list(b.params) for b in opt.plan.buckets],
        list(executor.units),
    )
    opt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,links", [(2, 1), (3, 2)])
def test_without_a_profile_the_job_measures_itself_exactly_first_and_the_preserver_checks_the_schedule(world, links):
    outcomes = run_workers(_measured, world, 64, STEPS + 2, True, links, timeout=100)
    loss, drift, noise = preserver_inputs("adamw", world)
    mu = outcomes[0].value[9]  # two links: the second's time over the first's, measured alone on rank 0
    assert (mu is None) == (links == 1) and all(o.value[9] == mu for o in outcomes)
    assert mu is None or mu > 0
    assert len({o.value[12] for o in outcomes}) == 1  # the reduction rank 0 measured faster, on every rank
    want_preserved = Preserver().solve(
        [1.0] * N_BUCKETS, [1.0] * N_BUCKETS, [2.5] * N_BUCKETS, loss=loss, drift=drift, noise=noise, mu=mu
    )
    assert want_preserved.passed
    if links == 1:  # the solver alone merges steps; the Preserver raised the capacities until the loss kept up
        assert (
            want_preserved.resolves > 0
            and want_preserved.schedule.updates_per_iteration
            > deft_schedule([1.0] * N_BUCKETS, [1.0] * N_BUCKETS, [2.5] * N_BUCKETS).updates_per_iteration
        )
    elif mu < 2.0:  # (measured on this machine) the second link takes a 2.5 s bucket within a 6 s stage
        assert any(it.second_old or it.second_new for it in want_preserved.schedule.period)
    for o in outcomes:
        params, offset, schedule, real, shared, applied, repartitions, _, preserved, *_ = o.value
        assert offset == 3 and applied[:3] == [0, 1, 2] and not repartitions  # the measuring steps are exact
        assert shared == ([1.0] * N_BUCKETS, [1.0] * N_BUCKETS, [2.5] * N_BUCKETS)  # rank 0's, on every rank
        assert preserved.ratio == pytest.approx(want_preserved.ratio, rel=1e-6)
        assert preserved.capacity_factor == want_preserved.capacity_factor
        assert preserved.resolves == want_preserved.resolves and preserved.passed
        assert schedule == want_preserved.schedule
        if o.rank == 0:
            forward, backward, comm = real
            assert len(forward) == len(backward) == len(comm) == N_BUCKETS
            assert all(t >= 0 for t in forward + backward) and all(c > 0 for c in comm)
            assert sum(forward) > 0 and sum(backward) > 0
        want, want_applied = emulate(
            _AfterMeasuring(offset, schedule),
            "adamw",
            STEPS + 2,
            apply="bucket",
            buckets=o.value[14],
            units=o.value[15],
        )
        assert applied == want_applied
        assert_params_match(params, want)


@pytest.mark.timeout(90)
def test_a_job_that_accumulates_measures_itself_and_follows_its_schedule():
    for o in run_workers(_measured, 2, 64, STEPS + 2, False, 1, None, 2, timeout=70):
        params, offset, schedule, real, shared, applied, *_ = o.value
        assert offset == 3 and applied[:3] == [0, 1, 2] and schedule == deft_schedule(*shared)
        if o.rank == 0:  # the forward stage measured from the step's first forward to its communicating backward
            forward, backward, comm = real
            assert sum(forward) > 0 and sum(backward) > 0 and all(c > 0 for c in comm)
        want, want_applied = emulate(
            _AfterMeasuring(offset, schedule),
            "adamw",
            STEPS + 2,
            apply="bucket",
            buckets=o.value[14],
            units=o.value[15],
            micro=2,
            world=2,
        )
        assert applied == want_applied
        assert_params_match(params, want)


@pytest.mark.timeout(120)
def test_a_bucket_longer_than_a_stage_is_split_into_buckets_and_pieces_and_measured_again():
    steps = 11  # (and the units are summed by reduce-scatter + all-gather, as if measured faster)
    for o in run_workers(_measured, 2, 4096, steps, False, 1, RSAG, timeout=100):
        (
            params,
            offset,
            schedule,
            _,
            shared,
            applied,
            repartitions,
            n_units,
            preserved,
            _,
            n_buckets,
            nbytes,
            reduction,
            times,
            buckets,
            units,
        ) = o.value
        assert reduction == RSAG
        assert preserved is None  # preserver=False
        assert schedule == deft_schedule(*shared)
        # what the solver was given, as the optimizer reports it (the bench records it): it solves to the same
        assert times == dict(zip(("forward", "backward", "comm"), map(list, shared)))
        assert schedule == deft_schedule(times["forward"], times["backward"], times["comm"])
        # one bucket (the MLP's 155 floats, 6 used flags and 2 step tags: 164 floats, 656 bytes) measured 1 s on
        # the link against 0.1 s stages: re-planned to buckets and pieces of 0.8 * 0.1 / 1 of its bytes (52), but
        # to no more than GROWTH (4) times as many pieces: a quarter of its bytes
        size = max(int(656 * 0.8 * 0.1 / 1.0), 656 // 4)
        assert repartitions == [size] and n_buckets > 1
        # fc1.weight (192 bytes) is larger than 164: its bucket is sent in pieces, each scheduled on its own
        assert n_units > n_buckets and max(nbytes) <= size and len(nbytes) == n_units
        assert offset == 6 and applied[:6] == list(range(6))  # measured twice, exact meanwhile
        assert shared == ([1.0] * n_units, [1.0] * n_units, [2.5] * n_units)
        want, want_applied = emulate(
            _AfterMeasuring(offset, schedule), "adamw", steps, apply="bucket", buckets=buckets, units=units
        )
        assert applied == want_applied
        assert_params_match(params, want)


def _timeline_run(path):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("sgd", model),
        model,
        schedule=dearopt.DeFT(given=SCHEDULES["solver: communication-bound"]),
        buffer_size=64,
        timeline=path,
    )
    schedule = SCHEDULES["solver: communication-bound"]
    for step in range(STEPS):
        train_step(opt, model, step, rank, world)
        it = schedule.iteration(step)
        if it.backward_new and not it.held:  # step() did not wait for the new group's sends: still listed
            assert len(opt._executor.rounds.group.handles) == len(it.backward_new)
    opt.synchronize()  # waits for every send in flight
    assert opt._executor.rounds.group is None or opt._executor.rounds.group.handles == []
    opt.close()


@pytest.mark.timeout(60)
def test_the_timeline_shows_every_send_of_the_schedule(tmp_path):
    """Each step's sends, as the schedule lists them (the old group's in forward and backward, the new group's in
    backward), are communication spans of that step, one per unit, on every rank; ``step()`` leaves the new
    group's sends in flight and ``synchronize()`` waits for them."""
    import json

    from dearopt.engine.timeline import timeline_path_for_rank

    path = str(tmp_path / "trace.json")
    run_workers(_timeline_run, 2, path, timeout=50)
    schedule = SCHEDULES["solver: communication-bound"]
    want = []
    for t in range(STEPS):
        it = schedule.iteration(t)
        want += [(t, u, "old") for u in it.forward + it.backward_old] + [(t, u, "new") for u in it.backward_new]
    assert any(g == "old" for *_, g in want) and any(g == "new" for *_, g in want)
    for rank in range(2):
        with open(timeline_path_for_rank(path, rank)) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
        sends = [e for e in events if e["cat"] == "comm"]
        assert all(
            e["tid"] == 1 and e["dur"] >= 0 and e["name"] == f"all_reduce unit {e['args']['unit']}" for e in sends
        )
        assert sorted((e["args"]["step"], e["args"]["unit"], e["args"]["group"]) for e in sends) == sorted(want)
        assert sum(1 for e in events if e["name"] == "step") == STEPS
