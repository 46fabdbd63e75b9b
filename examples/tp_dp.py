"""Tensor parallel x data parallel: ``torchrun --nproc-per-node 4 examples/tp_dp.py`` (CPU, gloo; or 4 GPUs).

A 2x2 device mesh: the two layers of each block are split over ``mesh["tp"]`` (torch's ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``), and dearopt averages the gradients over ``mesh["dp"]``, each rank its
local shards, under the default ``dear`` schedule.  At the end rank 0 trains the same model as one process on the
global batch and prints the largest difference from it (fp32 rounding: about 1e-7).
"""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dearopt

STEPS, BATCH, WIDTH = 20, 32, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(WIDTH, 1))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(model, optimizer, dp_rank=0, dp_size=1):
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x.chunk(dp_size)[dp_rank]), y.chunk(dp_size)[dp_rank])
        loss.backward()
        optimizer.step()
    return loss.detach()


def main():
    dearopt.init()  # the job's process group (gloo on CPU, NCCL on GPUs)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dearopt.size() // 2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model().to(device)
    for i in range(2):
        parallelize_module(model[i], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = dearopt.DistOptim(torch.optim.AdamW(model.parameters(), lr=1e-3), model, process_group=mesh["dp"])
    loss = train(model, optimizer, mesh["dp"].get_local_rank(), mesh["dp"].size())
    optimizer.synchronize()
    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for p in model.parameters()]
    if dearopt.rank() == 0:
        single = make_model()
        train(single, torch.optim.AdamW(single.parameters(), lr=1e-3))
        diff = max(float((a - b.detach()).abs().max()) for a, b in zip(params, single.parameters()))
        print(f"loss {loss.item():.4f}; largest difference from one process on the global batch: {diff:.2e}")


if __name__ == "__main__":
    main()
