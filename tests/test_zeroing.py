"""Every way a training loop zeroes or replaces gradients is exact, with tied weights and without.

``model.zero_grad()`` (what Hugging Face's ``Trainer`` calls every step), ``optimizer.zero_grad()``, the wrapped
optimizer's own ``zero_grad()``, ``p.grad = None`` by hand and a submodule's ``zero_grad()`` (the rest of the model
then accumulates across steps, as in torch): each, with ``set_to_none`` True and False where it has one, under every
exact schedule and the sharded update, against the same loop in one process on the global batch (fp32, 1e-5).
The sharded update clears every gradient at ``step()`` (no rank holds a whole averaged gradient; its contract, as
DeepSpeed's ZeRO), so a loop that carries gradients across steps is not run under it.
The models: a tiny ``GPT2LMHeadModel`` (tied input and output embeddings), the same untied, and an MLP with a layer
that never gets a gradient (its bucket must not send the gradient it held before the loop cleared it).
"""

import logging

import pytest
import torch

import dearopt
from harness import run_workers
from models import make_model

transformers = pytest.importorskip("transformers")

SCHEDULES = ["dear", "wfbp", "rsag", "bytescheduler", "prophet", "prophet-allreduce", "dear-sharded"]
ZEROINGS = ["optimizer", "optimizer-keep", "inner", "model", "model-keep", "by-hand", "submodule"]
STEPS = 5
BATCH, SEQ, VOCAB = 4, 8, 37


def _model(kind):
    if kind == "unused":
        return make_model("unused")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=kind == "tied",
    )
    return transformers.GPT2LMHeadModel(config)


def _loss(kind, model, step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "unused":
        x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        return torch.nn.functional.mse_loss(model(x), y)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if rank is not None:
        ids = ids.chunk(world)[rank]
    return model(input_ids=ids, labels=ids).loss


def _zero(how, model, opt, inner):
    if how == "optimizer":
        opt.zero_grad()
    elif how == "optimizer-keep":
        opt.zero_grad(set_to_none=False)
    elif how == "inner":
        inner.zero_grad()
    elif how == "model":
        model.zero_grad()
    elif how == "model-keep":
        model.zero_grad(set_to_none=False)
    elif how == "by-hand":
        for p in model.parameters():
            p.grad = None
    elif how == "submodule":  # the rest of the model accumulates across steps, as in torch
        part = model.fc1 if hasattr(model, "fc1") else model.transformer.h[0]
        part.zero_grad()


def _run(kind, how, schedule=None, rank=None, world=None):
    model = _model(kind)
    model.train()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    opt = inner
    if schedule is not None:
        extra = {"shard_optimizer": True} if schedule == "dear-sharded" else {}
        opt = dearopt.DistOptim(inner, model, schedule=schedule.replace("-sharded", ""), buffer_size="4KB", **extra)
    for step in range(STEPS):
        _loss(kind, model, step, rank, world).backward()
        opt.step()
        _zero(how, model, opt, inner)
    params = [p.detach().clone() for p in model.parameters()]
    if schedule is not None:
        opt.close()
    return params


def _zeroings(schedule):
    return [how for how in ZEROINGS if not (schedule == "dear-sharded" and how == "submodule")]


def _distributed(kind):
    # every schedule in one job (the processes and the rendezvous are the slow part of a case)
    rank, world = dearopt.rank(), dearopt.size()
    return {s: {how: _run(kind, how, s, rank, world) for how in _zeroings(s)} for s in SCHEDULES}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["tied", "untied", "unused"])
def test_every_way_of_zeroing_gradients_is_exact(kind):
    """Each zeroing path, under every exact schedule and the sharded update, against one process."""
    want = {how: _run(kind, how) for how in ZEROINGS}
    for o in run_workers(_distributed, 2, kind, timeout=380):
        for schedule in SCHEDULES:
            for how in _zeroings(schedule):
                for i, (g, w) in enumerate(zip(o.value[schedule][how], want[how])):
                    scale = max(1.0, float(w.abs().max()))
                    torch.testing.assert_close(
                        g / scale,
                        w / scale,
                        rtol=1e-5,
                        atol=1e-5,
                        msg=lambda m: f"{schedule}, {how}, param {i}, rank {o.rank}: {m}",
                    )


def _clipped(rank=None, world=None):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)  # tied input and output embeddings
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = inner if rank is None else dearopt.DistOptim(inner, model)
    replans = []  # the engine's warning when it re-plans for a loop that reads p.grad (logged on rank 0)
    handler = logging.Handler()
    handler.emit = lambda record: replans.append(record.getMessage())
    logging.getLogger("dearopt").addHandler(handler)
    for step in range(8):
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        if rank is not None:
            ids = ids.chunk(world)[rank]
        model(input_ids=ids, labels=ids).loss.backward()
        if rank is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        else:
            opt.clip_grad_norm_(0.05)
        opt.step()
        model.zero_grad()
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    logging.getLogger("dearopt").removeHandler(handler)
    if rank is not None:
        out["replanned"] = [m for m in replans if "was read between backward() and step()" in m]
        opt.close()
    return out


def _clipped_distributed():
    return _clipped(dearopt.rank(), dearopt.size())


@pytest.mark.timeout(120)
def test_clipping_a_tied_model_through_the_optimizer_is_exact_and_keeps_the_schedule():
    """``optimizer.clip_grad_norm_`` on a tied GPT-2 (what DearTrainer calls): exact, and the engine's own combining of
    the tied weight's gradients is not taken for user code reading ``p.grad`` (which re-plans to DDP's all-reduce)."""
    want = _clipped()["params"]
    for o in run_workers(_clipped_distributed, 2, timeout=100):
        assert not o.value["replanned"]
        for i, (g, w) in enumerate(zip(o.value["params"], want)):
            scale = max(1.0, float(w.abs().max()))
            torch.testing.assert_close(g / scale, w / scale, rtol=1e-5, atol=1e-5, msg=lambda m: f"param {i}: {m}")
