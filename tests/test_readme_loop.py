"""The README's realistic loop runs as printed: accumulation under ``dearopt.no_sync``, autocast with a GradScaler,
torch's clipping after ``scaler.unscale_``, a backbone unfrozen with ``add_param_group``, a checkpoint on rank 0; and
the same loop with dearopt's own ``optimizer.unscale_(scaler)`` / ``optimizer.clip_grad_norm_``.  Two ranks end with
identical parameters, equal to one process on the global batch (float32 exactly up to rounding; float16 autocast
within its precision)."""

import contextlib
import os

import pytest
import torch
from torch import nn

import dearopt
from harness import run_workers

STEPS, MICRO, ACCUMULATE, UNFREEZE_AT = 4, 8, 2, 1  # MICRO samples per global micro-batch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def _loader(rank, world):
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        batches = [(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)) for _ in range(ACCUMULATE)]
        yield [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]


def _train(ckpt_dir, amp, ours, rank=0, world=1, distributed=True):
    torch.manual_seed(0)
    model = Net()
    model.backbone.requires_grad_(False)  # frozen at first
    loss_fn, device, unfreeze_at, backbone = nn.functional.mse_loss, "cpu", UNFREEZE_AT, model.backbone
    inner = torch.optim.AdamW(model.head.parameters(), lr=0.05)
    no_sync = dearopt.no_sync if distributed else (lambda m: contextlib.nullcontext())
    rank_of = dearopt.rank if distributed else (lambda: 0)
    loader = _loader(rank, world)

    # ---- the README's loop (device "cpu" here; float16 autocast on CPU where amp) ----
    optimizer = dearopt.DistOptim(inner, model) if distributed else inner
    scaler = torch.amp.GradScaler(device, enabled=amp)
    for step, micro_batches in enumerate(loader):  # this rank's share of the global batch
        for i, (x, y) in enumerate(micro_batches):  # accumulate; communicate on the last one only
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else no_sync(model):
                with torch.autocast(device, dtype=torch.float16, enabled=amp):
                    loss = loss_fn(model(x), y) / len(micro_batches)
                scaler.scale(loss).backward()
        if ours and distributed:
            optimizer.unscale_(scaler)  # the same, keeping dear's overlap
            optimizer.clip_grad_norm_(1.0)
        else:
            scaler.unscale_(optimizer)  # p.grad holds the averaged gradient here
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
        scaler.step(optimizer)  # skipped on every rank alike on inf/NaN
        scaler.update()
        optimizer.zero_grad()
        if step == unfreeze_at:  # a new trainable group: re-planned at the next backward
            backbone.requires_grad_(True)
            optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.01})
        if rank_of() == 0:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                os.path.join(ckpt_dir, f"ckpt-{distributed}.pt"),
            )
    # ---- end ----
    if distributed:
        optimizer.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["dear", "wfbp"])
@pytest.mark.parametrize("amp, ours", [(False, False), (True, False), (True, True)])
def test_readme_loop_on_two_ranks_equals_one_process(tmp_path, schedule, amp, ours):
    outcomes = run_workers(_worker, 2, str(tmp_path), amp, ours, schedule, timeout=90)
    reference = _train(str(tmp_path), amp, ours, distributed=False)
    tolerance = 2e-3 if amp else 1e-5
    for o in outcomes:
        assert len(o.value) == len(reference)
        for got, want, other in zip(o.value, reference, outcomes[0].value):
            assert torch.equal(got, other)  # every rank ends with the same parameters
            assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (got - want).abs().max()
    saved = torch.load(os.path.join(str(tmp_path), "ckpt-True.pt"))
    assert len(saved["optimizer"]["param_groups"]) == 2  # the unfrozen backbone's group is in the checkpoint


def _worker(ckpt_dir, amp, ours, schedule):
    rank, world = dearopt.rank(), dearopt.size()
    real = dearopt.DistOptim

    def distoptim(inner, model):  # the README's line, with this test's schedule
        return real(inner, model, schedule=schedule)

    dearopt.DistOptim = distoptim
    try:
        return _train(ckpt_dir, amp, ours, rank, world)
    finally:
        dearopt.DistOptim = real
