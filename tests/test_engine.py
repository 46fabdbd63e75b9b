"""The engine carries out exactly the plan: every schedule (and one registered from outside) issues the plan's
ops and trains as one process would; step hooks fire once per step; fp16/bf16 communication hooks round as
stated, under every schedule."""

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

import dearopt
from dearopt.planning.plan import ALL_REDUCE, BACKWARD_END, STEP, CommOp
from dearopt.schedules import Schedule, mark_updates, register
from harness import run_workers
from models import global_batch, loss_fn, make_model, shard
from test_distoptim import assert_params_match, reference


class AtBackwardEnd(Schedule):
    """A schedule defined outside the package: every all-reduce starts once backward has ended."""

    name = "test-at-backward-end"

    def ops(self, layout):
        return mark_updates(
            [
                CommOp(ALL_REDUCE, b, k, layout.buckets[b].piece_nbytes(k), start=BACKWARD_END, due=STEP, average=True)
                for b, k in layout.reduction_order
            ]
        )


if AtBackwardEnd.name not in dearopt.schedules.names():
    register(AtBackwardEnd())

SCHEDULES = ["dear", "wfbp", "rsag", "bytescheduler", AtBackwardEnd.name]
STEPS = 4


def _train_every_schedule(steps=STEPS):
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for schedule in SCHEDULES:
        model = make_model("mlp")
        # dear with half of the buckets all-reduced in backward: both kinds of bucket, and a plan fixed from
        # step 0 (allreduce="auto" re-plans after a profile of step 1)
        opt = dearopt.DistOptim(
            torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
            model,
            schedule=dearopt.DeAR(allreduce=0.5) if schedule == "dear" else schedule,
            buffer_size=64,
        )
        for step in range(steps):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
        planned = [(op.kind, op.bucket, op.piece) for op in opt.plan.ops]
        if schedule == "dear":
            assert {op.kind for op in opt.plan.ops} == {"all_reduce", "reduce_scatter", "all_gather"}
        issued = [entry[1:] for entry in opt._executor.launch_log]
        out[schedule] = ([p.detach().clone() for p in model.parameters()], planned, issued, len(opt.plan.buckets))
        opt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_every_schedule_issues_exactly_its_plan_and_trains_exactly(world):
    want, _ = reference("mlp", "adamw", world, steps=STEPS)
    for o in run_workers(_train_every_schedule, world, timeout=100):
        for schedule in SCHEDULES:
            params, planned, issued, n_buckets = o.value[schedule]
            assert n_buckets > 2
            # the executor starts the plan's ops, in the plan's order, once per step: nothing more, nothing less
            # (rsag's all-gathers included: dropping them from the plan changes what is issued)
            assert issued == planned * STEPS, schedule
            assert_params_match(params, want)


def _hooks(schedule):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = dearopt.DistOptim(inner, model, schedule=schedule, buffer_size=64)
    calls = {"pre": 0, "post": 0, "inner pre": 0, "inner post": 0, "global pre": 0, "global post": 0}
    seen_after_step = []

    def count(key):
        def hook(optimizer, args, kwargs):
            calls[key] += 1

        return hook

    opt.register_step_pre_hook(count("pre"))
    opt.register_step_post_hook(count("post"))
    # the post hook sees the parameters with this step's update applied (under dear: in the next forward)
    opt.register_step_post_hook(lambda *a: seen_after_step.append([p.detach().clone() for p in model.parameters()]))
    inner.register_step_pre_hook(count("inner pre"))
    inner.register_step_post_hook(count("inner post"))
    handles = [
        torch_optimizer.register_optimizer_step_pre_hook(count("global pre")),
        torch_optimizer.register_optimizer_step_post_hook(count("global post")),
    ]
    raw = []  # the wrapped optimizer's own step() runs: SGD prepares its one param group once per run
    prepare = inner._init_group
    inner._init_group = lambda *a, **k: (raw.append(1), prepare(*a, **k))[1]
    try:
        for step in range(3):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
    finally:
        for h in handles:
            h.remove()
    n_buckets = len(opt.plan.buckets)
    opt.close()
    return calls, seen_after_step, n_buckets, len(raw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["dear", "wfbp"])
def test_step_hooks_fire_once_per_step_and_post_hooks_see_the_update(schedule):
    for o in run_workers(_hooks, 2, schedule, timeout=50):
        calls, seen, n_buckets, raw = o.value
        assert n_buckets > 2
        assert calls == {k: 3 for k in calls}, calls
        if schedule == "wfbp":  # every bucket lands at step(): one run of the wrapped optimizer per step, as DDP's
            assert raw == 3
        else:  # dear: each bucket's update in the next forward, one run each (its all-reduced ones at step(), one)
            assert 3 <= raw <= 3 * n_buckets
        for step, params in enumerate(seen):
            want, _ = reference("mlp", "sgd-plain-momentum", 2, steps=step + 1)
            assert_params_match(params, want)


# --------------------------------------------------------------------------- comm hooks
def _rounded_reference(world, dtype, gathers_rounded, steps=STEPS):
    """One process, the ranks' gradients rounded as the wire rounds them: each rank's gradient in ``dtype``,
    their sum rounded to ``dtype``, divided by the world size in float32, and (dear: the all-gather travels
    in ``dtype`` too) rounded once more."""
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step, "mlp")
        total = None
        for r in range(world):
            model.zero_grad()
            loss_fn("mlp", model(shard(x, r, world)), shard(y, r, world)).backward()
            grads = [p.grad.to(dtype).float() for p in model.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            avg = g.to(dtype).float() / world
            p.grad = avg.to(dtype).float() if gathers_rounded else avg
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_with_hook(cases, steps=STEPS):
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for schedule, hook in cases:
        model = make_model("mlp")
        opt = dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model,
            schedule=schedule,
            buffer_size=64,
            comm_hook=hook,
        )
        for step in range(steps):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
        out[(schedule, hook)] = [p.detach().clone() for p in model.parameters()]
        opt.close()
    return out


HOOK_CASES = [
    ("dear", "fp16"),
    ("dear", "bf16"),
    ("wfbp", "fp16"),
    ("wfbp", "bf16"),
    ("rsag", "bf16"),
    ("bytescheduler", "fp16"),
]


@pytest.mark.timeout(120)
def test_fp16_and_bf16_hooks_round_exactly_as_stated_on_two_ranks():
    """With two ranks every rounding of the wire is reproducible in one process: equal within float32 noise."""
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    exact, _ = reference("mlp", "sgd-plain-momentum", 2, steps=STEPS)
    for o in run_workers(_train_with_hook, 2, HOOK_CASES, timeout=100):
        for schedule, hook in HOOK_CASES:
            got = o.value[(schedule, hook)]
            # the all-gathers of dear and rsag carry the averaged gradient in the wire dtype too
            want = _rounded_reference(2, dtypes[hook], gathers_rounded=schedule in ("dear", "rsag"))
            assert_params_match(got, want)
            # and the rounding is real: bounded by the dtype's precision, not zero
            error = max(float((g - e).abs().max()) for g, e in zip(got, exact))
            bound = {"fp16": 2e-3, "bf16": 2e-2}[hook]
            assert 0 < error < bound, (schedule, hook, error)


@pytest.mark.timeout(120)
def test_fp16_hook_under_dear_on_three_ranks_within_its_bound():
    # three fp16 terms: the wire's sum may round in another order than one process does; one fp16 ulp per step
    cases = [("dear", "fp16")]
    want = _rounded_reference(3, torch.float16, gathers_rounded=True)
    for o in run_workers(_train_with_hook, 3, cases, timeout=100):
        got = o.value[cases[0]]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-4)


# --------------------------------------------------------------------------- tied embeddings, rows
VOCAB, DIM = 200, 8


class TiedLM(torch.nn.Module):
    """A word embedding shared with the output projection (BERT's MLM head); ``functional`` also uses the
    weight outside any module, which makes its gradient dense in a way the engine cannot see coming."""

    def __init__(self, tied=True, functional=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.decoder = torch.nn.Linear(DIM, VOCAB)
        if tied:
            self.decoder.weight = self.embed.weight
        self.functional = functional

    def forward(self, tokens):
        h = torch.tanh(self.hidden(self.embed(tokens)))
        if self.functional:
            h = h + torch.tanh(h @ self.embed.weight.T).mean(-1, keepdim=True)  # every row of the weight
        return self.decoder(h)


def _lm_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (6, 2), generator=g), torch.randint(0, VOCAB, (6, 2), generator=g)


def _lm_loss(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def _lm_reference(variant, steps=STEPS):
    torch.manual_seed(0)
    model = TiedLM(**variant)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        x, y = _lm_batch(step)
        _lm_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


LM_VARIANTS = {"tied": {}, "untied": {"tied": False}, "tied + functional use": {"functional": True}}


def _lm_distributed(steps=STEPS):
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for name, variant in LM_VARIANTS.items():
        for schedule in ["dear", "wfbp", "rsag", "bytescheduler"]:
            torch.manual_seed(0)
            model = TiedLM(**variant)
            opt = dearopt.DistOptim(
                torch.optim.Adam(model.parameters(), lr=0.01), model, schedule=schedule, buffer_size=256
            )
            for step in range(steps):
                opt.zero_grad()
                x, y = _lm_batch(step)
                _lm_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
                opt.step()
            opt.synchronize()
            out[(name, schedule)] = (
                [p.detach().clone() for p in model.parameters()],
                dict(opt._executor.rows_reductions),
                [b.spec.twin_of is not None for b in opt._executor.buckets].count(True),
                type(model.decoder.weight) is torch.nn.Parameter and model.decoder.weight is model.embed.weight
                if variant.get("tied", True)
                else True,
            )
            opt.close()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_tied_and_untied_embeddings_are_reduced_as_rows_exactly(world):
    refs = {name: _lm_reference(variant) for name, variant in LM_VARIANTS.items()}
    for o in run_workers(_lm_distributed, world, timeout=140):
        for (name, schedule), (params, rows, twins, tied_after) in o.value.items():
            assert_params_match(params, refs[name])
            assert tied_after, "the model's tying is restored outside forward"
            assert twins == (0 if name == "untied" else 1), (name, schedule)
            if name == "tied + functional use":  # dense: every rank noticed and all-reduced densely
                assert rows == {"rows": 0, "dense": STEPS}, (name, schedule, rows)
            else:  # a few rows of 200 per rank each step
                assert rows == {"rows": STEPS, "dense": 0}, (name, schedule, rows)
