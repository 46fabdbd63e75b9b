"""Hugging Face's ``transformers.Trainer`` with dearopt (``dearopt.integrations.transformers.DearTrainer``), and
``accelerate``'s ``Accelerator`` in a loop of one's own, against one process on the global batch (fp32, 1e-5).

A tiny ``GPT2LMHeadModel`` (tied embeddings, from a config) trains for six steps of two accumulated micro-batches
with ``max_grad_norm`` clipping, AdamW (Trainer's, with its no-decay group) and Trainer's linear schedule with
warm-up, on 2 ranks: under ``dear``; under ``wfbp`` with the user's own optimizer and scheduler
(``optimizers=``); under ``dear`` with ``shard_optimizer=True``, evaluating every third step; in bf16.  The
reference is a plain ``Trainer`` in one process with twice the per-device batch, reading the data in order
(``train_sampling_strategy="sequential"``): accelerate deals rank r the r-th of every ``world_size``
consecutive per-device batches, so each step's micro-batches are the reference's, split between the ranks.  The
bf16 run keeps Trainer's default random order (accelerate's seeded sampler draws the same permutation in every
process) and its reference runs the ranks' micro-batches one after the other (bf16 autocast rounds differently
with the batch's shape: 4e-3 on the parameters between micro-batches of 4 and of 2, in one process).
Trainer's loss under ``average_tokens_across_devices=True`` (its default) is this rank's summed token losses
over the step's tokens counted on all ranks, times the world size: averaged by dearopt it is the reference's mean
over the step's tokens, and so are the logged loss, grad norm and evaluation loss.  The ``dear`` runs, sharded
or not, save at step 3 and a second run resumed from there ends bit for bit where the straight run ends.  A model
inside DDP or FSDP2 is refused by name; ``import dearopt`` imports neither transformers nor accelerate.
"""

import contextlib
import os

import pytest
import torch

import dearopt
from harness import Attempts, run_workers

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD = 2
STEPS = 6
MICRO = 2  # gradient_accumulation_steps
PER_RANK = 2  # sequences per micro-batch and rank
SEQ = 8
VOCAB = 61
CLIP = 0.5
RUNS = {
    "dear": ("dear", {}),
    "wfbp": ("wfbp", {}),
    "dear-sharded": ("dear", {"shard_optimizer": True}),
    "bf16": ("dear", {}),  # bf16=True (autocast) and Trainer's default random order, against the same in one process
}
RESUMED = ("dear", "dear-sharded")  # save at step 3, resume from there in a second run


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


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences (seeded): each item is a causal-LM example, its labels its inputs."""

    def __init__(self, count, seed):
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(output_dir, per_device, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=MICRO,
        max_steps=STEPS,
        learning_rate=3e-3,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=CLIP,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _dataset(count=STEPS * MICRO * PER_RANK * WORLD, seed=7):
    return _Tokens(count, seed)


def _evaluating(per_device):
    """Trainer's evaluation every third step, on 8 other sequences."""
    return {"eval_dataset": _dataset(8, seed=8)}, dict(
        eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=per_device
    )


def _result(trainer):
    history = trainer.state.log_history
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "loss": [entry["loss"] for entry in history if "loss" in entry],
        "grad_norm": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
        "eval_loss": [entry["eval_loss"] for entry in history if "eval_loss" in entry],
    }


def _plain_environment():
    """This worker as a plain process: no launcher variables, so Trainer (accelerate) runs undistributed."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)


def _references(output_dir):
    """Every reference, in one plain process: Trainer in fp32 and bf16, and the accelerate loop."""
    _plain_environment()
    # first: accelerate's state is per process, and Accelerator() keeps a bf16 Trainer's mixed precision
    results = {"accelerate": _accelerate_loop(distributed=False)}
    for precision in ("fp32", "bf16"):
        data, evaluation = _evaluating(PER_RANK * WORLD)
        if precision == "fp32":  # each micro-batch's global batch at once
            args = _args(os.path.join(output_dir, precision), PER_RANK * WORLD, **evaluation)
        else:  # bf16 rounds differently with the batch's shape: the ranks' micro-batches one after the other
            args = _args(
                os.path.join(output_dir, precision),
                PER_RANK,
                gradient_accumulation_steps=MICRO * WORLD,
                bf16=True,
                train_sampling_strategy="random",
            )
        extra = data if precision == "fp32" else {}
        trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_dataset(), **extra)
        trainer.train()
        results[precision] = _result(trainer)
    return results


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("one-process"))
    (value,) = [o.value for o in run_workers(_references, 1, output_dir, timeout=120, init_kwargs=False)]
    return value


def _own_optimizer(model):
    """What Trainer builds from the arguments, built by hand: AdamW with Trainer's no-decay group, linear warm-up."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3, fused=True)
    return optimizer, transformers.get_linear_schedule_with_warmup(optimizer, 2, STEPS)


def _distributed(output_dir):
    from dearopt.integrations.transformers import DearTrainer

    results = {}
    for name, (schedule, kwargs) in RUNS.items():
        model, overrides, extra = _model(), {}, {}
        if name in RESUMED:
            overrides.update(save_strategy="steps", save_steps=3)
        if name == "wfbp":
            extra["optimizers"] = _own_optimizer(model)  # the user's optimizer and scheduler, wrapped
        elif name == "dear-sharded":  # evaluation between steps sees the parameters the shards were updated to
            data, evaluation = _evaluating(PER_RANK)
            extra.update(data)
            overrides.update(evaluation)
        elif name == "bf16":
            overrides.update(bf16=True, train_sampling_strategy="random")
        trainer = DearTrainer(
            model=model,
            args=_args(os.path.join(output_dir, name), PER_RANK, **overrides),
            train_dataset=_dataset(),
            schedule=schedule,
            distoptim_kwargs=kwargs,
            **extra,
        )
        trainer.train()
        assert isinstance(trainer.distoptim, dearopt.DistOptim)
        assert trainer.model_wrapped is trainer.model  # no DistributedDataParallel around it
        results[name] = _result(trainer)
        trainer.close()
    torch.distributed.barrier()
    for name in RESUMED:  # the run again, resumed from the checkpoint it saved at step 3
        schedule, kwargs = RUNS[name]
        args = _args(os.path.join(output_dir, name), PER_RANK)
        trainer = DearTrainer(
            model=_model(), args=args, train_dataset=_dataset(), schedule=schedule, distoptim_kwargs=kwargs
        )
        trainer.train(resume_from_checkpoint=os.path.join(output_dir, name, "checkpoint-3"))
        results[f"{name} resumed"] = _result(trainer)
        trainer.close()
    return results


def _assert_close(got, want, what, tol=1e-5):
    assert len(got["loss"]) == len(want["loss"]) == STEPS, (what, got["loss"])
    for key in ("loss", "grad_norm", "eval_loss"):
        if key != "eval_loss" or got[key]:
            assert got[key] == pytest.approx(want[key], rel=tol), (what, key)
    for i, (g, w) in enumerate(zip(got["params"], want["params"])):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{what} param {i}: {m}")


def _two_ranks(output_dir):
    """Everything on two ranks, in one job (one start-up): the accelerate loop first (accelerate's state is per
    process: a fresh one), the Trainer runs, the refusals."""
    return {
        "accelerate": _accelerate_loop(distributed=True),
        "trainer": _distributed(os.path.join(output_dir, "trainer")),
        "refusals": _refusals(os.path.join(output_dir, "refusals")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("two-ranks")
    return output_dir, [o.value for o in run_workers(_two_ranks, WORLD, str(output_dir), timeout=200)]


@pytest.mark.timeout(300)
def test_trainer_with_accumulation_clipping_and_schedule_is_exact_and_resumes(references, two_ranks):
    want = references
    output_dir, values = two_ranks
    for rank, value in enumerate(values):
        got = value["trainer"]
        for name in RUNS:
            precision = "bf16" if name == "bf16" else "fp32"
            _assert_close(got[name], want[precision], f"rank {rank} {name}")
        assert len(got["dear-sharded"]["eval_loss"]) == 2  # after steps 3 and 6
        for name in RESUMED:
            straight, resumed = got[name]["params"], got[f"{name} resumed"]["params"]
            for i, (a, b) in enumerate(zip(straight, resumed)):
                assert torch.equal(a, b), (
                    f"rank {rank}: {name} param {i}: the resumed run differs from the straight one"
                )
    for name in RESUMED:  # rank 0 wrote it, gathered on every rank under shard_optimizer=True: the ordinary layout
        state = torch.load(output_dir / "trainer" / name / "checkpoint-3" / "optimizer.pt", weights_only=True)
        assert len(state["state"]) == len(want["fp32"]["params"]) and state["state"][0]["step"] == 3


# ---------------------------------------------------------------- accelerate's Accelerator in a loop of one's own


def _accelerate_loop(distributed):
    """The documented recipe: the model prepared without DDP, a DistOptim on it, the rest prepared as usual; the
    scheduler stepped by the loop (accelerate's prepared scheduler steps ``num_processes`` times a step)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, STEPS)
    per_device = PER_RANK if distributed else PER_RANK * WORLD
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=per_device, shuffle=False)
    if distributed:
        model = accelerator.prepare_model(model, evaluation_mode=True)  # device and autocast, no DDP
        dist = dearopt.DistOptim(optimizer, model)
        optimizer, loader = accelerator.prepare(dist, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    norms = []
    for batch in loader:
        with accelerator.accumulate(model):
            quiet = (
                dearopt.no_sync(model) if distributed and not accelerator.sync_gradients else contextlib.nullcontext()
            )
            with quiet:
                accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                if distributed:
                    norms.append(float(dist.clip_grad_norm_(CLIP)))
                else:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
    if distributed:
        dist.synchronize()
        dist.close()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.timeout(300)
def test_an_accelerate_loop_with_distoptim_is_exact(references, two_ranks):
    want, want_norms = references["accelerate"]
    assert len(want_norms) == STEPS
    for rank, value in enumerate(two_ranks[1]):
        params, norms = value["accelerate"]
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for i, (g, w) in enumerate(zip(params, want)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} param {i}: {m}")


# ---------------------------------------------------------------- what is refused, what is not imported


def _refusals(output_dir):
    from torch.distributed.fsdp import fully_shard

    from dearopt.integrations.transformers import DearTrainer

    attempts = Attempts()
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    args = _args(output_dir, PER_RANK)
    attempts.attempt("trainer", lambda: DearTrainer(model=ddp, args=args, train_dataset=_dataset()))
    attempts.attempt("distoptim", lambda: dearopt.DistOptim(torch.optim.AdamW(ddp.parameters()), ddp))
    sharded = fully_shard(_model())
    attempts.attempt("fsdp2", lambda: dearopt.DistOptim(torch.optim.AdamW(sharded.parameters()), sharded))
    attempts.attempt(
        "kwargs", lambda: DearTrainer(model=_model(), args=args, distoptim_kwargs={"shard_optimiser": True})
    )
    return dict(attempts)


@pytest.mark.timeout(300)
def test_a_model_inside_ddp_or_fsdp_is_refused_by_name(two_ranks):
    for value in two_ranks[1]:
        Attempts.expect(
            value["refusals"],
            {
                "trainer": ("UsageError", "DistributedDataParallel (DDP)"),
                "distoptim": ("UsageError", "Pass the unwrapped module (the DDP's .module)"),
                "fsdp2": ("UsageError", "FSDP2"),
                "kwargs": ("TypeError", "shard_optimiser"),
            },
        )


_IMPORTS_NOTHING_HEAVY = """
import sys
import dearopt, dearopt.integrations
heavy = sorted(name for name in ("transformers", "accelerate", "lightning") if name in sys.modules)
assert not heavy, f"import dearopt, dearopt.integrations imported {heavy}"
"""


def test_import_dearopt_imports_neither_transformers_nor_accelerate():
    # run by exec in a fresh worker (the forkserver has torch and dearopt, not this module, which imports transformers)
    run_workers(exec, 1, _IMPORTS_NOTHING_HEAVY, {}, timeout=60, init_kwargs=False)
