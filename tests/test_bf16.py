"""bfloat16 models: gradients summed over ranks in float32 by default (comm_hook="auto"), in bfloat16 with
comm_hook=None; against a hand computation of each: every rank's own bfloat16 gradient (computed here on its
shard, as the rank does), summed in float32 and rounded once, averaged as the engine does (times 1/world in
float32, rounded), applied by SGD."""

import pytest
import torch

import dearopt
from harness import run_workers
from models import global_batch, loss_fn, make_model, shard

LR = 0.5


def _bf16_model():
    return make_model("mlp").to(torch.bfloat16)


def _train(comm_hook, schedule):
    rank, world = dearopt.rank(), dearopt.size()
    model = _bf16_model()
    kwargs = {} if comm_hook == "default" else {"comm_hook": comm_hook}
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=LR), model, schedule=schedule, buffer_size=64, **kwargs
    )
    x, y = global_batch(0, "mlp")
    loss_fn("mlp", model(shard(x, rank, world).bfloat16()), shard(y, rank, world).bfloat16()).backward()
    opt.step()
    opt.synchronize()
    # the wire buffers the reductions took (given back to the issuer's pool once each op completed)
    wire = sorted(str(t.dtype) for t in opt._executor.issuer.pool.buffers())
    out = [p.detach().clone() for p in model.parameters()], wire
    opt.close()
    return out


def _expected(world, sum_dtype):
    """Parameters after one SGD step on the average of the ranks' bfloat16 gradients summed in ``sum_dtype``."""
    x, y = global_batch(0, "mlp")
    grads = []
    for r in range(world):
        model = _bf16_model()
        loss_fn("mlp", model(shard(x, r, world).bfloat16()), shard(y, r, world).bfloat16()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model = _bf16_model()
    inverse = torch.tensor(1.0 / world, dtype=torch.float32)
    out = []
    for i, p in enumerate(model.parameters()):
        total = torch.zeros_like(p, dtype=sum_dtype)
        for g in grads:
            total += g[i].to(sum_dtype)
        average = (total.to(torch.bfloat16).float() * inverse).to(torch.bfloat16)
        out.append(p.detach().clone().add_(average, alpha=-LR))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["dear", "wfbp"])
def test_bf16_gradients_are_summed_in_float32_by_default(schedule):
    world = 3
    outcomes = run_workers(_train, world, "default", schedule, timeout=150)
    want = _expected(world, torch.float32)
    for o in outcomes:
        params, wire = o.value
        assert set(wire) == {"torch.float32"}, wire
        for i, (got, w) in enumerate(zip(params, want)):
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, w), f"parameter {i}: {(got.float() - w.float()).abs().max()}"


def _train_within_the_least_budget():
    """``_train`` with the wire budget at its least (the largest op's buffer), the pool's peak bytes taken
    recorded; returns the parameters, that peak, the budget and the wire of all the ops together."""
    from dearopt.compression.hooks import WirePool
    from dearopt.engine import issuer

    issuer.WIRE_BUDGET = 0  # (read when the plan's issuer is made, at the first backward)
    take, peak = WirePool.take, [0]

    def recording(pool, *args):
        buffer = take(pool, *args)
        peak[0] = max(peak[0], pool.taken)
        return buffer

    WirePool.take = recording
    rank, world = dearopt.rank(), dearopt.size()
    model = _bf16_model()
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=LR), model, schedule="dear", buffer_size=64)
    x, y = global_batch(0, "mlp")
    loss_fn("mlp", model(shard(x, rank, world).bfloat16()), shard(y, rank, world).bfloat16()).backward()
    opt.step()
    opt.synchronize()
    ops = opt._executor.issuer.ops
    out = [p.detach().clone() for p in model.parameters()], peak[0], opt._executor.issuer.wire_budget
    out += (sum(op.wire for op in ops),)
    opt.close()
    return out


@pytest.mark.timeout(180)
def test_bf16_sums_within_the_least_wire_budget_are_the_same():
    """With the wire budget at its least (the largest op's buffer: the other ops wait for room, started by later
    hooks or at step()), the float32 sums are the hand computation's still, and the wire buffers taken at once
    never exceed the budget, where all of them together would."""
    world = 3
    outcomes = run_workers(_train_within_the_least_budget, world, timeout=150)
    want = _expected(world, torch.float32)
    for o in outcomes:
        params, peak, budget, total = o.value
        assert 0 < peak <= budget < total, (peak, budget, total)
        for i, (got, w) in enumerate(zip(params, want)):
            assert torch.equal(got, w), f"parameter {i}: {(got.float() - w.float()).abs().max()}"


@pytest.mark.timeout(180)
def test_comm_hook_none_reduces_in_bf16_without_wire_buffers():
    outcomes = run_workers(_train, 2, None, "dear", timeout=150)
    want = _expected(2, torch.bfloat16)  # two ranks: one addition, the same in either order
    for o in outcomes:
        params, wire = o.value
        assert wire == []
        for got, w in zip(params, want):
            assert torch.equal(got, w)


def _float32_hook():
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model)
    hook = opt._executor.comm_hook
    opt.close()
    return hook is None


@pytest.mark.timeout(60)
def test_float32_models_get_no_hook_by_default():
    """The default leaves a float32 model's buckets as they were (no wire buffers, the plan's hook is 'none')."""
    assert run_workers(_float32_hook, 1, timeout=50)[0].value is True


def test_the_wire_pool_holds_what_the_ops_in_flight_need_not_a_buffer_per_size():
    """A free buffer serves any op that fits in it (the smallest that fits); where none fits, the smaller free
    ones are let go before a buffer of the op's size is made."""
    from dearopt.compression.hooks import WirePool

    pool, f32, cpu = WirePool(), torch.float32, torch.device("cpu")
    a = pool.take(100, f32, cpu)
    b = pool.take(60, f32, cpu)  # both in flight: two buffers
    pool.give(a)
    pool.give(b)
    assert sorted(t.numel() for t in pool.buffers()) == [60, 100]
    c = pool.take(50, f32, cpu)  # the smallest that fits: b's buffer, its front
    assert c.numel() == 50 and c.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    pool.give(c)
    d = pool.take(300, f32, cpu)  # none fits: the free ones go, one buffer of 300 is made
    assert pool.buffers() == [] and d.numel() == 300
    pool.give(d)
    for n in (300, 120, 7):  # every later size fits in it, one at a time: one buffer in all
        pool.give(pool.take(n, f32, cpu))
    assert [t.numel() for t in pool.buffers()] == [300]
    assert pool.take(10, torch.bfloat16, cpu).dtype == torch.bfloat16  # another dtype: a buffer of its own


def test_the_wire_pool_keeps_within_its_limit_what_is_taken_and_free_together():
    """With the issuer's budget as its limit, a free buffer the ops in flight leave no room for is let go (the
    smallest first): the tied embedding's large op took its buffer while a bucket's stayed free beside it."""
    from dearopt.compression.hooks import WirePool

    pool, f32, cpu = WirePool(), torch.float32, torch.device("cpu")
    pool.limit = 300 * 4  # bytes
    for n in (300, 100):  # a large op's buffer and a bucket's, both free after their ops
        pool.give(pool.take(n, f32, cpu))
    assert sorted(t.numel() for t in pool.buffers()) == [300]  # 400 floats held would pass the limit
    pool.give(pool.take(100, f32, cpu))  # later buckets are served by the large buffer: nothing made
    assert [t.numel() for t in pool.buffers()] == [300]
    big = pool.take(300, f32, cpu)
    small = pool.take(100, f32, cpu)  # two in flight (more than the limit: the issuer's budget allows one op's)
    pool.give(small)
    assert pool.buffers() == []  # the small one cannot stay beside the large one in flight
    pool.give(big)
    assert [t.numel() for t in pool.buffers()] == [300] and pool.taken == 0
