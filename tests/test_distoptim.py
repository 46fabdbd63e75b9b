"""DistOptim against single-process training on the global batch (and against DDP).

Every test asserts parameter values: after N steps on W ranks, each rank's
parameters equal those of one process that trained on the concatenated global
batch with the mean loss, within 1e-5 relative (float32).
"""

import pytest
import torch

import dearopt
from harness import run_workers
from models import OPTIMIZERS, global_batch, loss_fn, make_model, make_optimizer, make_scheduler, shard

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6
ALL_OPTIMIZERS = list(OPTIMIZERS) + ["groups+scheduler"]


def reference(kind, opt_name, world, steps=STEPS, *, bpps=1, set_to_none=True, clip=None, skip_middle_at=()):
    """One process, global batch, mean loss: what every rank must end with."""
    model = make_model(kind)
    opt = make_optimizer(opt_name, model)
    sched = make_scheduler(opt_name, opt)
    norms = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        if hasattr(model, "skip_middle"):
            model.skip_middle = step in skip_middle_at
        for micro in range(bpps):
            x, y = global_batch(step * bpps + micro, kind)
            (loss_fn(kind, model(x), y) / bpps).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched:
            sched.step()
    return [p.detach().clone() for p in model.parameters()], norms


def _train(
    kind,
    opt_names,
    schedule,
    steps=STEPS,
    buffer_size=64,
    bpps=1,
    use_no_sync=False,
    set_to_none=True,
    clip=None,
    skip_middle_at=(),
    read_with="synchronize",
    **options,
):
    rank, world = dearopt.rank(), dearopt.size()
    policy = dearopt.schedules.get_schedule(schedule)
    knobs = {k: options.pop(k) for k in list(options) if k in policy.knob_names()}  # the schedule's own
    if knobs:
        schedule = policy.with_knobs(**knobs)
    results = {}
    for opt_name in opt_names:
        model = make_model(kind)
        opt = dearopt.DistOptim(
            make_optimizer(opt_name, model),
            model,
            schedule=schedule,
            buffer_size=buffer_size,
            backward_passes_per_step=1 if use_no_sync else bpps,
            **options,
        )
        sched = make_scheduler(opt_name, opt)
        norms = []
        for step in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            if hasattr(model, "skip_middle"):
                model.skip_middle = step in skip_middle_at
            for micro in range(bpps):
                x, y = global_batch(step * bpps + micro, kind)
                loss = loss_fn(kind, model(shard(x, rank, world)), shard(y, rank, world)) / bpps
                if use_no_sync and micro < bpps - 1:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            if clip is not None:
                norms.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
            if sched:
                sched.step()
        if read_with == "synchronize":
            opt.synchronize()
            params = [p.detach().clone() for p in model.parameters()]
        elif read_with == "state_dict":
            state = model.state_dict()
            params = [state[name].clone() for name, _ in model.named_parameters()]
        elif read_with == "eval_forward":
            model.eval()
            with torch.no_grad():
                model(global_batch(0, kind)[0][:2])
            params = [p.detach().clone() for p in model.parameters()]
        results[opt_name] = (params, norms, len(opt.plan.buckets))
        opt.close()
    return results


def assert_params_match(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m: f"parameter {i}: {m}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", ["dear", "wfbp", "rsag"])
def test_every_optimizer_matches_single_process(schedule, world):
    outcomes = run_workers(_train, world, "mlp", ALL_OPTIMIZERS, schedule, timeout=150)
    for opt_name in ALL_OPTIMIZERS:
        want, _ = reference("mlp", opt_name, world)
        for o in outcomes:
            params, _, n_buckets = o.value[opt_name]
            assert n_buckets > 2, "the test must exercise several buckets"
            assert_params_match(params, want)


CASES = {
    # name: (model kind, optimizer, train kwargs, reference kwargs)
    "unused parameters": ("unused", "adamw", {}, {}),
    "tied parameters": ("tied", "adam", {}, {}),
    "frozen parameters": ("frozen", "sgd", {}, {}),
    "forward order differs from registration": ("reordered", "adamw", {}, {}),
    "backward_passes_per_step=2": ("mlp", "adam", {"bpps": 2}, {"bpps": 2}),
    "no_sync accumulation": ("mlp", "sgd", {"bpps": 3, "use_no_sync": True}, {"bpps": 3}),
    "zero_grad(set_to_none=False) with unused": ("unused", "adamw", {"set_to_none": False}, {"set_to_none": False}),
    "dynamic control flow skips a bucket": ("mlp", "adam", {"skip_middle_at": (1, 3)}, {"skip_middle_at": (1, 3)}),
    "clip_grad_norm_": ("mlp", "sgd", {"clip": 0.05}, {"clip": 0.05}),
    "state_dict after last step": ("mlp", "adamw", {"read_with": "state_dict"}, {}),
    "eval forward applies pending updates": ("mlp", "rmsprop", {"read_with": "eval_forward"}, {}),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["dear", "wfbp"])
@pytest.mark.parametrize("case", list(CASES))
def test_cases_users_hit(case, schedule):
    kind, opt_name, train_kwargs, ref_kwargs = CASES[case]
    world = 3 if schedule == "dear" else 2
    outcomes = run_workers(_train, world, kind, [opt_name], schedule, timeout=150, **train_kwargs)
    want, want_norms = reference(kind, opt_name, world, **ref_kwargs)
    for o in outcomes:
        params, norms, _ = o.value[opt_name]
        assert_params_match(params, want)
        if want_norms:
            assert norms == pytest.approx(want_norms, rel=1e-5)
    if case == "frozen parameters":
        frozen_before = [p.detach() for p in make_model(kind).fc2.parameters()]
        torch.testing.assert_close(outcomes[0].value[opt_name][0][2], frozen_before[0], rtol=0, atol=0)


def _forward_order_plan():
    model = make_model("reordered")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=1)
    x, y = global_batch(0, "reordered")
    loss_fn("reordered", model(x), y).backward()
    opt.step()
    return [opt.plan.params[i].name for b in opt.plan.buckets for i in b.params]


@pytest.mark.timeout(60)
def test_plan_follows_forward_order_not_registration():
    names = run_workers(_forward_order_plan, 2)[0].value
    assert names == ["first.weight", "first.bias", "middle.weight", "middle.bias", "last.weight", "last.bias"]


def _step_without_backward():
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model(torch.randn(2, 6))
    opt.step()


@pytest.mark.timeout(60)
def test_step_without_backward_is_a_clear_error():
    for o in run_workers(_step_without_backward, 2, expect_errors=True):
        assert o.error_type == "UsageError" and "backward" in o.message


def _mismatched_models():
    model = make_model("mlp" if dearopt.rank() == 0 else "unused")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, broadcast_parameters=False)
    x, y = global_batch(0, "mlp")
    loss_fn("mlp", model(x), y).backward()
    opt.step()


@pytest.mark.timeout(60)
def test_plan_mismatch_is_a_named_error_on_every_rank():
    for o in run_workers(_mismatched_models, 2, expect_errors=True, timeout=40):
        assert o.error_type == "PlanMismatchError", o.message
        assert "ranks [1] differ from rank 0" in o.message


def _against_ddp(schedule):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dearopt.rank(), dearopt.size()
    ours = make_model("batchnorm")
    theirs = make_model("batchnorm")
    if rank == 1:  # different start: both must broadcast rank 0's parameters and buffers
        for p in list(ours.parameters()) + list(theirs.parameters()):
            p.data.add_(1.0)
    ddp = DDP(theirs, bucket_cap_mb=25)
    opt = dearopt.DistOptim(torch.optim.Adam(ours.parameters(), lr=0.01), ours, schedule=schedule, buffer_size=64)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = global_batch(step, "mlp")
        x, y = shard(x, rank, world), shard(y, rank, world)
        opt.zero_grad()
        loss_fn("mlp", ours(x), y).backward()
        opt.step()
        ddp_opt.zero_grad()
        loss_fn("mlp", ddp(x), y).backward()
        ddp_opt.step()
    opt.synchronize()
    return (
        [p.detach().clone() for p in ours.parameters()],
        [p.detach().clone() for p in theirs.parameters()],
        [b.clone() for b in ours.buffers()],
        [b.clone() for b in theirs.buffers()],
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["dear", "wfbp", "rsag"])
def test_matches_ddp_with_batchnorm_buffers(schedule):
    for o in run_workers(_against_ddp, 2, schedule):
        ours, theirs, our_buffers, their_buffers = o.value
        assert_params_match(ours, theirs)
        for a, b in zip(our_buffers, their_buffers):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_bad_arguments_are_named():
    dearopt.init()
    try:
        model = make_model("mlp")
        with pytest.raises(TypeError, match="torch.optim.Optimizer"):
            dearopt.DistOptim(None, model)
        with pytest.raises(TypeError, match="nn.Module"):
            dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), "model")
        with pytest.raises(ValueError, match="not a parameter of the model"):
            dearopt.DistOptim(torch.optim.SGD(make_model("mlp").parameters(), lr=0.1), model)
        with pytest.raises(ValueError, match="schedule"):
            dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule="fast")
        with pytest.raises(ValueError, match="cannot read size"):
            dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size="lots")
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = dearopt.DistOptim(inner, model)
        with pytest.raises(dearopt.UsageError, match="already"):
            dearopt.DistOptim(inner, model)
        with pytest.raises(dearopt.UsageError, match="already a DistOptim"):
            dearopt.DistOptim(opt, model)
        frozen = make_model("mlp")
        for p in frozen.parameters():
            p.requires_grad_(False)
        with pytest.raises(ValueError, match="nothing to train"):
            dearopt.DistOptim(torch.optim.SGD(frozen.parameters(), lr=0.1), frozen)
        opt.close()
    finally:
        dearopt.shutdown()
