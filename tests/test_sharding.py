"""The sharded update (issue 19, ``shard_optimizer=True``): each rank updates its shard, the all-gather carries
parameters.  Against single-process training on the global batch (1e-5), torch's own optimizer state, and
uninterrupted runs (bit-identical resume)."""

import pytest
import torch

import dearopt
from harness import run_workers
from models import global_batch, loss_fn, make_model, make_optimizer, make_scheduler, train_step
from test_distoptim import ALL_OPTIMIZERS, _train, assert_params_match, reference

STEPS = 5


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_every_elementwise_optimizer_matches_single_process(world):
    # 64-byte buckets: one parameter each, sizes 3..64 that split unevenly over 2 and 3 ranks
    outcomes = run_workers(_train, world, "mlp", ALL_OPTIMIZERS, "dear", timeout=180, shard_optimizer=True)
    for opt_name in ALL_OPTIMIZERS:
        want, _ = reference("mlp", opt_name, world)
        for o in outcomes:
            params, _, n_buckets = o.value[opt_name]
            assert n_buckets > 2
            assert_params_match(params, want)


CASES = {
    # name: (model kind, optimizer, train kwargs, reference kwargs)
    "unused parameters": ("unused", "adamw", {}, {}),
    "frozen parameters": ("frozen", "sgd", {}, {}),
    "forward order differs from registration": ("reordered", "adamw", {}, {}),
    "dynamic control flow skips a bucket": ("mlp", "adam", {"skip_middle_at": (1, 3)}, {"skip_middle_at": (1, 3)}),
    "backward_passes_per_step=2": ("mlp", "adam", {"bpps": 2}, {"bpps": 2}),
    "no_sync accumulation": ("mlp", "sgd", {"bpps": 3, "use_no_sync": True}, {"bpps": 3}),
    "zero_grad(set_to_none=False)": ("unused", "adamw", {"set_to_none": False}, {"set_to_none": False}),
    "clip_grad_norm_ on shards": ("mlp", "sgd", {"clip": 0.05}, {"clip": 0.05}),
    "state_dict after last step": ("mlp", "adamw", {"read_with": "state_dict"}, {}),
    "eval forward gathers pending parameters": ("mlp", "rmsprop", {"read_with": "eval_forward"}, {}),
    "pieces (partition_size) and one big bucket": ("mlp", "adam", {"buffer_size": 4096, "partition_size": 100}, {}),
    "tied weights (reduced densely)": ("tied", "adam", {}, {}),
}


def _cases(names, **options):
    """Several cases in one job (each its own model and optimizer)."""
    return {name: _train(CASES[name][0], [CASES[name][1]], "dear", **CASES[name][2], **options) for name in names}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_cases_users_hit(world):
    outcomes = run_workers(_cases, world, list(CASES), shard_optimizer=True, timeout=220)
    for name, (kind, opt_name, _, ref_kwargs) in CASES.items():
        want, want_norms = reference(kind, opt_name, world, **ref_kwargs)
        for o in outcomes:
            params, norms, _ = o.value[name][opt_name]
            assert_params_match(params, want)
            if want_norms:
                assert norms == pytest.approx(want_norms, rel=1e-5), name


def _state_sizes(opt_name):
    """Elements of optimizer state per rank, sharded and not, after 3 steps; and what p.grad is after step()."""
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for sharded in (False, True):
        model = make_model("mlp")
        opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, buffer_size=64, shard_optimizer=sharded)
        for step in range(3):
            train_step(opt, model, step, rank, world)
        grads_after_step = [p.grad is None for p in model.parameters()]
        opt.synchronize()
        elements = sum(
            v.numel()
            for entry in opt.state.values()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        out[sharded] = (elements, grads_after_step, opt.plan.describe())
        opt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_state_per_rank_is_one_nth(world):
    outcomes = run_workers(_state_sizes, world, "adam", timeout=100)
    numel = sum(p.numel() for p in make_model("mlp").parameters())
    total = 0
    for o in outcomes:
        whole, whole_grads, _ = o.value[False]
        mine, sharded_grads, described = o.value[True]
        assert whole == 2 * numel  # exp_avg and exp_avg_sq of every parameter on every rank
        # each rank's shard of each bucket: at most a ceil(1/N) share of the bucket (plus its flags and tags)
        assert mine <= 2 * (numel // world + 6 * 8)
        total += mine
        assert not any(whole_grads) and all(sharded_grads)  # unsharded p.grad holds the average; sharded: None
        assert "sharded update" in described
    assert total == 2 * numel  # every element's state lives on exactly one rank


def _single_process(opt_name, steps, start=0, model=None, state=None):
    """Single-process training on the global batch from step ``start``; returns the model and its optimizer."""
    model = model or make_model("mlp")
    opt = make_optimizer(opt_name, model)
    if state is not None:
        opt.load_state_dict(state)
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    return model, opt


def _checkpoints(opt_name, torch_state, torch_params):
    rank, world = dearopt.rank(), dearopt.size()

    def run(steps, start=0, model_state=None, load=None):
        model = make_model("mlp")
        if model_state is not None:
            model.load_state_dict(model_state)
        opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, buffer_size=64, shard_optimizer=True)
        if load is not None:
            load(opt)
        snapshots = {}
        for step in range(start, start + steps):
            train_step(opt, model, step, rank, world)
            if step == 2:
                snapshots = {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": opt.state_dict(),
                    "sharded": opt.sharded_state_dict(),
                }
        final = {"params": [p.detach().clone() for p in model.parameters()], "optimizer": opt.state_dict()}
        return opt, snapshots, final

    _, at3, uninterrupted = run(6)
    _, _, resumed = run(3, 3, at3["model"], lambda opt: opt.load_state_dict(at3["optimizer"]))
    _, _, resumed_sharded = run(3, 3, at3["model"], lambda opt: opt.load_sharded_state_dict(at3["sharded"]))
    start = dict(zip([n for n, _ in make_model("mlp").named_parameters()], torch_params))
    _, _, from_torch = run(3, 3, start, lambda opt: opt.load_state_dict(torch_state))
    # a per-rank checkpoint of another rank is refused by name
    other = dearopt.broadcast_object(at3["sharded"], root_rank=0)
    opt, _, _ = run(1)
    error = None
    try:
        opt.load_sharded_state_dict(other)
    except dearopt.errors.CheckpointMismatchError as exc:
        error = str(exc)
    return {
        "at3": at3["optimizer"],
        "at3_params": [v for v in at3["model"].values()],
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "resumed_sharded": resumed_sharded,
        "from_torch": from_torch,
        "error": error,
    }


def _assert_states_close(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry)
        for key, value in entry.items():
            torch.testing.assert_close(
                got["state"][index][key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"state {index}[{key!r}]: {m}"
            )


def _assert_equal_runs(a, b):
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    for index, entry in a["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][index][key]))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,opt_name", [(2, "adam"), (3, "sgd"), (3, "adagrad")])
def test_state_dict_round_trips_and_resume_is_bit_identical(world, opt_name):
    torch_model, torch_opt = _single_process(opt_name, 3)
    torch_state = torch_opt.state_dict()
    outcomes = run_workers(
        _checkpoints, world, opt_name, torch_state, [p.detach().clone() for p in torch_model.parameters()], timeout=180
    )
    want6_model, want6_opt = _single_process(opt_name, 6)
    for o in outcomes:
        got = o.value
        # the gathered state is torch's ordinary layout, equal to single-process training's
        _assert_states_close(got["at3"], torch_state)
        # sharded -> unsharded: torch's optimizer continues from the gathered state
        model = make_model("mlp")
        with torch.no_grad():
            for p, v in zip(model.parameters(), got["at3_params"]):
                p.copy_(v)
        model, _ = _single_process(opt_name, 3, 3, model, got["at3"])
        assert_params_match([p.detach() for p in model.parameters()], [p.detach() for p in want6_model.parameters()])
        # resume from either checkpoint form: bit-identical to the uninterrupted run
        _assert_equal_runs(got["resumed"], got["uninterrupted"])
        _assert_equal_runs(got["resumed_sharded"], got["uninterrupted"])
        # unsharded (torch) -> sharded
        assert_params_match(got["from_torch"]["params"], [p.detach() for p in want6_model.parameters()])
        _assert_states_close(got["from_torch"]["optimizer"], want6_opt.state_dict())
        if o.rank == 0:
            assert got["error"] is None
        else:
            assert "saved by rank 0" in got["error"]


class _MyAdam(torch.optim.Adam):
    pass


def _refusals():
    model = make_model("mlp")
    out = {}

    def attempt(name, make):
        try:
            make()
            out[name] = None
        except dearopt.DearoptError as exc:
            out[name] = (type(exc).__name__, str(exc))

    attempt(
        "adafactor", lambda: dearopt.DistOptim(torch.optim.Adafactor(model.parameters()), model, shard_optimizer=True)
    )
    attempt("subclass", lambda: dearopt.DistOptim(_MyAdam(model.parameters()), model, shard_optimizer=True))
    dearopt.register_elementwise(_MyAdam)
    attempt(
        "registered subclass",
        lambda: dearopt.DistOptim(_MyAdam(model.parameters()), model, shard_optimizer=True).close(),
    )
    embedding = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True))
    sparse_opt = dearopt.DistOptim(torch.optim.SGD(embedding.parameters(), lr=0.1), embedding, shard_optimizer=True)

    def sparse_step():
        embedding(torch.tensor([[1, 2]])).sum().backward()
        sparse_opt.step()

    attempt("sparse gradients", sparse_step)
    attempt(
        "sharded_state_dict unsharded",
        lambda: dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model).sharded_state_dict(),
    )
    return out


@pytest.mark.timeout(60)
def test_what_cannot_be_sharded_is_refused_by_name():
    for kwargs, match in [
        (dict(schedule="wfbp"), "needs schedule='dear'"),
        (dict(schedule=dearopt.DeAR(allreduce=0.5)), "reduce-scatters every bucket"),
        (dict(schedule=dearopt.DeAR(embedding_rows=True)), "reduces embeddings densely"),
    ]:
        with pytest.raises(ValueError, match=match):
            dearopt.Options(shard_optimizer=True, **kwargs)
    options = dearopt.Options(shard_optimizer=True)
    assert options.allreduce == 0.0 and options.embedding_rows is False
    assert dearopt.Options().embedding_rows is True
    got = run_workers(_refusals, 1, timeout=50)[0].value
    assert got["adafactor"][0] == "NotElementwiseError" and "factored" in got["adafactor"][1]
    assert got["subclass"][0] == "NotElementwiseError" and "register_elementwise(_MyAdam)" in got["subclass"][1]
    assert got["registered subclass"] is None
    assert got["sharded_state_dict unsharded"][0] == "UsageError"
    assert got["sparse gradients"][0] == "UsageError" and "sparse=False" in got["sparse gradients"][1]


def _replanned(opt_names):
    """A re-plan in the middle (the tuner's path): the state is gathered, the new buckets cut it anew."""
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for opt_name in opt_names:
        model = make_model("mlp")
        opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, buffer_size=64, shard_optimizer=True)
        sched = make_scheduler(opt_name, opt)
        buckets = []
        for step in range(STEPS):
            train_step(opt, model, step, rank, world)
            if sched:
                sched.step()
            buckets.append(len(opt.plan.buckets))
            if step == 2:
                opt._executor.replan(buffer_size=4096)
        opt.synchronize()
        out[opt_name] = ([p.detach().clone() for p in model.parameters()], buckets)
        opt.close()
    return out


@pytest.mark.timeout(120)
def test_a_replan_keeps_training_exact():
    opt_names = ["adam", "groups+scheduler"]
    outcomes = run_workers(_replanned, 3, opt_names, timeout=100)
    for opt_name in opt_names:
        want, _ = reference("mlp", opt_name, 3)
        for o in outcomes:
            params, buckets = o.value[opt_name]
            assert buckets[0] == 6 and buckets[-1] == 1
            assert_params_match(params, want)


BAD_STEP = 2


def _poisoned_batch(step, world, rank=None):
    x, y = global_batch(step, "mlp")
    if step == BAD_STEP:
        x = x.clone()
        x[-1, 0] = float("inf")  # the last rank's last sample: a NaN gradient there
    return (x, y) if rank is None else (x.chunk(world)[rank], y.chunk(world)[rank])


def _nonfinite(policy):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("adam", model), model, buffer_size=64, shard_optimizer=True, nonfinite=policy
    )
    try:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _poisoned_batch(step, world, rank)
            loss_fn("mlp", model(x), y).backward()
            opt.step()
    except dearopt.errors.NonFiniteGradientError as exc:
        return f"raised at step {step}: {exc}"
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], opt.skipped_steps


def _nonfinite_both():
    return {policy: _nonfinite(policy) for policy in ("skip", "raise")}


@pytest.mark.timeout(120)
def test_a_nonfinite_gradient_on_one_rank_is_skipped_or_raised_on_every_rank():
    model = make_model("mlp")
    opt = make_optimizer("adam", model)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _poisoned_batch(step, 3)
        loss_fn("mlp", model(x), y).backward()
        if step != BAD_STEP:  # what nonfinite="skip" means: the step is not applied
            opt.step()
    want = [p.detach() for p in model.parameters()]
    for o in run_workers(_nonfinite_both, 3, timeout=100):
        params, skipped = o.value["skip"]
        assert skipped == 1
        assert_params_match(params, want)
        raised = o.value["raise"]
        assert raised.startswith(f"raised at step {BAD_STEP}") and "rank(s) [2]" in raised, raised


MORE_ELEMENTWISE = {
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01, weight_decay=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "adam-amsgrad-foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=True),
    "sgd-maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, maximize=True),
}


def _more_elementwise(names, sharded):
    rank, world = (dearopt.rank(), dearopt.size()) if sharded else (0, 1)
    out = {}
    for name in names:
        model = make_model("mlp")
        opt = MORE_ELEMENTWISE[name](list(model.parameters()))
        if sharded:
            opt = dearopt.DistOptim(opt, model, buffer_size=64, shard_optimizer=True)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            if sharded:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss_fn("mlp", model(x), y).backward()
            opt.step()
        if sharded:
            opt.synchronize()
            opt.close()
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.timeout(120)
def test_the_other_elementwise_optimizers_match_single_process():
    names = list(MORE_ELEMENTWISE)
    want = _more_elementwise(names, sharded=False)
    for o in run_workers(_more_elementwise, 3, names, True, timeout=100):
        for name in names:
            assert_params_match(o.value[name], want[name])
