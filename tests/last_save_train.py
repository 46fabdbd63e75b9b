"""Training ends the way torch scripts end (tests/test_last_save.py): ``python last_save_train.py SCHEDULE EXIT OUT``
under torchrun or mpirun trains the MLP for a few steps on this rank's shard of each global batch; then rank 0
alone saves ``model.state_dict()`` to ``OUT`` a moment later, while every other rank leaves at once by ``EXIT``:
``return`` (the interpreter exits), ``destroy`` (``torch.distributed.destroy_process_group()``) or ``shutdown``
(``dearopt.shutdown()``)."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import train_step, make_model  # noqa: E402

STEPS = 4


def main(schedule, leave, out):
    import dearopt

    dearopt.init()
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    kwargs = {"shard_optimizer": True} if schedule == "dear-sharded" else {}
    opt = dearopt.DistOptim(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        schedule=schedule.replace("-sharded", ""),
        buffer_size=64,
        **kwargs,
    )
    for step in range(STEPS):
        train_step(opt, model, step, rank, world)
    if rank == 0:
        time.sleep(0.5)  # the others have left by now
        torch.save(model.state_dict(), out)
        return
    if leave == "destroy":
        torch.distributed.destroy_process_group()
    elif leave == "shutdown":
        dearopt.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
