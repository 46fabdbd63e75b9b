"""A Horovod-style training script: scikit-learn's digits with a small MLP.

Written exactly as for Horovod; only the import differs::

    import dearopt.integrations.horovod as hvd      # instead of: import horovod.torch as hvd

Run it with any launcher (or none, for one process)::

    python examples/horovod_digits.py
    mpirun -np 2 python examples/horovod_digits.py
    python -m torch.distributed.run --nproc_per_node 2 examples/horovod_digits.py
    HOROVOD_RANK=.. HOROVOD_SIZE=2 HOROVOD_LOCAL_RANK=.. HOROVOD_LOCAL_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python ...

The global batch is the same for every world size (each rank takes its share
of it), so the result matches one process up to floating-point rounding.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import dearopt.integrations.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=40, help="global batch size")
parser.add_argument("--lr", type=float, default=5e-3)
parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 on the wire")
parser.add_argument("--clip", type=float, default=0.0, help="clip the averaged gradients to this norm")
args = parser.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())  # different on purpose: broadcast_parameters makes the models equal
torch.set_num_threads(1)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
x_train, y_train = x[order[:1400]], y[order[:1400]]
x_test, y_test = x[order[1400:]], y[order[1400:]]

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.85)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Average
)

if args.batch_size % hvd.size():
    raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the number of ranks {hvd.size()}")


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


for epoch in range(args.epochs):
    model.train()
    perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(100 + epoch))
    total_loss, batches = 0.0, 0
    for start in range(0, len(perm) - args.batch_size + 1, args.batch_size):
        idx = perm[start : start + args.batch_size][hvd.rank() :: hvd.size()]  # this rank's share of the batch
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        if args.clip:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        total_loss += loss.item()
        batches += 1
    scheduler.step()
    model.eval()
    with torch.no_grad():
        mine = torch.arange(hvd.rank(), len(x_test), hvd.size())  # each rank scores its share of the test set
        correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
    correct = hvd.allreduce(correct, op=hvd.Sum, name="correct").item()
    accuracy = correct / len(x_test)
    train_loss = metric_average(total_loss / batches, "avg_loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: train loss {train_loss:.4f} test accuracy {100 * accuracy:.2f}%", flush=True)

checksum = hvd.allgather_object(round(sum(float(p.detach().sum()) for p in model.parameters()), 4))
if hvd.rank() == 0:
    print(f"parameter checksums per rank: {checksum}")
    print(f"final test accuracy: {100 * accuracy:.2f}%")
