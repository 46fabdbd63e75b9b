"""``comm_hook=dearopt.Sparsify(...)`` (issue 18): DEFT's fragmented, norm-weighted top-k with error feedback.

The pure parts (Algorithms 2-4) by hand; the distributed runs against a single-process emulation of exactly
that selection and those residuals (1e-5) on 2 and 3 ranks, under ``wfbp`` and ``dear``; density 1.0 against
dense training; what each rank sends against the number of ranks; a bit-identical resume; refusals."""

import copy
import math

import pytest
import torch

import dearopt
from dearopt.compression.sparsify import (
    Fragment,
    allocate,
    assign_k,
    dense_by_default,
    fragments,
    largest,
    selection_cost,
)
from harness import Attempts, run_workers
from models import global_batch, loss_fn, make_model, make_optimizer, resumable_run, shard
from test_distoptim import assert_params_match, reference

STEPS = 6


# ----------------------------------------------------------------------------------------- by hand
def test_fragments_cut_what_one_rank_would_otherwise_take_mostly():
    # 60 + 10 + 2 elements on 3 ranks: at most ceil(72 / 3) = 24 per fragment; 60 -> 3 x 20
    got = fragments([(0, 0, 60), (1, 60, 10), (3, 80, 2)], 3)
    assert got == [
        Fragment(0, 0, 20),
        Fragment(0, 20, 20),
        Fragment(0, 40, 20),
        Fragment(1, 60, 10),
        Fragment(3, 80, 2),
    ]
    # 7 on 2 ranks (limit 4): two parts, the first one longer
    assert fragments([(0, 0, 7)], 2) == [Fragment(0, 0, 4), Fragment(0, 4, 3)]
    assert fragments([], 2) == []


def test_k_follows_the_norms_and_never_exceeds_a_fragment():
    # norms 3, 1, 0; k = 8: the largest first gets round(8 * 3/4) = 6, then round(2 * 1/1) = 2, then 0
    assert assign_k([3.0, 1.0, 0.0], [10, 10, 10], 8) == [6, 2, 0]
    # a full fragment passes what it cannot take on: 6 > 4 -> 4, then the other takes round(4 * 1/1) = 4
    assert assign_k([3.0, 1.0], [4, 10], 8) == [4, 4]
    # ties by position; all-zero norms share by size
    assert assign_k([1.0, 1.0], [10, 10], 3) == [2, 1]
    assert assign_k([0.0, 0.0], [30, 10], 4) == [3, 1]
    assert sum(assign_k([0.5, 0.25, 0.25], [3, 3, 3], 9)) == 9  # never more than there is, all when asked


def _topk_set(values, k):
    return torch.topk(values, k, sorted=False).indices.sort().values


@pytest.mark.parametrize("n,k", [(300_000, 3_000), (200_003, 1), (100_000, 6_249), (70_000, 70)])
def test_the_selection_is_torch_topk_s(n, k):
    # largest() takes its candidates from a threshold set on a sample; what it selects is torch.topk's set
    g = torch.Generator().manual_seed(n + k)
    values = torch.randn(n, generator=g).abs()
    assert torch.equal(largest(values, k), _topk_set(values, k))
    # the largest values where the strided sample never looks (every 2nd element; the sample takes every
    # n // 16384-th, an even stride here): fewer candidates than k reach the sample's threshold at first
    skewed = values.clone()
    skewed[1::2] += 100.0
    assert torch.equal(largest(skewed, k), _topk_set(skewed, k))
    # ties with the k-th largest (values on a coarse grid): the same values as torch.topk's, indices ascending
    coarse = (values * 4).round()
    got = largest(coarse, k)
    assert torch.equal(got, got.sort().values) and got.unique().numel() == k
    assert torch.equal(coarse[got].sort().values, torch.topk(coarse, k).values.sort().values)
    # a NaN is ranked first, as torch.topk ranks it
    with_nan = values.clone()
    with_nan[17] = float("nan")
    assert torch.equal(largest(with_nan, k), _topk_set(with_nan, k))
    assert largest(values, 0).numel() == 0


def test_allocation_balances_the_selection_cost():
    assert selection_cost(100, 0) == 0.0 and selection_cost(100, 1) == 100.0
    assert selection_cost(100, 8) == pytest.approx(300.0)
    # costs 5, 4, 3, 3 on two ranks: 5 -> r0, 4 -> r1, 3 -> r1 (4 < 5), 3 -> r0 (5 < 7)
    assert allocate([5.0, 4.0, 3.0, 3.0], 2) == [0, 1, 1, 0]
    assert allocate([1.0, 1.0, 1.0], 3) == [0, 1, 2]


def test_the_default_keeps_vectors_dense():
    assert dense_by_default("fc.bias", torch.zeros(3)) and dense_by_default("ln.weight", torch.zeros(3))
    assert not dense_by_default("fc.weight", torch.zeros(3, 4))
    assert not dense_by_default("embed.weight", torch.zeros(10, 4))
    with pytest.raises(ValueError, match="density"):
        dearopt.Sparsify(density=0.0)
    with pytest.raises(ValueError, match="selection"):
        dearopt.Sparsify(density=0.1, selection="random")


# ----------------------------------------------------------------------------------------- emulation
def emulate(layout, world, density, opt_name, steps=STEPS, selection="deft", warmup=0, momentum=0.0):
    """One process: every rank's gradient of its shard, the residuals (fed by a DGC velocity with ``momentum``),
    DEFT's selection and sum, then the update with the average.  ``layout``: per bucket, ``(model position,
    offset)`` of each parameter."""
    model = make_model("mlp")
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = make_optimizer(opt_name, model)
    residual = [
        [torch.zeros(sum(params[i].numel() for i, _ in bucket) + 64) for bucket in layout] for _ in range(world)
    ]
    velocity = copy.deepcopy(residual)
    for t in range(steps):
        x, y = global_batch(t, "mlp")
        own = []
        for r in range(world):
            model.zero_grad()
            loss_fn("mlp", model(shard(x, r, world)), shard(y, r, world)).backward()
            own.append([p.grad.detach().clone() for p in params])
        result = [torch.zeros_like(p) for p in params]
        for b, bucket in enumerate(layout):
            sparse = [
                (j, off, params[i].numel())
                for j, (i, off) in enumerate(bucket)
                if not dense_by_default(names[i], params[i])
            ]
            for i, off in bucket:
                if t < warmup or dense_by_default(names[i], params[i]):
                    if momentum:  # the velocity travels dense
                        where = slice(off, off + params[i].numel())
                        for r in range(world):
                            velocity[r][b][where] = momentum * velocity[r][b][where] + own[r][i].reshape(-1)
                        result[i] = (sum(velocity[r][b][where] for r in range(world)) / world).view_as(params[i])
                    else:
                        result[i] = sum(own[r][i] for r in range(world)) / world
                else:
                    for r in range(world):
                        where = slice(off, off + params[i].numel())
                        if momentum:
                            velocity[r][b][where] = momentum * velocity[r][b][where] + own[r][i].reshape(-1)
                            residual[r][b][where] += velocity[r][b][where]
                        else:
                            residual[r][b][where] += own[r][i].reshape(-1)
            if t < warmup or not sparse:
                continue
            budget = math.ceil(density * sum(n for _, _, n in sparse))
            flat_sum = torch.zeros_like(residual[0][b])
            if selection == "deft":
                frags = fragments(sparse, world)
                norms = [
                    sum(
                        float(torch.linalg.vector_norm(residual[r][b][f.start : f.start + f.numel]))
                        for r in range(world)
                    )
                    / world
                    for f in frags
                ]
                ks = assign_k(norms, [f.numel for f in frags], budget)
                owner = allocate([selection_cost(f.numel, k) for f, k in zip(frags, ks)], world)
                chosen = []
                for f, k, o in zip(frags, ks, owner):
                    if k:
                        part = residual[o][b][f.start : f.start + f.numel]
                        chosen.append(torch.topk(part.abs(), k).indices + f.start)
                chosen = torch.cat(chosen)
                flat_sum[chosen] = sum(residual[r][b][chosen] for r in range(world))
                for r in range(world):
                    residual[r][b][chosen] = 0.0
                    velocity[r][b][chosen] = 0.0
            else:  # every rank its own top-k of the whole bucket; all of them summed
                idx = torch.cat([torch.arange(o, o + n) for _, o, n in sparse])
                for r in range(world):
                    top = idx[torch.topk(residual[r][b][idx].abs(), budget).indices]
                    flat_sum.index_add_(0, top, residual[r][b][top])
                    residual[r][b][top] = 0.0
                    velocity[r][b][top] = 0.0
            for i, off in bucket:
                if not dense_by_default(names[i], params[i]):
                    result[i] = (flat_sum[off : off + params[i].numel()] / world).view_as(params[i])
        for p, g in zip(params, result):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


def _layout(opt):
    positions = {id(p): i for i, p in enumerate(opt._executor.model.parameters())}
    return [[(positions[id(p)], off) for p, off in zip(b.params, b.spec.offsets)] for b in opt._executor.buckets]


def _runs(cases):
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for case in cases:
        schedule, buffer_size, density, opt_name, selection, momentum = case
        model = make_model("mlp")
        opt = dearopt.DistOptim(
            make_optimizer(opt_name, model),
            model,
            schedule=schedule,
            buffer_size=buffer_size,
            comm_hook=dearopt.Sparsify(density, selection=selection, momentum=momentum),
        )
        sent = []
        for step in range(STEPS):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
            opt.synchronize()
            sent.append(dict(opt.comm_hook.traffic))
        out[case] = ([p.detach().clone() for p in model.parameters()], _layout(opt), sent)
        opt.close()
    return out


CASES = [
    ("wfbp", 64, 0.1, "sgd", "deft", 0.0),
    ("dear", 64, 0.1, "adam", "deft", 0.0),
    ("dear", 1 << 20, 0.25, "sgd", "deft", 0.0),
    ("wfbp", 1 << 20, 0.1, "sgd", "topk", 0.0),
    ("dear", 1 << 20, 1.0, "adam", "deft", 0.0),
    ("dear", 1 << 20, 0.1, "sgd-plain", "deft", 0.9),
    ("wfbp", 1 << 20, 0.1, "sgd-plain", "topk", 0.9),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_sparsified_training_equals_its_single_process_emulation(world):
    outcomes = run_workers(_runs, world, CASES, timeout=160)
    for case in CASES:
        schedule, buffer_size, density, opt_name, selection, momentum = case
        layout = outcomes[0].value[case][1]
        want = emulate(layout, world, density, opt_name, selection=selection, momentum=momentum)
        for o in outcomes:
            params, got_layout, _ = o.value[case]
            assert got_layout == layout
            assert_params_match(params, want)
    # density 1.0 is dense training: against one process on the global batch
    assert_params_match(
        outcomes[0].value[("dear", 1 << 20, 1.0, "adam", "deft", 0.0)][0], reference("mlp", "adam", world, STEPS)[0]
    )
    # and a sparse run is not the dense one (the compression is real)
    sparse = outcomes[0].value[("dear", 1 << 20, 0.25, "sgd", "deft", 0.0)][0]
    dense = emulate(outcomes[0].value[("dear", 1 << 20, 0.25, "sgd", "deft", 0.0)][1], world, 1.0, "sgd")
    assert not torch.allclose(sparse[0], dense[0])


def test_what_each_rank_sends_does_not_grow_with_the_ranks():
    cases = [("wfbp", 1 << 20, 0.1, "sgd", "deft", 0.0), ("wfbp", 1 << 20, 0.1, "sgd", "topk", 0.0)]
    sent = {world: run_workers(_runs, world, cases, timeout=100) for world in (2, 3)}
    # one bucket: fc1.weight 48 + fc2.weight 64 + fc3.weight 24 = 136 sparsified elements, budget ceil(13.6) = 14;
    # the biases (19), flags, tags and padding travel dense
    for world, outcomes in sent.items():
        deft = [o.value[cases[0]][2][-1] for o in outcomes]
        topk = [o.value[cases[1]][2][-1] for o in outcomes]
        assert sum(s["indices"] for s in deft) == 14  # the union is the budget: no build-up
        assert len({s["values"] for s in deft}) == 1  # every rank all-reduces the same values
        assert all(s["indices"] == 14 for s in topk) and all(s["received"] == 14 * world for s in topk)
    # the deft all-reduce is as long on 3 ranks as on 2 but for padding; top-k's gathered pairs grow
    dense2, dense3 = (sent[w][0].value[cases[0]][2][-1]["values"] - 14 for w in (2, 3))
    assert abs(dense2 - dense3) <= 4


def _resume():
    rank, world = dearopt.rank(), dearopt.size()

    def run(steps, start=0, load=None):
        params, saved, opt = resumable_run(
            lambda model: dearopt.DistOptim(
                make_optimizer("sgd-plain", model),
                model,
                schedule="dear",
                buffer_size=64,
                comm_hook=dearopt.Sparsify(0.1, momentum=0.9),
            ),
            steps,
            rank,
            world,
            start,
            load,
        )
        opt.close()
        return params, saved

    whole, at3 = run(STEPS)
    resumed, _ = run(STEPS - 3, 3, at3)
    saved = at3[1]["dearopt_sparse"]
    return whole, resumed, [sum(float(v.abs().sum()) for v in saved[k].values()) for k in ("residual", "velocity")]


@pytest.mark.timeout(90)
def test_residuals_and_velocities_are_checkpointed_and_a_resume_is_bit_identical():
    for o in run_workers(_resume, 2, timeout=80):
        whole, resumed, (residual_mass, velocity_mass) = o.value
        assert residual_mass > 0 and velocity_mass > 0  # the checkpoint holds unsent gradient and momentum
        for a, b in zip(whole, resumed):
            assert torch.equal(a, b)


def _refusals():
    model = make_model("mlp")
    out = Attempts()
    attempt = out.attempt

    hook = dearopt.Sparsify(0.1)
    for name, kwargs in [
        ("rsag", dict(schedule="rsag")),
        ("dear half", dict(schedule=dearopt.DeAR(allreduce=0.5))),
        ("partitions", dict(schedule=dearopt.WFBP(partition_size=1024))),
        ("rows", dict(schedule=dearopt.DeAR(embedding_rows=True))),
        ("sharded", dict(shard_optimizer=True)),
        ("skip", dict(nonfinite="skip")),
    ]:
        attempt(
            name,
            lambda: dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, comm_hook=hook, **kwargs),
        )
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model)
    attempt("late", lambda: opt.register_comm_hook(hook))
    opt.close()
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule="wfbp", comm_hook=hook)
    scaler = torch.amp.GradScaler("cpu")
    x, y = global_batch(0, "mlp")
    scaler.scale(loss_fn("mlp", model(shard(x, dearopt.rank(), 2)), shard(y, dearopt.rank(), 2))).backward()
    attempt("scaler", lambda: scaler.step(opt))
    opt.close()
    return out


@pytest.mark.timeout(60)
def test_what_sparsification_cannot_do_is_refused_by_name():
    Attempts.expect(
        run_workers(_refusals, 2, timeout=50)[0].value,
        {
            "rsag": ("ValueError", "'wfbp' or 'dear'"),
            "dear half": ("ValueError", "allreduce=0.5"),
            "partitions": ("ValueError", "partition_size"),
            "rows": ("ValueError", "embedding_rows"),
            "sharded": ("ValueError", "shard_optimizer"),
            "late": ("UsageError", "comm_hook"),
            "skip": ("ValueError", "nonfinite='skip'"),
            "scaler": ("UsageError", "GradScaler"),
        },
    )


def _poisoned(schedule):
    """Step 2: the last rank's last sample is inf, so its gradients are NaN (the biases travel dense, the weights'
    NaN sit in the residual and are selected first)."""
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("sgd", model), model, schedule=schedule, buffer_size=64, comm_hook=dearopt.Sparsify(0.1)
    )
    try:
        for step in range(4):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            if step == 2:
                x = x.clone()
                x[-1, 0] = float("inf")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
            opt.synchronize()
    except dearopt.errors.NonFiniteGradientError as exc:
        return step, str(exc)
    finally:
        opt.close()
    return None


def _poisoned_both():
    return {s: _poisoned(s) for s in ("wfbp", "dear")}


@pytest.mark.timeout(90)
def test_the_nonfinite_check_still_names_the_step_and_the_parameter():
    for o in run_workers(_poisoned_both, 3, timeout=80):
        for schedule, got in o.value.items():
            assert got is not None, schedule
            step, message = got
            # as for any all-reduced bucket: the step, the parameter, this rank (where it came from is not kept)
            assert step == 2 and "'fc1.weight' is not finite" in message and "step 2]" in message, message
