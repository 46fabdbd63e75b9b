"""Small models and data shared by the optimizer tests (deterministic by seed)."""

import torch
from torch import nn

IN, OUT = 6, 3


class MLP(nn.Module):
    """Three linear layers; ``skip_middle`` skips one (same on every rank)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, OUT)
        self.skip_middle = False

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        if not self.skip_middle:
            x = torch.tanh(self.fc2(x))
        return self.fc3(x)


class Reordered(nn.Module):
    """Registration order differs from forward order."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(8, OUT)
        self.middle = nn.Linear(8, 8)
        self.first = nn.Linear(IN, 8)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


class WithUnused(nn.Module):
    """``unused`` never takes part in forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 8)
        self.unused = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, OUT)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Tied(nn.Module):
    """Embedding and decoder share one weight."""

    def __init__(self, vocab=11, dim=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embed.weight

    def forward(self, tokens):
        return self.decoder(torch.tanh(self.hidden(self.embed(tokens))))


class Frozen(MLP):
    def __init__(self):
        super().__init__()
        for p in self.fc2.parameters():
            p.requires_grad_(False)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, OUT)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


MODELS = {
    "mlp": MLP,
    "reordered": Reordered,
    "unused": WithUnused,
    "tied": Tied,
    "frozen": Frozen,
    "batchnorm": WithBatchNorm,
}


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def global_batch(step: int, kind: str, batch: int = 12):
    """The step's global batch; rank r of W trains on chunk r of W."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        return torch.randint(0, 11, (batch, 4), generator=g), torch.randint(0, 11, (batch, 4), generator=g)
    return torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)


def loss_fn(kind, output, target):
    if kind == "tied":
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(output, target)


def shard(tensor, rank, world):
    return tensor.chunk(world)[rank]


def train_step(opt, model, step, rank, world, kind="mlp"):
    """One step on this rank's shard of the step's global batch: zero_grad, forward, backward, step."""
    opt.zero_grad()
    x, y = global_batch(step, kind)
    loss_fn(kind, model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


EXTRA_OPTIMIZERS = {  # for single tests; not in every optimizer loop
    "sgd-plain-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


def make_optimizer(name, model):
    if name == "groups+scheduler":
        params = list(model.parameters())
        opt = torch.optim.SGD(
            [{"params": params[:2], "lr": 0.2}, {"params": params[2:], "lr": 0.05}], lr=0.1, momentum=0.9
        )
        return opt
    return {**OPTIMIZERS, **EXTRA_OPTIMIZERS}[name]([p for p in model.parameters()])


def make_scheduler(name, opt):
    if name == "groups+scheduler":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return None


def resumable_run(make_opt, steps, rank, world, start=0, load=None, save_at=2):
    """Train the MLP on this rank's shards for ``steps`` steps from ``start``, after loading ``load`` (model and
    optimizer states) if given, keeping copies of both states after step ``save_at`` (torch's state_dict() holds
    live tensors, which later steps change).  Returns (parameters, saved states, the optimizer: close it)."""
    import copy

    model = make_model("mlp")
    opt = make_opt(model)
    if load is not None:
        model.load_state_dict(load[0])
        opt.load_state_dict(load[1])
    saved = None
    for step in range(start, start + steps):
        train_step(opt, model, step, rank, world)
        if step == save_at:
            opt.synchronize()
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], saved, opt
