"""Fine-tune a small CNN on scikit-learn's digits the way a vision fine-tuning loop does (issue 41's second
"ordinary script").

A conv backbone and a linear head; the backbone is frozen for the first epoch and unfrozen at epoch 1, either
by flipping ``requires_grad`` while its group is already in the optimizer (the default) or, with
``--add-group``, by ``optimizer.add_param_group(...)`` (the other common way).  OneCycleLR, a GradScaler with
``scaler.unscale_`` and torch's own ``clip_grad_norm_``, and an EMA of the weights
(``torch.optim.swa_utils.AveragedModel``) updated after every step.  The lines marked ``# dearopt`` are all it
takes to run it on any number of ranks; each step's global batch is sliced by rank, so one process and N ranks
see the same samples per step and end with the same parameters (tests/test_finetune_examples.py).

    python examples/finetune_cnn.py                                    # one process
    torchrun --nproc_per_node 2 examples/finetune_cnn.py               # two ranks
    torchrun --nproc_per_node 2 examples/finetune_cnn.py --schedule wfbp --add-group
"""

import argparse

import dearopt  # dearopt
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32, help="images per step, all ranks together")
parser.add_argument("--train-size", type=int, default=960)
parser.add_argument(
    "--add-group",
    action="store_true",
    help="the backbone joins the optimizer at epoch 1 (add_param_group) instead of being in it frozen",
)
parser.add_argument("--schedule", default="dear")
parser.add_argument("--shard-optimizer", action="store_true")
args = parser.parse_args()

dearopt.init()  # dearopt
torch.manual_seed(0)
torch.set_num_threads(1)
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
x_train, y_train = x[order[: args.train_size]], y[order[: args.train_size]]
x_test, y_test = x[order[1400:]], y[order[1400:]]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, inputs):
        return self.head(self.backbone(inputs))


model = Net()
for p in model.backbone.parameters():  # the first epoch trains the head only
    p.requires_grad_(False)
if args.add_group:
    groups = [{"params": model.head.parameters()}]
else:
    groups = [{"params": model.head.parameters()}, {"params": model.backbone.parameters()}]
optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-4)
optimizer = dearopt.DistOptim(
    optimizer,
    model,
    schedule=args.schedule,  # dearopt
    shard_optimizer=args.shard_optimizer,
)
steps_per_epoch = len(x_train) // args.batch_size
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=args.epochs * steps_per_epoch)
scaler = torch.amp.GradScaler("cpu")
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))

for epoch in range(args.epochs):
    if epoch == 1:  # unfreeze the backbone
        for p in model.backbone.parameters():
            p.requires_grad_(True)
        if args.add_group:  # with the head group's hyperparameters, OneCycleLR's included
            optimizer.add_param_group(dict(optimizer.param_groups[0], params=list(model.backbone.parameters())))
    model.train()
    perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
    for step in range(steps_per_epoch):
        idx = perm[step * args.batch_size : (step + 1) * args.batch_size]
        idx = idx[dearopt.rank() :: dearopt.size()]  # dearopt: this rank's share of the global batch
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        ema.update_parameters(model)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        ema_accuracy = (ema(x_test).argmax(1) == y_test).float().mean().item()
    if dearopt.rank() == 0:  # dearopt
        print(
            f"epoch {epoch}: loss {loss.item():.4f} test accuracy {100 * accuracy:.2f}% EMA {100 * ema_accuracy:.2f}%",
            flush=True,
        )

with torch.no_grad():
    params = [p.detach().double() for p in model.parameters()]
    ema_params = [p.detach().double() for p in ema.module.parameters()]
    checksum = sum(p.sum() for p in params).item()
    squares = sum((p * p).sum() for p in params).item()
    ema_checksum = sum(p.sum() for p in ema_params).item()
if dearopt.rank() == 0:  # dearopt
    print(f"final test accuracy: {100 * accuracy:.2f}% EMA {100 * ema_accuracy:.2f}%")
    print(f"final checksum: {checksum:.8f} sum of squares: {squares:.8f} EMA checksum: {ema_checksum:.8f}", flush=True)
