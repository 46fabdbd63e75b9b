"""A Hugging Face fine-tuning loop, unchanged but for the four lines: a tiny ``GPT2LMHeadModel`` (tied embeddings,
built from a config with random weights), AdamW with a no-decay group, ``get_linear_schedule_with_warmup``,
accumulation of two micro-batches (the first under ``dearopt.no_sync(model)``, as DDP's ``model.no_sync()``) and
torch's own ``clip_grad_norm_`` between backward and step.  Under every exact schedule and the sharded update it
equals one process on the global batch (fp32, 1e-5), and the norms torch's clip returns are the global ones.
"""

import contextlib

import pytest
import torch

import dearopt
from harness import run_workers

transformers = pytest.importorskip("transformers")

SCHEDULES = ["dear", "wfbp", "rsag", "bytescheduler", "prophet", "prophet-allreduce", "dear-sharded"]
STEPS = 5
MICRO = 2  # micro-batches per step
BATCH = 6  # sequences per micro-batch, global
SEQ = 8
VOCAB = 61


def _model():
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
    )
    return transformers.GPT2LMHeadModel(config)


def _groups(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "ln_" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _tokens(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _run(schedule=None, rank=None, world=None):
    model = _model()
    model.train()
    opt = torch.optim.AdamW(_groups(model), lr=3e-3)
    if rank is not None:
        kwargs = {"shard_optimizer": True} if schedule == "dear-sharded" else {}
        opt = dearopt.DistOptim(opt, model, schedule=schedule.replace("-sharded", ""), buffer_size="64KB", **kwargs)
    scheduler = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            ids = _tokens(step, micro)
            if rank is not None:
                ids = ids.chunk(world)[rank]
            last = micro == MICRO - 1
            with contextlib.nullcontext() if last or rank is None else dearopt.no_sync(model):
                loss = model(input_ids=ids, labels=ids).loss / MICRO
                loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        scheduler.step()
        opt.zero_grad()
    if rank is not None:
        opt.synchronize()
        opt.close()
    return [p.detach().clone() for p in model.parameters()], norms


def _distributed():
    return {s: _run(s, dearopt.rank(), dearopt.size()) for s in SCHEDULES}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_a_hugging_face_gpt2_loop_is_exact_under_every_schedule(world):
    # the loss is a mean over each rank's tokens: with equal shards the mean of the ranks' means is the global one
    assert BATCH % world == 0
    want, want_norms = _run()
    for o in run_workers(_distributed, world, timeout=220):
        for schedule in SCHEDULES:
            params, norms = o.value[schedule]
            assert norms == pytest.approx(want_norms, rel=1e-5), schedule
            for i, (g, w) in enumerate(zip(params, want)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{schedule} param {i}: {m}")
