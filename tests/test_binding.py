"""The bound plan: what it was derived from is recorded; a change of any input makes a new one, the same inputs
the same plan; it cannot be changed in place."""

import dataclasses

import pytest
import torch

import dearopt
from harness import run_workers
from models import global_batch, loss_fn, make_model, shard


def _step(opt, model, step):
    rank, world = dearopt.rank(), dearopt.size()
    opt.zero_grad()
    x, y = global_batch(step, "mlp")
    loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    opt.synchronize()


def _inputs_and_plans():
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule="wfbp", buffer_size=128)
    ex = opt._executor
    _step(opt, model, 0)
    first = ex.bound
    out = {"fingerprint": first.plan.fingerprint()}
    try:
        first.buckets = ()
    except dataclasses.FrozenInstanceError:
        out["frozen"] = True
    ex.replan()  # the same inputs: the same plan, every bucket kept as it was
    out["same inputs"] = ex.bound.inputs == first.inputs
    out["same fingerprint"] = ex.bound.plan.fingerprint() == out["fingerprint"]
    out["buckets kept"] = all(a is b for a, b in zip(ex.bound.buckets, first.buckets))
    ex.replan(buffer_size=64)  # a knob
    out["knob"] = (
        ex.bound.inputs.knobs.buffer_size,
        ex.bound.plan.fingerprint() != out["fingerprint"],
        len(ex.bound.buckets) > len(first.buckets),
    )
    generation = ex.planner.generation
    model.fc1.weight.requires_grad_(False)  # the trainable set
    model.fc1.weight.grad = None
    _step(opt, model, 1)
    out["frozen set"] = (
        ex.bound.inputs.groups != first.inputs.groups,
        ex.planner.generation == generation + 1,
        id(model.fc1.weight) not in ex.bound.where,
    )
    extra = torch.nn.Linear(2, 2)
    model.extra = extra  # a new parameter group (of the model's)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    before = ex.bound.inputs.groups
    _step(opt, model, 2)
    out["group"] = (len(ex.bound.inputs.groups), ex.bound.inputs.groups != before)
    opt.close()
    return out


@pytest.mark.timeout(60)
def test_a_change_of_any_input_makes_a_new_plan_and_the_same_inputs_the_same():
    got = run_workers(_inputs_and_plans, 2, timeout=50)
    for o in got:
        v = o.value
        assert v["frozen"] and v["same inputs"] and v["same fingerprint"] and v["buckets kept"]
        assert v["knob"] == (64, True, True)
        assert v["frozen set"] == (True, True, True)
        assert v["group"] == (2, True)
    assert got[0].value["fingerprint"] == got[1].value["fingerprint"]


def _replan_frees(width):
    import gc
    import weakref

    from dearopt.engine.engine import REPLAN_COLLECT_BYTES

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4 * width))
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule="dear", buffer_size=2**26)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, width)).square().mean().backward()
        opt.step()
    ex = opt._executor
    dropped = sum(b.buffer.numel() * b.buffer.element_size() for b in ex.buckets)
    old = [weakref.ref(b.buffer) for b in ex.buckets] + [weakref.ref(b) for b in ex.buckets]
    gc.disable()  # what reference counting frees
    ex.replan(buffer_size=32 * width)  # smaller buckets: the old ones dropped
    freed = [r() is None for r in old]
    gc.enable()
    opt.close()
    return dropped >= REPLAN_COLLECT_BYTES, freed


@pytest.mark.parametrize("width", [32, 1024])
def test_a_replan_frees_the_buckets_it_drops_at_once(width):
    (o,) = run_workers(_replan_frees, 1, width, timeout=60)
    large, freed = o.value
    assert large == (width == 1024)  # ~20 MiB of gradients: the cycle collector runs too; 16 KiB: it does not
    assert freed and all(freed)
