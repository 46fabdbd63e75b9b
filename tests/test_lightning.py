"""dearopt.integrations.lightning.DearStrategy: a LightningModule trained by Lightning's Trainer on 2 CPU ranks under
``dear``, ``wfbp`` and ``shard_optimizer=True``, with gradient clipping, ``accumulate_grad_batches=2`` and a per-step LR
scheduler, equals a plain torch loop on the global batch in one process; resuming from a Lightning checkpoint
(``fit(ckpt_path=...)``) equals the uninterrupted run.

The ranks are started by the harness with torchrun's variables (Lightning sees a torchelastic launch and builds
the Trainer in each rank with ``devices=2``); every scenario runs in the same two processes, one after the other,
so that Lightning is imported once.  ``test_lightning_launcher`` starts a script with ``devices=2`` the way a user
does, letting Lightning's own launcher start the second process.
"""

import importlib
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("lightning")

from harness import launcher_free_env, run_workers  # noqa: E402

N = 64  # samples
PER_RANK = 4  # samples per rank per micro-batch: a global micro-batch is 8 samples
ACCUMULATE = 2
STEPS_PER_EPOCH = N // (2 * PER_RANK * ACCUMULATE)  # 4
TOLERANCE = 1e-5

SCENARIOS = {
    # name: (DearStrategy kwargs, optimizer, gradient_clip_val, gradient_clip_algorithm, precision)
    "dear-sgd-clipnorm": (dict(schedule="dear"), "sgd", 0.5, "norm", "32-true"),
    "wfbp-adamw-clipvalue": (dict(schedule="wfbp"), "adamw", 0.05, "value", "32-true"),
    "sharded-adamw-clipnorm": (dict(schedule="dear", shard_optimizer=True), "adamw", 0.5, "norm", "32-true"),
    "dear-sgd-bf16": (dict(schedule="dear"), "sgd", 0.5, "norm", "bf16-mixed"),
}
RESUME = (dict(schedule="dear", shard_optimizer=True), "adamw", 0.5, "norm", "32-true")


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 8, generator=g), torch.randint(0, 4, (N,), generator=g)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def _optimizer(kind, params):
    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    else:
        optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))


def _reference(kind, clip, algorithm, precision, steps):
    """One process on the global batch: what the two ranks must compute together."""
    x, y = _data()
    net = _net()
    optimizer, scheduler = _optimizer(kind, net.parameters())
    micro = 2 * PER_RANK
    for step in range(steps):
        for m in range(ACCUMULATE):
            k = (step * ACCUMULATE + m) % (N // micro)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = torch.nn.functional.cross_entropy(
                    net(x[k * micro : (k + 1) * micro]), y[k * micro : (k + 1) * micro]
                )
            (loss / ACCUMULATE).backward()
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        else:
            torch.nn.utils.clip_grad_value_(net.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# ----------------------------------------------------------------------------- what each rank runs
def _module_class():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            self.net = _net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=True)  # the strategy's reduce
            return loss

        def configure_optimizers(self):
            optimizer, scheduler = _optimizer(self.kind, self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Classifier


def _fit(scenario, *, max_steps=-1, max_epochs=None, ckpt_dir=None, ckpt_path=None):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import dearopt.integrations.lightning

    strategy_kwargs, kind, clip, algorithm, precision = scenario
    dataset = TensorDataset(*_data())
    rank = int(os.environ["RANK"])
    loader = DataLoader(
        dataset, batch_size=PER_RANK, sampler=DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
    )
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=ckpt_dir, filename="first", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
            )
        )
    strategy = dearopt.integrations.lightning.DearStrategy(**strategy_kwargs)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        precision=precision,
        max_steps=max_steps,
        max_epochs=max_epochs,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        accumulate_grad_batches=ACCUMULATE,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_model_summary=False,
        callbacks=callbacks,
        use_distributed_sampler=False,
    )
    module = _module_class()(kind)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    assert trainer.global_step == (max_steps if max_steps > 0 else max_epochs * STEPS_PER_EPOCH)
    distoptims = [o for o in trainer.optimizers if isinstance(o, dearopt.DistOptim)]
    assert len(distoptims) == 1, trainer.optimizers
    params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    strategy.close()
    return params


def _count_calls(calls):
    """Count the DistOptim clips and the dearopt.no_sync blocks the strategy enters (in this rank's process)."""
    import dearopt
    import dearopt.integrations.lightning

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original = getattr(dearopt.DistOptim, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(dearopt.DistOptim, name, counting)
    original_no_sync = dearopt.integrations.lightning.no_sync

    def counting_no_sync(model):
        calls["no_sync"] += 1
        return original_no_sync(model)

    dearopt.integrations.lightning.no_sync = counting_no_sync


def _all_scenarios(ckpt_dir):
    import collections
    import warnings

    warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|sync_dist).*")
    calls = collections.Counter()
    _count_calls(calls)
    out = {}
    for name, scenario in SCENARIOS.items():
        calls.clear()
        try:
            out[name] = _fit(scenario, max_steps=STEPS_PER_EPOCH)
            out[name + "/calls"] = dict(calls)
        except Exception as exc:  # reported by the test of that scenario
            out[name] = f"{type(exc).__name__}: {exc}"
    try:
        _fit(RESUME, max_epochs=1, ckpt_dir=ckpt_dir)
        ckpt = os.path.join(ckpt_dir, "first.ckpt")
        out["resumed"] = _fit(RESUME, max_epochs=2, ckpt_path=ckpt)
        out["uninterrupted"] = _fit(RESUME, max_epochs=2)
        out["checkpoint"] = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    except Exception as exc:
        out["resumed"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("lightning_ckpt"))
    env = {"TORCHELASTIC_RUN_ID": "dearopt-test", "GROUP_RANK": "0", "PYTHONWARNINGS": "ignore"}
    outcomes = run_workers(_all_scenarios, 2, ckpt_dir, timeout=240, env=env, init_kwargs=False)
    return [o.value for o in outcomes]


def _assert_close(got, want, what, tolerance=TOLERANCE):
    assert not isinstance(got, str), f"{what}: {got}"
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= tolerance, f"{what}: {key} differs from one process on the global batch by {diff:.3g}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_lightning_matches_global_batch(results, name):
    _, kind, clip, algorithm, precision = SCENARIOS[name]
    want = _reference(kind, clip, algorithm, precision, STEPS_PER_EPOCH)
    # bf16 autocast rounds each rank's half batch as the global batch would be rounded, but not bit for bit
    tolerance = 5e-4 if precision == "bf16-mixed" else TOLERANCE
    for rank, value in enumerate(results):
        _assert_close(value[name], want, f"{name}, rank {rank}", tolerance)
        # Lightning's clipping went to the DistOptim's own clip (once per step), and the first micro-batch of
        # each step ran inside dearopt.no_sync
        clip = "clip_grad_norm_" if algorithm == "norm" else "clip_grad_value_"
        assert value[name + "/calls"] == {clip: STEPS_PER_EPOCH, "no_sync": STEPS_PER_EPOCH}, value[name + "/calls"]


def test_lightning_resume_from_checkpoint(results):
    _, kind, clip, algorithm, precision = RESUME
    want = _reference(kind, clip, algorithm, precision, 2 * STEPS_PER_EPOCH)
    for rank, value in enumerate(results):
        _assert_close(value["uninterrupted"], want, f"uninterrupted, rank {rank}")
        _assert_close(value["resumed"], want, f"resumed from the checkpoint, rank {rank}")
        for key in want:
            assert torch.equal(value["resumed"][key], value["uninterrupted"][key]), key
    # under shard_optimizer=True the checkpoint still holds torch's ordinary per-parameter layout, all of it
    saved = results[0]["checkpoint"]
    assert sorted(saved["state"]) == list(range(6))
    assert saved["state"][0]["exp_avg"].shape == (32, 8)


def test_missing_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # what an environment without Lightning imports
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "dearopt.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install dearopt\[lightning\]"):
        importlib.import_module("dearopt.integrations.lightning")


def test_unknown_strategy_argument_is_refused():
    import dearopt.integrations.lightning

    with pytest.raises(TypeError, match="shard_optimiser"):
        dearopt.integrations.lightning.DearStrategy(shard_optimiser=True)


_SCRIPT = """
    import sys
    import dearopt
    assert not any(m == "lightning" or m.startswith("lightning.") for m in sys.modules), "import dearopt imported it"
    import torch, lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    import dearopt.integrations.lightning

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 2)
        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.arange(32.0).reshape(8, 4) / 32)
    strategy = dearopt.integrations.lightning.DearStrategy(schedule="wfbp")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2,
                         max_steps=2, enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         enable_model_summary=False)
    model = M()
    trainer.fit(model, DataLoader(data, batch_size=2))
    import os
    line = f"RESULT {dearopt.rank()} {dearopt.size()} {trainer.global_step} {model.net.weight.sum().item()}\\n"
    os.write(1, line.encode())  # one write: the ranks share the pipe (print's pieces could interleave)
"""


def test_lightning_launcher(tmp_path):
    """``python script.py`` with ``devices=2``: Lightning's launcher starts the second rank (as for DDPStrategy).
    The script also checks that ``import dearopt`` alone does not import Lightning."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(
        launcher_free_env(),
        PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
    )
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # the two ranks share the pipe: a rank's line may land in the middle of the other's output
    lines = sorted(list(m) for m in re.findall(r"RESULT (\d+) (\d+) (\d+) (\S+)", run.stdout))
    assert [line[:3] for line in lines] == [["0", "2", "2"], ["1", "2", "2"]], run.stdout + run.stderr
    assert lines[0][3] == lines[1][3]  # the same parameters on both ranks
