"""Online tuning inside DistOptim: re-planning at trial boundaries never changes the mathematics."""

import pytest
import torch

import dearopt
from dearopt.tuner import BayesianTuner, Knob
from harness import run_workers
from models import global_batch, loss_fn, make_model, make_optimizer, shard
from test_distoptim import assert_params_match, reference

STEPS = 12


def _train_tuned(opt_name, schedule, knob_names):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    knobs = {"buffer_size": Knob("buffer_size", 64, 2048, log=True, initial=256, integer=True),
             "partition_size": Knob("partition_size", 32, 512, log=True, initial=128, integer=True),
             "credit": Knob("credit", 128, 4096, log=True, initial=512, integer=True)}
    tuner = BayesianTuner([knobs[k] for k in knob_names], budget=5, seed=0)
    opt = dearopt.DistOptim(make_optimizer(opt_name, model), model, schedule=schedule,
                            tuner=tuner, tuning_steps=1)
    plans = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        plans.append((opt.plan.buffer_size, opt.plan.partition_size, len(opt.plan.buckets)))
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], plans, opt.tuning.history, opt.tuning.finished


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world, schedule, knob_names", [
    (2, "dear", ("buffer_size",)),
    (3, "dear", ("buffer_size",)),
    (2, "wfbp", ("buffer_size",)),
    (3, "dear", ("partition_size", "credit")),
])
def test_tuning_replans_exactly(world, schedule, knob_names):
    outcomes = run_workers(_train_tuned, world, "adamw", schedule, knob_names, timeout=150)
    want, _ = reference("mlp", "adamw", world, steps=STEPS)
    for o in outcomes:
        params, plans, history, finished = o.value
        assert_params_match(params, want)
        assert plans == outcomes[0].value[1], "every rank re-planned at the same step with the same knobs"
        assert len(history) >= 3 and finished
        assert len({p[:2] for p in plans}) >= 2, "the knobs really changed during the run"


def test_auto_builds_the_papers_tuner():
    dearopt.init()
    try:
        model = make_model("mlp")
        opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size="auto")
        knob = opt.tuning.tuner.knobs[0]
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        assert knob.name == "buffer_size" and knob.low == 2**20 and knob.high == max(model_bytes, 2 * 2**20)
        assert opt.tuning.current["buffer_size"] == min(25 * 2**20, knob.high)
        opt.close()
    finally:
        dearopt.shutdown()
