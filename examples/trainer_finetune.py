"""Fine-tune a tiny GPT-2 with Hugging Face's ``Trainer`` and dearopt (``DearTrainer``), on CPU or GPUs.

The task is learnable in a few dozen steps: sequences of digits that count up (7 8 9 0 1 2 ...) from a random
start, so the loss falls from about 2.3 (a guess among 10 digits) towards 0.  ``DearTrainer`` is the one change
from a plain ``Trainer`` script: the optimizer Trainer builds (AdamW, linear schedule with warm-up) is wrapped in a
``dearopt.DistOptim``, Trainer's DDP is kept out, accumulation, clipping and checkpoints work as in Trainer.

    torchrun --nproc_per_node 2 examples/trainer_finetune.py                       # two ranks, 4 sequences each
    python examples/trainer_finetune.py --plain --per-device-batch 8               # one process, plain Trainer

The data is read in order (``train_sampling_strategy="sequential"``), so the two commands above train on the
same global batches; with ``--save PATH`` each writes its final parameters, to compare.  A checkpoint is written
halfway (``--output-dir``, default ``$TMPDIR/trainer_finetune``); ``--resume DIR/checkpoint-20`` continues from it.
"""

import argparse
import os
import tempfile

import torch
import transformers

from dearopt.integrations.transformers import DearTrainer  # dearopt

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
parser.add_argument("--per-device-batch", type=int, default=4, help="sequences per micro-batch and process")
parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--schedule", default="dear", help="dearopt's schedule (dear, wfbp, rsag, prophet, ...)")
parser.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1 style sharded optimizer state")
parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
parser.add_argument("--plain", action="store_true", help="a plain transformers.Trainer (the one-process reference)")
parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "trainer_finetune"), help="checkpoints")
parser.add_argument("--save", default=None, help="write the final parameters here (rank 0)")
parser.add_argument("--resume", default=None, help="a checkpoint directory to continue from (e.g. .../checkpoint-20)")
args = parser.parse_args()

SEQ, DIGITS, GLOBAL_SEQUENCES = 16, 10, 1024


class CountingDigits(torch.utils.data.Dataset):
    """Digit sequences counting up modulo 10 from a random (seeded) start; the labels are the inputs (causal LM)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        starts = torch.randint(0, DIGITS, (count, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (starts + torch.arange(SEQ)) % DIGITS

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)  # every rank builds the same model (DistOptim also broadcasts rank 0's parameters)
config = transformers.GPT2Config(
    n_layer=2,
    n_head=2,
    n_embd=32,
    vocab_size=DIGITS,
    n_positions=SEQ,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
model = transformers.GPT2LMHeadModel(config)

training_args = transformers.TrainingArguments(
    output_dir=args.output_dir,  # the same on every rank: each writes its RNG state into the checkpoints
    max_steps=args.steps,
    per_device_train_batch_size=args.per_device_batch,
    gradient_accumulation_steps=args.accumulation,
    learning_rate=3e-3,
    weight_decay=0.01,
    warmup_steps=4,
    lr_scheduler_type="linear",
    max_grad_norm=1.0,
    bf16=args.bf16,
    train_sampling_strategy="sequential",  # the same order for any number of processes
    logging_steps=10,
    save_strategy="steps",
    save_steps=args.steps // 2,  # a checkpoint halfway: --resume OUTPUT_DIR/checkpoint-20 continues from it
    report_to="none",
    disable_tqdm=True,
    use_cpu=not torch.cuda.is_available(),
    dataloader_num_workers=0,
    seed=0,
)
dataset = CountingDigits(GLOBAL_SEQUENCES)
if args.plain:
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=dataset)
else:
    trainer = DearTrainer(  # dearopt
        model=model,
        args=training_args,
        train_dataset=dataset,
        schedule=args.schedule,
        distoptim_kwargs={"shard_optimizer": args.shard_optimizer},
    )
result = trainer.train(resume_from_checkpoint=args.resume)
trainer.save_model()  # every rank: pending updates are applied together, rank 0 writes
if trainer.is_world_process_zero():
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"losses every {training_args.logging_steps} steps: " + " ".join(f"{loss:.4f}" for loss in losses))
    print(
        f"final loss {losses[-1]:.4f} after {result.global_step} steps on {training_args.world_size} process(es) "
        f"({'plain Trainer' if args.plain else 'DearTrainer, schedule ' + args.schedule}); "
        f"saved to {training_args.output_dir}"
    )
    if args.save:
        torch.save({name: p.detach().cpu() for name, p in model.named_parameters()}, args.save)
        print(f"final parameters written to {os.path.abspath(args.save)}")
