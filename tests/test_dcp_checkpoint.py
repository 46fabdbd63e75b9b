"""``dearopt.checkpoint`` (issue 45): checkpoints through torch.distributed.checkpoint that load at another world
size, bucket plan or schedule, sharded or not, and into one plain torch process; each run continues as one
process training on the global batch would (1e-5).  What cannot move (``deft``'s gradient sums in flight at
another world size) is refused by name.

Three jobs share the checkpoints: 2 ranks save, 3 ranks load and save again, 2 ranks load that."""

import os

import pytest
import torch

import dearopt
import dearopt.checkpoint as ckpt
from harness import run_workers
from models import make_model, make_optimizer, train_step
from test_deft import SCHEDULES
from test_distoptim import assert_params_match, reference


def _model(seed=1):
    return make_model("mlp", seed=seed)  # seed 1: what a load must overwrite differs from the saved run's start


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(opt, model, start, stop):
    rank, world = dearopt.rank(), dearopt.size()
    for step in range(start, stop):
        train_step(opt, model, step, rank, world)
    opt.synchronize()


def _bytes(value, elementwise=False):
    """Bytes of the tensors in ``value`` (only those of one or more dimensions: ``elementwise``)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.dim() or not elementwise else 0
    if isinstance(value, dict):
        return sum(_bytes(v, elementwise) for v in value.values())
    return 0


def _ptrs(value):
    if isinstance(value, torch.Tensor):
        return {value.data_ptr()}
    if isinstance(value, dict):
        return set().union(*(_ptrs(v) for v in value.values())) if value else set()
    return set()


def _save_at_2(root):
    """2 ranks: a sharded AdamW run, an unsharded SGD run (saved async), a deft run with a group in flight."""
    import torch.distributed.checkpoint as dcp

    out = {}
    model = make_model("mlp")
    opt = dearopt.DistOptim(make_optimizer("adamw", model), model, buffer_size=64, shard_optimizer=True)
    _train(opt, model, 0, 3)
    handed = {}
    real_save = dcp.save

    def spy(state_dict, **kwargs):
        handed.update(state_dict)
        return real_save(state_dict, **kwargs)

    dcp.save = spy
    try:
        ckpt.save(os.path.join(root, "a_sharded"), model, opt, extra={"step": 3})
    finally:
        dcp.save = real_save
    optim = {k: v for k, v in handed.items() if k.startswith("optim.")}
    live = {i: v for i, v in enumerate(v for entry in opt.state.values() for v in entry.values())}
    out["memory"] = {
        "handed": _bytes(optim),
        "shard": _bytes(dict(enumerate(opt.state.values()))),
        "copied": _ptrs(optim) - _ptrs(live),
        "shard elementwise": _bytes(dict(enumerate(opt.state.values())), elementwise=True),
        "whole elementwise": _bytes(opt.state_dict()["state"], elementwise=True),
        "elements": sum(p.numel() for p in model.parameters()),
        "model handed": _bytes({k: v for k, v in handed.items() if k.startswith("model.")}),
        "model": _bytes(model.state_dict()),
    }
    opt.close()

    model = make_model("mlp")
    opt = dearopt.DistOptim(make_optimizer("sgd", model), model, buffer_size=64)
    _train(opt, model, 0, 3)
    pending = ckpt.save(os.path.join(root, "a_plain"), model, opt, extra={"step": 3}, async_=True)
    _train(opt, model, 3, 4)  # training goes on while the copy is written
    pending.result(timeout=60)
    opt.close()

    model = make_model("mlp")
    opt = dearopt.DistOptim(
        make_optimizer("sgd", model),
        model,
        schedule=dearopt.DeFT(given=SCHEDULES["given: one step late"]),
        buffer_size=64,
    )
    _train(opt, model, 0, 3)
    ckpt.save(os.path.join(root, "a_deft"), model, opt, extra={"step": 3})
    _train(opt, model, 3, 6)
    out["deft_uninterrupted"] = _params(model)
    opt.close()
    return out


def _load_at_3(root):
    out = {}

    def resume(name, opt_name, warm=False, **options):
        model = _model()
        opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, **options)
        if warm:  # one step first: the sharded state exists and the load reads only this rank's ranges
            _train(opt, model, 0, 1)
        step = ckpt.load(os.path.join(root, name), model, opt)["step"]
        return model, opt, step

    # sharded at 2 -> unsharded at 3, one bucket instead of six
    model, opt, step = resume("a_sharded", "adamw", buffer_size=4096)
    _train(opt, model, step, 6)
    out["sharded->unsharded"] = _params(model)
    opt.close()
    # sharded at 2 -> sharded at 3 (another plan); saved again (async) at 3 ranks after step 5
    model, opt, step = resume("a_sharded", "adamw", warm=True, buffer_size=100, shard_optimizer=True)
    _train(opt, model, step, 5)
    pending = ckpt.save(os.path.join(root, "b_sharded"), model, opt, extra={"step": 5}, async_=True)
    _train(opt, model, 5, 6)  # the copy of this rank's shard is written while training goes on
    pending.result(timeout=60)
    out["sharded->sharded"] = _params(model)
    opt.close()
    # dear at 2 -> wfbp at 3
    model, opt, step = resume("a_plain", "sgd", schedule="wfbp", buffer_size=64)
    _train(opt, model, step, 6)
    out["dear->wfbp"] = _params(model)
    opt.close()
    # unsharded at 2 -> sharded at 3
    model, opt, step = resume("a_plain", "sgd", buffer_size=64, shard_optimizer=True)
    _train(opt, model, step, 6)
    out["unsharded->sharded"] = _params(model)
    opt.close()
    # deft's group in flight at 2 ranks does not move to 3
    for schedule in ("deft", "wfbp"):
        model = _model()
        policy = dearopt.DeFT(given=SCHEDULES["given: one step late"]) if schedule == "deft" else schedule
        opt = dearopt.DistOptim(make_optimizer("sgd", model), model, schedule=policy, buffer_size=64)
        try:
            ckpt.load(os.path.join(root, "a_deft"), model, opt)
            out[f"deft->{schedule}"] = None
        except dearopt.DearoptError as exc:
            out[f"deft->{schedule}"] = (type(exc).__name__, str(exc))
        out[f"deft->{schedule} untouched"] = all(torch.equal(a, b) for a, b in zip(_params(model), _params(_model())))
        opt.close()
    return out


def _load_at_2(root):
    out = {}
    # sharded at 3 -> sharded at 2, loaded before the first step: the optimizer state is read at that step, once
    # this rank's segments exist, and only their ranges (across the saved ranks' chunks)
    model = _model()
    opt = dearopt.DistOptim(make_optimizer("adamw", model), model, buffer_size=64, shard_optimizer=True)
    step = ckpt.load(os.path.join(root, "b_sharded"), model, opt)["step"]
    out["state before the first step"] = _bytes(dict(enumerate(opt.state.values())))
    _train(opt, model, step, 8)
    out["3->2 sharded"] = _params(model)
    out["state after"] = _bytes(dict(enumerate(opt.state.values())), elementwise=True)
    out["elements"] = sum(p.numel() for p in model.parameters())
    opt.close()
    # sharded at 3 -> wfbp at 2
    model = _model()
    opt = dearopt.DistOptim(make_optimizer("adamw", model), model, schedule="wfbp", buffer_size=64)
    step = ckpt.load(os.path.join(root, "b_sharded"), model, opt)["step"]
    _train(opt, model, step, 8)
    out["3->2 wfbp"] = _params(model)
    opt.close()
    # deft at the same world size resumes where it was, group in flight included
    model = _model()
    opt = dearopt.DistOptim(
        make_optimizer("sgd", model),
        model,
        schedule=dearopt.DeFT(given=SCHEDULES["given: one step late"]),
        buffer_size=64,
    )
    step = ckpt.load(os.path.join(root, "a_deft"), model, opt)["step"]
    _train(opt, model, step, 6)
    out["deft resumed"] = _params(model)
    opt.close()
    return out


def _want(opt_name, steps):
    return reference("mlp", opt_name, 1, steps=steps)[0]


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, run_workers(_save_at_2, 2, root, timeout=60)


@pytest.mark.timeout(150)
def test_checkpoints_move_between_world_sizes_plans_and_schedules(saved_at_2):
    root, saved = saved_at_2
    at3 = run_workers(_load_at_3, 3, root, timeout=60)
    at2 = run_workers(_load_at_2, 2, root, timeout=60)
    adamw6, sgd6, adamw8 = _want("adamw", 6), _want("sgd", 6), _want("adamw", 8)
    for o in at3:
        assert_params_match(o.value["sharded->unsharded"], adamw6)
        assert_params_match(o.value["sharded->sharded"], adamw6)
        assert_params_match(o.value["dear->wfbp"], sgd6)
        assert_params_match(o.value["unsharded->sharded"], sgd6)
        for schedule in ("deft", "wfbp"):
            kind, message = o.value[f"deft->{schedule}"]
            assert kind == "CheckpointMismatchError" and "schedule='deft'" in message and "in flight" in message
            assert o.value[f"deft->{schedule} untouched"]  # refused before anything was written
    for o in at2:
        assert_params_match(o.value["3->2 sharded"], adamw8)
        assert o.value["state before the first step"] == 0  # nothing read before the segments existed
        assert o.value["state after"] <= 2 * 4 * (o.value["elements"] // 2 + 6 * 8)  # one rank's shard
        assert_params_match(o.value["3->2 wfbp"], adamw8)
        for got, want in zip(o.value["deft resumed"], saved[0].value["deft_uninterrupted"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The sharded save allocates nothing for the optimizer state: the tensors DCP is handed (counted in the dict
    # given to torch.distributed.checkpoint.save) are this rank's live segments, the same storage (no copy, no
    # gather), and their bytes are this rank's shard: each element's state on one rank only.
    for o in saved:
        memory = o.value["memory"]
        assert memory["copied"] == set()
        assert memory["handed"] == memory["shard"]
        # exp_avg and exp_avg_sq: a 1/2 share of each parameter, plus a ragged bucket's rounding (as test_sharding)
        assert memory["shard elementwise"] <= 2 * 4 * (memory["elements"] // 2 + 6 * 8)
    assert sum(o.value["memory"]["shard elementwise"] for o in saved) == saved[0].value["memory"]["whole elementwise"]
    # the model, the same on every rank, is handed to DCP once: each tensor by one rank (dealt by bytes)
    assert sum(o.value["memory"]["model handed"] for o in saved) == saved[0].value["memory"]["model"]
    assert all(0 < o.value["memory"]["model handed"] < saved[0].value["memory"]["model"] for o in saved)


@pytest.mark.timeout(120)
def test_a_checkpoint_loads_into_one_plain_torch_process(saved_at_2, tmp_path):
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _ = saved_at_2
    assert not torch.distributed.is_initialized()
    # DCP's own converter, then torch.load: torch's layouts for model.load_state_dict and the optimizer
    dcp_to_torch_save(os.path.join(root, "a_sharded"), str(tmp_path / "whole.pt"))
    model_state, optim_state = ckpt.torch_state_dicts(torch.load(tmp_path / "whole.pt", weights_only=False))
    model = _model()
    model.load_state_dict(model_state)
    opt = make_optimizer("adamw", model)
    opt.load_state_dict(optim_state)
    _single_process(model, opt, 3, 6)
    assert_params_match(_params(model), _want("adamw", 6))
    # or dearopt.checkpoint.load straight into a torch optimizer, without a process group
    model = _model()
    opt = make_optimizer("sgd", model)
    assert ckpt.load(os.path.join(root, "a_plain"), model, opt)["step"] == 3
    _single_process(model, opt, 3, 6)
    assert_params_match(_params(model), _want("sgd", 6))
    # an unfinished checkpoint (no .metadata) is refused by name, and latest() passes over it
    # another model is refused by name, before anything is written
    other = torch.nn.Sequential(torch.nn.Linear(6, 3))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    before = _params(other)
    with pytest.raises(dearopt.errors.CheckpointMismatchError, match="only in the checkpoint"):
        ckpt.load(os.path.join(root, "a_plain"), other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(_params(other), before))
    wider = make_model("mlp")
    wider.fc3 = torch.nn.Linear(8, 4)
    with pytest.raises(dearopt.errors.CheckpointMismatchError, match="'fc3.weight' has shape"):
        ckpt.load(os.path.join(root, "a_plain"), wider, torch.optim.SGD(wider.parameters(), lr=0.1))
    jobs = str(tmp_path / "job")
    for step in (3, 5, 7):
        os.makedirs(ckpt.step_path(jobs, step))
        if step != 7:
            shutil.copy(os.path.join(root, "a_plain", ".metadata"), ckpt.step_path(jobs, step))
    assert ckpt.latest(jobs) == (5, ckpt.step_path(jobs, 5))
    with pytest.raises(dearopt.errors.CheckpointMismatchError, match="not a finished DCP checkpoint"):
        ckpt.load(ckpt.step_path(jobs, 7), model, opt)


def _single_process(model, opt, start, stop):
    from models import global_batch, loss_fn

    for step in range(start, stop):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(x), y).backward()
        opt.step()


def test_tied_weights_are_written_once_and_one_process_saves_without_a_process_group(tmp_path):
    from models import Tied, global_batch, loss_fn

    def train(model, opt, start, stop):
        for step in range(start, stop):
            opt.zero_grad()
            x, y = global_batch(step, "tied")
            loss_fn("tied", model(x), y).backward()
            opt.step()

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, 0, 2)
    ckpt.save(tmp_path / "tied", model, opt, extra={"step": 2})
    train(model, opt, 2, 4)
    keys = ckpt.read(tmp_path / "tied")
    assert "model.embed.weight" in keys and "model.decoder.weight" not in keys  # one tensor, written once
    assert ckpt.describe(tmp_path / "tied")["world"] == 1
    torch.manual_seed(1)
    resumed = Tied()
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    assert ckpt.load(tmp_path / "tied", resumed, resumed_opt)["step"] == 2
    assert resumed.decoder.weight is resumed.embed.weight
    train(resumed, resumed_opt, 2, 4)
    assert_params_match(_params(resumed), _params(model))
    model_state, _ = ckpt.torch_state_dicts(keys)
    assert model_state["decoder.weight"] is model_state["embed.weight"]
