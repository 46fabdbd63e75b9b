"""Accumulation over several DistOptims of one model, as DDP users write it with ``model.no_sync()``:
``with dearopt.no_sync(model):`` holds back every DistOptim built on the model (AdamW for the body, SGD for the
head), and training equals one process on the global batch."""

import pytest
import torch
from torch import nn

import dearopt
from harness import run_workers

WINDOWS = [1, 3, 2, 4, 1, 2]  # micro-batches per optimizer step
MICRO = 12  # samples per global micro-batch (divisible by 2 and 3: equal shards)


class Split(nn.Module):
    """A body, a head, and ``aux``: used only in the first micro-batch of a window longer than one, so that it has
    a gradient from an earlier micro-batch of the window but none from the last (the one that communicates)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.aux = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, use_aux: bool):
        h = self.body(x)
        if use_aux:
            h = h + torch.tanh(self.aux(x))
        return self.head(h)


def _make():
    torch.manual_seed(0)
    model = Split()
    body = torch.optim.AdamW(list(model.body.parameters()) + list(model.aux.parameters()), lr=0.01, weight_decay=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    return model, body, head


def _micro_batch(window: int, m: int):
    g = torch.Generator().manual_seed(100 * window + m)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)


def _loop(model, optimizers, rank=0, world=1, hold=None):
    """Train WINDOWS; ``hold(model)``: the context for every micro-batch of a window but the last."""
    for w, length in enumerate(WINDOWS):
        for opt in optimizers:
            opt.zero_grad()
        for m in range(length):
            x, y = _micro_batch(w, m)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            use_aux = length > 1 and m == 0

            def backward():
                nn.functional.mse_loss(model(x, use_aux), y).backward()

            if hold is not None and m < length - 1:
                with hold(model):
                    backward()
            else:
                backward()
        for opt in optimizers:
            opt.step()


SCHEDULES = ["dear", "wfbp", "rsag", "bytescheduler", "prophet", "prophet-allreduce", "dear-sharded"]


def _distributed_one(schedule):
    model, body, head = _make()
    kwargs = dict(schedule="dear", shard_optimizer=True) if schedule == "dear-sharded" else dict(schedule=schedule)
    optimizers = [
        dearopt.DistOptim(body, model, buffer_size=64, **kwargs),
        dearopt.DistOptim(head, model, buffer_size=64, **kwargs),
    ]
    _loop(model, optimizers, dearopt.rank(), dearopt.size(), hold=dearopt.no_sync)
    for opt in optimizers:
        opt.synchronize()
        opt.close()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _distributed():
    return {schedule: _distributed_one(schedule) for schedule in SCHEDULES}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_of_the_model_accumulates_over_every_distoptim_exactly(world):
    model, body, head = _make()
    _loop(model, [body, head])  # one process on the global micro-batches, accumulating as torch does
    want = {name: p.detach() for name, p in model.named_parameters()}
    start = {name: p.detach() for name, p in _make()[0].named_parameters()}
    assert not torch.equal(want["aux.weight"], start["aux.weight"])  # aux trained (and decayed)
    for o in run_workers(_distributed, world, timeout=130):
        for schedule in SCHEDULES:
            for name, got in o.value[schedule].items():
                torch.testing.assert_close(
                    got, want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{schedule} {name}: {m}"
                )


def _one_optimizer_held():
    """Only the body's own no_sync(): the head's DistOptim communicates, and the next backward is refused."""
    model, body, head = _make()
    body_opt = dearopt.DistOptim(body, model, buffer_size=64)
    head_opt = dearopt.DistOptim(head, model, buffer_size=64)  # kept, as a loop keeps it to call step()
    x, y = _micro_batch(0, 0)
    for _ in range(2):
        with body_opt.no_sync():
            try:
                nn.functional.mse_loss(model(x, False), y).backward()
            except dearopt.UsageError as exc:
                return str(exc)
    del head_opt
    return None


@pytest.mark.timeout(60)
def test_the_refusal_names_the_distoptim_that_communicated():
    for o in run_workers(_one_optimizer_held, 2, timeout=40):
        message = o.value
        assert message is not None
        assert message.startswith(
            "backward() was called again after DistOptim 2 of 2 on this model (SGD over "
            "'head.weight', 'head.bias') sent the gradients of this step"
        ), message
        assert "`with dearopt.no_sync(model):`" in message
        assert (
            "DistOptim 1 of 2 on this model (AdamW over 'body.0.weight', 'body.0.bias', 'body.2.weight' and 3 "
            "more) accumulated inside its own no_sync(), this one did not"
        ) in message, message
        assert message.endswith(f"[rank {o.rank}, step 0]")


def test_no_sync_needs_a_model_with_a_distoptim():
    with pytest.raises(TypeError, match="nn.Module"):
        with dearopt.no_sync("model"):
            pass
    with pytest.raises(dearopt.UsageError, match="no DistOptim was built on this Linear"):
        with dearopt.no_sync(nn.Linear(2, 2)):
            pass
