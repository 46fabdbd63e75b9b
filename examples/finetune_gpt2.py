"""Fine-tune a small GPT-2 the way a Hugging Face-style loop does (issue 41's first "ordinary script").

AdamW with the usual two groups (no weight decay for biases and LayerNorm weights), a linear schedule with
warmup, two micro-batches accumulated per step, torch's own clip_grad_norm_, optional bf16 autocast, and a
checkpoint of model, optimizer and scheduler that a second launch resumes from.  The lines marked
``# dearopt`` are all it takes to run it on any number of ranks; everything else is the single-process script.
Each step's global batch is sliced by rank, so one process and N ranks see the same samples per step and
end with the same parameters (tests/test_finetune_examples.py compares the checksums).

    python examples/finetune_gpt2.py                                   # one process
    torchrun --nproc_per_node 2 examples/finetune_gpt2.py              # two ranks
    torchrun --nproc_per_node 2 examples/finetune_gpt2.py --save-at 4 --save ckpt.pt
    torchrun --nproc_per_node 2 examples/finetune_gpt2.py --resume ckpt.pt
"""

import argparse
import contextlib

import dearopt  # dearopt
import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch, all ranks together")
parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--bf16", action="store_true", help="bf16 autocast (off: fp32, exact)")
parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this many steps")
parser.add_argument("--save", default="gpt2_checkpoint.pt", help="where --save-at writes the checkpoint")
parser.add_argument("--resume", default=None, help="a checkpoint written by --save-at to continue from")
parser.add_argument("--schedule", default="dear")
parser.add_argument("--shard-optimizer", action="store_true")
args = parser.parse_args()

dearopt.init()  # dearopt
torch.manual_seed(0)
torch.set_num_threads(1)
config = GPT2Config(
    n_layer=2,
    n_head=2,
    n_embd=32,
    vocab_size=97,
    n_positions=32,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
model = GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight (tied)
model.train()

# the data: random token sequences from a seeded generator, one global micro-batch per (step, micro-step)
data = torch.randint(
    0,
    config.vocab_size,
    (args.steps, args.accumulation, args.batch_size, args.seq_len),
    generator=torch.Generator().manual_seed(1234),
)

no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or ".ln_" in n]
decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or ".ln_" in n)]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
)
optimizer = dearopt.DistOptim(
    optimizer,
    model,
    schedule=args.schedule,  # dearopt
    shard_optimizer=args.shard_optimizer,
)
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=args.steps)

start_step = 0
if args.resume:
    checkpoint = torch.load(args.resume, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    start_step = checkpoint["step"]

for step in range(start_step, args.steps):
    total = 0.0
    for micro in range(args.accumulation):
        batch = data[step, micro]
        batch = batch[dearopt.rank() :: dearopt.size()]  # dearopt: this rank's share of the global micro-batch
        # the micro-batches before the last accumulate locally (DDP's model.no_sync())
        last = micro == args.accumulation - 1
        with contextlib.nullcontext() if last else dearopt.no_sync(model):  # dearopt
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(input_ids=batch, labels=batch).loss / args.accumulation
            loss.backward()
        total += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    if dearopt.rank() == 0:  # dearopt (the loss is rank 0's share; the norm is the global one)
        print(
            f"step {step + 1}: loss {total:.6f} grad norm {grad_norm.item():.6f} lr {scheduler.get_last_lr()[0]:.3e}",
            flush=True,
        )
    if args.save_at is not None and step + 1 == args.save_at:
        # every rank builds it (with --shard-optimizer, optimizer.state_dict() gathers the shards: a collective)
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step + 1,
        }
        if dearopt.rank() == 0:  # dearopt
            torch.save(checkpoint, args.save)
            print(f"saved {args.save} after step {step + 1}", flush=True)

with torch.no_grad():
    params = [p.detach().double() for p in model.parameters()]
    checksum = sum(p.sum() for p in params).item()
    squares = sum((p * p).sum() for p in params).item()
if dearopt.rank() == 0:  # dearopt
    print(f"final checksum: {checksum:.8f} sum of squares: {squares:.8f}", flush=True)
