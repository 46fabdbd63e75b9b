"""A training script for torchrun's elastic agent (tests/test_elastic.py): resumes from the latest checkpoint of
``$DEAROPT_ELASTIC_DIR`` at whatever world size it is restarted with.

``python elastic_train.py dearopt|horovod``: the dearopt API (``dearopt.checkpoint``, ``shard_optimizer=True``: the
restarted process reads its shard of the optimizer state at its first step) or Horovod's elastic API
(``dearopt.integrations.horovod.elastic``, the script as Horovod's with the import changed).  With
``ELASTIC_CRASH_AT=k`` in its environment, the first attempt of this node kills its own agent and exits before step
``k`` (a node lost).
Each rank logs ``restart world rank step sample...`` per step to ``$DEAROPT_ELASTIC_DIR/log_<restart>_<rank>``;
rank 0 saves the final parameters to ``final.pt`` there.
"""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import loss_fn, make_model  # noqa: E402

SAMPLES, BATCH, COMMIT_EVERY = 48, 4, 2


def dataset():
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 3, generator=g))


def _crash_here(step):
    crash_at = os.environ.get("ELASTIC_CRASH_AT")
    if crash_at is not None and int(crash_at) == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getppid(), signal.SIGKILL)  # the agent: this node is gone
        os._exit(1)


class Log:
    def __init__(self, root, rank, world):
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.file = open(os.path.join(root, f"log_{restart}_{rank}"), "a")
        self.prefix = f"{restart} {world} {rank}"

    def step(self, step, indices):
        self.file.write(f"{self.prefix} {step} {' '.join(str(int(i)) for i in indices)}\n")
        self.file.flush()


def with_dearopt(root):
    import dearopt
    import dearopt.checkpoint as ckpt

    dearopt.init()
    rank, world = dearopt.rank(), dearopt.size()
    data = dataset()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, buffer_size=64, shard_optimizer=True
    )
    sampler = ckpt.ElasticSampler(data, shuffle=True, seed=0)
    step = 0
    found = ckpt.latest(root)
    if found is not None:
        step = ckpt.load(found[1], model, opt, extra={"sampler": sampler})["step"]
    log = Log(root, rank, world)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    for i, (x, y) in enumerate(loader):
        _crash_here(step)
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        log.step(step, sampler.get_indices(i, BATCH))
        sampler.record_batch(i, BATCH)
        step += 1
        if step % COMMIT_EVERY == 0:
            ckpt.save(ckpt.step_path(root, step), model, opt, extra={"step": step, "sampler": sampler})
    opt.synchronize()
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], os.path.join(root, "final.pt"))
    dearopt.shutdown()


def with_horovod(root):
    import dearopt.integrations.horovod as hvd

    hvd.init()
    data = dataset()
    model = make_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)

    @hvd.elastic.run
    def train(state):
        log = Log(root, hvd.rank(), hvd.size())
        for state.epoch in range(state.epoch, 1):
            for batch_idx, (x, y) in enumerate(loader):
                _crash_here(state.step)
                optimizer.zero_grad()
                loss_fn("mlp", model(x), y).backward()
                optimizer.step()
                log.step(state.step, state.train_sampler.get_indices(batch_idx, BATCH))
                state.train_sampler.record_batch(batch_idx, BATCH)
                state.step += 1
                if state.step % COMMIT_EVERY == 0:
                    state.commit()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, step=0)
    train(state)
    if hvd.rank() == 0:
        torch.save([p.detach() for p in model.parameters()], os.path.join(root, "final.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"dearopt": with_dearopt, "horovod": with_horovod}[sys.argv[1]](os.environ["DEAROPT_ELASTIC_DIR"])
