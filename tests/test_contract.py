"""The contract with the user's loop: what people do between backward() and step(), and after step(), is exact
(equal to single-process training on the global batch) or a named error at that step.

* torch's clip_grad_norm_ / clip_grad_value_ on p.grad, and GradScaler.unscale_(optimizer): exact under every
  schedule: where p.grad does not hold the averaged gradient when backward() returns (dear, bytescheduler, prophet,
  the sharded update), the first read of a p.grad finishes the reductions and gathers the average into p.grad.
* GradScaler driving step() (scale, step, update), with an overflow on one rank at a chosen step: exact under
  every schedule; every rank skips the same step and keeps the same scale.
* Parameters written or read right after step() (a WGAN clamp, an EMA): exact.
* A parameter used on some ranks only: exact.
"""

import pytest
import torch
from torch import nn

import dearopt
from harness import run_workers
from models import global_batch, loss_fn, make_model, shard
from test_distoptim import assert_params_match

SCHEDULES = ["dear", "wfbp", "rsag", "bytescheduler", "prophet", "prophet-allreduce", "dear-sharded"]
STEPS = 4
OVERFLOW_STEP = 2  # GradScaler cases: the gradient of one sample is NaN at this step


def _wrap(opt, model, schedule, **kwargs):
    """``DistOptim`` under ``schedule``; ``"dear-sharded"`` is ``dear`` with ``shard_optimizer=True``."""
    if schedule == "dear-sharded":
        return dearopt.DistOptim(opt, model, schedule="dear", shard_optimizer=True, **kwargs)
    return dearopt.DistOptim(opt, model, schedule=schedule, **kwargs)


def _batch(step, world, rank=None):
    x, y = global_batch(step, "mlp")
    if step == OVERFLOW_STEP:
        x = x.clone()
        x[-1, 0] = float("inf")  # the last sample belongs to the last rank: tanh(inf * w) has a NaN gradient
    if rank is None:
        return x, y
    return shard(x, rank, world), shard(y, rank, world)


def _opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _loop(model, opt, case, world, rank=None):
    """One training loop, the same for the reference (rank None: global batch) and each rank."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if case.startswith("scaler") else None
    norms, scales = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = (
            _batch(step, world, rank)
            if scaler
            else (
                global_batch(step, "mlp")
                if rank is None
                else tuple(shard(t, rank, world) for t in global_batch(step, "mlp"))
            )
        )
        loss = loss_fn("mlp", model(x), y)
        if scaler:
            scaler.scale(loss).backward()
            if case == "scaler+torch unscale+clip":
                scaler.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            elif case == "scaler+our unscale+clip":
                if rank is None:
                    scaler.unscale_(opt)
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
                else:
                    opt.unscale_(scaler)
                    norms.append(float(opt.clip_grad_norm_(0.05)))
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            continue
        loss.backward()
        if case == "eval forward, torch clip norm":  # an evaluation between backward and step(), then the clip
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        if case in ("torch clip norm", "eval forward, torch clip norm"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        elif case == "torch clip value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        elif case == "our clip value":
            if rank is None:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            else:
                opt.clip_grad_value_(0.01)
        opt.step()
        if case == "clamp after step":
            for p in model.parameters():
                p.data.clamp_(-0.3, 0.3)  # a WGAN critic's weight clipping, right after step()
    return norms, scales


CASES = [
    "torch clip norm",
    "torch clip value",
    "our clip value",
    "scaler",
    "scaler+torch unscale+clip",
    "scaler+our unscale+clip",
    "clamp after step",
    "eval forward, torch clip norm",
]
TORCH_TOOLS = {"torch clip norm", "torch clip value", "scaler+torch unscale+clip", "eval forward, torch clip norm"}


def _reference(case, world):
    model = make_model("mlp")
    norms, scales = _loop(model, _opt(model), case, world)
    return [p.detach().clone() for p in model.parameters()], norms, scales


def _distributed(cases):
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for schedule in SCHEDULES:
        for case in cases:
            model = make_model("mlp")
            opt = _wrap(_opt(model), model, schedule, buffer_size=64)
            try:
                norms, scales = _loop(model, opt, case, world, rank)
                opt.synchronize()
                out[(schedule, case)] = (
                    [p.detach().clone() for p in model.parameters()],
                    norms,
                    scales,
                    opt.skipped_steps,
                )
            except dearopt.DearoptError as exc:
                out[(schedule, case)] = f"{type(exc).__name__}: {exc}"
            opt.close()
    return out


def _expect_exact(schedule, case, world):
    """torch's tools act on p.grad: exact under every schedule (where p.grad does not hold the average when
    backward() returns, the first read of it gathers the average first)."""
    return True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_tools_and_writes_after_step_are_exact_or_named(world):
    refs = {case: _reference(case, world) for case in CASES}
    outcomes = run_workers(_distributed, world, CASES, timeout=220)
    for o in outcomes:
        for schedule in SCHEDULES:
            for case in CASES:
                got = o.value[(schedule, case)]
                if not _expect_exact(schedule, case, world):
                    assert isinstance(got, str) and got.startswith("UsageError"), (schedule, case, got)
                    assert "between backward() and step()" in got and "optimizer.clip_grad_norm_" in got
                    continue
                assert not isinstance(got, str), (schedule, case, got)
                params, norms, scales, skipped = got
                want, want_norms, want_scales = refs[case]
                assert_params_match(params, want)
                assert norms == pytest.approx(want_norms, rel=1e-5, nan_ok=True), (schedule, case)  # global norms
                assert scales == want_scales, (schedule, case)  # every rank skipped the same step
                if case.startswith("scaler") and world > 1:
                    assert skipped == 1, (schedule, case)


# ------------------------------------------------------------------- after step(): reads, hooks
def _ema_run(schedule, world=None, rank=None):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = make_model("mlp")
    inner = _opt(model)
    opt = inner if rank is None else _wrap(inner, model, schedule, buffer_size=64)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    opt.register_step_post_hook(lambda *a: ema.update_parameters(model))  # an EMA driven by a post hook
    norms_after_step = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        if rank is not None:
            x, y = shard(x, rank, world), shard(y, rank, world)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        with torch.no_grad():  # a read right after step(): under dear it applies the pending updates first
            norms_after_step.append(float(torch.nn.utils.parameters_to_vector(model.parameters()).norm()))
    if rank is not None:
        opt.synchronize()
        opt.close()
    return [p.detach().clone() for p in ema.module.parameters()], norms_after_step


def _ema_distributed():
    return {s: _ema_run(s, dearopt.size(), dearopt.rank()) for s in SCHEDULES}


@pytest.mark.timeout(120)
def test_an_ema_post_hook_and_reads_right_after_step_see_current_parameters():
    want, want_norms = _ema_run(None)
    for o in run_workers(_ema_distributed, 2, timeout=100):
        for schedule in SCHEDULES:
            got, norms = o.value[schedule]
            assert_params_match(got, want)
            assert norms == pytest.approx(want_norms, rel=1e-6), schedule


# ------------------------------------------------------------------- partly used parameters
class Branchy(nn.Module):
    """``extra`` runs only where ``use_extra`` is set (a rank-dependent branch, an expert some ranks route to)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, use_extra):
        h = torch.tanh(self.fc1(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h)


def _branchy_reference(world):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cleared = []
    for step in range(STEPS):
        opt.zero_grad()
        cleared.append([p.grad is None for p in model.parameters()])
        x, y = global_batch(step, "mlp")
        outs = [model(shard(x, r, world), r == 1) for r in range(world)]  # only rank 1's samples take the branch
        loss_fn("mlp", torch.cat(outs), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], cleared


def _branchy(schedule):
    rank, world = dearopt.rank(), dearopt.size()
    torch.manual_seed(0)
    model = Branchy()
    opt = _wrap(torch.optim.Adam(model.parameters(), lr=0.01), model, schedule, buffer_size=64)
    cleared = []
    for step in range(STEPS):
        opt.zero_grad()
        cleared.append([p.grad is None for p in model.parameters()])  # even where dear's update is pending
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(shard(x, rank, world), rank == 1), shard(y, rank, world)).backward()
        opt.step()
    opt.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return params, cleared


SPARSE_TOKENS = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9], [1, 3, 4, 0], [4, 7, 9, 8], [6, 6, 2, 0], [5, 1, 1, 3]])


def _sparse_embedding(schedule=None, world=1):
    """SparseAdam over nn.Embedding(sparse=True): the optimizer gets sparse gradients, as in one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True))
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
    rank = dearopt.rank() if schedule else None
    if schedule:
        opt = _wrap(opt, model, schedule)
    for step in range(STEPS):
        opt.zero_grad()
        tokens = torch.roll(SPARSE_TOKENS, step, dims=0)
        if rank is None:
            (model(tokens).sum() / tokens.shape[0]).backward()
        else:
            mine = shard(tokens, rank, world)
            (model(mine).sum() / mine.shape[0]).backward()
        opt.step()
    if schedule:
        opt.synchronize()
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


def _branchy_all():
    out = {s: _branchy(s) for s in SCHEDULES}
    for s in SCHEDULES:
        try:
            out[("sparse", s)] = _sparse_embedding(s, dearopt.size())
        except dearopt.errors.NotElementwiseError as exc:  # SparseAdam cannot be sharded: refused by name
            out[("sparse", s)] = str(exc)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_a_parameter_used_on_one_rank_only_gets_the_global_batch_gradient(world):
    """Also: sparse embedding gradients reach SparseAdam sparse, reduced as the global batch's; every p.grad
    is None after zero_grad(), as in torch (the buffers are not zeroed: the next gradient is copied in)."""
    want, want_cleared = _branchy_reference(world)
    assert all(all(step) for step in want_cleared)
    want_sparse = _sparse_embedding()
    for o in run_workers(_branchy_all, world, timeout=100):
        for schedule in SCHEDULES:
            params, cleared = o.value[schedule]
            assert_params_match(params, want)
            assert cleared == want_cleared, schedule
            if schedule == "dear-sharded":
                assert "SparseAdam cannot be sharded" in o.value[("sparse", schedule)]
                continue
            assert_params_match(o.value[("sparse", schedule)], want_sparse)


def _one_rank_reads_grad():
    model = make_model("mlp")
    opt = _wrap(_opt(model), model, "dear", buffer_size=64)
    x, y = global_batch(0, "mlp")
    rank, world = dearopt.rank(), dearopt.size()
    loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
    try:
        if rank == 0:
            float(model.fc1.weight.grad.norm())  # a log line on rank 0 only
        opt.step()
    except dearopt.DearoptError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.timeout(60)
def test_a_read_of_p_grad_on_one_rank_only_ends_in_a_timeout_that_says_so():
    """Under dear the first read of p.grad before step() gathers the averages, which every rank must join: where
    one rank alone reads it, the job cannot go on; the reading rank's timeout names the cause and the fix."""
    outcomes = run_workers(_one_rank_reads_grad, 2, timeout=50, init_kwargs={"timeout": 3.0})
    kind, message = outcomes[0].value
    assert kind == "CollectiveTimeoutError", (kind, message)
    assert "read p.grad between backward() and step()" in message and "on every rank" in message, message
    assert outcomes[1].value is not None and outcomes[1].value[0] in ("CollectiveTimeoutError", "PeerFailedError")
